"""Tests for tfdist.runtime.watchdog: the deadline and the one watcher process.

Each kill is of a child Python process (the watcher kills the process that
started it); the watcher's stdin protocol is driven in this process with a
clock long enough never to fire.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

from absl.testing import absltest

from tests import testutil
from tfdist.runtime import watchdog


def _run_child(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
  """Runs `code` in a fresh Python with this checkout importable."""
  return subprocess.run(
      [sys.executable, "-c", textwrap.dedent(code)], cwd=testutil.REPO_ROOT,
      capture_output=True, text=True, timeout=timeout,
      env={**os.environ, "PYTHONPATH": testutil.REPO_ROOT})


class DeadlineTest(absltest.TestCase):

  def test_rejects_a_non_positive_deadline(self):
    with self.assertRaisesRegex(ValueError, "received 0"):
      watchdog.Deadline(0, "never")

  def test_a_block_that_overruns_is_killed_with_the_message(self):
    child = _run_child("""
        import time
        from tfdist.runtime import watchdog
        with watchdog.Deadline(0.5, "tfdist: the block took over 0.5 s (100%)"):
          time.sleep(30)
        """)
    self.assertEqual(child.returncode, -signal.SIGKILL)
    self.assertIn("tfdist: the block took over 0.5 s (100%)", child.stderr)

  def test_a_block_that_finishes_in_time_stops_the_watcher(self):
    deadline = watchdog.Deadline(60, "never printed")
    with deadline:
      watcher = deadline._watcher
      self.assertIsNone(watcher.poll())
    self.assertEqual(watcher.returncode, 0)
    self.assertIsNone(deadline._watcher)
    deadline.cancel()  # Idempotent.


class WatcherProcessTest(absltest.TestCase):

  def test_an_unarmed_watcher_reports_a_watched_signal_and_ends_with_stdin(
      self):
    watcher = watchdog.start_watcher(
        seconds=60, message="never", armed=False,
        signals=(signal.SIGTERM,), stdout=subprocess.PIPE)
    before = time.time()
    watcher.stdin.write(bytes([signal.SIGTERM]))
    watcher.stdin.flush()
    signum, arrived = watcher.stdout.readline().split()
    self.assertEqual(int(signum), signal.SIGTERM)
    self.assertBetween(float(arrived), before - 1, time.time() + 1)
    watcher.stdin.close()
    self.assertEqual(watcher.wait(timeout=10), 0)
    watcher.stdout.close()

  def test_a_sigint_at_the_watchers_start_does_not_end_it(self):
    # A terminal's Ctrl-C may reach the watcher while its interpreter
    # starts, before its script ignores SIGINT: it starts with SIGINT
    # blocked, so the signal waits and is then dropped.
    watcher = watchdog.start_watcher(seconds=60, message="never",
                                     armed=False, signals=(signal.SIGTERM,),
                                     stdout=subprocess.PIPE)
    os.kill(watcher.pid, signal.SIGINT)  # At once, mid start-up.
    watcher.stdin.write(bytes([signal.SIGTERM]))
    watcher.stdin.flush()
    self.assertTrue(watcher.stdout.readline().startswith(b"15 "))
    watcher.stdin.close()
    self.assertEqual(watcher.wait(timeout=10), 0)
    watcher.stdout.close()

  def test_a_peer_stop_starts_the_clock_and_names_it(self):
    child = _run_child("""
        import time
        from tfdist.runtime import watchdog
        w = watchdog.start_watcher(
            seconds=0.5, armed=False, signals=(15,),
            message="gone after %(elapsed).1f s of %(what)s")
        w.stdin.write(bytes([watchdog.PEER_STOP]))
        w.stdin.flush()
        time.sleep(30)
        """)
    self.assertEqual(child.returncode, -signal.SIGKILL)
    self.assertRegex(child.stderr, r"gone after 0\.\d s of a peer's stop")

  def test_disarm_stops_the_clock(self):
    child = _run_child("""
        import time
        from tfdist.runtime import watchdog
        w = watchdog.start_watcher(seconds=0.5, armed=False, signals=(15,),
                                   message="killed")
        w.stdin.write(bytes([watchdog.PEER_STOP, watchdog.DISARM]))
        w.stdin.flush()
        time.sleep(1.5)
        print("alive")
        """)
    self.assertEqual(child.returncode, 0, child.stderr)
    self.assertIn("alive", child.stdout)


if __name__ == "__main__":
  absltest.main()
