"""A user's unsynchronized batch norm: the reported metrics are the export's.

`BatchNormalization(synchronized=False)` keeps a copy of its moving
statistics per replica; tfdist averages them before each evaluation,
checkpoint and export (tfdist/training/step/moving_statistics.py), so the final
evaluation loss in the manifest is what `Model.evaluate` gives for the
exported SavedModel and for the final checkpoint (Keras's own `fit` under
Mirrored evaluates with the first replica's copy). Measured with
`tfdist.fit` on one device and under MirroredStrategy on 2 logical CPUs
(one child process: the devices must exist before TensorFlow starts), and on
two MultiWorkerMirrored workers (a local cluster, `tfdist.launch
--module=tests.batch_norm_metrics_test`), where each worker's half of the
data gives its copy other statistics. Each run's cell of the fit-contract
table (tests/conformance_table.py) is checked.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest

from tests import conformance_table
from tests import testutil

_CHILD_ENV = "TFDIST_BATCH_NORM_METRICS_CHILD"
# The reported loss against the export's and the checkpoint's (float32).
ATOL = 1e-5
CELL = ("works (the reported evaluation loss is what the exported "
        "SavedModel and the final checkpoint give)")
CELL_NAMED = CELL[:-1] + "; the plan names the layer and the fix)"


def _bn_model():
  """Dense, `BatchNormalization` (named "bn", not synchronized), Dense: 3
  features in, one output, compiled for mean squared error."""
  import keras  # pylint: disable=g-import-not-at-top
  inputs = keras.Input((3,), name="x")
  h = keras.layers.Dense(4)(inputs)
  h = keras.layers.BatchNormalization(momentum=0.5, name="bn")(h)
  model = keras.Model(inputs, keras.layers.Dense(1)(h))
  model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
  return model


def _data():
  """64 examples of 3 features on different scales (float32 [64, 3]), and
  their targets (float32 [64])."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(0)
  x = (rng.normal(size=(64, 3)) * [1.0, 3.0, 10.0] + [0.0, 2.0, 5.0]
       ).astype(np.float32)
  y = (x @ np.array([1.0, -1.0, 0.5], np.float32) + 1.0).astype(np.float32)
  return x, y


def _fit(model_dir: str, strategy: str) -> dict:
  """`tfdist.fit` of `_bn_model` under `strategy`; the manifest's final
  evaluation loss, and `Model.evaluate`'s (one device) of the exported
  SavedModel and of the final checkpoint on the same examples (on the
  chief; other workers' artifacts are gone with their scratch)."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top
  x, y = _data()
  xv, yv = x[:16], y[:16]
  result = tfdist.fit(
      _bn_model, x=x, y=y, validation_data=(xv, yv), verbose=0,
      config=tfdist.TrainConfig(
          model_dir=model_dir, train_steps=6, batch_size=8, log_steps=3,
          distribution_strategy=strategy))
  out = {"strategy": result["strategy"],
         "replicas": result["num_replicas_in_sync"],
         "sync_batch_norm_reason": result.get("sync_batch_norm_reason", ""),
         "manifest_eval_loss": result["final_metrics"]["eval_loss"]}
  if not result.get("cluster", {}).get("is_chief", True):
    return out
  serving = tf.saved_model.load(
      result["artifacts"]["saved_model"]).signatures["serving_default"]
  exported = serving(x=tf.constant(xv))["output_0"].numpy()
  restored = _bn_model()
  tf.train.Checkpoint(model=restored).restore(
      result["artifacts"]["checkpoint"]).expect_partial()
  return {**out,
          "exported_eval_loss": float(keras.losses.MeanSquaredError()(
              yv, exported)),
          "checkpoint_eval_loss": float(restored.evaluate(
              xv, yv, batch_size=16, verbose=0))}


def _child_main() -> dict:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.set_logical_device_configuration(
      tf.config.list_physical_devices("CPU")[0],
      [tf.config.LogicalDeviceConfiguration()] * 2)
  root = tempfile.mkdtemp(dir=testutil.scratch_dir())
  return {strategy: _fit(os.path.join(root, strategy), strategy)
          for strategy in ("one_device", "mirrored")}


class ReportedMetricsAreTheExportsTest(absltest.TestCase):

  def _check(self, run: dict, strategy: str, replicas: int):
    self.assertEqual((run["strategy"], run["replicas"]),
                     (strategy, replicas))
    for other in ("exported_eval_loss", "checkpoint_eval_loss"):
      self.assertAlmostEqual(run["manifest_eval_loss"], run[other],
                             delta=ATOL, msg=f"{other}: {run}")
    if replicas > 1:
      # Per replica: the plan names the layer and the fix.
      self.assertIn("per replica in the model's bn",
                    run["sync_batch_norm_reason"])
      self.assertIn("BatchNormalization(synchronized=True)",
                    run["sync_batch_norm_reason"])
    conformance_table.check_cell(self, "unsynchronized_batch_norm", strategy,
                                 CELL_NAMED if replicas > 1 else CELL)

  def test_one_device_and_mirrored(self):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               TF_ENABLE_ONEDNN_OPTS="0", **{_CHILD_ENV: "1"})
    env["PYTHONPATH"] = (testutil.REPO_ROOT + os.pathsep +
                         env.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)],
                          cwd=testutil.REPO_ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    self.assertTrue(proc.returncode == 0 and lines, proc.stdout[-4000:])
    runs = json.loads(lines[-1])
    self._check(runs["one_device"], "one_device", 1)
    self._check(runs["mirrored"], "mirrored", 2)

  def test_two_workers(self):
    from tests import multi_worker_testlib  # pylint: disable=g-import-not-at-top
    out = os.path.join(tempfile.mkdtemp(dir=testutil.scratch_dir()),
                       "result.json")
    status, output = multi_worker_testlib.run_launcher(
        ["--num_workers=2", "--module=tests.batch_norm_metrics_test"],
        [out], timeout=240,
        env={"TF_ENABLE_ONEDNN_OPTS": "0", "CUDA_VISIBLE_DEVICES": ""})
    self.assertEqual(status, 0, output[-4000:])
    with open(out) as f:
      self._check(json.load(f), "multi_worker_mirrored", 2)


def _cluster_main(out_path: str):
  """`_fit` on the cluster of `TF_CONFIG`; the chief writes OUT_JSON."""
  tf_config = json.loads(os.environ["TF_CONFIG"])
  result = _fit(os.path.join(os.path.dirname(out_path), "run"),
                "multi_worker_mirrored")
  if tf_config["task"]["type"] == "chief":
    with open(out_path, "w") as f:
      json.dump(result, f)


if __name__ == "__main__":
  if os.environ.get(_CHILD_ENV):
    print(json.dumps(_child_main()), flush=True)
  elif os.environ.get("TF_CONFIG"):
    _cluster_main(sys.argv[1])
  else:
    absltest.main()
