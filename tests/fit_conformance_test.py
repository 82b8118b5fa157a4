"""`tfdist.fit` keeps `keras.Model.fit`'s contract, under every strategy.

The same small models and data (`tests/fit_conformance_testlib.py`) go
through `keras.Model.fit` + `Model.evaluate` on one device and through
`tfdist.fit`, and the final weights and reported metrics are compared:

* one device and MirroredStrategy on 2 logical CPUs: one child process
  (this file run as a script; the logical devices must exist before
  TensorFlow starts) runs every case once, with start-up paid once;
* MultiWorkerMirrored (2 workers) and parameter servers (chief, 2 workers,
  1 ps): one local cluster each (`tfdist.launch --module=
  tests.fit_conformance_testlib`), running the sample-weight case with
  ReduceLROnPlateau, a custom loss function and metric, and callbacks
  recording their hooks.

Callbacks: a recording `Callback` subclass and a `LambdaCallback` run in
every case, with `Model.fit` as with tfdist, and their hooks, `params` and
logs are compared (`_compare_hooks`). Every public class of
`keras.callbacks` has a row (`CALLBACK_ROWS`, checked by
`EveryKerasCallbackTest`).

Tolerances: synchronous strategies make the same updates on the same global
batches as one device, so weights and metrics agree to float32 round-off
(`ATOL` = 1e-4 absolute). Parameter-server training is asynchronous (each
worker's update lands on weights the other may have moved), so only its
outcome is compared: the slope within `PS_SLOPE_TOLERANCE` of `Model.fit`'s
(without the weights it would be near 0).

The suite writes the table of `docs/guides/fit-conformance.md` (between its
`conformance-table` markers): run with `TFDIST_WRITE_CONFORMANCE_TABLE=1`
to rewrite it; otherwise the test fails when the table differs from what
the suite measured.
"""

import json
import math
import os
import re
import tempfile

from absl.testing import absltest

from tests import multi_worker_testlib
from tests import testutil

_CHILD_ENV = "TFDIST_FIT_CONFORMANCE_CHILD"
ATOL = 1e-4
PS_SLOPE_TOLERANCE = 0.3
# Parameter servers, class weights: the largest weight's distance from
# Model.fit's after two epochs of asynchronous updates.
PS_CLASS_WEIGHT_TOLERANCE = 0.1
DOC = os.path.join(testutil.REPO_ROOT, "docs", "guides",
                   "fit-conformance.md")
STRATEGIES = ("one_device", "mirrored", "multi_worker_mirrored",
              "parameter_server")
# (row key, what the docs row says).
FEATURES = (
    ("sample_weight", "sample weights: dataset of `(x, y, w)`"),
    ("sample_weight_parse_fn", "sample weights: `parse_fn` returning "
     "`(x, y, w)`"),
    ("weighted_metrics", "`compile(weighted_metrics=...)` (named as Keras "
     "names them)"),
    ("class_weight", "`class_weight` (`TrainConfig`, `--class_weight`)"),
    ("class_and_sample_weight", "`class_weight` with sample weights"),
    ("reduce_lr_on_plateau", "`keras.callbacks.ReduceLROnPlateau`"),
    ("learning_rate_scheduler", "`keras.callbacks.LearningRateScheduler`"),
    ("learning_rate_checkpointed", "a rate set by a callback survives a "
     "resume"),
    ("callback_state_resumed", "`EarlyStopping(restore_best_weights=True)`"
     " and `ReduceLROnPlateau` interrupted and resumed: the uninterrupted "
     "run's stop, weights and rates"),
    ("early_stopping_restore", "`EarlyStopping(restore_best_weights=True)`:"
     " one answer in export, final checkpoint, manifest"),
    ("file_callbacks", "`ModelCheckpoint`, `CSVLogger`, `TensorBoard`: "
     "files from the chief only"),
    ("backup_and_restore", "`BackupAndRestore`"),
    ("history", "`History`: `tfdist.fit` returns its `history`"),
    ("batch_valued_metric", "a metric function returning one value per "
     "batch"),
    ("numpy_arrays", "NumPy arrays `x, y, sample_weight`"),
    ("validation_split", "`validation_split` (the arrays' last fraction)"),
    ("validation_data", "`validation_data=(x, y, sample_weight)` arrays"),
    ("custom_loss_function", "a loss function: `compile(loss=fn)`"),
    ("custom_loss_class", "a `keras.losses.Loss` subclass"),
    ("custom_metric", "a `keras.metrics.Metric` subclass (state summed "
     "over replicas)"),
    ("steps_per_execution", "`compile(steps_per_execution=N)`"),
    ("early_stopping", "`keras.callbacks.EarlyStopping` (not restoring): "
     "stops after the same epoch"),
    ("terminate_on_nan", "`keras.callbacks.TerminateOnNaN`: stops at the "
     "step the loss goes NaN"),
    ("lambda_callback", "`keras.callbacks.LambdaCallback`: the same hooks "
     "and logs keys"),
    ("callback_subclass", "a `keras.callbacks.Callback` subclass of yours: "
     "the same hooks, `params` and logs"),
    ("progbar_logger", "`keras.callbacks.ProgbarLogger`"),
    ("remote_monitor", "`keras.callbacks.RemoteMonitor`"),
    ("swap_ema_weights", "`keras.callbacks.SwapEMAWeights`"),
    ("orbax_checkpoint", "`keras.callbacks.OrbaxCheckpoint`"),
    ("callback_list", "`keras.callbacks.CallbackList` (a container of "
     "callbacks, as `callbacks=` or inside the list)"),
    ("stop_in_batch_hook", "`model.stop_training` set in a batch hook: "
     "stops after that batch"),
)
# Each public class of `keras.callbacks` -> the row that says what tfdist
# does with it (`EveryKerasCallbackTest` fails on a class missing here).
CALLBACK_ROWS = {
    "BackupAndRestore": "backup_and_restore",
    "CSVLogger": "file_callbacks",
    "Callback": "callback_subclass",
    "CallbackList": "callback_list",
    "EarlyStopping": "early_stopping",
    "History": "history",
    "LambdaCallback": "lambda_callback",
    "LearningRateScheduler": "learning_rate_scheduler",
    "ModelCheckpoint": "file_callbacks",
    "OrbaxCheckpoint": "orbax_checkpoint",
    "ProgbarLogger": "progbar_logger",
    "ReduceLROnPlateau": "reduce_lr_on_plateau",
    "RemoteMonitor": "remote_monitor",
    "SwapEMAWeights": "swap_ema_weights",
    "TensorBoard": "file_callbacks",
    "TerminateOnNaN": "terminate_on_nan",
}
# Callbacks refused at start: class -> (a pattern of the error, the cell).
REFUSED_CALLBACKS = {
    "BackupAndRestore": (r"tfdist's own checkpoints .* Instead, drop it",
                         "refused at start (tfdist's checkpoints back up "
                         "and resume the run)"),
    "SwapEMAWeights": (r"without use_ema=True, so there are no "
                       r"moving-average weights", "refused at start "
                       "(tfdist's optimizers keep no moving average)"),
    "OrbaxCheckpoint": (r"save the model state from every process .* "
                        r"Instead, drop it", "refused at start (it would "
                        "save from every process; tfdist's checkpoints "
                        "hold the state)"),
}


def _case(test, name):
  """Case `name` of this file's child process (run once per process; it
  trains about 15 small runs, so its time limit is longer than
  `testutil.child_case`'s)."""
  result = testutil.child_cases(os.path.abspath(__file__), _CHILD_ENV,
                                timeout=600)[name]
  test.assertNotIn("error", result, result.get("error"))
  return result


def _max_diff(a, b) -> float:
  import numpy as np  # pylint: disable=g-import-not-at-top
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(a, b))


def _without(values: dict, skip: str) -> dict:
  """`values` without the keys that contain `skip` ("": all of them)."""
  return {k: v for k, v in values.items() if not skip or skip not in k}


def _agrees(reference: dict, result: dict, *, skip: str = "") -> dict:
  """Largest absolute differences of weights, training and evaluation
  metrics (Keras's names) and the final learning rate between `Model.fit`
  and a tfdist run; metrics whose names contain `skip` are left out."""
  reference = {**reference, **{k: _without(reference[k], skip)
                               for k in ("history", "train", "eval")}}
  return {
      "weights": _max_diff(reference["weights"], result["weights"]),
      "learning_rate": abs(reference["learning_rate"] -
                           result["learning_rate"]),
      # tfdist.fit returns what Model.fit's History holds, epoch by epoch.
      "history": max(abs(a - b) for k, v in reference["history"].items()
                     for a, b in zip(v, result["history"][k])) if all(
                         len(v) == len(result["history"].get(k, ()))
                         for k, v in reference["history"].items())
                 else float("inf"),
      "train": max(abs(v - result["train"][k])
                   for k, v in reference["train"].items()),
      "eval": max(abs(v - result["eval"][k])
                  for k, v in reference["eval"].items()),
  }


# The in-process runs: (case, data source) -> strategies: one device and
# Mirrored (2 replicas) for every case, a few seconds each.
_BOTH = ("one_device", "mirrored")
_IN_PROCESS_RUNS = {
    ("sample_weight", "dataset_fn"): _BOTH,
    ("sample_weight", "parse_fn"): _BOTH,
    ("class_weight", "parse_fn"): _BOTH,
    ("reduce_lr_on_plateau", "dataset_fn"): _BOTH,
    ("learning_rate_scheduler", "dataset_fn"): _BOTH,
    ("early_stopping_restore", "dataset_fn"): _BOTH,
    ("numpy_arrays", "arrays"): _BOTH,
    # validation_data = the arrays, file callbacks, RemoteMonitor; the
    # mirrored run passes its callbacks as one CallbackList.
    ("callbacks", "arrays"): _BOTH,
}


def _brief(run: dict) -> dict:
  """`run` without what is long to print (hooks, printed text)."""
  return {k: v for k, v in run.items()
          if k not in ("hooks", "lambda_hooks", "stdout")}


def _fit_hooks(run: dict, *, batch: bool = True) -> list:
  """The hooks a recording callback received (the `on_test_*` hooks of
  validation too); without the batch hooks unless `batch`."""
  return [h for h in run["hooks"] if batch or "batch" not in h[0]]


def _compare_hooks(test, reference: dict, run: dict, *, batch: bool = True,
                   values: bool = True, skip: str = ""):
  """Asserts the same hooks, in order, with the same batch or epoch and
  logs keys (and values within `ATOL` when `values`, NaN where fit's is
  NaN, except for keys containing `skip`), and the same `params` steps and
  epochs."""
  ours, fits = _fit_hooks(run, batch=batch), _fit_hooks(reference,
                                                        batch=batch)
  test.assertEqual([h[:2] for h in ours], [h[:2] for h in fits])
  for mine, theirs in zip(ours, fits):
    test.assertEqual(sorted(mine[2]), sorted(theirs[2]), mine[:2])
    for key, value in _without(theirs[2], skip).items() if values else ():
      if math.isnan(value):
        test.assertTrue(math.isnan(mine[2][key]), f"{mine[:2]} {key}")
      else:
        test.assertAlmostEqual(mine[2][key], value, delta=ATOL,
                               msg=f"{mine[:2]} {key}")
  test.assertEqual({k: run["params"][k] for k in ("epochs", "steps")},
                   {k: reference["params"][k] for k in ("epochs", "steps")})


def _progbar_lines(stdout: str) -> list:
  """What a ProgbarLogger printed: its `Epoch i/n` lines and, for each
  epoch's finished bar (the last `16/16` line: updates in between depend
  on the clock), the names of the values shown."""
  plain = re.sub(r"\x1b\[[0-9;]*m|\x08", "", stdout)  # Colours, backspaces.
  out = []
  for line in (line.strip() for line in re.split(r"[\r\n]+", plain)):
    if line.startswith("Epoch "):
      out.append(line)
    elif re.match(r"16/16 ", line):
      if out and not isinstance(out[-1], str):
        out.pop()  # An update the finished bar replaces.
      out.append(sorted(re.findall(r"(\w+): ", line)))
  return out


# The cells measured so far by this process's tests: {feature: {strategy:
# text}}; the last test compares them with the docs table.
_CELLS = {}


def _cell(feature: str, strategy: str, text: str):
  _CELLS.setdefault(feature, {})[strategy] = text


class InProcessStrategiesTest(absltest.TestCase):
  """One device and MirroredStrategy (2 logical CPUs) against Model.fit."""

  def _check_matches(self, case: str, feature: str, via: str = "dataset_fn"):
    result = _case(self, "results")
    reference = result["keras"][case]
    for strategy in _IN_PROCESS_RUNS[(case, via)]:
      run = result["tfdist"][f"{case}/{via}/{strategy}"]
      with self.subTest(strategy=strategy):
        self.assertEqual(run["replicas"], 1 if strategy == "one_device"
                         else 2)
        diffs = _agrees(reference, run)
        for what, diff in diffs.items():
          self.assertLess(diff, ATOL, f"{what}: {diffs}\nkeras "
                          f"{_brief(reference)}\ntfdist {_brief(run)}")
      _cell(feature, strategy, "works")
      _cell("history", strategy, "works")

  def test_sample_weights_from_a_dataset_function(self):
    result = _case(self, "results")
    # The example: the weights select y = 3x (Model.fit's slope,
    # about 2.4 after 3 epochs here); dropped, the halves cancel.
    self.assertGreater(result["keras"]["sample_weight"]["weights"][0][0][0],
                       2.0)
    self._check_matches("sample_weight", "sample_weight")

  def test_sample_weights_from_a_parse_fn(self):
    self._check_matches("sample_weight", "sample_weight_parse_fn",
                        via="parse_fn")

  def test_weighted_metrics_take_the_weights_and_keras_names(self):
    result = _case(self, "results")
    for strategy in _IN_PROCESS_RUNS[("sample_weight", "dataset_fn")]:
      run = result["tfdist"][f"sample_weight/dataset_fn/{strategy}"]
      self.assertEqual(set(result["keras"]["sample_weight"]["train"]),
                       {k for k in run["train"] if not k.startswith("val_")})
      # The weighted and unweighted mae differ: the weights reached one.
      self.assertGreater(abs(run["eval"]["mae"] - run["eval"]["weighted_mae"]),
                         0.5)
      _cell("weighted_metrics", strategy, "works")

  def test_class_weights(self):
    self._check_matches("class_weight", "class_weight", via="parse_fn")

  def test_reduce_lr_on_plateau_changes_the_schedules_rate(self):
    result = _case(self, "results")
    # Halved at the end of epochs 1 and 2 (epoch 0 improves on infinity).
    self.assertAlmostEqual(
        result["keras"]["reduce_lr_on_plateau"]["learning_rate"], 0.025)
    self._check_matches("reduce_lr_on_plateau", "reduce_lr_on_plateau")

  def test_learning_rate_scheduler_sets_each_epochs_rate(self):
    self._check_matches("learning_rate_scheduler", "learning_rate_scheduler")

  def test_rate_set_by_a_callback_is_checkpointed(self):
    # 2 epochs with ReduceLROnPlateau (the rate halves once, to 0.05), then
    # the run resumed to 3 epochs without the callback: still 0.05, not the
    # schedule's 0.1.
    for strategy in _BOTH:
      resumed = _case(self, "results")["resumed"][strategy]
      self.assertAlmostEqual(resumed["first_learning_rate"], 0.05, places=6)
      self.assertAlmostEqual(resumed["learning_rate"], 0.05, places=6)
      self.assertGreater(resumed["restored_step"], 0)
      _cell("learning_rate_checkpointed", strategy, "works")

  def test_restored_best_weights_are_the_one_answer(self):
    result = _case(self, "results")
    best = result["keras"]["early_stopping_restore"]
    self._check_matches("early_stopping_restore", "early_stopping_restore")
    for strategy in _IN_PROCESS_RUNS[("early_stopping_restore",
                                      "dataset_fn")]:
      run = result["tfdist"][f"early_stopping_restore/dataset_fn/{strategy}"]
      with self.subTest(strategy=strategy):
        for where in ("checkpoint_slope", "export_slope"):
          self.assertAlmostEqual(run[where], best["weights"][0][0][0],
                                 delta=ATOL, msg=where)
        self.assertAlmostEqual(run["final_eval_loss"], best["eval"]["loss"],
                               delta=ATOL)

  def test_numpy_arrays_with_validation_split(self):
    result = _case(self, "results")
    # Model.fit's val_ metrics of the last quarter, epoch by epoch.
    self.assertIn("val_loss", result["keras"]["numpy_arrays"]["history"])
    self._check_matches("numpy_arrays", "numpy_arrays", via="arrays")
    for strategy in _IN_PROCESS_RUNS[("numpy_arrays", "arrays")]:
      _cell("validation_split", strategy, "works")

  def test_custom_losses_and_metrics(self):
    # The metric subclass is compiled into every slope case; the loss
    # subclass into sample_weight, the loss function into numpy_arrays.
    result = _case(self, "results")
    self.assertIn("abs_error", result["keras"]["sample_weight"]["train"])
    self._check_matches("sample_weight", "custom_loss_class")
    self._check_matches("numpy_arrays", "custom_loss_function", via="arrays")
    self._check_matches("numpy_arrays", "custom_metric", via="arrays")

  def test_compiled_steps_per_execution_is_warned_and_changes_nothing(self):
    result = _case(self, "results")
    # Model.fit ran 4 steps per call: 4 batch hooks an epoch.
    batch_ends = [h for h in result["keras"]["class_weight"]["hooks"]
                  if h[0] == "on_train_batch_end"]
    self.assertEqual([h[1] for h in batch_ends[:4]], [3, 7, 11, 15])
    self._check_matches("class_weight", "steps_per_execution", via="parse_fn")
    for strategy in _BOTH:
      warnings = result["tfdist"][f"class_weight/parse_fn/{strategy}"][
          "warnings"]
      self.assertLen(warnings, 1, warnings)
      self.assertIn("compiled with steps_per_execution=4, which tfdist does "
                    "not read: it runs --steps_per_execution=1", warnings[0])
      self.assertIn("Set --steps_per_execution=4", warnings[0])
      _cell("steps_per_execution", strategy, "works (warned at start: "
            "tfdist groups steps by --steps_per_execution; the same "
            "weights)")

  def test_callbacks_get_fits_hooks_params_and_logs(self):
    result = _case(self, "results")
    for case, via in (("reduce_lr_on_plateau", "dataset_fn"),
                      ("numpy_arrays", "arrays"), ("callbacks", "arrays")):
      reference = result["keras"][case]
      # Model.fit validates: on_test_* hooks (compared in _compare_hooks)
      # before each on_epoch_end.
      self.assertTrue([h for h in reference["hooks"]
                       if h[0] == "on_test_batch_end"])
      for strategy in _IN_PROCESS_RUNS[(case, via)]:
        run = result["tfdist"][f"{case}/{via}/{strategy}"]
        with self.subTest(case=case, strategy=strategy):
          _compare_hooks(self, reference, run)
          self.assertEqual(run["lambda_hooks"], reference["lambda_hooks"])
    for strategy in _BOTH:
      _cell("callback_subclass", strategy, "works")
      _cell("lambda_callback", strategy, "works")

  def test_stop_training_in_a_batch_hook_stops_after_that_batch(self):
    # numpy_arrays stops in on_train_batch_end of epoch 2's batch 4 (12
    # steps an epoch): fit runs 29 steps, then validates the cut epoch
    # and calls its on_epoch_end.
    from tests import fit_conformance_testlib as lib  # pylint: disable=g-import-not-at-top
    result = _case(self, "results")
    reference = result["keras"]["numpy_arrays"]
    epoch, batch = lib.STOP_AT_BATCH
    self.assertEqual(reference["iterations"], epoch * 12 + batch + 1)
    last = [h[:2] for h in reference["hooks"] if h[0] in (
        "on_train_batch_end", "on_epoch_end")][-2:]
    self.assertEqual(last, [["on_train_batch_end", batch],
                            ["on_epoch_end", epoch]])
    for strategy in _IN_PROCESS_RUNS[("numpy_arrays", "arrays")]:
      run = result["tfdist"][f"numpy_arrays/arrays/{strategy}"]
      self.assertEqual(run["final_step"], reference["iterations"])
    # The same weights, history and hooks (test_callbacks_get_fits_...).
    self._check_matches("numpy_arrays", "stop_in_batch_hook", via="arrays")

  def test_early_stopping_stops_after_the_same_epoch(self):
    result = _case(self, "results")
    self.assertEqual(len(result["keras"]["callbacks"]["history"]["loss"]), 2)
    self._check_matches("callbacks", "early_stopping", via="arrays")

  def test_validation_data_arrays(self):
    # The callbacks case validates on the arrays in Model.fit and tfdist.
    self.assertIn("val_loss", _case(self, "results")["keras"]["callbacks"][
        "history"])
    self._check_matches("callbacks", "validation_data", via="arrays")

  def test_callback_lists_are_flattened(self):
    # One device: a CallbackList inside the list; mirrored: callbacks= a
    # CallbackList (both as Model.fit takes them).
    self._check_matches("callbacks", "callback_list", via="arrays")

  def test_progbar_logger_prints_what_fit_prints(self):
    result = _case(self, "results")
    reference = _progbar_lines(result["keras"]["callbacks"]["stdout"])
    self.assertEqual([line for line in reference if isinstance(line, str)],
                     ["Epoch 1/3", "Epoch 2/3"])
    self.assertIn("val_loss", reference[1])
    for strategy in _BOTH:
      run = result["tfdist"][f"callbacks/arrays/{strategy}"]
      self.assertEqual(_progbar_lines(run["stdout"]), reference)
      _cell("progbar_logger", strategy, "works")

  def test_remote_monitor_posts_fits_epoch_logs(self):
    result = _case(self, "results")
    reference = result["keras"]["callbacks"]["posts"]
    self.assertEqual([p["epoch"] for p in reference], [0, 1])
    for strategy in _BOTH:
      posts = result["tfdist"][f"callbacks/arrays/{strategy}"]["posts"]
      self.assertEqual([sorted(p) for p in posts],
                       [sorted(p) for p in reference])
      for post, fits in zip(posts, reference):
        for key, value in fits.items():
          self.assertAlmostEqual(post[key], value, delta=ATOL, msg=key)
      _cell("remote_monitor", strategy, "works (from the chief only)")

  def test_file_callbacks_write_what_fit_writes(self):
    result = _case(self, "results")
    reference = result["keras"]["callbacks"]["files"]
    self.assertEqual(reference["ckpt"], ["w_1.weights.h5", "w_2.weights.h5"])
    for strategy in _BOTH:
      self.assertEqual(result["tfdist"][f"callbacks/arrays/{strategy}"][
          "files"], reference)
      _cell("file_callbacks", strategy, "works")

  def test_terminate_on_nan_stops_at_fits_step(self):
    result = _case(self, "results")
    reference = result["keras"]["terminate_on_nan"]
    steps = reference["iterations"]
    self.assertEqual(steps, 6)  # The NaN example is in batch 5.
    # fit's last hooks: the NaN batch's end, the cut epoch's validation
    # and end, the end of training (a CSVLogger closes its file there).
    self.assertEqual([h[:2] for h in reference["hooks"][-4:]], [
        ["on_test_batch_end", 15], ["on_test_end", None],
        ["on_epoch_end", 0], ["on_train_end", None]])
    self.assertTrue(math.isnan(reference["hooks"][-2][2]["loss"]))
    for strategy in _BOTH:
      run = result["terminate_on_nan"][strategy]
      with self.subTest(strategy=strategy):
        self.assertRegex(run.get("diverged", "not stopped"),
                         rf"^TrainingDivergedError: Training diverged at "
                         rf"step {steps}: the training loss is nan")
        # The NaN is in the features, so the error says so (not: lower
        # the learning rate).
        self.assertIn(
            f"The training data is the likely cause: the batch of step "
            f"{steps} on this worker holds 1 NaN in its features (rows [3] "
            "of replica 0's batch)", run["diverged"])
        self.assertNotIn("--base_learning_rate", run["diverged"])
        # Step 6 is before the first checkpoint (epoch 0's end): none to
        # keep, and the message says so.
        self.assertIn("It diverged before its first checkpoint",
                      run["diverged"])
        # The same hooks as fit's, in order, with the same (NaN) logs.
        _compare_hooks(self, reference, run)
        self.assertEqual(run["lambda_hooks"], reference["lambda_hooks"])
      _cell("terminate_on_nan", strategy, "works (stops at fit's step "
            "after fit's hooks, then raises TrainingDivergedError, status "
            "1, keeping the last good checkpoint)")

  def test_backup_and_restore_is_refused_at_start(self):
    # In this process: refused before the model is built (model_fn fails
    # the test if called), so it takes no training run.
    import keras  # pylint: disable=g-import-not-at-top
    import tfdist  # pylint: disable=g-import-not-at-top
    with self.assertRaisesRegex(
        tfdist.ConfigError, r"^callbacks: keras.callbacks.BackupAndRestore "
        r"is not supported: tfdist's own checkpoints .* Instead, drop it"):
      _refused_fit(callbacks=[keras.callbacks.BackupAndRestore(
          tempfile.mkdtemp(dir=testutil.scratch_dir()))])
    for strategy in STRATEGIES:
      _cell("backup_and_restore", strategy, "refused at start (tfdist's "
            "checkpoints back up and resume the run)")

  def test_class_and_sample_weights_are_refused_at_start(self):
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tfdist  # pylint: disable=g-import-not-at-top
    with self.assertRaisesRegex(
        tfdist.ConfigError, r"^--class_weight=0:1.0 and sample weights in .* "
        r"cannot be used together"):
      _refused_fit(class_weight={0: 1.0}, sample_weight=np.ones(8))
    for strategy in STRATEGIES:
      _cell("class_and_sample_weight", strategy,
            "refused at start (as Keras's fit refuses it)")


def _refused_fit(*, class_weight=(), **kwargs):
  """`tfdist.fit` on 8 rows of arrays with a model function that fails if
  called: for arguments refused at start."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top

  def model_fn():
    raise AssertionError("the model was built before the check")
  tfdist.fit(model_fn, config=tfdist.TrainConfig(
      model_dir=tempfile.mkdtemp(dir=testutil.scratch_dir()),
      train_steps=1, batch_size=4, distribution_strategy="one_device",
      class_weight=class_weight), x=np.zeros((8, 1), "float32"),
             y=np.zeros(8, "float32"), **kwargs)


class NonFiniteValidationDataTest(absltest.TestCase):
  """NaN validation data: `fit` trains on and reports a NaN `val_loss`;
  so does tfdist, with a warning that names the data (not the learning
  rate) as the cause, and fit's hooks (a CSVLogger writes every epoch)."""

  def test_nan_in_validation_data_is_reported_and_named(self):
    import keras  # pylint: disable=g-import-not-at-top
    import tfdist  # pylint: disable=g-import-not-at-top
    from tests import fit_conformance_testlib as lib  # pylint: disable=g-import-not-at-top
    x, y, w = lib.slope_data()
    held_out = [a[:128].copy() for a in (x, y, w)]
    held_out[0][5, 0] = float("nan")
    model_dir = tempfile.mkdtemp(dir=testutil.scratch_dir())
    csv = os.path.join(model_dir, "log.csv")
    with self.assertLogs(level="INFO") as logs:
      result = tfdist.fit(
          lambda: lib.build_model("sample_weight"),
          config=tfdist.TrainConfig(
              model_dir=model_dir, train_epochs=2,
              batch_size=lib.GLOBAL_BATCH, optimizer="sgd",
              distribution_strategy="one_device", log_steps=1000),
          x=x, y=y, sample_weight=w, validation_data=tuple(held_out),
          callbacks=[keras.callbacks.CSVLogger(csv)])
    # Keras's: both epochs trained, each val_loss NaN.
    self.assertEqual(result["final_step"], 32)
    val_loss = result["history"]["val_loss"]
    self.assertLen(val_loss, 2)
    self.assertTrue(all(math.isnan(v) for v in val_loss), val_loss)
    warned = "\n".join(logs.output)
    self.assertIn("the evaluation loss at step 16 is nan while the model's "
                  "weights and optimizer state are finite, so the evaluation "
                  "data is the likely cause", warned)
    self.assertNotIn("--base_learning_rate", warned)
    with open(csv) as f:
      self.assertLen(f.read().splitlines(), 3)  # A header, two epochs.


class SchedulerWithDefaultWarmupTest(absltest.TestCase):
  """`LearningRateScheduler` sets epoch 0's rate at step 0, where tfdist's
  default warmup gives 0 (the rate was not settable there: a crash at step
  0). Without a warmup asked for, the scheduler's rates are the run's, as
  in `fit`; a warmup from 0 asked for is refused at start."""

  def test_the_schedulers_rates_without_a_warmup_asked_for(self):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tfdist  # pylint: disable=g-import-not-at-top
    from tests import fit_conformance_testlib as lib  # pylint: disable=g-import-not-at-top
    reference = lib.keras_fit("learning_rate_scheduler")
    recorder = lib.Recorder()
    arrays = lib.slope_data()
    tfdist.fit(lambda: lib.build_model("learning_rate_scheduler"),
               config=tfdist.TrainConfig(
                   model_dir=tempfile.mkdtemp(dir=testutil.scratch_dir()),
                   train_epochs=lib.EPOCHS, batch_size=lib.GLOBAL_BATCH,
                   optimizer="sgd", momentum=0.0, shuffle_buffer_size=0,
                   distribution_strategy="one_device", log_steps=1000),
               dataset_fn=lambda training: tf.data.Dataset.from_tensor_slices(
                   arrays),
               callbacks=[*lib.CASES["learning_rate_scheduler"][
                   "callbacks"](), recorder])
    self.assertAlmostEqual(recorder.learning_rate, reference["learning_rate"],
                           places=6)
    self.assertLess(_max_diff(recorder.weights, reference["weights"]), ATOL)

  def test_a_warmup_from_zero_is_refused_at_start(self):
    import keras  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tfdist  # pylint: disable=g-import-not-at-top

    def model_fn():
      raise AssertionError("the model was built before the check")
    with self.assertRaisesRegex(
        tfdist.ConfigError, r"^callbacks: keras.callbacks."
        r"LearningRateScheduler with warmup_steps=2 .* Instead, leave the "
        r"warmup out .*warmup_start_learning_rate"):
      tfdist.fit(model_fn, config=tfdist.TrainConfig(
          model_dir=tempfile.mkdtemp(dir=testutil.scratch_dir()),
          train_steps=4, batch_size=4, warmup_steps=2,
          distribution_strategy="one_device"),
                 x=np.zeros((8, 1), "float32"), y=np.zeros(8, "float32"),
                 callbacks=[keras.callbacks.LearningRateScheduler(
                     lambda epoch, lr: 0.1)])


class EvalModeTest(absltest.TestCase):
  """`--mode=eval` evaluates as the run evaluated."""

  def test_eval_mode_reports_the_runs_final_eval(self):
    # A metric with one value per batch depends on the per-replica batch:
    # only the run's strategy (Mirrored, 2 replicas) and evaluation batch
    # (64) give the run's number (one device at 1,024 does not).
    result = _case(self, "results")["eval_mode"]
    self.assertEqual(result["run_eval_batch_size"], 64)
    (evaluated,) = result["results"]
    self.assertEqual(evaluated["evaluated_with"]["strategy"], "mirrored")
    self.assertEqual(evaluated["evaluated_with"]["num_replicas_in_sync"], 2)
    self.assertEqual(evaluated["evaluated_with"]["global_batch_size"], 64)
    for name in ("loss", "spread"):
      self.assertAlmostEqual(evaluated[name], result["run_eval"][name],
                             delta=1e-5, msg=name)


  def test_evaluator_plan_under_each_run_strategy(self):
    import tfdist  # pylint: disable=g-import-not-at-top
    from tfdist import experiment  # pylint: disable=g-import-not-at-top
    config = tfdist.TrainConfig(model_dir="/unused", batch_size=32,
                                num_gpus=0, num_cpu_devices=2)
    record = {"eval_batch_size": 64, "global_batch_size": 64}
    plans = {s: experiment.evaluator_plan(config, run_strategy=s,
                                          run_record=record)
             for s in ("one_device", "mirrored", "multi_worker_mirrored",
                       "parameter_server", "tpu")}
    self.assertEqual({s: p.strategy for s, p in plans.items()}, {
        "one_device": "one_device", "mirrored": "mirrored",
        # One process outside the cluster: its 2 local devices.
        "multi_worker_mirrored": "mirrored", "parameter_server": "mirrored",
        "tpu": "one_device"})
    self.assertEqual({p.global_batch_size for p in plans.values()}, {64})
    one_cpu = config.replace(num_cpu_devices=1)
    self.assertEqual(experiment.evaluator_plan(
        one_cpu, run_strategy="multi_worker_mirrored",
        run_record=record).strategy, "one_device")
    # A record without eval_batch_size: its global batch; the
    # parameter-server coordinator's at least 1,024.
    ps = experiment.evaluator_plan(one_cpu, run_strategy="parameter_server",
                                   run_record={"global_batch_size": 64,
                                               "strategy":
                                                   "parameter_server"})
    self.assertEqual(ps.global_batch_size, 1024)
    # No record yet (an evaluator task starting first): the run's rule on
    # the job's flags.
    self.assertEqual(experiment.evaluator_plan(
        one_cpu, run_strategy="mirrored", run_record=None).global_batch_size,
                     32)
    self.assertEqual(experiment.evaluator_plan(
        one_cpu, run_strategy="parameter_server",
        run_record=None).global_batch_size, 1024)


class BatchValuedMetricsTest(absltest.TestCase):

  def test_a_metric_returning_one_value_per_batch_is_found(self):
    import keras  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdist.training import objectives  # pylint: disable=g-import-not-at-top

    def spread(y_true, y_pred):
      del y_true
      return keras.ops.max(y_pred) - keras.ops.min(y_pred)

    metrics = [objectives.resolve_metric(m, y_true=tf.TensorShape([None]),
                                         y_pred=tf.TensorShape([None, 1]))
               for m in (spread, "mae", "accuracy")]
    self.assertEqual(objectives.batch_valued_metrics(
        metrics, y_true=tf.TensorSpec([None], tf.float32),
        y_pred=tf.TensorSpec([None, 1], tf.float32)), ["spread"])
    _cell("batch_valued_metric", "one_device", "works")

  def test_mirrored_run_warns_naming_the_metric(self):
    warnings = _case(self, "results")["batch_valued_warnings"]
    self.assertLen(warnings, 1, warnings)
    self.assertIn("Metric(s) spread return one value per batch", warnings[0])
    self.assertIn("per-replica batches of 32 examples (2 replicas",
                  warnings[0])
    _cell("batch_valued_metric", "mirrored", "warned at start (the value "
          "depends on the per-replica batch)")


class EveryKerasCallbackTest(absltest.TestCase):
  """Every public class of `keras.callbacks` has a row in the table."""

  def test_every_callback_class_has_a_row(self):
    import inspect  # pylint: disable=g-import-not-at-top
    import keras  # pylint: disable=g-import-not-at-top
    classes = sorted(name for name, value in vars(keras.callbacks).items()
                     if inspect.isclass(value) and
                     issubclass(value, keras.callbacks.Callback))
    self.assertIn("TerminateOnNaN", classes)
    self.assertEqual([c for c in classes if c not in CALLBACK_ROWS], [],
                     "a keras.callbacks class without a row: add its row to "
                     "FEATURES and CALLBACK_ROWS, with a case that shows it "
                     "works as in Model.fit or is refused at start")
    rows = {key for key, _ in FEATURES}
    self.assertEqual({c: CALLBACK_ROWS[c] for c in classes
                      if CALLBACK_ROWS[c] not in rows}, {})

  def test_refused_callbacks_stop_before_the_model_is_built(self):
    import keras  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tfdist  # pylint: disable=g-import-not-at-top

    def model_fn():
      raise AssertionError("the model was built before the check")
    config = tfdist.TrainConfig(
        model_dir=tempfile.mkdtemp(dir=testutil.scratch_dir()),
        train_steps=1, batch_size=4, distribution_strategy="one_device")
    for name, (pattern, cell) in REFUSED_CALLBACKS.items():
      cls = getattr(keras.callbacks, name, None)
      if cls is None:
        continue  # Not in this Keras (OrbaxCheckpoint: Keras >= 3.13).
      # OrbaxCheckpoint's constructor needs the orbax package: the check
      # reads only the class.
      callback = (cls.__new__(cls) if name == "OrbaxCheckpoint" else
                  cls(tempfile.mkdtemp(dir=testutil.scratch_dir()))
                  if name == "BackupAndRestore" else cls())
      # Inside a CallbackList too.
      for callbacks in ([callback], keras.callbacks.CallbackList([callback])):
        with self.assertRaisesRegex(
            tfdist.ConfigError, rf"^callbacks: keras.callbacks.{name} is not "
            rf"supported: .*{pattern}"):
          tfdist.fit(model_fn, config=config, x=np.zeros((8, 1), "float32"),
                     y=np.zeros(8, "float32"), callbacks=callbacks)
      for strategy in STRATEGIES:
        _cell(CALLBACK_ROWS[name], strategy, cell)


class InMemoryArgumentsTest(absltest.TestCase):
  """`tfdist.fit`'s array arguments are checked before the model is built
  (the model function here fails the test if called)."""

  def _refused(self, pattern, **kwargs):
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tfdist  # pylint: disable=g-import-not-at-top

    def model_fn():
      raise AssertionError("the model was built before the check")
    kwargs.setdefault("x", np.zeros((8, 1), "float32"))
    config = tfdist.TrainConfig(
        model_dir=tempfile.mkdtemp(dir=testutil.scratch_dir()),
        train_steps=1, batch_size=4, distribution_strategy="one_device")
    with self.assertRaisesRegex(tfdist.ConfigError, pattern):
      tfdist.fit(model_fn, config=config, **kwargs)

  def test_each_pipeline_reads_a_disjoint_share_every_example_once(self):
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdist import api  # pylint: disable=g-import-not-at-top
    x = np.arange(10, dtype="float32")[:, None]
    input_fn, has_validation = api.in_memory_dataset(
        x=x, y=np.arange(10), validation_split=0.3)
    self.assertTrue(has_validation)
    for training, rows in ((True, range(7)), (False, range(7, 10))):
      shares = [[int(y) for _, y in input_fn(
          training=training, input_context=tf.distribute.InputContext(
              num_input_pipelines=3, input_pipeline_id=i))]
                for i in range(3)]
      self.assertEqual(sorted(sum(shares, [])), list(rows))
      self.assertEqual([len(s) for s in shares],
                       [len(rows[i::3]) for i in range(3)])
    # Without validation data nothing is held out; the eval modes read the
    # arrays themselves.
    input_fn, has_validation = api.in_memory_dataset(x=x, y=np.arange(10))
    self.assertFalse(has_validation)
    self.assertLen(list(input_fn(training=False,
                                 input_context=tf.distribute.InputContext())),
                   10)

  def test_a_resumed_run_continues_the_arrays_epoch(self):
    # 300 rows at batch 32: epochs of 9 steps. Stopped after step 13 (epoch
    # 1, 4 steps in), the rerun's input continues epoch 1 after those 4
    # steps' rows (the input position), not from its start.
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tfdist  # pylint: disable=g-import-not-at-top
    from tests import fit_conformance_testlib as lib  # pylint: disable=g-import-not-at-top
    model_dir = tempfile.mkdtemp(dir=testutil.scratch_dir())
    x = np.linspace(-1, 1, 300, dtype="float32")[:, None]
    for steps in (13, 18):
      config = tfdist.TrainConfig(
          model_dir=model_dir, train_steps=steps, batch_size=32,
          optimizer="sgd", distribution_strategy="one_device",
          checkpoint_steps=13, log_steps=1000, mode="train")
      with self.assertLogs(level="INFO") as logs:
        tfdist.fit(lambda: lib.build_model("sample_weight"), config=config,
                   x=x, y=3 * x[:, 0])
    self.assertIn("tfdist: input position restored: step 13 continues "
                  "epoch 1 where the checkpoint stopped.",
                  "\n".join(logs.output))

  def test_mismatched_lengths(self):
    import numpy as np  # pylint: disable=g-import-not-at-top
    self._refused(r"Arrays of different lengths: x has 8 rows, y has 7 "
                  r"rows, sample_weight has 8 rows", y=np.zeros(7),
                  sample_weight=np.zeros(8))
    self._refused(r"validation_data x has 3 rows, validation_data y has 2",
                  y=np.zeros(8), validation_data=(np.zeros((3, 1)),
                                                  np.zeros(2)))
    self._refused(r"x: the arrays have different numbers of rows \(\[5, 8\]\)",
                  x={"a": np.zeros((8, 1)), "b": np.zeros((5, 1))},
                  y=np.zeros(8))

  def test_validation_split_outside_zero_one(self):
    import numpy as np  # pylint: disable=g-import-not-at-top
    for split in (-0.1, 1.0, 1.5):
      self._refused(rf"validation_split={split} must be in \(0, 1\)",
                    y=np.zeros(8), validation_split=split)
    self._refused(r"validation_split=0.9 of 8 examples leaves 0 for "
                  r"training and 8 for evaluation", y=np.zeros(8),
                  validation_split=0.9)

  def test_validation_split_with_a_dataset_function(self):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    self._refused(r"validation_split=0.2 is only for arrays \(x, y\), as "
                  r"in keras.Model.fit", x=None, validation_split=0.2,
                  dataset_fn=lambda: tf.data.Dataset.range(8))

  def test_arrays_and_a_dataset_function(self):
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    self._refused(r"arrays \(x, y\) or dataset_fn, not both",
                  y=np.zeros(8), dataset_fn=lambda: tf.data.Dataset.range(8))

  def test_bad_validation_data(self):
    import numpy as np  # pylint: disable=g-import-not-at-top
    self._refused(r"validation_data must be a tuple \(x_val, y_val\) .* "
                  r"received tuple of 1 entries", y=np.zeros(8),
                  validation_data=(np.zeros(8),))
    self._refused(r"y or sample_weight given without x", x=None,
                  y=np.zeros(8))

# The callback-state runs: epochs of 6 steps (192 training rows, batch 32).
_CALLBACK_STATE_EPOCHS = 8
_CALLBACK_STATE_CHILD_ENV = "TFDIST_CALLBACK_STATE_CHILD"


def _callback_state_fit(model_dir: str, *, strategy: str, interrupt_at=None,
                        log_steps: int = 2) -> dict:
  """One `tfdist.fit` call with EarlyStopping(restore_best_weights=True,
  patience=2) and ReduceLROnPlateau; returns its epochs, rates, best and
  stopped epochs, final step and final weights (or `preempted`: the step a
  SIGTERM stopped it at). `interrupt_at`: `(epoch, batch)` whose
  `on_train_batch_begin` sends the SIGTERM (the run stops after the step
  that follows)."""
  import signal  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = rng.uniform(-1, 1, (256, 1)).astype("float32")
  y = 3 * x[:, 0] + rng.normal(0, 0.1, 256).astype("float32")
  models = []

  def model_fn():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(
        1, use_bias=False, kernel_initializer="zeros")])
    model.compile(loss="mse")
    models.append(model)
    return model

  seen = {"epochs": [], "rates": []}

  class Record(keras.callbacks.Callback):

    def on_epoch_end(self, epoch, logs=None):
      seen["epochs"].append(epoch)
      seen["rates"].append(float(logs["learning_rate"]))

  class Interrupt(keras.callbacks.Callback):

    def on_epoch_begin(self, epoch, logs=None):
      seen["epoch"] = epoch

    def on_train_batch_begin(self, batch, logs=None):
      if (seen.get("epoch"), batch) == interrupt_at:
        os.kill(os.getpid(), signal.SIGTERM)

  # "max" on a falling val_loss: epoch 0 stays the best, so EarlyStopping
  # (patience 2) stops after epoch 2 and restores epoch 0's weights, and
  # ReduceLROnPlateau halves the rate after epoch 1 (then cools down).
  early = keras.callbacks.EarlyStopping(
      monitor="val_loss", mode="max", patience=2, restore_best_weights=True)
  reduce = keras.callbacks.ReduceLROnPlateau(
      monitor="val_loss", mode="max", patience=1, factor=0.5, cooldown=1)
  config = tfdist.TrainConfig(
      model_dir=model_dir, train_epochs=_CALLBACK_STATE_EPOCHS,
      batch_size=32, optimizer="sgd", base_learning_rate=0.05,
      lr_scaling="none", distribution_strategy=strategy, log_steps=log_steps,
      # After a signal the grace-period clock runs until the process exits
      # (it ends one still running after that long); this process trains
      # on, resuming, so the bound is far beyond the test.
      preemption_grace_seconds=3600)
  try:
    result = tfdist.fit(model_fn, config=config, x=x, y=y,
                        validation_split=0.25, verbose=0,
                        callbacks=[early, reduce, Record(), Interrupt()])
  except tfdist.errors.PreemptedError as e:
    return {"preempted": e.step}
  seen.pop("epoch", None)
  return {**seen, "best_epoch": early.best_epoch,
          "stopped_epoch": early.stopped_epoch, "step": result["final_step"],
          "replicas": result["num_replicas_in_sync"],
          "weights": [w.tolist() for w in models[-1].get_weights()]}


def _callback_state_runs(*, strategy: str, interrupt_at,
                         log_steps: int) -> dict:
  """The uninterrupted run (`whole`), then one interrupted at
  `interrupt_at` (`first`) and its resumed run (`resumed`)."""
  whole = _callback_state_fit(tempfile.mkdtemp(dir=testutil.scratch_dir()),
                              strategy=strategy, log_steps=log_steps)
  model_dir = tempfile.mkdtemp(dir=testutil.scratch_dir())
  first = _callback_state_fit(model_dir, strategy=strategy,
                              interrupt_at=interrupt_at, log_steps=log_steps)
  resumed = _callback_state_fit(model_dir, strategy=strategy,
                                log_steps=log_steps)
  return {"whole": whole, "first": first, "resumed": resumed}


class CallbackStateResumeTest(absltest.TestCase):
  """An interrupted and resumed `tfdist.fit` stops and restores as the
  uninterrupted run: EarlyStopping's and ReduceLROnPlateau's state rides in
  every checkpoint. One device in this process; MirroredStrategy on 2
  logical CPUs in a child process (the devices must exist before
  TensorFlow starts)."""

  def test_a_resumed_run_stops_and_restores_as_the_uninterrupted_one(self):
    # The SIGTERM sent as epoch 2 begins stops the run after step 13,
    # mid-epoch, with a checkpoint there.
    with self.assertLogs(level="INFO") as logs:
      runs = _callback_state_runs(strategy="one_device", interrupt_at=(2, 0),
                                  log_steps=2)
    self._check(runs, stopped_at=13)
    _cell("callback_state_resumed", "one_device", "works")
    self.assertIn("tfdist: callback state restored: 0-EarlyStopping, "
                  "1-ReduceLROnPlateau.", "\n".join(logs.output))

  def test_a_run_stopped_at_an_epoch_end_finishes_that_epoch(self):
    # The SIGTERM sent before epoch 1's last step stops the run at that
    # epoch's end (step 12): after its evaluation and on_epoch_end, as the
    # uninterrupted run, so the resumed run starts with epoch 2.
    self._check(_callback_state_runs(strategy="one_device",
                                     interrupt_at=(1, 5), log_steps=1),
                stopped_at=12)

  def test_mirrored_on_two_logical_cpus(self):
    import subprocess  # pylint: disable=g-import-not-at-top
    import sys  # pylint: disable=g-import-not-at-top
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               **{_CALLBACK_STATE_CHILD_ENV: "1"})
    env["PYTHONPATH"] = os.pathsep.join(
        [testutil.REPO_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    child = subprocess.run(
        [sys.executable, os.path.abspath(__file__)], cwd=testutil.REPO_ROOT,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=600)
    lines = [l for l in child.stdout.splitlines() if l.startswith("{")]
    self.assertTrue(child.returncode == 0 and lines, child.stdout[-4000:])
    runs = json.loads(lines[-1])
    self.assertEqual(runs["whole"]["replicas"], 2)
    self._check(runs, stopped_at=13)
    _cell("callback_state_resumed", "mirrored", "works")

  def _check(self, runs: dict, *, stopped_at: int):
    import numpy as np  # pylint: disable=g-import-not-at-top
    whole, first, resumed = runs["whole"], runs["first"], runs["resumed"]
    self.assertEqual((whole["stopped_epoch"], whole["best_epoch"]), (2, 0))
    self.assertEqual(first, {"preempted": stopped_at})
    done = len(whole["epochs"]) - len(resumed["epochs"])
    self.assertEqual(resumed["epochs"], whole["epochs"][done:])
    self.assertEqual(resumed["rates"], whole["rates"][done:])
    for key in ("stopped_epoch", "best_epoch", "step"):
      self.assertEqual(resumed[key], whole[key], key)
    np.testing.assert_allclose(resumed["weights"], whole["weights"],
                               atol=1e-6)


def _cluster(test, case: str, launch_args, files_dir=None) -> dict:
  """Runs `case` on a local cluster (with `file_callbacks(files_dir)`, and
  a RemoteMonitor posting to a server of this process); returns the
  chief's result, with what the processes printed (`output`) and what was
  posted (`posts`)."""
  out = os.path.join(tempfile.mkdtemp(dir=testutil.scratch_dir()),
                     "result.json")
  server = _RemoteMonitorServer()
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
    from tests import fit_conformance_testlib as lib  # pylint: disable=g-import-not-at-top
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
    diffs = _agrees(reference, run)
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
    _compare_hooks(self, reference, run)
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
    from tests import fit_conformance_testlib as lib  # pylint: disable=g-import-not-at-top
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
    _compare_hooks(self, self.reference, run, batch=False, values=False)
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
    from tests import fit_conformance_testlib as lib  # pylint: disable=g-import-not-at-top
    reference = lib.keras_fit("multi_worker_files")
    # EarlyStopping (not restoring) stopped fit after epoch 1.
    self.assertEqual(len(reference["history"]["loss"]), 2)
    run = _cluster(self, "multi_worker_files:parse_fn", ["--num_workers=2"])
    self.assertEqual(run["replicas"], 2)
    # Everything but the metric with one value per batch, which is
    # averaged over per-replica batches of 32 (warned below).
    diffs = _agrees(reference, run, skip="spread")
    for what, diff in diffs.items():
      self.assertLess(diff, ATOL, f"{what}: {diffs}")
    self.assertEqual(run["final_step"], reference["iterations"])
    # fit's batch hooks come once per 4 steps here, tfdist's once per step.
    _compare_hooks(self, reference, run, batch=False, skip="spread")
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
    from tests import fit_conformance_testlib as lib  # pylint: disable=g-import-not-at-top
    reference = lib.keras_fit("parameter_server_files")
    self.assertEqual(len(reference["history"]["loss"]), 2)
    run = _cluster(self, "parameter_server_files:parse_fn",
                   ["--num_workers=2", "--num_ps=1"])
    # Stopped after fit's epoch, with Keras's names.
    self.assertEqual(run["final_step"], reference["iterations"])
    self.assertEqual(sorted(run["history"]), sorted(reference["history"]))
    self.assertEqual({len(v) for v in run["history"].values()}, {2})
    _compare_hooks(self, reference, run, batch=False, values=False)
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

  def _run(self, launch_args):
    from tests import fit_conformance_testlib as lib  # pylint: disable=g-import-not-at-top
    reference = lib.keras_fit_resumed()
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
    self.assertLess(_max_diff(first["weights"], fits["weights"]), ATOL)
    self.assertAlmostEqual(first["learning_rate"], 0.05, places=6)
    # The resumed attempt: fit's hooks and logs, batch by batch, up to the
    # NaN and after it (the cut epoch's validation, its end, the end).
    self._resumed_at_epoch_2(lib, reference, run)
    _compare_hooks(self, reference["second"], run)
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
    unweighted = lib.keras_fit_resumed(class_weight=None)["first"]
    near = _max_diff(first["weights"], fits["weights"])
    self.assertLess(near, PS_CLASS_WEIGHT_TOLERANCE)
    self.assertLess(near, _max_diff(first["weights"],
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
    _compare_hooks(self, reference["second"], run, batch=False,
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

def render_table(cells) -> str:
  """The docs table: one row per feature, one column per strategy; a cell
  this run did not measure reads "not measured"."""
  lines = ["| `fit` feature | " + " | ".join(STRATEGIES) + " |",
           "|---" * (len(STRATEGIES) + 1) + "|"]
  for key, text in FEATURES:
    row = [cells.get(key, {}).get(s, "not measured") for s in STRATEGIES]
    lines.append(f"| {text} | " + " | ".join(row) + " |")
  return "\n".join(lines)


class ZDocsTableTest(absltest.TestCase):
  """Runs after the cases above (absltest orders classes by name)."""

  def test_docs_table_is_what_the_suite_measured(self):
    if len(_CELLS) < 2:
      self.skipTest("run the whole file: the table needs every case")
    with open(DOC) as f:
      text = f.read()
    pattern = re.compile(r"(<!-- conformance-table -->\n)(.*?)(\n<!-- "
                         r"/conformance-table -->)", re.S)
    table = render_table(_CELLS)
    if os.environ.get("TFDIST_WRITE_CONFORMANCE_TABLE"):
      with open(DOC, "w") as f:
        f.write(pattern.sub(lambda m: m.group(1) + table + m.group(3), text))
      return
    match = pattern.search(text)
    self.assertIsNotNone(match, f"{DOC} has no conformance-table markers")
    self.assertEqual(match.group(2), table,
                     "the table in docs/guides/fit-conformance.md differs "
                     "from what the suite measured: rerun with "
                     "TFDIST_WRITE_CONFORMANCE_TABLE=1 and commit it.")


class _RemoteMonitorServer:
  """An HTTP server on 127.0.0.1 keeping what RemoteMonitor posts: each
  post's JSON `data` field."""

  def __init__(self):
    import http.server  # pylint: disable=g-import-not-at-top
    import threading  # pylint: disable=g-import-not-at-top
    import urllib.parse  # pylint: disable=g-import-not-at-top
    import portpicker  # pylint: disable=g-import-not-at-top
    posts = self.posts = []

    class Handler(http.server.BaseHTTPRequestHandler):

      def do_POST(self):  # pylint: disable=invalid-name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        posts.append(json.loads(urllib.parse.parse_qs(body.decode())[
            "data"][0]))
        self.send_response(200)
        self.end_headers()

      def log_message(self, *args):
        del args

    self.server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", portpicker.pick_unused_port()), Handler)
    self.root = f"http://127.0.0.1:{self.server.server_port}"
    threading.Thread(target=self.server.serve_forever, daemon=True).start()

  def take(self) -> list:
    taken, self.posts[:] = list(self.posts), []
    return taken


def _files(folder: str) -> dict:
  """What `file_callbacks(folder)` wrote: the checkpoint names, the CSV's
  header and epochs, and the number of event files per TensorBoard
  folder."""
  with open(os.path.join(folder, "log.csv")) as f:
    rows = f.read().splitlines()
  tb = os.path.join(folder, "tb")
  return {"ckpt": sorted(os.listdir(os.path.join(folder, "ckpt"))),
          "csv": [rows[0]] + [r.split(",")[0] for r in rows[1:]],
          "tb": {sub: len([n for n in os.listdir(os.path.join(tb, sub))
                           if "tfevents" in n]) for sub in sorted(
                               os.listdir(tb))}}


def _captured(run, *, server, warnings, files_dir=None) -> dict:
  """`run()`'s result with what it printed (`stdout`), what RemoteMonitor
  posted (`posts`), the warnings about steps_per_execution it logged and
  what its file callbacks wrote (`files`, given `files_dir`)."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import io  # pylint: disable=g-import-not-at-top
  printed = io.StringIO()
  del warnings[:]
  with contextlib.redirect_stdout(printed):
    result = run()
  result.update(stdout=printed.getvalue(), posts=server.take(),
                warnings=[m for m in warnings if "steps_per_execution" in m])
  if files_dir:
    result["files"] = _files(files_dir)
  return result


def _child_main() -> dict:
  """The one-device and Mirrored runs of every case, and the references."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
  import logging  # pylint: disable=g-import-not-at-top
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  from tests import fit_conformance_testlib as lib  # pylint: disable=g-import-not-at-top
  root = tempfile.mkdtemp(dir=testutil.scratch_dir())
  server = _RemoteMonitorServer()
  lib.REMOTE_MONITOR_ROOT = server.root
  logged = []
  handler = logging.Handler(logging.WARNING)
  handler.emit = lambda record: logged.append(record.getMessage())
  absl_logging.get_absl_logger().addHandler(handler)

  def files_dir(name, case):
    if case != "callbacks":
      return None
    folder = os.path.join(root, "files", name.replace("/", "-"))
    os.makedirs(folder)  # CSVLogger makes none.
    return folder
  out = {"keras": {}, "tfdist": {}}
  for case in {case for case, _ in _IN_PROCESS_RUNS} | {"terminate_on_nan"}:
    folder = files_dir(f"keras-{case}", case)
    out["keras"][case] = _captured(
        lambda: lib.keras_fit(case, files_dir=folder), server=server,
        warnings=logged, files_dir=folder)
  for (case, via), strategies in _IN_PROCESS_RUNS.items():
    for strategy in strategies:
      name = f"{case}/{via}/{strategy}"
      folder = files_dir(name, case)
      out["tfdist"][name] = _captured(lambda: lib.tfdist_fit(
          case, strategy=strategy, via=via,
          model_dir=os.path.join(root, name.replace("/", "-")),
          extra_callbacks=lib.file_callbacks(folder) if folder else (),
          callback_list=("" if case != "callbacks" else
                         "inner" if strategy == "one_device" else "outer")),
                                      server=server, warnings=logged,
                                      files_dir=folder)
  out["terminate_on_nan"] = {}
  for strategy in _BOTH:
    # Its "diverged" entry holds the error.
    out["terminate_on_nan"][strategy] = lib.tfdist_fit(
        "terminate_on_nan", strategy=strategy,
        model_dir=os.path.join(root, f"nan-{strategy}"))
  del logged[:]
  run = lib.tfdist_fit("batch_valued_metric", strategy="mirrored",
                       model_dir=os.path.join(root, "batch_valued"),
                       epochs=1)
  absl_logging.get_absl_logger().removeHandler(handler)
  out["batch_valued_warnings"] = [m for m in logged
                                  if "one value per batch" in m]
  # --mode=eval on that run's checkpoint, told no strategy (auto).
  evaluated = lib.tfdist_fit("batch_valued_metric", strategy="auto",
                             model_dir=os.path.join(root, "batch_valued"),
                             epochs=1, mode="eval")
  out["eval_mode"] = {"run_eval": run["eval"],
                      "run_eval_batch_size": run["eval_batch_size"],
                      "results": evaluated["results"]}
  out["resumed"] = {}
  for strategy in _BOTH:
    resumed_dir = os.path.join(root, f"resumed-{strategy}")
    first = lib.tfdist_fit("reduce_lr_on_plateau", strategy=strategy,
                           model_dir=resumed_dir, epochs=2)
    second = lib.tfdist_fit("sample_weight", strategy=strategy,
                            model_dir=resumed_dir)
    out["resumed"][strategy] = {
        "first_learning_rate": first["learning_rate"],
        "learning_rate": second["learning_rate"],
        "restored_step": second["restored_step"]}
  server.server.shutdown()
  return {"results": out}


def _callback_state_child() -> dict:
  """`CallbackStateResumeTest`'s MirroredStrategy runs, on 2 logical CPUs."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
  return _callback_state_runs(strategy="mirrored", interrupt_at=(2, 0),
                              log_steps=2)


if __name__ == "__main__":
  if os.environ.get(_CHILD_ENV):
    print(json.dumps(_child_main()), flush=True)
  elif os.environ.get(_CALLBACK_STATE_CHILD_ENV):
    print(json.dumps(_callback_state_child()), flush=True)
  else:
    absltest.main()
