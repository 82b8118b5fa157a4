"""The Transformer text classifier trains sharded under two
MultiWorkerMirrored workers (`--zero_stage=1`), on a real slice of the
clothing reviews; one device and Mirrored are run by
benchmarks/text_baseline.py (docs/guides/sharded-training.md)."""

import os

from absl.testing import absltest

from tests import multi_worker_testlib as testlib
from tests import testutil
from tfdist.data import clothing_reviews

TIMEOUT = 420


class TwoWorkerShardedTest(absltest.TestCase):

  def test_two_workers_train_the_transformer_with_sharded_state(self):
    data = os.path.join(testutil.scratch_dir(), "clothing_reviews")
    clothing_reviews.convert_clothing_reviews(data, limit=512, train_shards=2,
                                              test_shards=2)
    model_dir = testutil.scratch_dir()
    status, output = testlib.run_launcher(
        ["--num_workers=2"],
        ["--dataset=clothing_reviews",
         f"--train_files={data}/train-*.tfrecord.gz",
         f"--eval_files={data}/test-*.tfrecord.gz",
         "--distribution_strategy=multi_worker_mirrored", "--zero_stage=1",
         "--batch_size=16", "--train_steps=6", "--log_steps=3",
         "--lr_schedule=cosine", "--warmup_steps=2", "--weight_decay=0.01",
         f"--model_dir={model_dir}"], timeout=TIMEOUT)
    self.assertEqual(status, 0, output[-6000:])
    self.assertRegex(output, r"\[chief:0\] .*ZeRO stage 1")
    self.assertRegex(output, r"\[chief:0\] .*step 6/6")
    self.assertIn("Final eval:", output)
    self.assertTrue(os.path.exists(
        os.path.join(model_dir, "saved_model", "saved_model.pb")))


if __name__ == "__main__":
  absltest.main()
