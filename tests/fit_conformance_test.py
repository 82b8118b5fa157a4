"""`tfdist.fit` keeps `keras.Model.fit`'s contract under the multi-process
strategies.

The same small models and data (`tests/fit_conformance_testlib.py`) go
through `keras.Model.fit` + `Model.evaluate` on one device and through
`tfdist.fit` under MultiWorkerMirrored (2 workers) and parameter servers
(chief, 2 workers, 1 ps): one local cluster each (`tfdist.launch
--module=tests.fit_conformance_testlib`), running the sample-weight case
with ReduceLROnPlateau, a custom loss function and metric, and callbacks
recording their hooks; then TFRecord files with a Loss subclass, and a run
failed and resumed by the launcher. One device and MirroredStrategy, and
what is refused at start, are in `tests/fit_conformance_one_process_test.py`
(one process, outside the cluster lane).

Tolerances: synchronous strategies make the same updates on the same global
batches as one device, so weights and metrics agree to float32 round-off
(`ATOL` = 1e-4 absolute). Parameter-server training is asynchronous (each
worker's update lands on weights the other may have moved), so only its
outcome is compared: the slope within `PS_SLOPE_TOLERANCE` of `Model.fit`'s
(without the weights it would be near 0).

The table of `docs/guides/fit-conformance.md` (between its
`conformance-table` markers): this file checks the multi-process columns
(`fit_conformance_testlib.table_owner`); with
`TFDIST_WRITE_CONFORMANCE_TABLE=1` it writes them.
"""

import json
import math
import os
import tempfile

from absl.testing import absltest

from tests import fit_conformance_testlib as lib
from tests import multi_worker_testlib
from tests import testutil

ATOL = lib.ATOL
PS_SLOPE_TOLERANCE = 0.3
# Parameter servers, class weights: the largest weight's distance from
# Model.fit's after two epochs of asynchronous updates.
PS_CLASS_WEIGHT_TOLERANCE = 0.1


# The cells measured so far by this process's tests: {feature: {strategy:
# text}}; the last test compares them with the docs table.
_CELLS = {}


def _cell(feature: str, strategy: str, text: str):
  _CELLS.setdefault(feature, {})[strategy] = text


def _cluster(test, case: str, launch_args, files_dir=None) -> dict:
  """Runs `case` on a local cluster (with `file_callbacks(files_dir)`, and
  a RemoteMonitor posting to a server of this process); returns the
  chief's result, with what the processes printed (`output`) and what was
  posted (`posts`)."""
  out = os.path.join(tempfile.mkdtemp(dir=testutil.scratch_dir()),
                     "result.json")
  server = lib.RemoteMonitorServer()
  try:
    status, output = multi_worker_testlib.run_launcher(
        [*launch_args, "--module=tests.fit_conformance_testlib"],
        [out, case, *([files_dir] if files_dir else [])], timeout=240,
        env={"TF_ENABLE_ONEDNN_OPTS": "0", "CUDA_VISIBLE_DEVICES": "",
             "TFDIST_TEST_REMOTE_MONITOR": server.root})
  finally:
    server.server.shutdown()
  test.assertEqual(status, 0, output[-4000:])
  with open(out) as f:
    return {**json.load(f), "output": output, "posts": server.take(),
            "first_path": f"{out}.first.json",
            "model_dir": os.path.join(os.path.dirname(out), "run")}


def _check_files(test, files: str, epochs: int = 3):
  """Asserts one writer: the chief's `file_callbacks(files)`, each once."""
  test.assertEqual(sorted(os.listdir(os.path.join(files, "ckpt"))),
                   [f"w_{e}.weights.h5" for e in range(1, epochs + 1)])
  with open(os.path.join(files, "log.csv")) as f:
    rows = f.read().splitlines()
  test.assertEqual([r.split(",")[0] for r in rows],
                   ["epoch", *(str(e) for e in range(epochs))])
  for sub in ("train", "validation"):
    events = [n for n in os.listdir(os.path.join(files, "tb", sub))
              if "tfevents" in n]
    test.assertLen(events, 1, sub)


def _check_posts(test, reference: dict, run: dict, *, values: bool):
  """Asserts one post per epoch (the chief's) of fit's epoch logs."""
  posts = run["posts"]
  epoch_logs = [h[2] for h in reference["hooks"] if h[0] == "on_epoch_end"]
  test.assertEqual([p["epoch"] for p in posts], list(range(len(epoch_logs))))
  for post, logs in zip(posts, epoch_logs):
    test.assertEqual(sorted(post), sorted([*logs, "epoch"]))
    for key, value in logs.items() if values else ():
      test.assertAlmostEqual(post[key], value, delta=ATOL, msg=key)


class MultiProcessStrategiesTest(absltest.TestCase):
  """MultiWorkerMirrored and parameter servers, one cluster each."""

  def test_multi_worker_mirrored_matches_one_device(self):
    # Sample weights, weighted metrics, a custom loss function and metric,
    # LearningRateScheduler with ReduceLROnPlateau, a stop in a batch hook
    # of epoch 1, EarlyStopping restoring epoch 0's weights, the callbacks
    # inside a CallbackList, and the callbacks `main` adds, in one run (one
    # MultiWorkerMirroredStrategy per process), against Model.fit with the
    # same combination.
    reference = lib.keras_fit("multi_worker")
    epoch, batch = lib.MULTI_WORKER_STOP_AT_BATCH
    self.assertEqual(reference["iterations"], epoch * 16 + batch + 1)
    self.assertAlmostEqual(reference["learning_rate"], 0.0125)
    files = tempfile.mkdtemp(dir=testutil.scratch_dir())
    # The examples as NumPy arrays, validation_data the same arrays (what
    # the reference evaluates): each worker reads half of them.
    run = _cluster(self, "multi_worker:arrays", ["--num_workers=2"],
                   files_dir=files)
    self.assertEqual(run["replicas"], 2)
    # One writer: the chief's files, each once (2 epochs); one post an
    # epoch.
    _check_files(self, files, epochs=epoch + 1)
    _cell("file_callbacks", "multi_worker_mirrored", "works")
    _check_posts(self, reference, run, values=True)
    _cell("remote_monitor", "multi_worker_mirrored", "works (from the chief "
          "only)")
    _cell("history", "multi_worker_mirrored", "works")
    diffs = lib.agrees(reference, run)
    for what, diff in diffs.items():
      self.assertLess(diff, ATOL, f"{what}: {diffs}")
    # Stopped where fit stopped; one answer of the restored weights.
    self.assertEqual(run["final_step"], reference["iterations"])
    for where in ("checkpoint_slope", "export_slope"):
      self.assertAlmostEqual(run[where], reference["weights"][0][0][0],
                             delta=ATOL, msg=where)
    self.assertAlmostEqual(run["final_eval_loss"], reference["eval"]["loss"],
                           delta=ATOL)
    for feature in ("weighted_metrics", "reduce_lr_on_plateau",
                    "learning_rate_scheduler", "numpy_arrays",
                    "validation_data", "custom_loss_function", "custom_metric",
                    "early_stopping_restore", "stop_in_batch_hook",
                    "callback_list"):
      _cell(feature, "multi_worker_mirrored", "works")
    # Every worker's callbacks got Model.fit's hooks and logs (on_test_*
    # too).
    lib.compare_hooks(self, reference, run)
    self.assertEqual(run["lambda_hooks"], reference["lambda_hooks"])
    _cell("callback_subclass", "multi_worker_mirrored", "works")
    _cell("lambda_callback", "multi_worker_mirrored", "works")
    # The chief's ProgbarLogger printed; the other worker's did not run.
    self.assertEqual(run["output"].count("Epoch 1/3"), 1,
                     run["output"][-3000:])
    self.assertEqual(run["output"].count("Epoch 2/3"), 1)
    _cell("progbar_logger", "multi_worker_mirrored", "works (the chief "
          "prints)")
    # Arrays become a dataset function of (x, y, w) examples in tfdist.
    _cell("sample_weight", "multi_worker_mirrored",
          "works (measured with the arrays as a dataset function)")

  def test_parameter_servers_learn_the_weighted_slope(self):
    # Sample weights (NumPy arrays, validation_data the same arrays),
    # weighted metrics, LearningRateScheduler with ReduceLROnPlateau, a
    # custom loss function and metric, the callbacks inside a CallbackList
    # and the callbacks `main` adds, in one run, against Model.fit with the
    # same combination.
    self.reference = lib.keras_fit("parameter_server")
    # The scheduler's rate of epoch 2, halved by ReduceLROnPlateau.
    self.assertAlmostEqual(self.reference["learning_rate"], 0.003125)
    # fit stopped after batch 4 of epoch 2.
    epoch, batch = lib.PS_STOP_AT_BATCH
    self.assertEqual(self.reference["iterations"], epoch * 16 + batch + 1)
    files = tempfile.mkdtemp(dir=testutil.scratch_dir())
    run = _cluster(self, "parameter_server:arrays",
                   ["--num_workers=2", "--num_ps=1"], files_dir=files)
    _check_files(self, files)
    _cell("file_callbacks", "parameter_server", "works (the chief writes)")
    _check_posts(self, self.reference, run, values=False)
    _cell("remote_monitor", "parameter_server", "works (from the chief)")
    slope = run["weights"][0][0][0]
    self.assertAlmostEqual(slope, self.reference["weights"][0][0][0],
                           delta=PS_SLOPE_TOLERANCE)
    self.assertAlmostEqual(run["learning_rate"],
                           self.reference["learning_rate"], places=6)
    _cell("sample_weight", "parameter_server",
          f"works (asynchronous: slope within {PS_SLOPE_TOLERANCE}; measured "
          "with the arrays as a dataset function)")
    for feature in ("reduce_lr_on_plateau", "learning_rate_scheduler"):
      _cell(feature, "parameter_server", "works (the same rates; "
            "asynchronous updates)")
    for feature in ("custom_loss_function", "numpy_arrays", "callback_list"):
      _cell(feature, "parameter_server",
            f"works (asynchronous: slope within {PS_SLOPE_TOLERANCE})")
    # Keras's names, epochs and hooks; asynchronous values.
    self.assertEqual(sorted(run["history"]), sorted(self.reference["history"]))
    self.assertEqual({len(v) for v in run["history"].values()}, {3})
    self.assertEqual(sorted(set(self.reference["eval"]) - set(run["eval"])),
                     [])
    for feature in ("history", "custom_metric", "weighted_metrics",
                    "validation_data"):
      _cell(feature, "parameter_server", "works (Keras's names and epochs; "
            "asynchronous values)")
    lib.compare_hooks(self, self.reference, run, batch=False, values=False)
    self.assertEqual([h for h in run["lambda_hooks"] if "batch" not in h[0]],
                     [h for h in self.reference["lambda_hooks"]
                      if "batch" not in h[0]])
    # One chunk of 4 scheduled steps between log points, with the batch
    # logs Keras's would hold; the stop set in the hook of batches 4-7 of
    # epoch 2 took effect after that chunk (fit stopped after batch 4).
    batch_hooks = [h for h in run["hooks"]
                   if h[0].startswith("on_train_batch")]
    chunks = [[["on_train_batch_begin", first],
               ["on_train_batch_end", first + lib.PS_LOG_STEPS - 1]]
              for first in range(0, 16, lib.PS_LOG_STEPS)]
    self.assertEqual([h[:2] for h in batch_hooks],
                     sum(chunks * epoch + chunks[:2], []))
    self.assertEqual(run["final_step"], epoch * 16 + 2 * lib.PS_LOG_STEPS)
    _cell("stop_in_batch_hook", "parameter_server", "works late: stops "
          "after the scheduled chunk whose batch hook set it (batch hooks "
          "come once per chunk, which ends at a log point, checkpoint or "
          "epoch end)")
    fits_keys = sorted(next(h[2] for h in self.reference["hooks"]
                            if h[0] == "on_train_batch_end"))
    self.assertEqual(sorted(batch_hooks[1][2]), fits_keys)
    # The coordinator evaluates in batches of 1,024: one test batch per
    # validation, with evaluate's logs.
    test_batches = [h for h in run["hooks"]
                    if h[0].startswith("on_test_batch")]
    self.assertEqual([h[:2] for h in test_batches], [
        ["on_test_batch_begin", 0], ["on_test_batch_end", 0]] * 3)
    self.assertEqual(sorted(test_batches[1][2]), sorted(next(
        h[2] for h in self.reference["hooks"] if h[0] == "on_test_end")))
    _cell("lambda_callback", "parameter_server", "works on the chief (train "
          "and epoch hooks as in fit; batch hooks once per scheduled chunk)")
    _cell("callback_subclass", "parameter_server", "works on the chief "
          "(train, epoch and on_test_begin/end hooks as in fit; batch hooks "
          "once per scheduled chunk and per evaluation batch of 1,024)")
    self.assertEqual(run["output"].count("Epoch 1/3"), 1,
                     run["output"][-3000:])
    _cell("progbar_logger", "parameter_server", "works (the chief prints)")


class MultiProcessFilesTest(absltest.TestCase):
  """The second cluster run of each multi-process strategy: sample weights
  from a parse_fn over TFRecord files, a Loss subclass, a metric with one
  value per batch, compile(steps_per_execution=4) and EarlyStopping,
  against Model.fit with the same combination."""

  def _warned_steps_per_execution(self, output: str):
    self.assertIn("compiled with steps_per_execution=4, which tfdist does "
                  "not read", output)

  def test_multi_worker_mirrored_matches_one_device(self):
    reference = lib.keras_fit("multi_worker_files")
    # EarlyStopping (not restoring) stopped fit after epoch 1.
    self.assertEqual(len(reference["history"]["loss"]), 2)
    run = _cluster(self, "multi_worker_files:parse_fn", ["--num_workers=2"])
    self.assertEqual(run["replicas"], 2)
    # Everything but the metric with one value per batch, which is
    # averaged over per-replica batches of 32 (warned below).
    diffs = lib.agrees(reference, run, skip="spread")
    for what, diff in diffs.items():
      self.assertLess(diff, ATOL, f"{what}: {diffs}")
    self.assertEqual(run["final_step"], reference["iterations"])
    # fit's batch hooks come once per 4 steps here, tfdist's once per step.
    lib.compare_hooks(self, reference, run, batch=False, skip="spread")
    self.assertIn("Metric(s) spread return one value per batch", run[
        "output"])
    self.assertIn("per-replica batches of 32 examples (2 replicas",
                  run["output"])
    self._warned_steps_per_execution(run["output"])
    for feature in ("sample_weight_parse_fn", "custom_loss_class",
                    "early_stopping"):
      _cell(feature, "multi_worker_mirrored", "works")
    _cell("batch_valued_metric", "multi_worker_mirrored", "warned at start "
          "(the value depends on the per-replica batch)")
    _cell("steps_per_execution", "multi_worker_mirrored", "works (warned at "
          "start: tfdist groups steps by --steps_per_execution; the same "
          "weights)")

  def test_parameter_servers_stop_restore_and_learn_the_slope(self):
    reference = lib.keras_fit("parameter_server_files")
    self.assertEqual(len(reference["history"]["loss"]), 2)
    run = _cluster(self, "parameter_server_files:parse_fn",
                   ["--num_workers=2", "--num_ps=1"])
    # Stopped after fit's epoch, with Keras's names.
    self.assertEqual(run["final_step"], reference["iterations"])
    self.assertEqual(sorted(run["history"]), sorted(reference["history"]))
    self.assertEqual({len(v) for v in run["history"].values()}, {2})
    lib.compare_hooks(self, reference, run, batch=False, values=False)
    # The restored best weights (epoch 0's) are the one answer: the
    # callbacks' model at the end, the final checkpoint, the export, and
    # the final evaluation (epoch 0's validation of the same weights).
    slope = run["weights"][0][0][0]
    self.assertAlmostEqual(slope, reference["weights"][0][0][0],
                           delta=PS_SLOPE_TOLERANCE)
    for where in ("checkpoint_slope", "export_slope"):
      self.assertAlmostEqual(run[where], slope, delta=ATOL, msg=where)
    self.assertAlmostEqual(run["final_eval_loss"],
                           run["history"]["val_loss"][0], delta=ATOL)
    # One worker computes each step on the whole global batch (one replica
    # per worker), as fit does: no warning, fit's names.
    self.assertNotIn("return one value per batch", run["output"])
    self.assertIn("spread", run["eval"])
    self._warned_steps_per_execution(run["output"])
    for feature in ("sample_weight_parse_fn", "custom_loss_class"):
      _cell(feature, "parameter_server", "works (asynchronous: slope "
            f"within {PS_SLOPE_TOLERANCE})")
    _cell("early_stopping", "parameter_server", "works (stops after fit's "
          "epoch)")
    _cell("early_stopping_restore", "parameter_server", "works (one answer; "
          "asynchronous values)")
    _cell("batch_valued_metric", "parameter_server", "works (each step is "
          "one worker's whole batch, as in fit; asynchronous values)")
    _cell("steps_per_execution", "parameter_server", "works (warned at "
          "start: tfdist groups steps by --steps_per_execution; "
          "asynchronous values)")


class MultiProcessResumedTest(absltest.TestCase):
  """The third cluster run of each multi-process strategy, two attempts of
  one launcher group (`--max_restarts=1`): NumPy arrays with class
  weights and a validation split, ReduceLROnPlateau and TerminateOnNaN;
  the first attempt's tasks fail at the start of epoch 2, the restarted
  group resumes from epoch 1's checkpoint and meets a NaN feature in
  epoch 2's batch 5. Against `Model.fit` on one device: two calls, the
  second with `initial_epoch=2` on the NaN arrays
  (`fit_conformance_testlib.keras_fit_resumed`)."""

  _reference = {}

  def _run(self, launch_args):
    # Model.fit's resumed script, once for both strategies' tests.
    if not self._reference:
      self._reference.update(lib.keras_fit_resumed())
    reference = self._reference
    # The rate halved at epoch 1's end (ReduceLROnPlateau); TerminateOnNaN
    # stopped the second call in the NaN batch (step 6 of epoch 2).
    self.assertAlmostEqual(reference["first"]["learning_rate"], 0.05)
    self.assertEqual(reference["second"]["iterations"],
                     lib.RESUMED_AT_EPOCH * 12 + 6)
    run = _cluster(self, "class_weight_resumed:arrays",
                   [*launch_args, "--max_restarts=1",
                    "--stop_grace_seconds=10"])
    self.assertIn("restarting the group (1 of 1)", run["output"])
    with open(run["first_path"]) as f:
      first = json.load(f)
    return lib, reference, first, run

  def _resumed_at_epoch_2(self, lib, reference, run):
    """The second attempt resumed from epoch 1's checkpoint with its rate
    (the callback's 0.05, not the schedule's 0.1) and went on at epoch 2,
    as fit's second call did."""
    self.assertAlmostEqual(run["first_learning_rate"],
                           reference["second"]["first_learning_rate"],
                           places=6)
    self.assertEqual(run["hooks"][:2], [["on_train_begin", None, {}],
                                        ["on_epoch_begin",
                                         lib.RESUMED_AT_EPOCH, {}]])

  def _checkpoint_kept(self, run, step: int):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    folder = os.path.join(run["model_dir"], "checkpoints")
    latest = tf.train.latest_checkpoint(folder)
    self.assertIsNotNone(latest, os.listdir(folder))
    self.assertTrue(latest.endswith(f"-{step}"), latest)

  def test_multi_worker_mirrored_matches_one_device(self):
    lib, reference, first, run = self._run(["--num_workers=2"])
    # Epochs 0 and 1: class weights and the validation split as fit's
    # (every epoch's training and validation metrics, the weights, the
    # rate).
    fits = reference["first"]
    self.assertEqual(sorted(first["history"]), sorted(fits["history"]))
    for key, values in fits["history"].items():
      for mine, theirs in zip(first["history"][key], values):
        self.assertAlmostEqual(mine, theirs, delta=ATOL, msg=key)
    self.assertLess(lib.max_diff(first["weights"], fits["weights"]), ATOL)
    self.assertAlmostEqual(first["learning_rate"], 0.05, places=6)
    # The resumed attempt: fit's hooks and logs, batch by batch, up to the
    # NaN and after it (the cut epoch's validation, its end, the end).
    self._resumed_at_epoch_2(lib, reference, run)
    lib.compare_hooks(self, reference["second"], run)
    steps = reference["second"]["iterations"]
    self.assertRegex(run.get("diverged", "not stopped"),
                     rf"^TrainingDivergedError: Training diverged at step "
                     rf"{steps}: the training loss is nan")
    # The NaN row is in the other worker's half of the batch: the chief's
    # error points there, the worker's names it.
    self.assertIn(f"another worker's training batch of steps {steps}-{steps} "
                  "holds NaN or infinite values", run["diverged"])
    self.assertRegex(run["output"], rf"\[worker:0\] test: diverged: .*the "
                     rf"batch of step {steps} on this worker holds 1 NaN in "
                     "its features")
    # The last good checkpoint (epoch 1's end) is kept.
    self.assertIn("the last good checkpoint", run["diverged"])
    self._checkpoint_kept(run, lib.RESUMED_AT_EPOCH * 12)
    for feature in ("class_weight", "validation_split",
                    "learning_rate_checkpointed"):
      _cell(feature, "multi_worker_mirrored", "works")
    _cell("terminate_on_nan", "multi_worker_mirrored", "works (stops at "
          "fit's step after fit's hooks, then raises TrainingDivergedError, "
          "status 1, keeping the last good checkpoint)")

  def test_parameter_servers_resume_with_the_rate_and_stop_on_nan(self):
    import numpy as np  # pylint: disable=g-import-not-at-top
    lib, reference, first, run = self._run(["--num_workers=2",
                                            "--num_ps=1"])
    fits = reference["first"]
    self.assertEqual(sorted(first["history"]), sorted(fits["history"]))
    self.assertEqual({len(v) for v in first["history"].values()}, {2})
    # Asynchronous updates: the weights are near fit's with class weights,
    # much nearer than to fit's without them.
    unweighted = lib.keras_fit_resumed(class_weight=None,
                                       resumed=False)["first"]
    near = lib.max_diff(first["weights"], fits["weights"])
    self.assertLess(near, PS_CLASS_WEIGHT_TOLERANCE)
    self.assertLess(near, lib.max_diff(first["weights"],
                                    unweighted["weights"]) / 2)
    # The validation split: epoch 1's val_ metrics are those of its
    # weights on the arrays' last quarter, as evaluate computes them.
    x, y = lib.class_data()
    held_out = int(len(x) * (1 - lib.RESUMED_SPLIT))
    model = lib.build_model("class_weight_resumed")
    model.set_weights([np.asarray(w, "float32") for w in first["weights"]])
    evaluated = model.evaluate(x[held_out:], y[held_out:],
                               batch_size=lib.GLOBAL_BATCH, verbose=0,
                               return_dict=True)
    for key, value in evaluated.items():
      self.assertAlmostEqual(first["history"][f"val_{key}"][-1], value,
                             delta=ATOL, msg=key)
    self.assertAlmostEqual(first["learning_rate"], 0.05, places=6)
    # Resumed at epoch 2 with the callback's rate; the NaN step's chunk
    # (the epoch's 12 steps: no log point or checkpoint inside) ends with
    # a NaN loss in its batch logs, TerminateOnNaN stops the run, and the
    # epoch's hooks follow as in fit.
    self._resumed_at_epoch_2(lib, reference, run)
    lib.compare_hooks(self, reference["second"], run, batch=False,
                   values=False)
    batch_ends = [h for h in run["hooks"] if h[0] == "on_train_batch_end"]
    self.assertEqual([h[1] for h in batch_ends], [11])
    self.assertTrue(math.isnan(batch_ends[0][2]["loss"]))
    self.assertRegex(run.get("diverged", "not stopped"),
                     r"^TrainingDivergedError: Training diverged at step "
                     r"36 \(in steps 25-36\): the training loss is nan")
    # The coordinator read the input again and found the NaN row (batch 5,
    # row 3 of an unshuffled read): no advice to lower the rate.
    self.assertIn("The training data is the likely cause: the training input "
                  "holds 1 NaN in its features (rows [3] of replica 0's "
                  "batch) in batch 5 of an unshuffled read", run["diverged"])
    self.assertNotIn("--base_learning_rate", run["diverged"])
    self.assertIn("the last good checkpoint", run["diverged"])
    self._checkpoint_kept(run, lib.RESUMED_AT_EPOCH * 12)
    _cell("class_weight", "parameter_server", "works (asynchronous: weights "
          f"within {PS_CLASS_WEIGHT_TOLERANCE})")
    _cell("validation_split", "parameter_server", "works")
    _cell("learning_rate_checkpointed", "parameter_server", "works")
    _cell("terminate_on_nan", "parameter_server", "works late: stops after "
          "the scheduled chunk that holds the NaN step (its batch hooks come "
          "once per chunk), then raises TrainingDivergedError, status 1, "
          "keeping the last good checkpoint")


class ZDocsTableTest(absltest.TestCase):
  """Runs after the cases above (absltest orders classes by name)."""

  def test_docs_table_is_what_the_suite_measured(self):
    if len(_CELLS) < 2:
      self.skipTest("run the whole file: the table needs every case")
    lib.check_table(self, _CELLS)


if __name__ == "__main__":
  absltest.main()
