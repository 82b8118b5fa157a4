"""Tests for tfdist.distribute.devices (logical CPU devices, the device listing)."""

import json
import os
import subprocess
import sys

from absl.testing import absltest
import pytest
import tensorflow as tf

from tests import testutil
from tfdist.distribute import devices

pytestmark = pytest.mark.compat

# Runs in a fresh process: TensorFlow's devices are fixed once its runtime
# starts, and this test process's may have started (other test files).
_SPLIT = """
import json
import tensorflow as tf
from tfdist.distribute import devices
out = {"split": devices.configure_cpu_devices(2)}
tf.constant(1.0) + 1.0
out["again"] = devices.configure_cpu_devices(2)
out["whole"] = devices.configure_cpu_devices(0)
try:
  devices.configure_cpu_devices(3)
except RuntimeError as e:
  out["refused"] = str(e)
print(json.dumps(out))
"""


class DevicesTest(absltest.TestCase):

  def test_split_then_refused_once_started(self):
    run = subprocess.run(
        [sys.executable, "-c", _SPLIT], capture_output=True, text=True,
        timeout=300, env=dict(os.environ, PYTHONPATH=testutil.REPO_ROOT,
                              TF_CPP_MIN_LOG_LEVEL="2"))
    self.assertEqual(run.returncode, 0, run.stderr[-2000:])
    out = json.loads(run.stdout.strip().splitlines()[-1])
    self.assertEqual(out["split"], ["/device:CPU:0", "/device:CPU:1"])
    # The same split again is fine; 0 leaves the devices as they are.
    self.assertEqual(out["again"], out["split"])
    self.assertEqual(out["whole"], out["split"])
    # Another split, once TensorFlow started, is refused by flag.
    self.assertIn("--num_cpu_devices=3 could not be applied: TensorFlow "
                  "already started with 2 CPU device(s)", out["refused"])

  def test_without_a_split_the_devices_stay(self):
    names = [d.name for d in tf.config.list_logical_devices("CPU")]
    self.assertEqual(devices.configure_cpu_devices(0), names)
    self.assertEqual(devices.configure_cpu_devices(1), names)

  def test_describe_devices(self):
    listed = devices.describe_devices()
    logical = tf.config.list_logical_devices()
    self.assertEqual([d["name"] for d in listed[:len(logical)]],
                     [d.name for d in logical])
    self.assertIn("CPU", [d["device_type"] for d in listed])
    for entry in listed[len(logical):]:
      self.assertEqual(entry["device_type"], "GPU (physical)")


if __name__ == "__main__":
  absltest.main()
