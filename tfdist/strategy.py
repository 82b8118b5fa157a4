"""The strategy factory: the one place that turns a config into a strategy.

Modelled on Model Garden's `get_distribution_strategy`: a closed set of names,
each checked by its own helper, and `auto`, which chooses from the devices and
cluster it finds and says why.
"""

import dataclasses
import os
from typing import Optional

from absl import logging
import tensorflow as tf

from tfdist.config import ConfigError, TrainConfig


class StrategyNotAvailableError(ConfigError):
  """The requested strategy is not implemented in this version of tfdist."""


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
  system = tpu_lib.connect_tpu(
      # `auto` may choose a TPU that it found with --tpu unset: a local one.
      config.tpu or os.environ.get("TPU_NAME", "") or "local",
      zone=config.tpu_zone,
      project=config.tpu_gcp_project, init_timeout=config.tpu_init_timeout)
  strategy = tpu_lib.make_tpu_strategy(system)
  return StrategyChoice(strategy, "tpu", reason,
                        tuple(strategy.extended.worker_devices))


def _parameter_server(config: TrainConfig, reason: str) -> StrategyChoice:
  # Imported here: needed only on this path.
  from tfdist import parameter_server  # pylint: disable=g-import-not-at-top
  strategy, ps_devices = parameter_server.make_ps_strategy(config)
  return StrategyChoice(strategy, "parameter_server", reason, ps_devices)


_MWMS_IMPLEMENTATIONS = {"auto": "AUTO", "ring": "RING", "nccl": "NCCL"}


def _multi_worker_mirrored(config: TrainConfig, reason: str,
                           cluster) -> StrategyChoice:
  """MultiWorkerMirroredStrategy over the cluster's chief and workers.

  The all-reduce implementation comes from `--all_reduce_alg` (`ring`,
  `nccl`, `auto`), every collective times out after
  `--collective_timeout_seconds`, and building the strategy (which waits for
  every peer to connect, with no timeout of TensorFlow's own) is bounded by
  `--cluster_start_timeout_seconds`.
  """
  # Imported here: only this path needs them.
  from tfdist import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from tfdist import watchdog  # pylint: disable=g-import-not-at-top
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
  options = tf.distribute.experimental.CommunicationOptions(
      implementation=implementation,
      timeout_seconds=config.collective_timeout_seconds)
  resolver = cluster.cluster_resolver(jobs=jobs)
  seconds = config.cluster_start_timeout_seconds
  peers = ", ".join(f"{job} {i} at {address}"
                    for job, addresses in cluster.cluster_dict(jobs).items()
                    for i, address in enumerate(addresses))
  with watchdog.Deadline(
      seconds,
      f"tfdist: error: {cluster.task_type} {cluster.task_index} could not "
      f"form the multi_worker_mirrored cluster within "
      f"--cluster_start_timeout_seconds={seconds:g}: not every task connected "
      f"(cluster from {cluster.source}: {peers}). Check that every task was "
      "started with the same cluster and that the addresses are reachable."):
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=resolver, communication_options=options)
  return StrategyChoice(strategy, "multi_worker_mirrored", reason,
                        tuple(strategy.extended.worker_devices))


def _not_available(name: str) -> StrategyNotAvailableError:
  return StrategyNotAvailableError(
      f"--distribution_strategy={name} is not available in this version of "
      "tfdist yet. Available now: off, one_device, mirrored, "
      "multi_worker_mirrored, tpu, parameter_server, auto.")


def resolve_auto(config: TrainConfig) -> tuple:
  """Picks a concrete strategy name for `auto`, with the reason.

  The rules live in `tfdist.auto_select.decide_strategy` (TPU, then a
  cluster in TF_CONFIG/CLUSTER_SPEC with parameter servers or several
  workers, then GPUs, then logical CPU devices, then one CPU device);
  this reads the real devices and environment.
  """
  # Imported here: auto_select imports this module's siblings only.
  from tfdist import auto_select  # pylint: disable=g-import-not-at-top
  return auto_select.decide_strategy(auto_select.take_inventory(config))


def make_strategy(config: TrainConfig) -> StrategyChoice:
  """Builds the `tf.distribute.Strategy` that `config` asks for.

  Args:
    config: the run's `TrainConfig` (reads `distribution_strategy`,
      `num_gpus`, `num_cpu_devices`, `all_reduce_alg`, `reduction_server`
      (NCCL under multi_worker_mirrored, GPUs only), and for TPU `tpu`,
      `tpu_zone`, `tpu_gcp_project`, `tpu_init_timeout`).

  Returns:
    A `StrategyChoice`.

  Raises:
    ConfigError: inconsistent device flags.
    tfdist.tpu.TPUNotAvailableError: `tpu` with no TPU reachable (raised
      within `config.tpu_init_timeout` seconds).
    StrategyNotAvailableError: a strategy this version does not provide.
  """
  name = config.distribution_strategy
  reason = f"--distribution_strategy={name}"
  cluster = None
  if name in ("auto", "multi_worker_mirrored"):
    # Imported here: only these paths need the cluster.
    from tfdist import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
    cluster = cluster_lib.resolve_cluster(
        worker_hosts=config.worker_hosts, task_index=config.task_index,
        reduction_server=config.reduction_server)
  if name == "auto" and cluster.num_workers > 1 and not cluster.num_ps:
    # Decided without listing devices: MultiWorkerMirroredStrategy must be
    # built before anything starts TensorFlow's runtime.
    name = "multi_worker_mirrored"
    reason = (f"auto chose {name}: the cluster ({cluster.source}) has "
              f"{cluster.num_workers} workers")
  elif name == "auto":
    name, why = resolve_auto(config)
    reason = f"auto chose {name}: {why}"
  if config.reduction_server and name != "multi_worker_mirrored":
    raise ConfigError(
        f"--reduction_server needs a multi-worker cluster under "
        f"multi_worker_mirrored, but this run resolved to {name} ({reason}). "
        "Vertex AI sets CLUSTER_SPEC for a job with a chief and workers "
        "(python -m tfdist.job_spec vertex --num_workers=N "
        "--reduction_server_replicas=R); drop --reduction_server for a "
        "single-process run.")
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
    choice = _parameter_server(config, reason)
  elif name == "multi_worker_mirrored":
    choice = _multi_worker_mirrored(config, reason, cluster)
  else:
    raise ConfigError(f"--distribution_strategy={name!r} is unknown.")
  logging.info("Strategy: %s (%s); %d replica(s) on %s", choice.name, reason,
               choice.strategy.num_replicas_in_sync, ", ".join(choice.devices))
  return choice
