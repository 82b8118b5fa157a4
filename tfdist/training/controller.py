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
Keras's epoch hooks and the stop on a callback's request. The actions share
no mutable state: each receives an immutable record (`Progress` between
chunks, `StepRequest` before one, `Chunk` after one) with what the actions
before it produced, and returns what it produces (`{"saved": path}`);
the controller threads the results from one action to the next.

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
import inspect
import json
import math
import os
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

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


@dataclasses.dataclass(frozen=True)
class Progress:
  """Where the outer loop stands between chunks of steps (immutable).

  Given to `Action.on_begin`, `Action.before_steps` and `Action.on_end`.
  The controller makes a new one after each chunk from the chunk's
  results; `on_end` hooks may produce `last_eval` (see `Action`).

  Attributes:
    step: the last step trained (the step counter).
    epoch: the epoch being trained, or next to train (0-based).
    epoch_begun: `on_epoch_begin` was called for `epoch`.
    last_eval: the last evaluation's result (`loss`, each metric,
      `num_examples`, `step`), or None.
    epoch_logs: the logs of the last `on_epoch_end` (Keras passes them to
      `on_train_end`), or None.
  """
  step: int
  epoch: int
  epoch_begun: bool = False
  last_eval: Optional[dict] = None
  epoch_logs: Optional[dict] = None

  # What an `on_end` hook may produce.
  RESULTS = ("last_eval",)


@dataclasses.dataclass(frozen=True)
class StepRequest:
  """What the actions ask of the next chunk (`Action.before_steps`);
  it rides with the chunk's step sums to every worker.

  Attributes:
    stop_signal: this process got a stop signal (SIGTERM, SIGINT).
    stop_training: a callback set `model.stop_training`.
  """
  stop_signal: bool = False
  stop_training: bool = False

  # What a `before_steps` hook may produce.
  RESULTS = ("stop_signal", "stop_training")


@dataclasses.dataclass(frozen=True)
class Chunk:
  """One chunk of steps as the actions after it see it (immutable).

  The first four fields are the chunk's; the rest are results of the
  actions, filled in as the controller threads the record through them:
  each action receives the record with what the actions before it
  produced, and returns what it produces (`Action.__call__`).

  Attributes:
    step: the last step of the chunk.
    first_step: the step before the chunk (`step - first_step` steps ran).
    epoch: the epoch the chunk trained in (0-based).
    output: the runner's `tfdist.training.step_runner.StepOutput`: the
      step sums (`loss`, the metrics' sums, `micro_steps`, timings) and
      the `StepSignals` every worker reduced.
    stop_requested: a callback of some worker asks to stop (from the
      signals; then from the batch-end and epoch-end hooks).
    saved: the checkpoint saved at `step`, or None.
    evaluation: the evaluation at `step` (`loss`, each metric,
      `num_examples`, `step`), or None.
    epoch_logs: the logs given to `on_epoch_end` when the chunk ended an
      epoch, else None.
    preempted: the checkpoint saved for a stop signal at an epoch end,
      which stops the run once that epoch has ended; None: no such stop.
    stopped_early: training stops here on a callback's request.
  """
  step: int
  first_step: int
  epoch: int
  output: step_runner.StepOutput
  stop_requested: bool = False
  saved: Optional[str] = None
  evaluation: Optional[dict] = None
  epoch_logs: Optional[dict] = None
  preempted: Optional[str] = None
  stopped_early: bool = False

  # What an action may produce (`Action.__call__`, `Action.on_diverged`).
  RESULTS = ("stop_requested", "saved", "evaluation", "epoch_logs",
             "preempted", "stopped_early")

  @property
  def num_steps(self) -> int:
    """Steps in the chunk."""
    return self.step - self.first_step


def with_results(record, action, produced: Optional[Mapping[str, Any]]):
  """`record` (a `Progress`, `StepRequest` or `Chunk`) with what `action`
  returned: None (nothing) or a mapping of some of `record.RESULTS` to
  their new values.

  Raises:
    TypeError: a return value that is no mapping, or names a field that
      is not a result of this hook (e.g. `step`).
  """
  if produced is None:
    return record
  kind = type(record).__name__
  if not isinstance(produced, Mapping):
    raise TypeError(
        f"{type(action).__name__} returned {produced!r}; an action returns "
        f"None or a dict of what it produces for the {kind}: "
        f"{', '.join(record.RESULTS)}.")
  unknown = sorted(set(produced) - set(record.RESULTS))
  if unknown:
    raise TypeError(
        f"{type(action).__name__} returned {', '.join(unknown)}, which no "
        f"action produces for the {kind}; it may produce "
        f"{', '.join(record.RESULTS)}.")
  return dataclasses.replace(record, **produced)


Produced = Optional[Dict[str, Any]]


class Action:
  """Side work of the outer loop; every hook is optional.

  Each hook receives an immutable record and returns what it produces:
  None, or a dict of the record's `RESULTS` fields with new values, which
  the controller puts into the record it gives the next action. So an
  action reads what the actions before it produced, and the order of the
  built-in ones (`Controller._make_actions`) is the order of that data.

  The controller calls, for each action in its order: `on_begin` once
  (after restoring), `boundaries` and `before_steps` before each chunk of
  steps, the action itself after each chunk, and `on_end` once when
  training ends normally (not on an error or a preemption).
  """

  def on_begin(self, progress: Progress) -> None:
    """Training starts at `progress.step`."""

  def boundaries(self, step: int) -> Sequence[int]:
    """Steps after `step` at which a chunk must end, beyond the
    controller's own (log, checkpoint, epoch, end)."""
    del step  # Unused.
    return ()

  def before_steps(self, progress: Progress) -> Produced:
    """The next chunk starts after `progress.step`; may return
    `StepRequest` fields (`{"stop_signal": True}`) to send with it."""

  def __call__(self, chunk: Chunk) -> Produced:
    """A chunk ended at `chunk.step`; may return `Chunk.RESULTS` fields
    (`{"saved": path}`)."""

  def on_end(self, progress: Progress) -> Produced:
    """Training ended at `progress.step`; may return `Progress.RESULTS`
    fields (`{"last_eval": None}`: evaluate again)."""

  def on_diverged(self, chunk: Chunk) -> Produced:
    """An action before this one raised a divergence error after `chunk`:
    end the epoch and the run as `fit` ends them (the run then raises that
    error); may return `Chunk.RESULTS` fields, as `__call__`."""


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

  def on_begin(self, progress):
    opts = self.options
    self.callbacks.set_params({
        "verbose": 0, "steps": opts.steps_per_epoch,
        "epochs": int(math.ceil(opts.total_steps / opts.steps_per_epoch))})
    if self.model is not None:
      self.model.stop_training = False
    self.callbacks.on_train_begin()
    callback_state_lib.after_train_begin(
        self.checkpoints.callback_state, self.callbacks.callbacks,
        resumed=progress.step > 0)

  def before_steps(self, progress):
    if not progress.epoch_begun:
      self.callbacks.on_epoch_begin(progress.epoch)
    self.callbacks.on_train_batch_begin(
        progress.step % self.options.steps_per_epoch)
    return {"stop_training": _wants_stop(self.model)}

  def on_end(self, progress):
    self.callbacks.on_train_end(progress.epoch_logs)
    restored_best = _restored_best_epoch(self.callbacks,
                                         last_epoch=progress.epoch - 1)
    if restored_best is None:
      return None
    # Epochs counted from 1, as EarlyStopping's own "best epoch: N".
    logging.info("EarlyStopping(restore_best_weights=True) restored the "
                 "weights of epoch %d: saving them as step %d's checkpoint "
                 "and evaluating them.", restored_best + 1, progress.step)
    self.checkpoints.save(progress.step)
    return {"last_eval": None}  # `Evaluate.on_end` evaluates them.


class ProfilerWindow(Action):
  """A `tfdist.observability.profiling.ProfileWindow`: its edges end chunks, so the trace
  holds exactly its steps."""

  def __init__(self, window):
    self.window = window

  def boundaries(self, step):
    return self.window.boundaries(step)

  def before_steps(self, progress):
    self.window.before_steps(progress.step)

  def __call__(self, chunk):
    self.window.after_steps(chunk.step)


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

  def __call__(self, chunk):
    loss = float(chunk.output.sums.get("loss", 0.0))
    if (not math.isfinite(loss) and
        not self.checkpoints.keeper.state_is_finite()):
      raise self.checkpoints.diverged(
          chunk.first_step, chunk.step, f"the training loss is "
          f"{float(chunk.output.sums['loss'])} and the model or optimizer "
          "state holds NaN or infinite values")


class SkippedStepWatch(Action):
  """Counts skipped steps; stops a run whose optimizer no longer updates
  (`tfdist.training.training_checks.SkippedStepMonitor`)."""

  def __init__(self, options: ControllerOptions,
               loss_scale: Callable[[], Optional[float]]):
    self.options = options
    self.loss_scale = loss_scale
    self.monitor = training_checks.SkippedStepMonitor(
        options.max_consecutive_skipped_steps)

  def on_begin(self, progress):
    self.monitor = training_checks.SkippedStepMonitor(
        self.options.max_consecutive_skipped_steps, start_step=progress.step)

  def __call__(self, chunk):
    signals = chunk.output.signals
    self.monitor.record_chunk(
        steps=chunk.num_steps, skipped=signals.skipped_steps,
        skipped_at_end=signals.skipped_steps_at_end,
        loss_scale=self.loss_scale)
    if self.options.is_last(chunk.step):
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

  def __call__(self, chunk):
    self._batch_end(chunk)
    if self.runner is None:
      return None
    return {"stop_requested": self.runner.agree(
        chunk.stop_requested or _wants_stop(self.model))}

  def on_diverged(self, chunk):
    # The hooks see the non-finite loss, as fit's do (TerminateOnNaN
    # decides there); the run stops whatever they set.
    self._batch_end(chunk)

  def _batch_end(self, chunk):
    if chunk.first_step % self.options.steps_per_epoch == 0:
      self.window.take()  # Keras resets its metrics at each epoch.
    self.window.add(chunk.output.sums, chunk.num_steps)
    sums, steps = self.window.sums, self.window.steps
    logs = (self.summarize(sums, steps) if self.summarize is not None else
            # A model's own train_step may log no loss (custom_step).
            {"loss": float(sums["loss"]) / steps} if "loss" in sums else {})
    self.callbacks.on_train_batch_end(
        (chunk.step - 1) % self.options.steps_per_epoch, logs)


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

  def __call__(self, chunk):
    self.window.add(chunk.output.sums, chunk.num_steps)
    step = chunk.step
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
          hold=self.evaluates and _evaluation_due(self.options, chunk))
    except errors.TrainingDivergedError as e:
      raise errors.TrainingDivergedError(
          f"{e} {self.checkpoints.kept_and_rerun()}") from e


class SaveCheckpoint(Action):
  """Saves every `checkpoint_steps` (or at each epoch end) and at the end."""

  def __init__(self, checkpoints: Checkpoints, options: ControllerOptions):
    self.checkpoints = checkpoints
    self.options = options

  def __call__(self, chunk):
    if not self.options.is_checkpoint_step(chunk.step):
      return None
    return {"saved": self.checkpoints.save(chunk.step)}


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

  def before_steps(self, progress):
    return {"stop_signal": self.watcher.signal_received()}

  def __call__(self, chunk):
    if (not chunk.output.signals.stop_signal or
        self.options.is_last(chunk.step)):
      return None
    self.watcher.note_peer_stop()
    path = chunk.saved or self.checkpoints.save(chunk.step)
    if self.options.is_epoch_end(chunk.step):
      return {"saved": path, "preempted": path}
    self.callbacks.on_train_end()
    raise self.watcher.preempted(step=chunk.step, checkpoint=path)


class PreemptionStopAfterEpoch(Action):
  """Raises the stop `PreemptionStop` deferred to the end of an epoch (the
  checkpoint `KerasEpochEnd` saved again, if it did, is the one named)."""

  def __init__(self, stop: PreemptionStop):
    self.stop = stop

  def __call__(self, chunk):
    if chunk.preempted is None:
      return
    path = chunk.saved or chunk.preempted
    self.stop.callbacks.on_train_end()
    raise self.stop.watcher.preempted(step=chunk.step, checkpoint=path)


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

  def __call__(self, chunk):
    if not _evaluation_due(self.options, chunk):
      return None
    return {"evaluation": (
        self.evaluate(chunk.step) if self.callbacks is None
        else self.evaluate(chunk.step, callbacks=self.callbacks))}

  def on_end(self, progress):
    if (progress.last_eval is not None and
        progress.last_eval["step"] == progress.step):
      return None
    return {"last_eval": self.evaluate(progress.step)}

  def on_diverged(self, chunk):
    # fit validates the epoch a stop cuts short (TerminateOnNaN's too),
    # with the non-finite weights: the same hooks, the same NaN logs.
    if (self.callbacks is None or not (
        (chunk.epoch + 1) % self.options.epochs_between_evals == 0 or
        self.options.is_last(chunk.step))):
      return None
    return {"evaluation": self.evaluate(chunk.step, callbacks=self.callbacks,
                                        check_loss=False)}


def _evaluation_due(options: ControllerOptions, chunk: Chunk) -> bool:
  """`Evaluate` evaluates after `chunk`."""
  return (((options.is_epoch_end(chunk.step) or chunk.stop_requested) and
           (chunk.epoch + 1) % options.epochs_between_evals == 0) or
          options.is_last(chunk.step))


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

  def __call__(self, chunk):
    self.window.add(chunk.output.sums, chunk.num_steps)
    step = chunk.step
    # An epoch ends at its last step, or where a stop request ends it (as
    # `fit` ends an epoch that a batch hook stops).
    if not (self.options.is_epoch_end(step) or self.options.is_last(step) or
            chunk.stop_requested):
      return None
    logs = self._epoch_logs(chunk)
    rate_before = self.checkpoints.learning_rate()
    self.callbacks.on_epoch_end(chunk.epoch, logs)
    produced = {"epoch_logs": logs}
    if chunk.saved is not None and (
        not _same_rate(rate_before, self.checkpoints.learning_rate()) or
        callback_state_lib.changed_since_save(
            self.checkpoints.callback_state)):
      produced["saved"] = self.checkpoints.save(step)
    produced["stop_requested"] = self.runner.agree(
        chunk.stop_requested or _wants_stop(self.model))
    return produced

  def on_diverged(self, chunk):
    # As fit ends a run that TerminateOnNaN stops: this epoch's
    # on_epoch_end (its logs hold the non-finite values), then
    # on_train_end with them (a CSVLogger closes its file). Nothing is
    # saved and the workers need not agree: the run raises on all alike.
    # The epoch is open: this action had not run for the chunk.
    self.window.add(chunk.output.sums, chunk.num_steps)
    logs = self._epoch_logs(chunk)
    self.callbacks.on_epoch_end(chunk.epoch, logs)
    self.callbacks.on_train_end(logs)
    return {"epoch_logs": logs}

  def _epoch_logs(self, chunk):
    """The epoch's metrics, with the chunk's evaluation as `val_*`."""
    logs = self.run_log.summarize(*self.window.take())
    if chunk.evaluation:
      logs.update({f"val_{k}": v for k, v in
                   run_log_lib.metric_values(chunk.evaluation).items()})
    return logs


class StopOnRequest(Action):
  """Stops, with a checkpoint, when a callback set `model.stop_training`
  (EarlyStopping, TerminateOnNaN): on every worker after the same step."""

  def __init__(self, checkpoints: Checkpoints, options: ControllerOptions):
    self.checkpoints = checkpoints
    self.options = options

  def __call__(self, chunk):
    if not chunk.stop_requested or self.options.is_last(chunk.step):
      return None
    logging.info("Stopping at step %d of %d (epoch %d, counted from 1 as "
                 "Keras's callbacks count it): a callback set "
                 "model.stop_training.", chunk.step, self.options.total_steps,
                 progress.epoch_of(chunk.step, self.options.steps_per_epoch))
    if chunk.saved is None:
      return {"saved": self.checkpoints.save(chunk.step),
              "stopped_early": True}
    return {"stopped_early": True}


def _wants_stop(model: Optional[keras.Model]) -> bool:
  return bool(model is not None and model.stop_training)


def _check_hooks_take_one_record(action: Action) -> None:
  """Raises `TypeError` when a hook of `action` cannot be called with one
  record (e.g. `__call__(self, state, output)`, an older signature)."""
  for name in ("on_begin", "before_steps", "__call__", "on_end",
               "on_diverged"):
    hook = getattr(action, name)
    try:
      inspect.signature(hook).bind(None)
    except TypeError:
      raise TypeError(
          f"Controller(train_actions=...): {type(action).__name__}.{name}"
          f"{inspect.signature(hook)} does not take one argument; each hook "
          "of an Action takes one immutable record (`Progress` for on_begin, "
          "before_steps and on_end; `Chunk` for __call__ and on_diverged: "
          "chunk.output is the step output) and returns what it produces. "
          "Write e.g. `def __call__(self, chunk):`.") from None
    except ValueError:
      pass  # No signature to read (a builtin): called as it is.


def _after(loop: Progress, chunk: Chunk) -> Progress:
  """Where the loop stands after `chunk` and its actions' results: the
  epoch begun before its steps, the next one once it produced
  `epoch_logs`."""
  ended = chunk.epoch_logs is not None
  return Progress(
      step=chunk.step, epoch=loop.epoch + 1 if ended else loop.epoch,
      epoch_begun=not ended,
      last_eval=(chunk.evaluation if chunk.evaluation is not None
                 else loop.last_eval),
      epoch_logs=chunk.epoch_logs if ended else loop.epoch_logs)


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
      `Action`: `Progress` between chunks, and after each chunk the
      `Chunk` record (its steps, `StepOutput`, and the built-in actions'
      results: `saved`, `evaluation`, `epoch_logs`, `stop_requested`,
      ...), once the controller's own work for that chunk (its log,
      checkpoint, evaluation and epoch end) is done.
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
      _check_hooks_take_one_record(action)
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

    Each action reads the `Chunk` fields that the ones before it produced
    (and returns its own), so the order is the order of that data:

    1. `KerasTrainHooks`: Keras's train, epoch-begin and batch-begin hooks;
       before the steps, produces `stop_training` (a batch hook's request)
       for the `StepRequest`; at the end, `last_eval=None` when
       EarlyStopping restored other weights (saved again).
    2. `ProfilerWindow` (with `--profile_steps`).
    3. `DivergenceCheck`: a non-finite loss stops here, before anything
       reads the chunk's metrics.
    4. `SkippedStepWatch`: fp16 steps skipped; reads the chunk's signals.
    5. `KerasBatchEnd`: Keras's batch-end hooks; produces `stop_requested`
       (agreed by every worker).
    6. `TrainLog`: the log line and scalars of a log point; reads
       `stop_requested` (a line held for this step's evaluation).
    7. `SaveCheckpoint`: produces `saved` at checkpoint boundaries.
    8. `PreemptionStop`: before the steps, produces `stop_signal`; after,
       reads `saved`, saves if needed, raises (at an epoch end: produces
       `saved` and `preempted` instead).
    9. `Evaluate`: reads `stop_requested`; produces `evaluation` at
       evaluation boundaries (at the end, `last_eval` when the last one is
       not of the last step).
    10. `KerasEpochEnd`: reads `evaluation` and `saved`; produces
        `epoch_logs`, `stop_requested` and, when a callback changed what a
        checkpoint holds, `saved` at epoch ends.
    11. `PreemptionStopAfterEpoch`: reads `preempted` and `saved`, raises.
    12. `StopOnRequest`: reads `stop_requested` and `saved`; produces
        `stopped_early` (and `saved`).

    The caller's `train_actions` follow, in their order, and receive the
    record with all of the above.
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
    loop = Progress(step=self.step,
                    epoch=self.step // self.options.steps_per_epoch)
    if restored:
      logging.info("tfdist: restored %s: resuming at step %d", restored,
                   loop.step)
    self.run_log.resume(loop.step)
    started = time.time()
    for action in self.actions:
      action.on_begin(loop)
    micro_steps = 0
    stopped_early = False
    while loop.step < self.options.total_steps and not stopped_early:
      chunk = self._run_chunk(loop)
      micro_steps += int(chunk.output.sums.get("micro_steps",
                                               chunk.num_steps))
      stopped_early = chunk.stopped_early
      loop = _after(loop, chunk)
    for action in self.actions:
      loop = with_results(loop, action, action.on_end(loop))
    self.run_log.flush()
    return ControllerResult(
        step=loop.step, final_eval=loop.last_eval,
        stopped_early=stopped_early, restored_from=restored,
        train_seconds=time.time() - started,
        skipped_steps=self.skipped.total_skipped,
        micro_steps=micro_steps)

  def _run_chunk(self, loop: Progress) -> Chunk:
    """Runs the steps up to the next boundary, then threads the chunk's
    record through every action; returns the record with their results."""
    extra = [b for action in self.actions for b in action.boundaries(
        loop.step)]
    num_steps = next_boundary(loop.step, self.options, extra) - loop.step
    if self.runner.max_steps_per_call:
      num_steps = min(num_steps, self.runner.max_steps_per_call)
    request = StepRequest()
    for action in self.actions:
      asked = with_results(StepRequest(), action, action.before_steps(loop))
      # Each request stands: one action's False clears none.
      request = StepRequest(
          stop_signal=request.stop_signal or asked.stop_signal,
          stop_training=request.stop_training or asked.stop_training)
    output = self.runner.run(num_steps, start_step=loop.step,
                             stop_signal=request.stop_signal,
                             stop_training=request.stop_training)
    self.step = loop.step + num_steps
    chunk = Chunk(step=self.step, first_step=loop.step, epoch=loop.epoch,
                  output=output,
                  stop_requested=output.signals.stop_training)
    for index, action in enumerate(self.actions):
      try:
        chunk = with_results(chunk, action, action(chunk))
      except errors.TrainingDivergedError:
        self._wind_down(chunk, self.actions[index + 1:])
        raise
    return chunk

  def _wind_down(self, chunk: Chunk, rest: Sequence[Action]) -> None:
    """After a divergence error of an action: the actions after it end the
    epoch and the run as `fit` ends a run that TerminateOnNaN stops
    (`Action.on_diverged`); the caller then raises the error. A failure
    here is logged and does not replace that error."""
    try:
      for action in rest:
        chunk = with_results(chunk, action, action.on_diverged(chunk))
    except Exception:  # pylint: disable=broad-except
      logging.exception("tfdist: ending the diverged run at step %d failed "
                        "(the divergence error follows):", chunk.step)

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
