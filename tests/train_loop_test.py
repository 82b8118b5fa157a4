"""Tests for tfdist.training.train_loop: step counting and mirrored evaluation."""

import os

from absl.testing import absltest
from absl.testing import parameterized
import keras
import tensorflow as tf

import models
from tests import testutil
from tfdist.observability import manifest as manifest_lib
from tfdist.training.train_loop import Trainer


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
    with strategy.scope():
      model = models.build_model("cnn", input_shape=(28, 28, 1),
                                 num_classes=10)
      optimizer = keras.optimizers.SGD(0.01)
      optimizer.build(model.trainable_variables)
    trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                      global_batch_size=8,
                      steps_per_execution=steps_per_execution)
    iterator = iter(data)
    chunks = [steps_per_execution, 1] + ([2] if steps_per_execution > 2
                                         else [])
    for n in chunks:
      out = trainer.train_function(iterator, tf.constant(n, tf.int32))
      self.assertEqual(float(out["count"]), 8.0 * n)
    self.assertEqual(int(trainer.global_step.numpy()), sum(chunks))
    self.assertEqual(int(optimizer.iterations.numpy()), sum(chunks))


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
