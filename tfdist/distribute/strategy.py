"""What building a strategy takes and gives, whatever its kind.

`StrategyOptions` (the `--distribution_strategy` group, made from the
config's strategy section by `StrategyOptions.of`) goes in, a
`StrategyChoice` comes out. Each kind's backend builds its own strategy
(`tfdist.backends.base.Backend.make_strategy`, asked through
`tfdist.backends.registry.backend_for(kind)`), as Model Garden's
`get_distribution_strategy` builds each kind with its own helper; `auto` is
decided before, in one place (`tfdist.distribute.auto_select.resolve`).
What several backends share lives here: waiting for a cluster's peers, and
the collective instance keys of cross-process all-reduces.
"""

import dataclasses
import os

from absl import logging
import tensorflow as tf

from tfdist import config as config_lib
from tfdist import errors
from tfdist.distribute import cluster as cluster_lib
from tfdist.distribute import parameter_server
from tfdist.distribute import rendezvous
from tfdist.distribute import tpu as tpu_lib
from tfdist.core.strategy_kind import StrategyKind


# While the cluster forms, the peers that do not answer are logged this often.
START_REPORT_SECONDS = 30.0
# How long host names that do not resolve are retried (a cluster manager may
# register a peer's name only as the peer starts).
RESOLVE_RETRY_SECONDS = 30.0
# "1" keeps TensorFlow's per-call collective instance keys under
# MultiWorkerMirroredStrategy (see `use_trace_time_instance_keys`); "0" or
# unset gives each collective one key, fixed when its function is traced.
PER_CALL_INSTANCE_KEYS_ENV = "TFDIST_PER_CALL_INSTANCE_KEYS"


@dataclasses.dataclass(frozen=True)
class StrategyChoice:
  """The strategy built for a run, its name and why it was chosen.

  Attributes:
    strategy: the `tf.distribute.Strategy`.
    name: the kind built (a `StrategyKind`, or a kind registered outside
      tfdist: a `str` that equals and prints as the flag value, e.g.
      `multi_worker_mirrored`; never `auto`).
    reason: a sentence saying why (for `auto`) or what was asked.
    devices: device names the replicas run on.
  """
  strategy: tf.distribute.Strategy
  name: str
  reason: str
  devices: tuple


@dataclasses.dataclass(frozen=True)
class StrategyOptions:
  """What building a strategy reads: the config's strategy section as
  given, with the strategy and the TPU address preparing the run decided.

  Attributes:
    kind: the concrete strategy to build (`auto` already decided).
    strategy: the strategy section (`tfdist.config.StrategyConfig`), read
      as it is: `num_gpus` (-1: all visible, 0: none, N: the first N),
      `num_cpu_devices` (logical CPU devices Mirrored expects when there is
      no GPU; 0 or 1: no check), `all_reduce_alg`, `bytes_per_pack` (the
      gradients' all-reduce packs under multi_worker_mirrored, TensorFlow's
      `CommunicationOptions.bytes_per_pack`; 0: one pack), its cluster
      section's `collective_timeout_seconds` (0: none) and
      `cluster_start_timeout_seconds` (seconds), and its parameter-server
      section (the variable partitioner,
      `tfdist.config.ParameterServerConfig`).
    tpu_address: the TPU to connect to as decided (`auto`'s probe, or a
      platform's `$TPU_NAME`); '' : the TPU section's `--tpu`.
    reduction_server: `--reduction_server` (the cloud section's: Vertex
      AI's Reduction Server, NCCL all-reduce under multi_worker_mirrored,
      GPUs only).
  """
  kind: str
  strategy: config_lib.StrategyConfig = dataclasses.field(
      default_factory=config_lib.StrategyConfig)
  tpu_address: str = ""
  reduction_server: bool = False

  @property
  def tpu(self) -> tpu_lib.TpuOptions:
    """The TPU section (`tfdist.config.TpuConfig`) with the decided
    address."""
    if not self.tpu_address:
      return self.strategy.tpu
    return dataclasses.replace(self.strategy.tpu, tpu=self.tpu_address)

  @classmethod
  def of(cls, strategy, decisions=None, *,
         reduction_server: bool = False) -> "StrategyOptions":
    """The config's strategy section with the strategy and TPU decided.

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
      kind, tpu_address = StrategyKind.parse(
          strategy.distribution_strategy), ""
    else:
      kind, tpu_address = decisions.strategy, decisions.tpu
    return cls(kind=kind, strategy=strategy, tpu_address=tpu_address or "",
               reduction_server=bool(reduction_server))


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
