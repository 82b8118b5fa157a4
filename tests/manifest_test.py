"""The run manifest (tfdist/observability/manifest.py): its keys, values and strict JSON.

A manifest is built from real parts (a `RunLog` that logged two intervals,
a `BatchPlan`, a `LinearWarmup` schedule, a `ClusterInfo`, a
`ControllerResult`) without training, then written and read back.
"""

import hashlib
import json
import math
import os
import shutil
import tempfile

from absl.testing import absltest
import keras
import numpy as np
import tensorflow as tf

from tfdist.config import TrainConfig
from tfdist.data import input_pipeline
from tfdist.distribute import auto_select
from tfdist.distribute import cluster as cluster_lib
from tfdist.distribute import strategy as strategy_lib
from tfdist.observability import manifest
from tfdist.observability import run_log as run_log_lib
from tfdist.training.plan import batch_plan
from tfdist.training import controller
from tfdist.training.plan import lr_schedule
from tfdist.training.plan import run_plan


def _plan() -> run_plan.RunPlan:
  batch = batch_plan.make_batch_plan(num_replicas_in_sync=1, batch_size=32,
                                     num_train_examples=320)
  schedule = lr_schedule.LinearWarmup(lr_schedule.ConstantLearningRate(0.05),
                                      warmup_steps=2, peak_learning_rate=0.05)
  return run_plan.RunPlan(
      train_files=(), eval_files=(), num_train_examples=320, batch=batch,
      total_steps=20,
      lr=lr_schedule.LRPlan(peak_learning_rate=0.05, warmup_steps=2,
                            schedule=schedule),
      strategy="one_device", strategy_reason="asked", dtype="fp32",
      dtype_reason="asked",
      sharding=input_pipeline.ShardingPlan(mode="off", reason="one worker"))


def _logged_run(metrics_dir: str) -> run_log_lib.RunLog:
  log = run_log_lib.RunLog(tensorboard_dir=None, metrics_dir=metrics_dir,
                           global_batch_size=32, total_steps=20,
                           process_id="p0")
  for step in (10, 20):
    log.log_train(step, {"loss": 5.0, "correct": 200.0, "count": 320.0}, 10,
                  learning_rate=0.05)
  return log


class ManifestTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
    self.config = TrainConfig(model_dir=self.dir, train_steps=20,
                              dataset="fashion_mnist", model="mlp",
                              base_learning_rate=0.2, base_batch_size=128,
                              flags_snapshot=(("train_steps", "20"),))

  def _build(self, **ran):
    result = controller.ControllerResult(
        step=20, final_eval={"loss": 0.4, "accuracy": 0.9,
                             "num_examples": 64},
        stopped_early=False, restored_from=None, train_seconds=1.5,
        micro_steps=20)
    cluster = cluster_lib.ClusterInfo(task_type="chief", task_index=0,
                                      cluster={}, source="none")
    choice = strategy_lib.StrategyChoice(
        strategy=tf.distribute.get_strategy(), name="one_device",
        reason="asked", devices=("/cpu:0",))
    return manifest.build_manifest(
        manifest.ManifestOptions.of(self.config),
        ran=manifest.WhatRan(
            decision=auto_select.Decision("one_device", "asked", "fp32",
                                          "asked"),
            plan=_plan(), dtype_policy="float32", loss_scale=None,
            optimizer_iterations=20, result=result,
            run_log=_logged_run(self.dir), **ran),
        where=manifest.WhereItRan(cluster=cluster, choice=choice,
                                  num_workers=1, is_chief=True,
                                  devices=[{"name": "/cpu:0"}],
                                  environment_applied=(("model_dir",
                                                        "AIP_MODEL_DIR"),)),
        wrote=manifest.WhatItWrote(artifacts={"checkpoint": "ckpt-20"},
                                   seconds={"total": 2.0, "training": 1.5}))

  def test_build_manifest_records_the_run(self):
    record = self._build(strategy_details={"placement": "none"})
    self.assertEqual(record["strategy"], "one_device")
    self.assertEqual(record["one_device"], {"placement": "none"})
    self.assertEqual(record["global_batch_size"], 32)
    self.assertEqual(record["steps_per_epoch"], 10)
    self.assertEqual(record["train_steps"], 20)
    self.assertEqual(record["final_step"], 20)
    self.assertEqual(record["base_learning_rate"], 0.2)
    self.assertEqual(record["base_batch_size"], 128)
    self.assertEqual(record["peak_learning_rate"], 0.05)
    self.assertEqual(record["model"], "mlp")
    self.assertEqual(record["data"]["dataset"], "fashion_mnist")
    self.assertIsNone(record["data"]["feature_spec"])
    self.assertEqual(record["environment"],
                     [{"field": "model_dir", "variable": "AIP_MODEL_DIR"}])
    self.assertIsNone(record["trial"])
    self.assertTrue(record["cluster"]["is_chief"])
    self.assertEqual(record["flags"], {"train_steps": "20"})
    self.assertEqual(record["config"]["model_dir"], self.dir)
    self.assertEqual([h["step"] for h in record["history"]], [10, 20])
    self.assertEqual(record["final_metrics"]["eval_loss"], 0.4)
    self.assertEqual(record["final_metrics"]["train_loss"], 0.5)
    self.assertAlmostEqual(record["final_metrics"]["train_accuracy"], 0.625)
    self.assertIsNone(record["objectives"])
    self.assertEqual(record["seconds"], {"total": 2.0, "training": 1.5})
    self.assertEqual(record["lr_schedule"]["class_name"], "LinearWarmup")

  def test_the_model_name_given_overrides_the_config(self):
    self.assertEqual(self._build(model_name="my.module:build")["model"],
                     "my.module:build")
    self.assertEqual(self._build()["one_device"], {})

  def test_final_metrics_adds_each_metric(self):
    self.assertEqual(
        manifest.final_metrics({"loss": 1.0, "auc": 0.7, "mae": 0.3},
                               {"loss": 2.0, "mae": 0.4}, ("mae",)),
        {"eval_loss": 1.0, "eval_auc": 0.7, "eval_examples": None,
         "train_loss": 2.0, "train_auc": None, "eval_mae": 0.3,
         "train_mae": 0.4})

  def test_final_metrics_omit_what_does_not_apply(self):
    # A regression model without accuracy or AUC, and no evaluation.
    self.assertEqual(
        manifest.final_metrics({}, {"loss": 2.0, "mae": 0.4}, ("mae",)),
        {"train_loss": 2.0, "train_mae": 0.4})
    self.assertEqual(
        manifest.final_metrics({"loss": 1.0, "num_examples": 8, "mae": 0.3},
                               {"loss": 2.0, "mae": 0.4}, ("mae",)),
        {"eval_loss": 1.0, "eval_examples": 8, "eval_mae": 0.3,
         "train_loss": 2.0, "train_mae": 0.4})

  def test_final_metrics_of_a_step_that_logs_no_loss(self):
    # A GAN's own train_step logs d_loss and g_loss: no None train_loss.
    self.assertEqual(
        manifest.final_metrics({}, {"d_loss": 0.5, "g_loss": 0.7}), {})
    self.assertEqual(
        manifest.final_metrics({"num_examples": 8}, {"d_loss": 0.5}),
        {"eval_examples": 8})

  def test_batch_norm_facts_only_for_a_model_with_batch_norm(self):
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    nested = keras.Sequential([keras.Input((3,)), keras.Sequential(
        [keras.layers.Dense(2), keras.layers.BatchNormalization()])])
    self.assertFalse(manifest.has_batch_norm(plain))
    self.assertTrue(manifest.has_batch_norm(nested))
    self.assertIn("sync_batch_norm", self._build())
    record = self._build(batch_norm=False)
    self.assertNotIn("sync_batch_norm", record)
    self.assertNotIn("sync_batch_norm_reason", record)

  def test_written_as_strict_json_and_read_back(self):
    path = manifest.write_manifest(
        self.dir, {"loss": math.inf, "auc": float("nan"),
                   "value": np.float32(0.5), "nested": [1, -math.inf]})
    self.assertEqual(path, os.path.join(self.dir, manifest.MANIFEST_FILE))
    with open(path) as f:
      text = f.read()
    self.assertNotIn("Infinity", text)
    self.assertNotIn("NaN", text)
    json.loads(text)  # Strict JSON.
    self.assertEqual(manifest.read_manifest(self.dir),
                     {"loss": None, "auc": None, "value": 0.5,
                      "nested": [1, None]})
    self.assertEqual(os.listdir(self.dir), [manifest.MANIFEST_FILE])

  def test_file_fingerprints_are_size_and_sha256(self):
    path = os.path.join(self.dir, "shard")
    data = b"x" * 3000
    with open(path, "wb") as f:
      f.write(data)
    self.assertEqual(manifest.file_fingerprints([path]), [
        {"path": path, "bytes": 3000,
         "sha256": hashlib.sha256(data).hexdigest()}])

  def test_run_header_has_the_versions(self):
    header = manifest.run_header(manifest.ManifestOptions.of(self.config))
    self.assertEqual(header["versions"]["tensorflow"], tf.__version__)
    self.assertRegex(header["created"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
    self.assertIn("allocator", header)


if __name__ == "__main__":
  absltest.main()
