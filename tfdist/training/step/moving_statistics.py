"""Batch normalization's moving statistics, made one over the replicas.

Keras 3's `BatchNormalization` with `synchronized=False` (its default) keeps
`moving_mean` and `moving_variance` as `MirroredVariable`s with
`aggregation=NONE` under MirroredStrategy and MultiWorkerMirroredStrategy.
An assignment in the replica context then writes only that replica's copy,
so each replica's copy follows its own share of the batch and the copies
drift apart. `variable.numpy()`, a checkpoint and a SavedModel read one copy
(the first replica's; the chief's, for what the chief writes), while an
evaluation under the strategy normalizes each replica's share of the
evaluation batch with that replica's copy: its metrics belong to no model
that is saved (measured with TensorFlow 2.21 and Keras 3 on two logical
CPU devices).

`MovingStatistics.synchronize` replaces every copy of those variables by
their mean over all replicas of all workers (one all-reduce of all of them,
packed into one vector) and is called before each evaluation, checkpoint
and export, at most once per training step. The model evaluated is then the
one checkpointed and exported, and its statistics are estimates over every
replica's examples rather than one replica's. Training is unchanged: in
training a layer normalizes with its batch's own statistics; the moving
ones are only updated.

`note_in_plan` tells, once the model is built, whether the model's batch
normalization is synchronized, and names the layers that are not together
with the fix (`BatchNormalization(synchronized=True)`, or
`--sync_batch_norm` for built-in models).
"""

import dataclasses
from typing import List, Optional, Sequence

from absl import logging
import keras
import tensorflow as tf

from tfdist import models
from tfdist.runtime import private_api


def batch_norm_layers(model: keras.Model) -> List[keras.layers.Layer]:
  """The `keras.layers.BatchNormalization` layers of `model`, at any depth,
  in the model's order."""
  layers = private_api.flatten_layers(model, include_self=False)
  return [layer for layer in layers
          if isinstance(layer, keras.layers.BatchNormalization)]


def unsynchronized_layers(model: keras.Model) -> List[keras.layers.Layer]:
  """The batch-normalization layers of `model` whose statistics are each
  replica's own (`synchronized=False`)."""
  return [layer for layer in batch_norm_layers(model)
          if not getattr(layer, "synchronized", False)]


def _tf_variable(variable):
  """The TensorFlow variable under a Keras 3 variable (or `variable`)."""
  return getattr(variable, "value", variable)


class MovingStatistics:
  """Averages unsynchronized batch normalization's per-replica statistics.

  Args:
    strategy: the `tf.distribute.Strategy` the model was built under.
    model: the Keras 3 model.
    step_counter: an int64 `tf.Variable` counting training steps; one
      synchronization per value of it is enough (training alone moves the
      statistics). None: every call synchronizes.

  `variables` (found at the first `synchronize`, when the model is built)
  is empty, and `synchronize` does nothing, with one replica or when no
  unsynchronized batch-normalization layer's statistics are mirrored over
  several replicas (parameter servers hold one copy).
  """

  def __init__(self, strategy: tf.distribute.Strategy, model: keras.Model,
               *, step_counter: Optional[tf.Variable] = None):
    self.strategy = strategy
    self.model = model
    self.step_counter = step_counter
    self.variables = None
    self._synchronized_at = None
    self._fn = None

  def _find_variables(self) -> list:
    if self.strategy.num_replicas_in_sync <= 1:
      return []
    return [v for layer in unsynchronized_layers(self.model)
            for v in (getattr(layer, "moving_mean", None),
                      getattr(layer, "moving_variance", None))
            if v is not None and
            isinstance(_tf_variable(v), tf.distribute.DistributedValues)]

  def _synchronize(self):
    variables = self.variables
    sizes = [tf.TensorShape(v.shape).num_elements() for v in variables]

    def replica_fn():
      context = tf.distribute.get_replica_context()
      # In the replica context a variable reads, and (aggregation NONE)
      # writes, this replica's copy.
      local = tf.concat([tf.reshape(tf.cast(tf.convert_to_tensor(
          _tf_variable(v)), tf.float32), [-1]) for v in variables], axis=0)
      mean = context.all_reduce(tf.distribute.ReduceOp.MEAN, local)
      for v, part in zip(variables, tf.split(mean, sizes)):
        _tf_variable(v).assign(tf.cast(tf.reshape(part, v.shape), v.dtype))

    self.strategy.run(replica_fn)

  def synchronize(self) -> bool:
    """Gives every replica's copy of the statistics their mean over all
    replicas (a collective: under MultiWorkerMirroredStrategy every worker
    calls it at the same steps). Returns whether anything ran: False without
    such statistics, or when they were synchronized at this step already."""
    if self.variables is None:
      self.variables = self._find_variables()
      if self.variables:
        self._fn = tf.function(self._synchronize)
    if self._fn is None:
      return False
    step = (None if self.step_counter is None else
            int(self.step_counter.numpy()))
    if step is not None and step == self._synchronized_at:
      return False
    self._fn()
    self._synchronized_at = step
    return True


def before_save(statistics: MovingStatistics, hook=None):
  """A checkpoint's `before_save`: `statistics` synchronized (a collective,
  so first: every worker reaches it), then `hook()` (if not None)."""

  def before():
    statistics.synchronize()
    if hook is not None:
      hook()

  return before


def plan_line(names: Sequence[str], *, num_replicas_in_sync: int) -> str:
  """The plan's batch-norm line for a model whose layers `names` are
  unsynchronized under `num_replicas_in_sync` (> 1) replicas."""
  shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more"
                                  if len(names) > 5 else "")
  return (f"per replica in the model's {shown} (synchronized=False): each "
          f"of the {num_replicas_in_sync} replicas normalizes its share of "
          "the batch and keeps its own moving statistics, averaged over the "
          "replicas before each evaluation, checkpoint and export. To "
          "normalize over the global batch as one device does, build them "
          "with keras.layers.BatchNormalization(synchronized=True) (built-in "
          "models: --sync_batch_norm)")


def for_run(plan, parts, *, strategy: tf.distribute.Strategy,
            model_name: str):
  """`(plan, statistics)` of a training run: `note_in_plan`'s plan, and the
  `MovingStatistics` of `parts.model` (a `tfdist.training.assembly.Parts`
  whose trainer's `global_step` counts the steps) for the runner to
  synchronize before each evaluation, checkpoint and export."""
  return (note_in_plan(plan, parts.model, model_name=model_name,
                       num_replicas_in_sync=strategy.num_replicas_in_sync),
          MovingStatistics(strategy, parts.model,
                           step_counter=parts.trainer.global_step))


def note_in_plan(plan, model: keras.Model, *, model_name: str,
                 num_replicas_in_sync: int):
  """The run plan with its batch-norm facts as `model` has them, logged.

  Args:
    plan: the `tfdist.training.plan.run_plan.RunPlan` (its `sync_batch_norm`
      says what a built-in model's builder was asked for).
    model: the built Keras model (a user's builder may ignore the plan).
    model_name: `--model` (a built-in model's name, or a user's
      `module:function`).
    num_replicas_in_sync: replicas over all workers.

  Returns:
    `plan` itself for a model without batch normalization, or a built-in
    model whose layers follow the plan (its plan line said so already);
    else a copy whose `sync_batch_norm` and `sync_batch_norm_reason`
    describe the model's layers. Unsynchronized layers under several
    replicas of a synchronous strategy are named in a logged plan line,
    with the fix.
  """
  layers = batch_norm_layers(model)
  if not layers:
    return plan
  unsynchronized = [layer.name for layer in layers
                    if not getattr(layer, "synchronized", False)]
  synchronized = not unsynchronized
  if models.has_batch_norm(model_name) and (
      synchronized == plan.sync_batch_norm):
    return plan
  if unsynchronized and num_replicas_in_sync > 1 and not plan.asynchronous:
    reason = plan_line(unsynchronized,
                       num_replicas_in_sync=num_replicas_in_sync)
    logging.info("tfdist plan:\n  batch norm             %s", reason)
    return dataclasses.replace(plan, sync_batch_norm=False,
                               sync_batch_norm_reason=reason)
  if synchronized == plan.sync_batch_norm:
    return plan
  return dataclasses.replace(
      plan, sync_batch_norm=synchronized,
      sync_batch_norm_reason=(
          "the model's BatchNormalization layers are synchronized=True"
          if synchronized else
          "the model's BatchNormalization layers are synchronized=False"))
