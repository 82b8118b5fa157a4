"""The run manifest: `run_manifest.json`, a record of what ran.

Written atomically (to a temporary file, then renamed) so a reader never sees
half a manifest, and as strict JSON: a non-finite number (an infinite loss,
a NaN AUC) is written as null, never as `Infinity` or `NaN`, which strict
JSON parsers reject.
"""

import hashlib
import json
import math
import os
import platform
import subprocess
import time
import uuid
from typing import Iterable, List, Optional

import numpy as np
import tensorflow as tf

from tfdist import allocator
from tfdist import environment
from tfdist import strict_json

MANIFEST_FILE = "run_manifest.json"


def file_fingerprints(paths: Iterable[str]) -> List[dict]:
  """Size (bytes) and SHA-256 of each file, read through `tf.io.gfile`."""
  out = []
  for path in paths:
    digest = hashlib.sha256()
    with tf.io.gfile.GFile(path, "rb") as f:
      while True:
        chunk = f.read(1 << 20)
        if not chunk:
          break
        digest.update(chunk)
    out.append({"path": path, "bytes": tf.io.gfile.stat(path).length,
                "sha256": digest.hexdigest()})
  return out


def git_commit(start_dir: Optional[str] = None) -> Optional[str]:
  """The commit of the git checkout holding tfdist, or None outside git."""
  start_dir = start_dir or os.path.dirname(os.path.abspath(__file__))
  try:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=start_dir,
                         capture_output=True, text=True, timeout=10)
  except (OSError, subprocess.TimeoutExpired):
    return None
  return out.stdout.strip() if out.returncode == 0 else None


def software_versions() -> dict:
  import keras  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top
  return {"tfdist": tfdist.__version__, "tensorflow": tf.__version__,
          "keras": keras.__version__, "python": platform.python_version()}


def run_header(config) -> dict:
  """The fields every manifest starts with: when, flags, config, versions,
  git commit, and the malloc settings in force (`allocator`: they change
  resident memory, see `tfdist.allocator`). `config` is a
  `tfdist.config.TrainConfig`."""
  return {"created": utc_now(), "flags": dict(config.flags_snapshot),
          "config": config.to_dict(), "versions": software_versions(),
          "git_commit": git_commit(),
          "allocator": allocator.state().to_dict()}


def write_manifest(directory: str, manifest: dict) -> str:
  """Writes `manifest` as `directory/run_manifest.json`, atomically and as
  strict JSON (non-finite floats become null: `tfdist.strict_json.json_safe`).

  Returns:
    The manifest's path.
  """
  tf.io.gfile.makedirs(directory)
  path = os.path.join(directory, MANIFEST_FILE)
  tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
  text = json.dumps(strict_json.json_safe(manifest), indent=2,
                    sort_keys=True, default=str, allow_nan=False)
  with tf.io.gfile.GFile(tmp, "w") as f:
    f.write(text)
  tf.io.gfile.rename(tmp, path, overwrite=True)
  return path


def read_manifest(directory: str) -> dict:
  with tf.io.gfile.GFile(os.path.join(directory, MANIFEST_FILE)) as f:
    return json.load(f)


def utc_now() -> str:
  return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def build_manifest(*, config, decision, plan, cluster, choice, num_workers,
                   is_chief: bool, devices, dtype_policy: str,
                   loss_scale: Optional[float], optimizer_iterations: int,
                   result, run_log, artifacts: dict, seconds: dict,
                   environment_applied=(), trial_fields=(),
                   strategy_details=None,
                   objectives=None, model_name: Optional[str] = None,
                   model_memory: Optional[dict] = None) -> dict:
  """The run manifest: the same keys for every strategy.

  Args:
    config: the run's `TrainConfig` (no `auto` left).
    decision: the `tfdist.auto_select.Decision`.
    plan: the `tfdist.run_plan.RunPlan`.
    cluster: the `tfdist.cluster.ClusterInfo`.
    choice: the `tfdist.strategy.StrategyChoice`.
    num_workers: hosts training.
    is_chief: this process writes the artifacts.
    devices: `tfdist.devices.describe_devices()`.
    dtype_policy: the Keras dtype policy's name.
    loss_scale: the final loss scale (fp16), or None.
    optimizer_iterations: the optimizer's update count.
    result: the `tfdist.controller.ControllerResult`.
    run_log: the `tfdist.run_log.RunLog` (history of every process).
    artifacts: paths written (`checkpoint`, `checkpoint_dir`,
      `saved_model`, `tensorboard`, `metrics`, ...).
    seconds: `{"total", "training"}` of this process (seconds), and
      `training_all_processes` (`RunLog.training_seconds()`).
    environment_applied: `(field, variable)` pairs filled from the
      environment (`tfdist.environment.apply_environment`).
    trial_fields: the folder fields given the hyperparameter-tuning
      trial's subfolder (`tfdist.environment.trial_folders`).
    strategy_details: a dict of strategy-specific facts (parameter-server
      placement, ...), written under the strategy's name (e.g.
      `manifest["parameter_server"]`); None: empty.
    objectives: the run's `tfdist.objectives.Objectives` (loss and metric
      names, where they came from); each metric `m` adds `eval_m` and
      `train_m` to `final_metrics`.
    model_name: the model trained (a registered name or `module:function`;
      default: `config.model`).
    model_memory: `tfdist.memory.ModelMemory.to_dict()` of the model, or
      None.

  Returns:
    A JSON-ready dict: the same keys for every strategy, plus the section
    named after the strategy.
  """
  final_eval = result.final_eval or {}
  history = run_log.all_records("train")
  last = history[-1] if history else {}
  metric_names = tuple(objectives.metric_names) if objectives else ()
  final_metrics = {
      "eval_loss": final_eval.get("loss"),
      "eval_accuracy": final_eval.get("accuracy"),
      "eval_auc": final_eval.get("auc"),
      "eval_examples": final_eval.get("num_examples"),
      "train_loss": last.get("loss"),
      "train_accuracy": last.get("accuracy"),
      "train_auc": last.get("auc"),
  }
  for name in metric_names:
    final_metrics[f"eval_{name}"] = final_eval.get(name)
    final_metrics[f"train_{name}"] = last.get(name)
  return {
      **run_header(config),
      "environment": [{"field": f, "variable": v}
                      for f, v in environment_applied],
      # Vertex AI hyperparameter tuning: this run's trial (None outside a
      # tuning job) and the flag-given folders nested in its subfolder.
      "trial": ({"id": cluster.trial,
                 "subfolder": environment.trial_subfolder(cluster.trial),
                 "fields": list(trial_fields)} if cluster.trial else None),
      "devices": devices,
      "strategy": choice.name,
      "strategy_reason": decision.strategy_reason,
      "dtype": decision.dtype,
      "dtype_reason": decision.dtype_reason,
      "replica_devices": list(choice.devices),
      "num_replicas_in_sync": plan.batch.num_replicas_in_sync,
      "num_workers": num_workers,
      "asynchronous": plan.asynchronous,
      "cluster": {"source": cluster.source, "task_type": cluster.task_type,
                  "task_index": cluster.task_index, "is_chief": is_chief,
                  "trial": cluster.trial, "jobs": cluster.cluster_dict()},
      "per_replica_batch_size": plan.batch.per_replica_batch_size,
      "global_batch_size": plan.batch.global_batch_size,
      "gradient_accumulation_steps": plan.batch.gradient_accumulation_steps,
      "eval_batch_size": plan.eval_batch_size,
      "steps_per_epoch": plan.batch.steps_per_epoch,
      "train_steps": plan.total_steps,
      "final_step": result.step,
      "stopped_early": result.stopped_early,
      "skipped_steps": result.skipped_steps,
      "optimizer_iterations": optimizer_iterations,
      # Micro-batches this process ran (gradient accumulation: K per step).
      "micro_steps": result.micro_steps,
      "restored_from": result.restored_from,
      "base_learning_rate": config.base_learning_rate,
      "base_batch_size": config.base_batch_size,
      "lr_scaling": config.lr_scaling,
      "peak_learning_rate": plan.lr.peak_learning_rate,
      "warmup_steps": plan.lr.warmup_steps,
      "lr_schedule": _serialize_schedule(plan.lr.schedule),
      "dtype_policy": dtype_policy,
      "loss_scale": loss_scale,
      "sync_batch_norm": plan.sync_batch_norm,
      "sync_batch_norm_reason": plan.sync_batch_norm_reason,
      "model": model_name or config.model,
      "objectives": ({"loss": objectives.loss.name,
                      "metrics": list(metric_names),
                      "source": objectives.source} if objectives else None),
      "data": {
          "dataset": config.dataset,
          "feature_spec": config.feature_spec or None,
          "num_train_examples": plan.num_train_examples,
          "input_sharding": {
              "mode": plan.sharding.mode, "reason": plan.sharding.reason,
              "records_per_worker": list(
                  plan.sharding.records_per_pipeline or ()),
              "examples_per_epoch_per_worker":
                  plan.sharding.examples_per_epoch},
          "train_files": file_fingerprints(plan.train_files),
          "eval_files": file_fingerprints(plan.eval_files),
      },
      "throughput": run_log.throughput(),
      # Peak host RSS and GPU memory of the run's processes, and the bytes
      # of the model's parameters, gradients and optimizer state.
      "memory": {**run_log.memory(), "model": model_memory},
      "history": history,
      "eval_history": run_log.all_records("eval"),
      "final_metrics": final_metrics,
      "artifacts": artifacts,
      "seconds": seconds,
      # The strategy-specific section, under the strategy's name.
      choice.name: strategy_details or {},
  }


def _serialize_schedule(schedule):
  import keras  # pylint: disable=g-import-not-at-top
  return keras.saving.serialize_keras_object(schedule)
