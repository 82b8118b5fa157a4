"""A deadline that holds even while TensorFlow blocks the Python interpreter.

Some TensorFlow calls wait inside C++ while holding the GIL (building a
MultiWorkerMirroredStrategy waits there for every peer to connect, without a
timeout of its own), so neither a Python thread nor a Python signal handler
can run until they return. `Deadline` therefore watches from a tiny separate
process (standard library only, no TensorFlow): if the guarded block has not
finished after `seconds`, the watcher prints `message` to this process's
stderr and ends this process with SIGKILL (exit status -9, or 137 from a
shell). Leaving the block in time stops the watcher.

While it waits, the watcher can also

* report, every `report_seconds`, which peers (`probes`: `host:port` ->
  task name) do not accept a TCP connection yet (a plain connect, closed at
  once), so a start-up that waits for a peer says which one;
* end the process on SIGTERM or SIGINT (`signals`): CPython's C-level
  signal handler writes the signal number into the watcher's pipe
  (`signal.set_wakeup_fd`) the moment the signal arrives, even while the
  main thread is held in C++. Nothing has been trained or saved yet, so the
  watcher ends the process at once (status 137), saying so.
"""

import json
import os
import signal
import subprocess
import sys
from typing import Mapping, Optional, Sequence

# Run by the watcher process: wait for the parent to close our stdin (block
# finished, or parent died), for a signal byte on it, or for the deadline;
# report the probes every `report` seconds meanwhile.
_WATCHER = r"""
import json, os, select, signal, socket, sys, time
pid, seconds, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
report, probes = float(sys.argv[4]), json.loads(sys.argv[5])
watched = {int(x) for x in sys.argv[6].split(",") if x}
started = time.time()
deadline, next_report = started + seconds, started + (report or seconds + 1)
def end(text):
  sys.stderr.write(text + "\n")
  sys.stderr.flush()
  try:
    os.kill(pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  sys.exit(0)
def answers(address):
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
      return True
  except (OSError, ValueError):
    return False
while True:
  now = time.time()
  if now >= deadline:
    end(message)
  wait = min(deadline, next_report) - now
  ready, _, _ = select.select([0], [], [], max(wait, 0))
  if ready:
    data = os.read(0, 256)
    if not data:
      sys.exit(0)
    for byte in data:
      if byte in watched:
        end("tfdist: received %s after %.0f s of waiting for the cluster to "
            "form; nothing is trained or saved yet: ending the process." %
            (signal.Signals(byte).name, time.time() - started))
    continue
  if report and time.time() >= next_report:
    next_report += report
    missing = [name + " at " + a for a, name in probes.items()
               if not answers(a)]
    waited = time.time() - started
    if missing:
      text = ("still waiting for the cluster to form after %.0f s (at most "
              "%.0f s): no answer from %s" % (waited, seconds,
                                              ", ".join(missing)))
    else:
      text = ("still waiting for the cluster to form after %.0f s (at most "
              "%.0f s): every peer's server answers (%s); waiting for them "
              "to join" % (waited, seconds, ", ".join(probes.values())))
    sys.stderr.write("tfdist: " + text + ".\n")
    sys.stderr.flush()
"""


class Deadline:
  """Kills this process if a block takes longer than `seconds`.

  Usage:

      with Deadline(60, "tfdist: the cluster did not start in 60 s"):
        strategy = tf.distribute.MultiWorkerMirroredStrategy(...)

  Args:
    seconds: time allowed, in seconds (> 0).
    message: printed to stderr (one line) just before the kill; say what
      timed out, after how long, and what to check.
    probes: `{host:port: task name}` of the peers to report on; {} for none.
    report_seconds: how often to report the peers that do not answer, in
      seconds (0: never).
    signals: signals that end the process at once while the block runs
      (e.g. `(signal.SIGTERM, signal.SIGINT)`); their Python handlers are
      replaced for the block (main thread only; elsewhere none are
      watched) and restored after it.

  Raises:
    ValueError: `seconds` <= 0.
  """

  def __init__(self, seconds: float, message: str, *,
               probes: Optional[Mapping[str, str]] = None,
               report_seconds: float = 0.0,
               signals: Sequence[int] = ()):
    if seconds <= 0:
      raise ValueError(f"Deadline seconds must be > 0; received {seconds}.")
    self.seconds = float(seconds)
    self.message = message
    self.probes = dict(probes or {})
    self.report_seconds = float(report_seconds)
    self.signals = tuple(int(s) for s in signals)
    self._watcher: Optional[subprocess.Popen] = None
    self._previous = {}
    self._previous_wakeup_fd = None

  def start(self) -> "Deadline":
    """Starts the watcher (idempotent)."""
    if self._watcher is not None:
      return self
    import threading  # pylint: disable=g-import-not-at-top
    on_main = threading.current_thread() is threading.main_thread()
    signals = self.signals if on_main else ()
    self._watcher = subprocess.Popen(
        [sys.executable, "-S", "-c", _WATCHER, str(os.getpid()),
         str(self.seconds), self.message, str(self.report_seconds),
         json.dumps(self.probes), ",".join(str(s) for s in signals)],
        stdin=subprocess.PIPE, close_fds=True)
    if signals:
      write_end = self._watcher.stdin.fileno()
      os.set_blocking(write_end, False)
      for signum in signals:
        # A Python-level handler, so that CPython's C handler writes the
        # signal into the wakeup fd; it does nothing itself (the watcher
        # acts).
        self._previous[signum] = signal.signal(signum, lambda *_: None)
      self._previous_wakeup_fd = signal.set_wakeup_fd(
          write_end, warn_on_full_buffer=False)
    return self

  def cancel(self):
    """Stops the watcher: the guarded work finished in time."""
    watcher, self._watcher = self._watcher, None
    if watcher is None:
      return
    if self._previous_wakeup_fd is not None:
      signal.set_wakeup_fd(self._previous_wakeup_fd)
      self._previous_wakeup_fd = None
    for signum, previous in self._previous.items():
      signal.signal(signum, previous if previous is not None else
                    signal.SIG_DFL)
    self._previous = {}
    try:
      watcher.stdin.close()
    except OSError:
      pass
    try:
      watcher.wait(timeout=10)
    except subprocess.TimeoutExpired:
      watcher.kill()
      watcher.wait()

  def __enter__(self) -> "Deadline":
    return self.start()

  def __exit__(self, *exc_info):
    self.cancel()
    return False
