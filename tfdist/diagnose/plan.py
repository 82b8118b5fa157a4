"""The plan: every run of a diagnosis checked before any is measured.
"""

import dataclasses
import os
from typing import Optional, Sequence, Tuple

from tfdist import errors
from tfdist import job_spec
from tfdist.diagnose.child_runs import RunSpec
from tfdist.diagnose.child_runs import baseline_args
from tfdist.diagnose.child_runs import baseline_dropped
from tfdist.diagnose.measure import backend_of
from tfdist.core.strategy_kind import StrategyKind


@dataclasses.dataclass(frozen=True)
class MeasurementPlan:
  """The runs a diagnosis measures, each checked before any starts.

  Attributes:
    requested: the requested run's `RunSpec`.
    baseline: the one-device baseline's `RunSpec` with the planned
      per-replica batch (the measured one replaces it once the requested
      run has run), or None without a baseline.
    dropped: the requested run's flags the baseline drops, as given
      (`baseline_dropped`: they apply only to several replicas).
    strategy: the requested run's strategy (`auto` resolved as
      `tfdist.distribute.auto_select` would, from this host's GPUs).
    num_replicas: replicas in sync the requested run will have (parameter
      servers: 1, each worker's step); None where only the device knows
      (TPUs).
    per_replica_batch_size: examples per replica per step; None likewise.
    on_gpu: the requested run's replicas are GPUs of this host.
  """
  requested: RunSpec
  baseline: Optional[RunSpec]
  dropped: Tuple[str, ...]
  strategy: StrategyKind
  num_replicas: Optional[int]
  per_replica_batch_size: Optional[int]
  on_gpu: bool

  @property
  def num_runs(self) -> int:
    """Runs per repeat (the requested one, and the baseline)."""
    return 2 if self.baseline else 1

  def describe(self, *, repeats: int) -> str:
    """The plan's lines for the report: the runs, and what the baseline
    dropped."""
    replicas = (f"{self.num_replicas} replica(s)" if self.num_replicas
                else "the TPU's replicas")
    workers = self.requested.num_workers
    lines = [
        f"Plan: {self.num_runs * repeats} run(s), every one's flags checked "
        f"by tfdist.train's parser: the requested run ({self.strategy}, "
        f"{replicas}" + (f", {workers} worker processes" if workers > 1
                         else "") + ")" +
        (", then the one-device baseline" if self.baseline else "") +
        (f", alternated {repeats} times" if repeats > 1 else "") + "."]
    if self.baseline:
      batch = (f"per-replica batch {self.per_replica_batch_size}"
               if self.per_replica_batch_size else
               "the requested run's per-replica batch")
      lines.append(
          f"Baseline: {StrategyKind.ONE_DEVICE}, {batch}" +
          (f"; dropped {' '.join(self.dropped)} (they apply only to "
           "several replicas or devices)." if self.dropped else "."))
    return "\n".join(lines)


def _planned_strategy(config, *, num_workers: int, num_ps: int,
                      gpus: int) -> StrategyKind:
  """The requested run's strategy; `auto` decided as
  `tfdist.distribute.auto_select.decide_strategy` decides it for the
  cluster `tfdist.launch` starts and `gpus` GPUs (a TPU is not probed)."""
  from tfdist import config as config_lib  # pylint: disable=g-import-not-at-top
  kind = config_lib.requested_kind(config.strategy.distribution_strategy)
  if kind is not None:
    return kind
  from tfdist.distribute import auto_select  # pylint: disable=g-import-not-at-top
  cluster = num_workers > 1 or num_ps > 0
  return auto_select.decide_strategy(auto_select.DeviceInventory(
      gpus=(auto_select.GpuInfo(),) * gpus,
      cluster_source="tfdist.launch" if cluster else "",
      cluster_workers=num_workers if cluster else 0, cluster_ps=num_ps,
      num_cpu_devices=config.strategy.num_cpu_devices))[0]


@dataclasses.dataclass(frozen=True)
class _PlannedDevices:
  """The device settings of the strategy section a backend's
  `planned_replicas` reads."""
  num_gpus: int
  num_cpu_devices: int


@dataclasses.dataclass(frozen=True)
class _PlannedConfig:
  """What a backend's `planned_replicas` reads of a config: its strategy
  section's devices (`config.strategy.num_gpus`)."""
  strategy: _PlannedDevices


def local_cluster(num_workers: int, num_ps: int = 0):
  """The `tfdist.distribute.cluster.ClusterInfo` of the chief of the local
  cluster `tfdist.launch` starts for `num_workers` training processes and
  `num_ps` ps tasks (`tfdist.launch.plan_tasks`; placeholder ports)."""
  from tfdist import launch  # pylint: disable=g-import-not-at-top
  from tfdist.distribute import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  jobs = {}
  for task in launch.plan_tasks(num_workers=num_workers, num_ps=num_ps):
    jobs.setdefault(task.task_type, []).append(
        f"127.0.0.1:{len(jobs.get(task.task_type, ()))}")
  return cluster_lib.ClusterInfo(task_type=cluster_lib.CHIEF, task_index=0,
                                 cluster=jobs, source="flags")


def planned_replicas(kind: StrategyKind, *, num_workers: int, gpus: int,
                     num_cpu_devices: int) -> Optional[int]:
  """Replicas in sync under `kind` (parameter servers: 1, each worker's
  step), as its backend's `planned_replicas` counts them (of `gpus`, at
  most this host's), for the local cluster of `num_workers`; None for
  TPUs (only the TPU knows its cores)."""
  backend = backend_of(kind)
  if backend.on_tpu:
    return None
  replicas, _ = backend.planned_replicas(
      _PlannedConfig(_PlannedDevices(num_gpus=gpus,
                                     num_cpu_devices=num_cpu_devices)),
      None, cluster=local_cluster(num_workers))
  return replicas


def _trains_in_one_process(backend) -> bool:
  """One process runs `backend`'s steps whatever the cluster: a
  synchronous backend with one training worker in a cluster of two."""
  return (not backend.asynchronous and
          backend.training_workers(local_cluster(2)) == 1)


def check_cluster(kind: StrategyKind, *, num_workers: int,
                  num_ps: int) -> None:
  """Refuses a local cluster the requested strategy cannot use.

  Raises:
    ConfigError: `--num_workers` / `--num_ps` and the strategy disagree.
  """
  backend = backend_of(kind)
  if (num_workers > 1 or num_ps) and _trains_in_one_process(backend):
    raise errors.ConfigError(
        f"--num_workers={num_workers} --num_ps={num_ps} start a cluster of "
        f"processes, but --distribution_strategy={kind} trains in one. Use "
        "--distribution_strategy=multi_worker_mirrored (parameter_server "
        "with --num_ps), or leave tfdist.diagnose's --num_workers and "
        "--num_ps out.")
  if backend.asynchronous and not num_ps:
    raise errors.ConfigError(
        f"--distribution_strategy={kind} needs parameter-server tasks: give "
        "tfdist.diagnose --num_ps=1 or more (and --num_workers).")
  if num_ps and not backend.asynchronous:
    raise errors.ConfigError(
        f"--num_ps={num_ps} starts parameter-server tasks, which "
        f"--distribution_strategy={kind} does not use. Use "
        "--distribution_strategy=parameter_server, or drop --num_ps.")


def _local_gpus(num_gpus: int) -> int:
  """The GPUs a run of this host uses (`--num_gpus`; -1: all)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  gpus = len(tf.config.list_physical_devices("GPU"))
  return min(gpus, num_gpus) if num_gpus >= 0 else gpus


def plan_measurements(args: Sequence[str], config, *, num_workers: int = 1,
                      num_ps: int = 0, pin: bool = False,
                      baseline: bool = True,
                      gpus: Optional[int] = None) -> MeasurementPlan:
  """Plans and checks every run of a diagnosis before any is measured
  (seconds: flags are parsed, nothing is built or trained).

  Args:
    args: the requested run's `tfdist.train` flags (no `--model_dir`).
    config: their `tfdist.config.TrainConfig` (parsed and checked).
    num_workers, num_ps: the requested run's local cluster.
    pin: pin every worker (and the baseline) to a core of its own.
    baseline: plan the one-device baseline too.
    gpus: GPUs a run uses (None: this host's, after `--num_gpus`).

  Returns:
    A `MeasurementPlan`.

  Raises:
    ConfigError: the cluster does not suit the strategy (`check_cluster`),
      or the batch does not split over the planned replicas.
    tfdist.errors.JobSpecError: tfdist.train would refuse the baseline's
      flags (the message names the flag).
  """
  from tfdist.training.plan import batch_plan  # pylint: disable=g-import-not-at-top
  strategy, loop = config.strategy, config.loop
  gpus = _local_gpus(strategy.num_gpus) if gpus is None else gpus
  kind = _planned_strategy(config, num_workers=num_workers, num_ps=num_ps,
                           gpus=gpus)
  check_cluster(kind, num_workers=num_workers, num_ps=num_ps)
  backend = backend_of(kind)
  replicas = planned_replicas(kind, num_workers=num_workers, gpus=gpus,
                              num_cpu_devices=strategy.num_cpu_devices)
  per_replica = loop.per_replica_batch_size
  if replicas is not None:
    per_replica = batch_plan.make_batch_plan(
        num_replicas_in_sync=replicas, batch_size=loop.batch_size,
        per_replica_batch_size=loop.per_replica_batch_size,
        gradient_accumulation_steps=loop.gradient_accumulation_steps,
        # As tfdist.training.plan.run_plan: a pipeline per synchronous worker.
        num_input_pipelines=(1 if backend.asynchronous else
                             backend.num_input_pipelines(num_workers)),
    ).per_replica_batch_size
  base = None
  if baseline:
    base = RunSpec("baseline", tuple(baseline_args(
        args, per_replica or batch_plan.DEFAULT_GLOBAL_BATCH_SIZE)), pin=pin)
    # tfdist.train's own parser, as the baseline child would meet it.
    job_spec.parse_train_flags(
        [*base.train_args, "--model_dir=/tmp/tfdist-diagnose/baseline"],
        where="the one-device baseline",
        environ=dict(os.environ))
  return MeasurementPlan(
      requested=RunSpec("requested", tuple(args), num_workers=num_workers,
                        num_ps=num_ps, pin=pin),
      baseline=base, dropped=tuple(baseline_dropped(args)), strategy=kind,
      num_replicas=replicas, per_replica_batch_size=per_replica,
      on_gpu=bool(gpus) and not backend.on_tpu)
