"""Actions due at boundaries: the checkpoint and the evaluation.
"""

from typing import Callable, Optional

import keras

from tfdist.training.controller.checkpoints import Checkpoints
from tfdist.training.controller.protocol import Action
from tfdist.training.controller.records import ControllerOptions
from tfdist.training.controller.records import evaluation_due


class SaveCheckpoint(Action):
  """Saves every `checkpoint_steps` (or at each epoch end) and at the end."""

  def __init__(self, checkpoints: Checkpoints, options: ControllerOptions):
    self.checkpoints = checkpoints
    self.options = options

  def __call__(self, chunk):
    if not self.options.is_checkpoint_step(chunk.step):
      return None
    return {"saved": self.checkpoints.save(chunk.step)}


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
    if not evaluation_due(self.options, chunk):
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
