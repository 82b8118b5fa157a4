"""The action protocol: `Action`'s hooks and how their results join a record.
"""

import dataclasses
import inspect
from typing import Any, Dict, Mapping, Optional, Sequence

from tfdist.training.controller.records import Chunk, Progress


Produced = Optional[Dict[str, Any]]


def with_results(record, action, produced: Optional[Mapping[str, Any]]):
  """`record` (a `Progress`, `StepRequest` or `Chunk`) with what `action`
  returned: None (nothing) or a mapping of some of `record.RESULTS` to
  their new values.

  Raises:
    TypeError: a return value that is no mapping, or names a field that
      is not a result of this hook (e.g. `step`).
  """
  if produced is None:
    return record
  kind = type(record).__name__
  if not isinstance(produced, Mapping):
    raise TypeError(
        f"{type(action).__name__} returned {produced!r}; an action returns "
        f"None or a dict of what it produces for the {kind}: "
        f"{', '.join(record.RESULTS)}.")
  unknown = sorted(set(produced) - set(record.RESULTS))
  if unknown:
    raise TypeError(
        f"{type(action).__name__} returned {', '.join(unknown)}, which no "
        f"action produces for the {kind}; it may produce "
        f"{', '.join(record.RESULTS)}.")
  return dataclasses.replace(record, **produced)


class Action:
  """Side work of the outer loop; every hook is optional.

  Each hook receives an immutable record and returns what it produces:
  None, or a dict of the record's `RESULTS` fields with new values, which
  the controller puts into the record it gives the next action. So an
  action reads what the actions before it produced, and the order of the
  built-in ones (`Controller._make_actions`) is the order of that data.

  The controller calls, for each action in its order: `on_begin` once
  (after restoring), `boundaries` and `before_steps` before each chunk of
  steps, the action itself after each chunk, and `on_end` once when
  training ends normally (not on an error or a preemption).
  """

  def on_begin(self, progress: Progress) -> None:
    """Training starts at `progress.step`."""

  def boundaries(self, step: int) -> Sequence[int]:
    """Steps after `step` at which a chunk must end, beyond the
    controller's own (log, checkpoint, epoch, end)."""
    del step  # Unused.
    return ()

  def before_steps(self, progress: Progress) -> Produced:
    """The next chunk starts after `progress.step`; may return
    `StepRequest` fields (`{"stop_signal": True}`) to send with it."""

  def __call__(self, chunk: Chunk) -> Produced:
    """A chunk ended at `chunk.step`; may return `Chunk.RESULTS` fields
    (`{"saved": path}`)."""

  def on_end(self, progress: Progress) -> Produced:
    """Training ended at `progress.step`; may return `Progress.RESULTS`
    fields (`{"last_eval": None}`: evaluate again)."""

  def on_diverged(self, chunk: Chunk) -> Produced:
    """An action before this one raised a divergence error after `chunk`:
    end the epoch and the run as `fit` ends them (the run then raises that
    error); may return `Chunk.RESULTS` fields, as `__call__`."""


def check_hooks_take_one_record(action: Action) -> None:
  """Raises `TypeError` when a hook of `action` cannot be called with one
  record (e.g. `__call__(self, state, output)`, an older signature)."""
  for name in ("on_begin", "before_steps", "__call__", "on_end",
               "on_diverged"):
    hook = getattr(action, name)
    try:
      inspect.signature(hook).bind(None)
    except TypeError:
      raise TypeError(
          f"Controller(train_actions=...): {type(action).__name__}.{name}"
          f"{inspect.signature(hook)} does not take one argument; each hook "
          "of an Action takes one immutable record (`Progress` for on_begin, "
          "before_steps and on_end; `Chunk` for __call__ and on_diverged: "
          "chunk.output is the step output) and returns what it produces. "
          "Write e.g. `def __call__(self, chunk):`.") from None
    except ValueError:
      pass  # No signature to read (a builtin): called as it is.
