"""The strategy section (`config.strategy`): the tf.distribute strategy, its
devices and all-reduce, and its parts: the cluster, parameter servers, the
TPU (and the parallelism section, `tfdist.config.parallelism`).

Consumers: `tfdist.distribute.strategy` builds the strategy from it
(`config.strategy.tpu` is the TPU part's `TpuOptions`,
`config.strategy.parameter_servers` its `PartitionerOptions`), the
backends (`tfdist.backends`) check their rules on it, and the cluster
reads `config.strategy.cluster`.
"""

import dataclasses
from typing import Optional

from tfdist import config_tree
from tfdist import errors
from tfdist.config.parallelism import ParallelismConfig
from tfdist.config.values import _need
from tfdist.config.values import _set
from tfdist.config_tree import setting
from tfdist.core import reduce_dtype
from tfdist.core.strategy_kind import StrategyKind


# `--distribution_strategy` values: every concrete kind, then `auto`
# (tfdist.distribute.auto_select picks a kind for it).
AUTO_STRATEGY = "auto"
STRATEGIES = tuple(kind.value for kind in StrategyKind) + (AUTO_STRATEGY,)
ALL_REDUCE_ALGS = ("auto", "nccl", "hierarchical_copy", "ring")
PS_PARTITIONERS = ("min_size", "fixed", "max_size", "none")


def requested_kind(strategy) -> Optional[StrategyKind]:
  """The `StrategyKind` a `--distribution_strategy` value names.

  Args:
    strategy: a flag value (any case) or a `StrategyKind`.

  Returns:
    The kind; None for `auto` (resolved later by
    `tfdist.distribute.auto_select`), for names that are no strategy
    (`TrainConfig` rejects those), and for a kind registered outside tfdist
    (`strategy_kind.register_kind`: its backend's `validate` holds its
    rules, the config's rules are the built-in kinds').
  """
  try:
    kind = StrategyKind.parse(strategy)
  except ValueError:
    return None
  return kind if isinstance(kind, StrategyKind) else None


def refuse_auto(strategy: str, dtype: str = "") -> None:
  """The one refusal of `auto` where concrete values are needed (building
  a strategy, deciding without `prepare_run`).

  Raises:
    ConfigError: `strategy` or `dtype` is `auto`.
  """
  if AUTO_STRATEGY in (strategy, dtype):
    raise errors.ConfigError(
        "the strategy is built from concrete values; decide `auto` "
        "first with tfdist.experiment.prepare_run "
        "(tfdist.distribute.auto_select.resolve).")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
  """The multi-worker cluster: `--worker_hosts`, timeouts, preemption
  (tfdist/distribute/cluster.py: TF_CONFIG, CLUSTER_SPEC).
  """
  worker_hosts: str = setting(
      "", "string", "cluster", key=True,
      help=("Comma-separated host:port of every worker (Model Garden's flag);"
            " all are 'worker' tasks and worker 0 is the chief. Overrides "
            "TF_CONFIG and CLUSTER_SPEC."),
      traits=("operational", "multi_replica", "cluster_given"))
  task_index: int = setting(
      -1, "integer", "cluster", key=True,
      help="This host's position in --worker_hosts (0-based; -1: unset).",
      traits=("operational", "multi_replica", "cluster_given"))
  collective_timeout_seconds: float = setting(
      0.0, "float", "cluster",
      help=("multi_worker_mirrored: a collective (all-reduce) that has not "
            "finished after this many seconds fails instead of hanging. 0 "
            "(the default): no per-collective timeout; a lost or stopped peer"
            " is detected by the coordination service's heartbeats (about 10 "
            "s) instead. A timeout costs one sleeping thread per collective "
            "for that long (TensorFlow's collective executor): thousands of "
            "threads in a long run, enough to exhaust the machine's thread "
            "limit."),
      traits=("operational", "multi_replica"))
  cluster_start_timeout_seconds: float = setting(
      900.0, "float", "cluster",
      help=("multi_worker_mirrored: fail with an error naming the cluster if "
            "not every task has connected within this many seconds of start."),
      traits=("operational", "multi_replica"))
  preemption_grace_seconds: float = setting(
      30.0, "float", "cluster", key=True,
      help=("On SIGTERM (preemption) or SIGINT, save a checkpoint at the next"
            " step boundary (all workers agree on the step) and exit within "
            "this many seconds; a process still alive then is ended."),
      traits=("operational",))

  def __post_init__(self):
    _need(self.task_index >= -1,
          f"--task_index={self.task_index} must be >= 0 (-1: unset).")
    _need(self.collective_timeout_seconds >= 0,
          f"--collective_timeout_seconds={self.collective_timeout_seconds} "
          "must be > 0, or 0 for no per-collective timeout.")
    _need(self.cluster_start_timeout_seconds > 0,
          "--cluster_start_timeout_seconds="
          f"{self.cluster_start_timeout_seconds} must be > 0.")
    _need(self.preemption_grace_seconds > 0,
          f"--preemption_grace_seconds={self.preemption_grace_seconds} must "
          "be > 0.")


@dataclasses.dataclass(frozen=True)
class ParameterServerConfig:
  """How parameter servers shard embedding tables over the ps tasks."""
  ps_partitioner: str = setting(
      "min_size", "enum", "distribution", choices=PS_PARTITIONERS,
      help=("parameter_server: how embedding tables are split across ps tasks"
            " (dense weights always stay whole). min_size: as many shards as "
            "allowed with each at least --ps_min_shard_bytes; max_size: "
            "shards of at most --ps_min_shard_bytes each (up to "
            "--ps_max_shards); fixed: exactly --ps_max_shards shards; none: "
            "no sharding."),
      traits=("multi_replica",))
  ps_min_shard_bytes: int = setting(
      256 << 10, "integer", "distribution",
      help=("parameter_server: shard size bound in bytes (the minimum for "
            "min_size, the maximum for max_size). Default: 256 KiB."),
      traits=("multi_replica",))
  ps_max_shards: int = setting(
      0, "integer", "distribution",
      help=("parameter_server: most shards per table (the exact count for "
            "fixed); 0: the number of ps tasks."),
      traits=("multi_replica",))

  def __post_init__(self):
    _need(self.ps_partitioner in PS_PARTITIONERS,
          f"--ps_partitioner={self.ps_partitioner!r} is unknown. Use one of: "
          f"{', '.join(PS_PARTITIONERS)}.")
    _need(self.ps_min_shard_bytes > 0,
          f"--ps_min_shard_bytes={self.ps_min_shard_bytes} must be > 0 "
          "bytes.")
    _need(self.ps_max_shards >= 0,
          f"--ps_max_shards={self.ps_max_shards} must be >= 0 (0: one shard "
          "per ps task).")


@dataclasses.dataclass(frozen=True)
class TpuConfig:
  """The TPU connection (Model Garden's flag names)."""
  tpu: str = setting(
      "", "string", "tpu", key=True,
      help=("TPU for --distribution_strategy=tpu (or for auto to try): "
            "`local` on a Cloud TPU VM, the Cloud TPU's name, or "
            "grpc://HOST:8470. Empty: $TPU_NAME."),
      traits=("operational", "multi_replica", "from_environment", "decided"))
  tpu_zone: str = setting(
      "", "string", "tpu",
      help="Zone of the Cloud TPU named by --tpu (default: this VM's zone).",
      traits=("operational", "multi_replica"))
  tpu_gcp_project: str = setting(
      "", "string", "tpu",
      help=("Google Cloud project of the Cloud TPU named by --tpu (default: "
            "this VM's project)."),
      traits=("operational", "multi_replica"))
  tpu_init_timeout: float = setting(
      300.0, "float", "tpu",
      help=("Seconds allowed for resolving, connecting to and initializing "
            "the TPU before the run fails (TensorFlow alone would wait "
            "forever on an address where nothing answers)."),
      traits=("operational", "multi_replica"))

  def __post_init__(self):
    _need(self.tpu_init_timeout > 0,
          f"--tpu_init_timeout={self.tpu_init_timeout} must be > 0 seconds.")


@dataclasses.dataclass(frozen=True)
class StrategyConfig:
  """The tf.distribute strategy, its devices and all-reduce, and its parts:
  the cluster, parameter servers, the TPU, model parallelism.
  """
  distribution_strategy: str = setting(
      "auto", "enum", "distribution", choices=STRATEGIES, key=True,
      help=("tf.distribute strategy. off: none; one_device; mirrored: one "
            "host, all GPUs or --num_cpu_devices logical CPUs; "
            "multi_worker_mirrored; parameter_server; tpu; auto: chosen from "
            "the devices and cluster found, and the choice is printed."),
      traits=("operational", "decided", "cluster_given"))
  num_gpus: int = setting(
      -1, "integer", "distribution", key=True,
      help="GPUs to use: -1 for all visible, 0 for none.",
      traits=("operational", "multi_replica"))
  num_cpu_devices: int = setting(
      0, "integer", "distribution", key=True,
      help=("Split the host CPU into this many logical devices, so mirrored "
            "runs that many replicas on a CPU-only machine (0 or 1: no "
            "split). In a cluster, each task's count."),
      traits=("operational", "multi_replica"))
  all_reduce_alg: str = setting(
      "auto", "enum", "distribution", choices=ALL_REDUCE_ALGS,
      help=("All-reduce. mirrored: nccl or hierarchical_copy (GPUs); "
            "multi_worker_mirrored: ring (gRPC, works on CPUs) or nccl (GPUs;"
            " what Vertex AI's Reduction Server needs); auto lets TensorFlow "
            "choose."),
      traits=("operational", "multi_replica"))
  bytes_per_pack: int = setting(
      0, "integer", "distribution",
      help=("multi_worker_mirrored: all-reduce the gradients in packs of "
            "about this many bytes, last layers first, so each pack's all-"
            "reduce can start while the backward pass computes the earlier "
            "layers' gradients (TensorFlow's "
            "CommunicationOptions.bytes_per_pack). 0 (the default): one all-"
            "reduce of every gradient after the whole backward pass. No "
            "effect with one replica; refused for other strategies."),
      traits=("operational", "multi_replica"))
  all_reduce_dtype: str = setting(
      reduce_dtype.FLOAT32, "enum", "distribution",
      choices=reduce_dtype.ALL_REDUCE_DTYPES,
      help=("The dtype gradients travel in between replicas (mirrored, "
            "multi_worker_mirrored, tpu, and ZeRO's gradient all-reduce): "
            "cast before the all-reduce, cast back to float32 after it. "
            "bfloat16 and float16 send half the bytes of float32 and round "
            "each gradient to about 3 significant digits; float16 needs "
            "--dtype=fp16 (a loss scale catches its overflow). The step's "
            "loss and metric sums stay float32 (then one more small all-"
            "reduce per step). No effect with one replica; refused with "
            "parameter_server."),
      traits=("operational", "multi_replica"))
  cluster: ClusterConfig = config_tree.section(ClusterConfig)
  parameter_servers: ParameterServerConfig = config_tree.section(
      ParameterServerConfig)
  tpu: TpuConfig = config_tree.section(TpuConfig)
  parallelism: ParallelismConfig = config_tree.section(ParallelismConfig)

  def __post_init__(self):
    _set(self, "distribution_strategy",
         str(self.distribution_strategy).lower())
    for flag, choices in (("distribution_strategy", STRATEGIES),
                          ("all_reduce_alg", ALL_REDUCE_ALGS)):
      value = getattr(self, flag)
      _need(value in choices, f"--{flag}={value!r} is unknown. Use one of: "
            f"{', '.join(choices)}.")
    _need(self.num_cpu_devices >= 0,
          f"--num_cpu_devices={self.num_cpu_devices} must be >= 0.")
    _need(self.bytes_per_pack >= 0,
          f"--bytes_per_pack={self.bytes_per_pack} must be >= 0 (0: the "
          "gradients in one all-reduce).")
    # Whether the strategy takes packs is its backend's rule
    # (`tfdist.backends.base.Backend.validate`).
    _need(self.num_gpus >= -1,
          f"--num_gpus={self.num_gpus} must be -1 (all visible), 0 or more.")

  @property
  def kind(self) -> Optional[StrategyKind]:
    """The requested strategy's kind; None for `auto` (not yet resolved)."""
    return requested_kind(self.distribution_strategy)
