"""The example projects in examples/, one TensorFlow process at a time.

Each project (tests/examples_testlib.py) is copied to a scratch folder and
run from there with plain `python`, as a new user runs it, under one device
and MirroredStrategy over 2 logical CPUs:

* `examples/tagging`: its own TFRecords through `--feature_spec`, its own
  `models/` package and `flags.py`, from the command line: one device, then
  the same run resumed under Mirrored, and the SavedModel against the
  checkpoint;
* `examples/movielens_rating`: its own Keras model and dataset function
  through `tfdist.fit`: 2 replicas on the same global batch take the steps
  one device takes, and the SavedModel against the checkpoint; and, in a
  child process with an in-process cluster, the rating model's tables are
  sharded across 2 ps tasks when it trains under ParameterServerStrategy.

The two-worker jobs are tests/examples_test.py (a cluster target). No test
here runs two TensorFlow processes at once, so Bazel runs this file beside
a cluster target.

Cost (Bazel on 2 cores): five `python` runs (and the tagging data's), 15 to
20 s each, nearly all process start-up and graph building.
"""

import json
import os
import subprocess
import sys

from absl import flags
from absl.testing import absltest
import numpy as np
import portpicker
import tensorflow as tf

from tests import examples_testlib
from tests import testutil
from tfdist import api
from tfdist.experiment import prepare
from tfdist.config import TrainConfig
from tfdist.data import feature_spec
from tfdist.data import input_pipeline
from tfdist.distribute import parameter_server as ps_lib
from tfdist.training import assembly
from tfdist.training.plan import batch_plan
from tfdist.training.plan import lr_schedule
from tfdist.training.step import step_runner

_CHILD_ENV = "TFDIST_EXAMPLES_TEST_CHILD"
load_module = examples_testlib.load_module


class TaggingProjectTest(examples_testlib.TaggingProject):

  def test_one_device_then_mirrored_resume_and_saved_model(self):
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    self.train(model_dir, "--distribution_strategy=one_device",
               "--train_steps=8")
    self.check_manifest(self.manifest(model_dir), strategy="one_device",
                        replicas=1, final_step=8)
    # The same run resumed under MirroredStrategy over 2 logical CPUs (a
    # checkpoint holds no strategy).
    self.train(model_dir, "--distribution_strategy=mirrored",
               "--num_cpu_devices=2", "--train_steps=16")
    manifest = self.manifest(model_dir)
    self.check_manifest(manifest, strategy="mirrored", replicas=2,
                        final_step=16)
    self.assertTrue(manifest["restored_from"].endswith("ckpt-8"))
    self.assertEqual([h["step"] for h in manifest["history"]],
                     [4, 8, 12, 16])
    self.assertLen({h["process"] for h in manifest["history"]}, 2)
    # The SavedModel serves the named features (dict inputs).
    spec = feature_spec.load(os.path.join(self.project, "feature_spec.json"))
    tagger = load_module(os.path.join(self.project, "models", "tagger.py"),
                         "tagging_project_tagger")
    model = tagger.build_tagger(spec.dataset_spec())
    rng = np.random.RandomState(0)
    out = self.saved_model_matches_checkpoint(model_dir, model, {
        "signal": rng.normal(size=(3, 16)).astype(np.float32),
        "channel": np.array([0, 3, 7], np.int64)})
    self.assertEqual(out.shape, (3, 4))
    self.assertTrue(((out > 0) & (out < 1)).all())


class RatingProjectTest(examples_testlib.RatingProject):

  def test_one_device_mirrored_and_saved_model(self):
    one = os.path.join(testutil.scratch_dir(), "one")
    self.train(one, "--distribution_strategy=one_device", "--train_steps=20")
    first = self.manifest(one)
    self.check_manifest(first, strategy="one_device", replicas=1,
                        final_step=20)
    # Two replicas on the same global batch take the same steps.
    mirrored = os.path.join(testutil.scratch_dir(), "mirrored")
    self.train(mirrored, "--distribution_strategy=mirrored",
               "--num_cpu_devices=2", "--train_steps=20")
    second = self.manifest(mirrored)
    self.check_manifest(second, strategy="mirrored", replicas=2,
                        final_step=20)
    self.assertEqual(second["per_replica_batch_size"], 128)
    for key in ("eval_loss", "eval_rmse", "eval_mae"):
      self.assertAlmostEqual(first["final_metrics"][key],
                             second["final_metrics"][key], places=4, msg=key)
    # (Resuming: TaggingProjectTest.) The SavedModel serves the checkpoint.
    rating = load_module(os.path.join(self.project, "rating_regression.py"),
                         "rating_project")
    self.saved_model_matches_checkpoint(one, rating.build_model(), {
        "user": np.array([1, 50, 943], np.int64),
        "item": np.array([1, 1682, 7], np.int64)})

  def test_tables_shard_under_parameter_servers(self):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=testutil.REPO_ROOT, **{_CHILD_ENV: self.project})
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)],
                          env=env, cwd=self.project, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True,
                          timeout=examples_testlib.TIMEOUT)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    self.assertTrue(lines, proc.stdout[-4000:])
    result = json.loads(lines[-1][len("RESULT "):])
    tables = {t["layer"]: t for t in result["placement"]["tables"]}
    # 944 x 32 float32 rows (118 KiB) in shards of at least 16 KiB, at most
    # one per ps task; the 1-wide bias tables (3.7 KiB) stay whole.
    user = tables["user_embedding"]
    self.assertEqual(user["num_shards"], 2)
    self.assertEqual(sorted(s["task"] for s in user["shards"]),
                     ["ps:0", "ps:1"])
    self.assertEqual(tables["user_bias"]["num_shards"], 1)
    self.assertEqual(result["steps"], 6)
    self.assertTrue(np.isfinite(result["loss"]))
    self.assertEqual(sorted(result["metrics"]), ["loss", "mae", "rmse"])


def _child_parameter_server(project: str) -> dict:
  """Trains the rating model for 6 steps on an in-process cluster (a worker
  and 2 ps tasks as `tf.distribute.Server`s on 127.0.0.1), through tfdist's
  task, assembly and coordinator step runner; returns the placement."""
  sys.argv = sys.argv[:1]
  rating = load_module(os.path.join(project, "rating_regression.py"),
                       "rating_project")
  flags.FLAGS(sys.argv)
  spec = tf.train.ClusterSpec({
      "worker": [f"127.0.0.1:{portpicker.pick_unused_port()}"],
      "ps": [f"127.0.0.1:{portpicker.pick_unused_port()}" for _ in range(2)]})
  servers = [tf.distribute.Server(spec, job_name=job, task_index=i,
                                  protocol="grpc", start=True)
             for job, i in (("worker", 0), ("ps", 0), ("ps", 1))]
  del servers  # Kept alive by the runtime until the process ends.
  strategy = tf.distribute.ParameterServerStrategy(
      tf.distribute.cluster_resolver.SimpleClusterResolver(spec,
                                                           rpc_layer="grpc"),
      variable_partitioner=ps_lib.make_partitioner(
          "min_size", num_ps=2, shard_bytes=16 << 10, max_shards=0))
  config = TrainConfig(model_dir="/tmp/unused", train_steps=6,
                       batch_size=64, optimizer="adam", log_steps=6,
                       distribution_strategy="parameter_server",
                       steps_per_execution=2)
  task = api.make_task(rating.build_model, rating.make_dataset, config=config)
  plan_batch = batch_plan.make_batch_plan(
      num_replicas_in_sync=1, batch_size=64, per_replica_batch_size=None,
      gradient_accumulation_steps=1, num_train_examples=80034,
      num_input_pipelines=1)
  lr = lr_schedule.plan_learning_rate(
      config.optimization.learning_rate, global_batch_size=64,
      steps_per_epoch=plan_batch.steps_per_epoch,
      total_steps=6)

  class Plan:  # What assembly.build reads of a run plan.
    global_batch_size = 64
    sync_batch_norm = False
  Plan.lr = lr
  Plan.batch = plan_batch
  options = prepare.assembly_options(config, None)
  parts = assembly.build(options, task=task, strategy=strategy, plan=Plan)
  placement = ps_lib.describe_placement(parts.model, parts.optimizer,
                                        large_bytes=16 << 10)
  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
  options = input_pipeline.options_for(task.dataset, global_batch_size=64,
                                       is_training=True, cache=False)
  iterator = iter(coordinator.create_per_worker_dataset(
      lambda: strategy.distribute_datasets_from_function(
          lambda ctx: input_pipeline.make_dataset(options, ctx))))
  runner = step_runner.CoordinatorStepRunner(
      trainer=parts.trainer, coordinator=coordinator, iterator=iterator)
  sums = runner.run(6, start_step=0).sums
  metrics = parts.trainer.summarize(sums, 6)
  return {"placement": placement, "steps": int(parts.trainer.global_step),
          "loss": metrics["loss"], "metrics": sorted(metrics)}


if __name__ == "__main__":
  if os.environ.get(_CHILD_ENV):
    print("RESULT " + json.dumps(_child_parameter_server(
        os.environ[_CHILD_ENV]), default=str), flush=True)
  else:
    absltest.main()
