"""Unit tests of models/recompute.py: same model, same gradients, less kept."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from models import recompute


def _layers():
  inputs = keras.Input((6,))
  first = keras.layers.Dense(5, activation="relu")(inputs)
  norm = keras.layers.BatchNormalization()(first)
  second = keras.layers.Dense(4, activation="tanh")(norm)
  outputs = keras.layers.Dense(2)(second)
  return inputs, first, second, outputs


def _gradients(model, x, y):
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
  return tape.gradient(loss, model.trainable_weights)


def test_gradients_equal_the_plain_models():
  inputs, first, second, outputs = _layers()
  plain = keras.Model(inputs, outputs)
  recomputing = recompute.recomputing_model(
      inputs, outputs, boundaries=[first, second], name="r")
  assert recomputing.num_recomputed_segments >= 2
  assert [w.name for w in plain.weights] == [w.name for w in
                                             recomputing.weights]
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, 6)).astype(np.float32)
  y = rng.normal(size=(8, 2)).astype(np.float32)
  for a, b in zip(_gradients(plain, x, y), _gradients(recomputing, x, y)):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def test_batch_norm_statistics_are_updated_once_per_step():
  inputs, first, second, outputs = _layers()
  plain = keras.Model(inputs, outputs)
  x = np.random.default_rng(1).normal(size=(8, 6)).astype(np.float32)
  y = np.zeros((8, 2), np.float32)
  norm = [l for l in plain.layers
          if isinstance(l, keras.layers.BatchNormalization)][0]
  start = norm.moving_mean.numpy().copy()
  _gradients(plain, x, y)
  once = norm.moving_mean.numpy().copy()
  norm.moving_mean.assign(start)
  recomputing = recompute.recomputing_model(
      inputs, outputs, boundaries=[first, second])
  _gradients(recomputing, x, y)
  np.testing.assert_allclose(norm.moving_mean.numpy(), once, rtol=1e-6)


def test_a_segment_with_dropout_is_refused():
  inputs = keras.Input((6,))
  hidden = keras.layers.Dropout(0.5)(keras.layers.Dense(4)(inputs))
  outputs = keras.layers.Dense(2)(hidden)
  with pytest.raises(ValueError):
    recompute.recomputing_model(inputs, outputs, boundaries=[hidden])
