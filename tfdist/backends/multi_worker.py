"""`MultiWorkerMirroredStrategy`: every worker process runs every step, the
gradients all-reduced across processes; the chief writes."""

import contextlib
import signal
import sys
import threading
from typing import Optional, Tuple

from absl import logging
import tensorflow as tf

from tfdist import errors
from tfdist.backends import base
from tfdist.backends import synchronous
from tfdist.distribute import cluster as cluster_lib
from tfdist.distribute import devices
from tfdist.distribute import strategy as strategy_lib
from tfdist.distribute import worker_exit
from tfdist.core.strategy_kind import StrategyKind
from tfdist.runtime import watchdog
from tfdist.distribute import done_marker
from tfdist.training.step import step_runner

# MultiWorkerMirroredStrategy over a real cluster configures TensorFlow's
# collective runtime for that cluster, once per process: a second one cannot
# be built.
_MWMS_BUILT = []
# Once every peer answered, TensorFlow's own wait gets at least this long.
MIN_JOIN_SECONDS = 60.0


@base.register_backend(StrategyKind.MULTI_WORKER_MIRRORED)
class MultiWorkerMirroredBackend(synchronous.SynchronousBackend):
  """The chief and the workers step together; a lost peer stops them all
  (`tfdist.errors.PeerLostError`, resumed from the last checkpoint)."""

  multi_process = True
  mirrored = True
  # Its all-reduce splits the gradients into packs.
  accepts_bytes_per_pack = True

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
    with (lease.extended(config.strategy.cluster.cluster_start_timeout_seconds)
          if lease is not None else contextlib.nullcontext()):
      choice = self.make_strategy(self.strategy_options(config, decisions),
                                  cluster=cluster)
    devices.configure_cpu_devices(config.strategy.num_cpu_devices)
    return choice

  def new_strategy(self, options, *, cluster):
    return multi_worker_mirrored_strategy(options, cluster)

  def planned_replicas(self, config, decisions, *, cluster) -> Tuple[int, int]:
    workers = self.training_workers(cluster)
    gpus = base.local_accelerators(config.strategy.num_gpus)
    return workers * max(gpus, 1), workers

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

  def leave_together(self, run: base.RunEnding, *,
                     failed: bool = False) -> None:
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
          e, after="the final barrier",
          last_checkpoint=run.latest_checkpoint(),
          cluster=cluster) from e
    if failed or run.exit_plan is None or run.num_workers <= 1:
      return

    def release():
      run.close()  # The lease, the signal handlers.
      # Side-car evaluators stop with the chief.
      done_marker.mark_done(run.model_dir)

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


_MWMS_IMPLEMENTATIONS = {"auto": "AUTO", "ring": "RING", "nccl": "NCCL"}
_MWMS_JOBS = (cluster_lib.CHIEF, cluster_lib.WORKER)


def _mwms_all_reduce(options: strategy_lib.StrategyOptions, cluster) -> str:
  """The MWMS all-reduce implementation name (`auto`, `ring`, `nccl`).

  Raises:
    ConfigError: a Reduction Server without GPUs, NCCL without GPUs, or an
      algorithm that does not apply to multi_worker_mirrored.
  """
  alg = options.strategy.all_reduce_alg
  if options.reduction_server or cluster.reduction_server_replicas:
    # Vertex AI's Reduction Server serves NCCL all-reduce only.
    why = ("--reduction_server" if options.reduction_server else
           f"{cluster.source}'s job description runs it in worker pool 2")
    if not tf.config.list_physical_devices("GPU"):
      raise errors.ConfigError(
          f"Vertex AI's Reduction Server ({why}) needs GPU workers: it works "
          "with NCCL all-reduce, and this task sees no GPU. Give the chief "
          "and worker pools accelerators (python -m tfdist.job_spec vertex "
          "--accelerator=...), or drop the Reduction Server pool (and "
          "--reduction_server) to all-reduce over gRPC on CPUs.")
    alg = "nccl"
  if alg not in _MWMS_IMPLEMENTATIONS:
    raise errors.ConfigError(
        f"--all_reduce_alg={alg} does not apply to multi_worker_mirrored. Use "
        "ring (gRPC; CPUs or GPUs), nccl (GPUs; Vertex AI Reduction Server) "
        "or auto.")
  if alg == "nccl" and not tf.config.list_physical_devices("GPU"):
    raise errors.ConfigError(
        "--all_reduce_alg=nccl needs GPUs; on CPU-only workers use "
        "--all_reduce_alg=ring or auto.")
  return alg


def _check_first_mwms() -> None:
  """Raises ConfigError when this process already built an MWMS."""
  if _MWMS_BUILT:
    raise errors.ConfigError(
        "A MultiWorkerMirroredStrategy was already built in this process "
        f"({_MWMS_BUILT[0]}); TensorFlow configures its collective runtime "
        "once per process, so a second one cannot be built. Run each "
        "multi-worker training in a process of its own (python -m "
        "tfdist.train, or tfdist.launch for a local cluster).")


def _check_mwms_task(cluster) -> None:
  """Raises ConfigError when this task is not a chief or worker."""
  if cluster.is_multi_worker and cluster.task_type not in _MWMS_JOBS:
    raise errors.ConfigError(
        f"This task is {cluster.task_type} {cluster.task_index} "
        f"({cluster.source}); multi_worker_mirrored runs only on chief and "
        "worker tasks. Use --distribution_strategy=parameter_server for a "
        "cluster with ps tasks.")


def _wait_for_mwms_peers(cluster, seconds: float) -> float:
  """Waits in Python until every chief and worker answers: seconds waited.

  In Python, SIGTERM and SIGINT work and the missing tasks can be named;
  TensorFlow's own wait after this is then short. 0 outside a cluster.
  """
  return strategy_lib.wait_for_peers(
      cluster, _MWMS_JOBS, seconds,
      describe="the multi_worker_mirrored cluster")


@contextlib.contextmanager
def _signals_end_the_process():
  """SIGINT (Ctrl-C) takes its default action inside the block, on the main
  thread: the process ends (status 130 from a shell).

  Building a MultiWorkerMirroredStrategy waits inside TensorFlow's C++ for
  every task to join, holding the GIL, so no Python signal handler runs
  until it returns: a task whose peer accepts connections but never joins
  (another program on its port, or a task started with another cluster)
  was deaf to Ctrl-C until the start-up deadline. Nothing is trained or
  saved yet, so ending at once loses nothing (a `--model_dir` lease left
  behind is taken over by the next run: its process is gone). SIGTERM is
  set to its default action too, but TensorFlow's coordination service
  installs its own SIGTERM handler (its preemption notifier) while it
  forms the cluster, so a SIGTERM then waits for the cluster or for the
  start-up deadline (`watchdog.Deadline`). The handlers in place before are
  put back after the block.
  """
  if (threading.current_thread() is not threading.main_thread() or
      "ipykernel" in sys.modules):
    # Signals stay with the host framework (Ray; a notebook's interrupt
    # must not end its kernel).
    yield
    return
  saved = {signum: signal.getsignal(signum)
           for signum in (signal.SIGTERM, signal.SIGINT)}
  for signum in saved:
    signal.signal(signum, signal.SIG_DFL)
  try:
    yield
  finally:
    for signum, handler in saved.items():
      signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def multi_worker_mirrored_strategy(options: strategy_lib.StrategyOptions,
                                   cluster):
  """MultiWorkerMirroredStrategy over the cluster's chief and workers:
  `(strategy, device names)`; its backend's `new_strategy`.

  The all-reduce implementation comes from `--all_reduce_alg` (`ring`,
  `nccl`, `auto`). Building the strategy (which waits for every peer to
  connect, with no timeout of TensorFlow's own, deaf to SIGTERM and SIGINT)
  is bounded by `--cluster_start_timeout_seconds`: first
  `tfdist.distribute.rendezvous.wait_for_peers` waits in Python until every peer
  answers (logging the missing ones every 30 s; SIGTERM or SIGINT stop it),
  then `tfdist.runtime.watchdog.Deadline` bounds TensorFlow's own, short,
  wait (at least `MIN_JOIN_SECONDS`), during which Ctrl-C ends the process
  at once (`_signals_end_the_process`; TensorFlow holds SIGTERM there).

  Collectives have no timeout by default (`--collective_timeout_seconds=0`).
  A timeout costs one thread per collective for its whole length:
  `BaseCollectiveExecutor::ExecuteAsync` and `CompleteParamsAsync`
  (tensorflow/core/common_runtime/base_collective_executor.cc) schedule the
  timeout check with `SchedNonBlockingClosureAfter`
  (tensorflow/core/common_runtime/process_util.cc), which calls
  `Env::Default()->SchedClosureAfter`; the POSIX Env's `SchedClosureAfter`
  (third_party/xla/xla/tsl/platform/default/env.cc, `PosixEnv`) starts a
  detached `std::thread` that sleeps for the whole timeout before it checks.
  So threads = collectives per second x timeout: with 300 s, 12,285
  threads per worker at step 800 of the CNN, and an abort
  (`std::system_error`) near 15,600. A lost or stopped peer is detected
  instead by the coordination service that MultiWorkerMirroredStrategy
  starts (its heartbeat timeout, TensorFlow's default of 10 s,
  `kDefaultHeartbeatTimeoutMs` in coordination_service.cc): the pending
  collective fails with `UnavailableError`, which the step runner turns into
  `PeerLostError` naming the task (status 200).

  Resident memory: TensorFlow's default gives every collective a new
  instance key at every call, and keeps each key's records (about 10 KiB
  per call of the training function); `use_trace_time_instance_keys`
  fixes the keys at trace time so memory stays flat
  (docs/design/long-runs.md).

  Raises:
    ConfigError: a second MultiWorkerMirroredStrategy in this process, an
      all-reduce that does not apply, or a task that is not a chief or
      worker.
  """
  _check_first_mwms()
  alg = _mwms_all_reduce(options, cluster)
  _check_mwms_task(cluster)
  strategy_lib.use_trace_time_instance_keys()
  implementation = getattr(tf.distribute.experimental.CommunicationImplementation,
                           _MWMS_IMPLEMENTATIONS[alg])
  # 0: no per-collective timeout (see the docstring: a timeout holds a
  # sleeping thread per collective).
  section = options.strategy
  communication = tf.distribute.experimental.CommunicationOptions(
      implementation=implementation, bytes_per_pack=section.bytes_per_pack,
      timeout_seconds=section.cluster.collective_timeout_seconds or None)
  resolver = cluster.cluster_resolver(jobs=_MWMS_JOBS)
  seconds = section.cluster.cluster_start_timeout_seconds
  peers = ", ".join(f"{job} {i} at {address}"
                    for job, addresses in cluster.cluster_dict(
                        _MWMS_JOBS).items()
                    for i, address in enumerate(addresses))
  waited = _wait_for_mwms_peers(cluster, seconds)
  bound = max(seconds - waited, MIN_JOIN_SECONDS)
  if cluster.is_multi_worker:
    logging.info(
        "tfdist: every peer answered after %.0f s; TensorFlow now forms the "
        "cluster (at most %.0f s more; Ctrl-C ends this process at once, "
        "nothing is trained or saved yet; TensorFlow holds SIGTERM until the "
        "cluster has formed).", waited, bound)
  with watchdog.Deadline(
      bound,
      f"tfdist: error: {cluster.task_type} {cluster.task_index} could not "
      f"form the multi_worker_mirrored cluster within {waited + bound:.0f} s "
      f"(--cluster_start_timeout_seconds={seconds:g}, and at least "
      f"{MIN_JOIN_SECONDS:g} s for TensorFlow's own wait once every peer "
      f"answered): not every task connected (cluster from {cluster.source}: "
      f"{peers}). Check that every task was started with the same cluster "
      "and that the addresses are reachable."), _signals_end_the_process():
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=resolver, communication_options=communication)
  if cluster.is_multi_worker:
    _MWMS_BUILT.append(f"{cluster.task_type} {cluster.task_index} of the "
                       f"cluster from {cluster.source}")
  return strategy, tuple(strategy.extended.worker_devices)
