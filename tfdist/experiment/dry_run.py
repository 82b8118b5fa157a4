"""`--dry_run`: every start-up check that needs the data and the plan, and
nothing built or trained."""

from typing import Tuple

from absl import logging

from tfdist.backends import registry as backends
from tfdist.experiment import prepare
from tfdist.training.plan import run_plan as run_plan_lib


def planned_replicas(config, *, decisions, cluster) -> Tuple[int, int]:
  """`(num_replicas_in_sync, num_workers)` a run will have, without
  building its strategy (its backend's `planned_replicas`; TPUs are asked).

  Args:
    config: the run's `TrainConfig`.
    decisions: its `tfdist.distribute.decisions.Decisions`.
    cluster: its `ClusterInfo`.

  Raises:
    ConfigError: as the backend's `make_strategy` (TPU only).
  """
  backend = backends.backend_for(decisions.strategy)
  return backend.planned_replicas(config, decisions, cluster=cluster)


def dry_run(prepared: prepare.PreparedRun, *, task, writer: bool) -> dict:
  """The plan made and printed, the resume compared (by the writer).

  Args:
    prepared: the run's `PreparedRun`.
    task: its `tfdist.training.task.Task`.
    writer: this process writes `--model_dir` (it compares the run with the
      checkpoint's).

  Returns:
    The dry run's summary: role, batch, replicas, steps, examples, notes.

  Raises:
    ConfigError: as `tfdist.training.plan.run_plan.make_run_plan`.
    tfdist.errors.IncompatibleResumeError: as
      `tfdist.experiment.prepare.check_resume`.
  """
  config, cluster = prepared.config, prepared.cluster
  decided = prepared.decisions
  replicas, num_workers = prepared.backend.planned_replicas(
      config, decided, cluster=cluster)
  plan_options = prepare.plan_options(config, decided, cluster=cluster)
  plan = run_plan_lib.make_run_plan(
      plan_options, task.dataset,
      num_replicas_in_sync=replicas,
      num_workers=num_workers, asynchronous=prepared.backend.asynchronous,
      decision=prepared.decision, on_tpu=prepared.backend.on_tpu)
  logging.info("%s", plan.describe(plan_options))
  notes = prepare.check_resume(config, decided, plan) if writer else []
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
