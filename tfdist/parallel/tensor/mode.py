"""The trainer's step under tensor parallelism (`--tensor_parallel=T`).

`build` makes two models of the run's Transformer (or of the user's model
a Keras `LayoutMap` splits, `from_layout_map`): the unsharded one
first (outside the strategy, on the host CPU, so its initial weights and
random-layer seeds are those of an unsharded run with the same `--seed`),
then the tensor-parallel one in the strategy's scope, split T ways
(`groups.split_over(T)`), given the unsharded weights
(`tensor_parallel.load_full_weights`) and seed states. The
tensor-parallel model is the one trained; the unsharded one is the
*gathered view* that checkpoints and the SavedModel see.

The strategy's N = D x T replicas form a data x tensor mesh
(`tfdist.parallel.mesh.DeviceMesh.build(devices, tensor=T)`, laid out by
`tfdist.parallel.tensor.groups`): T consecutive replicas are one tensor
group (one data-parallel copy of the model, split T ways), and the D
replicas holding the same shard are one data group. With D = 1 (T = N)
every collective spans all replicas (`ReplicaContext`'s).

`TensorParallelStep` changes the `Trainer`'s step in three places:

* forward and backward: each replica reads its 1/N of the global batch
  as under data parallelism, all-gathers its tensor group's shares (token
  ids and labels: small; the group's copy then runs 1/D of the global
  batch, every example once), runs them through the model and returns
  their loss (counted on the group's shard-0 replica only) and its own
  examples' outputs (so the summed metrics count every example once);
* the update (`Trainer._replica_apply`): no all-replica gradient
  all-reduce. Within a tensor group, Megatron's f and g operators give
  each replica the gradient of its shards and the same whole gradient of
  every replicated weight (embeddings, layer norms, the row-parallel
  biases, the classifier) on its copy's examples. With D > 1 every
  gradient (shards and replicated weights, packed into one vector per
  dtype) is then summed over the replica's data group
  (`collectives.replica_all_reduce`): the trainer's losses are divided by
  the global batch size, so the sum is one device's gradient on the
  whole global batch. The optimizer, applied per replica, keeps the
  replicated weights equal and each shard's slots (momentum, Adam's
  moments) at 1/T size;
* evaluation: the same gather, whatever each replica's share.

With `--zero_stage=1` or 2 (hybrid sharding, `tfdist.parallel.tensor.zero`)
the trainer's `ShardedOptimizer` is given the data groups
(`sharded_optimizer`): the step leaves the data-group sum to it, and each
replica keeps the optimizer state of 1/D of its per-replica variables.

Random layers draw the same stream on every replica (the one replica 0
of a data-parallel run draws). With D = 1 each dropout mask is then the
unsharded model's on the same batch. With D > 1 each `keras.layers.Dropout`
of the model (those of attention included) draws the mask of the whole
global batch (D x its copy's rows: training batches are all full) and
applies its copy's rows: the run equals one device's, at the cost of
drawing D masks' worth of random numbers.

Checkpoints hold the gathered view under the unsharded model's keys and
shapes, the optimizer's slots included (gathered from the shards of the
first data copy when saved, split into every copy's when restored), so a
checkpoint restores into an unsharded run of the same Transformer, into
another D x T layout, and back.
"""

import dataclasses
from typing import Callable, List, Optional

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfdist.parallel import collectives
from tfdist.parallel import layout_map as layout_map_lib
from tfdist.parallel import mesh as mesh_lib
from tfdist.parallel import mode as mode_lib
from tfdist.parallel import views
from tfdist.parallel.tensor import from_layout_map
from tfdist.parallel.tensor import groups as groups_lib
from tfdist.parallel.tensor import layers as tp_lib
from tfdist.parallel.tensor import options as tensor_options
from tfdist.parallel.tensor import zero as zero_lib
from tfdist.runtime import private_api

_VALUE = "VARIABLE_VALUE"


class _SameStreamSeedGenerator(keras.random.SeedGenerator):
  """A `keras.random.SeedGenerator` drawing on every replica what replica
  0 of a data-parallel run draws (`train_loop._PerReplicaSeedGenerator`
  folds the replica id in; here it is always 0)."""

  def next(self, ordered=True):
    seed = super().next(ordered=ordered)
    if tf.distribute.get_replica_context() is None:
      return seed
    return tf.cast(tf.random.experimental.stateless_fold_in(
        tf.cast(seed, tf.int64), 0), seed.dtype)


class _Gathered:
  """Mixed into a Keras variable of the gathered view: saved as the value
  `_tfdist_read()` gives, restored through `_tfdist_write(value)`."""

  _tfdist_read: Callable[[], np.ndarray]
  _tfdist_write: Callable[[np.ndarray], None]

  def _serialize_to_tensors(self):
    return {_VALUE: tf.constant(self._tfdist_read())}

  def _restore_from_tensors(self, restored_tensors):
    value = restored_tensors[_VALUE]
    self._tfdist_write(np.asarray(value))
    return self.value.assign(value)


class _CopyRowsDropout(keras.layers.Dropout):
  """A `keras.layers.Dropout` of a data-parallel copy (D > 1): it draws
  the mask of the whole global batch, [D x b, ...] for its copy's input
  [b, ...] (every copy's training batch has the same b), and applies the
  rows of its copy d, [d x b, (d + 1) x b): the mask one device draws for
  the global batch (stateless Philox: element i of a draw depends on the
  seed and i only). `_tfdist_groups`: the model's `TensorGroups`."""

  _tfdist_groups: groups_lib.TensorGroups

  def call(self, inputs, training=False):
    groups = self._tfdist_groups
    if (not training or self.rate <= 0 or groups.data == 1 or
        tf.distribute.in_cross_replica_context() or
        (self.noise_shape is not None and
         self.noise_shape[0] is not None)):
      return super().call(inputs, training=training)
    place = groups.here(f"Dropout {self.name!r}")
    shape = tf.shape(inputs)
    whole = tf.concat([[shape[0] * groups.data], shape[1:]], axis=0)
    mask = keras.random.dropout(tf.ones(whole, inputs.dtype), self.rate,
                                noise_shape=self.noise_shape,
                                seed=self.seed_generator)
    return inputs * mask[place.data * shape[0]:(place.data + 1) * shape[0]]


def _copy_rows_dropout(model: keras.Model,
                       groups: groups_lib.TensorGroups) -> int:
  """Makes every `keras.layers.Dropout` of `model` a `_CopyRowsDropout`;
  returns how many."""
  count = 0
  for layer in private_api.flatten_layers(model, include_self=False):
    if type(layer) is keras.layers.Dropout:  # pylint: disable=unidiomatic-typecheck
      layer.__class__ = _CopyRowsDropout
      object.__setattr__(layer, "_tfdist_groups", groups)
      count += 1
  return count


def _gather_in_group(group, rank, *tensors):
  """Each of `tensors` (a tensor, a nest or None) gathered along axis 0
  over `group` (`collectives.replica_all_gather`, in the group's order;
  shares of different sizes padded for the gather and the padding
  dropped), and where this replica's (rank `rank`) examples lie in the
  result (`start`, `size`)."""
  size = tf.shape(tf.nest.flatten(tensors[1])[0])[0]
  sizes = collectives.replica_all_gather(group, tf.reshape(size, [1]))
  start = tf.reduce_sum(sizes[:rank])
  # At least one row each: a collective of empty tensors crashes
  # TensorFlow 2.21's CPU gather (a tensor group with no examples in the
  # last evaluation round).
  most = tf.maximum(tf.reduce_max(sizes), 1)
  keep = tf.reshape(tf.sequence_mask(sizes, most), [-1])

  def gather(x):
    padding = [[0, most - size]] + [[0, 0]] * (len(x.shape) - 1)
    return tf.boolean_mask(
        collectives.replica_all_gather(group, tf.pad(x, padding)), keep)

  gathered = [None if t is None else tf.nest.map_structure(gather, t)
              for t in tensors]
  return gathered, start, size


def _at_least_one_row(x):
  """`x` [n, ...], or one row of zeros [1, ...] when n is 0."""
  return tf.cond(tf.shape(x)[0] > 0, lambda: x,
                 lambda: tf.zeros(tf.concat([[1], tf.shape(x)[1:]], 0),
                                  x.dtype))


def _sum_over(group, rank, grads):
  """`grads` (None, dense or `tf.IndexedSlices`) summed over `group` (this
  replica: rank `rank`): the dense ones by one all-reduce per dtype of
  the flattened, concatenated gradients; each `tf.IndexedSlices` (an
  embedding's) by all-gathering its rows and indices in the group's
  order: the slices one device gets for the whole batch, duplicates
  included (an optimizer such as Adam squares each slice, so summing the
  rows of one token first would give another update)."""
  out = list(grads)
  for i, g in enumerate(grads):
    if isinstance(g, tf.IndexedSlices):
      (values, indices), _, _ = _gather_in_group(group, rank, g.values,
                                                 g.indices)
      out[i] = tf.IndexedSlices(values, indices, g.dense_shape)
  dense = [None if g is None or isinstance(g, tf.IndexedSlices) else g
           for g in grads]
  for dtype in sorted({g.dtype for g in dense if g is not None},
                      key=lambda d: d.name):
    picked = [i for i, g in enumerate(dense)
              if g is not None and g.dtype == dtype]
    flat = tf.concat([tf.reshape(dense[i], [-1]) for i in picked], axis=0)
    summed = collectives.replica_all_reduce(group, flat)
    pieces = tf.split(summed, [int(np.prod(dense[i].shape)) for i in picked])
    for i, piece in zip(picked, pieces):
      out[i] = tf.reshape(piece, dense[i].shape)
  return out


_GATHERED_CLASSES = {}


def _gather_through(variable, read, write) -> None:
  """Makes the Keras `variable` save `read()` and restore into `write`
  (again on a variable made so before: its read and write are replaced;
  mixing `_Gathered` into its class a second time is a TypeError)."""
  if isinstance(variable, _Gathered):
    variable._tfdist_read = read  # pylint: disable=protected-access
    variable._tfdist_write = write  # pylint: disable=protected-access
    return
  base = type(variable)
  cls = _GATHERED_CLASSES.get(base)
  if cls is None:
    cls = _GATHERED_CLASSES[base] = type(f"Gathered{base.__name__}",
                                         (_Gathered, base), {})
  variable.__class__ = cls
  variable._tfdist_read = read  # pylint: disable=protected-access
  variable._tfdist_write = write  # pylint: disable=protected-access


def _components(variable) -> tuple:
  return tp_lib._components(variable)  # pylint: disable=protected-access


@mode_lib.register_mode("tensor")
@dataclasses.dataclass
class TensorParallelStep(mode_lib.StepMode):
  """The `tensor` step mode: the tensor-parallel model, its gathered view
  and the step's changes. Each replica's gradients are its own (its
  shards', and the same replicated ones), summed over its data group only
  (D > 1): not all-reduced over all replicas.

  Attributes:
    model: the tensor-parallel Keras model (trained; built in the
      strategy's scope).
    unsharded: the same model with `keras.layers.Dense` and
      `MultiHeadAttention` (on the host CPU): the gathered view.
    num_shards: T, the replicas of a tensor group the layers are split
      over.
    groups: the replicas' `groups.TensorGroups` (D x T = N).
  """
  model: keras.Model
  unsharded: keras.Model
  num_shards: int
  groups: groups_lib.TensorGroups
  all_reduces_gradients = False

  @classmethod
  def model_facts(cls, model) -> dict:
    """`tensor_parallel_bytes`: the weight bytes the tensor-parallel
    layers would split (`layers.splittable_weight_bytes`)."""
    return {"tensor_parallel_bytes": tp_lib.splittable_weight_bytes(model)}

  @classmethod
  def plan_lines(cls, facts) -> list:
    """The run plan's lines for `--tensor_parallel=T` on R replicas: the
    data x tensor mesh (`DeviceMesh.plan_lines`, replicas named by
    index)."""
    tensor = facts.parallelism.tensor_parallel
    mesh = mesh_lib.DeviceMesh.build(
        [f"replica {r}" for r in range(facts.num_replicas_in_sync)],
        tensor=tensor)
    return [f"  tensor_parallel        {tensor}: {mesh.data} data-parallel "
            f"cop{'y' if mesh.data == 1 else 'ies'} x {tensor} tensor-"
            "parallel replicas (D x T)"] + [
                "    " + line for line in mesh.plan_lines()]

  @classmethod
  def validate(cls, settings) -> None:
    """`tfdist.parallel.tensor.options.check_flags` on `settings`."""
    tensor_options.check_flags(**{
        name: settings[name] for name in tensor_options.CHECKED_SETTINGS})

  @classmethod
  def devices(cls, settings) -> int:
    """N: the replicas the layers are split over."""
    return int(settings["tensor_parallel"])

  @classmethod
  def layout_rows(cls, facts) -> list:
    """Tensor parallelism: the splittable layers' state
    (`facts.tensor_parallel_bytes` of weights, their gradients and
    optimizer slots in proportion) / N, the rest whole; every replica runs
    the whole batch B, and its activations are counted whole (an upper
    bound: the split heads' are 1/N)."""
    e, n = facts.estimate, facts.num_devices
    trainable = e.gradients_bytes
    grads = e.gradients_bytes + facts.accumulators
    split = min(max(int(facts.tensor_parallel_bytes), 0), trainable)
    share = split / trainable if trainable else 0.0
    # The split layers' share of the weights, gradients and slots, / N;
    # the flags (the Transformer's, or --layout_map's) and why not
    # (`LayoutFacts.tensor_split`).
    flags, note = facts.tensor_split(n)
    note = facts.one_device_note or (
        "no layer of this model can be split" if not split else note)
    if facts.tensor_parallel_flag and not facts.layout_map:
      flags = facts.tensor_parallel_flag
    return [facts.row(
        "tensor parallel", flags if not facts.one_device_note else "", n,
        e.parameters_bytes - split + facts.ceil_div(split, n),
        grads - facts.ceil_div(grads * share * (n - 1), n),
        e.optimizer_bytes - facts.ceil_div(
            e.optimizer_bytes * share * (n - 1), n),
        facts.activation_bytes_per_example * facts.global_batch_size,
        not note, note)]

  def sharded_optimizer(self, stage_class, **kwargs):
    """ZeRO stages 1-2 sharded over each data group (hybrid sharding):
    `stage_class` given the mesh's data groups (`zero.DataGroupShards`,
    the D replicas holding one tensor shard). Stage 3 is refused at start
    (`tfdist.parallel.tensor.options`).

    Raises:
      tfdist.errors.ConfigError: as `zero.DataGroupShards` (a data group
        out of replica order) and `ShardedOptimizer` raise.
    """
    return stage_class(**kwargs, groups=zero_lib.DataGroupShards(self.groups))

  def describe(self) -> str:
    """One line for the manifest and the log."""
    shard = sum(int(np.prod(v.shape)) for v in self.model.weights
                if getattr(v, tp_lib._SHARD_AXIS, None) is not None)  # pylint: disable=protected-access
    total = sum(int(np.prod(v.shape)) for v in self.unsharded.weights)
    n, d = self.num_shards, self.groups.data
    copies = ("trains on the whole batch" if d == 1 else
              f"trains on its copy's 1/{d} of the batch ({d} data-parallel "
              f"copies of {n} replicas, gradients summed over each shard's "
              f"{d} replicas)")
    return (f"{n} replicas split the attention heads and feed-forward "
            f"units: each holds {shard} of their {shard * n} weights (1/{n}) "
            f"and all {total - shard * n} others, and {copies}")

  # --- the step -----------------------------------------------------------
  @staticmethod
  def _gather_batch(*tensors):
    """The global batch on every replica: each tensor (or nest) gathered
    along axis 0 in replica order, and where this replica's examples lie
    in it (`start`, `size`)."""
    context = tf.distribute.get_replica_context()
    size = tf.shape(tf.nest.flatten(tensors[1])[0])[0]
    sizes = context.all_gather(tf.reshape(size, [1]), axis=0)
    start = tf.reduce_sum(sizes[:context.replica_id_in_sync_group])
    gathered = [None if t is None else tf.nest.map_structure(
        lambda x: context.all_gather(x, axis=0), t) for t in tensors]
    return gathered, start, size

  def _gather(self, *tensors):
    """`(gathered, start, size, place)`: `tensors` gathered over this
    replica's tensor group (all replicas when D = 1; `place` None then),
    and where its own examples lie in them."""
    if self.groups.data == 1:
      return (*self._gather_batch(*tensors), None)
    place = self.groups.here("the tensor-parallel step")
    gathered, start, size = _gather_in_group(place.tensor_group,
                                             place.tensor, *tensors)
    return gathered, start, size, place

  def forward_backward(self, trainer, inputs, labels, weights=None):
    """`StepContext.model_forward_backward` on the tensor group's batch.

    Args:
      trainer: the `tfdist.parallel.mode.StepContext` (the trainer).
      inputs: this replica's inputs, [b, ...] (b: its share of the batch).
      labels: [b, ...].
      weights: its examples' training weights, float32 [b], or None.

    Returns:
      `(loss, grads, outputs)`: the group's batch's loss on its shard-0
      replica and 0 on the others (float32 scalar; summed over replicas it
      is the global batch's loss once), the gradients of
      `model.trainable_variables` (shard-shaped for shards; summed over
      the data group when D > 1, unless ZeRO's sharded optimizer sums
      them there itself; not to be summed over replicas), and
      this replica's examples' outputs, float32 [b, ...].
    """
    (inputs, labels, weights), start, size, place = self._gather(
        inputs, labels, weights)
    loss, grads, outputs = trainer.model_forward_backward(inputs, labels,
                                                          weights)
    if place is None:
      rank = tf.distribute.get_replica_context().replica_id_in_sync_group
    else:
      rank = place.tensor
      if trainer.sharded is None:  # ZeRO sums them over the group itself.
        grads = _sum_over(place.data_group, place.data, grads)
    first = tf.cast(tf.equal(rank, 0), loss.dtype)
    return loss * first, grads, outputs[start:start + size]

  def eval_sums(self, trainer, inputs, labels, weights=None, mask=None):
    """`StepContext.eval_sums` of this replica's examples, the model
    run on the tensor group's gathered batch (a replica with no examples
    in the last round still takes part in the collectives; a tensor group
    with none at all runs the model on one example of zeros, its output
    unused: the model's collectives must run in every replica)."""
    (all_inputs, _), start, size, _ = self._gather(inputs, labels)
    if self.groups.data > 1:
      all_inputs = tf.nest.map_structure(_at_least_one_row, all_inputs)
    outputs = tf.cast(self.model(all_inputs, training=False), tf.float32)
    return trainer.eval_sums(
        inputs, labels, weights, mask, outputs=outputs[start:start + size])

  # --- the gathered view --------------------------------------------------
  def gathered_model(self) -> keras.Model:
    """The unsharded model holding the trained (gathered) weights: for
    export and anything that reads the whole model."""
    self.unsharded.set_weights(tp_lib.gathered_weights(self.model))
    return self.unsharded

  def exported_model(self, context=None) -> keras.Model:
    """`gathered_model`: the whole model for export."""
    del context
    return self.gathered_model()

  def checkpoint_model(self, context=None) -> keras.Model:
    """The unsharded model, each of its variables saving the gathered
    value of its tensor-parallel twin and restoring into it: the
    checkpoint's `model`, under an unsharded run's keys."""
    for view, variable in zip(self.unsharded.weights, self.model.weights):
      _gather_through(
          view,
          lambda v=variable: tp_lib._full_value(v),  # pylint: disable=protected-access
          lambda value, v=variable: tp_lib._assign_full(v, value))  # pylint: disable=protected-access
    return self.unsharded

  def checkpoint_optimizer(self, context):
    """An optimizer of the trainer's (`context.optimizer`) class and
    configuration built on the unsharded model, each of its variables
    saving the gathered value of `optimizer`'s (a shard's slot: its
    replicas' components concatenated) and restoring into it: the
    checkpoint's `optimizer`. Under ZeRO (`context.sharded`), the slots
    gathered from the data groups' shards too (`zero.checkpoint_view`).

    Raises:
      ValueError: the two optimizers' variables do not pair up.
    """
    optimizer = context.optimizer
    if context.sharded is not None:
      return zero_lib.checkpoint_view(context.sharded, self.unsharded,
                                      optimizer, _gather_through)
    view = views.optimizer_view(optimizer, self.unsharded)
    ours, theirs = list(optimizer.variables), list(view.variables)
    if len(ours) != len(theirs):
      raise ValueError(f"the tensor-parallel optimizer has {len(ours)} "
                       f"variables, its unsharded view {len(theirs)}")
    n = self.num_shards
    for mine, twin in zip(ours, theirs):
      axis = zero_lib.split_axis(twin.shape, mine.shape, n)

      def read(v=mine, axis=axis):
        # Replicas 0 ... T-1: shards 0 ... T-1 of the first copy.
        parts = [np.asarray(c.numpy()) for c in _components(v)[:n]]
        return parts[0] if axis is None else np.concatenate(parts, axis)

      def write(value, v=mine, axis=axis):
        pieces = ([value] * n if axis is None else
                  np.split(value, n, axis=axis))
        for r, component in enumerate(_components(v)):
          component.assign(pieces[r % n])

      _gather_through(twin, read, write)
    return view


def _same_streams(model: keras.Model) -> List[keras.random.SeedGenerator]:
  generators, seen = [], set()
  for layer in private_api.flatten_layers(model, include_self=True):
    for generator in getattr(layer, "_seed_generators", ()):
      if id(generator) not in seen:
        seen.add(id(generator))
        generators.append(generator)
  return generators


def build(build_model: Callable[[bool], keras.Model],
          strategy: tf.distribute.Strategy,
          tensor: Optional[int] = None,
          layout_map=None) -> TensorParallelStep:
  """Builds the unsharded model, then the tensor-parallel one from it.

  Call before anything else of the run is built (the unsharded model must
  draw the same initial values and seeds an unsharded run draws), outside
  the strategy's scope.

  Args:
    build_model: `build_model(tensor_parallel=bool)` builds the run's model
      (in the current scope).
    strategy: the run's `MirroredStrategy` (its N replicas: D tensor
      groups of T).
    tensor: T, `--tensor_parallel` (a divisor of N); None: N.
    layout_map: a `keras.distribution.LayoutMap` (`tfdist.fit(layout_map=
      ...)`): the tensor-parallel model is the unsharded one cloned with
      the layers the map splits made tensor-parallel
      (`from_layout_map.split_model`; `build_model` is called once).
      None: `build_model(tensor_parallel=True)` builds it.

  Returns:
    The `TensorParallelStep`.

  Raises:
    ConfigError: T does not divide the replicas (`DeviceMesh.build`),
      the model cannot be split T ways (heads or feed-forward units not a
      multiple of T; from the layers), or the layout map cannot split it
      (`from_layout_map.split_model`).
    ValueError: the two models' weights or random layers do not pair up.
  """
  tensor = tensor or strategy.num_replicas_in_sync
  groups = groups_lib.groups_for(tp_lib._local_devices(strategy), tensor)  # pylint: disable=protected-access
  with tf.device("/cpu:0"):
    unsharded = build_model(tensor_parallel=False)
  with strategy.scope(), groups_lib.split_over(tensor):
    model = (build_model(tensor_parallel=True) if layout_map is None else
             from_layout_map.split_model(unsharded, layout_map, tensor))
  tp_lib.load_full_weights(model, unsharded.get_weights())
  theirs, ours = _same_streams(unsharded), _same_streams(model)
  if len(theirs) != len(ours):
    raise ValueError(f"the tensor-parallel model has {len(ours)} random "
                     f"layers' generators, the unsharded one {len(theirs)}")
  for mine, twin in zip(ours, theirs):
    mine.state.assign(twin.state.numpy())
    if type(mine) is keras.random.SeedGenerator:  # pylint: disable=unidiomatic-typecheck
      mine.__class__ = _SameStreamSeedGenerator
  if groups.data > 1:
    _copy_rows_dropout(model, groups)
  step = TensorParallelStep(model, unsharded, tensor, groups)
  note = (None if layout_map is None else
          layout_map_lib.batch_axis_note(layout_map, groups.data))
  if note:
    logging.warning("%s", note)
  logging.info("Tensor parallelism: %s.", step.describe())
  # The plan printed the mesh by replica; here each replica's device, once.
  logging.info("Tensor-parallel replicas' devices: %s.", ", ".join(
      f"replica {r} on {d}" for r, d in enumerate(groups.mesh.devices)))
  return step
