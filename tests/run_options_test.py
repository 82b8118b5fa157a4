"""Unit tests of tfdist.training.run_options: each converter reads the
config's own values into its part's options (the inputs' converters are in
tests/run_options_inputs_test.py)."""

import dataclasses

from absl.testing import absltest

from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.distribute import decisions as decisions_lib
from tfdist.distribute import auto_select
from tfdist.distribute import strategy as strategy_lib
from tfdist.distribute.strategy_kind import StrategyKind
from tfdist.training import run_options


def _config(**kwargs):
  return TrainConfig(model_dir="/tmp/run_options_test", **kwargs)


class ConvertersTest(absltest.TestCase):

  def test_strategy_options_carry_the_kind_and_the_cluster_settings(self):
    options = run_options.strategy_options(_config(
        distribution_strategy="mirrored", num_cpu_devices=2,
        collective_timeout_seconds=7, tpu="grpc://10.0.0.1:8470"))
    self.assertIs(options.kind, StrategyKind.MIRRORED)
    self.assertEqual(options.num_cpu_devices, 2)
    self.assertEqual(options.collective_timeout_seconds, 7)
    self.assertEqual(options.tpu.tpu, "grpc://10.0.0.1:8470")
    self.assertTrue(dataclasses.is_dataclass(options))
    with self.assertRaises(dataclasses.FrozenInstanceError):
      options.num_cpu_devices = 4

  def test_the_tpu_and_ps_parts_receive_their_sections(self):
    config = _config(distribution_strategy="tpu", tpu="grpc://127.0.0.1:1",
                     tpu_zone="z", tpu_init_timeout=2, ps_max_shards=3)
    options = run_options.strategy_options(config)
    # The sections themselves (the TPU's with its decided address).
    self.assertEqual(options.tpu, config.strategy.tpu)
    self.assertIs(options.partitioner, config.strategy.parameter_servers)
    self.assertEqual(options.partitioner.ps_max_shards, 3)
    # The strategy factory reads the TPU section by its flag names (nothing
    # listens on port 1: the connection is refused at once).
    with self.assertRaisesRegex(errors.TPUNotAvailableError,
                                "--tpu=grpc://127.0.0.1:1"):
      strategy_lib.make_strategy(options)

  def test_auto_must_be_decided_first(self):
    with self.assertRaisesRegex(errors.ConfigError, "decide `auto` first"):
      run_options.strategy_options(_config(distribution_strategy="auto"))

  def test_decisions_leave_no_auto_and_the_config_unchanged(self):
    config = _config(distribution_strategy="auto", dtype="auto")
    decision = auto_select.Decision(
        strategy=StrategyKind.ONE_DEVICE, strategy_reason="auto: test",
        dtype="fp32", dtype_reason="auto: test")
    decided = decisions_lib.Decisions.of(config, choice=decision)
    self.assertIs(decided.strategy, StrategyKind.ONE_DEVICE)
    self.assertEqual(decided.dtype, "fp32")
    self.assertEqual((config.distribution_strategy, config.dtype),
                     ("auto", "auto"))
    self.assertIs(run_options.strategy_options(config, decided).kind,
                  StrategyKind.ONE_DEVICE)
    self.assertEqual(run_options.assembly_options(config, decided).dtype,
                     "fp32")

  def test_plan_options_hold_batch_learning_rate_and_data(self):
    options = run_options.plan_options(_config(
        batch_size=48, gradient_accumulation_steps=2, warmup_steps=5,
        base_learning_rate=0.3, train_files="/d/train-*", mode="train"))
    self.assertEqual(options.batch_size, 48)
    self.assertEqual(options.gradient_accumulation_steps, 2)
    self.assertEqual(options.lr.warmup_steps, 5)
    self.assertEqual(options.lr.base_learning_rate, 0.3)
    self.assertEqual(options.data.train_files, "/d/train-*")
    self.assertFalse(options.need_eval)

  def test_task_names_and_task(self):
    config = _config(model="cnn", dataset="fashion_mnist")
    names = run_options.task_names(config)
    self.assertEqual((names.model, names.dataset), ("cnn", "fashion_mnist"))
    task = run_options.task(config)
    self.assertEqual(task.model_name, "cnn")
    self.assertEqual(run_options.dataset(config).name, "fashion_mnist")

  def test_config_paths_name_their_flags(self):
    paths = dict((flag, path) for flag, path in run_options.config_paths(
        _config(train_files="gs://b/train-*", export_dir="/tmp/export")))
    self.assertEqual(paths["--train_files"], "gs://b/train-*")
    self.assertEqual(paths["--model_dir"], "/tmp/run_options_test")

  def test_manifest_and_record_settings_come_from_the_config(self):
    config = _config(seed=3)
    self.assertEqual(run_options.run_record_settings(config)["seed"], 3)
    options = run_options.manifest_options(config)
    self.assertTrue(dataclasses.is_dataclass(options))

  def test_manifest_records_the_zero_stage_that_ran(self):
    for switches, stage in (({}, 0), ({"shard_optimizer_state": True}, 1),
                            ({"shard_optimizer_state": True,
                              "shard_gradients": True}, 2)):
      config = _config(distribution_strategy="mirrored", **switches)
      recorded = run_options.manifest_options(config).config
      self.assertEqual(recorded["zero_stage"], stage, switches)
      self.assertIsNone(config.zero_stage)  # Not given.
    config = _config(distribution_strategy="mirrored", zero_stage=1)
    self.assertEqual(run_options.manifest_options(config).config["zero_stage"],
                     1)


if __name__ == "__main__":
  absltest.main()
