"""Losses and metrics (tfdist/training/objectives.py): defaults, resolution, sums.

`MetricSums` is checked against Keras's own stateful metrics: the sum of
per-batch contributions of two halves of the data gives what one metric
updated on all of it gives.
"""

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf

from tfdist.config import ConfigError
from tfdist.data.dataset_spec import DatasetSpec
from tfdist.training import objectives

SPARSE = dict(y_true=tf.TensorShape([None]),
              y_pred=tf.TensorShape([None, 3]))
BINARY = dict(y_true=tf.TensorShape([None, 1]),
              y_pred=tf.TensorShape([None, 1]))
ONE_HOT = dict(y_true=tf.TensorShape([None, 3]),
               y_pred=tf.TensorShape([None, 3]))


def _no_data(training):
  del training
  raise AssertionError("not read")


class DefaultsTest(absltest.TestCase):

  def test_task_defaults(self):
    loss, metrics = objectives.task_defaults("multiclass")
    self.assertIsInstance(loss, keras.losses.SparseCategoricalCrossentropy)
    self.assertEqual([m.name for m in metrics], ["accuracy"])
    loss, metrics = objectives.task_defaults("binary")
    self.assertIsInstance(loss, keras.losses.BinaryCrossentropy)
    self.assertEqual([m.name for m in metrics], ["accuracy", "auc"])
    with self.assertRaisesRegex(ValueError, "task='regression'"):
      objectives.task_defaults("regression")


class ResolveTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("sparse", SPARSE, keras.metrics.SparseCategoricalAccuracy),
      ("binary", BINARY, keras.metrics.BinaryAccuracy),
      ("one_hot", ONE_HOT, keras.metrics.CategoricalAccuracy))
  def test_accuracy_follows_the_shapes(self, shapes, cls):
    self.assertIsInstance(objectives.resolve_metric("accuracy", **shapes),
                          cls)

  def test_crossentropy_follows_the_shapes(self):
    loss = objectives.resolve_loss("crossentropy", **SPARSE)
    y_true = np.array([0, 2])
    y_pred = np.array([[0.8, 0.1, 0.1], [0.2, 0.2, 0.6]], np.float32)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(loss(y_true, y_pred)),
        -np.log([0.8, 0.6]), rtol=1e-5)

  def test_losses_are_per_example(self):
    loss = objectives.resolve_loss("mse", **BINARY)
    values = keras.ops.convert_to_numpy(
        loss(np.array([[1.0], [0.0]]), np.array([[0.5], [0.0]])))
    np.testing.assert_allclose(values, [0.25, 0.0])

  def test_unknown_names_and_losses_per_output(self):
    with self.assertRaisesRegex(ConfigError, "loss='nope'"):
      objectives.resolve_loss("nope", **BINARY)
    with self.assertRaisesRegex(ConfigError, "per output"):
      objectives.resolve_loss({"a": "mse"}, **BINARY)
    with self.assertRaisesRegex(ConfigError, "metric 'nope'"):
      objectives.resolve_metric("nope", **BINARY)

  def test_resolve_prefers_arguments_then_the_dataset_task(self):
    spec = DatasetSpec(name="d", task="binary", input_fn=_no_data)
    got = objectives.resolve(dataset=spec, **BINARY)
    self.assertEqual(got.source, "task binary")
    self.assertEqual(got.metric_names, ("accuracy", "auc"))
    got = objectives.resolve(loss="mse", metrics=["mae"], dataset=spec,
                             **BINARY)
    self.assertEqual(got.source, "arguments")
    self.assertEqual(got.metric_names, ("mae",))

  def test_resolve_without_a_loss_says_where_to_give_one(self):
    with self.assertRaisesRegex(ConfigError, "has no loss"):
      objectives.resolve(dataset=DatasetSpec(name="d", input_fn=_no_data))

  def test_duplicate_metric_names_are_made_unique(self):
    got = objectives.resolve(loss="mse", metrics=["mae", "mae"], **BINARY)
    self.assertEqual(got.metric_names, ("mae", "mae_1"))


class MetricSumsTest(absltest.TestCase):

  def test_summed_halves_equal_one_keras_metric(self):
    rng = np.random.default_rng(0)
    y_true = (rng.random((64, 1)) > 0.5).astype(np.float32)
    y_pred = rng.random((64, 1)).astype(np.float32)
    metrics = [keras.metrics.BinaryAccuracy(name="accuracy"),
               keras.metrics.AUC(name="auc", num_thresholds=201)]
    sums = objectives.MetricSums(metrics)
    total = sums.zeros()
    for half in (slice(0, 32), slice(32, 64)):
      part = sums.batch_sums(tf.constant(y_true[half]),
                             tf.constant(y_pred[half]))
      total = {k: total[k] + part[k] for k in total}
    got = sums.results({k: v.numpy() for k, v in total.items()})
    want_accuracy = float(np.mean((y_pred > 0.5) == (y_true > 0.5)))
    self.assertAlmostEqual(got["accuracy"], want_accuracy, places=6)
    auc = keras.metrics.AUC(num_thresholds=201)
    auc.update_state(y_true, y_pred)
    self.assertAlmostEqual(got["auc"], float(auc.result()), places=5)

  def test_a_mask_leaves_padding_out(self):
    sums = objectives.MetricSums([keras.metrics.BinaryAccuracy(name="a")])
    part = sums.batch_sums(tf.constant([[1.0], [1.0]]),
                           tf.constant([[0.9], [0.1]]),
                           mask=tf.constant([1.0, 0.0]))
    self.assertEqual(
        sums.results({k: v.numpy() for k, v in part.items()}), {"a": 1.0})


if __name__ == "__main__":
  absltest.main()
