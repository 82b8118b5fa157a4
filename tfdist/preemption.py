"""Preemption: on SIGTERM (or Ctrl-C), checkpoint at an agreed step and exit.

Vertex AI and Kubernetes send SIGTERM some seconds before they take a machine
away. Under MultiWorkerMirroredStrategy TensorFlow's own preemption notifier
catches SIGTERM and the process does not exit, and a worker that simply died
would leave its peers failing in their next all-reduce. tfdist instead:

1. installs its own handler for SIGTERM and SIGINT (after the strategy is
   built, replacing TensorFlow's), which only records the signal and starts
   a `watchdog.Deadline` of `--preemption_grace_seconds`;
2. after every chunk of steps the controller asks `should_stop()`. With
   several workers this is a one-number all-reduce, so a signal received by
   any one worker stops *all* of them at the same step;
3. every worker then calls the checkpoint save (a collective operation; the
   chief writes to `--model_dir`, the others to their scratch folders) and
   the run ends with `PreemptedError`, which `tfdist.train` turns into exit
   status 128 + signal (143 for SIGTERM, 130 for SIGINT);
4. if that has not happened within the grace period (a peer is gone, a
   step hangs), the deadline ends the process.

Rerunning with the same `--model_dir` resumes from that checkpoint.

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
import tensorflow as tf

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
  """Records SIGTERM/SIGINT and lets all workers agree to stop.

  Args:
    strategy: the run's strategy; used for the agreement all-reduce when
      `num_workers` > 1.
    num_workers: hosts training in sync (1: no all-reduce, the local flag
      decides).
    grace_seconds: after the first signal, the process is ended if it has
      not exited within this many seconds (`--preemption_grace_seconds`).
    signals: the signals to handle.

  Attributes:
    installed: whether `install` put the handlers in place (False off the
      main thread, where Python cannot handle signals).

  Raises:
    ValueError: `grace_seconds` <= 0.
  """

  def __init__(self, *, strategy: tf.distribute.Strategy, num_workers: int,
               grace_seconds: float,
               signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)):
    if grace_seconds <= 0:
      raise ValueError(
          f"--preemption_grace_seconds={grace_seconds} must be > 0.")
    self.strategy = strategy
    self.num_workers = int(num_workers)
    self.grace_seconds = float(grace_seconds)
    self.signals = tuple(signals)
    self.signum: Optional[int] = None
    self.installed = False
    self.received_at: Optional[float] = None
    self._previous = {}
    self._deadline: Optional[watchdog.Deadline] = None
    self._agree_fn = None
    if self.num_workers > 1:
      self._agree_fn = tf.function(self._agree)

  # --- signal handling -----------------------------------------------------
  def install(self) -> "PreemptionWatcher":
    """Installs the handlers; returns self.

    Python runs signal handlers only in the main thread, and `signal.signal`
    raises `ValueError` anywhere else. Called from another thread (Ray
    Train runs the training function in one; so do notebook executors and
    some test runners), this installs nothing and logs why: the host
    framework keeps its signals, `installed` is False and
    `signal_received()` stays False. `should_stop()` still joins the
    agreement all-reduce, so workers that do have handlers still stop
    together with this one.
    """
    if threading.current_thread() is not threading.main_thread():
      logging.warning(
          "tfdist: not on the main thread (%s): signal-based preemption "
          "(SIGTERM/SIGINT -> checkpoint and exit) is off in this process; "
          "signals are left to the host framework.",
          threading.current_thread().name)
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

  def _handle(self, signum, frame):
    del frame  # Unused.
    name = signal.Signals(signum).name
    if self.signum is not None:
      sys.stderr.write(f"tfdist: second signal ({name}): exiting now.\n")
      sys.stderr.flush()
      sys.exit(128 + signum)
    self.signum = signum
    self.received_at = time.time()
    message = (f"tfdist: received {name}: saving a checkpoint at the next "
               f"step boundary and exiting within {self.grace_seconds:g} s "
               "(--preemption_grace_seconds).")
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    self._deadline = watchdog.Deadline(
        self.grace_seconds,
        f"tfdist: error: still running {self.grace_seconds:g} s after "
        f"{name} (--preemption_grace_seconds): ending the process without a "
        "final checkpoint.").start()

  def signal_received(self) -> bool:
    """True once this process got one of `signals`."""
    return self.signum is not None

  # --- agreement -------------------------------------------------------------
  def _agree(self, flag):
    per_replica = self.strategy.run(tf.identity, args=(flag,))
    return self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica,
                                axis=None)

  def should_stop(self) -> bool:
    """Whether any worker got a signal; every worker must call this together.

    With several workers this runs one all-reduce (a float32 scalar), so it
    must be called at the same points on all of them (the controller calls
    it after every chunk of steps).
    """
    local = self.signum is not None
    if self._agree_fn is None:
      return local
    total = float(self._agree_fn(tf.constant(1.0 if local else 0.0)))
    # Re-read `self.signum`: this process's own signal may have arrived
    # during the all-reduce, and it wins over the peer's (SIGINT stays 130).
    if total > 0 and self.signum is None:
      logging.warning("A peer worker received a stop signal: saving and "
                      "stopping with it.")
      self.signum = signal.SIGTERM
      self.received_at = time.time()
      self._deadline = watchdog.Deadline(
          self.grace_seconds,
          f"tfdist: error: still running {self.grace_seconds:g} s after a "
          "peer's stop signal (--preemption_grace_seconds): ending the "
          "process without a final checkpoint.").start()
    return total > 0

  def preempted(self, *, step: int,
                checkpoint: Optional[str]) -> PreemptedError:
    """The error to raise once the checkpoint at `step` is saved."""
    signum = self.signum if self.signum is not None else signal.SIGTERM
    elapsed = time.time() - (self.received_at or time.time())
    logging.warning("Stopped at step %d, %.1f s after the signal; checkpoint "
                    "%s.", step, elapsed, checkpoint)
    return PreemptedError(signum=signum, step=step, checkpoint=checkpoint)
