"""The one place where a `TrainConfig` becomes each part's own options.

The run assembly (`tfdist.experiment`) calls these converters; every module
below it takes the small frozen options object (or plain arguments) it
reads, never the whole `TrainConfig` (as Orbit's `Controller` takes its
`ControllerOptions`). Each converter is a pure function of the config.
"""

import dataclasses
import json
from typing import List, Tuple

from tfdist import config as config_lib
from tfdist.data import filesystems
from tfdist.data import input_pipeline
from tfdist.distribute import auto_select
from tfdist.distribute import decisions as decisions_lib
from tfdist.distribute import strategy as strategy_lib
from tfdist.distribute import tpu as tpu_lib
from tfdist.observability import manifest
from tfdist.parallel import pipeline_options as pipeline_options_lib
from tfdist.training import preflight
from tfdist.training import assembly
from tfdist.training import run_plan
from tfdist.training import task as task_lib

TrainConfig = config_lib.TrainConfig

# --- cluster and strategy ---


def tpu_options(config: TrainConfig) -> tpu_lib.TpuOptions:
  """The `--tpu*` flags of `config`: its TPU section."""
  return config.strategy.tpu


def select_options(config: TrainConfig) -> auto_select.SelectOptions:
  """What `tfdist.distribute.auto_select.resolve` reads from `config` (flags as given)."""
  return auto_select.SelectOptions(
      distribution_strategy=config.distribution_strategy, dtype=config.dtype,
      dtype_defaulted="dtype" in config.defaulted, num_gpus=config.num_gpus,
      num_cpu_devices=config.num_cpu_devices, tpu=tpu_options(config),
      pipeline_stages=config.pipeline_stages,
      tensor_parallel=config.tensor_parallel)


def strategy_options(config: TrainConfig, decisions=None
                     ) -> strategy_lib.StrategyOptions:
  """What `tfdist.distribute.strategy.make_strategy` reads: the strategy
  flags of `config`, with the strategy and TPU `decisions`
  (`tfdist.distribute.decisions.Decisions`; None: `config`'s own, which
  must not say `auto`) made."""
  decisions = decisions_lib.resolved(config, decisions)
  return strategy_lib.StrategyOptions(
      kind=decisions.strategy, num_gpus=config.num_gpus,
      num_cpu_devices=config.num_cpu_devices,
      all_reduce_alg=config.all_reduce_alg,
      reduction_server=bool(config.reduction_server),
      bytes_per_pack=config.bytes_per_pack,
      collective_timeout_seconds=config.collective_timeout_seconds,
      cluster_start_timeout_seconds=config.cluster_start_timeout_seconds,
      # The TPU and parameter-server sections are those parts' options;
      # the TPU's address is the decided one.
      tpu=dataclasses.replace(config.strategy.tpu, tpu=decisions.tpu),
      partitioner=config.strategy.parameter_servers)


def data_options(config: TrainConfig, decisions=None) -> run_plan.DataOptions:
  """The data section of `config`, with the files `decisions`
  (`tfdist.distribute.decisions.Decisions`; None: `config`'s own) chose."""
  if decisions is None:
    return config.task.data
  return dataclasses.replace(
      config.task.data, train_files=decisions.train_files,
      eval_files=decisions.eval_files, data_dir=decisions.data_dir)


def pipeline_options(config: TrainConfig
                     ) -> pipeline_options_lib.PipelineOptions:
  """The pipeline flags of `config` (`--num_microbatches` defaulted to
  `--pipeline_stages`)."""
  return pipeline_options_lib.PipelineOptions(
      num_stages=config.pipeline_stages,
      num_microbatches=pipeline_options_lib.resolved_microbatches(
          config.pipeline_stages, config.num_microbatches),
      schedule=config.pipeline_schedule, cuts=tuple(config.pipeline_cuts),
      microbatches_defaulted=config.num_microbatches is None)


def plan_options(config: TrainConfig, decisions=None) -> run_plan.PlanOptions:
  """What `tfdist.training.run_plan.make_run_plan` reads from `config` and
  the run's `decisions` (its files)."""
  return run_plan.PlanOptions(
      data=data_options(config, decisions),
      lr=config.optimization.learning_rate,
      need_eval=config.mode != "train", batch_size=config.batch_size,
      per_replica_batch_size=config.per_replica_batch_size,
      gradient_accumulation_steps=config.gradient_accumulation_steps,
      train_steps=config.train_steps, train_epochs=config.train_epochs,
      sync_batch_norm=config.sync_batch_norm, enable_xla=config.enable_xla,
      model=config.model,
      activation_recomputation=config.activation_recomputation,
      zero_stage=config.zero_stage_resolved,
      deterministic=config.deterministic,
      all_reduce_dtype=config.all_reduce_dtype,
      pipeline=pipeline_options(config))

# --- inputs and data ---


def train_input_options(config: TrainConfig, spec, *, files, global_batch_size,
                        file_record_counts=None,
                        gradient_accumulation_steps: int = 1,
                        resumable: bool = False
                        ) -> input_pipeline.PipelineOptions:
  """The training split's `PipelineOptions` under a synchronous strategy.

  Args:
    config: the run's config (`shuffle_buffer_size`, `cache_dataset`,
      `seed`, `deterministic`).
    spec: the data set's `DatasetSpec`.
    files: the training TFRecord paths (ignored for a dataset function).
    global_batch_size: examples per update over all replicas.
    file_record_counts: records per file, or None.
    gradient_accumulation_steps: micro-batches per update.
    resumable: the input position is checkpointed, which needs a
      reproducible reading order (deterministic).
  """
  return input_pipeline.options_for(
      spec, files=files, global_batch_size=global_batch_size,
      is_training=True, shuffle_buffer_size=config.shuffle_buffer_size,
      cache=config.cache_dataset, seed=config.seed,
      file_record_counts=file_record_counts,
      gradient_accumulation_steps=gradient_accumulation_steps,
      deterministic=config.deterministic or resumable)


def parameter_server_input_options(config: TrainConfig, spec, *, files,
                                   global_batch_size
                                   ) -> input_pipeline.PipelineOptions:
  """The training split's `PipelineOptions` for parameter-server workers.

  Unseeded: each worker must shuffle its copy differently.
  """
  return input_pipeline.options_for(
      spec, files=files, global_batch_size=global_batch_size,
      is_training=True, shuffle_buffer_size=config.shuffle_buffer_size,
      cache=config.cache_dataset, seed=None)


def eval_input_options(config: TrainConfig, spec, *, files, global_batch_size,
                       pad_to_static_batches: bool = False
                       ) -> input_pipeline.PipelineOptions:
  """The evaluation split's `PipelineOptions`: read once, in order.

  Args:
    config: the run's config (`cache_dataset`).
    spec: the data set's `DatasetSpec`.
    files: the evaluation TFRecord paths (ignored for a dataset function).
    global_batch_size: examples per evaluation step over all replicas.
    pad_to_static_batches: pad the last batches (TPUs need static shapes).
  """
  return input_pipeline.options_for(
      spec, files=files, global_batch_size=global_batch_size,
      is_training=False, cache=config.cache_dataset,
      pad_to_static_batches=pad_to_static_batches)


# --- model, optimizer and training loop ---


def assembly_options(config: TrainConfig,
                     decisions=None) -> assembly.AssemblyOptions:
  """The model, optimizer and precision settings `tfdist.training.assembly` reads.

  Args:
    config: the run's `TrainConfig`.
    decisions: its `tfdist.distribute.decisions.Decisions` (the dtype, loss
      scale and steps per execution that run); None: `config`'s own.

  Returns:
    `assembly.AssemblyOptions`; model builders asking for `config` get
    `config` itself.
  """
  decided = config if decisions is None else decisions
  return assembly.AssemblyOptions(
      optimizer=config.optimizer,
      momentum=config.momentum,
      weight_decay=config.weight_decay,
      clipnorm=config.clipnorm,
      global_clipnorm=config.global_clipnorm,
      dtype=decided.dtype,
      loss_scale=decided.loss_scale,
      steps_per_execution=decided.steps_per_execution,
      enable_xla=config.enable_xla,
      run_eagerly=config.run_eagerly,
      deterministic=config.deterministic,
      zero_stage=config.zero_stage_resolved,
      class_weight=tuple(config.class_weight),
      activation_recomputation=config.activation_recomputation,
      bytes_per_pack=config.bytes_per_pack,
      all_reduce_dtype=config.all_reduce_dtype,
      pipeline=pipeline_options(config),
      tensor_parallel=config.tensor_parallel,
      builder_config=config)


def task_names(config: TrainConfig) -> task_lib.TaskNames:
  """The names the run's task comes from (`--model`, `--dataset`,
  `--feature_spec`, `--import_modules`): `tfdist.training.task.from_names` reads
  them."""
  return task_lib.TaskNames(model=config.model, dataset=config.dataset,
                            feature_spec=config.feature_spec,
                            import_modules=tuple(config.import_modules))


def task(config: TrainConfig) -> task_lib.Task:
  """The run's `Task` (`tfdist.training.task.from_names` of `task_names`).

  Raises:
    ConfigError: as `tfdist.training.task.from_names`.
  """
  return task_lib.from_names(task_names(config))


def dataset(config: TrainConfig):
  """The run's `DatasetSpec` (`tfdist.training.task.dataset_from_names`).

  Raises:
    ConfigError: as `tfdist.training.task.dataset_from_names`.
  """
  return task_lib.dataset_from_names(task_names(config))


# --- checkpoints and outputs ---


def run_record_settings(config: TrainConfig, decisions=None) -> dict:
  """The settings `tfdist.training.checkpointing.run_record` records beside the
  checkpoints: every config field by flag name, as JSON-serializable values
  (`TrainConfig.to_dict`), with nothing left to resolve (`recorded_config`)."""
  return recorded_config(config, decisions)


def recorded_config(config: TrainConfig, decisions=None) -> dict:
  """`config.to_dict()` with nothing left to resolve: the decided fields
  as `decisions` (`tfdist.distribute.decisions.Decisions.field_values`) set
  them (None: as `config` has them), and `zero_stage` the stage that runs
  (`TrainConfig.zero_stage_resolved`: from the switches when
  `--zero_stage` was not given; the manifest's `flags` say which were)."""
  recorded = config.to_dict()
  if decisions is not None:
    recorded.update(json.loads(json.dumps(decisions.field_values(),
                                          default=str)))
  recorded["zero_stage"] = config.zero_stage_resolved
  return recorded


# --- observability (run log, manifest, diagnose) ---


def manifest_options(config: TrainConfig,
                     decisions=None) -> manifest.ManifestOptions:
  """What `tfdist.observability.manifest.build_manifest` records of `config`
  and the run's `decisions` (the config as `recorded_config` gives it)."""
  return manifest.ManifestOptions(
      flags=tuple(config.flags_snapshot),
      config=recorded_config(config, decisions),
      base_learning_rate=config.base_learning_rate,
      base_batch_size=config.base_batch_size, lr_scaling=config.lr_scaling,
      model=config.model, dataset=config.dataset,
      feature_spec=config.feature_spec,
      all_reduce_dtype=config.all_reduce_dtype)


def name_options(config: TrainConfig) -> preflight.NameOptions:
  """The registry names `tfdist.training.preflight.check_names` checks."""
  return preflight.NameOptions(
      model=config.model, dataset=config.dataset,
      feature_spec=config.feature_spec,
      import_modules=tuple(config.import_modules),
      hptune_metric=config.hptune_metric)


def output_options(config: TrainConfig,
                   decisions=None) -> preflight.OutputOptions:
  """The output folders `tfdist.training.preflight.probe_outputs` probes:
  those the run's `decisions` (`tfdist.distribute.decisions.Decisions`;
  None: `config`'s own) chose."""
  if decisions is None:
    return preflight.OutputOptions(
        model_dir=config.model_dir, checkpoint_dir=config.checkpoint_dir,
        tensorboard_dir=config.tensorboard_dir, export_dir=config.export_dir,
        resolved_checkpoint_dir=config.resolved_checkpoint_dir,
        resolved_tensorboard_dir=config.resolved_tensorboard_dir,
        resolved_export_dir=config.resolved_export_dir)
  values = decisions.field_values()
  return preflight.OutputOptions(
      model_dir=decisions.model_dir, checkpoint_dir=values["checkpoint_dir"],
      tensorboard_dir=values["tensorboard_dir"],
      export_dir=values["export_dir"],
      resolved_checkpoint_dir=decisions.checkpoint_dir,
      resolved_tensorboard_dir=decisions.tensorboard_dir,
      resolved_export_dir=decisions.export_dir)


def config_paths(config: TrainConfig,
                 decisions=None) -> List[Tuple[str, str]]:
  """`(flag, path)` of every path `config` reads or writes, for
  `tfdist.data.filesystems.require_file_systems` (comma-separated flags give
  one pair per entry); with `decisions`
  (`tfdist.distribute.decisions.Decisions`), the folders and files they chose
  (the environment's, a trial's) in place of the flags'."""
  names = ("train_files", "eval_files", "data_dir", "raw_data_dir",
           "model_dir", "checkpoint_dir", "tensorboard_dir", "export_dir",
           "feature_spec", "init_checkpoint")
  values = {name: getattr(config, name) for name in names}
  if decisions is not None:
    values.update({name: value for name, value
                   in decisions.field_values().items() if name in values})
  out = []
  for name in names:
    out += filesystems.split_paths(f"--{name}", values[name])
  return out

# --- cloud engines (Ray, Vertex AI, Kubernetes) ---
