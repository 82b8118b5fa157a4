"""Cases of `tests/fit_conformance_test.py`: `keras.Model.fit` on one device
against `tfdist.fit`, on the same small models and data.

Every case builds its data from a fixed NumPy seed and its model with
zero-initialized weights, and trains with plain SGD (no momentum, no
warmup, no shuffling, a constant learning rate), so `Model.fit` on one
device and `tfdist.fit` under a synchronous strategy make the same updates
on the same global batches (float32 round-off apart).

Run as a module (`python -m tests.fit_conformance_testlib OUT_JSON CASE`,
normally by `tfdist.launch --module=...` for MultiWorkerMirrored and
parameter servers), it runs one case with tfdist (the strategy from
`TF_CONFIG`) and the chief writes the result to OUT_JSON.
"""

import json
import math
import os
import re
import sys

import numpy as np

GLOBAL_BATCH = 64
EPOCHS = 3
LEARNING_RATE = 0.1
EXAMPLES = 1024


def slope_data():
  """`(x, y, w)`: y = 3x where w = 1, y = -3x where w = 0 (float32 [1024,
  1], [1024], [1024]). Sample weights make the slope 3; without them the
  two halves cancel (about 0)."""
  rng = np.random.default_rng(0)
  x = rng.uniform(-1, 1, (EXAMPLES, 1)).astype("float32")
  good = rng.uniform(size=EXAMPLES) < 0.5
  y = np.where(good, 3 * x[:, 0], -3 * x[:, 0]).astype("float32")
  return x, y, good.astype("float32")


def class_data():
  """`(x, y)`: 4 float32 features, 3 classes (int64 [1024]), imbalanced."""
  rng = np.random.default_rng(1)
  x = rng.normal(size=(EXAMPLES, 4)).astype("float32")
  logits = x @ rng.normal(size=(4, 3)) + np.array([1.5, 0.0, -1.0])
  y = np.argmax(logits + rng.gumbel(size=logits.shape), axis=1)
  return x, y.astype("int64")


CLASS_WEIGHT = {0: 0.5, 1: 2.0, 2: 4.0}
# The example whose NaN feature makes the loss NaN: in step 6 (batch 5).
NAN_ROW = 5 * GLOBAL_BATCH + 3
# Keras's steps_per_execution for the class-weight case's compile.
STEPS_PER_EXECUTION = 4
# RemoteMonitor's server (`http://127.0.0.1:<port>`); None: no RemoteMonitor.
REMOTE_MONITOR_ROOT = None


def nan_data():
  """`slope_data` with a NaN feature at row `NAN_ROW`."""
  x, y, w = slope_data()
  x = x.copy()
  x[NAN_ROW, 0] = np.nan
  return x, y, w


def class_nan_data():
  """`class_data` with a NaN feature at row `NAN_ROW` (in the first 3/4,
  which a validation split of 0.25 trains on)."""
  x, y = class_data()
  x = x.copy()
  x[NAN_ROW, 0] = np.nan
  return x, y


# The resumed case: its validation split, and the epoch its first attempt
# ends before (after epoch 1's checkpoint).
RESUMED_SPLIT = 0.25
RESUMED_AT_EPOCH = 2


def squared_error(y_true, y_pred):
  """A loss function: the squared error per example (float32 [batch])."""
  import keras  # pylint: disable=g-import-not-at-top
  y_true = keras.ops.cast(y_true, y_pred.dtype)
  return keras.ops.mean(keras.ops.square(y_pred - y_true), axis=-1)


def squared_error_loss():
  """A `keras.losses.Loss` subclass (built lazily: keras imported late):
  the squared error, Keras's default reduction."""
  import keras  # pylint: disable=g-import-not-at-top

  class SquaredError(keras.losses.Loss):

    def call(self, y_true, y_pred):
      y_true = keras.ops.reshape(keras.ops.cast(y_true, y_pred.dtype),
                                 keras.ops.shape(y_pred))
      return keras.ops.mean(keras.ops.square(y_pred - y_true), axis=-1)

  return SquaredError(name="squared_error")


def abs_error_metric():
  """A `keras.metrics.Metric` subclass with summable state (a total and a
  count, aggregated by sum): the mean absolute error, named `abs_error`."""
  import keras  # pylint: disable=g-import-not-at-top

  class AbsError(keras.metrics.Metric):

    def __init__(self, name="abs_error", **kwargs):
      super().__init__(name=name, **kwargs)
      self.total = self.add_variable(shape=(), initializer="zeros",
                                     name="total")
      self.count = self.add_variable(shape=(), initializer="zeros",
                                     name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
      y_true = keras.ops.reshape(keras.ops.cast(y_true, y_pred.dtype),
                                 keras.ops.shape(y_pred))
      error = keras.ops.mean(keras.ops.abs(y_pred - y_true), axis=-1)
      weight = (keras.ops.ones_like(error) if sample_weight is None else
                keras.ops.cast(sample_weight, error.dtype))
      self.total.assign_add(keras.ops.sum(error * weight))
      self.count.assign_add(keras.ops.sum(weight))

    def result(self):
      return keras.ops.divide_no_nan(self.total, self.count)

  return AbsError()


def spread(y_true, y_pred):
  """A metric function with one value per batch, not per example."""
  import keras  # pylint: disable=g-import-not-at-top
  del y_true
  return keras.ops.max(y_pred) - keras.ops.min(y_pred)


def _compile_args(case: str) -> dict:
  import keras  # pylint: disable=g-import-not-at-top
  if case == "batch_valued_metric":
    return dict(loss="mse", metrics=[spread])
  if case in ("multi_worker_files", "parameter_server_files"):
    # The second cluster runs: a Loss subclass, a metric with one value
    # per batch and Keras's steps_per_execution, beside the usual metrics.
    return dict(loss=squared_error_loss(),
                metrics=["mae", abs_error_metric(), spread],
                weighted_metrics=["mae"],
                steps_per_execution=STEPS_PER_EXECUTION)
  if case.startswith("class_weight"):
    # The resumed case leaves Keras's steps_per_execution out: fit would
    # see the NaN loss only at the end of a group of 4 steps.
    return dict(loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), metrics=["accuracy"],
                weighted_metrics=["accuracy"],
                **({} if case == "class_weight_resumed" else dict(
                    steps_per_execution=STEPS_PER_EXECUTION)))
  # Custom losses: a Loss subclass, a loss function, or Keras's "mse".
  loss = {"sample_weight": squared_error_loss,
          "callbacks": squared_error_loss,
          "multi_worker": lambda: squared_error,
          "parameter_server": lambda: squared_error,
          "numpy_arrays": lambda: squared_error}.get(case, lambda: "mse")()
  return dict(loss=loss, metrics=["mae", abs_error_metric()],
              weighted_metrics=["mae"])


def build_model(case: str, optimizer=None):
  """The case's model, zero-initialized, compiled with its loss and
  metrics (and `optimizer`, for `Model.fit`)."""
  import keras  # pylint: disable=g-import-not-at-top
  inputs, units, bias = ((4, 3, True) if case.startswith("class_weight")
                         else (1, 1, False))
  model = keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(
      units, use_bias=bias, kernel_initializer="zeros")])
  model.compile(optimizer=optimizer, **_compile_args(case))
  return model


def _reduce_lr():
  import keras  # pylint: disable=g-import-not-at-top
  # min_delta=100: no epoch after the first improves, so the rate halves
  # at the end of epochs 1, 2, ...
  return [keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5,
                                            patience=0, min_delta=100.0)]


def _lr_scheduler():
  import keras  # pylint: disable=g-import-not-at-top
  return [keras.callbacks.LearningRateScheduler(
      lambda epoch, lr: LEARNING_RATE * 0.25 ** epoch)]


def _early_stopping():
  import keras  # pylint: disable=g-import-not-at-top
  # mode="max" on a falling loss: epoch 0 stays the best, training stops
  # after epoch 1 and the weights of epoch 0 come back at the end.
  return [keras.callbacks.EarlyStopping(monitor="loss", mode="max",
                                        patience=1,
                                        restore_best_weights=True)]


def _callback_suite():
  import keras  # pylint: disable=g-import-not-at-top
  # EarlyStopping without restoring: stops after epoch 1 (as above).
  out = [keras.callbacks.EarlyStopping(monitor="loss", mode="max",
                                       patience=1),
         keras.callbacks.TerminateOnNaN(), keras.callbacks.ProgbarLogger()]
  if REMOTE_MONITOR_ROOT:
    out.append(keras.callbacks.RemoteMonitor(root=REMOTE_MONITOR_ROOT))
  return out


# Where the numpy_arrays case's callback sets `model.stop_training` in a
# batch hook: (epoch, batch), 0-based.
STOP_AT_BATCH = (2, 4)
# The same for the multi_worker case.
MULTI_WORKER_STOP_AT_BATCH = (1, 4)
# The same for the parameter_server case, whose batch hooks come once per
# chunk of PS_LOG_STEPS steps (a log point ends each chunk).
PS_STOP_AT_BATCH = (2, 4)
PS_LOG_STEPS = 4


def _stop_at_batch(at=STOP_AT_BATCH):
  """A callback setting `model.stop_training` in `on_train_batch_end` of
  the first batch at or after batch `at[1]` of epoch `at[0]` that it is
  called for (`fit` calls it for every batch; tfdist under parameter
  servers once per scheduled chunk) (built lazily: keras imported late)."""
  import keras  # pylint: disable=g-import-not-at-top

  class StopAtBatch(keras.callbacks.Callback):

    def on_epoch_begin(self, epoch, logs=None):
      self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
      if self.epoch == at[0] and batch >= at[1]:
        self.model.stop_training = True

  return [StopAtBatch()]


def _multi_worker_callbacks():
  # Both learning-rate callbacks (the scheduler sets each epoch's rate,
  # ReduceLROnPlateau halves it at epoch 1's end); a stop in a batch hook
  # of epoch 1; EarlyStopping (_early_stopping) then restores
  # epoch 0's weights.
  return [*_lr_scheduler(), *_reduce_lr(),
          *_stop_at_batch(MULTI_WORKER_STOP_AT_BATCH), *_early_stopping()]


def _terminate_on_nan():
  import keras  # pylint: disable=g-import-not-at-top
  return [keras.callbacks.TerminateOnNaN()]


def _early_stopping_not_restoring():
  import keras  # pylint: disable=g-import-not-at-top
  # As _early_stopping: stops after epoch 1; the weights stay epoch 1's.
  return [keras.callbacks.EarlyStopping(monitor="loss", mode="max",
                                        patience=1)]


# The cluster cases whose parse_fn reads two files (`tfdist_fit`).
TWO_FILE_CASES = ("multi_worker_files", "parameter_server_files")


# What each case feeds: the arrays, the class weights, a function making
# the case's Keras callbacks (fresh ones for each run), and whether
# Model.fit validates on the arrays themselves (`validation`: what tfdist
# evaluates of a dataset function without an evaluation split).
CASES = {
    "sample_weight": dict(data=slope_data, class_weight=None),
    "class_weight": dict(data=class_data, class_weight=CLASS_WEIGHT),
    # EarlyStopping, TerminateOnNaN, ProgbarLogger (and RemoteMonitor).
    "callbacks": dict(data=slope_data, class_weight=None,
                      callbacks=_callback_suite, validation=True),
    # The loss goes NaN in step 6; fit validates the cut epoch (with NaN
    # weights) before it ends the run.
    "terminate_on_nan": dict(data=nan_data, class_weight=None,
                             callbacks=_terminate_on_nan, validation=True),
    "learning_rate_scheduler": dict(data=slope_data, class_weight=None,
                                    callbacks=_lr_scheduler),
    "batch_valued_metric": dict(data=slope_data, class_weight=None),
    # The MultiWorkerMirrored run's combination, with a loss function; also
    # the one-device and Mirrored runs of its callbacks' rows
    # (fit_conformance_one_process_test). In the cluster tfdist gets the
    # callbacks inside a CallbackList.
    "multi_worker": dict(data=slope_data, class_weight=None,
                         callbacks=_multi_worker_callbacks, validation=True),
    # The parameter-server run's: both learning-rate callbacks and a stop
    # in a batch hook of epoch 2 (its batch hooks come once per chunk of
    # PS_LOG_STEPS scheduled steps); tfdist gets them inside a
    # CallbackList.
    "parameter_server": dict(data=slope_data, class_weight=None,
                             callbacks=lambda: [
                                 *_lr_scheduler(), *_reduce_lr(),
                                 *_stop_at_batch(PS_STOP_AT_BATCH)],
                             validation=True, log_steps=PS_LOG_STEPS),
    # The second MultiWorkerMirrored run: sample weights from a parse_fn
    # (TFRecord files, validated on the same file), a Loss subclass, a
    # metric with one value per batch, compile(steps_per_execution=4) and
    # EarlyStopping not restoring (stops after epoch 1).
    "multi_worker_files": dict(data=slope_data, class_weight=None,
                               callbacks=_early_stopping_not_restoring,
                               validation=True),
    # The second parameter-server run: the same, with EarlyStopping
    # restoring the best epoch's weights beside the one not restoring
    # (both stop after epoch 1).
    "parameter_server_files": dict(
        data=slope_data, class_weight=None,
        callbacks=lambda: [*_early_stopping(),
                           *_early_stopping_not_restoring()],
        validation=True),
    # The third cluster run of each multi-process strategy, in two
    # attempts of one `tfdist.launch --max_restarts=1` (`main`): NumPy
    # arrays with class weights and a validation split, ReduceLROnPlateau
    # (the rate halves to 0.05 at epoch 1's end) and TerminateOnNaN. The
    # first attempt's tasks exit at the start of epoch 2 (after epoch 1's
    # checkpoint); the restarted group resumes there, its arrays
    # (`class_nan_data`) hold a NaN feature in epoch 2's batch 5, and
    # TerminateOnNaN stops it. `keras_fit_resumed` is the reference.
    "class_weight_resumed": dict(
        data=class_data, class_weight=CLASS_WEIGHT,
        validation_split=RESUMED_SPLIT,
        callbacks=lambda: [*_reduce_lr(), *_terminate_on_nan()]),
    # Arrays with Keras's validation_split: the last quarter evaluates;
    # a callback stops training in a batch hook of epoch 2.
    "numpy_arrays": dict(data=slope_data, class_weight=None,
                         validation_split=0.25, callbacks=_stop_at_batch),
}


def _floats(logs) -> dict:
  return {k: float(v) for k, v in (logs or {}).items() if np.ndim(v) == 0}


class Recorder:
  """A Keras callback (built lazily: keras imported late) keeping the last
  epoch's logs, the weights at the end of training, and every hook it
  received: `hooks`, `[hook name, batch or epoch (or None), {logs key:
  float}]`, and `params`."""

  HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin",
           "on_epoch_end", "on_train_batch_begin", "on_train_batch_end",
           "on_test_begin", "on_test_end", "on_test_batch_begin",
           "on_test_batch_end")

  def __new__(cls):
    import keras  # pylint: disable=g-import-not-at-top

    def hook(name):
      def record(self, *args, **kwargs):
        index = args[0] if args and not isinstance(args[0], dict) else None
        logs = kwargs.get("logs", args[-1] if args and isinstance(
            args[-1], dict) else None)
        self.hooks.append([name, index, _floats(logs)])
        if name == "on_train_begin":
          self.first_learning_rate = float(self.model.optimizer.learning_rate)
        if name == "on_epoch_end":
          self.epoch_logs = _floats(logs)
        if name == "on_train_end":
          self.weights = [np.asarray(w).tolist()
                          for w in self.model.get_weights()]
          self.learning_rate = float(self.model.optimizer.learning_rate)
      return record

    class _Recorder(keras.callbacks.Callback):

      def __init__(self):
        super().__init__()
        self.epoch_logs, self.weights, self.learning_rate = {}, None, None
        self.first_learning_rate = None
        self.hooks = []

    for name in cls.HOOKS:
      setattr(_Recorder, name, hook(name))
    return _Recorder()


def lambda_recorder():
  """`(keras.callbacks.LambdaCallback, seen)`: the callback appends
  `[hook, sorted logs keys]` to `seen` for each hook it takes."""
  import keras  # pylint: disable=g-import-not-at-top
  seen = []

  def note(name):
    def record(*args, **kwargs):
      logs = kwargs.get("logs", args[-1] if args and not isinstance(
          args[-1], int) else None)
      seen.append([name, sorted(logs or {})])
    return record
  callback = keras.callbacks.LambdaCallback(**{
      name: note(name) for name in (
          "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
          "on_train_batch_begin", "on_train_batch_end")})
  return callback, seen


def _callbacks(case: str) -> list:
  make = CASES[case].get("callbacks")
  return make() if make else []


def keras_fit(case: str, files_dir=None) -> dict:
  """`Model.fit` then `Model.evaluate` on one device: the reference (with
  `file_callbacks(files_dir)` too, given a folder)."""
  import keras  # pylint: disable=g-import-not-at-top
  spec = CASES[case]
  arrays = spec["data"]()
  split = spec.get("validation_split", 0.0)
  model = build_model(case, keras.optimizers.SGD(learning_rate=LEARNING_RATE))
  recorder = Recorder()
  lambda_callback, lambda_hooks = lambda_recorder()
  progbar = any(isinstance(c, keras.callbacks.ProgbarLogger)
                for c in _callbacks(case))
  history = model.fit(*arrays[:2], sample_weight=(
      arrays[2] if len(arrays) > 2 else None),
                      class_weight=spec["class_weight"],
                      validation_split=split,
                      validation_data=arrays if spec.get("validation")
                      else None,
                      batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                      # Model.fit's default ("auto") when a ProgbarLogger
                      # is to print.
                      verbose="auto" if progbar else 0,
                      callbacks=[*_callbacks(case), *(
                          file_callbacks(files_dir) if files_dir else ()),
                                 recorder, lambda_callback])
  held_out = [a[int(len(a) * (1 - split)):] for a in arrays] if split else (
      arrays)
  evaluation = model.evaluate(*held_out[:2], sample_weight=(
      held_out[2] if len(held_out) > 2 else None), batch_size=GLOBAL_BATCH,
                              verbose=0, return_dict=True)
  return {"weights": [w.tolist() for w in model.get_weights()],
          "train": {k: float(v[-1]) for k, v in history.history.items()
                    if k != "learning_rate"},
          "learning_rate": float(model.optimizer.learning_rate),
          "iterations": int(model.optimizer.iterations),
          "history": {k: [float(x) for x in v]
                      for k, v in history.history.items()},
          "hooks": recorder.hooks, "params": dict(recorder.params),
          "lambda_hooks": lambda_hooks,
          "eval": {k: float(v) for k, v in evaluation.items()}}


def tfdist_fit(case: str, *, strategy: str, model_dir: str,
               via: str = "dataset_fn", class_weight=None,
               epochs: int = EPOCHS, extra_callbacks=(),
               mode: str = "train_and_eval", callback_list: str = "",
               data=None) -> dict:
  """The case through `tfdist.fit` under `strategy` (an in-process one, or
  the cluster's from `TF_CONFIG`). `via`: `dataset_fn` (a function of
  `(x, y[, w])` examples) or `parse_fn` (TFRecords of `tf.train.Example`s
  in `model_dir`, parsed to the same tuples). `class_weight`: instead of
  the case's. `extra_callbacks`: Keras callbacks added to the case's.
  `mode`: the `TrainConfig.mode` (`eval`: `results` holds the
  evaluator's). `callback_list`: "outer" passes the callbacks as one
  `keras.callbacks.CallbackList`, "inner" the case's and the extra ones
  inside a `CallbackList` in the list.
  `via="arrays"`: the NumPy arrays as `x, y, sample_weight`, with the
  case's `validation_split`, else `validation_data` = the arrays.
  `data`: a function making the arrays, instead of the case's."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top
  from tfdist import errors  # pylint: disable=g-import-not-at-top
  spec = CASES[case]
  arrays = (data or spec["data"])()
  recorder = Recorder()
  lambda_callback, lambda_hooks = lambda_recorder()
  config = dict(model_dir=model_dir, train_epochs=epochs,
                batch_size=GLOBAL_BATCH, base_batch_size=GLOBAL_BATCH,
                optimizer="sgd", momentum=0.0,
                base_learning_rate=LEARNING_RATE, warmup_steps=0,
                lr_schedule="constant", shuffle_buffer_size=0,
                distribution_strategy=strategy,
                log_steps=spec.get("log_steps", 1000), mode=mode,
                class_weight=class_weight or spec["class_weight"] or ())
  kwargs = {}
  if via == "dataset_fn":
    kwargs["dataset_fn"] = lambda training: (
        tf.data.Dataset.from_tensor_slices(arrays))
  elif via == "arrays":
    kwargs.update(x=arrays[0], y=arrays[1],
                  sample_weight=arrays[2] if len(arrays) > 2 else None)
    if spec.get("validation_split"):
      kwargs["validation_split"] = spec["validation_split"]
    else:
      kwargs["validation_data"] = arrays
  else:
    os.makedirs(model_dir, exist_ok=True)
    if case in TWO_FILE_CASES:
      # Two files, one per worker (sharded by file): file 0 holds the first
      # half of every global batch, file 1 the second, so the two workers'
      # per-replica batches make up fit's global batches.
      half = (np.arange(len(arrays[0])) // (GLOBAL_BATCH // 2)) % 2
      files = {os.path.join(model_dir, f"data-{i}.tfrecord"):
               [a[half == i] for a in arrays] for i in (0, 1)}
      pattern = os.path.join(model_dir, "data-*.tfrecord")
    else:
      pattern = os.path.join(model_dir, "data.tfrecord")
      files = {pattern: arrays}
    for path, rows in files.items():
      # Every task of a cluster writes the same records: each its own
      # file, renamed into place, so none reads a file being written.
      part = f"{path}.{os.getpid()}.part"
      with tf.io.TFRecordWriter(part) as writer:
        for row in zip(*rows):
          feature = {f"c{i}": tf.train.Feature(float_list=tf.train.FloatList(
              value=np.ravel(v).astype("float32")))
                     for i, v in enumerate(row)}
          writer.write(tf.train.Example(features=tf.train.Features(
              feature=feature)).SerializeToString())
      os.replace(part, path)
    shapes = [a.shape[1:] for a in arrays]
    description = {f"c{i}": tf.io.FixedLenFeature(list(s), tf.float32)
                   for i, s in enumerate(shapes)}

    def parse(record):
      parsed = tf.io.parse_single_example(record, description)
      return tuple(parsed[f"c{i}"] for i in range(len(arrays)))
    kwargs["parse_fn"] = parse
    config.update(train_files=pattern, eval_files=pattern, cache_dataset=True)
  import keras  # pylint: disable=g-import-not-at-top
  callbacks = [*_callbacks(case), *extra_callbacks]
  if callback_list == "inner":
    callbacks = [keras.callbacks.CallbackList(callbacks)]
  callbacks += [recorder, lambda_callback]
  if callback_list == "outer":
    callbacks = keras.callbacks.CallbackList(callbacks)
  try:
    manifest = tfdist.fit(lambda: build_model(case),
                          config=tfdist.TrainConfig(**config),
                          callbacks=callbacks, **kwargs)
  except errors.TrainingDivergedError as e:
    # What the callbacks saw before the error (TerminateOnNaN's case).
    return {"diverged": f"{type(e).__name__}: {e}", "hooks": recorder.hooks,
            "params": dict(recorder.params or {}),
            "first_learning_rate": recorder.first_learning_rate,
            "lambda_hooks": lambda_hooks}
  last_eval = (manifest.get("eval_history") or [{}])[-1]
  return {"weights": recorder.weights, "train": recorder.epoch_logs,
          "eval": {k: v for k, v in last_eval.items()
                   if isinstance(v, float)},
          "learning_rate": recorder.learning_rate,
          "history": manifest.get("history"),
          "hooks": recorder.hooks, "params": dict(recorder.params or {}),
          "lambda_hooks": lambda_hooks,
          "results": manifest.get("results"),
          "eval_batch_size": manifest.get("eval_batch_size"),
          "restored_step": _restored_step(manifest),
          "final_step": manifest.get("final_step"),
          "final_eval_loss": (manifest.get("final_metrics") or {}).get(
              "eval_loss"),
          **_artifact_slopes(manifest, arrays[0]),
          "replicas": manifest.get("num_replicas_in_sync",
                                   manifest.get("replicas"))}


def keras_fit_resumed(class_weight=CLASS_WEIGHT, *,
                      resumed: bool = True) -> dict:
  """The `class_weight_resumed` reference, as a resumed `fit` script runs:
  `Model.fit` of epochs 0-1 on `class_data`, then, on the same model,
  `fit(initial_epoch=2)` on `class_nan_data`, each call with fresh
  callbacks (a new process's). Returns `{"first": ..., "second": ...}`:
  each call's hooks, `params`, history, final weights and rates.
  `class_weight`: instead of `CLASS_WEIGHT` (None: none). `resumed=False`:
  the first call only (no `"second"`)."""
  import keras  # pylint: disable=g-import-not-at-top
  case = "class_weight_resumed"
  model = build_model(case, keras.optimizers.SGD(learning_rate=LEARNING_RATE))
  out = {}
  calls = (("first", class_data, (0, RESUMED_AT_EPOCH)),
           ("second", class_nan_data, (RESUMED_AT_EPOCH, EPOCHS)))
  for name, data, epochs in calls if resumed else calls[:1]:
    recorder = Recorder()
    history = model.fit(*data(), class_weight=class_weight,
                        validation_split=RESUMED_SPLIT,
                        batch_size=GLOBAL_BATCH, initial_epoch=epochs[0],
                        epochs=epochs[1], shuffle=False, verbose=0,
                        callbacks=[*_callbacks(case), recorder])
    out[name] = {"hooks": recorder.hooks, "params": dict(recorder.params),
                 "history": {k: [float(v) for v in values]
                             for k, values in history.history.items()
                             if k != "learning_rate"},
                 "weights": [w.tolist() for w in model.get_weights()],
                 "first_learning_rate": recorder.first_learning_rate,
                 "learning_rate": float(model.optimizer.learning_rate),
                 "iterations": int(model.optimizer.iterations)}
  return out


def end_first_attempt(path: str, *, writes: bool):
  """A Keras callback that ends the first attempt of the
  `class_weight_resumed` run at the start of epoch `RESUMED_AT_EPOCH`
  (after the previous epoch's checkpoint), with `os._exit(3)` (a failed
  task: `tfdist.launch --max_restarts` restarts the group). The task that
  `writes` (the chief) first writes `path`: the epochs' logs (`history`),
  the weights and the rate; the others wait up to 60 s for that file, so
  no task is stopped by the launcher before the chief has written it."""
  import time  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top

  class EndFirstAttempt(keras.callbacks.Callback):

    def __init__(self):
      super().__init__()
      self.history = {}

    def on_epoch_end(self, epoch, logs=None):
      for key, value in _floats(logs).items():
        self.history.setdefault(key, []).append(value)

    def on_epoch_begin(self, epoch, logs=None):
      if epoch != RESUMED_AT_EPOCH:
        return
      if writes:
        part = f"{path}.part"
        with open(part, "w") as f:
          json.dump({"history": {k: v for k, v in self.history.items()
                                 if k != "learning_rate"},
                     "weights": [np.asarray(w).tolist()
                                 for w in self.model.get_weights()],
                     "learning_rate": float(
                         self.model.optimizer.learning_rate)}, f)
        os.replace(part, path)
      else:
        deadline = time.time() + 60
        while not os.path.exists(path) and time.time() < deadline:
          time.sleep(0.05)
      sys.stdout.flush()
      os._exit(3)  # pylint: disable=protected-access

  return EndFirstAttempt()


def _artifact_slopes(manifest: dict, x) -> dict:
  """The slope model's weight in the run's final checkpoint and what its
  SavedModel predicts for x = 1 (slope cases, on the chief); else {}."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  artifacts = manifest.get("artifacts") or {}
  if (x.shape[1:] != (1,) or not artifacts.get("saved_model") or
      not manifest.get("cluster", {}).get("is_chief", True)):
    return {}  # Other workers' artifacts are gone with their scratch.
  restored = build_model("sample_weight")
  tf.train.Checkpoint(model=restored).restore(
      artifacts["checkpoint"]).expect_partial()
  exported = tf.saved_model.load(artifacts["saved_model"])
  prediction = exported.serve(tf.ones([1, 1]))
  prediction = list(prediction.values())[0] if isinstance(
      prediction, dict) else prediction
  return {"checkpoint_slope": float(np.ravel(restored.get_weights()[0])[0]),
          "export_slope": float(np.ravel(prediction)[0])}


def _restored_step(manifest: dict) -> int:
  restored = manifest.get("restored_from")
  if isinstance(restored, dict):
    return int(restored.get("step", 0))
  return int(str(restored).rsplit("-", 1)[-1]) if restored else 0


def file_callbacks(folder: str) -> list:
  """Keras callbacks that write files under `folder`: `ModelCheckpoint`
  (`ckpt/w_<epoch>.weights.h5`), `CSVLogger` (`log.csv`), `TensorBoard`
  (`tb/`)."""
  import keras  # pylint: disable=g-import-not-at-top
  return [keras.callbacks.ModelCheckpoint(
      os.path.join(folder, "ckpt", "w_{epoch}.weights.h5"),
      save_weights_only=True),
          keras.callbacks.CSVLogger(os.path.join(folder, "log.csv")),
          keras.callbacks.TensorBoard(os.path.join(folder, "tb"),
                                      write_graph=False)]


# The checks both test files make (fit_conformance_test: the clusters;
# fit_conformance_one_process_test: one device, Mirrored, and what is
# refused at start).

# Synchronous strategies agree with one device to float32 round-off.
ATOL = 1e-4
DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "docs", "guides", "fit-conformance.md")
WRITE_ENV = "TFDIST_WRITE_CONFORMANCE_TABLE"
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
# Rows refused at start, before a strategy is built: one process measures
# every column of them.
REFUSED_AT_START = ("backup_and_restore", "class_and_sample_weight",
                    "swap_ema_weights", "orbax_checkpoint")
ONE_PROCESS_TEST = "fit_conformance_one_process_test"
CLUSTER_TEST = "fit_conformance_test"
_TABLE = re.compile(r"(<!-- conformance-table -->\n)(.*?)(\n<!-- "
                    r"/conformance-table -->)", re.S)


def table_owner(feature: str, strategy: str) -> str:
  """The test file (module name) that measures the docs table's cell:
  the cluster file the multi-process columns, the one-process file the
  rest."""
  if feature in REFUSED_AT_START or strategy in ("one_device", "mirrored"):
    return ONE_PROCESS_TEST
  return CLUSTER_TEST


def render_table(cells: dict) -> str:
  """The docs table: one row per feature, one column per strategy; a cell
  `cells` (`{feature: {strategy: text}}`) lacks reads "not measured"."""
  lines = ["| `fit` feature | " + " | ".join(STRATEGIES) + " |",
           "|---" * (len(STRATEGIES) + 1) + "|"]
  for key, text in FEATURES:
    row = [cells.get(key, {}).get(s, "not measured") for s in STRATEGIES]
    lines.append(f"| {text} | " + " | ".join(row) + " |")
  return "\n".join(lines)


def read_table(doc_text: str) -> dict:
  """`{feature: {strategy: text}}` as the guide's table has them (the rows
  whose text is a `FEATURES` row's).

  Raises:
    ValueError: the guide has no conformance-table markers.
  """
  match = _TABLE.search(doc_text)
  if not match:
    raise ValueError(f"{DOC} has no <!-- conformance-table --> markers")
  keys = {text: key for key, text in FEATURES}
  cells = {}
  for line in match.group(2).splitlines()[2:]:
    text, *values = line[2:-2].split(" | ")
    if text in keys:
      cells[keys[text]] = dict(zip(STRATEGIES, values))
  return cells


def check_table(test, cells: dict) -> None:
  """Asserts that the docs table's cells `test`'s file owns
  (`table_owner`) read what it measured (`cells`: `{feature: {strategy:
  text}}`, "not measured" where it has none) and that its rows are
  `FEATURES`; with `WRITE_ENV` set, writes those cells into the guide
  instead (run both files to rewrite the whole table)."""
  import inspect  # pylint: disable=g-import-not-at-top
  measurer = os.path.splitext(os.path.basename(inspect.getfile(type(test))))[0]
  owned = [(f, s) for f, _ in FEATURES for s in STRATEGIES
           if table_owner(f, s) == measurer]
  test.assertTrue(owned, f"{measurer} owns no cell of the table")
  test.assertEqual(
      sorted((f, s) for f, row in cells.items() for s in row
             if table_owner(f, s) != measurer), [],
      f"cells measured by {measurer} but owned by another file "
      "(fit_conformance_testlib.table_owner)")
  mine = {(f, s): cells.get(f, {}).get(s, "not measured") for f, s in owned}
  with open(DOC) as f:
    doc_text = f.read()
  in_doc = read_table(doc_text)
  if os.environ.get(WRITE_ENV):
    for (f, s), text in mine.items():
      in_doc.setdefault(f, {})[s] = text
    with open(DOC, "w") as f:
      f.write(_TABLE.sub(lambda m: m.group(1) + render_table(in_doc) +
                         m.group(3), doc_text))
    return
  test.assertEqual(_TABLE.search(doc_text).group(2), render_table(in_doc),
                   f"the rows of {DOC}'s table are not FEATURES: rewrite "
                   f"it with {WRITE_ENV}=1 (both files) and commit it")
  test.assertEqual(
      {cell: in_doc.get(cell[0], {}).get(cell[1]) for cell in owned}, mine,
      f"the table in docs/guides/fit-conformance.md differs from what "
      f"{measurer} measured: rerun it with {WRITE_ENV}=1 and commit it.")


def max_diff(a, b) -> float:
  """The largest absolute difference of two lists of arrays."""
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(a, b))


def _without(values: dict, skip: str) -> dict:
  """`values` without the keys that contain `skip` ("": all of them)."""
  return {k: v for k, v in values.items() if not skip or skip not in k}


def agrees(reference: dict, result: dict, *, skip: str = "") -> dict:
  """Largest absolute differences of weights, training and evaluation
  metrics (Keras's names) and the final learning rate between `Model.fit`
  and a tfdist run; metrics whose names contain `skip` are left out."""
  reference = {**reference, **{k: _without(reference[k], skip)
                               for k in ("history", "train", "eval")}}
  return {
      "weights": max_diff(reference["weights"], result["weights"]),
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


def _fit_hooks(run: dict, *, batch: bool = True) -> list:
  """The hooks a recording callback received (the `on_test_*` hooks of
  validation too); without the batch hooks unless `batch`."""
  return [h for h in run["hooks"] if batch or "batch" not in h[0]]


def compare_hooks(test, reference: dict, run: dict, *, batch: bool = True,
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


class RemoteMonitorServer:
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


def main(argv):
  """`OUT_JSON CASE[:VIA] [FILES_DIR]`: VIA as `tfdist_fit` takes it
  (default `dataset_fn`); with FILES_DIR, `file_callbacks` too; a
  `ProgbarLogger` (printing on the chief only) and a `TerminateOnNaN`
  (with nothing to stop) always; a `RemoteMonitor` posting to
  `$TFDIST_TEST_REMOTE_MONITOR` when set. The `multi_worker` and
  `parameter_server` cases pass their callbacks inside a `CallbackList`.
  `class_weight_resumed` runs in two attempts of one launcher group (see
  `CASES`): the chief writes the first's results to `OUT_JSON.first.json`
  (`end_first_attempt`), the second's to OUT_JSON."""
  import keras  # pylint: disable=g-import-not-at-top
  out_path, (case, _, via) = argv[1], argv[2].partition(":")
  tf_config = json.loads(os.environ.get("TF_CONFIG") or "{}")
  task_type = tf_config.get("task", {}).get("type", "chief")
  strategy = ("parameter_server" if "ps" in tf_config.get("cluster", {})
              else "multi_worker_mirrored")
  data, ending = None, []
  if case == "class_weight_resumed":
    # Which attempt of the launcher's group this task is in: a marker per
    # task, left by the first.
    task = tf_config.get("task", {})
    marker = f"{out_path}.{task.get('type')}-{task.get('index')}.started"
    if os.path.exists(marker):
      data = class_nan_data
    else:
      with open(marker, "w"):
        pass
      ending = [end_first_attempt(f"{out_path}.first.json",
                                  writes=task_type == "chief")]
  result = tfdist_fit(case, strategy=strategy, via=via or "dataset_fn",
                      data=data,
                      callback_list=("inner" if case in (
                          "multi_worker", "parameter_server",
                          *TWO_FILE_CASES) else ""),
                      model_dir=os.path.join(
      os.path.dirname(out_path), "run"), extra_callbacks=[
          *(file_callbacks(argv[3]) if len(argv) > 3 else ()),
          keras.callbacks.ProgbarLogger(), keras.callbacks.TerminateOnNaN(),
          *([keras.callbacks.RemoteMonitor(root=os.environ[
              "TFDIST_TEST_REMOTE_MONITOR"])]
            if os.environ.get("TFDIST_TEST_REMOTE_MONITOR") else []),
          *ending])
  if task_type == "chief":
    with open(out_path, "w") as f:
      json.dump(result, f)
  elif "diverged" in result:
    print(f"test: diverged: {result['diverged']}", flush=True)


if __name__ == "__main__":
  main(sys.argv)
