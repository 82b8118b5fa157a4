"""`--hptune_metric`: each evaluation's value reaches cloudml-hypertune's file.

A short real training run evaluates three times; the file
cloudml-hypertune writes (`$CLOUD_ML_HP_METRIC_FILE`, what Vertex AI reads)
must hold one line per evaluation whose value and step match the run
manifest's `eval_history`.
"""

import json
import os
from unittest import mock

from absl.testing import absltest
import pytest
import keras

from tests import testutil
from tfdist import experiment
from tfdist import hptune
from tfdist import manifest as manifest_lib
from tfdist.config import ConfigError, HPTUNE_METRICS, TrainConfig

# Also run on the oldest supported TensorFlow (tests/conftest.py).
pytestmark = pytest.mark.compat


class ConfigTest(absltest.TestCase):

  def test_unknown_metric_lists_valid_ones(self):
    with self.assertRaisesRegex(
        ConfigError, "--hptune_metric='val_acc' is not an evaluation metric "
        "tfdist reports. Use one of: eval_accuracy, eval_loss, eval_auc"):
      TrainConfig(model_dir="/m", train_steps=1, hptune_metric="val_acc")

  def test_auc_needs_a_binary_task(self):
    with self.assertRaisesRegex(ConfigError, "binary tasks only"):
      hptune.check_metric("eval_auc", task="multiclass")
    hptune.check_metric("eval_auc", task="binary")

  def test_callback_maps_every_metric(self):
    self.assertCountEqual(hptune.LOGS_KEYS, HPTUNE_METRICS)

  def test_binary_rejects_unknown_metric_at_start(self):
    proc = testutil.run_module(
        "tfdist.train", [f"--model_dir={testutil.scratch_dir()}",
                         "--train_steps=1", "--hptune_metric=accuracy"],
        timeout=60)
    self.assertNotEqual(proc.returncode, 0)
    self.assertIn("--hptune_metric=accuracy", proc.stdout)
    for name in HPTUNE_METRICS:
      self.assertIn(name, proc.stdout)


class ReportTest(absltest.TestCase):

  def tearDown(self):
    keras.mixed_precision.set_global_policy("float32")
    super().tearDown()

  def test_training_run_reports_each_evaluation(self):
    data = testutil.fashion_mnist_subset(limit=256, train_shards=2,
                                         test_shards=1)
    model_dir = testutil.scratch_dir()
    metric_file = os.path.join(testutil.scratch_dir(), "hypertune",
                               "output.metrics")
    # 256 examples at batch 64: 4 steps per epoch; 12 steps evaluate at the
    # end of each of 3 epochs. (The flag itself: ConfigTest above.)
    config = TrainConfig(
        model_dir=model_dir, train_files=data["train"],
        eval_files=data["eval"], distribution_strategy="one_device",
        batch_size=64, train_steps=12, log_steps=4,
        hptune_metric="eval_accuracy")
    with mock.patch.dict(os.environ, {"CLOUD_ML_HP_METRIC_FILE": metric_file,
                                      "CLOUD_ML_TRIAL_ID": "7"}):
      record = experiment.run_experiment(config)
    with open(metric_file) as f:
      lines = [json.loads(line) for line in f]
    evals = record["eval_history"]
    self.assertLen(evals, 3)
    self.assertEqual(evals, manifest_lib.read_manifest(model_dir)[
        "eval_history"])
    self.assertEqual([int(line["global_step"]) for line in lines],
                     [e["step"] for e in evals])
    self.assertEqual([int(line["global_step"]) for line in lines], [4, 8, 12])
    for line, evaluation in zip(lines, evals):
      self.assertAlmostEqual(float(line["eval_accuracy"]),
                             evaluation["accuracy"], places=6)
      self.assertEqual(line["trial"], "7")


if __name__ == "__main__":
  absltest.main()
