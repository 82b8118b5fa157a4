"""Where a run's training input stands: the layout a checkpoint records.

A checkpoint records the training input's layout (`input_layout`: files,
record counts, workers, global batch, seed, shuffle buffer, cache; a few
hundred bytes of JSON), not any iterator state. With the step it fixes where
every worker's input stands, which each worker recomputes for its own shard
(`tfdist.data.input_pipeline.PipelineOptions.start_step`), so nothing per worker
has to be stored, and the chief alone writing `--model_dir` is enough.
`InputPosition` is the checkpointed object (`--checkpoint_input_position`);
a run whose layout differs (`layout_change`) discards the position with a
message naming the change and starts the epoch over (`epoch_start`).
"""

import json
import os
from typing import Optional, Sequence

from absl import logging
import tensorflow as tf


def epoch_start(step: int, steps_per_epoch: int) -> int:
  """The first step of the epoch `step` falls in (steps count from 0).

  Args:
    step: a global step (updates done).
    steps_per_epoch: updates per epoch, > 0.

  Returns:
    `step` rounded down to a multiple of `steps_per_epoch`.
  """
  return step - step % steps_per_epoch


def input_layout(*, files: Sequence[str], file_record_counts: Sequence[int],
                 num_input_pipelines: int, global_batch_size: int,
                 seed: Optional[int], shuffle_buffer_size: int,
                 cache: bool) -> dict:
  """What makes a step mean the same position in every host's input.

  Two runs with equal layouts read the same examples in the same order at
  the same step (module docstring); a checkpoint records its run's layout
  (`InputPosition`).

  Args:
    files: the training files (only their base names are kept, so the same
      files moved to another folder or bucket keep the position).
    file_record_counts: records per file.
    num_input_pipelines: hosts reading the training data (workers).
    global_batch_size: examples per update (the effective global batch).
    seed: `--seed` (None: the order cannot be rebuilt).
    shuffle_buffer_size, cache: the pipeline's settings that change the
      order.

  Returns:
    A JSON-serializable dict.
  """
  return {"version": 1,
          "files": [os.path.basename(f) for f in files],
          "file_record_counts": [int(c) for c in file_record_counts],
          "num_input_pipelines": int(num_input_pipelines),
          "global_batch_size": int(global_batch_size),
          "seed": None if seed is None else int(seed),
          "shuffle_buffer_size": int(shuffle_buffer_size),
          "cache": bool(cache)}


def layout_change(saved: Optional[dict], current: dict) -> Optional[str]:
  """Why a checkpoint's input position does not apply to this run.

  Args:
    saved: the layout the checkpoint recorded (None: it recorded none).
    current: this run's `input_layout`.

  Returns:
    None when the position applies, else a sentence naming what changed.
  """
  if saved is None:
    return "the checkpoint recorded no input position"
  if current["seed"] is None:
    return "--seed is unset, so the input order cannot be rebuilt"
  names = {"num_input_pipelines": "worker count (input pipelines)",
           "files": "training files", "file_record_counts":
           "record counts of the training files",
           "global_batch_size": "global batch size", "seed": "--seed",
           "shuffle_buffer_size": "--shuffle_buffer_size",
           "cache": "--cache_dataset", "version": "layout version"}
  for key, name in names.items():
    if saved.get(key) != current.get(key):
      if key in ("files", "file_record_counts"):
        return (f"the {name} changed ({len(saved.get(key) or [])} -> "
                f"{len(current[key])} files, or other names or counts)")
      return f"the {name} changed from {saved.get(key)} to {current[key]}"
  return None


# Where `InputPosition` lives in a checkpoint.
INPUT_POSITION_KEY = "input_position/.ATTRIBUTES/py_state"


class InputPosition(tf.train.experimental.PythonState):
  """The training input's layout, saved in every checkpoint.

  Args:
    layout: this run's `input_layout` (a dict).
    steps_per_epoch: this run's updates per epoch.

  After a restore, `saved` holds the checkpoint's layout (None: it had
  none) and `resume_step(step)` says where the input resumes.
  """

  def __init__(self, layout: dict, *, steps_per_epoch: int):
    self.layout = dict(layout)
    self.steps_per_epoch = int(steps_per_epoch)
    self.saved: Optional[dict] = None

  def serialize(self) -> str:
    return json.dumps(self.layout, sort_keys=True)

  def deserialize(self, string_value):
    value = string_value.numpy() if hasattr(string_value, "numpy") else (
        string_value)
    if isinstance(value, bytes):
      value = value.decode("utf-8")
    self.saved = json.loads(value)

  def resume_step(self, step: int) -> int:
    """The step whose input position a run restored at `step` starts from.

    `step` itself when the checkpoint's layout equals this run's (the epoch
    continues where it stopped); otherwise the first step of the epoch
    `step` falls in (the epoch starts over), with a warning naming what
    changed. 0 for a fresh run.
    """
    if step <= 0:
      return 0
    change = layout_change(self.saved, self.layout)
    if change is None:
      # Epochs counted from 1, as in the progress lines and Keras's logs.
      logging.info("tfdist: input position restored: step %d continues "
                   "epoch %d where the checkpoint stopped.", step,
                   step // self.steps_per_epoch + 1)
      return step
    start = epoch_start(step, self.steps_per_epoch)
    logging.warning(
        "tfdist: input position discarded: %s. The input starts epoch %d "
        "over (examples the first %d steps of that epoch used may be used "
        "again).", change, step // self.steps_per_epoch + 1, step - start)
    return start
