"""How a `tfdist.fit` script ends when a signal stops its training.

`python -m tfdist.train` turns SIGINT (Ctrl-C) or SIGTERM into a checkpoint,
one line and the exit status 128 + signal: 130 for SIGINT, 143 for SIGTERM,
the retryable statuses of `tfdist.errors` that cluster managers (and
`tfdist.launch`) act on. A script that calls `tfdist.fit` ends the same way:

* `tfdist.fit` raises `tfdist.errors.PreemptedError` once every worker has
  saved, whose message says how to resume in the script's terms (run it
  again with the same `model_dir` in its `TrainConfig`). A script may
  catch it (`except tfdist.errors.PreemptedError`) and go on: nothing else
  happens then.
* Before raising it, `fit` installs `StopHook` as `sys.excepthook`. If the
  error reaches the top of the script uncaught, the hook prints that
  message as one line on stderr (`<script>: Stopped by SIGINT at step 40;
  checkpoint ...`), no traceback, and ends the process with the error's
  `exit_code` at once, without Python's teardown (as the binary does:
  tearing down a half-read distributed iterator can hang for minutes;
  `atexit` functions do not run). Every other exception goes to the hook
  that was there before, unchanged.

In an interactive session (`python -i`, a notebook) or off the main thread
no hook is installed: the error stays an ordinary exception there.

Standard library only, plus `tfdist.errors`.
"""

import logging as std_logging
import os
import sys
import threading
from typing import Callable

from tfdist import errors

# The stops that end a script with their own status (128 + signal).
STOP_ERRORS = (errors.PreemptedError, errors.StoppedAtStartError)


def _interactive() -> bool:
  return bool(sys.flags.interactive) or hasattr(sys, "ps1")


def program_name() -> str:
  """The running script's file name (`train.py`), for message prefixes."""
  return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else (
      "python")


def exit_now(status: int) -> None:
  """Flushes Python's logging and the standard streams, then ends the
  process with `status` without Python's teardown (`os._exit`)."""
  std_logging.shutdown()  # Flushes and closes every logging handler (absl's).
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  os._exit(status)  # pylint: disable=protected-access


class StopHook:
  """A `sys.excepthook`: one line and 128 + signal for an uncaught stop.

  Args:
    previous: the hook that handles every other exception.
    exit_fn: ends the process with a status (`exit_now`; tests pass their
      own).
  """

  def __init__(self, previous: Callable,
               exit_fn: Callable[[int], None] = exit_now):
    self.previous = previous
    self.exit_fn = exit_fn

  def __call__(self, kind, value, traceback):
    if not isinstance(value, STOP_ERRORS):
      return self.previous(kind, value, traceback)
    print(f"{program_name()}: {errors.first_line(value)}", file=sys.stderr,
          flush=True)
    return self.exit_fn(value.exit_code)


def install_stop_hook() -> bool:
  """Installs `StopHook` as `sys.excepthook` (once; it chains to the hook
  found). Returns whether it is installed: not in an interactive session
  or off the main thread."""
  if (threading.current_thread() is not threading.main_thread()
      or _interactive()):
    return False
  if not isinstance(sys.excepthook, StopHook):
    sys.excepthook = StopHook(sys.excepthook)
  return True
