"""The run plan: files, example counts, batch plan and learning rate, once.

Built after the strategy (it needs `num_replicas_in_sync`) and before the
model, by `make_run_plan`; every later step (input pipelines, optimizer,
controller, manifest) reads this one object, and `describe()` is the plan
printed at start.
"""

import dataclasses
from typing import List, Optional, Sequence, Tuple

from tfdist import config as config_lib
from tfdist import models
from tfdist.data import data_checks
from tfdist.data import input_pipeline
from tfdist import errors
from tfdist.core.strategy_kind import StrategyKind
from tfdist.parallel.pipeline import options as pipeline_options
from tfdist.training.plan import batch_plan as batch_plan_lib
from tfdist.training.plan import lr_schedule
from tfdist.training.step import precision
from tfdist.core import reduce_dtype


# The parameter-server coordinator's smallest evaluation batch (evaluation
# keeps no activations for a backward pass).
MIN_EVAL_BATCH_SIZE = 1024


# Which data a run reads: the config's data section (`--dataset`,
# `--data_dir`, `--raw_data_dir`, `--train_files`, `--eval_files`), handed to
# this part as it is.
DataOptions = config_lib.DataConfig


def decided_data(data: DataOptions, decisions=None) -> DataOptions:
  """The data section `data` with the files the run's `decisions`
  (`tfdist.distribute.decisions.Decisions`: Vertex AI's data URIs, the
  default `--data_dir`) chose; None: `data` as given."""
  if decisions is None:
    return data
  return dataclasses.replace(
      data, train_files=decisions.train_files,
      eval_files=decisions.eval_files, data_dir=decisions.data_dir)


@dataclasses.dataclass(frozen=True)
class PlanOptions:
  """What `make_run_plan` (and `RunPlan.describe`) read: the config's
  sections, each handed over as the config holds it (no field restated),
  and the data the run decided.

  Attributes:
    data: the `DataOptions` (the task's data section with the files the run
      decided: `decided_data`).
    lr: the `tfdist.training.plan.lr_schedule.LROptions` (the optimization
      section's `learning_rate`).
    loop: the `tfdist.config.LoopConfig`: `batch_size` (None: from the
      per-replica one), `per_replica_batch_size`,
      `gradient_accumulation_steps`, `train_steps` (0: from
      `train_epochs`), `train_epochs`, `deterministic`.
    task: the `tfdist.config.TaskConfig`: `model` (the plan's batch-norm
      line), `sync_batch_norm` (None: decided by the model), `mode`
      (evaluation files are listed unless `train`).
    precision: the `tfdist.config.PrecisionConfig`: `enable_xla`.
    memory: the `tfdist.config.MemoryConfig`: `activation_recomputation`
      and the resolved ZeRO stage.
    strategy: the `tfdist.config.StrategyConfig`: `all_reduce_dtype` (the
      gradients' wire dtype) and its parallelism section (the pipeline).
    tasks: across a cluster, its chief and worker tasks
      (`ClusterInfo.training_tasks`), over which a pipeline's copies are
      counted; empty: one process.
  """
  data: DataOptions
  lr: lr_schedule.LROptions
  loop: config_lib.LoopConfig = dataclasses.field(
      default_factory=config_lib.LoopConfig)
  task: config_lib.TaskConfig = dataclasses.field(
      default_factory=config_lib.TaskConfig)
  precision: config_lib.PrecisionConfig = dataclasses.field(
      default_factory=config_lib.PrecisionConfig)
  memory: config_lib.MemoryConfig = dataclasses.field(
      default_factory=config_lib.MemoryConfig)
  strategy: config_lib.StrategyConfig = dataclasses.field(
      default_factory=config_lib.StrategyConfig)
  tasks: Tuple[str, ...] = ()

  @property
  def need_eval(self) -> bool:
    """Evaluation files are listed (`--mode` other than `train`)."""
    return self.task.mode != "train"

  @property
  def pipeline(self) -> Optional[pipeline_options.PipelineOptions]:
    """The parallelism section's `PipelineOptions` on the strategy
    section's devices, each of `tasks`' across a cluster (one stage:
    none)."""
    strategy = self.strategy
    return pipeline_options.PipelineOptions.of(
        strategy.parallelism, num_gpus=strategy.num_gpus,
        num_cpu_devices=strategy.num_cpu_devices, tasks=self.tasks)


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """What one run will do, decided before anything is built.

  Attributes:
    train_files, eval_files: the TFRecord files read (sorted paths; empty
      for a data set from a dataset function, and `eval_files` under
      `--mode=train`).
    num_train_examples: examples in one epoch (records in `train_files`).
    batch: the `BatchPlan` (replicas, per-replica and global batch,
      steps per epoch).
    total_steps: optimizer updates in the whole run.
    lr: the `LRPlan` (peak learning rate, warmup steps, schedule).
    strategy: the concrete `StrategyKind`.
    strategy_reason: why it was chosen.
    dtype: `fp32`, `bf16` or `fp16`.
    dtype_reason: why.
    asynchronous: parameter-server training (each worker step is one
      update; batch sizes are per worker step).
    num_workers: hosts training (input pipelines under multi-worker
      strategies; workers under parameter servers).
    train_file_counts: records in each of `train_files`.
    sharding: the `input_pipeline.ShardingPlan` of the training split (how
      the workers split the records, and why).
    sync_batch_norm: built-in models normalize over the global batch.
    sync_batch_norm_reason: why (`tfdist.models.resolve_sync_batch_norm`).
    num_eval_examples: records in `eval_files`, or examples in a dataset
      function's evaluation split (0 when the run does not evaluate).
    pipeline: the run's `PipelineOptions` when the model is cut into
      stages (its micro-batches checked against the batch), else None.
    mode_lines: the run's parallelism mode's lines of the plan
      (`tfdist.parallel.mode.StepMode.plan_lines`: its layout, mesh and
      traffic).
  """
  train_files: Tuple[str, ...]
  eval_files: Tuple[str, ...]
  num_train_examples: int
  batch: batch_plan_lib.BatchPlan
  total_steps: int
  lr: lr_schedule.LRPlan
  strategy: StrategyKind
  strategy_reason: str
  dtype: str
  dtype_reason: str
  asynchronous: bool = False
  num_workers: int = 1
  train_file_counts: Tuple[int, ...] = ()
  sharding: Optional[input_pipeline.ShardingPlan] = None
  sync_batch_norm: bool = False
  sync_batch_norm_reason: str = ""
  num_eval_examples: int = 0
  pipeline: Optional[pipeline_options.PipelineOptions] = None
  mode_lines: Tuple[str, ...] = ()

  @property
  def steps_per_epoch(self) -> int:
    return self.batch.steps_per_epoch

  @property
  def global_batch_size(self) -> int:
    return self.batch.global_batch_size

  @property
  def eval_batch_size(self) -> int:
    """The global batch the run evaluates with: its micro-batch (what a
    step's memory was sized for) under synchronous strategies; at least
    `MIN_EVAL_BATCH_SIZE` on the parameter-server coordinator, which
    evaluates alone."""
    if self.asynchronous:
      return max(self.global_batch_size, MIN_EVAL_BATCH_SIZE)
    return self.global_batch_size // self.batch.gradient_accumulation_steps

  def describe(self, options: "PlanOptions") -> str:
    """The plan as printed at start (`options`: the run's `PlanOptions`)."""
    return "\n".join(line for line in
                     self._main_lines(options) + self._option_lines(options)
                     if line)

  def _main_lines(self, options: "PlanOptions") -> List[str]:
    """`describe`'s lines every plan has ("" for one it leaves out)."""
    plan = self.batch
    mode = (f"asynchronous: {self.num_workers} worker(s) each apply their "
            "own batches" if self.asynchronous else
            f"synchronous: {self.num_workers} worker(s)")
    return [
        "tfdist plan:",
        f"  strategy               {self.strategy}: {self.strategy_reason}",
        f"  training               {mode}",
        (f"  model                  {options.task.model}"
         if options.task.model
         else ""),
        (f"  dataset                {options.data.dataset}"
         if options.data.dataset else ""),
        f"  num_replicas_in_sync   {plan.num_replicas_in_sync}",
        f"  per_replica_batch_size {plan.per_replica_batch_size}"
        + (" (micro-batch)" if plan.gradient_accumulation_steps > 1
           else ""),
        f"  gradient_accumulation  {plan.gradient_accumulation_steps}"
        + (f" micro-batches per update (one all-reduce and one update "
           f"every {plan.gradient_accumulation_steps} micro-steps)"
           if plan.gradient_accumulation_steps > 1 else ""),
        f"  global_batch_size      {plan.global_batch_size}"
        + (" (per worker step)" if self.asynchronous else "")
        + (f" (effective: {plan.per_replica_batch_size} x "
           f"{plan.num_replicas_in_sync} replica(s) x "
           f"{plan.gradient_accumulation_steps} micro-batches)"
           if plan.gradient_accumulation_steps > 1 else ""),
        f"  train examples         {plan.num_train_examples} in "
        + (f"{len(self.train_files)} file(s)" if self.train_files else
           f"--dataset={options.data.dataset}'s dataset function"),
        (f"  eval examples          {self.num_eval_examples} in "
         f"{len(self.eval_files)} file(s)" if self.eval_files else
         f"  eval examples          {self.num_eval_examples} in "
         f"--dataset={options.data.dataset}'s dataset function"
         if self.num_eval_examples else ""),
        f"  steps_per_epoch        {plan.steps_per_epoch} (remainder "
        + (f"dropped: {plan.dropped_per_epoch} examples per epoch untrained)"
           if plan.dropped_per_epoch else "dropped: none)"),
        f"  train steps            {self.total_steps}",
        f"  learning rate          {options.lr.base_learning_rate:g} at batch "
        f"{options.lr.base_batch_size} -> {self.lr.peak_learning_rate:g} at "
        f"batch {plan.global_batch_size} ({options.lr.lr_scaling} rule), "
        f"{options.lr.lr_schedule} after warmup",
        f"  warmup_steps           {self.lr.warmup_steps}",
        f"  dtype                  {self.dtype} "
        f"({precision.policy_name(self.dtype)}): {self.dtype_reason}",
    ]

  def _option_lines(self, options: "PlanOptions") -> List[str]:
    """`describe`'s lines for the settings a run may have: input sharding,
    batch norm, recomputation, ZeRO, determinism, all-reduce dtype and
    pipeline."""
    plan = self.batch
    lines = []
    if self.sharding:
      lines.append(f"  input sharding         {self.sharding.describe()}")
    if models.has_batch_norm(options.task.model):
      lines.append(
          f"  batch norm             "
          f"{'synchronized (global batch)' if self.sync_batch_norm else 'per replica'}"
          f" ({self.sync_batch_norm_reason})")
    if options.memory.activation_recomputation:
      lines.append("  activation recompute   on: blocks recompute their "
                   "activations in the backward pass")
    zero_stage = options.memory.zero_stage_resolved
    if zero_stage:
      n = plan.num_replicas_in_sync
      parallelism = options.strategy.parallelism
      tensor = parallelism.tensor_parallel
      # Hybrid sharding beside tensor parallelism: within each data group;
      # beside experts: the non-expert weights' state only.
      over = (f"each data group's {n // tensor} replicas (1/{n // tensor} "
              f"of each replica's variables; replicated across the "
              f"{tensor} tensor ranks: hybrid sharding)" if tensor > 1 else
              f"the {n} replicas (1/{n} each of the non-expert weights' "
              "state; each expert's stays on its replicas)"
              if parallelism.expert_parallel > 1 else
              f"the {n} replicas (1/{n} each)")
      accumulating = plan.gradient_accumulation_steps > 1
      lines.append(
          f"  zero_stage             {zero_stage}"
          f": optimizer state sharded over {over}"
          + (", and the gradient accumulators"
             if zero_stage >= 2 and accumulating else "")
          + (" (stage 2 also shards the accumulators of "
             "--gradient_accumulation_steps > 1; with none, its state is "
             "stage 1's)" if zero_stage == 2 and not accumulating else "")
          + (", and the weights (gathered for each step; "
             "embedding tables stay replicated)"
             if zero_stage == 3 else ""))
    if options.loop.deterministic:
      lines.append("  deterministic          op determinism and a "
                   "deterministic input order")
    wire_dtype = options.strategy.all_reduce_dtype
    if reduce_dtype.compresses(wire_dtype):
      lines.append(
          f"  all_reduce_dtype       {wire_dtype}: "
          + (reduce_dtype.describe(wire_dtype)
             if plan.num_replicas_in_sync > 1 and
             not self.asynchronous else
             "no effect (no all-reduce: one replica)"))
    return lines + list(self.mode_lines)


def mode_plan_lines(options: "PlanOptions", spec, plan, *, dtype: str,
                    pipeline) -> Tuple[str, ...]:
  """The run's parallelism mode's lines of the plan: the mode the
  parallelism and memory sections choose (`tfdist.parallel.mode.
  mode_name_for`), asked with `StepMode.plan_lines`.

  Args:
    options: the run's `PlanOptions`.
    spec: the data set's `DatasetSpec`.
    plan: the run's `BatchPlan`.
    dtype: the decided `fp32`, `bf16` or `fp16`.
    pipeline: the run's checked `PipelineOptions`, or None.
  """
  # Imported here: the registered modes import TensorFlow; the plan's
  # other parts do not.
  from tfdist.parallel import modes  # pylint: disable=g-import-not-at-top
  parallelism = options.strategy.parallelism
  mode = modes.get_mode(modes.mode_name_of(parallelism, options.memory))
  return tuple(mode.plan_lines(modes.PlanFacts(
      parallelism=parallelism,
      num_replicas_in_sync=plan.num_replicas_in_sync,
      per_replica_batch_size=plan.per_replica_batch_size,
      gradient_accumulation_steps=plan.gradient_accumulation_steps,
      compute_bytes=4 if dtype == "fp32" else 2, pipeline=pipeline,
      experts=models.experts_shape(options.task.model, options.task,
                                   spec),
      zero_stage=options.memory.zero_stage_resolved)))


def resolve_data_files(data: DataOptions, spec, *, need_eval: bool = True
                       ) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
  """`(train_files, eval_files)`, converting the named data set if the
  flags give no files, and checked against the data set
  (`DatasetSpec.check_files`: a feature spec's features).

  `data` is the run's `DataOptions` (a `TrainConfig`'s `task.data`);
  `spec` its `DatasetSpec`.

  A data set from a dataset function has no files: `((), ())`. Without
  `need_eval` (`--mode=train`) no evaluation files are listed.

  Raises:
    DataNotFoundError: a glob matches nothing, or the raw data is missing.
    ConfigError: the files do not match the data set's spec, or one flag
      mixes `.gz` and uncompressed files.
  """
  if not spec.reads_files:
    return (), ()
  train_pattern, eval_pattern = data.train_files, data.eval_files
  if not train_pattern or (need_eval and not eval_pattern):
    if spec.prepare is None:
      raise errors.DataNotFoundError(
          f"--dataset={spec.name} reads TFRecord files: give them as "
          "--train_files and --eval_files.")
    default_train, default_eval = spec.prepare(data.data_dir,
                                               data.raw_data_dir)
    train_pattern = train_pattern or default_train
    eval_pattern = eval_pattern or default_eval
  train_files = tuple(input_pipeline.list_files(train_pattern,
                                                flag="--train_files"))
  eval_files = tuple(input_pipeline.list_files(
      eval_pattern, flag="--eval_files")) if need_eval else ()
  for flag, files in (("--train_files", train_files),
                      ("--eval_files", eval_files)):
    data_checks.check_compression(files, flag=flag)
  if spec.check_files is not None:
    spec.check_files(train_files, "--train_files")
    spec.check_files(eval_files, "--eval_files")
  return train_files, eval_files


def data_patterns(data: DataOptions, spec=None) -> Sequence[Tuple[str, str]]:
  """`(flag, path)` pairs of what the run reads, for the TPU `gs://` rule
  (`data`: the run's `DataOptions`; `spec`: its `DatasetSpec`, where one
  from a dataset function reads no files of tfdist's)."""
  if spec is not None and not spec.reads_files:
    return []
  out = []
  for flag, value in (("--train_files", data.train_files),
                      ("--eval_files", data.eval_files)):
    if value:
      out.append((flag, value))
  if not (data.train_files and data.eval_files):
    out.append(("--data_dir", data.data_dir))
  return out


def _checked_pipeline(options: PlanOptions, plan
                      ) -> Optional[pipeline_options.PipelineOptions]:
  """The run's pipeline, its micro-batches checked against the batch plan
  `plan`; None when the model is not cut into stages.

  Raises:
    ConfigError: as `tfdist.parallel.pipeline.options.check_batch`.
  """
  pipeline = options.pipeline
  if pipeline is None or not pipeline.enabled:
    return None
  pipeline_options.check_batch(
      pipeline, micro_step_batch=plan.per_replica_batch_size,
      gradient_accumulation_steps=plan.gradient_accumulation_steps)
  return pipeline


def make_run_plan(options: PlanOptions, spec, *, num_replicas_in_sync: int,
                  num_workers: int, asynchronous: bool, decision,
                  on_tpu: bool = False) -> RunPlan:
  """Lists and counts the data, then plans the batch and learning rate.

  Args:
    options: the run's `PlanOptions` (its sections).
    spec: the data set's `DatasetSpec`.
    num_replicas_in_sync: replicas per update (`strategy.
      num_replicas_in_sync`; 1 per worker step under parameter servers).
    num_workers: hosts that each read a disjoint part of the data under
      synchronous multi-worker training (their input pipelines), or the
      parameter-server workers (each reads every file).
    asynchronous: parameter-server training (the backend's trait).
    decision: the `tfdist.distribute.auto_select.Decision` (strategy, dtype,
      reasons).
    on_tpu: the strategy runs on a TPU (the backend's trait), where
      `--enable_xla` compiles the whole step, not each replica's.

  Returns:
    A `RunPlan`.

  Raises:
    ConfigError: inconsistent batch sizes, warmup longer than the run.
    DataNotFoundError: missing data.
    tfdist.errors.DataError: a damaged file (named), or records of
      another schema than the data set's parser reads.
  """
  kind = StrategyKind.parse(decision.strategy)
  train_files, eval_files = resolve_data_files(
      options.data, spec, need_eval=options.need_eval)
  num_eval = 0
  if spec.reads_files:
    # Every file read to its end and counted, before anything is built: a
    # damaged one is named (tfdist.data.data_checks).
    counts = data_checks.check_data(train_files, eval_files)
    train_file_counts = tuple(n for _, n in counts.train)
    num_train = counts.num_train_examples
    num_eval = counts.num_eval_examples
  else:  # A dataset function: one epoch of its training split, counted.
    train_file_counts = ()
    num_train = input_pipeline.count_examples(spec)
    if options.need_eval:  # The run evaluates its whole evaluation split.
      num_eval = input_pipeline.count_examples(spec, training=False)
  plan = batch_plan_lib.make_batch_plan(
      num_replicas_in_sync=num_replicas_in_sync,
      batch_size=options.loop.batch_size,
      per_replica_batch_size=options.loop.per_replica_batch_size,
      gradient_accumulation_steps=options.loop.gradient_accumulation_steps,
      num_train_examples=num_train,
      num_input_pipelines=1 if asynchronous else num_workers)
  total_steps = batch_plan_lib.resolve_train_steps(
      train_steps=options.loop.train_steps,
      train_epochs=options.loop.train_epochs,
      steps_per_epoch=plan.steps_per_epoch)
  lr_plan = lr_schedule.plan_learning_rate(
      options.lr, global_batch_size=plan.global_batch_size,
      steps_per_epoch=plan.steps_per_epoch, total_steps=total_steps)
  pipelines = 1 if asynchronous else num_workers
  if spec.reads_files:
    sharding = input_pipeline.plan_sharding(
        train_file_counts, num_files=len(train_files),
        num_input_pipelines=pipelines,
        global_batch_size=plan.global_batch_size, is_training=True)
  else:
    sharding = input_pipeline.function_sharding(
        spec.input_fn, num_input_pipelines=pipelines)
  pipeline = _checked_pipeline(options, plan)
  sync_batch_norm, sync_batch_norm_reason = models.resolve_sync_batch_norm(
      options.task.sync_batch_norm, strategy_name=kind,
      num_replicas_in_sync=num_replicas_in_sync,
      synchronous=not asynchronous,
      xla_per_replica=options.precision.enable_xla and not on_tpu)
  return RunPlan(
      train_file_counts=train_file_counts, sharding=sharding,
      sync_batch_norm=sync_batch_norm,
      sync_batch_norm_reason=sync_batch_norm_reason,
      train_files=train_files, eval_files=eval_files,
      num_train_examples=num_train, batch=plan, total_steps=total_steps,
      lr=lr_plan, strategy=kind,
      strategy_reason=decision.strategy_reason, dtype=decision.dtype,
      dtype_reason=decision.dtype_reason, asynchronous=asynchronous,
      num_workers=num_workers, num_eval_examples=num_eval,
      pipeline=pipeline, mode_lines=mode_plan_lines(
          options, spec, plan, dtype=decision.dtype, pipeline=pipeline))
