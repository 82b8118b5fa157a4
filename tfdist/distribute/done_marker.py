"""The marker a chief writes in `--model_dir` when training finished.

`<model_dir>/training_done` holds `{"finished": <seconds since the epoch>}`.
Parameter-server `worker` and `ps` tasks
(`tfdist.distribute.parameter_server.serve`) and the continuous evaluator serve
a run until it appears; the chief clears it at start, so a rerun in the same
`--model_dir` is not taken for done.
"""

import json
import os
import time

import tensorflow as tf

DONE_MARKER = "training_done"


def done_marker(model_dir: str) -> str:
  """The marker's path in `model_dir` (local or a bucket)."""
  return os.path.join(model_dir, DONE_MARKER)


def mark_done(model_dir: str):
  """Marks the run in `model_dir` finished now (creates `model_dir`)."""
  tf.io.gfile.makedirs(model_dir)
  with tf.io.gfile.GFile(done_marker(model_dir), "w") as f:
    f.write(json.dumps({"finished": time.time()}))


def clear_done(model_dir: str):
  """Removes the marker, if there is one."""
  if tf.io.gfile.exists(done_marker(model_dir)):
    tf.io.gfile.remove(done_marker(model_dir))


def marked_done_since(model_dir: str, since: float) -> bool:
  """True if the chief marked the run done at or after `since` (seconds
  since the epoch); False when there is no readable marker."""
  try:
    with tf.io.gfile.GFile(done_marker(model_dir)) as f:
      return float(json.load(f)["finished"]) >= since
  except (tf.errors.OpError, ValueError, KeyError, OSError):
    return False
