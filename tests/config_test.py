"""Tests for tfdist.config: validation errors name flag, value and fix."""

import os
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized

from tfdist import config
from tfdist.config import ConfigError, TrainConfig


class TrainConfigTest(parameterized.TestCase):

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
      ("no_model_dir", dict(model_dir=""), "--model_dir is required"),
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
      ("bad_optimizer", dict(optimizer="adagrad"), "--optimizer='adagrad'"),
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
  )
  def test_errors(self, changes, message):
    kwargs = dict(model_dir="/m", train_steps=10)
    kwargs.update(changes)
    with self.assertRaisesRegex(ConfigError, message):
      TrainConfig(**kwargs)

  def test_vertex_environment_fills_output_folders(self):
    env = {"AIP_MODEL_DIR": "gs://b/model/",
           "AIP_CHECKPOINT_DIR": "gs://b/checkpoints/",
           "AIP_TENSORBOARD_LOG_DIR": "gs://b/logs/"}
    with mock.patch.dict(os.environ, env):
      cfg = TrainConfig(train_steps=1)
    self.assertEqual(cfg.model_dir, "gs://b/checkpoints/")
    self.assertEqual(cfg.resolved_checkpoint_dir, "gs://b/checkpoints/")
    self.assertEqual(cfg.resolved_tensorboard_dir, "gs://b/logs/")
    self.assertEqual(cfg.resolved_export_dir, "gs://b/model/")

  def test_explicit_model_dir_wins_over_vertex(self):
    with mock.patch.dict(os.environ, {"AIP_MODEL_DIR": "gs://b/model/"}):
      cfg = TrainConfig(model_dir="/local", train_steps=1)
    self.assertEqual(cfg.model_dir, "/local")
    self.assertEqual(cfg.resolved_checkpoint_dir, "/local/checkpoints")

  def test_to_dict_is_json_ready(self):
    d = TrainConfig(model_dir="/m", train_steps=3).to_dict()
    self.assertEqual(d["train_steps"], 3)
    self.assertEqual(d["piecewise_multipliers"], [1.0, 0.1, 0.01])

  def test_normalize_dtype_error_lists_choices(self):
    with self.assertRaisesRegex(ConfigError, "bfloat16.*fp16"):
      config.normalize_dtype("half")


if __name__ == "__main__":
  absltest.main()
