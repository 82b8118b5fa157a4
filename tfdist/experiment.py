"""`run_experiment`: the whole run, from a `TrainConfig` to artifacts.

Short wiring of one-job modules, in the order data flows:

    config + environment (tfdist.environment)
      -> task: model builder, data set, loss, metrics (tfdist.task; the
         registries and import paths of tfdist.registry, or tfdist.fit's
         objects)
      -> cluster (tfdist.cluster)            -> role: train, serve, evaluate
      -> decision: strategy and dtype (tfdist.auto_select, the one place
         that decides `auto`)
      -> strategy (tfdist.strategy)
      -> run plan: files, batch, learning rate (tfdist.run_plan)
      -> model, optimizer, trainer, checkpoint (tfdist.assembly)
      -> input pipelines (tfdist.input_pipeline)
      -> step runner (tfdist.step_runner) under one controller
         (tfdist.controller)
      -> artifacts: SavedModel (tfdist.export), manifest (tfdist.manifest)

Every strategy goes through the same steps; parameter-server training
differs only in its step runner and input (one copy per worker), and in the
roles its cluster has (`worker` and `ps` tasks serve, the `evaluator`
evaluates checkpoints as they appear, as it does for every strategy).
`--mode=continuous_eval` makes any process that evaluator, `--mode=eval`
evaluates the latest checkpoint once, `--mode=train` trains without
evaluating.
"""

import atexit
import contextlib
import dataclasses
import gc
import os
import shutil
import tempfile
import time
from typing import Optional, Sequence, Tuple

from absl import logging
import keras
import tensorflow as tf

from tfdist import allocator
from tfdist import assembly
from tfdist import auto_select
from tfdist import checkpoint_paths
from tfdist import checkpointing
from tfdist import cluster as cluster_lib
from tfdist import controller as controller_lib
from tfdist import devices
from tfdist import done_marker
from tfdist import environment as environment_lib
from tfdist import export
from tfdist import failures
from tfdist import filesystems
from tfdist import hptune
from tfdist import input_pipeline
from tfdist import input_position as input_position_lib
from tfdist import keras_callbacks
from tfdist import lease as lease_lib
from tfdist import manifest as manifest_lib
from tfdist import memory
from tfdist import parameter_server as ps_lib
from tfdist import precision
from tfdist import preemption
from tfdist import preflight
from tfdist import profiling
from tfdist import run_log as run_log_lib
from tfdist import run_options
from tfdist import run_plan as run_plan_lib
from tfdist import step_runner
from tfdist import strategy as strategy_lib
from tfdist import task as task_lib
from tfdist import tpu as tpu_lib
from tfdist import versions
from tfdist import worker_exit
from tfdist.checkpointing import CheckpointKeeper
from tfdist.config import ConfigError
from tfdist.config import TrainConfig
from tfdist.controller import Controller, ControllerOptions
from tfdist.dataset_spec import DataNotFoundError

MIN_EVAL_BATCH_SIZE = run_plan_lib.MIN_EVAL_BATCH_SIZE


def _worker_scratch_dir(cluster: cluster_lib.ClusterInfo) -> str:
  """A local folder for a non-chief worker's writes, deleted at exit.

  Raises:
    tfdist.preflight.OutputNotWritableError: it cannot be made or written.
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


def prepare_run(config: TrainConfig, *,
                environment: Optional[environment_lib.RunEnvironment] = None,
                dataset=None):
  """The decisions every role makes first: environment, cluster, `auto`.

  Nothing expensive runs here (no model, no data); the TPU is probed only
  when `auto` needs it, boundedly.

  Args:
    config: the caller's `TrainConfig`.
    environment: the environment to use (None: read `os.environ` now).
    dataset: the run's `DatasetSpec`, if known (a dataset function reads
      no files, so the TPU `gs://` rule has nothing to check).

  Returns:
    `(config, cluster, decision, environment_applied, trial_fields)`: the
    config with the environment applied (a tuning trial's folders nested,
    `environment.trial_folders`) and `auto` decided, the `ClusterInfo`, the
    `auto_select.Decision`, the `(field, variable)` pairs the environment
    filled, and the folder fields given the trial's subfolder.

  Raises:
    ConfigError: missing `--model_dir`, `--feature_spec` without files, a
      data URI of another format than `tf-record`, a malformed cluster,
      fp16 on a TPU, local input with a remote TPU, an export folder that
      would replace the run's other outputs
      (`tfdist.export.ExportRefusedError`).
  """
  if environment is None:
    environment = environment_lib.read_environment()
  config, applied = environment_lib.apply_environment(config, environment)
  config.require_model_dir()
  config.require_data_files()
  for field, variable in applied:
    logging.info("--%s=%s from $%s", field, getattr(config, field), variable)
  if config.recommended_applied:
    logging.info("--dataset=%s sets flags left unset: %s (pass them to "
                 "override).", config.dataset,
                 " ".join(f"--{k}={v}" for k, v in config.recommended_applied))
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
  if decision.strategy == "tpu":
    tpu_lib.validate_tpu_config(
        config.tpu, data_patterns=run_plan_lib.data_patterns(run_options.data_options(config), dataset))
  logging.info("%s", decision.describe())
  return config, cluster, decision, applied, trial_fields


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


def run_experiment(config: TrainConfig, *,
                   callbacks: Sequence[keras.callbacks.Callback] = (),
                   environment: Optional[environment_lib.RunEnvironment] = None,
                   task: Optional[task_lib.Task] = None,
                   exit_plan: Optional[worker_exit.ExitPlan] = None) -> dict:
  """Runs this process's part of the job `config` describes.

  Works from any thread: off the main thread, signal-based preemption is
  off (the host framework owns signals; see `tfdist.preemption`).

  Args:
    config: a `TrainConfig`.
    callbacks: extra Keras callbacks, called by the controller on every
      training process at the same points.
    environment: the process environment (`tfdist.environment`); None reads
      `os.environ` once, here.
    task: what to train (`tfdist.task.Task`: model builder, data set, loss,
      metrics); None: what `config.model`, `config.dataset`,
      `config.feature_spec` and `config.import_modules` name.
    exit_plan: for binaries that end their process when the run is done
      (`tfdist.train`): a MultiWorkerMirrored task of a multi-worker run
      then ends its process inside this call, right after the final
      barrier, the chief last (`tfdist.worker_exit.leave_process`), and
      this call does not return there. None (library use): it returns.

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
    tfdist.data_checks.DataError: a damaged input file or records of another
      schema (before training).
    tfdist.preflight.OutputNotWritableError: an output folder cannot be
      written (before anything else is done).
    tfdist.checkpointing.IncompatibleResumeError: the checkpoint's run had
      another model or global batch (before training).
    tfdist.lease.LeaseHeldError: another live run holds `--model_dir`.
    tfdist.preemption.PreemptedError: SIGTERM or SIGINT stopped training
      after a checkpoint was saved (rerun to resume).
    tfdist.run_log.DivergenceError: the loss or the state became NaN or
      infinite (the last good checkpoint is kept and named).
    tfdist.parameter_server.ParameterServerError: a ps task was lost.
    tfdist.step_runner.PeerLostError: a MultiWorkerMirrored peer was lost.
  """
  started = time.time()
  versions.check_installed_versions()
  keras_callbacks.check_callbacks(callbacks)
  # Every role (chief, worker, ps, evaluator) trains or serves in this
  # process: the malloc settings apply to all (tfdist.allocator).
  allocator.configure_allocator(config.tune_allocator)
  # Every task opens files itself (ps workers read the input shards, every
  # process reads a --feature_spec), so every task imports tensorflow-io
  # when a path needs it; again once the environment filled the folders.
  filesystems.require_file_systems(run_options.config_paths(config))
  if task is None:
    task = task_lib.from_config(config)
  config, cluster, decision, applied, trial_fields = prepare_run(
      config, environment=environment, dataset=task.dataset)
  filesystems.require_file_systems(run_options.config_paths(config))
  assembly.check_model_options(config, task=task)
  hypertune_reporter = None
  if config.hptune_metric:
    # Vertex AI hyperparameter tuning: the package now, the metric's name
    # once the model is built (before training).
    hypertune_reporter = hptune.make_hypertune()
  evaluating = config.mode in ("eval", "continuous_eval")
  if evaluating and cluster.task_type not in (
      cluster_lib.EVALUATOR, cluster_lib.CHIEF) and (
          cluster.num_workers > 1 or cluster.num_ps):
    raise ConfigError(
        f"--mode={config.mode} evaluates in one process; this one is "
        f"{cluster.task_type} {cluster.task_index} of a training cluster. "
        "Run it without TF_CONFIG/--worker_hosts, or as the cluster's "
        "evaluator task.")
  if cluster.task_type == cluster_lib.EVALUATOR or evaluating:
    # Never a writer of the chief's artifacts, and never the lease holder.
    for folder in (os.path.join(config.model_dir, "eval"),
                   os.path.join(config.resolved_tensorboard_dir, "eval")):
      preflight.probe_writable(folder, flag="--model_dir",
                               value=config.model_dir)
    if config.dry_run:
      return _dry_run(config, task=task, cluster=cluster, decision=decision,
                      writer=False)
    return run_evaluator(config, task=task, cluster=cluster,
                         decision=decision, once=config.mode == "eval")
  if decision.strategy == "parameter_server":
    ps_lib.set_grpc_fail_fast()
    if cluster.task_type in (cluster_lib.WORKER, cluster_lib.PS):
      if config.dry_run:
        logging.info("tfdist: dry run: %s %d would serve the parameter-server "
                     "cluster.", cluster.task_type, cluster.task_index)
        return {"dry_run": True, "role": cluster.task_type,
                "index": cluster.task_index}
      status = ps_lib.serve(config.model_dir, cluster,
                            grace_seconds=config.preemption_grace_seconds)
      return {"role": cluster.task_type, "index": cluster.task_index,
              "exit_status": status}
  # The process that writes --model_dir: the only one, the MultiWorkerMirrored
  # chief, the parameter-server coordinator.
  writer = (cluster.is_chief if decision.strategy == "multi_worker_mirrored"
            else True)
  lease = None
  if writer:
    preflight.probe_outputs(run_options.output_options(config))
    export.check_export_dir(
        config.resolved_export_dir,
        source=environment_lib.output_sources(config, applied)[
            "export_dir"][1])
    lease = lease_lib.Lease(config.model_dir,
                            timeout_seconds=config.lease_timeout_seconds)
  # What the run must undo however it ends (signal handlers, the lease).
  cleanup = contextlib.ExitStack()
  if lease is not None:
    cleanup.callback(lease.release)
  with cleanup, _name_environment_sources(applied):
    if config.dry_run:
      if lease is not None:
        lease.check_free()
      return _dry_run(config, task=task, cluster=cluster, decision=decision,
                      writer=writer)
    if lease is not None:
      lease.acquire()
    # A full disk, a refused write, a data file gone: one line, status 2.
    with failures.named_failures(
        {"--model_dir": config.model_dir,
         "--checkpoint_dir": config.resolved_checkpoint_dir,
         "--tensorboard_dir": config.resolved_tensorboard_dir,
         "--export_dir": config.resolved_export_dir},
        data_folders=failures.data_folders(config.train_files,
                                           config.eval_files,
                                           config.data_dir),
        checkpoint_dir=config.resolved_checkpoint_dir):
      record = _train(config, task=task, cluster=cluster, decision=decision,
                      applied=applied, trial_fields=trial_fields,
                      callbacks=callbacks, started=started,
                      hypertune_reporter=hypertune_reporter, lease=lease,
                      cleanup=cleanup, exit_plan=exit_plan)
    if writer:
      # Tells parameter-server tasks and side-car evaluators the run is
      # over, only once the training objects are gone: a parameter-server
      # coordinator removes its functions from the workers and ps tasks as
      # they are freed, and a server that had already left made each removal
      # a gRPC error ("Failed to remove function remotely").
      gc.collect()
      done_marker.mark_done(config.model_dir)
    return record


def planned_replicas(config, *, decision, cluster) -> Tuple[int, int]:
  """`(num_replicas_in_sync, num_workers)` a run will have, without
  building its strategy (for `--dry_run`; TPUs are asked).

  Raises:
    ConfigError: as `tfdist.strategy.make_strategy` (TPU only).
  """
  name = decision.strategy
  gpus = len(tf.config.list_physical_devices("GPU"))
  if config.num_gpus >= 0:
    gpus = min(gpus, config.num_gpus)
  if name == "mirrored":
    return (gpus or max(config.num_cpu_devices, 1)), 1
  if name == "multi_worker_mirrored":
    workers = max(cluster.num_workers, 1)
    return workers * max(gpus, 1), workers
  if name == "parameter_server":
    return 1, len(cluster.cluster.get(cluster_lib.WORKER, ()))
  if name == "tpu":
    choice = strategy_lib.make_strategy(run_options.strategy_options(config), cluster=cluster)
    return choice.strategy.num_replicas_in_sync, 1
  return 1, 1


def _dry_run(config, *, task, cluster, decision, writer: bool) -> dict:
  """`--dry_run`: the checks that need the data and the plan, no model."""
  spec = task.dataset
  replicas, num_workers = planned_replicas(config, decision=decision,
                                           cluster=cluster)
  asynchronous = decision.strategy == "parameter_server"
  plan = run_plan_lib.make_run_plan(
      run_options.plan_options(config), spec, num_replicas_in_sync=replicas, num_workers=num_workers,
      asynchronous=asynchronous, decision=decision)
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
    tfdist.checkpointing.IncompatibleResumeError: a changed model or
      global batch without `--allow_incompatible_resume`.
  """
  directory = config.resolved_checkpoint_dir
  latest = tf.train.latest_checkpoint(directory)
  if not latest:
    return []
  previous = checkpointing.read_run_record(directory, config.model_dir)
  if previous is None:
    return []
  restored_step = checkpoint_paths.checkpoint_step(latest, default=0)
  notes = checkpointing.check_resume(
      previous, checkpointing.run_record(
          run_options.run_record_settings(config), plan), checkpoint=latest,
      restored_step=restored_step, allow=config.allow_incompatible_resume)
  if notes:
    logging.warning("tfdist: resuming from %s, which a run with other "
                    "settings wrote: %s.", latest, "; ".join(notes))
  return notes


def _train(config, *, task, cluster, decision, applied, callbacks, started,
           hypertune_reporter=None, trial_fields=(), lease=None,
           cleanup=None, exit_plan=None):
  """The training process: the only one, the chief, a worker, or the
  parameter-server coordinator (`lease`: the writer's `--model_dir`
  lease, held; `cleanup`: a `contextlib.ExitStack` the caller closes)."""
  multi_worker = decision.strategy == "multi_worker_mirrored"
  asynchronous = decision.strategy == "parameter_server"
  # Under MultiWorkerMirroredStrategy only the chief writes to --model_dir;
  # the others write what they must (saving and export are collective) to a
  # scratch folder they delete (Model Garden's pattern), probed first.
  is_chief = cluster.is_chief if multi_worker else True
  scratch_dir = None if is_chief else _worker_scratch_dir(cluster)
  if multi_worker:
    # Built before anything starts TensorFlow's runtime (it configures the
    # collective runtime); the decision listed physical devices only. It
    # may hold the interpreter, and so the lease's renewals, until every
    # peer has connected.
    with (lease.extended(config.cluster_start_timeout_seconds)
          if lease is not None else contextlib.nullcontext()):
      choice = strategy_lib.make_strategy(run_options.strategy_options(config), cluster=cluster)
  devices.configure_cpu_devices(config.num_cpu_devices)
  if not multi_worker:
    choice = strategy_lib.make_strategy(run_options.strategy_options(config), cluster=cluster)
  strategy = choice.strategy
  num_workers = (cluster.num_workers if multi_worker else
                 len(cluster.cluster.get(cluster_lib.WORKER, ()))
                 if asynchronous else 1)
  # Replaces TensorFlow's own SIGTERM handler (installed with the strategy).
  watcher = preemption.PreemptionWatcher(
      grace_seconds=config.preemption_grace_seconds).install()
  if cleanup is not None:
    # Also when a start-up check below stops the run.
    cleanup.callback(watcher.uninstall)
  if config.seed is not None:
    keras.utils.set_random_seed(config.seed)
  if config.deterministic:
    # Reproducible runs (--deterministic): the same seed, data and cluster
    # give the same weights.
    tf.config.experimental.enable_op_determinism()
  spec = task.dataset
  plan = run_plan_lib.make_run_plan(
      run_options.plan_options(config), spec, num_replicas_in_sync=strategy.num_replicas_in_sync,
      num_workers=num_workers, asynchronous=asynchronous, decision=decision)
  logging.info("%s", plan.describe(run_options.plan_options(config)))
  if config.profile_steps and config.profile_steps[0] > plan.total_steps:
    raise ConfigError(
        f"--profile_steps={config.profile_steps[0]},{config.profile_steps[1]}"
        f" starts after the run's last step ({plan.total_steps}): nothing "
        "would be traced. Choose a window within the run, e.g. "
        f"--profile_steps={min(10, plan.total_steps)},"
        f"{min(15, plan.total_steps)}.")
  if is_chief:
    _check_resume(config, plan)
    checkpointing.clean_interrupted_saves(config.resolved_checkpoint_dir)
    checkpointing.write_run_record(config.resolved_checkpoint_dir,
                                   checkpointing.run_record(
                                       run_options.run_record_settings(config),
                                       plan))
  on_tpu = decision.strategy == "tpu"
  policy = precision.configure_precision(config.dtype)
  parts = assembly.build(config, task=task, strategy=strategy, plan=plan,
                         on_tpu=on_tpu)
  model, optimizer, trainer = parts.model, parts.optimizer, parts.trainer
  if config.hptune_metric:
    hptune.check_metric(config.hptune_metric, available=[
        "loss", *parts.metric_sums.results({})])
  model_memory = memory.estimate_model_memory(model, optimizer,
                                              sharded=trainer.sharded)
  logging.info(
      "Model state per replica: parameters %s (%d values), gradients %s, "
      "optimizer %s: %s in all (activations not counted)",
      memory.format_bytes(model_memory.parameters_bytes),
      model_memory.num_parameters,
      memory.format_bytes(model_memory.gradients_bytes),
      memory.format_bytes(model_memory.optimizer_bytes),
      memory.format_bytes(model_memory.total_bytes))

  def out_dir(path: str, scratch_name: str) -> str:
    return path if is_chief else os.path.join(scratch_dir, scratch_name)

  checkpoint_dir = out_dir(config.resolved_checkpoint_dir, "checkpoints")
  tensorboard_dir = out_dir(config.resolved_tensorboard_dir, "tensorboard")
  # The input position: synchronous strategies reading TFRecord
  # files only (parameter-server workers read unseeded copies of every file;
  # a dataset function's epochs are not aligned to steps).
  input_position = None
  if (config.checkpoint_input_position and not asynchronous and
      spec.reads_files):
    input_position = input_position_lib.InputPosition(
        input_position_lib.input_layout(
            files=plan.train_files, file_record_counts=plan.train_file_counts,
            num_input_pipelines=num_workers,
            global_batch_size=plan.global_batch_size, seed=config.seed,
            shuffle_buffer_size=config.shuffle_buffer_size,
            cache=config.cache_dataset),
        steps_per_epoch=plan.steps_per_epoch)
  state = list(model.variables)
  if optimizer is not None:
    known = {id(v) for v in state}
    state += [v for v in optimizer.variables if id(v) not in known]
  keeper = CheckpointKeeper(
      checkpoint=parts.checkpoint, directory=checkpoint_dir,
      step_counter=trainer.global_step, max_to_keep=config.max_checkpoints,
      restore_dir=config.resolved_checkpoint_dir,
      input_position=input_position, variables=state,
      before_save=lease.check if lease is not None else None)
  warm_started = None
  if config.init_checkpoint and not tf.train.latest_checkpoint(
      config.resolved_checkpoint_dir):
    # A fresh run starts from these weights; a resumed one from its own
    # checkpoint (which the controller restores).
    warm_started = assembly.load_init_checkpoint(model,
                                                 config.init_checkpoint)

  if is_chief:
    done_marker.clear_done(config.model_dir)
  strategy_details = {}
  if asynchronous:
    placement = ps_lib.describe_placement(
        model, optimizer, large_bytes=min(config.ps_min_shard_bytes,
                                          64 << 10))
    logging.info("%s", ps_lib.format_placement(placement))
    ps_lib.check_shard_layout(config.resolved_checkpoint_dir, model)
    ps_lib.write_shard_layout(config.resolved_checkpoint_dir, model)
    strategy_details = {
        "num_workers": num_workers, "num_ps": cluster.num_ps,
        "cluster": cluster.cluster_dict(),
        "partitioner": config.ps_partitioner,
        "min_shard_bytes": config.ps_min_shard_bytes,
        "max_shards": config.ps_max_shards or cluster.num_ps,
        "steps_per_execution": config.steps_per_execution,
        "placement": placement}
    runner, evaluate = _parameter_server_runner(
        config, spec=spec, plan=plan, strategy=strategy, parts=parts,
        keeper=keeper)
  else:
    train_options = input_pipeline.options_for(
        spec, files=plan.train_files,
        global_batch_size=plan.global_batch_size, is_training=True,
        shuffle_buffer_size=config.shuffle_buffer_size,
        cache=config.cache_dataset, seed=config.seed,
        file_record_counts=plan.train_file_counts,
        gradient_accumulation_steps=plan.batch.gradient_accumulation_steps,
        # A resumable position needs a reproducible reading order.
        deterministic=config.deterministic or input_position is not None)

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

    runner = step_runner.LocalStepRunner(
        trainer=trainer, iterator_fn=train_iterator, num_workers=num_workers)
    evaluate = None
    if config.mode != "train":
      eval_data = input_pipeline.distribute(
          strategy, input_pipeline.options_for(
              spec, files=plan.eval_files,
              # Micro-batches: what a step's memory was sized for.
              global_batch_size=plan.eval_batch_size,
              is_training=False,
              cache=config.cache_dataset,
              # TPUs need static shapes: pad the last batches, masked in the
              # metrics.
              pad_to_static_batches=on_tpu))
      evaluate = lambda: trainer.evaluate(eval_data)

  run_log = run_log_lib.RunLog(
      tensorboard_dir=tensorboard_dir,
      metrics_dir=config.model_dir if is_chief else None,
      global_batch_size=plan.global_batch_size, total_steps=plan.total_steps,
      summarize=trainer.summarize,
      loss_explosion_factor=config.loss_explosion_factor)
  all_callbacks = [run_log_lib.TrainingTensorBoard(log_dir=tensorboard_dir,
                                                   write_graph=False)]
  # Other workers' file-writing callbacks write into their scratch folder.
  all_callbacks += keras_callbacks.for_this_task(
      callbacks, scratch_dir=None if is_chief else scratch_dir)
  # The chief traces its own process (other workers' folders are scratch).
  profiler = (profiling.ProfileWindow(
      config.profile_steps, os.path.join(tensorboard_dir, "train"))
              if config.profile_steps and is_chief else None)
  if hypertune_reporter is not None and is_chief:
    # The chief reports each evaluation's metric (every strategy).
    all_callbacks.append(hptune.HypertuneCallback(
        config.hptune_metric, reporter=hypertune_reporter,
        step_fn=lambda: controller.step))
  controller = Controller(
      runner=runner,
      options=ControllerOptions(
          total_steps=plan.total_steps, steps_per_epoch=plan.steps_per_epoch,
          log_steps=config.log_steps, checkpoint_steps=config.checkpoint_steps,
          epochs_between_evals=config.epochs_between_evals,
          max_consecutive_skipped_steps=config.max_consecutive_skipped_steps),
      checkpoints=keeper, step_counter=trainer.global_step, run_log=run_log,
      evaluate=evaluate, model=model,
      learning_rate=lambda: assembly.current_learning_rate(optimizer),
      loss_scale=lambda: precision.current_loss_scale(optimizer),
      callbacks=all_callbacks, preemption=watcher, profiler=profiler)
  try:
    result = controller.run()
  except preemption.PreemptedError:
    if is_chief:
      # Servers and side-car evaluators stop with the chief.
      done_marker.mark_done(config.model_dir)
    raise
  except step_runner.PS_LOST_ERRORS + step_runner.PEER_LOST_ERRORS as e:
    if asynchronous:
      # Noticed outside the step runner (a checkpoint save, an evaluation).
      raise step_runner.ps_lost_error(
          e, after=f"step {controller.step}",
          last_checkpoint=keeper.latest) from e
    if multi_worker and isinstance(e, step_runner.PEER_LOST_ERRORS):
      # A collective (a step, a save, the agreement) failed or timed out.
      raise step_runner.peer_lost_error(
          e, after=f"step {controller.step}",
          last_checkpoint=keeper.latest,
          own=(cluster.task_type, cluster.task_index),
          addresses=cluster.cluster) from e
    raise
  finally:
    watcher.uninstall()
  export_model = model
  if asynchronous:
    # The tables are ShardedVariables on the ps tasks, which a SavedModel
    # cannot capture: export a local copy restored from the final
    # checkpoint (each table one variable again).
    export_model = assembly.build_model(
        config, task=task, sync_batch_norm=plan.sync_batch_norm)
    tf.train.Checkpoint(model=export_model).restore(
        keeper.latest).expect_partial()
  export_dir = export.export_saved_model(
      export_model, out_dir(config.resolved_export_dir, "saved_model"),
      source=environment_lib.output_sources(config, applied)["export_dir"][1],
      details={"step": controller.step, "model": task.model_name})
  record = manifest_lib.build_manifest(
      run_options.manifest_options(config),
      ran=manifest_lib.WhatRan(
          decision=decision, plan=plan, dtype_policy=policy.name,
          loss_scale=precision.current_loss_scale(optimizer),
          optimizer_iterations=int(optimizer.iterations.numpy()),
          result=result, run_log=run_log, objectives=parts.objectives,
          model_name=task.model_name, model_memory=model_memory.to_dict(),
          strategy_details=strategy_details),
      where=manifest_lib.WhereItRan(
          cluster=cluster, choice=choice, num_workers=num_workers,
          is_chief=is_chief, devices=devices.describe_devices(),
          environment_applied=applied, trial_fields=trial_fields),
      wrote=manifest_lib.WhatItWrote(
          artifacts={"checkpoint": keeper.latest,
                     "checkpoint_dir": config.resolved_checkpoint_dir,
                     "saved_model": config.resolved_export_dir,
                     "tensorboard": config.resolved_tensorboard_dir,
                     "metrics": os.path.join(config.model_dir,
                                             run_log_lib.METRICS_FILE),
                     "init_checkpoint": warm_started,
                     "profile": profiler.latest_trace if profiler else None},
          seconds={"total": time.time() - started,
                   "training": result.train_seconds,
                   "training_all_processes": run_log.training_seconds()}))
  if not is_chief:
    shutil.rmtree(scratch_dir, ignore_errors=True)
    logging.info("%s %d done; the chief writes the artifacts.",
                 cluster.task_type, cluster.task_index)
  else:
    path = manifest_lib.write_manifest(config.model_dir, record)
    logging.info("Run manifest: %s; SavedModel: %s", path, export_dir)
    final_eval = result.final_eval
    if final_eval:
      print("Final eval: " + run_log_lib.format_metrics(
          run_log_lib.metric_values(final_eval)) +
            f" ({final_eval['num_examples']} examples). Artifacts in "
            f"{config.model_dir}", flush=True)
  if multi_worker:
    # No worker leaves while another still needs it (the chief hosts the
    # coordination service).
    try:
      worker_exit.leave_together(strategy, num_workers=num_workers)
    except step_runner.PEER_LOST_ERRORS as e:
      raise step_runner.peer_lost_error(
          e, after="the final barrier", last_checkpoint=keeper.latest,
          own=(cluster.task_type, cluster.task_index),
          addresses=cluster.cluster) from e
    if exit_plan is not None and num_workers > 1:

      def release():
        if cleanup is not None:
          cleanup.close()  # The lease, the signal handlers.
        # Side-car evaluators stop with the chief.
        done_marker.mark_done(config.model_dir)

      # Never returns: the objects above stay alive until the process ends.
      worker_exit.leave_process(
          exit_plan, task_type=cluster.task_type,
          task_index=cluster.task_index, jobs=cluster.cluster,
          is_chief=is_chief, before_exit=release)
  return record


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
  runner = step_runner.CoordinatorStepRunner(
      trainer=parts.trainer, coordinator=coordinator, iterator=iterator,
      last_checkpoint=lambda: keeper.latest)
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
  return runner, lambda: evaluator.evaluate(eval_data)


@dataclasses.dataclass(frozen=True)
class EvaluatorPlan:
  """How an evaluator process evaluates: as the run evaluates, where it can.

  Attributes:
    strategy: the strategy name it evaluates under (`mirrored`,
      `one_device`, or `off`: the default strategy).
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
  job's flags), else `MIN_EVAL_BATCH_SIZE`. A mirrored evaluator whose replicas do not divide
  the batch evaluates on one device instead (the batch is kept: the
  metrics do not depend on it, summed over examples, but a per-batch
  metric would; `run_evaluator` checks this once the strategy is built).

  Args:
    config: the evaluator's `TrainConfig`.
    run_strategy: the run's strategy name (`--distribution_strategy`, or
      the one the run recorded when the evaluator was given `auto`).
    run_record: `run_config.json` of the checkpoint folder, or None.
  """
  if run_record and run_record.get("eval_batch_size"):
    batch, source = int(run_record["eval_batch_size"]), "the run's record"
  elif run_record and run_record.get("global_batch_size"):
    batch = int(run_record["global_batch_size"])
    if run_record.get("strategy") == "parameter_server":
      batch = max(batch, MIN_EVAL_BATCH_SIZE)
    source = "the run's record (global batch)"
  elif config.batch_size and run_strategy == "parameter_server":
    # An evaluator task may start before the chief records the run: the
    # same flags give the coordinator's rule.
    batch = max(config.batch_size, MIN_EVAL_BATCH_SIZE)
    source = "--batch_size (the coordinator's rule)"
  elif config.batch_size:
    batch = max(1, config.batch_size // config.gradient_accumulation_steps)
    source = "--batch_size / --gradient_accumulation_steps"
  else:
    batch, source = MIN_EVAL_BATCH_SIZE, "the default"
  if run_strategy in ("mirrored", "one_device", "off"):
    name, reason = run_strategy, "the run's strategy"
  elif run_strategy == "tpu":
    name, reason = "one_device", ("the run trains on TPU; the evaluator "
                                  "uses one local device")
  else:
    local = _local_devices(config)
    name = "mirrored" if local > 1 else "one_device"
    reason = (f"the run's {run_strategy} spans processes; the evaluator is "
              f"one process: its {local} local device(s)")
  return EvaluatorPlan(strategy=name, global_batch_size=batch,
                       batch_source=source, reason=reason)


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
  included).

  Returns:
    `{"role": "evaluator", "results": [...]}`.

  Raises:
    ConfigError: `once` and no checkpoint to evaluate.
  """
  started = time.time()
  spec = task.dataset
  num_workers = max(cluster.num_workers, 1)
  checkpoint_dir = config.resolved_checkpoint_dir
  latest = tf.train.latest_checkpoint(checkpoint_dir) if once else None
  if once and not latest:
    raise ConfigError(
        f"--mode=eval: no checkpoint in {checkpoint_dir} to evaluate. Train "
        "first (same --model_dir), or point --checkpoint_dir at one.")
  plan = run_plan_lib.make_run_plan(
      run_options.plan_options(config), spec, num_replicas_in_sync=1, num_workers=1,
      asynchronous=True, decision=decision) if (
          config.train_steps <= 0 and not once) else None
  final_step = (checkpoint_paths.checkpoint_step(latest) if once else
                config.train_steps if config.train_steps > 0 else
                plan.total_steps)
  eval_files = (plan.eval_files if plan else
                run_plan_lib.resolve_data_files(run_options.data_options(config), spec)[1])
  record = checkpointing.read_run_record(checkpoint_dir, config.model_dir)
  # Told no strategy (`auto`), it evaluates with the one the run recorded.
  run_strategy = (record["strategy"] if record and record.get("strategy")
                  and decision.strategy_reason.startswith("auto")
                  else decision.strategy)
  how = evaluator_plan(config, run_strategy=run_strategy, run_record=record)
  precision.configure_precision(config.dtype)
  if how.strategy == "mirrored":
    devices.configure_cpu_devices(config.num_cpu_devices)
  choice = strategy_lib.make_strategy(
      run_options.strategy_options(config.replace(distribution_strategy=how.strategy)))
  if how.global_batch_size % choice.strategy.num_replicas_in_sync:
    how = dataclasses.replace(how, strategy="one_device", reason=(
        f"{choice.strategy.num_replicas_in_sync} local replicas do not "
        f"divide the run's evaluation batch {how.global_batch_size}"))
    choice = strategy_lib.make_strategy(
        run_options.strategy_options(config.replace(distribution_strategy="one_device")))
  strategy = choice.strategy
  logging.info("Evaluator: %s, %d replica(s) (%s); global batch %d (from "
               "%s)", how.strategy, strategy.num_replicas_in_sync,
               how.reason, how.global_batch_size, how.batch_source)
  with strategy.scope():
    parts = assembly.evaluation_parts(config, task=task)
  model = parts.model
  trainer = assembly.evaluation_trainer(
      parts, global_batch_size=how.global_batch_size, strategy=strategy)
  dataset = input_pipeline.distribute(strategy, input_pipeline.options_for(
      spec, files=eval_files, global_batch_size=how.global_batch_size,
      is_training=False, cache=config.cache_dataset))
  evaluated_with = {"strategy": how.strategy,
                    "num_replicas_in_sync": strategy.num_replicas_in_sync,
                    "global_batch_size": how.global_batch_size,
                    "reason": how.reason}
  run_log = run_log_lib.RunLog(
      tensorboard_dir=config.resolved_tensorboard_dir, metrics_dir=None,
      global_batch_size=how.global_batch_size, total_steps=final_step,
      eval_subdir="eval")
  controller = Controller(
      options=ControllerOptions(total_steps=max(final_step, 1),
                                steps_per_epoch=1),
      run_log=run_log, evaluate=lambda: {**trainer.evaluate(dataset),
                                         "evaluated_with": evaluated_with},
      model=model)

  def restore(path):
    tf.train.Checkpoint(model=model).restore(path).expect_partial()

  results_dir = os.path.join(config.model_dir, "eval")
  if once:
    restore(latest)
    result = controller.evaluate(final_step)
    result.update(checkpoint=latest)
    controller_lib.append_eval_result(results_dir, result)
    run_log.flush()
    print(f"Eval of {latest}: {run_log_lib.format_eval(result)}",
          flush=True)
    return {"role": "evaluator", "results": [result]}
  logging.info("Evaluator for %d training worker(s): final step %d%s",
               num_workers, final_step,
               "" if config.train_steps > 0 else
               " (from --train_epochs; the chief's done marker also ends "
               "the evaluation)")
  results = controller.evaluate_continuously(
      checkpoint_dir=checkpoint_dir, results_dir=results_dir,
      restore=restore, final_step=final_step,
      finished=lambda: done_marker.marked_done_since(config.model_dir, started),
      poll_seconds=poll_seconds, idle_timeout=idle_timeout)
  return {"role": "evaluator", "results": results}
