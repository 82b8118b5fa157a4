"""Tests for tfdist.models.batch_norm: Keras's synchronized batch norm with
its three all-reduces packed into one.

Under MirroredStrategy on 2 logical CPU devices (in a child process: the
device split must come before TensorFlow starts), the packed layer and
Keras's own `synchronized=True` give the same outputs, moving statistics
and gradients on different per-replica data, and a training step of a layer
calls `ReplicaContext.all_reduce` 2 times (forward, backward) against
Keras's 5.
"""

import json
import os
import subprocess
import sys

from absl.testing import absltest
import pytest

from tests import testutil

# Also run on the oldest supported TensorFlow (see tests/conftest.py).
pytestmark = pytest.mark.compat


def _child() -> dict:
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.set_logical_device_configuration(
      tf.config.list_physical_devices("CPU")[0],
      [tf.config.LogicalDeviceConfiguration()] * 2)
  from tfdist.models import batch_norm  # pylint: disable=g-import-not-at-top
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  rng = np.random.RandomState(0)
  # Different data (and scales) on each replica: per-replica statistics
  # would differ from the global ones.
  data = [rng.normal(r * 2.0, 1.0 + r, (4, 3, 3, 5)).astype(np.float32)
          for r in range(2)]
  calls = []
  original = tf.distribute.ReplicaContext.all_reduce

  def counting(self, *args, **kwargs):
    calls.append(1)
    return original(self, *args, **kwargs)

  tf.distribute.ReplicaContext.all_reduce = counting

  def run(layer_class):
    with strategy.scope():
      layer = layer_class(synchronized=True, momentum=0.5)
      layer.build((None, 3, 3, 5))

    def replica_step(ctx_inputs):
      x = tf.constant(data[0]) if ctx_inputs is None else ctx_inputs
      with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
        loss = tf.reduce_sum(y * tf.range(5, dtype=tf.float32))
      dx, dgamma = tape.gradient(loss, [x, layer.gamma])
      return y, dx, dgamma

    inputs = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(data[ctx.replica_id_in_sync_group]))
    del calls[:]
    out = tf.function(lambda v: strategy.run(replica_step, args=(v,)))(inputs)
    traced = len(calls) // 2  # Traced once per replica.
    local = [[np.asarray(t) for t in strategy.experimental_local_results(o)]
             for o in out]
    return local, np.asarray(layer.moving_variance.numpy()), traced

  keras_out, keras_var, keras_calls = run(keras.layers.BatchNormalization)
  ours_out, ours_var, ours_calls = run(batch_norm.BatchNormalization)
  diff = max(float(np.abs(a - b).max())
             for o1, o2 in zip(keras_out, ours_out) for a, b in zip(o1, o2))
  return {"max_diff": diff,
          "moving_variance_diff": float(np.abs(keras_var - ours_var).max()),
          "moving_variance_moved": float(np.abs(ours_var - 1.0).max()),
          "keras_all_reduces": keras_calls, "packed_all_reduces": ours_calls}


class PackedSyncBatchNormTest(absltest.TestCase):

  def test_same_statistics_and_gradients_with_fewer_all_reduces(self):
    proc = subprocess.run(
        [sys.executable, "-c",
         "import json; from tests import batch_norm_test as t; "
         "print(json.dumps(t._child()))"],
        cwd=testutil.REPO_ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
             "PYTHONPATH": testutil.REPO_ROOT + os.pathsep +
                           os.environ.get("PYTHONPATH", "")})
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    self.assertLess(result["max_diff"], 1e-5, result)
    self.assertLess(result["moving_variance_diff"], 1e-5, result)
    self.assertGreater(result["moving_variance_moved"], 0.1, result)
    self.assertEqual(result["keras_all_reduces"], 5, result)
    self.assertEqual(result["packed_all_reduces"], 2, result)


if __name__ == "__main__":
  absltest.main()
