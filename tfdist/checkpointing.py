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
"""

from typing import Optional

from absl import logging
import tensorflow as tf


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
  """

  def __init__(self, *, checkpoint: tf.train.Checkpoint, directory: str,
               step_counter: tf.Variable, max_to_keep: int = 5,
               restore_dir: Optional[str] = None):
    self.checkpoint = checkpoint
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
      self.checkpoint.restore(path).assert_existing_objects_matched()
    self.restored_from = path
    return path

  def save(self, step: int) -> str:
    """Saves the state as checkpoint number `step`; returns its path."""
    path = self.manager.save(checkpoint_number=step)
    logging.info("Saved checkpoint %s", path)
    return path
