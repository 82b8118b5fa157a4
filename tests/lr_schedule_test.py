"""Tests for tfdist.training.plan.lr_schedule: scaling rules, warmup and decay
values."""

import json
import math

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest

from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.core import decay_schedules
from tfdist.training.plan import lr_schedule

# Also run on the oldest supported TensorFlow (see tests/conftest.py).
pytestmark = pytest.mark.compat


def reference_lr(step, *, peak, start, warmup, total, schedule, alpha=0.0,
                 boundaries=(0.5, 0.75), multipliers=(1.0, 0.1, 0.01)):
  """An independent, plain-Python statement of the schedule."""
  if step < warmup:
    return start + (peak - start) * step / warmup
  t = step - warmup
  decay_steps = max(total - warmup, 1)
  if schedule == "constant":
    return peak
  if schedule == "cosine":
    t = min(t, decay_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * t / decay_steps))
    return peak * ((1 - alpha) * cosine + alpha)
  bounds = [round(b * decay_steps) for b in boundaries]
  for bound, mult in zip(bounds, multipliers):
    if t <= bound:
      return peak * mult
  return peak * multipliers[-1]


class ScalingTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("linear_up", "linear", 1024, 0.4),
      ("linear_down", "linear", 64, 0.025),
      ("sqrt_up", "sqrt", 1024, 0.2),
      ("sqrt_down", "sqrt", 64, 0.05),
      ("none", "none", 1024, 0.1),
  )
  def test_rules(self, rule, global_batch, expected):
    self.assertAlmostEqual(lr_schedule.scale_learning_rate(
        0.1, global_batch_size=global_batch, base_batch_size=256, rule=rule),
                           expected)

  def test_unknown_rule(self):
    with self.assertRaisesRegex(errors.ConfigError, "--lr_scaling='cube'"):
      lr_schedule.scale_learning_rate(0.1, global_batch_size=8,
                                      base_batch_size=8, rule="cube")


class ScheduleValuesTest(parameterized.TestCase):

  @parameterized.product(schedule=("constant", "cosine", "piecewise"),
                         rule=("linear", "sqrt"))
  def test_known_steps(self, schedule, rule):
    peak = lr_schedule.scale_learning_rate(0.1, global_batch_size=512,
                                           base_batch_size=256, rule=rule)
    total, warmup, start = 1000, 100, 0.01  # non-zero start on purpose
    sched = lr_schedule.build_lr_schedule(
        peak_learning_rate=peak, total_steps=total, warmup_steps=warmup,
        schedule=schedule, warmup_start_learning_rate=start,
        end_learning_rate_factor=0.1)
    # start, mid-warmup, end of warmup, mid-decay, end.
    for step in (0, 50, 100, 550, 999, 1000):
      expected = reference_lr(step, peak=peak, start=start, warmup=warmup,
                              total=total, schedule=schedule, alpha=0.1)
      self.assertAlmostEqual(float(sched(step)), expected, places=5,
                             msg=f"step {step}")
    self.assertAlmostEqual(float(sched(0)), start, places=6)
    self.assertAlmostEqual(float(sched(100)), peak, places=6)

  def test_no_warmup(self):
    sched = lr_schedule.build_lr_schedule(peak_learning_rate=0.3,
                                          total_steps=10, warmup_steps=0)
    self.assertAlmostEqual(float(sched(0)), 0.3, places=6)

  def test_warmup_longer_than_run(self):
    with self.assertRaisesRegex(errors.ConfigError, "longer than the run"):
      lr_schedule.build_lr_schedule(peak_learning_rate=0.1, total_steps=10,
                                    warmup_steps=11)

  def test_negative_warmup(self):
    with self.assertRaisesRegex(ValueError, "warmup_steps must be >= 0"):
      lr_schedule.LinearWarmup(0.1, warmup_steps=-1, peak_learning_rate=0.1)

  def test_optimizer_reads_schedule_from_its_step(self):
    sched = lr_schedule.build_lr_schedule(peak_learning_rate=1.0,
                                          total_steps=10, warmup_steps=4)
    opt = keras.optimizers.SGD(learning_rate=sched)
    var = keras.Variable(np.zeros(1, np.float32))
    opt.build([var])
    seen = []
    for _ in range(5):
      seen.append(float(keras.ops.convert_to_numpy(opt.learning_rate)))
      opt.apply_gradients([(np.ones(1, np.float32), var)])
    np.testing.assert_allclose(seen, [0.0, 0.25, 0.5, 0.75, 1.0], atol=1e-6)


class SerializationTest(parameterized.TestCase):

  @parameterized.named_parameters(("constant", "constant"),
                                  ("cosine", "cosine"),
                                  ("piecewise", "piecewise"))
  def test_json_round_trip(self, schedule):
    sched = lr_schedule.build_lr_schedule(
        peak_learning_rate=0.2, total_steps=300, warmup_steps=30,
        schedule=schedule, warmup_start_learning_rate=0.02)
    blob = json.dumps(keras.saving.serialize_keras_object(sched))
    restored = keras.saving.deserialize_keras_object(json.loads(blob))
    self.assertIsInstance(restored, lr_schedule.LinearWarmup)
    self.assertEqual(restored.get_config(), sched.get_config())
    for step in (0, 15, 30, 200, 299):
      self.assertAlmostEqual(float(restored(step)), float(sched(step)),
                             places=6)


class DecayRegistryTest(absltest.TestCase):

  def test_a_user_registers_a_decay(self):

    @decay_schedules.register_decay_schedule("halving")
    def halving(peak_learning_rate, decay_steps, **options):
      del options
      return keras.optimizers.schedules.ExponentialDecay(
          peak_learning_rate, decay_steps=decay_steps, decay_rate=0.5)

    self.addCleanup(decay_schedules._SCHEDULES.pop, "halving")  # pylint: disable=protected-access
    self.assertIs(halving, decay_schedules._SCHEDULES["halving"])  # pylint: disable=protected-access
    # The config accepts the name; the run's schedule warms up into it.
    config = TrainConfig(model_dir="/x", train_steps=1, lr_schedule="halving")
    self.assertEqual(config.lr_schedule, "halving")
    schedule = lr_schedule.build_lr_schedule(
        peak_learning_rate=0.8, total_steps=110, warmup_steps=10,
        schedule="halving")
    self.assertAlmostEqual(float(schedule(10)), 0.8, places=6)
    self.assertAlmostEqual(float(schedule(110)), 0.4, places=6)

  def test_unknown_names_are_refused_with_the_registered_ones(self):
    message = ("--lr_schedule='warm' is unknown. Use one of: constant, "
               "cosine, piecewise")
    with self.assertRaisesRegex(errors.ConfigError, message):
      TrainConfig(model_dir="/x", train_steps=1, lr_schedule="warm")
    with self.assertRaisesRegex(errors.ConfigError, message):
      lr_schedule.build_lr_schedule(peak_learning_rate=0.1, total_steps=10,
                                    warmup_steps=0, schedule="warm")
    with self.assertRaisesRegex(ValueError, "lower case"):
      decay_schedules.register_decay_schedule("Warm")


class OldPathTest(absltest.TestCase):

  def test_the_old_path_is_the_same_module(self):
    # --helpfull names
    # tfdist.training.decay_schedules.register_decay_schedule.
    from tfdist.training import decay_schedules as old  # pylint: disable=g-import-not-at-top
    self.assertIs(old, decay_schedules)

  def test_the_manifest_names_the_schedules_public_path(self):
    # run_manifest.json records Keras's serialization of the schedule,
    # whose `module` is the class's: the path manifests named before
    # tfdist/training/ was split by role (it imports the same module).
    sched = lr_schedule.build_lr_schedule(
        peak_learning_rate=0.2, total_steps=300, warmup_steps=30,
        schedule="cosine")
    for value in (sched, lr_schedule.AdjustableLearningRate(sched)):
      self.assertEqual(keras.saving.serialize_keras_object(value)["module"],
                       "tfdist.training.lr_schedule")
    from tfdist.training import lr_schedule as old  # pylint: disable=g-import-not-at-top
    self.assertIs(old, lr_schedule)


if __name__ == "__main__":
  absltest.main()
