"""Keras callbacks' own state, saved with every checkpoint and restored on
resume.

A resumed run equals an uninterrupted one only if the callbacks that decide
across epochs remember what they saw before the interruption. tfdist keeps,
in every checkpoint (a `callback_state` part of the `tf.train.Checkpoint`,
so it is written, listed and rotated with the rest: whole or absent):

* `keras.callbacks.EarlyStopping`: `best`, `wait`, `best_epoch`,
  `stopped_epoch` and, with `restore_best_weights=True`, the best weights;
* `keras.callbacks.ReduceLROnPlateau`: `best`, `wait`, `cooldown_counter`
  (the rate it set is the checkpoint's `lr_multiplier`);
* `keras.callbacks.ModelCheckpoint`: `best` (`save_best_only`) and its
  batch counters (an integer `save_freq`);
* any callback with the hook `get_state() -> dict` (JSON-able) and
  `set_state(dict)`: what `get_state` returns, given back to `set_state`.

A resumed run gives each callback its state right after `on_train_begin`
(which resets Keras's callbacks), so it goes on deciding as in the
uninterrupted run. Callbacks are matched by their place among the stateful
callbacks of the list and their class name. Multi-worker: every worker
restores from the chief's checkpoint, so each holds the chief's state.

Stateful callbacks tfdist cannot keep are warned about at resume
(`unkept_warnings`).
"""

import io
import json
from typing import Dict, List, Optional, Sequence

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfdist import errors

# The checkpoint part's name
# (`tfdist.training.state.checkpointing.OPTIONAL_PARTS`).
PART = "callback_state"
_FORMAT = 1
# Keras callback class -> the attributes kept.
_KERAS_FIELDS = (
    (keras.callbacks.EarlyStopping,
     ("best", "wait", "best_epoch", "stopped_epoch")),
    (keras.callbacks.ReduceLROnPlateau, ("best", "wait", "cooldown_counter")),
    (keras.callbacks.ModelCheckpoint,
     ("best", "_batches_seen_since_last_saving", "_last_batch_seen")),
)


def _has_hook(callback) -> bool:
  return (callable(getattr(callback, "get_state", None)) and
          callable(getattr(callback, "set_state", None)))


def _fields(callback) -> Optional[tuple]:
  for cls, fields in _KERAS_FIELDS:
    if isinstance(callback, cls):
      return fields
  return None


def is_stateful(callback) -> bool:
  """Whether tfdist keeps `callback`'s state across a resume."""
  return _has_hook(callback) or _fields(callback) is not None


def _plain(value):
  """A JSON-able copy of a Keras attribute (NumPy scalars as Python's)."""
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, np.ndarray) and value.ndim == 0:
    return value.item()
  return value


class CallbackState(tf.train.experimental.PythonState):
  """The state of a run's stateful callbacks, as one checkpoint part.

  `serialize` (at each save) reads the callbacks; `deserialize` (at
  restore) keeps what was read until `apply` gives it to the callbacks.

  Payload: the JSON of `{"format": 1, "callbacks": {key: state}}`, a NUL
  byte, then an `.npz` of the arrays (EarlyStopping's best weights, named
  `<key>/<index>`). `key` is `<place among stateful callbacks>-<class>`.

  Args:
    callbacks: the run's callbacks (flattened), stateful or not.
  """

  def __init__(self, callbacks: Sequence[keras.callbacks.Callback]):
    self.callbacks = list(callbacks)
    self._stateful = {f"{i}-{type(c).__name__}": c for i, c in enumerate(
        c for c in self.callbacks if is_stateful(c))}
    self.restored: Optional[dict] = None
    self._restored_arrays: Dict[str, np.ndarray] = {}
    self._saved_summary: Optional[str] = None

  @property
  def keeps_any(self) -> bool:
    """Whether any callback has state tfdist keeps."""
    return bool(self._stateful)

  def _read(self):
    """(states by key, arrays by name) of the callbacks now.

    Raises:
      ConfigError: a `get_state()` that returns no dict, or one JSON cannot
        hold.
    """
    states, arrays = {}, {}
    for key, callback in self._stateful.items():
      if _has_hook(callback):
        state = callback.get_state()
        if not isinstance(state, dict):
          raise errors.ConfigError(
              f"callbacks: {type(callback).__name__}.get_state() returned "
              f"{type(state).__name__}, not a dict. Instead, return a dict "
              "of JSON values (numbers, strings, lists, dicts), which "
              "tfdist saves with each checkpoint and gives back to "
              "set_state() on resume.")
        try:
          json.dumps(state)
        except (TypeError, ValueError) as e:
          raise errors.ConfigError(
              f"callbacks: {type(callback).__name__}.get_state() returned "
              f"a dict JSON cannot hold ({e}). Instead, return numbers, "
              "strings, lists and dicts (arrays as .tolist()).") from None
        states[key] = {"hook": state}
        continue
      state = {name: _plain(getattr(callback, name, None))
               for name in _fields(callback)}
      weights = getattr(callback, "best_weights", None)
      if (isinstance(callback, keras.callbacks.EarlyStopping) and
          callback.restore_best_weights and weights is not None):
        state["best_weights"] = len(weights)
        for i, w in enumerate(weights):
          arrays[f"{key}/{i}"] = np.asarray(w)
      states[key] = state
    return states, arrays

  def _summary(self, states) -> str:
    return json.dumps(states, sort_keys=True)

  def changed_since_save(self) -> bool:
    """Whether the callbacks' state differs from the last one saved."""
    if not self._stateful:
      return False
    return self._summary(self._read()[0]) != self._saved_summary

  def serialize(self) -> bytes:
    states, arrays = self._read()
    self._saved_summary = self._summary(states)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    head = json.dumps({"format": _FORMAT, "callbacks": states},
                      sort_keys=True).encode("utf-8")
    return head + b"\0" + buffer.getvalue()

  def deserialize(self, string_value) -> None:
    data = bytes(string_value.numpy() if hasattr(string_value, "numpy")
                 else string_value)
    head, _, tail = data.partition(b"\0")
    self.restored = json.loads(head.decode("utf-8"))
    with np.load(io.BytesIO(tail), allow_pickle=False) as npz:
      self._restored_arrays = {name: npz[name] for name in npz.files}

  def check_hooks(self) -> None:
    """Calls every `get_state()` hook once, so a bad one fails before training.

    Raises:
      ConfigError: a hook returning no dict, or one JSON cannot hold.
    """
    self._read()

  def apply(self) -> List[str]:
    """Gives each callback the state restored (after `on_train_begin`).

    Returns:
      The keys of the callbacks given their state (empty when nothing was
      restored).
    """
    if self.restored is None:
      return []
    saved = self.restored.get("callbacks", {})
    done = []
    for key, callback in self._stateful.items():
      if key not in saved:
        logging.warning(
            "tfdist: the checkpoint holds no state of callback %s "
            "(callbacks changed since it was written): it starts afresh.",
            key)
        continue
      state = saved[key]
      if _has_hook(callback):
        callback.set_state(state.get("hook", {}))
      else:
        for name in _fields(callback):
          if name in state:
            setattr(callback, name, state[name])
        count = state.get("best_weights")
        if count is not None:
          callback.best_weights = [self._restored_arrays[f"{key}/{i}"]
                                   for i in range(count)]
      done.append(key)
    for key in sorted(set(saved) - set(self._stateful)):
      logging.warning("tfdist: the checkpoint holds the state of callback "
                      "%s, which this run does not have: not used.", key)
    if done:
      logging.info("tfdist: callback state restored: %s.", ", ".join(done))
    return done


# A fresh Callback's attributes: a user callback with others may keep state.
_BASE_ATTRIBUTES = frozenset(vars(keras.callbacks.Callback())) | {
    "validation_data", "model"}


def unkept_warnings(callbacks: Sequence[keras.callbacks.Callback]
                    ) -> List[str]:
  """What a resumed run loses of `callbacks`' state, one sentence each:
  Keras callbacks known to keep state that tfdist does not save, and
  callbacks of the user's own with attributes but no
  `get_state`/`set_state` hook."""
  out = []
  for callback in callbacks:
    name = type(callback).__name__
    if is_stateful(callback):
      continue
    if isinstance(callback, keras.callbacks.CSVLogger):
      if not callback.append:
        out.append(
            f"CSVLogger(filename={callback.filename!r}, append=False) "
            "rewrites its file from the resumed epoch on, dropping the "
            "rows before it: pass append=True to keep them")
    elif isinstance(callback, keras.callbacks.TensorBoard):
      if getattr(callback, "update_freq", "epoch") != "epoch":
        out.append(
            f"TensorBoard(update_freq={callback.update_freq!r}) numbers "
            "its batch summaries from 0 again after a resume")
    elif (not type(callback).__module__.startswith("keras") and
          not type(callback).__module__.startswith("tfdist")):
      extra = sorted(set(vars(callback)) - _BASE_ATTRIBUTES)
      if extra:
        out.append(
            f"{name} (attributes {', '.join(extra)}) has no get_state()/"
            "set_state() hook: if it keeps state across epochs, the resumed "
            "run starts it afresh; define get_state() -> dict (JSON "
            "values) and set_state(dict) to have it saved with each "
            "checkpoint")
  return out


def attach(checkpoint: tf.train.Checkpoint,
           callbacks: Sequence[keras.callbacks.Callback]
           ) -> Optional[CallbackState]:
  """Adds the callbacks' state to `checkpoint` (as its `callback_state`
  part) when any callback has state tfdist keeps; returns it, or None."""
  state = CallbackState(callbacks)
  if not state.keeps_any:
    return None
  setattr(checkpoint, PART, state)
  return state


def changed_since_save(state: Optional[CallbackState]) -> bool:
  """`state.changed_since_save()`; False for None (nothing kept)."""
  return state is not None and state.changed_since_save()


def after_train_begin(state: Optional[CallbackState],
                      callbacks: Sequence[keras.callbacks.Callback], *,
                      resumed: bool) -> None:
  """Right after `on_train_begin`, before the first step: checks every
  `get_state()` hook once; in a `resumed` run, gives the callbacks the
  state restored, then warns once about the state of `callbacks` that is
  lost (`unkept_warnings`).

  Args:
    state: the run's `CallbackState`; None when no callback keeps any.
    callbacks: the run's callbacks (flattened).
    resumed: the run resumed from a checkpoint.

  Raises:
    ConfigError: a `get_state()` hook returning no dict, or one JSON cannot
      hold.
  """
  if state is not None:
    state.check_hooks()
  if not resumed:
    return
  if state is not None:
    state.apply()
  lost = unkept_warnings(list(callbacks))
  if lost:
    logging.warning("tfdist: resumed; what callbacks kept before the resume "
                    "is lost: %s.", "; ".join(lost))
