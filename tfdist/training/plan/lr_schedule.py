"""Learning-rate scaling and warmup schedules.

Two rules scale the base learning rate, tuned at `base_batch_size`, to the
global batch actually used:

* linear: `peak = base_lr * global_batch / base_batch` (Goyal et al. 2017,
  "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour"), for SGD;
* sqrt: `peak = base_lr * sqrt(global_batch / base_batch)` (Malladi et al.
  2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms"),
  for Adam-type optimizers.

`LinearWarmup` then ramps linearly from a start value to the peak over the
warmup steps (Goyal et al.'s "gradual warmup") and hands over to a decay
schedule. Every schedule here is a `keras.optimizers.schedules.
LearningRateSchedule` with a complete `get_config`, so it is evaluated from
the optimizer's own step counter: no callback assigns a variable, which keeps
it correct under ParameterServerStrategy (no per-step read of one ps).
"""

import dataclasses
import math
from typing import Optional, Sequence, Tuple

import keras
import tensorflow as tf

from tfdist import config as config_lib
from tfdist import errors
from tfdist.training.plan import batch_plan
from tfdist.core import constant_schedule
from tfdist.core import decay_schedules

LearningRateSchedule = keras.optimizers.schedules.LearningRateSchedule


def scale_learning_rate(base_learning_rate: float, *, global_batch_size: int,
                        base_batch_size: int, rule: str) -> float:
  """Scales a learning rate tuned at `base_batch_size` to `global_batch_size`.

  Args:
    base_learning_rate: LR (per step) tuned for `base_batch_size` examples.
    global_batch_size: examples per optimizer update in this run.
    base_batch_size: the batch size `base_learning_rate` was tuned for.
    rule: `linear` (Goyal et al. 2017), `sqrt` (Malladi et al. 2022) or `none`.

  Returns:
    The peak learning rate (float).

  Raises:
    ConfigError: unknown rule or non-positive sizes.
  """
  if global_batch_size <= 0 or base_batch_size <= 0:
    raise errors.ConfigError(
        f"Batch sizes must be > 0 (global_batch_size={global_batch_size}, "
        f"--base_batch_size={base_batch_size}).")
  ratio = global_batch_size / base_batch_size
  if rule == "linear":
    return base_learning_rate * ratio
  if rule == "sqrt":
    return base_learning_rate * math.sqrt(ratio)
  if rule == "none":
    return base_learning_rate
  raise errors.ConfigError(
      f"--lr_scaling={rule!r} is unknown. Use linear, sqrt or none.")


# Defined apart so that the light decay registry can build it.
ConstantLearningRate = constant_schedule.ConstantLearningRate


@keras.saving.register_keras_serializable(package="tfdist")
class LinearWarmup(LearningRateSchedule):
  """Linear warmup to `peak_learning_rate`, then a wrapped decay schedule.

  For step `s` (the optimizer's update count, starting at 0):

      s <  warmup_steps:  lr = warmup_start_learning_rate
                               + (peak_learning_rate -
                               warmup_start_learning_rate)
                               * s / warmup_steps
      s >= warmup_steps:  lr = after_warmup(s - warmup_steps)

  so the decay schedule starts from its own step 0 when warmup ends (its
  initial value should be `peak_learning_rate`). `warmup_steps=0` means no
  warmup. Source: Goyal et al. 2017, section 2.2 ("gradual warmup").

  Args:
    after_warmup: a `LearningRateSchedule` (or a float) used after warmup.
    warmup_steps: steps of linear warmup (>= 0).
    peak_learning_rate: the value reached at the end of warmup.
    warmup_start_learning_rate: the value at step 0. Defaults to 0.

  Raises:
    ValueError: `warmup_steps` < 0 or a negative learning rate.
  """

  def __init__(self, after_warmup, warmup_steps: int,
               peak_learning_rate: float,
               warmup_start_learning_rate: float = 0.0):
    if warmup_steps < 0:
      raise ValueError(f"warmup_steps must be >= 0. Received: {warmup_steps}")
    if peak_learning_rate < 0 or warmup_start_learning_rate < 0:
      raise ValueError(
          "Learning rates must be >= 0. Received: peak_learning_rate="
          f"{peak_learning_rate}, warmup_start_learning_rate="
          f"{warmup_start_learning_rate}")
    if isinstance(after_warmup, dict):
      after_warmup = keras.saving.deserialize_keras_object(after_warmup)
    if isinstance(after_warmup, (int, float)):
      after_warmup = ConstantLearningRate(after_warmup)
    self.after_warmup = after_warmup
    self.warmup_steps = int(warmup_steps)
    self.peak_learning_rate = float(peak_learning_rate)
    self.warmup_start_learning_rate = float(warmup_start_learning_rate)

  def __call__(self, step):
    step = tf.cast(step, tf.float32)
    decayed = tf.cast(
        self.after_warmup(tf.maximum(step - self.warmup_steps, 0.0)),
        tf.float32)
    if self.warmup_steps == 0:
      return decayed
    fraction = step / float(self.warmup_steps)
    warm = (self.warmup_start_learning_rate +
            (self.peak_learning_rate - self.warmup_start_learning_rate) *
            fraction)
    return tf.where(step < self.warmup_steps, warm, decayed)

  def get_config(self):
    return {
        "after_warmup": keras.saving.serialize_keras_object(self.after_warmup),
        "warmup_steps": self.warmup_steps,
        "peak_learning_rate": self.peak_learning_rate,
        "warmup_start_learning_rate": self.warmup_start_learning_rate,
    }


@keras.saving.register_keras_serializable(package="tfdist")
class AdjustableLearningRate:
  """tfdist's schedule times a factor that Keras's learning-rate callbacks
  set: `lr(step) = schedule(step) * multiplier`.

  Given to a Keras optimizer as its `learning_rate` (a callable, not a
  `LearningRateSchedule`), it makes `optimizer.learning_rate = value`
  work, which `keras.callbacks.ReduceLROnPlateau` and
  `LearningRateScheduler` do: the setter calls `assign(value)`, which sets
  `multiplier = value / schedule(step)` at the optimizer's current step, so
  the rate is `value` now and the schedule's shape (warmup, decay) scales
  by that factor from there. `multiplier` is a float32 scalar variable
  created under the strategy's scope and saved in tfdist's checkpoints: a
  resumed run keeps the rate the callbacks chose. Under synchronous
  multi-worker strategies every worker runs the callbacks on the same
  (reduced) logs and so sets the same value; under parameter servers the
  coordinator alone runs them and the variable lives on a ps.

  Args:
    schedule: a `LearningRateSchedule` (tfdist's, `LRPlan.schedule`).
    multiplier: the factor, a float32 scalar `tf.Variable` (initially 1).

  `bind(optimizer)` gives it the optimizer's step counter; unbound, it
  cannot be called.
  """

  def __init__(self, schedule, multiplier=None):
    if isinstance(schedule, dict):
      schedule = keras.saving.deserialize_keras_object(schedule)
    self.schedule = schedule
    self.multiplier = (multiplier if isinstance(multiplier, tf.Variable)
                       else tf.Variable(1.0 if multiplier is None else
                                        float(multiplier), trainable=False,
                                        dtype=tf.float32,
                                        name="lr_multiplier"))
    self._iterations = None

  def bind(self, optimizer) -> "AdjustableLearningRate":
    """Reads the step from `optimizer.iterations`; returns self."""
    self._iterations = optimizer.iterations
    return self

  def base(self):
    """The schedule's rate at the current step (float32 scalar tensor)."""
    if self._iterations is None:
      raise ValueError("AdjustableLearningRate is not bound to an optimizer:"
                       " call bind(optimizer) first.")
    return tf.cast(self.schedule(self._iterations), tf.float32)

  def __call__(self):
    return self.base() * self.multiplier

  def assign(self, learning_rate):
    """Makes the current rate `learning_rate` (a float > 0) by setting the
    multiplier (what `optimizer.learning_rate = ...` calls).

    Raises:
      ValueError: the schedule gives 0 at this step (warmup starting at 0),
        so no factor gives `learning_rate`.
    """
    base = float(self.base())
    if base <= 0.0:
      raise ValueError(
          f"Cannot set the learning rate to {float(learning_rate)} at step "
          f"{int(self._iterations)}: tfdist's schedule gives {base} there "
          "(a warmup starting at 0), so no factor of it does. Set "
          "--warmup_start_learning_rate > 0, or change the rate after warmup.")
    self.multiplier.assign(float(learning_rate) / base)

  def get_config(self):
    return {"schedule": keras.saving.serialize_keras_object(self.schedule),
            "multiplier": float(self.multiplier.numpy())}

  @classmethod
  def from_config(cls, config):
    return cls(**config)


# The schedules' public path, as `run_manifest.json` records it (Keras's
# serialization names the class's module): this module's old flat path in
# the training package, which every manifest written before
# `tfdist/training/` was split by role names, and whose alias module
# imports this one (`tfdist/training/lr_schedule.py`). Computed, not
# spelled: it names no module this one imports.
PUBLIC_MODULE = __name__.replace(".plan.", ".", 1)
LinearWarmup.__module__ = PUBLIC_MODULE
AdjustableLearningRate.__module__ = PUBLIC_MODULE


def build_lr_schedule(*, peak_learning_rate: float, total_steps: int,
                      warmup_steps: int, schedule: str = "constant",
                      warmup_start_learning_rate: float = 0.0,
                      end_learning_rate_factor: float = 0.0,
                      piecewise_boundaries: Sequence[float] = (0.5, 0.75),
                      piecewise_multipliers: Sequence[float] = (1.0, 0.1, 0.01)
                      ) -> LinearWarmup:
  """Builds warmup + decay as one serializable schedule.

  Args:
    peak_learning_rate: LR at the end of warmup (already batch-scaled).
    total_steps: optimizer updates in the whole run.
    warmup_steps: steps of linear warmup (0: none); must be <= total_steps.
    schedule: a decay registered in `tfdist.core.decay_schedules`:
      `constant`; `cosine` (Keras `CosineDecay` from the peak to
      `peak * end_learning_rate_factor` over the steps after warmup);
      `piecewise` (Keras `PiecewiseConstantDecay`, the peak times each
      multiplier, boundaries given as fractions of the post-warmup steps);
      or one registered with `register_decay_schedule`.
    warmup_start_learning_rate: LR at step 0.
    end_learning_rate_factor: cosine's final LR as a fraction of the peak.
    piecewise_boundaries: increasing fractions in (0, 1).
    piecewise_multipliers: one more value than boundaries.

  Returns:
    A `LinearWarmup` schedule.

  Raises:
    ConfigError: the warmup is longer than the run, or an unknown schedule.
  """
  if warmup_steps > total_steps:
    raise errors.ConfigError(
        f"Warmup of {warmup_steps} steps is longer than the run "
        f"({total_steps} steps). Lower --warmup_steps/--warmup_epochs or "
        "train longer.")
  after = decay_schedules.build_decay(
      schedule, peak_learning_rate, total_steps - warmup_steps,
      end_learning_rate_factor=end_learning_rate_factor,
      piecewise_boundaries=piecewise_boundaries,
      piecewise_multipliers=piecewise_multipliers)
  return LinearWarmup(after, warmup_steps=warmup_steps,
                      peak_learning_rate=peak_learning_rate,
                      warmup_start_learning_rate=warmup_start_learning_rate)


@dataclasses.dataclass(frozen=True)
class LRPlan:
  """The learning rate of a run.

  Attributes:
    peak_learning_rate: the batch-scaled LR reached at the end of warmup.
    warmup_steps: steps of linear warmup.
    schedule: the `LinearWarmup` schedule the optimizer reads.
  """
  peak_learning_rate: float
  warmup_steps: int
  schedule: LinearWarmup


# The learning-rate flags a run plan reads (`plan_learning_rate`): the
# config's learning-rate section (`--base_learning_rate`,
# `--base_batch_size`, `--lr_scaling`, `--lr_schedule`, `--warmup_steps`,
# `--warmup_epochs`, `--warmup_start_learning_rate`,
# `--end_learning_rate_factor`, `--piecewise_boundaries`,
# `--piecewise_multipliers`), handed to this part as it is.
LROptions = config_lib.LearningRateConfig


def plan_learning_rate(options: LROptions, *, global_batch_size: int,
                       steps_per_epoch: int, total_steps: int) -> LRPlan:
  """Scales `options.base_learning_rate` and builds warmup + decay for a run.

  Args:
    options: the run's `LROptions` (a `TrainConfig`'s
      `optimization.learning_rate`).
    global_batch_size: examples per update.
    steps_per_epoch: updates per epoch (for `--warmup_epochs`).
    total_steps: updates in the whole run.

  Returns:
    An `LRPlan`.

  Raises:
    ConfigError: the warmup is longer than the run, or an unknown rule or
      schedule.
  """
  warmup_steps = batch_plan.resolve_warmup_steps(
      warmup_steps=options.warmup_steps, warmup_epochs=options.warmup_epochs,
      steps_per_epoch=steps_per_epoch, total_steps=total_steps)
  peak = scale_learning_rate(
      options.base_learning_rate, global_batch_size=global_batch_size,
      base_batch_size=options.base_batch_size, rule=options.lr_scaling)
  schedule = build_lr_schedule(
      peak_learning_rate=peak, total_steps=total_steps,
      warmup_steps=warmup_steps, schedule=options.lr_schedule,
      warmup_start_learning_rate=options.warmup_start_learning_rate,
      end_learning_rate_factor=options.end_learning_rate_factor,
      piecewise_boundaries=options.piecewise_boundaries,
      piecewise_multipliers=options.piecewise_multipliers)
  return LRPlan(peak, warmup_steps, schedule)
