"""Tests for tfdist.runtime.preemption: real signals, a real watcher process.

Signals to this process are only sent while a `PreemptionWatcher` is
installed (its handler records them); the grace-period kill runs in a child
Python process.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

from absl.testing import absltest

from tests import testutil
from tfdist.runtime import preemption


class PreemptionWatcherTest(absltest.TestCase):

  def test_rejects_a_non_positive_grace_period(self):
    with self.assertRaisesRegex(ValueError, "grace_seconds=0 must be > 0"):
      preemption.PreemptionWatcher(grace_seconds=0)

  def test_a_signal_is_recorded_with_its_arrival_time(self):
    watcher = preemption.PreemptionWatcher(grace_seconds=60).install()
    self.addCleanup(watcher.uninstall)
    self.addCleanup(watcher.cancel_deadline)
    self.assertTrue(watcher.installed)
    self.assertFalse(watcher.signal_received())
    sent = time.time()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)  # The handler runs at the next bytecode boundary.
    self.assertTrue(watcher.signal_received())
    self.assertEqual(watcher.signum, signal.SIGTERM)
    self.assertBetween(watcher.received_at, sent - 1, time.time())
    error = watcher.preempted(step=7, checkpoint="/tmp/ckpt-7")
    self.assertEqual((error.step, error.checkpoint, error.exit_code),
                     (7, "/tmp/ckpt-7", 128 + signal.SIGTERM))

  def test_uninstall_restores_the_previous_handler(self):
    previous = signal.getsignal(signal.SIGINT)
    watcher = preemption.PreemptionWatcher(grace_seconds=60).install()
    self.assertNotEqual(signal.getsignal(signal.SIGINT), previous)
    watcher.uninstall()
    self.assertEqual(signal.getsignal(signal.SIGINT), previous)
    self.assertIsNone(watcher._watcher)  # No stop under way: it ended.

  def test_off_the_main_thread_nothing_is_installed(self):
    watcher = preemption.PreemptionWatcher(grace_seconds=60)
    thread = threading.Thread(target=watcher.install)
    thread.start()
    thread.join()
    self.assertFalse(watcher.installed)
    self.assertIsNone(watcher._watcher)

  def test_a_peer_stop_counts_as_sigterm(self):
    watcher = preemption.PreemptionWatcher(grace_seconds=60)
    watcher.note_peer_stop()
    self.assertEqual(watcher.signum, signal.SIGTERM)
    error = watcher.preempted(step=3, checkpoint=None)
    self.assertEqual(error.exit_code, 143)
    self.assertIn("Stopped by SIGTERM at step 3", str(error))

  def test_the_grace_period_ends_a_process_that_does_not_stop(self):
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent("""
            import os, signal, time
            from tfdist.runtime import preemption
            preemption.PreemptionWatcher(grace_seconds=0.5).install()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
            """)], cwd=testutil.REPO_ROOT, capture_output=True, text=True,
        timeout=60, env={**os.environ, "PYTHONPATH": testutil.REPO_ROOT})
    self.assertEqual(child.returncode, -signal.SIGKILL, child.stderr)
    self.assertIn("tfdist: received SIGTERM", child.stderr)
    self.assertRegex(child.stderr,
                     r"still running 0\.\d s after SIGTERM "
                     r"\(--preemption_grace_seconds=0\.5\): ending the "
                     "process without a final checkpoint")


class PreemptedErrorTest(absltest.TestCase):

  def test_exit_code_is_128_plus_the_signal(self):
    error = preemption.PreemptedError(signum=signal.SIGINT, step=2,
                                      checkpoint="ckpt-2")
    self.assertEqual(error.exit_code, 130)
    self.assertIn("--model_dir to resume", str(error))


if __name__ == "__main__":
  absltest.main()
