"""`run_experiment`: this process's part of the job, by role.

Every role first runs `tfdist.experiment.prepare.start_run`; then an
evaluator evaluates (`tfdist.experiment.evaluator`), a serving task serves
(its backend's `serve`), and a training process runs an
`ExperimentRunner` (`tfdist.experiment.runner`).
"""

import os
import time
from typing import Any, Optional, Sequence

import keras

from tfdist.cloud import hptune
from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.distribute import cluster as cluster_lib
from tfdist.distribute import environment as environment_lib
from tfdist.distribute import worker_exit
from tfdist.experiment import dry_run as dry_run_lib
from tfdist.experiment import evaluator as evaluator_lib
from tfdist.experiment import exporter
from tfdist.experiment import prepare
from tfdist.experiment import runner as runner_lib
from tfdist.training.plan import preflight
from tfdist.training import task as task_lib


def _evaluates(prepared: prepare.PreparedRun) -> bool:
  """Whether this process is an evaluator (an `evaluator` task, or
  `--mode=eval`/`continuous_eval`).

  Raises:
    ConfigError: an evaluating mode on a member of a training cluster.
  """
  config, cluster = prepared.config, prepared.cluster
  evaluating = config.task.mode in ("eval", "continuous_eval")
  if evaluating and cluster.task_type not in (
      cluster_lib.EVALUATOR, cluster_lib.CHIEF) and (
          cluster.num_workers > 1 or cluster.num_ps):
    raise errors.ConfigError(
        f"--mode={config.task.mode} evaluates in one process; this one is "
        f"{cluster.task_type} {cluster.task_index} of a training cluster. "
        "Run it without TF_CONFIG/--worker_hosts, or as the cluster's "
        "evaluator task.")
  return cluster.task_type == cluster_lib.EVALUATOR or evaluating


def _evaluate(prepared: prepare.PreparedRun, *, task: task_lib.Task) -> dict:
  """The evaluator role: its folders probed, then a dry run or
  `run_evaluator`."""
  config, decided = prepared.config, prepared.decisions
  # Never a writer of the chief's artifacts, and never the lease holder.
  for folder in (os.path.join(decided.model_dir, "eval"),
                 os.path.join(decided.tensorboard_dir, "eval")):
    preflight.probe_writable(folder, flag="--model_dir",
                             value=decided.model_dir)
  if config.reliability.dry_run:
    return dry_run_lib.dry_run(prepared, task=task, writer=False)
  return evaluator_lib.run_evaluator(config, task=task, cluster=prepared.cluster,
                       decisions=decided,
                       once=config.task.mode == "eval")


def run_experiment(config: TrainConfig, *,
                   callbacks: Sequence[keras.callbacks.Callback] = (),
                   environment: Optional[environment_lib.RunEnvironment] = None,
                   task: Optional[task_lib.Task] = None,
                   exit_plan: Optional[worker_exit.ExitPlan] = None,
                   print_final_eval: bool = True,
                   train_actions: Sequence[Any] = (),
                   eval_actions: Sequence[Any] = ()) -> dict:
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
    train_actions: `tfdist.training.controller.Action`s run after the
      controller's own after each chunk of steps, on every training
      process (`Controller(train_actions=...)`).
    eval_actions: callables given each evaluation's result on the
      training processes (`Controller(eval_actions=...)`).

  Returns:
    The run manifest (the chief also writes it to
    `model_dir/run_manifest.json`); for a parameter-server `worker` or `ps`
    task, `{"role": ..., "index": ...}`; for an `evaluator` task and the
    `eval` and `continuous_eval` modes, `{"role": "evaluator", "results":
    [...]}`; for the `export` mode, `{"role": "export", "checkpoint": ...,
    "step": ..., "saved_model": ...}` (`tfdist.experiment.exporter`).

  With `config.dry_run`, every start-up check runs (names, cluster, output
  folders, the `--model_dir` lease, data files and schema, resumption) and
  the plan is printed; nothing is built or trained.

  Raises:
    ConfigError: invalid or inconsistent configuration, an unknown model or
      data set, a model or data the other does not fit (before training),
      an unsupported TensorFlow or Keras
      (`tfdist.errors.UnsupportedVersionError`) or a path whose file
      system is missing (`tfdist.errors.FileSystemUnavailableError`).
    DataNotFoundError: missing data.
    tfdist.errors.DataError: a damaged input file or records of
      another schema (before training).
    tfdist.errors.OutputNotWritableError: an output folder cannot be
      written (before anything else is done).
    tfdist.errors.IncompatibleResumeError: the checkpoint's run
      had another model or global batch (before training).
    tfdist.errors.LeaseHeldError: another live run holds
      `--model_dir`.
    tfdist.errors.PreemptedError: SIGTERM or SIGINT stopped training
      after a checkpoint was saved (rerun to resume).
    tfdist.errors.TrainingDivergedError: the loss or the state became
      NaN or infinite (the last good checkpoint is kept and named).
    tfdist.errors.ParameterServerError: a ps task was lost.
    tfdist.errors.PeerLostError: a MultiWorkerMirrored peer was
      lost.
  """
  started = time.time()
  task, prepared = prepare.start_run(config, callbacks=callbacks,
                             environment=environment, task=task)
  hypertune_reporter = None
  if prepared.config.cloud.hptune_metric:
    # Vertex AI hyperparameter tuning: the package now, the metric's name
    # once the model is built (before training).
    hypertune_reporter = hptune.make_hypertune()
  if _evaluates(prepared):
    return _evaluate(prepared, task=task)
  if prepared.config.task.mode == "export":
    return exporter.run_export(prepared.config, task=task,
                               cluster=prepared.cluster,
                               decisions=prepared.decisions)
  # A parameter-server cluster's `worker` and `ps` tasks serve until the
  # run ends.
  served = prepared.backend.serve(prepared.config, prepared.decisions,
                                  prepared.cluster)
  if served is not None:
    return served
  runner = runner_lib.ExperimentRunner(prepared, task=task, callbacks=callbacks,
                            exit_plan=exit_plan, started=started,
                            hypertune_reporter=hypertune_reporter,
                            print_final_eval=print_final_eval,
                            train_actions=train_actions,
                            eval_actions=eval_actions)
  with prepare.name_environment_sources(prepared.environment_applied):
    return runner.run()

