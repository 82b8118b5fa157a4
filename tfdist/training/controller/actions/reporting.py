"""Actions that report: the log line and scalars, the mixture-of-experts
routing, the profiler window.
"""

from tfdist import errors
from tfdist.observability import run_log as run_log_lib
from tfdist.parallel.experts import layer as moe_layer
from tfdist.training.controller.checkpoints import Checkpoints
from tfdist.training.controller.protocol import Action
from tfdist.training.controller.records import ControllerOptions
from tfdist.training.controller.records import SumsSince
from tfdist.training.controller.records import evaluation_due
from tfdist.training.controller.records import log_due


class RoutingLog(Action):
  """Logs the routing of every `tfdist.MixtureOfExperts` in the model at
  each log point (`log_steps`, and the last step): the slots each expert
  kept, the dropped fraction and the two auxiliary losses of that step's
  batch (`RunLog.log_routing`: a line and TensorBoard scalars). Reads
  nothing from the record, produces nothing. The controller adds it only
  for a model with such layers (`moe_layers`)."""

  def __init__(self, run_log: run_log_lib.RunLog, layers, *,
               options: ControllerOptions):
    self.run_log = run_log
    self.layers = list(layers)
    self.options = options

  def __call__(self, chunk):
    step = chunk.step
    if not log_due(self.options, step):
      return
    statistics = moe_layer.routing_statistics_of(self.layers)
    self.run_log.log_routing(
        step, {key: value.numpy() for key, value in statistics.items()})


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


class TrainLog(Action):
  """Logs loss, learning rate, skipped steps and throughput every
  `log_steps` steps and at the end
  (`tfdist.observability.run_log.RunLog.log_train`); a line followed by an
  evaluation at its step (`evaluates`) is held and logged with it, as one
  line.

  The skipped steps come from the records (`Chunk.skipped_steps` and
  `Chunk.total_skipped`, produced by `SkippedStepWatch`): this action sums
  the chunks' counts over its own log interval."""

  def __init__(self, run_log: run_log_lib.RunLog, *,
               options: ControllerOptions, checkpoints: Checkpoints,
               evaluates: bool = False):
    self.run_log = run_log
    self.options = options
    self.checkpoints = checkpoints
    self.evaluates = evaluates
    self.window = SumsSince()
    self.skipped_since_log = 0

  def __call__(self, chunk):
    self.window.add(chunk.output.sums, chunk.num_steps)
    self.skipped_since_log += chunk.skipped_steps
    step = chunk.step
    if not log_due(self.options, step):
      return
    sums, steps = self.window.take()
    skipped, self.skipped_since_log = self.skipped_since_log, 0
    try:
      self.run_log.log_train(
          step, sums, steps,
          learning_rate=self.checkpoints.learning_rate(),
          loss_scale=self.checkpoints.loss_scale(),
          skipped_steps=skipped, total_skipped=chunk.total_skipped,
          hold=self.evaluates and evaluation_due(self.options, chunk))
    except errors.TrainingDivergedError as e:
      raise errors.TrainingDivergedError(
          f"{e} {self.checkpoints.kept_and_rerun()}") from e
