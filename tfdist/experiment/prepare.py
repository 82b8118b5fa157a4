"""Preparing a run: the decisions every role makes first.

`start_run` checks what needs no model (versions, callbacks, allocator, file
systems, the task) and calls `prepare_run`, which applies the environment,
resolves the cluster and decides `auto`. Its `PreparedRun` holds the
config, the cluster, the decisions, the strategy's backend
(`tfdist.backends`) and this process's `Role`; nothing decided is written
into the config the caller gave.
"""

import contextlib
import dataclasses
import functools
from typing import Optional, Sequence, Tuple

from absl import logging
import keras
import tensorflow as tf

from tfdist.backends import registry as backends
from tfdist import config as config_lib
from tfdist.config import parallelism as parallelism_config
from tfdist.config import TrainConfig
from tfdist.data import filesystems
from tfdist import errors
from tfdist.distribute import auto_select
from tfdist.distribute import cluster as cluster_lib
from tfdist.distribute import decisions as decisions_lib
from tfdist.distribute import environment as environment_lib
from tfdist.core.strategy_kind import StrategyKind
from tfdist.observability import manifest as manifest_lib
from tfdist.observability import versions
from tfdist.parallel.pipeline import options as pipeline_options
from tfdist.runtime import allocator
from tfdist.training import assembly
from tfdist.training.state import checkpoint_paths
from tfdist.training.state import checkpointing
from tfdist.training.state import export
from tfdist.training.state import keras_callbacks
from tfdist.training.plan import preflight
from tfdist.training.plan import run_plan as run_plan_lib
from tfdist.training import task as task_lib


def training_workers(kind: StrategyKind,
                     cluster: cluster_lib.ClusterInfo) -> int:
  """The processes that run training steps (`Backend.training_workers`).

  Args:
    kind: the run's strategy kind.
    cluster: its resolved cluster.

  Returns:
    Under MultiWorkerMirrored, the chief and the workers
    (`ClusterInfo.num_workers`, at least 1); under parameter servers, the
    `worker` tasks (the coordinator schedules, it does not step; 0 in a
    cluster without workers); otherwise 1.
  """
  return backends.backend_for(kind).training_workers(cluster)


@dataclasses.dataclass(frozen=True)
class PreparedRun:
  """The decisions every role makes first (`prepare_run`).

  Attributes:
    config: the caller's `TrainConfig`, as given (nothing decided is
      written into it).
    cluster: the `tfdist.distribute.cluster.ClusterInfo`.
    decisions: the `tfdist.distribute.decisions.Decisions`: the strategy
      and dtype `auto` chose, the folders and files the environment or a
      tuning trial set.
  """
  config: TrainConfig
  cluster: cluster_lib.ClusterInfo
  decisions: decisions_lib.Decisions

  @property
  def decision(self) -> auto_select.Decision:
    """`auto`'s choice and its reasons (`Decisions.choice`)."""
    return self.decisions.choice

  @property
  def environment_applied(self) -> Tuple[Tuple[str, str], ...]:
    """The `(field, variable)` pairs the environment filled."""
    return self.decisions.environment_applied

  @property
  def trial_fields(self) -> Tuple[str, ...]:
    """The folder fields given a tuning trial's subfolder."""
    return self.decisions.trial_fields

  @property
  def kind(self) -> StrategyKind:
    """The decided strategy."""
    return self.decisions.strategy

  @functools.cached_property
  def backend(self) -> backends.Backend:
    """The decided strategy's backend (`tfdist.backends`; the pipeline's
    under `--pipeline_stages`)."""
    return backends.backend_for_run(self.kind, self.config, self.cluster)

  @functools.cached_property
  def role(self) -> backends.Role:
    """This process's `Role`: writer or not, training workers, server."""
    return self.backend.role(self.cluster)

  @property
  def num_workers(self) -> int:
    """The processes that run training steps (`Role.num_workers`)."""
    return self.role.num_workers

  @property
  def is_writer(self) -> bool:
    """Whether this process writes `--model_dir` (`Role.is_writer`): the
    only process, the MultiWorkerMirrored chief, the parameter-server
    coordinator."""
    return self.role.is_writer


def _log_environment(config: TrainConfig, changes, applied) -> None:
  """Logs the fields the environment and `--dataset` filled."""
  for field, variable in applied:
    logging.info("--%s=%s from $%s", field, changes[field], variable)
  if config.recommended_applied:
    logging.info("--dataset=%s sets flags left unset: %s (pass them to "
                 "override).", config.task.data.dataset,
                 " ".join(f"--{k}={v}" for k, v in config.recommended_applied))


def prepare_run(config: TrainConfig, *,
                environment: Optional[environment_lib.RunEnvironment] = None,
                dataset=None) -> PreparedRun:
  """The decisions every role makes first: environment, cluster, `auto`.

  Nothing expensive runs here (no model, no data); the TPU is probed only
  when `auto` needs it, boundedly.

  Args:
    config: the caller's `TrainConfig`.
    environment: the environment to use (None: read `os.environ` now).
    dataset: the run's `DatasetSpec`, if known (a dataset function reads
      no files, so the TPU `gs://` rule has nothing to check).

  Returns:
    A `PreparedRun`: the config as given, the `ClusterInfo`, and the
    `Decisions` (`tfdist.distribute.decisions`): `auto`'s choice, the
    precision, the TPU, the folders and files the environment
    (`environment.environment_changes`) and a tuning trial
    (`environment.trial_changes`) set, the `(field, variable)` pairs the
    environment filled and the folder fields given the trial's subfolder.

  Raises:
    ConfigError: missing `--model_dir`, `--feature_spec` without files, a
      `keras.distribution` distribution set in the process, a data URI of
      another format than `tf-record`, a malformed cluster,
      fp16 on a TPU, local input with a remote TPU, an export folder that
      would replace the run's other outputs
      (`tfdist.errors.ExportRefusedError`).
  """
  if environment is None:
    environment = environment_lib.read_environment()
  # What the environment fills (Vertex AI's folders and files, $TPU_NAME,
  # the data folder's default): read into `Decisions`, never into `config`.
  changes, applied = environment_lib.environment_changes(
      {name: getattr(config, name)
       for name in environment_lib.ENVIRONMENT_FIELDS}, environment)
  data = config.task.data
  config_lib.require_model_dir(
      changes.get("model_dir", config.outputs.model_dir))
  config_lib.require_data_files(
      config.task.feature_spec, changes.get("train_files", data.train_files),
      changes.get("eval_files", data.eval_files), config.task.mode)
  preflight.check_no_keras_distribution()
  _log_environment(config, changes, applied)
  cluster = cluster_lib.resolve_cluster(
      worker_hosts=config.strategy.cluster.worker_hosts,
      task_index=config.strategy.cluster.task_index,
      environ=environment.variables,
      reduction_server=config.cloud.reduction_server)
  logging.info("%s", cluster.describe())
  # Hyperparameter tuning: trials never share a checkpoint.
  trial = environment_lib.trial_changes(
      {name: changes.get(name, getattr(config, name))
       for name in environment_lib.TRIAL_FOLDER_FIELDS},
      trial=cluster.trial, filled=applied)
  changes.update(trial)
  for field, folder in trial.items():
    logging.info("--%s=%s: hyperparameter-tuning trial %s's own folder "
                 "(from %s)", field, folder, cluster.trial, cluster.source)
  options = auto_select.SelectOptions(
      strategy=config.strategy, precision=config.precision,
      dtype_defaulted="dtype" in config.defaulted)
  if changes.get("tpu"):
    options = options.with_strategy(tpu=dataclasses.replace(
        config.strategy.tpu, tpu=changes["tpu"]))
  # The export replaces its folder: never one holding the run's outputs.
  export.check_layout(**decisions_lib.decide_folders(
      config.outputs, changes).sources(applied))
  choice = auto_select.resolve(options, cluster=cluster,
                               environment=environment)
  decisions = decisions_lib.Decisions.of(
      config, choice=choice, changes=changes, environment_applied=applied,
      trial_fields=tuple(trial))
  # The model is named now (an unset --model is the data set's): expert
  # parallelism's model rules run on it, before anything is built.
  parallelism_config.check_expert_parallel(config, model_named=True)
  prepared = PreparedRun(config=config, cluster=cluster, decisions=decisions)
  prepared.backend.validate(config, decisions, dataset=dataset)
  logging.info("%s", choice.describe())
  return prepared


@contextlib.contextmanager
def name_environment_sources(applied):
  """Missing data named by a field the environment filled (Vertex AI's
  `AIP_TRAINING_DATA_URI` filled `--train_files`) also names the variable:
  the user gave no such flag.

  Raises:
    DataNotFoundError: the same message, with the variable and the fix
      appended when a filled field is the one named.
  """
  try:
    yield
  except errors.DataNotFoundError as e:
    message = str(e)
    notes = [f"--{field} came from ${variable}: fix that variable, or pass "
             f"--{field} (a flag wins over ${variable})."
             for field, variable in applied if f"--{field}=" in message]
    if not notes:
      raise
    raise errors.DataNotFoundError(" ".join([message, *notes])) from e


def start_run(config: TrainConfig, *,
              callbacks: Sequence[keras.callbacks.Callback] = (),
              environment: Optional[environment_lib.RunEnvironment] = None,
              task: Optional[task_lib.Task] = None
              ) -> Tuple[task_lib.Task, PreparedRun]:
  """The checks of every role before anything is built: the installed
  TensorFlow and Keras, the callbacks, the allocator, the file systems,
  the task, `prepare_run` and the model options.

  Returns:
    `(task, prepared)`: the `tfdist.training.task.Task` (`task`, or what the
    config names) and the `PreparedRun`.

  Raises:
    As `run_experiment`, for what is checked before training.
  """
  versions.check_installed_versions()
  keras_callbacks.check_callbacks(callbacks)
  # Every role (chief, worker, ps, evaluator) trains or serves in this
  # process: the malloc settings apply to all (tfdist.runtime.allocator).
  allocator.configure_allocator(config.memory.tune_allocator)
  # Every task opens files itself (ps workers read the input shards, every
  # process reads a --feature_spec), so every task imports tensorflow-io
  # when a path needs it; again once the environment filled the folders.
  filesystems.require_file_systems(filesystems.config_paths(config))
  if task is None:
    task = task_lib.from_names(config.task)
    # `--layout_map`: its T and entries, as `tfdist.fit`'s keyword sets
    # them (`tfdist.fit` gives its own task, resolved so already).
    config, task = task_lib.split_by_layout_map(config, task)
  prepared = prepare_run(config, environment=environment,
                         dataset=task.dataset)
  filesystems.require_file_systems(
      filesystems.config_paths(prepared.config, prepared.decisions))
  assembly.check_model_options(
      assembly_options(prepared.config, prepared.decisions,
                       cluster=prepared.cluster), task=task)
  return task, prepared


def assembly_options(config: TrainConfig, decisions, *,
                     cluster=None) -> assembly.AssemblyOptions:
  """The run's `tfdist.training.assembly.AssemblyOptions`: the sections the
  assembly reads, handed over as they are, the run's `decisions` (dtype,
  loss scale, steps per execution; None: the sections' own), the
  parallelism section's pipeline (its copies counted over the `cluster`'s
  chief and worker tasks: `ClusterInfo.training_tasks`; None: one process)
  and the model options a builder asking for `config` gets
  (`tfdist.config.ModelBuilderConfig`)."""
  if decisions is None:  # The sections' own (no run decided them).
    dtype, loss_scale = config.precision.dtype, config.precision.loss_scale
    steps_per_execution = config.loop.steps_per_execution
  else:
    dtype, loss_scale = decisions.dtype, decisions.loss_scale
    steps_per_execution = decisions.steps_per_execution
  return assembly.AssemblyOptions(
      optimization=config.optimization, precision=config.precision,
      loop=config.loop, memory=config.memory, task=config.task,
      strategy=config.strategy, dtype=dtype, loss_scale=loss_scale,
      steps_per_execution=steps_per_execution,
      pipeline=pipeline_options.PipelineOptions.of(
          config.strategy.parallelism, num_gpus=config.strategy.num_gpus,
          num_cpu_devices=config.strategy.num_cpu_devices,
          tasks=cluster.training_tasks() if cluster is not None else ()),
      builder_config=config_lib.ModelBuilderConfig(config))


def plan_options(config: TrainConfig, decisions, *,
                 cluster=None) -> run_plan_lib.PlanOptions:
  """The run's `tfdist.training.plan.run_plan.PlanOptions`: the sections the
  plan reads, handed over as they are, with the data files the run's
  `decisions` chose (`run_plan.decided_data`) and the `cluster`'s chief and
  worker tasks (a pipeline's copies are counted over them; None: one
  process)."""
  return run_plan_lib.PlanOptions(
      data=run_plan_lib.decided_data(config.task.data, decisions),
      lr=config.optimization.learning_rate, loop=config.loop,
      task=config.task, precision=config.precision, memory=config.memory,
      strategy=config.strategy,
      tasks=cluster.training_tasks() if cluster is not None else ())




def check_resume(config, decisions, plan) -> list:
  """Compares this run with the one that wrote `--model_dir`'s checkpoint
  (the writing process only); returns what changed (logged).

  Raises:
    tfdist.errors.IncompatibleResumeError: a changed model or
      global batch without `--allow_incompatible_resume`.
  """
  directory = decisions.checkpoint_dir
  latest = tf.train.latest_checkpoint(directory)
  if not latest:
    return []
  previous = checkpointing.read_run_record(directory, decisions.model_dir)
  if previous is None:
    return []
  try:
    restored_step = checkpoint_paths.checkpoint_step(latest, default=0)
  except (IndexError, ValueError):
    restored_step = 0
  notes = checkpointing.check_resume(
      previous, checkpointing.run_record(
          manifest_lib.recorded_config(config, decisions), plan),
      checkpoint=latest,
      restored_step=restored_step,
      allow=config.reliability.allow_incompatible_resume)
  if notes:
    logging.warning("tfdist: resuming from %s, which a run with other "
                    "settings wrote: %s.", latest, "; ".join(notes))
  return notes


