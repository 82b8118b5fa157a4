"""What a run says about itself while it trains: one formatter, one sink.

`RunLog` turns the controller's step sums and evaluation results into

* one log line each (absl logging, INFO), in one format for every strategy;
* TensorBoard scalars (`train/` at log points, `validation/` at
  evaluations): loss, every metric (accuracy, AUC, ...), learning rate,
  loss scale (fp16), examples/sec and step time;
* records in `history` / `eval_history` (for the manifest), and
* one JSON line per record appended to `<model_dir>/metrics.jsonl` (chief
  only), which survives a crash: a resumed run reads the records of the
  earlier processes up to the step it resumed from, so its history is
  whole.

It also holds the divergence checks of the log points: a non-finite
training loss raises `DivergenceError` (a `FloatingPointError`; the
controller checks every chunk of steps as well, before any checkpoint), and
a loss that stays finite but exceeds `loss_explosion_factor` times its
early value (the first log point's) is named in one warning.
"""

import json
import math
import os
import socket
import time
import uuid
from typing import Callable, Dict, List, Optional

from absl import logging
import numpy as np
import tensorflow as tf

from tfdist import training_checks
from tfdist.throughput import ThroughputMeter

METRICS_FILE = "metrics.jsonl"
# Keys of an evaluation result that are not metric values.
_NOT_METRICS = ("num_examples", "step", "checkpoint")


# The training loss became NaN or infinite (one error for every check).
DivergenceError = training_checks.TrainingDivergedError


def divergence_advice(*, loss_scaled: bool) -> str:
  """What to change after a divergence (`loss_scaled`: fp16 with a loss
  scale, where a too large fixed scale is a cause too)."""
  text = ("Lower --base_learning_rate or lengthen the warmup "
          "(--warmup_steps)")
  if loss_scaled:
    text += ", or lower --loss_scale (or use --loss_scale=dynamic)"
  return text + "."


def metrics_from_sums(sums: Dict[str, np.ndarray], steps: int) -> dict:
  """Mean loss and accuracy from summed step outputs: the summary of a
  runner that returns `loss` (sum of per-step mean losses), `correct` and
  `count` (examples). A `tfdist.train_loop.Trainer` summarizes its own sums
  (`Trainer.summarize`, any Keras metric).

  Args:
    sums: `loss`, `correct`, `count`.
    steps: the steps summed.
  """
  return {"loss": float(sums.get("loss", 0.0)) / max(steps, 1),
          "accuracy": float(sums.get("correct", 0.0)) /
                      max(float(sums.get("count", 0.0)), 1.0)}


def metric_values(result: dict) -> dict:
  """The loss and metric values of a result (no counts, steps, paths)."""
  return {k: v for k, v in result.items() if k not in _NOT_METRICS
          and isinstance(v, (int, float, np.floating, np.integer))}


def format_metrics(values: dict) -> str:
  """`loss L, accuracy A, auc U`: the loss first, then the metrics."""
  keys = ["loss"] if "loss" in values else []
  keys += [k for k in values if k != "loss"]
  return ", ".join(f"{'AUC' if k == 'auc' else k} {values[k]:.4f}"
                   for k in keys)


def format_eval(result: dict) -> str:
  """`loss L, accuracy A[, AUC U, ...] on N examples`."""
  return (format_metrics(metric_values(result)) +
          f" on {result['num_examples']} examples")


def read_metrics(model_dir: str) -> List[dict]:
  """The records of `<model_dir>/metrics.jsonl` (empty when absent)."""
  path = os.path.join(model_dir, METRICS_FILE)
  if not model_dir or not tf.io.gfile.exists(path):
    return []
  out = []
  with tf.io.gfile.GFile(path) as f:
    for line in f:
      line = line.strip()
      if line:
        try:
          out.append(json.loads(line))
        except ValueError:
          logging.warning("Skipping a damaged line of %s: %r", path,
                          line[:80])
  return out


class RunLog:
  """Formats, logs and records training and evaluation metrics.

  Args:
    tensorboard_dir: TensorBoard folder (`train/` and `validation/` go
      below it); None writes no summaries.
    metrics_dir: where `metrics.jsonl` is appended (the chief's
      `--model_dir`); None keeps records in memory only (non-chief workers).
    global_batch_size: examples per step, for examples/sec.
    total_steps: for the `step N/M` prefix.
    process_id: tags this process's records (a resumed run has several).
    eval_subdir: the TensorBoard subfolder of evaluation scalars
      (`validation` for in-loop evaluation, `eval` for the side-car
      evaluator).
    summarize: `summarize(sums, steps) -> {"loss": ..., metric: ...}`, the
      values of summed training steps (`Trainer.summarize`); default
      `metrics_from_sums`.
    loss_explosion_factor: warn once when a log point's mean loss exceeds
      this multiple of the run's first log point's (`--loss_explosion_
      factor`); 0: never.
  """

  def __init__(self, *, tensorboard_dir: Optional[str],
               metrics_dir: Optional[str], global_batch_size: int,
               total_steps: int, process_id: Optional[str] = None,
               eval_subdir: str = "validation",
               summarize: Optional[Callable[[dict, int], dict]] = None,
               loss_explosion_factor: float = 0.0):
    self.total_steps = int(total_steps)
    self.summarize = summarize or metrics_from_sums
    self.loss_explosion_factor = float(loss_explosion_factor)
    self.explosion_warned = False
    self.metrics_dir = metrics_dir
    self.process_id = process_id or (
        f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}")
    self.meter = ThroughputMeter(global_batch_size)
    self.history: List[dict] = []
    self.eval_history: List[dict] = []
    self.earlier: List[dict] = []
    self.started = time.time()
    self._writers = {}
    self._writer_dirs = {}
    if tensorboard_dir:
      self._writer_dirs = {"train": os.path.join(tensorboard_dir, "train"),
                           "eval": os.path.join(tensorboard_dir, eval_subdir)}

  # --- the record file ------------------------------------------------------
  def _append(self, record: dict):
    if not self.metrics_dir:
      return
    line = json.dumps(training_checks.json_safe(record), sort_keys=True,
                      allow_nan=False)
    tf.io.gfile.makedirs(self.metrics_dir)
    with tf.io.gfile.GFile(os.path.join(self.metrics_dir, METRICS_FILE),
                           "a") as f:
      f.write(line + "\n")

  def resume(self, step: int):
    """Reads the earlier processes' records up to `step` (the restored
    step); later ones were lost with the process that wrote them."""
    if self.metrics_dir:
      self.earlier = [r for r in read_metrics(self.metrics_dir)
                      if r.get("step", 0) <= step]
    self.started = time.time()
    self.meter.start(step)

  def all_records(self, kind: str) -> List[dict]:
    """Every record of `kind` (`train` or `eval`), earlier processes first."""
    mine = self.history if kind == "train" else self.eval_history
    return [r for r in self.earlier if r.get("kind") == kind] + mine

  # --- training --------------------------------------------------------------
  def _scalars(self, writer: str, step: int, values: dict):
    if writer not in self._writer_dirs:
      return
    if writer not in self._writers:  # Created on first use.
      self._writers[writer] = tf.summary.create_file_writer(
          self._writer_dirs[writer])
    with self._writers[writer].as_default(step=step):
      for key, value in values.items():
        if value is not None and math.isfinite(value):
          tf.summary.scalar(key, value)

  def log_train(self, step: int, sums: Dict[str, np.ndarray], steps: int, *,
                learning_rate: float,
                loss_scale: Optional[float] = None, skipped_steps: int = 0,
                total_skipped: int = 0) -> dict:
    """Logs the `steps` steps that ended at `step`; returns the record.

    `skipped_steps` of the `steps` made no update (fp16 gradients not
    finite; `total_skipped` in this process so far): logged when any was,
    recorded, and a TensorBoard scalar under fp16.

    Raises:
      DivergenceError: the mean loss or the learning rate is not finite.
    """
    interval = self.meter.record(step)
    now = time.time()
    values = self.summarize(sums, steps)
    record = {"kind": "train", "step": step, "steps": int(steps),
              **values,
              "learning_rate": float(learning_rate),
              "process": self.process_id, "time": now,
              "process_seconds": now - self.started,
              "skipped_steps": int(skipped_steps)}
    if loss_scale is not None:
      record["loss_scale"] = float(loss_scale)
    text = (f"tfdist: step {step}/{self.total_steps}: "
            f"{format_metrics(values)}")
    text += f", learning rate {record['learning_rate']:.6g}"
    if loss_scale is not None:
      text += f", loss scale {loss_scale:g}"
    if skipped_steps or total_skipped:
      text += (f", {skipped_steps} of {steps} steps skipped (fp16 gradients "
               f"not finite; {total_skipped} in this run)")
    if interval is not None:
      record["examples_per_second"] = interval.examples_per_second
      record["step_time_seconds"] = interval.step_time
      text += (f", {interval.examples_per_second:.1f} examples/sec, "
               f"{interval.step_time * 1000:.1f} ms/step")
      if interval.excluded:
        record["excluded_from_throughput"] = True
        text += " (first interval: warm-up, not averaged)"
    self._scalars("train", step, {
        **values, **{k: record[k] for k in (
            "learning_rate", "loss_scale", "examples_per_second",
            "step_time_seconds") if k in record}})
    if loss_scale is not None:
      self._scalars("train", step, {"skipped_steps": float(skipped_steps)})
    self.history.append(record)
    self._append(record)
    logging.info("%s", text)
    if not all(math.isfinite(v) for v in (record["loss"], learning_rate)):
      raise DivergenceError(
          f"Training diverged at step {step}: loss {record['loss']}, "
          f"learning rate {learning_rate}. " +
          divergence_advice(loss_scaled=loss_scale is not None))
    self._check_explosion(record)
    return record

  def _check_explosion(self, record: dict):
    """Warns once when the loss exceeds `loss_explosion_factor` times the
    run's first logged loss (earlier processes' records included)."""
    if not self.loss_explosion_factor or self.explosion_warned:
      return
    first = next((r for r in self.all_records("train")
                  if r.get("loss") is not None and
                  math.isfinite(r["loss"])), None)
    if first is None or first["loss"] <= 0 or first is record:
      return
    if record["loss"] > self.loss_explosion_factor * first["loss"]:
      self.explosion_warned = True
      logging.warning(
          "tfdist: the training loss %.4g at step %d is more than %g times "
          "its early value %.4g (step %d): training is diverging although "
          "the loss is still finite. %s The multiple is "
          "--loss_explosion_factor (0: no warning).", record["loss"],
          record["step"], self.loss_explosion_factor, first["loss"],
          first["step"], divergence_advice(
              loss_scaled=record.get("loss_scale") is not None))

  # --- evaluation -------------------------------------------------------------
  def log_eval(self, step: int, result: dict, *,
               prefix: str = "held-out evaluation") -> dict:
    """Logs one evaluation at `step`; returns the record."""
    record = {"kind": "eval", "step": step, **result,
              "process": self.process_id, "time": time.time()}
    self._scalars("eval", step, metric_values(result))
    self.eval_history.append(record)
    self._append(record)
    logging.info("tfdist: %s at step %d: %s", prefix, step,
                 format_eval(result))
    return record

  def throughput(self) -> dict:
    """Examples/sec and step time over every process of the run.

    Averages over the measured intervals (each process's first, warm-up
    interval excluded), weighted by steps.

    Returns:
      `{"examples_per_second", "step_time_seconds", "measured_steps",
      "processes", "this_process"}`; averages None when nothing was
      measured. `this_process` is the `ThroughputMeter` summary.
    """
    measured = [r for r in self.all_records("train")
                if r.get("step_time_seconds") and r.get("steps")
                and not r.get("excluded_from_throughput")]
    steps = sum(r["steps"] for r in measured)
    seconds = sum(r["steps"] * r["step_time_seconds"] for r in measured)
    batch = self.meter.global_batch_size
    return {
        "examples_per_second": steps * batch / seconds if seconds else None,
        "step_time_seconds": seconds / steps if steps else None,
        "measured_steps": steps,
        "processes": sorted({r.get("process") for r in
                             self.all_records("train")} - {None}),
        "this_process": self.meter.summary(),
    }

  def training_seconds(self) -> dict:
    """Training wall time (seconds) of each process of the run, up to its
    last log point, and their sum: `{"processes": {id: s}, "total": s}`."""
    per_process = {}
    for record in self.all_records("train"):
      if "process_seconds" in record:
        per_process[record["process"]] = record["process_seconds"]
    return {"processes": per_process, "total": sum(per_process.values())}

  def flush(self):
    for writer in self._writers.values():
      writer.flush()
