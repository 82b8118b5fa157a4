"""The strategy factory: the one place that turns a config into a strategy.

Modelled on Model Garden's `get_distribution_strategy`: a closed set of names,
each checked by its own helper. `auto` is decided before this runs, in one
place (`tfdist.auto_select.resolve`); the factory takes concrete names only.
"""

import dataclasses

from absl import logging
import tensorflow as tf

from tfdist.config import ConfigError, TrainConfig


# MultiWorkerMirroredStrategy over a real cluster configures TensorFlow's
# collective runtime for that cluster, once per process: a second one cannot
# be built.
_MWMS_BUILT = []
# While the cluster forms, the peers that do not answer are logged this often.
START_REPORT_SECONDS = 30.0
# How long host names that do not resolve are retried (a cluster manager may
# register a peer's name only as the peer starts).
RESOLVE_RETRY_SECONDS = 30.0
# Once every peer answered, TensorFlow's own wait gets at least this long.
MIN_JOIN_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class StrategyChoice:
  """The strategy built for a run, its name and why it was chosen.

  Attributes:
    strategy: the `tf.distribute.Strategy`.
    name: one of `off|one_device|mirrored|multi_worker_mirrored|
      parameter_server|tpu` (never `auto`).
    reason: a sentence saying why (for `auto`) or what was asked.
    devices: device names the replicas run on.
  """
  strategy: tf.distribute.Strategy
  name: str
  reason: str
  devices: tuple


def _gpus(num_gpus: int):
  gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
  if num_gpus == -1:
    return gpus
  if num_gpus > len(gpus):
    raise ConfigError(
        f"--num_gpus={num_gpus} but only {len(gpus)} GPU(s) are visible. "
        f"Use --num_gpus={len(gpus)} or -1 for all.")
  return gpus[:num_gpus]


def _all_reduce(alg: str, on_gpu: bool):
  if alg == "nccl":
    if not on_gpu:
      raise ConfigError(
          "--all_reduce_alg=nccl needs GPUs; on CPU devices use "
          "--all_reduce_alg=auto.")
    return tf.distribute.NcclAllReduce()
  if alg == "hierarchical_copy":
    return tf.distribute.HierarchicalCopyAllReduce()
  if alg == "ring":
    raise ConfigError(
        "--all_reduce_alg=ring applies to multi_worker_mirrored; for "
        "mirrored use auto, nccl or hierarchical_copy.")
  return None if on_gpu else tf.distribute.ReductionToOneDevice()


def _one_device(config: TrainConfig, reason: str) -> StrategyChoice:
  gpus = _gpus(config.num_gpus) if config.num_gpus != 0 else []
  device = gpus[0] if gpus else "/cpu:0"
  return StrategyChoice(tf.distribute.OneDeviceStrategy(device), "one_device",
                        reason, (device,))


def _mirrored(config: TrainConfig, reason: str) -> StrategyChoice:
  gpus = _gpus(config.num_gpus) if config.num_gpus != 0 else []
  if gpus:
    devices = gpus
  else:
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    if config.num_cpu_devices > 1 and len(devices) != config.num_cpu_devices:
      raise ConfigError(
          f"--num_cpu_devices={config.num_cpu_devices} but "
          f"{len(devices)} logical CPU device(s) exist: call "
          "tfdist.devices.configure_cpu_devices before building the strategy.")
  strategy = tf.distribute.MirroredStrategy(
      devices=devices,
      cross_device_ops=_all_reduce(config.all_reduce_alg, bool(gpus)))
  return StrategyChoice(strategy, "mirrored", reason, tuple(devices))


def _tpu(config: TrainConfig, reason: str) -> StrategyChoice:
  # Imported here: tfdist.tpu is needed only on this path.
  from tfdist import tpu as tpu_lib  # pylint: disable=g-import-not-at-top
  # `auto` fills --tpu with the address it found (tfdist.tpu's one rule).
  system = tpu_lib.connect_tpu(
      tpu_lib.resolve_tpu_address(config.tpu), zone=config.tpu_zone,
      project=config.tpu_gcp_project, init_timeout=config.tpu_init_timeout)
  strategy = tpu_lib.make_tpu_strategy(system)
  return StrategyChoice(strategy, "tpu", reason,
                        tuple(strategy.extended.worker_devices))


def _parameter_server(config: TrainConfig, reason: str,
                      cluster) -> StrategyChoice:
  # Imported here: needed only on this path.
  from tfdist import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from tfdist import parameter_server  # pylint: disable=g-import-not-at-top
  # The coordinator connects to every worker and ps task.
  cluster_lib.check_addresses_resolve(
      cluster, retry_seconds=min(RESOLVE_RETRY_SECONDS,
                                 config.cluster_start_timeout_seconds))
  strategy, ps_devices = parameter_server.make_ps_strategy(config, cluster)
  return StrategyChoice(strategy, "parameter_server", reason, ps_devices)


_MWMS_IMPLEMENTATIONS = {"auto": "AUTO", "ring": "RING", "nccl": "NCCL"}


def _multi_worker_mirrored(config: TrainConfig, reason: str,
                           cluster) -> StrategyChoice:
  """MultiWorkerMirroredStrategy over the cluster's chief and workers.

  The all-reduce implementation comes from `--all_reduce_alg` (`ring`,
  `nccl`, `auto`). Building the strategy (which waits for every peer to
  connect, with no timeout of TensorFlow's own, deaf to SIGTERM and SIGINT)
  is bounded by `--cluster_start_timeout_seconds`: first
  `tfdist.rendezvous.wait_for_peers` waits in Python until every peer
  answers (logging the missing ones every 30 s; SIGTERM or SIGINT stop it),
  then `tfdist.watchdog.Deadline` bounds TensorFlow's own, short, wait.

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
  """
  # Imported here: only this path needs them.
  from tfdist import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from tfdist import rendezvous  # pylint: disable=g-import-not-at-top
  from tfdist import watchdog  # pylint: disable=g-import-not-at-top
  if _MWMS_BUILT:
    raise ConfigError(
        "A MultiWorkerMirroredStrategy was already built in this process "
        f"({_MWMS_BUILT[0]}); TensorFlow configures its collective runtime "
        "once per process, so a second one cannot be built. Run each "
        "multi-worker training in a process of its own (python -m "
        "tfdist.train, or tfdist.launch for a local cluster).")
  alg = config.all_reduce_alg
  if config.reduction_server or cluster.reduction_server_replicas:
    # Vertex AI's Reduction Server serves NCCL all-reduce only.
    why = ("--reduction_server" if config.reduction_server else
           f"{cluster.source}'s job description runs it in worker pool 2")
    if not tf.config.list_physical_devices("GPU"):
      raise ConfigError(
          f"Vertex AI's Reduction Server ({why}) needs GPU workers: it works "
          "with NCCL all-reduce, and this task sees no GPU. Give the chief "
          "and worker pools accelerators (python -m tfdist.job_spec vertex "
          "--accelerator=...), or drop the Reduction Server pool (and "
          "--reduction_server) to all-reduce over gRPC on CPUs.")
    alg = "nccl"
  if alg not in _MWMS_IMPLEMENTATIONS:
    raise ConfigError(
        f"--all_reduce_alg={alg} does not apply to multi_worker_mirrored. Use "
        "ring (gRPC; CPUs or GPUs), nccl (GPUs; Vertex AI Reduction Server) "
        "or auto.")
  if alg == "nccl" and not tf.config.list_physical_devices("GPU"):
    raise ConfigError(
        "--all_reduce_alg=nccl needs GPUs; on CPU-only workers use "
        "--all_reduce_alg=ring or auto.")
  jobs = (cluster_lib.CHIEF, cluster_lib.WORKER)
  if cluster.is_multi_worker and cluster.task_type not in jobs:
    raise ConfigError(
        f"This task is {cluster.task_type} {cluster.task_index} "
        f"({cluster.source}); multi_worker_mirrored runs only on chief and "
        "worker tasks. Use --distribution_strategy=parameter_server for a "
        "cluster with ps tasks.")
  implementation = getattr(tf.distribute.experimental.CommunicationImplementation,
                           _MWMS_IMPLEMENTATIONS[alg])
  # 0: no per-collective timeout (see the docstring: a timeout holds a
  # sleeping thread per collective).
  options = tf.distribute.experimental.CommunicationOptions(
      implementation=implementation,
      timeout_seconds=config.collective_timeout_seconds or None)
  resolver = cluster.cluster_resolver(jobs=jobs)
  seconds = config.cluster_start_timeout_seconds
  peers = ", ".join(f"{job} {i} at {address}"
                    for job, addresses in cluster.cluster_dict(jobs).items()
                    for i, address in enumerate(addresses))
  members = cluster.cluster_dict(jobs)
  mine = members.get(cluster.task_type, [])
  me = mine[cluster.task_index] if cluster.task_index < len(mine) else None
  probes = {address: f"{job} {i}" for job, addresses in members.items()
            for i, address in enumerate(addresses) if address != me}
  waited = 0.0
  if cluster.is_multi_worker:
    # A peer whose name does not resolve would be waited for until the
    # start-up limit.
    cluster_lib.check_addresses_resolve(
        cluster, retry_seconds=min(RESOLVE_RETRY_SECONDS, seconds))
    # In Python, where SIGTERM and SIGINT work and the missing tasks can be
    # named; TensorFlow's own wait below is then short.
    waited = rendezvous.wait_for_peers(
        me, probes, timeout_seconds=seconds,
        report_seconds=START_REPORT_SECONDS,
        describe=f"the multi_worker_mirrored cluster from {cluster.source}")
  with watchdog.Deadline(
      max(seconds - waited, MIN_JOIN_SECONDS),
      f"tfdist: error: {cluster.task_type} {cluster.task_index} could not "
      f"form the multi_worker_mirrored cluster within "
      f"--cluster_start_timeout_seconds={seconds:g}: not every task connected "
      f"(cluster from {cluster.source}: {peers}). Check that every task was "
      "started with the same cluster and that the addresses are reachable."):
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=resolver, communication_options=options)
  if cluster.is_multi_worker:
    _MWMS_BUILT.append(f"{cluster.task_type} {cluster.task_index} of the "
                       f"cluster from {cluster.source}")
  return StrategyChoice(strategy, "multi_worker_mirrored", reason,
                        tuple(strategy.extended.worker_devices))


def make_strategy(config: TrainConfig, *, cluster=None) -> StrategyChoice:
  """Builds the `tf.distribute.Strategy` that `config` asks for.

  Args:
    config: the run's `TrainConfig` with a concrete `distribution_strategy`
      (`auto` is decided first by `tfdist.auto_select.resolve`); reads
      `num_gpus`, `num_cpu_devices`, `all_reduce_alg`, `reduction_server`
      (NCCL under multi_worker_mirrored, GPUs only), the multi-worker
      timeouts, and for TPU `tpu`, `tpu_zone`, `tpu_gcp_project`,
      `tpu_init_timeout`.
    cluster: the resolved `tfdist.cluster.ClusterInfo`; needed for
      `multi_worker_mirrored` and `parameter_server`.

  Returns:
    A `StrategyChoice` (its `reason` says what was asked; the caller
    replaces it with the decision's reason).

  Raises:
    ConfigError: `auto` or an unknown name, inconsistent device flags, a
      multi-worker strategy without a cluster, or a second
      MultiWorkerMirroredStrategy in this process.
    tfdist.tpu.TPUNotAvailableError: `tpu` with no TPU reachable (raised
      within `config.tpu_init_timeout` seconds).
  """
  name = config.distribution_strategy
  reason = f"--distribution_strategy={name}"
  if name == "auto":
    raise ConfigError(
        "make_strategy takes a concrete strategy; decide `auto` first with "
        "tfdist.auto_select.resolve and apply_decision.")
  if name in ("multi_worker_mirrored", "parameter_server") and cluster is None:
    raise ConfigError(f"--distribution_strategy={name} needs the resolved "
                      "cluster (tfdist.cluster.resolve_cluster).")
  if name == "off":
    choice = StrategyChoice(tf.distribute.get_strategy(), "off", reason,
                            ("default",))
  elif name == "one_device":
    choice = _one_device(config, reason)
  elif name == "mirrored":
    choice = _mirrored(config, reason)
  elif name == "tpu":
    choice = _tpu(config, reason)
  elif name == "parameter_server":
    choice = _parameter_server(config, reason, cluster)
  elif name == "multi_worker_mirrored":
    choice = _multi_worker_mirrored(config, reason, cluster)
  else:
    raise ConfigError(f"--distribution_strategy={name!r} is unknown.")
  logging.info("Strategy: %s; %d replica(s) on %s", choice.name,
               choice.strategy.num_replicas_in_sync, ", ".join(choice.devices))
  return choice
