"""Unit tests of each part's options built from the config's sections
(`StrategyOptions.of`, `SelectOptions`, `prepare.plan_options`,
`prepare.assembly_options`, the task section read by `task.from_names`,
`preflight.decided_outputs`)
and of the records that list the whole run (`manifest.recorded_config`,
`ManifestOptions.of`, `filesystems.config_paths`)."""

import dataclasses

from absl.testing import absltest
import tensorflow as tf

from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.data import filesystems
from tfdist.distribute import decisions as decisions_lib
from tfdist.distribute import auto_select
from tfdist.distribute import strategy as strategy_lib
from tfdist.experiment import prepare
from tfdist.backends import registry as backend_registry
from tfdist.core.strategy_kind import StrategyKind
from tfdist.observability import manifest
from tfdist.parallel.pipeline import options as pipeline_options
from tfdist.training import assembly
from tfdist.training.plan import preflight
from tfdist.training.plan import run_plan
from tfdist.training import task as task_lib


def _config(**kwargs):
  return TrainConfig(model_dir="/tmp/section_options_test", **kwargs)


def _strategy_options(config, decisions=None):
  return strategy_lib.StrategyOptions.of(
      config.strategy, decisions,
      reduction_server=config.cloud.reduction_server)


class SectionOptionsTest(absltest.TestCase):

  def test_strategy_options_carry_the_kind_and_the_cluster_settings(self):
    config = _config(
        distribution_strategy="mirrored", num_cpu_devices=2,
        collective_timeout_seconds=7, tpu="grpc://10.0.0.1:8470")
    options = _strategy_options(config)
    self.assertIs(options.kind, StrategyKind.MIRRORED)
    # The section itself, nothing restated: the backends read it as is.
    self.assertIs(options.strategy, config.strategy)
    self.assertEqual(options.strategy.num_cpu_devices, 2)
    self.assertEqual(options.strategy.cluster.collective_timeout_seconds, 7)
    self.assertEqual(options.tpu.tpu, "grpc://10.0.0.1:8470")
    self.assertTrue(dataclasses.is_dataclass(options))
    with self.assertRaises(dataclasses.FrozenInstanceError):
      options.kind = StrategyKind.ONE_DEVICE

  def test_the_tpu_and_ps_parts_receive_their_sections(self):
    config = _config(distribution_strategy="tpu", tpu="grpc://127.0.0.1:1",
                     tpu_zone="z", tpu_init_timeout=2, ps_max_shards=3)
    options = _strategy_options(config)
    # The sections themselves (the TPU's with its decided address).
    self.assertEqual(options.tpu, config.strategy.tpu)
    self.assertIs(options.strategy.parameter_servers,
                  config.strategy.parameter_servers)
    self.assertEqual(options.strategy.parameter_servers.ps_max_shards, 3)
    # The TPU backend reads the TPU section by its flag names (nothing
    # listens on port 1: the connection is refused at once).
    with self.assertRaisesRegex(errors.TPUNotAvailableError,
                                "--tpu=grpc://127.0.0.1:1"):
      backend_registry.make_strategy(options)

  def test_auto_must_be_decided_first(self):
    with self.assertRaisesRegex(errors.ConfigError, "decide `auto` first"):
      _strategy_options(_config(distribution_strategy="auto"))

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
    self.assertIs(_strategy_options(config, decided).kind,
                  StrategyKind.ONE_DEVICE)
    self.assertEqual(prepare.assembly_options(config, decided).dtype, "fp32")

  def test_zero3_block_settings_reach_the_sharding(self):
    config = _config(zero_stage=3, zero3_blocks=1, zero3_prefetch=True)
    options = prepare.assembly_options(config, None)
    sharding = assembly._sharding_for(  # pylint: disable=protected-access
        options, strategy=tf.distribute.MirroredStrategy(["/cpu:0"]))
    self.assertEqual((sharding.stage, sharding.num_blocks, sharding.prefetch),
                     (3, 1, True))
    with self.assertRaisesRegex(errors.ConfigError,
                                "--zero3_blocks=0 must be a positive"):
      _config(zero3_blocks=0)

  def test_plan_options_hold_the_sections_as_the_config_does(self):
    config = _config(
        batch_size=48, gradient_accumulation_steps=2, warmup_steps=5,
        base_learning_rate=0.3, train_files="/d/train-*", mode="train")
    options = prepare.plan_options(config, None)
    # Each section handed over as it is, not restated field by field.
    for name in ("loop", "task", "precision", "memory", "strategy"):
      self.assertIs(getattr(options, name), getattr(config, name), name)
    self.assertIs(options.lr, config.optimization.learning_rate)
    self.assertEqual(options.loop.batch_size, 48)
    self.assertEqual(options.loop.gradient_accumulation_steps, 2)
    self.assertEqual(options.lr.warmup_steps, 5)
    self.assertEqual(options.data.train_files, "/d/train-*")
    self.assertFalse(options.need_eval)
    self.assertFalse(run_plan.PlanOptions(
        data=config.task.data, lr=options.lr).pipeline.enabled)

  def test_task_names_and_task(self):
    config = _config(model="cnn", dataset="fashion_mnist")
    names = config.task  # The section itself: no converter.
    self.assertEqual((names.model, names.data.dataset),
                     ("cnn", "fashion_mnist"))
    task = task_lib.from_names(names)
    self.assertEqual(task.model_name, "cnn")
    self.assertEqual(task_lib.dataset_from_names(names).name, "fashion_mnist")

  def test_config_paths_name_their_flags(self):
    paths = dict((flag, path) for flag, path in filesystems.config_paths(
        _config(train_files="gs://b/train-*", export_dir="/tmp/export")))
    self.assertEqual(paths["--train_files"], "gs://b/train-*")
    self.assertEqual(paths["--model_dir"], "/tmp/section_options_test")

  def test_manifest_and_record_settings_come_from_the_config(self):
    config = _config(seed=3)
    self.assertEqual(manifest.recorded_config(config)["seed"], 3)
    options = manifest.ManifestOptions.of(config)
    self.assertTrue(dataclasses.is_dataclass(options))

  def test_manifest_records_the_zero_stage_that_ran(self):
    for switches, stage in (({}, 0), ({"shard_optimizer_state": True}, 1),
                            ({"shard_optimizer_state": True,
                              "shard_gradients": True}, 2)):
      config = _config(distribution_strategy="mirrored", **switches)
      recorded = manifest.ManifestOptions.of(config).config
      self.assertEqual(recorded["zero_stage"], stage, switches)
      self.assertIsNone(config.zero_stage)  # Not given.
    config = _config(distribution_strategy="mirrored", zero_stage=1)
    self.assertEqual(manifest.ManifestOptions.of(config).config["zero_stage"],
                     1)


  def test_each_part_reads_only_its_sections(self):
    config = _config(distribution_strategy="auto", dtype="auto",
                     num_gpus=0, pipeline_stages=2, num_microbatches=None,
                     model="cnn", hptune_metric="eval_loss",
                     checkpoint_dir="/c")
    select = auto_select.SelectOptions(
        strategy=config.strategy, precision=config.precision,
        dtype_defaulted=True)
    # auto reads the two sections as they are, nothing restated.
    self.assertIs(select.strategy, config.strategy)
    self.assertIs(select.precision, config.precision)
    self.assertEqual((select.requested, select.dtype_defaulted),
                     ("auto", True))
    pipeline = pipeline_options.PipelineOptions.of(
        config.strategy.parallelism)
    self.assertEqual((pipeline.num_stages, pipeline.num_microbatches,
                      pipeline.microbatches_defaulted), (2, 2, True))
    preflight.check_names(config.task, config.cloud)  # Sections as they are.
    outputs = preflight.decided_outputs(config.outputs)
    self.assertIs(outputs, config.outputs)  # The section itself.
    self.assertEqual((outputs.checkpoint_dir, outputs.resolved_checkpoint_dir,
                      outputs.resolved_export_dir),
                     ("/c", "/c", "/tmp/section_options_test/saved_model"))

  def test_decided_folders_and_files_replace_the_sections(self):
    config = _config(distribution_strategy="one_device", dtype="fp32",
                     train_files="/given/train-*")
    # As the environment's folders and files are decided (Vertex AI's
    # AIP_* variables): into the decisions, the config unchanged.
    decided = dataclasses.replace(
        decisions_lib.Decisions.of(config, changes=dict(
            model_dir="/aip/model", checkpoint_dir="/aip/ckpt",
            export_dir="/aip/export", train_files="/aip/train-*")),
        precision=decisions_lib.PrecisionDecision(dtype="bf16"),
        accelerator=decisions_lib.TpuDecision(steps_per_execution=9))
    self.assertEqual((config.model_dir, config.train_files),
                     ("/tmp/section_options_test", "/given/train-*"))
    outputs = preflight.decided_outputs(config.outputs, decided)
    self.assertEqual((outputs.model_dir, outputs.resolved_checkpoint_dir,
                      outputs.resolved_export_dir),
                     ("/aip/model", "/aip/ckpt", "/aip/export"))
    self.assertEqual(run_plan.decided_data(config.task.data, decided)
                     .train_files, "/aip/train-*")
    self.assertIs(run_plan.decided_data(config.task.data), config.task.data)
    options = prepare.assembly_options(config, decided)
    self.assertEqual((options.dtype, options.steps_per_execution),
                     ("bf16", 9))
    own = prepare.assembly_options(config, None)
    self.assertEqual(own.dtype, "fp32")
    self.assertIs(own.builder_config.task, config.task)


if __name__ == "__main__":
  absltest.main()
