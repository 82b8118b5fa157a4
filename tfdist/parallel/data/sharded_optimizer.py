"""Sharded optimizer state and gradients: ZeRO stages 1 and 2.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models". Under data parallelism every replica keeps, per
float32 parameter with Adam, 4 bytes of weight, 4 of gradient and 8 of
optimizer state (two moments): 16 bytes. ZeRO stage 1 keeps on each of the
N replicas the optimizer state of 1/N of the parameters only; stage 2 also
the gradients (here: the gradient accumulators under gradient accumulation);
stage 3 shards the weights themselves (`tfdist.parallel.zero3`, a subclass
of `ShardedOptimizer` registered for stage 3).

Layout: one flat, padded float32 buffer. The trainable variables, in
`model.trainable_variables` order, are flattened and concatenated into a
vector of P elements, padded with zeros to P' = N x S (S = ceil(P / N)), and
replica r (`replica_id_in_sync_group`, unique over all workers) owns
elements [r x S, (r + 1) x S). (Stage 3 lays the same buffer out block by
block, each block padded and split over the replicas on its own:
`FlatLayout`'s `blocks`.) This balances memory to within one element
per replica whatever the variables' sizes (assigning whole variables to
owners cannot split a variable larger than P / N, e.g. an embedding table).
The price is that an optimizer whose update needs a whole variable's norm
(LAMB's layer-wise trust ratio) cannot run on a shard; `check_optimizer`
refuses it.

Groups (`ShardGroups`): by default the N shards are every replica's. A
parallel mode may shard within sub-groups instead (hybrid sharding, as
PyTorch FSDP's `HYBRID_SHARD`): tensor parallelism's data groups
(`tfdist.parallel.tensor.zero`), where N is the group's size D, the
shard index a replica's rank in its group, and steps 1 and 4 below run
over its group.

One update, on every replica:

1. the replica's gradients (per variable) are flattened into [P'] and
   summed over all replicas of all workers (in `--all_reduce_dtype`,
   `tfdist.core.reduce_dtype`, then float32 again), and the replica keeps its
   slice [S]. TensorFlow's collectives on CPUs offer no reduce-scatter
   (its CPU implementation resolves to none; `tf.distribute` exposes only
   `all_reduce` and `all_gather`), so this is an all-reduce followed by a
   slice: twice the traffic of a true reduce-scatter for that phase (each
   replica receives the whole sum, P' elements, not its S), and the whole
   summed vector exists transiently during the step;
2. one small all-reduce of [V + 1] statistics (per-variable sums of
   squares of the shard and its count of non-finite values, V variables):
   the fp16 finite check, the global norm of `global_clipnorm` and the
   per-variable norms of `clipnorm` are exact and equal everywhere, so
   every replica skips a non-finite step in unison;
3. the shard gradient is unscaled (fp16), clipped, and the user's Keras
   optimizer, one copy per replica built on that replica's shard, applies
   it to the replica's float32 master shard [S] (the copy's slots are [S]);
4. the updated master shards are all-gathered ([S] -> [P']) and written
   into every replica's (mirrored) model variables.

The master shard exists only during the update: it is filled from the
model variables (a slice of their flat values: weights loaded or
restored after the trainer was built are honoured) before step 3 and
emptied (0 elements) after step 4. Keras keeps float32 variables, so the
model's weights are the float32 master weights; the shard is only the
variable the Keras optimizer updates, and between steps it holds nothing
(a variable of shape [None]). The loss scale, step counter and iterations
of the user's optimizer advance as Keras's `LossScaleOptimizer` advances
them.

Memory per parameter, fp32 Adam, N replicas, between steps: unsharded 16
bytes; stage 1: 4 (weights) + 4 (gradients) + 8 (moments) / N, as
Rajbhandari et al. count it; stage 2 with gradient accumulation: the
accumulators (4 bytes unsharded) become 4 / N. Without accumulation
TensorFlow holds no gradient between steps, so stages 1 and 2 hold the
same memory here. During a step the flat buffers (the gradients' sum
[P'], the master shard [S], the gathered update [P']) add transient
memory.

Checkpoints: the slots are saved under the keys an unsharded Keras
optimizer uses (`checkpoint_view`), each as slices of its unsharded shape
(`slice_saveables`): every replica's piece of a slot is written where it
lives, as the boxes `row_major_boxes` cuts it into, nothing gathered;
`tf.train.list_variables` and `tf.train.load_checkpoint` show each slot
whole (its full shape, the slices reassembled), and a restore reads only
the boxes each local replica holds, so a checkpoint moves between
unsharded runs and sharded runs of any replica count. With replicas on
other workers (`all_local` false) a slot is still gathered and saved
whole by every worker (each worker's files hold only what it writes).
"""

import dataclasses
import re
from typing import Dict, List, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.training.saving import saveable_object

from tfdist import errors
from tfdist.core import optimizers
from tfdist.training.step import precision
from tfdist.core import reduce_dtype

STAGES = (0, 1, 2, 3)

_STANDIN_PREFIX = "tfdistzero"
_VARIABLE_VALUE = "VARIABLE_VALUE"


def _rate_is_shared(optimizer) -> bool:
  """Whether `optimizer`'s learning rate is a schedule or a callable (such
  as `tfdist.training.plan.lr_schedule.AdjustableLearningRate`) that the
  per-replica copies share as the same object, rather than a variable to
  copy."""
  rate = optimizer._learning_rate  # pylint: disable=protected-access
  if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
    return True
  return callable(rate) and not isinstance(rate, (keras.Variable,
                                                   tf.Variable))


def copy_config(optimizer) -> dict:
  """The configuration of a copy of `optimizer` (a Keras optimizer, not a
  `LossScaleOptimizer`) that applies already clipped gradients to some of
  the variables: its `get_config` without clipping, its learning rate
  the same object when it is a schedule or a callable (`_rate_is_shared`;
  else a float the copy follows, `follow`)."""
  config = optimizer.get_config()
  config.update(clipnorm=None, global_clipnorm=None)
  if _rate_is_shared(optimizer):
    config["learning_rate"] = optimizer._learning_rate  # pylint: disable=protected-access
  return config


def follow(copy, optimizer) -> None:
  """Sets `copy`'s (made from `copy_config(optimizer)`) iterations, and
  its learning rate unless shared, to `optimizer`'s, before the copy
  applies an update of `optimizer`'s step (Adam's bias correction reads
  the iterations). Any context: replica context assigns through the
  copy's variables' own aggregation."""
  copy.iterations.assign(optimizer.iterations)
  if not _rate_is_shared(optimizer):
    copy.learning_rate.assign(optimizer.learning_rate)


@dataclasses.dataclass(frozen=True)
class ShardingOptions:
  """How the optimizer state is sharded.

  Attributes:
    stage: ZeRO stage: 0 (off), 1 (optimizer state), 2
      (also the gradient accumulators), 3 (also the weights:
      `tfdist.parallel.zero3`).
    num_blocks: stage 3: the most blocks the model is cut into, each
      gathering its weights just before it runs (1: the whole model at
      once). Stages 1-2 ignore it.
    prefetch: stage 3: gather each block's weights while the block before
      it computes (two blocks' weights alive at the peak) rather than
      after it. Stages 1-2 ignore it.
  """
  stage: int = 0
  num_blocks: int = 4
  prefetch: bool = False

  def __post_init__(self):
    if self.stage not in STAGES:
      raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3. Received: "
                       f"stage={self.stage!r}")
    if not isinstance(self.num_blocks, int) or self.num_blocks < 1:
      raise ValueError(f"ZeRO stage 3's num_blocks must be a positive "
                       f"integer. Received: num_blocks={self.num_blocks!r}")

  @property
  def enabled(self) -> bool:
    return self.stage > 0


# The optimizer class of each ZeRO stage above 0 (`optimizer_class`);
# `tfdist.parallel.zero3` registers stage 3's when imported.
_STAGE_CLASSES: Dict[int, type] = {}


def register_stage(stage: int, cls: type) -> None:
  """Makes `cls` (a `ShardedOptimizer` subclass) the optimizer of ZeRO
  `stage`."""
  _STAGE_CLASSES[int(stage)] = cls


def optimizer_class(options: "ShardingOptions") -> type:
  """The `ShardedOptimizer` class that runs `options.stage`.

  Raises:
    ValueError: stage 3 and `tfdist.parallel.zero3` was not imported.
  """
  if options.stage in _STAGE_CLASSES:
    return _STAGE_CLASSES[options.stage]
  if options.stage == 3:
    raise ValueError("ZeRO stage 3 needs tfdist.parallel.zero3 imported "
                     "(it registers its optimizer).")
  return ShardedOptimizer


def inner_optimizer(optimizer):
  """The optimizer under a `LossScaleOptimizer`, or `optimizer` itself."""
  return getattr(optimizer, "inner_optimizer", None) or optimizer


def check_optimizer(optimizer, *, what: str = "--optimizer") -> None:
  """Raises `ConfigError` for an optimizer that cannot run on a shard: one
  whose registered traits say so (`tfdist.core.optimizers`; LAMB, You
  et al. 2019, scales each variable's update by the ratio of the
  variable's norm to the update's norm, and a shard cuts across
  variables), or one tfdist does not know.
  """
  spec = optimizers.spec_of(optimizer)
  if not spec.traits.shardable:
    raise errors.ConfigError(
        f"{what}={spec.name} cannot shard its state "
        f"(--shard_optimizer_state): {spec.traits.not_shardable_because}. "
        "Use adamw or adam, or train without sharding.")


class ShardGroups:
  """Over which replicas ZeRO stages 1-2 shard: every replica of the
  strategy (this class), or sub-groups of them (a subclass: hybrid
  sharding, each group sharding its own copy of the state and the groups
  replicated; FSDP's `HYBRID_SHARD`, Zhao et al. 2023; tensor parallelism
  gives each data group, `tfdist.parallel.tensor.zero`). The stages are
  Rajbhandari et al. 2020's, within each group.

  A replica's shard index is its rank in its group, and the gradients'
  sum and the updated shards' gather run over its group only. The
  all-replica default: N shards, replica r owns shard r, tf.distribute's
  own `ReplicaContext` collectives.

  Args:
    num_shards: N, the replicas of one group (every replica: the strategy's
      `num_replicas_in_sync`).
  """

  def __init__(self, num_shards: int):
    self.num_shards = int(num_shards)

  def shard_of_replica(self, replica: int) -> int:
    """The shard index of replica `replica` (`replica_id_in_sync_group`, a
    Python int): itself here."""
    return int(replica)

  def replicas_of_group(self, replica: int) -> List[int]:
    """The replicas (ids, in shard order) of `replica`'s group: every
    replica here."""
    del replica
    return list(range(self.num_shards))

  def replica_shard_index(self, context):
    """The calling replica's shard index (int32 scalar tensor, or a Python
    int). Replica context."""
    return context.replica_id_in_sync_group

  def replica_sum(self, context, flat: tf.Tensor,
                  all_reduce_dtype: str) -> tf.Tensor:
    """`flat` (float32 [P']) summed over the calling replica's group,
    travelling in `all_reduce_dtype`. Replica context."""
    summed, = reduce_dtype.all_reduce_sum(context, [flat], all_reduce_dtype)
    return summed

  def replica_reduce_scatter(self, context, flat: tf.Tensor,
                             all_reduce_dtype: str,
                             layout: "FlatLayout") -> tf.Tensor:
    """The calling replica's shard [S] of `flat` (float32 [P'] of
    `layout`) summed over its group. Here `replica_sum`, then the slice:
    TensorFlow's CPU collectives have no reduce-scatter (twice its bytes).
    Replica context."""
    return layout.shard_of(self.replica_sum(context, flat, all_reduce_dtype),
                           self.replica_shard_index(context))

  def replica_gather(self, context, shard: tf.Tensor) -> tf.Tensor:
    """`shard` (float32 [s]) of every replica of the group, concatenated
    in shard order: [N x s]. Replica context."""
    return context.all_gather(shard, axis=0)

  def describe(self, stage: int) -> str:
    """How ZeRO `stage`'s gradients travel over these groups, for the log."""
    del stage
    return ("gradients are all-reduced then sliced (no reduce-scatter on "
            "CPU collectives)")


class FlatLayout:
  """The padded flat buffer: variables' offsets and the shards.

  The variables are grouped into blocks (`blocks`: lists of variable
  indices; default one block of all of them, in order). Block b's
  variables, concatenated in its order, are padded with zeros to N x S_b
  elements (S_b = ceil(P_b / N), P_b its elements), and replica r owns
  elements [r x S_b, (r + 1) x S_b) of that region. The flat buffer [P']
  is the blocks' regions in order (P' = N x S, S = the sum of the S_b);
  replica r's shard [S] is its slice of every block, in block order, so
  the shard's elements [o_b, o_b + S_b) (o_b: `block_offsets[b]`) are its
  part of block b, and all-gathering them gives block b's region whole.
  With one block this is the whole model's flat buffer, replica r owning
  [r x S, (r + 1) x S). Use `shard_of` / `flat_from_shards` to move
  between the flat buffer and the shards.

  Args:
    shapes: the variables' shapes (`tf.TensorShape`s, fully defined).
    num_shards: N, the number of replicas in sync.
    blocks: lists of variable indices (each variable in exactly one,
      no block empty), in the order their regions take in the flat
      buffer; default `[range(len(shapes))]`.

  Raises:
    ValueError: `blocks` not a partition of the variables into non-empty
      blocks.
  """

  def __init__(self, shapes: Sequence[tf.TensorShape], num_shards: int,
               blocks: Optional[Sequence[Sequence[int]]] = None):
    self.shapes = [tf.TensorShape(s) for s in shapes]
    self.sizes = [int(s.num_elements()) for s in self.shapes]
    self.total = int(sum(self.sizes))
    self.num_shards = int(num_shards)
    if blocks is None:
      blocks = [list(range(len(self.sizes)))]
    self.blocks = [tuple(int(j) for j in block) for block in blocks]
    flat_indices = sorted(j for block in self.blocks for j in block)
    if (flat_indices != list(range(len(self.sizes))) or
        (len(self.blocks) > 1 and not all(self.blocks))):
      raise ValueError(
          f"FlatLayout blocks must put each of the {len(self.sizes)} "
          f"variables in exactly one non-empty block. Received: "
          f"blocks={[list(b) for b in self.blocks]}")
    block_totals = [sum(self.sizes[j] for j in b) for b in self.blocks]
    self.block_sizes = [-(-n // self.num_shards) for n in block_totals]
    if len(self.blocks) == 1:
      self.block_sizes = [max(1, self.block_sizes[0])]
    self.block_offsets = [int(x) for x in
                          np.cumsum([0] + self.block_sizes[:-1])]
    self.shard_size = int(sum(self.block_sizes))
    self.padded_total = self.shard_size * self.num_shards
    self.padding = self.padded_total - self.total
    self.offsets = [0] * len(self.sizes)
    for b, block in enumerate(self.blocks):
      at = self.block_start(b)
      for j in block:
        self.offsets[j] = at
        at += self.sizes[j]

  # --- blocks ---------------------------------------------------------------
  def block_start(self, b: int) -> int:
    """Where block b's region [N x S_b] begins in the flat buffer."""
    return self.num_shards * self.block_offsets[b]

  def block_padding(self, b: int) -> int:
    return (self.num_shards * self.block_sizes[b] -
            sum(self.sizes[j] for j in self.blocks[b]))

  def flatten_block(self, b: int, tensors) -> tf.Tensor:
    """float32 [N x S_b], block b's region, from tensors of its
    variables' shapes, in the block's order (None: zeros)."""
    parts = [tf.zeros([self.sizes[j]], tf.float32) if t is None else
             tf.reshape(tf.cast(tf.convert_to_tensor(t), tf.float32), [-1])
             for t, j in zip(tensors, self.blocks[b])]
    padding = self.block_padding(b)
    if padding:
      parts.append(tf.zeros([padding], tf.float32))
    return tf.concat(parts, axis=0)

  def unflatten_block(self, b: int, region) -> List[tf.Tensor]:
    """Block b's variables (in the block's order) from its region
    float32 [N x S_b]."""
    sizes = [self.sizes[j] for j in self.blocks[b]]
    padding = self.block_padding(b)
    parts = tf.split(region, sizes + ([padding] if padding else []))
    return [tf.reshape(p, self.shapes[j])
            for p, j in zip(parts, self.blocks[b])]

  # --- the whole buffer -----------------------------------------------------
  def flatten(self, tensors) -> tf.Tensor:
    """float32 [P'] from tensors of `shapes` (None: zeros)."""
    return tf.concat([self.flatten_block(b, [tensors[j] for j in block])
                      for b, block in enumerate(self.blocks)], axis=0)

  def unflatten(self, flat) -> List[tf.Tensor]:
    """Tensors of `shapes` from float32 [P'] (the padding dropped)."""
    regions = tf.split(flat, [self.num_shards * s for s in self.block_sizes])
    out = [None] * len(self.sizes)
    for b, region in enumerate(regions):
      for j, value in zip(self.blocks[b], self.unflatten_block(b, region)):
        out[j] = value
    return out

  def shard_of(self, flat, shard_index) -> tf.Tensor:
    """float32 [S]: shard `shard_index` (an int or an int32 scalar
    tensor) of the flat buffer `flat` [P'] (a tensor)."""
    parts = [tf.slice(flat, [self.block_start(b) + shard_index * size],
                      [size])
             for b, size in enumerate(self.block_sizes) if size]
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)

  def shard_of_array(self, flat: np.ndarray, shard_index: int) -> np.ndarray:
    """`shard_of` for a NumPy [P'] and a Python int (a copy)."""
    return np.concatenate(
        [flat[self.block_start(b) + shard_index * size:][:size]
         for b, size in enumerate(self.block_sizes)])

  def flat_from_shards(self, shards) -> np.ndarray:
    """NumPy [P']: the flat buffer from every replica's shard (N NumPy
    arrays [S], in replica order, or one [N x S] array of them
    concatenated, as an all-gather of the shards gives)."""
    shards = np.reshape(np.asarray(shards), [self.num_shards,
                                             self.shard_size])
    return np.concatenate(
        [shards[:, o:o + size].reshape(-1)
         for o, size in zip(self.block_offsets, self.block_sizes)])

  def segment_ids(self, shard_index) -> tf.Tensor:
    """int32 [S]: for each element of shard `shard_index` (a scalar, maybe
    a tensor), the index of its variable, or V for padding."""
    shard_index = tf.cast(shard_index, tf.int64)
    positions = tf.concat(
        [self.block_start(b) + shard_index * size +
         tf.range(size, dtype=tf.int64)
         for b, size in enumerate(self.block_sizes) if size], axis=0)
    # The flat buffer as consecutive intervals: each variable, and each
    # block's padding (id V).
    starts, ids = [], []
    for b, block in enumerate(self.blocks):
      for j in block:
        starts.append(self.offsets[j])
        ids.append(j)
      if self.block_padding(b):
        starts.append(self.block_start(b) + self.num_shards *
                      self.block_sizes[b] - self.block_padding(b))
        ids.append(len(self.sizes))
    interval = tf.searchsorted(tf.constant(starts, tf.int64), positions,
                               side="right") - 1
    return tf.gather(tf.constant(ids, tf.int32), interval)

  def pieces(self, shard_index: int):
    """(variable index, start in the variable, start in the shard, length)
    of every variable piece inside shard `shard_index` (a Python int), in
    shard order. The shard's elements outside them are padding."""
    out = []
    for b, block in enumerate(self.blocks):
      lo = self.block_start(b) + shard_index * self.block_sizes[b]
      hi = lo + self.block_sizes[b]
      for j in block:
        off, n = self.offsets[j], self.sizes[j]
        a, b_ = max(lo, off), min(hi, off + n)
        if a < b_:
          out.append((j, a - off, self.block_offsets[b] + a - lo, b_ - a))
    return out


def row_major_boxes(shape: Sequence[int], start: int,
                    stop: int) -> List[tuple]:
  """The boxes (rectangular regions) that elements [start, stop) of a
  tensor of `shape`, counted in row-major order, fill: a list of
  `(offsets, lengths)` (tuples of len(shape) ints), in order, each box's
  own row-major elements a contiguous run of the range. At most 2 x
  rank - 1 boxes: the rest of a partial first row (cut the same way in
  the trailing dimensions), the whole rows, the start of a partial last
  row. A scalar (shape []) is one box `((), ())`. Empty when stop <=
  start."""
  shape = [int(d) for d in shape]
  if stop <= start:
    return []
  if len(shape) <= 1:
    return [((start,), (stop - start,))] if shape else [((), ())]
  inner = int(np.prod(shape[1:]))
  first, a = divmod(start, inner)
  last, b = divmod(stop, inner)

  def in_row(row, lo, hi):
    return [((row,) + o, (1,) + n)
            for o, n in row_major_boxes(shape[1:], lo, hi)]

  if first == last:
    return in_row(first, a, b)
  out = []
  if a:
    out += in_row(first, a, inner)
    first += 1
  if last > first:
    out.append(((first,) + (0,) * (len(shape) - 1),
                (last - first,) + tuple(shape[1:])))
  if b:
    out += in_row(last, 0, b)
  return out


def slice_spec(shape: Sequence[int], offsets, lengths) -> str:
  """TensorFlow's slice spec of a box of a tensor of `shape` ("3 4 0,1:1,2":
  the full shape, then offset,length per dimension), as
  `tf.Variable.SaveSliceInfo.spec` writes it; "" (the whole tensor) for a
  scalar."""
  if not list(shape):
    return ""
  return tf.Variable.SaveSliceInfo(
      full_shape=[int(d) for d in shape], var_offset=list(offsets),
      var_shape=list(lengths)).spec


class _SliceSaveable(saveable_object.SaveableObject):
  """One box of a sharded variable: elements [at, at + n) of one replica's
  flat buffer (`buffer`, a float32 tf.Variable [S]), saved as the box
  `spec` of the unsharded variable under checkpoint key `name` (read at
  save time only), restored into the same elements."""

  def __init__(self, buffer, spec: str, at: int, lengths, name: str,
               on_restore=None):
    self._buffer = buffer
    self._at = int(at)
    self._size = int(np.prod(lengths))
    self._on_restore = on_restore
    size = self._size

    def read():
      with tf.device(buffer.device):
        return tf.reshape(buffer[at:at + size], list(lengths))

    super().__init__(None, [saveable_object.SaveSpec(
        read, spec, name, dtype=tf.float32, device=buffer.device)], name)

  def restore(self, restored_tensors, restored_shapes):
    del restored_shapes
    if self._on_restore is not None:
      self._on_restore()
    value = tf.reshape(tf.cast(restored_tensors[0], tf.float32), [-1])
    with tf.device(self._buffer.device):
      return self._buffer[self._at:self._at + self._size].assign(value)


class WholeSaveable(saveable_object.SaveableObject):
  """A sharded variable saved whole under checkpoint key `name`: `read()`
  gives its full value (gathered), `write(value)` puts a restored full
  value into the local shards. `device`: a device of this process (a
  local shard's): the saver groups tensors by their devices' tasks, and a
  task-less device would count as another task (the restore then runs
  as a tf.function, where Keras variables cannot restore)."""

  def __init__(self, read, write, name: str, device: str):
    self._write = write
    super().__init__(None, [saveable_object.SaveSpec(
        read, "", name, dtype=tf.float32, device=device)], name)

  def restore(self, restored_tensors, restored_shapes):
    del restored_shapes
    self._write(restored_tensors[0])
    return tf.no_op()


def slice_saveables(layout: "FlatLayout", index: int, buffers,
                    replica_ids: Sequence[int], name: str,
                    on_restore=None) -> list:
  """The `SaveableObject`s that save variable `index` of `layout` as
  slices of its unsharded shape, with no gather: for each local replica
  (`replica_ids[i]`, whose flat shard [S] is `buffers[i]`, a float32
  tf.Variable), each piece it holds (`FlatLayout.pieces`) cut into
  `row_major_boxes`, saved under checkpoint key `name` with its
  `slice_spec` (TensorFlow's slice-aware checkpointing, as partitioned
  and sharded variables save). Restoring reads each box from the
  checkpoint (a slice of an unsliced tensor too) into the shard.
  `on_restore`: called before each box is written (cache invalidation).
  Empty when no local replica holds an element of the variable."""
  shape = layout.shapes[index].as_list()
  out = []
  for buffer, replica in zip(buffers, replica_ids):
    for j, start, at, length in layout.pieces(replica):
      if j != index:
        continue
      for offsets, lengths in row_major_boxes(shape, start, start + length):
        out.append(_SliceSaveable(buffer, slice_spec(shape, offsets, lengths),
                                  at, lengths, name, on_restore))
        at += int(np.prod(lengths))
  return out


class _PerVariable:
  """Per-variable sums over one replica's shard, and per-variable scaling
  of it (the statistics and `clipnorm` of `ShardedOptimizer.replica_prepare`).

  With the replica's index known when the step is traced (a constant under
  `MirroredStrategy` and `MultiWorkerMirroredStrategy`), the shard's pieces
  are static slices. Segment ids [S] computed from that constant index
  would be constant-folded by Grappler (up to its 10 MiB limit per
  constant) into constants that the compiled step keeps between calls:
  4 to 8 bytes per shard element per replica at rest (measured;
  tests/sharded_optimizer_test.py checks that none is kept). Only an index unknown at trace time takes the
  segment-id route (computed at every step, freed after it).

  Args:
    layout: the `FlatLayout`.
    replica: `replica_id_in_sync_group`, an int32 scalar tensor.
  """

  def __init__(self, layout: "FlatLayout", replica):
    self.layout = layout
    self.replica = replica
    index = tf.get_static_value(replica)
    self.pieces = None if index is None else layout.pieces(int(index))

  def sums_of_squares(self, shard) -> tf.Tensor:
    """float32 [V]: each variable's sum of squares over `shard` [S]."""
    num_vars = len(self.layout.sizes)
    if self.pieces is None:
      return tf.math.unsorted_segment_sum(
          tf.square(shard), self.layout.segment_ids(self.replica),
          num_vars + 1)[:num_vars]
    sums = [tf.constant(0.0)] * num_vars
    for j, _, start, length in self.pieces:
      sums[j] = tf.reduce_sum(tf.square(shard[start:start + length]))
    return tf.stack(sums)

  def scale(self, shard, factors) -> tf.Tensor:
    """`shard` [S] with each variable's elements times its factor
    (`factors`, float32 [V]); the padding unchanged."""
    if self.pieces is None:
      return shard * tf.gather(tf.concat([factors, [1.0]], axis=0),
                               self.layout.segment_ids(self.replica))
    parts, at = [], 0
    for j, _, start, length in self.pieces:
      if start > at:  # Padding (of a block's last shard) kept as it is.
        parts.append(shard[at:start])
      parts.append(shard[start:start + length] * factors[j])
      at = start + length
    if at < self.layout.shard_size:
      parts.append(shard[at:])
    return tf.concat(parts, axis=0)


class _FullSlot(tf.__internal__.tracking.Trackable):
  """One slot variable of one model variable, as an unsharded optimizer
  keeps it: saved under its checkpoint key as slices of the variable's
  shape, each written by the replica holding it
  (`ShardedOptimizer.slot_saveables`), restored into the shards."""

  def __init__(self, owner: "ShardedOptimizer", kind: str, index: int):
    self._owner = owner
    self._kind = kind
    self._index = index

  def _gather_saveables_for_checkpoint(self):
    def factory(name):
      return self._owner.slot_saveables(self._kind, self._index, name)
    return {_VARIABLE_VALUE: factory}


class ShardedOptimizer:
  """Runs a Keras 3 optimizer on per-replica shards (ZeRO stages 1 and 2).

  Args:
    strategy: a `MirroredStrategy` or `MultiWorkerMirroredStrategy`; the
      model's variables were created under its scope.
    optimizer: the user's Keras 3 optimizer (possibly a
      `LossScaleOptimizer`), built on an empty variable list (its slots are
      the shards' business): it keeps the iterations, learning rate and
      loss scale that callbacks and checkpoints read.
    variables: the model's trainable variables (float32).
    options: `ShardingOptions` (stage 1 or 2).
    all_reduce_dtype: the dtype the flat gradient buffer travels in
      (`tfdist.core.reduce_dtype`; summed back to float32 before the
      finite check, clipping and the update); the gather of the updated
      shards stays float32 (the master weights).
    model: the Keras model the variables belong to (stage 3 cuts it into
      blocks for its layout; stages 1-2 ignore it).
    groups: the `ShardGroups` the state is sharded over (None: every
      replica). With sub-groups (hybrid sharding) each group shards the
      variables' per-replica values (which may differ between groups, as
      tensor-parallel shards do); the statistics of step 2 are still
      summed over every replica, so the fp16 finite check agrees
      everywhere, but clipping norms would count each group's copy: a
      mode that passes groups refuses clipping.

  Construct outside the strategy's scope (the per-replica optimizer copies
  are plain, per-device objects); the shard variables enter the scope
  themselves.

  Raises:
    tfdist.errors.ConfigError: LAMB (`check_optimizer`); a trainable
      variable that is not float32.
  """

  def __init__(self, *, strategy: tf.distribute.Strategy, optimizer,
               variables: Sequence, options: ShardingOptions,
               all_reduce_dtype: str = reduce_dtype.FLOAT32, model=None,
               groups: Optional[ShardGroups] = None):
    if not options.enabled:
      raise ValueError("ShardedOptimizer needs stage 1 or 2.")
    check_optimizer(optimizer)
    for v in variables:
      if v.dtype != "float32":
        raise errors.ConfigError(
            f"--shard_optimizer_state shards float32 variables; "
            f"{v.path if hasattr(v, 'path') else v.name} is {v.dtype}. "
            "Keep trainable variables in float32 (Keras mixed precision "
            "does), or train without sharding.")
    self.strategy = strategy
    self.options = options
    self.all_reduce_dtype = all_reduce_dtype
    self.optimizer = optimizer
    self.inner = inner_optimizer(optimizer)
    self.variables = list(variables)
    self.uses_loss_scale = isinstance(optimizer,
                                      keras.optimizers.LossScaleOptimizer)
    self.groups = groups or ShardGroups(strategy.num_replicas_in_sync)
    self.layout = FlatLayout([v.shape for v in self.variables],
                             self.groups.num_shards,
                             blocks=self._layout_blocks(model))
    self.clipnorm = self.inner.clipnorm
    self.global_clipnorm = self.inner.global_clipnorm
    self.devices = list(strategy.extended.worker_devices)
    with strategy.scope():
      # Shape [None]: [S] during an update, [0] between updates.
      self.master = tf.Variable(
          tf.zeros([0], tf.float32), shape=tf.TensorShape([None]),
          trainable=False, name="zero_master_shard",
          synchronization=tf.VariableSynchronization.ON_READ,
          aggregation=tf.VariableAggregation.NONE)
    self.grad_accumulator = None
    ids = strategy.run(
        lambda: tf.identity(
            tf.distribute.get_replica_context().replica_id_in_sync_group))
    self.replica_ids = [int(x) for x in
                        strategy.experimental_local_results(ids)]
    # Every replica in this process: checkpoints write each replica's
    # slices (`slice_saveables`); otherwise whole, gathered values.
    self.all_local = len(self.replica_ids) == strategy.num_replicas_in_sync
    built = [self._make_copy(component, device) for component, device
             in zip(self.master.values, self.devices)]
    self.copies = [copy for copy, _ in built]
    self._slots = [slots for _, slots in built]
    self._slot_kinds = self._slots[0]
    self._cache: Dict[str, tuple] = {}
    self._generation = 0

  # --- construction --------------------------------------------------------
  def _layout_blocks(self, model):
    """The `FlatLayout` blocks for `model` (None: one block, the flat
    buffer of stages 1-2; stage 3 groups the weights by model block)."""
    del model
    return None

  def _copy_config(self) -> dict:
    return copy_config(self.inner)

  def _make_copy(self, component, device):
    """The user's optimizer (class and configuration, clipping left to
    this class), built for one replica's master shard, on its device.

    Keras sizes an optimizer's slots from its variables' static shapes,
    and the master shard's is [None]. So the copy is built on a stand-in
    of shape [S] and the same name (its slots are [S] and named after the
    shard), then keyed to the shard: Keras finds a variable's slots by
    `_var_key` in `_trainable_variables_indices` (Keras 3.0 on).

    Returns:
      `(copy, slots)`: the optimizer and its slot variables by kind.
    """
    with tf.device(device):
      copy = type(self.inner).from_config(self._copy_config())
      stand_in = tf.Variable(tf.zeros([self.layout.shard_size], tf.float32),
                             trainable=False,
                             name=str(component.name).split(":")[0])
      copy.build([stand_in])
      slots = self._slot_kinds_of(copy, stand_in)
    # pylint: disable=protected-access
    if not isinstance(getattr(copy, "_trainable_variables_indices", None),
                      dict):
      raise RuntimeError(
          f"keras {keras.__version__}'s optimizers keep no "
          "_trainable_variables_indices: tfdist's sharded optimizer "
          "supports Keras 3.0-3.15's optimizers.")
    copy._trainable_variables = [component]
    copy._trainable_variables_indices = {copy._var_key(component): 0}
    # pylint: enable=protected-access
    return copy, slots

  @staticmethod
  def _slot_kinds_of(copy, reference) -> Dict[str, keras.Variable]:
    """The copy's slot variables by kind (`momentum`, `velocity`, ...)."""
    prefix = str(reference.name).replace("/", "_").replace(":", "_") + "_"
    kinds = {}
    for v in copy.variables:
      if v is copy.iterations or v is getattr(copy, "_learning_rate", None):
        continue
      if not v.name.startswith(prefix):
        raise ValueError(f"unexpected optimizer variable {v.name}")
      kinds[v.name[len(prefix):]] = v
    return kinds

  def state_bytes_per_replica(self) -> int:
    """Bytes one replica keeps between steps for the sharded state: its
    optimizer copy's variables (slots of S elements, iterations, learning
    rate) and, at stage 2 under gradient accumulation, its
    gradient-accumulator shard (S float32). The master shard is empty
    between steps."""
    copy = self.copies[0]
    total = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
                for v in copy.variables)
    if self.grad_accumulator is not None:
      total += 4 * self.layout.shard_size
    return total

  # --- replica context ------------------------------------------------------
  def replica_shard(self, flat: tf.Tensor) -> tf.Tensor:
    """This replica's slice [S] of `flat` [P'] summed over its group (all
    replicas by default): all-reduce, then slice (no reduce-scatter on
    CPU collectives); from stage 2, the groups' `replica_reduce_scatter`
    (a true one within a tensor mesh's data groups). Replica context."""
    context = tf.distribute.get_replica_context()
    if self.options.stage >= 2:
      return self.groups.replica_reduce_scatter(
          context, flat, self.all_reduce_dtype, self.layout)
    summed = self.groups.replica_sum(context, flat, self.all_reduce_dtype)
    return self.layout.shard_of(summed,
                                self.groups.replica_shard_index(context))

  def make_gradient_accumulator(self) -> tf.Variable:
    """Stage 2 under gradient accumulation: creates this replica's
    accumulator shard (float32 [S], sync-on-read: one value per replica,
    zero between updates, not checkpointed). Call in the strategy's
    scope."""
    self.grad_accumulator = tf.Variable(
        tf.zeros([self.layout.shard_size], tf.float32), trainable=False,
        name="zero_gradient_shard",
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.NONE)
    return self.grad_accumulator

  def replica_accumulate(self, grads) -> None:
    """Stage 2 under gradient accumulation: reduces this micro-batch's
    gradients and adds this replica's shard to its shard accumulator.
    Replica context."""
    self.grad_accumulator.assign_add(
        self.replica_shard(self.layout.flatten(grads)))

  def replica_take_accumulated(self) -> tf.Tensor:
    """Stage 2: the accumulated shard [S] (already summed over replicas);
    the accumulator is zeroed after it is read. Replica context."""
    shard = self.grad_accumulator.read_value()
    with tf.control_dependencies([shard]):
      self.grad_accumulator.assign(tf.zeros_like(shard))
    return tf.identity(shard)

  def replica_prepare(self, grads=None, shard=None):
    """Steps 1-3 of the module docstring up to the optimizer: the replica's
    final shard gradient. Replica context.

    Args:
      grads: this replica's gradients, one per variable (unreduced), or
      shard: float32 [S], already summed over replicas (stage 2
        accumulation).

    Returns:
      `(skipped, update)`: skipped, float32 scalar (1.0: a non-finite fp16
      gradient somewhere, the same on every replica), and update, a dict
      of `grad` (float32 [S], unscaled and clipped) and `finite` (bool).
    """
    context = tf.distribute.get_replica_context()
    replica = self.groups.replica_shard_index(context)
    self._replica_load_master(replica)
    if shard is None:
      shard = self.replica_shard(self.layout.flatten(grads))
    nonfinite = tf.reduce_sum(
        tf.cast(tf.logical_not(tf.math.is_finite(shard)), tf.float32))
    if self.uses_loss_scale:
      shard = shard / tf.cast(self.optimizer.dynamic_scale, tf.float32)
    per_variable = _PerVariable(self.layout, replica)
    sumsq = per_variable.sums_of_squares(shard)
    num_vars = len(self.variables)
    stats = context.all_reduce(tf.distribute.ReduceOp.SUM,
                               tf.concat([sumsq, [nonfinite]], axis=0))
    sumsq, nonfinite = stats[:num_vars], stats[num_vars]
    if self.clipnorm:
      # tf.clip_by_norm per variable, as Keras's `clipnorm`.
      clip = tf.constant(float(self.clipnorm), tf.float32)
      norms = tf.where(sumsq > 0, tf.sqrt(tf.where(sumsq > 0, sumsq, 1.0)),
                       sumsq)
      factors = clip / tf.maximum(norms, clip)
      shard = per_variable.scale(shard, factors)
    elif self.global_clipnorm:
      # keras.optimizers' clip_by_global_norm.
      clip = tf.constant(float(self.global_clipnorm), tf.float32)
      norm = tf.sqrt(tf.reduce_sum(sumsq))
      scale = clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
      shard = shard * scale
    finite = tf.equal(nonfinite, 0.0)
    skipped = (1.0 - tf.cast(finite, tf.float32) if self.uses_loss_scale
               else tf.constant(0.0))
    return skipped, {"grad": shard, "finite": finite}

  def _replica_load_master(self, replica) -> None:
    """Fills the master shard (shard index `replica`) from the model's
    weights (set or restored since the last update). Replica context."""
    self.master.assign(self.layout.shard_of(
        self.layout.flatten(self.variables), replica))

  def attach(self, trainer) -> None:
    """Called once by the `Trainer` that owns this optimizer, after its
    step functions are chosen (stages 1-2: nothing to change)."""
    del trainer

  def _replica_gather(self):
    context = tf.distribute.get_replica_context()
    # A static shape: the collective then needs no shape exchange.
    shard = tf.ensure_shape(self.master.read_value(),
                            [self.layout.shard_size])
    gather = self.groups.replica_gather
    if len(self.layout.blocks) == 1:
      return self.layout.unflatten(gather(context, shard))
    return self.layout.unflatten(tf.concat(
        [gather(context, shard[o:o + size]) for o, size in
         zip(self.layout.block_offsets, self.layout.block_sizes)], axis=0))

  # --- cross-replica context ------------------------------------------------
  def apply(self, update) -> None:
    """Step 3's optimizer update of every local shard and step 4's
    all-gather into the model's variables. Cross-replica context, outside
    `strategy.scope()` (the copies are single-device optimizers).

    Args:
      update: the per-replica `update` of `replica_prepare`.

    Raises:
      RuntimeError: called inside a strategy's scope (the Keras optimizer
        copies would then try to merge across replicas).
    """
    if tf.distribute.has_strategy():
      raise RuntimeError(
          "The sharded optimizer's update runs outside `strategy.scope()`: "
          "call the Trainer's train_function outside the scope.")
    local = self.strategy.experimental_local_results
    grads = local(update["grad"])
    finite = local(update["finite"])[0]
    inner = self.inner

    def apply_all():
      for copy, component, grad, device in zip(self.copies,
                                               self.master.values, grads,
                                               self.devices):
        with tf.device(device):
          follow(copy, inner)
          copy.apply([grad], [component])
      inner.iterations.assign_add(1)
      return tf.constant(True)

    if self.uses_loss_scale:
      tf.cond(finite, apply_all, lambda: tf.constant(False))
      self._update_loss_scale(finite)
    else:
      apply_all()
    self._publish()

  def _publish(self) -> None:
    """Step 4: the updated master shards all-gathered into every replica's
    model variables; the master shards emptied. Cross-replica context."""
    gathered = self.strategy.run(self._replica_gather)
    for variable, value in zip(self.variables, gathered):
      self.strategy.extended.update(
          getattr(variable, "value", variable),
          lambda var, val: var.assign(val), args=(value,), group=False)
    # Emptied after the gather read it (automatic control dependencies
    # order the ops on each shard's resource as written).
    for component, device in zip(self.master.values, self.devices):
      with tf.device(device):
        component.assign(tf.zeros([0], tf.float32))

  def _update_loss_scale(self, finite) -> None:
    """The loss scale after a step, as Keras's `LossScaleOptimizer`
    changes it (dynamic: x2 after `dynamic_growth_steps` finite steps in a
    row, /2 on a non-finite one); a `FixedLossScaleOptimizer` keeps it."""
    opt = self.optimizer
    if isinstance(opt, precision.FixedLossScaleOptimizer):
      return
    grow = tf.logical_and(
        finite, tf.equal(opt.step_counter, opt.dynamic_growth_steps - 1))
    counter = tf.where(grow | tf.logical_not(finite),
                       tf.zeros_like(opt.step_counter),
                       opt.step_counter + 1)
    scale = tf.where(grow, opt.dynamic_scale * 2.0,
                     tf.where(finite, opt.dynamic_scale,
                              opt.dynamic_scale * 0.5))
    opt.step_counter.assign(counter)
    opt.dynamic_scale.assign(scale)

  # --- checkpoints ----------------------------------------------------------
  def checkpoint_view(self):
    """A trackable that saves like the unsharded optimizer: the same
    object graph and keys (`optimizer/inner_optimizer/_variables/3/...`),
    each slot in its variable's shape. Use it as the checkpoint's
    `optimizer`."""
    inner_view = self._view_of(self.inner, inner=True)
    if self.inner is self.optimizer:
      return inner_view
    return self._view_of(self.optimizer, inner=False, inner_view=inner_view)

  def _view_of(self, optimizer, *, inner, inner_view=None):
    view = tf.__internal__.tracking.AutoTrackable()
    for name, child in optimizer._trackable_children().items():  # pylint: disable=protected-access
      if name in ("_trainable_variables", "_trainable_variables_indices"):
        continue
      if name == "inner_optimizer":
        child = inner_view
      elif name == "_variables" and inner:
        child = self._unsharded_variables()
      elif isinstance(child, (list, tuple)) or hasattr(child, "_storage"):
        if not list(child):
          continue  # The user's optimizer keeps no slots itself.
      setattr(view, name, child)
    view._trainable_variables = list(self.variables)  # pylint: disable=protected-access
    return view

  def variable_entries(self) -> list:
    """What each variable of an unsharded build of the user's optimizer
    is, in Keras's order (read from a build on [1]-sized stand-ins):
    "iterations", "learning_rate", or `(kind, index)` for the slot `kind`
    (`momentum`, `velocity`, ...) of model variable `index`.

    Raises:
      ValueError: a variable of none of these kinds.
    """
    standins = [keras.Variable(np.zeros([1], np.float32),
                               name=f"{_STANDIN_PREFIX}{j}")
                for j in range(len(self.variables))]
    probe = type(self.inner).from_config(self._copy_config())
    probe.build(standins)
    pattern = re.compile(rf"^{_STANDIN_PREFIX}(\d+)_(.+)$")
    out = []
    for v in probe.variables:
      if v is probe.iterations:
        out.append("iterations")
      elif v is getattr(probe, "_learning_rate", None):
        out.append("learning_rate")
      else:
        match = pattern.match(v.name)
        if not match or match.group(2) not in self._slot_kinds:
          raise ValueError(f"unexpected optimizer variable {v.name}")
        out.append((match.group(2), int(match.group(1))))
    return out

  def optimizer_variable(self, name: str):
    """The user's optimizer's own variable `name` as `variable_entries`
    names it: "iterations" (int64 scalar) or "learning_rate" (float32
    scalar; an optimizer whose rate is a schedule has none).

    Raises:
      KeyError: another name.
    """
    return {"iterations": self.inner.iterations,
            "learning_rate": self.inner._learning_rate}[name]  # pylint: disable=protected-access

  def _unsharded_variables(self) -> list:
    """The `_variables` list an unsharded build of the user's optimizer
    would have: its iterations and learning rate, then a `_FullSlot` per
    slot, in Keras's order (`variable_entries`)."""
    return [self.optimizer_variable(entry) if isinstance(entry, str) else
            _FullSlot(self, *entry) for entry in self.variable_entries()]

  def _full_kind(self, kind: str,
                 group: Optional[Sequence[int]] = None) -> np.ndarray:
    """Slot `kind` over all P elements, gathered from every replica of
    `group` (replica ids in shard order, all in this process; None:
    every replica, one group)."""
    key = (int(self.inner.iterations.numpy()), self._generation)
    cache_key = (kind, None if group is None else tuple(group))
    cached = self._cache.get(cache_key)
    if cached is not None and cached[0] == key:
      return cached[1]
    slots = [kinds[kind] for kinds in self._slots]
    if group is not None:
      by_replica = dict(zip(self.replica_ids, slots))
      flat = self.layout.flat_from_shards(
          [by_replica[r].numpy() for r in group])
    elif len(self.replica_ids) == self.strategy.num_replicas_in_sync:
      parts = [None] * len(slots)
      for replica, slot in zip(self.replica_ids, slots):
        parts[replica] = slot.numpy()
      flat = self.layout.flat_from_shards(parts)
    else:
      base = self.replica_ids[0]
      values = self.strategy.experimental_distribute_values_from_function(
          lambda ctx: tf.identity(
              slots[ctx.replica_id_in_sync_group - base].value))
      flat = self.layout.flat_from_shards(
          self.strategy.gather(values, axis=0).numpy())
    self._cache = {k: v for k, v in self._cache.items() if v[0] == key}
    self._cache[cache_key] = (key, flat)
    return flat

  def full_slot(self, kind: str, index: int,
                group: Optional[Sequence[int]] = None) -> tf.Tensor:
    """Slot `kind` of variable `index` in the variable's (per-replica)
    shape, gathered over `group` (replica ids in shard order; None: every
    replica)."""
    flat = self._full_kind(kind, group)
    off, n = self.layout.offsets[index], self.layout.sizes[index]
    return tf.constant(flat[off:off + n].reshape(
        self.layout.shapes[index].as_list()))

  def slot_saveables(self, kind: str, index: int, name: str) -> list:
    """The `SaveableObject`s of slot `kind` of variable `index` under
    checkpoint key `name`: its slices where this process holds every
    replica (`slice_saveables`; no gather), else its whole value
    (`full_slot`, gathered) restored by `restore_slot`."""
    if self.all_local and self.layout.sizes[index]:
      return slice_saveables(
          self.layout, index, [kinds[kind].value for kinds in self._slots],
          self.replica_ids, name, on_restore=self._invalidate)
    return [WholeSaveable(lambda: self.full_slot(kind, index),
                          lambda v: self.restore_slot(kind, index, v),
                          name, self._slots[0][kind].value.device)]

  def _invalidate(self) -> None:
    """Drops the gathered slots `_full_kind` cached (a slot was written)."""
    self._generation += 1

  def restore_slot(self, kind: str, index: int, value,
                   group: Optional[Sequence[int]] = None) -> None:
    """Writes slot `kind` of variable `index` (its per-replica shape) into
    the local shards that hold part of it, of the replicas of `group`
    (replica ids; None: every local replica)."""
    self._generation += 1
    flat = tf.reshape(tf.cast(value, tf.float32), [-1])
    for kinds, replica in zip(self._slots, self.replica_ids):
      if group is not None and replica not in group:
        continue
      slot = kinds[kind]
      shard = self.groups.shard_of_replica(replica)
      for j, start, shard_start, length in self.layout.pieces(shard):
        if j == index:
          slot.value[shard_start:shard_start + length].assign(
              flat[start:start + length])
