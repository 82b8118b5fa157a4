"""SavedModel export with a serving signature, and its contract.

The `serving_default` signature is the Keras model itself: it does not
contain the input parser's preprocessing, so a client must give inputs
exactly as the data set's parser makes them (README "Serving", with a
serving example that `tests/cluster_faults_test.py` runs):

* image models (`cnn`, `resnet`; `fashion_mnist`): keyword `image`,
  float32 [batch, 28, 28, 1], pixels scaled to [0, 1] (uint8 / 255, as
  `tfdist.fashion_mnist.parse_image_example` does); output `output_0`,
  float32 logits [batch, 10];
* `ranking` (`movielens`): keywords `user_id`, `item_id`, `gender`,
  `occupation`, `zip3` (string [batch, 1]) and `dense` (float32
  [batch, 21]), as `tfdist.movielens.parse_example` makes them; output
  `output_0`, float32 probability [batch, 1].
"""

import os
import uuid

from absl import logging
import keras
import tensorflow as tf


def export_saved_model(model: keras.Model, export_dir: str) -> str:
  """Exports `model` as a TensorFlow SavedModel with a `serving_default`.

  The signature takes the model's inputs under their input names (e.g.
  `image`: float32 [batch, 28, 28, 1] scaled to [0, 1]) and returns
  `{"output_0": float32 outputs}` (see the module docstring). The export goes
  to a temporary sibling folder
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
