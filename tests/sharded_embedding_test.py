"""Tests for tfdist.distribute.sharded_embedding.

Unsharded behaviour is compared with `keras.layers.Embedding` in this
process. Strategy cases run in a child process each (this file run as a
script), because they change process-wide TensorFlow state: MirroredStrategy
needs two logical CPU devices, and ParameterServerStrategy connects the eager
context to a cluster (two ps tasks and one worker served in the child, on
portpicker ports of 127.0.0.1). Each child prints one JSON line of results.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest
import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.distribute import sharded_embedding
from tfdist.distribute.sharded_embedding import ShardedEmbedding

# Also run on the oldest supported TensorFlow (see tests/conftest.py).
pytestmark = pytest.mark.compat

_CHILD_ENV = "TFDIST_SHARDED_EMBEDDING_CHILD"
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ids():
  return np.array([[1, 2, 0], [9, 9, 4]], np.int64)


class UnshardedTest(absltest.TestCase):

  def test_matches_keras_embedding(self):
    ours = ShardedEmbedding(
        10, 3, embeddings_initializer=keras.initializers.RandomUniform(seed=7))
    theirs = keras.layers.Embedding(
        10, 3, embeddings_initializer=keras.initializers.RandomUniform(seed=7))
    ids = _ids()
    np.testing.assert_array_equal(ours(ids).numpy(), theirs(ids).numpy())
    self.assertEqual(ours.compute_output_shape((2, 3)), (2, 3, 3))
    self.assertEqual(ours.num_shards, 1)

  def test_gradients_match_keras_embedding(self):
    init = keras.initializers.RandomNormal(seed=3)
    ours = ShardedEmbedding(10, 3, embeddings_initializer=init)
    theirs = keras.layers.Embedding(10, 3, embeddings_initializer=init)
    ids = _ids()
    weights = tf.constant(np.arange(18, dtype=np.float32).reshape(2, 3, 3))
    grads = []
    for layer in (ours, theirs):
      layer(ids)
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(ids) * weights)
      grads.append(tf.convert_to_tensor(
          tape.gradient(loss, layer.trainable_weights[0])).numpy())
    self.assertLen(ours.trainable_weights, 1)
    np.testing.assert_allclose(grads[0], grads[1])
    # Rows never looked up get no gradient.
    np.testing.assert_array_equal(grads[0][[3, 5, 6, 7, 8]], 0.0)

  def test_mask_zero(self):
    layer = ShardedEmbedding(5, 2, mask_zero=True)
    np.testing.assert_array_equal(
        layer.compute_mask(np.array([[0, 3]])).numpy(), [[False, True]])
    self.assertIsNone(ShardedEmbedding(5, 2).compute_mask(np.array([[0]])))

  def test_trains_in_a_model_with_optimizer_slots(self):
    inputs = keras.Input(shape=(2,), dtype="int64")
    x = ShardedEmbedding(8, 4, name="emb")(inputs)
    outputs = keras.layers.Dense(1)(keras.layers.Flatten()(x))
    model = keras.Model(inputs, outputs)
    self.assertEqual(model.trainable_variables[0].name, "emb/embeddings:0")
    optimizer = keras.optimizers.Adam(0.1)
    optimizer.build(model.trainable_variables)
    ids = np.array([[1, 2], [3, 4]])
    target = np.array([[1.0], [-1.0]], np.float32)
    losses = []
    for _ in range(20):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(ids) - target))
      grads = tape.gradient(loss, model.trainable_variables)
      self.assertIsInstance(grads[0], tf.IndexedSlices)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      losses.append(float(loss))
    self.assertLess(losses[-1], 0.1 * losses[0])
    # Adam: iterations, learning rate, and 2 slots for each of 3 variables.
    self.assertLen(optimizer.variables, 2 + 2 * 3)

  def test_invalid_arguments(self):
    with self.assertRaisesRegex(ValueError, "input_dim=0"):
      ShardedEmbedding(0, 3)
    with self.assertRaisesRegex(ValueError, "output_dim=2.5"):
      ShardedEmbedding(3, 2.5)

  def test_config_round_trip(self):
    layer = ShardedEmbedding(
        12, 5, embeddings_initializer=keras.initializers.TruncatedNormal(
            stddev=0.02, seed=4), mask_zero=True, name="table")
    config = json.loads(json.dumps(
        keras.saving.serialize_keras_object(layer)))
    clone = keras.saving.deserialize_keras_object(config)
    self.assertIsInstance(clone, ShardedEmbedding)
    self.assertEqual(clone.get_config(), layer.get_config())
    ids = np.array([[1, 11]])
    np.testing.assert_array_equal(clone(ids).numpy(), layer(ids).numpy())

  def test_keras_file_round_trip(self):
    inputs = keras.Input(shape=(2,), dtype="int64")
    outputs = ShardedEmbedding(6, 2, name="emb")(inputs)
    model = keras.Model(inputs, outputs)
    model.layers[1].embeddings.assign_add(tf.ones((6, 2)))
    path = os.path.join(tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR")),
                        "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    ids = np.array([[0, 5]])
    np.testing.assert_array_equal(loaded(ids).numpy(), model(ids).numpy())

  def test_checkpoint_round_trip(self):
    layer = ShardedEmbedding(4, 2)
    layer.build()
    layer.embeddings.assign(tf.reshape(tf.range(8, dtype=tf.float32), (4, 2)))
    prefix = os.path.join(tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR")),
                          "ckpt")
    path = tf.train.Checkpoint(layer=layer).save(prefix)
    fresh = ShardedEmbedding(4, 2)
    fresh.build()
    tf.train.Checkpoint(layer=fresh).restore(path).assert_consumed()
    np.testing.assert_array_equal(fresh.embeddings.numpy(),
                                  layer.embeddings.numpy())

  def test_describe_shards(self):
    inputs = keras.Input(shape=(1,), dtype="int64")
    model = keras.Model(inputs, ShardedEmbedding(7, 3, name="emb")(inputs))
    [info] = sharded_embedding.describe_shards(model)
    self.assertEqual(info["layer"], "emb")
    self.assertEqual(info["shape"], [7, 3])
    self.assertEqual(info["bytes"], 7 * 3 * 4)
    self.assertEqual(info["num_shards"], 1)

  def test_sharding_scope(self):
    self.assertFalse(sharded_embedding.sharding_allowed())
    with sharded_embedding.sharding_scope():
      self.assertTrue(sharded_embedding.sharding_allowed())
    self.assertFalse(sharded_embedding.sharding_allowed())


def _run_child(kind: str, timeout: float = 120) -> dict:
  env = dict(os.environ, **{_CHILD_ENV: kind, "TF_CPP_MIN_LOG_LEVEL": "2",
                            "GRPC_FAIL_FAST": "use_caller"})
  env["PYTHONPATH"] = _REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, os.path.abspath(__file__)],
                        env=env, cwd=_REPO_ROOT, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=timeout)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  if proc.returncode != 0 or not lines:
    raise AssertionError(f"child {kind} failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-4000:]}")
  return json.loads(lines[-1][len("RESULT "):])


class StrategyTest(absltest.TestCase):

  def test_mirrored_matches_one_device(self):
    result = _run_child("mirrored")
    self.assertEqual(result["replicas"], 2)
    self.assertEqual(result["num_shards"], 1)
    self.assertLess(result["max_abs_diff"], 1e-6)

  def test_parameter_server_shards_table_and_slots(self):
    result = _run_child("parameter_server")
    self.assertEqual(result["num_shards"], 2)
    self.assertEqual(result["shard_rows"], [51, 50])
    self.assertEqual(result["shard_tasks"], [0, 1])
    # Each Adam slot of a shard lives on that shard's ps task.
    self.assertEqual(result["slot_tasks"], {"part_0": [0, 0], "part_1": [1, 1]})
    # Dense weights stay whole even though they exceed the minimum size.
    self.assertEqual(result["dense_kernel_shape"], [256, 1])
    self.assertLess(result["lookup_max_abs_diff"], 1e-6)
    self.assertLess(result["final_loss"], 0.5 * result["first_loss"])
    self.assertTrue(result["untouched_rows_unchanged"])


# --- child processes ------------------------------------------------------
def _toy_model(table_rows: int, seed: int = 1):
  inputs = keras.Input(shape=(2,), dtype="int64")
  x = ShardedEmbedding(
      table_rows, 4, name="emb",
      embeddings_initializer=keras.initializers.RandomUniform(seed=seed))(
          inputs)
  x = keras.layers.Flatten()(x)
  outputs = keras.layers.Dense(1, kernel_initializer="ones")(x)
  return keras.Model(inputs, outputs)


def _child_mirrored() -> dict:
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
  ids = np.array([[1, 2], [3, 4], [5, 1], [7, 7]], np.int64)
  target = np.array([[1.0], [-1.0], [0.5], [0.0]], np.float32)
  results = []
  for strategy in (tf.distribute.OneDeviceStrategy("/cpu:0"),
                   tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])):
    with strategy.scope():
      model = _toy_model(8)
      optimizer = keras.optimizers.SGD(0.5)
      optimizer.build(model.trainable_variables)

    def replica_step(x, y):
      with tf.GradientTape() as tape:
        loss = tf.nn.compute_average_loss(
            tf.square(model(x) - y)[:, 0], global_batch_size=4)
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))

    dataset = tf.data.Dataset.from_tensors((ids, target))
    for x, y in strategy.experimental_distribute_dataset(dataset):
      strategy.run(tf.function(replica_step), args=(x, y))
    results.append((strategy.num_replicas_in_sync,
                    model.layers[1].num_shards,
                    np.asarray(model.layers[1].embeddings.numpy())))
  return {"replicas": results[1][0], "num_shards": results[1][1],
          "max_abs_diff": float(np.abs(results[0][2] - results[1][2]).max())}


def _child_parameter_server() -> dict:
  import portpicker  # pylint: disable=g-import-not-at-top
  ports = [portpicker.pick_unused_port() for _ in range(4)]
  cluster = tf.train.ClusterSpec({
      "chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"],
      "ps": [f"127.0.0.1:{ports[2]}", f"127.0.0.1:{ports[3]}"]})
  servers = [tf.distribute.Server(cluster, job_name=job, task_index=index,
                                  protocol="grpc", start=True)
             for job, index in (("worker", 0), ("ps", 0), ("ps", 1))]
  del servers  # Kept alive by the runtime until the process ends.
  inner = tf.distribute.experimental.partitioners.MinSizePartitioner(
      min_shard_bytes=256, max_shards=2)

  def partitioner(shape, dtype):
    if sharded_embedding.sharding_allowed():
      return inner(shape, dtype)
    return [1] * len(shape)

  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      cluster, task_type="chief", task_id=0, rpc_layer="grpc")
  strategy = tf.distribute.ParameterServerStrategy(
      resolver, variable_partitioner=partitioner)
  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
  with strategy.scope():
    inputs = keras.Input(shape=(2,), dtype="int64")
    emb = ShardedEmbedding(
        101, 4, name="emb",
        embeddings_initializer=keras.initializers.RandomUniform(seed=1))
    x = keras.layers.Flatten()(emb(inputs))
    # A 256 x 1 kernel (1 KiB) exceeds min_shard_bytes but must stay whole.
    x = keras.layers.Dense(256)(x)
    outputs = keras.layers.Dense(1)(x)
    model = keras.Model(inputs, outputs)
    optimizer = keras.optimizers.Adam(0.01)
    optimizer.build(model.trainable_variables)
  [info] = sharded_embedding.describe_shards(model)
  task_of = lambda device: int(device.split("/task:")[1].split("/")[0])
  slot_tasks = {}
  for var in optimizer.variables:
    for part in ("part_0", "part_1"):
      if part in var.path:
        slot_tasks.setdefault(part, []).append(task_of(var.value.device))
  table = np.concatenate([v.numpy() for v in emb.shards], axis=0)
  probe = np.array([[0, 50], [51, 100]], np.int64)
  lookup = emb(probe).numpy()
  lookup_diff = float(np.abs(lookup - table[probe]).max())

  def dataset_fn(_):
    # Only ids < 60 appear: rows 60..100 must not change (sparse updates).
    ids = tf.random.stateless_uniform([32, 2], seed=[1, 2], maxval=60,
                                      dtype=tf.int64)
    y = tf.cast(ids[:, :1] % 2, tf.float32)
    return tf.data.Dataset.from_tensors((ids, y)).repeat()

  per_worker = coordinator.create_per_worker_dataset(
      lambda: strategy.distribute_datasets_from_function(dataset_fn))
  iterator = iter(per_worker)

  @tf.function
  def step(iterator):
    def replica_fn(x, y):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      return loss
    x, y = next(iterator)
    return strategy.run(replica_fn, args=(x, y))

  first = coordinator.schedule(step, args=(iterator,))
  coordinator.join()
  first_loss = float(first.fetch())
  for _ in range(60):
    last = coordinator.schedule(step, args=(iterator,))
  coordinator.join()
  after = np.concatenate([v.numpy() for v in emb.shards], axis=0)
  return {
      "num_shards": info["num_shards"],
      "shard_rows": [s["shape"][0] for s in info["shards"]],
      "shard_tasks": [task_of(s["device"]) for s in info["shards"]],
      "slot_tasks": {k: sorted(v) for k, v in slot_tasks.items()},
      "dense_kernel_shape": [int(d) for d in model.layers[-1].kernel.shape],
      "lookup_max_abs_diff": lookup_diff,
      "first_loss": first_loss,
      "final_loss": float(last.fetch()),
      "untouched_rows_unchanged": bool(np.array_equal(after[60:],
                                                      table[60:])),
  }


class OldPathTest(absltest.TestCase):

  def test_the_old_path_is_the_same_module(self):
    # examples and user code name
    # tfdist.training.sharded_embedding.ShardedEmbedding.
    from tfdist.training import sharded_embedding as old  # pylint: disable=g-import-not-at-top
    self.assertIs(old, sharded_embedding)
    self.assertIs(old.ShardedEmbedding, ShardedEmbedding)


if __name__ == "__main__":
  _kind = os.environ.get(_CHILD_ENV)
  if _kind == "mirrored":
    print("RESULT " + json.dumps(_child_mirrored()), flush=True)
  elif _kind == "parameter_server":
    print("RESULT " + json.dumps(_child_parameter_server()), flush=True)
  else:
    absltest.main()
