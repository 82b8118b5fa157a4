"""Parameter-server training on real local clusters (127.0.0.1).

Each test starts ps, worker, chief (and evaluator) processes of
`python -m tfdist.train` with TF_CONFIG (tests/ps_testutil.py), on a
20,000-rating slice of MovieLens-100k, or goes through
`python -m tfdist.launch`. Every wait has a deadline and every process
started is killed by PID (the launcher by its own process group) at the
end.

Each cluster run is checked by several assertions: the whole run with an
evaluator also has a worker SIGKILLed mid-run (worker failures are
tolerated), and the launcher run whose ps task is SIGKILLed also shows the
chief failing fast on its own (status 200, naming the loss) before the
launcher restarts every task and the run resumes.

Cost (pytest on the shared 2-core machine, 1 December 2026, load average 3
to 8): 188 s in all (208 s with one cluster per claim, load average 0.5 to
3): the two ParameterServerTrainingTest runs 31 and 49 s, the
one-controller test (two launcher runs and a Mirrored run) 60 to 100 s.
"""

import json
import os
import re
import signal
import tempfile
import time

from absl.testing import absltest
import psutil
import tensorflow as tf

from tests import ps_testutil
from tests import testutil
from tfdist.data import movielens

_DATA = {}


def _data() -> dict:
  if not _DATA:
    out = os.path.join(tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR")),
                       "movielens")
    movielens.convert_movielens(out, limit=20_000, train_shards=4,
                                test_shards=1)
    _DATA.update(train=os.path.join(out, "train-*.tfrecord.gz"),
                 eval=os.path.join(out, "test-*.tfrecord.gz"))
  return _DATA


def _flags(model_dir: str, **overrides) -> list:
  flags = {
      "distribution_strategy": "parameter_server", "model": "ranking",
      "dataset": "movielens", "train_files": _data()["train"],
      "eval_files": _data()["eval"], "model_dir": model_dir,
      "train_steps": 60, "batch_size": 64, "steps_per_execution": 5,
      "log_steps": 10, "checkpoint_steps": 20,
      # 20,000 x 16 float32 = 1.2 MiB: 2 shards at the 256 KiB minimum.
      "hash_buckets": 20_000, "shuffle_buffer_size": 1000,
  }
  flags.update(overrides)
  return [f"--{k}={v}" for k, v in flags.items()]


def _read_manifest(model_dir: str) -> dict:
  with open(os.path.join(model_dir, "run_manifest.json")) as f:
    return json.load(f)


class ParameterServerTrainingTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    self.model_dir = os.path.join(self.tmp, "run")

  def _cluster(self, flags, **kwargs):
    cluster = ps_testutil.LocalCluster(
        flags, os.path.join(self.tmp, f"logs-{time.time():.0f}"), **kwargs)
    self.addCleanup(cluster.stop)
    return cluster.start()

  def _chief_log(self, cluster):
    return cluster.log("chief-0")[-6000:]

  def test_end_to_end_with_evaluator_and_a_worker_killed_mid_run(self):
    # One cluster for two claims: the whole run (placement, evaluator,
    # export of the metrics), and worker failures tolerated: worker-1 is
    # SIGKILLed at step 20 of 120 and the chief finishes on worker-0.
    cluster = self._cluster(
        _flags(self.model_dir, train_steps=120, steps_per_execution=2),
        num_workers=2, num_ps=2, evaluator=True)
    self.assertTrue(cluster.wait_for_log("chief-0", ", step 20/120: ",
                                         timeout=180),
                    self._chief_log(cluster))
    cluster.kill("worker-1")
    # The kill came mid-run (else the run would prove nothing about it).
    self.assertIsNone(cluster.procs["chief-0"].poll(),
                      self._chief_log(cluster))
    self.assertEqual(cluster.procs["worker-1"].returncode, -signal.SIGKILL)
    rc = cluster.wait("chief-0", timeout=240)
    self.assertEqual(rc, 0, self._chief_log(cluster))
    # The other worker and the ps tasks exit 0 once the chief marks the run
    # done.
    for name in ("worker-0", "ps-0", "ps-1", "evaluator-0"):
      self.assertEqual(cluster.wait(name, timeout=60), 0, cluster.log(name))
    manifest = _read_manifest(self.model_dir)
    self.assertEqual(manifest["final_step"], 120)
    self.assertEqual(manifest["history"][-1]["step"], 120)
    self.assertEqual(manifest["strategy"], "parameter_server")
    placement = manifest["parameter_server"]["placement"]
    tables = {t["layer"]: t for t in placement["tables"]}
    users = tables["user_id_embedding"]
    self.assertEqual(users["num_shards"], 2)
    self.assertEqual([s["task"] for s in users["shards"]], ["ps:0", "ps:1"])
    self.assertEqual(tables["gender_embedding"]["num_shards"], 1)
    # The optimizer's slots of each shard (Adam, MovieLens's recommended
    # optimizer: 2) sit on that shard's ps.
    slots = {v["name"]: v["task"] for v in placement["large_variables"]}
    for part, task in (("part_0", "ps:0"), ("part_1", "ps:1")):
      names = [n for n in slots if "user_id_embedding" in n and part in n]
      self.assertLen(names, 3, slots)  # The table shard and its 2 slots.
      self.assertEqual({slots[n] for n in names}, {task})
    self.assertIsNotNone(manifest["final_metrics"]["eval_auc"])
    self.assertIn("held-out evaluation at step 120: ",
                  cluster.log("chief-0"))
    # The evaluator saw each checkpoint once, in order.
    with open(os.path.join(self.model_dir, "eval",
                           "eval_results.jsonl")) as f:
      results = [json.loads(line) for line in f if line.strip()]
    steps = [r["step"] for r in results]
    self.assertEqual(steps, sorted(set(steps)))
    # One process outside the cluster, on its one CPU device, with the
    # coordinator's evaluation batch.
    self.assertEqual(manifest["eval_batch_size"], max(
        manifest["global_batch_size"], 1024))
    self.assertEqual({(r["evaluated_with"]["strategy"],
                       r["evaluated_with"]["global_batch_size"])
                      for r in results},
                     {("one_device", manifest["eval_batch_size"])})
    self.assertIn(120, steps)
    self.assertTrue(any(n.startswith("events.out.tfevents") for n in
                        os.listdir(os.path.join(self.model_dir, "eval"))))
    with open(os.path.join(self.model_dir, "checkpoints",
                           "shards.json")) as f:
      self.assertEqual(json.load(f)["user_id_embedding"], 2)

  def test_ps_killed_chief_fails_fast_and_launcher_restarts_cluster(self):
    # A lost ps task ends the chief itself, at once, non-zero, naming the
    # loss (what a platform without tfdist.launch restarts on); the
    # launcher then restarts every task (new ports) and the run resumes.
    flags = _flags(self.model_dir, train_steps=100, steps_per_execution=2)
    log_path = os.path.join(self.tmp, "launch.log")
    launcher = ps_testutil.start_launcher(
        self, ["--num_workers=1", "--num_ps=2", "--max_restarts=1"], flags,
        log_path)

    def read_log():
      with open(log_path, errors="replace") as f:
        return f.read()

    def wait_for(text, seconds):
      deadline = time.time() + seconds
      while text not in read_log():
        self.assertLess(time.time(), deadline,
                        f"no {text!r} within {seconds} s:\n"
                        + read_log()[-4000:])
        self.assertIsNone(launcher.poll(), read_log()[-4000:])
        time.sleep(0.2)

    wait_for(", step 40/100: ", 180)
    ps_task = None
    for child in psutil.Process(launcher.pid).children(recursive=True):
      try:
        tf_config = json.loads(child.environ().get("TF_CONFIG", "{}"))
      except (psutil.Error, ValueError):
        continue
      if tf_config.get("task") == {"type": "ps", "index": 1}:
        ps_task = child
    self.assertIsNotNone(ps_task, "no ps:1 process under the launcher")
    ps_task.send_signal(signal.SIGKILL)
    wait_for("restarting the group", 90)
    log = read_log()
    first = log[:log.index("restarting the group")]
    # The chief exited on its own with the peer-lost status (200), not
    # killed by the launcher (137) after its few seconds' wait for the
    # survivors, and said why and what a restart resumes from.
    self.assertRegex(first, r"exit statuses: chief:0 200\b")
    self.assertRegex(first, r"\[chief:0\] .*lost a ps task")
    self.assertIn("resumes from the last checkpoint", first)
    rc = launcher.wait(timeout=300)
    log = read_log()
    self.assertEqual(rc, 0, log[-6000:])
    self.assertRegex(log, r"restored .*ckpt-(20|40|60|80): resuming at step")
    manifest = _read_manifest(self.model_dir)
    self.assertEqual(manifest["final_step"], 100)
    self.assertIsNotNone(manifest["restored_from"])


class OneControllerTest(absltest.TestCase):
  """Parameter-server training gets what synchronous training has: `auto`
  for strategy and dtype, Keras callbacks, SIGTERM preemption with a
  checkpoint and resume, a SavedModel, and the same manifest keys as a
  Mirrored run (outside the strategy's own section)."""

  def setUp(self):
    super().setUp()
    self.tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))

  def _launch(self, args, log_path):
    return ps_testutil.start_launcher(
        self, ["--num_workers=1", "--num_ps=1",
               "--module=tests.callback_testlib"], args, log_path)

  def _read(self, path):
    with open(path, errors="replace") as f:
      return f.read()

  def test_auto_callbacks_sigterm_resume_export_and_manifest_keys(self):
    model_dir = os.path.join(self.tmp, "ps")
    events = os.path.join(self.tmp, "events.jsonl")
    args = _flags(model_dir, distribution_strategy="auto", dtype="auto",
                  train_steps=40, checkpoint_steps=10, steps_per_execution=2,
                  preemption_grace_seconds=30) + [f"--events_file={events}"]
    log_path = os.path.join(self.tmp, "first.log")
    launcher = self._launch(args, log_path)
    deadline = time.time() + 240
    while ", step 10/40: " not in self._read(log_path):
      self.assertLess(time.time(), deadline, self._read(log_path)[-4000:])
      self.assertIsNone(launcher.poll(), self._read(log_path)[-4000:])
      time.sleep(0.2)
    launcher.send_signal(signal.SIGTERM)  # Forwarded to every task.
    self.assertEqual(launcher.wait(timeout=120), 128 + signal.SIGTERM,
                     self._read(log_path)[-6000:])
    log = self._read(log_path)
    stopped = re.search(r"\[chief:0\] .*Stopped by SIGTERM at step (\d+)",
                        log)
    self.assertIsNotNone(stopped, log[-6000:])
    stopped = int(stopped.group(1))
    self.assertLess(stopped, 40)
    latest = tf.train.latest_checkpoint(os.path.join(model_dir,
                                                     "checkpoints"))
    self.assertTrue(latest.endswith(f"ckpt-{stopped}"), latest)
    # The same command resumes from that checkpoint and finishes.
    log_path = os.path.join(self.tmp, "second.log")
    launcher = self._launch(args, log_path)
    self.assertEqual(launcher.wait(timeout=300), 0,
                     self._read(log_path)[-6000:])
    self.assertRegex(self._read(log_path),
                     rf"\[chief:0\] .*resuming at step {stopped}\b")
    manifest = _read_manifest(model_dir)
    self.assertEqual((manifest["strategy"], manifest["dtype"]),
                     ("parameter_server", "fp32"))
    self.assertRegex(manifest["strategy_reason"],
                     "^auto: TF_CONFIG lists 1 parameter server")
    self.assertRegex(manifest["dtype_reason"], "^auto: ")
    self.assertEqual(manifest["final_step"], 40)
    self.assertTrue(manifest["restored_from"].endswith(f"ckpt-{stopped}"))
    self.assertEqual({h["step"] for h in manifest["history"]},
                     {10, 20, 30, 40} | ({stopped} if stopped % 10 else
                                         set()))
    # The SavedModel, exported by the coordinator, serves.
    reloaded = tf.saved_model.load(os.path.join(model_dir, "saved_model"))
    self.assertIn("serving_default", reloaded.signatures)
    # The Keras callback ran on the coordinator, with Keras's params, in
    # both processes.
    with open(events) as f:
      seen = [json.loads(line) for line in f]
    begins = [e for e in seen if e["hook"] == "train_begin"]
    self.assertLen(begins, 2)
    self.assertEqual(begins[0]["params"]["steps"],
                     manifest["steps_per_epoch"])
    self.assertTrue(any(e["hook"] == "epoch_end" and "val_auc" in e["logs"]
                        for e in seen))

    # A Mirrored run of the same model and data, with EarlyStopping: it
    # stops early, and its manifest has the same keys outside the
    # strategy's own section.
    mirrored_dir = os.path.join(self.tmp, "mirrored")
    result = testutil.run_module("tests.callback_testlib", _flags(
        mirrored_dir, distribution_strategy="mirrored", num_cpu_devices=2,
        train_steps=0, train_epochs=5, batch_size=1024,
        checkpoint_steps=0, log_steps=5) + [
            "--early_stopping_patience=0"], timeout=300)
    self.assertEqual(result.returncode, 0, result.stdout[-4000:])
    mirrored = _read_manifest(mirrored_dir)
    self.assertTrue(mirrored["stopped_early"])
    self.assertEqual(mirrored["final_step"], 2 * mirrored["steps_per_epoch"])
    self.assertEqual(set(mirrored) - {"mirrored"},
                     set(manifest) - {"parameter_server"})
    self.assertIn("placement", manifest["parameter_server"])


if __name__ == "__main__":
  absltest.main()
