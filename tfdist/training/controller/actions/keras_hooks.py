"""Actions that call Keras's callbacks as `fit` calls them: train, epoch
and batch hooks, `model.stop_training`.
"""

import math
from typing import Callable, Optional

from absl import logging
import keras

from tfdist.observability import run_log as run_log_lib
from tfdist.training.state import callback_state as callback_state_lib
from tfdist.training.state import keras_callbacks
from tfdist.training.step import step_runner
from tfdist.training.controller.checkpoints import Checkpoints
from tfdist.training.controller.protocol import Action
from tfdist.training.controller.records import ControllerOptions
from tfdist.training.controller.records import SumsSince


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
    self.window = SumsSince()

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


class KerasEpochEnd(Action):
  """Keras's `on_epoch_end` with the epoch's metrics (and this step's
  evaluation as `val_*`); then every worker agrees on a stop request.

  A learning-rate callback (ReduceLROnPlateau) that changed the rate after
  this step's checkpoint, or a callback whose kept state changed
  (`tfdist.training.state.callback_state`), has it saved again, so a resume from
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
    self.window = SumsSince()

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


def _wants_stop(model: Optional[keras.Model]) -> bool:
  return bool(model is not None and model.stop_training)


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
