"""The inner training loop: one `tf.function` step run with `strategy.run`.

Keras 3's `Model.fit` fails under MultiWorkerMirroredStrategy and
ParameterServerStrategy, so tfdist drives Keras 3 models, optimizers and
losses through its own step (as Model Garden's Orbit does). The same
`train_function` serves every strategy: called directly for one device,
Mirrored, MultiWorkerMirrored and TPU, and passed to
`ClusterCoordinator.schedule` under ParameterServerStrategy.

Loss: any Keras loss, reduced over the *global* batch as `Model.fit`
reduces it on one device (`tfdist.training.step.objectives.REDUCTIONS`): by
default (`"sum_over_batch_size"`) computed per example and averaged over
the global batch (the replica's sum divided by the global batch size, as
`tf.nn.compute_average_loss(..., global_batch_size=...)` computes it);
`reduction="sum"` summed over it; `reduction=None` differentiated as the
sum and reported as the mean, as `fit` does. A loss returning one value for
the whole batch is that batch's loss (each replica's value weighs its share
of the global batch, 1/N of N equal shares; `objectives.loss_values`). The
step sums gradients over replicas, so the update equals the single-device
update on the whole global batch. `model.losses` (regularizers, `add_loss`)
are added once per step (`tf.nn.scale_regularization_loss`: each replica
adds 1/N), in training and in evaluation, as `fit` and `evaluate` add them.

Sample weights: a batch `(inputs, labels, weights)` (weights float32
[batch], as Keras's `fit` takes a dataset of `(x, y, sample_weight)`), or
`class_weight` (`{class id: weight}`, turned into per-example weights from
the labels as Keras does: `argmax` of one-hot labels, else the rounded
label; classes not named weigh 1), multiplies each example's loss: the step's
loss is `sum(weight x loss) / global_batch_size`, Keras's
`"sum_over_batch_size"` reduction over the global batch. Metrics compiled as
`weighted_metrics` take the weights, the others do not, as in `fit`.
Evaluation takes sample weights (not class weights, as `evaluate`): loss
`sum(weight x loss) / examples`.

Metrics: any Keras metrics whose state is summed (every built-in one). Each
step returns each metric's state for its batch, summed over replicas and
workers by the strategy (see `tfdist.training.step.objectives.MetricSums`), so
the values equal one device's on all the data.

What every replica (and worker) does in one step, in order:

1. forward and backward pass on its share of the batch (the loss scaled by
   the fp16 loss scale, if any), with dropout and other random layers drawing
   from the replica's own random stream (see `per_replica_random_streams`);
2. one all-reduce (sum) of the gradients over all replicas of all workers,
   which also carries the step's sums of the gradients' dtype (float32:
   loss, example count, metric states, the stop requests) under Mirrored
   and MultiWorkerMirrored: one collective per step, not one for the
   gradients and another for the sums, each a point where a worker waits
   for its peers (`_all_reduce_sum`). Sums of another dtype, and every sum
   under ZeRO sharding or other strategies, keep a reduction of their own
   (`_reduce`). With `all_reduce_dtype` bfloat16 or float16 the gradients
   travel in that dtype and come back in float32
   (`tfdist.training.reduce_dtype`), and the float32 sums take `_reduce`;
3. the optimizer's `apply` on those summed gradients, with the optimizer's
   own all-reduce turned off (Keras 3 optimizers sum gradients inside
   `apply`, after their fp16 finite check and their clipping). So:
   * the fp16 finite check sees the summed gradient, identical on every
     replica and worker: all skip the step together (a step whose summed
     gradient is not finite), the loss scale changes the same way
     everywhere, no non-finite value reaches a weight, and no worker is
     left waiting in an all-reduce the others skipped;
   * `clipnorm` / `global_clipnorm` of the (inner) Keras optimizer clip
     once, the summed and unscaled gradient, as on one device
     (tensorflow/tensorflow#25806: clipping each replica's share differs).
4. skipped steps (fp16: non-finite summed gradient) are counted inside the
   compiled step and returned with the chunk's sums.

Where the time goes: the compiled function also returns, per call, the
seconds it waited for the input iterator (`tf.timestamp` before and after
each `get_next`, see `_timed_next`) and the seconds the call took from its
first to its last op, measured inside the graph: no host synchronization
of its own.

Gradient accumulation (`gradient_accumulation_steps` K > 1): one step is
one optimizer update made of K micro-steps. Each micro-step takes the next
per-replica micro-batch from the iterator, runs step 1 above and adds the
replica's gradients (and metric sums) to accumulators of its own (one
float32 buffer per trainable variable on every replica: sync-on-read
variables, never checkpointed, zero between updates); then steps 2-4 run
once, on the accumulated gradients: one all-reduce per update, one finite
check (an fp16 overflow in any micro-batch makes the sum non-finite, so the
whole update is skipped and the scale lowered), clipping once on the
accumulated, summed, unscaled gradient. The loss is averaged over the
effective global batch (K x replicas x micro-batch), so the update equals
one update on the K-times larger batch (Keras 3's own
`gradient_accumulation_steps` fails under MirroredStrategy:
`merge_call called while defining a new graph`). Micro-steps are counted
inside the step (`micro_steps` in the sums).
"""

import contextlib
from typing import Callable, Dict, Optional

import keras
import numpy as np
import tensorflow as tf

from tfdist.parallel import mode as mode_lib
from tfdist.parallel import modes
from tfdist.parallel.data import sharded_optimizer
from tfdist.runtime import private_api
from tfdist.training.step import objectives
from tfdist.training.step import precision
from tfdist.core import reduce_dtype


# The key of the sharded optimizer's per-replica update in a step's sums.
_SHARD_UPDATE = "_shard_update"
# The key of a step's sums already summed over replicas (they rode with the
# gradients' all-reduce): every replica holds the same values.
_SUMMED = "_summed"


class _PerReplicaSeedGenerator(keras.random.SeedGenerator):
  """A `keras.random.SeedGenerator` whose draws differ per replica.

  The generator's state (a [2] seed-and-counter variable) stays the same on
  every replica and worker, advances the same way and is what checkpoints
  hold; each draw is `tf.random.experimental.stateless_fold_in(state,
  replica_id_in_sync_group)`, so replica r of N gets its own stream,
  reproducible from the seed, and unchanged by a checkpoint and resume.
  """

  def next(self, ordered=True):
    seed = super().next(ordered=ordered)
    context = tf.distribute.get_replica_context()
    if context is None:  # Cross-replica context: no replica to tell apart.
      return seed
    replica_id = tf.cast(context.replica_id_in_sync_group, tf.int32)
    return tf.cast(tf.random.experimental.stateless_fold_in(
        tf.cast(seed, tf.int64), replica_id), seed.dtype)


def per_replica_random_streams(model: keras.Model) -> int:
  """Gives every replica its own random stream in `model`'s random layers.

  Keras layers that draw random numbers (`Dropout`, `GaussianNoise`,
  `RandomFlip`, ...) own a `keras.random.SeedGenerator`. Created under a
  `tf.distribute` strategy its state is mirrored, so every replica (and,
  seeded with the same `--seed`, every worker) would draw the same dropout
  mask at every step: N replicas would then not train like one device on
  the global batch. After this call each draw is folded with the replica's
  `replica_id_in_sync_group` (unique over all workers), see
  `_PerReplicaSeedGenerator`.

  Returns:
    The number of seed generators changed.
  """
  changed = 0
  for layer in private_api.flatten_layers(model, include_self=True):
    for generator in getattr(layer, "_seed_generators", ()):
      if type(generator) is keras.random.SeedGenerator:  # pylint: disable=unidiomatic-typecheck
        generator.__class__ = _PerReplicaSeedGenerator
        changed += 1
  return changed


def random_state(model: keras.Model) -> list:
  """The state variables of `model`'s seed generators (int [2] each: seed
  and counter; one per random layer such as `Dropout`, in layer order).

  Keras keeps a `SeedGenerator` out of its layer's checkpoint dependencies,
  so `tf.train.Checkpoint(model=model)` does not save them: a resumed run
  would draw its dropout masks from the initial state again, not from where
  the run stopped. tfdist saves these variables beside the model
  (`tfdist.training.assembly.build`).
  """
  states, seen = [], set()
  for layer in private_api.flatten_layers(model, include_self=True):
    for generator in getattr(layer, "_seed_generators", ()):
      if id(generator) not in seen:
        seen.add(id(generator))
        states.append(generator.state)
  return states


def _sum_gradients_once(optimizer):
  """Turns off `optimizer`'s own gradient all-reduce while the step runs.

  Keras 3's TensorFlow optimizers sum gradients over replicas inside
  `apply` (`_all_reduce_sum_gradients`), after their clipping and after a
  `LossScaleOptimizer` decided from each replica's own gradients whether the
  step is finite. The `Trainer` sums the gradients itself before `apply`
  and, while its step is traced, makes the optimizer (and an inner one)
  pass them through unchanged; outside the step the optimizer behaves as
  Keras made it.

  Returns:
    A context manager.
  """
  optimizers = [optimizer]
  if getattr(optimizer, "inner_optimizer", None) is not None:
    optimizers.append(optimizer.inner_optimizer)

  @contextlib.contextmanager
  def context():
    for opt in optimizers:
      opt._all_reduce_sum_gradients = list  # pylint: disable=protected-access
    try:
      yield
    finally:
      for opt in optimizers:
        del opt._all_reduce_sum_gradients  # pylint: disable=protected-access
  return context()


def _all_reduce_sum(grads, bytes_per_pack: int = 0, riders=None,
                    all_reduce_dtype: str = reduce_dtype.FLOAT32):
  """Sums gradients (tensors or `IndexedSlices`; None kept) over all
  replicas of all workers. Replica context.

  `bytes_per_pack` 0: one batched all-reduce after the whole backward pass.
  N > 0 (MultiWorkerMirroredStrategy): TensorFlow's `CollectiveAllReduce`
  groups the dense gradients, last variable first, into packs of about N
  bytes and launches one all-reduce per pack, each depending only on its
  own gradients, so the last layers' packs travel while the earlier
  layers' gradients are computed. Other strategies' all-reduce ignores it.

  `riders`: `{key: tensor}` summed in the same all-reduce (TensorFlow packs
  dense values of one dtype into one collective: they must have the dense
  gradients' dtype). Placed after the gradients, so they travel in the
  first pack, with the last layers' gradients.

  `all_reduce_dtype`: the gradients travel in this dtype and come back in
  their own (`tfdist.training.reduce_dtype`); riders must then have the
  wire dtype, so a caller reducing in a 2-byte dtype passes none.

  Returns:
    `(gradients, summed riders)`: the gradients a list like `grads`, the
    riders a dict like `riders` (`{}` when None).
  """
  context = tf.distribute.get_replica_context()
  present = [g for g in grads if g is not None]
  riders = dict(riders or {})
  keys = sorted(riders)
  if context is None or not (present or keys):
    return list(grads), riders
  options = (tf.distribute.experimental.CommunicationOptions(
      bytes_per_pack=bytes_per_pack) if bytes_per_pack else None)
  if keys and reduce_dtype.compresses(all_reduce_dtype):
    raise ValueError("Riders travel with float32 gradients only. Received: "
                     f"all_reduce_dtype={all_reduce_dtype!r}")
  summed = reduce_dtype.all_reduce_sum(
      context, present + [riders[k] for k in keys], all_reduce_dtype,
      options)
  out = iter(summed[:len(present)])
  return ([None if g is None else next(out) for g in grads],
          dict(zip(keys, summed[len(present):])))


def _rides_with_gradients(strategy: tf.distribute.Strategy) -> bool:
  """Whether the step's sums join the gradients' all-reduce: under
  Mirrored and MultiWorkerMirrored, where that all-reduce is
  `CollectiveAllReduce` or a `CrossDeviceOps` batch over the replicas of
  the whole group (other strategies keep a reduction of their own)."""
  return isinstance(strategy, (tf.distribute.MirroredStrategy,
                               tf.distribute.MultiWorkerMirroredStrategy))


def _one_replica(strategy: tf.distribute.Strategy) -> bool:
  """True when `strategy` runs one replica in all: a `OneDeviceStrategy`,
  or no strategy (TensorFlow's default one, outside any scope). Its
  replica's values are then already the sums over every replica."""
  if isinstance(strategy, tf.distribute.OneDeviceStrategy):
    return True
  return (not tf.distribute.has_strategy() and
          strategy is tf.distribute.get_strategy())


def _checked_reduce_dtype(all_reduce_dtype: str,
                          strategy: tf.distribute.Strategy, optimizer) -> str:
  """`all_reduce_dtype`, checked against the strategy and the optimizer
  (`tfdist.training.reduce_dtype`: parameter servers have no all-reduce;
  float16 needs a loss scale)."""
  reduce_dtype.check_name(all_reduce_dtype)
  if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
    reduce_dtype.check_strategy(all_reduce_dtype, "parameter_server")
  reduce_dtype.check_loss_scaling(
      all_reduce_dtype,
      isinstance(optimizer, keras.optimizers.LossScaleOptimizer))
  return all_reduce_dtype


def _timed_next(iterator):
  """`next(iterator)` and the seconds it took (float64 scalar tensor).

  The seconds are the time the step waited for its input: from a
  `tf.timestamp` that runs before the iterator's `get_next` to one that runs
  once every component of the batch is ready. Both orders are explicit
  control dependencies, and the batch is handed on only after the second
  timestamp ran (an identity of each component on its own device, no
  copy): otherwise an executor with one thread (a worker pinned to one
  core) may run the whole step before the ready timestamp, and the wait
  would include the step. Cross-replica context.
  """
  before = tf.timestamp()
  with tf.control_dependencies([before]):
    batch = next(iterator)
  with tf.control_dependencies(tf.nest.flatten(batch, expand_composites=True)):
    after = tf.timestamp()

  def gate(component):
    with tf.device(component.device), tf.control_dependencies([after]):
      return tf.identity(component)

  return (tf.nest.map_structure(gate, batch, expand_composites=True),
          after - before)


def _as_weights(weights):
  """Sample weights as float32, [batch, 1] as [batch]; None stays None."""
  if weights is None:
    return None
  weights = tf.cast(weights, tf.float32)
  if weights.shape.rank == 2 and weights.shape[-1] == 1:
    weights = tf.squeeze(weights, -1)
  return weights


def class_weight_table(class_weight) -> tf.Tensor:
  """`class_weight` as a float32 [max class id + 1] table, 1 for classes it
  does not name (Keras's `make_class_weight_map_fn`).

  Raises:
    ValueError: a key that is not an integer >= 0.
  """
  try:
    keys = [int(k) for k in class_weight]
  except (TypeError, ValueError):
    keys = [-1]
  if min(keys) < 0 or any(int(k) != k for k in class_weight):
    raise ValueError("class_weight keys must be class ids (integers >= 0). "
                     f"Received: class_weight={class_weight!r}")
  by_id = {int(k): float(v) for k, v in class_weight.items()}
  return tf.constant([by_id.get(c, 1.0) for c in range(max(keys) + 1)],
                     tf.float32)


def class_weights_of(table: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
  """Each example's class weight, float32 [batch], from `labels` as Keras's
  `fit` derives the class: rank >= 2 labels with a last axis > 1 are one-hot
  (`argmax`), otherwise the rounded label; ids past the table weigh 1."""
  if labels.shape.rank is not None and labels.shape.rank >= 2:
    if labels.shape[-1] is not None and labels.shape[-1] > 1:
      classes = tf.argmax(labels, axis=-1, output_type=tf.int32)
    else:
      classes = tf.cast(tf.round(tf.squeeze(labels, -1)), tf.int32)
  else:
    classes = tf.cast(tf.round(labels), tf.int32)
  classes = tf.reshape(classes, [-1])
  size = tf.shape(table)[0]
  known = tf.logical_and(classes >= 0, classes < size)
  return tf.where(known, tf.gather(table, tf.clip_by_value(classes, 0,
                                                            size - 1)),
                  tf.ones_like(classes, tf.float32))


class Trainer:
  """Owns the compiled step functions of one run.

  Args:
    strategy: the `tf.distribute.Strategy`; `model` and `optimizer` must have
      been created under its scope.
    model: a Keras 3 model with one output (cast to float32 for the loss
      and metrics).
    optimizer: a built Keras 3 optimizer (possibly a `LossScaleOptimizer`).
    global_batch_size: examples per update over all replicas.
    steps_per_execution: training steps run inside one `tf.function` call.
    enable_xla: jit-compile the per-replica forward and backward pass (XLA);
      the optimizer update runs outside the compiled function.
    run_eagerly: run without `tf.function` (debugging).
    task: the default loss and metrics when `loss` is None
      (`tfdist.training.step.objectives.TASKS`: `multiclass`, sparse categorical
      cross-entropy on logits and accuracy; `binary`, binary cross-entropy
      on probabilities, accuracy at 0.5 and ROC AUC).
    eval_example_weights: evaluation batches carry a last element, float32
      weights [batch] (1 for real examples, 0 for padding), as
      `input_pipeline.pad_to_static_batches` makes for TPUs (after the
      sample weights, if any).
    loss: a Keras loss (object, function `fn(y_true, y_pred)` or name);
      computed per example, losses of trailing axes averaged, then reduced
      over the global batch as its `reduction` says (module docstring).
    metrics: Keras metrics (objects, functions or names), or a built
      `tfdist.training.step.objectives.MetricSums`; None: the `task`'s when
      `loss` is None, else none.
    gradient_accumulation_steps: micro-batches per optimizer update (K);
      the iterator then yields per-replica micro-batches of
      `global_batch_size / (K x replicas)` examples, and one training step
      takes K of them (module docstring).
    sharding: a `tfdist.parallel.data.sharded_optimizer.ShardingOptions`
      (ZeRO stage 1 or 2: the optimizer, built on no variables, then runs
      on per-replica shards, see `tfdist.parallel.data.sharded_optimizer`;
      stage 3 also the weights, `tfdist.parallel.zero3`); None or stage 0:
      unsharded. `mode` builds it (`StepMode.sharded_optimizer`: the
      `experts` mode shards the non-expert weights' state only).
    time_steps: measure the input wait and the call's execution time with
      `tf.timestamp` (see `train_function`); False under op determinism
      (`--deterministic`), which refuses `tf.timestamp`: both are then NaN
      (not measured).
    class_weight: `{class id (int >= 0): weight (float)}` for training
      (module docstring), or None. Batches must then be `(inputs, labels)`:
      Keras refuses class and sample weights together, and so does
      `tfdist.training.assembly.build` at start.
    bytes_per_pack: all-reduce the gradients in packs of about this many
      bytes, last layers first (`_all_reduce_sum`); 0: in one.
    all_reduce_dtype: the dtype the gradients travel in between replicas
      (`tfdist.training.reduce_dtype.ALL_REDUCE_DTYPES`: float32, bfloat16,
      float16); the sums come back in the variables' dtype before
      clipping, the finite check and the update. A 2-byte dtype gives the
      step's sums (loss, count, metrics) a float32 all-reduce of their own.
      No effect with one replica (`self.all_reduce_dtype` is then
      float32).
    mode: the parallelism mode (`tfdist.parallel.mode.StepMode`) that runs
      each replica's forward and backward pass and evaluation batch (the
      trainer's one call for each); None: the mode `sharding`'s ZeRO stage
      chooses (`data`, or `zero3` at stage 3). The trainer is its
      `StepContext`: `losses`, `regularization_loss`, `scale_loss`,
      `model_forward_backward`, `eval_sums`, `empty_eval_sums` and the
      attributes the protocol names.

  The Trainer changes `model` and `optimizer` for its step (see the module
  docstring): the model's random layers draw per replica
  (`per_replica_random_streams`), and the optimizer's own all-reduce is off
  while the step is traced (`_sum_gradients_once`).

  Raises:
    ValueError: unknown `task`; `global_batch_size` < 1;
      `gradient_accumulation_steps` < 1; a `class_weight` key that is not
      an integer >= 0.
    tfdist.errors.ConfigError: a metric whose state is not summed; a loss
      with `reduction="mean_with_sample_weight"` and `class_weight`
      (`objectives.check_reduction`; with sample weights, when the step is
      traced); an unknown `all_reduce_dtype`, a 2-byte one under
      ParameterServerStrategy, or float16 without a `LossScaleOptimizer`
      (`tfdist.training.reduce_dtype`).
  """

  def __init__(self, *, strategy: tf.distribute.Strategy, model: keras.Model,
               optimizer: keras.optimizers.Optimizer, global_batch_size: int,
               steps_per_execution: int = 1, enable_xla: bool = False,
               run_eagerly: bool = False, task: str = "multiclass",
               eval_example_weights: bool = False, loss=None, metrics=None,
               gradient_accumulation_steps: int = 1,
               time_steps: bool = True,
               sharding: Optional[sharded_optimizer.ShardingOptions] = None,
               class_weight=None, bytes_per_pack: int = 0,
               all_reduce_dtype: str = reduce_dtype.FLOAT32,
               mode: Optional[mode_lib.StepMode] = None):
    self.strategy = strategy
    self.bytes_per_pack = int(bytes_per_pack)
    self.all_reduce_dtype = _checked_reduce_dtype(all_reduce_dtype, strategy,
                                                  optimizer)
    if strategy.num_replicas_in_sync == 1:
      # Nothing travels: rounding the gradients would buy nothing.
      self.all_reduce_dtype = reduce_dtype.FLOAT32
    self.time_steps = bool(time_steps)
    self.model = model
    self.optimizer = optimizer
    self.global_batch_size = int(global_batch_size)
    if self.global_batch_size <= 0:
      raise ValueError("global_batch_size must be > 0. Received: "
                       f"{global_batch_size}")
    self.one_replica = _one_replica(strategy)
    self.rides_with_gradients = _rides_with_gradients(strategy)
    self.steps_per_execution = int(steps_per_execution)
    self.eval_example_weights = bool(eval_example_weights)
    if loss is None:
      loss, default_metrics = objectives.task_defaults(task)
      metrics = default_metrics if metrics is None else metrics
    self.task = task
    self.class_weight = dict(class_weight) if class_weight else None
    self._class_weights = (class_weight_table(self.class_weight)
                           if self.class_weight else None)
    self.gradient_accumulation_steps = int(gradient_accumulation_steps)
    if self.gradient_accumulation_steps < 1:
      raise ValueError("gradient_accumulation_steps must be >= 1. Received: "
                       f"{gradient_accumulation_steps}")
    self._resolve_objectives(loss, metrics)
    self.uses_loss_scale = isinstance(optimizer,
                                      keras.optimizers.LossScaleOptimizer)
    per_replica_random_streams(model)
    self.sharded = self._make_sharded(sharding, mode)
    self._make_step_variables()
    # XLA compiles the per-replica forward and backward pass; Keras 3 turns
    # XLA off under a tf.distribute strategy, so tfdist applies it to its own
    # step. The gradients are applied outside the compiled function: the
    # optimizer's cross-replica all-reduce (a merge_call) and its variables
    # on other devices cannot be compiled into one replica's XLA cluster.
    self.xla_applied = bool(enable_xla) and not run_eagerly
    self._bind_mode(mode, sharding)
    self._replica_train = self._replica_train_step
    compile_fn = (lambda f: f) if run_eagerly else tf.function
    self.train_function = compile_fn(self._train_function)
    self.eval_function = compile_fn(self._eval_function)

  def _resolve_objectives(self, loss, metrics) -> None:
    """Sets `loss_fn`, `eval_loss_reduction` and `metric_sums` from the
    constructor's `loss` and `metrics` (the task's defaults filled in).

    Raises:
      tfdist.errors.ConfigError: as `objectives.resolve_loss`,
        `check_reduction` and `resolve_metric` raise it (an unknown or
        unusable loss or metric).
    """
    # Shapes unknown here: "accuracy" and "crossentropy" resolve for sparse
    # labels; tfdist.training.step.objectives.resolve knows the shapes
    # (tfdist.training.assembly).
    shapes = dict(y_true=tf.TensorShape([None]),
                  y_pred=tf.TensorShape([None, None]))
    self.loss_fn = objectives.resolve_loss(loss, **shapes)
    objectives.check_reduction(self.loss_fn,
                               weighted=bool(self.class_weight))
    # The reduction of the evaluation loss, known once `eval_function` is
    # traced (a loss returning one value per batch is averaged).
    self.eval_loss_reduction = objectives.fit_reduction(self.loss_fn)
    self.metric_sums = (metrics if isinstance(metrics, objectives.MetricSums)
                        else objectives.MetricSums([
                            objectives.resolve_metric(m, **shapes)
                            for m in metrics or ()]))

  def _make_sharded(self, sharding, mode):
    """The ZeRO optimizer of `sharding`'s stage (None: stage 0), as
    `mode` builds it (`StepMode.sharded_optimizer`; the stage's class on
    the model's trainable variables without a mode)."""
    if sharding is None or not sharding.enabled:
      return None
    stage_class = sharded_optimizer.optimizer_class(sharding)
    kwargs = dict(strategy=self.strategy, optimizer=self.optimizer,
                  variables=self.model.trainable_variables, options=sharding,
                  all_reduce_dtype=self.all_reduce_dtype, model=self.model)
    if mode is None:
      return stage_class(**kwargs)
    return mode.sharded_optimizer(stage_class, **kwargs)

  def _make_step_variables(self) -> None:
    """Creates `global_step` (and the gradient accumulators, with more than
    one micro-batch per update) in the strategy's scope."""
    with self.strategy.scope():
      # Counts updates made by this loop (skipped fp16 steps included), for
      # checkpoint numbering and resumption.
      self.global_step = tf.Variable(
          0, dtype=tf.int64, trainable=False, name="global_step",
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
      self._accumulators = (self._make_accumulators()
                            if self.gradient_accumulation_steps > 1 else None)

  def _bind_mode(self, mode: Optional[mode_lib.StepMode],
                 sharding: Optional[sharded_optimizer.ShardingOptions]
                 ) -> None:
    """Sets `mode` (None: the one `sharding`'s stage chooses) and binds it
    and the sharded optimizer to this trainer."""
    # The parallelism mode runs each replica's forward and backward pass
    # and evaluation batch (`tfdist.parallel.mode`); by default the one
    # `sharding`'s ZeRO stage chooses (`data`, or `zero3` at stage 3).
    if mode is None:
      mode = modes.get_mode(modes.mode_name_for(
          zero_stage=sharding.stage if sharding is not None else 0))()
    self.mode = mode
    if self.sharded is not None:  # Stage 3 shards the model's weights.
      self.sharded.attach(self)
    self.mode.bind(self)

  # --- replica functions -------------------------------------------------
  def losses(self, labels, outputs, weights=None):
    """`(objective, reported)`: one replica's share of the step's loss as
    `fit` reduces it (`tfdist.training.step.objectives.REDUCTIONS`), float32
    scalars, `model.losses` not included. `objective` is differentiated;
    summed over replicas (and micro-batches) it is one device's loss on the
    global batch, so the summed gradients are one device's. `reported`,
    summed likewise, is the loss `fit` reports for the batch. `weights`:
    the examples' training weights, float32 [batch], or None."""
    values, elements, reduction = objectives.loss_values(self.loss_fn,
                                                         labels, outputs)
    if weights is not None:
      if reduction == "mean_with_sample_weight":
        objectives.check_reduction(self.loss_fn, weighted=True)
      values = values * weights
    total = tf.reduce_sum(values)
    # `tf.nn.compute_average_loss`'s arithmetic, without its run-time
    # assertions on a batch size fixed (and checked) at construction.
    mean = tf.math.divide_no_nan(total, float(self.global_batch_size))
    if reduction == "sum":
      return total * elements, total * elements
    if reduction == "none":
      return total * elements, mean
    return mean, mean

  def regularization_loss(self) -> Optional[tf.Tensor]:
    """The sum of `model.losses` (weight and activity regularizers,
    `add_loss`) from the last forward pass, float32, or None: none."""
    if not self.model.losses:
      return None
    return tf.add_n([tf.cast(tf.reduce_sum(l), tf.float32)
                     for l in self.model.losses])

  def _metric_sums(self, labels, outputs, mask=None, sample_weight=None
                   ) -> Dict[str, tf.Tensor]:
    """Per-batch sums: `count` (examples) and every metric's state.
    `mask` (float32 [batch], 1 real / 0 padding) masks the padding of
    static-shape evaluation batches; `sample_weight` (float32 [batch])
    weighs the weighted metrics (`MetricSums.batch_sums`)."""
    count = (tf.reduce_sum(mask) if mask is not None else
             tf.cast(tf.shape(labels)[0], tf.float32))
    return {"count": count,
            **self.metric_sums.batch_sums(labels, outputs, mask,
                                          sample_weight)}

  def _training_weights(self, labels, weights):
    """The examples' training weights, float32 [batch]: `weights` (the
    batch's sample weights) or the class weights of `labels`, or None."""
    if self._class_weights is not None:
      return class_weights_of(self._class_weights, labels)
    return _as_weights(weights)

  def scale_loss(self, objective: tf.Tensor) -> tf.Tensor:
    """`objective` times the fp16 loss scale (as is without one)."""
    return (self.optimizer.scale_loss(objective) if self.uses_loss_scale
            else objective)

  def _replica_pass(self, inputs, labels, weights=None):
    """The step's one forward and backward pass: the mode's
    (`tfdist.parallel.mode.StepMode.forward_backward`)."""
    return self.mode.forward_backward(self, inputs, labels, weights)

  def model_forward_backward(self, inputs, labels, weights=None):
    """Loss, gradients and outputs of one replica's batch through the
    whole model (no update; the `data` mode's pass); `weights`: the
    examples' training weights, float32 [batch], or None."""
    with tf.GradientTape() as tape:
      outputs = tf.cast(self.model(inputs, training=True), tf.float32)
      objective, loss = self.losses(labels, outputs, weights)
      regularization = self.regularization_loss()
      if regularization is not None:
        # Once per update: each of the K micro-steps adds 1/K of it.
        regularization = tf.nn.scale_regularization_loss(
            regularization) / self.gradient_accumulation_steps
        objective += regularization
        loss += regularization
      scaled = self.scale_loss(objective)
    grads = tape.gradient(scaled, self.model.trainable_variables)
    return loss, grads, outputs

  def _replica_train_step(self, inputs, labels, stop_flags, weights=None):
    """One replica's step; returns its loss and metric sums, `skipped`
    (float32 scalar, 1.0 when the step was skipped for a non-finite fp16
    gradient; equal on every replica), and the host's stop requests
    `stop_flags` (float32 [2]), which ride with the step's sums (one
    reduction): any worker's request reaches every worker after the same
    step. `weights`: the batch's sample weights, float32 [batch], or
    None."""
    weights = self._training_weights(labels, weights)
    loss, grads, outputs = self._replica_pass(inputs, labels, weights)
    # Metrics outside the (optionally XLA-compiled) forward and backward.
    sums = {"loss": loss, **self._metric_sums(labels, outputs,
                                              sample_weight=weights)}
    return self._replica_apply(grads, sums, stop_flags)

  def _replica_apply(self, grads, sums, stop_flags, shard=None):
    """Steps 2-4 of the module docstring on one replica's gradients (of one
    batch, or accumulated over K micro-batches); returns `sums` with
    `skipped` and the stop requests added (those that rode in the
    gradients' all-reduce, already summed, under `_SUMMED`). Sharded
    (`self.sharded`): the gradients (or the reduced `shard` of stage 2)
    are reduced and sliced here, and `sums` also carries the shard's
    update, which `_train_step` applies in cross-replica context."""
    sums = {**sums, "stop_signal": stop_flags[0],
            "stop_training": stop_flags[1]}
    if self.sharded is not None:
      skipped, update = self.sharded.replica_prepare(grads, shard)
      return {**sums, "skipped": skipped, _SHARD_UPDATE: update}
    summed = {}
    # One replica: the sum is the gradients. A mode that does not
    # all-reduce them (tensor parallelism): each replica's are its own.
    if not self.one_replica and self.mode.all_reduces_gradients:
      grads, summed = _all_reduce_sum(grads, self.bytes_per_pack,
                                      self._riders(grads, sums),
                                      self.all_reduce_dtype)
      sums = {k: v for k, v in sums.items() if k not in summed}
    # The same summed gradients on every replica and worker: the finite
    # check (here and inside a LossScaleOptimizer) agrees everywhere.
    skipped = precision.step_skipped(self.optimizer, grads)
    self.optimizer.apply(grads, self.model.trainable_variables)
    return {**sums, "skipped": skipped, _SUMMED: summed}

  def _riders(self, grads, sums):
    """The `sums` that ride with the gradients' all-reduce
    (`_all_reduce_sum`): under `_rides_with_gradients` strategies, those
    of the dense gradients' dtype (float32 unless the variables are not);
    the others keep `_reduce`. `{}`: none ride, and none can when the
    gradients travel in a 2-byte `all_reduce_dtype` (the sums stay
    float32)."""
    if (not self.rides_with_gradients or
        reduce_dtype.compresses(self.all_reduce_dtype)):
      return {}
    dense = {g.dtype for g in grads
             if g is not None and not isinstance(g, tf.IndexedSlices)}
    dtype = dense.pop() if len(dense) == 1 else (
        tf.float32 if not dense else None)
    return {k: v for k, v in sums.items() if v.dtype == dtype}

  # --- gradient accumulation (K > 1) ----------------------------------------
  def _shards_gradients(self) -> bool:
    """ZeRO stage 2: the gradient accumulators are per-replica shards."""
    return self.sharded is not None and self.sharded.options.stage >= 2

  def _make_accumulators(self):
    """Per-replica zero buffers: one per trainable variable (its shape and
    dtype), one for the loss and one per metric sum. Sync-on-read: each
    replica adds to its own copy. Not tracked by the checkpoint (always zero
    between updates, where checkpoints land)."""
    def zeros(shape, dtype, name):
      return tf.Variable(tf.zeros(shape, dtype), trainable=False, name=name,
                         synchronization=tf.VariableSynchronization.ON_READ,
                         aggregation=tf.VariableAggregation.SUM)
    if self._shards_gradients():  # One shard per replica instead.
      self.sharded.make_gradient_accumulator()
      grads = []
    else:
      grads = [zeros(v.shape, v.dtype, "grad_accumulator")
               for v in self.model.trainable_variables]
    sums = {"loss": zeros([], tf.float32, "loss_accumulator"),
            "count": zeros([], tf.float32, "count_accumulator")}
    for key, value in self.metric_sums.zeros().items():
      sums[key] = zeros(value.shape, value.dtype, "metric_accumulator")
    return grads, sums

  def _replica_accumulate(self, inputs, labels, weights=None):
    """One micro-step of one replica: adds its micro-batch's gradients (the
    loss scaled by the fp16 loss scale, if any, which stays fixed within an
    update), loss and metric sums to its accumulators. No all-reduce."""
    weights = self._training_weights(labels, weights)
    loss, grads, outputs = self._replica_pass(inputs, labels, weights)
    sums = {"loss": loss, **self._metric_sums(labels, outputs,
                                              sample_weight=weights)}
    grad_accumulators, sum_accumulators = self._accumulators
    if self._shards_gradients():
      self.sharded.replica_accumulate(grads)
    for accumulator, grad in zip(grad_accumulators, grads):
      if grad is not None:  # IndexedSlices are added densely.
        accumulator.assign_add(tf.convert_to_tensor(grad))
    for key, value in sums.items():
      sum_accumulators[key].assign_add(value)

  def _replica_apply_accumulated(self, stop_flags):
    """`_replica_apply` on the accumulated gradients and sums (over the K
    micro-batches); then zeroes the accumulators."""
    grad_accumulators, sum_accumulators = self._accumulators
    grads = [a.read_value() for a in grad_accumulators]
    sums = {k: a.read_value() for k, a in sum_accumulators.items()}
    shard = (self.sharded.replica_take_accumulated()
             if self._shards_gradients() else None)
    out = self._replica_apply(grads or None, sums, stop_flags, shard)
    for accumulator in grad_accumulators + list(sum_accumulators.values()):
      accumulator.assign(tf.zeros_like(accumulator.read_value()))
    return out

  def _replica_eval_step(self, inputs, labels, weights=None, mask=None):
    """One replica's evaluation sums: the mode's
    (`tfdist.parallel.mode.StepMode.eval_sums`)."""
    return self.mode.eval_sums(self, inputs, labels, weights, mask)

  def empty_eval_sums(self) -> Dict[str, tf.Tensor]:
    """`eval_sums` of an empty batch: zeros."""
    return {"loss_sum": tf.constant(0.0),
            "regularization_sum": tf.constant(0.0),
            "count": tf.constant(0.0), **self.metric_sums.zeros()}

  def eval_sums(self, inputs, labels, weights=None, mask=None,
                         outputs=None):
    """Summed loss, count and metric state of one replica's evaluation
    batch; `weights`: sample weights, `mask`: 1 real / 0 padding (float32
    [batch] each, or None). `loss_sum`: the loss's weighted values summed
    (times the values per example under `"sum"`); `regularization_sum`:
    the sum of `model.losses` times the batch's examples (`Model.evaluate`
    adds them to each batch's loss, and averages batches by size).
    `outputs`: the model's outputs on `inputs` when already computed."""
    if outputs is None:
      outputs = tf.cast(self.model(inputs, training=False), tf.float32)
    weights = _as_weights(weights)
    loss_weights = (weights if mask is None else mask if weights is None
                    else weights * mask)
    values, elements, reduction = objectives.loss_values(self.loss_fn,
                                                         labels, outputs)
    if loss_weights is not None:
      values = values * loss_weights
    self.eval_loss_reduction = reduction
    sums = self._metric_sums(labels, outputs, mask, weights)
    regularization = self.regularization_loss()
    return {"loss_sum": tf.reduce_sum(values) * (
        elements if reduction == "sum" else 1.0),
            "regularization_sum": (tf.constant(0.0) if regularization is None
                                   else regularization * sums["count"]),
            **sums}

  # --- cross-replica functions -------------------------------------------
  def _reduce(self, per_replica: Dict[str, tf.Tensor]) -> Dict[str, tf.Tensor]:
    """Sums per-replica values (scalars, metric states of any shape) over
    every replica of every worker in one all-reduce per dtype (one for the
    usual float32 sums): each replica packs the values of a dtype into one
    vector (keys in sorted order), the vectors are summed, and the sum is
    split and reshaped again; every value keeps its dtype. Under
    MultiWorkerMirroredStrategy each all-reduce is a collective of its own
    with a fixed cost (a gRPC round trip, and a thread held for the
    collective's timeout), so one per step instead of one per key. With
    one replica in all (`one_replica`) the values are the sums: returned as
    they are, with no packing."""
    if self.one_replica:
      return {k: self.strategy.experimental_local_results(v)[0]
              for k, v in per_replica.items()}
    first = {k: self.strategy.experimental_local_results(v)[0]
             for k, v in per_replica.items()}
    groups: Dict[tf.DType, list] = {}
    for k in sorted(per_replica):
      groups.setdefault(first[k].dtype, []).append(k)
    out = {}
    for keys in groups.values():
      shapes = [first[k].shape for k in keys]

      def pack(values, keys=keys):
        return tf.concat([tf.reshape(values[k], [-1]) for k in keys], axis=0)

      total = self.strategy.reduce(
          tf.distribute.ReduceOp.SUM,
          self.strategy.run(pack, args=({k: per_replica[k] for k in keys},)),
          axis=None)
      sizes = [shape.num_elements() for shape in shapes]
      out.update({k: tf.reshape(part, shape) for k, part, shape in
                  zip(keys, tf.split(total, sizes), shapes)})
    return out

  def _next(self, iterator):
    """`_timed_next`, or (`time_steps` False: op determinism forbids
    `tf.timestamp`) the batch and a NaN wait: not measured."""
    if self.time_steps:
      return _timed_next(iterator)
    return next(iterator), tf.constant(float("nan"), tf.float64)

  def _train_step(self, iterator, stop_flags):
    """One update from `iterator` (K = `gradient_accumulation_steps`
    batches): its sums, reduced over every replica, with `micro_steps` (K),
    and the seconds it waited for its input (float64 scalar, this worker's
    own, summed over the K batches: `_timed_next`)."""
    accumulate = self.gradient_accumulation_steps
    with _sum_gradients_once(self.optimizer):
      if accumulate == 1:
        batch, waited = self._next(iterator)
        per_replica = self.strategy.run(
            self._replica_train, args=(*batch[:2], stop_flags, *batch[2:3]))
      else:
        waited = tf.constant(0.0, tf.float64)
        for _ in tf.range(accumulate):
          batch, micro_waited = self._next(iterator)
          waited += micro_waited
          self.strategy.run(self._replica_accumulate, args=tuple(batch[:3]))
        per_replica = self.strategy.run(self._replica_apply_accumulated,
                                        args=(stop_flags,))
    if self.sharded is not None:
      self.sharded.apply(per_replica.pop(_SHARD_UPDATE))
    # Equal on every replica: read the first local one (no all-reduce).
    skipped = self.strategy.experimental_local_results(
        per_replica.pop("skipped"))[0]
    summed = per_replica.pop(_SUMMED, {})
    step = self._reduce(per_replica)
    step.update({k: self.strategy.experimental_local_results(v)[0]
                 for k, v in summed.items()})
    step["skipped_steps"] = skipped
    step["micro_steps"] = tf.constant(float(accumulate))
    return step, waited

  def _train_function(self, iterator, num_steps,
                      stop_flags=None) -> Dict[str, tf.Tensor]:
    """Runs `num_steps` steps from a distributed iterator.

    Args:
      iterator: an iterator over a distributed dataset of `(inputs, labels)`.
      num_steps: int32 scalar tensor, at most `steps_per_execution` (a tensor
        so that shorter final chunks do not retrace the function).
      stop_flags: float32 [2], this worker's requests to stop: `[a stop
        signal arrived, a callback set model.stop_training]` (0 or 1 each);
        None: no requests.

    Returns:
      Sums over the executed steps: `loss` (sum of per-step global mean
      losses), `count` (examples), every metric's state
      (`tfdist.training.step.objectives.MetricSums`; `summarize` turns them into
      values), `skipped_steps` (steps whose update was skipped: fp16 gradients
      not finite; the same on every worker), `micro_steps` (micro-batches run:
      `num_steps` x `gradient_accumulation_steps`),
      `skipped_steps_at_end` (how many
      of the last steps in a row were skipped: equal to `num_steps` when
      every step was), and `stop_signal` and `stop_training` (> 0 when any
      worker, in any step of the chunk, asked to stop: every worker gets
      the same sums; `tfdist.training.step.step_runner.StepSignals.split` takes
      these four out of the metric sums). Also this worker's own timings
      (float64 seconds, not reduced across workers): `input_wait_seconds`, the
      time spent waiting for the input iterator, and `execution_seconds`, the
      call's time from its first to its last op.
    """
    if self.time_steps:
      started = tf.timestamp()
      input_wait = started - started  # 0.0, after `started` ran.
    else:
      input_wait = tf.constant(0.0, tf.float64)
    if stop_flags is None:
      stop_flags = tf.zeros([2], tf.float32)
    if self.steps_per_execution == 1:
      # One step, no loop (as Keras's fit runs steps_per_execution=1).
      totals, input_wait = self._train_step(iterator, stop_flags)
      totals["skipped_steps_at_end"] = totals["skipped_steps"]
      num_steps = 1
    else:
      totals = {"loss": tf.constant(0.0), "count": tf.constant(0.0),
                "skipped_steps": tf.constant(0.0),
                "micro_steps": tf.constant(0.0),
                "stop_signal": tf.constant(0.0),
                "stop_training": tf.constant(0.0),
                **self.metric_sums.zeros()}
      skipped_at_end = tf.constant(0.0)
      for _ in tf.range(num_steps):
        step, waited = self._train_step(iterator, stop_flags)
        input_wait += waited
        totals = {k: totals[k] + step[k] for k in totals}
        skipped_at_end = (skipped_at_end + 1.0) * step["skipped_steps"]
      totals["skipped_steps_at_end"] = skipped_at_end
    # Counted once per call, after the steps: a call that fails part-way
    # (a parameter-server worker lost mid-closure, then rerun elsewhere)
    # adds nothing.
    self.global_step.assign_add(tf.cast(num_steps, tf.int64))
    totals["input_wait_seconds"] = input_wait
    if self.time_steps:
      with tf.control_dependencies(tf.nest.flatten(totals)):
        totals["execution_seconds"] = tf.timestamp() - started
    else:
      totals["execution_seconds"] = tf.constant(float("nan"), tf.float64)
    return totals

  def _eval_function(self, batch) -> Dict[str, tf.Tensor]:
    """Evaluates one distributed batch; returns summed loss, count and
    metric state.

    The batch is `(inputs, labels)` or `(inputs, labels, sample_weights)`,
    and with `eval_example_weights` one more last element, the padding
    mask float32 [batch] (0 for padding).
    """
    batch = tuple(batch)
    if self.eval_example_weights:
      args = (*batch[:2], batch[2] if len(batch) > 3 else None, batch[-1])
    else:
      args = batch[:3]
    return self._reduce(self.strategy.run(self._replica_eval_step,
                                          args=args))

  def summarize(self, sums: Dict[str, np.ndarray], steps: int) -> dict:
    """Mean training loss and metric values from `train_function` sums
    added over `steps` steps (the controller's log points and epochs)."""
    return {"loss": float(sums.get("loss", 0.0)) / max(steps, 1),
            **self.metric_sums.results(sums)}

  def evaluate(self, dist_dataset, *,
               on_batch_begin: Optional[Callable[[int], None]] = None,
               on_batch_end: Optional[Callable[[int, dict], None]] = None
               ) -> Dict[str, float]:
    """Evaluates every example of `dist_dataset` exactly once.

    Args:
      dist_dataset: the distributed evaluation dataset.
      on_batch_begin: called with each batch's index (0-based) before it
        is evaluated (Keras's `on_test_batch_begin`), or None.
      on_batch_end: called with each batch's index and the loss and metrics
        over the batches so far (Keras's `on_test_batch_end` logs), or None.

    Returns:
      `{"loss": the loss as `Model.evaluate` reports it (the mean per
      example, or under `reduction="sum"` the batches' sums averaged by
      batch size; plus `model.losses`), <metric name>: value, ...,
      "num_examples": n}`.
    """
    sums = {}
    evaluate_batch = self._eval_function_of(dist_dataset)
    for index, batch in enumerate(dist_dataset):
      if on_batch_begin is not None:
        on_batch_begin(index)
      out = evaluate_batch(tuple(batch))
      if self.eval_loss_reduction == "sum":
        # `Model.evaluate` averages each batch's sum, weighted by the
        # batch's size.
        out = {**out, "loss_sum": np.asarray(out["loss_sum"]) *
               np.asarray(out["count"])}
      for k, v in out.items():
        sums[k] = sums.get(k, 0.0) + np.asarray(v, np.float64)
      if on_batch_end is not None:
        on_batch_end(index, self._eval_results(sums))
    return {**self._eval_results(sums),
            "num_examples": int(sums.get("count", 0.0))}

  def _eval_function_of(self, dist_dataset):
    """`eval_function` traced once for `dist_dataset`'s batches: with its
    element spec (batch dimension None) as the input signature, where a
    batch's own shapes would retrace it for a partial last batch (about a
    third of a short evaluation's time on a CPU: the tests' Transformer
    on 38 examples). Eager (`run_eagerly`), or without an element spec:
    `eval_function` itself."""
    spec = getattr(dist_dataset, "element_spec", None)
    if spec is None or not isinstance(self.eval_function,
                                      tf.types.experimental.PolymorphicFunction):
      return self.eval_function
    key = repr(spec)
    cache = self.__dict__.setdefault("_eval_functions", {})
    if key not in cache:
      cache[key] = tf.function(self._eval_function,
                               input_signature=[tuple(spec)])
    return cache[key]

  def _eval_results(self, sums: Dict[str, np.ndarray]) -> Dict[str, float]:
    """The loss per example and the metrics of summed evaluation state."""
    n = max(float(sums.get("count", 0.0)), 1.0)
    return {"loss": (float(sums.get("loss_sum", 0.0)) +
                     float(sums.get("regularization_sum", 0.0))) / n,
            **self.metric_sums.results(sums)}
