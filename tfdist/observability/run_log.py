"""What a run says about itself while it trains: one formatter, one sink.

`RunLog` turns the controller's step sums and evaluation results into

* one log line each (absl logging, INFO), in one format for every strategy;
* TensorBoard scalars, each value once, under the tags Keras's own
  `TensorBoard` callback gives them in `model.fit` (`TAGS`; the list:
  docs/reference/tensorboard-tags.md): at log points, in `train/`,
  `batch_loss` and `batch_<metric>` (Keras's tags for values between epoch
  ends) with tfdist's learning rate, loss scale (fp16), examples/sec, step
  time, input wait, peak host memory (RSS) and, on GPUs, peak device
  memory; at evaluations, in `validation/` (the side-car evaluator:
  `eval/`), `evaluation_loss_vs_iterations` and
  `evaluation_<metric>_vs_iterations` (Keras's tags for an evaluation
  against the training step). The epoch values `epoch_loss`,
  `epoch_<metric>` and `epoch_learning_rate` in `train/` are Keras's
  callback's (`TrainingTensorBoard`, which leaves the validation values to
  this log);
* records in `history` / `eval_history` (for the manifest), and
* one JSON line per record appended to `<model_dir>/metrics.jsonl` (chief
  only), which survives a crash: a resumed run reads the records of the
  earlier processes up to the step it resumed from, so its history is
  whole.

A step line reads `tfdist: epoch E/N, step S/T: <values>, ..., ETA 1m12s`
(epochs counted from 1, as Keras's callbacks print them:
`tfdist.observability.progress`); an evaluation at its step ends it.

Where the time goes, per log interval: examples/sec and step time (host
wall clock between log points, `tfdist.observability.throughput`), and the time
the compiled step waited for its input (`input_wait_seconds` per step, and
`input_wait_fraction` of the compiled function's own time; the log line
shows the wait as a share of the whole step's wall time), both measured
inside the compiled function (`tfdist.training.step.train_loop`) and returned
with the step sums: no host synchronization of their own. Under
MultiWorkerMirroredStrategy these are the chief's own; under parameter
servers, every worker's chunks summed. Memory: the process's peak RSS and
each GPU's current and peak bytes (`tfdist.training.plan.memory`).

It also holds the divergence checks of the log points: a non-finite
training loss raises `tfdist.errors.TrainingDivergedError` (a
`FloatingPointError`; the controller checks every chunk of steps as well,
before any checkpoint), and a loss that stays finite but exceeds
`loss_explosion_factor` times its early value (the first log point's) is
named in one warning.
"""

import json
import math
import os
import socket
import time
import uuid
from typing import Callable, Dict, List, Optional

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfdist import errors
from tfdist.observability import memory_use
from tfdist.observability import progress
from tfdist.observability.throughput import ThroughputMeter
from tfdist.runtime import strict_json

METRICS_FILE = "metrics.jsonl"
# Keys of an evaluation result that are not metric values.
_NOT_METRICS = ("num_examples", "step", "checkpoint")
# Step sums that are timings, not metrics (seconds; see
# tfdist.training.step.train_loop).
INPUT_WAIT_KEY = "input_wait_seconds"
EXECUTION_KEY = "execution_seconds"



def divergence_advice(*, loss_scaled: bool,
                      learning_rate: Optional[float] = None) -> str:
  """What to change after a divergence (`loss_scaled`: fp16 with a loss
  scale, where a too large fixed scale is a cause too; `learning_rate`: the
  rate the schedule gave at the divergence, named so the user sees the value
  to lower)."""
  rate = (f" (the learning rate was {learning_rate:g} there, after scaling "
          "to the global batch)"
          if learning_rate is not None and math.isfinite(learning_rate)
          else "")
  text = (f"Lower --base_learning_rate{rate} or lengthen the warmup "
          "(--warmup_steps)")
  if loss_scaled:
    text += ", or lower --loss_scale (or use --loss_scale=dynamic)"
  return text + "."


def metrics_from_sums(sums: Dict[str, np.ndarray], steps: int) -> dict:
  """Mean loss and accuracy from summed step outputs: the summary of a
  runner that returns `loss` (sum of per-step mean losses), `correct` and
  `count` (examples). A `tfdist.training.step.train_loop.Trainer` summarizes its
  own sums (`Trainer.summarize`, any Keras metric).

  Args:
    sums: `loss`, `correct`, `count`.
    steps: the steps summed.
  """
  return {"loss": float(sums.get("loss", 0.0)) / max(steps, 1),
          "accuracy": float(sums.get("correct", 0.0)) /
                      max(float(sums.get("count", 0.0)), 1.0)}


# TensorBoard tag formats of the values this log writes (Keras 3's
# `keras.callbacks.TensorBoard`: `batch_<name>` for values written every
# `update_freq` steps, `evaluation_<name>_vs_iterations` for an evaluation
# against the optimizer's iterations).
TAGS = {"train": "batch_{}", "eval": "evaluation_{}_vs_iterations"}


class TrainingTensorBoard(keras.callbacks.TensorBoard):
  """Keras's `TensorBoard` callback for the epoch values of training only.

  It writes `train/epoch_<name>` (x: the epoch) as in `model.fit`; the
  `val_*` values the controller passes to `on_epoch_end` (for other
  callbacks, e.g. `EarlyStopping`) are left out: `RunLog` writes each
  evaluation once, at its step, as `validation/evaluation_<name>_vs_
  iterations`, including evaluations that end no epoch.
  """

  def on_epoch_end(self, epoch, logs=None):
    super().on_epoch_end(epoch, {k: v for k, v in (logs or {}).items()
                                 if not k.startswith("val_")})

  # The controller's evaluations call the `on_test_*` hooks as `fit`
  # does; `RunLog` writes each evaluation itself.
  def on_test_begin(self, logs=None):
    del logs  # Unused.

  def on_test_end(self, logs=None):
    del logs  # Unused.


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


def _cpu_seconds() -> float:
  times = os.times()
  return times.user + times.system


def _input_wait(sums: Dict[str, np.ndarray], steps: int) -> dict:
  """Per-step input wait and compiled-function seconds from a log
  interval's sums, and the wait's share of the function's time; nothing
  when not measured (NaN: `--deterministic`, see `Trainer.time_steps`)."""
  if INPUT_WAIT_KEY not in sums or not steps:
    return {}
  wait = float(sums[INPUT_WAIT_KEY])
  if not math.isfinite(wait):
    return {}
  out = {"input_wait_seconds": wait / steps}
  execution = float(sums.get(EXECUTION_KEY, 0.0))
  if execution > 0:
    out["execution_seconds"] = execution / steps
    out["input_wait_fraction"] = min(wait / execution, 1.0)
  return out


def _position(step: int, total_steps: int,
              steps_per_epoch: Optional[int]) -> str:
  """`epoch E/N, step S/T` (epochs counted from 1, as Keras's callbacks
  print them), or `step S/T` without `steps_per_epoch`."""
  text = f"step {step}/{total_steps}"
  if not steps_per_epoch:
    return text
  return (f"epoch {progress.epoch_of(step, steps_per_epoch)}/"
          f"{progress.num_epochs(total_steps, steps_per_epoch)}, {text}")


def _train_text(record: dict, values: dict, *, total_steps: int,
                loss_scale: Optional[float], total_skipped: int,
                interval, steps_per_epoch: Optional[int] = None,
                eta: Optional[float] = None) -> str:
  """The log line of a train `record` (`RunLog.log_train`): epoch and step,
  values, learning rate, loss scale, skipped steps, throughput, input wait
  (a share of the whole step, host wall time, when `interval` is known)
  and memory peaks, then the ETA; `interval` is the record's throughput
  interval or None; `eta` the seconds left (None: not shown)."""
  step, steps, micro = record["step"], record["steps"], record["micro_steps"]
  # With gradient accumulation a step (update) is several micro-steps.
  # The counts are this log interval's (`step` counts updates): "the last
  # N updates", so `step 40/40 (40 micro-steps in 20 updates)` is never
  # read as the whole run's.
  micro_text = (f" ({micro} micro-steps in the last {steps} "
                f"update{'' if steps == 1 else 's'})"
                if micro != steps else "")
  text = (f"tfdist: {_position(step, total_steps, steps_per_epoch)}"
          f"{micro_text}: {format_metrics(values)}")
  text += f", learning rate {record['learning_rate']:.6g}"
  if loss_scale is not None:
    text += f", loss scale {loss_scale:g}"
  skipped_steps = record["skipped_steps"]
  if skipped_steps or total_skipped:
    text += (f", {skipped_steps} of {steps} steps skipped (fp16 gradients "
             f"not finite; {total_skipped} in this run)")
  if interval is not None:
    text += (f", {interval.examples_per_second:.1f} examples/sec, "
             f"{interval.step_time * 1000:.1f} ms/step")
  if "input_wait_seconds" in record:
    wait = record["input_wait_seconds"]
    text += f", input wait {wait * 1000:.1f} ms/step"
    if interval is not None and interval.step_time > 0:
      # A share of the whole step (host wall time between log points), not
      # of the compiled function alone: 0.5 ms of a 0.9 ms compiled step in
      # a 18.9 ms step is 3%, not input-bound.
      text += f" ({min(wait / interval.step_time, 1.0):.0%} of the step)"
    elif "input_wait_fraction" in record:
      text += (f" ({record['input_wait_fraction']:.0%} of the compiled "
               "step)")
  text += f", peak RSS {memory_use.format_bytes(record['peak_rss_bytes'])}"
  if "device_memory_peak_bytes" in record:
    text += (", device memory peak "
             f"{memory_use.format_bytes(record['device_memory_peak_bytes'])}")
  if record.get("excluded_from_throughput"):
    text += " (first interval: warm-up, not averaged)"
  if eta is not None:
    text += f", ETA {progress.format_duration(eta)}"
  return text


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
    steps_per_epoch: optimizer updates per epoch: lines then begin
      `epoch E/N, step S/T` (epochs counted from 1, as Keras's callbacks
      print them) and step lines end with an ETA; None: `step S/T`, no
      ETA.

  Step lines and in-loop evaluation lines are logged with
  `tfdist.observability.progress.PROGRESS` as `extra` (a progress bar
  shows them already). A step line followed by an evaluation at the same
  step (`log_train(..., hold=True)`) becomes one line with it.
  """

  def __init__(self, *, tensorboard_dir: Optional[str],
               metrics_dir: Optional[str], global_batch_size: int,
               total_steps: int, process_id: Optional[str] = None,
               eval_subdir: str = "validation",
               summarize: Optional[Callable[[dict, int], dict]] = None,
               loss_explosion_factor: float = 0.0,
               steps_per_epoch: Optional[int] = None):
    self.total_steps = int(total_steps)
    self.steps_per_epoch = int(steps_per_epoch) if steps_per_epoch else None
    # A step line waiting for the evaluation at its step: (step, text).
    self._held: Optional[tuple] = None
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
    self._last_cpu = None
    self._writers = {}
    self._writer_dirs = {}
    if tensorboard_dir:
      self._writer_dirs = {"train": os.path.join(tensorboard_dir, "train"),
                           "eval": os.path.join(tensorboard_dir, eval_subdir)}

  # --- the record file ------------------------------------------------------
  def _append(self, record: dict):
    if not self.metrics_dir:
      return
    line = json.dumps(strict_json.json_safe(record), sort_keys=True,
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
    self._last_cpu = _cpu_seconds()
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
                total_skipped: int = 0, hold: bool = False) -> dict:
    """Logs the `steps` steps that ended at `step`; returns the record.

    With `hold`, an evaluation at `step` follows: the line waits for it
    (`log_eval` logs both as one line); any other log call, `release` or
    `flush` logs it alone first. A diverged step's line is never held.

    `skipped_steps` of the `steps` made no update (fp16 gradients not
    finite; `total_skipped` in this process so far): logged when any was,
    recorded, and a TensorBoard scalar under fp16. `sums["micro_steps"]`
    (micro-batches run; gradient accumulation) is recorded, and logged when
    it differs from `steps`.

    Raises:
      tfdist.errors.TrainingDivergedError: the mean loss or the learning
        rate is not finite.
    """
    interval = self.meter.record(step)
    values = self.summarize(sums, steps)
    record = self._train_record(
        step, sums, steps, values, learning_rate=learning_rate,
        loss_scale=loss_scale, skipped_steps=skipped_steps,
        interval=interval)
    text = _train_text(record, values, total_steps=self.total_steps,
                       loss_scale=loss_scale, total_skipped=total_skipped,
                       interval=interval,
                       steps_per_epoch=self.steps_per_epoch,
                       eta=self._eta(step, interval))
    self._scalars("train", step, {
        **{TAGS["train"].format(k): v for k, v in values.items()},
        **{k: record[k] for k in (
            "learning_rate", "loss_scale", "examples_per_second",
            "step_time_seconds", "input_wait_seconds", "input_wait_fraction",
            "peak_rss_bytes", "device_memory_peak_bytes") if k in record}})
    if loss_scale is not None:
      self._scalars("train", step, {"skipped_steps": float(skipped_steps)})
    self.history.append(record)
    self._append(record)
    self.release()
    # A model's own train_step may log no "loss" (a GAN's d_loss and
    # g_loss): then every value it logs is watched.
    watched = ([record["loss"]] if "loss" in record else
               [v for v in values.values() if isinstance(v, float)])
    finite = all(math.isfinite(v) for v in (*watched, learning_rate))
    if hold and finite:
      self._held = (step, text)
    else:
      logging.info("%s", text, extra=progress.PROGRESS)
    if not finite:
      raise errors.TrainingDivergedError(
          f"Training diverged at step {step}: loss {record.get('loss')}, "
          f"learning rate {learning_rate}. " +
          divergence_advice(loss_scaled=loss_scale is not None))
    self._check_explosion(record)
    return record

  def log_routing(self, step: int, statistics: Dict[str, np.ndarray]):
    """Logs the mixture-of-experts routing of the step `step` (one line)
    and writes it as TensorBoard scalars of the train writer:
    `routing/<layer>/dropped_fraction`, `.../load_balancing_loss`,
    `.../router_z_loss` and `.../tokens_expert_<i>` per expert.

    Args:
      step: the step the statistics are of.
      statistics: `tfdist.parallel.experts.layer.model_statistics`'s
        `{"<layer>/<statistic>": value}` as NumPy: `tokens_per_expert`
        float32 [E] (the slots kept), the others float32 scalars.

    Returns:
      The line logged (None when `statistics` is empty).
    """
    if not statistics:
      return None
    scalars, parts = {}, []
    layers = sorted({key.rsplit("/", 1)[0] for key in statistics})
    for layer in layers:
      tokens = np.asarray(statistics[f"{layer}/tokens_per_expert"]).ravel()
      dropped = float(statistics[f"{layer}/dropped_fraction"])
      balance = float(statistics[f"{layer}/load_balancing_loss"])
      z_loss = float(statistics[f"{layer}/router_z_loss"])
      scalars.update({f"routing/{layer}/dropped_fraction": dropped,
                      f"routing/{layer}/load_balancing_loss": balance,
                      f"routing/{layer}/router_z_loss": z_loss})
      scalars.update({f"routing/{layer}/tokens_expert_{i}": float(t)
                      for i, t in enumerate(tokens)})
      counts = " ".join(f"{int(round(t))}" for t in tokens)
      parts.append(f"{layer}: tokens per expert [{counts}], "
                   f"{dropped:.1%} dropped, load balancing {balance:.4g}, "
                   f"router z {z_loss:.4g}")
    self._scalars("train", step, scalars)
    line = f"routing at step {step}: " + "; ".join(parts)
    logging.info("%s", line, extra=progress.PROGRESS)
    return line

  def _eta(self, step: int, interval) -> Optional[float]:
    """Seconds left after `step`: the steps left at this process's mean
    host time per step (warm-up excluded; the warm-up interval's until
    another is measured), evaluations and checkpoints included; None
    without `steps_per_epoch` or at the end."""
    if not self.steps_per_epoch:
      return None
    per_step = self.meter.summary()["step_time_seconds"]
    if per_step is None and interval is not None:
      per_step = interval.step_time
    return progress.eta_seconds(step=step, total_steps=self.total_steps,
                                seconds_per_step=per_step)

  def release(self):
    """Logs a held step line (`log_train(..., hold=True)`) alone."""
    if self._held is not None:
      _, text = self._held
      self._held = None
      logging.info("%s", text, extra=progress.PROGRESS)

  def _train_record(self, step: int, sums: Dict[str, np.ndarray],
                    steps: int, values: dict, *, learning_rate: float,
                    loss_scale: Optional[float], skipped_steps: int,
                    interval) -> dict:
    """The train record of `log_train` (`metrics.jsonl`'s keys, in order):
    the values, timing, throughput of `interval` (a `ThroughputMeter`
    interval, or None), input wait, CPU seconds per step and memory."""
    now = time.time()
    record = {"kind": "train", "step": step, "steps": int(steps),
              **values,
              "learning_rate": float(learning_rate),
              "process": self.process_id, "time": now,
              "process_seconds": now - self.started,
              "skipped_steps": int(skipped_steps)}
    if loss_scale is not None:
      record["loss_scale"] = float(loss_scale)
    record["micro_steps"] = int(sums.get("micro_steps", steps))
    if interval is not None:
      record["examples_per_second"] = interval.examples_per_second
      record["step_time_seconds"] = interval.step_time
    record.update(_input_wait(sums, steps))
    cpu = _cpu_seconds()
    if self._last_cpu is not None:
      # CPU seconds of this process (every thread) per step: steadier than
      # wall time on a shared machine.
      record["cpu_seconds_per_step"] = (cpu - self._last_cpu) / max(steps, 1)
    self._last_cpu = cpu
    record.update(self._memory())
    if interval is not None and interval.excluded:
      record["excluded_from_throughput"] = True
    return record

  def _check_explosion(self, record: dict):
    """Warns once when the loss exceeds `loss_explosion_factor` times the
    run's first logged loss (earlier processes' records included)."""
    if (not self.loss_explosion_factor or self.explosion_warned or
        "loss" not in record):
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
              loss_scaled=record.get("loss_scale") is not None,
              learning_rate=record.get("learning_rate")))

  # --- evaluation -------------------------------------------------------------
  def log_eval(self, step: int, result: dict, *,
               prefix: str = "held-out evaluation") -> dict:
    """Logs one evaluation at `step`; returns the record.

    The line is `tfdist: [epoch E/N, ]<prefix> at step S: <values>`, or
    ends the step line held for `step` (`log_train(..., hold=True)`) after
    a `; `. With `steps_per_epoch` (the training loop's evaluations) it is
    a `progress.PROGRESS` line.
    """
    record = {"kind": "eval", "step": step, **result,
              "process": self.process_id, "time": time.time(),
              **self._memory()}
    self._scalars("eval", step, {TAGS["eval"].format(k): v for k, v in
                                 metric_values(result).items()})
    self.eval_history.append(record)
    self._append(record)
    text = f"{prefix} at step {step}: {format_eval(result)}"
    if self._held is not None and self._held[0] == step:
      held, self._held = self._held[1], None
      logging.info("%s; %s", held, text, extra=progress.PROGRESS)
    else:
      self.release()
      where = (f"epoch {progress.epoch_of(step, self.steps_per_epoch)}/"
               f"{progress.num_epochs(self.total_steps, self.steps_per_epoch)}"
               ", " if self.steps_per_epoch else "")
      logging.info("tfdist: %s%s", where, text,
                   extra=progress.PROGRESS if self.steps_per_epoch else None)
    return record

  def _memory(self) -> dict:
    out = {"peak_rss_bytes": memory_use.peak_rss_bytes()}
    devices = memory_use.device_memory()
    if devices:
      out["device_memory"] = devices
      out["device_memory_peak_bytes"] = memory_use.peak_device_bytes(devices)
    return out

  def memory(self) -> dict:
    """Peak memory over every process of the run (bytes).

    Returns:
      `{"peak_rss_bytes": the largest peak RSS of any process,
      "device_memory_peak_bytes": the largest GPU peak or None,
      "device_memory": this process's per-GPU current and peak bytes,
      "host_memory_bytes": this host's physical memory}`.
    """
    now = self._memory()
    records = self.all_records("train") + self.all_records("eval")
    peaks = [r["device_memory_peak_bytes"] for r in records
             if r.get("device_memory_peak_bytes") is not None]
    if now.get("device_memory_peak_bytes") is not None:
      peaks.append(now["device_memory_peak_bytes"])
    return {
        "peak_rss_bytes": max([now["peak_rss_bytes"]] +
                              [r["peak_rss_bytes"] for r in records
                               if r.get("peak_rss_bytes")]),
        "device_memory_peak_bytes": max(peaks) if peaks else None,
        "device_memory": now.get("device_memory", {}),
        "host_memory_bytes": memory_use.host_memory_bytes(),
    }

  def throughput(self) -> dict:
    """Examples/sec, step time and input wait over every process of the run.

    Averages over the measured intervals (each process's first, warm-up
    interval excluded), weighted by steps.

    Returns:
      `{"examples_per_second", "step_time_seconds", "input_wait_seconds"
      (per step), "input_wait_fraction" (of the compiled step's time),
      "cpu_seconds_per_step" (this host process, every thread),
      "measured_steps", "processes", "this_process"}`; averages None when
      nothing was measured. `this_process` is the `ThroughputMeter`
      summary.
    """
    measured = [r for r in self.all_records("train")
                if r.get("step_time_seconds") and r.get("steps")
                and not r.get("excluded_from_throughput")]
    steps = sum(r["steps"] for r in measured)
    seconds = sum(r["steps"] * r["step_time_seconds"] for r in measured)
    batch = self.meter.global_batch_size
    timed = [r for r in measured if r.get("execution_seconds")]
    wait = sum(r["steps"] * r["input_wait_seconds"] for r in timed)
    execution = sum(r["steps"] * r["execution_seconds"] for r in timed)
    timed_steps = sum(r["steps"] for r in timed)
    cpu = [r for r in measured if r.get("cpu_seconds_per_step") is not None]
    cpu_steps = sum(r["steps"] for r in cpu)
    return {
        "cpu_seconds_per_step": (sum(r["steps"] * r["cpu_seconds_per_step"]
                                     for r in cpu) / cpu_steps
                                 if cpu_steps else None),
        "examples_per_second": steps * batch / seconds if seconds else None,
        "step_time_seconds": seconds / steps if steps else None,
        "input_wait_seconds": wait / timed_steps if timed_steps else None,
        "input_wait_fraction": wait / execution if execution else None,
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
    """Logs a held step line; flushes the TensorBoard writers."""
    self.release()
    for writer in self._writers.values():
      writer.flush()
