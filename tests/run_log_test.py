"""The run log (tfdist/observability/run_log.py): records, log lines, metrics.jsonl."""

import math
import os
import shutil
import tempfile

from absl import logging
from absl.testing import absltest
import numpy as np

from tfdist import errors
from tfdist.observability import progress
from tfdist.observability import run_log
from tfdist.observability import throughput


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


class ProgressTest(absltest.TestCase):
  """tfdist/observability/progress.py: epochs, durations, verbosity."""

  def test_epochs_are_counted_from_one_and_the_last_step_ends_one(self):
    self.assertEqual([progress.epoch_of(s, 4) for s in (1, 4, 5, 8, 9)],
                     [1, 1, 2, 2, 3])
    self.assertEqual(progress.num_epochs(10, 4), 3)
    with self.assertRaisesRegex(ValueError, "steps_per_epoch must be >= 1; "
                                "received 0"):
      progress.epoch_of(3, 0)

  def test_durations_read_as_an_eta(self):
    self.assertEqual([progress.format_duration(s) for s in
                      (0.2, 45, 72, 3599, 7380)],
                     ["0s", "45s", "1m12s", "59m59s", "2h03m"])
    self.assertIsNone(progress.eta_seconds(step=8, total_steps=8,
                                           seconds_per_step=0.1))
    self.assertAlmostEqual(progress.eta_seconds(
        step=2, total_steps=8, seconds_per_step=0.5), 3.0)

  def test_auto_is_a_bar_in_a_terminal_and_lines_elsewhere(self):

    class Stream:

      def __init__(self, tty):
        self.tty = tty

      def isatty(self):
        return self.tty

    self.assertEqual(progress.resolve_verbose("auto", Stream(True)), 1)
    self.assertEqual(progress.resolve_verbose("auto", Stream(False)), 2)
    self.assertEqual(progress.resolve_verbose("auto", object()), 2)
    self.assertEqual(progress.resolve_verbose(2, Stream(True)), 2)
    self.assertEqual(progress.resolve_verbose(True), 1)
    self.assertEqual(progress.resolve_verbose(False), 0)
    with self.assertRaisesRegex(ValueError, r"verbose=1\.0: use \"auto\""):
      progress.resolve_verbose(1.0)


class EpochLinesTest(absltest.TestCase):
  """Step lines with epochs, an ETA and the input wait's share."""

  def setUp(self):
    super().setUp()
    self.now = 0.0
    self.log = run_log.RunLog(tensorboard_dir=None, metrics_dir=None,
                              global_batch_size=16, total_steps=12,
                              process_id="p0", steps_per_epoch=4)
    self.log.meter = throughput.ThroughputMeter(16, clock=lambda: self.now)
    self.log.resume(0)

  def _line(self, step, seconds, *, hold=False, **sums):
    self.now += seconds
    with self.assertLogs(logging.get_absl_logger(), "INFO") as logs:
      self.log.log_train(step, {"loss": 4.0, "correct": 2.0, "count": 4.0,
                                **sums}, 4, learning_rate=0.1, hold=hold)
      logging.info("marker")
    return [r.getMessage() for r in logs.records[:-1]]

  def test_epoch_numbered_lines_with_a_decreasing_eta(self):
    lines = [self._line(4, 8.0), self._line(8, 1.0), self._line(12, 1.0)]
    self.assertTrue(all(len(l) == 1 for l in lines), lines)
    first, second, last = (l[0] for l in lines)
    self.assertRegex(first, r"^tfdist: epoch 1/3, step 4/12: loss 1\.0000")
    self.assertRegex(second, r"^tfdist: epoch 2/3, step 8/12: ")
    self.assertRegex(last, r"^tfdist: epoch 3/3, step 12/12: ")
    etas = [l.rsplit(", ETA ", 1) for l in (first, second)]
    # The warm-up interval's 2 s/step at first, then the measured 0.25.
    self.assertEqual([e[1] for e in etas], ["16s", "1s"])
    self.assertNotIn("ETA", last)  # Nothing is left.

  def test_input_wait_is_a_share_of_the_whole_step(self):
    # 0.5 ms of input wait per step is 58% of a 0.86 ms compiled function
    # but 3% of the 18.9 ms the step takes.
    self._line(4, 4 * 0.0189)
    line, = self._line(8, 4 * 0.0189, input_wait_seconds=0.002,
                       execution_seconds=0.00344)
    self.assertIn("input wait 0.5 ms/step (3% of the step)", line)
    self.assertNotIn("compiled", line)

  def test_an_evaluation_joins_its_step_line(self):
    self.assertEqual(self._line(4, 1.0, hold=True), [])
    with self.assertLogs(logging.get_absl_logger(), "INFO") as logs:
      self.log.log_eval(4, {"loss": 0.5, "accuracy": 0.75,
                            "num_examples": 8})
    line, = [r.getMessage() for r in logs.records]
    self.assertRegex(line, r"^tfdist: epoch 1/3, step 4/12: loss 1\.0000, .*"
                     r"; held-out evaluation at step 4: loss 0\.5000, "
                     r"accuracy 0\.7500 on 8 examples$")
    self.assertTrue(progress.is_progress_line(logs.records[0]))
    # An evaluation at another step: its own line, with its epoch.
    with self.assertLogs(logging.get_absl_logger(), "INFO") as logs:
      self.log.log_eval(6, {"loss": 0.5, "num_examples": 8})
    self.assertEqual([r.getMessage() for r in logs.records],
                     ["tfdist: epoch 2/3, held-out evaluation at step 6: "
                      "loss 0.5000 on 8 examples"])

  def test_a_held_line_without_its_evaluation_is_logged_at_flush(self):
    self.assertEqual(self._line(4, 1.0, hold=True), [])
    with self.assertLogs(logging.get_absl_logger(), "INFO") as logs:
      self.log.flush()
    self.assertRegex(logs.records[0].getMessage(),
                     r"^tfdist: epoch 1/3, step 4/12: ")

  def test_a_diverged_line_is_never_held(self):
    with self.assertLogs(logging.get_absl_logger(), "INFO") as logs:
      with self.assertRaises(errors.TrainingDivergedError):
        self.log.log_train(4, {"loss": math.nan}, 4, learning_rate=0.1,
                           hold=True)
    self.assertRegex(logs.records[0].getMessage(),
                     r"^tfdist: epoch 1/3, step 4/12: loss nan")


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
    with self.assertRaisesRegex(errors.TrainingDivergedError,
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
