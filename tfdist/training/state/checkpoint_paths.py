"""The names of tfdist's checkpoint files, read without TensorFlow.

`tf.train.CheckpointManager` numbers each checkpoint with the global step it
was saved at: the prefix `<folder>/ckpt-<step>` names its index
(`ckpt-<step>.index`) and data files (`ckpt-<step>.data-*`). A sharded save
that was interrupted leaves the folder `ckpt-<step>_temp/` of parts not yet
merged.
"""

import re

# `ckpt-12_temp`: the parts of a sharded save not yet merged into ckpt-12.
_TEMP_RE = re.compile(r"-\d+_temp$")


def checkpoint_step(path: str, default: int = -1) -> int:
  """The step a checkpoint prefix is numbered with.

  Args:
    path: a checkpoint prefix (`.../ckpt-48`, local or `gs://`).
    default: returned when `path` ends in no `-<number>`.

  Returns:
    The step (`.../ckpt-48` -> 48), else `default`.
  """
  try:
    return int(path.rsplit("-", 1)[1])
  except (IndexError, ValueError):
    return default


def is_interrupted_save(name: str) -> bool:
  """True for the name of a folder an interrupted save left (`ckpt-12_temp`)."""
  return bool(_TEMP_RE.search(name.rstrip("/")))
