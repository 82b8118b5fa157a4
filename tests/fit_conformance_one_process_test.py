"""`tfdist.fit` keeps `keras.Model.fit`'s contract on one device and under
MirroredStrategy, and refuses at start what it cannot keep.

The same small models and data (`tests/fit_conformance_testlib.py`) go
through `keras.Model.fit` + `Model.evaluate` on one device and through
`tfdist.fit`, and the final weights and reported metrics are compared:
every case runs once on one device and on MirroredStrategy with 2 logical
CPUs, in this process when no test trained here before it (the logical
devices must exist before TensorFlow's runtime starts), else in one child
process (this file run as a script), with start-up paid once. The
multi-process strategies (MultiWorkerMirrored, parameter servers) are in
`tests/fit_conformance_test.py`; this file runs one TensorFlow process at a
time, so it is no cluster target.

Callbacks: a recording `Callback` subclass and a `LambdaCallback` run in
every case, with `Model.fit` as with tfdist, and their hooks, `params` and
logs are compared (`fit_conformance_testlib.compare_hooks`). Every public
class of `keras.callbacks` has a row (`CALLBACK_ROWS`, checked by
`EveryKerasCallbackTest`).

Tolerances: synchronous strategies make the same updates on the same global
batches as one device, so weights and metrics agree to float32 round-off
(`ATOL` = 1e-4 absolute).

The table of `docs/guides/fit-conformance.md` (between its
`conformance-table` markers): this file checks the one-device and Mirrored
columns and the rows refused at start (`fit_conformance_testlib.
table_owner`); with `TFDIST_WRITE_CONFORMANCE_TABLE=1` it writes them.
"""

import json
import math
import os
import re
import tempfile

from absl.testing import absltest

from tests import fit_conformance_testlib as lib
from tests import testutil

_CHILD_ENV = "TFDIST_FIT_CONFORMANCE_CHILD"
ATOL = lib.ATOL
STRATEGIES = lib.STRATEGIES
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


_RESULTS = {}


def _case(test, name):
  """Case `name` of `_child_main`'s runs (made once per test process)."""
  if not _RESULTS:
    _RESULTS.update(_child_results())
  result = _RESULTS[name]
  test.assertNotIn("error", result, result.get("error"))
  return result


def _child_results() -> dict:
  """`_child_main`'s runs: in this process when its CPU can still be split
  (no test trained here before: TensorFlow's start-up is then paid once for
  the file), else in a child process (this file run as a script; it trains
  about 30 small runs, so its time limit is longer than
  `testutil.child_case`'s). JSON either way (lists, not tuples)."""
  if testutil.two_logical_cpus():
    try:
      return json.loads(json.dumps(_child_main()))
    finally:
      lib.REMOTE_MONITOR_ROOT = None
  return testutil.child_cases(os.path.abspath(__file__), _CHILD_ENV,
                              timeout=600)


# The in-process runs: (case, data source) -> strategies: one device and
# Mirrored (2 replicas) for every case, a few seconds each.
_BOTH = ("one_device", "mirrored")
_IN_PROCESS_RUNS = {
    ("sample_weight", "dataset_fn"): _BOTH,
    ("sample_weight", "parse_fn"): _BOTH,
    ("class_weight", "parse_fn"): _BOTH,
    # LearningRateScheduler with ReduceLROnPlateau, a stop in a batch hook
    # of epoch 1 and EarlyStopping restoring epoch 0's weights, in one run
    # against Model.fit with the same combination: the MultiWorkerMirrored
    # run's case (`fit_conformance_testlib.CASES`), which measures those
    # rows in tests/fit_conformance_test.py the same way.
    ("multi_worker", "dataset_fn"): _BOTH,
    ("numpy_arrays", "arrays"): _BOTH,
    # validation_data = the arrays, file callbacks, RemoteMonitor; the
    # mirrored run passes its callbacks as one CallbackList.
    ("callbacks", "arrays"): _BOTH,
}


def _brief(run: dict) -> dict:
  """`run` without what is long to print (hooks, printed text)."""
  return {k: v for k, v in run.items()
          if k not in ("hooks", "lambda_hooks", "stdout")}


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
        diffs = lib.agrees(reference, run)
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
    # The scheduler's rate of epoch 1 (0.025), halved at that epoch's end
    # (epoch 0 improves on infinity); fit stopped in epoch 1.
    reference = result["keras"]["multi_worker"]
    self.assertAlmostEqual(reference["learning_rate"], 0.0125)
    epoch, batch = lib.MULTI_WORKER_STOP_AT_BATCH
    self.assertEqual(reference["iterations"], epoch * 16 + batch + 1)
    self._check_matches("multi_worker", "reduce_lr_on_plateau")

  def test_learning_rate_scheduler_sets_each_epochs_rate(self):
    # Each epoch's rate is in the history fit and tfdist return (compared
    # by _check_matches): the scheduler's 0.1, then 0.025.
    history = _case(self, "results")["keras"]["multi_worker"]["history"]
    self.assertEqual([round(r, 6) for r in history["learning_rate"]],
                     [0.1, 0.025])
    self._check_matches("multi_worker", "learning_rate_scheduler")

  def test_rate_set_by_a_callback_is_checkpointed(self):
    # CallbackStateResumeTest's runs: ReduceLROnPlateau halves the
    # configured 0.05 to 0.025 at epoch 1's end; the run interrupted in
    # epoch 2 and resumed trains epoch 2 at 0.025 (the uninterrupted run's
    # rate), not the configured 0.05 (no callback changes the rate after
    # epoch 1: it cools down, then EarlyStopping stops the run).
    runs = {"one_device": _one_device_callback_state((2, 0)),
            "mirrored": _case(self, "callback_state")}
    for strategy in _BOTH:
      whole, resumed = runs[strategy]["whole"], runs[strategy]["resumed"]
      self.assertEqual([round(r, 6) for r in whole["rates"]],
                       [0.05, 0.05, 0.025])
      self.assertEqual(resumed["epochs"], [2])
      self.assertAlmostEqual(resumed["rates"][0], 0.025, places=6)
      self.assertGreater(resumed["restored_step"], 0)
      _cell("learning_rate_checkpointed", strategy, "works")

  def test_restored_best_weights_are_the_one_answer(self):
    result = _case(self, "results")
    best = result["keras"]["multi_worker"]
    self._check_matches("multi_worker", "early_stopping_restore")
    for strategy in _IN_PROCESS_RUNS[("multi_worker", "dataset_fn")]:
      run = result["tfdist"][f"multi_worker/dataset_fn/{strategy}"]
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
      # In tfdist.fit's terms: the field, not the binary's flag.
      self.assertIn("compiled with steps_per_execution=4, which tfdist does "
                    "not read: it runs steps_per_execution=1", warnings[0])
      self.assertIn("Set steps_per_execution=4", warnings[0])
      _cell("steps_per_execution", strategy, "works (warned at start: "
            "tfdist groups steps by --steps_per_execution; the same "
            "weights)")

  def test_callbacks_get_fits_hooks_params_and_logs(self):
    result = _case(self, "results")
    for case, via in (("multi_worker", "dataset_fn"),
                      ("numpy_arrays", "arrays"), ("callbacks", "arrays")):
      reference = result["keras"][case]
      # Model.fit validates: on_test_* hooks (compared in _compare_hooks)
      # before each on_epoch_end.
      self.assertTrue([h for h in reference["hooks"]
                       if h[0] == "on_test_batch_end"])
      for strategy in _IN_PROCESS_RUNS[(case, via)]:
        run = result["tfdist"][f"{case}/{via}/{strategy}"]
        with self.subTest(case=case, strategy=strategy):
          lib.compare_hooks(self, reference, run)
          self.assertEqual(run["lambda_hooks"], reference["lambda_hooks"])
    for strategy in _BOTH:
      _cell("callback_subclass", strategy, "works")
      _cell("lambda_callback", strategy, "works")

  def test_stop_training_in_a_batch_hook_stops_after_that_batch(self):
    # numpy_arrays stops in on_train_batch_end of epoch 2's batch 4 (12
    # steps an epoch): fit runs 29 steps, then validates the cut epoch
    # and calls its on_epoch_end.
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
        lib.compare_hooks(self, reference, run)
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
        tfdist.ConfigError, r"^class_weight=0:1.0 and sample weights in .* "
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
    self.assertLess(lib.max_diff(recorder.weights, reference["weights"]), ATOL)

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
    from tfdist.training.step import objectives  # pylint: disable=g-import-not-at-top

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
    rows = {key for key, _ in lib.FEATURES}
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
    # 300 rows at batch 32: epochs of 9 steps. Stopped after step 13 (the
    # second epoch, 4 steps in), the rerun's input continues epoch 2
    # (counted from 1, as Keras counts) after those 4 steps' rows (the
    # input position), not from its start.
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tfdist  # pylint: disable=g-import-not-at-top
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
                  "epoch 2 where the checkpoint stopped.",
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
  restored = result.get("restored_from")
  return {**seen, "best_epoch": early.best_epoch,
          "stopped_epoch": early.stopped_epoch, "step": result["final_step"],
          "replicas": result["num_replicas_in_sync"],
          "restored_step": (int(str(restored).rsplit("-", 1)[-1])
                            if restored else 0),
          "weights": [w.tolist() for w in models[-1].get_weights()]}


def _callback_state_runs(*, strategy: str, interrupt_at, log_steps: int,
                         whole=None) -> dict:
  """The uninterrupted run (`whole`, unless given: its result does not
  depend on `log_steps`), then one interrupted at `interrupt_at` (`first`)
  and its resumed run (`resumed`)."""
  whole = whole or _callback_state_fit(
      tempfile.mkdtemp(dir=testutil.scratch_dir()), strategy=strategy,
      log_steps=log_steps)
  model_dir = tempfile.mkdtemp(dir=testutil.scratch_dir())
  first = _callback_state_fit(model_dir, strategy=strategy,
                              interrupt_at=interrupt_at, log_steps=log_steps)
  resumed = _callback_state_fit(model_dir, strategy=strategy,
                                log_steps=log_steps)
  return {"whole": whole, "first": first, "resumed": resumed}


_ONE_DEVICE_CALLBACK_STATE = {}


def _one_device_callback_state(interrupt_at) -> dict:
  """`_callback_state_runs` on one device in this process, once per
  `interrupt_at` per test process: (2, 0) with log_steps=2, (1, 5) with
  log_steps=1 and the uninterrupted run of (2, 0); with the lines logged
  at INFO (`logged`)."""
  import logging  # pylint: disable=g-import-not-at-top
  if interrupt_at not in _ONE_DEVICE_CALLBACK_STATE:
    whole = (None if interrupt_at == (2, 0) else
             _one_device_callback_state((2, 0))["whole"])
    logged = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logged.append(record.getMessage())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
      runs = _callback_state_runs(
          strategy="one_device", interrupt_at=interrupt_at,
          log_steps=2 if interrupt_at == (2, 0) else 1, whole=whole)
    finally:
      root.removeHandler(handler)
      root.setLevel(level)
    _ONE_DEVICE_CALLBACK_STATE[interrupt_at] = {**runs, "logged": logged}
  return _ONE_DEVICE_CALLBACK_STATE[interrupt_at]


class CallbackStateResumeTest(absltest.TestCase):
  """An interrupted and resumed `tfdist.fit` stops and restores as the
  uninterrupted run: EarlyStopping's and ReduceLROnPlateau's state rides in
  every checkpoint. One device in this process; MirroredStrategy on 2
  logical CPUs in the file's child process (the devices must exist before
  TensorFlow starts)."""

  def test_a_resumed_run_stops_and_restores_as_the_uninterrupted_one(self):
    # The SIGTERM sent as epoch 2 begins stops the run after step 13,
    # mid-epoch, with a checkpoint there.
    runs = _one_device_callback_state((2, 0))
    self._check(runs, stopped_at=13)
    _cell("callback_state_resumed", "one_device", "works")
    self.assertIn("tfdist: callback state restored: 0-EarlyStopping, "
                  "1-ReduceLROnPlateau.", "\n".join(runs["logged"]))

  def test_a_run_stopped_at_an_epoch_end_finishes_that_epoch(self):
    # The SIGTERM sent before epoch 1's last step stops the run at that
    # epoch's end (step 12): after its evaluation and on_epoch_end, as the
    # uninterrupted run (the one of the test above), so the resumed run
    # starts with epoch 2.
    self._check(_one_device_callback_state((1, 5)), stopped_at=12)

  def test_mirrored_on_two_logical_cpus(self):
    # In the file's child process (2 logical CPUs), after its other runs.
    runs = _case(self, "callback_state")
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


class ZDocsTableTest(absltest.TestCase):
  """Runs after the cases above (absltest orders classes by name)."""

  def test_docs_table_is_what_the_suite_measured(self):
    if len(_CELLS) < 2:
      self.skipTest("run the whole file: the table needs every case")
    lib.check_table(self, _CELLS)


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
  """The one-device and Mirrored runs of every case, and the references
  (on 2 logical CPUs: `testutil.two_logical_cpus` first)."""
  import logging  # pylint: disable=g-import-not-at-top
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  root = tempfile.mkdtemp(dir=testutil.scratch_dir())
  server = lib.RemoteMonitorServer()
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
  server.server.shutdown()
  # Last: CallbackStateResumeTest's MirroredStrategy runs (one SIGTERMs
  # this process, as a preemption does), here to pay TensorFlow's start-up
  # once.
  import traceback  # pylint: disable=g-import-not-at-top
  try:
    callback_state = _callback_state_runs(strategy="mirrored",
                                          interrupt_at=(2, 0), log_steps=2)
  except Exception:  # pylint: disable=broad-except
    callback_state = {"error": traceback.format_exc()}
  return {"results": out, "callback_state": callback_state}


if __name__ == "__main__":
  if os.environ.get(_CHILD_ENV):
    assert testutil.two_logical_cpus()
    print(json.dumps(_child_main()), flush=True)
  else:
    absltest.main()
