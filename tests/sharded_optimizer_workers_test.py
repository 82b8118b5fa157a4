"""Sharded optimizer state and gradients (ZeRO stages 1 and 2) under 2 real
MultiWorkerMirroredStrategy workers train like unsharded training.

`tfdist.launch` runs 2 workers of `tests.sharded_optimizer_testlib`: 3
updates of Adam and SGD with momentum at stage 1 and 2, with and without
gradient accumulation and clipping, and Adam at stage 3 (the weights
sharded across the workers, `tfdist.parallel.zero3`) on a small dense model
and on the built-in Transformer (no token repeated within a batch), give
the unsharded run's weights within 1e-5; an fp16 overflow on one worker
skips the update on both; a checkpoint
goes unsharded -> stage 2 -> unsharded (the save gathers the shards across
workers) and the weights at the end equal an uninterrupted run's. The same
cases under MirroredStrategy, and the binary's: tests/sharded_optimizer_test.py.
"""

from absl.testing import absltest

from tests import multi_worker_testlib
from tests import sharded_optimizer_testlib as cases_lib
from tests import testutil


class MultiWorkerShardedTest(cases_lib.CaseChecks, absltest.TestCase):

  def test_two_workers_equal_skip_together_and_checkpoint(self):
    data = testutil.fashion_mnist_subset(limit=256, train_shards=2,
                                         test_shards=1)
    results = multi_worker_testlib.run_for_results(
        self, "tests.sharded_optimizer_testlib",
        ["worker", testutil.scratch_dir(), data["train"]], "sharded",
        timeout=300)
    for result in results.values():
      self.assertNotIn("error", result, result.get("error"))
    for result in results.values():
      self.check_equal(result, cases_lib.MWMS_CASES)
      self.check_fp16(result, stages=(1,))
      self.check_checkpoint(result, [2, 2, 2])
      self.check_transformer(result)
    self.assertEqual(results["chief0"]["equal"], results["worker0"]["equal"])


if __name__ == "__main__":
  absltest.main()
