"""The user's Keras callbacks on every task: refused at start, or kept with
their files on the chief.

tfdist's controller calls a user's `keras.callbacks` on every training
process at the same points (`tfdist.training.controller`), as Keras's
multi-worker `fit` does, with Keras's logs. Some need more:

* **Callbacks that write files** (`ModelCheckpoint`, `TensorBoard`,
  `CSVLogger`): on the chief they write where the user said; on every other
  worker they write into the worker's scratch folder, which tfdist deletes
  at the end (as tfdist's own checkpoints and summaries do, and as Keras's
  multi-worker guide has non-chief workers write to temporary folders).
  Two workers never write the same path. `RemoteMonitor` (which posts to a
  server) and `ProgbarLogger` (which prints) run on the chief only.
* **`ProgbarLogger`** prints as in `Model.fit` (whose `verbose="auto"`
  gives it 1), although tfdist's `params` say `verbose=0` (`tfdist.fit`
  adds one under `verbose=1`; otherwise tfdist logs every `--log_steps`).
* **Callbacks that fight tfdist's own state**, refused at start:
  `BackupAndRestore` (tfdist's checkpoints already back up the whole
  training state and a rerun resumes from them; a second restore would put
  an older state over tfdist's), `OrbaxCheckpoint` (it would save from
  every process; tfdist's checkpoints already hold the state),
  `SwapEMAWeights` (tfdist's optimizers keep no moving average of the
  weights), and a `ModelCheckpoint` that saves whole `.keras` models
  (their compile config names the model's own optimizer, not tfdist's, so
  `keras.models.load_model` would not restore the training state; its
  weights files work).
"""

import copy
import os
from typing import List, Optional, Sequence

from absl import logging
import keras

from tfdist import errors

# Callback class -> the attribute holding the path it writes.
_PATH_ATTRIBUTES = (
    (keras.callbacks.ModelCheckpoint, "filepath"),
    (keras.callbacks.TensorBoard, "log_dir"),
    (keras.callbacks.CSVLogger, "filename"),
)
# Callbacks only the chief runs.
_CHIEF_ONLY = (keras.callbacks.RemoteMonitor, keras.callbacks.ProgbarLogger)
_BATCH_END_HOOKS = ("on_train_batch_end", "on_batch_end")
# Keras's own batch-end hooks that read no metric (TerminateOnNaN's: the
# loss), and those that read none when their callback works per epoch.
_LOSS_ONLY_HOOKS = tuple(
    vars(cls)[hook] for cls in (keras.callbacks.TerminateOnNaN,
                                keras.callbacks.History)
    for hook in _BATCH_END_HOOKS if hook in vars(cls))
_PER_EPOCH_HOOKS = tuple(
    vars(cls)[hook] for cls in (keras.callbacks.TensorBoard,
                                keras.callbacks.ModelCheckpoint)
    for hook in _BATCH_END_HOOKS if hook in vars(cls))
_TRAIN_BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end",
                      "on_batch_begin", "on_batch_end")
_TEST_BATCH_HOOKS = ("on_test_batch_begin", "on_test_batch_end")
# Keras's callbacks whose batch hooks never set `model.stop_training`
# (the chief-only ones among them: every worker decides alike).
_NEVER_STOP_IN_BATCH = (keras.callbacks.ProgbarLogger,
                        keras.callbacks.RemoteMonitor,
                        keras.callbacks.TensorBoard,
                        keras.callbacks.ModelCheckpoint,
                        keras.callbacks.CSVLogger, keras.callbacks.History)
# Refused: class -> (why, what to do instead).
_REFUSED = {
    keras.callbacks.BackupAndRestore: (
        "tfdist's own checkpoints back up the whole training state (model, "
        "optimizer, step, input position) and a rerun with the same "
        "--model_dir resumes from them; a BackupAndRestore would restore "
        "its own, older backup over that state",
        "drop it: rerun with the same --model_dir to resume (SIGTERM saves "
        "a checkpoint first; --checkpoint_steps sets how often)"),
    keras.callbacks.SwapEMAWeights: (
        "tfdist builds its optimizer from --optimizer without "
        "use_ema=True, so there are no moving-average weights to swap in",
        "drop it"),
}
if hasattr(keras.callbacks, "OrbaxCheckpoint"):  # Keras >= 3.13.
  _REFUSED[keras.callbacks.OrbaxCheckpoint] = (
      "it would save the model state from every process into one folder "
      "(its multi-host coordination is JAX's), beside tfdist's own "
      "checkpoints of the whole training state",
      "drop it: tfdist checkpoints every --checkpoint_steps (or epoch) and "
      "a rerun with the same --model_dir resumes; for files of your own, "
      "use keras.callbacks.ModelCheckpoint (the chief writes them)")


def flatten(callbacks) -> List[keras.callbacks.Callback]:
  """`callbacks` (a sequence of callbacks, or a `keras.callbacks.
  CallbackList`, which `Model.fit` also takes; either may hold
  `CallbackList`s) as one list of the callbacks, in the order called."""
  if isinstance(callbacks, keras.callbacks.CallbackList):
    callbacks = callbacks.callbacks
  out = []
  for callback in callbacks:
    if isinstance(callback, keras.callbacks.CallbackList):
      out += flatten(callback)
    else:
      out.append(callback)
  return out


def check_callbacks(callbacks: Sequence[keras.callbacks.Callback]) -> None:
  """Refuses callbacks tfdist cannot honour, before anything is built
  (inside `CallbackList`s too).

  Raises:
    ConfigError: one of `_REFUSED`, naming the reason and the alternative.
  """
  for callback in flatten(callbacks):
    for cls, (why, instead) in _REFUSED.items():
      if isinstance(callback, cls):
        raise errors.ConfigError(
            f"callbacks: keras.callbacks.{cls.__name__} is not supported: "
            f"{why}. Instead, {instead}.")
    if (isinstance(callback, keras.callbacks.ModelCheckpoint) and
        not callback.save_weights_only and
        not str(callback.filepath).endswith(".weights.h5")):
      raise errors.ConfigError(
          "callbacks: keras.callbacks.ModelCheckpoint(filepath="
          f"{callback.filepath!r}) saves whole .keras models, and is not "
          "supported: such a file records the optimizer the model was "
          "compiled with, not the one tfdist trains with (--optimizer, its "
          "scaled learning rate and warmup), so keras.models.load_model "
          "would not give back the training state (it warns and skips the "
          "optimizer, or fails when compile had optimizer=None). Instead, "
          "save the weights (a filepath ending in .weights.h5, or "
          "save_weights_only=True), and resume from tfdist's own "
          "checkpoints (--model_dir) or serve its SavedModel.")


def warmup_for_rate_callbacks(callbacks: Sequence[keras.callbacks.Callback],
                              *, warmup_steps: Optional[int],
                              warmup_epochs: Optional[float],
                              warmup_start_learning_rate: float
                              ) -> Optional[int]:
  """The warmup a run with these callbacks gets: `0` (off) when a
  `keras.callbacks.LearningRateScheduler` sets every epoch's rate and no
  warmup was asked for (tfdist's default warmup would make the schedule 0
  at step 0, where no factor of it gives the scheduler's rate); None: as
  configured.

  Args:
    callbacks: the user's callbacks (a `CallbackList` or a sequence, which
      may hold `CallbackList`s).
    warmup_steps, warmup_epochs, warmup_start_learning_rate: the run's
      `TrainConfig` values (None: not given).

  Raises:
    ConfigError: a `LearningRateScheduler` with a warmup asked for that
      starts at 0.
  """
  if not any(isinstance(c, keras.callbacks.LearningRateScheduler)
             for c in flatten(callbacks)):
    return None
  if warmup_steps is None and warmup_epochs is None:
    logging.info("tfdist: warmup off (warmup_steps=0): "
                 "keras.callbacks.LearningRateScheduler sets every epoch's "
                 "rate, as in keras.Model.fit.")
    return 0
  if (warmup_steps or warmup_epochs) and warmup_start_learning_rate <= 0:
    asked = (f"warmup_steps={warmup_steps}" if warmup_steps is not None
             else f"warmup_epochs={warmup_epochs}")
    raise errors.ConfigError(
        f"callbacks: keras.callbacks.LearningRateScheduler with {asked} "
        "(--warmup_steps / --warmup_epochs) from a rate of 0: the scheduler "
        "sets epoch 0's rate at step 0, where the warmup gives 0, so no "
        "factor of tfdist's schedule gives it. Instead, leave the warmup "
        "out (the scheduler's rates are the run's), or start it above 0 "
        "(TrainConfig(warmup_start_learning_rate=...), "
        "--warmup_start_learning_rate).")
  return None


def for_this_task(callbacks: Sequence[keras.callbacks.Callback], *,
                  scratch_dir: Optional[str]) -> List[keras.callbacks.Callback]:
  """The callbacks this task runs.

  Args:
    callbacks: the user's callbacks (`CallbackList`s flattened).
    scratch_dir: None on the chief (every callback as given); on another
      worker, a folder of its own that tfdist deletes at the end.

  Returns:
    On the chief, `callbacks` (a `ProgbarLogger` as a copy that prints);
    elsewhere copies of the file-writing ones
    writing under `scratch_dir/callbacks/<index>-<class>/` (the last path
    component kept), without the chief-only ones, and the others as given.
  """
  callbacks = flatten(callbacks)
  if scratch_dir is None:
    return [_printing(c) if isinstance(c, keras.callbacks.ProgbarLogger)
            else c for c in callbacks]
  out = []
  for i, callback in enumerate(callbacks):
    if isinstance(callback, _CHIEF_ONLY):
      continue
    for cls, attribute in _PATH_ATTRIBUTES:
      if isinstance(callback, cls):
        path = str(getattr(callback, attribute)).rstrip("/")
        folder = os.path.join(scratch_dir, "callbacks",
                              f"{i}-{type(callback).__name__}")
        os.makedirs(folder, exist_ok=True)  # CSVLogger makes none.
        callback = copy.copy(callback)
        setattr(callback, attribute,
                os.path.join(folder, os.path.basename(path) or "out"))
        break
    out.append(callback)
  return out


def _printing(progbar: keras.callbacks.ProgbarLogger
              ) -> keras.callbacks.ProgbarLogger:
  """A copy of `progbar` that prints whatever `params["verbose"]` says
  (`Model.fit`'s default, `verbose="auto"`, gives it 1)."""
  out = copy.copy(progbar)
  set_params = out.set_params
  out.set_params = lambda params: set_params({**params, "verbose": 1})
  return out


def reads_batch_metrics(callbacks) -> bool:
  """Whether a callback of `callbacks` (a list or a `CallbackList`) may
  read the metrics of `on_train_batch_end`'s logs. When none does, the
  controller gives those hooks the loss alone and skips computing the
  metrics every step.

  Only callbacks whose batch-end hooks are known not to read them are
  left out: those whose hooks are `keras.callbacks.Callback`'s own (which
  do nothing), `TerminateOnNaN`'s and `History`'s own (the loss at most),
  and `TensorBoard`'s or `ModelCheckpoint`'s own when they work per epoch.
  Any other hook, however it is found (a subclass, an attribute of the
  instance, `__getattribute__`), may read them: tfdist then gives every
  metric.
  """
  for callback in flatten(callbacks):
    known = _LOSS_ONLY_HOOKS
    if (isinstance(callback, keras.callbacks.TensorBoard) and
        getattr(callback, "update_freq", None) == "epoch") or (
            isinstance(callback, keras.callbacks.ModelCheckpoint) and
            getattr(callback, "save_freq", None) == "epoch"):
      known = known + _PER_EPOCH_HOOKS
    if any(_defines(callback, hook, known=known)
           for hook in _BATCH_END_HOOKS):
      return True
  return False


def _defines(callback, hook: str, *, known=()) -> bool:
  """Whether `callback`'s `hook`, as Keras calls it (looked up on the
  instance), may do something: True unless it is a method of `callback`
  whose function is `keras.callbacks.Callback`'s own (which does nothing,
  or calls the older `on_batch_*` hook, checked on its own) or one of
  `known`. Whatever tfdist cannot tell counts as defined."""
  try:
    bound = getattr(callback, hook)
  except Exception:  # pylint: disable=broad-except
    return True  # A __getattribute__ or property that fails: cannot tell.
  function = getattr(bound, "__func__", None)
  if getattr(bound, "__self__", None) is not callback or function is None:
    return True  # Set on the instance (LambdaCallback), or not a method.
  return not (function is getattr(keras.callbacks.Callback, hook, None) or
              function in known)


def _overrides(callback: keras.callbacks.Callback, hooks) -> bool:
  """Whether `callback` defines one of `hooks` (`_defines`: its class, the
  instance, as `LambdaCallback` does, or `__getattribute__`)."""
  return any(_defines(callback, hook) for hook in hooks)


def may_stop_in_batch_hooks(callbacks) -> bool:
  """Whether a callback of `callbacks` (a list or a `CallbackList`) may set
  `model.stop_training` in a training batch hook: one that overrides a
  batch hook, other than Keras's callbacks that never stop there. The
  answer is the same on every worker (chief-only callbacks never stop),
  so the controller agrees on the flag after every call of the compiled
  step only when this is True.
  """
  return any(not isinstance(c, _NEVER_STOP_IN_BATCH) and
             _overrides(c, _TRAIN_BATCH_HOOKS) for c in flatten(callbacks))


def reads_test_batches(callbacks) -> bool:
  """Whether a callback of `callbacks` (a list or a `CallbackList`)
  overrides `on_test_batch_begin` or `on_test_batch_end`: only then does
  an evaluation compute the running logs of every batch for them."""
  return any(_overrides(c, _TEST_BATCH_HOOKS) for c in flatten(callbacks))
