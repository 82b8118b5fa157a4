"""Numbers and names in messages: ordinals, plurals, a flag or a field.

Leaf helpers (no first-party imports) for the text of log lines and errors:
`ordinal(2)` is "2nd", not "2-th"; `count(1, "element")` is "1 element";
`multiples_near(63, 2)` is "62 or 64"; `in_field_terms` rewrites an error
written in `tfdist.train`'s terms (`--batch_size=63`) into those of a
`tfdist.fit` caller, who typed the `TrainConfig` field (`batch_size=63`).
"""

import contextlib
import functools
import logging
import re
from typing import Callable, Collection, Optional, Tuple, Type


def ordinal(n: int) -> str:
  """`n` as an English ordinal: 1st, 2nd, 3rd, 4th, 11th, 12th, 13th, 21st.

  Args:
    n: an integer (>= 0).

  Returns:
    The digits of `n` and its suffix (the teens take "th").
  """
  n = int(n)
  if 10 <= n % 100 <= 20:
    suffix = "th"
  else:
    suffix = {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
  return f"{n}{suffix}"


def count(n: int, noun: str, plural: Optional[str] = None) -> str:
  """`n` and `noun`, plural unless `n` is 1: "1 element", "0 elements".

  Args:
    n: the number (an int).
    noun: the singular.
    plural: the plural; None: `noun` + "s".

  Returns:
    "<n> <noun or plural>".
  """
  return f"{n} {noun if n == 1 else (plural or noun + 's')}"


def either(values) -> str:
  """The values as a choice in words: "2", "2 or 4", "2, 3 or 6".

  Args:
    values: a non-empty sequence (each said with `str`).
  """
  words = [str(v) for v in values]
  if len(words) <= 1:
    return "".join(words)
  return f"{', '.join(words[:-1])} or {words[-1]}"


def multiples_near(value: int, multiple: int) -> str:
  """The multiples of `multiple` nearest `value`, below and above it.

  Args:
    value: an int >= 1, not a multiple of `multiple`.
    multiple: an int >= 1.

  Returns:
    "62 or 64" for (63, 2); only `multiple` when `value` is below it
    (nothing smaller is a positive multiple): "8" for (5, 8).
  """
  below = value // multiple * multiple
  above = below + multiple
  if below < multiple:
    return str(above)
  return f"{below} or {above}"


_FLAG = re.compile(r"(?<![\w/-])--([a-z][a-z0-9_]*)(=?)")


def in_field_terms(message: str, fields: Collection[str]) -> str:
  """`message` with each flag that is a field of `fields` said as the field.

  A `tfdist.fit` caller sets `TrainConfig(batch_size=63)`, never
  `--batch_size=63`: messages written in the binary's terms are rewritten
  for it. `--name=value` becomes `name=value` and `--name` alone becomes
  `name`, for each `name` in `fields`; other flags (absl's, a launcher's)
  and text inside paths or URLs stay as they are.

  Args:
    message: an error message in flag terms.
    fields: the names to rewrite (`tfdist.config.flat_fields()`).

  Returns:
    The rewritten message.
  """
  return _FLAG.sub(
      lambda m: m.group(1) + m.group(2) if m.group(1) in fields
      else m.group(0), message)


class _FieldTermsFilter(logging.Filter):
  """Rewrites each record's message by `in_field_terms` (a filter of the
  `absl` logger, the one tfdist's lines go through)."""

  def __init__(self, fields: Callable[[], Collection[str]]):
    super().__init__()
    self._fields = fields
    self._names = None

  def filter(self, record: logging.LogRecord) -> bool:
    if self._names is None:
      self._names = frozenset(self._fields())
    message = record.getMessage()
    rewritten = in_field_terms(message, self._names)
    if rewritten != message:
      record.msg, record.args = rewritten, ()
    return True


@contextlib.contextmanager
def log_lines_in_field_terms(fields: Callable[[], Collection[str]]):
  """Within the block, the lines logged through absl (`absl.logging`) say
  each flag of `fields` as its field (`in_field_terms`): a `tfdist.fit`
  caller reads `tensor_parallel=2`, the name it typed, not the binary's
  `--tensor_parallel=2`. The filter is removed on exit, error or not.

  Args:
    fields: returns the field names (called at the first line).
  """
  logger = logging.getLogger("absl")
  field_terms = _FieldTermsFilter(fields)
  logger.addFilter(field_terms)
  try:
    yield
  finally:
    logger.removeFilter(field_terms)


def errors_in_field_terms(fields: Callable[[], Collection[str]],
                          kinds: Tuple[Type[BaseException], ...]):
  """Decorates a library entry point (`tfdist.fit`): an error of `kinds`
  leaving it has its message (`args[0]`) rewritten by `in_field_terms`,
  and so are the lines it logs (`log_lines_in_field_terms`).

  The error is the same object (its class, exit status and traceback
  kept), re-raised.

  Args:
    fields: returns the field names (called on the first error only).
    kinds: the exception classes whose messages are rewritten.

  Returns:
    The decorator.
  """
  def decorate(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
      try:
        with log_lines_in_field_terms(fields):
          return fn(*args, **kwargs)
      except kinds as e:
        if e.args and isinstance(e.args[0], str):
          e.args = (in_field_terms(e.args[0], fields()),) + e.args[1:]
        raise
    return wrapper
  return decorate
