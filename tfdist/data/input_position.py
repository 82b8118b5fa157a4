"""Where a run's training input stands: the layout a checkpoint records.

A checkpoint records the training input's layout (`input_layout`: files,
record counts, workers, global batch, seed, shuffle buffer, cache; a few
hundred bytes of JSON), not any iterator state. With the step it fixes where
every worker's input stands, which each worker recomputes for its own shard
(`tfdist.data.input_pipeline.PipelineOptions.start_step`), so nothing per worker
has to be stored, and the chief alone writing `--model_dir` is enough.
`InputPosition` is the checkpointed object (`--checkpoint_input_position`);
a run whose layout differs (`layout_change`) discards the position with a
message naming the change and starts the epoch over (`epoch_start`), but
for a change of the worker count alone: the run then replays the
checkpoint's workers' input order (`InputPosition.replay_pipelines`,
`tfdist.data.input_pipeline.PipelineOptions.replay_pipelines`), each worker
rebuilding every old worker's stream and keeping its slice of each global
batch, so every step averages over the examples it would have had.

Which inputs keep a position (`source_files`): TFRecord files; `tfdist.fit`'s
arrays, `PyDataset`s and generators (named as one file of their rows); and
dataset functions. Their position is a seeded replay: the resumed run
rebuilds the interrupted epoch (the function's examples once, in its order,
then tfdist's shuffle seeded by `--seed` and the epoch) and skips the
examples the steps before used. A function that does not take
`input_context` is sharded by tfdist and its epochs are whole steps; one
that takes it shards itself, and each worker's stream is passes over its
own share, pass p shuffled with the seed of p: the resumed worker skips the
`step x global batch / workers` examples it used. That replays exactly when
the function returns the same examples in the same order in every run for
the same `input_context` (any shuffle of its own seeded). TensorFlow's
iterator checkpoints (`tf.train.Checkpoint(iterator=...)`) are not used:
each worker's iterator state would need its own storage (only the chief
writes `--model_dir`), and the state does not carry over a change of worker
count.
"""

import json
import os
from typing import Callable, List, Optional, Sequence, Tuple

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


# An attribute of a training dataset function (`DatasetSpec.input_fn`) made
# by `tfdist.fit` from in-memory input: its examples are held as arrays and
# sharded by tfdist (`tfdist.data.input_pipeline.SHARDS_BY_EXAMPLE`).
IN_MEMORY = "tfdist_in_memory"
# An attribute of a training dataset function: a sentence said once when a
# run resumes mid-epoch from a checkpoint (a generator's examples, which a
# rerun of the script makes anew).
RESUME_NOTE = "tfdist_resume_note"


def source_files(*, input_fn: Optional[Callable], name: str,
                 files: Sequence[str], file_record_counts: Sequence[int],
                 num_examples: Optional[int], shards_by_example: bool,
                 shards_itself: bool) -> Optional[Tuple[List[str],
                                                        List[int]]]:
  """The files (or their stand-in) and counts an input's layout names.

  Args:
    input_fn: the training dataset function (None: TFRecord files).
    name: the data set's name (a dataset function's `module:function`).
    files, file_record_counts: the TFRecord files and their record counts.
    num_examples: a dataset function's training examples per epoch.
    shards_by_example: tfdist shards the function's examples
      (`tfdist.data.input_pipeline.SHARDS_BY_EXAMPLE`).
    shards_itself: the function takes `input_context`.

  Returns:
    `(files, counts)`: the files themselves; `["<in-memory arrays>"]` for
    `tfdist.fit`'s arrays, `PyDataset`s and generators (as checkpoints
    have named them since positions were kept); `["<dataset function
    NAME>"]` for a dataset function (`"<dataset function NAME, sharded by
    its input_context>"` for one that shards itself); with the examples
    (of every worker) as the one count. None: no position (an unknown
    count).
  """
  if input_fn is None:
    return list(files), [int(c) for c in file_record_counts]
  if num_examples is None:
    return None
  if getattr(input_fn, IN_MEMORY, False):
    return ["<in-memory arrays>"], [int(num_examples)]
  if shards_itself and not shards_by_example:
    return ([f"<dataset function {name}, sharded by its input_context>"],
            [int(num_examples)])
  return [f"<dataset function {name}>"], [int(num_examples)]


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

  def __init__(self, layout: dict, *, steps_per_epoch: int,
               resume_note: Optional[str] = None):
    self.layout = dict(layout)
    self.steps_per_epoch = int(steps_per_epoch)
    self.resume_note = resume_note
    self.saved: Optional[dict] = None
    # After `resume_step`: the worker count whose input order this run
    # replays (`tfdist.data.input_pipeline.PipelineOptions
    # .replay_pipelines`); None: its own.
    self.replay_pipelines: Optional[int] = None

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
    continues where it stopped), or differs in the worker count alone
    (then `replay_pipelines` is the checkpoint's worker count, whose order
    this run replays, and this run's layout takes it on); otherwise the
    first step of the epoch `step` falls in (the epoch starts over), with a
    warning naming what changed. 0 for a fresh run. A run resumed mid-epoch
    says its `resume_note` (a generator's) once.
    """
    if step <= 0:
      return 0
    change = layout_change(self.saved, self.layout)
    workers = (self.saved or {}).get("num_input_pipelines")
    if change is not None and workers and layout_change(
        self.saved, dict(self.layout, num_input_pipelines=workers)) is None:
      # Only the worker count changed: this run replays the checkpoint's
      # order (and its checkpoints record it, so a later resume on any
      # worker count continues it).
      change, current = None, self.layout["num_input_pipelines"]
      self.replay_pipelines = int(workers)
      self.layout["num_input_pipelines"] = int(workers)
      logging.info(
          "tfdist: the worker count changed from %d to %d: the input replays "
          "the checkpoint's %d workers' order (each worker reads all of the "
          "training input and keeps its share of every step's batch).",
          workers, current, workers)
    if self.resume_note and step % self.steps_per_epoch:
      logging.warning("tfdist: %s", self.resume_note.format(
          step=step, epoch=step // self.steps_per_epoch + 1,
          steps=step % self.steps_per_epoch))
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
