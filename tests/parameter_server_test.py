"""Tests for tfdist.distribute.parameter_server: roles, partitioners, shard checks.

No cluster here (see ps_training_test.py for real clusters).
"""

import json
import os
import tempfile

from absl.testing import absltest
from absl.testing import flagsaver
from absl.testing import parameterized
import keras
import pytest
import tensorflow as tf

from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.distribute import auto_select
from tfdist.distribute import cluster as cluster_lib
from tfdist.distribute import parameter_server as ps_lib
from tfdist.distribute import sharded_embedding

# Also run on the oldest supported TensorFlow (see tests/conftest.py).
pytestmark = pytest.mark.compat


def _tf_config(task_type, index=0, ps=2):
  return json.dumps({
      "cluster": {"chief": ["127.0.0.1:1"],
                  "worker": ["127.0.0.1:2", "127.0.0.1:3"],
                  "ps": [f"127.0.0.1:{4 + i}" for i in range(ps)]},
      "task": {"type": task_type, "index": index}})


def _cluster(text: str):
  return cluster_lib.resolve_cluster(environ={"TF_CONFIG": text})


class RolesTest(parameterized.TestCase):
  """Roles come from tfdist.distribute.cluster (the one TF_CONFIG parser)."""

  @parameterized.named_parameters(
      ("chief", "chief", 0), ("master", "master", 0), ("worker", "worker", 1),
      ("ps", "ps", 1), ("evaluator", "evaluator", 0))
  def test_current_task(self, task_type, index):
    info = _cluster(_tf_config(task_type, index))
    expected = "chief" if task_type == "master" else task_type
    self.assertEqual((info.task_type, info.task_index), (expected, index))

  def test_no_tf_config_is_chief(self):
    info = cluster_lib.resolve_cluster(environ={})
    self.assertEqual((info.task_type, info.task_index), ("chief", 0))
    self.assertEqual(info.num_ps, 0)

  def test_unknown_role(self):
    with self.assertRaisesRegex(errors.ConfigError, "driver"):
      _cluster(_tf_config("driver"))

  def test_uses_parameter_server(self):
    config = TrainConfig(model_dir="/tmp/x", train_steps=1,
                         distribution_strategy="auto")

    def decided(cfg, text):
      options = auto_select.SelectOptions(
          strategy=cfg.strategy, precision=cfg.precision,
          dtype_defaulted="dtype" in cfg.defaulted)
      return auto_select.resolve(options,
                                 cluster=_cluster(text)).strategy

    self.assertEqual(decided(config, _tf_config("chief")),
                     "parameter_server")
    self.assertNotEqual(decided(config, _tf_config("chief", ps=0)),
                        "parameter_server")
    self.assertEqual(decided(
        config.replace(distribution_strategy="parameter_server"),
        _tf_config("chief", ps=0)), "parameter_server")

  def test_cluster_without_ps_is_a_clear_error(self):
    with self.assertRaisesRegex(errors.ConfigError, "needs a cluster with ps"):
      ps_lib.cluster_resolver(_cluster(_tf_config("chief", ps=0)))


class PartitionerTest(parameterized.TestCase):

  @parameterized.named_parameters(
      # 100000 x 16 float32 = 6.1 MiB.
      ("min_size", "min_size", 256 << 10, 0, [2, 1]),
      ("min_size_big_minimum", "min_size", 8 << 20, 0, [1, 1]),
      ("min_size_more_shards", "min_size", 256 << 10, 4, [4, 1]),
      ("max_size", "max_size", 1 << 20, 0, [2, 1]),
      ("max_size_unbounded", "max_size", 1 << 20, 16, [7, 1]),
      ("fixed", "fixed", 1, 3, [3, 1]),
  )
  def test_shards_tables(self, kind, shard_bytes, max_shards, expected):
    partitioner = ps_lib.make_partitioner(
        kind, num_ps=2, shard_bytes=shard_bytes, max_shards=max_shards)
    with sharded_embedding.sharding_scope():
      self.assertEqual(list(partitioner(tf.TensorShape([100000, 16]),
                                        tf.float32)), expected)

  @parameterized.named_parameters(("min_size", "min_size"),
                                  ("max_size", "max_size"),
                                  ("fixed", "fixed"))
  def test_never_shards_other_variables(self, kind):
    partitioner = ps_lib.make_partitioner(kind, num_ps=2, shard_bytes=1,
                                          max_shards=2)
    self.assertEqual(partitioner(tf.TensorShape([4096, 512]), tf.float32),
                     [1, 1])

  def test_none(self):
    self.assertIsNone(ps_lib.make_partitioner("none", num_ps=2,
                                              shard_bytes=1))

  def test_bad_arguments(self):
    with self.assertRaisesRegex(errors.ConfigError, "--ps_partitioner='even'"):
      ps_lib.make_partitioner("even", num_ps=2, shard_bytes=1)
    with self.assertRaisesRegex(errors.ConfigError, "needs ps tasks"):
      ps_lib.make_partitioner("min_size", num_ps=0, shard_bytes=1)

  def test_config_validates_flags(self):
    with self.assertRaisesRegex(errors.ConfigError, "--ps_partitioner='even'"):
      TrainConfig(model_dir="/tmp/x", train_steps=1, ps_partitioner="even")
    with self.assertRaisesRegex(errors.ConfigError, "--ps_min_shard_bytes=0"):
      TrainConfig(model_dir="/tmp/x", train_steps=1, ps_min_shard_bytes=0)
    with self.assertRaisesRegex(errors.ConfigError, "--hash_buckets=0"):
      TrainConfig(model_dir="/tmp/x", train_steps=1, hash_buckets=0)


class ShardLayoutTest(absltest.TestCase):

  def _model(self):
    inputs = keras.Input(shape=(1,), dtype="int64")
    outputs = sharded_embedding.ShardedEmbedding(10, 2, name="users")(inputs)
    return keras.Model(inputs, outputs)

  def test_round_trip_and_mismatch(self):
    ckpt_dir = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    model = self._model()
    ps_lib.check_shard_layout(ckpt_dir, model)  # Nothing saved yet.
    ps_lib.write_shard_layout(ckpt_dir, model)
    ps_lib.check_shard_layout(ckpt_dir, model)
    with open(os.path.join(ckpt_dir, ps_lib.SHARDS_FILE), "w") as f:
      json.dump({"users": 4}, f)
    with self.assertRaisesRegex(
        errors.ShardCountMismatchError,
        r"table 'users' in 4 shard\(s\), but this cluster splits it into 1"):
      ps_lib.check_shard_layout(ckpt_dir, model)

  def test_done_marker(self):
    model_dir = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    self.assertFalse(ps_lib.marked_done_since(model_dir, 0.0))
    ps_lib.mark_done(model_dir)
    self.assertTrue(ps_lib.marked_done_since(model_dir, 0.0))
    self.assertFalse(ps_lib.marked_done_since(model_dir, 4e9))
    ps_lib.clear_done(model_dir)
    self.assertFalse(ps_lib.marked_done_since(model_dir, 0.0))

  def test_task_of(self):
    self.assertEqual(ps_lib.task_of("/job:ps/replica:0/task:1/device:CPU:0"),
                     "ps:1")


class RecommendedFlagsTest(absltest.TestCase):
  """MovieLens's recommended flag values fill only flags left unset."""

  def setUp(self):
    super().setUp()
    # Importing the binary defines every tfdist flag on absl's FLAGS.
    from tfdist import flags as tfdist_flags  # pylint: disable=g-import-not-at-top
    from tfdist import train  # pylint: disable=g-import-not-at-top,unused-import
    self.flags_to_config = tfdist_flags.flags_to_config

  def test_movielens_fills_unset_flags(self):
    with flagsaver.as_parsed(dataset="movielens", model_dir="/tmp/x",
                             train_steps="5", optimizer="sgd"):
      config = self.flags_to_config()
    self.assertEqual(config.model, "ranking")
    self.assertEqual(config.batch_size, 512)
    self.assertEqual(config.optimizer, "sgd")  # Given: kept.
    self.assertEqual(config.base_learning_rate, 0.002)
    self.assertEqual(dict(config.flags_snapshot)["batch_size"], "512")

  def test_per_replica_batch_keeps_batch_size_unset(self):
    with flagsaver.as_parsed(dataset="movielens", model_dir="/tmp/x",
                             train_steps="5", per_replica_batch_size="64"):
      config = self.flags_to_config()
    self.assertIsNone(config.batch_size)
    self.assertEqual(config.per_replica_batch_size, 64)

  def test_other_data_sets_unchanged(self):
    with flagsaver.as_parsed(model_dir="/tmp/x", train_steps="5"):
      config = self.flags_to_config()
    self.assertEqual(config.model, "cnn")
    self.assertEqual(config.optimizer, "sgd")


if __name__ == "__main__":
  absltest.main()
