"""The records the controller's actions exchange, and its options and result.

Every value that passes from one action to another passes in one of these
immutable records (`Progress` between chunks, `StepRequest` before one,
`Chunk` after one): an action returns what it produces (`with_results`), and
the controller gives the next action the record with it.
"""

import dataclasses
from typing import Dict, Optional, Sequence

import numpy as np

from tfdist.training.step import step_runner
from tfdist.training.step import training_checks


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


class SumsSince:
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
    output: the runner's `tfdist.training.step.step_runner.StepOutput`: the
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
    skipped_steps: steps of the chunk whose update was skipped (fp16
      gradients not finite), as `SkippedStepWatch` counted them.
    total_skipped: such steps of this run in this process so far,
      this chunk's included.
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
  skipped_steps: int = 0
  total_skipped: int = 0

  # What an action may produce (`Action.__call__`, `Action.on_diverged`).
  RESULTS = ("stop_requested", "saved", "evaluation", "epoch_logs",
             "preempted", "stopped_early", "skipped_steps", "total_skipped")

  @property
  def num_steps(self) -> int:
    """Steps in the chunk."""
    return self.step - self.first_step


def log_due(options: ControllerOptions, step: int) -> bool:
  """`step` is a log point: every `log_steps` steps, and the last step."""
  return not step % options.log_steps or options.is_last(step)


def evaluation_due(options: ControllerOptions, chunk: Chunk) -> bool:
  """`Evaluate` evaluates after `chunk`."""
  return (((options.is_epoch_end(chunk.step) or chunk.stop_requested) and
           (chunk.epoch + 1) % options.epochs_between_evals == 0) or
          options.is_last(chunk.step))
