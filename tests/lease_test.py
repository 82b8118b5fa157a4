"""Tests for tfdist.distribute.lease: the lease on a real temporary --model_dir."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest
import pytest

from tfdist import errors
from tfdist.distribute import lease as lease_lib

pytestmark = pytest.mark.compat

# Long enough that the renewal thread (every quarter of it) stays asleep
# through a test; the tests renew by hand.
TIMEOUT = 120.0


class LeaseTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    folder = tempfile.TemporaryDirectory()
    self.addCleanup(folder.cleanup)
    self.model_dir = os.path.join(folder.name, "run")

  def _lease(self) -> lease_lib.Lease:
    lease = lease_lib.Lease(self.model_dir, timeout_seconds=TIMEOUT)
    self.addCleanup(lease.release)
    return lease

  def _write(self, **changes):
    """Writes a lease of another holder, `changes` applied, as the file."""
    now = time.time()
    info = lease_lib.LeaseInfo(
        holder="other:1:abc", host=socket.gethostname(), pid=os.getpid(),
        pid_start=lease_lib._process_start(os.getpid()),  # pylint: disable=protected-access
        command="train", started=now, heartbeat=now, expires=now + TIMEOUT,
        timeout_seconds=TIMEOUT)
    os.makedirs(self.model_dir, exist_ok=True)
    with open(lease_lib.lease_path(self.model_dir), "w") as f:
      f.write(dataclasses.replace(info, **changes).to_json())

  def test_acquire_writes_and_release_removes(self):
    lease = self._lease().acquire()
    self.assertTrue(lease.held)
    info = lease_lib.read_lease(self.model_dir)
    self.assertEqual(info.holder, lease.holder)
    self.assertEqual(info.pid, os.getpid())
    self.assertAlmostEqual(info.expires - info.heartbeat, TIMEOUT, places=3)
    lease.release()
    self.assertFalse(lease.held)
    self.assertIsNone(lease_lib.read_lease(self.model_dir))

  def test_a_live_holder_is_refused_by_name(self):
    holder = self._lease().acquire()
    with self.assertRaisesRegex(errors.LeaseHeldError,
                                f"in use by another run: holder "
                                f"{holder.holder}"):
      self._lease().acquire()
    with self.assertRaises(errors.LeaseHeldError):
      self._lease().check_free()
    # The holder keeps its lease.
    self.assertEqual(lease_lib.read_lease(self.model_dir).holder,
                     holder.holder)

  def test_an_expired_lease_is_taken_over(self):
    now = time.time()
    self._write(host="elsewhere", heartbeat=now - 3 * TIMEOUT,
                expires=now - 2 * TIMEOUT)
    lease = self._lease().acquire()
    self.assertEqual(lease_lib.read_lease(self.model_dir).holder,
                     lease.holder)

  def test_a_gone_process_on_this_host_is_taken_over_at_once(self):
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True, text=True, check=True, timeout=60)
    self._write(pid=int(gone.stdout), pid_start=None)
    lease = self._lease().acquire()
    self.assertEqual(lease_lib.read_lease(self.model_dir).holder,
                     lease.holder)

  def test_a_damaged_lease_file_counts_as_expired(self):
    os.makedirs(self.model_dir)
    with open(lease_lib.lease_path(self.model_dir), "w") as f:
      f.write("{not json")
    with self.assertRaisesRegex(ValueError, "does not hold a lease"):
      lease_lib.read_lease(self.model_dir)
    lease = self._lease().acquire()
    self.assertTrue(lease.held)

  def test_a_lease_taken_by_another_run_is_lost_at_renewal(self):
    lease = self._lease().acquire()
    self.assertTrue(lease.renew())
    lease.check()  # Still ours: nothing raised.
    self._write(holder="thief:2:def")
    self.assertFalse(lease.renew())
    self.assertEqual(lease.lost.holder, "thief:2:def")
    with self.assertRaisesRegex(errors.LeaseLostError, "thief:2:def"):
      lease.check()
    # Release leaves the other run's lease alone.
    lease.release()
    self.assertEqual(lease_lib.read_lease(self.model_dir).holder,
                     "thief:2:def")

  def test_extended_pushes_the_expiry_out(self):
    lease = self._lease().acquire()
    with lease.extended(1000):
      info = lease_lib.read_lease(self.model_dir)
      self.assertGreater(info.expires - info.heartbeat, 1000 + TIMEOUT - 5)
    info = lease_lib.read_lease(self.model_dir)
    self.assertAlmostEqual(info.expires - info.heartbeat, TIMEOUT, places=3)

  def test_context_manager(self):
    with self._lease() as lease:
      self.assertTrue(lease.held)
      self.assertTrue(os.path.exists(lease_lib.lease_path(self.model_dir)))
    self.assertFalse(os.path.exists(lease_lib.lease_path(self.model_dir)))

  def test_the_record_round_trips_and_describes_itself(self):
    lease = self._lease().acquire()
    info = lease_lib.read_lease(self.model_dir)
    self.assertEqual(lease_lib.LeaseInfo.from_json(info.to_json()), info)
    self.assertEqual(json.loads(info.to_json())["holder"], lease.holder)
    text = info.describe(now=info.heartbeat + 10)
    self.assertIn(f"pid {os.getpid()} on host {socket.gethostname()}", text)
    self.assertIn("last heartbeat 10 s ago", text)
    self.assertIsNone(info.gone_reason(info.heartbeat))
    self.assertIn("expired", info.gone_reason(info.expires + 5))

  def test_timeout_must_be_positive(self):
    with self.assertRaisesRegex(ValueError, "--lease_timeout_seconds=0"):
      lease_lib.Lease(self.model_dir, timeout_seconds=0)


if __name__ == "__main__":
  absltest.main()
