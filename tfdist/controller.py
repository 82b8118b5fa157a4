"""The outer loop: one controller for every strategy.

Orbit-style split: a step runner (`tfdist.step_runner`) runs steps (a local
call of the compiled step, or chunks scheduled on a `ClusterCoordinator`);
the `Controller` owns everything between steps, the same way for every
strategy:

* boundaries: it runs up to the next log, checkpoint, epoch or final step
  (and, for a local runner, at most `steps_per_execution` steps per call),
  so every boundary is hit exactly;
* logging (`tfdist.run_log.RunLog`: one formatter, one set of TensorBoard
  scalars, one divergence check);
* checkpoints (`tfdist.checkpointing.CheckpointKeeper`): restore at start,
  save every `checkpoint_steps` (or at each epoch end) and at the end;
* evaluation every `epochs_between_evals` epochs and at the end;
* Keras callbacks (`set_params`, train/epoch/batch hooks with Keras's logs,
  `model.stop_training` honoured: EarlyStopping, TerminateOnNaN);
* preemption (`tfdist.preemption.PreemptionWatcher`): a signal on any
  worker stops every worker after the same step, with a checkpoint;
* a profiler window (`tfdist.profiling.ProfileWindow`, `--profile_steps`):
  its edges are boundaries too, so the trace holds exactly those steps.

Where the time goes (examples/sec, step time, input wait, memory) is
logged at every log point by `tfdist.run_log.RunLog` from the step sums and
the host's clock: the controller adds no host synchronization of its own.

Stop requests (a signal, a callback's `model.stop_training`) ride with the
next chunk's step sums, which every worker reduces anyway, so workers agree
without a host synchronization of their own; at epoch ends, where callbacks
decide, one all-reduce of one number makes them agree (multi-worker only).

Skipped steps (fp16 updates skipped for a non-finite summed gradient) come
back from the compiled step with each chunk's sums; the controller logs
them and stops a run whose optimizer no longer updates
(`tfdist.training_checks.SkippedStepMonitor`). A non-finite training or
evaluation loss stops the run as diverged.

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

from tfdist import checkpointing
from tfdist import errors
from tfdist import run_log as run_log_lib
from tfdist import strict_json
from tfdist import training_checks
from tfdist.checkpoint_paths import checkpoint_step

EVAL_RESULTS_FILE = "eval_results.jsonl"
# Keys of the runner's sums that are not metrics.
_CONTROL_KEYS = ("stop_signal", "stop_training", "skipped_steps",
                 "skipped_steps_at_end")


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


def _add(total: Dict[str, np.ndarray], sums: Dict[str, np.ndarray]):
  for key, value in sums.items():
    if key not in _CONTROL_KEYS:
      total[key] = total.get(key, 0.0) + value


class Controller:
  """Trains to `total_steps` with any step runner; or evaluates checkpoints.

  Args:
    runner: a step runner (`LocalStepRunner` or `CoordinatorStepRunner`);
      None for an evaluation-only controller.
    options: a `ControllerOptions`.
    checkpoints: a `tfdist.checkpointing.CheckpointKeeper`; None for an
      evaluation-only controller.
    step_counter: the global step variable (read after restoring).
    run_log: the `tfdist.run_log.RunLog`.
    evaluate: a function returning one evaluation of the current weights
      (`{"loss", <metric>: value, ..., "num_examples"}`), or None.
    model: the Keras model (callbacks read it; `stop_training`).
    learning_rate: returns the current learning rate (float).
    loss_scale: returns the current loss scale, or None without one.
    callbacks: Keras callbacks.
    preemption: a `tfdist.preemption.PreemptionWatcher`, or None.
    profiler: a `tfdist.profiling.ProfileWindow`, or None.

  Raises:
    ValueError: `options` with a non-positive step count.
  """

  def __init__(self, *, runner=None, options: ControllerOptions,
               checkpoints=None, step_counter: Optional[tf.Variable] = None,
               run_log: run_log_lib.RunLog,
               evaluate: Optional[Callable[[], dict]] = None,
               model: Optional[keras.Model] = None,
               learning_rate: Callable[[], float] = lambda: float("nan"),
               loss_scale: Callable[[], Optional[float]] = lambda: None,
               callbacks: Sequence[keras.callbacks.Callback] = (),
               preemption=None, profiler=None):
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
    self.model = model
    self.learning_rate = learning_rate
    self.loss_scale = loss_scale
    self.preemption = preemption
    self.profiler = profiler
    self.callbacks = keras.callbacks.CallbackList(list(callbacks),
                                                  model=model)
    # The last step trained (while `run` runs, for error messages).
    self.step = 0
    self.skipped = training_checks.SkippedStepMonitor(
        options.max_consecutive_skipped_steps)

  # --- evaluation ------------------------------------------------------------
  def evaluate(self, step: int) -> Optional[dict]:
    """Evaluates the current weights; logs and returns the result."""
    if self.evaluate_fn is None:
      return None
    result = dict(self.evaluate_fn())
    result["step"] = step
    self.run_log.log_eval(step, result)
    training_checks.check_eval_loss(result["loss"], step=step)
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
      tfdist.preemption.PreemptedError: a stop signal reached this or
        another worker; a checkpoint at the step every worker stopped at was
        saved first.
      tfdist.run_log.DivergenceError: the training loss (checked after
        every chunk of steps) or the state to be saved (checked before every
        checkpoint) became NaN or infinite; nothing was saved after the last
        good checkpoint, which the message names.
      tfdist.parameter_server.ParameterServerError: (coordinator runner) a
        ps task was lost.
    """
    if self.runner is None or self.checkpoints is None:
      raise ValueError("Controller.run needs a runner and checkpoints; this "
                       "controller was built for evaluation only.")
    try:
      return self._run()
    finally:
      if self.profiler is not None:
        self.profiler.stop()  # Training stopped inside the window.

  def _run(self) -> ControllerResult:
    opts = self.options
    restored = self.checkpoints.restore()
    step = self._current_step()
    self.step = step
    if restored:
      logging.info("tfdist: restored %s: resuming at step %d", restored, step)
    self.run_log.resume(step)
    self.skipped = training_checks.SkippedStepMonitor(
        opts.max_consecutive_skipped_steps, start_step=step)
    started = time.time()
    self.callbacks.set_params({
        "verbose": 0, "steps": opts.steps_per_epoch,
        "epochs": int(math.ceil(opts.total_steps / opts.steps_per_epoch))})
    if self.model is not None:
      self.model.stop_training = False
    self.callbacks.on_train_begin()
    epoch = step // opts.steps_per_epoch
    epoch_sums: Dict[str, np.ndarray] = {}
    epoch_steps = 0
    log_sums: Dict[str, np.ndarray] = {}
    log_steps = 0
    last_eval, stopped_early, epoch_open = None, False, False
    micro_steps = 0
    while step < opts.total_steps:
      if not epoch_open:
        self.callbacks.on_epoch_begin(epoch)
        epoch_open = True
      boundary = next_boundary(
          step, opts, self.profiler.boundaries(step) if self.profiler else ())
      n = boundary - step
      if self.runner.max_steps_per_call:
        n = min(n, self.runner.max_steps_per_call)
      self.callbacks.on_train_batch_begin(step % opts.steps_per_epoch)
      wants_stop = bool(self.model is not None and self.model.stop_training)
      if self.profiler is not None:
        self.profiler.before_steps(step)
      sums = self.runner.run(
          n, start_step=step,
          stop_signal=bool(self.preemption and
                           self.preemption.signal_received()),
          stop_training=wants_stop)
      step += n
      self.step = step
      if self.profiler is not None:
        self.profiler.after_steps(step)
      micro_steps += int(sums.get("micro_steps", n))
      # The chunk's summed loss is NaN or infinite when any of its steps'
      # was (read from the sums every worker already has). Only then is the
      # state checked (one compiled reduction): NaN weights stop the run at
      # once, with nothing saved after the last good checkpoint; a finite
      # state (an fp16 step skipped, a callback such as TerminateOnNaN
      # deciding) goes on.
      if (not math.isfinite(float(sums.get("loss", 0.0))) and
          not self.checkpoints.state_is_finite()):
        raise self._diverged(step - n, step, f"the training loss is "
                             f"{float(sums['loss'])} and the model or "
                             "optimizer state holds NaN or infinite values")
      self.skipped.record_chunk(
          steps=n, skipped=float(sums.get("skipped_steps", 0.0)),
          skipped_at_end=float(sums.get("skipped_steps_at_end", 0.0)),
          loss_scale=self.loss_scale)
      if step == opts.total_steps:
        self.skipped.finish(loss_scale=self.loss_scale)
      _add(epoch_sums, sums)
      _add(log_sums, sums)
      epoch_steps += n
      log_steps += n
      self.callbacks.on_train_batch_end(
          (step - 1) % opts.steps_per_epoch,
          {"loss": float(sums["loss"]) / n})
      if step % opts.log_steps == 0 or step == opts.total_steps:
        try:
          self.run_log.log_train(step, log_sums, log_steps,
                                 learning_rate=self.learning_rate(),
                                 loss_scale=self.loss_scale(),
                                 skipped_steps=self.skipped.take_interval(),
                                 total_skipped=self.skipped.total_skipped)
        except run_log_lib.DivergenceError as e:
          raise run_log_lib.DivergenceError(
              f"{e} {self._kept_and_rerun()}") from e
        log_sums, log_steps = {}, 0
      epoch_end = step % opts.steps_per_epoch == 0
      saved = None
      if ((opts.checkpoint_steps and step % opts.checkpoint_steps == 0) or
          (not opts.checkpoint_steps and epoch_end) or
          step == opts.total_steps):
        saved = self._save(step)
      if float(sums.get("stop_signal", 0)) > 0 and step < opts.total_steps:
        if self.preemption is not None:
          self.preemption.note_peer_stop()
        path = saved or self._save(step)
        self.callbacks.on_train_end()
        raise self.preemption.preempted(step=step, checkpoint=path)
      stop_requested = float(sums.get("stop_training", 0)) > 0
      if epoch_end or step == opts.total_steps:
        logs = self.run_log.summarize(epoch_sums, epoch_steps)
        if ((epoch + 1) % opts.epochs_between_evals == 0 or
            step == opts.total_steps):
          last_eval = self.evaluate(step)
          if last_eval:
            logs.update({f"val_{k}": v for k, v in
                         run_log_lib.metric_values(last_eval).items()})
        rate_before = self.learning_rate()
        self.callbacks.on_epoch_end(epoch, logs)
        if saved is not None and not _same_rate(rate_before,
                                                self.learning_rate()):
          # A learning-rate callback (ReduceLROnPlateau) changed the rate
          # after this step's checkpoint: save again, so a resume from it
          # trains on with the new rate.
          saved = self._save(step)
        epoch_open = False
        epoch += 1
        epoch_sums, epoch_steps = {}, 0
        wants_stop = bool(self.model is not None and self.model.stop_training)
        stop_requested = self.runner.agree(stop_requested or wants_stop)
      if stop_requested and step < opts.total_steps:
        logging.info("Stopping at step %d of %d: a callback set "
                     "model.stop_training.", step, opts.total_steps)
        if saved is None:
          self._save(step)
        stopped_early = True
        break
    self.callbacks.on_train_end()
    restored_best = _restored_best_epoch(self.callbacks, last_epoch=epoch - 1)
    if restored_best is not None:
      # The weights now are another epoch's than the checkpoint just saved
      # and the last evaluation: save and evaluate them, so the final
      # checkpoint, the export and the manifest hold one answer.
      logging.info("EarlyStopping(restore_best_weights=True) restored the "
                   "weights of epoch %d: saving them as step %d's checkpoint "
                   "and evaluating them.", restored_best, step)
      self._save(step)
      last_eval = None
    if last_eval is None or last_eval["step"] != step:
      last_eval = self.evaluate(step)
    self.run_log.flush()
    return ControllerResult(step=step, final_eval=last_eval,
                            stopped_early=stopped_early,
                            restored_from=restored,
                            train_seconds=time.time() - started,
                            skipped_steps=self.skipped.total_skipped,
                            micro_steps=micro_steps)

  def _save(self, step: int) -> str:
    """Saves through the keeper; a non-finite state is divergence."""
    try:
      return self.checkpoints.save(step)
    except checkpointing.NonFiniteStateError as e:
      raise self._diverged(None, step, "the model or optimizer state holds "
                           "NaN or infinite values") from e

  def _diverged(self, first: Optional[int], step: int,
                what: str) -> run_log_lib.DivergenceError:
    """The one divergence error: what went wrong, where, the last good
    checkpoint (kept: nothing was saved after it) and what to change."""
    where = f"at step {step}" + (
        f" (in steps {first + 1}-{step})"
        if first is not None and first + 1 < step else "")
    return run_log_lib.DivergenceError(
        f"Training diverged {where}: {what}. " +
        run_log_lib.divergence_advice(
            loss_scaled=self.loss_scale() is not None,
            learning_rate=self.learning_rate()) +
        f" {self._kept_and_rerun()}")

  def _kept_and_rerun(self) -> str:
    """Which checkpoint survives a divergence and what a rerun does."""
    last_good = self.checkpoints.latest
    if last_good:
      return (f"No checkpoint was saved after it went wrong: the last good "
              f"checkpoint, {last_good}, is kept, and a rerun with the same "
              f"--model_dir resumes from it.")
    return ("It diverged before its first checkpoint: a rerun with the same "
            "--model_dir starts from step 0.")

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
    results_path = os.path.join(results_dir, EVAL_RESULTS_FILE)
    results, done = [], set()
    if tf.io.gfile.exists(results_path):
      with tf.io.gfile.GFile(results_path) as f:
        for line in f:
          if line.strip():
            results.append(json.loads(line))
            done.add(results[-1]["step"])
    seen_paths = set()
    last_new = time.time()
    logging.info("Evaluator: watching %s (final step %d)", checkpoint_dir,
                 final_step)
    while True:
      state = tf.train.get_checkpoint_state(checkpoint_dir)
      paths = list(state.all_model_checkpoint_paths) if state else []
      for path in sorted(seen_paths - set(paths), key=checkpoint_step):
        if checkpoint_step(path) not in done:
          logging.warning(
              "Evaluator: checkpoint %s was rotated away (--max_checkpoints)"
              " before it could be evaluated; step %d has no evaluation.",
              path, checkpoint_step(path))
          done.add(checkpoint_step(path))
      seen_paths.update(paths)
      todo = sorted((p for p in paths if checkpoint_step(p) not in done),
                    key=checkpoint_step)
      for path in todo:
        step = checkpoint_step(path)
        try:
          restore(path)
        except (tf.errors.NotFoundError, tf.errors.DataLossError) as e:
          logging.warning(
              "Evaluator: checkpoint %s was deleted (rotated away by "
              "--max_checkpoints) before it could be evaluated: %s", path,
              errors.first_line(e, default=type(e).__name__))
          done.add(step)
          continue
        result = self.evaluate(step)
        result.update(checkpoint=path)
        append_eval_result(results_dir, result)
        self.run_log.flush()
        results.append(result)
        done.add(step)
        last_new = time.time()
      if final_step in done:
        break
      if finished() and not todo:
        state = tf.train.get_checkpoint_state(checkpoint_dir)
        latest = state.model_checkpoint_path if state else None
        if latest is None or checkpoint_step(latest) in done:
          break
        continue
      if idle_timeout is not None and time.time() - last_new > idle_timeout:
        logging.warning("Evaluator: no new checkpoint for %.0f s; stopping.",
                        idle_timeout)
        break
      time.sleep(poll_seconds)
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
