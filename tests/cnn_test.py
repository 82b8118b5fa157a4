"""Unit tests of models/cnn.py: shapes, dtypes, batch norm, recomputation."""

import keras
import numpy as np
import tensorflow as tf

from models import cnn
from models import recompute
from models.batch_norm import BatchNormalization


def test_logits_for_a_batch_of_images():
  model = cnn.build_cnn(input_shape=(28, 28, 1), num_classes=10, width=4)
  images = np.random.default_rng(0).random((3, 28, 28, 1), np.float32)
  logits = model(images, training=False)
  assert logits.shape == (3, 10) and logits.dtype == tf.float32
  assert model.name == "cnn"


def test_blocks_and_batch_norm_follow_the_arguments():
  model = cnn.build_cnn(width=4, convs_per_block=2, sync_batch_norm=True)
  norms = [l for l in model.layers if isinstance(l, BatchNormalization)]
  convs = [l for l in model.layers if isinstance(l, keras.layers.Conv2D)]
  assert len(norms) == len(convs) == 4
  assert [c.filters for c in convs] == [4, 4, 8, 8]
  assert all(n.synchronized for n in norms)


def test_the_output_stays_float32_under_mixed_precision():
  keras.mixed_precision.set_global_policy("mixed_bfloat16")
  try:
    model = cnn.build_cnn(width=4)
    assert model(np.zeros((1, 28, 28, 1), np.float32)).dtype == tf.float32
  finally:
    keras.mixed_precision.set_global_policy("float32")


def test_recomputation_keeps_the_layers_and_recomputes_both_blocks():
  plain = cnn.build_cnn(width=4)
  recomputing = cnn.build_cnn(width=4, activation_recomputation=True)
  assert isinstance(recomputing, recompute.RecomputingModel)
  assert recomputing.num_recomputed_segments == 2
  assert [w.shape for w in plain.weights] == [
      w.shape for w in recomputing.weights]
