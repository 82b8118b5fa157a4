"""Actions that stop a run whose training went wrong: a non-finite state, an
optimizer that no longer updates.
"""

import math
from typing import Callable, Optional

from tfdist.training.step import training_checks
from tfdist.training.controller.checkpoints import Checkpoints
from tfdist.training.controller.protocol import Action
from tfdist.training.controller.records import ControllerOptions


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
  (`tfdist.training.step.training_checks.SkippedStepMonitor`). Produces the
  chunk's skipped steps and the run's so far (`skipped_steps`,
  `total_skipped`) for the actions after it."""

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
    total_before = self.monitor.total_skipped
    self.monitor.record_chunk(
        steps=chunk.num_steps, skipped=signals.skipped_steps,
        skipped_at_end=signals.skipped_steps_at_end,
        loss_scale=self.loss_scale)
    if self.options.is_last(chunk.step):
      self.monitor.finish(loss_scale=self.loss_scale)
    return {"skipped_steps": self.monitor.total_skipped - total_before,
            "total_skipped": self.monitor.total_skipped}
