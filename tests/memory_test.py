"""Tests for tfdist.training.memory: the model-state estimate against the real bytes
of a model's variables and its optimizer's, and the data-parallel fit."""

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest

from tfdist.training import memory
from tfdist.training import precision

# Also run on the oldest supported TensorFlow (see tests/conftest.py).
pytestmark = pytest.mark.compat


def _model():
  inputs = keras.Input((12,))
  x = keras.layers.Dense(32, use_bias=False)(inputs)
  x = keras.layers.BatchNormalization()(x)  # Non-trainable statistics too.
  outputs = keras.layers.Dense(3)(x)
  return keras.Model(inputs, outputs)


def _nbytes(variables) -> int:
  return sum(np.asarray(v.numpy()).nbytes for v in variables)


class EstimateTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("sgd_momentum", lambda: keras.optimizers.SGD(0.1, momentum=0.9), 1),
      ("adam", lambda: keras.optimizers.Adam(1e-3), 2),
      ("fp16_loss_scale", lambda: precision.wrap_optimizer_for_precision(
          keras.optimizers.SGD(0.1, momentum=0.9), dtype="fp16"), 1))
  def test_equals_the_bytes_of_variables_and_optimizer_state(
      self, make_optimizer, slots_per_weight):
    model = _model()
    optimizer = make_optimizer()
    optimizer.build(model.trainable_variables)
    estimate = memory.estimate_model_memory(model, optimizer)
    self.assertEqual(estimate.parameters_bytes, _nbytes(model.variables))
    self.assertEqual(estimate.gradients_bytes,
                     _nbytes(model.trainable_variables))
    self.assertEqual(estimate.optimizer_bytes, _nbytes(optimizer.variables))
    self.assertEqual(estimate.total_bytes,
                     _nbytes(model.variables) +
                     _nbytes(model.trainable_variables) +
                     _nbytes(optimizer.variables))
    # The slots dominate the optimizer's state: 1 (momentum) or 2 (Adam)
    # per trainable value, plus a few scalars (iterations, loss scale).
    trainable = _nbytes(model.trainable_variables)
    self.assertBetween(estimate.optimizer_bytes - slots_per_weight *
                       trainable, 0, 64)
    self.assertEqual(estimate.num_parameters,
                     sum(int(np.prod(v.shape)) for v in model.variables))


class FitTest(absltest.TestCase):

  def test_fits_and_the_strategy_that_fits_when_not(self):
    estimate = memory.ModelMemory(parameters_bytes=4 << 30,
                                  gradients_bytes=4 << 30,
                                  optimizer_bytes=8 << 30,
                                  num_parameters=1 << 30)
    fit = memory.fits_data_parallel(estimate, capacity_bytes=80 << 30)
    self.assertTrue(fit.fits)
    self.assertAlmostEqual(fit.share, 16 / 80)
    fit = memory.fits_data_parallel(estimate, capacity_bytes=80 << 30,
                                    replicas_sharing=8)  # 8 CPU copies.
    self.assertFalse(fit.fits)
    small = memory.fits_data_parallel(estimate, capacity_bytes=5 << 30,
                                      optimizer="adam")
    self.assertFalse(small.fits)
    # Variables and slots (12 GiB) sharded over ps tasks of 5 GiB: 3.
    self.assertIn("parameter_server with at least 3 ps task(s)", small.advice)
    self.assertIn("--optimizer=adam keeps 2 slots", small.advice)
    # 16 GiB of state over devices of 5 GiB: at least 4 pipeline stages.
    self.assertIn("--pipeline_stages=4 cuts the model into 4 stages on 4 "
                  "devices", small.advice)
    self.assertIn("each holding about 4.0 GiB", small.advice)

  def test_sharding_recommended_when_it_makes_the_state_fit(self):
    # fp32 Adam, 1 Gi parameters: 4 + 4 + 8 bytes each.
    estimate = memory.ModelMemory(parameters_bytes=4 << 30,
                                  gradients_bytes=4 << 30,
                                  optimizer_bytes=8 << 30,
                                  num_parameters=1 << 30)
    # Stage 1 over 4 replicas: 4 + 4 + 8 / 4 = 10 bytes each.
    sharded = memory.sharded_estimate(estimate, num_replicas=4)
    self.assertEqual(sharded.optimizer_bytes, 2 << 30)
    self.assertEqual(sharded.total_bytes, 10 << 30)
    self.assertEqual(memory.sharded_estimate(estimate, num_replicas=4,
                                             stage=0), estimate)
    # 16 GiB does not fit 12 GiB; 10 GiB does.
    fit = memory.fits_data_parallel(estimate, capacity_bytes=12 << 30,
                                    optimizer="adam", num_replicas=4)
    self.assertFalse(fit.fits)
    self.assertIn("--shard_optimizer_state (--zero_stage=1) over the 4 "
                  "replicas keeps 2.0 GiB", fit.advice)
    self.assertTrue(memory.fits_data_parallel(
        estimate, capacity_bytes=12 << 30, num_replicas=4,
        zero_stage=1).fits)
    # One replica, or too little memory even sharded: not recommended.
    for replicas, capacity in ((1, 12 << 30), (4, 9 << 30)):
      fit = memory.fits_data_parallel(estimate, capacity_bytes=capacity,
                                      optimizer="adam",
                                      num_replicas=replicas)
      self.assertNotIn("--shard_optimizer_state", fit.advice)
    # LAMB cannot shard.
    self.assertNotIn("--shard_optimizer_state", memory.fits_data_parallel(
        estimate, capacity_bytes=12 << 30, optimizer="lamb",
        num_replicas=4).advice)

  def test_peak_rss_is_this_process(self):
    self.assertGreater(memory.peak_rss_bytes(), 50 << 20)
    self.assertGreater(memory.host_memory_bytes(), memory.peak_rss_bytes())
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    if not tf.config.list_physical_devices("GPU"):
      self.assertEqual(memory.device_memory(), {})
    self.assertEqual(memory.format_bytes(3 << 20), "3.0 MiB")


if __name__ == "__main__":
  absltest.main()
