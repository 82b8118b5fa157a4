"""Tests for tfdist.distribute.rendezvous against real local ports."""

import os
import signal
import socket
import threading
import time

from absl.testing import absltest
import portpicker
import pytest

from tfdist import errors
from tfdist.distribute import rendezvous

pytestmark = pytest.mark.compat


def _address(port: int) -> str:
  return f"localhost:{port}"


class _Listener:
  """A real TCP server on a free local port (accepting in the backlog)."""

  def __init__(self):
    self.port = portpicker.pick_unused_port()
    self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self.socket.bind(("localhost", self.port))
    self.socket.listen(16)

  @property
  def address(self) -> str:
    return _address(self.port)

  def close(self):
    self.socket.close()


class RendezvousTest(absltest.TestCase):

  def _listener(self) -> _Listener:
    listener = _Listener()
    self.addCleanup(listener.close)
    return listener

  def test_answers(self):
    listener = self._listener()
    self.assertTrue(rendezvous.answers(listener.address))
    self.assertFalse(rendezvous.answers(
        _address(portpicker.pick_unused_port()), timeout=0.5))
    self.assertFalse(rendezvous.answers("not-an-address"))

  def test_returns_once_every_peer_answered(self):
    peers = {self._listener().address: f"worker {i}" for i in range(2)}
    waited = rendezvous.wait_for_peers(None, peers, timeout_seconds=5,
                                       poll_seconds=0.01)
    self.assertGreaterEqual(waited, 0.0)
    self.assertLess(waited, 5.0)

  def test_no_peers(self):
    self.assertLess(rendezvous.wait_for_peers(None, {}, timeout_seconds=1),
                    1.0)

  def test_a_missing_peer_is_named_after_the_timeout(self):
    there = self._listener().address
    missing = _address(portpicker.pick_unused_port())
    with self.assertRaisesRegex(
        errors.ClusterStartError,
        f"did not all answer within --cluster_start_timeout_seconds=0.3: no "
        f"answer from worker 1 at {missing}"):
      rendezvous.wait_for_peers(
          None, {there: "worker 0", missing: "worker 1"},
          timeout_seconds=0.3, poll_seconds=0.05, describe="the test cluster")

  def test_listens_on_its_own_address_while_waiting(self):
    # The peers waiting for this task see it answer before TensorFlow's
    # server starts on the address.
    own = _address(portpicker.pick_unused_port())
    missing = _address(portpicker.pick_unused_port())
    results = {}

    def task():
      try:
        rendezvous.wait_for_peers(own, {missing: "worker 1"},
                                  timeout_seconds=3, poll_seconds=0.05)
      except errors.ClusterStartError as e:
        results["error"] = e

    thread = threading.Thread(target=task)
    thread.start()
    seen = False
    for _ in range(100):
      if rendezvous.answers(own, timeout=0.2):
        seen = True
        break
      time.sleep(0.02)
    thread.join(30)
    self.assertTrue(seen)
    self.assertIn("worker 1", str(results["error"]))
    # The listener closed with the wait.
    self.assertFalse(rendezvous.answers(own, timeout=0.5))

  def test_a_reserved_port_is_held_until_the_wait_hands_it_on(self):
    port = rendezvous.reserve_port()
    own = _address(port)
    self.addCleanup(lambda: rendezvous._RESERVED.pop(port, None))  # pylint: disable=protected-access
    # No other process can take it meanwhile (a plain bind, as a port
    # picker's or another server's, fails), and a peer already sees it.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
      with self.assertRaises(OSError):
        other.bind(("", port))
    self.assertTrue(rendezvous.answers(own))
    # The wait listens on that same socket, and closes it at the end for
    # TensorFlow's server.
    rendezvous.wait_for_peers(own, {}, timeout_seconds=1)
    self.assertNotIn(port, rendezvous._RESERVED)  # pylint: disable=protected-access
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
      server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      server.bind(("", port))

  def test_sigterm_stops_the_wait(self):
    missing = _address(portpicker.pick_unused_port())
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    previous = signal.getsignal(signal.SIGTERM)
    timer.start()
    try:
      with self.assertRaisesRegex(errors.StoppedAtStartError,
                                  "received SIGTERM .*no answer yet from "
                                  f"worker 1 at {missing}") as cm:
        rendezvous.wait_for_peers(None, {missing: "worker 1"},
                                  timeout_seconds=30, poll_seconds=0.05)
    finally:
      timer.cancel()
    self.assertEqual(cm.exception.signum, signal.SIGTERM)
    self.assertEqual(cm.exception.exit_code, 143)
    # The previous handler is back.
    self.assertEqual(signal.getsignal(signal.SIGTERM), previous)


if __name__ == "__main__":
  absltest.main()
