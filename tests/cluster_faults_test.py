"""Clean runs are clean; an evaluator of any strategy; the binary's edges.

Real processes of `python -m tfdist.train` on 127.0.0.1, with
`TF_CPP_MIN_LOG_LEVEL` unset as a user has it:

* a Vertex AI `CLUSTER_SPEC` job: a chief and a worker (workerpool0/1)
  train with MultiWorkerMirroredStrategy while a `workerpool3` task
  evaluates every checkpoint and writes nothing of the chief's;
* clean one-device, MultiWorkerMirrored and parameter-server runs print no
  TensorFlow or gRPC line at WARNING or above, and each tfdist line once;
* the serving guide's example (docs/guides/serving.md) runs against a
  freshly exported SavedModel, and its input scaling is the training
  parser's;
* `--dry_run`: every start-up check and the plan, exit 0, nothing built or
  written; an unwritable `--model_dir` exits 2 before the plan.
"""

import json
import os
import re
import subprocess
import sys
import time

from absl.testing import absltest
import numpy as np
import portpicker
import tensorflow as tf

from tests import ps_testutil
from tests import testutil
from tfdist.data import datasets
from tfdist.data import movielens

_TFDIST_MODULES = testutil.TFDIST_MODULES
_PREFIX = testutil.LOG_PREFIX
noise = testutil.noise


def user_env(extra=None) -> dict:
  """The environment of a user who set nothing of TensorFlow's."""
  env = dict(os.environ)
  for name in ("TF_CPP_MIN_LOG_LEVEL", "TF_CONFIG", "CLUSTER_SPEC"):
    env.pop(name, None)
  env["PYTHONPATH"] = testutil.REPO_ROOT + os.pathsep + env.get(
      "PYTHONPATH", "")
  env.update(extra or {})
  return env


def repeated_tfdist_lines(text: str) -> list:
  """tfdist's log lines (prefix removed) that appear more than once."""
  seen, repeated = set(), []
  for line in text.splitlines():
    prefix = _PREFIX.match(line)
    if not (prefix and prefix["file"] in _TFDIST_MODULES):
      continue
    body = line[prefix.end():]
    if body in seen:
      repeated.append(line)
    seen.add(body)
  return repeated


def _train_flags(model_dir, data, **overrides):
  flags = dict(model_dir=model_dir, train_files=data["train"],
               eval_files=data["eval"], batch_size=64, train_steps=12,
               log_steps=6, checkpoint_steps=3, max_checkpoints=10,
               warmup_steps=2, seed=7)
  flags.update(overrides)
  return [f"--{k}={v}" for k, v in flags.items()]


def _tree(model_dir):
  """`{path: (size, mtime)}` of every file outside `eval/`."""
  out = {}
  for root, _, files in os.walk(model_dir):
    if os.path.relpath(root, model_dir).split(os.sep)[0] == "eval":
      continue
    for name in files:
      path = os.path.join(root, name)
      stat = os.stat(path)
      out[path] = (stat.st_size, stat.st_mtime_ns)
  return out


class CleanRunsTest(absltest.TestCase):

  def assertQuiet(self, text, who):
    self.assertEqual(noise(text), [], f"{who}:\n{text[-4000:]}")
    self.assertEqual(repeated_tfdist_lines(text), [],
                     f"{who}:\n{text[-4000:]}")

  def test_workerpool3_evaluates_a_multi_worker_mirrored_job(self):
    data = testutil.fashion_mnist_subset(limit=512, train_shards=4,
                                         test_shards=2)
    tmp = testutil.scratch_dir()
    model_dir = os.path.join(tmp, "run")
    ports = [portpicker.pick_unused_port() for _ in range(3)]
    cluster = {f"workerpool{pool}": [f"127.0.0.1:{port}"]
               for pool, port in zip((0, 1, 3), ports)}
    procs, logs = {}, {}
    for pool in (0, 1, 3):
      spec = {"cluster": cluster, "environment": "cloud", "job": {},
              "task": {"type": f"workerpool{pool}", "index": 0, "trial": ""}}
      logs[pool] = os.path.join(tmp, f"pool{pool}.log")
      with open(logs[pool], "wb") as log:
        procs[pool] = subprocess.Popen(
            [sys.executable, "-m", "tfdist.train", *_train_flags(
                model_dir, data, train_steps=6,
                distribution_strategy="multi_worker_mirrored")],
            cwd=testutil.REPO_ROOT,
            env=user_env({"CLUSTER_SPEC": json.dumps(spec)}),
            stdout=log, stderr=subprocess.STDOUT)
    for proc in procs.values():
      self.addCleanup(lambda p=proc: p.poll() is None and p.kill())

    def read(pool):
      with open(logs[pool], errors="replace") as f:
        return f.read()

    for pool in (0, 1):
      self.assertEqual(procs[pool].wait(timeout=400), 0, read(pool)[-4000:])
    trained = _tree(model_dir)
    self.assertEqual(procs[3].wait(timeout=200), 0, read(3)[-4000:])
    # The evaluator wrote nothing of the chief's: no checkpoint, SavedModel,
    # manifest or lease, nothing changed outside eval/.
    self.assertEqual(_tree(model_dir), trained)
    for text in ("Saved checkpoint", "SavedModel written", "Run manifest",
                 "lease on"):
      self.assertNotIn(text, read(3))
    manifest = json.load(open(os.path.join(model_dir, "run_manifest.json")))
    self.assertEqual(manifest["cluster"]["task_type"], "chief")
    self.assertEqual(manifest["num_replicas_in_sync"], 2)
    # It evaluated every checkpoint the chief saved, once, in order.
    state = tf.train.get_checkpoint_state(os.path.join(model_dir,
                                                       "checkpoints"))
    saved = [int(p.rsplit("-", 1)[1])
             for p in state.all_model_checkpoint_paths]
    self.assertEqual(saved, [3, 6])
    with open(os.path.join(model_dir, "eval", "eval_results.jsonl")) as f:
      evaluated = [json.loads(line)["step"] for line in f if line.strip()]
    self.assertEqual(evaluated, saved)
    # The chief (hosting the coordination service) left last: a worker
    # still alive after it had left logged an UNAVAILABLE heartbeat error.
    self.assertIn("The other 1 worker(s) have left", read(0))
    for pool in (0, 1, 3):
      self.assertQuiet(read(pool), f"workerpool{pool}")

  def test_a_parameter_server_run_is_quiet(self):
    out = os.path.join(testutil.scratch_dir(), "movielens")
    movielens.convert_movielens(out, limit=4_000, train_shards=4,
                                test_shards=1)
    tmp = testutil.scratch_dir()
    flags = [
        "--distribution_strategy=parameter_server", "--model=ranking",
        "--dataset=movielens",
        f"--train_files={os.path.join(out, 'train-*.tfrecord.gz')}",
        f"--eval_files={os.path.join(out, 'test-*.tfrecord.gz')}",
        f"--model_dir={os.path.join(tmp, 'run')}", "--train_steps=20",
        "--batch_size=64", "--steps_per_execution=5", "--log_steps=10",
        "--checkpoint_steps=10", "--hash_buckets=5000"]
    cluster = ps_testutil.LocalCluster(
        flags, os.path.join(tmp, "logs"), num_workers=1, num_ps=1,
        env={"TF_CPP_MIN_LOG_LEVEL": ""})  # As unset: tfdist's default.
    self.addCleanup(cluster.stop)
    cluster.start()
    for name in ("chief-0", "worker-0", "ps-0"):
      self.assertEqual(cluster.wait(name, timeout=400), 0,
                       cluster.log(name)[-4000:])
    self.assertIn("held-out evaluation at step 20: ",
                  cluster.log("chief-0"))
    for name in ("chief-0", "worker-0", "ps-0"):
      self.assertQuiet(cluster.log(name), name)

  def test_a_one_device_run_is_quiet_and_serves_as_documented(self):
    data = testutil.fashion_mnist_subset(limit=512, train_shards=4,
                                         test_shards=2)
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    proc = subprocess.run(
        [sys.executable, "-m", "tfdist.train", *_train_flags(
            model_dir, data, distribution_strategy="one_device")],
        cwd=testutil.REPO_ROOT, env=user_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=400)
    self.assertEqual(proc.returncode, 0, proc.stdout[-4000:])
    self.assertQuiet(proc.stdout, "one_device")
    # The serving guide's example, as written, against this SavedModel.
    with open(os.path.join(testutil.REPO_ROOT, "docs", "guides",
                           "serving.md")) as f:
      guide = f.read()
    example = re.search(
        r"<!-- run: tests/cluster_faults_test.py serving-example -->\n"
        r"```python\n(.*?)```", guide, re.S).group(1)
    export_line = re.search(r'^export_dir = ".*"', example, re.M)
    self.assertIsNotNone(export_line, example)
    example = example.replace(export_line.group(0), "export_dir = " + repr(
        os.path.join(model_dir, "saved_model")))
    scope = {}
    exec(compile(example, "docs/guides/serving.md (serving example)", "exec"),
         scope)  # pylint: disable=exec-used
    self.assertEqual(scope["logits"].shape, (8, 10))
    # Its inputs are the training parser's: the first test images (ids
    # 60000...) as parse_image_example makes them from the TFRecords.
    parsed = {}
    for path in tf.io.gfile.glob(data["eval"]):
      for record in tf.data.TFRecordDataset(path, compression_type="GZIP"):
        image, _, example_id = datasets.parse_image_example(record,
                                                            with_id=True)
        parsed[int(example_id)] = image.numpy()
    np.testing.assert_allclose(scope["images"],
                               np.stack([parsed[60000 + k]
                                         for k in range(8)]), rtol=0)

  def test_dry_run_checks_everything_and_builds_nothing(self):
    data = testutil.fashion_mnist_subset(limit=512, train_shards=4,
                                         test_shards=2)
    tmp = testutil.scratch_dir()
    model_dir = os.path.join(tmp, "run")
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "tfdist.train", "--dry_run",
         *_train_flags(model_dir, data, distribution_strategy="mirrored",
                       num_cpu_devices=2)],
        cwd=testutil.REPO_ROOT, env=user_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=300)
    self.assertEqual(proc.returncode, 0, proc.stdout[-4000:])
    self.assertIn("num_replicas_in_sync   2", proc.stdout)
    self.assertIn("eval examples          512 in 2 file(s)", proc.stdout)
    self.assertIn("tfdist: dry run: every start-up check passed",
                  proc.stdout)
    self.assertNotIn("Input pipeline", proc.stdout)  # Nothing built.
    self.assertFalse(os.path.exists(model_dir), os.listdir(tmp))
    # Bad output: status 2 right after the flags, before any plan.
    blocker = os.path.join(tmp, "a_file")
    open(blocker, "w").close()
    proc = subprocess.run(
        [sys.executable, "-m", "tfdist.train", "--dry_run",
         *_train_flags(os.path.join(blocker, "run"), data,
                       distribution_strategy="one_device")],
        cwd=testutil.REPO_ROOT, env=user_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=300)
    self.assertEqual(proc.returncode, 2, proc.stdout[-4000:])
    self.assertIn(f"--model_dir={os.path.join(blocker, 'run')} is not "
                  f"writable: {blocker} is a file, not a folder", proc.stdout)
    self.assertNotIn("tfdist plan:", proc.stdout)
    self.assertLess(time.time() - started, 280)


if __name__ == "__main__":
  absltest.main()
