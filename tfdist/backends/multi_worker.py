"""`MultiWorkerMirroredStrategy`: every worker process runs every step, the
gradients all-reduced across processes; the chief writes."""

import contextlib
from typing import Optional, Tuple

from tfdist.backends import base
from tfdist.backends import synchronous
from tfdist.distribute import devices
from tfdist.distribute import strategy as strategy_lib
from tfdist.distribute import worker_exit
from tfdist.distribute.strategy_kind import StrategyKind
from tfdist.training import done_marker
from tfdist.training import step_runner


@base.register_backend(StrategyKind.MULTI_WORKER_MIRRORED)
class MultiWorkerMirroredBackend(synchronous.SynchronousBackend):
  """The chief and the workers step together; a lost peer stops them all
  (`tfdist.errors.PeerLostError`, resumed from the last checkpoint)."""

  def training_workers(self, cluster) -> int:
    """The chief and the workers (`ClusterInfo.num_workers`, at least 1)."""
    return max(cluster.num_workers, 1)

  def writes_model_dir(self, cluster) -> bool:
    """Only the chief; the other workers write into a scratch folder."""
    return bool(cluster.is_chief)

  def cross_process_collectives(self, num_workers: int) -> bool:
    return num_workers > 1

  def build_strategy(self, config, decisions, *, cluster,
                     lease=None) -> strategy_lib.StrategyChoice:
    # Built before anything starts TensorFlow's runtime (it configures the
    # collective runtime). It may hold the interpreter, and so the lease's
    # renewals, until every peer has connected.
    with (lease.extended(config.cluster_start_timeout_seconds)
          if lease is not None else contextlib.nullcontext()):
      choice = strategy_lib.make_strategy(
          strategy_lib.StrategyOptions.of(
              config.strategy, decisions,
              reduction_server=config.cloud.reduction_server),
          cluster=cluster)
    devices.configure_cpu_devices(config.num_cpu_devices)
    return choice

  def planned_replicas(self, config, decisions, *, cluster) -> Tuple[int, int]:
    workers = self.training_workers(cluster)
    return workers * max(base.local_accelerators(config.num_gpus), 1), workers

  def translate_failure(self, error, *, after: str,
                        last_checkpoint: Optional[str], cluster):
    if not isinstance(error, step_runner.PEER_LOST_ERRORS):
      return None
    # A collective (a step, a save, the agreement, the barrier) failed or
    # timed out.
    return step_runner.peer_lost_error(
        error, after=after, last_checkpoint=last_checkpoint,
        own=(cluster.task_type, cluster.task_index),
        addresses=cluster.cluster)

  def leave_together(self, run, *, failed: bool = False) -> None:
    """The final barrier, then (with an `exit_plan`, unless this task or
    another arrived `failed`) the process ends here, the chief last.

    Raises:
      tfdist.errors.PeerLostError: a peer was lost at the barrier.
      tfdist.errors.PeerStoppedError: another task arrived `failed`.
    """
    cluster = run.cluster
    # No worker leaves while another still needs it (the chief hosts the
    # coordination service).
    try:
      worker_exit.leave_together(run.strategy, num_workers=run.num_workers,
                                 failed=failed)
    except step_runner.PEER_LOST_ERRORS as e:
      raise self.translate_failure(
          e, after="the final barrier", last_checkpoint=run.keeper.latest,
          cluster=cluster) from e
    if failed or run.exit_plan is None or run.num_workers <= 1:
      return

    def release():
      run.cleanup.close()  # The lease, the signal handlers.
      # Side-car evaluators stop with the chief.
      done_marker.mark_done(run.decisions.model_dir)

    # Never returns: the runner's objects stay alive until the process ends.
    worker_exit.leave_process(
        run.exit_plan, task_type=cluster.task_type,
        task_index=cluster.task_index, jobs=cluster.cluster,
        is_chief=run.is_writer, before_exit=release)

  def evaluator_strategy(self, local_devices: int):
    return spanning_evaluator(self.kind, local_devices)


def spanning_evaluator(kind, local_devices: int):
  """`(strategy, reason)` for the one-process evaluator of a run that spans
  processes: Mirrored over its local devices when it has several."""
  name = (StrategyKind.MIRRORED if local_devices > 1 else
          StrategyKind.ONE_DEVICE)
  return name, (f"the run's {kind} spans processes; the evaluator is one "
                f"process: its {local_devices} local device(s)")
