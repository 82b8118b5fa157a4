"""Tests for tfdist.train_loop that need a real multi-replica strategy."""

import os

from absl.testing import absltest

from tests import testutil
from tfdist import manifest as manifest_lib


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
