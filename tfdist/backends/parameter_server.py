"""`ParameterServerStrategy`: a coordinator schedules steps on `worker` tasks
that read and update variables (sharded tables among them) on `ps` tasks."""

import dataclasses
from typing import Optional

from absl import logging
import tensorflow as tf

from tfdist.backends import base
from tfdist.backends import multi_worker
from tfdist.data import input_pipeline
from tfdist.distribute import cluster as cluster_lib
from tfdist.distribute import parameter_server as ps_lib
from tfdist.distribute import strategy as strategy_lib
from tfdist.core.strategy_kind import StrategyKind
from tfdist.training import assembly
from tfdist.training.plan import run_plan
from tfdist.training.step import step_runner


@base.register_backend(StrategyKind.PARAMETER_SERVER)
class ParameterServerBackend(base.Backend):
  """Asynchronous: each worker steps on its own batches, scheduled by the
  coordinator (the writer); `worker` and `ps` tasks serve until the run
  ends. A lost worker is tolerated; a lost ps task stops the run
  (`ParameterServerError`, resumed from the last checkpoint)."""

  asynchronous = True
  multi_process = True
  # Workers read unseeded copies of every file: no one reading order to
  # record.
  keeps_input_position = False

  def new_strategy(self, options, *, cluster):
    """`ParameterServerStrategy` over the cluster's workers and ps tasks,
    once every address resolves (the coordinator connects to each)."""
    section = options.strategy
    cluster_lib.check_addresses_resolve(
        cluster, retry_seconds=min(
            strategy_lib.RESOLVE_RETRY_SECONDS,
            section.cluster.cluster_start_timeout_seconds))
    return ps_lib.make_ps_strategy(section.parameter_servers, cluster)

  def training_workers(self, cluster) -> int:
    """The `worker` tasks (the coordinator schedules, it does not step; 0
    in a cluster without workers)."""
    return len(cluster.cluster.get(cluster_lib.WORKER, ()))

  def serves(self, cluster) -> bool:
    return cluster.task_type in (cluster_lib.WORKER, cluster_lib.PS)

  def serve(self, config, decisions, cluster) -> Optional[dict]:
    """`worker` and `ps` tasks serve until the coordinator marks the run
    done; returns `{"role", "index", "exit_status"}` (or the dry run's)."""
    ps_lib.set_grpc_fail_fast()
    if not self.serves(cluster):
      return None
    if config.reliability.dry_run:
      logging.info("tfdist: dry run: %s %d would serve the parameter-server "
                   "cluster.", cluster.task_type, cluster.task_index)
      return {"dry_run": True, "role": cluster.task_type,
              "index": cluster.task_index}
    status = ps_lib.serve(decisions.model_dir, cluster,
                          grace_seconds=(config.strategy.cluster
                                         .preemption_grace_seconds))
    return {"role": cluster.task_type, "index": cluster.task_index,
            "exit_status": status}

  def build_inputs(self, run: base.TrainingRun):
    details = self._describe_placement(run)
    runner, evaluate = _coordinator_runner(
        run.settings, spec=run.task.dataset, plan=run.plan,
        strategy=run.strategy, parts=run.parts,
        latest_checkpoint=run.latest_checkpoint)
    return runner, evaluate, details

  def _describe_placement(self, run: base.TrainingRun) -> dict:
    """Logs and checks the variables' placement on the ps tasks; returns
    the manifest's `strategy_details`."""
    partitioner = run.strategy_options.strategy.parameter_servers
    model = run.parts.model
    placement = ps_lib.describe_placement(
        model, run.parts.optimizer,
        large_bytes=min(partitioner.ps_min_shard_bytes, 64 << 10))
    logging.info("%s", ps_lib.format_placement(placement))
    ps_lib.check_shard_layout(run.checkpoint_dir, model)
    ps_lib.write_shard_layout(run.checkpoint_dir, model)
    return {"num_workers": run.num_workers, "num_ps": run.cluster.num_ps,
            "cluster": run.cluster.cluster_dict(),
            "partitioner": partitioner.ps_partitioner,
            "min_shard_bytes": partitioner.ps_min_shard_bytes,
            "max_shards": partitioner.ps_max_shards or run.cluster.num_ps,
            "steps_per_execution": run.steps_per_execution,
            "placement": placement}

  def translate_failure(self, error, *, after: str,
                        last_checkpoint: Optional[str], cluster):
    del cluster
    if not isinstance(error, step_runner.PS_LOST_ERRORS +
                      step_runner.PEER_LOST_ERRORS):
      return None
    # Noticed outside the step runner (a checkpoint save, an evaluation).
    return step_runner.ps_lost_error(error, after=after,
                                     last_checkpoint=last_checkpoint)

  def export_model(self, run: base.TrainingRun):
    """A local copy restored from the final checkpoint: the tables are
    ShardedVariables on the ps tasks, which a SavedModel cannot capture
    (each table is one variable again)."""
    model = assembly.build_model(
        run.assembly_options, task=run.task,
        sync_batch_norm=run.plan.sync_batch_norm)
    tf.train.Checkpoint(model=model).restore(
        run.latest_checkpoint()).expect_partial()
    return model

  def evaluation_batch(self, global_batch_size: int) -> int:
    """At least `MIN_EVAL_BATCH_SIZE` (the coordinator's rule)."""
    return max(global_batch_size, run_plan.MIN_EVAL_BATCH_SIZE)

  def evaluator_strategy(self, local_devices: int):
    return multi_worker.spanning_evaluator(self.kind, local_devices)


def _coordinator_runner(settings: base.InputSettings, *, spec, plan,
                        strategy, parts, latest_checkpoint):
  """The coordinator's step runner and in-process evaluation."""
  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
  train_options = input_pipeline.options_for(
      spec, files=plan.train_files,
      global_batch_size=plan.global_batch_size, is_training=True,
      shuffle_buffer_size=settings.shuffle_buffer_size,
      cache=settings.cache_dataset,
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
      last_checkpoint=latest_checkpoint,
      reread_fn=lambda: input_pipeline.make_dataset(reread_options),
      reread_batches=plan.steps_per_epoch)
  if settings.mode == "train":
    return runner, None
  # Held-out evaluation on the coordinator (it reads the ps tasks'
  # variables), with the default strategy.
  eval_batch = plan.eval_batch_size
  evaluator = assembly.evaluation_trainer(parts,
                                          global_batch_size=eval_batch)
  eval_data = input_pipeline.make_dataset(input_pipeline.options_for(
      spec, files=plan.eval_files, global_batch_size=eval_batch,
      is_training=False, cache=settings.cache_dataset))
  return runner, lambda **hooks: evaluator.evaluate(eval_data, **hooks)
