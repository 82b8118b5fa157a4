"""Checkpoints of the whole training state: where they go, restore, save.

One `CheckpointKeeper` per run wraps a `tf.train.Checkpoint` (model,
optimizer with its slots, iteration count and loss scale, the global step)
and a `tf.train.CheckpointManager`:

* the chief (or the only process) saves into `--model_dir/checkpoints` (or
  `--checkpoint_dir`) and resumes from there;
* under MultiWorkerMirroredStrategy the other workers take part in every
  save (it is collective) but write into a scratch folder of their own, and
  resume from the chief's folder (Model Garden's pattern).

TensorFlow writes a checkpoint's data files first and updates the index
(`checkpoint`) last, so a checkpoint is listed only once it is whole. A save
that was interrupted leaves a `ckpt-N_temp/` folder of parts behind; the
chief removes those at start (`clean_interrupted_saves`).

A non-finite state is never saved: before each save one compiled check
(`tf.math.is_finite` over every floating-point variable of the state, one
host synchronization per checkpoint) runs, and a state holding NaN or
infinity raises `NonFiniteStateError` instead. The rotation
(`--max_checkpoints`) only ever runs on a save, so the newest checkpoint
kept is always the last good one, and a rerun resumes from it. Restoring a
non-finite checkpoint (written by an older tfdist) falls back to the newest
finite one.

The run that wrote the checkpoints is recorded beside them
(`run_config.json`, `run_record`); `check_resume` compares a resuming run
with it: a changed model or global batch is refused unless
`--allow_incompatible_resume`, other changes are listed.

The input position (`InputPosition`, `--checkpoint_input_position`): a
checkpoint also records the training input's layout, not any iterator state
(`tfdist.data.input_position`, its home; exported here too).
"""

import json
import os
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from absl import logging
import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2

from tfdist import config as config_lib
from tfdist import errors
from tfdist.data.input_position import INPUT_POSITION_KEY  # noqa: F401
from tfdist.data.input_position import InputPosition
from tfdist.training.state.checkpoint_paths import checkpoint_step  # noqa: F401
from tfdist.training.state.checkpoint_paths import is_interrupted_save

RUN_RECORD_FILE = "run_config.json"


def _damaged_checkpoint(path: str,
                        error: Exception) -> errors.DamagedCheckpointError:
  """The error naming a checkpoint `path` whose files `error` could not read."""
  first = errors.first_line(error, default=type(error).__name__)
  folder, name = os.path.split(path)
  return errors.DamagedCheckpointError(
      f"The checkpoint {path} cannot be read, its files are damaged "
      f"({type(error).__name__}: {first}). tfdist deletes nothing it did "
      f"not write: move its files ({name}.*) out of {folder} to resume "
      "from the checkpoint before it, or start a fresh --model_dir.")


def clean_interrupted_saves(directory: str) -> List[str]:
  """Removes `<prefix>-N_temp/` folders that interrupted saves left.

  Call it only from the process that writes `directory`, before it saves
  (the `--model_dir` lease keeps any other writer away).

  Returns:
    The removed paths.
  """
  if not tf.io.gfile.isdir(directory):
    return []
  removed = []
  for name in sorted(tf.io.gfile.listdir(directory)):
    name = name.rstrip("/")
    path = os.path.join(directory, name)
    if is_interrupted_save(name) and tf.io.gfile.isdir(path):
      tf.io.gfile.rmtree(path)
      removed.append(path)
  if removed:
    logging.info("tfdist: removed %d folder(s) left by interrupted "
                 "checkpoint saves: %s", len(removed), ", ".join(removed))
  return removed


# Parts of the training state (children of the checkpoint's root) that a
# checkpoint may lack: the input position (`InputPosition`), the random
# layers' seed-generator states (`tfdist.training.step.train_loop.random_state`)
# and the learning-rate factor Keras's learning-rate callbacks set
# (`tfdist.training.plan.lr_schedule.AdjustableLearningRate`; absent, it stays
# 1), which older checkpoints do not hold; and the Keras callbacks' state
# (`tfdist.training.state.callback_state`), saved only when a callback has some.
OPTIONAL_PARTS = ("input_position", "random_state", "lr_multiplier",
                  "callback_state")


def root_children(prefix: str) -> set:
  """Names of the objects a checkpoint's root holds (`model`, `optimizer`,
  ...), from its object graph."""
  graph = trackable_object_graph_pb2.TrackableObjectGraph()
  graph.ParseFromString(tf.train.load_checkpoint(prefix).get_tensor(
      "_CHECKPOINTABLE_OBJECT_GRAPH"))
  return {child.local_name for child in graph.nodes[0].children}


def _components(variable) -> tuple:
  """The per-device variables of a distributed (Keras) variable, each
  checked on its own: a tensor-parallel shard (sync-on-read, no
  aggregation) cannot be read whole; `(variable,)` otherwise."""
  value = getattr(variable, "value", variable)
  if isinstance(value, tf.distribute.DistributedValues):
    return tuple(value.values)
  return (variable,)


class CheckpointKeeper:
  """Restores and saves one run's checkpoints; never saves a NaN state.

  Args:
    checkpoint: the `tf.train.Checkpoint` over the whole state.
    directory: where this process saves (the chief's checkpoint folder, or
      a non-chief worker's scratch folder).
    step_counter: the global step variable (numbers the checkpoints).
    max_to_keep: checkpoints kept in `directory`.
    restore_dir: where to resume from when it is not `directory` (non-chief
      workers resume from the chief's folder); None: `directory`.
    input_position: an `InputPosition` saved with (attached to)
      `checkpoint`; None: no input position.
    variables: the state's variables checked for NaN and infinity before
      every save (model and optimizer variables); None or empty: unchecked.
    before_save: called before every save (e.g.
      `tfdist.distribute.lease.Lease.check`, which raises once another run took
      `--model_dir` over).
    log_every_seconds: a save is logged at INFO when it is this process's
      first or the last INFO line of a save is at least this old (seconds;
      the line then counts the saves since); the others at DEBUG, so a
      short run's progress lines are not buried. 0: every save at INFO.
    clock: seconds, for `log_every_seconds` (default `time.monotonic`).
  """

  def __init__(self, *, checkpoint: tf.train.Checkpoint, directory: str,
               step_counter: tf.Variable, max_to_keep: int = 5,
               restore_dir: Optional[str] = None,
               input_position: Optional[InputPosition] = None,
               variables: Optional[Sequence[tf.Variable]] = None,
               before_save=None, log_every_seconds: float = 600.0,
               clock: Callable[[], float] = time.monotonic):
    self.checkpoint = checkpoint
    self.log_every_seconds = float(log_every_seconds)
    self._clock = clock
    self._last_info: Optional[float] = None
    self._saves_unlogged = 0
    self.input_position = input_position
    if input_position is not None:
      checkpoint.input_position = input_position
    self.directory = directory
    self.restore_dir = restore_dir or directory
    self.manager = tf.train.CheckpointManager(
        checkpoint, directory, max_to_keep=max_to_keep,
        step_counter=step_counter)
    self.restored_from: Optional[str] = None
    self.before_save = before_save
    floats = [c for v in (variables or ())
              if tf.as_dtype(v.dtype).is_floating for c in _components(v)]
    self._check_fn = None
    if floats:
      def all_finite():
        return tf.reduce_all(tf.stack(
            [tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(v)))
             for v in floats]))
      self._check_fn = tf.function(all_finite)

  @property
  def latest(self) -> Optional[str]:
    """The newest checkpoint this process saved or resumed from."""
    return self.manager.latest_checkpoint or self.restored_from

  def state_is_finite(self) -> bool:
    """True when every checked variable is finite (one compiled reduction
    and one host synchronization); True when nothing is checked."""
    if self._check_fn is None:
      return True
    return bool(self._check_fn())

  def restore(self) -> Optional[str]:
    """Restores the newest finite checkpoint of `restore_dir`, if any.

    A checkpoint whose state is not finite (written before tfdist checked)
    is skipped with a warning for the next older one.

    Returns:
      The checkpoint's path, or None when training starts fresh.

    Raises:
      NonFiniteStateError: every checkpoint there holds NaN or infinity.
      DamagedCheckpointError: the newest checkpoint's files cannot be read
        (a damaged index, a data file cut or gone), named with the fix.
    """
    state = tf.train.get_checkpoint_state(self.restore_dir)
    latest = tf.train.latest_checkpoint(self.restore_dir)
    candidates = list(reversed(state.all_model_checkpoint_paths)) \
        if state else []
    if latest and latest not in candidates:
      candidates.insert(0, latest)
    path = None
    for candidate in candidates:
      if not tf.io.gfile.exists(candidate + ".index"):
        continue
      try:
        self._restore(candidate)
      except tf.errors.OpError as e:
        # A damaged index ("not an sstable") or a data file gone or cut:
        # not a lost peer or a missing file system (those have their own
        # error classes and messages).
        if type(e) in (tf.errors.OpError, tf.errors.DataLossError) or (
            isinstance(e, tf.errors.NotFoundError) and candidate in str(e)):
          raise _damaged_checkpoint(candidate, e) from None
        raise
      if self.state_is_finite():
        path = candidate
        break
      logging.warning("tfdist: checkpoint %s holds NaN or infinite values; "
                      "trying the one before it.", candidate)
    else:
      if candidates and any(tf.io.gfile.exists(c + ".index")
                            for c in candidates):
        raise errors.NonFiniteStateError(
            f"Every checkpoint in {self.restore_dir} holds NaN or infinite "
            "values: no good state to resume from. Start a fresh "
            "--model_dir.")
    self.restored_from = path
    return path

  def _restore(self, path: str):
    """Restores `path`. A checkpoint without an optional part
    (`OPTIONAL_PARTS`: written with --nocheckpoint_input_position, or before
    tfdist saved that part) restores everything else; a part the checkpoint
    has and this run does not is left unread."""
    present = root_children(path)
    absent = {name: getattr(self.checkpoint, name) for name in OPTIONAL_PARTS
              if name not in present and hasattr(self.checkpoint, name)}
    for name in absent:
      delattr(self.checkpoint, name)
    try:
      status = self.checkpoint.restore(path)
      status.assert_existing_objects_matched()
      if any(name in present and not hasattr(self.checkpoint, name)
             for name in OPTIONAL_PARTS):
        status.expect_partial()  # E.g. a saved position not needed.
    finally:
      for name, value in absent.items():
        setattr(self.checkpoint, name, value)
    if "input_position" in absent:
      self.input_position.saved = None
    if "random_state" in absent:
      logging.warning(
          "tfdist: %s holds no random-layer state (written before tfdist "
          "saved it): dropout and other random layers continue from a "
          "fresh state, so their draws differ from an uninterrupted run's.",
          path)

  def save(self, step: int) -> str:
    """Saves the state as checkpoint number `step`; returns its path.

    Raises:
      NonFiniteStateError: the state holds NaN or infinity; nothing was
        saved and the last good checkpoint (`latest`) stays.
    """
    if self.before_save is not None:
      self.before_save()
    if not self.state_is_finite():
      raise errors.NonFiniteStateError(
          f"The training state at step {step} holds NaN or infinite values: "
          "no checkpoint was saved.")
    path = self.manager.save(checkpoint_number=step)
    self._log_save(path)
    return path

  def _log_save(self, path: str):
    """`Saved checkpoint PATH` at INFO now and then (`log_every_seconds`),
    else at DEBUG."""
    now = self._clock()
    if (self._last_info is not None and
        now - self._last_info < self.log_every_seconds):
      self._saves_unlogged += 1
      logging.debug("Saved checkpoint %s", path)
      return
    since = (f" ({self._saves_unlogged} more saved since the last such "
             "line)" if self._saves_unlogged else "")
    logging.info("Saved checkpoint %s%s", path, since)
    self._last_info, self._saves_unlogged = now, 0


# --- the run that wrote the checkpoints --------------------------------------
# Fields that define the model: a checkpoint of one does not fit another.
MODEL_FIELDS = config_lib.settings_with("model")
# Config fields that do not change what is trained (paths, logging,
# cluster plumbing, timeouts): left out of the comparison.
OPERATIONAL_FIELDS = frozenset(config_lib.settings_with("operational") +
                               config_lib.BOOKKEEPING_FIELDS)


def run_record(settings: Mapping[str, Any], plan) -> dict:
  """What a run trains, as recorded beside its checkpoints.

  Args:
    settings: the run's settings by flag name
      (`tfdist.observability.manifest.recorded_config`); the operational
      ones are left out.
    plan: its `tfdist.training.plan.run_plan.RunPlan`.

  Returns:
    A JSON-serializable dict: the batch and step plan, the strategy and
    `config` (the settings that change what is trained).
  """
  flags = {k: v for k, v in settings.items()
           if k not in OPERATIONAL_FIELDS}
  return {"global_batch_size": plan.global_batch_size,
          "num_replicas_in_sync": plan.batch.num_replicas_in_sync,
          "per_replica_batch_size": plan.batch.per_replica_batch_size,
          "total_steps": plan.total_steps,
          "steps_per_epoch": plan.steps_per_epoch,
          "warmup_steps": plan.lr.warmup_steps,
          "peak_learning_rate": plan.lr.peak_learning_rate,
          "strategy": plan.strategy,
          "eval_batch_size": plan.eval_batch_size, "config": flags}


def write_run_record(directory: str, record: dict):
  """Writes `record` as `directory/run_config.json` (atomically)."""
  tf.io.gfile.makedirs(directory)
  path = os.path.join(directory, RUN_RECORD_FILE)
  tmp = f"{path}.tmp-{os.getpid()}"
  with tf.io.gfile.GFile(tmp, "w") as f:
    json.dump(record, f, indent=2, sort_keys=True, default=str)
  tf.io.gfile.rename(tmp, path, overwrite=True)


def read_run_record(directory: str,
                    model_dir: Optional[str] = None) -> Optional[dict]:
  """The record of the run that wrote `directory`'s checkpoints.

  Falls back to `model_dir`'s run manifest (runs of tfdist versions that
  wrote no record); None when neither exists.
  """
  path = os.path.join(directory, RUN_RECORD_FILE)
  if tf.io.gfile.exists(path):
    with tf.io.gfile.GFile(path) as f:
      return json.load(f)
  manifest = os.path.join(model_dir or "", "run_manifest.json")
  if model_dir and tf.io.gfile.exists(manifest):
    with tf.io.gfile.GFile(manifest) as f:
      old = json.load(f)
    config = old.get("config") or {}
    return {"global_batch_size": old.get("global_batch_size"),
            "num_replicas_in_sync": old.get("num_replicas_in_sync"),
            "per_replica_batch_size": old.get("per_replica_batch_size"),
            "total_steps": old.get("total_steps") or old.get("train_steps"),
            "config": {k: v for k, v in config.items()
                       if k not in OPERATIONAL_FIELDS}}
  return None


def _flag_changes(before: Dict, after: Dict) -> List[str]:
  changes = []
  for name in sorted(set(before) | set(after)):
    if name in OPERATIONAL_FIELDS or name in MODEL_FIELDS:
      continue
    old, new = before.get(name), after.get(name)
    if old != new:
      changes.append(f"--{name} {old} -> {new}")
  return changes


def check_resume(previous: dict, current: dict, *, checkpoint: str,
                 restored_step: int, allow: bool = False) -> List[str]:
  """Compares a resuming run with the run that wrote its checkpoint.

  Args:
    previous: `run_record` of the run that wrote the checkpoint.
    current: `run_record` of this run.
    checkpoint: the checkpoint resumed from (for messages).
    restored_step: its step.
    allow: `--allow_incompatible_resume`: report a changed model or global
      batch instead of refusing.

  Returns:
    What changed, one sentence each (empty when nothing did).

  Raises:
    IncompatibleResumeError: the model or the global batch changed and
      `allow` is False; the optimizer changed (whatever `allow` says: the
      checkpoint's optimizer state is another optimizer's, which cannot
      be restored); the message says what changed and how to proceed.
  """
  old_config = previous.get("config") or {}
  new_config = current.get("config") or {}
  old_optimizer, new_optimizer = (old_config.get("optimizer"),
                                  new_config.get("optimizer"))
  if old_optimizer and new_optimizer and old_optimizer != new_optimizer:
    raise errors.IncompatibleResumeError(
        f"Cannot resume from {checkpoint}: the optimizer changed "
        f"(--optimizer {old_optimizer} -> {new_optimizer}), and the "
        f"checkpoint's optimizer state is {old_optimizer}'s, which "
        f"{new_optimizer} cannot restore. Resume with "
        f"--optimizer={old_optimizer}, or start a fresh --model_dir with "
        f"--init_checkpoint={checkpoint} (its weights, a new optimizer "
        "state).")
  problems, notes = [], []
  model_changes = [f"--{k} {old_config.get(k)} -> {new_config.get(k)}"
                   for k in MODEL_FIELDS
                   if k in old_config and old_config.get(k) !=
                   new_config.get(k)]
  if model_changes:
    problems.append("the model changed (" + ", ".join(model_changes) + ")")
  old_batch = previous.get("global_batch_size")
  new_batch = current.get("global_batch_size")
  if old_batch is not None and old_batch != new_batch:
    problems.append(
        f"the global batch changed from {old_batch} to {new_batch} "
        "(--batch_size, or --per_replica_batch_size x replicas): the "
        "learning-rate scaling, the warmup and the steps per epoch of the "
        f"first {restored_step} steps were planned for {old_batch}")
  if problems and not allow:
    raise errors.IncompatibleResumeError(
        f"Cannot resume from {checkpoint}: " + "; ".join(problems) + ". "
        "Resume with the checkpoint's settings, start a fresh --model_dir, "
        "or pass --allow_incompatible_resume to resume anyway (weights "
        "that do not fit the new model still fail to restore).")
  notes += [p + " (--allow_incompatible_resume)" for p in problems]
  old_steps, new_steps = previous.get("total_steps"), current.get(
      "total_steps")
  if old_steps and new_steps and old_steps != new_steps:
    notes.append(
        f"the run is {'longer' if new_steps > old_steps else 'shorter'}: "
        f"{old_steps} -> {new_steps} steps; the warmup and decay schedules "
        f"(--lr_schedule={new_config.get('lr_schedule')}) are recomputed for "
        f"{new_steps} steps, so from step {restored_step} on the learning "
        "rate follows the new schedule")
  old_replicas = previous.get("num_replicas_in_sync")
  new_replicas = current.get("num_replicas_in_sync")
  if (old_replicas and new_replicas and old_replicas != new_replicas and
      old_batch == new_batch):
    notes.append(
        f"{old_replicas} -> {new_replicas} replicas at the same global batch "
        f"{new_batch}: per-replica batch "
        f"{previous.get('per_replica_batch_size')} -> "
        f"{current.get('per_replica_batch_size')}")
  notes += _flag_changes(old_config, new_config)
  return notes

