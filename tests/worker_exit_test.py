"""Tests for tfdist.distribute.worker_exit: done markers, the address probe, the
final barrier."""

import os
import socket
import subprocess
import sys
import tempfile

from absl.testing import absltest
import portpicker
import pytest
import tensorflow as tf

from tests import testutil
from tfdist.distribute import worker_exit

pytestmark = pytest.mark.compat


class DoneMarkerTest(absltest.TestCase):

  def test_mark_and_read(self):
    folder = tempfile.TemporaryDirectory()
    self.addCleanup(folder.cleanup)
    path = os.path.join(folder.name, "worker-1.done")
    self.assertFalse(worker_exit.is_done(path))
    worker_exit.mark_done(path)
    self.assertTrue(worker_exit.is_done(path))
    with open(path) as f:
      pid, stamp = f.read().split()
    self.assertEqual(int(pid), os.getpid())
    self.assertGreater(float(stamp), 0)
    # Written atomically: no temporary file is left beside it.
    self.assertEqual(os.listdir(folder.name), ["worker-1.done"])

  def test_no_path_is_a_no_op(self):
    worker_exit.mark_done(None)
    worker_exit.mark_done("")
    self.assertFalse(worker_exit.is_done(None))
    self.assertFalse(worker_exit.is_done(""))


class WaitUntilGoneTest(absltest.TestCase):

  def test_a_listening_address_is_not_gone(self):
    port = portpicker.pick_unused_port()
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("localhost", port))
    server.listen(16)
    try:
      self.assertFalse(worker_exit.wait_until_gone(f"localhost:{port}",
                                                   timeout_seconds=0.3))
    finally:
      server.close()
    self.assertTrue(worker_exit.wait_until_gone(f"localhost:{port}",
                                                timeout_seconds=5))

  def test_a_malformed_address_counts_as_gone(self):
    self.assertTrue(worker_exit.wait_until_gone("no-port", 1))


class LeaveTogetherTest(absltest.TestCase):

  def test_one_worker_returns_at_once(self):
    self.assertEqual(worker_exit.leave_together(None, num_workers=1), 0.0)

  def test_barrier_over_a_real_strategy(self):
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    waited = worker_exit.leave_together(strategy, num_workers=2)
    self.assertGreaterEqual(waited, 0.0)


class FailuresSharedTest(absltest.TestCase):
  """A status-2 error at the end of a run is announced at the final barrier
  (every task then exits 2: tests/multi_worker_test.py ExportFailureTest)."""

  def test_a_status_2_error_joins_the_barrier_as_failed(self):
    from tfdist import errors  # pylint: disable=g-import-not-at-top
    calls = []
    with self.assertRaises(errors.OutputWriteError):
      with worker_exit.failures_shared(lambda failed: calls.append(failed)):
        raise errors.OutputWriteError("--export_dir=/e: full")
    self.assertEqual(calls, [True])
    # Anything else is not a shared failure (the peers see a lost peer).
    with self.assertRaises(RuntimeError):
      with worker_exit.failures_shared(lambda failed: calls.append(failed)):
        raise RuntimeError("a bug")
    with worker_exit.failures_shared(lambda failed: calls.append(failed)):
      pass
    self.assertEqual(calls, [True])

  def test_a_barrier_that_fails_keeps_the_error(self):
    from tfdist import errors  # pylint: disable=g-import-not-at-top

    def leave(failed):
      raise tf.errors.UnavailableError(None, None, "chief gone")
    with self.assertRaisesRegex(errors.OutputWriteError, "full"):
      with worker_exit.failures_shared(leave):
        raise errors.OutputWriteError("full")

  def test_the_failed_barrier_over_a_real_strategy(self):
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    # Only this task failed: nothing raised here (it raises its own error).
    worker_exit.leave_together(strategy, num_workers=2, failed=True)


class ImportTest(absltest.TestCase):

  def test_the_launcher_side_stays_tensorflow_free(self):
    # The launcher imports this module; importing it must not start
    # TensorFlow (seconds, and its threads, in every launcher).
    code = ("import sys, tfdist.distribute.worker_exit; "
            "print('tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, check=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=testutil.REPO_ROOT))
    self.assertEqual(out.stdout.strip(), "False")


if __name__ == "__main__":
  absltest.main()
