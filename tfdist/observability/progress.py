"""Progress as a Keras user reads it: epochs counted from 1, an ETA, a bar.

* `epoch_of(step, steps_per_epoch)`: the epoch a step is in, counted from 1
  as Keras's callbacks print it (`EarlyStopping`'s "best epoch: 3",
  `ProgbarLogger`'s "Epoch 3/5" are `epoch + 1` of their 0-based `epoch`),
  so tfdist's lines and Keras's name the same epoch alike.
* `format_duration(seconds)`: `45s`, `1m12s`, `2h03m` (an ETA).
* `resolve_verbose(verbose, stdout)`: `tfdist.fit`'s `verbose="auto"` made
  1 (a progress bar) in a terminal or a notebook, 2 (one log line per log
  point) otherwise, as a Keras user expects to see in each.
* `PROGRESS`: the `extra` of the log records that a progress bar shows
  already (step lines, in-loop evaluations); `is_progress_line` finds
  them, so `verbose=1` can leave them out of the terminal.
"""

import logging as std_logging
import math
import sys
from typing import Optional, TextIO, Union

# Passed as `extra=` to absl's `logging.info` for the lines a progress bar
# repeats (`RunLog`'s step and in-loop evaluation lines).
PROGRESS_ATTRIBUTE = "tfdist_progress"
PROGRESS = {PROGRESS_ATTRIBUTE: True}


def epoch_of(step: int, steps_per_epoch: int) -> int:
  """The epoch (counted from 1) that step `step` (counted from 1: the
  last step trained) belongs to; its last step ends it.

  Raises:
    ValueError: `steps_per_epoch` below 1.
  """
  if steps_per_epoch < 1:
    raise ValueError(f"steps_per_epoch must be >= 1; received "
                     f"{steps_per_epoch}.")
  return max(int(step) - 1, 0) // int(steps_per_epoch) + 1


def num_epochs(total_steps: int, steps_per_epoch: int) -> int:
  """Epochs in a run of `total_steps` (a last, partial epoch counts)."""
  return int(math.ceil(int(total_steps) / int(steps_per_epoch)))


def format_duration(seconds: float) -> str:
  """`seconds` as an ETA: `45s`, `1m12s`, `2h03m` (rounded to a second;
  over an hour to a minute)."""
  seconds = max(int(round(seconds)), 0)
  if seconds < 60:
    return f"{seconds}s"
  if seconds < 3600:
    return f"{seconds // 60}m{seconds % 60:02d}s"
  minutes = (seconds + 30) // 60
  return f"{minutes // 60}h{minutes % 60:02d}m"


def eta_seconds(*, step: int, total_steps: int,
                seconds_per_step: Optional[float]) -> Optional[float]:
  """Seconds left for the steps after `step` at `seconds_per_step` (host
  wall time per step, evaluations and checkpoints included); None when
  unknown or nothing is left."""
  left = int(total_steps) - int(step)
  if left <= 0 or not seconds_per_step or not math.isfinite(
      seconds_per_step):
    return None
  return left * seconds_per_step


def in_notebook() -> bool:
  """An IPython kernel (Jupyter, Colab) runs this process."""
  return "ipykernel" in sys.modules


def resolve_verbose(verbose: Union[str, int, bool],
                    stdout: Optional[TextIO] = None) -> int:
  """`tfdist.fit`'s `verbose` as 0, 1 or 2.

  "auto" is 1 (a progress bar) when `stdout` (default `sys.stdout`) is a
  terminal or the process is a notebook's kernel, else 2 (log lines: a
  file, a pipe, a cluster's log collector, where a bar's redraws are
  noise). True is 1, False 0.

  Raises:
    ValueError: another value (floats and None too).
  """
  if isinstance(verbose, bool):
    return int(verbose)
  if isinstance(verbose, float) or verbose not in ("auto", 0, 1, 2):
    raise ValueError(f"verbose={verbose!r}: use \"auto\", 0, 1 or 2.")
  if verbose != "auto":
    return int(verbose)
  stream = sys.stdout if stdout is None else stdout
  try:
    terminal = bool(stream.isatty())
  except (AttributeError, ValueError):  # No isatty, or a closed stream.
    terminal = False
  return 1 if terminal or in_notebook() else 2


def is_progress_line(record: std_logging.LogRecord) -> bool:
  """`record` is a line a progress bar shows already (`PROGRESS`)."""
  return bool(getattr(record, PROGRESS_ATTRIBUTE, False))
