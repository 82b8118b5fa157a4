"""The outer loop: one controller for every strategy.

Orbit-style split: a step runner (`tfdist.training.step_runner`) runs steps (a
local call of the compiled step, or chunks scheduled on a `ClusterCoordinator`);
the `Controller` owns everything between steps, the same way for every
strategy:

* boundaries: it runs up to the next log, checkpoint, epoch or final step
  (and, for a local runner, at most `steps_per_execution` steps per call),
  so every boundary is hit exactly;
* logging (`tfdist.observability.run_log.RunLog`: one formatter, one set of
  TensorBoard scalars, one divergence check);
* checkpoints (`tfdist.training.checkpointing.CheckpointKeeper`): restore at
  start, save every `checkpoint_steps` (or at each epoch end) and at the end;
* evaluation every `epochs_between_evals` epochs and at the end;
* Keras callbacks (`set_params`, train/epoch/batch hooks with Keras's logs,
  the `on_test_*` hooks around each evaluation during training,
  `model.stop_training` honoured where `fit` honours it: EarlyStopping,
  TerminateOnNaN);
* preemption (`tfdist.runtime.preemption.PreemptionWatcher`): a signal on any
  worker stops every worker after the same step, with a checkpoint;
* a profiler window (`tfdist.observability.profiling.ProfileWindow`,
  `--profile_steps`): its edges are boundaries too, so the trace holds exactly
  those steps.

Where the time goes (examples/sec, step time, input wait, memory) is
logged at every log point by `tfdist.observability.run_log.RunLog` from the step
sums and the host's clock: the controller adds no host synchronization of its
own.

The loop itself is short (`Controller._run`): the step runner runs a chunk
up to the next boundary, then each `Action` does its side work, in order:
the profiler window, the divergence check, the skipped-step watch, Keras's
batch hooks, the log, the checkpoint, the preemption stop, the evaluation,
Keras's epoch hooks and the stop on a callback's request.

Stop requests (a signal, a callback's `model.stop_training`) ride with the
next chunk's step sums, which every worker reduces anyway, so workers agree
without a host synchronization of their own; they come back apart from the
metrics, as `tfdist.training.step_runner.StepSignals`. At epoch ends, where
callbacks decide, one all-reduce of one number makes them agree
(multi-worker only); after the batch hooks too, when a callback may stop
there (`keras_callbacks.may_stop_in_batch_hooks`), so training stops after
the call in whose hooks the flag was set, as `fit` stops after that batch
(its epoch then ends there: evaluated and given `on_epoch_end`).

Skipped steps (fp16 updates skipped for a non-finite summed gradient) come
back from the compiled step with each chunk's signals; the controller logs
them and stops a run whose optimizer no longer updates
(`tfdist.training.training_checks.SkippedStepMonitor`). A non-finite training or
evaluation loss stops the run as diverged: the actions after the one that
found it end the epoch and the run for the callbacks (`Action.on_diverged`,
as `fit` ends a run that TerminateOnNaN stops), then the error is raised;
it names the data as the cause when the batches concerned, read again
(`StepRunner.nonfinite_input`), hold NaN or infinite values.

`Controller.evaluate_continuously` is the one side-car evaluator: it
evaluates every checkpoint once, in step order (evaluator tasks of every
strategy, `tfdist.train --mode=continuous_eval`; `--mode=eval` evaluates
the latest checkpoint once).
"""

import dataclasses
import json
import math
import os
import time
from typing import Callable, Dict, List, Optional, Sequence

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfdist import errors
from tfdist.observability import progress
from tfdist.observability import run_log as run_log_lib
from tfdist.runtime import strict_json
from tfdist.training import callback_state as callback_state_lib
from tfdist.training import checkpointing
from tfdist.training import keras_callbacks
from tfdist.training import step_runner
from tfdist.training import training_checks
from tfdist.training.checkpoint_paths import checkpoint_step

EVAL_RESULTS_FILE = "eval_results.jsonl"


@dataclasses.dataclass(frozen=True)
class ControllerOptions:
  """When the controller stops to do what (all in steps unless named).

  Attributes:
    total_steps: optimizer updates in the whole run.
    steps_per_epoch: updates per epoch.
    log_steps: log loss, learning rate and throughput every this many steps.
    checkpoint_steps: save every this many steps (0: at every epoch end).
    epochs_between_evals: evaluate after every this many epochs (and at end).
    max_consecutive_skipped_steps: fail once this many steps in a row made
      no update (`--max_consecutive_skipped_steps`; 0: no limit).
  """
  total_steps: int
  steps_per_epoch: int
  log_steps: int = 100
  checkpoint_steps: int = 0
  epochs_between_evals: int = 1
  max_consecutive_skipped_steps: int = (
      training_checks.DEFAULT_MAX_CONSECUTIVE_SKIPPED_STEPS)

  def is_epoch_end(self, step: int) -> bool:
    """`step` (the last step trained) ends an epoch."""
    return step % self.steps_per_epoch == 0

  def is_last(self, step: int) -> bool:
    """`step` is the run's last."""
    return step == self.total_steps

  def is_checkpoint_step(self, step: int) -> bool:
    """A checkpoint is due after `step`: every `checkpoint_steps` (or at
    each epoch end without them) and after the last step."""
    if self.checkpoint_steps:
      due = step % self.checkpoint_steps == 0
    else:
      due = self.is_epoch_end(step)
    return due or self.is_last(step)


@dataclasses.dataclass
class ControllerResult:
  """What `Controller.run` did.

  Attributes:
    step: the last step trained (== `total_steps` unless stopped early).
    final_eval: the last evaluation's result (`loss`, each metric, e.g.
      `accuracy` and `auc`, `num_examples`, `step`), or None without an
      evaluation.
    stopped_early: a callback set `model.stop_training`.
    restored_from: the checkpoint training resumed from, or None.
    train_seconds: wall time of the training loop in this process.
    skipped_steps: steps of this process whose update was skipped (fp16
      gradients not finite).
    micro_steps: micro-batches this process ran (steps x
      `--gradient_accumulation_steps`), counted by the compiled step.
  """
  step: int
  final_eval: Optional[dict]
  stopped_early: bool
  restored_from: Optional[str]
  train_seconds: float
  skipped_steps: int = 0
  micro_steps: int = 0


def next_boundary(step: int, options: ControllerOptions,
                  extra: Sequence[int] = ()) -> int:
  """The first step after `step` at which the controller must stop: a log
  point, a checkpoint, an epoch end, the end of training, or one of `extra`
  (e.g. a profiler window's edges) that lies after `step`."""
  candidates = [b for b in extra if b > step]
  candidates += [options.total_steps,
                (step // options.log_steps + 1) * options.log_steps,
                (step // options.steps_per_epoch + 1) *
                options.steps_per_epoch]
  if options.checkpoint_steps:
    candidates.append((step // options.checkpoint_steps + 1) *
                      options.checkpoint_steps)
  return min(candidates)


class _SumsSince:
  """The step sums and step count since the last `take` (a log interval,
  an epoch)."""

  def __init__(self):
    self.sums: Dict[str, np.ndarray] = {}
    self.steps = 0

  def add(self, sums: Dict[str, np.ndarray], num_steps: int) -> None:
    for key, value in sums.items():
      self.sums[key] = self.sums.get(key, 0.0) + value
    self.steps += num_steps

  def take(self):
    """`(sums, steps)` so far; starts the next window empty."""
    taken = (self.sums, self.steps)
    self.sums, self.steps = {}, 0
    return taken


@dataclasses.dataclass
class LoopState:
  """Where the outer loop is; the actions read and update it.

  Attributes:
    step: the last step trained.
    epoch: the epoch being trained (0-based).
    first_step: the step before the last chunk of steps.
    epoch_open: `on_epoch_begin` was called for `epoch`.
    stop_signal: passed to the next chunk: this process got a stop signal.
    stop_training: passed to the next chunk: a callback asks to stop.
    saved: the checkpoint an action saved at `step` (None: none yet).
    stop_requested: after a chunk, a callback of some worker asks to stop.
    last_eval: the last evaluation's result (with its `step`), or None.
    stopped_early: training stopped on a callback's request.
    micro_steps: micro-batches run so far by this process.
    epoch_logs: the logs of the last `on_epoch_end` (Keras passes them to
      `on_train_end`), or None.
    preempted: the checkpoint saved for a stop signal at an epoch end,
      which stops the run once that epoch has ended; None: no such stop.
  """
  step: int
  epoch: int
  first_step: int = 0
  epoch_open: bool = False
  stop_signal: bool = False
  stop_training: bool = False
  saved: Optional[str] = None
  stop_requested: bool = False
  last_eval: Optional[dict] = None
  stopped_early: bool = False
  micro_steps: int = 0
  epoch_logs: Optional[dict] = None
  preempted: Optional[str] = None

  @property
  def num_steps(self) -> int:
    """Steps in the last chunk."""
    return self.step - self.first_step


class Action:
  """Side work of the outer loop; every hook is optional.

  The controller calls, for each action in its order: `on_begin` once
  (after restoring), `boundaries` and `before_steps` before each chunk of
  steps, the action itself after each chunk, and `on_end` once when
  training ends normally (not on an error or a preemption).
  """

  def on_begin(self, state: LoopState) -> None:
    """Training starts at `state.step`."""

  def boundaries(self, step: int) -> Sequence[int]:
    """Steps after `step` at which a chunk must end, beyond the
    controller's own (log, checkpoint, epoch, end)."""
    del step  # Unused.
    return ()

  def before_steps(self, state: LoopState) -> None:
    """The next chunk starts after `state.step`."""

  def __call__(self, state: LoopState,
               output: step_runner.StepOutput) -> None:
    """A chunk ended at `state.step` with `output`."""

  def on_end(self, state: LoopState) -> None:
    """Training ended at `state.step`."""

  def on_diverged(self, state: LoopState,
                  output: step_runner.StepOutput) -> None:
    """An action before this one raised a divergence error after the chunk
    that ended at `state.step` (with `output`): end the epoch and the run
    as `fit` ends them (the run then raises that error)."""


class Checkpoints:
  """Saves through a `CheckpointKeeper`, and words divergence errors.

  Args:
    keeper: the `tfdist.training.checkpointing.CheckpointKeeper`.
    learning_rate: returns the current learning rate (float).
    loss_scale: returns the current loss scale, or None without one.
    nonfinite_input: `(after_step, step) -> str or None`
      (`StepRunner.nonfinite_input`): what in the training batches of
      steps `after_step + 1 .. step` (`after_step` None: since the input
      started) is NaN or infinite, re-read after a divergence; None: not
      checked.
    callback_state: the `tfdist.training.callback_state.CallbackState`
      saved with each checkpoint, or None.
  """

  def __init__(self, keeper, *, learning_rate: Callable[[], float],
               loss_scale: Callable[[], Optional[float]],
               nonfinite_input: Optional[Callable[[Optional[int], int],
                                                  Optional[str]]] = None,
               callback_state=None):
    self.keeper = keeper
    self.learning_rate = learning_rate
    self.loss_scale = loss_scale
    self.nonfinite_input = nonfinite_input
    self.callback_state = callback_state

  def save(self, step: int) -> str:
    """Saves step `step`; returns the path.

    Raises:
      tfdist.errors.TrainingDivergedError: the state holds NaN or
        infinite values (nothing is saved).
    """
    try:
      return self.keeper.save(step)
    except errors.NonFiniteStateError as e:
      raise self.diverged(None, step, "the model or optimizer state holds "
                          "NaN or infinite values") from e

  def diverged(self, first: Optional[int], step: int,
               what: str) -> errors.TrainingDivergedError:
    """The one divergence error: what went wrong, where, the last good
    checkpoint (kept: nothing was saved after it) and what to change.

    `first`: the step before the chunk whose loss went non-finite (None:
    the state was found non-finite at a checkpoint). The training batches
    since then (since the last checkpoint when `first` is None) are read
    again; when they hold NaN or infinite features, labels or weights, the
    error says the data is the cause instead of advising a lower learning
    rate.
    """
    where = f"at step {step}" + (
        f" (in steps {first + 1}-{step})"
        if first is not None and first + 1 < step else "")
    found = None
    if self.nonfinite_input is not None:
      after = first
      if after is None and self.keeper.latest:
        after = checkpoint_step(self.keeper.latest)
      found = self.nonfinite_input(after, step)
    if found:
      advice = (
          f"The training data is the likely cause: {found}. A NaN or "
          "infinite input makes the loss or the gradients non-finite "
          "whatever the learning rate. Find those examples with "
          "tf.debugging.check_numerics(tensor, name) (or "
          "tf.math.is_finite) on each feature and label in your parse_fn "
          "or dataset function, then fix or drop them (e.g. "
          "dataset.filter(lambda x, y, *w: tf.reduce_all("
          "tf.math.is_finite(x))))")
    else:
      advice = run_log_lib.divergence_advice(
          loss_scaled=self.loss_scale() is not None,
          learning_rate=self.learning_rate()).rstrip(".")
    return errors.TrainingDivergedError(
        f"Training diverged {where}: {what}. {advice}. "
        f"{self.kept_and_rerun()}")

  def kept_and_rerun(self) -> str:
    """Which checkpoint survives a divergence and what a rerun does."""
    last_good = self.keeper.latest
    if last_good:
      return (f"No checkpoint was saved after it went wrong: the last good "
              f"checkpoint, {last_good}, is kept, and a rerun with the same "
              f"--model_dir resumes from it.")
    return ("It diverged before its first checkpoint: a rerun with the same "
            "--model_dir starts from step 0.")


class KerasTrainHooks(Action):
  """Keras's train, epoch and batch-begin hooks; `model.stop_training`.

  At the end, an `EarlyStopping(restore_best_weights=True)` that put back
  another epoch's weights has them saved (as the last step's checkpoint)
  and evaluated again, so the final checkpoint, the export and the
  manifest hold one answer.
  """

  def __init__(self, callbacks: keras.callbacks.CallbackList, *,
               model: Optional[keras.Model], options: ControllerOptions,
               checkpoints: Checkpoints):
    self.callbacks = callbacks
    self.model = model
    self.options = options
    self.checkpoints = checkpoints

  def on_begin(self, state):
    opts = self.options
    self.callbacks.set_params({
        "verbose": 0, "steps": opts.steps_per_epoch,
        "epochs": int(math.ceil(opts.total_steps / opts.steps_per_epoch))})
    if self.model is not None:
      self.model.stop_training = False
    self.callbacks.on_train_begin()
    callback_state_lib.after_train_begin(
        self.checkpoints.callback_state, self.callbacks.callbacks,
        resumed=state.step > 0)

  def before_steps(self, state):
    if not state.epoch_open:
      self.callbacks.on_epoch_begin(state.epoch)
      state.epoch_open = True
    self.callbacks.on_train_batch_begin(
        state.step % self.options.steps_per_epoch)
    state.stop_training = _wants_stop(self.model)

  def on_end(self, state):
    self.callbacks.on_train_end(state.epoch_logs)
    restored_best = _restored_best_epoch(self.callbacks,
                                         last_epoch=state.epoch - 1)
    if restored_best is not None:
      # Epochs counted from 1, as EarlyStopping's own "best epoch: N".
      logging.info("EarlyStopping(restore_best_weights=True) restored the "
                   "weights of epoch %d: saving them as step %d's checkpoint "
                   "and evaluating them.", restored_best + 1, state.step)
      self.checkpoints.save(state.step)
      state.last_eval = None


class ProfilerWindow(Action):
  """A `tfdist.observability.profiling.ProfileWindow`: its edges end chunks, so the trace
  holds exactly its steps."""

  def __init__(self, window):
    self.window = window

  def boundaries(self, step):
    return self.window.boundaries(step)

  def before_steps(self, state):
    self.window.before_steps(state.step)

  def __call__(self, state, output):
    self.window.after_steps(state.step)


class DivergenceCheck(Action):
  """Stops a run whose weights became NaN or infinite.

  The chunk's summed loss is NaN or infinite when any of its steps' was
  (read from the sums every worker already has). Only then is the state
  checked (one compiled reduction): NaN weights stop the run at once, with
  nothing saved after the last good checkpoint; a finite state (an fp16
  step skipped, a callback such as TerminateOnNaN deciding) goes on.
  """

  def __init__(self, checkpoints: Checkpoints):
    self.checkpoints = checkpoints

  def __call__(self, state, output):
    loss = float(output.sums.get("loss", 0.0))
    if (not math.isfinite(loss) and
        not self.checkpoints.keeper.state_is_finite()):
      raise self.checkpoints.diverged(
          state.first_step, state.step, f"the training loss is "
          f"{float(output.sums['loss'])} and the model or optimizer state "
          "holds NaN or infinite values")


class SkippedStepWatch(Action):
  """Counts skipped steps; stops a run whose optimizer no longer updates
  (`tfdist.training.training_checks.SkippedStepMonitor`)."""

  def __init__(self, options: ControllerOptions,
               loss_scale: Callable[[], Optional[float]]):
    self.options = options
    self.loss_scale = loss_scale
    self.monitor = training_checks.SkippedStepMonitor(
        options.max_consecutive_skipped_steps)

  def on_begin(self, state):
    self.monitor = training_checks.SkippedStepMonitor(
        self.options.max_consecutive_skipped_steps, start_step=state.step)

  def __call__(self, state, output):
    self.monitor.record_chunk(
        steps=state.num_steps, skipped=output.signals.skipped_steps,
        skipped_at_end=output.signals.skipped_steps_at_end,
        loss_scale=self.loss_scale)
    if self.options.is_last(state.step):
      self.monitor.finish(loss_scale=self.loss_scale)


class KerasBatchEnd(Action):
  """Keras's `on_train_batch_end` with Keras's logs: the mean loss over the
  epoch's steps so far and, with `summarize`, every metric over them.

  A callback that sets `model.stop_training` there stops training after
  this call, as `fit` stops after that batch: when a callback may do so
  (`keras_callbacks.may_stop_in_batch_hooks`), every worker agrees on the
  flag right after the hooks (`runner.agree`: one all-reduce of one number
  with several workers, nothing otherwise).

  Args:
    callbacks: the callbacks.
    options: the `ControllerOptions`.
    summarize: `(sums, steps) -> logs` (`RunLog.summarize`), or None for
      the loss alone (no callback reads the metrics per batch).
    model: the Keras model (`stop_training`), or None.
    runner: the step runner (`agree`), or None: no stop in batch hooks.
  """

  def __init__(self, callbacks: keras.callbacks.CallbackList,
               options: ControllerOptions,
               summarize: Optional[Callable[..., dict]] = None, *,
               model: Optional[keras.Model] = None,
               runner: Optional[step_runner.StepRunner] = None):
    self.callbacks = callbacks
    self.options = options
    self.summarize = summarize
    self.model = model
    self.runner = (runner if model is not None and
                   keras_callbacks.may_stop_in_batch_hooks(callbacks)
                   else None)
    self.window = _SumsSince()

  def __call__(self, state, output):
    self._batch_end(state, output)
    if self.runner is not None:
      state.stop_requested = self.runner.agree(
          state.stop_requested or _wants_stop(self.model))

  def on_diverged(self, state, output):
    # The hooks see the non-finite loss, as fit's do (TerminateOnNaN
    # decides there); the run stops whatever they set.
    self._batch_end(state, output)

  def _batch_end(self, state, output):
    if state.first_step % self.options.steps_per_epoch == 0:
      self.window.take()  # Keras resets its metrics at each epoch.
    self.window.add(output.sums, state.num_steps)
    sums, steps = self.window.sums, self.window.steps
    logs = (self.summarize(sums, steps) if self.summarize is not None else
            # A model's own train_step may log no loss (custom_step).
            {"loss": float(sums["loss"]) / steps} if "loss" in sums else {})
    self.callbacks.on_train_batch_end(
        (state.step - 1) % self.options.steps_per_epoch, logs)


class TrainLog(Action):
  """Logs loss, learning rate, skipped steps and throughput every
  `log_steps` steps and at the end
  (`tfdist.observability.run_log.RunLog.log_train`); a line followed by an
  evaluation at its step (`evaluates`) is held and logged with it, as one
  line."""

  def __init__(self, run_log: run_log_lib.RunLog, *,
               options: ControllerOptions, checkpoints: Checkpoints,
               skipped: SkippedStepWatch, evaluates: bool = False):
    self.run_log = run_log
    self.options = options
    self.checkpoints = checkpoints
    self.skipped = skipped
    self.evaluates = evaluates
    self.window = _SumsSince()

  def __call__(self, state, output):
    self.window.add(output.sums, state.num_steps)
    step = state.step
    if step % self.options.log_steps and not self.options.is_last(step):
      return
    monitor = self.skipped.monitor
    sums, steps = self.window.take()
    try:
      self.run_log.log_train(
          step, sums, steps,
          learning_rate=self.checkpoints.learning_rate(),
          loss_scale=self.checkpoints.loss_scale(),
          skipped_steps=monitor.take_interval(),
          total_skipped=monitor.total_skipped,
          hold=self.evaluates and _evaluation_due(self.options, state))
    except errors.TrainingDivergedError as e:
      raise errors.TrainingDivergedError(
          f"{e} {self.checkpoints.kept_and_rerun()}") from e


class SaveCheckpoint(Action):
  """Saves every `checkpoint_steps` (or at each epoch end) and at the end."""

  def __init__(self, checkpoints: Checkpoints, options: ControllerOptions):
    self.checkpoints = checkpoints
    self.options = options

  def __call__(self, state, output):
    if self.options.is_checkpoint_step(state.step):
      state.saved = self.checkpoints.save(state.step)


class PreemptionStop(Action):
  """A stop signal on any worker stops every worker after the same step,
  with a checkpoint (`tfdist.runtime.preemption.PreemptionWatcher`).

  At an epoch end the checkpoint is saved here and the stop comes after
  the epoch's evaluation and `on_epoch_end` (`PreemptionStopAfterEpoch`),
  which a resumed run, starting with the next epoch, would not run: so
  callbacks deciding per epoch see every epoch, as in an uninterrupted
  run.
  """

  def __init__(self, watcher, *, checkpoints: Checkpoints,
               callbacks: keras.callbacks.CallbackList,
               options: ControllerOptions):
    self.watcher = watcher
    self.checkpoints = checkpoints
    self.callbacks = callbacks
    self.options = options

  def before_steps(self, state):
    state.stop_signal = self.watcher.signal_received()

  def __call__(self, state, output):
    if not output.signals.stop_signal or self.options.is_last(state.step):
      return
    self.watcher.note_peer_stop()
    path = state.saved or self.checkpoints.save(state.step)
    if self.options.is_epoch_end(state.step):
      state.saved = state.preempted = path
      return
    self.callbacks.on_train_end()
    raise self.watcher.preempted(step=state.step, checkpoint=path)


class PreemptionStopAfterEpoch(Action):
  """Raises the stop `PreemptionStop` deferred to the end of an epoch (the
  checkpoint `KerasEpochEnd` saved again, if it did, is the one named)."""

  def __init__(self, stop: PreemptionStop):
    self.stop = stop

  def __call__(self, state, output):
    if state.preempted is None:
      return
    path = state.saved or state.preempted
    self.stop.callbacks.on_train_end()
    raise self.stop.watcher.preempted(step=state.step, checkpoint=path)


class Evaluate(Action):
  """Evaluates every `epochs_between_evals` epochs (an epoch that a stop
  request ends early too, as `fit` validates it) and at the end, calling
  Keras's `on_test_*` hooks as `fit` calls them while it validates; at the
  end again (without hooks) when the last evaluation is not of the last
  step."""

  def __init__(self, evaluate: Callable[..., Optional[dict]],
               options: ControllerOptions,
               callbacks: Optional[keras.callbacks.CallbackList] = None):
    self.evaluate = evaluate
    self.options = options
    self.callbacks = callbacks

  def __call__(self, state, output):
    if _evaluation_due(self.options, state):
      state.last_eval = (self.evaluate(state.step) if self.callbacks is None
                         else self.evaluate(state.step,
                                            callbacks=self.callbacks))

  def on_end(self, state):
    if state.last_eval is None or state.last_eval["step"] != state.step:
      state.last_eval = self.evaluate(state.step)

  def on_diverged(self, state, output):
    # fit validates the epoch a stop cuts short (TerminateOnNaN's too),
    # with the non-finite weights: the same hooks, the same NaN logs.
    if (self.callbacks is not None and
        ((state.epoch + 1) % self.options.epochs_between_evals == 0 or
         self.options.is_last(state.step))):
      state.last_eval = self.evaluate(state.step, callbacks=self.callbacks,
                                      check_loss=False)


def _evaluation_due(options: ControllerOptions, state: LoopState) -> bool:
  """`Evaluate` evaluates after the chunk that ended at `state.step`."""
  return (((options.is_epoch_end(state.step) or state.stop_requested) and
           (state.epoch + 1) % options.epochs_between_evals == 0) or
          options.is_last(state.step))


class KerasEpochEnd(Action):
  """Keras's `on_epoch_end` with the epoch's metrics (and this step's
  evaluation as `val_*`); then every worker agrees on a stop request.

  A learning-rate callback (ReduceLROnPlateau) that changed the rate after
  this step's checkpoint, or a callback whose kept state changed
  (`tfdist.training.callback_state`), has it saved again, so a resume from
  it trains on with the new rate and the callbacks' new state.
  """

  def __init__(self, callbacks: keras.callbacks.CallbackList, *,
               model: Optional[keras.Model], run_log: run_log_lib.RunLog,
               runner: step_runner.StepRunner, checkpoints: Checkpoints,
               options: ControllerOptions):
    self.callbacks = callbacks
    self.model = model
    self.run_log = run_log
    self.runner = runner
    self.checkpoints = checkpoints
    self.options = options
    self.window = _SumsSince()

  def __call__(self, state, output):
    self.window.add(output.sums, state.num_steps)
    step = state.step
    # An epoch ends at its last step, or where a stop request ends it (as
    # `fit` ends an epoch that a batch hook stops).
    if not (self.options.is_epoch_end(step) or self.options.is_last(step) or
            state.stop_requested):
      return
    logs = self.run_log.summarize(*self.window.take())
    if state.last_eval and state.last_eval["step"] == step:
      logs.update({f"val_{k}": v for k, v in
                   run_log_lib.metric_values(state.last_eval).items()})
    rate_before = self.checkpoints.learning_rate()
    self.callbacks.on_epoch_end(state.epoch, logs)
    state.epoch_logs = logs
    if state.saved is not None and (
        not _same_rate(rate_before, self.checkpoints.learning_rate()) or
        callback_state_lib.changed_since_save(
            self.checkpoints.callback_state)):
      state.saved = self.checkpoints.save(step)
    state.epoch_open = False
    state.epoch += 1
    state.stop_requested = self.runner.agree(
        state.stop_requested or _wants_stop(self.model))

  def on_diverged(self, state, output):
    # As fit ends a run that TerminateOnNaN stops: this epoch's
    # on_epoch_end (its logs hold the non-finite values), then
    # on_train_end with them (a CSVLogger closes its file). Nothing is
    # saved and the workers need not agree: the run raises on all alike.
    self.window.add(output.sums, state.num_steps)
    if state.epoch_open:
      logs = self.run_log.summarize(*self.window.take())
      if state.last_eval and state.last_eval["step"] == state.step:
        logs.update({f"val_{k}": v for k, v in
                     run_log_lib.metric_values(state.last_eval).items()})
      self.callbacks.on_epoch_end(state.epoch, logs)
      state.epoch_logs = logs
      state.epoch_open = False
    self.callbacks.on_train_end(state.epoch_logs)


class StopOnRequest(Action):
  """Stops, with a checkpoint, when a callback set `model.stop_training`
  (EarlyStopping, TerminateOnNaN): on every worker after the same step."""

  def __init__(self, checkpoints: Checkpoints, options: ControllerOptions):
    self.checkpoints = checkpoints
    self.options = options

  def __call__(self, state, output):
    if not state.stop_requested or self.options.is_last(state.step):
      return
    logging.info("Stopping at step %d of %d (epoch %d, counted from 1 as "
                 "Keras's callbacks count it): a callback set "
                 "model.stop_training.", state.step, self.options.total_steps,
                 progress.epoch_of(state.step, self.options.steps_per_epoch))
    if state.saved is None:
      self.checkpoints.save(state.step)
    state.stopped_early = True


def _wants_stop(model: Optional[keras.Model]) -> bool:
  return bool(model is not None and model.stop_training)


class Controller:
  """Trains to `total_steps` with any step runner; or evaluates checkpoints.

  Training is a short loop: the runner runs a chunk of steps up to the
  next boundary, then each `Action` (see `actions`) does its side work.

  Args:
    runner: a `tfdist.training.step_runner.StepRunner` (`LocalStepRunner` or
      `CoordinatorStepRunner`); None for an evaluation-only controller.
    options: a `ControllerOptions`.
    checkpoints: a `tfdist.training.checkpointing.CheckpointKeeper`; None for an
      evaluation-only controller.
    step_counter: the global step variable (read after restoring).
    run_log: the `tfdist.observability.run_log.RunLog`.
    evaluate: a function returning one evaluation of the current weights
      (`{"loss", <metric>: value, ..., "num_examples"}`), or None; called
      with `on_batch_begin` and `on_batch_end` (as
      `tfdist.training.train_loop.Trainer.evaluate` takes them) when a
      callback overrides Keras's `on_test_batch_*` hooks.
    model: the Keras model (callbacks read it; `stop_training`).
    learning_rate: returns the current learning rate (float).
    loss_scale: returns the current loss scale, or None without one.
    callbacks: Keras callbacks.
    preemption: a `tfdist.runtime.preemption.PreemptionWatcher`, or None.
    profiler: a `tfdist.observability.profiling.ProfileWindow`, or None.
    train_actions: the caller's `Action`s, run after the built-in ones
      (Orbit's `Controller(train_actions=...)`): each gets every hook of
      `Action` with the `LoopState` and each chunk's `StepOutput`, after the
      controller's own work for that chunk (its log, checkpoint,
      evaluation and epoch end) is done.
    eval_actions: the caller's callables `(result: dict) -> None`, each
      given every evaluation's result (`loss`, each metric,
      `num_examples`, `step`) after it is logged, during training and in
      `evaluate_continuously`, in order.

  Raises:
    ValueError: `options` with a non-positive step count.
    TypeError: a train action that is not an `Action`, or an eval action
      that is not callable.
  """

  def __init__(self, *, runner: Optional[step_runner.StepRunner] = None,
               options: ControllerOptions,
               checkpoints=None, step_counter: Optional[tf.Variable] = None,
               run_log: run_log_lib.RunLog,
               evaluate: Optional[Callable[[], dict]] = None,
               model: Optional[keras.Model] = None,
               learning_rate: Callable[[], float] = lambda: float("nan"),
               loss_scale: Callable[[], Optional[float]] = lambda: None,
               callbacks: Sequence[keras.callbacks.Callback] = (),
               preemption=None, profiler=None,
               train_actions: Sequence["Action"] = (),
               eval_actions: Sequence[Callable[[dict], None]] = ()):
    for action in train_actions:
      if not isinstance(action, Action):
        raise TypeError(
            f"Controller(train_actions=...): {action!r} is not a "
            "tfdist.training.controller.Action; subclass Action and "
            "override the hooks it needs.")
    for action in eval_actions:
      if not callable(action):
        raise TypeError(
            f"Controller(eval_actions=...): {action!r} is not callable; "
            "give functions of one argument, the evaluation's result.")
    self.eval_actions = tuple(eval_actions)
    for name in ("total_steps", "steps_per_epoch", "log_steps",
                 "epochs_between_evals"):
      if getattr(options, name) <= 0:
        raise ValueError(f"ControllerOptions.{name} must be > 0; received "
                         f"{getattr(options, name)}.")
    self.runner = runner
    self.options = options
    self.checkpoints = checkpoints
    self.step_counter = step_counter
    self.run_log = run_log
    self.evaluate_fn = evaluate
    self.profiler = profiler
    # The last step trained (while `run` runs, for error messages).
    self.step = 0
    self.actions: List[Action] = []
    self._skipped = SkippedStepWatch(options, loss_scale)
    if checkpoints is not None:
      self.actions = self._make_actions(
          Checkpoints(checkpoints, learning_rate=learning_rate,
                      loss_scale=loss_scale,
                      nonfinite_input=getattr(runner, "nonfinite_input",
                                              None),
                      callback_state=callback_state_lib.attach(
                          checkpoints.checkpoint,
                          keras_callbacks.flatten(callbacks))),
          keras.callbacks.CallbackList(list(callbacks), model=model),
          model=model, preemption=preemption) + list(train_actions)

  def _make_actions(self, saver: Checkpoints, callbacks, *, model,
                    preemption) -> List[Action]:
    """The built-in side work after each chunk, in the order it runs.

    The order is part of the contract, since the actions share one
    `LoopState`:

    1. `KerasTrainHooks`: Keras's train and batch-begin hooks; sets
       `stop_training` from a batch hook's request.
    2. `ProfilerWindow` (with `--profile_steps`).
    3. `DivergenceCheck`: a non-finite loss stops here, before anything
       reads the chunk's metrics.
    4. `SkippedStepWatch`: fp16 steps skipped; reads the chunk's signals.
    5. `KerasBatchEnd`: Keras's batch-end hooks; sets `stop_requested`.
    6. `TrainLog`: the log line and scalars of a log point.
    7. `SaveCheckpoint`: sets `saved` at checkpoint boundaries.
    8. `PreemptionStop`: reads `saved`, saves if needed, raises (at an
       epoch end: sets `saved` and `preempted` instead).
    9. `Evaluate`: sets `last_eval` at evaluation boundaries.
    10. `KerasEpochEnd`: reads `last_eval`; sets `epoch_logs` and
        `stop_requested` at epoch ends.
    11. `PreemptionStopAfterEpoch`: reads `preempted` and `saved`, raises.
    12. `StopOnRequest`: reads `stop_requested` and `saved`; sets
        `stopped_early`.

    The caller's `train_actions` follow, in their order.
    """
    opts = self.options
    actions = [KerasTrainHooks(callbacks, model=model, options=opts,
                               checkpoints=saver)]
    if self.profiler is not None:
      actions.append(ProfilerWindow(self.profiler))
    actions += [
        DivergenceCheck(saver), self._skipped,
        KerasBatchEnd(callbacks, opts, summarize=(
            self.run_log.summarize
            if keras_callbacks.reads_batch_metrics(callbacks) else None),
                      model=model, runner=self.runner),
        TrainLog(self.run_log, options=opts, checkpoints=saver,
                 skipped=self._skipped,
                 evaluates=self.evaluate_fn is not None),
        SaveCheckpoint(saver, opts)]
    stop = None
    if preemption is not None:
      stop = PreemptionStop(preemption, checkpoints=saver,
                            callbacks=callbacks, options=opts)
      actions.append(stop)
    actions += [
        Evaluate(self.evaluate, opts, callbacks),
        KerasEpochEnd(callbacks, model=model, run_log=self.run_log,
                      runner=self.runner, checkpoints=saver, options=opts)]
    if stop is not None:
      actions.append(PreemptionStopAfterEpoch(stop))
    actions.append(StopOnRequest(saver, opts))
    return actions

  @property
  def skipped(self) -> training_checks.SkippedStepMonitor:
    """The skipped-step monitor of the current (or last) run."""
    return self._skipped.monitor

  # --- evaluation ------------------------------------------------------------
  def evaluate(self, step: int,
               callbacks: Optional[keras.callbacks.CallbackList] = None, *,
               check_loss: bool = True) -> Optional[dict]:
    """Evaluates the current weights; logs and returns the result.

    Args:
      step: the step of the weights.
      callbacks: Keras callbacks to get `on_test_begin`, `on_test_end` (with
        the loss and metrics) and, when one overrides them
        (`keras_callbacks.reads_test_batches`), `on_test_batch_begin` and
        `on_test_batch_end` with the running logs (the `evaluate`
        function is then called with `on_batch_begin` and `on_batch_end`);
        None: no hooks.
      check_loss: raise when the loss is not finite (False: the run has
        diverged already and this evaluation is for the callbacks).

    Returns:
      The evaluation (`loss`, each metric, `num_examples`, `step`), or None
      without an `evaluate` function.

    Raises:
      tfdist.errors.TrainingDivergedError: the evaluation loss is not
        finite, nor the model's state (while the state is finite, a warning
        names the evaluation data and training goes on).
    """
    if self.evaluate_fn is None:
      return None
    if callbacks is None:
      result = dict(self.evaluate_fn())
    else:
      callbacks.on_test_begin()
      hooks = (dict(on_batch_begin=callbacks.on_test_batch_begin,
                    on_batch_end=callbacks.on_test_batch_end)
               if keras_callbacks.reads_test_batches(callbacks) else {})
      result = dict(self.evaluate_fn(**hooks))
      callbacks.on_test_end(run_log_lib.metric_values(result))
    result["step"] = step
    self.run_log.log_eval(step, result)
    for action in self.eval_actions:
      action(dict(result))
    # A model's own test_step may report no loss (custom_step).
    if check_loss and "loss" in result:
      finite_state = None
      if (not math.isfinite(result["loss"]) and
          self.checkpoints is not None):
        # Every worker has the same (reduced) loss, so all check together.
        finite_state = self.checkpoints.state_is_finite()
      training_checks.check_eval_loss(result["loss"], step=step,
                                      state_is_finite=finite_state)
    return result

  # --- training --------------------------------------------------------------
  def _current_step(self) -> int:
    return int(self.step_counter.numpy()) if self.step_counter is not None \
        else 0

  def run(self) -> ControllerResult:
    """Restores, then trains to `total_steps` (or until stopped).

    Returns:
      A `ControllerResult`.

    Raises:
      ValueError: an evaluation-only controller (no runner or checkpoints).
      tfdist.errors.PreemptedError: a stop signal reached this or
        another worker; a checkpoint at the step every worker stopped at was
        saved first.
      tfdist.errors.TrainingDivergedError: the training loss (checked
        after every chunk of steps) or the state to be saved (checked before
        every checkpoint) became NaN or infinite; nothing was saved after the
        last good checkpoint, which the message names.
      tfdist.errors.ParameterServerError: (coordinator
        runner) a ps task was lost.
    """
    if self.runner is None or self.checkpoints is None:
      raise ValueError("Controller.run needs a runner and checkpoints; this "
                       "controller was built for evaluation only.")
    try:
      return self._run()
    finally:
      self.run_log.release()  # A step line held for a failed evaluation.
      if self.profiler is not None:
        self.profiler.stop()  # Training stopped inside the window.

  def _run(self) -> ControllerResult:
    restored = self.checkpoints.restore()
    self.step = self._current_step()
    state = LoopState(step=self.step,
                      epoch=self.step // self.options.steps_per_epoch)
    if restored:
      logging.info("tfdist: restored %s: resuming at step %d", restored,
                   state.step)
    self.run_log.resume(state.step)
    started = time.time()
    for action in self.actions:
      action.on_begin(state)
    while state.step < self.options.total_steps and not state.stopped_early:
      self._run_chunk(state)
    for action in self.actions:
      action.on_end(state)
    self.run_log.flush()
    return ControllerResult(
        step=state.step, final_eval=state.last_eval,
        stopped_early=state.stopped_early, restored_from=restored,
        train_seconds=time.time() - started,
        skipped_steps=self.skipped.total_skipped,
        micro_steps=state.micro_steps)

  def _run_chunk(self, state: LoopState):
    """Runs the steps up to the next boundary, then every action."""
    extra = [b for action in self.actions for b in action.boundaries(
        state.step)]
    num_steps = next_boundary(state.step, self.options, extra) - state.step
    if self.runner.max_steps_per_call:
      num_steps = min(num_steps, self.runner.max_steps_per_call)
    for action in self.actions:
      action.before_steps(state)
    output = self.runner.run(num_steps, start_step=state.step,
                             stop_signal=state.stop_signal,
                             stop_training=state.stop_training)
    state.first_step, state.step = state.step, state.step + num_steps
    self.step = state.step
    state.micro_steps += int(output.sums.get("micro_steps", num_steps))
    state.saved = None
    state.stop_requested = output.signals.stop_training
    for index, action in enumerate(self.actions):
      try:
        action(state, output)
      except errors.TrainingDivergedError:
        self._wind_down(state, output, self.actions[index + 1:])
        raise

  def _wind_down(self, state: LoopState, output: step_runner.StepOutput,
                 rest: Sequence[Action]) -> None:
    """After a divergence error of an action: the actions after it end the
    epoch and the run as `fit` ends a run that TerminateOnNaN stops
    (`Action.on_diverged`); the caller then raises the error. A failure
    here is logged and does not replace that error."""
    try:
      for action in rest:
        action.on_diverged(state, output)
    except Exception:  # pylint: disable=broad-except
      logging.exception("tfdist: ending the diverged run at step %d failed "
                        "(the divergence error follows):", state.step)

  # --- the side-car evaluator ------------------------------------------------
  def evaluate_continuously(self, *, checkpoint_dir: str, results_dir: str,
                            restore: Callable[[str], None],
                            final_step: int,
                            finished: Callable[[], bool] = lambda: False,
                            poll_seconds: float = 2.0,
                            idle_timeout: Optional[float] = None
                            ) -> List[dict]:
    """Evaluates every checkpoint in `checkpoint_dir` once, in step order.

    Each result is logged (TensorBoard `validation/` scalars at the
    checkpoint's step) and appended as one JSON line to
    `results_dir/eval_results.jsonl`; a restarted evaluator skips the steps
    already there. A checkpoint that was rotated away (`--max_checkpoints`)
    before it could be read is named in a warning.

    Args:
      checkpoint_dir: the chief's checkpoint folder.
      results_dir: where `eval_results.jsonl` goes.
      restore: loads a checkpoint path's model weights.
      final_step: stop after evaluating this step's checkpoint.
      finished: returns True once the training job is done (e.g. the chief's
        done marker); the newest checkpoint is then evaluated and the loop
        ends.
      poll_seconds: how often to look for new checkpoints.
      idle_timeout: stop after this many seconds without a new checkpoint
        (None: wait for `final_step` or `finished`).

    Returns:
      Every result in `eval_results.jsonl` (earlier runs' included).
    """
    tf.io.gfile.makedirs(results_dir)
    results = read_eval_results(results_dir)
    done = {result["step"] for result in results}
    seen_paths = set()
    last_new = time.time()
    logging.info("Evaluator: watching %s (final step %d)", checkpoint_dir,
                 final_step)
    while True:
      paths = _checkpoint_paths(checkpoint_dir)
      _note_rotated_away(seen_paths - set(paths), done)
      seen_paths.update(paths)
      todo = sorted((p for p in paths if checkpoint_step(p) not in done),
                    key=checkpoint_step)
      for path in todo:
        result = self._evaluate_checkpoint(path, restore, results_dir)
        done.add(checkpoint_step(path))
        if result is not None:
          results.append(result)
          last_new = time.time()
      if final_step in done:
        break
      if finished() and not todo:
        if _latest_is_done(checkpoint_dir, done):
          break
        continue
      if idle_timeout is not None and time.time() - last_new > idle_timeout:
        logging.warning("Evaluator: no new checkpoint for %.0f s; stopping.",
                        idle_timeout)
        break
      time.sleep(poll_seconds)
    return results

  def _evaluate_checkpoint(self, path: str, restore: Callable[[str], None],
                           results_dir: str) -> Optional[dict]:
    """Restores and evaluates one checkpoint and appends the result to
    `eval_results.jsonl`; None when the checkpoint is gone (rotated away
    before it could be read)."""
    try:
      restore(path)
    except (tf.errors.NotFoundError, tf.errors.DataLossError) as e:
      logging.warning(
          "Evaluator: checkpoint %s was deleted (rotated away by "
          "--max_checkpoints) before it could be evaluated: %s", path,
          errors.first_line(e, default=type(e).__name__))
      return None
    result = self.evaluate(checkpoint_step(path))
    result.update(checkpoint=path)
    append_eval_result(results_dir, result)
    self.run_log.flush()
    return result


def _checkpoint_paths(checkpoint_dir: str) -> List[str]:
  """The checkpoints `checkpoint_dir`'s state file lists (oldest first)."""
  state = tf.train.get_checkpoint_state(checkpoint_dir)
  return list(state.all_model_checkpoint_paths) if state else []


def _note_rotated_away(gone: set, done: set):
  """Warns of each checkpoint in `gone` (listed once, no longer) that was
  not evaluated, and adds its step to `done`."""
  for path in sorted(gone, key=checkpoint_step):
    if checkpoint_step(path) not in done:
      logging.warning(
          "Evaluator: checkpoint %s was rotated away (--max_checkpoints)"
          " before it could be evaluated; step %d has no evaluation.",
          path, checkpoint_step(path))
      done.add(checkpoint_step(path))


def _latest_is_done(checkpoint_dir: str, done: set) -> bool:
  """There is no checkpoint, or the newest one's step is in `done`."""
  state = tf.train.get_checkpoint_state(checkpoint_dir)
  latest = state.model_checkpoint_path if state else None
  return latest is None or checkpoint_step(latest) in done


def read_eval_results(results_dir: str) -> List[dict]:
  """Every result in `results_dir/eval_results.jsonl` ([] without it)."""
  path = os.path.join(results_dir, EVAL_RESULTS_FILE)
  results = []
  if tf.io.gfile.exists(path):
    with tf.io.gfile.GFile(path) as f:
      for line in f:
        if line.strip():
          results.append(json.loads(line))
  return results


def _same_rate(a: float, b: float) -> bool:
  """Equal learning rates (NaN, not known, equals NaN)."""
  return a == b or (math.isnan(a) and math.isnan(b))


def _restored_best_epoch(callbacks, *, last_epoch: int) -> Optional[int]:
  """The epoch whose weights a `keras.callbacks.EarlyStopping(
  restore_best_weights=True)` of `callbacks` put back in `on_train_end`,
  when it is not `last_epoch` (the weights trained last); else None."""
  for callback in getattr(callbacks, "callbacks", callbacks):
    if (isinstance(callback, keras.callbacks.EarlyStopping) and
        callback.restore_best_weights and
        callback.best_weights is not None and
        callback.best_epoch != last_epoch):
      return int(callback.best_epoch)
  return None


def append_eval_result(results_dir: str, result: dict) -> str:
  """Appends one evaluation as a JSON line to
  `results_dir/eval_results.jsonl` (NaN as null); returns the path."""
  tf.io.gfile.makedirs(results_dir)
  path = os.path.join(results_dir, EVAL_RESULTS_FILE)
  with tf.io.gfile.GFile(path, "a") as f:
    f.write(json.dumps(strict_json.json_safe(result),
                       allow_nan=False) + "\n")
  return path
