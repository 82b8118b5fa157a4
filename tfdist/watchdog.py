"""A deadline that holds even while TensorFlow blocks the Python interpreter.

Some TensorFlow calls wait inside C++ while holding the GIL (building a
MultiWorkerMirroredStrategy waits there for every peer to connect, without a
timeout of its own), so neither a Python thread nor a Python signal handler
can run until they return. `Deadline` therefore watches from a tiny separate
process (standard library only, no TensorFlow): if the guarded block has not
finished after `seconds`, the watcher prints `message` to this process's
stderr and ends this process with SIGKILL (exit status -9, or 137 from a
shell). Leaving the block in time stops the watcher.
"""

import os
import subprocess
import sys
from typing import Optional

# Run by the watcher process: wait for the parent to close our stdin (block
# finished, or parent died) or for the deadline, whichever comes first.
_WATCHER = r"""
import os, select, signal, sys
pid, seconds, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
ready, _, _ = select.select([sys.stdin], [], [], seconds)
if not ready:
  sys.stderr.write(message + "\n")
  sys.stderr.flush()
  try:
    os.kill(pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
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
      self._watcher = subprocess.Popen(
          [sys.executable, "-S", "-c", _WATCHER, str(os.getpid()),
           str(self.seconds), self.message],
          stdin=subprocess.PIPE, close_fds=True)
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
