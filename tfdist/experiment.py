"""`run_experiment`: the whole run, from a `TrainConfig` to artifacts.

Short wiring of one-job modules, in the order data flows:

    config + environment (tfdist.distribute.environment)
      -> task: model builder, data set, loss, metrics (tfdist.training.task; the
         registries and import paths of tfdist.training.registry, or
         tfdist.fit's objects)
      -> cluster (tfdist.distribute.cluster)            -> role: train, serve,
      evaluate -> decision: strategy and dtype (tfdist.distribute.auto_select,
      the one place
         that decides `auto`), parsed once into a `StrategyKind`
      -> strategy (tfdist.distribute.strategy)
      -> run plan: files, batch, learning rate (tfdist.training.run_plan)
      -> model, optimizer, trainer, checkpoint (tfdist.training.assembly)
      -> input pipelines (tfdist.data.input_pipeline)
      -> step runner (tfdist.training.step_runner) under one controller
         (tfdist.training.controller)
      -> artifacts: SavedModel (tfdist.training.export), manifest
      (tfdist.observability.manifest)

A training process runs as an `ExperimentRunner`: one object holding the
run's state, whose `build_*` methods build one part each, in the order
`ExperimentRunner.train` shows; the side-car evaluator is an
`EvaluatorRunner` of the same shape. Every strategy goes through the same
steps; parameter-server training differs only in its step runner and input
(one copy per worker), and in the roles its cluster has (`worker` and `ps`
tasks serve, the `evaluator` evaluates checkpoints as they appear, as it
does for every strategy). `--mode=continuous_eval` makes any process that
evaluator, `--mode=eval` evaluates the latest checkpoint once,
`--mode=train` trains without evaluating.
"""

import atexit
import contextlib
import dataclasses
import gc
import os
import shutil
import tempfile
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

from absl import logging
import keras
import tensorflow as tf

from tfdist.cloud import hptune
from tfdist.config import ConfigError
from tfdist.config import TrainConfig
from tfdist.data import filesystems
from tfdist.data import input_pipeline
from tfdist.data import input_position as input_position_lib
from tfdist.data.dataset_spec import DataNotFoundError
from tfdist.distribute import auto_select
from tfdist.distribute import cluster as cluster_lib
from tfdist.distribute import devices
from tfdist.distribute import environment as environment_lib
from tfdist.distribute import lease as lease_lib
from tfdist.distribute import parameter_server as ps_lib
from tfdist.distribute import strategy as strategy_lib
from tfdist.distribute import tpu as tpu_lib
from tfdist.distribute import worker_exit
from tfdist.distribute.strategy_kind import StrategyKind
from tfdist.observability import manifest as manifest_lib
from tfdist.observability import profiling
from tfdist.observability import run_log as run_log_lib
from tfdist.observability import versions
from tfdist.runtime import allocator
from tfdist.runtime import failures
from tfdist.runtime import preemption
from tfdist.runtime import preflight
from tfdist.runtime import run_options
from tfdist.training import assembly
from tfdist.training import checkpoint_paths
from tfdist.training import checkpointing
from tfdist.training import controller as controller_lib
from tfdist.training import done_marker
from tfdist.training import export
from tfdist.training import keras_callbacks
from tfdist.training import memory
from tfdist.training import precision
from tfdist.training import run_plan as run_plan_lib
from tfdist.training import step_runner
from tfdist.training import task as task_lib
from tfdist.training.checkpointing import CheckpointKeeper
from tfdist.training.controller import Controller, ControllerOptions

MIN_EVAL_BATCH_SIZE = run_plan_lib.MIN_EVAL_BATCH_SIZE


def _worker_scratch_dir(cluster: cluster_lib.ClusterInfo) -> str:
  """A local folder for a non-chief worker's writes, deleted at exit.

  Raises:
    tfdist.runtime.preflight.OutputNotWritableError: it cannot be made or
      written.
  """
  parent = os.environ.get("TEST_TMPDIR") or tempfile.gettempdir()
  try:
    path = tempfile.mkdtemp(
        prefix=f"tfdist-{cluster.task_type}{cluster.task_index}-",
        dir=parent)
  except OSError as e:
    raise preflight.OutputNotWritableError(
        f"The scratch folder of {cluster.task_type} {cluster.task_index} "
        f"(under {parent}: $TMPDIR) is not writable: {e}. Point TMPDIR at "
        "a writable local folder.") from None
  atexit.register(shutil.rmtree, path, True)
  preflight.probe_writable(path, flag="TMPDIR", value=parent)
  return path


def training_workers(kind: StrategyKind,
                     cluster: cluster_lib.ClusterInfo) -> int:
  """The processes that run training steps: the one place this is decided.

  Args:
    kind: the run's strategy kind.
    cluster: its resolved cluster.

  Returns:
    Under MultiWorkerMirrored, the chief and the workers
    (`ClusterInfo.num_workers`, at least 1); under parameter servers, the
    `worker` tasks (the coordinator schedules, it does not step; 0 in a
    cluster without workers); otherwise 1.
  """
  if kind.is_asynchronous:
    return len(cluster.cluster.get(cluster_lib.WORKER, ()))
  if kind.is_multi_worker:
    return max(cluster.num_workers, 1)
  return 1


@dataclasses.dataclass(frozen=True)
class PreparedRun:
  """The decisions every role makes first (`prepare_run`).

  Iterates (and indexes) as the tuple `(config, cluster, decision,
  environment_applied, trial_fields)`, so `config, cluster, *_ =
  prepare_run(...)` reads it.

  Attributes:
    config: the `TrainConfig` with the environment applied and `auto`
      decided.
    cluster: the `tfdist.distribute.cluster.ClusterInfo`.
    decision: the `tfdist.distribute.auto_select.Decision`.
    environment_applied: the `(field, variable)` pairs the environment
      filled.
    trial_fields: the folder fields given a tuning trial's subfolder.
  """
  config: TrainConfig
  cluster: cluster_lib.ClusterInfo
  decision: auto_select.Decision
  environment_applied: Tuple[Tuple[str, str], ...] = ()
  trial_fields: Tuple[str, ...] = ()

  @property
  def kind(self) -> StrategyKind:
    """The decided strategy, parsed once."""
    return StrategyKind.parse(self.decision.strategy)

  @property
  def num_workers(self) -> int:
    """The processes that run training steps (`training_workers`)."""
    return training_workers(self.kind, self.cluster)

  @property
  def is_writer(self) -> bool:
    """Whether this process writes `--model_dir`: the only process, the
    MultiWorkerMirrored chief, the parameter-server coordinator."""
    return self.kind.writes_model_dir(self.cluster.is_chief)

  def __iter__(self):
    return iter((self.config, self.cluster, self.decision,
                 self.environment_applied, self.trial_fields))

  def __getitem__(self, index):
    return tuple(self)[index]

  def __len__(self) -> int:
    return 5


def _log_environment(config: TrainConfig, applied) -> None:
  """Logs the fields the environment and `--dataset` filled."""
  for field, variable in applied:
    logging.info("--%s=%s from $%s", field, getattr(config, field), variable)
  if config.recommended_applied:
    logging.info("--dataset=%s sets flags left unset: %s (pass them to "
                 "override).", config.dataset,
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
    A `PreparedRun` (iterable as `(config, cluster, decision,
    environment_applied, trial_fields)`): the config with the environment
    applied (a tuning trial's folders nested, `environment.trial_folders`)
    and `auto` decided, the `ClusterInfo`, the `auto_select.Decision`, the
    `(field, variable)` pairs the environment filled, and the folder fields
    given the trial's subfolder.

  Raises:
    ConfigError: missing `--model_dir`, `--feature_spec` without files, a
      `keras.distribution` distribution set in the process, a data URI of another format than `tf-record`, a malformed cluster,
      fp16 on a TPU, local input with a remote TPU, an export folder that
      would replace the run's other outputs
      (`tfdist.training.export.ExportRefusedError`).
  """
  if environment is None:
    environment = environment_lib.read_environment()
  config, applied = environment_lib.apply_environment(config, environment)
  config.require_model_dir()
  config.require_data_files()
  preflight.check_no_keras_distribution()
  _log_environment(config, applied)
  cluster = cluster_lib.resolve_cluster(
      worker_hosts=config.worker_hosts, task_index=config.task_index,
      environ=environment.variables,
      reduction_server=config.reduction_server)
  logging.info("%s", cluster.describe())
  # Hyperparameter tuning: trials never share a checkpoint.
  config, trial_fields = environment_lib.trial_folders(
      config, trial=cluster.trial, filled=applied)
  for field in trial_fields:
    logging.info("--%s=%s: hyperparameter-tuning trial %s's own folder "
                 "(from %s)", field, getattr(config, field), cluster.trial,
                 cluster.source)
  # The export replaces its folder: never one holding the run's outputs.
  export.check_layout(**environment_lib.output_sources(config, applied))
  decision = auto_select.resolve(run_options.select_options(config), cluster=cluster,
                                 environment=environment)
  config = run_options.apply_decision(config, decision)
  if StrategyKind.parse(decision.strategy).is_tpu:
    tpu_lib.validate_tpu_config(
        config.tpu, data_patterns=run_plan_lib.data_patterns(
            run_options.data_options(config), dataset))
  logging.info("%s", decision.describe())
  return PreparedRun(config=config, cluster=cluster, decision=decision,
                     environment_applied=applied, trial_fields=trial_fields)


@contextlib.contextmanager
def _name_environment_sources(applied):
  """Missing data named by a field the environment filled (Vertex AI's
  `AIP_TRAINING_DATA_URI` filled `--train_files`) also names the variable:
  the user gave no such flag.

  Raises:
    DataNotFoundError: the same message, with the variable and the fix
      appended when a filled field is the one named.
  """
  try:
    yield
  except DataNotFoundError as e:
    message = str(e)
    notes = [f"--{field} came from ${variable}: fix that variable, or pass "
             f"--{field} (a flag wins over ${variable})."
             for field, variable in applied if f"--{field}=" in message]
    if not notes:
      raise
    raise DataNotFoundError(" ".join([message, *notes])) from e


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
  allocator.configure_allocator(config.tune_allocator)
  # Every task opens files itself (ps workers read the input shards, every
  # process reads a --feature_spec), so every task imports tensorflow-io
  # when a path needs it; again once the environment filled the folders.
  filesystems.require_file_systems(run_options.config_paths(config))
  if task is None:
    task = task_lib.from_names(run_options.task_names(config))
  prepared = prepare_run(config, environment=environment,
                         dataset=task.dataset)
  filesystems.require_file_systems(
      run_options.config_paths(prepared.config))
  options = run_options.assembly_options(prepared.config)
  assembly.check_model_options(options, task=task)
  return task, prepared


def _evaluates(prepared: PreparedRun) -> bool:
  """Whether this process is an evaluator (an `evaluator` task, or
  `--mode=eval`/`continuous_eval`).

  Raises:
    ConfigError: an evaluating mode on a member of a training cluster.
  """
  config, cluster = prepared.config, prepared.cluster
  evaluating = config.mode in ("eval", "continuous_eval")
  if evaluating and cluster.task_type not in (
      cluster_lib.EVALUATOR, cluster_lib.CHIEF) and (
          cluster.num_workers > 1 or cluster.num_ps):
    raise ConfigError(
        f"--mode={config.mode} evaluates in one process; this one is "
        f"{cluster.task_type} {cluster.task_index} of a training cluster. "
        "Run it without TF_CONFIG/--worker_hosts, or as the cluster's "
        "evaluator task.")
  return cluster.task_type == cluster_lib.EVALUATOR or evaluating


def _evaluate(prepared: PreparedRun, *, task: task_lib.Task) -> dict:
  """The evaluator role: its folders probed, then a dry run or
  `run_evaluator`."""
  config = prepared.config
  # Never a writer of the chief's artifacts, and never the lease holder.
  for folder in (os.path.join(config.model_dir, "eval"),
                 os.path.join(config.resolved_tensorboard_dir, "eval")):
    preflight.probe_writable(folder, flag="--model_dir",
                             value=config.model_dir)
  if config.dry_run:
    return _dry_run(prepared, task=task, writer=False)
  return run_evaluator(config, task=task, cluster=prepared.cluster,
                       decision=prepared.decision,
                       once=config.mode == "eval")


def _serve(prepared: PreparedRun) -> Optional[dict]:
  """A parameter-server cluster's `worker` and `ps` tasks serve until the
  run ends; returns their result, or None for every other process."""
  config, cluster = prepared.config, prepared.cluster
  if not prepared.kind.is_asynchronous:
    return None
  ps_lib.set_grpc_fail_fast()
  if cluster.task_type not in (cluster_lib.WORKER, cluster_lib.PS):
    return None
  if config.dry_run:
    logging.info("tfdist: dry run: %s %d would serve the parameter-server "
                 "cluster.", cluster.task_type, cluster.task_index)
    return {"dry_run": True, "role": cluster.task_type,
            "index": cluster.task_index}
  status = ps_lib.serve(config.model_dir, cluster,
                        grace_seconds=config.preemption_grace_seconds)
  return {"role": cluster.task_type, "index": cluster.task_index,
          "exit_status": status}


def run_experiment(config: TrainConfig, *,
                   callbacks: Sequence[keras.callbacks.Callback] = (),
                   environment: Optional[environment_lib.RunEnvironment] = None,
                   task: Optional[task_lib.Task] = None,
                   exit_plan: Optional[worker_exit.ExitPlan] = None,
                   print_final_eval: bool = True) -> dict:
  """Runs this process's part of the job `config` describes.

  Works from any thread: off the main thread, signal-based preemption is
  off (the host framework owns signals; see `tfdist.runtime.preemption`).

  Args:
    config: a `TrainConfig`.
    callbacks: extra Keras callbacks, called by the controller on every
      training process at the same points.
    environment: the process environment (`tfdist.distribute.environment`); None
      reads `os.environ` once, here.
    task: what to train (`tfdist.training.task.Task`: model builder, data set,
      loss, metrics); None: what `config.model`, `config.dataset`,
      `config.feature_spec` and `config.import_modules` name.
    exit_plan: for binaries that end their process when the run is done
      (`tfdist.train`): a MultiWorkerMirrored task of a multi-worker run
      then ends its process inside this call, right after the final
      barrier, the chief last (`tfdist.distribute.worker_exit.leave_process`),
      and this call does not return there. None (library use): it returns.
    print_final_eval: the chief prints the final evaluation's line
      (`Final eval: ...`) on stdout at the end, as `tfdist.train` does.

  Returns:
    The run manifest (the chief also writes it to
    `model_dir/run_manifest.json`); for a parameter-server `worker` or `ps`
    task, `{"role": ..., "index": ...}`; for an `evaluator` task and the
    `eval` and `continuous_eval` modes, `{"role": "evaluator", "results":
    [...]}`.

  With `config.dry_run`, every start-up check runs (names, cluster, output
  folders, the `--model_dir` lease, data files and schema, resumption) and
  the plan is printed; nothing is built or trained.

  Raises:
    ConfigError: invalid or inconsistent configuration, an unknown model or
      data set, a model or data the other does not fit (before training),
      an unsupported TensorFlow or Keras (`versions.UnsupportedVersionError`)
      or a path whose file system is missing
      (`filesystems.FileSystemUnavailableError`).
    DataNotFoundError: missing data.
    tfdist.data.data_checks.DataError: a damaged input file or records of
      another schema (before training).
    tfdist.runtime.preflight.OutputNotWritableError: an output folder cannot be
      written (before anything else is done).
    tfdist.training.checkpointing.IncompatibleResumeError: the checkpoint's run
      had another model or global batch (before training).
    tfdist.distribute.lease.LeaseHeldError: another live run holds
      `--model_dir`.
    tfdist.runtime.preemption.PreemptedError: SIGTERM or SIGINT stopped training
      after a checkpoint was saved (rerun to resume).
    tfdist.observability.run_log.DivergenceError: the loss or the state became
      NaN or infinite (the last good checkpoint is kept and named).
    tfdist.distribute.parameter_server.ParameterServerError: a ps task was lost.
    tfdist.training.step_runner.PeerLostError: a MultiWorkerMirrored peer was
      lost.
  """
  started = time.time()
  task, prepared = start_run(config, callbacks=callbacks,
                             environment=environment, task=task)
  hypertune_reporter = None
  if prepared.config.hptune_metric:
    # Vertex AI hyperparameter tuning: the package now, the metric's name
    # once the model is built (before training).
    hypertune_reporter = hptune.make_hypertune()
  if _evaluates(prepared):
    return _evaluate(prepared, task=task)
  served = _serve(prepared)
  if served is not None:
    return served
  runner = ExperimentRunner(prepared, task=task, callbacks=callbacks,
                            exit_plan=exit_plan, started=started,
                            hypertune_reporter=hypertune_reporter,
                            print_final_eval=print_final_eval)
  with _name_environment_sources(prepared.environment_applied):
    return runner.run()


def _check_profile_window(config: TrainConfig, plan) -> None:
  """Raises `ConfigError` for a `--profile_steps` window after the run."""
  if config.profile_steps and config.profile_steps[0] > plan.total_steps:
    raise ConfigError(
        f"--profile_steps={config.profile_steps[0]},{config.profile_steps[1]}"
        f" starts after the run's last step ({plan.total_steps}): nothing "
        "would be traced. Choose a window within the run, e.g. "
        f"--profile_steps={min(10, plan.total_steps)},"
        f"{min(15, plan.total_steps)}.")


# Host memory TensorFlow's runtime keeps per call of a training function
# whose collectives reach another process when every call gets new
# collective instance keys (TensorFlow's default, which
# `TFDIST_PER_CALL_INSTANCE_KEYS=1` keeps; tfdist otherwise fixes the keys
# at trace time and memory stays flat: docs/design/long-runs.md; upstream:
# tensorflow/tensorflow#42616), and the growth over a run from which tfdist
# warns at start.
CROSS_PROCESS_BYTES_PER_CALL = 10 << 10
CROSS_PROCESS_WARN_BYTES = 256 << 20


def cross_process_memory_warning(*, total_steps: int,
                                 steps_per_execution: int,
                                 cross_process: bool) -> Optional[str]:
  """The start-up warning for a long run whose collectives cross processes.

  Args:
    total_steps: the run's training steps.
    steps_per_execution: steps per call of the compiled training function.
    cross_process: the run's collectives reach another process (a
      MultiWorkerMirrored run of more than one worker).

  Returns:
    The warning (the expected growth, in MiB per task, and the flag that
    divides it) when the run would grow by `CROSS_PROCESS_WARN_BYTES` or
    more at `CROSS_PROCESS_BYTES_PER_CALL`; None otherwise.
  """
  if not cross_process:
    return None
  per_call = max(int(steps_per_execution), 1)
  calls = -(-int(total_steps) // per_call)
  growth = calls * CROSS_PROCESS_BYTES_PER_CALL
  if growth < CROSS_PROCESS_WARN_BYTES:
    return None
  suggested = per_call * 10
  return (f"{total_steps} steps at --steps_per_execution={per_call}: "
          "with per-call collective instance keys "
          "(TFDIST_PER_CALL_INSTANCE_KEYS=1), TensorFlow's runtime keeps "
          "about 10 KiB of host memory per call of the training function "
          f"whose collectives reach another process, about {growth / (1 << 20):,.0f} MiB per task by the "
          "end of this run (docs/design/long-runs.md). "
          f"--steps_per_execution={suggested} divides that by "
          f"{suggested // per_call}.")


def _log_model_memory(model_memory: memory.ModelMemory) -> None:
  logging.info(
      "Model state per replica: parameters %s (%d values), gradients %s, "
      "optimizer %s: %s in all (activations not counted)",
      memory.format_bytes(model_memory.parameters_bytes),
      model_memory.num_parameters,
      memory.format_bytes(model_memory.gradients_bytes),
      memory.format_bytes(model_memory.optimizer_bytes),
      memory.format_bytes(model_memory.total_bytes))


class ExperimentRunner:
  """One training process's run: the strategy, the model, the loop and the
  artifacts, built by named steps on one object that holds the run.

  `run()` checks the outputs and takes the `--model_dir` lease, then either
  dry-runs (`dry_run`) or trains (`train`), which calls, in order:
  `build_strategy`, `build_preemption_watcher`, `set_seeds`, `build_plan`,
  `check_resume`, `build_model_and_optimizer`, `build_checkpoints`,
  `warm_start`, `build_inputs`, `build_run_log`, `build_callbacks`,
  `build_profiler`, `build_controller`, `run_controller`, `build_export`,
  `build_manifest`, `write_outputs` and `leave_together`. Each `build_*`
  returns its part and reads only what earlier steps set.

  Override a step by subclassing, e.g. another strategy:

      class MyRunner(experiment.ExperimentRunner):
        def build_strategy(self):
          choice = super().build_strategy()
          ...
          return choice

      from tfdist.config import TrainConfig
      config = TrainConfig(model_dir="/tmp/run", dataset="fashion_mnist",
                           distribution_strategy="mirrored")
      task, prepared = experiment.start_run(config)
      MyRunner(prepared, task=task).run()

  `config` is the same `tfdist.config.TrainConfig` that `tfdist.fit` takes
  (one field per `tfdist.train` flag, validated when built: a bad value
  raises `ConfigError`); `flags.definitions.flags_to_config()` builds it
  from parsed absl flags, as `tfdist.train` does.

  (`run_experiment` does the same with `ExperimentRunner`, after sending
  evaluator and parameter-server server processes to their own roles.)

  Attributes (the facts, decided once in `__init__`):
    config, cluster, decision, task: the run's `TrainConfig`,
      `ClusterInfo`, `auto_select.Decision` and `tfdist.training.task.Task`.
    kind: the strategy's `StrategyKind`.
    is_writer: this process writes `--model_dir` (the only process, the
      MultiWorkerMirrored chief, the parameter-server coordinator); the
      other MultiWorkerMirrored workers write to a scratch folder.
    num_workers: the processes that run training steps
      (`training_workers`).
    lease: the `--model_dir` lease of the writer (None elsewhere).
    cleanup: what `run` undoes however the run ends (an `ExitStack`).
  Attributes set by the steps: `choice`, `strategy`, `watcher`, `plan`,
  `policy`, `parts`, `model_memory`, `keeper`, `warm_started`,
  `strategy_details`, `step_runner`, `evaluate`, `run_log`, `profiler`,
  `controller`, `result`, `export_dir`. Once a run has ended, `run`
  releases the training objects (the parameter-server coordinator removes
  its functions from the servers as they are freed, before the done
  marker).
  """

  # The training objects `run` releases once the run is over.
  _TRAINING_OBJECTS = ("choice", "strategy", "watcher", "parts", "keeper",
                       "step_runner", "evaluate", "run_log", "profiler",
                       "controller")

  def __init__(self, prepared: PreparedRun, *, task: task_lib.Task,
               callbacks: Sequence[keras.callbacks.Callback] = (),
               exit_plan: Optional[worker_exit.ExitPlan] = None,
               started: Optional[float] = None,
               hypertune_reporter: Any = None,
               print_final_eval: bool = True):
    self.prepared = prepared
    self.print_final_eval = print_final_eval
    self.config = prepared.config
    self.cluster = prepared.cluster
    self.decision = prepared.decision
    self.applied = prepared.environment_applied
    self.trial_fields = prepared.trial_fields
    self.kind = prepared.kind
    self.is_writer = prepared.is_writer
    self.num_workers = prepared.num_workers
    self.task = task
    self.callbacks = tuple(callbacks)
    self.exit_plan = exit_plan
    self.started = time.time() if started is None else started
    self.hypertune_reporter = hypertune_reporter
    self.lease: Optional[lease_lib.Lease] = None
    self.cleanup = contextlib.ExitStack()
    self.scratch_dir: Optional[str] = None
    for name in self._TRAINING_OBJECTS:
      setattr(self, name, None)
    self.plan = self.policy = self.model_memory = self.result = None
    self.warm_started = self.export_dir = None
    self.strategy_details = {}

  def run(self) -> dict:
    """This process's run: the manifest, or the dry run's summary.

    Raises:
      As `run_experiment`.
    """
    self.lease = self.build_lease()
    with self.cleanup:
      if self.config.dry_run:
        return self.dry_run()
      if self.lease is not None:
        self.lease.acquire()
        export.remove_stale_exports(self.config.resolved_export_dir)
      with self._named_failures():
        record = self.train()
      if self.is_writer:
        self._release_training_objects()
        # Tells parameter-server tasks and side-car evaluators the run is
        # over, only once the training objects are gone: a
        # parameter-server coordinator removes its functions from the
        # workers and ps tasks as they are freed, and a server that had
        # already left made each removal a gRPC error ("Failed to remove
        # function remotely").
        gc.collect()
        done_marker.mark_done(self.config.model_dir)
    return record

  def train(self) -> dict:
    """The training steps, in order; returns the run manifest."""
    self.scratch_dir = (None if self.is_writer else
                        _worker_scratch_dir(self.cluster))
    self.choice = self.build_strategy()
    self.strategy = self.choice.strategy
    self.watcher = self.build_preemption_watcher()
    self.set_seeds()
    self.plan = self.build_plan()
    self.check_resume()
    self.parts = self.build_model_and_optimizer()
    self.keeper = self.build_checkpoints()
    self.warm_started = self.warm_start()
    if self.is_writer:
      done_marker.clear_done(self.config.model_dir)
    self.step_runner, self.evaluate = self.build_inputs()
    self.run_log = self.build_run_log()
    callbacks = self.build_callbacks()
    self.profiler = self.build_profiler()
    self.controller = self.build_controller(callbacks)
    self.result = self.run_controller()
    with worker_exit.failures_shared(
        lambda failed: self.leave_together(failed=failed)), \
        self._named_failures():
      self.export_dir = self.build_export()
      record = self.build_manifest()
      self.write_outputs(record)
    self.leave_together()
    return record

  def _release_training_objects(self) -> None:
    for name in self._TRAINING_OBJECTS:
      setattr(self, name, None)

  def _named_failures(self):
    """A full disk, a refused write, a data file gone: one line, status 2."""
    config = self.config
    return failures.named_failures(
        {"--model_dir": config.model_dir,
         "--checkpoint_dir": config.resolved_checkpoint_dir,
         "--tensorboard_dir": config.resolved_tensorboard_dir,
         "--export_dir": config.resolved_export_dir},
        data_folders=failures.data_folders(config.train_files,
                                           config.eval_files,
                                           config.data_dir),
        checkpoint_dir=config.resolved_checkpoint_dir)

  def _export_source(self) -> str:
    """The flag or variable that chose the export folder."""
    return environment_lib.output_sources(
        self.config, self.applied)["export_dir"][1]

  def out_dir(self, path: str, scratch_name: str) -> str:
    """`path` for the writer, else `scratch_name` in the scratch folder."""
    return (path if self.is_writer else
            os.path.join(self.scratch_dir, scratch_name))

  def build_lease(self) -> Optional[lease_lib.Lease]:
    """The writer's output checks and its `--model_dir` lease (not yet
    held; released by `cleanup`); None for other processes."""
    if not self.is_writer:
      return None
    preflight.probe_outputs(run_options.output_options(self.config))
    export.check_export_dir(self.config.resolved_export_dir,
                            source=self._export_source())
    lease = lease_lib.Lease(self.config.model_dir,
                            timeout_seconds=self.config.lease_timeout_seconds)
    self.cleanup.callback(lease.release)
    return lease

  def dry_run(self) -> dict:
    """`--dry_run`: the lease checked free, the plan made, nothing built."""
    if self.lease is not None:
      self.lease.check_free()
    return _dry_run(self.prepared, task=self.task, writer=self.is_writer)

  def build_strategy(self) -> strategy_lib.StrategyChoice:
    """The `tf.distribute` strategy (with the CPU devices configured)."""
    if self.kind is StrategyKind.MULTI_WORKER_MIRRORED:
      # Built before anything starts TensorFlow's runtime (it configures
      # the collective runtime); the decision listed physical devices only.
      # It may hold the interpreter, and so the lease's renewals, until
      # every peer has connected.
      with (self.lease.extended(self.config.cluster_start_timeout_seconds)
            if self.lease is not None else contextlib.nullcontext()):
        choice = strategy_lib.make_strategy(
        run_options.strategy_options(self.config), cluster=self.cluster)
      devices.configure_cpu_devices(self.config.num_cpu_devices)
      return choice
    devices.configure_cpu_devices(self.config.num_cpu_devices)
    return strategy_lib.make_strategy(
        run_options.strategy_options(self.config), cluster=self.cluster)

  def build_preemption_watcher(self) -> preemption.PreemptionWatcher:
    """SIGTERM/SIGINT handling, uninstalled however the run ends."""
    # Replaces TensorFlow's own SIGTERM handler (installed with the
    # strategy).
    watcher = preemption.PreemptionWatcher(
        grace_seconds=self.config.preemption_grace_seconds).install()
    # Also when a start-up check below stops the run.
    self.cleanup.callback(watcher.uninstall)
    return watcher

  def set_seeds(self) -> None:
    """`--seed` and `--deterministic`."""
    if self.config.seed is not None:
      keras.utils.set_random_seed(self.config.seed)
    if self.config.deterministic:
      # Reproducible runs (--deterministic): the same seed, data and
      # cluster give the same weights.
      tf.config.experimental.enable_op_determinism()

  def build_plan(self) -> run_plan_lib.RunPlan:
    """The run plan: files, batch, steps, learning rate.

    Raises:
      ConfigError: as `tfdist.training.run_plan.make_run_plan`, or a
        `--profile_steps` window after the last step.
    """
    plan = run_plan_lib.make_run_plan(
        run_options.plan_options(self.config), self.task.dataset,
        num_replicas_in_sync=self.strategy.num_replicas_in_sync,
        num_workers=self.num_workers,
        asynchronous=self.kind.is_asynchronous, decision=self.decision)
    logging.info("%s", plan.describe(run_options.plan_options(self.config)))
    remainder = plan.batch.remainder_warning()
    if remainder and self.is_writer:
      logging.warning("%s", remainder)
    _check_profile_window(self.config, plan)
    warning = cross_process_memory_warning(
        total_steps=plan.total_steps,
        steps_per_execution=self.config.steps_per_execution,
        cross_process=(self.kind.is_multi_worker and not
                       self.kind.is_asynchronous and self.num_workers > 1 and
                       strategy_lib.per_call_instance_keys()))
    if warning:
      logging.warning("%s", warning)
    return plan

  def check_resume(self) -> None:
    """The writer compares this run with the checkpoint's and records it.

    Raises:
      tfdist.training.checkpointing.IncompatibleResumeError: as `_check_resume`.
    """
    if not self.is_writer:
      return
    directory = self.config.resolved_checkpoint_dir
    _check_resume(self.config, self.plan)
    checkpointing.clean_interrupted_saves(directory)
    checkpointing.write_run_record(
        directory, checkpointing.run_record(
            run_options.run_record_settings(self.config), self.plan))

  def build_model_and_optimizer(self) -> assembly.Parts:
    """The precision policy, then model, optimizer, trainer and checkpoint
    under the strategy (`tfdist.training.assembly.build`)."""
    self.policy = precision.configure_precision(self.config.dtype)
    options = run_options.assembly_options(self.config)
    parts = assembly.build(options, task=self.task, strategy=self.strategy,
                           plan=self.plan, on_tpu=self.kind.is_tpu)
    if self.config.hptune_metric:
      hptune.check_metric(self.config.hptune_metric, available=[
          "loss", *parts.metric_sums.results({})])
    self.model_memory = memory.estimate_model_memory(
        parts.model, parts.optimizer, sharded=parts.trainer.sharded)
    _log_model_memory(self.model_memory)
    return parts

  def _input_position(self) -> Optional[input_position_lib.InputPosition]:
    """The checkpointed input position: synchronous strategies reading
    TFRecord files or `tfdist.fit`'s arrays (parameter-server workers read
    unseeded copies of every file; a user's dataset function may order its
    examples differently in every pass, so its epoch resumes from its
    start). The arrays' layout names them as one file of their rows."""
    config, plan, spec = self.config, self.plan, self.task.dataset
    arrays = getattr(spec.input_fn, input_pipeline.SHARDS_BY_EXAMPLE, False)
    if not (config.checkpoint_input_position and
            not self.kind.is_asynchronous and (spec.reads_files or arrays)):
      return None
    files, counts = plan.train_files, plan.train_file_counts
    if not spec.reads_files:
      files, counts = ["<in-memory arrays>"], [plan.num_train_examples]
    return input_position_lib.InputPosition(
        input_position_lib.input_layout(
            files=files, file_record_counts=counts,
            num_input_pipelines=self.kind.num_input_pipelines(
                self.num_workers),
            global_batch_size=plan.global_batch_size, seed=config.seed,
            shuffle_buffer_size=config.shuffle_buffer_size,
            cache=config.cache_dataset),
        steps_per_epoch=plan.steps_per_epoch)

  def build_checkpoints(self) -> CheckpointKeeper:
    """The checkpoint keeper: saves, restores, keeps the input position."""
    parts = self.parts
    state = list(parts.model.variables)
    if parts.optimizer is not None:
      known = {id(v) for v in state}
      state += [v for v in parts.optimizer.variables if id(v) not in known]
    return CheckpointKeeper(
        checkpoint=parts.checkpoint,
        directory=self.out_dir(self.config.resolved_checkpoint_dir,
                               "checkpoints"),
        step_counter=parts.trainer.global_step,
        max_to_keep=self.config.max_checkpoints,
        restore_dir=self.config.resolved_checkpoint_dir,
        input_position=self._input_position(), variables=state,
        before_save=self.lease.check if self.lease is not None else None)

  def warm_start(self) -> Optional[str]:
    """`--init_checkpoint` for a fresh run; returns what was loaded."""
    config = self.config
    if not config.init_checkpoint or tf.train.latest_checkpoint(
        config.resolved_checkpoint_dir):
      # A resumed run starts from its own checkpoint (which the controller
      # restores).
      return None
    return assembly.load_init_checkpoint(self.parts.model,
                                         config.init_checkpoint)

  def build_inputs(self) -> Tuple[Any, Optional[Callable[[], dict]]]:
    """`(step_runner, evaluate)`: the input pipelines and what runs the
    steps on them; `evaluate` (None under `--mode=train`) evaluates the
    held-out data once."""
    if self.kind.is_asynchronous:
      self.strategy_details = self._describe_parameter_servers()
      return _parameter_server_runner(
          self.config, spec=self.task.dataset, plan=self.plan,
          strategy=self.strategy, parts=self.parts, keeper=self.keeper)
    return self._local_runner(), self._local_evaluation()

  def _describe_parameter_servers(self) -> dict:
    """Logs and checks the variables' placement on the ps tasks; returns
    the manifest's `strategy_details`."""
    config, model = self.config, self.parts.model
    placement = ps_lib.describe_placement(
        model, self.parts.optimizer,
        large_bytes=min(config.ps_min_shard_bytes, 64 << 10))
    logging.info("%s", ps_lib.format_placement(placement))
    ps_lib.check_shard_layout(config.resolved_checkpoint_dir, model)
    ps_lib.write_shard_layout(config.resolved_checkpoint_dir, model)
    return {"num_workers": self.num_workers, "num_ps": self.cluster.num_ps,
            "cluster": self.cluster.cluster_dict(),
            "partitioner": config.ps_partitioner,
            "min_shard_bytes": config.ps_min_shard_bytes,
            "max_shards": config.ps_max_shards or self.cluster.num_ps,
            "steps_per_execution": config.steps_per_execution,
            "placement": placement}

  def _local_runner(self) -> step_runner.LocalStepRunner:
    """The synchronous strategies' step runner over the training input."""
    config, plan, strategy = self.config, self.plan, self.strategy
    input_position = self.keeper.input_position
    train_options = input_pipeline.options_for(
        self.task.dataset, files=plan.train_files,
        global_batch_size=plan.global_batch_size, is_training=True,
        shuffle_buffer_size=config.shuffle_buffer_size,
        cache=config.cache_dataset, seed=config.seed,
        file_record_counts=plan.train_file_counts,
        gradient_accumulation_steps=plan.batch.gradient_accumulation_steps,
        # A resumable position needs a reproducible reading order.
        deterministic=config.deterministic or input_position is not None,
        # A dataset function's epochs of whole steps (as files'): the
        # examples each pipeline reads per epoch.
        examples_per_epoch=(
            None if self.task.dataset.reads_files else
            plan.steps_per_epoch * plan.global_batch_size //
            self.kind.num_input_pipelines(self.num_workers)))

    def train_iterator(restored_step: int):
      """The training input from the restored step's position: where the
      checkpoint left the epoch, or the start of that epoch."""
      if input_position is not None:
        start = input_position.resume_step(restored_step)
      else:
        start = input_position_lib.epoch_start(restored_step,
                                               plan.steps_per_epoch)
      return iter(input_pipeline.distribute(
          strategy, dataclasses.replace(train_options, start_step=start)))

    return step_runner.LocalStepRunner(
        trainer=self.parts.trainer, iterator_fn=train_iterator,
        num_workers=self.num_workers)

  def _local_evaluation(self) -> Optional[Callable[[], dict]]:
    """Held-out evaluation under the run's strategy (None: `--mode=train`)."""
    if self.config.mode == "train":
      return None
    plan, trainer = self.plan, self.parts.trainer
    eval_data = input_pipeline.distribute(
        self.strategy, input_pipeline.options_for(
            self.task.dataset, files=plan.eval_files,
            # Micro-batches: what a step's memory was sized for.
            global_batch_size=plan.eval_batch_size,
            is_training=False,
            cache=self.config.cache_dataset,
            # TPUs need static shapes: pad the last batches, masked in the
            # metrics.
            pad_to_static_batches=self.kind.is_tpu))
    return lambda **hooks: trainer.evaluate(eval_data, **hooks)

  def build_run_log(self) -> run_log_lib.RunLog:
    """Log lines, TensorBoard scalars and the writer's `metrics.jsonl`."""
    return run_log_lib.RunLog(
        tensorboard_dir=self.out_dir(self.config.resolved_tensorboard_dir,
                                     "tensorboard"),
        metrics_dir=self.config.model_dir if self.is_writer else None,
        global_batch_size=self.plan.global_batch_size,
        total_steps=self.plan.total_steps,
        summarize=self.parts.trainer.summarize,
        loss_explosion_factor=self.config.loss_explosion_factor)

  def build_callbacks(self) -> List[keras.callbacks.Callback]:
    """TensorBoard, the caller's callbacks, and hyperparameter tuning's."""
    tensorboard_dir = self.out_dir(self.config.resolved_tensorboard_dir,
                                   "tensorboard")
    callbacks = [run_log_lib.TrainingTensorBoard(log_dir=tensorboard_dir,
                                                 write_graph=False)]
    # Other workers' file-writing callbacks write into their scratch folder.
    callbacks += keras_callbacks.for_this_task(
        self.callbacks,
        scratch_dir=None if self.is_writer else self.scratch_dir)
    if self.hypertune_reporter is not None and self.is_writer:
      # The chief reports each evaluation's metric (every strategy).
      callbacks.append(hptune.HypertuneCallback(
          self.config.hptune_metric, reporter=self.hypertune_reporter,
          step_fn=lambda: self.controller.step))
    return callbacks

  def build_profiler(self) -> Optional[profiling.ProfileWindow]:
    """`--profile_steps` on the writer (other workers' folders are
    scratch)."""
    if not (self.config.profile_steps and self.is_writer):
      return None
    return profiling.ProfileWindow(
        self.config.profile_steps,
        os.path.join(self.config.resolved_tensorboard_dir, "train"))

  def build_controller(self, callbacks: Sequence[keras.callbacks.Callback]
                       ) -> Controller:
    """The outer loop: steps, checkpoints, evaluations, callbacks."""
    config, plan, optimizer = self.config, self.plan, self.parts.optimizer
    options = ControllerOptions(
        total_steps=plan.total_steps, steps_per_epoch=plan.steps_per_epoch,
        log_steps=config.log_steps, checkpoint_steps=config.checkpoint_steps,
        epochs_between_evals=config.epochs_between_evals,
        max_consecutive_skipped_steps=config.max_consecutive_skipped_steps)
    return Controller(
        runner=self.step_runner, options=options, checkpoints=self.keeper,
        step_counter=self.parts.trainer.global_step, run_log=self.run_log,
        evaluate=self.evaluate, model=self.parts.model,
        learning_rate=lambda: assembly.current_learning_rate(optimizer),
        loss_scale=lambda: precision.current_loss_scale(optimizer),
        callbacks=callbacks, preemption=self.watcher,
        profiler=self.profiler)

  def run_controller(self) -> controller_lib.ControllerResult:
    """Trains; a lost ps task or peer becomes one named error.

    Raises:
      tfdist.runtime.preemption.PreemptedError: stopped after a checkpoint.
      tfdist.distribute.parameter_server.ParameterServerError: a ps task was
        lost.
      tfdist.training.step_runner.PeerLostError: a MultiWorkerMirrored peer was
        lost.
    """
    controller = self.controller
    try:
      return controller.run()
    except preemption.PreemptedError:
      if self.is_writer:
        # Servers and side-car evaluators stop with the chief.
        done_marker.mark_done(self.config.model_dir)
      raise
    except step_runner.PS_LOST_ERRORS + step_runner.PEER_LOST_ERRORS as e:
      if self.kind.is_asynchronous:
        # Noticed outside the step runner (a checkpoint save, an
        # evaluation).
        raise step_runner.ps_lost_error(
            e, after=f"step {controller.step}",
            last_checkpoint=self.keeper.latest) from e
      if (self.kind is StrategyKind.MULTI_WORKER_MIRRORED and
          isinstance(e, step_runner.PEER_LOST_ERRORS)):
        # A collective (a step, a save, the agreement) failed or timed out.
        raise step_runner.peer_lost_error(
            e, after=f"step {controller.step}",
            last_checkpoint=self.keeper.latest,
            own=(self.cluster.task_type, self.cluster.task_index),
            addresses=self.cluster.cluster) from e
      raise
    finally:
      self.watcher.uninstall()

  def build_export(self) -> str:
    """The SavedModel of the trained model; returns its folder (the
    scratch folder's on other workers: saving is collective)."""
    model = self.parts.model
    if self.kind.is_asynchronous:
      # The tables are ShardedVariables on the ps tasks, which a SavedModel
      # cannot capture: export a local copy restored from the final
      # checkpoint (each table one variable again).
      model = assembly.build_model(
          run_options.assembly_options(self.config), task=self.task,
          sync_batch_norm=self.plan.sync_batch_norm)
      tf.train.Checkpoint(model=model).restore(
          self.keeper.latest).expect_partial()
    return export.export_saved_model(
        model, self.out_dir(self.config.resolved_export_dir, "saved_model"),
        source=self._export_source() if self.is_writer else "TMPDIR",
        details={"step": self.controller.step,
                 "model": self.task.model_name},
        last_checkpoint=self.keeper.latest)

  def _artifacts(self) -> dict:
    config = self.config
    return {"checkpoint": self.keeper.latest,
            "checkpoint_dir": config.resolved_checkpoint_dir,
            "saved_model": config.resolved_export_dir,
            "tensorboard": config.resolved_tensorboard_dir,
            "metrics": os.path.join(config.model_dir,
                                    run_log_lib.METRICS_FILE),
            "init_checkpoint": self.warm_started,
            "profile": (self.profiler.latest_trace if self.profiler
                        else None)}

  def build_manifest(self) -> dict:
    """The run manifest (`tfdist.observability.manifest.build_manifest`)."""
    optimizer, result = self.parts.optimizer, self.result
    return manifest_lib.build_manifest(
        run_options.manifest_options(self.config),
        ran=manifest_lib.WhatRan(
            decision=self.decision, plan=self.plan,
            dtype_policy=self.policy.name,
            loss_scale=precision.current_loss_scale(optimizer),
            optimizer_iterations=int(optimizer.iterations.numpy()),
            result=result, run_log=self.run_log,
            objectives=self.parts.objectives,
            model_name=self.task.model_name,
            model_memory=self.model_memory.to_dict(),
            strategy_details=self.strategy_details),
        where=manifest_lib.WhereItRan(
            cluster=self.cluster, choice=self.choice,
            num_workers=self.num_workers, is_chief=self.is_writer,
            devices=devices.describe_devices(),
            environment_applied=self.applied, trial_fields=self.trial_fields),
        wrote=manifest_lib.WhatItWrote(
            artifacts=self._artifacts(),
            seconds={"total": time.time() - self.started,
                     "training": result.train_seconds,
                     "training_all_processes":
                         self.run_log.training_seconds()}))

  def write_outputs(self, record: dict) -> None:
    """The writer writes the manifest and prints the final evaluation;
    other workers delete their scratch folder."""
    if not self.is_writer:
      shutil.rmtree(self.scratch_dir, ignore_errors=True)
      logging.info("%s %d done; the chief writes the artifacts.",
                   self.cluster.task_type, self.cluster.task_index)
      return
    path = manifest_lib.write_manifest(self.config.model_dir, record)
    logging.info("Run manifest: %s; SavedModel: %s", path, self.export_dir)
    final_eval = self.result.final_eval
    if final_eval and self.print_final_eval:
      print("Final eval: " + run_log_lib.format_metrics(
          run_log_lib.metric_values(final_eval)) +
            f" ({final_eval['num_examples']} examples). Artifacts in "
            f"{self.config.model_dir}", flush=True)

  def leave_together(self, failed: bool = False) -> None:
    """MultiWorkerMirrored: the final barrier, then (with an `exit_plan`,
    unless this task or another arrived `failed`) the process ends here,
    the chief last.

    Raises:
      tfdist.training.step_runner.PeerLostError: a peer was lost at the barrier.
      tfdist.errors.PeerStoppedError: another task arrived `failed`.
    """
    if self.kind is not StrategyKind.MULTI_WORKER_MIRRORED:
      return
    cluster = self.cluster
    # No worker leaves while another still needs it (the chief hosts the
    # coordination service).
    try:
      worker_exit.leave_together(self.strategy, num_workers=self.num_workers,
                                 failed=failed)
    except step_runner.PEER_LOST_ERRORS as e:
      raise step_runner.peer_lost_error(
          e, after="the final barrier", last_checkpoint=self.keeper.latest,
          own=(cluster.task_type, cluster.task_index),
          addresses=cluster.cluster) from e
    if failed or self.exit_plan is None or self.num_workers <= 1:
      return

    def release():
      self.cleanup.close()  # The lease, the signal handlers.
      # Side-car evaluators stop with the chief.
      done_marker.mark_done(self.config.model_dir)

    # Never returns: the runner's objects stay alive until the process ends.
    worker_exit.leave_process(
        self.exit_plan, task_type=cluster.task_type,
        task_index=cluster.task_index, jobs=cluster.cluster,
        is_chief=self.is_writer, before_exit=release)


def _parameter_server_runner(config, *, spec, plan, strategy, parts, keeper):
  """The coordinator's step runner and in-process evaluation."""
  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
  train_options = input_pipeline.options_for(
      spec, files=plan.train_files,
      global_batch_size=plan.global_batch_size, is_training=True,
      shuffle_buffer_size=config.shuffle_buffer_size,
      cache=config.cache_dataset,
      # Unseeded: each worker must shuffle its copy differently.
      seed=None)

  def per_worker_dataset_fn():
    return strategy.distribute_datasets_from_function(
        lambda ctx: input_pipeline.make_dataset(train_options, ctx))

  # Each worker must shuffle differently. With a global seed set (--seed),
  # the shuffles' op seeds would be fixed when the dataset function is
  # traced here, once, and every worker would read the same examples in the
  # same order (each batch applied once per worker). Unseeded, each worker's
  # shuffle draws its own seed at run time.
  tf.random.set_seed(None)
  iterator = iter(coordinator.create_per_worker_dataset(
      per_worker_dataset_fn))
  # After a divergence, the input read again here, unshuffled (every
  # worker reads all of it): an epoch of it at most.
  reread_options = dataclasses.replace(train_options, shuffle_buffer_size=0)
  runner = step_runner.CoordinatorStepRunner(
      trainer=parts.trainer, coordinator=coordinator, iterator=iterator,
      last_checkpoint=lambda: keeper.latest,
      reread_fn=lambda: input_pipeline.make_dataset(reread_options),
      reread_batches=plan.steps_per_epoch)
  if config.mode == "train":
    return runner, None
  # Held-out evaluation on the coordinator (it reads the ps tasks'
  # variables), with the default strategy.
  eval_batch = plan.eval_batch_size
  evaluator = assembly.evaluation_trainer(parts,
                                          global_batch_size=eval_batch)
  eval_data = input_pipeline.make_dataset(input_pipeline.options_for(
      spec, files=plan.eval_files, global_batch_size=eval_batch,
      is_training=False, cache=config.cache_dataset))
  return runner, lambda **hooks: evaluator.evaluate(eval_data, **hooks)


def planned_replicas(config, *, decision, cluster) -> Tuple[int, int]:
  """`(num_replicas_in_sync, num_workers)` a run will have, without
  building its strategy (for `--dry_run`; TPUs are asked).

  Raises:
    ConfigError: as `tfdist.distribute.strategy.make_strategy` (TPU only).
  """
  kind = StrategyKind.parse(decision.strategy)
  num_workers = training_workers(kind, cluster)
  gpus = len(tf.config.list_physical_devices("GPU"))
  if config.num_gpus >= 0:
    gpus = min(gpus, config.num_gpus)
  if kind is StrategyKind.MIRRORED:
    return (gpus or max(config.num_cpu_devices, 1)), num_workers
  if kind is StrategyKind.MULTI_WORKER_MIRRORED:
    return num_workers * max(gpus, 1), num_workers
  if kind.is_tpu:
    choice = strategy_lib.make_strategy(
        run_options.strategy_options(config), cluster=cluster)
    return choice.strategy.num_replicas_in_sync, num_workers
  return 1, num_workers


def _dry_run(prepared: PreparedRun, *, task, writer: bool) -> dict:
  """`--dry_run`: the checks that need the data and the plan, no model."""
  config, cluster = prepared.config, prepared.cluster
  replicas, num_workers = planned_replicas(
      config, decision=prepared.decision, cluster=cluster)
  plan = run_plan_lib.make_run_plan(
      run_options.plan_options(config), task.dataset,
      num_replicas_in_sync=replicas,
      num_workers=num_workers, asynchronous=prepared.kind.is_asynchronous,
      decision=prepared.decision)
  logging.info("%s", plan.describe(run_options.plan_options(config)))
  notes = _check_resume(config, plan) if writer else []
  print(f"tfdist: dry run: every start-up check passed ({cluster.task_type} "
        f"{cluster.task_index}; {plan.num_train_examples} training and "
        f"{plan.num_eval_examples} evaluation examples read, output folders "
        "writable); nothing was built or trained.", flush=True)
  return {"dry_run": True, "role": cluster.task_type,
          "index": cluster.task_index,
          "global_batch_size": plan.global_batch_size,
          "num_replicas_in_sync": plan.batch.num_replicas_in_sync,
          "total_steps": plan.total_steps,
          "num_train_examples": plan.num_train_examples,
          "num_eval_examples": plan.num_eval_examples,
          "resume_notes": notes}


def _check_resume(config, plan) -> list:
  """Compares this run with the one that wrote `--model_dir`'s checkpoint
  (the writing process only); returns what changed (logged).

  Raises:
    tfdist.training.checkpointing.IncompatibleResumeError: a changed model or
      global batch without `--allow_incompatible_resume`.
  """
  directory = config.resolved_checkpoint_dir
  latest = tf.train.latest_checkpoint(directory)
  if not latest:
    return []
  previous = checkpointing.read_run_record(directory, config.model_dir)
  if previous is None:
    return []
  try:
    restored_step = checkpoint_paths.checkpoint_step(latest, default=0)
  except (IndexError, ValueError):
    restored_step = 0
  notes = checkpointing.check_resume(
      previous, checkpointing.run_record(
          run_options.run_record_settings(config), plan), checkpoint=latest,
      restored_step=restored_step, allow=config.allow_incompatible_resume)
  if notes:
    logging.warning("tfdist: resuming from %s, which a run with other "
                    "settings wrote: %s.", latest, "; ".join(notes))
  return notes


@dataclasses.dataclass(frozen=True)
class EvaluatorPlan:
  """How an evaluator process evaluates: as the run evaluates, where it can.

  Attributes:
    strategy: the `StrategyKind` it evaluates under (`mirrored`,
      `one_device`, or `off`: the default strategy); equal to its name.
    global_batch_size: examples per evaluation batch, over all its replicas.
    batch_source: where the batch came from, for the log.
    reason: why this strategy.
  """
  strategy: str
  global_batch_size: int
  batch_source: str
  reason: str


def _local_devices(config: TrainConfig) -> int:
  """Devices a mirrored evaluator would use in this process."""
  gpus = len(tf.config.list_physical_devices("GPU"))
  if config.num_gpus != 0 and gpus:
    return gpus if config.num_gpus < 0 else min(gpus, config.num_gpus)
  return max(1, config.num_cpu_devices)


def _recorded_kind(record: Optional[dict]) -> Optional[StrategyKind]:
  """The strategy a run record names, or None (no record, no name, or a
  name this version does not know)."""
  try:
    return StrategyKind.parse(record["strategy"])
  except (TypeError, KeyError, ValueError):
    return None


def _evaluation_batch(config: TrainConfig, *, kind: StrategyKind,
                      run_record: Optional[dict]) -> Tuple[int, str]:
  """`(global batch, where it came from)` for `evaluator_plan`."""
  if run_record and run_record.get("eval_batch_size"):
    return int(run_record["eval_batch_size"]), "the run's record"
  if run_record and run_record.get("global_batch_size"):
    batch = int(run_record["global_batch_size"])
    recorded = _recorded_kind(run_record)
    if recorded is not None and recorded.is_asynchronous:
      batch = max(batch, MIN_EVAL_BATCH_SIZE)
    return batch, "the run's record (global batch)"
  if config.batch_size and kind.is_asynchronous:
    # An evaluator task may start before the chief records the run: the
    # same flags give the coordinator's rule.
    return (max(config.batch_size, MIN_EVAL_BATCH_SIZE),
            "--batch_size (the coordinator's rule)")
  if config.batch_size:
    return (max(1, config.batch_size // config.gradient_accumulation_steps),
            "--batch_size / --gradient_accumulation_steps")
  return MIN_EVAL_BATCH_SIZE, "the default"


def evaluator_plan(config: TrainConfig, *, run_strategy: str,
                   run_record: Optional[dict]) -> EvaluatorPlan:
  """The strategy and batch an evaluator (`--mode=eval`,
  `--mode=continuous_eval`, an `evaluator` task) uses: the run's.

  Strategy: the run's where this process holds its devices (`mirrored`,
  `one_device`, `off`); under `multi_worker_mirrored` or
  `parameter_server` the evaluator is one process outside the cluster, so
  it mirrors over its local devices (`mirrored` when there are several,
  else `one_device`); under `tpu`, `one_device` (a TPU evaluator would
  hold the TPU the run trains on).

  Batch: the run's evaluation batch (`RunPlan.eval_batch_size`, recorded in
  the checkpoint folder's run record), else the record's
  `global_batch_size`, else the same rule on `config.batch_size` (an
  evaluator task may start before the chief writes the record; it has the
  job's flags), else `MIN_EVAL_BATCH_SIZE`. A mirrored evaluator whose
  replicas do not divide the batch evaluates on one device instead (the
  batch is kept: the
  metrics do not depend on it, summed over examples, but a per-batch
  metric would; `run_evaluator` checks this once the strategy is built).

  Args:
    config: the evaluator's `TrainConfig`.
    run_strategy: the run's strategy name (`--distribution_strategy`, or
      the one the run recorded when the evaluator was given `auto`), or its
      `StrategyKind`.
    run_record: `run_config.json` of the checkpoint folder, or None.

  Raises:
    ValueError: `run_strategy` is no concrete strategy name.
  """
  kind = StrategyKind.parse(run_strategy)
  batch, source = _evaluation_batch(config, kind=kind, run_record=run_record)
  if kind.is_single_process and not kind.is_tpu:
    name, reason = kind, "the run's strategy"
  elif kind.is_tpu:
    name, reason = StrategyKind.ONE_DEVICE, (
        "the run trains on TPU; the evaluator uses one local device")
  else:
    local = _local_devices(config)
    name = StrategyKind.MIRRORED if local > 1 else StrategyKind.ONE_DEVICE
    reason = (f"the run's {kind} spans processes; the evaluator is "
              f"one process: its {local} local device(s)")
  return EvaluatorPlan(strategy=name, global_batch_size=batch,
                       batch_source=source, reason=reason)


class EvaluatorRunner:
  """The side-car evaluator's run, built by named steps (as
  `ExperimentRunner`): `run()` calls `build_plan`, `build_strategy`,
  `build_model`, `build_controller`, then `evaluate_once` or
  `evaluate_continuously`. Override a step by subclassing.

  Attributes:
    config, task, cluster, decision: as `run_evaluator` takes them.
    once: evaluate the latest checkpoint and stop (`--mode=eval`).
    latest: that checkpoint (None unless `once`).
    final_step, eval_files, how: set by `build_plan` (`how`: the
      `EvaluatorPlan`).
    choice, strategy, parts, trainer, dataset, run_log, controller: set by
      the later steps.

  Raises:
    ConfigError: `once` and no checkpoint to evaluate (in `__init__`).
  """

  def __init__(self, config: TrainConfig, *, task: task_lib.Task, cluster,
               decision, poll_seconds: float = 2.0,
               idle_timeout: Optional[float] = None, once: bool = False):
    self.started = time.time()
    self.config, self.task = config, task
    self.cluster, self.decision = cluster, decision
    self.poll_seconds, self.idle_timeout, self.once = (poll_seconds,
                                                       idle_timeout, once)
    self.checkpoint_dir = config.resolved_checkpoint_dir
    self.latest = (tf.train.latest_checkpoint(self.checkpoint_dir) if once
                   else None)
    if once and not self.latest:
      raise ConfigError(
          f"--mode=eval: no checkpoint in {self.checkpoint_dir} to evaluate."
          " Train first (same --model_dir), or point --checkpoint_dir at "
          "one.")
    self.final_step = self.eval_files = self.how = None
    self.choice = self.strategy = self.parts = self.trainer = None
    self.dataset = self.run_log = self.controller = None

  def run(self) -> dict:
    """Returns `{"role": "evaluator", "results": [...]}`."""
    self.final_step, self.eval_files, self.how = self.build_plan()
    self.choice = self.build_strategy()
    self.strategy = self.choice.strategy
    self.parts, self.trainer, self.dataset = self.build_model()
    self.run_log = self.build_run_log()
    self.controller = self.build_controller()
    if self.once:
      return self.evaluate_once()
    return self.evaluate_continuously()

  def build_plan(self) -> Tuple[int, Sequence[str], EvaluatorPlan]:
    """`(final step, evaluation files, EvaluatorPlan)`."""
    config, spec = self.config, self.task.dataset
    plan = run_plan_lib.make_run_plan(
        run_options.plan_options(config), spec, num_replicas_in_sync=1,
        num_workers=1,
        asynchronous=True, decision=self.decision) if (
            config.train_steps <= 0 and not self.once) else None
    final_step = (checkpoint_paths.checkpoint_step(self.latest) if self.once
                  else config.train_steps if config.train_steps > 0 else
                  plan.total_steps)
    eval_files = (plan.eval_files if plan else
                  run_plan_lib.resolve_data_files(
                      run_options.data_options(config), spec)[1])
    record = checkpointing.read_run_record(self.checkpoint_dir,
                                           config.model_dir)
    # Told no strategy (`auto`), it evaluates with the one the run recorded.
    run_strategy = (record["strategy"] if record and record.get("strategy")
                    and self.decision.strategy_reason.startswith("auto")
                    else self.decision.strategy)
    how = evaluator_plan(config, run_strategy=run_strategy,
                         run_record=record)
    return final_step, eval_files, how

  def build_strategy(self) -> strategy_lib.StrategyChoice:
    """The plan's strategy; one device when its replicas do not divide the
    evaluation batch (`how` then says so)."""
    config, how = self.config, self.how
    precision.configure_precision(config.dtype)
    if how.strategy == StrategyKind.MIRRORED:
      devices.configure_cpu_devices(config.num_cpu_devices)
    choice = strategy_lib.make_strategy(run_options.strategy_options(
        config.replace(distribution_strategy=str(how.strategy))))
    replicas = choice.strategy.num_replicas_in_sync
    if how.global_batch_size % replicas:
      self.how = dataclasses.replace(
          how, strategy=StrategyKind.ONE_DEVICE, reason=(
              f"{replicas} local replicas do not divide the run's "
              f"evaluation batch {how.global_batch_size}"))
      choice = strategy_lib.make_strategy(run_options.strategy_options(
          config.replace(distribution_strategy=str(StrategyKind.ONE_DEVICE))))
    logging.info("Evaluator: %s, %d replica(s) (%s); global batch %d (from "
                 "%s)", self.how.strategy,
                 choice.strategy.num_replicas_in_sync, self.how.reason,
                 self.how.global_batch_size, self.how.batch_source)
    return choice

  def build_model(self) -> Tuple[assembly.Parts, Any, Any]:
    """`(parts, trainer, dataset)`: the model with its loss and metrics,
    what evaluates it, and the distributed evaluation data."""
    strategy, batch = self.strategy, self.how.global_batch_size
    with strategy.scope():
      parts = assembly.evaluation_parts(
          run_options.assembly_options(self.config), task=self.task)
    trainer = assembly.evaluation_trainer(parts, global_batch_size=batch,
                                          strategy=strategy)
    dataset = input_pipeline.distribute(strategy, input_pipeline.options_for(
        self.task.dataset, files=self.eval_files, global_batch_size=batch,
        is_training=False, cache=self.config.cache_dataset))
    return parts, trainer, dataset

  def build_run_log(self) -> run_log_lib.RunLog:
    """TensorBoard scalars under `<tensorboard_dir>/eval/`."""
    return run_log_lib.RunLog(
        tensorboard_dir=self.config.resolved_tensorboard_dir,
        metrics_dir=None, global_batch_size=self.how.global_batch_size,
        total_steps=self.final_step, eval_subdir="eval")

  def build_controller(self) -> Controller:
    """A controller that only evaluates; each result says how."""
    how, trainer, dataset = self.how, self.trainer, self.dataset
    evaluated_with = {"strategy": str(how.strategy),
                      "num_replicas_in_sync":
                          self.strategy.num_replicas_in_sync,
                      "global_batch_size": how.global_batch_size,
                      "reason": how.reason}
    return Controller(
        options=ControllerOptions(total_steps=max(self.final_step, 1),
                                  steps_per_epoch=1),
        run_log=self.run_log,
        evaluate=lambda: {**trainer.evaluate(dataset),
                          "evaluated_with": evaluated_with},
        model=self.parts.model)

  def restore(self, path: str) -> None:
    tf.train.Checkpoint(model=self.parts.model).restore(path).expect_partial()

  @property
  def results_dir(self) -> str:
    return os.path.join(self.config.model_dir, "eval")

  def evaluate_once(self) -> dict:
    """`--mode=eval`: the latest checkpoint, once."""
    self.restore(self.latest)
    result = self.controller.evaluate(self.final_step)
    result.update(checkpoint=self.latest)
    controller_lib.append_eval_result(self.results_dir, result)
    self.run_log.flush()
    print(f"Eval of {self.latest}: {run_log_lib.format_eval(result)}",
          flush=True)
    return {"role": "evaluator", "results": [result]}

  def evaluate_continuously(self) -> dict:
    """Each new checkpoint once, until the final step's, the done marker,
    or `idle_timeout`."""
    config = self.config
    logging.info("Evaluator for %d training worker(s): final step %d%s",
                 training_workers(StrategyKind.parse(self.decision.strategy),
                                  self.cluster), self.final_step,
                 "" if config.train_steps > 0 else
                 " (from --train_epochs; the chief's done marker also ends "
                 "the evaluation)")
    results = self.controller.evaluate_continuously(
        checkpoint_dir=self.checkpoint_dir, results_dir=self.results_dir,
        restore=self.restore, final_step=self.final_step,
        finished=lambda: done_marker.marked_done_since(config.model_dir,
                                                  self.started),
        poll_seconds=self.poll_seconds, idle_timeout=self.idle_timeout)
    return {"role": "evaluator", "results": results}


def run_evaluator(config: TrainConfig, *, task, cluster, decision,
                  poll_seconds: float = 2.0,
                  idle_timeout: Optional[float] = None,
                  once: bool = False) -> dict:
  """The side-car evaluator: evaluates each checkpoint once, in step order.

  For an `evaluator` task of any strategy (it is never a cluster member: it
  joins no collective and writes no checkpoint, SavedModel or manifest),
  and for `--mode=continuous_eval`. It stops after the final step's
  checkpoint, once the chief marks the run done, or after `idle_timeout`
  seconds without a new checkpoint. With `once` (`--mode=eval`) it
  evaluates the latest checkpoint and returns. Results go to
  `<model_dir>/eval/eval_results.jsonl` and TensorBoard scalars to
  `<tensorboard_dir>/eval/`. It evaluates as the run does
  (`evaluator_plan`): the run's strategy where this process has its
  devices (else `mirrored`/`one_device` over the local devices) and the
  run's evaluation batch, so one checkpoint gives the run's numbers; each
  result records them under `evaluated_with`. Checkpoints of every
  strategy load into the local model (parameter servers' sharded tables
  included). The steps are `EvaluatorRunner`'s.

  Returns:
    `{"role": "evaluator", "results": [...]}`.

  Raises:
    ConfigError: `once` and no checkpoint to evaluate.
  """
  return EvaluatorRunner(config, task=task, cluster=cluster,
                         decision=decision, poll_seconds=poll_seconds,
                         idle_timeout=idle_timeout, once=once).run()
