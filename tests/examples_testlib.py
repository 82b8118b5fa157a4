"""What tests/examples_test.py and tests/examples_one_process_test.py share:
the example projects of examples/ copied to a scratch folder and run from
there with plain `python` (tfdist from this checkout on PYTHONPATH), as a
new user runs them, and the checks of each project's runs.

`TaggingProject` and `RatingProject` are test-case bases without tests:
each test file adds its own.
"""

import importlib.util
import os
import shutil
import subprocess
import sys

from absl.testing import absltest
import numpy as np
import tensorflow as tf

from tests import testutil
from tfdist.observability import manifest as manifest_lib

EXAMPLES = os.path.join(testutil.REPO_ROOT, "examples")
TIMEOUT = 300


def copy_project(name: str) -> str:
  """A copy of `examples/<name>` in a scratch folder (files, not links)."""
  dest = os.path.join(testutil.scratch_dir(), name)
  shutil.copytree(os.path.join(EXAMPLES, name), dest, symlinks=False,
                  ignore=shutil.ignore_patterns("__pycache__", "data", "BUILD"))
  return dest


def run(project: str, args, *, timeout: float = TIMEOUT
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


class TaggingProject(ProjectTest):
  """`examples/tagging`: a feature spec + the project's own models/ and
  flags.py, from the CLI (its data made once per class)."""

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

class RatingProject(ProjectTest):
  """`examples/movielens_rating`: a Keras model and dataset function through
  tfdist.fit."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.project = copy_project("movielens_rating")

  def train(self, model_dir, *extra, module=False):
    args = (["-m", "tfdist.launch", "--num_workers=2", "--output=all",
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
