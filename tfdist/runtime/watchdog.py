"""A deadline that holds even while TensorFlow blocks the Python interpreter.

Some TensorFlow calls wait inside C++ while holding the GIL (building a
MultiWorkerMirroredStrategy waits there for every peer to connect, without a
timeout of its own), so neither a Python thread nor a Python signal handler
can run until they return. `Deadline` therefore watches from a tiny separate
process (standard library only, no TensorFlow): if the guarded block has not
finished after `seconds`, the watcher prints `message` to this process's
stderr and ends this process with SIGKILL (exit status -9, or 137 from a
shell). Leaving the block in time stops the watcher.

The same watcher process (`start_watcher`) also enforces
`tfdist.runtime.preemption`'s grace period: there its clock starts when a signal
arrives.
"""

import os
import signal
import subprocess
import sys
from typing import Optional, Sequence

# Bytes a process writes into its watcher's stdin, beside the signal
# numbers (1-64) CPython's C-level handler writes there
# (`signal.set_wakeup_fd`); the script below spells them as numbers.
PEER_STOP = 250  # A peer's stop signal: start the clock now.
DISARM = 251     # The process handles its exit itself: stop the clock.

# The one watcher process (standard library only, no TensorFlow). argv:
# pid, seconds, message, armed ("1": the clock runs from the start), the
# watched signal numbers (comma-separated). Unarmed, the clock starts when a
# watched signal's number or PEER_STOP arrives on stdin, and DISARM stops
# it; a second watched signal kills at once. Each watched signal's arrival
# is reported on stdout as "<signum> <time.time()>". When the clock runs
# out, `message % {"elapsed": seconds since the clock started, "what": what
# started it}` goes to stderr and `pid` gets SIGKILL. Closing stdin (the
# process finished or died) ends the watcher.
#
# The watcher ignores SIGINT, first thing: a terminal's Ctrl-C goes to the
# whole foreground process group, the watcher included, and the decision
# is the watched process's (which hears of the signal through the wakeup
# pipe); a watcher dying of KeyboardInterrupt would print a traceback, take
# the grace deadline with it, and leave the process a broken pipe. The
# watcher starts with SIGINT blocked (`start_watcher`), so one that arrives
# while its interpreter starts waits, and is dropped once ignored.
WATCHER_SCRIPT = r"""
import signal
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
import os, select, sys, time
pid, grace, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
armed = time.time() if sys.argv[4] == "1" else None
watched = {int(x) for x in sys.argv[5].split(",") if x}
PEER, DISARM = 250, 251
what = ""
def name(n):
  try:
    return signal.Signals(n).name
  except ValueError:
    return "signal %d" % n
def kill(text):
  sys.stderr.write(text + "\n")
  sys.stderr.flush()
  try:
    os.kill(pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  sys.exit(0)
while True:
  timeout = None if armed is None else max(0.0, armed + grace - time.time())
  ready, _, _ = select.select([0], [], [], timeout)
  if not ready:
    kill(message % {"elapsed": time.time() - armed, "what": what})
  data = os.read(0, 256)
  if not data:
    sys.exit(0)
  now = time.time()
  for byte in data:
    if byte == DISARM:
      armed = None
    elif byte == PEER:
      if armed is None:
        armed, what = now, "a peer's stop signal"
    elif byte in watched:
      if armed is not None and what != "a peer's stop signal":
        kill("tfdist: second signal (%s): ending the process now." %
             name(byte))
      if armed is None:
        armed = now
      what = name(byte)
      sys.stdout.write("%d %.6f\n" % (byte, now))
      sys.stdout.flush()
"""


def start_watcher(*, seconds: float, message: str, armed: bool,
                  signals: Sequence[int] = (), stdin=subprocess.PIPE,
                  stdout=None) -> subprocess.Popen:
  """Starts the watcher process (`WATCHER_SCRIPT`) for this process.

  Args:
    seconds: how long after its clock starts the watcher kills this
      process (SIGKILL).
    message: the stderr line before the kill, a %-template with
      `%(elapsed)` (seconds since the clock started) and `%(what)` (the
      signal, or "a peer's stop signal", that started it); "%%" for "%".
    armed: start the clock now (else at the first watched signal or
      `PEER_STOP` written to the watcher's stdin).
    signals: the signal numbers the watcher reacts to on its stdin.
    stdin: the watcher's stdin (`subprocess.PIPE`, or a pipe's read end);
      closing its write end ends the watcher.
    stdout: where the watcher reports signal arrivals (None: inherited).

  Returns:
    The watcher's `subprocess.Popen`.

  Raises:
    OSError: the process could not be started.
  """
  # The child inherits this thread's signal mask: SIGINT stays blocked in
  # it until its script ignores SIGINT. Here a SIGINT that arrives
  # meanwhile is delivered when the mask is restored.
  previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
  try:
    return subprocess.Popen(
        [sys.executable, "-S", "-c", WATCHER_SCRIPT, str(os.getpid()),
         str(float(seconds)), message, "1" if armed else "0",
         ",".join(str(int(s)) for s in signals)],
        stdin=stdin, stdout=stdout, close_fds=True)
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class Deadline:
  """Kills this process if a block takes longer than `seconds`.

  Usage:

      with Deadline(60, "tfdist: the cluster did not start in 60 s"):
        strategy = tf.distribute.MultiWorkerMirroredStrategy(...)

  Args:
    seconds: time allowed, in seconds (> 0).
    message: printed to stderr (one line) just before the kill; say what
      timed out, after how long, and what to check.

  Raises:
    ValueError: `seconds` <= 0.
  """

  def __init__(self, seconds: float, message: str):
    if seconds <= 0:
      raise ValueError(f"Deadline seconds must be > 0; received {seconds}.")
    self.seconds = float(seconds)
    self.message = message
    self._watcher: Optional[subprocess.Popen] = None

  def start(self) -> "Deadline":
    """Starts the watcher (idempotent)."""
    if self._watcher is None:
      self._watcher = start_watcher(
          seconds=self.seconds, message=self.message.replace("%", "%%"),
          armed=True)
    return self

  def cancel(self):
    """Stops the watcher: the guarded work finished in time."""
    watcher, self._watcher = self._watcher, None
    if watcher is None:
      return
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
