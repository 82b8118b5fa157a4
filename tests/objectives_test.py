"""Losses and metrics (tfdist/training/step/objectives.py): defaults,
resolution, sums.

`MetricSums` is checked against Keras's own stateful metrics: the sum of
per-batch contributions of two halves of the data gives what one metric
updated on all of it gives.
"""

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf

from tfdist import errors
from tfdist.core.dataset_spec import DatasetSpec
from tfdist.training.step import objectives

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
    with self.assertRaisesRegex(errors.ConfigError, "loss='nope'"):
      objectives.resolve_loss("nope", **BINARY)
    with self.assertRaisesRegex(errors.ConfigError, "per output"):
      objectives.resolve_loss({"a": "mse"}, **BINARY)
    with self.assertRaisesRegex(errors.ConfigError, "metric 'nope'"):
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
    with self.assertRaisesRegex(errors.ConfigError, "has no loss"):
      objectives.resolve(dataset=DatasetSpec(name="d", input_fn=_no_data))

  def test_duplicate_metric_names_are_made_unique(self):
    got = objectives.resolve(loss="mse", metrics=["mae", "mae"], **BINARY)
    self.assertEqual(got.metric_names, ("mae", "mae_1"))


class LossValuesTest(parameterized.TestCase):
  """`resolve_loss` keeps how `fit` reduces a loss; `loss_values` gives the
  step its values (tfdist.fit against Model.fit: tests/loss_semantics_test.py).
  """

  def _values(self, identifier, y_true, y_pred):
    loss = objectives.resolve_loss(identifier, **BINARY)
    values, elements, reduction = objectives.loss_values(
        loss, tf.constant(y_true, tf.float32), tf.constant(y_pred,
                                                           tf.float32))
    return values.numpy(), float(elements), reduction

  @parameterized.named_parameters(
      ("default", keras.losses.MeanSquaredError(), "sum_over_batch_size"),
      ("mean", keras.losses.MeanSquaredError(reduction="mean"),
       "sum_over_batch_size"),
      ("sum", keras.losses.MeanSquaredError(reduction="sum"), "sum"),
      ("none", keras.losses.MeanSquaredError(reduction=None), "none"),
      ("weighted_mean", keras.losses.MeanSquaredError(
          reduction="mean_with_sample_weight"), "mean_with_sample_weight"),
      ("function", keras.losses.mean_squared_error, "sum_over_batch_size"),
      ("name", "mse", "sum_over_batch_size"))
  def test_the_reduction_fit_applies_is_kept(self, identifier, reduction):
    values, elements, got = self._values(identifier, [[1.0], [0.0]],
                                         [[0.5], [0.0]])
    np.testing.assert_allclose(values, [0.25, 0.0])
    self.assertEqual(elements, 1.0)
    self.assertEqual(got, reduction)
    loss = objectives.resolve_loss(identifier, **BINARY)
    self.assertIs(objectives.resolve_loss(loss, **BINARY), loss)

  def test_one_value_per_batch_is_every_examples_loss(self):
    # As fit takes it: the value is the batch's loss, whatever the
    # reduction (Keras's reduce_values returns a scalar as it is).
    for identifier in (lambda y, p: tf.reduce_mean(tf.square(y - p)),
                       _BatchMean(reduction="sum")):
      values, elements, reduction = self._values(
          identifier, [[1.0], [0.0], [0.0]], [[0.0], [0.0], [0.0]])
      np.testing.assert_allclose(values, [1 / 3] * 3, rtol=1e-6)
      self.assertEqual((elements, reduction), (1.0, "sum_over_batch_size"))

  def test_values_of_trailing_axes_are_averaged_and_counted(self):
    loss = objectives.resolve_loss(lambda y, p: tf.square(y - p), **BINARY)
    values, elements, _ = objectives.loss_values(
        loss, tf.zeros([2, 3]), tf.constant([[1.0, 2.0, 3.0], [0, 0, 0]]))
    np.testing.assert_allclose(values.numpy(), [14 / 3, 0.0], rtol=1e-6)
    self.assertEqual(float(elements), 3.0)

  def test_a_lambda_gets_a_valid_scope_name(self):
    loss = objectives.resolve_loss(lambda y, p: tf.square(y - p), **BINARY)
    self.assertEqual(loss.name, "lambda")
    # Keras opens a name scope named after the loss ('<lambda>' is refused).
    tf.function(lambda: loss(tf.zeros([2, 1]), tf.ones([2, 1])))()

  def test_batch_valued_loss_is_found_at_start(self):
    specs = dict(y_true=tf.TensorSpec([None, 1]),
                 y_pred=tf.TensorSpec([None, 1]))
    batch = objectives.resolve_loss(
        lambda y, p: tf.reduce_mean(tf.square(y - p)), **BINARY)
    self.assertTrue(objectives.batch_valued_loss(batch, **specs))
    self.assertFalse(objectives.batch_valued_loss(
        objectives.resolve_loss("mse", **BINARY), **specs))

  def test_mean_with_sample_weight_is_refused_with_weights(self):
    loss = objectives.resolve_loss(keras.losses.MeanSquaredError(
        reduction="mean_with_sample_weight"), **BINARY)
    objectives.check_reduction(loss, weighted=False)
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"'mean_squared_error' has reduction='mean_with_sample"
        r"_weight' and the examples carry sample or class weights.*Use "
        r"reduction='sum_over_batch_size'"):
      objectives.check_reduction(loss, weighted=True)


class _BatchMean(keras.losses.Loss):

  def call(self, y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - y_pred))


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
