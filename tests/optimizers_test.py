"""Tests for tfdist.training.optimizers.build_optimizer."""

from absl.testing import absltest
from absl.testing import parameterized
import keras
import pytest

from tfdist.config import ConfigError
from tfdist.training import optimizers

pytestmark = pytest.mark.compat


class BuildOptimizerTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("sgd", "sgd", keras.optimizers.SGD),
      ("momentum", "momentum", keras.optimizers.SGD),
      ("adam", "adam", keras.optimizers.Adam),
      ("adamw", "adamw", keras.optimizers.AdamW),
      ("rmsprop", "rmsprop", keras.optimizers.RMSprop),
      ("lamb", "lamb", keras.optimizers.Lamb))
  def test_each_name(self, name, cls):
    optimizer = optimizers.build_optimizer(name, 0.25)
    self.assertIs(type(optimizer), cls)
    self.assertAlmostEqual(float(optimizer.learning_rate), 0.25)

  def test_momentum_and_weight_decay(self):
    sgd = optimizers.build_optimizer("momentum", 0.1, momentum=0.8,
                                     weight_decay=1e-4)
    self.assertAlmostEqual(sgd.momentum, 0.8)
    self.assertAlmostEqual(sgd.weight_decay, 1e-4)
    # 0 turns weight decay off; AdamW has a default of its own.
    self.assertIsNone(optimizers.build_optimizer("adam", 0.1).weight_decay)
    self.assertAlmostEqual(
        optimizers.build_optimizer("adamw", 0.1).weight_decay, 0.004)
    self.assertAlmostEqual(optimizers.build_optimizer(
        "adamw", 0.1, weight_decay=0.01).weight_decay, 0.01)

  def test_clipping(self):
    self.assertEqual(optimizers.build_optimizer(
        "adam", 0.1, clipnorm=1.5).clipnorm, 1.5)
    self.assertEqual(optimizers.build_optimizer(
        "sgd", 0.1, global_clipnorm=2.0).global_clipnorm, 2.0)

  def test_a_schedule_is_the_learning_rate(self):
    schedule = keras.optimizers.schedules.ExponentialDecay(
        1.0, decay_steps=10, decay_rate=0.5)
    optimizer = optimizers.build_optimizer("sgd", schedule)
    self.assertIs(optimizer._learning_rate, schedule)  # pylint: disable=protected-access

  def test_unknown_name(self):
    with self.assertRaisesRegex(
        ConfigError, "--optimizer='adagrad' is unknown. Use sgd, momentum, "
        "adam, adamw, rmsprop or lamb."):
      optimizers.build_optimizer("adagrad", 0.1)


if __name__ == "__main__":
  absltest.main()
