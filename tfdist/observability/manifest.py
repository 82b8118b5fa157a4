"""The run manifest: `run_manifest.json`, a record of what ran.

Written atomically (to a temporary file, then renamed) so a reader never sees
half a manifest, and as strict JSON: a non-finite number (an infinite loss,
a NaN AUC) is written as null, never as `Infinity` or `NaN`, which strict
JSON parsers reject.
"""

import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import time
import uuid
from typing import Any, Iterable, List, Optional, Tuple

import keras
import tensorflow as tf

import tfdist
from tfdist.distribute import environment
from tfdist.runtime import allocator
from tfdist.runtime import private_api
from tfdist.runtime import strict_json

MANIFEST_FILE = "run_manifest.json"


@dataclasses.dataclass(frozen=True)
class ManifestOptions:
  """What the manifest records of the run's configuration.

  Built from the run's `TrainConfig` by `ManifestOptions.of`.

  Attributes:
    flags: the flags as given, `(name, value)` pairs
      (`TrainConfig.flags_snapshot`).
    config: the whole configuration as a JSON-ready dict
      (`TrainConfig.to_dict()`).
    base_learning_rate: the learning rate at `base_batch_size`.
    base_batch_size: the global batch the base learning rate is for.
    lr_scaling: the learning-rate scaling rule's name.
    model: `--model` (a registered name or `module:function`).
    dataset: `--dataset`.
    feature_spec: `--feature_spec` ('' when none).
    all_reduce_dtype: `--all_reduce_dtype`, the dtype gradients travel in
      between replicas.
  """
  flags: Tuple[Tuple[str, str], ...]
  config: dict
  base_learning_rate: float
  base_batch_size: int
  lr_scaling: str
  model: str
  dataset: str
  feature_spec: str = ""
  all_reduce_dtype: str = "float32"

  @classmethod
  def of(cls, config, decisions=None) -> "ManifestOptions":
    """What the manifest records of the whole run: its `config`
    (`tfdist.config.TrainConfig`, as `recorded_config` gives it with the
    run's `decisions`) and the flags as given."""
    lr = config.optimization.learning_rate
    return cls(
        flags=tuple(config.flags_snapshot),
        config=recorded_config(config, decisions),
        base_learning_rate=lr.base_learning_rate,
        base_batch_size=lr.base_batch_size, lr_scaling=lr.lr_scaling,
        model=config.task.model, dataset=config.task.data.dataset,
        feature_spec=config.task.feature_spec,
        all_reduce_dtype=config.strategy.all_reduce_dtype)


def recorded_config(config, decisions=None) -> dict:
  """The settings a run's records list (the manifest's `config`, the run
  record beside the checkpoints,
  `tfdist.training.state.checkpointing.run_record`): `config.to_dict()`
  (`tfdist.config.TrainConfig`: every setting by flag name, JSON-serializable)
  with nothing left to resolve: the decided fields as `decisions`
  (`tfdist.distribute.decisions.Decisions.field_values`) set them (None: as
  `config` has them), and `zero_stage` the stage that runs
  (`TrainConfig.zero_stage_resolved`: from the switches when `--zero_stage` was
  not given; the manifest's `flags` say which were)."""
  recorded = config.to_dict()
  if decisions is not None:
    recorded.update(json.loads(json.dumps(decisions.field_values(),
                                          default=str)))
  recorded["zero_stage"] = config.zero_stage_resolved
  return recorded


@dataclasses.dataclass(frozen=True)
class WhereItRan:
  """Where the run ran: its cluster, devices and environment.

  Attributes:
    cluster: the `tfdist.distribute.cluster.ClusterInfo`.
    choice: the `tfdist.distribute.strategy.StrategyChoice`.
    num_workers: hosts training.
    is_chief: this process writes the artifacts.
    devices: `tfdist.distribute.devices.describe_devices()`.
    environment_applied: `(field, variable)` pairs filled from the
      environment (`tfdist.distribute.environment.apply_environment`).
    trial_fields: the folder fields given the hyperparameter-tuning
      trial's subfolder (`tfdist.distribute.environment.trial_folders`).
  """
  cluster: Any
  choice: Any
  num_workers: int
  is_chief: bool
  devices: Any
  environment_applied: Tuple = ()
  trial_fields: Tuple = ()


@dataclasses.dataclass(frozen=True)
class WhatRan:
  """What ran: the decisions, the plan, the model and the training result.

  Attributes:
    decision: the `tfdist.distribute.auto_select.Decision`.
    plan: the `tfdist.training.plan.run_plan.RunPlan`.
    dtype_policy: the Keras dtype policy's name.
    loss_scale: the final loss scale (fp16), or None.
    optimizer_iterations: the optimizer's update count.
    result: the `tfdist.training.controller.ControllerResult`.
    run_log: the `tfdist.observability.run_log.RunLog` (history of every
      process).
    objectives: the run's `tfdist.training.step.objectives.Objectives` (loss and
      metric names, where they came from); each metric `m` adds `eval_m` and
      `train_m` to `final_metrics`; None: none recorded.
    model_name: the model trained (a registered name or `module:function`;
      None: `ManifestOptions.model`).
    model_memory: `tfdist.training.plan.memory.ModelMemory.to_dict()` of the
      model, or None.
    strategy_details: a dict of strategy-specific facts (parameter-server
      placement, ...), written under the strategy's name (e.g.
      `manifest["parameter_server"]`); None: empty.
    batch_norm: the model has batch normalization (`has_batch_norm`); False
      leaves `sync_batch_norm` and its reason out of the manifest.
  """
  decision: Any
  plan: Any
  dtype_policy: str
  loss_scale: Optional[float]
  optimizer_iterations: int
  result: Any
  run_log: Any
  objectives: Any = None
  model_name: Optional[str] = None
  model_memory: Optional[dict] = None
  strategy_details: Optional[dict] = None
  batch_norm: bool = True


def has_batch_norm(model) -> bool:
  """Whether `model` (a `keras.Model`) holds a batch-normalization layer at
  any depth: the manifest's `sync_batch_norm` facts apply only then."""
  layers = private_api.flatten_layers(model, include_self=False)
  return any(isinstance(layer, keras.layers.BatchNormalization)
             for layer in layers)


@dataclasses.dataclass(frozen=True)
class WhatItWrote:
  """What the run wrote, and how long it took.

  Attributes:
    artifacts: paths written (`checkpoint`, `checkpoint_dir`,
      `saved_model`, `tensorboard`, `metrics`, ...).
    seconds: `{"total", "training"}` of this process (seconds), and
      `training_all_processes` (`RunLog.training_seconds()`).
  """
  artifacts: dict
  seconds: dict


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
  """The versions of tfdist, TensorFlow, Keras and Python (strings)."""
  return {"tfdist": tfdist.__version__, "tensorflow": tf.__version__,
          "keras": keras.__version__, "python": platform.python_version()}


def run_header(options: ManifestOptions) -> dict:
  """The fields every manifest starts with: when, flags, config, versions,
  git commit, and the malloc settings in force (`allocator`: they change
  resident memory, see `tfdist.runtime.allocator`)."""
  return {"created": utc_now(), "flags": dict(options.flags),
          "config": options.config, "versions": software_versions(),
          "git_commit": git_commit(),
          "allocator": allocator.state().to_dict()}


def write_manifest(directory: str, manifest: dict) -> str:
  """Writes `manifest` as `directory/run_manifest.json`, atomically and as
  strict JSON (non-finite floats become null:
  `tfdist.runtime.strict_json.json_safe`).

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
  """The manifest `directory/run_manifest.json` holds, as a dict.

  Raises:
    tf.errors.NotFoundError: there is no manifest in `directory`.
  """
  with tf.io.gfile.GFile(os.path.join(directory, MANIFEST_FILE)) as f:
    return json.load(f)


def utc_now() -> str:
  """The current UTC time to the second, e.g. `2026-12-01T13:05:00Z`."""
  return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def build_manifest(options: ManifestOptions, *, ran: WhatRan,
                   where: WhereItRan, wrote: WhatItWrote) -> dict:
  """The run manifest: the same keys for every strategy.

  Args:
    options: the run's configuration as the manifest records it (no `auto`
      left; `ManifestOptions.of`).
    ran: what ran (decisions, plan, result, logs, model).
    where: where it ran (cluster, strategy, devices, environment).
    wrote: what it wrote, and the seconds it took.

  Returns:
    A JSON-ready dict: the same keys for every strategy, plus the section
    named after the strategy.
  """
  return {
      **run_header(options),
      **_placement_section(where, ran.decision),
      **_batch_section(ran.plan),
      **_result_section(ran.result, ran.optimizer_iterations),
      **_learning_rate_section(options, ran.plan),
      **_model_section(options, ran),
      "data": _data_section(options, ran.plan),
      "throughput": ran.run_log.throughput(),
      # Peak host RSS and GPU memory of the run's processes, and the bytes
      # of the model's parameters, gradients and optimizer state.
      "memory": {**ran.run_log.memory(), "model": ran.model_memory},
      **_history_section(ran),
      "artifacts": wrote.artifacts,
      "seconds": wrote.seconds,
      # The strategy-specific section, under the strategy's name.
      where.choice.name: ran.strategy_details or {},
  }


def _placement_section(where: WhereItRan, decision) -> dict:
  """Environment, trial, devices, strategy, dtype decision and cluster."""
  cluster = where.cluster
  return {
      "environment": [{"field": f, "variable": v}
                      for f, v in where.environment_applied],
      # Vertex AI hyperparameter tuning: this run's trial (None outside a
      # tuning job) and the flag-given folders nested in its subfolder.
      "trial": ({"id": cluster.trial,
                 "subfolder": environment.trial_subfolder(cluster.trial),
                 "fields": list(where.trial_fields)} if cluster.trial
                else None),
      "devices": where.devices,
      "strategy": where.choice.name,
      "strategy_reason": decision.strategy_reason,
      "dtype": decision.dtype,
      "dtype_reason": decision.dtype_reason,
      "replica_devices": list(where.choice.devices),
      "num_workers": where.num_workers,
      "cluster": {"source": cluster.source, "task_type": cluster.task_type,
                  "task_index": cluster.task_index,
                  "is_chief": where.is_chief,
                  "trial": cluster.trial, "jobs": cluster.cluster_dict()},
  }


def _batch_section(plan) -> dict:
  """Replicas, batch sizes and step counts of the plan."""
  return {
      "num_replicas_in_sync": plan.batch.num_replicas_in_sync,
      "asynchronous": plan.asynchronous,
      "per_replica_batch_size": plan.batch.per_replica_batch_size,
      "global_batch_size": plan.batch.global_batch_size,
      "gradient_accumulation_steps": plan.batch.gradient_accumulation_steps,
      "eval_batch_size": plan.eval_batch_size,
      "steps_per_epoch": plan.batch.steps_per_epoch,
      "train_steps": plan.total_steps,
      # Pipeline parallelism: stages, micro-batches, schedule, cuts.
      **({"pipeline": plan.pipeline.to_dict()}
         if getattr(plan, "pipeline", None) else {}),
  }


def _result_section(result, optimizer_iterations: int) -> dict:
  """Where training ended, and what it skipped or restored."""
  return {
      "final_step": result.step,
      "stopped_early": result.stopped_early,
      "skipped_steps": result.skipped_steps,
      "optimizer_iterations": optimizer_iterations,
      # Micro-batches this process ran (gradient accumulation: K per step).
      "micro_steps": result.micro_steps,
      "restored_from": result.restored_from,
  }


def _learning_rate_section(options: ManifestOptions, plan) -> dict:
  """The base and scaled learning rate, warmup and the schedule."""
  return {
      "base_learning_rate": options.base_learning_rate,
      "base_batch_size": options.base_batch_size,
      "lr_scaling": options.lr_scaling,
      "peak_learning_rate": plan.lr.peak_learning_rate,
      "warmup_steps": plan.lr.warmup_steps,
      "lr_schedule": keras.saving.serialize_keras_object(plan.lr.schedule),
  }


def _model_section(options: ManifestOptions, ran: WhatRan) -> dict:
  """Precision, batch norm, the model's name and its objectives."""
  objectives = ran.objectives
  return {
      "dtype_policy": ran.dtype_policy,
      "loss_scale": ran.loss_scale,
      "all_reduce_dtype": options.all_reduce_dtype,
      **({"sync_batch_norm": ran.plan.sync_batch_norm,
          "sync_batch_norm_reason": ran.plan.sync_batch_norm_reason}
         if ran.batch_norm else {}),
      "model": ran.model_name or options.model,
      "objectives": ({"loss": objectives.loss.name,
                      "metrics": list(_metric_names(objectives)),
                      "source": objectives.source} if objectives else None),
  }


def _data_section(options: ManifestOptions, plan) -> dict:
  """The data set, its sharding, and fingerprints of its files."""
  sharding = plan.sharding
  return {
      "dataset": options.dataset,
      "feature_spec": options.feature_spec or None,
      "num_train_examples": plan.num_train_examples,
      "input_sharding": {
          "mode": sharding.mode, "reason": sharding.reason,
          "records_per_worker": list(sharding.records_per_pipeline or ()),
          "examples_per_epoch_per_worker": sharding.examples_per_epoch},
      "train_files": file_fingerprints(plan.train_files),
      "eval_files": file_fingerprints(plan.eval_files),
  }


def _metric_names(objectives) -> Tuple[str, ...]:
  return tuple(objectives.metric_names) if objectives else ()


def _history_section(ran: WhatRan) -> dict:
  """The train and eval history, and the final metrics."""
  history = ran.run_log.all_records("train")
  return {
      "history": history,
      "eval_history": ran.run_log.all_records("eval"),
      "final_metrics": final_metrics(
          ran.result.final_eval or {}, history[-1] if history else {},
          _metric_names(ran.objectives)),
  }


def final_metrics(final_eval: dict, last_train: dict,
                  metric_names: Iterable[str] = ()) -> dict:
  """The manifest's `final_metrics`: the last eval and train values.

  Args:
    final_eval: the final evaluation's values (`loss`, `accuracy`, `auc`,
      `num_examples`, each metric's name); `{}` when none ran.
    last_train: the last train log record; `{}` when none.
    metric_names: the objectives' metric names; each `m` adds `eval_m` and
      `train_m`.

  Returns:
    Only what applies to the run: `train_loss` (when the last record has
    a `loss`); `eval_loss` (likewise) and `eval_examples` when an
    evaluation ran; `train_m` and (with an
    evaluation) `eval_m` for each metric `m` of `metric_names` and for
    `accuracy` and `auc` where their record holds them (a value missing
    from its record is None). A model without AUC has no `eval_auc`.
  """
  names = [*metric_names, *(m for m in ("accuracy", "auc")
                            if m not in metric_names and
                            (m in final_eval or m in last_train))]
  # A model's own train_step may log no `loss` (a GAN's d_loss, g_loss).
  out = {"train_loss": last_train["loss"]} if "loss" in last_train else {}
  if final_eval:
    if "loss" in final_eval:
      out["eval_loss"] = final_eval["loss"]
    out["eval_examples"] = final_eval.get("num_examples")
  for name in names:
    if final_eval:
      out[f"eval_{name}"] = final_eval.get(name)
    out[f"train_{name}"] = last_train.get(name)
  return out
