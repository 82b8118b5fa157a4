"""The one place where a `TrainConfig` becomes each part's own options.

The run assembly (`tfdist.experiment`) calls these converters; every module
below it takes the small frozen options object (or plain arguments) it
reads, never the whole `TrainConfig` (as Orbit's `Controller` takes its
`ControllerOptions`). Each converter is a pure function of the config.
"""

from tfdist import auto_select
from tfdist import config as config_lib
from tfdist import lr_schedule
from tfdist import parameter_server
from tfdist import run_plan
from tfdist import strategy as strategy_lib
from tfdist import tpu as tpu_lib
from tfdist.strategy_kind import StrategyKind

TrainConfig = config_lib.TrainConfig

# --- cluster and strategy ---


def tpu_options(config: TrainConfig) -> tpu_lib.TpuOptions:
  """The `--tpu*` flags of `config`."""
  return tpu_lib.TpuOptions(tpu=config.tpu, zone=config.tpu_zone,
                            project=config.tpu_gcp_project,
                            init_timeout=config.tpu_init_timeout)


def select_options(config: TrainConfig) -> auto_select.SelectOptions:
  """What `tfdist.auto_select.resolve` reads from `config` (flags as given)."""
  return auto_select.SelectOptions(
      distribution_strategy=config.distribution_strategy, dtype=config.dtype,
      dtype_defaulted="dtype" in config.defaulted, num_gpus=config.num_gpus,
      num_cpu_devices=config.num_cpu_devices, tpu=tpu_options(config))


def apply_decision(config: TrainConfig,
                   decision: auto_select.Decision) -> TrainConfig:
  """`config` with `auto`'s decision applied (`auto_select.decision_changes`).

  Returns:
    A validated `TrainConfig` with no `auto` left in it.

  Raises:
    ConfigError: `--reduction_server` when the decision is not
      multi_worker_mirrored.
  """
  return config.replace(**auto_select.decision_changes(
      decision, tpu=config.tpu, loss_scale=config.loss_scale,
      steps_per_execution=config.steps_per_execution,
      steps_per_execution_defaulted="steps_per_execution" in config.defaulted,
      reduction_server=bool(getattr(config, "reduction_server", False))))


def strategy_kind(config: TrainConfig) -> StrategyKind:
  """The concrete `StrategyKind` of a config whose `auto` is decided.

  Raises:
    ConfigError: `--distribution_strategy=auto` (decide it first with
      `tfdist.auto_select.resolve` and `apply_decision`).
  """
  if config.distribution_strategy == "auto":
    raise config_lib.ConfigError(
        "make_strategy takes a concrete strategy; decide `auto` first with "
        "tfdist.auto_select.resolve and apply_decision.")
  return StrategyKind.parse(config.distribution_strategy)


def strategy_options(config: TrainConfig) -> strategy_lib.StrategyOptions:
  """What `tfdist.strategy.make_strategy` reads from `config`.

  Raises:
    ConfigError: `auto` not decided yet (`strategy_kind`).
  """
  return strategy_lib.StrategyOptions(
      kind=strategy_kind(config), num_gpus=config.num_gpus,
      num_cpu_devices=config.num_cpu_devices,
      all_reduce_alg=config.all_reduce_alg,
      reduction_server=bool(config.reduction_server),
      collective_timeout_seconds=config.collective_timeout_seconds,
      cluster_start_timeout_seconds=config.cluster_start_timeout_seconds,
      tpu=tpu_options(config),
      partitioner=parameter_server.PartitionerOptions(
          kind=config.ps_partitioner, shard_bytes=config.ps_min_shard_bytes,
          max_shards=config.ps_max_shards))

def lr_options(config: TrainConfig) -> lr_schedule.LROptions:
  """The learning-rate flags of `config` (its defaults already resolved)."""
  return lr_schedule.LROptions(
      base_learning_rate=config.base_learning_rate,
      base_batch_size=config.base_batch_size, lr_scaling=config.lr_scaling,
      lr_schedule=config.lr_schedule, warmup_steps=config.warmup_steps,
      warmup_epochs=config.warmup_epochs,
      warmup_start_learning_rate=config.warmup_start_learning_rate,
      end_learning_rate_factor=config.end_learning_rate_factor,
      piecewise_boundaries=tuple(config.piecewise_boundaries),
      piecewise_multipliers=tuple(config.piecewise_multipliers))


def data_options(config: TrainConfig) -> run_plan.DataOptions:
  """The data set and file flags of `config`."""
  return run_plan.DataOptions(
      dataset=config.dataset, train_files=config.train_files,
      eval_files=config.eval_files, data_dir=config.data_dir,
      raw_data_dir=config.raw_data_dir)


def plan_options(config: TrainConfig) -> run_plan.PlanOptions:
  """What `tfdist.run_plan.make_run_plan` reads from `config`."""
  return run_plan.PlanOptions(
      data=data_options(config), lr=lr_options(config),
      need_eval=config.mode != "train", batch_size=config.batch_size,
      per_replica_batch_size=config.per_replica_batch_size,
      gradient_accumulation_steps=config.gradient_accumulation_steps,
      train_steps=config.train_steps, train_epochs=config.train_epochs,
      sync_batch_norm=config.sync_batch_norm, enable_xla=config.enable_xla,
      model=config.model,
      activation_recomputation=config.activation_recomputation,
      zero_stage=config.zero_stage_resolved,
      deterministic=config.deterministic)

# --- inputs and data ---

# --- model, optimizer and training loop ---

# --- checkpoints and outputs ---

# --- observability (run log, manifest, diagnose) ---

# --- cloud engines (Ray, Vertex AI, Kubernetes) ---
