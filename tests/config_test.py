"""Tests for tfdist.config: validation errors name flag, value and fix."""

import ast
import dataclasses
import os
import types
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tfdist import config
from tfdist import config_tree
from tfdist import errors
from tfdist.backends import registry as backend_registry
from tfdist.config import TrainConfig
from tfdist.distribute import auto_select
from tfdist.distribute import decisions
from tfdist.distribute import environment
from tfdist.core.strategy_kind import StrategyKind
from tfdist.observability import manifest
from tfdist.training.state import checkpointing
from tfdist.parallel.pipeline import options as pipeline_options
from tfdist.parallel.tensor import options as tensor_parallel_options

# Also run on the oldest supported TensorFlow (see tests/conftest.py).
pytestmark = pytest.mark.compat


# The built-in Transformer on its text data set (what --tensor_parallel splits).
_TRANSFORMER = dict(model="transformer", dataset="clothing_reviews")


class TrainConfigTest(parameterized.TestCase):

  def test_zero_switches_given_false_can_contradict_the_stage(self):
    base = dict(model_dir="/tmp/x", train_steps=1)
    # Unset switches take no side: --zero_stage decides.
    self.assertEqual(TrainConfig(zero_stage=2, **base).zero_stage_resolved,
                     2)
    self.assertFalse(TrainConfig(**base).shard_optimizer_state)
    self.assertEqual(TrainConfig(zero_stage=1, shard_gradients=False,
                                 **base).zero_stage_resolved, 1)
    with self.assertRaisesRegex(
        errors.ConfigError, r"^--zero_stage=2 contradicts "
        r"--shard_optimizer_state=False\. Give"):
      TrainConfig(zero_stage=2, shard_optimizer_state=False, **base)
    # Only the switches given are named.
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"^--zero_stage=1 contradicts --shard_gradients=True\."):
      TrainConfig(zero_stage=1, shard_gradients=True, **base)
    with self.assertRaisesRegex(errors.ConfigError, "contradict each other"):
      TrainConfig(shard_gradients=True, shard_optimizer_state=False, **base)
    # A replaced config keeps the switches unset.
    self.assertEqual(TrainConfig(**base).replace(zero_stage=2)
                     .zero_stage_resolved, 2)

  def test_stage_3_and_its_switch(self):
    base = dict(model_dir="/tmp/x", train_steps=1)
    self.assertEqual(TrainConfig(zero_stage=3, **base).zero_stage_resolved, 3)
    self.assertEqual(TrainConfig(shard_parameters=True, **base)
                     .zero_stage_resolved, 3)
    self.assertEqual(TrainConfig(zero_stage=3, shard_gradients=True, **base)
                     .zero_stage_resolved, 3)
    with self.assertRaisesRegex(errors.ConfigError,
                                "--zero_stage=4 is not offered"):
      TrainConfig(zero_stage=4, **base)
    with self.assertRaisesRegex(errors.ConfigError, "--zero_stage=2 contradicts"):
      TrainConfig(zero_stage=2, shard_parameters=True, **base)
    with self.assertRaisesRegex(errors.ConfigError, "contradict each other"):
      TrainConfig(shard_parameters=True, shard_gradients=False, **base)
    with self.assertRaisesRegex(errors.ConfigError,
                                "--zero_stage=3 .* --enable_xla"):
      TrainConfig(zero_stage=3, enable_xla=True, **base)
    with self.assertRaisesRegex(errors.ConfigError, "--optimizer=lamb cannot"):
      TrainConfig(shard_parameters=True, optimizer="lamb", **base)
    # The Transformer's token embedding stays replicated
    # (tfdist.parallel.zero3.replicated_variables).
    self.assertEqual(TrainConfig(zero_stage=3, dataset="clothing_reviews",
                                 **base).model, "transformer")
    with self.assertRaisesRegex(errors.ConfigError,
                                "--zero_stage=3 cannot train --model=ranking"
                                ".*ShardedEmbedding"):
      TrainConfig(zero_stage=3, model="ranking", **base)
    with self.assertRaisesRegex(errors.ConfigError,
                                "--distribution_strategy=parameter_server"):
      # The strategy's rule: its backend's, run as the run is prepared.
      backend_registry.check_strategy_rules(TrainConfig(
          zero_stage=3, distribution_strategy="parameter_server", **base))

  def test_class_weight_forms(self):
    base = dict(model_dir="/tmp/x", train_steps=1)
    want = ((0, 1.0), (1, 4.5))
    for value in ({1: 4.5, 0: 1}, "0:1,1:4.5", ["1:4.5", "0:1"],
                  [(0, 1.0), (1, 4.5)]):
      self.assertEqual(TrainConfig(class_weight=value, **base).class_weight,
                       want, value)
    self.assertEqual(TrainConfig(**base).class_weight, ())

  @parameterized.named_parameters(
      ("no_colon", "0:1,2"), ("negative_id", "-1:1"), ("fractional_id",
                                                       "1.5:1"),
      ("negative_weight", "0:-1"), ("twice", "0:1,0:2"), ("word", "cat:1"))
  def test_bad_class_weight_is_named(self, value):
    with self.assertRaisesRegex(
        errors.ConfigError, "--class_weight item .* is not "
                                "CLASS_ID:WEIGHT"):
      TrainConfig(model_dir="/tmp/x", train_steps=1, class_weight=value)

  def test_class_weight_dict_with_string_keys_is_refused(self):
    # keras.Model.fit looks weights up by int(class) and would ignore
    # these keys; tfdist applied them (a tester's case).
    with self.assertRaisesRegex(
        errors.ConfigError, r"class_weight key '0' is not a "
                                r"class id: keras.Model.fit .* ignore it"):
      TrainConfig(model_dir="/tmp/x", train_steps=1,
                  class_weight={"0": 1.0, "1": 4.0})

  def test_defaults_are_valid_and_frozen(self):
    cfg = TrainConfig(model_dir="/tmp/x", train_steps=10)
    self.assertEqual(cfg.dtype, "fp32")
    with self.assertRaises(Exception):
      cfg.model = "resnet"  # frozen

  @parameterized.named_parameters(
      ("float16", "float16", "fp16"), ("bfloat16", "bfloat16", "bf16"),
      ("float32", "float32", "fp32"), ("upper", "FP16", "fp16"),
      ("bf16", "bf16", "bf16"))
  def test_dtype_aliases(self, given, expected):
    self.assertEqual(TrainConfig(model_dir="/m", train_steps=1,
                                 dtype=given).dtype, expected)

  @parameterized.named_parameters(
      ("dynamic", "dynamic", "dynamic"), ("number", "128", 128.0),
      ("float", 64.0, 64.0))
  def test_loss_scale(self, given, expected):
    cfg = TrainConfig(model_dir="/m", train_steps=1, dtype="fp16",
                      loss_scale=given)
    self.assertEqual(cfg.loss_scale, expected)

  @parameterized.named_parameters(
      ("no_length", dict(train_steps=0, train_epochs=0),
       "--train_steps=N or --train_epochs=N"),
      ("bad_strategy", dict(distribution_strategy="horovod"),
       "--distribution_strategy='horovod' is unknown.*mirrored"),
      ("bad_dtype", dict(dtype="int8"), "--dtype='int8'"),
      ("bad_loss_scale", dict(dtype="fp16", loss_scale="-1"),
       "--loss_scale='-1'.*dynamic"),
      ("loss_scale_without_fp16", dict(loss_scale="dynamic"),
       "--loss_scale=dynamic only applies to --dtype=fp16"),
      ("both_warmups", dict(warmup_steps=10, warmup_epochs=1.0),
       "--warmup_steps=10 and --warmup_epochs=1.0 were both given"),
      ("negative_warmup", dict(warmup_steps=-5), "--warmup_steps=-5"),
      ("zero_batch", dict(batch_size=0), "--batch_size=0"),
      ("bad_scaling", dict(lr_scaling="cubic"), "--lr_scaling='cubic'"),
      ("bad_schedule", dict(lr_schedule="step"), "--lr_schedule='step'"),
      ("bad_optimizer", dict(optimizer="adagradient"),
       "--optimizer='adagradient' is unknown"),
      ("tune_allocator_not_bool", dict(tune_allocator="yes"),
       "--tune_allocator='yes' must be true or false"),
      ("piecewise_mismatch", dict(piecewise_boundaries="0.5",
                                  piecewise_multipliers="1,0.1,0.01"),
       "one more value than --piecewise_boundaries"),
      ("piecewise_order", dict(piecewise_boundaries="0.8,0.4",
                               piecewise_multipliers="1,0.1,0.01"),
       "increasing fractions"),
      ("log_steps", dict(log_steps=0), "--log_steps=0"),
      ("num_gpus", dict(num_gpus=-3), "--num_gpus=-3"),
      ("base_lr", dict(base_learning_rate=0.0), "--base_learning_rate=0.0"),
      ("transformer_layers", dict(transformer_layers=0),
       "--transformer_layers=0 must be > 0"),
      ("pipeline_stages", dict(pipeline_stages=0),
       "--pipeline_stages=0 must be a positive integer"),
      ("num_microbatches", dict(pipeline_stages=2, num_microbatches=0),
       "--num_microbatches=0 must be a positive integer"),
      ("microbatches_without_stages", dict(num_microbatches=4),
       "--num_microbatches=4 applies to a pipeline: pass "
       "--pipeline_stages=P"),
      ("pipeline_schedule", dict(pipeline_stages=2, pipeline_schedule="zb"),
       "--pipeline_schedule='zb' is unknown. Use one of: gpipe, 1f1b, "
       "interleaved"),
      ("interleaved_without_virtual_stages", dict(
          pipeline_stages=2, pipeline_schedule="interleaved"),
       r"--pipeline_schedule=interleaved needs --pipeline_virtual_stages=V "
       r">= 2 \(received 1\).*Pass --pipeline_virtual_stages=2"),
      ("virtual_stages_without_interleaved", dict(
          pipeline_stages=2, pipeline_schedule="1f1b",
          pipeline_virtual_stages=2),
       "--pipeline_virtual_stages=2 applies to --pipeline_schedule="
       "interleaved only \\(received --pipeline_schedule=1f1b\\)"),
      ("virtual_stages_without_stages", dict(
          pipeline_schedule="interleaved", pipeline_virtual_stages=2),
       "--pipeline_virtual_stages=2 applies to a pipeline: pass "
       "--pipeline_stages=P"),
      ("virtual_stages_zero", dict(pipeline_stages=2,
                                   pipeline_virtual_stages=0),
       "--pipeline_virtual_stages=0 must be a positive integer"),
      ("interleaved_microbatches", dict(
          pipeline_stages=4, pipeline_schedule="interleaved",
          pipeline_virtual_stages=2, num_microbatches=6),
       r"--num_microbatches to be a multiple of --pipeline_stages=4 "
       r"\(received --num_microbatches=6\).*Use --num_microbatches=4 or 8"),
      ("interleaved_copies", dict(
          pipeline_stages=2, pipeline_schedule="interleaved",
          pipeline_virtual_stages=2, num_cpu_devices=4),
       r"--pipeline_schedule=interleaved with --num_cpu_devices=4 \(D=2 "
       r"copies.*not built yet. Use --num_cpu_devices=2"),
      ("interleaved_cuts", dict(
          pipeline_stages=2, pipeline_schedule="interleaved",
          pipeline_virtual_stages=2, pipeline_cuts="a"),
       r"--pipeline_cuts=a makes 2 chunks but --pipeline_stages=2 x "
       r"--pipeline_virtual_stages=2 needs 4: pass 3 cut\(s\)"),
      ("cuts_and_stages", dict(pipeline_stages=2, pipeline_cuts="a,b"),
       "--pipeline_cuts=a,b makes 3 stages but --pipeline_stages=2: pass "
       "--pipeline_stages=3"),
      ("cuts_without_stages", dict(pipeline_cuts="a"),
       "--pipeline_cuts=a makes 2 stages but --pipeline_stages=1"),
      ("pipeline_mirrored", dict(pipeline_stages=2,
                                 distribution_strategy="mirrored"),
       "--pipeline_stages=2 cannot run under --distribution_strategy="
       "mirrored: a pipeline's data parallelism is D copies of the pipeline "
       "on a data x pipeline device mesh driven by one process.*"
       "--num_gpus=N or --num_cpu_devices=N"),
      ("pipeline_devices_uneven", dict(pipeline_stages=4, num_cpu_devices=6),
       "--num_cpu_devices=6 devices cannot hold whole copies of a "
       "--pipeline_stages=4 pipeline.*Use --num_cpu_devices=4 or 8"),
      ("pipeline_gpus_uneven", dict(pipeline_stages=2, num_gpus=3),
       "--num_gpus=3 devices cannot hold whole copies of a "
       "--pipeline_stages=2 pipeline"),
      ("pipeline_multi_worker", dict(
          pipeline_stages=2, distribution_strategy="multi_worker_mirrored"),
       "--pipeline_stages=2 cannot run under --distribution_strategy="
       "multi_worker_mirrored"),
      ("pipeline_parameter_server", dict(
          pipeline_stages=2, distribution_strategy="parameter_server"),
       "--pipeline_stages=2 cannot run under --distribution_strategy="
       "parameter_server"),
      ("pipeline_tpu", dict(pipeline_stages=2, distribution_strategy="tpu"),
       "--pipeline_stages=2 cannot run under --distribution_strategy=tpu"),
      ("pipeline_zero", dict(pipeline_stages=2, zero_stage=1),
       r"--pipeline_stages=2 and --zero_stage=1 \(--shard_optimizer_state\)"
       " cannot be combined"),
      # Stage 3 named its switch as stage 1's (issue 47).
      ("pipeline_zero3", dict(pipeline_stages=2, zero_stage=3),
       r"--pipeline_stages=2 and --zero_stage=3 \(--shard_parameters\) "
       "cannot be combined"),
      ("pipeline_shard_parameters", dict(pipeline_stages=2,
                                         shard_parameters=True),
       r"--pipeline_stages=2 and --zero_stage=3 \(--shard_parameters\) "
       "cannot be combined"),
      ("pipeline_xla", dict(pipeline_stages=2, enable_xla=True),
       "--enable_xla cannot compile a pipelined step"),
      ("tensor_parallel", dict(tensor_parallel=0),
       "--tensor_parallel=0 must be a positive integer"),
      # Without --model the message named the default as if the user had
      # typed it, and told a tfdist.fit user nothing of the layout map's T
      # (issue 44's new-user trial).
      ("tensor_parallel_no_model", dict(tensor_parallel=2),
       r"no --model is given \(the default, cnn, has no tensor-parallel "
       r"layers\)\. Use --model=transformer; for a model of your own, leave "
       r"--tensor_parallel out and pass tfdist\.fit\(\.\.\., layout_map="),
      ("tensor_parallel_model", dict(tensor_parallel=2, model="cnn"),
       "--tensor_parallel=2 splits the built-in Transformer.*--model=cnn "
       "has no tensor-parallel layers"),
      ("tensor_parallel_uneven", dict(_TRANSFORMER, tensor_parallel=3,
                                      num_cpu_devices=3),
       "--tensor_parallel=3 cannot split the built-in Transformer evenly: "
       "each rank takes an equal share of its 4 attention heads, 128 "
       "feed-forward units. Use --tensor_parallel=2 or 4."),
      ("tensor_parallel_multi_worker", dict(
          _TRANSFORMER, tensor_parallel=2,
          distribution_strategy="multi_worker_mirrored"),
       "--tensor_parallel=2 runs under --distribution_strategy=mirrored on "
       "one host.*sub-group collectives across workers"),
      ("tensor_parallel_devices_not_a_multiple", dict(
          _TRANSFORMER, tensor_parallel=2, num_cpu_devices=3),
       r"--tensor_parallel=2 with --num_cpu_devices=3: .* must be a "
       r"multiple of 2\. Pass --num_cpu_devices=2 or 4, or a "
       "--tensor_parallel that divides 3"),
      # Under ZeRO the counts offered give D >= 2 copies (2 would be
      # refused next: nothing to shard).
      ("tensor_parallel_zero_devices_not_a_multiple", dict(
          _TRANSFORMER, tensor_parallel=2, num_cpu_devices=3, zero_stage=1),
       r"--tensor_parallel=2 with --num_cpu_devices=3: .* must be a "
       r"multiple of 2\. Pass --num_cpu_devices=4, or a "
       "--tensor_parallel that divides 3"),
      ("tensor_parallel_gpus_not_a_multiple", dict(
          _TRANSFORMER, tensor_parallel=4, num_gpus=6),
       "--tensor_parallel=4 with --num_gpus=6: .* Pass --num_gpus=4 or 8"),
      ("tensor_parallel_zero3", dict(_TRANSFORMER, tensor_parallel=2,
                                     zero_stage=3,
                                     distribution_strategy="mirrored"),
       r"--tensor_parallel=2 cannot run with --zero_stage=3 "
       r"\(--shard_parameters\): .* Use --zero_stage=1 or 2"),
      ("tensor_parallel_zero_one_copy", dict(
          _TRANSFORMER, tensor_parallel=2, shard_optimizer_state=True,
          distribution_strategy="mirrored"),
       r"--tensor_parallel=2 with --zero_stage=1 \(--shard_optimizer_state"
       r"\) on 2 replicas: .* \(D = 1\).* Pass --num_cpu_devices=4"),
      ("tensor_parallel_pipeline", dict(_TRANSFORMER, tensor_parallel=2,
                                        pipeline_stages=2),
       r"--tensor_parallel=2 with --pipeline_stages=2 needs a Keras "
       r"LayoutMap: .*without one \(--model=transformer\) .*attention by "
       r"heads .*Pass tfdist.fit\(model_fn, ..., layout_map=.*or drop "
       r"--pipeline_stages .* or --tensor_parallel"),
      ("tensor_parallel_pipeline_devices", dict(
          tensor_parallel=2, pipeline_stages=2, num_cpu_devices=6,
          layout_map_entries=(("block_2/kernel", "None,model"),)),
       r"--num_cpu_devices=6 devices cannot hold whole copies of a "
       r"--pipeline_stages=2 pipeline whose stages each split over "
       r"--tensor_parallel=2 devices: pass --num_cpu_devices a multiple of "
       r"4"),
      # tfdist.fit's layout map set T (config_changes): the refusal named
      # --tensor_parallel, which the user never gave (a new-user trial).
      ("layout_map_fp16", dict(
          tensor_parallel=2, num_cpu_devices=2, dtype="fp16",
          layout_map_entries=(("up/kernel", "(None, 'model')"),)),
       r"^layout_map \(its DeviceMesh's 'model' axis: T = 2\) cannot run "
       r"with --dtype=fp16"),
      # --layout_map names the function whose map sets T: the refusal
      # names the flag and its value.
      ("layout_map_flag_fp16", dict(
          tensor_parallel=2, num_cpu_devices=2, dtype="fp16",
          layout_map="my_project.mlp:layout_map"),
       r"^--layout_map=my_project.mlp:layout_map \(its DeviceMesh's 'model' "
       r"axis: T = 2\) cannot run with --dtype=fp16"),
      ("layout_map_not_an_import_path", dict(layout_map="layout_map"),
       r"^--layout_map='layout_map' is not an import path: write "
       r"package.module:function"),
      ("tensor_parallel_fp16", dict(_TRANSFORMER, tensor_parallel=2,
                                    dtype="fp16"),
       "--tensor_parallel=2 cannot run with --dtype=fp16"),
      ("tensor_parallel_clipnorm", dict(_TRANSFORMER, tensor_parallel=2,
                                        global_clipnorm=1.0),
       "--tensor_parallel=2 cannot run with --global_clipnorm=1.0"),
  )
  def test_errors(self, changes, message):
    kwargs = dict(model_dir="/m", train_steps=10)
    kwargs.update(changes)
    with self.assertRaisesRegex(errors.ConfigError, message):
      TrainConfig(**kwargs)

  def test_tensor_parallel_inside_pipeline_stages_is_accepted(self):
    # D x P x T = 2 x 2 x 2 with a layout map (`tfdist.fit` records its
    # entries): N = 8 devices, D = 8 / (P x T).
    config = TrainConfig(model_dir="/m", train_steps=1, tensor_parallel=2,
                         pipeline_stages=2, num_cpu_devices=8,
                         layout_map_entries=(("block_2/kernel",
                                              "None,model"),))
    options = pipeline_options.PipelineOptions.of(
        config.strategy.parallelism, num_gpus=config.num_gpus,
        num_cpu_devices=config.num_cpu_devices)
    self.assertEqual((options.data, options.num_stages, options.tensor),
                     (2, 2, 2))
    self.assertEqual(options.mesh().describe(),
                     "data 2 x pipeline 2 x tensor 2 over 8 devices")

  def test_tensor_parallel_beside_data_parallelism_is_accepted(self):
    # D x T = 2 x 2: the replicas are two data-parallel copies of 2.
    config = TrainConfig(model_dir="/m", train_steps=1, tensor_parallel=2,
                         num_cpu_devices=4, **_TRANSFORMER)
    self.assertEqual(tensor_parallel_options.replicas(
        config.tensor_parallel, num_gpus=config.num_gpus,
        num_cpu_devices=config.num_cpu_devices), 4)
    self.assertEqual(tensor_parallel_options.replicas(
        2, num_gpus=-1, num_cpu_devices=0), 2)

  def test_tensor_parallel_is_offered_only_where_it_divides(self):
    self.assertEqual(
        [n for n in range(1, 6)
         if tensor_parallel_options.flags_for("transformer", n)], [2, 4])
    self.assertEqual(tensor_parallel_options.flags_for("cnn", 2), "")

  def test_pipeline_fields(self):
    config = TrainConfig(model_dir="/m", train_steps=1, pipeline_stages=3,
                         pipeline_cuts="block_3, block_6",
                         distribution_strategy="one_device")
    self.assertEqual(config.pipeline_cuts, ("block_3", "block_6"))
    self.assertIsNone(config.num_microbatches)  # P, once resolved.
    self.assertEqual(config.pipeline_virtual_stages, 1)

  def test_interleaved_plan_line_names_the_schedule_and_v(self):
    config = TrainConfig(model_dir="/m", train_steps=1, pipeline_stages=2,
                         pipeline_schedule="interleaved",
                         pipeline_virtual_stages=2, num_microbatches=4,
                         distribution_strategy="one_device")
    options = pipeline_options.PipelineOptions.of(
        config.strategy.parallelism)
    self.assertEqual(
        options.describe(),
        "2 stages (balanced by weight and activation bytes), 4 "
        "micro-batches per step, interleaved (V=2 virtual stages: 4 "
        "chunks, chunk c on stage c mod 2) schedule; batch normalization "
        "sees micro-batches")
    self.assertEqual(options.to_dict()["virtual_stages"], 2)
    self.assertNotIn("virtual_stages", pipeline_options.PipelineOptions(
        num_stages=2, num_microbatches=2).to_dict())

  def test_no_model_dir(self):
    # Checked once the environment is applied (Vertex may supply it).
    with self.assertRaisesRegex(errors.ConfigError, "--model_dir is required"):
      TrainConfig(model_dir="", train_steps=10).require_model_dir()

  def test_vertex_environment_fills_output_folders(self):
    env = {"AIP_MODEL_DIR": "gs://b/model/",
           "AIP_CHECKPOINT_DIR": "gs://b/checkpoints/",
           "AIP_TENSORBOARD_LOG_DIR": "gs://b/logs/"}
    cfg, applied = environment.apply_environment(
        TrainConfig(train_steps=1), environment.read_environment(env))
    self.assertEqual(cfg.model_dir, "gs://b/checkpoints/")
    self.assertEqual(cfg.resolved_checkpoint_dir, "gs://b/checkpoints/")
    self.assertEqual(cfg.resolved_tensorboard_dir, "gs://b/logs/")
    self.assertEqual(cfg.resolved_export_dir, "gs://b/model/")
    self.assertIn(("model_dir", "AIP_CHECKPOINT_DIR"), applied)

  def test_explicit_model_dir_wins_over_vertex(self):
    cfg, _ = environment.apply_environment(
        TrainConfig(model_dir="/local", train_steps=1),
        environment.read_environment({"AIP_MODEL_DIR": "gs://b/model/"}))
    self.assertEqual(cfg.model_dir, "/local")
    self.assertEqual(cfg.resolved_checkpoint_dir, "/local/checkpoints")

  def test_config_is_pure(self):
    # The same arguments give the same config whatever the environment.
    env = {"AIP_MODEL_DIR": "gs://b/model/", "TPU_NAME": "t1"}
    with mock.patch.dict(os.environ, env):
      cfg = TrainConfig(train_steps=1)
    self.assertEqual((cfg.model_dir, cfg.export_dir, cfg.tpu), ("", "", ""))

  def test_tpu_name_fills_tpu(self):
    cfg, applied = environment.apply_environment(
        TrainConfig(model_dir="/m", train_steps=1),
        environment.read_environment({"TPU_NAME": "my-tpu"}))
    self.assertEqual(cfg.tpu, "my-tpu")
    self.assertIn(("tpu", "TPU_NAME"), applied)

  def test_default_data_dir(self):
    env = environment.read_environment({"HOME": "/home/u"})
    self.assertEqual(env.default_data_dir, "/home/u/.cache/tfdist/datasets")
    env = environment.read_environment({"TFDIST_DATA_DIR": "/d",
                                        "HOME": "/home/u"})
    self.assertEqual(env.default_data_dir, "/d")

  @parameterized.named_parameters(
      ("library", {}, {"model": "ranking", "batch_size": 512,
                       "optimizer": "adam"}),
      ("caller_wins", {"optimizer": "sgd", "model": "cnn"},
       {"model": "cnn", "optimizer": "sgd", "batch_size": 512}),
      ("per_replica_given", {"per_replica_batch_size": 64},
       {"batch_size": None, "per_replica_batch_size": 64}))
  def test_dataset_recommendations_apply_to_library_users(self, given,
                                                          expected):
    cfg = TrainConfig(model_dir="/m", train_steps=1, dataset="movielens",
                      **given)
    for name, value in expected.items():
      self.assertEqual(getattr(cfg, name), value, name)
    for name in given:
      self.assertNotIn(name, cfg.unset_fields)

  def test_replace_brings_the_new_datasets_recommendations(self):
    cfg = TrainConfig(model_dir="/m", train_steps=1)
    self.assertEqual((cfg.model, cfg.optimizer), ("cnn", "sgd"))
    movielens = cfg.replace(dataset="movielens")
    self.assertEqual((movielens.model, movielens.optimizer,
                      movielens.lr_scaling), ("ranking", "adam", "sqrt"))
    back = movielens.replace(dataset="fashion_mnist")
    self.assertEqual((back.model, back.optimizer, back.batch_size),
                     ("cnn", "sgd", None))

  def test_to_dict_is_json_ready(self):
    d = TrainConfig(model_dir="/m", train_steps=3).to_dict()
    self.assertEqual(d["train_steps"], 3)
    self.assertEqual(d["piecewise_multipliers"], [1.0, 0.1, 0.01])

  def test_normalize_dtype_error_lists_choices(self):
    with self.assertRaisesRegex(errors.ConfigError, "bfloat16.*fp16"):
      config.normalize_dtype("half")


if __name__ == "__main__":
  absltest.main()


class TraitsTest(absltest.TestCase):
  """Every setting states its traits; the name lists are derived from them."""

  def test_every_setting_states_its_traits(self):
    unstated = [name for name, field in config.flat_fields().items()
                if name not in config.BOOKKEEPING_FIELDS and
                config_tree.traits_of(field) is None]
    self.assertEqual(unstated, [])

  def test_a_setting_without_traits_is_caught(self):
    # The check above, on a section with a setting that states none.
    @dataclasses.dataclass(frozen=True)
    class Section:
      stated: int = config_tree.setting(1, "integer", "g", help="h",
                                        traits=())
      unstated: int = config_tree.setting(1, "integer", "g", help="h")

    self.assertEqual([f.name for _, f in config_tree.settings(Section)
                      if config_tree.traits_of(f) is None], ["unstated"])
    with self.assertRaisesRegex(ValueError, "traits=\\('fast',\\)"):
      config_tree.setting(1, "integer", "g", help="h", traits=("fast",))

  def test_the_lists_are_derived_from_the_traits(self):
    self.assertEqual(config.settings_with("output_folder"),
                     ("model_dir", "checkpoint_dir", "tensorboard_dir",
                      "export_dir"))
    self.assertEqual(checkpointing.MODEL_FIELDS,
                     config.settings_with("model"))
    self.assertIn("zero3_blocks", checkpointing.OPERATIONAL_FIELDS)
    self.assertEqual(set(decisions.DECIDED_FIELDS),
                     {"model_dir", "checkpoint_dir", "tensorboard_dir",
                      "export_dir", "train_files", "eval_files", "data_dir",
                      "tpu", "distribution_strategy", "dtype", "loss_scale",
                      "steps_per_execution"})

  def _record(self, **changes):
    run = TrainConfig(model_dir="/tmp/x", train_steps=4, optimizer="adamw",
                      distribution_strategy="mirrored", zero_stage=3,
                      **changes)
    plan = types.SimpleNamespace(
        global_batch_size=64, batch=types.SimpleNamespace(
            num_replicas_in_sync=2, per_replica_batch_size=32),
        total_steps=4, steps_per_epoch=10, strategy="mirrored",
        eval_batch_size=64, lr=types.SimpleNamespace(
            warmup_steps=0, peak_learning_rate=0.1))
    return checkpointing.run_record(manifest.recorded_config(run), plan)

  def test_resuming_with_other_zero3_blocks_is_no_changed_setting(self):
    # How stage 3 gathers the weights (blocks, prefetch) trains the same
    # weights, as --pipeline_stages' layout does: not a changed setting.
    before = self._record(zero3_blocks=4, zero3_prefetch=False)
    for changes in ({"zero3_blocks": 2}, {"zero3_prefetch": True},
                    {"zero3_blocks": 1, "zero3_prefetch": True}):
      self.assertEqual(checkpointing.check_resume(
          before, self._record(**changes), checkpoint="ckpt-2",
          restored_step=2), [], changes)
    # A setting that changes what is trained is still reported.
    self.assertEqual(checkpointing.check_resume(
        before, self._record(seed=7), checkpoint="ckpt-2", restored_step=2),
        ["--seed 42 -> 7"])


class DecisionsTest(absltest.TestCase):
  """Decisions are records built from the sections, with the config's rules
  run on the decided values and the config left as given."""

  def _choice(self, strategy, dtype="fp32", reason="auto: test"):
    return auto_select.Decision(
        strategy=StrategyKind.parse(strategy), strategy_reason=reason,
        dtype=dtype, dtype_reason="auto: test")

  def test_auto_decided_values_meet_the_decided_backends_rules(self):
    cfg = TrainConfig(model_dir="/m", train_steps=1, bytes_per_pack=1024)
    self.assertEqual(backend_registry.check_strategy_rules(
        cfg, decisions.Decisions.of(
            cfg, choice=self._choice("multi_worker_mirrored"))).strategy,
                     StrategyKind.MULTI_WORKER_MIRRORED)
    with self.assertRaisesRegex(
        errors.ConfigError, r"^--bytes_per_pack=1024 applies to "
        r"multi_worker_mirrored, not mirrored"):
      backend_registry.check_strategy_rules(cfg, decisions.Decisions.of(
          cfg, choice=self._choice("mirrored")))
    self.assertEqual(cfg.distribution_strategy, "auto")

  def test_reduction_server_names_how_auto_decided(self):
    cfg = TrainConfig(model_dir="/m", train_steps=1, reduction_server=True)
    with self.assertRaisesRegex(
        errors.ConfigError, r"resolved to one_device \(auto: one GPU\)"):
      backend_registry.check_strategy_rules(cfg, decisions.Decisions.of(
          cfg, choice=self._choice("one_device", reason="auto: one GPU")))
    with self.assertRaisesRegex(
        errors.ConfigError, r"^--reduction_server needs --distribution_"
        r"strategy=multi_worker_mirrored or auto .*received "
        r"--distribution_strategy=mirrored\.$"):
      backend_registry.check_strategy_rules(TrainConfig(
          model_dir="/m", train_steps=1, reduction_server=True,
          distribution_strategy="mirrored"))

  def test_the_flag_values_map_the_records(self):
    cfg = TrainConfig(model_dir="/m", train_steps=1, loss_scale="64",
                      dtype="auto", checkpoint_dir="/c")
    decided = decisions.Decisions.of(
        cfg, choice=dataclasses.replace(self._choice("tpu", dtype="bf16"),
                                        tpu="t1"),
        changes={"train_files": "/aip/t-*", "data_dir": "/d"})
    self.assertEqual(decided.field_values(), {
        "data_dir": "/d", "train_files": "/aip/t-*", "eval_files": "",
        "model_dir": "/m", "checkpoint_dir": "/c", "tensorboard_dir": "",
        "export_dir": "", "distribution_strategy": "tpu", "tpu": "t1",
        "steps_per_execution": config.TPU_DEFAULT_STEPS_PER_EXECUTION,
        "dtype": "bf16", "loss_scale": None})
    self.assertEqual((decided.checkpoint_dir, decided.export_dir,
                      decided.tensorboard_dir), ("/c", "/m/saved_model", "/m"))
    self.assertEqual((cfg.dtype, cfg.loss_scale, cfg.train_files),
                     ("auto", 64.0, ""))

  def test_auto_is_refused_without_a_choice(self):
    with self.assertRaisesRegex(errors.ConfigError, "decide `auto` first"):
      decisions.Decisions.of(TrainConfig(model_dir="/m", train_steps=1))


class DecidedRulesTest(absltest.TestCase):

  def test_zero_stage_3_is_refused_where_auto_decided_one_device(self):
    cfg = TrainConfig(model_dir="/m", train_steps=1, zero_stage=3)
    choice = auto_select.Decision(
        strategy=StrategyKind.ONE_DEVICE, strategy_reason="auto: test",
        dtype="fp32", dtype_reason="test")
    with self.assertRaisesRegex(
        errors.ConfigError, r"^--zero_stage=3 \(--shard_parameters\) "
        r"runs under mirrored or multi_worker_mirrored; received "
        r"--distribution_strategy=one_device"):
      backend_registry.check_strategy_rules(
          cfg, decisions.Decisions.of(cfg, choice=choice))


# --- flat reads outside the flag edge --------------------------------------
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the flat names belong (issue 43: "the flat names at the flag edge
# and for tfdist.fit keywords only"): the binary's flags, `tfdist.fit`, and
# the root config that installs the flat properties and runs the
# cross-section rules on them (`_DecidedView` answers decided values by
# flat name), with the parallelism section's module, which runs the parallel
# modes' checks across sections for it.
FLAT_EDGE = ("tfdist/train.py", "tfdist/api.py", "flags/",
             "tfdist/config/root.py", "tfdist/config/parallelism.py",
             "tfdist/config_tree.py")
# Flat reads left in library code: none (every module reads its sections).
MAX_FLAT_READS = 0


def _is_config(node, annotated=frozenset()) -> bool:
  """`config`, `self.config`, `run.config`, `base_config`, ... or an
  argument annotated `TrainConfig` (`annotated`): a name that holds a
  `TrainConfig`."""
  name = (node.id if isinstance(node, ast.Name) else
          node.attr if isinstance(node, ast.Attribute) else None)
  return bool(name) and (name == "config" or name.endswith("_config") or
                         (isinstance(node, ast.Name) and name in annotated))


def _annotated_configs(tree) -> frozenset:
  """The names of arguments annotated `TrainConfig` in `tree`."""
  return frozenset(
      node.arg for node in ast.walk(tree) if isinstance(node, ast.arg) and
      node.annotation is not None and
      ast.unparse(node.annotation).endswith("TrainConfig"))


def flat_reads(source: str) -> list:
  """`[(line, name)]`: each read of a flat setting off a config
  (`config.batch_size`, `getattr(config, "batch_size", ...)`); a read
  through its section (`config.loop.batch_size`) is none."""
  names = set(config.flat_fields()) - set(config.BOOKKEEPING_FIELDS)
  tree = ast.parse(source)
  annotated = _annotated_configs(tree)
  found = []
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and node.attr in names and
        isinstance(node.ctx, ast.Load) and
        _is_config(node.value, annotated)):
      found.append((node.lineno, node.attr))
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and
          node.func.id == "getattr" and len(node.args) >= 2 and
          _is_config(node.args[0], annotated) and
          isinstance(node.args[1], ast.Constant) and
          node.args[1].value in names):
      found.append((node.lineno, node.args[1].value))
  return sorted(found)


def flat_reads_outside_edge(root: str = _ROOT) -> dict:
  """`{path: [(line, name)]}` over tfdist/ and models/, outside
  `FLAT_EDGE`."""
  out = {}
  for package in ("tfdist", "models"):
    for folder, dirs, files in os.walk(os.path.join(root, package)):
      dirs[:] = sorted(d for d in dirs if d != "__pycache__")
      for name in sorted(files):
        path = os.path.join(folder, name)
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        if not name.endswith(".py") or rel.startswith(FLAT_EDGE):
          continue
        with open(path) as f:
          found = flat_reads(f.read())
        if found:
          out[rel] = found
  return out


class FlatReadsTest(absltest.TestCase):
  """Library code reads settings through their sections."""

  def test_few_flat_reads_outside_the_flag_edge(self):
    found = flat_reads_outside_edge()
    total = sum(len(reads) for reads in found.values())
    listing = "\n".join(f"{path}:{line}: config.{name}"
                        for path, reads in sorted(found.items())
                        for line, name in reads)
    self.assertLessEqual(
        total, MAX_FLAT_READS,
        "flat setting reads outside the flag edge: read the section "
        "(config.loop.batch_size), or hand the part its section:\n"
        + listing)

  def test_the_count_finds_each_form(self):
    source = ("a = config.batch_size\n"
              "b = self.config.loop.batch_size\n"
              "c = run.config.dtype\n"
              "d = getattr(config, 'transformer_experts', 0)\n"
              "e = options.batch_size\n"
              "f = config.loop\n"
              "g = base_config.model_dir\n"
              "h = config.defaulted\n"
              "def f(base: TrainConfig):\n"
              "  return base.seed, base.loop.seed\n")
    self.assertEqual(flat_reads(source),
                     [(1, "batch_size"), (3, "dtype"),
                      (4, "transformer_experts"), (7, "model_dir"),
                      (10, "seed")])
