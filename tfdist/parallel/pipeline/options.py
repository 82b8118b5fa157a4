"""The pipeline flags of `tfdist.train` and `tfdist.fit`, checked at start.

`--pipeline_stages=P` (1: off), `--num_microbatches=M` (default P),
`--pipeline_schedule=gpipe|1f1b|interleaved`, `--pipeline_virtual_stages=V`
(interleaved: each device holds V chunks) and `--pipeline_cuts=name,name`
become one `PipelineOptions`; `check_flags` refuses what the pipeline cannot run, before
anything is built.

Data x pipeline in one process: the devices the run names, N of them
(`--num_gpus=N`, or `--num_cpu_devices=N` logical CPU devices on a host
without GPUs or with `--num_gpus=0`), hold D = N / P copies of the
pipeline (`data_degree`): a `tfdist.parallel.mesh.DeviceMesh` of data D x
pipeline P, stage p of copy d on device p * D + d
(`tfdist.parallel.pipeline.copies`). Without such a flag (or with N <= P)
D = 1: the P stages on the first P devices, as before.

Data x pipeline across a cluster (the chief and T - 1 workers of
`TF_CONFIG` or `tfdist.launch`, the chief driving every device,
`tfdist.backends.pipeline`): the device flag counts each task's devices, n,
so N = T * n and D = N / P; the mesh is laid over the tasks' devices in
task order (the chief's first), so stage p of every copy sits on the
devices [p * D, (p + 1) * D) of that order: each task hosts P / T stages
of every copy, as it hosts P / T stages of one copy without the flag.
Pure Python (no TensorFlow): `tfdist.config` calls it
while it validates a `TrainConfig`. The pipeline itself is
`tfdist.parallel.pipeline`; the trainer's use of it,
`tfdist.parallel.pipeline.mode`.
"""

import dataclasses
import math
from typing import Optional, Sequence, Tuple

from tfdist import errors
from tfdist.core import zero_stages
from tfdist.runtime import wording
from tfdist.parallel import mesh as mesh_lib

GPIPE = "gpipe"
ONE_F_ONE_B = "1f1b"
INTERLEAVED = "interleaved"
SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED)
# Strategies that cannot host stages: a pipeline's data parallelism runs in
# its one process (D copies on a data x pipeline mesh, each stage's
# gradients all-reduced over its data group with tfdist.parallel.
# collectives), not as tf.distribute replicas; across the workers of a
# MultiWorkerMirrored cluster the chief drives the workers' devices (the
# strategy `auto` under a cluster), not as tf.distribute replicas either.
_DATA_PARALLEL = ("mirrored", "multi_worker_mirrored", "parameter_server",
                  "tpu")


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
  """A run's pipeline: P stages, M micro-batches, the schedule, the cuts.

  Attributes:
    num_stages: P (1: no pipeline), the pipeline's devices (per copy).
    num_microbatches: M, micro-batches per step (each B/M examples).
    schedule: `gpipe`, `1f1b` or `interleaved`.
    cuts: layer names, each the first layer of a stage (a chunk, under
      `interleaved`) after the first; empty: balanced by weight and
      activation bytes.
    microbatches_defaulted: `--num_microbatches` was not given (M = P).
    devices: the mesh's device names, N = D * P of them in mesh order
      (stage p of copy d on `devices[p * D + d]`; D = 1: stage i on
      `devices[i]`), set by the pipeline backend once its devices are
      known; empty: this process's first P GPUs, else its logical CPU
      devices.
    data: D, the copies of the pipeline (`data_degree`; 1: one copy).
    device_type: "GPU" or "CPU": what the mesh's devices are, from the
      flags (`--num_gpus` above 0: GPUs), before the backend finds them.
    virtual_stages: V, the model chunks each device holds (`interleaved`:
      V >= 2, P * V chunks, chunk c on device c mod P; else 1).
    tasks: across a cluster, the names of the tasks that host stages, in
      stage order (`ClusterInfo.training_tasks`: the chief's first), each
      with N / T of the mesh's devices; empty: one process.
    tensor: T, the devices each stage's split layers spread over
      (`--tensor_parallel` with a layout map,
      `tfdist.parallel.pipeline.tensor`; 1: none). The mesh is then data
      D x pipeline P x tensor T, N = D * P * T devices, stage p of copy d
      on device index(d, p, 0) = (p * D + d) * T.
  """
  num_stages: int = 1
  num_microbatches: int = 1
  schedule: str = GPIPE
  cuts: Tuple[str, ...] = ()
  microbatches_defaulted: bool = False
  devices: Tuple[str, ...] = ()
  data: int = 1
  device_type: str = "CPU"
  virtual_stages: int = 1
  tasks: Tuple[str, ...] = ()
  tensor: int = 1

  @classmethod
  def of(cls, parallelism, *, num_gpus: int = -1, num_cpu_devices: int = 0,
         tasks: Sequence[str] = ()) -> "PipelineOptions":
    """The pipeline of the config's parallelism section
    (`tfdist.config.ParallelismConfig`: `pipeline_stages`,
    `num_microbatches`, defaulted to the stages when None,
    `pipeline_schedule`, `pipeline_virtual_stages`, `pipeline_cuts`,
    `tensor_parallel`), its data degree from
    `--num_gpus` and `--num_cpu_devices` (`data_degree`), each task's
    across the cluster's stage `tasks` (`ClusterInfo.training_tasks`).

    Raises:
      ConfigError: as `data_degree`.
    """
    tensor = (parallelism.tensor_parallel
              if parallelism.pipeline_stages > 1 else 1)
    return cls(
        num_stages=parallelism.pipeline_stages,
        num_microbatches=resolved_microbatches(
            parallelism.pipeline_stages, parallelism.num_microbatches),
        schedule=parallelism.pipeline_schedule,
        cuts=tuple(parallelism.pipeline_cuts),
        microbatches_defaulted=parallelism.num_microbatches is None,
        data=data_degree(parallelism.pipeline_stages, num_gpus=num_gpus,
                         num_cpu_devices=num_cpu_devices,
                         tasks=max(1, len(tasks)), tensor=tensor),
        device_type="GPU" if num_gpus > 0 else "CPU",
        virtual_stages=parallelism.pipeline_virtual_stages,
        tasks=tuple(tasks), tensor=tensor)

  @property
  def enabled(self) -> bool:
    """P > 1: the model is cut into stages."""
    return self.num_stages > 1

  def mesh(self) -> mesh_lib.DeviceMesh:
    """The data x pipeline (x tensor) mesh: over `devices`, or, before
    the backend found them, over D * P * T names `/device:<device_type>:i`
    (the plan's; across a cluster, `<task>/device:<device_type>:i`, an
    equal share per task in `tasks` order).

    Raises:
      ConfigError: `devices` that P does not divide (`DeviceMesh.build`).
    """
    n = self.data * self.num_stages * self.tensor
    devices = self.devices or tuple(
        f"{task}/device:{self.device_type}:{i}"
        for task in (self.tasks or ("",))
        for i in range(n // max(1, len(self.tasks))))
    return mesh_lib.DeviceMesh.build(devices, pipeline=self.num_stages,
                                     tensor=self.tensor)

  def describe(self) -> str:
    """One line for the run plan and the log."""
    cuts = (f"at {','.join(self.cuts)}" if self.cuts else
            "balanced by weight and activation bytes")
    where = (f" over {len(self.tasks)} tasks" if self.tasks else "")
    tensor = f" x tensor {self.tensor}" if self.tensor > 1 else ""
    copies = (f"{self.data} copies (data {self.data} x pipeline "
              f"{self.num_stages}{tensor}{where}, each on 1/{self.data} of "
              "the batch) of " if self.data > 1 else "")
    split = (f", each stage's split layers over {self.tensor} devices "
             "(the layout map's)" if self.tensor > 1 else "")
    per_copy = " per copy" if self.data > 1 else ""
    schedule = self.schedule
    if self.virtual_stages > 1:
      schedule += (f" (V={self.virtual_stages} virtual stages: "
                   f"{self.num_stages * self.virtual_stages} chunks, chunk c "
                   f"on stage c mod {self.num_stages})")
    return (f"{copies}{self.num_stages} stages ({cuts}){split}, "
            f"{self.num_microbatches} micro-batches per step{per_copy}, "
            f"{schedule} schedule; batch normalization sees "
            "micro-batches")

  def to_dict(self) -> dict:
    """For the manifest: stages, micro-batches, schedule, cuts, what
    batch normalization sees, the data degree, the tensor degree and the
    virtual stages when above 1."""
    out = {"stages": self.num_stages,
           "num_microbatches": self.num_microbatches,
           "schedule": self.schedule, "cuts": list(self.cuts),
           "batch_norm": "micro-batches"}
    if self.data > 1:
      out["data"] = self.data
    if self.tensor > 1:
      out["tensor"] = self.tensor
    if self.virtual_stages > 1:
      out["virtual_stages"] = self.virtual_stages
    return out


def data_degree(pipeline_stages: int, *, num_gpus: int = -1,
                num_cpu_devices: int = 0, tasks: int = 1,
                tensor: int = 1) -> int:
  """D, the copies of a P-stage pipeline: N / (P * T) for the N devices
  the flags name, 1 when they name none beyond P * T.

  N is `tasks` times n, each task's devices: `--num_gpus` when above 0
  (GPUs); else `--num_cpu_devices` (logical CPU devices; the backend
  refuses it on a host whose GPUs would run the stages unless
  `--num_gpus=0`); `--num_gpus=-1` (all visible) or N <= P keeps D = 1, so
  an unchanged command runs as before.

  Args:
    pipeline_stages: P (1: no pipeline, D = 1).
    num_gpus: `--num_gpus` (-1: all visible).
    num_cpu_devices: `--num_cpu_devices` (0 or 1: no split).
    tasks: the cluster's tasks that host stages (1: one process).
    tensor: T, each stage's devices (its layers split over them with a
      layout map; 1: one device a stage).

  Returns:
    D >= 1.

  Raises:
    ConfigError: P does not divide N (the message names the flag, the
      value and the device counts that fit); with T > 1, P * T does not
      divide N (checked first by `tfdist.parallel.tensor.options`, one
      process).
  """
  if pipeline_stages <= 1:
    return 1
  flag, n = (("--num_gpus", num_gpus) if num_gpus > 0 else
             ("--num_cpu_devices", num_cpu_devices))
  total = max(n, 0) * tasks
  if tensor > 1:
    group = pipeline_stages * tensor
    if total <= group:
      return 1
    if total % group:
      raise errors.ConfigError(
          f"{flag}={n} devices cannot hold whole copies of a "
          f"--pipeline_stages={pipeline_stages} pipeline whose stages each "
          f"split over --tensor_parallel={tensor} devices: pass {flag} a "
          f"multiple of {group}.")
    return total // group
  if total <= pipeline_stages:
    return 1
  if total % pipeline_stages:
    step = pipeline_stages // math.gcd(pipeline_stages, tasks)
    fits = sorted({k for k in (step * (n // step), step * (n // step + 1))
                   if k})
    each = (f" on each of the cluster's {tasks} tasks ({total} in all)"
            if tasks > 1 else "")
    raise errors.ConfigError(
        f"{flag}={n} devices{each} cannot hold whole copies of a "
        f"--pipeline_stages={pipeline_stages} pipeline: the data x "
        "pipeline mesh puts D = devices / stages copies on them, so "
        f"--pipeline_stages must divide the devices. Use {flag}="
        f"{' or '.join(map(str, fits))}, or --pipeline_stages="
        + wording.either([d for d in range(2, total + 1)
                          if total % d == 0 and d % tasks == 0] or [tasks])
        + ".")
  return total // pipeline_stages


def parse_cuts(value) -> Tuple[str, ...]:
  """`--pipeline_cuts` as a tuple of layer names (a comma-separated string
  or a sequence; empty items dropped)."""
  if value is None:
    return ()
  if isinstance(value, str):
    value = value.split(",")
  return tuple(str(v).strip() for v in value if str(v).strip())


def resolved_microbatches(num_stages: int,
                          num_microbatches: Optional[int]) -> int:
  """M: `num_microbatches`, or P when it is not given."""
  return num_stages if num_microbatches is None else int(num_microbatches)


# The settings (flag names) `check_flags` reads, for the step mode's
# `validate` (`tfdist.parallel.mode.StepMode.validate`).
CHECKED_SETTINGS = (
    "pipeline_stages",
    "num_microbatches",
    "pipeline_schedule",
    "pipeline_virtual_stages",
    "pipeline_cuts",
    "distribution_strategy",
    "zero_stage",
    "enable_xla",
    "num_gpus",
    "num_cpu_devices",
    "tensor_parallel",
)


def check_flags(*, pipeline_stages: int, num_microbatches: Optional[int],
                pipeline_schedule: str, pipeline_cuts: Sequence[str],
                distribution_strategy: str, zero_stage: int,
                enable_xla: bool, num_gpus: int = -1,
                num_cpu_devices: int = 0,
                pipeline_virtual_stages: int = 1,
                tensor_parallel: int = 1) -> None:
  """Refuses pipeline flags that cannot run, naming the flag, the value and
  the fix. Pure: the devices, the model and the batch are checked later
  (`tfdist.backends.pipeline`, `tfdist.parallel.pipeline.mode`,
  `check_batch`).

  Raises:
    ConfigError: P < 1; M < 1; an unknown schedule; cuts disagreeing with
      P (P * V chunks under `interleaved`); micro-batches or cuts without
      P > 1; P > 1 with a data-parallel strategy, ZeRO or XLA; P not
      dividing the devices `--num_gpus` or `--num_cpu_devices` name
      (`data_degree`); `interleaved` without V >= 2, with M not a multiple
      of P or with D > 1 copies; V > 1 with another schedule or P = 1.
  """
  if not isinstance(pipeline_stages, int) or pipeline_stages < 1:
    raise errors.ConfigError(f"--pipeline_stages={pipeline_stages} must be a "
                             "positive integer (1: no pipeline).")
  if num_microbatches is not None and (
      not isinstance(num_microbatches, int) or num_microbatches < 1):
    raise errors.ConfigError(f"--num_microbatches={num_microbatches} must be a "
                             "positive integer (default: --pipeline_stages).")
  if pipeline_schedule not in SCHEDULES:
    raise errors.ConfigError(f"--pipeline_schedule={pipeline_schedule!r} is "
                             f"unknown. Use one of: {', '.join(SCHEDULES)}.")
  _check_virtual_stages(pipeline_stages, pipeline_schedule,
                        pipeline_virtual_stages)
  _check_cuts(pipeline_stages, pipeline_virtual_stages, pipeline_cuts)
  if pipeline_stages == 1:
    if num_microbatches not in (None, 1):
      raise errors.ConfigError(
          f"--num_microbatches={num_microbatches} applies to a pipeline: "
          "pass --pipeline_stages=P (P > 1) too, or use "
          "--gradient_accumulation_steps to split the batch without one.")
    return
  if distribution_strategy in _DATA_PARALLEL:
    raise errors.ConfigError(
        f"--pipeline_stages={pipeline_stages} cannot run under "
        f"--distribution_strategy={distribution_strategy}: a pipeline's "
        "data parallelism is D copies of the pipeline on a data x "
        "pipeline device mesh driven by one process (across a cluster, "
        "its chief), not tf.distribute replicas. Use "
        "--distribution_strategy=auto, one_device or off with "
        f"--num_gpus=N or --num_cpu_devices=N (N = D x {pipeline_stages} "
        "devices: D copies; in a cluster of T chief and worker tasks, N / "
        "T on each task), or drop --pipeline_stages.")
  data = data_degree(pipeline_stages, num_gpus=num_gpus,
                     num_cpu_devices=num_cpu_devices,
                     tensor=tensor_parallel)
  if pipeline_schedule == INTERLEAVED:
    check_interleaved(pipeline_stages, num_microbatches, data,
                      num_gpus=num_gpus, num_cpu_devices=num_cpu_devices)
  if zero_stage:
    raise errors.ConfigError(
        f"--pipeline_stages={pipeline_stages} and "
        f"{zero_stages.stage_flags(zero_stage)} cannot be combined: ZeRO "
        "shards the optimizer state (from stage 2 the gradients, at stage 3 "
        "the weights) over data-parallel replicas, and a pipeline keeps "
        "each stage's state on its own devices (ZeRO within a pipeline's "
        "data groups is not built yet). Drop one of them.")
  if enable_xla:
    raise errors.ConfigError(
        f"--enable_xla cannot compile a pipelined step (--pipeline_stages="
        f"{pipeline_stages}): one XLA cluster cannot span the stages' "
        "devices. Drop --enable_xla.")


def _check_cuts(pipeline_stages: int, pipeline_virtual_stages: int,
                pipeline_cuts: Sequence[str]) -> None:
  """Refuses cuts that do not make P stages (P * V chunks with V > 1).

  Raises:
    ConfigError: naming the flags, the values and the fix.
  """
  if pipeline_virtual_stages > 1 and pipeline_cuts and (
      len(pipeline_cuts) + 1 != pipeline_stages * pipeline_virtual_stages):
    chunks = pipeline_stages * pipeline_virtual_stages
    raise errors.ConfigError(
        f"--pipeline_cuts={','.join(pipeline_cuts)} makes "
        f"{len(pipeline_cuts) + 1} chunks but --pipeline_stages="
        f"{pipeline_stages} x --pipeline_virtual_stages="
        f"{pipeline_virtual_stages} needs {chunks}: pass {chunks - 1} "
        "cut(s), each the first layer of a chunk after the first.")
  if (pipeline_virtual_stages == 1 and pipeline_cuts and
      len(pipeline_cuts) + 1 != pipeline_stages):
    raise errors.ConfigError(
        f"--pipeline_cuts={','.join(pipeline_cuts)} makes "
        f"{len(pipeline_cuts) + 1} stages but --pipeline_stages="
        f"{pipeline_stages}: pass --pipeline_stages={len(pipeline_cuts) + 1}"
        f" with these cuts, or {pipeline_stages - 1} cut(s).")


def _check_virtual_stages(pipeline_stages: int, pipeline_schedule: str,
                          pipeline_virtual_stages: int) -> None:
  """Refuses a V that is not a positive integer, V >= 2 without the
  interleaved schedule or without P > 1, and `interleaved` with V < 2.

  Raises:
    ConfigError: naming the flags, the values and the fix.
  """
  v = pipeline_virtual_stages
  if not isinstance(v, int) or v < 1:
    raise errors.ConfigError(
        f"--pipeline_virtual_stages={v} must be a positive integer (1: one "
        "chunk per stage; >= 2 with --pipeline_schedule=interleaved).")
  if pipeline_schedule == INTERLEAVED and v < 2:
    raise errors.ConfigError(
        f"--pipeline_schedule=interleaved needs --pipeline_virtual_stages="
        f"V >= 2 (received {v}): each stage holds V chunks of the model. "
        "Pass --pipeline_virtual_stages=2 (or more), or use "
        "--pipeline_schedule=1f1b.")
  if pipeline_schedule != INTERLEAVED and v > 1:
    raise errors.ConfigError(
        f"--pipeline_virtual_stages={v} applies to --pipeline_schedule="
        f"interleaved only (received --pipeline_schedule="
        f"{pipeline_schedule}): pass --pipeline_schedule=interleaved, or "
        "drop --pipeline_virtual_stages.")
  if v > 1 and pipeline_stages == 1:
    raise errors.ConfigError(
        f"--pipeline_virtual_stages={v} applies to a pipeline: pass "
        "--pipeline_stages=P (P > 1) too.")


def check_interleaved(pipeline_stages: int, num_microbatches: Optional[int],
                      data: int, *, num_gpus: int, num_cpu_devices: int,
                      tasks: int = 1) -> None:
  """Refuses M not a multiple of P (Megatron's interleaved order runs the
  micro-batches in groups of P) and D > 1 copies (not built), the latter
  on one process's devices or on each of a cluster's `tasks`.

  Raises:
    ConfigError: naming the flags, the values and the fix.
  """
  m = resolved_microbatches(pipeline_stages, num_microbatches)
  if m % pipeline_stages:
    fits = sorted({pipeline_stages * max(1, m // pipeline_stages),
                   pipeline_stages * (m // pipeline_stages + 1)})
    raise errors.ConfigError(
        f"--pipeline_schedule=interleaved needs --num_microbatches to be a "
        f"multiple of --pipeline_stages={pipeline_stages} (received "
        f"--num_microbatches={m}): its order runs the micro-batches in "
        f"groups of P on each chunk. Use --num_microbatches="
        f"{' or '.join(map(str, fits))}, or --pipeline_schedule=1f1b.")
  if data > 1:
    flag, n = (("--num_gpus", num_gpus) if num_gpus > 0 else
               ("--num_cpu_devices", num_cpu_devices))
    each = f" on each of the cluster's {tasks} tasks" if tasks > 1 else ""
    raise errors.ConfigError(
        f"--pipeline_schedule=interleaved with {flag}={n}{each} (D={data} "
        f"copies of the --pipeline_stages={pipeline_stages} pipeline): data "
        "x pipeline copies of an interleaved pipeline are not built yet. "
        f"Use {flag}={max(1, pipeline_stages // tasks)} (one copy), or "
        "--pipeline_schedule=1f1b for D copies.")


def check_batch(options: PipelineOptions, *, micro_step_batch: int,
                gradient_accumulation_steps: int = 1) -> int:
  """The pipeline's micro-batch size: the examples of one step (one
  micro-step under gradient accumulation) split D * M ways.

  Args:
    options: the run's `PipelineOptions`.
    micro_step_batch: examples per replica per (micro-)step.
    gradient_accumulation_steps: K (named in the message).

  Returns:
    micro_step_batch // (D * M): each of the D copies gets 1/D of it, cut
    into M micro-batches.

  Raises:
    ConfigError: D does not divide the (micro-)step's batch, or M does not
      divide a copy's share.
  """
  m, d = options.num_microbatches, options.data
  if micro_step_batch % (d * m) == 0:
    return micro_step_batch // (d * m)
  step = ("each of the --gradient_accumulation_steps="
          f"{gradient_accumulation_steps} micro-steps' "
          if gradient_accumulation_steps > 1 else "the step's ")
  if micro_step_batch % d:
    raise errors.ConfigError(
        f"The data x pipeline mesh's {d} copies (--pipeline_stages="
        f"{options.num_stages} on {d * options.num_stages} devices) do not "
        f"divide {step}batch of {micro_step_batch} examples: each copy "
        "gets an equal share. Use a --batch_size whose per-step share is a "
        f"multiple of {d * m} (copies x --num_microbatches), or name "
        "fewer devices (--num_gpus, --num_cpu_devices).")
  share = micro_step_batch // d
  divisors = [k for k in range(1, share + 1) if share % k == 0]
  given = (" (not given: it defaults to --pipeline_stages)"
           if options.microbatches_defaulted else "")
  copies = (f" of each of the {d} data-parallel copies' share" if d > 1
            else "")
  raise errors.ConfigError(
      f"--num_microbatches={m}{given} does not divide {step}batch of "
      f"{share} examples{copies} (--pipeline_stages="
      f"{options.num_stages}): every micro-batch must have the same size "
      f"for the update to equal the unsplit one. Choose --num_microbatches "
      f"among {divisors}, or a --batch_size whose per-step share is a "
      f"multiple of {d * m}.")
