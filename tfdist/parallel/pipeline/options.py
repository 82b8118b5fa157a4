"""The pipeline flags of `tfdist.train` and `tfdist.fit`, checked at start.

`--pipeline_stages=P` (1: off), `--num_microbatches=M` (default P),
`--pipeline_schedule=gpipe|1f1b` and `--pipeline_cuts=name,name` become one
`PipelineOptions`; `check_flags` refuses what the pipeline cannot run, before
anything is built. Pure Python (no TensorFlow): `tfdist.config` calls it
while it validates a `TrainConfig`. The pipeline itself is
`tfdist.parallel.pipeline`; the trainer's use of it,
`tfdist.parallel.pipeline.mode`.
"""

import dataclasses
from typing import Optional, Sequence, Tuple

from tfdist import errors

GPIPE = "gpipe"
ONE_F_ONE_B = "1f1b"
SCHEDULES = (GPIPE, ONE_F_ONE_B)
# Strategies that cannot host stages yet: each replica would need its
# stages' gradients all-reduced with the same stage of the other replicas
# only, a collective over a sub-group of the replicas. tf.distribute
# all-reduces over every replica; the raw collectives do work in sub-groups
# (tfdist.parallel.collectives, over a tfdist.parallel.mesh.DeviceMesh), but
# the trainer does not yet run a pipeline on such a mesh.
_DATA_PARALLEL = ("mirrored", "multi_worker_mirrored", "parameter_server",
                  "tpu")


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
  """A run's pipeline: P stages, M micro-batches, the schedule, the cuts.

  Attributes:
    num_stages: P (1: no pipeline).
    num_microbatches: M, micro-batches per step (each B/M examples).
    schedule: `gpipe` or `1f1b`.
    cuts: layer names, each the first layer of a stage after the first;
      empty: balanced by weight and activation bytes.
    microbatches_defaulted: `--num_microbatches` was not given (M = P).
    devices: the stages' device names, stage i on `devices[i]` (set by
      the pipeline backend once its devices are known; empty: this
      process's first P GPUs, else its logical CPU devices).
  """
  num_stages: int = 1
  num_microbatches: int = 1
  schedule: str = GPIPE
  cuts: Tuple[str, ...] = ()
  microbatches_defaulted: bool = False
  devices: Tuple[str, ...] = ()

  @classmethod
  def of(cls, parallelism) -> "PipelineOptions":
    """The pipeline of the config's parallelism section
    (`tfdist.config.ParallelismConfig`: `pipeline_stages`,
    `num_microbatches`, defaulted to the stages when None,
    `pipeline_schedule`, `pipeline_cuts`)."""
    return cls(
        num_stages=parallelism.pipeline_stages,
        num_microbatches=resolved_microbatches(
            parallelism.pipeline_stages, parallelism.num_microbatches),
        schedule=parallelism.pipeline_schedule,
        cuts=tuple(parallelism.pipeline_cuts),
        microbatches_defaulted=parallelism.num_microbatches is None)

  @property
  def enabled(self) -> bool:
    """P > 1: the model is cut into stages."""
    return self.num_stages > 1

  def describe(self) -> str:
    """One line for the run plan and the log."""
    cuts = (f"at {','.join(self.cuts)}" if self.cuts else
            "balanced by weight and activation bytes")
    return (f"{self.num_stages} stages ({cuts}), {self.num_microbatches} "
            f"micro-batches per step, {self.schedule} schedule; batch "
            "normalization sees micro-batches")

  def to_dict(self) -> dict:
    """For the manifest: stages, micro-batches, schedule, cuts, and what
    batch normalization sees."""
    return {"stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule, "cuts": list(self.cuts),
            "batch_norm": "micro-batches"}


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
    "pipeline_cuts",
    "distribution_strategy",
    "zero_stage",
    "enable_xla",
)


def check_flags(*, pipeline_stages: int, num_microbatches: Optional[int],
                pipeline_schedule: str, pipeline_cuts: Sequence[str],
                distribution_strategy: str, zero_stage: int,
                enable_xla: bool) -> None:
  """Refuses pipeline flags that cannot run, naming the flag, the value and
  the fix. Pure: the devices, the model and the batch are checked later
  (`tfdist.backends.pipeline`, `tfdist.parallel.pipeline.mode`,
  `check_batch`).

  Raises:
    ConfigError: P < 1; M < 1; an unknown schedule; cuts disagreeing with
      P; micro-batches or cuts without P > 1; P > 1 with a data-parallel
      strategy, ZeRO or XLA.
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
  if pipeline_cuts and len(pipeline_cuts) + 1 != pipeline_stages:
    raise errors.ConfigError(
        f"--pipeline_cuts={','.join(pipeline_cuts)} makes "
        f"{len(pipeline_cuts) + 1} stages but --pipeline_stages="
        f"{pipeline_stages}: pass --pipeline_stages={len(pipeline_cuts) + 1}"
        f" with these cuts, or {pipeline_stages - 1} cut(s).")
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
        f"--distribution_strategy={distribution_strategy}: pipelines "
        "combined with data parallelism need each stage's gradients "
        "all-reduced across that stage's copies only, which tfdist does not "
        "yet do (a data x pipeline device mesh). Use "
        "--distribution_strategy=auto"
        ", one_device or off (one replica: the stages run in one process, "
        "stage i on GPU i or logical CPU device i, or on the chief and "
        "worker tasks of a cluster), or drop --pipeline_stages.")
  if zero_stage:
    raise errors.ConfigError(
        f"--pipeline_stages={pipeline_stages} and --zero_stage={zero_stage}"
        " (--shard_optimizer_state) cannot be combined: ZeRO shards the "
        "optimizer state across data-parallel replicas, and a pipeline "
        "already keeps each stage's optimizer state on its own device. "
        "Drop one of them.")
  if enable_xla:
    raise errors.ConfigError(
        f"--enable_xla cannot compile a pipelined step (--pipeline_stages="
        f"{pipeline_stages}): one XLA cluster cannot span the stages' "
        "devices. Drop --enable_xla.")


def check_batch(options: PipelineOptions, *, micro_step_batch: int,
                gradient_accumulation_steps: int = 1) -> int:
  """The pipeline's micro-batch size: the examples of one step (one
  micro-step under gradient accumulation) split M ways.

  Args:
    options: the run's `PipelineOptions`.
    micro_step_batch: examples per replica per (micro-)step.
    gradient_accumulation_steps: K (named in the message).

  Returns:
    micro_step_batch // M.

  Raises:
    ConfigError: M does not divide the (micro-)step's batch.
  """
  m = options.num_microbatches
  if micro_step_batch % m == 0:
    return micro_step_batch // m
  divisors = [d for d in range(1, micro_step_batch + 1)
              if micro_step_batch % d == 0]
  step = ("each of the --gradient_accumulation_steps="
          f"{gradient_accumulation_steps} micro-steps' "
          if gradient_accumulation_steps > 1 else "the step's ")
  given = (" (not given: it defaults to --pipeline_stages)"
           if options.microbatches_defaulted else "")
  raise errors.ConfigError(
      f"--num_microbatches={m}{given} does not divide {step}batch of "
      f"{micro_step_batch} examples (--pipeline_stages="
      f"{options.num_stages}): every micro-batch must have the same size "
      f"for the update to equal the unsplit one. Choose --num_microbatches "
      f"among {divisors}, or a --batch_size whose per-step share is a "
      f"multiple of {m}.")
