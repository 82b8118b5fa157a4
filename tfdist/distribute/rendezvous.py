"""Waiting for the peers of a cluster before TensorFlow waits for them.

Building a MultiWorkerMirroredStrategy waits inside one C++ call, holding
the GIL, until every task has joined the coordination service; TensorFlow's
own SIGTERM handler (its preemption notifier, installed at the start of that
call) catches SIGTERM there, and SIGINT's Python handler never runs. A task
whose peer never comes would sit there, deaf to both, until
`--cluster_start_timeout_seconds` (measured: 12 minutes, until SIGKILL).

`wait_for_peers` therefore waits first, in Python, until every peer's
address accepts a plain TCP connection: the task listens on its own cluster
port meanwhile (so that its peers see it too, whichever phase they are in),
logs every `report_seconds` which tasks still do not answer, and stops on
SIGTERM or SIGINT at once (nothing is trained or saved yet). When every peer
has answered it closes its port and TensorFlow's server takes it; what is
left of the start-up (the peers are up) takes seconds.

Standard library only.
"""

import contextlib
import signal
import socket
import threading
import time
from typing import Callable, Mapping, Optional

from absl import logging

from tfdist import errors


def _split(address: str):
  host, _, port = address.rpartition(":")
  return host.strip("[]"), int(port)


def answers(address: str, timeout: float = 1.0) -> bool:
  """Whether `host:port` accepts a TCP connection now (closed at once)."""
  try:
    with socket.create_connection(_split(address), timeout=timeout):
      return True
  except (OSError, ValueError):
    return False


# Listening sockets this process holds for its own cluster port, by port
# (`reserve_port`), until its `wait_for_peers` takes them over.
_RESERVED = {}


def reserve_port() -> int:
  """Listens on a free port of all interfaces and keeps it: returns the
  port, for this process's own cluster address.

  A port found free and released at once (`bind` to port 0, then `close`,
  as Ray Train's TensorFlow backend picks `TF_CONFIG` ports) can be taken
  by another process in the seconds before TensorFlow's server binds it,
  which then fails to start ("Could not start gRPC server"). This one stays
  held until this process's `wait_for_peers` for that address listens on
  it (the same socket) and closes it for TensorFlow's server.
  """
  server = _listening_socket(0)
  port = server.getsockname()[1]
  _RESERVED[port] = server
  return port


def _listening_socket(port: int) -> socket.socket:
  """A TCP socket listening on `port` (0: a free one) of all interfaces.

  Raises:
    OSError: the port cannot be bound.
  """
  server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  try:
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("", port))
    server.listen(64)
  except OSError:
    server.close()
    raise
  return server


def _listen(address: Optional[str]):
  """A non-blocking listening socket on `address`'s port (all interfaces):
  the one `reserve_port` holds for it, else a new one, or None when it
  cannot be bound (`_accept_all` closes what connects)."""
  if not address:
    return None
  held = _RESERVED.pop(_split(address)[1], None)
  if held is not None:
    held.setblocking(False)
    return held
  try:
    server = _listening_socket(_split(address)[1])
    server.setblocking(False)
  except OSError as e:
    logging.info("tfdist: not listening on %s while waiting for the peers "
                 "(%s).", address, e)
    return None
  return server


def _accept_all(server):
  while server is not None:
    try:
      conn, _ = server.accept()
    except OSError:  # Nothing pending (BlockingIOError) or closed.
      return
    conn.close()


@contextlib.contextmanager
def recording_stop_signals():
  """While the block runs, SIGTERM and SIGINT are recorded instead of acted
  on (on the main thread; elsewhere nothing changes), so that a wait before
  training can stop with a message. Yields the list of signal numbers
  received, in order; the previous handlers are restored after the block."""
  received = []
  previous = {}
  if threading.current_thread() is threading.main_thread():
    for signum in (signal.SIGTERM, signal.SIGINT):
      previous[signum] = signal.signal(
          signum, lambda signum, frame: received.append(signum))
  try:
    yield received
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler if handler is not None else
                    signal.SIG_DFL)


def wait_for_peers(own_address: Optional[str], peers: Mapping[str, str], *,
                   timeout_seconds: float, report_seconds: float = 30.0,
                   poll_seconds: float = 0.2,
                   describe: str = "the cluster",
                   clock: Callable[[], float] = time.time) -> float:
  """Waits until every peer's address has accepted a TCP connection once.

  Args:
    own_address: this task's `host:port` (listened on meanwhile), or None.
    peers: `{host:port: task name}` of the other tasks.
    timeout_seconds: the longest wait, in seconds.
    report_seconds: log the tasks that do not answer this often.
    poll_seconds: pause between rounds of connection attempts.
    describe: names the cluster and its source in messages.
    clock: the time source (tests).

  Returns:
    Seconds waited.

  Raises:
    ClusterStartError: a peer still did not answer after `timeout_seconds`.
    StoppedAtStartError: SIGTERM or SIGINT arrived meanwhile (handled here
      only on the main thread).
  """
  started = clock()
  missing = dict(peers)
  with recording_stop_signals() as received:
    return _wait(own_address, missing, received, started=started,
                 timeout_seconds=timeout_seconds,
                 report_seconds=report_seconds, poll_seconds=poll_seconds,
                 describe=describe, clock=clock)


def _wait(own_address, missing, received, *, started, timeout_seconds,
          report_seconds, poll_seconds, describe, clock) -> float:
  """`wait_for_peers`'s loop, with the stop signals recorded."""
  server = _listen(own_address)
  next_report = started + report_seconds
  announced = False
  try:
    while True:
      for address in list(missing):
        _accept_all(server)
        if received:
          break
        if answers(address):
          del missing[address]
      _accept_all(server)
      now = clock()
      names = ", ".join(f"{name} at {address}"
                        for address, name in missing.items())
      if received:
        name = signal.Signals(received[0]).name
        raise errors.StoppedAtStartError(
            f"received {name} after {now - started:.0f} s of waiting for "
            f"the peers of {describe}"
            + (f" (no answer yet from {names})" if names else "")
            + "; nothing was trained or saved yet.", received[0])
      if not missing:
        return now - started
      if not announced:
        announced = True
        logging.info("tfdist: waiting for the peers of %s (at most %g s): "
                     "no answer yet from %s.", describe, timeout_seconds,
                     names)
      if now - started >= timeout_seconds:
        raise errors.ClusterStartError(
            f"the peers of {describe} did not all answer within "
            f"--cluster_start_timeout_seconds={timeout_seconds:g}: no answer "
            f"from {names}. Check that every task was started with the same "
            "cluster and that the addresses are reachable from this one.")
      if now >= next_report:
        next_report += report_seconds
        logging.warning("tfdist: still waiting for the peers of %s after "
                        "%.0f s (at most %g s): no answer from %s.", describe,
                        now - started, timeout_seconds, names)
      time.sleep(poll_seconds)
  finally:
    if server is not None:
      server.close()
