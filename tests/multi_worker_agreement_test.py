"""Two real MultiWorkerMirroredStrategy workers agree, and leave together.

* fp16: when only one worker's gradients overflow, both skip the step (the
  loss scale halves on both, no weight becomes inf) and then train on, in
  step; before, one worker all-reduced while the other skipped and both
  failed with `DeadlineExceededError` after the collective timeout.
* Each worker draws its own dropout mask from the same seed.
* Unsynchronized batch norm's moving statistics, which each worker updates
  from its own data, are one after `MovingStatistics.synchronize`.
* The final barrier: a worker that arrives late is waited for.
* A worker that finished its work but does not exit (a test-only linger in
  `tests.multi_worker_testlib`, standing in for a shutdown that hangs once
  the chief's coordination service is gone) counts as finished: the
  launcher stops it and reports success, and does not restart the group.

Every run has a hard timeout and stops only the processes it started.
"""

import glob
import json
import os

from absl.testing import absltest
import numpy as np

from tests import multi_worker_testlib as testlib
from tests import testutil

TIMEOUT = 180


class WorkersAgreeTest(absltest.TestCase):

  def test_fp16_skip_dropout_streams_and_final_barrier(self):
    out = testutil.scratch_dir()
    status, output = testlib.run_launcher(
        ["--num_workers=2", "--module=tests.multi_worker_testlib"],
        ["agree", out], timeout=TIMEOUT,
        env={"TF_ENABLE_ONEDNN_OPTS": "0"})
    self.assertEqual(status, 0, output[-4000:])
    results = {}
    for path in glob.glob(os.path.join(out, "agree-*.json")):
      with open(path) as f:
        result = json.load(f)
      results[result["task"]] = result
    self.assertCountEqual(results, ["chief0", "worker0"], output[-3000:])
    chief, worker = results["chief0"], results["worker0"]
    for task in (chief, worker):
      first, second = task["fp16_steps"]
      # Step 1: worker 0's gradients overflowed; both skipped it.
      self.assertEqual(first["skipped"], 1.0)
      self.assertEqual(first["loss_scale"], 2.0**14)
      self.assertEqual(first["iterations"], 0)
      self.assertTrue(first["kernel_finite"])
      self.assertEqual(first["kernel"], [[1.0] * 3] * 4)
      # Step 2: finite everywhere; both updated.
      self.assertEqual(second["skipped"], 0.0)
      self.assertEqual(second["iterations"], 1)
      self.assertTrue(second["kernel_finite"])
      self.assertNotEqual(second["kernel"], first["kernel"])
    self.assertEqual(chief["fp16_steps"], worker["fp16_steps"])
    # Same seed, different workers: different masks.
    self.assertNotEqual(chief["dropout_mask"], worker["dropout_mask"])
    # Unsynchronized batch norm: the workers' moving means differed after a
    # step (Dense of ones: 2 on the chief, 10 on worker 0, times 1 -
    # momentum); once averaged (one all-reduce per step) they are one.
    self.assertNotEqual(chief["bn_before"], worker["bn_before"])
    for task in (chief, worker):
      self.assertEqual(task["bn_synchronized"], [True, False])
      np.testing.assert_allclose(
          task["bn_after"],
          (np.array(chief["bn_before"]) + worker["bn_before"]) / 2, rtol=1e-6)
    # Worker 0 arrived 3 s late; the chief waited for it.
    self.assertGreaterEqual(chief["barrier_left"], worker["barrier_arrived"])
    self.assertGreater(chief["barrier_left"] - chief["barrier_arrived"], 2.0)


class FinishedWorkerTest(absltest.TestCase):

  def test_worker_that_finished_but_lingers_fails_the_run_unrestarted(self):
    data = testutil.fashion_mnist_subset(limit=256)
    model_dir = testutil.scratch_dir()
    status, output = testlib.run_launcher(
        ["--num_workers=2", "--module=tests.multi_worker_testlib",
         "--stop_grace_seconds=5", "--max_restarts=1"],
        ["train_linger", "120", "--distribution_strategy="
         "multi_worker_mirrored", f"--train_files={data['train']}",
         f"--eval_files={data['eval']}", "--batch_size=32",
         "--train_steps=2", "--log_steps=2", f"--model_dir={model_dir}"],
        timeout=TIMEOUT)
    self.assertEqual(status, 1, output[-4000:])
    self.assertIn("[worker:0] test: worker 0 finished; lingering", output)
    self.assertIn("[launch] worker:0 finished its work but had not exited 5 s "
                  "later: stopping it; the run failed (not restarted: the "
                  "work is done).", output)
    self.assertIn("[launch] failed: worker:0 finished its work but had not "
                  "exited 5 s later: exit status 1", output)
    self.assertNotIn("restarting the group", output)
    self.assertNotIn("test: worker 0 exits", output)
    for task in ("chief:0", "worker:0"):  # The final barrier, on both.
      self.assertRegex(output, rf"\[{task}\] .*All 2 replicas reached the end")
    with open(os.path.join(model_dir, "run_manifest.json")) as f:
      manifest = json.load(f)
    self.assertEqual(manifest["final_step"], 2)
    # Synchronized batch norm is the default here (2 replicas).
    self.assertTrue(manifest["sync_batch_norm"])
    self.assertIn("batch norm             synchronized (global batch) "
                  "(default under multi_worker_mirrored with 2 replicas)",
                  output)


if __name__ == "__main__":
  absltest.main()
