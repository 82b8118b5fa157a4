"""Preemption: on SIGTERM (or Ctrl-C), checkpoint at an agreed step and exit.

Vertex AI and Kubernetes send SIGTERM some seconds before they take a machine
away. Under MultiWorkerMirroredStrategy TensorFlow's own preemption notifier
catches SIGTERM and the process does not exit, and a worker that simply died
would leave its peers failing in their next all-reduce. tfdist instead:

1. installs its own handler for SIGTERM and SIGINT (after the strategy is
   built, replacing TensorFlow's), which only records the signal and starts
   a `watchdog.Deadline` of `--preemption_grace_seconds`;
2. the controller passes `signal_received()` into the next chunk of steps,
   whose sums are reduced across all workers anyway: a signal received by
   any one worker stops *all* of them after the same step, with no
   collective of its own (`tfdist.step_runner`);
3. every worker then calls the checkpoint save (a collective operation; the
   chief writes to `--model_dir`, the others to their scratch folders) and
   the run ends with `PreemptedError`, which `tfdist.train` turns into exit
   status 128 + signal (143 for SIGTERM, 130 for SIGINT);
4. if that has not happened within the grace period (a peer is gone, a
   step hangs), the deadline ends the process.

Rerunning with the same `--model_dir` resumes from that checkpoint.

Signal handlers can only be installed from the main thread. Off it (Ray
Train, notebook executors, test runners call `run_experiment` from threads)
the watcher says so once and installs nothing: the host framework owns
signals there.

`tf.distribute.experimental.PreemptionCheckpointHandler` does much the same
for MultiWorkerMirroredStrategy, but owns the checkpoint manager and the
training function's call and exits with its own code; this watcher fits the
tfdist controller (which already saves collectively, with non-chief scratch
folders) and works the same under every single-host strategy.
"""

import signal
import sys
import threading
import time
from typing import Optional, Sequence

from absl import logging

from tfdist import watchdog


class PreemptedError(Exception):
  """Training stopped on a signal after saving a checkpoint.

  Attributes:
    signum: the signal received (by this worker or, if none, a peer:
      SIGTERM).
    step: the step at which every worker stopped and saved.
    checkpoint: the checkpoint path this process wrote (None if unknown).
    exit_code: 128 + signum, the shell's convention for "ended by signal".
  """

  def __init__(self, *, signum: int, step: int, checkpoint: Optional[str]):
    self.signum = signum
    self.step = step
    self.checkpoint = checkpoint
    self.exit_code = 128 + signum
    super().__init__(
        f"Stopped by {signal.Signals(signum).name} at step {step}; checkpoint "
        f"{checkpoint}. Run again with the same --model_dir to resume.")


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
    self._deadline: Optional[watchdog.Deadline] = None

  # --- signal handling -----------------------------------------------------
  def install(self) -> "PreemptionWatcher":
    """Installs the handlers; returns self.

    Off the main thread nothing is installed (Python allows signal handlers
    only there): the host framework (Ray, a notebook) owns signals, and this
    is logged once.
    """
    if threading.current_thread() is not threading.main_thread():
      logging.warning(
          "Signal-based preemption is off: tfdist is not on the main thread "
          "(%s), where Python handles signals, so SIGTERM/SIGINT stay with "
          "the host framework (Ray, a notebook). Checkpoints are still "
          "saved every --checkpoint_steps.", threading.current_thread().name)
      return self
    for signum in self.signals:
      self._previous[signum] = signal.signal(signum, self._handle)
    self.installed = True
    return self

  def uninstall(self):
    """Restores the handlers that were there before `install`."""
    for signum, previous in self._previous.items():
      signal.signal(signum, previous if previous is not None else
                    signal.SIG_DFL)
    self._previous = {}
    self.installed = False

  def _start_deadline(self, what: str):
    self._deadline = watchdog.Deadline(
        self.grace_seconds,
        f"tfdist: error: still running {self.grace_seconds:g} s after "
        f"{what} (--preemption_grace_seconds): ending the process without a "
        "final checkpoint.").start()

  def _handle(self, signum, frame):
    del frame  # Unused.
    name = signal.Signals(signum).name
    if self.signum is not None:
      sys.stderr.write(f"tfdist: second signal ({name}): exiting now.\n")
      sys.stderr.flush()
      sys.exit(128 + signum)
    self.signum = signum
    self.received_at = time.time()
    sys.stderr.write(
        f"tfdist: received {name}: saving a checkpoint at the next step "
        f"boundary and exiting within {self.grace_seconds:g} s "
        "(--preemption_grace_seconds).\n")
    sys.stderr.flush()
    self._start_deadline(name)

  def cancel_deadline(self):
    """Stops the grace-period watcher (a caller that catches
    `PreemptedError` and keeps the process alive, e.g. a test)."""
    if self._deadline is not None:
      self._deadline.cancel()
      self._deadline = None

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
    self._start_deadline("a peer's stop signal")

  def preempted(self, *, step: int,
                checkpoint: Optional[str]) -> PreemptedError:
    """The error to raise once the checkpoint at `step` is saved."""
    signum = self.signum if self.signum is not None else signal.SIGTERM
    elapsed = time.time() - (self.received_at or time.time())
    logging.warning("Stopped at step %d, %.1f s after the signal; checkpoint "
                    "%s.", step, elapsed, checkpoint)
    return PreemptedError(signum=signum, step=step, checkpoint=checkpoint)
