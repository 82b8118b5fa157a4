"""ZeRO stages 1-2 inside each data group of a data x tensor mesh.

Hybrid sharding (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", stage 1 P_os and stage 2 P_g;
sharded within a group and replicated across groups as PyTorch FSDP's
`HYBRID_SHARD`, Zhao et al. 2023): `--tensor_parallel=T` on N = D x T
replicas with `--zero_stage=1` (`--shard_optimizer_state`) or 2. The D
replicas holding the same tensor shard t (its data group,
`tfdist.parallel.tensor.groups`) hold the same per-replica variables:
shard t of each split weight and every replicated one. The run's
`tfdist.parallel.data.sharded_optimizer.ShardedOptimizer` (the one of
data parallelism's ZeRO, not a copy) is given a `DataGroupShards`: it lays
those per-replica variables out in one flat buffer of P_t elements padded
to D x S (S = ceil(P_t / D)), and the replica of data rank d keeps the
optimizer state of elements [d x S, (d + 1) x S) only. Each update:

1. the replica's gradients (its copy's batch; not yet summed over the
   data group) are flattened into [D x S] and summed over its data group:
   at stage 1 by an all-reduce (`tfdist.parallel.collectives.
   replica_all_reduce`) after which it keeps its slice [S], as stage 1
   does over all replicas; at stage 2 by a reduce-scatter made of an
   all-to-all (`replica_all_to_all`: the replica receives chunk d of
   every replica of its group and sums them; CPU collectives have no
   reduce-scatter op), half the bytes;
2. the user's optimizer updates the replica's master shard [S];
3. the updated shards are all-gathered over the data group
   (`replica_all_gather`) into the replica's variables.

Per device, per slot kind (Adam: 2, SGD with momentum: 1), float32:
4 x ceil((split / T + replicated) / D) bytes, `split` and `replicated`
the elements of the weights tensor parallelism splits and keeps whole;
`split / (D x T)` for a model whose every weight is split.

Checkpoints: `checkpoint_view` saves each slot under the unsharded Keras
optimizer's key and in its unsharded shape (the D shards of each data
group concatenated into its tensor shard, the T tensor shards
concatenated along the weight's split axis), so a checkpoint restores
into the unsplit one-device model, into tensor parallelism without ZeRO,
and back.
"""

from typing import List

import keras
import numpy as np
import tensorflow as tf

from tfdist import errors
from tfdist.core import reduce_dtype
from tfdist.parallel import collectives
from tfdist.parallel import views
from tfdist.parallel.data import sharded_optimizer
from tfdist.parallel.tensor import groups as groups_lib

# The stages offered beside `--tensor_parallel` (stage 3 is refused:
# `tfdist.parallel.tensor.options`).
STAGES = (1, 2)


class DataGroupShards(sharded_optimizer.ShardGroups):
  """The data groups of a data x tensor mesh as ZeRO's shard groups: D
  shards, the replica of mesh coordinates (d, t) (replica id d x T + t)
  owning shard d of its data group t's flat buffer.

  Args:
    groups: the mesh's `groups.TensorGroups` (D x T = N replicas).

  Raises:
    tfdist.errors.ConfigError: a data group whose devices are not in
      TensorFlow's rank order in replica order (its all-gather would put
      the shards out of order).
  """

  def __init__(self, groups: groups_lib.TensorGroups):
    super().__init__(groups.data)
    self.tensor_groups = groups
    self.tensor = groups.tensor
    for place in groups.places.values():
      group = place.data_group
      if group.rank(place.device) != place.data:
        raise errors.ConfigError(
            f"--tensor_parallel={groups.tensor} with ZeRO: the data group "
            f"{list(group.devices)} is not in replica order (its device "
            f"{place.device} of data rank {place.data} has rank "
            f"{group.rank(place.device)}). List the replicas' devices in "
            "index order.")

  def shard_of_replica(self, replica: int) -> int:
    """d = replica // T."""
    return int(replica) // self.tensor

  def replicas_of_group(self, replica: int) -> List[int]:
    """The D replica ids of `replica`'s data group (its tensor shard t =
    replica mod T), in data order: t, T + t, ..."""
    t = int(replica) % self.tensor
    return [d * self.tensor + t for d in range(self.num_shards)]

  def _place(self):
    return self.tensor_groups.here("ZeRO inside the data group")

  def replica_shard_index(self, context):
    """The calling replica's data rank d, a Python int (its device is
    known when the step is traced; 0 when D = 1). Replica context.

    Raises:
      tfdist.errors.ConfigError: outside a replica function, or on a
        device not in the mesh (`TensorGroups.here`).
    """
    del context
    return 0 if self.num_shards == 1 else self._place().data

  def replica_sum(self, context, flat, all_reduce_dtype):
    """`flat` (float32 [D x S]) summed over the calling replica's data
    group (D = 1: as is), travelling in `all_reduce_dtype`
    (`tfdist.core.reduce_dtype`); float32 [D x S]. Replica context.
    Raises as `replica_shard_index`."""
    del context
    if self.num_shards == 1:
      return flat
    d = self.num_shards
    wire, = reduce_dtype.compress([flat], all_reduce_dtype, d)
    summed = collectives.replica_all_reduce(self._place().data_group, wire)
    return reduce_dtype.decompress([summed], [flat], all_reduce_dtype, d)[0]

  def replica_reduce_scatter(self, context, flat, all_reduce_dtype,
                             layout):
    """Stage 2: the calling replica's shard [S] of `flat` [D x S] summed
    over its data group by a reduce-scatter built from an all-to-all
    (`collectives.replica_all_to_all`: chunk d of every replica reaches
    replica d, which sums them; (D - 1) / D of the buffer sent, half an
    all-reduce's bytes). A layout of several blocks, or D = 1: the base
    class's all-reduce and slice.

    Args:
      context: the replica context (unused: the device names the group).
      flat: float32 [D x S], this replica's flattened gradients.
      all_reduce_dtype: the dtype they travel in.
      layout: the sharded optimizer's `FlatLayout`.

    Returns:
      float32 [S]: shard d of the group's sum. Raises as
      `replica_shard_index`.
    """
    if self.num_shards == 1 or len(layout.blocks) != 1:
      return super().replica_reduce_scatter(context, flat, all_reduce_dtype,
                                            layout)
    d = self.num_shards
    wire, = reduce_dtype.compress([flat], all_reduce_dtype, d)
    chunks = collectives.replica_all_to_all(self._place().data_group, wire)
    summed = tf.reduce_sum(tf.reshape(chunks, [d, layout.shard_size]), 0)
    return reduce_dtype.decompress([summed], [flat], all_reduce_dtype, d)[0]

  def describe(self, stage: int) -> str:
    """How the gradients travel, for the log."""
    how = ("reduce-scattered (an all-to-all, each replica summing its "
           "chunks)" if stage >= 2 and self.num_shards > 1 else
           "all-reduced then sliced")
    return (f"gradients are {how} over each data group of "
            f"{self.num_shards} (hybrid sharding beside --tensor_parallel="
            f"{self.tensor})")

  def replica_gather(self, context, shard):
    """`shard` (float32 [s]) of every replica of the data group,
    concatenated in data order: float32 [D x s] (D = 1: `shard`).
    Replica context. Raises as `replica_shard_index`."""
    del context
    if self.num_shards == 1:
      return shard
    return collectives.replica_all_gather(self._place().data_group, shard)


def split_axis(full_shape, shard_shape, n: int):
  """The axis along which `shard_shape` (an optimizer slot of one
  replica) is 1/n of `full_shape` (its unsharded shape); None: equal,
  the slot is whole on every replica.

  Raises:
    ValueError: neither equal nor 1/n along one axis.
  """
  full, shard = tuple(full_shape), tuple(shard_shape)
  if full == shard:
    return None
  axes = [a for a, (f, s) in enumerate(zip(full, shard)) if f != s]
  if len(full) != len(shard) or len(axes) != 1 or \
      full[axes[0]] != shard[axes[0]] * n:
    raise ValueError(f"an optimizer slot of shape {shard} is not 1/{n} of "
                     f"its unsharded shape {full}")
  return axes[0]


def checkpoint_view(sharded, unsharded: keras.Model, optimizer,
                    gather_through) -> keras.optimizers.Optimizer:
  """An optimizer of `optimizer`'s class and configuration built on
  `unsharded`'s trainable variables (on the host CPU), each of its
  variables saving the value of its hybrid-sharded twin in the unsharded
  shape and restoring into it: the checkpoint's `optimizer`.

  Args:
    sharded: the run's `ShardedOptimizer` over `DataGroupShards`.
    unsharded: the tensor mode's unsharded model (the gathered view).
    optimizer: the trainer's Keras optimizer (iterations, learning rate).
    gather_through: `gather_through(variable, read, write)`, making a
      Keras variable save `read()` (NumPy) and restore through
      `write(value)` (the tensor mode's).

  Returns:
    The view optimizer.

  Raises:
    ValueError: the view's variables do not pair with the sharded
      optimizer's (another optimizer class or configuration), or a slot
      whose unsharded shape is not T times its shard's along one axis.
  """
  groups = sharded.groups
  view = views.optimizer_view(optimizer, unsharded)
  entries = sharded.variable_entries()
  if len(entries) != len(view.variables):
    raise ValueError(f"the sharded optimizer has {len(entries)} variables, "
                     f"its unsharded view {len(view.variables)}")
  for twin, entry in zip(view.variables, entries):
    if isinstance(entry, str):
      mine = sharded.optimizer_variable(entry)
      gather_through(twin, lambda v=mine: np.asarray(v.numpy()),
                     lambda value, v=mine: v.assign(value))
      continue
    kind, index = entry
    axis = split_axis(twin.shape, sharded.layout.shapes[index].as_list(),
                       groups.tensor)
    ranks = range(1 if axis is None else groups.tensor)

    def read(kind=kind, index=index, axis=axis, ranks=ranks):
      parts = [sharded.full_slot(kind, index,
                                 groups.replicas_of_group(t)).numpy()
               for t in ranks]
      return parts[0] if axis is None else np.concatenate(parts, axis)

    def write(value, kind=kind, index=index, axis=axis):
      pieces = ([value] * groups.tensor if axis is None else
                np.split(np.asarray(value), groups.tensor, axis=axis))
      for t, piece in enumerate(pieces):
        sharded.restore_slot(kind, index, piece,
                             group=groups.replicas_of_group(t))

    gather_through(twin, read, write)
  return view
