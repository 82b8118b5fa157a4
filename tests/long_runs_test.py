"""Long runs: flat threads, clean exits every time, a start-up that fails fast.

* Repeated two-worker MultiWorkerMirrored runs under `tfdist.launch` (CNN on
  Fashion-MNIST and the ranking model on MovieLens, alternating): every
  process exits 0 and prints no TensorFlow or gRPC line at WARNING or above
  (a worker still alive after the chief, host of the coordination service,
  had left printed `UNAVAILABLE`). The first run is longer and counts each
  task's threads (`/proc/PID/status`) at steps 50, 125 and 200: with a
  per-collective timeout TensorFlow keeps one sleeping thread per
  collective, about 10 a step.
* Start-up: a peer whose name does not resolve stops the task with status 2
  naming it; a peer that never answers is named while the task waits, and
  SIGTERM ends the wait at once (status 143).
* The pieces those rely on, in-process: address resolution, the rendezvous,
  the chief's check that a worker's server is gone, and the collective
  instance keys fixed at trace time (flat memory under MultiWorkerMirrored,
  measured by benchmarks/soak.py: see docs/design/long-runs.md).

Cost (Bazel on 2 cores, 1 December 2026): each repeated run about 17 s,
nearly all of it the start-up of three processes (the launcher and two
TensorFlow workers): runs 1-3 train 2 steps, as few as a run with a
checkpoint and a clean exit takes; run 0's 200 steps are what the thread
count needs (about 10 threads a step would show as 1,500 over its 150
sampled steps). Start-up tests about 20 s, the pieces under 10 s.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from absl.testing import absltest
import portpicker
from tensorflow.python.distribute import cross_device_utils

from tests import multi_worker_testlib as testlib
from tests import testutil
from tfdist import config as config_lib
from tfdist import errors
from tfdist.data import movielens
from tfdist.distribute import cluster as cluster_lib
from tfdist.distribute import rendezvous
from tfdist.distribute import strategy as strategy_lib
from tfdist.distribute import worker_exit

TIMEOUT = 300
# Consecutive 2-worker runs, each of which must exit cleanly: 4 here (about
# 70 s); the reliability figure in docs/design/long-runs.md is 10 of 10:
#   TFDIST_LONG_RUNS=10 python -m pytest tests/long_runs_test.py -k every_run
RUNS = int(os.environ.get("TFDIST_LONG_RUNS", "4"))
THREAD_STEPS = (50, 125, 200)
# Threads a task may gain between the first and the last sample: TensorFlow
# and tf.data start a few on demand; a per-collective timeout adds about 10
# per step (thousands here).
MAX_THREAD_GROWTH = 20


def _status(pid: int) -> dict:
  with open(f"/proc/{pid}/status") as f:
    return {k: v.strip() for k, v in (line.split(":", 1) for line in f)}


class RepeatedRunsTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    fashion = testutil.fashion_mnist_subset(limit=512, train_shards=2,
                                            test_shards=1)
    ranking = os.path.join(testutil.scratch_dir(), "movielens")
    movielens.convert_movielens(ranking, limit=4_000, train_shards=2,
                                test_shards=1)
    cls.data = {
        "cnn": [f"--train_files={fashion['train']}",
                f"--eval_files={fashion['eval']}"],
        "ranking": [
            "--model=ranking", "--dataset=movielens", "--hash_buckets=5000",
            f"--train_files={os.path.join(ranking, 'train-*.tfrecord.gz')}",
            f"--eval_files={os.path.join(ranking, 'test-*.tfrecord.gz')}"]}

  def _flags(self, model, steps, extra=()):
    return ["--distribution_strategy=multi_worker_mirrored",
            *self.data[model], "--batch_size=16", f"--train_steps={steps}",
            f"--log_steps={min(steps, 25)}",
            f"--checkpoint_steps={steps}", "--epochs_between_evals=100000",
            f"--model_dir={testutil.scratch_dir()}", *extra]

  def assertClean(self, output, status, run):
    self.assertEqual(status, 0, f"run {run}:\n{output[-6000:]}")
    self.assertIn("[launch] exit statuses: chief:0 0, worker:0 0", output,
                  f"run {run}")
    self.assertIn("The other 1 worker(s) have left", output,
                  f"run {run}:\n{output[-6000:]}")
    self.assertEqual(testutil.noise(output), [],
                     f"run {run}:\n{output[-6000:]}")

  def test_threads_stay_flat_and_every_run_exits_cleanly(self):
    env = {"TF_CPP_MIN_LOG_LEVEL": ""}  # As unset: tfdist's default.
    # Run 0: the thread count over a few hundred steps.
    watch = testlib.LauncherWatch(
        ["--num_workers=2"], self._flags("cnn", THREAD_STEPS[-1]),
        timeout=TIMEOUT, env=env)
    pids = {task: watch.task_pid(task) for task in ("chief:0", "worker:0")}
    threads = {task: [] for task in pids}
    for step in THREAD_STEPS:
      self.assertIsNotNone(
          watch.wait_for(rf"\[chief:0\] .*step {step}/", TIMEOUT),
          watch.output()[-4000:])
      for task, pid in pids.items():
        threads[task].append(int(_status(pid)["Threads"]))
    status = watch.wait()
    for task, counts in threads.items():
      self.assertLessEqual(counts[-1] - counts[0], MAX_THREAD_GROWTH,
                           f"{task} threads at steps {THREAD_STEPS}: {counts}")
    self.assertClean(watch.output(), status, 0)
    # Runs 1..RUNS-1: as short as start-up allows, CNN and ranking in turn.
    for run in range(1, RUNS):
      model = ("ranking", "cnn")[run % 2]
      status, output = testlib.run_launcher(
          ["--num_workers=2"], self._flags(model, 2), timeout=TIMEOUT,
          env=env)
      self.assertClean(output, status, run)


class StartUpTest(absltest.TestCase):

  def _chief(self, worker_address, extra=()):
    data = testutil.fashion_mnist_subset(limit=512, train_shards=2,
                                         test_shards=1)
    chief = f"127.0.0.1:{portpicker.pick_unused_port()}"
    tf_config = {"cluster": {"chief": [chief], "worker": [worker_address]},
                 "task": {"type": "chief", "index": 0}}
    env = dict(os.environ, TF_CONFIG=json.dumps(tf_config),
               PYTHONPATH=testutil.REPO_ROOT)
    return subprocess.Popen(
        [sys.executable, "-m", "tfdist.train",
         "--distribution_strategy=multi_worker_mirrored",
         f"--train_files={data['train']}", f"--eval_files={data['eval']}",
         f"--model_dir={testutil.scratch_dir()}", "--train_steps=2", *extra],
        cwd=testutil.REPO_ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, errors="replace")

  def test_unresolvable_peer_is_a_usage_error_naming_it(self):
    proc = self._chief("no-such-host.invalid:2222",
                       ["--cluster_start_timeout_seconds=1"])
    output, _ = proc.communicate(timeout=TIMEOUT)
    self.assertEqual(proc.returncode, 2, output[-3000:])
    self.assertRegex(output, r"tfdist.train: error: TF_CONFIG: worker 0 at "
                     r"no-such-host.invalid:2222: the host name does not "
                     r"resolve \(")
    self.assertNotIn("Traceback", output)

  def _read_until(self, proc, text):
    """Collects `proc`'s output lines on a thread until one holds `text`
    (the process still running); returns `(lines, reader thread)`."""
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout),
                              daemon=True)
    reader.start()
    deadline = time.time() + TIMEOUT
    while not any(text in l for l in lines):
      self.assertLess(time.time(), deadline, "".join(lines)[-3000:])
      self.assertIsNone(proc.poll(), "".join(lines)[-3000:])
      time.sleep(0.2)
    return lines, reader

  def test_sigterm_ends_the_wait_for_a_silent_peer(self):
    silent = f"127.0.0.1:{portpicker.pick_unused_port()}"
    proc = self._chief(silent, ["--cluster_start_timeout_seconds=600"])
    lines, reader = self._read_until(proc, "waiting for the peers")
    sent = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    status = proc.wait(timeout=60)
    waited = time.time() - sent
    reader.join(timeout=10)
    output = "".join(lines)
    self.assertEqual(status, 143, output[-3000:])
    self.assertLess(waited, 10, output[-3000:])
    self.assertIn(f"no answer yet from worker 0 at {silent}", output)
    self.assertIn("tfdist.train: received SIGTERM after", output)

  def test_ctrl_c_ends_tensorflows_wait_for_a_peer_that_never_joins(self):
    # The worker's port accepts connections (the kernel completes them for
    # a listening socket) but nothing there joins TensorFlow's cluster: the
    # chief's rendezvous passes and TensorFlow's own wait, in C++ holding
    # the GIL, begins. Ctrl-C must still end the chief at once (SIGTERM is
    # TensorFlow's there: its coordination service installs a handler).
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    self.addCleanup(listener.close)
    mute = f"127.0.0.1:{listener.getsockname()[1]}"
    proc = self._chief(mute, ["--cluster_start_timeout_seconds=600"])
    self.addCleanup(lambda: proc.poll() is None and proc.kill())
    lines, reader = self._read_until(proc, "TensorFlow now forms the cluster")
    time.sleep(2)  # Inside TensorFlow's wait by now.
    os.kill(proc.pid, signal.SIGINT)
    try:
      status = proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
      status = None
    reader.join(timeout=10)
    output = "".join(lines)
    self.assertEqual(status, -signal.SIGINT,
                     "Ctrl-C did not end the chief waiting for TensorFlow's "
                     "cluster:\n" + output[-3000:])
    self.assertIn("Ctrl-C ends this process at once", output)


class PiecesTest(absltest.TestCase):

  def test_resolution_names_the_task_and_retries_until_its_bound(self):
    info = cluster_lib.from_tf_config(json.dumps(
        {"cluster": {"chief": ["127.0.0.1:1"], "worker": [
            "localhost:2", "no-such-host.invalid:3"]},
         "task": {"type": "chief", "index": 0}}))
    sleeps = []
    with self.assertRaisesRegex(
        config_lib.ConfigError,
        r"^TF_CONFIG: worker 1 at no-such-host.invalid:3: the host name "
        r"does not resolve \(.*\), tried for 2.5 s\."):
      cluster_lib.check_addresses_resolve(info, retry_seconds=2.5,
                                          sleep=sleeps.append)
    self.assertNotEqual(sleeps, [])
    good = cluster_lib.from_tf_config(json.dumps(
        {"cluster": {"chief": ["127.0.0.1:1"], "worker": ["localhost:2"]},
         "task": {"type": "worker", "index": 0}}))
    cluster_lib.check_addresses_resolve(good, retry_seconds=0)

  def test_sigterm_while_names_are_retried_stops_with_a_message(self):
    info = cluster_lib.from_tf_config(json.dumps(
        {"cluster": {"chief": ["127.0.0.1:1"],
                     "worker": ["no-such-host.invalid:3"]},
         "task": {"type": "chief", "index": 0}}))
    # The signal arrives during the wait between lookups (its default
    # action would end the process without a word).
    before = signal.getsignal(signal.SIGTERM)
    with self.assertRaisesRegex(
        errors.StoppedAtStartError,
        r"^received SIGTERM after \d+ s of waiting for the host names of "
        r"the cluster from TF_CONFIG to resolve \(not resolving yet: "
        r"no-such-host.invalid:3\); nothing was trained or saved yet\.$"
    ) as caught:
      cluster_lib.check_addresses_resolve(
          info, retry_seconds=30,
          sleep=lambda seconds: os.kill(os.getpid(), signal.SIGTERM))
    self.assertEqual(caught.exception.exit_code, 143)
    # The handlers are back as they were.
    self.assertIs(signal.getsignal(signal.SIGTERM), before)

  def test_rendezvous_waits_for_a_listening_peer_and_names_a_silent_one(self):
    peer = socket.socket()
    peer.bind(("127.0.0.1", 0))
    peer.listen(4)
    self.addCleanup(peer.close)
    here = f"127.0.0.1:{portpicker.pick_unused_port()}"
    address = f"127.0.0.1:{peer.getsockname()[1]}"
    waited = rendezvous.wait_for_peers(here, {address: "worker 0"},
                                       timeout_seconds=5)
    self.assertLess(waited, 5)
    # While it waited it listened on its own port; now the port is free.
    self.assertFalse(rendezvous.answers(here))
    silent = f"127.0.0.1:{portpicker.pick_unused_port()}"
    with self.assertRaisesRegex(
        rendezvous.ClusterStartError,
        rf"within --cluster_start_timeout_seconds=0.5: no answer from "
        rf"worker 1 at {silent}\."):
      rendezvous.wait_for_peers(None, {silent: "worker 1"},
                                timeout_seconds=0.5, poll_seconds=0.05)

  def test_rendezvous_listens_on_its_own_port_while_waiting(self):
    here = f"127.0.0.1:{portpicker.pick_unused_port()}"
    silent = f"127.0.0.1:{portpicker.pick_unused_port()}"
    seen = []
    thread = threading.Thread(target=lambda: (
        time.sleep(0.5), seen.append(rendezvous.answers(here))))
    thread.start()
    with self.assertRaises(rendezvous.ClusterStartError):
      rendezvous.wait_for_peers(here, {silent: "worker 1"},
                                timeout_seconds=1.5, poll_seconds=0.05)
    thread.join()
    self.assertEqual(seen, [True])

  def test_a_signal_stops_the_rendezvous(self):
    silent = f"127.0.0.1:{portpicker.pick_unused_port()}"
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    self.addCleanup(timer.cancel)
    with self.assertRaises(rendezvous.StoppedAtStartError) as caught:
      rendezvous.wait_for_peers(None, {silent: "worker 0"},
                                timeout_seconds=30, poll_seconds=0.05)
    self.assertEqual(caught.exception.exit_code, 143)
    self.assertRegex(str(caught.exception),
                     rf"^received SIGTERM after \d+ s of waiting .* \(no "
                     rf"answer yet from worker 0 at {silent}\)")
    # The previous handler is back.
    self.assertIs(signal.getsignal(signal.SIGTERM), signal.SIG_DFL)

  def test_instance_keys_fixed_at_trace_time_unless_asked(self):
    launcher = cross_device_utils.CollectiveReplicaLauncher
    before = getattr(launcher, "_prefer_unique_instance_key")
    self.addCleanup(setattr, launcher, "_prefer_unique_instance_key", before)
    name = strategy_lib.PER_CALL_INSTANCE_KEYS_ENV
    self.addCleanup(os.environ.pop, name, None)
    for value, fixed in (("", True), ("0", True), ("1", False)):
      os.environ[name] = value
      self.assertIs(strategy_lib.use_trace_time_instance_keys(), fixed)
      self.assertIs(getattr(launcher, "_prefer_unique_instance_key"),
                    not fixed)
    os.environ[name] = "yes"
    with self.assertRaisesRegex(
        config_lib.ConfigError,
        r"^TFDIST_PER_CALL_INSTANCE_KEYS='yes' is not 0 or 1\. Unset it"):
      strategy_lib.use_trace_time_instance_keys()

  def test_wait_until_gone_sees_a_closed_port(self):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(128)  # Never accepted: the kernel completes connects.
    address = f"127.0.0.1:{server.getsockname()[1]}"
    self.assertFalse(worker_exit.wait_until_gone(address, 0.3))
    threading.Timer(0.2, server.close).start()
    self.assertTrue(worker_exit.wait_until_gone(address, 10))


if __name__ == "__main__":
  absltest.main()
