"""Tests of the single-host backends' strategies (`Backend.make_strategy`,
through `tfdist.backends.registry.make_strategy`)."""

from absl.testing import absltest
from absl.testing import parameterized
import pytest
import tensorflow as tf

from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.distribute import decisions as decisions_lib
from tfdist.distribute import auto_select
from tfdist.distribute import cluster as cluster_lib
from tfdist.distribute import strategy as strategy_lib
from tfdist.backends import registry as backend_registry

# Also run on the oldest supported TensorFlow (see tests/conftest.py).
pytestmark = pytest.mark.compat


def _config(**kwargs):
  return TrainConfig(model_dir="/tmp/unused", train_steps=1, **kwargs)


class MakeStrategyTest(parameterized.TestCase):

  def test_off_is_the_default_strategy(self):
    choice = backend_registry.make_strategy(strategy_lib.StrategyOptions.of(
        _config(distribution_strategy="off").strategy))
    self.assertIs(choice.strategy, tf.distribute.get_strategy())
    self.assertEqual(choice.strategy.num_replicas_in_sync, 1)

  def test_one_device_on_cpu(self):
    choice = backend_registry.make_strategy(strategy_lib.StrategyOptions.of(
        _config(distribution_strategy="one_device", num_gpus=0).strategy))
    self.assertIsInstance(choice.strategy, tf.distribute.OneDeviceStrategy)
    self.assertEqual(choice.devices, ("/cpu:0",))

  def test_mirrored_over_cpu_devices(self):
    choice = backend_registry.make_strategy(strategy_lib.StrategyOptions.of(
        _config(distribution_strategy="mirrored").strategy))
    self.assertIsInstance(choice.strategy, tf.distribute.MirroredStrategy)
    cpus = tf.config.list_logical_devices("CPU")
    self.assertEqual(choice.strategy.num_replicas_in_sync, len(cpus))
    # Variables created under the scope are mirrored.
    with choice.strategy.scope():
      v = tf.Variable(1.0)
    self.assertLen(choice.strategy.experimental_local_results(v), len(cpus))

  @parameterized.named_parameters(
      ("nccl_on_cpu", "nccl", "--all_reduce_alg=nccl needs GPUs"),
      ("ring_on_mirrored", "ring", "--all_reduce_alg=ring applies to "
       "multi_worker_mirrored"))
  def test_all_reduce_errors(self, alg, message):
    with self.assertRaisesRegex(errors.ConfigError, message):
      backend_registry.make_strategy(strategy_lib.StrategyOptions.of(
          _config(distribution_strategy="mirrored", all_reduce_alg=alg,
                  num_gpus=0).strategy))

  def test_too_many_gpus(self):
    with self.assertRaisesRegex(
        errors.ConfigError, r"--num_gpus=4 but only \d GPU"):
      backend_registry.make_strategy(strategy_lib.StrategyOptions.of(
          _config(distribution_strategy="mirrored", num_gpus=4).strategy))

  def test_auto_on_cpu_only_machine(self):
    # `auto` is decided in one place (auto_select); the factory takes the
    # concrete name.
    config = _config(distribution_strategy="auto")
    decision = auto_select.resolve(
        auto_select.SelectOptions(
            strategy=config.strategy, precision=config.precision,
            dtype_defaulted="dtype" in config.defaulted),
        cluster=cluster_lib.ClusterInfo.single_process())
    self.assertEqual(decision.strategy, "one_device")
    self.assertIn("auto: ", decision.strategy_reason)
    choice = backend_registry.make_strategy(strategy_lib.StrategyOptions.of(
        config.strategy, decisions_lib.Decisions.of(config, choice=decision)))
    self.assertEqual(choice.name, "one_device")

  def test_factory_never_sees_auto(self):
    with self.assertRaisesRegex(errors.ConfigError, "decide `auto` first"):
      backend_registry.make_strategy(strategy_lib.StrategyOptions.of(
          _config(distribution_strategy="auto").strategy))


if __name__ == "__main__":
  absltest.main()
