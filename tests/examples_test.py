"""The example projects in examples/, run as a new user runs them.

Each project is copied to a scratch folder and run from there with plain
`python` (tfdist from this checkout on PYTHONPATH), under one device,
MirroredStrategy over 2 logical CPUs and a 2-worker MultiWorkerMirrored job
(`tfdist.launch`), one short run per cell:

* `examples/tagging`: its own TFRecords through `--feature_spec`, its own
  `models/` package (`--model=models.tagger:build_tagger`) and `flags.py`,
  from the command line;
* `examples/movielens_rating`: its own Keras model and dataset function
  through `tfdist.fit`, on MovieLens-100k from the recbole package.

They check the manifest, a resume, the SavedModel against the checkpoint,
that 2 replicas and 2 workers compute the metrics one process computes
(`--mode=eval` on the tagging job's last checkpoint, `--mode=continuous_eval`
on every checkpoint of the rating job), and,
in a child process with an in-process cluster, that the rating model's
tables are sharded across 2 ps tasks when it trains under
ParameterServerStrategy.

Cost (Bazel on 2 cores, 1 December 2026): 160 to 200 s: two or three
`python` runs per test, 35 to 45 s a test (the parameter-server child about
20 s), nearly all process start-up and graph building.
"""

import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys

from absl import flags
from absl.testing import absltest
import numpy as np
import portpicker
import tensorflow as tf

from tests import testutil
from tfdist import api
from tfdist.config import TrainConfig
from tfdist.data import feature_spec
from tfdist.data import input_pipeline
from tfdist.distribute import parameter_server as ps_lib
from tfdist.observability import manifest as manifest_lib
from tfdist.runtime import run_options
from tfdist.training import assembly
from tfdist.training import batch_plan
from tfdist.training import lr_schedule
from tfdist.training import step_runner

EXAMPLES = os.path.join(testutil.REPO_ROOT, "examples")
_CHILD_ENV = "TFDIST_EXAMPLES_TEST_CHILD"
_TIMEOUT = 300


def copy_project(name: str) -> str:
  """A copy of `examples/<name>` in a scratch folder (files, not links)."""
  dest = os.path.join(testutil.scratch_dir(), name)
  shutil.copytree(os.path.join(EXAMPLES, name), dest, symlinks=False,
                  ignore=shutil.ignore_patterns("__pycache__", "data", "BUILD"))
  return dest


def run(project: str, args, *, timeout: float = _TIMEOUT
        ) -> subprocess.CompletedProcess:
  """`python args...` from the project's folder, tfdist from this checkout."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  env["PYTHONPATH"] = os.pathsep.join(
      [testutil.REPO_ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
  return subprocess.run([sys.executable, *args], cwd=project, env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True, timeout=timeout)


def load_module(path: str, name: str):
  """Imports a project's file under `name` (not its own module name)."""
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


class ProjectTest(absltest.TestCase):

  def run_ok(self, args, **kwargs):
    proc = run(self.project, args, **kwargs)
    self.assertEqual(proc.returncode, 0, proc.stdout[-6000:])
    return proc

  def manifest(self, model_dir):
    return manifest_lib.read_manifest(model_dir)

  def assert_same_metrics(self, a: dict, b: dict, names, places=5):
    for name in names:
      self.assertAlmostEqual(a[name], b[name], places=places, msg=name)

  def saved_model_matches_checkpoint(self, model_dir, model, inputs):
    """The SavedModel serves what the last checkpoint's weights compute."""
    tf.train.Checkpoint(model=model).restore(tf.train.latest_checkpoint(
        os.path.join(model_dir, "checkpoints"))).expect_partial()
    served = tf.saved_model.load(os.path.join(model_dir, "saved_model"))
    out = served.signatures["serving_default"](
        **{k: tf.constant(v) for k, v in inputs.items()})
    out = list(out.values())[0].numpy()
    np.testing.assert_allclose(out, model(inputs, training=False).numpy(),
                               rtol=1e-5, atol=1e-5)
    return out


class TaggingProjectTest(ProjectTest):
  """Feature spec + the project's own models/ and flags.py, from the CLI."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.project = copy_project("tagging")
    proc = run(cls.project, ["make_data.py", "--out_dir=data",
                             "--num_train=1024", "--num_eval=256",
                             "--num_shards=4"])
    assert proc.returncode == 0, proc.stdout[-3000:]

  def train(self, model_dir, *extra, launcher=()):
    args = list(launcher) + ([] if launcher else ["-m", "tfdist.train"])
    return self.run_ok(args + [
        "--feature_spec=feature_spec.json", "--train_files=data/train-*",
        "--eval_files=data/eval-*", "--model=models.tagger:build_tagger",
        f"--model_dir={model_dir}", "--batch_size=64", "--log_steps=4",
        "--checkpoint_steps=8", "--seed=3", "--optimizer=adam",
        "--base_learning_rate=0.01", "--lr_scaling=none", *extra])

  def check_manifest(self, manifest, *, strategy, replicas, final_step):
    self.assertEqual(manifest["strategy"], strategy)
    self.assertEqual(manifest["num_replicas_in_sync"], replicas)
    self.assertEqual(manifest["global_batch_size"], 64)
    self.assertEqual(manifest["per_replica_batch_size"], 64 // replicas)
    self.assertEqual(manifest["final_step"], final_step)
    self.assertEqual(manifest["model"], "models.tagger:build_tagger")
    self.assertEqual(manifest["data"]["dataset"], "feature_spec")
    self.assertEqual(manifest["data"]["num_train_examples"], 1024)
    self.assertLen(manifest["data"]["train_files"], 4)
    self.assertEqual(manifest["objectives"],
                     {"loss": "binary_crossentropy",
                      "metrics": ["auc", "accuracy"], "source": "compile"})
    final = manifest["final_metrics"]
    self.assertEqual(final["eval_examples"], 256)  # Every example once.
    # It learns (a chance-level tagger scores 0.5; 8 steps reach about 0.9).
    self.assertBetween(final["eval_auc"], 0.75, 1.0)
    self.assertBetween(final["eval_accuracy"], 0.0, 1.0)
    self.assertTrue(np.isfinite(final["train_loss"]))

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

  def test_multi_worker_then_eval(self):
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    self.train(model_dir, "--distribution_strategy=multi_worker_mirrored",
               "--train_steps=16",
               launcher=["-m", "tfdist.launch", "--num_workers=2", "--"])
    manifest = self.manifest(model_dir)
    self.check_manifest(manifest, strategy="multi_worker_mirrored",
                        replicas=2, final_step=16)
    self.assertEqual(manifest["num_workers"], 2)
    # One process evaluating the job's last checkpoint gets what the two
    # workers' summed metric states gave.
    proc = self.train(model_dir, "--mode=eval")
    self.assertIn("Eval of ", proc.stdout)
    results_path = os.path.join(model_dir, "eval", "eval_results.jsonl")
    with open(results_path) as f:
      once = [json.loads(line) for line in f]
    self.assertEqual([r["step"] for r in once], [16])
    final = manifest["final_metrics"]
    self.assert_same_metrics(
        {"loss": final["eval_loss"], "auc": final["eval_auc"],
         "accuracy": final["eval_accuracy"]}, once[0],
        ["loss", "auc", "accuracy"])
    self.assertTrue(glob.glob(os.path.join(model_dir, "eval",
                                           "events.out.tfevents.*")))


class RatingProjectTest(ProjectTest):
  """A Keras model and dataset function through tfdist.fit."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.project = copy_project("movielens_rating")

  def train(self, model_dir, *extra, module=False):
    args = (["-m", "tfdist.launch", "--num_workers=2",
             "--module=rating_regression", "--"] if module else
            ["rating_regression.py"])
    return self.run_ok(args + [f"--model_dir={model_dir}",
                               "--batch_size=256", "--log_steps=10",
                               "--seed=3", *extra])

  def check_manifest(self, manifest, *, strategy, replicas, final_step):
    self.assertEqual(manifest["strategy"], strategy)
    self.assertEqual(manifest["num_replicas_in_sync"], replicas)
    self.assertEqual(manifest["final_step"], final_step)
    self.assertEqual(manifest["model"], "__main__:build_model")
    self.assertEqual(manifest["data"]["dataset"], "__main__:make_dataset")
    self.assertEqual(manifest["data"]["train_files"], [])
    self.assertEqual(manifest["data"]["input_sharding"]["mode"],
                     "example" if replicas > 1 and strategy ==
                     "multi_worker_mirrored" else "none")
    self.assertEqual(manifest["data"]["num_train_examples"], 80034)
    # The script's own default for an unset --optimizer.
    self.assertEqual(manifest["config"]["optimizer"], "adam")
    self.assertEqual(manifest["objectives"], {
        "loss": "mse", "metrics": ["rmse", "mae"], "source": "compile"})
    final = manifest["final_metrics"]
    self.assertEqual(final["eval_examples"], 19966)  # Every rating once.
    # Stars are 1..5: a model that learned anything is well within 2.
    self.assertBetween(final["eval_rmse"], 0.8, 2.0)
    self.assertAlmostEqual(final["eval_rmse"] ** 2, final["eval_loss"],
                           places=4)

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

  def test_multi_worker_through_launch_module_then_continuous_eval(self):
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    self.train(model_dir, "--distribution_strategy=multi_worker_mirrored",
               "--train_steps=20", "--checkpoint_steps=10", module=True)
    manifest = self.manifest(model_dir)
    self.check_manifest(manifest, strategy="multi_worker_mirrored",
                        replicas=2, final_step=20)
    self.assertEqual(manifest["num_workers"], 2)
    # The side-car evaluator, after the job: every checkpoint once, in step
    # order, until the final step's; one process gets what the two workers'
    # summed metric states gave.
    self.train(model_dir, "--mode=continuous_eval", "--train_steps=20")
    with open(os.path.join(model_dir, "eval", "eval_results.jsonl")) as f:
      results = [json.loads(line) for line in f]
    self.assertEqual([r["step"] for r in results], [10, 20])
    final = manifest["final_metrics"]
    self.assert_same_metrics(
        {"loss": final["eval_loss"], "rmse": final["eval_rmse"],
         "mae": final["eval_mae"]}, results[1], ["loss", "rmse", "mae"])

  def test_tables_shard_under_parameter_servers(self):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=testutil.REPO_ROOT, **{_CHILD_ENV: self.project})
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)],
                          env=env, cwd=self.project, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True,
                          timeout=_TIMEOUT)
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
      run_options.lr_options(config), global_batch_size=64,
      steps_per_epoch=plan_batch.steps_per_epoch,
      total_steps=6)

  class Plan:  # What assembly.build reads of a run plan.
    global_batch_size = 64
    sync_batch_norm = False
  Plan.lr = lr
  Plan.batch = plan_batch
  parts = assembly.build(run_options.assembly_options(config), task=task,
                         strategy=strategy, plan=Plan)
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
