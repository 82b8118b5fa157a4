"""Tests for tfdist.observability.throughput with a controlled clock."""

from absl.testing import absltest
import pytest

from tfdist.observability.throughput import ThroughputMeter

# Also run on the oldest supported TensorFlow (see tests/conftest.py).
pytestmark = pytest.mark.compat


class ThroughputMeterTest(absltest.TestCase):

  def test_first_interval_excluded_and_units(self):
    now = [0.0]
    meter = ThroughputMeter(global_batch_size=64, clock=lambda: now[0])
    meter.start(0)
    now[0] = 10.0  # slow warm-up interval: 100 steps in 10 s
    first = meter.record(100)
    self.assertTrue(first.excluded)
    now[0] = 12.0  # 100 steps in 2 s
    second = meter.record(200)
    self.assertFalse(second.excluded)
    self.assertAlmostEqual(second.examples_per_second, 100 * 64 / 2.0)
    self.assertAlmostEqual(second.step_time, 0.02)
    now[0] = 15.0  # 100 steps in 3 s
    meter.record(300)
    summary = meter.summary()
    self.assertEqual(summary["measured_steps"], 200)
    self.assertAlmostEqual(summary["examples_per_second"], 200 * 64 / 5.0)
    self.assertAlmostEqual(summary["step_time_seconds"], 5.0 / 200)
    self.assertLen(summary["intervals"], 2)

  def test_nothing_measured(self):
    meter = ThroughputMeter(global_batch_size=8)
    meter.start(0)
    meter.record(10)  # only the excluded warm-up interval
    self.assertIsNone(meter.summary()["examples_per_second"])
    self.assertIsNone(meter.record(10))  # empty interval


if __name__ == "__main__":
  absltest.main()
