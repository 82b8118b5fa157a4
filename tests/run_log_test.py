"""The run log (tfdist/observability/run_log.py): records, log lines, metrics.jsonl."""

import math
import os
import shutil
import tempfile

from absl import logging
from absl.testing import absltest
import numpy as np

from tfdist.observability import run_log


class FormatTest(absltest.TestCase):

  def test_the_loss_first_and_auc_in_capitals(self):
    self.assertEqual(run_log.format_metrics({"auc": 0.5, "loss": 1.25}),
                     "loss 1.2500, AUC 0.5000")
    self.assertEqual(
        run_log.format_eval({"loss": 0.5, "accuracy": 0.75, "step": 3,
                             "num_examples": 64, "checkpoint": "c"}),
        "loss 0.5000, accuracy 0.7500 on 64 examples")

  def test_metrics_from_sums(self):
    self.assertEqual(
        run_log.metrics_from_sums({"loss": 6.0, "correct": 30.0,
                                   "count": 40.0}, 4),
        {"loss": 1.5, "accuracy": 0.75})

  def test_divergence_advice_names_the_rate_and_the_loss_scale(self):
    self.assertEqual(
        run_log.divergence_advice(loss_scaled=True, learning_rate=0.4),
        "Lower --base_learning_rate (the learning rate was 0.4 there, after "
        "scaling to the global batch) or lengthen the warmup "
        "(--warmup_steps), or lower --loss_scale (or use "
        "--loss_scale=dynamic).")


class LogTrainTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
    self.log = run_log.RunLog(tensorboard_dir=None, metrics_dir=self.dir,
                              global_batch_size=16, total_steps=8,
                              process_id="p0")

  def _logged(self, *args, **kwargs):
    """`log_train`'s record and its log line."""
    with self.assertLogs(logging.get_absl_logger(), "INFO") as logs:
      record = self.log.log_train(*args, **kwargs)
    return record, logs.records[-1].getMessage()

  def test_record_line_and_metrics_file(self):
    first, line = self._logged(
        4, {"loss": 2.0, "correct": 32.0, "count": 64.0,
            run_log.INPUT_WAIT_KEY: 0.04, run_log.EXECUTION_KEY: 0.2}, 4,
        learning_rate=0.05)
    self.assertEqual(first["kind"], "train")
    self.assertEqual(first["step"], 4)
    self.assertEqual(first["loss"], 0.5)
    self.assertEqual(first["accuracy"], 0.5)
    self.assertEqual(first["micro_steps"], 4)
    self.assertAlmostEqual(first["input_wait_seconds"], 0.01)
    self.assertAlmostEqual(first["input_wait_fraction"], 0.2)
    self.assertGreater(first["peak_rss_bytes"], 0)
    self.assertRegex(
        line,
        r"^tfdist: step 4/8: loss 0\.5000, accuracy 0\.5000, learning rate "
        r"0\.05, .*input wait 10\.0 ms/step \(20% of the compiled step\), "
        r"peak RSS ")
    second, line = self._logged(
        8, {"loss": 1.0, "correct": 48.0, "count": 64.0, "micro_steps": 8},
        4, learning_rate=0.05, loss_scale=1024.0, skipped_steps=1,
        total_skipped=1)
    self.assertEqual(second["loss_scale"], 1024.0)
    self.assertEqual(second["skipped_steps"], 1)
    self.assertIn("tfdist: step 8/8 (8 micro-steps in the last 4 updates): ",
                  line)
    self.assertIn(", loss scale 1024, 1 of 4 steps skipped (fp16 gradients "
                  "not finite; 1 in this run)", line)
    self.assertEqual([r["step"] for r in run_log.read_metrics(self.dir)],
                     [4, 8])
    self.assertEqual([r["step"] for r in self.log.all_records("train")],
                     [4, 8])

  def test_a_nan_loss_raises_divergence(self):
    with self.assertRaisesRegex(run_log.DivergenceError,
                                "Training diverged at step 2: loss nan"):
      self.log.log_train(2, {"loss": math.nan, "correct": 0.0,
                             "count": 8.0}, 2, learning_rate=0.1)

  def test_log_eval_and_read_back(self):
    self.log.log_eval(8, {"loss": 0.25, "accuracy": 0.9,
                          "num_examples": 32})
    records = run_log.read_metrics(self.dir)
    self.assertEqual([r["kind"] for r in records], ["eval"])
    self.assertEqual(records[0]["loss"], 0.25)

  def test_a_damaged_line_is_skipped(self):
    with open(os.path.join(self.dir, run_log.METRICS_FILE), "w") as f:
      f.write('{"kind": "train", "step": 1}\n{"kind": \n')
    self.assertEqual(run_log.read_metrics(self.dir),
                     [{"kind": "train", "step": 1}])

  def test_metric_values_keep_numbers_only(self):
    self.assertEqual(
        run_log.metric_values({"loss": np.float32(0.5), "step": 3,
                               "num_examples": 9, "name": "x"}),
        {"loss": np.float32(0.5)})


if __name__ == "__main__":
  absltest.main()
