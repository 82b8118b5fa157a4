"""What runs inside tfdist's Ray Train workers (`tfdist.ray`'s jobs).

* `run_worker`: Ray Train's per-worker function (`tfdist.ray` hands Ray
  `tfdist.ray.train_loop_per_worker`, which calls it): one
  `tfdist.experiment.run_experiment` of the job's `TrainConfig`.
* `RayReportCallback`: tfdist's metrics and checkpoints, reported to Ray
  Train (`ray.train.report`).
* `export_checkpoint` / `import_checkpoint`: a tfdist checkpoint copied
  into a Ray checkpoint's folder and back.

This module imports TensorFlow, Keras and Ray Train: only Ray's workers and
tests import it; `tfdist.ray` (the driver) reaches it through
`train_loop_per_worker` and its lazy attributes, after its own
`quiet_tensorflow` set-up.
"""

import logging as std_logging
import os
import sys
import tempfile
import time
import uuid
from typing import Optional, Sequence

from absl import logging
from google.protobuf import text_encoding
import keras
import ray.train
import tensorflow as tf

from tfdist import experiment
from tfdist.observability import manifest as manifest_lib
from tfdist.training.state.checkpoint_paths import checkpoint_step

# How long the other workers wait for the chief to import a Ray checkpoint.
IMPORT_TIMEOUT_SECONDS = 300


def log_tensorflow_once():
  """Leaves TensorFlow's Python log lines to the root logger's handlers.

  TensorFlow's logger gets a stderr handler of its own when TensorFlow is
  imported before the root logger has one (`tf.get_logger()`), and
  passes its records on to the root logger as well. In a Ray Train
  worker, Ray imports TensorFlow first and then gives the root logger its
  console and log-file handlers, so every TensorFlow line was written
  twice ("INFO:tensorflow:..." and the plain one). With root handlers
  there, TensorFlow's own stderr handlers go; its lines are then written
  once, by Ray's handlers (and so in Ray Train's worker log file too).
  """
  root = std_logging.getLogger()
  tf_logger = std_logging.getLogger("tensorflow")
  if not root.handlers or not tf_logger.propagate:
    return
  for handler in list(tf_logger.handlers):
    if (type(handler) is std_logging.StreamHandler and  # pylint: disable=unidiomatic-typecheck
        handler.stream in (sys.stderr, sys.stdout, sys.__stderr__,
                           sys.__stdout__)):
      tf_logger.removeHandler(handler)


# --- tfdist checkpoints as Ray checkpoints -----------------------------------
def write_checkpoint_state(folder: str, names: Sequence[str]):
  """Writes TensorFlow's `checkpoint` state file of `folder`: the last of
  `names` (checkpoint prefixes relative to `folder`, oldest first) is the
  latest, all are kept (`tf.train.get_checkpoint_state` reads them back).

  TensorFlow's own writer (`tf.compat.v1.train.update_checkpoint_state`)
  is deprecated and says so in every Ray worker's log; this writes the
  same text proto, to a temporary file renamed over the old one (a reader
  sees the old state or the new one, as TensorFlow's atomic write)."""
  def field(name, value):
    return f'{name}: "{text_encoding.CEscape(value, as_utf8=True)}"\n'
  text = field("model_checkpoint_path", names[-1]) + "".join(
      field("all_model_checkpoint_paths", name) for name in names)
  path = os.path.join(folder, "checkpoint")
  tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
  with tf.io.gfile.GFile(tmp, "w") as f:
    f.write(text)
  tf.io.gfile.rename(tmp, path, overwrite=True)


def _copy_checkpoint_files(prefix: str, folder: str):
  """Copies the files of checkpoint `prefix` (`ckpt-N.index`,
  `ckpt-N.data-*`) into `folder`, overwriting."""
  for path in tf.io.gfile.glob(prefix + ".*"):
    tf.io.gfile.copy(path, os.path.join(folder, os.path.basename(path)),
                     overwrite=True)


def export_checkpoint(checkpoint_dir: str, folder: str,
                      newer_than: int = -1) -> Optional[int]:
  """Copies the latest tfdist checkpoint of `checkpoint_dir` into `folder`.

  The copy is a tfdist checkpoint folder of its own: the checkpoint's files
  (`ckpt-N.index`, `ckpt-N.data-*`) and TensorFlow's `checkpoint` state
  file naming it, so `tf.train.latest_checkpoint(folder)` finds it; it is
  what a Ray checkpoint of the run holds.

  Args:
    checkpoint_dir: tfdist's checkpoint folder (local or gs://).
    folder: an existing local folder.
    newer_than: copy only a checkpoint of a later step than this.

  Returns:
    The step copied, or None (no checkpoint, or none newer).
  """
  prefix = tf.train.latest_checkpoint(checkpoint_dir)
  if not prefix or checkpoint_step(prefix) <= newer_than:
    return None
  _copy_checkpoint_files(prefix, folder)
  write_checkpoint_state(folder, [os.path.basename(prefix)])
  return checkpoint_step(prefix)


def import_checkpoint(folder: str, checkpoint_dir: str) -> Optional[int]:
  """Copies the tfdist checkpoint of a Ray checkpoint `folder` into
  `checkpoint_dir` when that holds no checkpoint of the same or a later
  step (a run restored through Ray into a new `--model_dir`).

  The files go first and TensorFlow's `checkpoint` state file last, so a
  reader sees the checkpoint whole or not at all; nothing there is deleted.

  Returns:
    The step imported, or None (nothing to import, or `checkpoint_dir`
    is as new).
  """
  prefix = tf.train.latest_checkpoint(folder)
  if not prefix:
    return None
  local = tf.train.latest_checkpoint(checkpoint_dir)
  step = checkpoint_step(prefix)
  if local and checkpoint_step(local) >= step:
    return None
  tf.io.gfile.makedirs(checkpoint_dir)
  _copy_checkpoint_files(prefix, checkpoint_dir)
  state = tf.train.get_checkpoint_state(checkpoint_dir)
  kept = list(state.all_model_checkpoint_paths) if state else []
  write_checkpoint_state(checkpoint_dir, [*kept, os.path.basename(prefix)])
  return step


def wait_for_checkpoint(checkpoint_dir: str, step: int, timeout: float,
                        poll_seconds: float = 0.5):
  """Waits until `checkpoint_dir`'s latest checkpoint is at `step` or later
  (the chief imports it; the other workers restore from it).

  Raises:
    RuntimeError: none is there after `timeout` seconds.
  """
  deadline = time.time() + timeout
  while True:
    latest = tf.train.latest_checkpoint(checkpoint_dir)
    if latest and checkpoint_step(latest) >= step:
      return
    if time.time() > deadline:
      raise RuntimeError(
          f"tfdist.ray: the chief did not import the Ray checkpoint of step "
          f"{step} into {checkpoint_dir} within {timeout:.0f} s.")
    time.sleep(poll_seconds)


# --- reports to Ray Train ------------------------------------------------------
class RayReportCallback(keras.callbacks.Callback):
  """Reports tfdist's metrics and checkpoints to Ray Train.

  Every worker reports (`ray.train.report` is a barrier across the
  workers: each must call it the same number of times), at points
  tfdist's controller reaches at the same step on every worker:

  * every `log_steps` steps (when the next chunk of steps begins, after
    the controller saved any checkpoint of that step): `step`, `loss`
    (the mean training loss of the interval), `epoch`, `start_step`;
    the chief (world rank 0) attaches a Ray checkpoint holding the
    newest tfdist checkpoint not reported yet (`export_checkpoint`), so
    Ray's `CheckpointConfig`, `Result.checkpoint` and
    `ray.train.get_checkpoint()` hold the model;
  * after each evaluation (`on_epoch_end`, with `val_*` logs): `step`,
    `epoch`, `start_step`, `loss`, `accuracy`, `val_loss`,
    `val_accuracy` (and whatever else the logs hold).

  Args:
    log_steps: the run's `--log_steps`.
    checkpoint_dir: tfdist's checkpoint folder (the chief exports from
      it).
    is_chief: this worker attaches the checkpoints.

  Reported values are floats except `step`, `epoch` and `start_step`
  (ints; `start_step` is the step this Ray attempt resumed from, 0 for
  a fresh start).
  """

  def __init__(self, *, log_steps: int = 0, checkpoint_dir: str = "",
               is_chief: bool = False):
    super().__init__()
    self.log_steps = int(log_steps)
    self.checkpoint_dir = checkpoint_dir
    self.is_chief = is_chief
    self.start_step = 0
    self.reported_checkpoint_step = -1
    self._last_step = 0
    self._loss_sum = 0.0
    self._loss_steps = 0
    self._reported_step = 0
    self._epoch = 0

  def _step(self, logs=None) -> int:
    if logs and "step" in logs:
      return int(logs["step"])
    return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

  def on_train_begin(self, logs=None):
    self.start_step = self._last_step = self._reported_step = (
        self._step(logs))
    self.reported_checkpoint_step = self.start_step

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch = int(epoch)

  def on_train_batch_end(self, batch, logs=None):
    step = self._step()
    if logs and "loss" in logs and step > self._last_step:
      self._loss_sum += float(logs["loss"]) * (step - self._last_step)
      self._loss_steps += step - self._last_step
    self._last_step = step

  def on_train_batch_begin(self, batch, logs=None):
    step = self._step()
    if (self.log_steps and step > self._reported_step and
        step % self.log_steps == 0):
      self._report_interval(step)

  def _report_interval(self, step):
    metrics = {"step": step, "epoch": self._epoch,
               "start_step": self.start_step}
    if self._loss_steps:
      metrics["loss"] = self._loss_sum / self._loss_steps
    self._loss_sum, self._loss_steps = 0.0, 0
    self._reported_step = step
    self.report(metrics)

  def report(self, metrics: dict, *, extra_files: Sequence = ()):
    """`ray.train.report(metrics)`; the chief attaches the newest tfdist
    checkpoint not reported yet (and `extra_files`: `(name, write)`
    pairs, `write(folder)` writing `name` into the checkpoint folder)."""
    if not self.is_chief:
      ray.train.report(metrics)
      return
    with tempfile.TemporaryDirectory(prefix="tfdist-ray-ckpt-") as folder:
      step = export_checkpoint(self.checkpoint_dir, folder,
                               newer_than=self.reported_checkpoint_step)
      for _, write in extra_files:
        write(folder)
      if step is None and not extra_files:
        ray.train.report(metrics)
        return
      if step is not None:
        self.reported_checkpoint_step = step
        metrics = {**metrics, "checkpoint_step": step}
      ray.train.report(
          metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))

  def on_epoch_end(self, epoch, logs=None):
    metrics = {k: float(v) for k, v in (logs or {}).items()
               if isinstance(v, (int, float))}
    metrics.update(step=self._step(logs), epoch=int(epoch),
                   start_step=self.start_step)
    ray.train.report(metrics)


def final_metrics(record: dict, *, start_step: int) -> dict:
  """The metrics reported at the end: from the run manifest `record`.

  Returns:
    `step`, `final_step`, `start_step`, `num_replicas_in_sync` (ints) and
    the manifest's `final_metrics` (`eval_loss`, `eval_accuracy`, ...:
    floats; `None` values left out) plus `examples_per_second`.
  """
  out = {"step": record["final_step"], "final_step": record["final_step"],
         "start_step": start_step,
         "num_replicas_in_sync": record["num_replicas_in_sync"]}
  out.update({k: v for k, v in record["final_metrics"].items()
              if v is not None})
  eps = (record.get("throughput") or {}).get("examples_per_second")
  if eps is not None:
    out["examples_per_second"] = eps
  return out


# --- the per-worker function ---------------------------------------------------
def _restore_from_ray(ray_checkpoint, checkpoint_dir: str, is_chief: bool):
  """Brings a Ray checkpoint newer than `checkpoint_dir`'s own into it: the
  chief copies it in (`import_checkpoint`), the others wait for that."""
  with ray_checkpoint.as_directory() as folder:
    if is_chief:
      step = import_checkpoint(folder, checkpoint_dir)
      if step is not None:
        logging.info("tfdist.ray: resuming from the Ray checkpoint of step "
                     "%d (copied into %s).", step, checkpoint_dir)
      return
    prefix = tf.train.latest_checkpoint(folder)
    if prefix:
      wait_for_checkpoint(checkpoint_dir, checkpoint_step(prefix),
                          IMPORT_TIMEOUT_SECONDS)


def run_worker(loop_config: dict) -> dict:
  """One tfdist run of `loop_config` on this Ray Train worker.

  A Ray checkpoint (`ray.train.get_checkpoint()`, the latest this Ray run
  reported; else `loop_config["resume_from"]`) newer than the checkpoint
  folder's own is imported there first (`import_checkpoint`, by the chief;
  the others wait for it): tfdist then resumes from it as from its own.

  Args:
    loop_config: `{"config": TrainConfig, "callbacks": [Keras callbacks],
      "resume_from": a ray.train.Checkpoint or None}`.

  Returns:
    This worker's run manifest (Ray keeps rank 0's: the chief's).
  """
  log_tensorflow_once()
  config = loop_config["config"]
  checkpoint_dir = config.resolved_checkpoint_dir
  is_chief = ray.train.get_context().get_world_rank() == 0
  # This run's own latest report first (a restart), else the checkpoint it
  # was asked to start from.
  ray_checkpoint = (ray.train.get_checkpoint() or
                    loop_config.get("resume_from"))
  if ray_checkpoint is not None:
    _restore_from_ray(ray_checkpoint, checkpoint_dir, is_chief)
  report = RayReportCallback(log_steps=config.loop.log_steps,
                             checkpoint_dir=checkpoint_dir, is_chief=is_chief)
  record = experiment.run_experiment(
      config, callbacks=[report, *loop_config.get("callbacks", ())])
  metrics = final_metrics(record, start_step=report.start_step)
  # The last report: the final metrics, and (chief) the final checkpoint
  # with the run manifest beside it.
  report.report(metrics, extra_files=[(
      manifest_lib.MANIFEST_FILE,
      lambda folder: manifest_lib.write_manifest(folder, record))])
  return record
