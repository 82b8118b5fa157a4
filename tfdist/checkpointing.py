"""Checkpoints of the whole training state: where they go, restore, save.

One `CheckpointKeeper` per run wraps a `tf.train.Checkpoint` (model,
optimizer with its slots, iteration count and loss scale, the global step)
and a `tf.train.CheckpointManager`:

* the chief (or the only process) saves into `--model_dir/checkpoints` (or
  `--checkpoint_dir`) and resumes from there;
* under MultiWorkerMirroredStrategy the other workers take part in every
  save (it is collective) but write into a scratch folder of their own, and
  resume from the chief's folder (Model Garden's pattern).

TensorFlow writes a checkpoint's data files first and updates the index
(`checkpoint`) last, so a checkpoint is listed only once it is whole.

The input position (`InputPosition`, `--checkpoint_input_position`): a
checkpoint also records the training input's layout (`tfdist.
input_pipeline.input_layout`: files, record counts, workers, global batch,
seed, shuffle buffer, cache; a few hundred bytes of JSON), not any iterator
state. With the step it fixes where every worker's input stands, which each
worker recomputes for its own shard, so nothing per worker has to be
stored, and the chief alone writing `--model_dir` is enough. A run whose
layout differs discards the position with a message naming the change.
"""

import json
from typing import Optional

from absl import logging
import tensorflow as tf

# Where `InputPosition` lives in a checkpoint.
INPUT_POSITION_KEY = "input_position/.ATTRIBUTES/py_state"


class InputPosition(tf.train.experimental.PythonState):
  """The training input's layout, saved in every checkpoint.

  Args:
    layout: this run's `tfdist.input_pipeline.input_layout` (a dict).
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
    from tfdist import input_pipeline  # pylint: disable=g-import-not-at-top
    if step <= 0:
      return 0
    change = input_pipeline.layout_change(self.saved, self.layout)
    if change is None:
      logging.info("tfdist: input position restored: step %d continues "
                   "epoch %d where the checkpoint stopped.", step,
                   step // self.steps_per_epoch)
      return step
    start = step - step % self.steps_per_epoch
    logging.warning(
        "tfdist: input position discarded: %s. The input starts epoch %d "
        "over (examples the first %d steps of that epoch used may be used "
        "again).", change, step // self.steps_per_epoch, step - start)
    return start


# Parts of the training state (children of the checkpoint's root) that a
# checkpoint may lack: the input position (`InputPosition`) and the random
# layers' seed-generator states (`tfdist.train_loop.random_state`), which
# older checkpoints do not hold.
OPTIONAL_PARTS = ("input_position", "random_state")


def root_children(prefix: str) -> set:
  """Names of the objects a checkpoint's root holds (`model`, `optimizer`,
  ...), from its object graph."""
  from tensorflow.core.protobuf import trackable_object_graph_pb2  # pylint: disable=g-import-not-at-top
  graph = trackable_object_graph_pb2.TrackableObjectGraph()
  graph.ParseFromString(tf.train.load_checkpoint(prefix).get_tensor(
      "_CHECKPOINTABLE_OBJECT_GRAPH"))
  return {child.local_name for child in graph.nodes[0].children}


class CheckpointKeeper:
  """Restores and saves one run's checkpoints.

  Args:
    checkpoint: the `tf.train.Checkpoint` over the whole state.
    directory: where this process saves (the chief's checkpoint folder, or
      a non-chief worker's scratch folder).
    step_counter: the global step variable (numbers the checkpoints).
    max_to_keep: checkpoints kept in `directory`.
    restore_dir: where to resume from when it is not `directory` (non-chief
      workers resume from the chief's folder); None: `directory`.
    input_position: an `InputPosition` saved with (attached to)
      `checkpoint`; None: no input position.
  """

  def __init__(self, *, checkpoint: tf.train.Checkpoint, directory: str,
               step_counter: tf.Variable, max_to_keep: int = 5,
               restore_dir: Optional[str] = None,
               input_position: Optional[InputPosition] = None):
    self.checkpoint = checkpoint
    self.input_position = input_position
    if input_position is not None:
      checkpoint.input_position = input_position
    self.directory = directory
    self.restore_dir = restore_dir or directory
    self.manager = tf.train.CheckpointManager(
        checkpoint, directory, max_to_keep=max_to_keep,
        step_counter=step_counter)
    self.restored_from: Optional[str] = None

  @property
  def latest(self) -> Optional[str]:
    """The newest checkpoint this process saved or resumed from."""
    return self.manager.latest_checkpoint or self.restored_from

  def restore(self) -> Optional[str]:
    """Restores the newest checkpoint of `restore_dir`, if any.

    Returns:
      The checkpoint's path, or None when training starts fresh.
    """
    path = tf.train.latest_checkpoint(self.restore_dir)
    if path:
      self._restore(path)
    self.restored_from = path
    return path

  def _restore(self, path: str):
    """Restores `path`. A checkpoint without an optional part
    (`OPTIONAL_PARTS`: written with --nocheckpoint_input_position, or before
    tfdist saved that part) restores everything else; a part the checkpoint
    has and this run does not is left unread."""
    present = root_children(path)
    absent = {name: getattr(self.checkpoint, name) for name in OPTIONAL_PARTS
              if name not in present and hasattr(self.checkpoint, name)}
    for name in absent:
      delattr(self.checkpoint, name)
    try:
      status = self.checkpoint.restore(path)
      status.assert_existing_objects_matched()
      if any(name in present and not hasattr(self.checkpoint, name)
             for name in OPTIONAL_PARTS):
        status.expect_partial()  # E.g. a saved position not needed.
    finally:
      for name, value in absent.items():
        setattr(self.checkpoint, name, value)
    if "input_position" in absent:
      self.input_position.saved = None
    if "random_state" in absent:
      logging.warning(
          "tfdist: %s holds no random-layer state (written before tfdist "
          "saved it): dropout and other random layers continue from a "
          "fresh state, so their draws differ from an uninterrupted run's.",
          path)

  def save(self, step: int) -> str:
    """Saves the state as checkpoint number `step`; returns its path."""
    path = self.manager.save(checkpoint_number=step)
    logging.info("Saved checkpoint %s", path)
    return path
