"""The user's Keras callbacks on every task: refused at start, or kept with
their files on the chief.

tfdist's controller calls a user's `keras.callbacks` on every training
process at the same points (`tfdist.training.controller`), as Keras's
multi-worker `fit` does. Two kinds need more:

* **Callbacks that write files** (`ModelCheckpoint`, `TensorBoard`,
  `CSVLogger`): on the chief they write where the user said; on every other
  worker they write into the worker's scratch folder, which tfdist deletes
  at the end (as tfdist's own checkpoints and summaries do, and as Keras's
  multi-worker guide has non-chief workers write to temporary folders).
  Two workers never write the same path. `RemoteMonitor` (which posts to a
  server) runs on the chief only.
* **Callbacks that fight tfdist's own state**, refused at start:
  `BackupAndRestore` (tfdist's checkpoints already back up the whole
  training state and a rerun resumes from them; a second restore would put
  an older state over tfdist's), `SwapEMAWeights` (tfdist's optimizers keep
  no moving average of the weights).
"""

import copy
import os
from typing import List, Optional, Sequence

import keras

from tfdist.config import ConfigError

# Callback class -> the attribute holding the path it writes.
_PATH_ATTRIBUTES = (
    (keras.callbacks.ModelCheckpoint, "filepath"),
    (keras.callbacks.TensorBoard, "log_dir"),
    (keras.callbacks.CSVLogger, "filename"),
)
# Callbacks only the chief runs.
_CHIEF_ONLY = (keras.callbacks.RemoteMonitor,)
# Refused: class -> (why, what to do instead).
_REFUSED = {
    keras.callbacks.BackupAndRestore: (
        "tfdist's own checkpoints back up the whole training state (model, "
        "optimizer, step, input position) and a rerun with the same "
        "--model_dir resumes from them; a BackupAndRestore would restore "
        "its own, older backup over that state",
        "drop it: rerun with the same --model_dir to resume (SIGTERM saves "
        "a checkpoint first; --checkpoint_steps sets how often)"),
    keras.callbacks.SwapEMAWeights: (
        "tfdist builds its optimizer from --optimizer without "
        "use_ema=True, so there are no moving-average weights to swap in",
        "drop it"),
}


def check_callbacks(callbacks: Sequence[keras.callbacks.Callback]) -> None:
  """Refuses callbacks tfdist cannot honour, before anything is built.

  Raises:
    ConfigError: one of `_REFUSED`, naming the reason and the alternative.
  """
  for callback in callbacks:
    for cls, (why, instead) in _REFUSED.items():
      if isinstance(callback, cls):
        raise ConfigError(
            f"callbacks: keras.callbacks.{cls.__name__} is not supported: "
            f"{why}. Instead, {instead}.")


def for_this_task(callbacks: Sequence[keras.callbacks.Callback], *,
                  scratch_dir: Optional[str]) -> List[keras.callbacks.Callback]:
  """The callbacks this task runs.

  Args:
    callbacks: the user's callbacks.
    scratch_dir: None on the chief (every callback as given); on another
      worker, a folder of its own that tfdist deletes at the end.

  Returns:
    On the chief, `callbacks`; elsewhere copies of the file-writing ones
    writing under `scratch_dir/callbacks/<index>-<class>/` (the last path
    component kept), without the chief-only ones, and the others as given.
  """
  if scratch_dir is None:
    return list(callbacks)
  out = []
  for i, callback in enumerate(callbacks):
    if isinstance(callback, _CHIEF_ONLY):
      continue
    for cls, attribute in _PATH_ATTRIBUTES:
      if isinstance(callback, cls):
        path = str(getattr(callback, attribute)).rstrip("/")
        folder = os.path.join(scratch_dir, "callbacks",
                              f"{i}-{type(callback).__name__}")
        os.makedirs(folder, exist_ok=True)  # CSVLogger makes none.
        callback = copy.copy(callback)
        setattr(callback, attribute,
                os.path.join(folder, os.path.basename(path) or "out"))
        break
    out.append(callback)
  return out
