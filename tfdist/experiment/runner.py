"""The training runner: one training process's run, built by named steps.

`ExperimentRunner.train` builds the strategy, the plan, the model, the
inputs, the controller and the artifacts in order; what one strategy does
its own way (its strategy, inputs, failures, export, finishing together)
is its backend's (`tfdist.backends`), so no step here asks which strategy
runs.
"""

import atexit
import contextlib
import gc
import os
import shutil
import tempfile
import time
from typing import Any, List, Optional, Sequence

from absl import logging
import keras
import tensorflow as tf

from tfdist.cloud import hptune
from tfdist import errors
from tfdist.backends import base as backend_lib
from tfdist.config import OutputsConfig
from tfdist.data import input_pipeline
from tfdist.data import input_position as input_position_lib
from tfdist.distribute import cluster as cluster_lib
from tfdist.distribute import devices
from tfdist.distribute import lease as lease_lib
from tfdist.distribute import strategy as strategy_lib
from tfdist.distribute import worker_exit
from tfdist.experiment import dry_run as dry_run_lib
from tfdist.experiment import prepare
from tfdist.observability import manifest as manifest_lib
from tfdist.observability import profiling
from tfdist.parallel import mode as mode_lib
from tfdist.observability import run_log as run_log_lib
from tfdist.runtime import failures
from tfdist.runtime import preemption
from tfdist.training.plan import preflight
from tfdist.training import assembly
from tfdist.training.state import checkpointing
from tfdist.training import controller as controller_lib
from tfdist.training.plan import differences
from tfdist.distribute import done_marker
from tfdist.training.state import export
from tfdist.training.state import keras_callbacks
from tfdist.training.plan import memory
from tfdist.training.step import moving_statistics
from tfdist.training.step import precision
from tfdist.training.plan import run_plan as run_plan_lib
from tfdist.training import task as task_lib
from tfdist.training.state.checkpointing import CheckpointKeeper
from tfdist.training.controller import Controller, ControllerOptions

def _worker_scratch_dir(cluster: cluster_lib.ClusterInfo) -> str:
  """A local folder for a non-chief worker's writes, deleted at exit.

  Raises:
    tfdist.errors.OutputNotWritableError: it cannot be made or
      written.
  """
  parent = os.environ.get("TEST_TMPDIR") or tempfile.gettempdir()
  try:
    path = tempfile.mkdtemp(
        prefix=f"tfdist-{cluster.task_type}{cluster.task_index}-",
        dir=parent)
  except OSError as e:
    raise errors.OutputNotWritableError(
        f"The scratch folder of {cluster.task_type} {cluster.task_index} "
        f"(under {parent}: $TMPDIR) is not writable: {e}. Point TMPDIR at "
        "a writable local folder.") from None
  atexit.register(shutil.rmtree, path, True)
  preflight.probe_writable(path, flag="TMPDIR", value=parent)
  return path


def _check_profile_window(outputs: OutputsConfig, plan) -> None:
  """Raises `ConfigError` for a `--profile_steps` window (the outputs
  section's) after the run."""
  window = outputs.profile_steps
  if window and window[0] > plan.total_steps:
    raise errors.ConfigError(
        f"--profile_steps={window[0]},{window[1]}"
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
    backend: its `tfdist.backends.base.Backend`: what this strategy does
      its own way.
    role: this process's `tfdist.backends.base.Role`.
    is_writer: this process writes `--model_dir` (the only process, the
      MultiWorkerMirrored chief, the parameter-server coordinator); the
      other MultiWorkerMirrored workers write to a scratch folder.
    num_workers: the processes that run training steps
      (`training_workers`).
    lease: the `--model_dir` lease of the writer (None elsewhere).
    cleanup: what `run` undoes however the run ends (an `ExitStack`).
  Attributes set by the steps: `choice`, `strategy`, `watcher`, `plan`,
  `policy`, `parts`, `moving_statistics`, `model_memory`, `keeper`,
  `warm_started`, `strategy_details`, `step_runner`, `evaluate`, `run_log`,
  `profiler`, `controller`, `result`, `export_dir`. Once a run has ended, `run`
  releases the training objects (the parameter-server coordinator removes
  its functions from the servers as they are freed, before the done
  marker).
  """

  # The training objects `run` releases once the run is over.
  _TRAINING_OBJECTS = ("choice", "strategy", "watcher", "parts",
                       "moving_statistics", "keeper", "step_runner",
                       "evaluate", "run_log", "profiler", "controller")

  def __init__(self, prepared: prepare.PreparedRun, *, task: task_lib.Task,
               callbacks: Sequence[keras.callbacks.Callback] = (),
               exit_plan: Optional[worker_exit.ExitPlan] = None,
               started: Optional[float] = None,
               hypertune_reporter: Any = None,
               print_final_eval: bool = True,
               train_actions: Sequence[controller_lib.Action] = (),
               eval_actions: Sequence[Any] = ()):
    self.prepared = prepared
    self.print_final_eval = print_final_eval
    self.train_actions = tuple(train_actions)
    self.eval_actions = tuple(eval_actions)
    self.config = prepared.config
    self.cluster = prepared.cluster
    self.decisions = prepared.decisions
    self.decision = prepared.decision
    self.applied = prepared.environment_applied
    self.trial_fields = prepared.trial_fields
    self.kind = prepared.kind
    self.backend = prepared.backend
    self.role = prepared.role
    self.is_writer = self.role.is_writer
    self.num_workers = self.role.num_workers
    self.task = task
    self.callbacks = tuple(callbacks)
    self.exit_plan = exit_plan
    self.started = time.time() if started is None else started
    self.hypertune_reporter = hypertune_reporter
    self.lease: Optional[lease_lib.Lease] = None
    self.cleanup = contextlib.ExitStack()
    self.scratch_dir: Optional[str] = None
    # This run's record, written before its first save (`_before_save`).
    self._run_record: Optional[dict] = None
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
      if self.config.reliability.dry_run:
        return self.dry_run()
      if self.lease is not None:
        self.lease.acquire()
        export.remove_stale_exports(self.decisions.export_dir)
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
        done_marker.mark_done(self.decisions.model_dir)
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
    self.plan, self.moving_statistics = moving_statistics.for_run(
        self.plan, self.parts, strategy=self.strategy,
        model_name=self.config.task.model)
    self.keeper = self.build_checkpoints()
    self.warm_started = self.warm_start()
    if self.is_writer:
      done_marker.clear_done(self.decisions.model_dir)
    self.step_runner, self.evaluate = self.build_inputs()
    self.run_log = self.build_run_log()
    callbacks = self.build_callbacks()
    self.profiler = self.build_profiler()
    self.controller = self.build_controller(callbacks)
    self.result = self.run_controller()
    # A task whose export or manifest fails tells the others at the final
    # barrier, so that every task of the run exits with the same status.
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
    decided = self.decisions
    return failures.named_failures(
        {"--model_dir": decided.model_dir,
         "--checkpoint_dir": decided.checkpoint_dir,
         "--tensorboard_dir": decided.tensorboard_dir,
         "--export_dir": decided.export_dir},
        data_folders=failures.data_folders(decided.train_files,
                                           decided.eval_files,
                                           decided.data_dir),
        checkpoint_dir=decided.checkpoint_dir)

  def _export_source(self) -> str:
    """The flag or variable that chose the export folder."""
    return self.decisions.output_sources()["export_dir"][1]

  def out_dir(self, path: str, scratch_name: str) -> str:
    """`path` for the writer, else `scratch_name` in the scratch folder."""
    return (path if self.is_writer else
            os.path.join(self.scratch_dir, scratch_name))

  def build_lease(self) -> Optional[lease_lib.Lease]:
    """The writer's output checks and its `--model_dir` lease (not yet
    held; released by `cleanup`); None for other processes."""
    if not self.is_writer:
      return None
    preflight.probe_outputs(preflight.decided_outputs(self.config.outputs,
                                                      self.decisions))
    export.check_export_dir(self.decisions.export_dir,
                            source=self._export_source())
    lease = lease_lib.Lease(self.decisions.model_dir,
                            timeout_seconds=(
                                self.config.reliability.lease_timeout_seconds))
    self.cleanup.callback(lease.release)
    return lease

  def dry_run(self) -> dict:
    """`--dry_run`: the lease checked free, the plan made, nothing built."""
    if self.lease is not None:
      self.lease.check_free()
    return dry_run_lib.dry_run(self.prepared, task=self.task,
                               writer=self.is_writer)

  def build_strategy(self) -> strategy_lib.StrategyChoice:
    """The `tf.distribute` strategy (with the CPU devices configured), as
    the backend builds it."""
    return self.backend.build_strategy(self.config, self.decisions,
                                       cluster=self.cluster, lease=self.lease)

  def build_preemption_watcher(self) -> preemption.PreemptionWatcher:
    """SIGTERM/SIGINT handling, uninstalled however the run ends."""
    # Replaces TensorFlow's own SIGTERM handler (installed with the
    # strategy).
    watcher = preemption.PreemptionWatcher(
        grace_seconds=(self.config.strategy.cluster
                       .preemption_grace_seconds)).install()
    # Also when a start-up check below stops the run.
    self.cleanup.callback(watcher.uninstall)
    return watcher

  def set_seeds(self) -> None:
    """`--seed` and `--deterministic`."""
    if self.config.loop.seed is not None:
      keras.utils.set_random_seed(self.config.loop.seed)
    if self.config.loop.deterministic:
      # Reproducible runs (--deterministic): the same seed, data and
      # cluster give the same weights.
      tf.config.experimental.enable_op_determinism()

  def build_plan(self) -> run_plan_lib.RunPlan:
    """The run plan: files, batch, steps, learning rate.

    Raises:
      ConfigError: as `tfdist.training.plan.run_plan.make_run_plan`, or a
        `--profile_steps` window after the last step.
    """
    plan_options = prepare.plan_options(self.config, self.decisions,
                                        cluster=self.cluster)
    plan = run_plan_lib.make_run_plan(
        plan_options, self.task.dataset,
        num_replicas_in_sync=self.strategy.num_replicas_in_sync,
        num_workers=self.num_workers,
        asynchronous=self.backend.asynchronous, decision=self.decision,
        on_tpu=self.backend.on_tpu)
    logging.info("%s", plan.describe(plan_options))
    remainder = plan.batch.remainder_warning()
    if remainder and self.is_writer:
      logging.warning("%s", remainder)
    _check_profile_window(self.config.outputs, plan)
    warning = cross_process_memory_warning(
        total_steps=plan.total_steps,
        steps_per_execution=self.decisions.steps_per_execution,
        cross_process=(
            self.backend.cross_process_collectives(self.num_workers) and
            strategy_lib.per_call_instance_keys()))
    if warning:
      logging.warning("%s", warning)
    return plan

  def check_resume(self) -> None:
    """The writer compares this run with the checkpoint's; its own record
    is written before its first save (`_before_save`), so a run that
    fails before it saves (a checkpoint that does not restore) leaves the
    record of the run that wrote the checkpoints.

    Raises:
      tfdist.errors.IncompatibleResumeError: as
        `tfdist.experiment.prepare.check_resume`.
    """
    if not self.is_writer:
      return
    directory = self.decisions.checkpoint_dir
    prepare.check_resume(self.config, self.decisions, self.plan)
    checkpointing.clean_interrupted_saves(directory)
    self._run_record = checkpointing.run_record(
        manifest_lib.recorded_config(self.config, self.decisions), self.plan)

  def _before_save(self) -> None:
    """Before each save of the writer: its `--model_dir` lease checked;
    before the first, this run's record written beside the checkpoints."""
    if self.lease is not None:
      self.lease.check()
    record, self._run_record = self._run_record, None
    if record is not None:
      checkpointing.write_run_record(self.decisions.checkpoint_dir, record)

  def assembly_options(self) -> assembly.AssemblyOptions:
    """The run's `AssemblyOptions` (`tfdist.experiment.prepare.assembly_options`),
    for the steps and the backend (a parameter-server export builds a local
    copy of the model from them)."""
    return prepare.assembly_options(self.config, self.decisions,
                                    cluster=self.cluster)

  def build_model_and_optimizer(self) -> assembly.Parts:
    """The precision policy, then model, optimizer, trainer and checkpoint
    under the strategy (`tfdist.training.assembly.build`)."""
    # The run's policy builds its model; the caller's is back when the
    # run ends (a later `keras.layers.Dense()` of a `tfdist.fit` script
    # is float32 again, as after `Model.fit`).
    self.cleanup.callback(keras.mixed_precision.set_global_policy,
                          keras.mixed_precision.global_policy())
    self.policy = precision.configure_precision(self.decisions.dtype)
    options = self.backend.assembly_options(
        self.assembly_options(), choice=self.choice)
    parts = assembly.build(options, task=self.task, strategy=self.strategy,
                           plan=self.plan, on_tpu=self.backend.on_tpu)
    if self.config.cloud.hptune_metric:
      hptune.check_metric(self.config.cloud.hptune_metric, available=[
          "loss", *parts.metric_sums.results({})])
    # Every known difference from one device that applies, said once.
    differences.say(differences.facts_of_run(
        options, parts=parts, plan=self.plan,
        replicas=self.strategy.num_replicas_in_sync,
        input_fn=self.task.dataset.input_fn,
        keeps_input_position=self.backend.keeps_input_position))
    self.model_memory = self.backend.model_memory(
        parts, num_replicas=self.strategy.num_replicas_in_sync)
    _log_model_memory(self.model_memory)
    return parts

  def _input_position(self) -> Optional[input_position_lib.InputPosition]:
    """The checkpointed input position: synchronous strategies reading
    TFRecord files, `tfdist.fit`'s in-memory input or a dataset function
    tfdist shards (`tfdist.data.input_position.source_files`; parameter-server
    workers read unseeded copies of every file)."""
    config, plan, spec = self.config, self.plan, self.task.dataset
    if not (config.loop.checkpoint_input_position and
            self.backend.keeps_input_position):
      return None
    fn = spec.input_fn
    source = input_position_lib.source_files(
        input_fn=fn, name=spec.name, files=plan.train_files,
        file_record_counts=plan.train_file_counts,
        num_examples=plan.num_train_examples,
        shards_by_example=bool(getattr(
            fn, input_pipeline.SHARDS_BY_EXAMPLE, False)),
        shards_itself=fn is not None and input_pipeline.takes_input_context(
            fn))
    if source is None:
      return None
    return input_position_lib.InputPosition(
        input_position_lib.input_layout(
            files=source[0], file_record_counts=source[1],
            num_input_pipelines=self.backend.num_input_pipelines(
                self.num_workers),
            global_batch_size=plan.global_batch_size, seed=config.loop.seed,
            shuffle_buffer_size=config.task.shuffle_buffer_size,
            cache=config.task.cache_dataset),
        steps_per_epoch=plan.steps_per_epoch,
        resume_note=getattr(fn, input_position_lib.RESUME_NOTE, None))

  def build_checkpoints(self) -> CheckpointKeeper:
    """The checkpoint keeper: saves, restores, keeps the input position."""
    parts = self.parts
    # As the trainer's parallelism mode holds them (ZeRO stage 3: its
    # weight shards in place of the released weights).
    state = mode_lib.state_variables(parts.trainer, parts.model)
    if parts.optimizer is not None:
      known = {id(v) for v in state}
      state += [v for v in parts.optimizer.variables if id(v) not in known]
    return CheckpointKeeper(
        checkpoint=parts.checkpoint,
        directory=self.out_dir(self.decisions.checkpoint_dir,
                               "checkpoints"),
        step_counter=parts.trainer.global_step,
        max_to_keep=self.config.loop.max_checkpoints,
        restore_dir=self.decisions.checkpoint_dir,
        input_position=self._input_position(), variables=state,
        before_save=moving_statistics.before_save(
            self.moving_statistics,
            self._before_save if self.is_writer else None))

  def warm_start(self) -> Optional[str]:
    """`--init_checkpoint` for a fresh run; returns what was loaded."""
    config = self.config
    if not config.task.init_checkpoint or tf.train.latest_checkpoint(
        self.decisions.checkpoint_dir):
      # A resumed run starts from its own checkpoint (which the controller
      # restores).
      return None
    return assembly.load_init_checkpoint(self.parts.model,
                                         config.task.init_checkpoint)

  def training_run(self) -> backend_lib.TrainingRun:
    """What the backend's `build_inputs` and `export_model` read of this
    run (its parts and checkpoint keeper built)."""
    config, decided, keeper = self.config, self.decisions, self.keeper
    return backend_lib.TrainingRun(
        task=self.task, plan=self.plan, strategy=self.strategy,
        parts=self.parts, cluster=self.cluster, num_workers=self.num_workers,
        settings=backend_lib.InputSettings(
            mode=config.task.mode,
            shuffle_buffer_size=config.task.shuffle_buffer_size,
            cache_dataset=config.task.cache_dataset, seed=config.loop.seed,
            deterministic=config.loop.deterministic),
        input_position=keeper.input_position,
        latest_checkpoint=lambda: keeper.latest,
        synchronize_statistics=self.moving_statistics.synchronize,
        strategy_options=self.backend.strategy_options(config, decided),
        checkpoint_dir=decided.checkpoint_dir,
        steps_per_execution=decided.steps_per_execution,
        assembly_options=self.assembly_options())

  def run_ending(self) -> backend_lib.RunEnding:
    """What the backend's `leave_together` reads as this run ends."""
    keeper = self.keeper
    return backend_lib.RunEnding(
        strategy=self.strategy, parts=self.parts, cluster=self.cluster,
        num_workers=self.num_workers, is_writer=self.is_writer,
        exit_plan=self.exit_plan,
        latest_checkpoint=lambda: keeper.latest if keeper else None,
        close=self.cleanup.close, model_dir=self.decisions.model_dir)

  def build_inputs(self):
    """`(step_runner, evaluate)`: the input pipelines and what runs the
    steps on them (the backend's); `evaluate` (None under `--mode=train`)
    evaluates the held-out data once. Sets `strategy_details`."""
    runner, evaluate, self.strategy_details = self.backend.build_inputs(
        self.training_run())
    return runner, evaluate

  def build_run_log(self) -> run_log_lib.RunLog:
    """Log lines, TensorBoard scalars and the writer's `metrics.jsonl`."""
    return run_log_lib.RunLog(
        tensorboard_dir=self.out_dir(self.decisions.tensorboard_dir,
                                     "tensorboard"),
        metrics_dir=self.decisions.model_dir if self.is_writer else None,
        global_batch_size=self.plan.global_batch_size,
        total_steps=self.plan.total_steps,
        summarize=self.parts.trainer.summarize,
        loss_explosion_factor=self.config.reliability.loss_explosion_factor,
        steps_per_epoch=self.plan.steps_per_epoch)

  def build_callbacks(self) -> List[keras.callbacks.Callback]:
    """TensorBoard, the caller's callbacks, and hyperparameter tuning's."""
    tensorboard_dir = self.out_dir(self.decisions.tensorboard_dir,
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
          self.config.cloud.hptune_metric, reporter=self.hypertune_reporter,
          step_fn=lambda: self.controller.step))
    return callbacks

  def build_profiler(self) -> Optional[profiling.ProfileWindow]:
    """`--profile_steps` on the writer (other workers' folders are
    scratch)."""
    if not (self.config.outputs.profile_steps and self.is_writer):
      return None
    return profiling.ProfileWindow(
        self.config.outputs.profile_steps,
        os.path.join(self.decisions.tensorboard_dir, "train"))

  def build_controller(self, callbacks: Sequence[keras.callbacks.Callback]
                       ) -> Controller:
    """The outer loop: steps, checkpoints, evaluations, callbacks."""
    config, plan, optimizer = self.config, self.plan, self.parts.optimizer
    options = ControllerOptions(
        total_steps=plan.total_steps, steps_per_epoch=plan.steps_per_epoch,
        log_steps=config.loop.log_steps,
        checkpoint_steps=config.loop.checkpoint_steps,
        epochs_between_evals=config.loop.epochs_between_evals,
        max_consecutive_skipped_steps=(
            config.reliability.max_consecutive_skipped_steps))
    return Controller(
        runner=self.step_runner, options=options, checkpoints=self.keeper,
        step_counter=self.parts.trainer.global_step, run_log=self.run_log,
        evaluate=self.evaluate, model=self.parts.model,
        learning_rate=lambda: assembly.current_learning_rate(optimizer),
        loss_scale=lambda: precision.current_loss_scale(optimizer),
        callbacks=callbacks, preemption=self.watcher,
        profiler=self.profiler, train_actions=self.train_actions,
        eval_actions=self.eval_actions)

  def run_controller(self) -> controller_lib.ControllerResult:
    """Trains; a lost ps task or peer becomes one named error.

    Raises:
      tfdist.errors.PreemptedError: stopped after a checkpoint.
      tfdist.errors.ParameterServerError: a ps task was
        lost.
      tfdist.errors.PeerLostError: a MultiWorkerMirrored peer was
        lost.
    """
    controller = self.controller
    try:
      return controller.run()
    except errors.PreemptedError:
      if self.is_writer:
        # Servers and side-car evaluators stop with the chief.
        done_marker.mark_done(self.decisions.model_dir)
      if self.exit_plan is None:
        # Library use (`tfdist.fit`): the checkpoint is saved and the caller
        # decides what comes next (a notebook's Ctrl-C, a script that
        # resumes), so the grace period no longer applies. A binary ends
        # its process now and keeps the bound on that.
        self.watcher.cancel_deadline()
      raise
    except tf.errors.OpError as e:
      named = self.backend.translate_failure(
          e, after=f"step {controller.step}",
          last_checkpoint=self.keeper.latest, cluster=self.cluster)
      if named is None:
        raise
      raise named from e
    finally:
      self.watcher.uninstall()

  def build_export(self) -> Optional[str]:
    """The SavedModel of the trained model; returns its folder (the
    scratch folder's on other workers: saving is collective), or None for
    a model that cannot be called on its features (its own `train_step`
    trains it; the checkpoint holds its weights)."""
    model = self.backend.export_model(self.training_run())
    features, _ = task_lib.example_spec(self.task.dataset)
    reason = export.exportable(model, features)
    if reason is not None:
      logging.warning("tfdist: no SavedModel: %s. The checkpoint in %s "
                      "holds the trained weights: restore the model there "
                      "and export the parts you serve.", reason,
                      self.decisions.checkpoint_dir)
      return None
    return export.export_saved_model(
        model, self.out_dir(self.decisions.export_dir, "saved_model"),
        source=self._export_source() if self.is_writer else "TMPDIR",
        details={"step": self.controller.step,
                 "model": self.task.model_name},
        last_checkpoint=self.keeper.latest)

  def _artifacts(self) -> dict:
    decided = self.decisions
    return {"checkpoint": self.keeper.latest,
            "checkpoint_dir": decided.checkpoint_dir,
            "saved_model": (decided.export_dir
                            if self.export_dir is not None else None),
            "tensorboard": decided.tensorboard_dir,
            "metrics": os.path.join(decided.model_dir,
                                    run_log_lib.METRICS_FILE),
            "init_checkpoint": self.warm_started,
            "profile": (self.profiler.latest_trace if self.profiler
                        else None)}

  def build_manifest(self) -> dict:
    """The run manifest (`tfdist.observability.manifest.build_manifest`)."""
    optimizer, result = self.parts.optimizer, self.result
    return manifest_lib.build_manifest(
        manifest_lib.ManifestOptions.of(self.config, self.decisions),
        ran=manifest_lib.WhatRan(
            decision=self.decision, plan=self.plan,
            dtype_policy=self.policy.name,
            loss_scale=precision.current_loss_scale(optimizer),
            optimizer_iterations=int(optimizer.iterations.numpy()),
            result=result, run_log=self.run_log,
            objectives=self.parts.objectives,
            model_name=self.task.model_name,
            model_memory=self.model_memory.to_dict(),
            strategy_details=self.strategy_details,
            batch_norm=manifest_lib.has_batch_norm(self.parts.model)),
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
    path = manifest_lib.write_manifest(self.decisions.model_dir, record)
    logging.info("Run manifest: %s; SavedModel: %s", path, self.export_dir)
    final_eval = self.result.final_eval
    if final_eval and self.print_final_eval:
      print("Final eval: " + run_log_lib.format_metrics(
          run_log_lib.metric_values(final_eval)) +
            f" ({final_eval['num_examples']} examples). Artifacts in "
            f"{self.decisions.model_dir}", flush=True)

  def leave_together(self, failed: bool = False) -> None:
    """The backend ends the run's processes together (MultiWorkerMirrored:
    the final barrier, then, with an `exit_plan`, unless this task or
    another arrived `failed`, the process ends there, the chief last).

    Raises:
      tfdist.errors.PeerLostError: a peer was lost at the barrier.
      tfdist.errors.PeerStoppedError: another task arrived `failed`.
    """
    self.backend.leave_together(self.run_ending(), failed=failed)
