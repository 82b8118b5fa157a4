"""The trainer's step under tensor parallelism (`--tensor_parallel=N`).

`build` makes two models of the run's Transformer: the unsharded one
first (outside the strategy, on the host CPU, so its initial weights and
random-layer seeds are those of an unsharded run with the same `--seed`),
then the tensor-parallel one in the strategy's scope, given the unsharded
weights (`tensor_parallel.load_full_weights`) and seed states. The
tensor-parallel model is the one trained; the unsharded one is the
*gathered view* that checkpoints and the SavedModel see.

`TensorParallelStep` changes the `Trainer`'s step in three places:

* forward and backward: each replica reads its 1/N of the global batch
  as under data parallelism, all-gathers the batch (token ids and labels:
  small), runs the whole batch through the model and returns the whole
  batch's loss (counted on replica 0 only) and its own examples' outputs
  (so the summed metrics count every example once);
* the update (`Trainer._replica_apply`): no gradient all-reduce. With the
  same batch and the same dropout masks on every replica, Megatron's f and
  g operators give each replica the gradient of its shards and the same
  whole gradient of every replicated weight (embeddings, layer norms, the
  row-parallel biases, the classifier), so the optimizer, applied per
  replica, keeps the replicated weights equal and each shard's slots
  (momentum, Adam's moments) on its replica at 1/N size;
* evaluation: the same gather, whatever each replica's share.

Random layers draw the same stream on every replica (the one replica 0
of a data-parallel run draws): each dropout mask is the unsharded model's
on the same batch, so the run equals one device's.

Checkpoints hold the gathered view under the unsharded model's keys and
shapes, the optimizer's slots included (gathered from the shards when
saved, split into them when restored), so a checkpoint restores into an
unsharded run of the same Transformer and back.
"""

import dataclasses
from typing import Callable, List

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfdist.parallel import mode as mode_lib
from tfdist.parallel.tensor import layers as tp_lib
from tfdist.parallel.tensor import options as tensor_options

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


_GATHERED_CLASSES = {}


def _gather_through(variable, read, write) -> None:
  """Makes the Keras `variable` save `read()` and restore into `write`."""
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


def _split_axis(full_shape, shard_shape, n: int):
  """The axis a slot of `shard_shape` splits `full_shape` on (None: the
  slot is whole on every replica)."""
  full, shard = tuple(full_shape), tuple(shard_shape)
  if full == shard:
    return None
  axes = [a for a, (f, s) in enumerate(zip(full, shard)) if f != s]
  if len(full) != len(shard) or len(axes) != 1 or \
      full[axes[0]] != shard[axes[0]] * n:
    raise ValueError(f"an optimizer slot of shape {shard} is not 1/{n} of "
                     f"its unsharded shape {full}")
  return axes[0]


@mode_lib.register_mode("tensor")
@dataclasses.dataclass
class TensorParallelStep(mode_lib.StepMode):
  """The `tensor` step mode: the tensor-parallel model, its gathered view
  and the step's changes. Each replica's gradients are its own (its
  shards', and the same replicated ones): not all-reduced.

  Attributes:
    model: the tensor-parallel Keras model (trained; built in the
      strategy's scope).
    unsharded: the same model with `keras.layers.Dense` and
      `MultiHeadAttention` (on the host CPU): the gathered view.
    num_shards: N, the replicas the layers are split over.
  """
  model: keras.Model
  unsharded: keras.Model
  num_shards: int
  all_reduces_gradients = False

  @classmethod
  def model_facts(cls, model) -> dict:
    """`tensor_parallel_bytes`: the weight bytes the tensor-parallel
    layers would split (`layers.splittable_weight_bytes`)."""
    return {"tensor_parallel_bytes": tp_lib.splittable_weight_bytes(model)}

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
    # The split layers' share of the weights, gradients and slots, / N.
    note = facts.one_device_note or (
        "no layer of this model can be split" if not split else
        "" if facts.tensor_parallel_flag else
        "--tensor_parallel splits only --model=transformer: build this "
        "model from tfdist.parallel.tensor_parallel's layers")
    return [facts.row(
        "tensor parallel", facts.tensor_parallel_flag, n,
        e.parameters_bytes - split + facts.ceil_div(split, n),
        grads - facts.ceil_div(grads * share * (n - 1), n),
        e.optimizer_bytes - facts.ceil_div(
            e.optimizer_bytes * share * (n - 1), n),
        facts.activation_bytes_per_example * facts.global_batch_size,
        not note, note)]

  def describe(self) -> str:
    """One line for the manifest and the log."""
    shard = sum(int(np.prod(v.shape)) for v in self.model.weights
                if getattr(v, tp_lib._SHARD_AXIS, None) is not None)  # pylint: disable=protected-access
    total = sum(int(np.prod(v.shape)) for v in self.unsharded.weights)
    n = self.num_shards
    return (f"{n} replicas split the attention heads and feed-forward "
            f"units: each holds {shard} of their {shard * n} weights (1/{n}) "
            f"and all {total - shard * n} others, and trains on the whole "
            "batch")

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
    return gathered, start, size, context

  def forward_backward(self, trainer, inputs, labels, weights=None):
    """`StepContext.model_forward_backward` on the gathered global batch.

    Args:
      trainer: the `tfdist.parallel.mode.StepContext` (the trainer).
      inputs: this replica's inputs, [b, ...] (b: its share of the batch).
      labels: [b, ...].
      weights: its examples' training weights, float32 [b], or None.

    Returns:
      `(loss, grads, outputs)`: the global batch's loss on replica 0 and 0
      on the others (float32 scalar; summed over replicas it is the loss
      once), the gradients of `model.trainable_variables` (shard-shaped for
      shards; not to be summed over replicas), and this replica's
      examples' outputs, float32 [b, ...].
    """
    (inputs, labels, weights), start, size, context = self._gather_batch(
        inputs, labels, weights)
    loss, grads, outputs = trainer.model_forward_backward(inputs, labels,
                                                          weights)
    first = tf.cast(tf.equal(context.replica_id_in_sync_group, 0),
                    loss.dtype)
    return loss * first, grads, outputs[start:start + size]

  def eval_sums(self, trainer, inputs, labels, weights=None, mask=None):
    """`StepContext.eval_sums` of this replica's examples, the model
    run on the gathered batch (a replica with no examples in the last
    round still takes part in the collectives)."""
    (all_inputs, _), start, size, _ = self._gather_batch(inputs, labels)
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
    """An optimizer of the trainer's (`context.optimizer`) class and configuration built on the
    unsharded model, each of its variables saving the gathered value of
    `optimizer`'s (a shard's slot: its replicas' components concatenated)
    and restoring into it: the checkpoint's `optimizer`.

    Raises:
      ValueError: the two optimizers' variables do not pair up.
    """
    optimizer = context.optimizer
    with tf.device("/cpu:0"):
      view = type(optimizer).from_config(optimizer.get_config())
      view.build(self.unsharded.trainable_variables)
    ours, theirs = list(optimizer.variables), list(view.variables)
    if len(ours) != len(theirs):
      raise ValueError(f"the tensor-parallel optimizer has {len(ours)} "
                       f"variables, its unsharded view {len(theirs)}")
    n = self.num_shards
    for mine, twin in zip(ours, theirs):
      axis = _split_axis(twin.shape, mine.shape, n)

      def read(v=mine, axis=axis):
        parts = [np.asarray(c.numpy()) for c in _components(v)]
        return parts[0] if axis is None else np.concatenate(parts, axis)

      def write(value, v=mine, axis=axis):
        parts = _components(v)
        pieces = ([value] * len(parts) if axis is None else
                  np.split(value, len(parts), axis=axis))
        for component, piece in zip(parts, pieces):
          component.assign(piece)

      _gather_through(twin, read, write)
    return view


def _same_streams(model: keras.Model) -> List[keras.random.SeedGenerator]:
  generators, seen = [], set()
  for layer in model._flatten_layers(include_self=True):  # pylint: disable=protected-access
    for generator in getattr(layer, "_seed_generators", ()):
      if id(generator) not in seen:
        seen.add(id(generator))
        generators.append(generator)
  return generators


def build(build_model: Callable[[bool], keras.Model],
          strategy: tf.distribute.Strategy) -> TensorParallelStep:
  """Builds the unsharded model, then the tensor-parallel one from it.

  Call before anything else of the run is built (the unsharded model must
  draw the same initial values and seeds an unsharded run draws), outside
  the strategy's scope.

  Args:
    build_model: `build_model(tensor_parallel=bool)` builds the run's model
      (in the current scope).
    strategy: the run's `MirroredStrategy` (its replicas: the group).

  Returns:
    The `TensorParallelStep`.

  Raises:
    ConfigError: the model cannot be split over the replicas (heads or
      feed-forward units not a multiple of N; from the layers).
    ValueError: the two models' weights or random layers do not pair up.
  """
  with tf.device("/cpu:0"):
    unsharded = build_model(tensor_parallel=False)
  with strategy.scope():
    model = build_model(tensor_parallel=True)
  tp_lib.load_full_weights(model, unsharded.get_weights())
  theirs, ours = _same_streams(unsharded), _same_streams(model)
  if len(theirs) != len(ours):
    raise ValueError(f"the tensor-parallel model has {len(ours)} random "
                     f"layers' generators, the unsharded one {len(theirs)}")
  for mine, twin in zip(ours, theirs):
    mine.state.assign(twin.state.numpy())
    if type(mine) is keras.random.SeedGenerator:  # pylint: disable=unidiomatic-typecheck
      mine.__class__ = _SameStreamSeedGenerator
  step = TensorParallelStep(model, unsharded,
                            strategy.num_replicas_in_sync)
  logging.info("Tensor parallelism: %s.", step.describe())
  return step
