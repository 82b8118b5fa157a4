"""The strategy factory: the one place that turns options into a strategy.

Modelled on Model Garden's `get_distribution_strategy`: a closed set of
kinds, each built by its own helper. `auto` is decided before this runs, in
one place (`tfdist.distribute.auto_select.resolve`); the factory takes a
concrete `StrategyKind` only, in a `StrategyOptions`
(`StrategyOptions.of` makes one from the config's strategy section).
"""

import contextlib
import dataclasses
import os
import signal
import sys
import threading

from absl import logging
import tensorflow as tf

from tfdist import config as config_lib
from tfdist import errors
from tfdist.distribute import cluster as cluster_lib
from tfdist.distribute import parameter_server
from tfdist.distribute import rendezvous
from tfdist.distribute import tpu as tpu_lib
from tfdist.distribute.strategy_kind import StrategyKind
from tfdist.runtime import watchdog


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
# "1" keeps TensorFlow's per-call collective instance keys under
# MultiWorkerMirroredStrategy (see `use_trace_time_instance_keys`); "0" or
# unset gives each collective one key, fixed when its function is traced.
PER_CALL_INSTANCE_KEYS_ENV = "TFDIST_PER_CALL_INSTANCE_KEYS"


@dataclasses.dataclass(frozen=True)
class StrategyChoice:
  """The strategy built for a run, its name and why it was chosen.

  Attributes:
    strategy: the `tf.distribute.Strategy`.
    name: the `StrategyKind` built (a `str` enum: it equals and prints as
      the flag value, `off|one_device|mirrored|multi_worker_mirrored|
      parameter_server|tpu`; never `auto`).
    reason: a sentence saying why (for `auto`) or what was asked.
    devices: device names the replicas run on.
  """
  strategy: tf.distribute.Strategy
  name: StrategyKind
  reason: str
  devices: tuple


@dataclasses.dataclass(frozen=True)
class StrategyOptions:
  """What the strategy factory reads (the `--distribution_strategy` group).

  Attributes:
    kind: the concrete strategy to build (`auto` already decided).
    num_gpus: `--num_gpus` (-1: all visible, 0: none, N: the first N).
    num_cpu_devices: `--num_cpu_devices` (logical CPU devices Mirrored
      expects when there is no GPU; 0 or 1: no check).
    all_reduce_alg: `--all_reduce_alg` (`auto`, `nccl`, `hierarchical_copy`,
      `ring`).
    reduction_server: `--reduction_server` (Vertex AI's Reduction Server:
      NCCL all-reduce under multi_worker_mirrored, GPUs only).
    bytes_per_pack: `--bytes_per_pack`, the size of the gradients' all-reduce
      packs under multi_worker_mirrored (TensorFlow's
      `CommunicationOptions.bytes_per_pack`; 0: one pack).
    collective_timeout_seconds: `--collective_timeout_seconds` (0: none).
    cluster_start_timeout_seconds: `--cluster_start_timeout_seconds`, the
      bound on forming a multi-worker cluster.
    tpu: the TPU to connect to (the config's TPU section,
      `tfdist.config.TpuConfig`).
    partitioner: the parameter-server variable partitioner (the config's
      parameter-server section, `tfdist.config.ParameterServerConfig`).
  """
  kind: StrategyKind
  num_gpus: int = -1
  num_cpu_devices: int = 0
  all_reduce_alg: str = "auto"
  reduction_server: bool = False
  bytes_per_pack: int = 0
  collective_timeout_seconds: float = 0.0
  cluster_start_timeout_seconds: float = 900.0
  tpu: tpu_lib.TpuOptions = tpu_lib.TpuOptions()
  partitioner: parameter_server.PartitionerOptions = (
      parameter_server.PartitionerOptions())

  @classmethod
  def of(cls, strategy, decisions=None, *,
         reduction_server: bool = False) -> "StrategyOptions":
    """The options of the config's strategy section with the strategy and
    TPU decided.

    Args:
      strategy: the strategy section (`tfdist.config.StrategyConfig`,
        with its `cluster`, `tpu` and `parameter_servers` sections).
      decisions: the run's `tfdist.distribute.decisions.Decisions` (the
        strategy that runs and the TPU's address); None: the section's
        own, which must name a concrete strategy.
      reduction_server: `--reduction_server` (the cloud section's).

    Raises:
      tfdist.errors.ConfigError: `decisions` None and the section says
        `--distribution_strategy=auto`.
    """
    if decisions is None:
      config_lib.refuse_auto(strategy.distribution_strategy)
      kind = StrategyKind.parse(strategy.distribution_strategy)
      tpu_address = strategy.tpu.tpu
    else:
      kind, tpu_address = decisions.strategy, decisions.tpu
    cluster = strategy.cluster
    return cls(
        kind=kind, num_gpus=strategy.num_gpus,
        num_cpu_devices=strategy.num_cpu_devices,
        all_reduce_alg=strategy.all_reduce_alg,
        reduction_server=bool(reduction_server),
        bytes_per_pack=strategy.bytes_per_pack,
        collective_timeout_seconds=cluster.collective_timeout_seconds,
        cluster_start_timeout_seconds=cluster.cluster_start_timeout_seconds,
        # The TPU and parameter-server sections are those parts' options;
        # the TPU's address is the decided one.
        tpu=dataclasses.replace(strategy.tpu, tpu=tpu_address),
        partitioner=strategy.parameter_servers)


def _gpus(num_gpus: int):
  gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
  if num_gpus == -1:
    return gpus
  if num_gpus > len(gpus):
    raise errors.ConfigError(
        f"--num_gpus={num_gpus} but only {len(gpus)} GPU(s) are visible. "
        f"Use --num_gpus={len(gpus)} or -1 for all.")
  return gpus[:num_gpus]


def _all_reduce(alg: str, on_gpu: bool):
  if alg == "nccl":
    if not on_gpu:
      raise errors.ConfigError(
          "--all_reduce_alg=nccl needs GPUs; on CPU devices use "
          "--all_reduce_alg=auto.")
    return tf.distribute.NcclAllReduce()
  if alg == "hierarchical_copy":
    return tf.distribute.HierarchicalCopyAllReduce()
  if alg == "ring":
    raise errors.ConfigError(
        "--all_reduce_alg=ring applies to multi_worker_mirrored; for "
        "mirrored use auto, nccl or hierarchical_copy.")
  return None if on_gpu else tf.distribute.ReductionToOneDevice()


def _off(options: StrategyOptions, reason: str, cluster) -> StrategyChoice:
  del options, cluster  # The default strategy has nothing to choose.
  return StrategyChoice(tf.distribute.get_strategy(), StrategyKind.OFF,
                        reason, ("default",))


def _one_device(options: StrategyOptions, reason: str,
                cluster) -> StrategyChoice:
  del cluster  # Single process.
  gpus = _gpus(options.num_gpus) if options.num_gpus != 0 else []
  device = gpus[0] if gpus else "/cpu:0"
  return StrategyChoice(tf.distribute.OneDeviceStrategy(device),
                        StrategyKind.ONE_DEVICE, reason, (device,))


def _mirrored(options: StrategyOptions, reason: str,
              cluster) -> StrategyChoice:
  del cluster  # Single process.
  gpus = _gpus(options.num_gpus) if options.num_gpus != 0 else []
  if gpus:
    devices = gpus
  else:
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    wanted = options.num_cpu_devices
    if wanted > 1 and len(devices) != wanted:
      raise errors.ConfigError(
          f"--num_cpu_devices={wanted} but "
          f"{len(devices)} logical CPU device(s) exist: call "
          "tfdist.distribute.devices.configure_cpu_devices before building the strategy.")
  strategy = tf.distribute.MirroredStrategy(
      devices=devices,
      cross_device_ops=_all_reduce(options.all_reduce_alg, bool(gpus)))
  return StrategyChoice(strategy, StrategyKind.MIRRORED, reason,
                        tuple(devices))


def _tpu(options: StrategyOptions, reason: str, cluster) -> StrategyChoice:
  del cluster  # The TPU system is found by its address.
  tpu = options.tpu
  # `auto` fills --tpu with the address it found (tfdist.distribute.tpu's one
  # rule).
  system = tpu_lib.connect_tpu(
      tpu_lib.resolve_tpu_address(tpu.tpu), zone=tpu.tpu_zone,
      project=tpu.tpu_gcp_project, init_timeout=tpu.tpu_init_timeout)
  strategy = tpu_lib.make_tpu_strategy(system)
  return StrategyChoice(strategy, StrategyKind.TPU, reason,
                        tuple(strategy.extended.worker_devices))


def _parameter_server(options: StrategyOptions, reason: str,
                      cluster) -> StrategyChoice:
  # The coordinator connects to every worker and ps task.
  cluster_lib.check_addresses_resolve(
      cluster, retry_seconds=min(RESOLVE_RETRY_SECONDS,
                                 options.cluster_start_timeout_seconds))
  strategy, ps_devices = parameter_server.make_ps_strategy(
      options.partitioner, cluster)
  return StrategyChoice(strategy, StrategyKind.PARAMETER_SERVER, reason,
                        ps_devices)


_MWMS_IMPLEMENTATIONS = {"auto": "AUTO", "ring": "RING", "nccl": "NCCL"}
_MWMS_JOBS = (cluster_lib.CHIEF, cluster_lib.WORKER)


def _mwms_all_reduce(options: StrategyOptions, cluster) -> str:
  """The MWMS all-reduce implementation name (`auto`, `ring`, `nccl`).

  Raises:
    ConfigError: a Reduction Server without GPUs, NCCL without GPUs, or an
      algorithm that does not apply to multi_worker_mirrored.
  """
  alg = options.all_reduce_alg
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
  return wait_for_peers(cluster, _MWMS_JOBS, seconds,
                        describe="the multi_worker_mirrored cluster")


def wait_for_peers(cluster, jobs, seconds: float, *,
                   describe: str = "the cluster") -> float:
  """Waits in Python until every task of `jobs` but this one answers.

  Args:
    cluster: this process's `ClusterInfo`.
    jobs: the jobs whose tasks to wait for (e.g. `("chief", "worker")`).
    seconds: the longest wait (`--cluster_start_timeout_seconds`).
    describe: names the cluster in messages (its source is appended).

  Returns:
    Seconds waited (0 outside a cluster).

  Raises:
    tfdist.errors.ClusterStartError: a task did not answer in time.
    tfdist.errors.StoppedAtStartError: SIGTERM or SIGINT meanwhile.
  """
  if not cluster.is_multi_worker:
    return 0.0
  members = cluster.cluster_dict(tuple(jobs))
  mine = members.get(cluster.task_type, [])
  me = mine[cluster.task_index] if cluster.task_index < len(mine) else None
  probes = {address: f"{job} {i}" for job, addresses in members.items()
            for i, address in enumerate(addresses) if address != me}
  # A peer whose name does not resolve would be waited for until the
  # start-up limit.
  cluster_lib.check_addresses_resolve(
      cluster, retry_seconds=min(RESOLVE_RETRY_SECONDS, seconds))
  return rendezvous.wait_for_peers(
      me, probes, timeout_seconds=seconds,
      report_seconds=START_REPORT_SECONDS,
      describe=f"{describe} from {cluster.source}")


def use_trace_time_instance_keys() -> bool:
  """Gives each MWMS collective one instance key, fixed at trace time.

  TensorFlow's default (`CollectiveReplicaLauncher._prefer_unique_instance_key`
  in tensorflow/python/distribute/cross_device_utils.py) feeds every
  collective a new instance key at every call of its function: the key is a
  captured call-time value, made by `ops.convert_to_tensor` from a new Python
  int. Each new key stays in two tables that nothing clears, found with
  jemalloc's heap profiler over a 2-worker run (docs/design/long-runs.md):

  * `CollectiveParamResolverLocal::GetOrCreateInstanceRec`
    (tensorflow/core/common_runtime/collective_param_resolver_local.cc): one
    `InstanceRec` per group, step and instance key, never erased; on a
    worker it is filled from the leader's answer
    (`CollectiveParamResolverDistributed::UpdateInstanceCache`);
  * the Python scalar cache (`TFE_TensorHandleCache`,
    tensorflow/python/eager/pywrap_tensor_conversion.cc), keyed by the
    Python value: every new int adds an entry and a device tensor.

  Together about 10 KiB per call of the training function, so resident
  memory grew without bound. With keys fixed at trace time both tables keep
  one entry per collective. The cost: the keys are counted as functions are
  traced, so every task must trace its collective functions in the same
  order (tfdist's tasks run the same program; training batches have one
  shape, so no task retraces alone).

  Set `TFDIST_PER_CALL_INSTANCE_KEYS=1` to keep TensorFlow's default.

  Returns:
    True when keys are fixed at trace time in this process; False when the
    environment variable keeps the default or this TensorFlow has no such
    setting.

  Raises:
    ConfigError: `TFDIST_PER_CALL_INSTANCE_KEYS` is not `0` or `1`.
  """
  value = os.environ.get(PER_CALL_INSTANCE_KEYS_ENV, "").strip()
  if value not in ("", "0", "1"):
    raise errors.ConfigError(
        f"{PER_CALL_INSTANCE_KEYS_ENV}={value!r} is not 0 or 1. Unset it "
        "(or 0: collective instance keys fixed at trace time, flat memory), "
        "or 1 for TensorFlow's per-call keys.")
  # pylint: disable=g-import-not-at-top
  from tensorflow.python.distribute import cross_device_utils
  # pylint: enable=g-import-not-at-top
  launcher = getattr(cross_device_utils, "CollectiveReplicaLauncher", None)
  if not hasattr(launcher, "_prefer_unique_instance_key"):
    logging.warning("tfdist: this TensorFlow has no "
                    "CollectiveReplicaLauncher._prefer_unique_instance_key; "
                    "its collective instance keys are left as they are.")
    return False
  fixed = value != "1"
  setattr(launcher, "_prefer_unique_instance_key", not fixed)
  return fixed


def per_call_instance_keys() -> bool:
  """Whether this process's collectives take a new instance key per call.

  True with TensorFlow's default (the memory it keeps grows with the calls;
  see `use_trace_time_instance_keys`), False once that set keys at trace
  time.
  """
  # pylint: disable=g-import-not-at-top
  from tensorflow.python.distribute import cross_device_utils
  # pylint: enable=g-import-not-at-top
  launcher = getattr(cross_device_utils, "CollectiveReplicaLauncher", None)
  return bool(getattr(launcher, "_prefer_unique_instance_key", True))


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


def _multi_worker_mirrored(options: StrategyOptions, reason: str,
                           cluster) -> StrategyChoice:
  """MultiWorkerMirroredStrategy over the cluster's chief and workers.

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
  """
  _check_first_mwms()
  alg = _mwms_all_reduce(options, cluster)
  _check_mwms_task(cluster)
  use_trace_time_instance_keys()
  implementation = getattr(tf.distribute.experimental.CommunicationImplementation,
                           _MWMS_IMPLEMENTATIONS[alg])
  # 0: no per-collective timeout (see the docstring: a timeout holds a
  # sleeping thread per collective).
  communication = tf.distribute.experimental.CommunicationOptions(
      implementation=implementation, bytes_per_pack=options.bytes_per_pack,
      timeout_seconds=options.collective_timeout_seconds or None)
  resolver = cluster.cluster_resolver(jobs=_MWMS_JOBS)
  seconds = options.cluster_start_timeout_seconds
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
  return StrategyChoice(strategy, StrategyKind.MULTI_WORKER_MIRRORED, reason,
                        tuple(strategy.extended.worker_devices))


# One builder per kind: `(options, reason, cluster) -> StrategyChoice`.
_BUILDERS = {
    StrategyKind.OFF: _off,
    StrategyKind.ONE_DEVICE: _one_device,
    StrategyKind.MIRRORED: _mirrored,
    StrategyKind.TPU: _tpu,
    StrategyKind.PARAMETER_SERVER: _parameter_server,
    StrategyKind.MULTI_WORKER_MIRRORED: _multi_worker_mirrored,
}


def make_strategy(options: StrategyOptions, *, cluster=None) -> StrategyChoice:
  """Builds the `tf.distribute.Strategy` that `options` asks for.

  Args:
    options: a `StrategyOptions` with a concrete `kind` (`auto` is decided
      first by `tfdist.distribute.auto_select.resolve`; the config's
      strategy section becomes options with `StrategyOptions.of`).
    cluster: the resolved `tfdist.distribute.cluster.ClusterInfo`; needed for
      `multi_worker_mirrored` and `parameter_server`.

  Returns:
    A `StrategyChoice` (its `reason` says what was asked; the caller
    replaces it with the decision's reason).

  Raises:
    ConfigError: inconsistent device flags, a multi-worker strategy without
      a cluster, `bytes_per_pack` for a strategy it does not apply to, or a
      second MultiWorkerMirroredStrategy in this process.
    ValueError: `options.kind` is not a concrete strategy name.
    tfdist.errors.TPUNotAvailableError: `tpu` with no TPU reachable
      (raised within `options.tpu.tpu_init_timeout` seconds).
  """
  kind = StrategyKind.parse(options.kind)
  reason = f"--distribution_strategy={kind}"
  if kind.is_multi_worker and cluster is None:
    raise errors.ConfigError(
        f"--distribution_strategy={kind} needs the resolved "
        "cluster (tfdist.distribute.cluster.resolve_cluster).")
  config_lib.check_bytes_per_pack(kind, options.bytes_per_pack)
  choice = _BUILDERS[kind](options, reason, cluster)
  logging.info("Strategy: %s; %d replica(s) on %s", choice.name,
               choice.strategy.num_replicas_in_sync, ", ".join(choice.devices))
  return choice
