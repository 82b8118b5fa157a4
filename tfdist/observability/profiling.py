"""`--profile_steps=START,END`: a TensorFlow profiler trace of a step window.

The `Controller` stops at the window's edges (`ProfileWindow.boundaries`,
added to its log, checkpoint and epoch boundaries), so the trace holds
exactly training steps START..END (counted from 1, both included): the
profiler starts before step START runs and stops after step END. Under a
coordinator (parameter servers) steps are scheduled in chunks; the window's
edges are still chunk edges, and the trace is the coordinator's own process.

The trace goes where Keras's TensorBoard callback puts its own:
`<logdir>/plugins/profile/<run>/<host>.xplane.pb` with `logdir` the
TensorBoard `train/` folder. TensorBoard's Profile tab opens it when the
`tensorboard-plugin-profile` package is installed (tfdist does not need it
to write the trace).
"""

import os
from typing import List, Optional, Sequence

from absl import logging
import tensorflow as tf

# Where a trace lands below the profiler's logdir (TensorBoard's layout).
PROFILE_SUBDIR = os.path.join("plugins", "profile")


def trace_files(logdir: str) -> List[str]:
  """The profiler's `.xplane.pb` files below `logdir` (sorted)."""
  return sorted(tf.io.gfile.glob(
      os.path.join(logdir, PROFILE_SUBDIR, "*", "*.xplane.pb")))


class ProfileWindow:
  """Runs TensorFlow's profiler over training steps `start..end`.

  Args:
    steps: `(start, end)`, 1-based and inclusive (`--profile_steps`).
    logdir: the profiler's log folder (the TensorBoard `train/` folder).

  Raises:
    ValueError: `steps` is not a window `1 <= start <= end`.
  """

  def __init__(self, steps: Sequence[int], logdir: str):
    start, end = (int(s) for s in steps)
    if not 1 <= start <= end:
      raise ValueError(f"profile steps {tuple(steps)}: need 1 <= START <= "
                       "END.")
    self.start, self.end = start, end
    self.logdir = logdir
    self.active = False
    self.done = False

  def boundaries(self, step: int) -> List[int]:
    """The window's edges after `step` (the last step trained): the
    controller must stop there."""
    return [b for b in (self.start - 1, self.end) if b > step]

  def before_steps(self, step: int):
    """Called with the last step trained, before the next chunk runs:
    starts the trace when the next step is in the window."""
    if self.active or self.done or not self.start - 1 <= step < self.end:
      return
    if step > self.start - 1:
      logging.warning("--profile_steps=%d,%d: resumed at step %d, so the "
                      "trace starts at step %d.", self.start, self.end, step,
                      step + 1)
    tf.io.gfile.makedirs(self.logdir)
    try:
      tf.profiler.experimental.start(self.logdir)
    except tf.errors.AlreadyExistsError as e:
      # Another profiler session runs in this process (e.g. Keras's
      # TensorBoard callback with profile_batch): one at a time.
      logging.warning("--profile_steps: the profiler is already running "
                      "(%s); no trace of steps %d-%d.", e, self.start,
                      self.end)
      self.done = True
      return
    self.active = True
    logging.info("Profiling steps %d-%d into %s", step + 1, self.end,
                 self.logdir)

  def after_steps(self, step: int):
    """Called with the last step trained: stops the trace after `end`."""
    if self.active and step >= self.end:
      self.stop()

  def stop(self):
    """Stops a running trace (also when training stops early) and logs
    where it went."""
    if not self.active:
      return
    tf.profiler.experimental.stop()
    self.active = False
    self.done = True
    files = trace_files(self.logdir)
    logging.info("Profiler trace of steps %d-%d: %s (TensorBoard's Profile "
                 "tab, tensorboard-plugin-profile)", self.start, self.end,
                 files[-1] if files else f"none found under {self.logdir}")

  @property
  def latest_trace(self) -> Optional[str]:
    files = trace_files(self.logdir)
    return files[-1] if files else None
