"""`--hptune_metric`: each evaluation's value reaches cloudml-hypertune's file.

A short real training run of a model with a metric of the user's own
evaluates three times; the file
cloudml-hypertune writes (`$CLOUD_ML_HP_METRIC_FILE`, what Vertex AI reads)
must hold one line per evaluation whose value and step match the run
manifest's `eval_history`.
"""

import dataclasses
import json
import os
from unittest import mock

from absl.testing import absltest
import pytest
import keras

from tests import testutil
from tfdist import experiment
from tfdist.cloud import hptune
from tfdist import errors
from tfdist.config import HPTUNE_METRICS, TrainConfig
from tfdist.observability import manifest as manifest_lib
from tfdist.training import task as task_lib

# Also run on the oldest supported TensorFlow (tests/conftest.py).
pytestmark = pytest.mark.compat


class ConfigTest(absltest.TestCase):

  def test_a_name_without_eval_prefix_is_refused(self):
    with self.assertRaisesRegex(
        errors.ConfigError,
        "--hptune_metric='val_acc' is not an evaluation metric: "
        "give eval_ and the metric's name, e.g. eval_loss or eval_accuracy, "
        "eval_auc for tfdist's models, eval_<name> for a metric of your "
        "model"):
      TrainConfig(model_dir="/m", train_steps=1, hptune_metric="val_acc")

  def test_any_metric_of_the_model(self):
    hptune.check_metric("eval_f1", available=["loss", "accuracy", "f1"])
    with self.assertRaisesRegex(
        errors.ConfigError, "--hptune_metric=eval_auc: this model's evaluation "
        "reports eval_loss, eval_accuracy. Use one of them"):
      hptune.check_metric("eval_auc", available=["loss", "accuracy"])

  def test_logs_key(self):
    self.assertEqual(hptune.logs_key("eval_top2"), "val_top2")

  def test_binary_rejects_a_malformed_name_at_start(self):
    proc = testutil.run_module(
        "tfdist.train", [f"--model_dir={testutil.scratch_dir()}",
                         "--train_steps=1", "--hptune_metric=accuracy"],
        timeout=60)
    self.assertNotEqual(proc.returncode, 0)
    self.assertIn("--hptune_metric='accuracy'", proc.stdout)
    for name in HPTUNE_METRICS:
      self.assertIn(name, proc.stdout)


class ReportTest(absltest.TestCase):

  def tearDown(self):
    keras.mixed_precision.set_global_policy("float32")
    super().tearDown()

  def test_training_run_reports_a_metric_of_the_users_model(self):
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
        hptune_metric="eval_top2")
    task = task_lib.from_names(config.task)
    task = dataclasses.replace(task, metrics=[
        "accuracy", keras.metrics.SparseTopKCategoricalAccuracy(
            k=2, name="top2")])
    # A name the model does not evaluate stops the run before training.
    with self.assertRaisesRegex(
        errors.ConfigError, "--hptune_metric=eval_top5: "
                                "this model's evaluation reports eval_loss, "
                                "eval_accuracy, eval_top2"):
      experiment.run_experiment(
          dataclasses.replace(config, hptune_metric="eval_top5"), task=task)
    self.assertFalse(os.path.exists(os.path.join(model_dir,
                                                 "run_manifest.json")))
    with mock.patch.dict(os.environ, {"CLOUD_ML_HP_METRIC_FILE": metric_file,
                                      "CLOUD_ML_TRIAL_ID": "7"}):
      record = experiment.run_experiment(config, task=task)
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
      self.assertAlmostEqual(float(line["eval_top2"]), evaluation["top2"],
                             places=6)
      self.assertGreaterEqual(evaluation["top2"], evaluation["accuracy"])
      self.assertEqual(line["trial"], "7")


if __name__ == "__main__":
  absltest.main()
