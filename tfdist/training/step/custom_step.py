"""A model's own `train_step` and `test_step`, run as Keras's `fit` runs them.

Keras documents overriding `train_step` (and `test_step`, `compute_loss`,
`compute_metrics`) as the way to customize `Model.fit` ("Customizing what
happens in fit()"): GANs with two optimizers, frozen variables, a loss
computed inside the step. tfdist's own step (`tfdist.training.step.train_loop`)
computes the compiled loss itself, so for such a model it would train
another model than the user wrote. Instead, where a model's class overrides
one of `HOOKS` (`overrides`), tfdist runs the model's own step per replica,
as Keras's TensorFlow trainer does (`keras/src/backend/tensorflow/
trainer.py`):

* training: `strategy.run(model.train_step, args=(batch,))` on each batch
  of tfdist's input pipeline (the global batch split over the replicas),
  with tfdist's optimizer (built from the flags, the learning rate scaled
  to the batch) as `model.optimizer`: Keras's `train_step` scales the loss
  by 1/replicas and its optimizer sums the gradients over replicas, and a
  step of the user's does whatever it does under `fit`;
* evaluation: `strategy.run(model.test_step, args=(batch,))` on each
  evaluation batch (a replica the last batch leaves without examples keeps
  its metric state and counts for nothing in the logs' reduction, where
  Keras's `test_step` would add a NaN mean);
* the step's returned logs are reduced as `fit` reduces them: the mean over
  replicas (Keras's `reduce_per_replica(..., "auto")` off TPUs; an
  all-reduce inside the replica function, so that it spans the workers of
  MultiWorkerMirrored too, where Keras's own `fit` fails), and, as
  `fit`'s `_get_metrics_result_or_logs`, replaced by the model's metrics
  read over every replica (`model.get_metrics_result()` in cross-replica
  context) when their names are the logs' names. The model's metrics are
  reset at each epoch's start and before each evaluation, as `fit` and
  `evaluate` reset them.

Everything around the step stays tfdist's: input pipeline and sharding,
global batch and learning-rate scaling, checkpoints (the model, with any
optimizer it owns, and tfdist's optimizer), resumption, callbacks, the run
log and the manifest. What only tfdist's own step can do is refused at
start (`check`), naming the override and the flag: gradient accumulation,
ZeRO sharding, tfdist's gradient clipping flags, XLA, class weights,
`tfdist.fit(loss=..., metrics=...)`, parameter servers and TPUs. Under
`--dtype=fp16` an overridden `train_step` is warned to scale its loss
(`self.optimizer.scale_loss`), as Keras's own does. The step's input wait
and execution time are not measured (the run log leaves them out).
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfdist import config as config_lib
from tfdist import errors
from tfdist.errors import first_line

# The `keras.Model` methods whose override makes tfdist run the model's
# own step.
HOOKS = ("train_step", "test_step", "compute_loss", "compute_metrics")

# Keys of the compiled functions' outputs that carry the step's logs and
# the model's metrics (taken out before the sums reach the controller).
_LOGS = "custom_step_logs/"
_METRICS = "custom_step_metrics/"
_COUNT = "custom_step_examples"


def overrides(model: keras.Model) -> Tuple[str, ...]:
  """`("Class.train_step", ...)`: the `HOOKS` that `model`'s class defines
  otherwise than `keras.Model` (the Keras TensorFlow trainer's methods);
  empty for `Sequential`, functional and plain subclassed models."""
  cls = type(model)
  return tuple(f"{cls.__name__}.{name}" for name in HOOKS
               if getattr(cls, name, None) is not getattr(keras.Model, name))


def check(found: Sequence[str], *, model_name: str, compiled: bool,
          gradient_accumulation_steps: int = 1, zero_stage: int = 0,
          clipnorm: Optional[float] = None,
          global_clipnorm: Optional[float] = None, enable_xla: bool = False,
          class_weight: Sequence[Tuple[int, float]] = (),
          loss_or_metrics_given: bool = False,
          strategy: Optional[tf.distribute.Strategy] = None,
          on_tpu: bool = False, loss_scaled: bool = False) -> None:
  """Refuses what cannot run with a model's own step (`found`: `overrides`).

  Args:
    found: the overridden methods, e.g. `("Gan.train_step",)`; empty: no
      check (tfdist's own step runs).
    model_name: how the model is named (`--model=...`).
    compiled: the model was compiled (`model.compiled`).
    gradient_accumulation_steps, zero_stage, clipnorm, global_clipnorm,
      enable_xla, class_weight: the run's settings of those flags.
    loss_or_metrics_given: `tfdist.fit` was given `loss=` or `metrics=`.
    strategy: the run's strategy (parameter servers are refused).
    on_tpu: the strategy is TPU (refused).
    loss_scaled: the optimizer is a `LossScaleOptimizer` (`--dtype=fp16`):
      an overridden `train_step` is warned that it must scale its loss.

  Raises:
    ConfigError: the first setting that needs tfdist's own step, naming
      the override, the flag and the fix.
  """
  if not found:
    return
  refusals = _refusals(
      compiled=compiled,
      gradient_accumulation_steps=gradient_accumulation_steps,
      zero_stage=zero_stage, clipnorm=clipnorm,
      global_clipnorm=global_clipnorm, enable_xla=enable_xla,
      class_weight=class_weight,
      loss_or_metrics_given=loss_or_metrics_given, strategy=strategy,
      on_tpu=on_tpu)
  for refused, flag, why, fix in refusals:
    if refused:
      raise errors.ConfigError(
          f"--model={model_name} overrides {', '.join(found)}, so tfdist "
          f"runs the model's own step as Keras's Model.fit does; {flag} "
          f"cannot go with it: {why}. Fix: {fix}.")
  steps = [name for name in found if name.endswith(".train_step")]
  if loss_scaled and steps:
    logging.warning(
        "--model=%s overrides %s under --dtype=fp16: its optimizer is a "
        "LossScaleOptimizer, which divides the gradients by the loss scale "
        "(32768 at first). As in Keras's fit, the step must take the "
        "gradients of self.optimizer.scale_loss(loss), as Keras's own "
        "train_step does; otherwise every update is that many times too "
        "small.", model_name, steps[0])


def _refusals(*, compiled: bool, gradient_accumulation_steps: int,
              zero_stage: int, clipnorm: Optional[float],
              global_clipnorm: Optional[float], enable_xla: bool,
              class_weight: Sequence[Tuple[int, float]],
              loss_or_metrics_given: bool,
              strategy: Optional[tf.distribute.Strategy],
              on_tpu: bool) -> List[Tuple[bool, str, str, str]]:
  """`check`'s refusals, in the order checked: `(refused, the flag or
  setting, why it needs tfdist's own step, the fix)` each."""
  return [
      (not compiled, "a model that is not compiled",
       "Keras's fit refuses a model that was not compiled, and its "
       "train_step and test_step read compile's loss and metrics",
       "call model.compile(...) in the builder (tfdist's --optimizer "
       "replaces compile's optimizer)"),
      (gradient_accumulation_steps > 1,
       f"--gradient_accumulation_steps={gradient_accumulation_steps}",
       "tfdist accumulates gradients inside its own step, and the model's "
       "train_step applies its gradients itself",
       "drop the flag (or accumulate inside train_step)"),
      (zero_stage > 0,
       f"--zero_stage={zero_stage} "
       f"(--{config_lib.SHARDING_SWITCHES[min(zero_stage, 3) - 1]})",
       "ZeRO shards the optimizer update of tfdist's own step, and the "
       "model's train_step calls its optimizer itself",
       "drop the flag"),
      (clipnorm is not None or global_clipnorm is not None,
       "--clipnorm" if clipnorm is not None else "--global_clipnorm",
       "tfdist clips the gradient summed over replicas inside its own "
       "step; inside the model's train_step the optimizer would clip each "
       "replica's share before the sum (tensorflow/tensorflow#25806)",
       "drop the flag and clip inside train_step"),
      (enable_xla, "--enable_xla",
       "tfdist compiles its own forward and backward pass with XLA; "
       "Keras's fit runs a step under tf.distribute without XLA",
       "drop the flag"),
      (bool(class_weight), "--class_weight",
       "tfdist weighs the loss of its own step by class; the model's step "
       "computes its loss itself",
       "give each example its weight in the data, as (x, y, sample_weight)"
       ", which train_step receives"),
      (loss_or_metrics_given, "tfdist.fit(loss=..., metrics=...)",
       "those replace the compiled loss and metrics in tfdist's own step; "
       "the model's step reads its own compile",
       "pass them to model.compile(...) in the builder"),
      (isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy),
       "--distribution_strategy=parameter_server",
       "the coordinator schedules tfdist's own step, and Keras 3's fit does "
       "not run under parameter servers (keras-team/keras#18624)",
       "use --distribution_strategy=mirrored or multi_worker_mirrored"),
      (on_tpu, "--distribution_strategy=tpu",
       "tfdist pads TPU evaluation batches with a mask that the model's "
       "test_step does not read",
       "use --distribution_strategy=mirrored or multi_worker_mirrored"),
  ]


def _all_replicas(fn: Callable, reduce_op=tf.distribute.ReduceOp.MEAN
                  ) -> Callable:
  """`fn` (a replica function returning a structure of values) followed by
  an all-reduce of each floating-point value over every replica of every
  worker (`reduce_op`, Keras's `reduce_per_replica(..., "mean")` for the
  logs); other values keep the replica's own. Every replica then returns
  the same values (read the first local one). In the replica function, not
  after `strategy.run`: under MultiWorkerMirrored with one replica per
  worker `strategy.run` returns plain tensors, which `strategy.reduce`
  would take as equal on every worker and not reduce."""

  def replica_fn(*args):
    values = tf.nest.map_structure(tf.convert_to_tensor, fn(*args))
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
      return values
    return tf.nest.map_structure(
        lambda v: context.all_reduce(reduce_op, v) if v.dtype.is_floating
        else v, values)
  return replica_fn


def _batch_examples(batch) -> tf.Tensor:
  """The examples in a replica's batch `(x, ...)`: int32 scalar."""
  return tf.shape(tf.nest.flatten(batch[0])[0])[0]


def _test_skipping_empty(model: keras.Model) -> Callable:
  """`model.test_step` for one replica's evaluation batch, counted by its
  examples: `(logs, examples of every replica)`.

  The last evaluation batch leaves replicas without examples when it does
  not fill them all (tfdist's input pipeline batches per replica); Keras's
  `test_step` on an empty batch adds a NaN mean to the loss tracker (NaN
  x 0 examples). On such a replica the model's metric state is put back
  as it was before the step, and each floating log is the mean over the
  replicas (Keras's `reduce_per_replica(..., "mean")`) of those that had
  examples or whose value is finite (a metric's result over the replica's
  earlier batches counts; an empty batch's NaN mean does not)."""

  def replica_fn(batch):
    examples = _batch_examples(batch)
    empty = tf.equal(examples, 0)
    state = list(model.metrics_variables)
    before = [tf.identity(v) for v in state]
    logs = tf.nest.map_structure(tf.convert_to_tensor,
                                 model.test_step(batch))
    for variable, value in zip(state, before):
      variable.assign(tf.where(empty, value, variable))
    count = tf.cast(examples, tf.float32)
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
      return logs, count
    total = context.all_reduce(tf.distribute.ReduceOp.SUM, count)

    def mean_over_kept(value):
      if not value.dtype.is_floating:
        return value
      keep = tf.logical_or(tf.logical_not(empty), tf.reduce_all(
          tf.math.is_finite(value)))
      kept = tf.cast(keep, value.dtype)
      summed = context.all_reduce(
          tf.distribute.ReduceOp.SUM,
          tf.where(keep, value, tf.zeros_like(value)))
      return summed / tf.maximum(
          context.all_reduce(tf.distribute.ReduceOp.SUM, kept),
          tf.ones_like(kept))
    return tf.nest.map_structure(mean_over_kept, logs), total
  return replica_fn


def _flat(prefix: str, logs) -> Dict[str, tf.Tensor]:
  """`logs` (a dict, possibly nested as Keras's metric results are) as
  `{prefix + name: tensor}`; anything else under `prefix + "output"`."""
  if not isinstance(logs, dict):
    return {f"{prefix}output": tf.convert_to_tensor(logs)}
  out = {}
  for key, value in logs.items():
    if isinstance(value, dict):
      out.update(_flat(prefix, value))
    else:
      out[f"{prefix}{key}"] = tf.convert_to_tensor(value)
  return out


def _take(prefix: str, values: Dict[str, Any]) -> Dict[str, float]:
  """The entries under `prefix`, removed from `values`, as floats (the mean
  of a vector, as tfdist reports vector-valued metrics)."""
  keys = [k for k in values if k.startswith(prefix)]
  return {k[len(prefix):]: float(np.mean(np.asarray(values.pop(k))))
          for k in keys}


def _as_logs(logs: Dict[str, float], metrics: Dict[str, float]
             ) -> Dict[str, float]:
  """Keras's `_get_metrics_result_or_logs`: the model's metrics when their
  names are the step's logs' names, else the step's logs."""
  return dict(metrics) if set(logs) == set(metrics) else dict(logs)


class CustomStepTrainer:
  """Runs a model's own `train_step` and `test_step` (module docstring).

  It offers what `tfdist.training.step.step_runner.LocalStepRunner`, the
  controller and the run log use of a `tfdist.training.step.train_loop.Trainer`:
  `train_function`, `summarize`, `evaluate`, `global_step`, `strategy`,
  `steps_per_execution`.

  Args:
    strategy: the run's strategy (one device, Mirrored or
      MultiWorkerMirrored); `model` was built in its scope.
    model: the Keras model, compiled, with `model.optimizer` set.
    steps_per_epoch: training steps per epoch (the model's metrics are
      reset before the first step of each, as `fit` resets them).
    steps_per_execution: training steps run inside one `tf.function` call.
    run_eagerly: run without `tf.function` (debugging).
  """

  gradient_accumulation_steps = 1
  sharded = None

  def __init__(self, *, strategy: tf.distribute.Strategy, model: keras.Model,
               steps_per_epoch: int, steps_per_execution: int = 1,
               run_eagerly: bool = False):
    self.strategy = strategy
    self.model = model
    self.optimizer = model.optimizer
    self.steps_per_epoch = max(int(steps_per_epoch), 1)
    self.steps_per_execution = max(int(steps_per_execution), 1)
    self.one_replica = strategy.num_replicas_in_sync == 1
    with strategy.scope():
      # Counts the steps run by this loop, for checkpoint numbering and
      # resumption (as tfdist's own Trainer's).
      self.global_step = tf.Variable(
          0, dtype=tf.int64, trainable=False, name="global_step",
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    # Keras runs the model's step unconverted by AutoGraph
    # (`do_not_convert`): so does tfdist, so a step traces as under fit.
    compile_fn = ((lambda f: f) if run_eagerly
                  else lambda f: tf.function(f, autograph=False))
    self._train = compile_fn(self._train_function)
    self._test = compile_fn(self._eval_function)
    self._next_step: Optional[int] = None
    self._logs: Dict[str, float] = {}

  # --- compiled functions --------------------------------------------------
  def _train_once(self, iterator) -> Dict[str, tf.Tensor]:
    """One `model.train_step` on every replica; its logs, mean over
    replicas."""
    outputs = self.strategy.run(_all_replicas(self.model.train_step),
                                args=(next(iterator),))
    return self._first(outputs)

  def _first(self, values):
    """The first local replica's values (equal on every replica)."""
    return tf.nest.map_structure(
        lambda v: self.strategy.experimental_local_results(v)[0], values)

  def _metric_results(self, prefix: str) -> Dict[str, tf.Tensor]:
    """The model's metrics over every replica (cross-replica context: their
    sync-on-read state is summed)."""
    return _flat(prefix, self.model.get_metrics_result())

  def _train_function(self, iterator, num_steps, stop_flags):
    logs = _flat(_LOGS, self._train_once(iterator))
    # The sum of the steps' logged losses: what tfdist's divergence check
    # and plain batch logs read (`sums["loss"]`).
    loss = {"loss": tf.cast(logs[_LOGS + "loss"], tf.float32)
            } if _LOGS + "loss" in logs else {}
    if self.steps_per_execution > 1:
      def body(i, _, loss):
        logs = _flat(_LOGS, self._train_once(iterator))
        return i + 1, logs, {k: v + tf.cast(logs[_LOGS + k], tf.float32)
                             for k, v in loss.items()}
      _, logs, loss = tf.while_loop(lambda i, *_: i < num_steps, body,
                                    (tf.constant(1), logs, loss))
    out = {**logs, **loss, **self._metric_results(_METRICS)}
    if not self.one_replica:
      # Every worker's stop requests reach every worker after this call.
      stop_flags = self._first(self.strategy.run(_all_replicas(
          tf.identity, tf.distribute.ReduceOp.SUM), args=(stop_flags,)))
    self.global_step.assign_add(tf.cast(num_steps, tf.int64))
    return {**out, "stop_signal": stop_flags[0],
            "stop_training": stop_flags[1]}

  def _eval_function(self, batch):
    logs, count = self._first(self.strategy.run(
        _test_skipping_empty(self.model), args=(batch,)))
    return {**_flat(_LOGS, logs), **self._metric_results(_METRICS),
            _COUNT: count}

  # --- what the step runner and controller call ---------------------------
  def train_function(self, iterator, num_steps, stop_flags=None
                     ) -> Dict[str, tf.Tensor]:
    """Runs `num_steps` (int32 scalar tensor, at most
    `steps_per_execution`) steps of the model's `train_step` from a
    distributed iterator of tfdist's batches (`(x, y)` or `(x, y,
    sample_weight)`), resetting the model's metrics first at an epoch's
    start.

    Args:
      iterator: the distributed training iterator.
      num_steps: int32 scalar tensor.
      stop_flags: float32 [2], this worker's stop requests (see
        `Trainer.train_function`); None: none.

    Returns:
      `stop_signal` and `stop_training` (> 0 when any worker asked), and
      `loss`, the sum of the steps' logged `loss` when the step logs one;
      the logs themselves are kept for `summarize`.
    """
    if self._next_step is None:
      self._next_step = int(self.global_step.numpy())
    if self._next_step % self.steps_per_epoch == 0:
      self.model.reset_metrics()
    if stop_flags is None:
      stop_flags = tf.zeros([2], tf.float32)
    out = dict(self._train(iterator, num_steps, stop_flags))
    logs, metrics = _take(_LOGS, out), _take(_METRICS, out)
    self._logs = _as_logs(logs, metrics)
    self._next_step += int(num_steps)
    return out

  def summarize(self, sums: Dict[str, np.ndarray], steps: int) -> dict:
    """The logs `fit` reports after the last step run: the model's step's
    (see the module docstring), whatever `sums` and `steps` hold."""
    del sums, steps  # The logs are those of the last step, not sums.
    return dict(self._logs)

  def evaluate(self, dist_dataset, *,
               on_batch_begin: Optional[Callable[[int], None]] = None,
               on_batch_end: Optional[Callable[[int, dict], None]] = None
               ) -> Dict[str, float]:
    """Runs the model's `test_step` on every batch of `dist_dataset` after
    resetting its metrics, as `Model.evaluate` does.

    Returns:
      The logs `evaluate` returns (the model's metrics, or the last
      step's logs when their names differ), floats, with `num_examples`.
    """
    self.model.reset_metrics()
    logs, count = {}, 0.0
    for index, batch in enumerate(dist_dataset):
      if on_batch_begin is not None:
        on_batch_begin(index)
      out = dict(self._test(batch))
      count += float(out.pop(_COUNT))
      logs = _as_logs(_take(_LOGS, out), _take(_METRICS, out))
      if on_batch_end is not None:
        on_batch_end(index, dict(logs))
    return {**logs, "num_examples": int(count)}


def build_trainer(model: keras.Model, found: Sequence[str], *,
                  strategy: tf.distribute.Strategy, batch_spec: tuple,
                  steps_per_epoch: int = 1, steps_per_execution: int = 1,
                  run_eagerly: bool = False) -> CustomStepTrainer:
  """The `CustomStepTrainer` of `model` (whose class overrides `found`),
  after building its compiled metrics and loss in `strategy`'s scope as
  `fit` builds them before its first step (`Model._symbolic_build`), so
  their variables are not first created inside a replica's step.

  Args:
    batch_spec: `tf.TensorSpec`s of one unbatched example, `(features,
      labels)` or `(features, labels, sample_weight)`.
    Others: see `CustomStepTrainer`.
  """
  batched = tf.nest.map_structure(
      lambda s: tf.TensorSpec([None, *s.shape], s.dtype), tuple(batch_spec))
  with strategy.scope():
    try:
      model._symbolic_build(data_batch=batched)  # pylint: disable=protected-access
    except RuntimeError as e:
      # A model without a `call` on its features (a GAN of Keras's
      # tutorial) cannot be built symbolically; `fit` on one device then
      # defers to its first step, and so does tfdist.
      logging.warning(
          "%s cannot be built before its first step (%s): its own "
          "train_step builds what it uses there, as Model.fit does on one "
          "device.", type(model).__name__, first_line(e))
  logging.info(
      "The model overrides %s: tfdist runs its own train_step and "
      "test_step on each replica, as Keras's Model.fit does (the logs "
      "reduced as fit reduces them), inside tfdist's input pipeline, batch "
      "and learning-rate scaling, checkpoints and callbacks.",
      ", ".join(found))
  return CustomStepTrainer(strategy=strategy, model=model,
                           steps_per_epoch=steps_per_epoch,
                           steps_per_execution=steps_per_execution,
                           run_eagerly=run_eagerly)
