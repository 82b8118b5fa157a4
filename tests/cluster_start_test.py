"""A cluster task's start-up fails fast and names the peer at fault.

One `python -m tfdist.train` chief at a time (TF_CONFIG on 127.0.0.1), whose
one peer is not a TensorFlow process:

* a peer whose name does not resolve stops the task with status 2 naming
  it;
* a peer that never starts: the task gives up within
  `--cluster_start_timeout_seconds` with the retryable status 137, naming
  it (moved from tests/multi_worker_test.py);
* a peer that never answers is named while the task waits, and SIGTERM
  ends the wait at once (status 143);
* a peer whose port accepts connections but never joins: Ctrl-C ends
  TensorFlow's own wait at once.

And the pieces those rely on, in-process: address resolution and the
rendezvous. (Moved from tests/long_runs_test.py: no test here runs two
TensorFlow processes at once, so Bazel runs this file beside a cluster
test.)

Cost: about 20 s a start-up test (one TensorFlow start-up each), the
pieces a few seconds.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl.testing import absltest
import portpicker

from tests import multi_worker_testlib as testlib
from tests import testutil
from tfdist.distribute import cluster as cluster_lib
from tfdist.distribute import rendezvous
from tfdist import config as config_lib
from tfdist import errors

TIMEOUT = 300


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

  def test_sigterm_ends_a_fit_scripts_wait_with_one_line_and_143(self):
    # tests/fit_stop_testlib.py: a plain tfdist.fit script, nothing caught.
    silent = f"127.0.0.1:{portpicker.pick_unused_port()}"
    chief = f"127.0.0.1:{portpicker.pick_unused_port()}"
    tf_config = {"cluster": {"chief": [chief], "worker": [silent]},
                 "task": {"type": "chief", "index": 0}}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fit_stop_testlib",
         os.path.join(testutil.scratch_dir(), "run"), "10"],
        cwd=testutil.REPO_ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, errors="replace",
        env=dict(os.environ, TF_CONFIG=json.dumps(tf_config),
                 PYTHONPATH=testutil.REPO_ROOT))
    self.addCleanup(lambda: proc.poll() is None and proc.kill())
    lines, reader = self._read_until(proc, "waiting for the peers")
    os.kill(proc.pid, signal.SIGTERM)
    status = proc.wait(timeout=60)
    reader.join(timeout=10)
    output = "".join(lines)
    self.assertEqual(status, 143, output[-3000:])
    self.assertNotIn("Traceback", output)
    self.assertRegex(output, r"(?m)^fit_stop_testlib\.py: received SIGTERM "
                     r"after \d+ s of waiting .*nothing was trained or saved "
                     r"yet\.$")

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
        errors.ConfigError,
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
        errors.ClusterStartError,
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
    with self.assertRaises(errors.ClusterStartError):
      rendezvous.wait_for_peers(here, {silent: "worker 1"},
                                timeout_seconds=1.5, poll_seconds=0.05)
    thread.join()
    self.assertEqual(seen, [True])

  def test_a_signal_stops_the_rendezvous(self):
    silent = f"127.0.0.1:{portpicker.pick_unused_port()}"
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    self.addCleanup(timer.cancel)
    with self.assertRaises(errors.StoppedAtStartError) as caught:
      rendezvous.wait_for_peers(None, {silent: "worker 0"},
                                timeout_seconds=30, poll_seconds=0.05)
    self.assertEqual(caught.exception.exit_code, 143)
    self.assertRegex(str(caught.exception),
                     rf"^received SIGTERM after \d+ s of waiting .* \(no "
                     rf"answer yet from worker 0 at {silent}\)")
    # The previous handler is back.
    self.assertIs(signal.getsignal(signal.SIGTERM), signal.SIG_DFL)


class PeerNeverStartsTest(absltest.TestCase):

  def test_clear_error_within_timeout(self):
    # A two-task cluster whose worker is never started. The timeout counts
    # from the start of the wait for the peers (after TensorFlow's import),
    # so 3 s show it firing as well as the 8 s of before did, 5 s sooner.
    from tfdist import launch  # pylint: disable=g-import-not-at-top
    import portpicker  # pylint: disable=g-import-not-at-top
    tasks = launch.plan_tasks(num_workers=2)
    cluster = launch.make_cluster(
        tasks, [portpicker.pick_unused_port() for _ in tasks])
    data = testutil.fashion_mnist_subset(limit=256)
    started = time.time()
    code, out, seconds = testlib.run_module_with_timeout(
        "tfdist.train",
        ["--distribution_strategy=multi_worker_mirrored",
         f"--train_files={data['train']}", f"--eval_files={data['eval']}",
         "--train_steps=2", f"--model_dir={testutil.scratch_dir()}",
         "--cluster_start_timeout_seconds=3"],
        timeout=90, env={"TF_CONFIG": launch.tf_config(cluster, tasks[0])})
    self.assertIsNotNone(code, "the worker hung:\n" + out[-3000:])
    self.assertEqual(code, 137, out[-3000:])  # Retryable: no cluster in time.
    self.assertLess(seconds, 60)
    self.assertLess(time.time() - started, 90)
    self.assertIn("did not all answer within "
                  "--cluster_start_timeout_seconds=3", out)
    self.assertIn(cluster["worker"][0], out)  # Names the missing peer.


if __name__ == "__main__":
  absltest.main()
