"""The controller's checkpoint service: saves through a `CheckpointKeeper`
and words divergence errors (shared by the actions that save or stop).
"""

from typing import Callable, Optional

from tfdist import errors
from tfdist.observability import run_log as run_log_lib
from tfdist.training.state.checkpoint_paths import checkpoint_step


class Checkpoints:
  """Saves through a `CheckpointKeeper`, and words divergence errors.

  Args:
    keeper: the `tfdist.training.state.checkpointing.CheckpointKeeper`.
    learning_rate: returns the current learning rate (float).
    loss_scale: returns the current loss scale, or None without one.
    nonfinite_input: `(after_step, step) -> str or None`
      (`StepRunner.nonfinite_input`): what in the training batches of
      steps `after_step + 1 .. step` (`after_step` None: since the input
      started) is NaN or infinite, re-read after a divergence; None: not
      checked.
    callback_state: the `tfdist.training.state.callback_state.CallbackState`
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
