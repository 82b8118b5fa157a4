"""SavedModel export with a serving signature."""

import os
import uuid

from absl import logging
import keras
import tensorflow as tf


def export_saved_model(model: keras.Model, export_dir: str) -> str:
  """Exports `model` as a TensorFlow SavedModel with a `serving_default`.

  The signature takes the model's input (e.g. float32 [batch, 28, 28, 1]) and
  returns its float32 logits. The export goes to a temporary sibling folder
  that replaces `export_dir` once complete, so `export_dir` is always either
  a whole SavedModel or absent.

  Returns:
    `export_dir`.
  """
  parent = os.path.dirname(export_dir.rstrip("/")) or "."
  tf.io.gfile.makedirs(parent)
  tmp = os.path.join(parent, f".tmp-export-{uuid.uuid4().hex[:8]}")
  model.export(tmp, format="tf_saved_model", verbose=False)
  if tf.io.gfile.exists(export_dir):
    tf.io.gfile.rmtree(export_dir)
  tf.io.gfile.rename(tmp, export_dir)
  logging.info("SavedModel written to %s", export_dir)
  return export_dir
