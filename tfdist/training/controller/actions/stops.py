"""Actions that stop the run: a stop signal (preemption), a callback's
request.
"""

from absl import logging
import keras

from tfdist.observability import progress
from tfdist.training.controller.checkpoints import Checkpoints
from tfdist.training.controller.protocol import Action
from tfdist.training.controller.records import ControllerOptions


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
  checkpoint `KerasEpochEnd` saved again, if it did, is the one named).

  It learns of the deferred stop from the record alone (`Chunk.preempted`);
  the watcher and the callbacks are its own arguments, the same ones
  `PreemptionStop` is given.

  Args:
    watcher: the `tfdist.runtime.preemption.PreemptionWatcher` (its
      `preempted` error is raised).
    callbacks: the callbacks, given `on_train_end` before the error.
  """

  def __init__(self, watcher, *, callbacks: keras.callbacks.CallbackList):
    self.watcher = watcher
    self.callbacks = callbacks

  def __call__(self, chunk):
    if chunk.preempted is None:
      return
    path = chunk.saved or chunk.preempted
    self.callbacks.on_train_end()
    raise self.watcher.preempted(step=chunk.step, checkpoint=path)


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
