"""Which output lines of a local cluster's tasks `tfdist.launch` shows.

Every task of a synchronous run prints the same plan, progress and
evaluation lines, and TensorFlow adds its own C++ log (the cluster's
coordination service, gRPC servers, graph optimizers) and import notices.
With `--output=chief` (the launcher's default) a user reads:

* the chief's lines as it wrote them (no prefix), less TensorFlow's
  chatter (`is_chatter`) unless `--verbose`;
* the evaluator's lines likewise, prefixed with its task
  (`[evaluator:0] `): its evaluations are its own;
* of every other task only what concerns it (`concerns_task`: warnings,
  errors, tracebacks), prefixed with the task (`[worker:0] `);
* for a task that fails, its last `FAILURE_TAIL_LINES` lines, chatter
  included (`TaskTail`).

`--output=all` shows every line of every task, each prefixed with its
task; `--task_log_dir` keeps each task's whole output in a file.

Standard library only: the launcher imports no TensorFlow.
"""

import collections
import re
from typing import Deque, List, Tuple

from tfdist.runtime import quiet_tensorflow

OUTPUT_CHIEF = "chief"
OUTPUT_ALL = "all"
OUTPUT_MODES = (OUTPUT_CHIEF, OUTPUT_ALL)
# The lines of a failed task the launcher shows.
FAILURE_TAIL_LINES = 20

# absl's log line format, shared by TensorFlow's C++ log and Python's absl
# logging: severity, MMDD, time (C++ before absl's log is initialized:
# 00:00:<seconds since the epoch>), thread id, file:line].
_LOG_LINE = re.compile(
    r"^(?P<severity>[IWEF])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ "
    r"(?P<file>[\w.+-]+):\d+\] ")
_NATIVE_SOURCE = re.compile(r"\.(cc|cpp|c|h)$")
# Lines of TensorFlow's own that are no log record: absl's notice before
# Python logging is set up, and the continuation lines of C++ records
# (the coordination service's list of stragglers).
_OTHER_CHATTER = re.compile(
    r"^WARNING: Logging before flag parsing goes to stderr\.|"
    r"^/job:\w+/replica:\d+/task:\d+\s*$")
_PATH = re.compile(r"(?<![\w.])(/[^\s;:,'\"()]+)+")
_NUMBER = re.compile(r"\d+(\.\d+)?")
# A Python warning (`warnings.warn`), a traceback and its last line.
_PROBLEM = re.compile(
    r":\d+: \w*Warning: |"
    r"^Traceback \(most recent call last\):|"
    r"^[\w.]*(Error|Exception|Exit|Interrupt)\b(: |$)")


def message_key(line: str) -> str:
  """What two tasks' lines share when they say the same thing: the text
  after the log header, with paths and numbers left out (a worker's
  "Stopped at step 17, 0.4 s after the signal; checkpoint <its folder>"
  says what the chief's line says).

  Args:
    line: one line of a task's output, without its end of line.
  """
  match = _LOG_LINE.match(line)
  text = line[match.end():] if match else line
  return _NUMBER.sub("#", _PATH.sub("<path>", text))


def is_chatter(line: str) -> bool:
  """True for TensorFlow's own lines that are not for a tfdist user: its
  C++ INFO and WARNING log records and the import-time notices.

  Args:
    line: one line of a task's output, without its end of line.
  """
  match = _LOG_LINE.match(line)
  if match:
    return (match.group("severity") in "IW" and
            bool(_NATIVE_SOURCE.search(match.group("file"))))
  return bool(quiet_tensorflow.IMPORT_NOTICES.search(line) or
              _OTHER_CHATTER.search(line))


def concerns_task(line: str) -> bool:
  """True for a line another task than the chief printed that its user
  should see: a warning, an error or a traceback (of Python's logging,
  TensorFlow's C++ log, `warnings` or the interpreter).

  Args:
    line: one line of the task's output, without its end of line.
  """
  match = _LOG_LINE.match(line)
  if match:
    return match.group("severity") in "WEF" and not is_chatter(line)
  return bool(_PROBLEM.search(line))


class TaskTail:
  """The last lines of one task, each with whether it was shown.

  Args:
    size: lines kept.
  """

  def __init__(self, size: int = FAILURE_TAIL_LINES):
    self._lines: Deque[Tuple[bytes, bool]] = collections.deque(maxlen=size)

  def add(self, line: bytes, shown: bool):
    self._lines.append((line, shown))

  def lines(self) -> List[bytes]:
    return [line for line, _ in self._lines]

  def any_hidden(self) -> bool:
    """Whether the user has not seen some of the kept lines."""
    return any(not shown for _, shown in self._lines)
