"""Tests for tfdist.training.step.precision: policies, float32 outputs and loss
scaling."""

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist import models
from tfdist.training.step import precision

# Also run on the oldest supported TensorFlow (see tests/conftest.py).
pytestmark = pytest.mark.compat


class PrecisionTest(parameterized.TestCase):

  def tearDown(self):
    keras.mixed_precision.set_global_policy("float32")
    super().tearDown()

  @parameterized.named_parameters(
      ("fp32", "fp32", "float32", "float32"),
      ("bf16", "bf16", "mixed_bfloat16", "bfloat16"),
      ("fp16", "fp16", "mixed_float16", "float16"))
  def test_policy_and_float32_logits(self, dtype, policy, compute):
    self.assertEqual(precision.configure_precision(dtype).name, policy)
    for name in ("cnn", "resnet"):  # the image models
      model = models.build_model(name, input_shape=(28, 28, 1), num_classes=10)
      self.assertEqual(model.layers[1].compute_dtype, compute)
      # Variables stay float32 under every policy.
      self.assertTrue(all(v.dtype == "float32" for v in model.weights))
      out = model(np.zeros((2, 28, 28, 1), np.float32))
      self.assertEqual(out.dtype, tf.float32)
      self.assertEqual(tuple(out.shape), (2, 10))

  def test_unknown_dtype(self):
    with self.assertRaisesRegex(ValueError, "--dtype='int8'"):
      precision.policy_name("int8")

  def test_no_wrapping_outside_fp16(self):
    inner = keras.optimizers.SGD(0.1)
    for dtype in ("fp32", "bf16"):
      self.assertIs(precision.wrap_optimizer_for_precision(
          inner, dtype=dtype, loss_scale=None), inner)
    self.assertIsNone(precision.current_loss_scale(inner))

  def test_dynamic_loss_scale_by_default(self):
    opt = precision.wrap_optimizer_for_precision(
        keras.optimizers.SGD(0.1), dtype="fp16", loss_scale=None)
    self.assertIsInstance(opt, keras.optimizers.LossScaleOptimizer)
    self.assertNotIsInstance(opt, precision.FixedLossScaleOptimizer)
    var = keras.Variable(np.ones(2, np.float32))
    opt.build([var])
    self.assertEqual(precision.current_loss_scale(opt), 2.0**15)
    # An overflowing step is skipped and the dynamic scale halves.
    opt.apply_gradients([(np.array([np.inf, 1.0], np.float32), var)])
    self.assertEqual(precision.current_loss_scale(opt), 2.0**14)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(var), [1.0, 1.0])

  def test_fixed_loss_scale_never_changes(self):
    opt = precision.wrap_optimizer_for_precision(
        keras.optimizers.SGD(1.0), dtype="fp16", loss_scale=128.0)
    self.assertIsInstance(opt, precision.FixedLossScaleOptimizer)
    var = keras.Variable(np.ones(2, np.float32))
    opt.build([var])
    self.assertEqual(precision.current_loss_scale(opt), 128.0)
    # Non-finite: skipped, scale kept.
    opt.apply_gradients([(np.array([np.nan, 1.0], np.float32), var)])
    self.assertEqual(precision.current_loss_scale(opt), 128.0)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(var), [1.0, 1.0])
    # Finite scaled gradient 128 * g: the update uses g.
    opt.apply_gradients([(np.array([128.0, 256.0], np.float32), var)])
    np.testing.assert_allclose(keras.ops.convert_to_numpy(var), [0.0, -1.0])
    self.assertEqual(precision.current_loss_scale(opt), 128.0)
    self.assertEqual(opt.scale_loss(2.0), 256.0)


if __name__ == "__main__":
  absltest.main()
