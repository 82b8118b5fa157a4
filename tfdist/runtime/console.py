"""A `tfdist.fit` script's console: lines that read like Keras's own.

In a plain script (no `absl.app.run`) `tfdist.fit` shows tfdist's log
lines for the call (`tfdist.api`); `keras_like_lines` makes them read like
Keras's output while it runs:

* plain text: the message alone for INFO, `WARNING: message` above it, no
  glog header (`I1206 19:48:44.075923 139643060059008 file.py:12] `, with
  its thread id); the `tfdist.train` binary keeps absl's format;
* no absl "WARNING: Logging before flag parsing goes to stderr." line;
* never inside Keras's progress bar: while a bar's line is open on stdout
  (Keras writes it without a newline until the epoch ends) a log line, or
  the SIGINT notice of `tfdist.runtime.preemption` (`end_open_line`), first
  ends that line;
* each of TensorFlow's warnings once: a message it repeats (its "Using
  MirroredStrategy eagerly has significant overhead" comes up to 5 times)
  shows once, and a record goes through TensorFlow's own handler alone,
  not also through a root handler set up after TensorFlow's import (which
  printed each of its warnings twice).

Everything is restored when the block ends.
"""

import contextlib
import logging as std_logging
import os
import sys
from typing import Optional


class _LineTracker:
  """A text stream that remembers whether its last write left a line open
  (`line_open`); everything else is the wrapped stream's."""

  def __init__(self, stream):
    self._stream = stream
    self.line_open = False

  def write(self, text):
    # Marked before the write: a signal handler runs between two bytecodes,
    # and one that ran after the bar's write but before the mark would see
    # the line closed and print its notice at the end of the bar (seen in a
    # Bazel run of tests/ctrl_c_test.py). Marked first, the worst case is a
    # newline before a bar that had not been written yet.
    if text:
      self.line_open = not text.endswith("\n")
    return self._stream.write(text)

  def __getattr__(self, name):
    return getattr(self._stream, name)


_tracker: Optional[_LineTracker] = None


def end_open_line(*, in_signal_handler: bool = False) -> None:
  """Ends the open line on stdout (a progress bar's), if any: a newline.

  Args:
    in_signal_handler: write the newline to file descriptor 1 directly (a
      handler may run in the middle of a write to `sys.stdout`, which a
      second write through the stream would break; Keras flushes each
      update of its bar, so nothing is left in the buffer).
  """
  tracker = _tracker
  if tracker is None or not tracker.line_open:
    return
  tracker.line_open = False
  try:
    if in_signal_handler:
      os.write(1, b"\n")
    else:
      tracker._stream.write("\n")  # pylint: disable=protected-access
      tracker._stream.flush()  # pylint: disable=protected-access
  except (OSError, ValueError):
    pass


class _PlainFormatter(std_logging.Formatter):
  """The message alone for INFO and below, `LEVEL: message` above."""

  def format(self, record):
    text = record.getMessage()
    if record.exc_info:
      text += "\n" + self.formatException(record.exc_info)
    if record.levelno > std_logging.INFO:
      text = f"{record.levelname}: {text}"
    return text


def _end_line_first(record) -> bool:
  """A filter: ends an open progress-bar line before `record` is shown."""
  del record  # Unused.
  end_open_line()
  return True


class _Once:
  """A filter: each (level, message) once."""

  def __init__(self):
    self._seen = set()

  def filter(self, record) -> bool:
    key = (record.levelno, record.getMessage())
    if key in self._seen:
      return False
    self._seen.add(key)
    return True


@contextlib.contextmanager
def keras_like_lines(handler: Optional[std_logging.Handler], *,
                     plain: bool):
  """While the block runs, tfdist's lines as the module docstring says.

  Args:
    handler: the handler that shows tfdist's lines (absl's), or None.
    plain: replace the handler's glog format with plain lines and silence
      absl's pre-parse notice (library use, where tfdist set the handler
      up); False keeps the format the caller's own logging set up.
  """
  global _tracker
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  previous_stdout, previous_tracker = sys.stdout, _tracker
  _tracker = _LineTracker(sys.stdout)
  sys.stdout = _tracker
  once = _Once()
  tensorflow_logger = std_logging.getLogger("tensorflow")
  tensorflow_logger.addFilter(once)
  # TensorFlow gives its logger a handler of its own when the root logger
  # has none at its import; a root handler added later (a first
  # `logging.warning` call sets one up) would print each record again.
  propagate = tensorflow_logger.propagate
  if tensorflow_logger.handlers:
    tensorflow_logger.propagate = False
  formatter = preinit = None
  if handler is not None:
    handler.addFilter(_end_line_first)
    if plain:
      # absl's handler formats through the handler it currently delegates
      # to (its `setFormatter` sets that one's).
      formatter = getattr(handler, "_current_handler", handler).formatter
      handler.setFormatter(_PlainFormatter())
      # absl prints "Logging before flag parsing goes to stderr." before
      # the first record of a process whose flags are unparsed: a notice
      # for absl apps, noise in a script.
      preinit = getattr(absl_logging, "_warn_preinit_stderr", None)
      absl_logging._warn_preinit_stderr = False  # pylint: disable=protected-access
  try:
    yield
  finally:
    end_open_line()
    if sys.stdout is _tracker:
      sys.stdout = previous_stdout
    _tracker = previous_tracker
    tensorflow_logger.removeFilter(once)
    tensorflow_logger.propagate = propagate
    if handler is not None:
      handler.removeFilter(_end_line_first)
      if plain:
        handler.setFormatter(formatter)
        if preinit is not None:
          absl_logging._warn_preinit_stderr = preinit  # pylint: disable=protected-access
