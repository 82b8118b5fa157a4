"""Tests for batch normalization across replicas.

tfdist.models.batch_norm, Keras's synchronized batch norm with its three
all-reduces packed into one: under MirroredStrategy on 2 logical CPU devices
(in a child process: the device split must come before TensorFlow starts),
the packed layer and Keras's own `synchronized=True` give the same outputs,
moving statistics and gradients on different per-replica data, and a
training step of a layer calls `ReplicaContext.all_reduce` 2 times (forward,
backward) against Keras's 5.

tfdist.training.step.moving_statistics, a user's unsynchronized batch norm:
under Mirrored on 2 logical CPU devices, `tfdist.fit`'s final evaluation is the
exported SavedModel's and the final checkpoint's (one-device
`Model.evaluate`), and the plan names the layer and the fix.
"""

import json
import os
import shutil
import subprocess
import sys

from absl.testing import absltest
import pytest

from tests import testutil
from tfdist.data import input_pipeline
from tfdist.training.plan import batch_plan
from tfdist.training.plan import lr_schedule
from tfdist.training.step import moving_statistics
from tfdist.training.plan import run_plan



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


@pytest.mark.compat  # Also on the oldest TensorFlow.
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


def _bn_model(synchronized: bool = False):
  """Dense, `BatchNormalization` (named "bn"), Dense: 3 features in, one
  output, compiled for mean squared error."""
  import keras  # pylint: disable=g-import-not-at-top
  inputs = keras.Input((3,), name="x")
  h = keras.layers.Dense(4)(inputs)
  h = keras.layers.BatchNormalization(momentum=0.5, synchronized=synchronized,
                                      name="bn")(h)
  model = keras.Model(inputs, keras.layers.Dense(1)(h))
  model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
  return model


def _regression_data():
  """64 examples of 3 features on different scales, and their targets."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(0)
  x = (rng.normal(size=(64, 3)) * [1.0, 3.0, 10.0] + [0.0, 2.0, 5.0]
       ).astype(np.float32)
  y = (x @ np.array([1.0, -1.0, 0.5], np.float32) + 1.0).astype(np.float32)
  return x, y


def _fit_child(model_dir: str) -> dict:
  """`tfdist.fit` of `_bn_model` under Mirrored on 2 logical CPU devices;
  the manifest's final evaluation, and `Model.evaluate` on the same data of
  the exported SavedModel and of the final checkpoint in a one-device
  model."""
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.set_logical_device_configuration(
      tf.config.list_physical_devices("CPU")[0],
      [tf.config.LogicalDeviceConfiguration()] * 2)
  import tfdist  # pylint: disable=g-import-not-at-top
  x, y = _regression_data()
  xv, yv = x[:16], y[:16]
  result = tfdist.fit(
      _bn_model, x=x, y=y, validation_data=(xv, yv),
      config=tfdist.TrainConfig(
          model_dir=model_dir, train_steps=6, batch_size=8, log_steps=3,
          distribution_strategy="mirrored", num_cpu_devices=2))
  serving = tf.saved_model.load(
      result["artifacts"]["saved_model"]).signatures["serving_default"]
  exported = serving(x=tf.constant(xv))["output_0"].numpy()
  restored = _bn_model()
  tf.train.Checkpoint(model=restored).restore(
      result["artifacts"]["checkpoint"]).expect_partial()
  return {"strategy": result["strategy"],
          "manifest_eval_loss": result["final_metrics"]["eval_loss"],
          "exported_eval_loss": float(keras.losses.MeanSquaredError()(
              yv, exported)),
          "checkpoint_eval_loss": float(restored.evaluate(xv, yv,
                                                          verbose=0)),
          "sync_batch_norm": result["sync_batch_norm"],
          "sync_batch_norm_reason": result["sync_batch_norm_reason"]}


class UnsynchronizedBatchNormTest(absltest.TestCase):

  def test_reported_evaluation_is_the_exported_models(self):
    model_dir = testutil.scratch_dir()
    self.addCleanup(shutil.rmtree, model_dir, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, "-c",
         "import json, sys; from tests import batch_norm_test as t; "
         "print('RESULT ' + json.dumps(t._fit_child(sys.argv[1])))",
         os.path.join(model_dir, "m")],
        cwd=testutil.REPO_ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
             "PYTHONPATH": testutil.REPO_ROOT + os.pathsep +
                           os.environ.get("PYTHONPATH", "")})
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    self.assertEqual(result["strategy"], "mirrored")
    self.assertAlmostEqual(result["manifest_eval_loss"],
                           result["exported_eval_loss"], delta=1e-5,
                           msg=result)
    self.assertAlmostEqual(result["manifest_eval_loss"],
                           result["checkpoint_eval_loss"], delta=1e-5,
                           msg=result)
    # The plan (logged, and in the manifest) names the layer and the fix.
    self.assertFalse(result["sync_batch_norm"])
    self.assertIn("batch norm             per replica in the model's bn ",
                  proc.stderr)
    self.assertIn("BatchNormalization(synchronized=True)",
                  result["sync_batch_norm_reason"])


def _plan(sync_batch_norm: bool, num_replicas_in_sync: int = 2,
          asynchronous: bool = False) -> run_plan.RunPlan:
  batch = batch_plan.make_batch_plan(
      num_replicas_in_sync=num_replicas_in_sync, batch_size=8,
      num_train_examples=64)
  schedule = lr_schedule.LinearWarmup(lr_schedule.ConstantLearningRate(0.05),
                                      warmup_steps=0, peak_learning_rate=0.05)
  return run_plan.RunPlan(
      train_files=(), eval_files=(), num_train_examples=64, batch=batch,
      total_steps=8,
      lr=lr_schedule.LRPlan(peak_learning_rate=0.05, warmup_steps=0,
                            schedule=schedule),
      strategy="mirrored", strategy_reason="asked", dtype="fp32",
      dtype_reason="asked", asynchronous=asynchronous,
      sharding=input_pipeline.ShardingPlan(mode="off", reason="one worker"),
      sync_batch_norm=sync_batch_norm, sync_batch_norm_reason="default")


@pytest.mark.compat  # Also on the oldest TensorFlow.
class NoteInPlanTest(absltest.TestCase):

  def test_unsynchronized_layers_under_several_replicas_are_named(self):
    with self.assertLogs("absl", "INFO") as logs:
      plan = moving_statistics.note_in_plan(
          _plan(True), _bn_model(), model_name="m:f", num_replicas_in_sync=2)
    self.assertFalse(plan.sync_batch_norm)
    self.assertIn("per replica in the model's bn (synchronized=False)",
                  plan.sync_batch_norm_reason)
    self.assertIn("each of the 2 replicas", plan.sync_batch_norm_reason)
    self.assertIn("--sync_batch_norm", plan.sync_batch_norm_reason)
    self.assertIn("batch norm             per replica in the model's bn",
                  "\n".join(logs.output))

  def test_what_the_model_has_replaces_what_was_planned(self):
    synchronized = moving_statistics.note_in_plan(
        _plan(False), _bn_model(synchronized=True), model_name="m:f",
        num_replicas_in_sync=2)
    self.assertTrue(synchronized.sync_batch_norm)
    self.assertIn("synchronized=True", synchronized.sync_batch_norm_reason)
    # A built-in model follows the plan, whose line said so already
    # (--nosync_batch_norm here).
    planned = _plan(False)
    self.assertIs(moving_statistics.note_in_plan(
        planned, _bn_model(), model_name="cnn", num_replicas_in_sync=2),
                  planned)
    # One replica (or parameter servers): per replica is one device's.
    for plan, replicas in ((_plan(False, 1), 1),
                           (_plan(False, 2, asynchronous=True), 2)):
      self.assertIs(moving_statistics.note_in_plan(
          plan, _bn_model(), model_name="m:f",
          num_replicas_in_sync=replicas), plan)

  def test_a_model_without_batch_norm_keeps_the_plan(self):
    import keras  # pylint: disable=g-import-not-at-top
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    plan = _plan(True)
    self.assertIs(moving_statistics.note_in_plan(
        plan, model, model_name="m:f", num_replicas_in_sync=2), plan)


if __name__ == "__main__":
  absltest.main()
