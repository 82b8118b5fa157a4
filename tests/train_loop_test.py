"""Tests for tfdist.training.step.train_loop: step counting and mirrored
evaluation."""

import os

from absl.testing import absltest
from absl.testing import parameterized
import keras
import tensorflow as tf

import models
from tests import testutil
from tfdist.observability import manifest as manifest_lib
from tfdist.training.step.train_loop import Trainer


def _cnn_trainer(strategy, **trainer_args):
  """The built-in CNN and SGD under tfdist's Trainer, global batch 8;
  returns (trainer, model, optimizer)."""
  with strategy.scope():
    model = models.build_model("cnn", input_shape=(28, 28, 1),
                               num_classes=10)
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)
  trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                    global_batch_size=8, **trainer_args)
  return trainer, model, optimizer


class TrainFunctionTest(parameterized.TestCase):

  @parameterized.parameters(1, 3)
  def test_counts_steps_and_examples(self, steps_per_execution):
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    images = tf.random.stateless_uniform([64, 28, 28, 1], seed=(1, 2))
    labels = tf.random.stateless_uniform([64], seed=(3, 4), maxval=10,
                                         dtype=tf.int64)
    data = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((images, labels)).batch(
            8, drop_remainder=True).repeat())
    trainer, model, optimizer = _cnn_trainer(
        strategy, steps_per_execution=steps_per_execution)
    iterator = iter(data)
    chunks = [steps_per_execution, 1] + ([2] if steps_per_execution > 2
                                         else [])
    for n in chunks:
      out = trainer.train_function(iterator, tf.constant(n, tf.int32))
      self.assertEqual(float(out["count"]), 8.0 * n)
    self.assertEqual(int(trainer.global_step.numpy()), sum(chunks))
    self.assertEqual(int(optimizer.iterations.numpy()), sum(chunks))


class EvaluateTracesOnceTest(absltest.TestCase):

  def test_a_partial_last_batch_is_not_traced_again(self):
    # 38 examples in batches of 8: four of 8, one of 6. Traced on each
    # batch's shapes, the last batch retraced the evaluation (a third of a
    # short evaluation's time); traced on the dataset's element spec, one
    # trace serves every batch and every later evaluation.
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    images = tf.random.stateless_uniform([38, 28, 28, 1], seed=(1, 2))
    labels = tf.random.stateless_uniform([38], seed=(3, 4), maxval=10,
                                         dtype=tf.int64)
    data = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((images, labels)).batch(8))
    trainer, _, _ = _cnn_trainer(strategy)
    traced = []
    replica_step = trainer._replica_eval_step  # pylint: disable=protected-access

    def counting(*args, **kwargs):
      traced.append(1)
      return replica_step(*args, **kwargs)

    trainer._replica_eval_step = counting  # pylint: disable=protected-access
    first = trainer.evaluate(data)
    self.assertEqual(first["num_examples"], 38)
    self.assertLen(traced, 1)
    again = trainer.evaluate(data)
    self.assertLen(traced, 1)
    self.assertAlmostEqual(again["loss"], first["loss"], places=5)


def _op_types(function, *args):
  """Op type -> count in `function`'s graph for `args`, the bodies of the
  functions it calls included."""
  graph = function.get_concrete_function(*args).graph.as_graph_def()
  counts = {}
  for node in list(graph.node) + [n for f in graph.library.function
                                  for n in f.node_def]:
    counts[node.op] = counts.get(node.op, 0) + 1
  return counts


class OneReplicaStepTest(absltest.TestCase):
  """One replica in all: the step neither packs its sums for a reduction
  nor all-reduces the gradients, and trains exactly as the general path."""

  def _train(self, strategy):
    keras.utils.set_random_seed(7)
    features = tf.random.stateless_uniform([32, 6], seed=(1, 2))
    labels = tf.random.stateless_uniform([32], seed=(3, 4), maxval=3,
                                         dtype=tf.int64)
    data = tf.data.Dataset.from_tensor_slices((features, labels)).batch(
        16, drop_remainder=True).repeat()
    with strategy.scope():
      model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
      optimizer = keras.optimizers.SGD(0.1)
      optimizer.build(model.trainable_variables)
    trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                      global_batch_size=16)
    iterator = iter(strategy.experimental_distribute_dataset(data))
    args = (iterator, tf.constant(1, tf.int32), tf.zeros([2], tf.float32))
    outs = [trainer.train_function(*args) for _ in range(2)]
    return (trainer, _op_types(trainer.train_function, *args),
            [{k: float(v) for k, v in out.items() if "seconds" not in k}
             for out in outs], [w.numpy() for w in model.weights])

  def test_one_device_step_skips_the_reductions(self):
    trainer, ops, sums, weights = self._train(
        tf.distribute.OneDeviceStrategy("/cpu:0"))
    # No packing of the sums (concat, split), no assertion of the batch
    # size, no identity per gradient for an all-reduce of one replica.
    for op in ("ConcatV2", "SplitV", "Assert"):
      self.assertNotIn(op, ops)
    self.assertLessEqual(ops.get("Identity", 0), len(sums[0]) + 4)
    self.assertTrue(trainer.one_replica)
    # A one-replica MirroredStrategy takes the general path: same numbers.
    general, general_ops, general_sums, general_weights = self._train(
        tf.distribute.MirroredStrategy(["/cpu:0"]))
    self.assertFalse(general.one_replica)
    self.assertGreater(general_ops.get("Identity", 0),
                       ops.get("Identity", 0))
    for got, want in zip(sums, general_sums):
      self.assertEqual(got.keys(), want.keys())
      for key in want:
        self.assertAlmostEqual(got[key], want[key], places=5, msg=key)
    for got, want in zip(weights, general_weights):
      self.assertTrue((abs(got - want) < 1e-6).all())

  def test_batch_size_must_be_positive(self):
    with self.assertRaisesRegex(ValueError, "global_batch_size.*Received: 0"):
      Trainer(strategy=tf.distribute.get_strategy(),
              model=keras.Sequential([keras.Input((2,)),
                                      keras.layers.Dense(1)]),
              optimizer=keras.optimizers.SGD(0.1), global_batch_size=0)


class StepSumsTest(absltest.TestCase):
  """The step's sums ride in the gradients' all-reduce when they have the
  gradients' dtype; the others, the stop requests among them, still reach
  the output."""

  def test_stop_requests_survive_float64_gradients(self):
    # float64 variables and metric states: the metric states ride with the
    # gradients, the float32 loss, count and stop requests do not.
    keras.config.set_floatx("float64")
    self.addCleanup(keras.config.set_floatx, "float32")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
      model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
      optimizer = keras.optimizers.SGD(0.1)
      optimizer.build(model.trainable_variables)
    data = tf.data.Dataset.from_tensor_slices((
        tf.ones([32, 6], tf.float64), tf.zeros([32], tf.int64))).batch(
            8, drop_remainder=True).repeat()
    for steps_per_execution in (1, 2):
      trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                        global_batch_size=8,
                        steps_per_execution=steps_per_execution)
      out = trainer.train_function(
          iter(strategy.experimental_distribute_dataset(data)),
          tf.constant(steps_per_execution, tf.int32),
          tf.constant([1.0, 0.0], tf.float32))
      self.assertGreater(float(out["stop_signal"]), 0.0, steps_per_execution)
      self.assertEqual(float(out["stop_training"]), 0.0)
      self.assertEqual(float(out["count"]), 8.0 * steps_per_execution)
      self.assertIn("metric/0/0", out)


class MirroredEvaluationTest(absltest.TestCase):

  def test_replica_with_empty_last_batch(self):
    # 512 evaluation examples in per-replica batches of 48: 11 batches, so
    # in the last round replica 1 gets an empty batch. TensorFlow 2.21's
    # oneDNN CPU kernels failed on it ("Incompatible shapes: [64] vs.
    # [0,14,14,32]"); oneDNN is forced on so every x86 machine sees it.
    data = testutil.fashion_mnist_subset(limit=512, train_shards=4,
                                         test_shards=2)
    model_dir = testutil.scratch_dir()
    proc = testutil.run_module("tfdist.train", [
        "--distribution_strategy=mirrored", "--num_cpu_devices=2",
        f"--train_files={data['train']}", f"--eval_files={data['eval']}",
        "--train_steps=2", "--batch_size=96", f"--model_dir={model_dir}"],
                               timeout=400, env={"TF_ENABLE_ONEDNN_OPTS": "1"})
    self.assertEqual(proc.returncode, 0, proc.stdout[-3000:])
    manifest = manifest_lib.read_manifest(model_dir)
    self.assertEqual(manifest["per_replica_batch_size"], 48)
    self.assertEqual(manifest["final_metrics"]["eval_examples"], 512)
    self.assertTrue(os.path.exists(os.path.join(model_dir, "saved_model")))


if __name__ == "__main__":
  absltest.main()
