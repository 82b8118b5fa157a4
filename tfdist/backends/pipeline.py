"""Pipeline parallelism (`--pipeline_stages=P`, P > 1), in one process or
across the tasks of a cluster.

In one process the model's stages run on this process's devices, stage i on
GPU i or, on a CPU-only host, on logical CPU device i (configured here: P
of them). With `--num_gpus=N` or `--num_cpu_devices=N` (N = D x P, D > 1)
the process trains D copies of the pipeline on a data x pipeline mesh
(`tfdist.parallel.mesh.DeviceMesh.build(devices, pipeline=P)`: stage p of
copy d on device p * D + d; `tfdist.parallel.pipeline.copies`), each copy
on 1/D of the step's batch, each stage's gradients all-reduced over its
data group. The run is otherwise a one-device run: one replica, the trainer's
loop, checkpoints and export, with the trainer's per-replica forward and
backward pass replaced by the pipeline's micro-batched one
(`tfdist.parallel.pipeline.mode`). The strategy is TensorFlow's default
one: `OneDeviceStrategy` would place every variable on its one device,
where the stages' variables must live on theirs.

Across a cluster (`TF_CONFIG` or `tfdist.launch` with a chief and T-1
workers, no ps tasks), the chief is the one client: it connects to the
cluster (`tf.config.experimental_connect_to_cluster`), reads all the input,
runs the steps and writes `--model_dir`, as a parameter-server coordinator
does; each worker only serves its devices (a `tf.distribute.Server`) until
the chief marks the run done. The P stages go P/T to a task, in order
(chief, worker 0, worker 1, ...), stage i on device i mod P/T of its task
(its GPUs, else its logical CPU devices). With `--num_cpu_devices=n` (or
`--num_gpus=n`) on each of the T tasks and T * n = D * P, D > 1, the chief
drives D copies: the data x pipeline mesh over the tasks' devices in task
order, so each task holds its P/T stages of every copy and each stage's
data group lies on one task (`tfdist.parallel.pipeline.copies`: the
gradients of a group on a worker are all-reduced with
`tfdist.parallel.collectives`; those on the chief's own devices, which its
collective executor cannot run as a client, are summed on copy 0's
device). A lost task stops the run with
`tfdist.errors.PeerLostError` (exit status 200; restart and resume from the
last checkpoint), as under MultiWorkerMirrored.

Registered for the `pipeline` mode (`tfdist.backends.mode_backends`):
`backend_for_run` chooses this backend for a config with
`pipeline_stages > 1` (the flags allow it only with `--distribution_strategy`
auto, one_device or off; `tfdist.parallel.pipeline.options`).
"""

import contextlib
import dataclasses
from typing import List, Optional, Tuple

from absl import logging
import tensorflow as tf

from tfdist.backends import base
from tfdist.backends import mode_backends
from tfdist.backends import single_process
from tfdist.distribute import cluster as cluster_lib
from tfdist.distribute import devices as devices_lib
from tfdist.distribute import parameter_server as ps_lib
from tfdist.distribute import strategy as strategy_lib
from tfdist.parallel import mode as mode_lib
from tfdist.parallel.pipeline import options as pipeline_options
from tfdist.core.strategy_kind import StrategyKind
from tfdist import errors
from tfdist.training.step import step_runner

# The jobs whose tasks host stages, in stage order.
STAGE_JOBS = (cluster_lib.CHIEF, cluster_lib.WORKER)


def data_degree(config, tasks: int = 1) -> int:
  """D, the pipeline's copies on the devices of `tasks` processes (each
  the flags' count; `tfdist.parallel.pipeline.options.data_degree`, T
  devices a stage with `--tensor_parallel`)."""
  strategy = config.strategy
  return pipeline_options.data_degree(
      strategy.parallelism.pipeline_stages, num_gpus=strategy.num_gpus,
      num_cpu_devices=strategy.num_cpu_devices, tasks=tasks,
      tensor=strategy.parallelism.tensor_parallel)


def stage_devices(num_stages: int, num_gpus: int = -1,
                  data: int = 1, tensor: int = 1) -> List[str]:
  """The devices of D copies of P stages of T devices each, N = D * P * T
  of them in mesh order: the first N logical GPUs, or, without GPUs, the
  first N logical CPU devices (configured when there are fewer).

  Args:
    num_stages: P.
    num_gpus: `--num_gpus` (-1: all visible; 0: none).
    data: D (1: one copy, stage i on device i).
    tensor: T (1: one device a stage).

  Raises:
    errors.ConfigError: fewer than N GPUs, or the CPU already split into
      fewer than N logical devices (TensorFlow's runtime started).
  """
  n = num_stages * data * tensor
  split = f" x --tensor_parallel={tensor}" if tensor > 1 else ""
  names = base.first_gpus(n, num_gpus)
  if names is not None:
    if len(names) < n:
      raise errors.ConfigError(
          f"--pipeline_stages={num_stages}{split} x {data} data-parallel "
          f"cop{'ies' if data > 1 else 'y'} needs {n} GPUs (one a stage"
          f"{' and tensor shard' if tensor > 1 else ''}); this process "
          f"sees {len(names)}. Lower --pipeline_stages or --num_gpus to fit "
          f"{len(names)}, or pass --num_gpus=0 to run the stages on logical "
          "CPU devices.")
    return names
  stages, num_stages = num_stages, n  # Below: one logical CPU device each.
  # Before anything lists the devices: listing starts TensorFlow's runtime,
  # after which the CPU can no longer be split.
  cpu = tf.config.list_physical_devices("CPU")[0]
  if len(tf.config.get_logical_device_configuration(cpu) or ()) < num_stages:
    try:
      devices_lib.configure_cpu_devices(num_stages)
    except RuntimeError:
      pass  # Started already: its devices are enough, or refused below.
  cpus = tf.config.list_logical_devices("CPU")
  if len(cpus) < num_stages:
    raise errors.ConfigError(
        f"--pipeline_stages={stages}{split}"
        f"{f' x {data} data-parallel copies' if data > 1 else ''} needs "
        f"{num_stages} logical CPU "
        f"devices, and TensorFlow already started with {len(cpus)}: "
        "run the pipeline in a fresh process, or call "
        f"tfdist.distribute.devices.configure_cpu_devices({num_stages}) "
        "before any TensorFlow op.")
  return [d.name for d in cpus][:num_stages]


def check_copies(config, *, gpus: int, tasks: int = 1) -> None:
  """Refuses D > 1 copies of the pipeline (`data_degree`), or stages of T
  > 1 devices, that cannot run:
  in one process, `--num_cpu_devices` on a host whose GPUs would run the
  stages, or more GPUs than the host has; across the `tasks` of a
  cluster, copies of an interleaved pipeline and T > 1 (each task's
  devices are checked once the driving process is connected,
  `cluster_stage_devices`).

  Args:
    config: the run's `TrainConfig` (`pipeline_stages`, `num_gpus`,
      `num_cpu_devices`).
    gpus: the GPUs this process would use (`base.local_accelerators`).
    tasks: the cluster's tasks that host stages (1: one process).

  Raises:
    errors.ConfigError: naming the flag, the value and the fix.
  """
  strategy = config.strategy
  data = data_degree(config, tasks)
  parallelism = strategy.parallelism
  stages = parallelism.pipeline_stages
  tensor = parallelism.tensor_parallel
  if tensor > 1 and tasks > 1:
    raise errors.ConfigError(
        f"--pipeline_stages={stages} with --tensor_parallel={tensor} runs in "
        f"one process; this cluster has {tasks} chief and worker tasks, and "
        "stages split over tensor devices are not placed across tasks yet. "
        "Run it as one process (no TF_CONFIG or tfdist.launch), or drop "
        "--tensor_parallel.")
  if data > 1 and tasks > 1 and (
      parallelism.pipeline_schedule == pipeline_options.INTERLEAVED):
    pipeline_options.check_interleaved(
        stages, parallelism.num_microbatches, data,
        num_gpus=strategy.num_gpus,
        num_cpu_devices=strategy.num_cpu_devices, tasks=tasks)
  if (data == 1 and tensor == 1) or tasks > 1:
    return
  n = data * stages * tensor
  if gpus and strategy.num_gpus < 0 and strategy.num_cpu_devices > 1:
    raise errors.ConfigError(
        f"--num_cpu_devices={strategy.num_cpu_devices} asks for {data} "
        f"copies of the --pipeline_stages={stages} pipeline on logical CPU "
        "devices, but this host's GPUs would run the stages. Pass "
        f"--num_gpus={n} for the copies on GPUs, or "
        "--num_gpus=0 to run them on logical CPU devices.")
  if 0 < gpus < n:
    raise errors.ConfigError(
        f"--pipeline_stages={stages} with --num_gpus={strategy.num_gpus} "
        f"({data} data-parallel copies) needs {n} GPUs; this "
        f"host has {gpus}. Lower --num_gpus to a multiple of "
        f"{stages * tensor} up to {gpus}, or pass --num_gpus=0 to run on "
        "logical CPU devices.")


def stage_tasks(cluster) -> List[Tuple[str, int]]:
  """The tasks that host stages, in stage order: the chief, then worker 0,
  1, ...; empty outside a cluster of two or more such tasks (the stages
  then run in this process).

  Args:
    cluster: the run's `tfdist.distribute.cluster.ClusterInfo`, or None.
  """
  if cluster is None:
    return []
  tasks = [(job, index) for job in STAGE_JOBS
           for index in range(len(cluster.cluster.get(job, ())))]
  return tasks if len(tasks) > 1 else []


def stages_per_task(num_stages: int, cluster) -> int:
  """P/T: the stages each of the cluster's T stage tasks hosts (P outside
  a cluster).

  Args:
    num_stages: P (`--pipeline_stages`).
    cluster: the run's `ClusterInfo`, or None.

  Raises:
    errors.ConfigError: the cluster has ps tasks, or T does not divide P.
  """
  tasks = stage_tasks(cluster)
  if not tasks:
    return num_stages
  source = cluster.source or "the cluster"
  if cluster.num_ps:
    raise errors.ConfigError(
        f"--pipeline_stages={num_stages} runs its stages on the chief and "
        f"worker tasks of a cluster; the cluster from {source} also has "
        f"{cluster.num_ps} ps task(s), which a pipeline has no use for. "
        "Start the cluster without ps tasks (python -m tfdist.launch "
        f"--num_workers={len(tasks)} -- ...), or drop --pipeline_stages.")
  if num_stages % len(tasks):
    fits = sorted({len(tasks), 2 * len(tasks)})
    raise errors.ConfigError(
        f"--pipeline_stages={num_stages} cannot be spread evenly over the "
        f"{len(tasks)} chief and worker tasks of the cluster from {source} "
        "(each task hosts --pipeline_stages / tasks consecutive stages). "
        f"Use --pipeline_stages={' or '.join(map(str, fits))}, or a cluster "
        f"whose number of tasks divides {num_stages}.")
  return num_stages // len(tasks)


def cluster_stage_devices(tasks, per_task: int, num_gpus: int = -1,
                          logical_devices=None, copies: int = 1
                          ) -> List[str]:
  """The stages' devices across a cluster this process is connected to:
  per task, in `tasks` order, its first `per_task * copies` GPUs, or,
  without enough GPUs, its first `per_task * copies` logical CPU devices.

  Args:
    tasks: `[(job, index), ...]` (`stage_tasks`).
    per_task: P/T (`stages_per_task`).
    num_gpus: `--num_gpus` (-1: all of a task's GPUs; 0: none; N: the
      first N).
    logical_devices: the cluster's logical devices (default:
      `tf.config.list_logical_devices()`, which lists the remote tasks'
      after `tf.config.experimental_connect_to_cluster`).
    copies: D, the pipeline's copies (`data_degree` over the tasks).

  Returns:
    D * P device names in task order: with D = 1 stage i's at index i;
    else the data x pipeline mesh's order (stage p of copy d at p * D + d:
    each task's devices hold P/T stages of every copy).

  Raises:
    errors.ConfigError: a task offers fewer than `per_task * copies`
      devices.
  """
  if logical_devices is None:
    logical_devices = tf.config.list_logical_devices()
  names, wanted = [], per_task * copies
  for job, index in tasks:
    prefix = f"/job:{job}/replica:0/task:{index}/"
    mine = sorted((d for d in logical_devices if d.name.startswith(prefix)),
                  key=lambda d: tf.DeviceSpec.from_string(d.name)
                  .device_index or 0)
    gpus = [d.name for d in mine if d.device_type == "GPU"]
    gpus = [] if num_gpus == 0 else gpus[:num_gpus] if num_gpus > 0 else gpus
    cpus = [d.name for d in mine if d.device_type == "CPU"]
    pick = gpus if len(gpus) >= wanted else cpus
    if len(pick) < wanted:
      if copies > 1:
        flag = "--num_gpus" if num_gpus > 0 else "--num_cpu_devices"
        raise errors.ConfigError(
            f"{flag}={wanted} a task puts {per_task} stage(s) x {copies} "
            f"data-parallel copies on {job} {index}, which offers "
            f"{len(gpus)} GPU(s) and {len(cpus)} CPU device(s). Lower "
            f"{flag} to {max(len(gpus), len(cpus))} or fewer (a multiple "
            f"of {per_task}), or add tasks to the cluster.")
      raise errors.ConfigError(
          f"--pipeline_stages puts {per_task} stages on {job} {index}, "
          f"which offers {len(gpus)} GPU(s) and {len(cpus)} CPU device(s). "
          "Lower --pipeline_stages, or add tasks to the cluster.")
    names += pick[:wanted]
  return names


class PipelineBackend(single_process.OneDeviceBackend):
  """The model's stages on P devices: of this process, or of the chief and
  worker tasks of a cluster (the chief drives, the workers serve)."""

  kind = StrategyKind.ONE_DEVICE

  def __init__(self, cluster=None):
    """`cluster`: the run's `ClusterInfo` (None: one process)."""
    self._tasks = stage_tasks(cluster)

  # -- Roles -----------------------------------------------------------------

  def _is_driver(self, cluster) -> bool:
    return (not self._tasks or
            (cluster.task_type, cluster.task_index) == self._tasks[0])

  def training_workers(self, cluster) -> int:
    """1: one process (the chief, across a cluster) runs the steps."""
    del cluster
    return 1

  def writes_model_dir(self, cluster) -> bool:
    """The driving process: the only one, or the cluster's chief."""
    return self._is_driver(cluster)

  def serves(self, cluster) -> bool:
    """The other stage tasks of a cluster: they serve their devices."""
    return bool(self._tasks) and not self._is_driver(cluster) and (
        cluster.task_type in STAGE_JOBS)

  def cross_process_collectives(self, num_workers: int) -> bool:
    del num_workers
    return False

  def validate(self, config, decisions, *, dataset) -> None:
    """Refuses, before anything is built, more stages than GPUs in one
    process (logical CPU devices are made as needed). Across a cluster,
    `serve` checks it on every task (ps tasks, T not dividing P) and the
    chief each task's devices once connected.

    Raises:
      errors.ConfigError: one process, a host with GPUs, fewer of them than
        `pipeline_stages`; D > 1 copies that cannot run (`check_copies`).
    """
    super().validate(config, decisions, dataset=dataset)
    check_copies(config, tasks=len(self._tasks) or 1,
                 gpus=0 if self._tasks else
                 base.local_accelerators(config.strategy.num_gpus))
    if self._tasks:
      return  # Checked by `serve`, on every task, with the cluster.
    gpus = base.local_accelerators(config.strategy.num_gpus)
    stages = config.strategy.parallelism.pipeline_stages
    if 0 < gpus < stages:
      raise errors.ConfigError(
          f"--pipeline_stages={stages} needs "
          f"{stages} GPUs (stage i runs on GPU i); this "
          f"host has {gpus}. Lower --pipeline_stages to {gpus} or fewer, or "
          "pass --num_gpus=0 to run the stages on logical CPU devices.")

  def serve(self, config, decisions, cluster) -> Optional[dict]:
    """Across a cluster: checks it (every task, at start); a worker then
    serves its devices until the chief marks the run done, and returns
    `{"role", "index", "exit_status"}`. None for the driving process.

    Raises:
      errors.ConfigError: as `stages_per_task`.
    """
    if not self._tasks:
      return None
    strategy = config.strategy
    per_task = stages_per_task(strategy.parallelism.pipeline_stages, cluster)
    if not self.serves(cluster):
      return None
    if config.reliability.dry_run:
      logging.info("tfdist: dry run: %s %d would serve pipeline stages.",
                   cluster.task_type, cluster.task_index)
      return {"dry_run": True, "role": cluster.task_type,
              "index": cluster.task_index}
    # The server's own devices (not the eager context's logical ones): P/T
    # CPU devices, for the stages the task hosts when it has no GPUs.
    cpus = max(per_task, strategy.num_cpu_devices, 1)
    status = ps_lib.serve(
        decisions.model_dir, cluster,
        grace_seconds=strategy.cluster.preemption_grace_seconds,
        resolver=cluster.cluster_resolver(jobs=STAGE_JOBS),
        server_config=tf.compat.v1.ConfigProto(device_count={"CPU": cpus}))
    return {"role": cluster.task_type, "index": cluster.task_index,
            "exit_status": status}

  # -- Start-up ----------------------------------------------------------------

  def build_strategy(self, config, decisions, *, cluster,
                     lease=None) -> strategy_lib.StrategyChoice:
    """TensorFlow's default strategy, with the stages' devices ready (in a
    cluster: this process connected to the other stage tasks)."""
    if self._tasks:
      return self._connect(config, decisions, cluster=cluster, lease=lease)
    strategy = config.strategy
    stages = strategy.parallelism.pipeline_stages
    tensor = strategy.parallelism.tensor_parallel
    if strategy.num_cpu_devices > stages:
      devices_lib.configure_cpu_devices(strategy.num_cpu_devices)
    data = data_degree(config)
    names = stage_devices(stages, strategy.num_gpus, data, tensor)
    kind = names[0].rsplit(":", 2)[-2]
    where = (f"data {data} x pipeline {stages} x tensor {tensor}, shard t "
             f"of stage p of copy d on {kind} device (p*{data}+d)*{tensor}+t"
             if tensor > 1 else
             f"data {data} x pipeline {stages}, stage p of "
             f"copy d on {kind} device p*{data}+d" if data > 1 else
             f"stage i on {kind} device i")
    return strategy_lib.StrategyChoice(
        tf.distribute.get_strategy(),
        decisions.strategy,
        f"--pipeline_stages={stages}: one process, {where}",
        tuple(names))

  def _connect(self, config, decisions, *, cluster, lease):
    """The chief: waits for the other stage tasks, connects to them, and
    finds the stages' devices there."""
    strategy = config.strategy
    stages = strategy.parallelism.pipeline_stages
    per_task = stages_per_task(stages, cluster)
    # A stage task that is gone fails the call at once instead of waiting.
    ps_lib.set_grpc_fail_fast()
    devices_lib.configure_cpu_devices(max(per_task, strategy.num_cpu_devices))
    resolver = cluster.cluster_resolver(jobs=STAGE_JOBS)
    timeout = strategy.cluster.cluster_start_timeout_seconds
    with (lease.extended(timeout) if lease is not None
          else contextlib.nullcontext()):
      strategy_lib.wait_for_peers(cluster, STAGE_JOBS, timeout,
                                  describe="the pipeline's cluster")
    tf.config.experimental_connect_to_cluster(
        resolver.cluster_spec(), job_name=cluster.task_type,
        task_index=cluster.task_index, protocol=resolver.rpc_layer or "grpc")
    data = data_degree(config, len(self._tasks))
    names = cluster_stage_devices(self._tasks, per_task, strategy.num_gpus,
                                  copies=data)
    copies = (f" x {data} data-parallel copies (stage p of copy d on "
              f"device p*{data}+d of the tasks' devices)" if data > 1 else "")
    return strategy_lib.StrategyChoice(
        tf.distribute.get_strategy(),
        decisions.strategy,
        f"--pipeline_stages={stages}: {per_task} stage(s){copies} "
        f"on each of {len(self._tasks)} tasks, driven by "
        f"{cluster.task_type} {cluster.task_index}", tuple(names))

  def assembly_options(self, options, *, choice):
    """The stages (of every copy, in mesh order) go on the devices
    `build_strategy` found."""
    if options.pipeline is None or not choice.devices:
      return options
    return dataclasses.replace(options, pipeline=dataclasses.replace(
        options.pipeline, devices=tuple(choice.devices)))

  def model_memory(self, parts, *, num_replicas: int):
    """The stage that holds the most: its weights, gradients and share of
    the optimizer's state (a device holds one stage, or its V chunks
    under the interleaved schedule, or P/T of them per task)."""
    from tfdist.training.plan import memory  # pylint: disable=g-import-not-at-top
    whole = super().model_memory(parts, num_replicas=num_replicas)
    step = mode_lib.mode_of(parts.trainer, "pipeline")
    if step is None:
      return whole
    return memory.heaviest_stage(whole, step.pipeline.device_loads())

  def build_inputs(self, run):
    """The one-device runner and evaluation; the manifest's strategy
    details list the stages (device, layers, weight bytes, activation
    estimate)."""
    runner, evaluate, details = super().build_inputs(run)
    pipeline = mode_lib.mode_of(run.parts.trainer, "pipeline")
    if pipeline is not None:
      details = {**details, "pipeline_stages": pipeline.stages()}
    return runner, evaluate, details

  def export_model(self, run):
    """The whole model: with stages split over tensor devices, the model
    as built holding the trained weights (`PipelineStep.exported_model`;
    also what a `tfdist.fit` caller gets back)."""
    step = mode_lib.mode_of(run.parts.trainer, "pipeline")
    if step is None:
      return super().export_model(run)
    return step.exported_model(run.parts.trainer)

  def planned_replicas(self, config, decisions, *, cluster) -> Tuple[int, int]:
    del config, decisions
    return 1, self.training_workers(cluster)

  def translate_failure(self, error, *, after: str,
                        last_checkpoint: Optional[str], cluster):
    """Across a cluster, a lost stage task: `PeerLostError`."""
    if not self._tasks or not isinstance(error,
                                         step_runner.PEER_LOST_ERRORS):
      return None
    return step_runner.peer_lost_error(
        error, after=after, last_checkpoint=last_checkpoint,
        own=(cluster.task_type, cluster.task_index),
        addresses=cluster.cluster, what="Pipeline training")


def _pipeline_backend(kind, kind_backend, cluster) -> PipelineBackend:
  """Whatever the kind: the pipeline replaces its step runner (the chief
  drives every stage, `tfdist.parallel.mode.StepMode
  .replaces_step_runner`)."""
  del kind, kind_backend
  return PipelineBackend(cluster)


mode_backends.register_mode_backend("pipeline", factory=_pipeline_backend)
