"""Preemption: on SIGTERM (or Ctrl-C), checkpoint at an agreed step and exit.

Vertex AI and Kubernetes send SIGTERM some seconds before they take a machine
away. Under MultiWorkerMirroredStrategy TensorFlow's own preemption notifier
catches SIGTERM and the process does not exit, and a worker that simply died
would leave its peers failing in their next all-reduce. tfdist instead:

1. installs its own handler for SIGTERM and SIGINT (after the strategy is
   built, replacing TensorFlow's), which only records the signal;
2. the controller passes `signal_received()` into the next chunk of steps,
   whose sums are reduced across all workers anyway: a signal received by
   any one worker stops *all* of them after the same step, with no
   collective of its own (`tfdist.training.step.step_runner`);
3. every worker then calls the checkpoint save (a collective operation; the
   chief writes to `--model_dir`, the others to their scratch folders) and
   the run ends with `PreemptedError`, which `tfdist.train` turns into exit
   status 128 + signal (143 for SIGTERM, 130 for SIGINT);
4. if that has not happened within `--preemption_grace_seconds` of the
   signal's arrival (a peer is gone, a step hangs), the process is ended
   (SIGKILL, status 137).

The grace period is a bound measured from the signal's arrival, whatever
the main thread is doing. A Python signal handler runs only when the main
thread returns to the interpreter, which a long TensorFlow call (tracing a
large first step, a step that blocks in C++) delays for minutes. So
`install` also starts a small watcher process (`tfdist.runtime.watchdog`'s,
standard library only, no TensorFlow) and hands it the write end of a pipe
through
`signal.set_wakeup_fd`: CPython's C-level signal handler writes the signal
number there the moment the signal arrives. The watcher starts the clock
then, reports the arrival time back (so the log says the true delay), and
kills the process when the grace period runs out, or at once on a second
signal. It exits with the process.

Rerunning with the same `--model_dir` resumes from that checkpoint.

Signal handlers can only be installed from the main thread. Off it (Ray
Train, notebook executors, test runners call `run_experiment` from threads)
the watcher says so once and installs nothing and starts no watcher: the
host framework owns signals there, and nothing is killed.

`tf.distribute.experimental.PreemptionCheckpointHandler` does much the same
for MultiWorkerMirroredStrategy, but owns the checkpoint manager and the
training function's call and exits with its own code; this watcher fits the
tfdist controller (which already saves collectively, with non-chief scratch
folders) and works the same under every single-host strategy.
"""

import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

from absl import logging

from tfdist import errors
from tfdist.runtime import console
from tfdist.runtime import watchdog


def _say(text: str) -> None:
  """Writes `text` to file descriptor 2 directly, from a signal handler.

  The handler runs in the main thread between two bytecodes, possibly in
  the middle of the main thread's own write to `sys.stderr` (a log line):
  writing through that buffered stream again raises `RuntimeError:
  reentrant call`, which `logging` prints as a traceback. An unbuffered
  write to the descriptor cannot.
  """
  console.end_open_line(in_signal_handler=True)  # Not after a bar.
  try:
    os.write(2, text.encode(errors="replace"))
  except OSError:
    pass


class PreemptionWatcher:
  """Records SIGTERM/SIGINT and ends the process if a stop takes too long.

  Args:
    grace_seconds: after the first signal (or a peer's stop), the process is
      ended if it has not exited within this many seconds
      (`--preemption_grace_seconds`).
    signals: the signals to handle.

  Raises:
    ValueError: `grace_seconds` <= 0.
  """

  def __init__(self, *, grace_seconds: float,
               signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)):
    if grace_seconds <= 0:
      raise ValueError(
          f"--preemption_grace_seconds={grace_seconds} must be > 0.")
    self.grace_seconds = float(grace_seconds)
    self.signals = tuple(signals)
    self.signum: Optional[int] = None
    self.received_at: Optional[float] = None
    self.installed = False
    self._previous = {}
    self._previous_wakeup_fd = -1
    self._watcher: Optional[subprocess.Popen] = None
    self._pipe_write: Optional[int] = None
    self._disarmed = False

  # --- signal handling -----------------------------------------------------
  def install(self) -> "PreemptionWatcher":
    """Installs the handlers and starts the grace-period watcher; returns
    self.

    Off the main thread nothing is installed and no watcher starts (Python
    allows signal handlers only there): the host framework (Ray, a
    notebook) owns signals, and this is logged once.
    """
    if threading.current_thread() is not threading.main_thread():
      logging.warning(
          "Signal-based preemption is off: tfdist is not on the main thread "
          "(%s), where Python handles signals, so SIGTERM/SIGINT stay with "
          "the host framework (Ray, a notebook). Checkpoints are still "
          "saved every --checkpoint_steps.", threading.current_thread().name)
      return self
    self._start_watcher()
    for signum in self.signals:
      self._previous[signum] = signal.signal(signum, self._handle)
    if self._pipe_write is not None:
      self._previous_wakeup_fd = signal.set_wakeup_fd(
          self._pipe_write, warn_on_full_buffer=False)
    self.installed = True
    return self

  def _start_watcher(self):
    read_end, write_end = os.pipe()
    try:
      self._watcher = watchdog.start_watcher(
          seconds=self.grace_seconds, armed=False, signals=self.signals,
          message=("tfdist: error: still running %%(elapsed).1f s after "
                   "%%(what)s (--preemption_grace_seconds=%g): ending the "
                   "process without a final checkpoint." % self.grace_seconds),
          stdin=read_end, stdout=subprocess.PIPE)
    except OSError as e:
      os.close(read_end)
      os.close(write_end)
      logging.warning("tfdist: could not start the grace-period watcher "
                      "(%s): --preemption_grace_seconds is not enforced.", e)
      return
    os.close(read_end)
    os.set_blocking(write_end, False)
    self._pipe_write = write_end

  def _send(self, byte: int):
    if self._pipe_write is None:
      return
    try:
      os.write(self._pipe_write, bytes([byte]))
    except OSError:
      pass

  def uninstall(self):
    """Restores the handlers that were there before `install`.

    While a stop is under way (a signal arrived) the watcher keeps the
    clock running until the process exits; otherwise it stops now.
    """
    if self.installed and self._pipe_write is not None:
      signal.set_wakeup_fd(self._previous_wakeup_fd)
    for signum, previous in self._previous.items():
      signal.signal(signum, previous if previous is not None else
                    signal.SIG_DFL)
    self._previous = {}
    self.installed = False
    if self.signum is None or self._disarmed:
      self._stop_watcher()

  def _stop_watcher(self):
    watcher, self._watcher = self._watcher, None
    write_end, self._pipe_write = self._pipe_write, None
    if write_end is not None:
      os.close(write_end)
    if watcher is not None:
      try:
        watcher.wait(timeout=10)
      except subprocess.TimeoutExpired:
        watcher.kill()
        watcher.wait()
      watcher.stdout.close()

  def _handle(self, signum, frame):
    del frame  # Unused.
    name = signal.Signals(signum).name
    if self.signum is not None:
      _say(f"tfdist: second signal ({name}): exiting now.\n")
      sys.exit(128 + signum)
    self.signum = signum
    self.received_at = self._arrival_time() or time.time()
    late = time.time() - self.received_at
    _say(f"tfdist: received {name}"
         + (f" {late:.1f} s ago" if late >= 0.5 else "")
         + ": saving a checkpoint at the next step boundary and exiting "
         f"within {self.grace_seconds:g} s of its arrival "
         "(--preemption_grace_seconds).\n")

  def _arrival_time(self) -> Optional[float]:
    """When the watcher saw the first signal arrive (None: unknown)."""
    watcher = self._watcher
    if watcher is None or watcher.stdout is None:
      return None
    ready, _, _ = select.select([watcher.stdout], [], [], 0.5)
    if not ready:
      return None
    line = watcher.stdout.readline().decode(errors="replace").split()
    try:
      return float(line[1])
    except (IndexError, ValueError):
      return None

  def cancel_deadline(self):
    """Stops the grace-period clock (a caller that catches
    `PreemptedError` and keeps the process alive, e.g. a test)."""
    self._send(watchdog.DISARM)
    self._disarmed = True
    if not self.installed:
      self._stop_watcher()

  def signal_received(self) -> bool:
    """True once this process got one of `signals`."""
    return self.signum is not None

  def note_peer_stop(self):
    """A peer worker asked to stop (its signal reached us through the step's
    reduction): stop with it, under the same grace period."""
    if self.signum is not None:
      return
    logging.warning("A peer worker received a stop signal: saving and "
                    "stopping with it.")
    self.signum = signal.SIGTERM
    self.received_at = time.time()
    self._send(watchdog.PEER_STOP)

  def preempted(self, *, step: int,
                checkpoint: Optional[str]) -> errors.PreemptedError:
    """The error to raise once the checkpoint at `step` is saved."""
    signum = self.signum if self.signum is not None else signal.SIGTERM
    elapsed = time.time() - (self.received_at or time.time())
    # The step and checkpoint are the error's to say (one line, at the
    # end); this says only how long the stop took.
    logging.info("tfdist: the stop's checkpoint was saved %.1f s after the "
                 "signal.", elapsed)
    return errors.PreemptedError(
        signum=signum, step=step, checkpoint=checkpoint)
