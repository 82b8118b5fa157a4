"""Throughput measurement: examples/sec and step time between log points.

As Model Garden's `TimeHistory`, the first interval (which includes tracing,
compilation and the input pipeline's warm-up) is excluded from the averages.
"""

import dataclasses
import time
from typing import List, Optional


@dataclasses.dataclass
class Interval:
  """One measured interval between two log points.

  Attributes:
    start_step, end_step: global steps bounding the interval.
    seconds: wall time (seconds).
    examples_per_second: `(end_step - start_step) * global_batch / seconds`.
    step_time: seconds per step.
    excluded: True for the first interval (warm-up), left out of averages.
  """
  start_step: int
  end_step: int
  seconds: float
  examples_per_second: float
  step_time: float
  excluded: bool = False


class ThroughputMeter:
  """Records log points and derives examples/sec and step time.

  Args:
    global_batch_size: examples per step.
    clock: a zero-argument function returning seconds (default
      `time.perf_counter`).
  """

  def __init__(self, global_batch_size: int, clock=time.perf_counter):
    self.global_batch_size = global_batch_size
    self._clock = clock
    self._last: Optional[tuple] = None
    self._first_done = False
    self.intervals: List[Interval] = []

  def start(self, step: int):
    """Marks the beginning of measurement at `step`."""
    self._last = (step, self._clock())
    self._first_done = False

  def record(self, step: int) -> Optional[Interval]:
    """Closes the interval ending at `step` and returns it (None if empty)."""
    now = self._clock()
    if self._last is None:
      self._last = (step, now)
      return None
    start_step, start_time = self._last
    self._last = (step, now)
    if step <= start_step:
      return None
    seconds = max(now - start_time, 1e-9)
    interval = Interval(start_step, step, seconds,
                        (step - start_step) * self.global_batch_size / seconds,
                        seconds / (step - start_step),
                        excluded=not self._first_done)
    self._first_done = True
    if not interval.excluded:
      self.intervals.append(interval)
    return interval

  def summary(self) -> dict:
    """Averages over the recorded intervals (first one excluded).

    Returns:
      `{"examples_per_second", "step_time_seconds", "measured_steps",
      "intervals"}`; the averages are None when nothing was measured.
    """
    steps = sum(i.end_step - i.start_step for i in self.intervals)
    seconds = sum(i.seconds for i in self.intervals)
    return {
        "examples_per_second": (steps * self.global_batch_size / seconds
                                if seconds else None),
        "step_time_seconds": seconds / steps if steps else None,
        "measured_steps": steps,
        "intervals": [dataclasses.asdict(i) for i in self.intervals],
    }
