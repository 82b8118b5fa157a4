"""Checks the outer loop runs between chunks of steps: loud, not silent.

The compiled step (`tfdist.training.step.train_loop.Trainer.train_function`)
returns, with each chunk's sums, how many steps it skipped (fp16: the summed
gradient was not finite, so the `LossScaleOptimizer` made no update) and how
many of the chunk's last steps in a row were skipped. From those, with no extra
host synchronization, `SkippedStepMonitor` counts skipped steps for the log and
the manifest and stops a run whose optimizer has stopped updating:

* `--max_consecutive_skipped_steps=N` (default 100) steps in a row skipped
  fail the run. A dynamic loss scale skips a few steps in a row while it
  settles (each skip halves the scale: 2^15 falls to 1 in 15 skips) and one
  step after each doubling; 100 skips in a row divide the scale by 2^100,
  which no healthy run does. A fixed `--loss_scale` that overflows skips
  every step.
* A run that made no update at all fails at its end, however short.

`check_eval_loss` treats a non-finite evaluation loss as divergence, or,
when the weights are finite, warns that the evaluation data is the likely
cause (training goes on, as in `fit`).
`check_steps_per_execution` warns when a model compiled with Keras's
`steps_per_execution` meets tfdist's own setting, `check_jit_compile` when
one compiled with `jit_compile=True` meets a run without `--enable_xla`. The
errors (`TrainingStalledError`, `TrainingDivergedError`: status 1) live in
`tfdist.errors`, `json_safe` in `tfdist.runtime.strict_json`; both are exported
here too.
"""

import math
from typing import Callable, Optional

from absl import logging

from tfdist import errors
# The setting's default lives with the setting (the configuration is below
# training); named here too for the monitor's callers.
from tfdist.config import DEFAULT_MAX_CONSECUTIVE_SKIPPED_STEPS  # noqa: F401
from tfdist.runtime.strict_json import json_safe  # noqa: F401


class SkippedStepMonitor:
  """Counts skipped steps and stops a run whose optimizer does not update.

  Args:
    max_consecutive_skipped_steps: fail once this many steps in a row were
      skipped (`--max_consecutive_skipped_steps`; 0: never, except that a
      run with no update at all still fails at its end).
    start_step: the global step the run starts (or resumes) from.

  Raises:
    ValueError: `max_consecutive_skipped_steps` < 0.
  """

  def __init__(self, max_consecutive_skipped_steps: int =
               DEFAULT_MAX_CONSECUTIVE_SKIPPED_STEPS, *, start_step: int = 0):
    if max_consecutive_skipped_steps < 0:
      raise ValueError(
          "--max_consecutive_skipped_steps="
          f"{max_consecutive_skipped_steps} must be >= 0 (0: no limit).")
    self.max_consecutive = int(max_consecutive_skipped_steps)
    self.start_step = int(start_step)
    self.step = int(start_step)
    self.total_skipped = 0
    self.consecutive = 0
    self.interval_skipped = 0  # Since the last `take_interval`.

  def record_chunk(self, *, steps: int, skipped: float,
                   skipped_at_end: float,
                   loss_scale: Optional[Callable[[], Optional[float]]] = None):
    """Adds one chunk's counts (from the compiled step's outputs).

    Args:
      steps: steps the chunk ran.
      skipped: steps of the chunk whose update was skipped.
      skipped_at_end: how many of the chunk's last steps in a row were
        skipped (`steps` when all were).
      loss_scale: returns the current fp16 loss scale (or None), for the
        error message; called only when raising.

    Raises:
      TrainingStalledError: `max_consecutive_skipped_steps` steps in a row
        were skipped.
    """
    skipped, skipped_at_end = int(round(skipped)), int(round(skipped_at_end))
    self.step += int(steps)
    self.total_skipped += skipped
    self.interval_skipped += skipped
    if skipped_at_end >= steps:
      self.consecutive += int(steps)
    else:
      self.consecutive = skipped_at_end
    if self.max_consecutive and self.consecutive >= self.max_consecutive:
      raise errors.TrainingStalledError(self._message(
          f"for the last {self.consecutive} steps in a row (steps "
          f"{self.step - self.consecutive + 1}-{self.step})", loss_scale) +
                                 " The limit is --max_consecutive_skipped_"
                                 f"steps={self.max_consecutive}.")

  def take_interval(self) -> int:
    """Skipped steps since the last call (for the periodic log line)."""
    out, self.interval_skipped = self.interval_skipped, 0
    return out

  def finish(self,
             loss_scale: Optional[Callable[[], Optional[float]]] = None):
    """Call when the run's last step is done (`loss_scale` as in
    `record_chunk`).

    Raises:
      TrainingStalledError: the run took steps but skipped every one.
    """
    ran = self.step - self.start_step
    if ran > 0 and self.total_skipped >= ran:
      raise errors.TrainingStalledError(self._message(
          f"at any of this run's {ran} steps (steps {self.start_step + 1}-"
          f"{self.step})", loss_scale))

  def _message(self, when: str, loss_scale) -> str:
    value = loss_scale() if loss_scale is not None else None
    scale = f" at loss scale {value:g}" if value is not None else ""
    return (f"Training stalled: the optimizer made no update {when}: every "
            f"step's summed gradient was not finite{scale} (float16 "
            "overflow), so the step was skipped. With a fixed --loss_scale, "
            "lower it or use --loss_scale=dynamic; otherwise lower "
            "--base_learning_rate, add warmup, or use --dtype=bf16 or fp32.")


def check_eval_loss(loss: float, *, step: int,
                    state_is_finite: Optional[bool] = None) -> bool:
  """Checks an evaluation loss; returns whether it is finite.

  A NaN or infinite loss while the model's state is finite comes from the
  evaluation data (or outputs that overflow on it), not from training:
  as `keras.Model.fit` does, the run goes on (the value is reported as it
  is), with a warning that names the data as the likely cause.

  Args:
    loss: the evaluation loss.
    step: the training step evaluated.
    state_is_finite: whether the model and optimizer state was finite when
      evaluated (None: not checked).

  Raises:
    TrainingDivergedError: (status 1) the loss is NaN or infinite and the
      state is not known to be finite: a model whose weights overflowed
      predicts inf or NaN; that is divergence, not a result to report.
  """
  if math.isfinite(loss):
    return True
  if state_is_finite:
    logging.warning(
        "tfdist: the evaluation loss at step %d is %s while the model's "
        "weights and optimizer state are finite, so the evaluation data is "
        "the likely cause: NaN or infinite features, labels or sample "
        "weights in --eval_files (or the evaluation split of your dataset "
        "function or validation data), or inputs on which the model's "
        "outputs overflow (with --dtype=fp16, try --dtype=fp32). Training "
        "goes on, as keras.Model.fit's does. Find those examples with "
        "tf.debugging.check_numerics(tensor, name) on each feature and "
        "label in your parse_fn or dataset function, then fix or drop "
        "them.", step, loss)
    return False
  raise errors.TrainingDivergedError(
      f"Training diverged: the evaluation loss at step {step} is {loss}. "
      "Lower --base_learning_rate, add warmup, or use --dtype=fp32.")


def check_steps_per_execution(model, *, steps_per_execution: int,
                              model_name: str = "the model") -> bool:
  """Warns when `model.compile(steps_per_execution=N)` asked for another N
  than tfdist's `--steps_per_execution`, which is what tfdist runs.

  Both settings only group steps into one `tf.function` call (and the
  batch hooks of callbacks into one call per group): the steps, their
  order and the weights are the same either way.

  Args:
    model: the built Keras model (compiled or not).
    steps_per_execution: the run's `--steps_per_execution`.
    model_name: how the warning names the model.

  Returns:
    Whether it warned.
  """
  compiled = getattr(model, "steps_per_execution", 1) or 1
  if int(compiled) in (1, int(steps_per_execution)):
    return False
  logging.warning(
      "%s was compiled with steps_per_execution=%d, which tfdist does not "
      "read: it runs --steps_per_execution=%d steps per call (the weights "
      "are the same: the steps run in the same order). Set "
      "--steps_per_execution=%d (TrainConfig(steps_per_execution=%d)) to "
      "group them as compile asked.", model_name, int(compiled),
      int(steps_per_execution), int(compiled), int(compiled))
  return True


def check_jit_compile(model, *, enable_xla: bool,
                      model_name: str = "the model") -> bool:
  """Warns when the model was compiled with `jit_compile=True` and the run
  does not compile with XLA: tfdist runs its own step, which reads
  `--enable_xla`, not the model's `jit_compile`.

  Keras resolves `jit_compile="auto"` (compile's default) when compiling:
  to False on a CPU-only machine and under a `tf.distribute` strategy, to
  True on a GPU outside one; so a model compiled on a GPU outside the
  strategy's scope is warned about too.

  Args:
    model: the built Keras model (compiled or not).
    enable_xla: the run's `--enable_xla`.
    model_name: how the warning names the model.

  Returns:
    Whether it warned.
  """
  if enable_xla or not getattr(model, "compiled", False):
    return False
  if getattr(model, "_jit_compile", None) is not True:
    return False
  logging.warning(
      "%s was compiled with jit_compile=True, which tfdist does not read: "
      "tfdist compiles its own training step, with XLA only under "
      "--enable_xla (now off). Set --enable_xla (TrainConfig(enable_xla="
      "True)) to compile the step with XLA, or compile with "
      "jit_compile=False to silence this.", model_name)
  return True
