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
launcher restarts every task and the run resumes; the restarted group is
then stopped by SIGTERM and resumed by a second launcher
(`_restart_and_preemption_run`, shared by ParameterServerTrainingTest and
OneControllerTest).

Cost (pytest on the shared 2-core machine, 7 December 2026, load average 3
to 4): 112 s wall and 134 CPU-seconds in all (the shared run 66 s, the
one-controller test's asserts and Mirrored run 12 s), where a launcher run
for the ps-killed claim and two for the SIGTERM claim took 136 s and 157
CPU-seconds (47 and 46 s).
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


# The steps of the run with an evaluator and a worker killed at step 20.
_EVALUATED_STEPS = 60
# The run of `_restart_and_preemption_run`: its steps, and what it left
# (filled once per process).
_PREEMPTED_STEPS = 60
_RUN = {}


class _Cleanups:
  """Collects `addCleanup` calls (of `ps_testutil.start_launcher`) for a
  run shared by two test classes."""

  def __init__(self):
    self.calls = []

  def addCleanup(self, fn):  # pylint: disable=invalid-name
    self.calls.append(fn)

  def run(self):
    for fn in reversed(self.calls):
      fn()


def _read(path: str) -> str:
  with open(path, errors="replace") as f:
    return f.read()


def _wait_for(launcher, log_path: str, pattern: str, seconds: float,
              start: int = 0) -> re.Match:
  """The first match of `pattern` in the launcher's log from `start`;
  fails after `seconds`, or when the launcher exits first."""
  deadline = time.time() + seconds
  regex = re.compile(pattern)
  while True:
    log = _read(log_path)
    match = regex.search(log, start)
    if match:
      return match
    if time.time() > deadline:
      raise AssertionError(f"no {pattern!r} within {seconds} s:\n"
                           + log[-4000:])
    if launcher.poll() is not None:
      raise AssertionError(f"the launcher exited ({launcher.returncode}) "
                           f"before {pattern!r}:\n" + log[-4000:])
    time.sleep(0.2)


def _restart_and_preemption_run() -> dict:
  """One parameter-server run (`tfdist.launch --num_ps=2 --max_restarts=1
  --module=tests.callback_testlib`, `auto` strategy and dtype) for two
  claims, once per process: at step 20, ps:1 is SIGKILLed (the chief fails
  fast, the launcher restarts the group, which resumes from a checkpoint);
  as the restarted chief resumes, the launcher gets SIGTERM (every task
  stops, the chief with a checkpoint); the same command then resumes and
  finishes: three group starts where a run per claim had four, and
  --train_steps=60 where the two runs had 100 and 40.

  Returns:
    `model_dir`, `events` (the callback's file), the first launcher's
    `first_status` and `first_log`, `ps_task` (ps:1's process), `latest`
    (the latest checkpoint after the first launcher), and the second's
    `second_status` and `second_log`.
  """
  if "error" in _RUN:
    raise AssertionError(_RUN["error"])
  if _RUN:
    return _RUN
  tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
  model_dir = os.path.join(tmp, "ps")
  events = os.path.join(tmp, "events.jsonl")
  args = _flags(model_dir, distribution_strategy="auto", dtype="auto",
                train_steps=_PREEMPTED_STEPS, checkpoint_steps=10,
                steps_per_execution=2, preemption_grace_seconds=30) + [
                    f"--events_file={events}"]
  launch_args = ["--num_workers=1", "--num_ps=2", "--max_restarts=1",
                 "--module=tests.callback_testlib"]
  cleanups = _Cleanups()
  run = {"model_dir": model_dir, "events": events}
  try:
    first_path = os.path.join(tmp, "first.log")
    launcher = ps_testutil.start_launcher(cleanups, launch_args, args,
                                          first_path)
    _wait_for(launcher, first_path, f", step 20/{_PREEMPTED_STEPS}: ", 240)
    ps_task = None
    for child in psutil.Process(launcher.pid).children(recursive=True):
      try:
        tf_config = json.loads(child.environ().get("TF_CONFIG", "{}"))
      except (psutil.Error, ValueError):
        continue
      if tf_config.get("task") == {"type": "ps", "index": 1}:
        ps_task = child
    run["ps_task"] = ps_task
    if ps_task is None:
      raise AssertionError("no ps:1 process under the launcher")
    ps_task.send_signal(signal.SIGKILL)
    restart = _wait_for(launcher, first_path, "restarting the group", 90)
    _wait_for(launcher, first_path, r"\[chief:0\] .*resuming at step", 240,
              start=restart.end())
    launcher.send_signal(signal.SIGTERM)  # Forwarded to every task.
    run["first_status"] = launcher.wait(timeout=120)
    run["first_log"] = _read(first_path)
    run["latest"] = tf.train.latest_checkpoint(
        os.path.join(model_dir, "checkpoints"))
    # The same command resumes from that checkpoint and finishes.
    second_path = os.path.join(tmp, "second.log")
    launcher = ps_testutil.start_launcher(cleanups, launch_args, args,
                                          second_path)
    run["second_status"] = launcher.wait(timeout=300)
    run["second_log"] = _read(second_path)
  except Exception as e:  # pylint: disable=broad-except
    _RUN["error"] = f"{type(e).__name__}: {e}"
    raise
  finally:
    cleanups.run()
  _RUN.update(run)
  return _RUN


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
    # SIGKILLed at step 20 of 60 and the chief finishes on worker-0: 40
    # steps (20 closures of 2) after the kill, and the evaluator sees the
    # checkpoints of steps 20, 40 and 60 (before: 120 steps, nothing after
    # the kill asserted but the end).
    steps = _EVALUATED_STEPS
    cluster = self._cluster(
        _flags(self.model_dir, train_steps=steps, steps_per_execution=2),
        num_workers=2, num_ps=2, evaluator=True)
    self.assertTrue(cluster.wait_for_log("chief-0", f", step 20/{steps}: ",
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
    self.assertEqual(manifest["final_step"], steps)
    self.assertEqual(manifest["history"][-1]["step"], steps)
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
    self.assertIn(f"held-out evaluation at step {steps}: ",
                  cluster.log("chief-0"))
    # The evaluator saw each checkpoint once, in order.
    with open(os.path.join(self.model_dir, "eval",
                           "eval_results.jsonl")) as f:
      results = [json.loads(line) for line in f if line.strip()]
    evaluated = [r["step"] for r in results]
    self.assertEqual(evaluated, sorted(set(evaluated)))
    # One process outside the cluster, on its one CPU device, with the
    # coordinator's evaluation batch.
    self.assertEqual(manifest["eval_batch_size"], max(
        manifest["global_batch_size"], 1024))
    self.assertEqual({(r["evaluated_with"]["strategy"],
                       r["evaluated_with"]["global_batch_size"])
                      for r in results},
                     {("one_device", manifest["eval_batch_size"])})
    self.assertIn(steps, evaluated)
    self.assertTrue(any(n.startswith("events.out.tfevents") for n in
                        os.listdir(os.path.join(self.model_dir, "eval"))))
    with open(os.path.join(self.model_dir, "checkpoints",
                           "shards.json")) as f:
      self.assertEqual(json.load(f)["user_id_embedding"], 2)

  def test_ps_killed_chief_fails_fast_and_launcher_restarts_cluster(self):
    # A lost ps task ends the chief itself, at once, non-zero, naming the
    # loss (what a platform without tfdist.launch restarts on); the
    # launcher then restarts every task (new ports) and the run resumes.
    run = _restart_and_preemption_run()
    first = run["first_log"]
    self.assertIsNotNone(run["ps_task"], "no ps:1 process under the launcher")
    self.assertIn("restarting the group", first, first[-4000:])
    before = first[:first.index("restarting the group")]
    # The chief exited on its own with the peer-lost status (200), not
    # killed by the launcher (137) after its few seconds' wait for the
    # survivors, and said why and what a restart resumes from.
    self.assertRegex(before, r"exit statuses: chief:0 200\b")
    self.assertRegex(before, r"\[chief:0\] .*lost a ps task")
    self.assertIn("resumes from the last checkpoint", before)
    # The restarted group resumed from a checkpoint written before the kill.
    after = first[first.index("restarting the group"):]
    restored = re.search(r"\[chief:0\] .*restored .*ckpt-(10|20): resuming "
                         r"at step (\d+)", after)
    self.assertIsNotNone(restored, after[-4000:])
    # ... and trained on past the restored step (until the SIGTERM).
    later = [int(n) for n in re.findall(
        rf"\[chief:0\] .*, step (\d+)/{_PREEMPTED_STEPS}: ",
        after[restored.end():])]
    self.assertTrue(later and max(later) > int(restored.group(2)),
                    after[-4000:])
    # (It was then stopped by SIGTERM; OneControllerTest checks that stop,
    # and the run's end, by the second launcher, there.)
    self.assertEqual(run["second_status"], 0, run["second_log"][-6000:])
    manifest = _read_manifest(run["model_dir"])
    self.assertEqual(manifest["final_step"], _PREEMPTED_STEPS)
    self.assertIsNotNone(manifest["restored_from"])


class OneControllerTest(absltest.TestCase):
  """Parameter-server training gets what synchronous training has: `auto`
  for strategy and dtype, Keras callbacks, SIGTERM preemption with a
  checkpoint and resume, a SavedModel, and the same manifest keys as a
  Mirrored run (outside the strategy's own section)."""

  def setUp(self):
    super().setUp()
    self.tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))

  def test_auto_callbacks_sigterm_resume_export_and_manifest_keys(self):
    run = _restart_and_preemption_run()
    model_dir, events = run["model_dir"], run["events"]
    # SIGTERM, forwarded to every task of the restarted group, stopped the
    # run with a checkpoint.
    log = run["first_log"]
    self.assertEqual(run["first_status"], 128 + signal.SIGTERM, log[-6000:])
    stopped = re.search(r"\[chief:0\] .*Stopped by SIGTERM at step (\d+)",
                        log)
    self.assertIsNotNone(stopped, log[-6000:])
    stopped = int(stopped.group(1))
    self.assertLess(stopped, _PREEMPTED_STEPS)
    self.assertTrue(run["latest"].endswith(f"ckpt-{stopped}"), run["latest"])
    # The same command resumed from that checkpoint and finished.
    self.assertEqual(run["second_status"], 0, run["second_log"][-6000:])
    self.assertRegex(run["second_log"],
                     rf"\[chief:0\] .*resuming at step {stopped}\b")
    manifest = _read_manifest(model_dir)
    self.assertEqual((manifest["strategy"], manifest["dtype"]),
                     ("parameter_server", "fp32"))
    self.assertRegex(manifest["strategy_reason"],
                     "^auto: TF_CONFIG lists 2 parameter server")
    self.assertRegex(manifest["dtype_reason"], "^auto: ")
    self.assertEqual(manifest["final_step"], _PREEMPTED_STEPS)
    self.assertTrue(manifest["restored_from"].endswith(f"ckpt-{stopped}"))
    self.assertEqual({h["step"] for h in manifest["history"]},
                     set(range(10, _PREEMPTED_STEPS + 1, 10)) | (
                         {stopped} if stopped % 10 else set()))
    # The SavedModel, exported by the coordinator, serves.
    reloaded = tf.saved_model.load(os.path.join(model_dir, "saved_model"))
    self.assertIn("serving_default", reloaded.signatures)
    # The Keras callback ran on the coordinator, with Keras's params, in
    # each of its three processes (the group's two attempts, the resumed
    # run).
    with open(events) as f:
      seen = [json.loads(line) for line in f]
    begins = [e for e in seen if e["hook"] == "train_begin"]
    self.assertLen(begins, 3)
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
