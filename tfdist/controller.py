"""The outer training loop: chunks of steps, logging, evaluation, checkpoints.

Orbit-style split: `train_loop.Trainer` owns the compiled step functions;
the `Controller` decides how many steps to run next, and between chunks logs
throughput and summaries, evaluates, saves checkpoints and calls Keras
callbacks. The chunk ends at the next log, checkpoint or epoch boundary, so
every boundary is hit exactly.
"""

import dataclasses
import math
from typing import Callable, List, Optional, Sequence

from absl import logging
import keras
import tensorflow as tf

from tfdist import precision
from tfdist.throughput import ThroughputMeter
from tfdist.train_loop import Trainer


@dataclasses.dataclass(frozen=True)
class ControllerOptions:
  """When the controller stops to do what (all in steps unless named).

  Attributes:
    total_steps: optimizer updates in the whole run.
    steps_per_epoch: updates per epoch.
    log_steps: log loss, learning rate and throughput every this many steps.
    checkpoint_steps: save every this many steps (0: at every epoch end).
    epochs_between_evals: evaluate after every this many epochs (and at end).
    steps_per_execution: most steps run inside one `tf.function` call.
  """
  total_steps: int
  steps_per_epoch: int
  log_steps: int = 100
  checkpoint_steps: int = 0
  epochs_between_evals: int = 1
  steps_per_execution: int = 1


class Controller:
  """Runs a `Trainer` to `total_steps`, restoring from and writing checkpoints.

  Args:
    trainer: the `Trainer`.
    options: a `ControllerOptions`.
    train_iterator: iterator over the distributed training dataset.
    eval_dataset: a distributed evaluation dataset (read once per
      evaluation), or None to skip evaluation.
    checkpoint_manager: a `tf.train.CheckpointManager` over the full state.
    summary_writer: a `tf.summary` writer for per-step scalars (a no-op
      writer on non-chief workers).
    callbacks: Keras callbacks (e.g. `keras.callbacks.TensorBoard`).
    preemption: a `tfdist.preemption.PreemptionWatcher`, or None. After every
      chunk its `should_stop()` is asked (a collective under
      MultiWorkerMirroredStrategy, so every worker stops at the same step);
      on True the controller saves a checkpoint and raises its
      `PreemptedError`.
    restore_dir: where to look for the checkpoint to resume from, when it is
      not the manager's own folder (non-chief workers save to a scratch
      folder but resume from the chief's checkpoints); None: the manager's.
  """

  def __init__(self, *, trainer: Trainer, options: ControllerOptions,
               train_iterator, eval_dataset,
               checkpoint_manager: tf.train.CheckpointManager,
               summary_writer, callbacks: Sequence[keras.callbacks.Callback] = (),
               preemption=None, restore_dir: Optional[str] = None):
    self.trainer = trainer
    self.options = options
    self.train_iterator = train_iterator
    self.eval_dataset = eval_dataset
    self.checkpoint_manager = checkpoint_manager
    self.summary_writer = summary_writer
    self.preemption = preemption
    self.restore_dir = restore_dir
    self.callbacks = keras.callbacks.CallbackList(
        list(callbacks), model=trainer.model)
    self.meter = ThroughputMeter(trainer.global_batch_size)
    self.history: List[dict] = []
    self.eval_history: List[dict] = []

  @property
  def step(self) -> int:
    return int(self.trainer.global_step.numpy())

  def restore(self) -> int:
    """Restores the latest checkpoint, if any; returns the step reached."""
    if self.restore_dir:
      path = tf.train.latest_checkpoint(self.restore_dir)
      if path:
        self.checkpoint_manager.checkpoint.restore(path)
    else:
      path = self.checkpoint_manager.restore_or_initialize()
    if path:
      logging.info("Restored %s: resuming at step %d", path, self.step)
    return self.step

  def _next_chunk(self, step: int) -> int:
    opts = self.options
    boundaries = [opts.total_steps, (step // opts.log_steps + 1) * opts.log_steps,
                  (step // opts.steps_per_epoch + 1) * opts.steps_per_epoch]
    if opts.checkpoint_steps:
      boundaries.append((step // opts.checkpoint_steps + 1) *
                        opts.checkpoint_steps)
    return max(1, min(min(boundaries) - step, opts.steps_per_execution))

  def _learning_rate(self) -> float:
    optimizer = self.trainer.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return float(keras.ops.convert_to_numpy(inner.learning_rate))

  def _log(self, step: int, sums: dict, steps: int):
    interval = self.meter.record(step)
    loss = sums["loss"] / max(steps, 1)
    accuracy = sums["correct"] / max(sums["count"], 1.0)
    lr = self._learning_rate()
    record = {"step": step, "loss": loss, "accuracy": accuracy,
              "learning_rate": lr}
    text = (f"step {step}/{self.options.total_steps}: loss {loss:.4f}, "
            f"accuracy {accuracy:.4f}, learning rate {lr:.6g}")
    with self.summary_writer.as_default(step=step):
      tf.summary.scalar("loss", loss)
      tf.summary.scalar("accuracy", accuracy)
      tf.summary.scalar("learning_rate", lr)
      scale = precision.current_loss_scale(self.trainer.optimizer)
      if scale is not None:
        tf.summary.scalar("loss_scale", scale)
        record["loss_scale"] = scale
        text += f", loss scale {scale:g}"
      if interval is not None:
        record["examples_per_second"] = interval.examples_per_second
        record["step_time_seconds"] = interval.step_time
        tf.summary.scalar("examples_per_second", interval.examples_per_second)
        tf.summary.scalar("step_time_seconds", interval.step_time)
        text += (f", {interval.examples_per_second:.1f} examples/sec, "
                 f"{interval.step_time * 1000:.1f} ms/step")
        if interval.excluded:
          record["excluded_from_throughput"] = True
          text += " (first interval: warm-up, not averaged)"
    self.history.append(record)
    logging.info(text)
    if not all(math.isfinite(v) for v in (loss, lr)):
      raise FloatingPointError(
          f"Training diverged at step {step}: loss {loss}, learning rate {lr}. "
          "Lower --base_learning_rate, add warmup, or use fp32.")

  def evaluate(self, step: int) -> Optional[dict]:
    if self.eval_dataset is None:
      return None
    result = self.trainer.evaluate(self.eval_dataset)
    result["step"] = step
    self.eval_history.append(result)
    logging.info("eval at step %d: loss %.4f, accuracy %.4f%s on %d examples",
                 step, result["loss"], result["accuracy"],
                 f", AUC {result['auc']:.4f}" if "auc" in result else "",
                 result["num_examples"])
    return result

  def run(self) -> dict:
    """Trains to `total_steps`; returns the final evaluation (or None)."""
    opts = self.options
    step = self.restore()
    self.callbacks.on_train_begin()
    self.meter.start(step)
    epoch = step // opts.steps_per_epoch
    epoch_sums = {"loss": 0.0, "correct": 0.0, "count": 0.0, "steps": 0}
    log_sums = dict(epoch_sums)
    last_eval = None
    if step < opts.total_steps:
      self.callbacks.on_epoch_begin(epoch)
    while step < opts.total_steps:
      n = self._next_chunk(step)
      self.callbacks.on_train_batch_begin(step % opts.steps_per_epoch)
      out = self.trainer.train_function(self.train_iterator,
                                        tf.constant(n, tf.int32))
      # Scalars only (binary tasks also return AUC histograms).
      out = {k: float(out[k]) for k in ("loss", "correct", "count")}
      step += n
      for sums in (epoch_sums, log_sums):
        for k in ("loss", "correct", "count"):
          sums[k] += out[k]
        sums["steps"] += n
      self.callbacks.on_train_batch_end(
          (step - 1) % opts.steps_per_epoch, {"loss": out["loss"] / n})
      if step % opts.log_steps == 0 or step == opts.total_steps:
        self._log(step, log_sums, log_sums["steps"])
        log_sums = {"loss": 0.0, "correct": 0.0, "count": 0.0, "steps": 0}
      epoch_end = step % opts.steps_per_epoch == 0
      saved = ((opts.checkpoint_steps and step % opts.checkpoint_steps == 0) or
               (not opts.checkpoint_steps and epoch_end) or
               step == opts.total_steps)
      if saved:
        self.checkpoint_manager.save(checkpoint_number=step)
      if (self.preemption is not None and step < opts.total_steps and
          self.preemption.should_stop()):
        path = (self.checkpoint_manager.latest_checkpoint if saved else
                self.checkpoint_manager.save(checkpoint_number=step))
        self.callbacks.on_train_end()
        raise self.preemption.preempted(step=step, checkpoint=path)
      if epoch_end or step == opts.total_steps:
        logs = {"loss": epoch_sums["loss"] / max(epoch_sums["steps"], 1),
                "accuracy": epoch_sums["correct"] / max(epoch_sums["count"], 1)}
        if ((epoch + 1) % opts.epochs_between_evals == 0 or
            step == opts.total_steps):
          last_eval = self.evaluate(step)
          if last_eval:
            logs.update({"val_loss": last_eval["loss"],
                         "val_accuracy": last_eval["accuracy"]})
            if "auc" in last_eval:  # binary tasks (issue 16: eval_auc)
              logs["val_auc"] = last_eval["auc"]
        self.callbacks.on_epoch_end(epoch, logs)
        epoch += 1
        epoch_sums = {"loss": 0.0, "correct": 0.0, "count": 0.0, "steps": 0}
        if step < opts.total_steps:
          self.callbacks.on_epoch_begin(epoch)
    self.callbacks.on_train_end()
    if last_eval is None:
      last_eval = self.evaluate(step)
    return last_eval
