"""Tests for tfdist.core.optimizers: the registry, its traits, and
`build_optimizer`."""

from absl.testing import absltest
from absl.testing import parameterized
import keras
import pytest

from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.training.plan import memory
from tfdist.core import optimizers
from tfdist.parallel.data import sharded_optimizer

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
        errors.ConfigError,
        "--optimizer='adagradient' is unknown. Use one of: sgd, "
        "momentum, adam, adamw, rmsprop, lamb, .*or a name that "
        "keras.optimizers.get accepts."):
      optimizers.build_optimizer("adagradient", 0.1)


class RegistryTest(parameterized.TestCase):

  def test_keras_names_are_accepted_with_measured_slots(self):
    # A name Keras knows and tfdist does not: Nadam's registration taken
    # away for this test.
    spec = optimizers._OPTIMIZERS.pop("nadam")  # pylint: disable=protected-access
    self.addCleanup(optimizers._OPTIMIZERS.__setitem__, "nadam", spec)  # pylint: disable=protected-access
    optimizer = optimizers.build_optimizer("Nadam", 0.1)
    self.assertIsInstance(optimizer, keras.optimizers.Nadam)
    unknown = optimizers.optimizer_spec("Nadam")
    self.assertEqual(round(unknown.traits.slots_per_parameter), 2)
    # Unknown to tfdist: not taken as shardable, and the refusal says why.
    self.assertFalse(unknown.traits.shardable)
    with self.assertRaisesRegex(errors.ConfigError, "register_optimizer"):
      TrainConfig(model_dir="/x", train_steps=1, optimizer="Nadam",
                  distribution_strategy="mirrored", zero_stage=1)

  @parameterized.parameters("sgd", "adam", "adamw", "rmsprop", "nadam",
                            "adamax", "adagrad", "lion", "adadelta", "ftrl")
  def test_registered_slot_counts_match_keras(self, name):
    spec = optimizers.optimizer_spec(name)
    built = optimizers.build_optimizer(name, 0.1, momentum=0.9)
    measured = optimizers._measured_slots(type(built))  # pylint: disable=protected-access
    if name == "sgd":
      measured = 1.0  # Keras's default SGD has no momentum; tfdist's has.
    # Per-variable scalars (Nadam's momentum product) aside.
    self.assertEqual(spec.traits.slots_per_parameter, round(measured), name)
    self.assertIs(optimizers.spec_of(built).class_name, spec.class_name)

  def test_one_trait_serves_every_reader(self):
    # LAMB's "not shardable" is read by the config, the sharded optimizer,
    # the memory advice and the flag help from the one registration.
    with self.assertRaisesRegex(
        errors.ConfigError, "--optimizer=lamb cannot run "
                                "with --zero_stage=1: LAMB's trust ratio"):
      TrainConfig(model_dir="/x", train_steps=1, optimizer="lamb",
                  distribution_strategy="mirrored", zero_stage=1)
    with self.assertRaisesRegex(
        errors.ConfigError, "--optimizer=lamb cannot shard"):
      sharded_optimizer.check_optimizer(keras.optimizers.Lamb())
    self.assertIn("lamb", optimizers.not_shardable())
    estimate = memory.ModelMemory(num_parameters=10**6,
                                  parameters_bytes=4 << 20,
                                  gradients_bytes=4 << 20,
                                  optimizer_bytes=8 << 20)
    for name, shard_advice in (("lamb", False), ("adam", True)):
      fit = memory.fits_data_parallel(estimate, capacity_bytes=12 << 20,
                                      num_replicas=4,
                                      optimizer=name)
      self.assertFalse(fit.fits)
      self.assertEqual("--shard_optimizer_state" in fit.advice,
                       shard_advice, name)
      self.assertIn(f"--optimizer={name} keeps 2 slots", fit.advice)

  def test_a_user_registers_an_optimizer(self):

    def sgd_nesterov(learning_rate, *, momentum, weight_decay, **clip):
      return keras.optimizers.SGD(learning_rate, momentum=momentum,
                                  nesterov=True, weight_decay=weight_decay,
                                  **clip)

    optimizers.register_optimizer("sgd_nesterov", slots_per_parameter=1)(
        sgd_nesterov)
    self.addCleanup(optimizers._OPTIMIZERS.pop, "sgd_nesterov")  # pylint: disable=protected-access
    built = optimizers.build_optimizer("sgd_nesterov", 0.1, momentum=0.5)
    self.assertTrue(built.nesterov)
    self.assertIn("sgd_nesterov", optimizers.registered_optimizers())
    # The config accepts it, sharded too (its traits say it may be).
    config = TrainConfig(model_dir="/x", train_steps=1,
                         optimizer="sgd_nesterov",
                         distribution_strategy="mirrored", zero_stage=1)
    self.assertEqual(config.optimizer, "sgd_nesterov")
    with self.assertRaisesRegex(ValueError, "lower case"):
      optimizers.register_optimizer("SGD2", slots_per_parameter=1)


class OldPathTest(absltest.TestCase):

  def test_the_old_path_is_the_same_module(self):
    # --helpfull names tfdist.training.optimizers.register_optimizer.
    from tfdist.training import optimizers as old  # pylint: disable=g-import-not-at-top
    self.assertIs(old, optimizers)
    self.assertIs(old.register_optimizer, optimizers.register_optimizer)


if __name__ == "__main__":
  absltest.main()
