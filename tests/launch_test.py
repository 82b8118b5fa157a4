"""Tests for tfdist.launch: task layout, TF_CONFIG, and fault tolerance.

The multi-process tests run real two-worker MultiWorkerMirroredStrategy jobs
of `tfdist.train` under the launcher on 127.0.0.1, each with a hard timeout;
they signal only PIDs the launcher reports having started.
"""

import collections
import io
import json
import os
import re
import signal
import sys
import textwrap
import time

from absl.testing import absltest

from tests import multi_worker_testlib as testlib
from tests import testutil
from tfdist import launch
from tfdist.distribute import cluster as cluster_lib
from tfdist.runtime import task_output

TIMEOUT = 240
CHECKPOINT_STEPS = 10
# --train_steps of the runs that a signal stops: never reached (the small
# model trains a step in milliseconds, so 1,000 steps could end a run
# before the signal on a loaded machine).
ENDLESS_STEPS = 100_000


class TaskLayoutTest(absltest.TestCase):

  def test_mirrored_layout(self):
    tasks = launch.plan_tasks(num_workers=3)
    self.assertEqual([t.name for t in tasks],
                     ["chief:0", "worker:0", "worker:1"])

  def test_parameter_server_layout(self):
    tasks = launch.plan_tasks(num_workers=2, num_ps=1, evaluator=True)
    self.assertEqual([t.name for t in tasks],
                     ["chief:0", "worker:0", "worker:1", "ps:0",
                      "evaluator:0"])
    cluster = launch.make_cluster(tasks, [1001, 1002, 1003, 1004, 1005])
    self.assertEqual(cluster, {"chief": ["127.0.0.1:1001"],
                               "worker": ["127.0.0.1:1002", "127.0.0.1:1003"],
                               "ps": ["127.0.0.1:1004"]})
    env = launch.task_env({"CLUSTER_SPEC": "{}", "HOME": "/h"}, cluster,
                          tasks[4], scratch_dir="/tmp/x")
    self.assertEqual(env["GRPC_FAIL_FAST"], "use_caller")
    self.assertNotIn("CLUSTER_SPEC", env)
    self.assertEqual(env["TMPDIR"], "/tmp/x")
    config = json.loads(env["TF_CONFIG"])
    self.assertEqual(config["task"], {"type": "evaluator", "index": 0})
    self.assertNotIn("evaluator", config["cluster"])
    info = cluster_lib.from_tf_config(env["TF_CONFIG"])
    self.assertEqual(info.task_type, "evaluator")

  def test_pin_workers_gives_each_worker_a_core_of_its_own(self):
    tasks = launch.plan_tasks(num_workers=3, evaluator=True)
    cpus = launch.worker_cpus(tasks, [0, 1])
    self.assertEqual({t.name: c for t, c in cpus.items()},
                     {"chief:0": 0, "worker:0": 1, "worker:1": 0})
    self.assertEqual(launch.service_cpus(tasks, [0, 1, 2, 3]), {})
    with self.assertRaisesRegex(ValueError, "at least one CPU core"):
      launch.worker_cpus(tasks, [])

  def test_pin_workers_with_ps_pins_workers_and_spares_the_rest(self):
    # With ps tasks the chief coordinates: the workers get a core each and
    # the chief and the ps tasks share the cores left over.
    tasks = launch.plan_tasks(num_workers=2, num_ps=1, evaluator=True)
    by_name = lambda d: {t.name: c for t, c in d.items()}
    self.assertEqual(by_name(launch.worker_cpus(tasks, [0, 1, 2, 3])),
                     {"worker:0": 0, "worker:1": 1})
    self.assertEqual(by_name(launch.service_cpus(tasks, [0, 1, 2, 3])),
                     {"chief:0": [2, 3], "ps:0": [2, 3]})
    # No core to spare: the chief and the ps tasks stay unpinned.
    self.assertEqual(launch.service_cpus(tasks, [0, 1]), {})

  def test_pinned_ps_worker_gets_two_inter_op_threads(self):
    # One inter-op thread (a worker pinned to one core) never finishes a
    # closure; strategy_runs_test trains with a pinned ps worker.
    tasks = launch.plan_tasks(num_workers=1, num_ps=1)
    cluster = launch.make_cluster(tasks, [1, 2, 3])
    chief, worker, ps = tasks
    env = launch.task_env({}, cluster, worker, pinned_cpus=[0])
    self.assertEqual(env["TF_NUM_INTEROP_THREADS"], "2")
    for task, cpus in ((worker, ()), (worker, [0, 1]), (chief, [1]),
                       (ps, [1])):
      self.assertNotIn("TF_NUM_INTEROP_THREADS",
                       launch.task_env({}, cluster, task, pinned_cpus=cpus))
    # The caller's own setting wins.
    env = launch.task_env({"TF_NUM_INTEROP_THREADS": "4"}, cluster, worker,
                          pinned_cpus=[0])
    self.assertEqual(env["TF_NUM_INTEROP_THREADS"], "4")
    # Without ps tasks a pinned worker keeps TensorFlow's own sizing.
    mwms = launch.plan_tasks(num_workers=2)
    env = launch.task_env({}, launch.make_cluster(mwms, [1, 2]), mwms[1],
                          pinned_cpus=[1])
    self.assertNotIn("TF_NUM_INTEROP_THREADS", env)

  def test_no_grpc_fail_fast_without_ps(self):
    tasks = launch.plan_tasks(num_workers=2)
    cluster = launch.make_cluster(tasks, [1, 2])
    env = launch.task_env({}, cluster, tasks[1])
    self.assertNotIn("GRPC_FAIL_FAST", env)
    info = cluster_lib.from_tf_config(env["TF_CONFIG"])
    self.assertEqual((info.task_type, info.task_index, info.num_workers),
                     ("worker", 0, 2))

  def test_bad_counts(self):
    with self.assertRaisesRegex(ValueError, "--num_workers=0 must be >= 1"):
      launch.plan_tasks(num_workers=0)
    with self.assertRaisesRegex(ValueError, "--num_ps=-1 must be >= 0"):
      launch.plan_tasks(num_workers=1, num_ps=-1)

  def test_exit_status(self):
    self.assertEqual(launch._exit_status(0), 0)  # pylint: disable=protected-access
    self.assertEqual(launch._exit_status(-9), 137)  # pylint: disable=protected-access
    self.assertEqual(launch._exit_status(143), 143)  # pylint: disable=protected-access


# Lines as the tasks of a 2-worker run print them (TF_CPP_MIN_LOG_LEVEL
# unset): absl's Python log, TensorFlow's C++ log and import notices.
_PROGRESS = ("I1204 22:09:40.582683 140249846459264 run_log.py:410] tfdist: "
             "epoch 1/2, step 10/40: loss 2.4781, accuracy 0.2531")
_CHATTER = (
    "WARNING: All log messages before absl::InitializeLog() is called are "
    "written to STDERR",
    "I0000 00:00:1796422189.066052   31501 port.cc:153] oneDNN custom "
    "operations are on.",
    "I0000 00:00:1796422189.098343   31501 cpu_feature_guard.cc:227] This "
    "TensorFlow binary is optimized to use available CPU instructions.",
    "To enable the following instructions: AVX2 FMA, in other operations, "
    "rebuild TensorFlow with the appropriate compiler flags.",
    "WARNING: Logging before flag parsing goes to stderr.",
    "I0000 00:00:1796422191.146889   31543 coordination_service.cc:502] "
    "Waiting for 1/2 tasks to connect.",
    "/job:worker/replica:0/task:0",
    "W0000 00:00:1796422193.257812   31503 loop_optimizer.cc:934] Skipping "
    "loop optimization for Merge node with control input: cond/_16",
)
_WORKER_WARNING = ("W1204 22:09:41.000000 140371414051712 input_pipeline.py:"
                   "99] worker 0 reads 3 of 4 files")
# What the chief and a worker say when both stop (their own numbers and
# folders): the worker's copy is not shown.
_STOPPED = ("W1204 22:34:17.521827 140360695827328 preemption.py:246] Stopped "
            "at step 17, 0.4 s after the signal; checkpoint /tmp/run/ckpt-17.")
_WORKER_STOPPED = (
    "W1204 22:34:17.537664 140084735122304 preemption.py:246] Stopped at "
    "step 17, 0.3 s after the signal; checkpoint /tmp/tfdist-launch-x/"
    "attempt0/worker0/ckpt-17.")
_EVALUATION = ("I1204 22:09:42.000000 140371414051712 evaluator.py:99] "
               "tfdist evaluator: checkpoint 32: loss 1.7615")


class OutputTest(absltest.TestCase):
  """What the launcher shows of its tasks' output (`--output`)."""

  def test_chatter_and_what_concerns_a_task(self):
    for line in _CHATTER:
      self.assertTrue(task_output.is_chatter(line), line)
      self.assertFalse(task_output.concerns_task(line), line)
    for line in (_PROGRESS, _WORKER_WARNING, "Final eval: loss 1.75",
                 "E0000 00:00:1.0  31501 collective_ops.cc:9] lost a peer"):
      self.assertFalse(task_output.is_chatter(line), line)
    for line in (_WORKER_WARNING, "Traceback (most recent call last):",
                 "tfdist.errors.PeerLostError: worker 1 left",
                 "/x/y.py:3: UserWarning: careful",
                 "E0000 00:00:1.0  31501 collective_ops.cc:9] lost a peer"):
      self.assertTrue(task_output.concerns_task(line), line)
    for line in (_PROGRESS, "Final eval: loss 1.75", "  strategy  mwms"):
      self.assertFalse(task_output.concerns_task(line), line)
    self.assertEqual(task_output.message_key(_STOPPED),
                     task_output.message_key(_WORKER_STOPPED))
    self.assertNotEqual(task_output.message_key(_STOPPED),
                        task_output.message_key(_WORKER_WARNING))

  def _launch(self, worker_status: int, **kwargs):
    """Runs a chief, a worker and an evaluator that print real tasks'
    lines (no TensorFlow); returns (status, output)."""
    script = textwrap.dedent(f"""
        import json, os, sys
        task = json.loads(os.environ["TF_CONFIG"])["task"]["type"]
        lines = [*{_CHATTER!r}, {_PROGRESS!r}]
        lines += {{"chief": ["Final eval: loss 1.75"],
                   "worker": [{_WORKER_WARNING!r}],
                   "evaluator": [{_EVALUATION!r}]}}[task]
        print("\\n".join(lines), flush=True)
        sys.exit({worker_status} if task == "worker" else 0)
        """)
    out = io.StringIO()
    launcher = launch.Launcher(
        tasks=launch.plan_tasks(num_workers=2, evaluator=True),
        command=[sys.executable, "-c", script], out=out,
        stop_grace_seconds=30, **kwargs)
    return launcher.run(), out.getvalue()

  def test_chief_lines_once_worker_warnings_prefixed_all_kept(self):
    logs = testutil.scratch_dir()
    status, output = self._launch(0, task_log_dir=logs)
    self.assertEqual(status, 0, output)
    lines = output.splitlines()
    # The chief's own lines as it printed them, once; no chatter.
    self.assertEqual(lines.count(_PROGRESS), 1, output)
    self.assertIn("Final eval: loss 1.75", lines)
    for line in _CHATTER:
      self.assertNotIn(line, output)
    # The worker: its warning alone, prefixed.
    self.assertIn(f"[worker:0] {_WORKER_WARNING}", lines)
    self.assertEqual(
        [l for l in lines if l.startswith("[worker:0]")],
        [f"[worker:0] {_WORKER_WARNING}"], output)
    self.assertNotIn("[chief:0]", output)
    # The evaluator's lines (its evaluations are its own), prefixed.
    self.assertIn(f"[evaluator:0] {_EVALUATION}", lines)
    # Each task's whole output stays in --task_log_dir.
    for name in ("chief-0.log", "worker-0.log", "evaluator-0.log"):
      with open(os.path.join(logs, name)) as f:
        logged = f.read()
      for line in (*_CHATTER, _PROGRESS):
        self.assertIn(line, logged)

  def test_a_workers_copy_of_a_chief_line_is_not_shown(self):
    # The chief's output, then the worker's, through the launcher's reader
    # (in this order, as the launcher reads them when the chief is first).
    out = io.StringIO()
    launcher = launch.Launcher(tasks=launch.plan_tasks(num_workers=2),
                               command=[], out=out)
    chief, worker = launcher.tasks
    for task, lines in ((chief, [_STOPPED]),
                        (worker, [_WORKER_STOPPED, _WORKER_WARNING])):
      launcher._tails[task] = task_output.TaskTail()  # pylint: disable=protected-access
      launcher._pump(task, io.BytesIO("".join(  # pylint: disable=protected-access
          f"{line}\n" for line in lines).encode()))
    self.assertEqual(out.getvalue().splitlines(),
                     [_STOPPED, f"[worker:0] {_WORKER_WARNING}"])

  def test_a_failed_task_shows_its_last_lines(self):
    status, output = self._launch(3)
    self.assertEqual(status, 1, output)
    self.assertIn("[launch] worker:0 exited with status 3.", output)
    tail = output[output.index("[launch] the last 10 lines of worker:0"):]
    for line in (*_CHATTER, _PROGRESS, _WORKER_WARNING):
      self.assertIn(f"[worker:0] {line}\n", tail)
    self.assertIn("--output=all or --task_log_dir=DIR", tail)

  def test_a_lost_worker_is_named_in_the_summary_and_the_chiefs_log(self):
    # The worker dies of SIGKILL; the chief, left alone, reports the lost
    # peer as tfdist's PeerLostError does (`worker_exit.lost_peers_note`)
    # and ends with the lost peer's status, with and without
    # --task_log_dir (before: the chief's own output named neither the
    # task nor its status; only --task_log_dir's file had the launcher's
    # note).
    script = textwrap.dedent(f"""
        import json, os, signal, sys, time
        sys.path.insert(0, {testutil.REPO_ROOT!r})
        task = json.loads(os.environ["TF_CONFIG"])["task"]["type"]
        print("started", flush=True)
        if task == "worker":
          os.kill(os.getpid(), signal.SIGKILL)
        from tfdist.distribute import worker_exit
        print("lost a peer:", worker_exit.lost_peers_note(wait_seconds=20),
              flush=True)
        sys.exit(200)
        """)
    for logs in (None, testutil.scratch_dir()):
      out = io.StringIO()
      status = launch.Launcher(
          tasks=launch.plan_tasks(num_workers=2),
          command=[sys.executable, "-c", script], out=out,
          stop_grace_seconds=30, task_log_dir=logs).run()
      output = out.getvalue()
      self.assertEqual(status, 200, output)
      self.assertIn("[launch] worker:0 exited with status 137.", output)
      # The chief's own line (unprefixed: the chief's output).
      self.assertIn("\nlost a peer: worker:0 exited with status 137\n",
                    output)
      self.assertRegex(
          output, r"\[launch\] failed after 0 restarts \(worker:0 exited "
          r"with status 137 first\): exit status 200 \(tasks: ")
    with open(os.path.join(logs, "chief-0.log")) as f:
      chief_log = f.read()
    self.assertIn("lost a peer: worker:0 exited with status 137", chief_log)
    self.assertIn("[launch] worker:0 exited with status 137: the launcher "
                  "stops the other tasks.", chief_log)
    with open(os.path.join(logs, "worker-0.log")) as f:
      self.assertNotIn("exited with status", f.read())

  def test_a_ps_groups_servers_are_not_waited_for_after_a_failure(self):
    # ps:1 dies; the chief (the coordinator) exits 200 once the launcher
    # has noted the loss, as tfdist's does; worker:0 and ps:0 serve on, as
    # servers do until the chief marks the run done. The launcher stops
    # them as soon as the chief has exited (before: it waited
    # FAILURE_STOP_SECONDS for servers that never exit on their own, and
    # every restart of a parameter-server group came that much later).
    script = textwrap.dedent(f"""
        import json, os, signal, sys, time
        sys.path.insert(0, {testutil.REPO_ROOT!r})
        task = json.loads(os.environ["TF_CONFIG"])["task"]
        if task == {{"type": "ps", "index": 1}}:
          os.kill(os.getpid(), signal.SIGKILL)
        if task["type"] == "chief":
          from tfdist.distribute import worker_exit
          print("lost:", worker_exit.lost_peers_note(wait_seconds=20),
                flush=True)
          sys.exit(200)
        time.sleep(600)  # A server.
        """)
    out = io.StringIO()
    started = time.time()
    status = launch.Launcher(
        tasks=launch.plan_tasks(num_workers=1, num_ps=2),
        command=[sys.executable, "-c", script], out=out).run()
    elapsed = time.time() - started
    output = out.getvalue()
    self.assertEqual(status, 200, output)
    self.assertIn("[launch] ps:1 exited with status 137.", output)
    self.assertIn("\nlost: ps:1 exited with status 137\n", output)
    self.assertIn("[launch] stopping worker:0, ps:0.", output)
    self.assertLess(elapsed, launch.FAILURE_STOP_SECONDS, output)

  def test_output_all_and_verbose(self):
    status, output = self._launch(0, output=task_output.OUTPUT_ALL)
    self.assertEqual(status, 0, output)
    for task in ("chief:0", "worker:0", "evaluator:0"):
      for line in (*_CHATTER, _PROGRESS):
        self.assertIn(f"[{task}] {line}\n", output)
    status, output = self._launch(0, verbose=True)
    self.assertEqual(status, 0, output)
    for line in _CHATTER:
      self.assertIn(f"\n{line}\n", output)  # The chief's, unprefixed.
    with self.assertRaisesRegex(ValueError, "--output='some' is not one of"):
      launch.Launcher(tasks=[], command=[], output="some")

  def test_an_unusable_task_log_dir_is_refused_before_any_task(self):
    blocker = os.path.join(testutil.scratch_dir(), "a_file")
    open(blocker, "w").close()
    out = testutil.run_module(
        "tfdist.launch", [f"--task_log_dir={blocker}/logs", "--", "x"],
        timeout=60)
    self.assertEqual(out.returncode, 2, out.stdout)
    self.assertIn(f"--task_log_dir='{blocker}/logs': Not a directory; give "
                  "a folder this user can write", out.stdout)
    self.assertNotIn("started chief:0", out.stdout)


def _train_args(model_dir, steps, data, extra=()):
  # --mode=train: no evaluation (nothing here reads it; the run that
  # finishes paid an evaluation step's trace in both tasks for it).
  return ["--distribution_strategy=multi_worker_mirrored",
          f"--train_files={data['train']}", "--mode=train",
          "--batch_size=32", f"--train_steps={steps}", "--log_steps=5",
          f"--checkpoint_steps={CHECKPOINT_STEPS}",
          "--collective_timeout_seconds=60",
          "--cluster_start_timeout_seconds=90", f"--model_dir={model_dir}",
          "--model=tests.multi_worker_testlib:small_model",
          *extra]


def _steps_logged(text):
  return [int(s) for s in re.findall(r"\] .*step (\d+)/\d+: loss", text)]


def _checkpoint_is_finite(model_dir):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  path = tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints"))
  reader = tf.train.load_checkpoint(path)
  step = None
  for name in reader.get_variable_to_shape_map():
    value = reader.get_tensor(name)
    if np.issubdtype(np.asarray(value).dtype, np.floating):
      if not np.all(np.isfinite(value)):
        return False, step
    if name.startswith("global_step/"):
      step = int(value)
  return True, step


class FaultToleranceTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.data = testutil.fashion_mnist_subset(limit=1024)

  def test_killed_worker_restarts_group_and_resumes(self):
    model_dir = testutil.scratch_dir()
    steps = 30  # Killed after step 15: the second attempt trains from 10.
    watch = testlib.LauncherWatch(
        ["--num_workers=2", "--max_restarts=1"],
        _train_args(model_dir, steps, self.data), timeout=TIMEOUT)
    worker_pid = watch.task_pid("worker:0")
    # Step 15 is logged after the step-10 checkpoint is complete.
    self.assertIsNotNone(
        watch.wait_for(r"\[chief:0\] .*step 15/30: loss", 150),
        watch.output()[-4000:])
    before_kill = max(_steps_logged(watch.output()))
    os.kill(worker_pid, signal.SIGKILL)
    status = watch.wait()
    output = watch.output()
    self.assertEqual(status, 0, output[-6000:])
    self.assertIn("worker:0 exited with status 137", output)
    self.assertIn("restarting the group (1 of 1)", output)
    resumed = re.search(r"\[chief:0\] .*resuming at step (\d+)", output)
    self.assertIsNotNone(resumed, output[-6000:])
    resumed = int(resumed.group(1))
    # At most one checkpoint interval of work is redone.
    self.assertEqual(resumed % CHECKPOINT_STEPS, 0)
    self.assertGreaterEqual(resumed, before_kill - CHECKPOINT_STEPS)
    self.assertGreater(resumed, 0)
    manifest = json.load(open(os.path.join(model_dir, "run_manifest.json")))
    self.assertEqual(manifest["final_step"], steps)
    self.assertEqual(manifest["num_replicas_in_sync"], 2)
    # The second attempt ran exactly the remaining steps.
    second = output[output.index("restarting the group"):]
    self.assertEqual(max(_steps_logged(second)), steps)
    self.assertGreater(min(_steps_logged(second)), resumed)
    finite, step = _checkpoint_is_finite(model_dir)
    self.assertTrue(finite)
    self.assertEqual(step, steps)

  def _check_chief_output(self, output: str):
    """The launcher's default output (`--output=chief`) of a 2-worker run
    whose worker alone got SIGTERM: each chief line once, as the chief
    wrote it; of the worker, the signal it alone received and, if the
    launcher saw it exit first, its last lines."""
    self.assertNotIn("[chief:0]", output)
    # Up to the first exit the launcher saw (the chief's or the worker's,
    # both 143): the chief's lines and the worker's signal.
    exited = re.search(r"^\[launch\] (\S+) exited with status 143\.$",
                       output, re.M)
    self.assertIsNotNone(exited, output[-6000:])
    before, tail = output[:exited.start()], output[exited.end():]
    steps = collections.Counter(
        re.findall(rf"^I\S+ .*step (\d+)/{ENDLESS_STEPS}: loss", before,
                   re.M))
    self.assertGreaterEqual(len(steps), 1, before)
    self.assertEqual(set(steps.values()), {1}, before)
    self.assertLen(re.findall(r"^tfdist.train: Stopped by SIGTERM at step "
                              r"\d+", output, re.M), 1, output[-6000:])
    worker_lines = "\n".join(re.findall(r"^\[worker:0\] (.*)", before, re.M))
    self.assertIn("tfdist: received SIGTERM", worker_lines)
    self.assertNotRegex(worker_lines, rf"step \d+/{ENDLESS_STEPS}: loss")
    for line in before.splitlines():
      line = re.sub(r"^\[worker:0\] ", "", line)
      self.assertFalse(task_output.is_chatter(line), line)
    if exited.group(1) == "worker:0":
      self.assertRegex(tail, r"\[launch\] the last 20 lines of worker:0 "
                       r"\(all of its output: .*worker-0\.log\)")
      self.assertRegex(tail,
                       r"\[worker:0\] tfdist.train: Stopped by SIGTERM")

  def test_sigterm_saves_exits_in_time_then_rerun_resumes_and_ctrl_c(self):
    # Two launches: a SIGTERM to the worker stops the first; the same
    # command resumes from that checkpoint and is then stopped by Ctrl-C
    # (the launcher forwards SIGINT to every task, and each saves). The
    # first shows the launcher's default output (`_check_chief_output`).
    model_dir, logs = testutil.scratch_dir(), testutil.scratch_dir()
    grace = 25
    watch = testlib.LauncherWatch(
        ["--num_workers=2", "--stop_grace_seconds=60", "--output=chief",
         f"--task_log_dir={logs}"],
        _train_args(model_dir, ENDLESS_STEPS, self.data,
                    [f"--preemption_grace_seconds={grace}"]),
        timeout=TIMEOUT)
    worker_pid = watch.task_pid("worker:0")
    self.assertIsNotNone(
        watch.wait_for(rf"^I\S+ .*step 5/{ENDLESS_STEPS}: loss", 150),
        watch.output()[-4000:])
    # Preempt only the worker: the chief learns of it through the agreement
    # all-reduce and both save at the same step.
    sent = time.time()
    os.kill(worker_pid, signal.SIGTERM)
    status = watch.wait()
    elapsed = time.time() - sent
    output = watch.output()
    self.assertEqual(status, 128 + signal.SIGTERM, output[-6000:])
    self.assertLess(elapsed, grace, output[-3000:])
    self._check_chief_output(output)
    stopped = re.search(r"^tfdist.train: Stopped by SIGTERM at step (\d+)",
                        output, re.M)
    self.assertIsNotNone(stopped, output[-6000:])
    stopped = int(stopped.group(1))
    with open(os.path.join(logs, "worker-0.log")) as f:
      worker_log = f.read()
    self.assertRegex(worker_log, rf"step 5/{ENDLESS_STEPS}: loss")
    self.assertRegex(worker_log, rf"Stopped by SIGTERM at step {stopped};")
    finite, step = _checkpoint_is_finite(model_dir)
    self.assertTrue(finite)
    self.assertEqual(step, stopped)

    # The rerun resumes from that checkpoint and trains on.
    watch = testlib.LauncherWatch(
        ["--num_workers=2"], _train_args(model_dir, ENDLESS_STEPS, self.data),
        timeout=TIMEOUT)
    self.assertIsNotNone(
        watch.wait_for(rf"\[chief:0\] .*resuming at step {stopped}\b", 150),
        watch.output()[-4000:])
    self.assertIsNotNone(
        watch.wait_for(rf"\[chief:0\] .*step \d+/{ENDLESS_STEPS}: loss", 150),
        watch.output()[-4000:])
    sent = time.time()
    watch.proc.send_signal(signal.SIGINT)  # What Ctrl-C sends the launcher.
    status = watch.wait()
    output = watch.output()
    self.assertEqual(status, 128 + signal.SIGINT, output[-6000:])
    self.assertLess(time.time() - sent, 30)
    self.assertIn("[launch] SIGINT: forwarding to every task", output)
    for task in ("chief:0", "worker:0"):
      self.assertIn(f"[{task}] tfdist: received SIGINT", output)
    interrupted = re.search(
        r"\[chief:0\] .*Stopped by SIGINT at step (\d+)", output)
    self.assertIsNotNone(interrupted, output[-6000:])
    interrupted = int(interrupted.group(1))
    self.assertGreater(interrupted, stopped)
    finite, step = _checkpoint_is_finite(model_dir)
    self.assertTrue(finite)
    self.assertEqual(step, interrupted)



class FitScriptStopTest(absltest.TestCase):
  """A `tfdist.fit` script (tests/fit_stop_testlib.py) stopped by a signal
  ends as `tfdist.train` does: a checkpoint, one line, 128 + signal."""

  def _check_stopped(self, status: int, output: str, signum: int,
                     tasks) -> int:
    """The step every task in `tasks` stopped at, after checking the
    status, the one line each printed and that no traceback was printed."""
    name = signal.Signals(signum).name
    self.assertEqual(status, 128 + signum, output[-6000:])
    self.assertNotIn("Traceback", output, output[-6000:])
    steps = set()
    for task in tasks:
      lines = re.findall(
          rf"^{re.escape(task)}fit_stop_testlib\.py: Stopped by {name} at "
          r"step (\d+); checkpoint \S+\. Run the script again with the "
          r"same model_dir in its TrainConfig \(model_dir='[^']+'\) to "
          r"resume\.$", output, re.M)
      self.assertLen(lines, 1, output[-6000:])
      steps.add(int(lines[0]))
    self.assertLen(steps, 1, output[-6000:])  # Every worker, one step.
    return steps.pop()

  def test_ctrl_c_under_the_launcher_then_alone_rerun_resumes(self):
    # Ctrl-C from a terminal: SIGINT to the launcher's whole process group
    # (it and its helpers). The launcher forwards the signal to its tasks,
    # which run in sessions of their own: each task hears it once, from the
    # launcher, and no process prints a traceback or an ignored exception.
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    args = [model_dir, "100000"]
    watch = testlib.LauncherWatch(
        ["--num_workers=2", "--module=tests.fit_stop_testlib"], args,
        timeout=TIMEOUT, own_group=True)
    self.assertIsNotNone(
        watch.wait_for(r"\[chief:0\] .*step 10/100000: loss", 150),
        watch.output()[-4000:])
    watch.ctrl_c()
    status, output = watch.wait(), watch.output()
    stopped = self._check_stopped(status, output, signal.SIGINT,
                                  ["[chief:0] ", "[worker:0] "])
    for text in ("Traceback", "Exception ignored", "BrokenPipeError",
                 "KeyboardInterrupt"):
      self.assertNotIn(text, output, output[-6000:])
    self.assertIn("[launch] SIGINT: forwarding to every task", output)
    finite, step = _checkpoint_is_finite(model_dir)
    self.assertTrue(finite)
    self.assertEqual(step, stopped)

    # The same script alone resumes there; SIGTERM stops it with 143.
    watch = testlib.LauncherWatch(
        [], [], timeout=TIMEOUT,
        command=[sys.executable, "-m", "tests.fit_stop_testlib", *args])
    self.assertIsNotNone(
        watch.wait_for(rf"resuming at step {stopped}\b", 150),
        watch.output()[-4000:])
    self.assertIsNotNone(watch.wait_for(r"step \d+/100000: loss", 150),
                         watch.output()[-4000:])
    watch.proc.send_signal(signal.SIGTERM)
    again = self._check_stopped(watch.wait(), watch.output(), signal.SIGTERM,
                                [""])
    self.assertGreater(again, stopped)


if __name__ == "__main__":
  absltest.main()
