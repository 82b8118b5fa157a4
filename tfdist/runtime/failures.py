"""Foreseeable failures during a run, as one line with a status.

A run meets failures that are not bugs: the disk or quota of an output
folder fills up during a save, a folder's permissions change, a data file
vanishes mid-epoch. TensorFlow reports them as an `OpError` (or Python as
an `OSError`) from deep inside a save or a step. `named_failures` turns
them into `ConfigError`s (status 2, `tfdist.errors`) that name the
folder or file, what happened and the fix, with the last checkpoint to
resume from; anything else passes through unchanged.

Why status 2 (permanent) for a full disk: a cluster manager's restart of
the same command on the same volume fails the same way at its next save
(after paying for the start-up again), and only a person can free space or
give a larger volume; the checkpoints already written stay whole
(TensorFlow writes a checkpoint's index last), so the rerun resumes.
The failure table: docs/design/nothing-lost.md.
"""

import contextlib
import errno
import os
import re
from typing import Mapping, Optional, Sequence

import tensorflow as tf

from tfdist import errors

# Words of a full disk or quota in TensorFlow's and the OS's messages
# (ENOSPC, EDQUOT; EFBIG: a file-size limit).
_FULL = ("No space left on device", "Disk quota exceeded", "File too large",
         "quota")
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_DENIED_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)


def what_happened(error: BaseException) -> str:
  """The line of the error's message that says what happened.

  Its first line (`tfdist.errors.first_line`), without TensorFlow's
  `{{function_node ...}}` prefix; for an error raised inside a compiled
  function ("Graph execution error:" and the Python stack), the last line
  of the message proper.

  Args:
    error: any exception.

  Returns:
    One line; the error's class name when its message is empty.
  """
  text = getattr(error, "message", None) or str(error)
  text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", text.strip())
  lines = [line.strip() for line in text.splitlines()]
  if lines and lines[0].startswith("Graph execution error"):
    detail = [line for line in lines[1:] if line and not line.startswith(
        ("File ", "[[", "Detected at node", "Stack trace"))]
    if detail:
      return detail[-1]
  return errors.first_line(text, default=type(error).__name__)


def _folder_named(text: str, folders: Mapping[str, str]):
  """`(flag, folder)` of the deepest output folder `text` mentions, or
  the first one (`--model_dir`) when it names none."""
  best = None
  for flag, folder in folders.items():
    if folder and folder.rstrip("/") in text and (
        best is None or len(folder) > len(best[1])):
      best = (flag, folder)
  return best or next(iter(folders.items()))


def describe(error: BaseException, *, folders: Mapping[str, str],
             data_folders: Sequence[str] = (),
             last_checkpoint: Optional[str] = None,
             step: Optional[int] = None) -> Optional[errors.ConfigError]:
  """The one-line error for a foreseeable failure, or None for others.

  Args:
    error: what the run raised.
    folders: `{flag: folder}` of the run's outputs, `--model_dir` first.
    data_folders: the folders of the files the run reads (a missing file
      there is a data file that vanished).
    last_checkpoint: the newest checkpoint, to resume from.
    step: the step the run had reached, for the message.

  Returns:
    An `OutputWriteError` (a full disk or quota, a permission refused on
    an output folder) or a `DataNotFoundError` (a file the run reads
    vanished), else None.
  """
  text = what_happened(error)
  whole = str(error)
  number = getattr(error, "errno", None)
  at = f" at step {step}" if step is not None else ""
  resume = (f"; rerun the same command to resume from {last_checkpoint}"
            if last_checkpoint else "; nothing was checkpointed yet")
  full = (isinstance(error, (tf.errors.ResourceExhaustedError,
                             tf.errors.OutOfRangeError,
                             tf.errors.UnknownError,
                             tf.errors.FailedPreconditionError,
                             tf.errors.InternalError)) and
          any(w in whole for w in _FULL)) or number in _FULL_ERRNOS
  denied = isinstance(error, tf.errors.PermissionDeniedError) or (
      number in _DENIED_ERRNOS)
  if full or denied:
    flag, folder = _folder_named(whole, folders)
    what = ("the disk or quota is full" if full else
            "this process may no longer write there")
    fix = ("free space there or give a larger volume" if full else
           "restore write access")
    return errors.OutputWriteError(
        f"{flag}={folder}: a write failed{at}: {what} "
        f"({type(error).__name__}: {text}). The run stopped; {fix}"
        f"{resume}.")
  if isinstance(error, tf.errors.NotFoundError) or number == errno.ENOENT:
    if not any(d and d.rstrip("/") in whole for d in data_folders):
      return None
    return errors.DataNotFoundError(
        f"A file the run reads vanished during training{at} "
        f"({type(error).__name__}: {text}): --train_files and --eval_files "
        "must stay in place while a run reads them. Restore it (or list "
        f"only files that stay){resume}.")
  return None


@contextlib.contextmanager
def named_failures(folders: Mapping[str, str], *,
                   data_folders: Sequence[str] = (),
                   checkpoint_dir: str = ""):
  """Re-raises a foreseeable failure inside the block as `describe` names
  it (the original chained as its cause), with the newest checkpoint of
  `checkpoint_dir` to resume from; everything else unchanged."""
  try:
    yield
  except (tf.errors.OpError, OSError) as e:
    latest = None
    if checkpoint_dir:
      try:
        latest = tf.train.latest_checkpoint(checkpoint_dir)
      except (tf.errors.OpError, OSError):
        pass
    named = describe(e, folders=folders, data_folders=data_folders,
                     last_checkpoint=latest)
    if named is None:
      raise
    raise named from e


def data_folders(*patterns: str) -> Sequence[str]:
  """The folders of comma-separated file globs (`--train_files`, ...)."""
  return tuple(sorted({os.path.dirname(p.strip()) for value in patterns
                       for p in (value or "").split(",") if p.strip()}))
