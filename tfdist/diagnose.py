"""Measure before distributing: a baseline, the requested run, a verdict.

Usage:
  python -m tfdist.diagnose -- --dataset=fashion_mnist \\
      --distribution_strategy=mirrored --num_cpu_devices=2
  python -m tfdist.diagnose --num_workers=2 --pin_workers -- \\
      --distribution_strategy=multi_worker_mirrored --dataset=fashion_mnist

Everything after `--` is `tfdist.train` flags. The diagnosis:

1. plans every run and checks it before any is measured
   (`plan_measurements`, seconds): the requested run's flags and the
   baseline's, each by tfdist.train's own parser, the local cluster against
   the strategy, the batch against the replicas; a refusal ends the binary
   with status 2 (`tfdist.errors.CONFIG`) naming the flag. The baseline
   drops what applies only to several replicas (`MULTI_REPLICA_FLAGS`: ZeRO
   stages and sharding switches, `--num_cpu_devices`, collectives, cluster,
   parameter-server and TPU flags) and the report says which it dropped;
2. estimates, from the model alone, the bytes of its parameters, gradients
   and optimizer state (`tfdist.training.memory`), and whether every replica's
   copy fits the device's memory under data parallelism (which strategy fits if
   not); for a sharded layout (ZeRO), whether it is needed at this size and
   what it costs in traffic (`layout_notes`); and every layout side by side
   (`layout_choice`: plain data parallelism, ZeRO 1/2/3, pipeline stages,
   tensor parallelism; state and activations per device) with the cheapest
   that fits recommended with its flags;
3. runs the requested configuration and a single-device baseline
   (`one_device`, the same model, data and per-replica batch) as child
   processes of `tfdist.train` (through `tfdist.launch` for a local cluster,
   `--num_workers` / `--num_ps`), for `--train_steps` steps (default 60),
   each in its own `--model_dir` (a temporary folder unless `--model_dir` is
   given; then `<model_dir>/baseline` and `<model_dir>/requested`), in
   alternation `--repeats` times, with a line as each starts and ends;
   `--plan_only` stops before this step;
4. reads their manifests and `metrics.jsonl`, prints a table (examples/sec,
   step time, input-wait share, peak memory, speedup, scaling efficiency;
   medians over repeats, with the range) and a verdict with the numbers
   behind it (`verdict`): memory-bound, input-bound, communication-bound or
   compute-bound, with what to try (for the hardware measured, and no
   cluster advice for a run of one process).

The rule: measure one device first and find the binding constraint
before adding devices; judge N devices by speedup (examples/sec against the
baseline's) and scaling efficiency (speedup / N): 4 devices at 300
examples/sec against one at 100 is 3x and 75%. Replicas that are logical
devices of one CPU share its cores: their "speedup" is called a
logical-CPU speedup, not scaling.

It replaces `benchmarks/scaling_benchmark.py`; `benchmarks/scaling.py`
drives it for the README's scaling figures.
"""

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from absl import app
from absl import flags

from tfdist import job_spec
from tfdist import config as config_lib
from tfdist.distribute.strategy_kind import StrategyKind
from tfdist import errors
from tfdist.parallel import tensor_parallel_options
from tfdist.training import memory
from tfdist.training import optimizers

# The input-wait share of step time above which a run is input-bound, and
# above which it is "moderately" so: TensorFlow's profiler (the input
# pipeline analyzer, xprof's input_pipeline_analysis.cc:
# kHighlyInfeedBoundThresholdInPercent = 20,
# kModeratelyInfeedBoundThresholdInPercent = 5).
INPUT_BOUND_SHARE = 0.20
INPUT_MODERATE_SHARE = 0.05
# Scaling efficiency below which the extra time of N replicas is called
# communication (when input does not bind): the target tfdist sets itself
# for 2 workers is 1.8x (90%); below 80% the collectives cost more than a
# fifth of the step.
COMMUNICATION_EFFICIENCY = 0.80
# Above this scaling efficiency, or this max/min ratio of interval
# throughputs, the measurements are called disturbed (a shared machine).
SUPERLINEAR_EFFICIENCY = 1.10
NOISY_INTERVAL_RATIO = 1.5
# A device whose measured peak is above this share of its memory is full.
MEMORY_FULL_SHARE = 0.90
DEFAULT_STEPS = 60
DEFAULT_LOG_STEPS = 10
# Flags the baseline sets itself: its strategy and batch, and where it
# writes (not reported as dropped: the baseline always sets them).
_BASELINE_SETS = ("distribution_strategy", "batch_size",
                  "per_replica_batch_size",
                  *config_lib.settings_with("output_folder"), "profile_steps")
# Flags that apply only to several replicas or devices, a cluster or another
# strategy: the devices, ZeRO's sharding, collectives, the cluster,
# parameter servers, TPUs and pipeline stages. The one-device baseline drops
# them and says so.
MULTI_REPLICA_FLAGS = config_lib.settings_with("multi_replica")
_BASELINE_DROPS = _BASELINE_SETS + MULTI_REPLICA_FLAGS
# Boolean flags among them (`--name`, `--noname`: no separate value).
_BOOLEAN_DROPS = tuple(
    n for n in _BASELINE_DROPS
    if config_lib.flat_fields()[n].metadata["flag"] == "bool")

INPUT_ADVICE = (
    "input pipeline knobs: keep --cache_dataset on (parsed examples cached in "
    "memory after the first epoch), split the data into more --train_files "
    "shards than hosts (parallel reads), lower --shuffle_buffer_size if the "
    "wait is at start, move heavy preprocessing offline (into the TFRecords) "
    "or to tf.data service; tfdist already reads, parses and prefetches in "
    "parallel (tf.data AUTOTUNE)")
COMMUNICATION_ADVICE = (
    "fewer all-reduces per example: a larger per-replica batch "
    "(--per_replica_batch_size), gradient accumulation "
    "(--gradient_accumulation_steps), --nosync_batch_norm (batch norm's "
    "per-layer all-reduces){gpu}; more steps per host round trip "
    "(--steps_per_execution)")
_COMMUNICATION_GPU = (
    ", NCCL (--all_reduce_alg=nccl) or Vertex AI's Reduction Server "
    "(--reduction_server)")
# What adds compute, by the device kind measured (`RunMeasurement.
# device_kind`), and mixed precision where the hardware runs it faster:
# bf16 on TPUs, on GPUs of compute capability >= 8.0 (fp16 on 7.x), and on
# CPUs with bf16 matrix instructions (AVX-512 BF16, AMX), which oneDNN
# uses; XLA (--enable_xla) on GPUs (TPUs always compile with it).
_MORE_COMPUTE = {
    "GPU": "add GPUs while efficiency holds",
    "TPU": "a larger TPU slice while efficiency holds, more steps per call "
           "(--steps_per_execution)",
    "CPU": "more cores per worker: workers on machines of their own "
           "(Vertex AI, a TFJob, Ray), or on one machine a core each "
           "(--pin_workers)",
}
# The same for a run of one process: no cluster advice (more processes is
# another setup, measured with tfdist.diagnose --num_workers).
_MORE_COMPUTE_ONE_PROCESS = {
    "CPU": "a machine with more cores (one process already uses all of "
           "this one's), or GPUs",
}
_MIXED_PRECISION = {
    "GPU": "mixed precision (--dtype=bf16 on GPUs of compute capability >= "
           "8.0, fp16 on 7.x)",
    "TPU": "mixed precision (--dtype=bf16)",
    "CPU": "mixed precision (--dtype=bf16: this CPU has bf16 matrix "
           "instructions)",
}
MEMORY_ADVICE = (
    "{mixed}activation recomputation, a smaller per-replica batch with "
    "gradient accumulation{sharded}")
# Where the optimizer state can be split: over several replicas (ZeRO), or
# over ps tasks (a cluster).
_MEMORY_ZERO = (
    "sharded optimizer state (--shard_optimizer_state: each replica keeps "
    "1/N of it)")
_MEMORY_PS = (
    "parameter servers (--distribution_strategy=parameter_server: variables "
    "and optimizer slots sharded over ps tasks)")


def _kind(device_kind: str) -> str:
  return "CPU" if device_kind in ("CPU", "logical CPU") else device_kind


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
  """Whether this machine's CPU has bf16 matrix instructions (the
  `avx512_bf16` or `amx_bf16` flag of `/proc/cpuinfo`)."""
  try:
    with open(cpuinfo) as f:
      flags_line = next((line for line in f if line.startswith("flags")), "")
  except OSError:
    return False
  return bool({"avx512_bf16", "amx_bf16"} & set(flags_line.split()))


def _mixed_precision(run: "RunMeasurement", cpu_bf16: bool) -> Optional[str]:
  """Mixed-precision advice for `run`'s hardware; None where it does not
  apply (already bf16/fp16, or a CPU without bf16 instructions)."""
  kind = _kind(run.device_kind)
  if run.dtype in ("bf16", "fp16") or (kind == "CPU" and not cpu_bf16):
    return None
  return _MIXED_PRECISION.get(kind)


def compute_advice(run: "RunMeasurement", *, cpu_bf16: bool = False) -> str:
  """What to try on a compute-bound `run`, for the hardware it ran on (no
  cluster advice for a run of one process)."""
  kind = _kind(run.device_kind)
  more = _MORE_COMPUTE.get(kind, "add devices while efficiency holds")
  if run.num_workers <= 1:
    more = _MORE_COMPUTE_ONE_PROCESS.get(kind, more)
  parts = ["the devices are busy computing: " + more]
  mixed = _mixed_precision(run, cpu_bf16)
  if mixed:
    parts.append(mixed)
  if kind == "GPU":
    parts.append("XLA (--enable_xla)")
  return ", ".join(parts)


def communication_advice(run: "RunMeasurement") -> str:
  """What to try on a communication-bound `run` (NCCL only for GPUs; the
  Reduction Server, which sums between hosts, only for GPU workers)."""
  gpu = ""
  if _kind(run.device_kind) == "GPU":
    gpu = (_COMMUNICATION_GPU if run.num_workers > 1 else
           ", NCCL (--all_reduce_alg=nccl)")
  return COMMUNICATION_ADVICE.format(gpu=gpu)


def memory_advice(run: "RunMeasurement", *, cpu_bf16: bool = False) -> str:
  """What to try on a memory-bound `run`, for its hardware: sharded
  optimizer state only with several replicas, parameter servers only for
  a cluster."""
  mixed = _mixed_precision(run, cpu_bf16)
  sharded = [text for text, applies in ((_MEMORY_ZERO, run.num_replicas > 1),
                                        (_MEMORY_PS, run.num_workers > 1))
             if applies]
  return MEMORY_ADVICE.format(
      mixed=f"{mixed[:-1]}: half-size activations), " if mixed else "",
      sharded="".join(f", {text}" for text in sharded[:-1]) +
      (f", or {sharded[-1]}" if sharded else ""))


@dataclasses.dataclass
class RunMeasurement:
  """What one training run measured (from its manifest and metrics.jsonl).

  Attributes:
    label: `baseline` or `requested` (or a benchmark's name).
    strategy: the strategy that ran.
    num_replicas: `num_replicas_in_sync` (parameter servers: workers).
    num_workers: training processes.
    device_kind: `GPU`, `TPU`, `CPU` (one per process) or `logical CPU`
      (several replicas on one CPU: they share its cores).
    dtype: `fp32`, `bf16` or `fp16`.
    global_batch_size, per_replica_batch_size: examples per step.
    examples_per_second: over the measured intervals (first excluded).
    step_time_seconds: wall time per step.
    input_wait_fraction: share of the compiled step's time spent waiting
      for input (the chief's, or every parameter-server worker's); None if
      not measured.
    input_wait_seconds: seconds per step waiting for input.
    peak_rss_bytes: the chief's peak host memory (bytes).
    device_memory_peak_bytes: the largest GPU peak (bytes), or None.
    model_memory: `tfdist.training.memory.ModelMemory.to_dict()`, or None.
    cpu_seconds_per_step: CPU seconds of the chief's process per step (all
      its threads).
    interval_examples_per_second: each measured interval's examples/sec.
    malloc_tuning: whether the chief ran with tfdist's glibc malloc
      settings (`tfdist.runtime.allocator`; they change resident memory and,
      with oneDNN off, speed); None if the manifest does not say.
    model_dir: where the run wrote.
  """
  label: str
  strategy: str
  num_replicas: int
  num_workers: int
  device_kind: str
  dtype: str
  global_batch_size: int
  per_replica_batch_size: int
  examples_per_second: Optional[float]
  step_time_seconds: Optional[float]
  input_wait_fraction: Optional[float] = None
  input_wait_seconds: Optional[float] = None
  peak_rss_bytes: Optional[int] = None
  device_memory_peak_bytes: Optional[int] = None
  model_memory: Optional[dict] = None
  cpu_seconds_per_step: Optional[float] = None
  interval_examples_per_second: List[float] = dataclasses.field(
      default_factory=list)
  malloc_tuning: Optional[bool] = None
  model_dir: str = ""

  @property
  def scale(self) -> int:
    """What a speedup is divided by: replicas (parameter servers:
    workers)."""
    return max(self.num_replicas, 1)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def _strategy_kind(manifest: dict) -> Optional[StrategyKind]:
  """The manifest's strategy as a `StrategyKind`; None if it names none."""
  try:
    return StrategyKind.parse(manifest.get("strategy") or "")
  except ValueError:
    return None


def _device_kind(manifest: dict) -> str:
  devices = [str(d).upper() for d in manifest.get("replica_devices", [])]
  kind = _strategy_kind(manifest)
  if (kind and kind.is_tpu) or any("TPU" in d for d in devices):
    return "TPU"
  if any("GPU" in d for d in devices):
    return "GPU"
  cpu_replicas = sum("CPU" in d for d in devices)
  return "logical CPU" if cpu_replicas > 1 else "CPU"


def measurement_from_run(model_dir: str, label: str) -> RunMeasurement:
  """Reads a finished run's `run_manifest.json` and `metrics.jsonl`.

  Raises:
    DiagnoseError: the run wrote no manifest.
  """
  # Imported here, as in `model_memory_of`: they load TensorFlow, which
  # this binary imports quietly first (`tfdist.job_spec.parse_train_flags`,
  # through `tfdist.runtime.quiet_tensorflow`).
  from tfdist.observability import manifest as manifest_lib  # pylint: disable=g-import-not-at-top
  from tfdist.observability import run_log  # pylint: disable=g-import-not-at-top
  path = os.path.join(model_dir, manifest_lib.MANIFEST_FILE)
  if not os.path.exists(path):
    raise errors.DiagnoseError(f"{label}: no {path}: the run did not finish.")
  manifest = manifest_lib.read_manifest(model_dir)
  throughput = manifest.get("throughput", {})
  mem = manifest.get("memory", {})
  strategy = manifest["strategy"]
  replicas = int(manifest.get("num_replicas_in_sync") or 1)
  kind = _strategy_kind(manifest)
  if kind and kind.is_asynchronous:  # A speedup is over workers.
    replicas = int(manifest.get("num_workers") or 1)
  intervals = [r["examples_per_second"]
               for r in run_log.read_metrics(model_dir)
               if r.get("kind") == "train" and r.get("examples_per_second")
               and not r.get("excluded_from_throughput")]
  return RunMeasurement(
      label=label, strategy=strategy, num_replicas=replicas,
      num_workers=int(manifest.get("num_workers") or 1),
      device_kind=_device_kind(manifest), dtype=manifest.get("dtype", ""),
      global_batch_size=int(manifest["global_batch_size"]),
      per_replica_batch_size=int(manifest["per_replica_batch_size"]),
      examples_per_second=throughput.get("examples_per_second"),
      step_time_seconds=throughput.get("step_time_seconds"),
      input_wait_fraction=throughput.get("input_wait_fraction"),
      input_wait_seconds=throughput.get("input_wait_seconds"),
      peak_rss_bytes=mem.get("peak_rss_bytes"),
      device_memory_peak_bytes=mem.get("device_memory_peak_bytes"),
      model_memory=mem.get("model"),
      cpu_seconds_per_step=throughput.get("cpu_seconds_per_step"),
      interval_examples_per_second=intervals,
      malloc_tuning=(bool(manifest["allocator"].get("applied"))
                     if "allocator" in manifest else None),
      model_dir=model_dir)


def median_measurement(runs: Sequence[RunMeasurement]) -> RunMeasurement:
  """One measurement from repeats: medians of the timings, peaks' maximum,
  every interval kept (their range is the spread)."""
  first = runs[0]

  def med(name):
    values = [getattr(r, name) for r in runs if getattr(r, name) is not None]
    return statistics.median(values) if values else None

  def top(name):
    values = [getattr(r, name) for r in runs if getattr(r, name) is not None]
    return max(values) if values else None

  return dataclasses.replace(
      first, examples_per_second=med("examples_per_second"),
      step_time_seconds=med("step_time_seconds"),
      input_wait_fraction=med("input_wait_fraction"),
      input_wait_seconds=med("input_wait_seconds"),
      cpu_seconds_per_step=med("cpu_seconds_per_step"),
      peak_rss_bytes=top("peak_rss_bytes"),
      device_memory_peak_bytes=top("device_memory_peak_bytes"),
      interval_examples_per_second=[
          v for r in runs for v in r.interval_examples_per_second])


# --- the verdict --------------------------------------------------------------
@dataclasses.dataclass
class Verdict:
  """The binding constraint, the numbers behind it, what to try.

  Attributes:
    constraint: `memory`, `input`, `communication` or `compute`.
    reasons: the measurements that decided it, as sentences with numbers.
    advice: what to try.
    notes: other facts worth knowing (a logical-CPU speedup, a moderately
      input-bound baseline).
    speedup: requested examples/sec over the baseline's (None without).
    scaling_efficiency: `speedup / (replicas / baseline replicas)`.
  """
  constraint: str
  reasons: List[str]
  advice: List[str]
  notes: List[str] = dataclasses.field(default_factory=list)
  speedup: Optional[float] = None
  scaling_efficiency: Optional[float] = None

  @property
  def label(self) -> str:
    return f"{self.constraint}-bound"

  def to_dict(self) -> dict:
    return {**dataclasses.asdict(self), "label": self.label}

  def render(self) -> str:
    lines = [f"Verdict: {self.label}."]
    lines += [f"  because {r}" for r in self.reasons]
    lines += [f"  try: {a}" for a in self.advice]
    lines += [f"  note: {n}" for n in self.notes]
    return "\n".join(lines)


def scaling(baseline: Optional[RunMeasurement], requested: RunMeasurement):
  """`(speedup, scaling_efficiency)` of `requested` over `baseline`, or
  `(None, None)` when either has no throughput."""
  if (baseline is None or not baseline.examples_per_second or
      not requested.examples_per_second):
    return None, None
  speedup = requested.examples_per_second / baseline.examples_per_second
  return speedup, speedup / (requested.scale / baseline.scale)


def verdict(requested: RunMeasurement,
            baseline: Optional[RunMeasurement] = None, *,
            model_fit: Optional[memory.Fit] = None,
            device_memory_bytes: Optional[int] = None,
            host_memory_bytes: Optional[int] = None,
            cores: Optional[int] = None,
            pinned: bool = False, cpu_bf16: bool = False) -> Verdict:
  """Names the binding constraint of `requested` from measurements.

  Rules, in order (the first that holds decides):

  1. memory: the model's parameters, gradients and optimizer state do not
     fit a device under data parallelism (`model_fit`), or a run's measured
     peak (GPU memory, or host RSS for CPU runs) is above `MEMORY_FULL_SHARE`
     of the memory it has;
  2. input: the requested run waited for input `INPUT_BOUND_SHARE` (20%)
     or more of its step time (TensorFlow profiler's "highly input-bound");
  3. with more replicas than the baseline: logical CPU devices (or more
     workers than cores, unpinned) share the cores, so the speedup is not
     scaling: compute-bound; else a scaling efficiency below
     `COMMUNICATION_EFFICIENCY` is communication-bound;
  4. otherwise compute-bound.

  Args:
    requested: the requested run (medians over repeats).
    baseline: the single-device baseline, or None.
    model_fit: `tfdist.training.memory.fits_data_parallel` of the model, or
      None.
    device_memory_bytes: one GPU's memory, or None (CPU runs).
    host_memory_bytes: this host's memory, or None.
    cores: CPU cores the runs could use (for the logical-CPU note).
    pinned: each worker process was pinned to a core of its own.
    cpu_bf16: the CPU has bf16 matrix instructions (`cpu_has_bf16`):
      mixed precision is advised on CPU runs only then.

  Returns:
    A `Verdict`.
  """
  speedup, efficiency = scaling(baseline, requested)
  judged = _Judgement(_disturbance_notes(requested, baseline, efficiency),
                      speedup, efficiency)
  compute = compute_advice(requested, cpu_bf16=cpu_bf16)
  full = _memory_reasons(requested, baseline, model_fit=model_fit,
                         device_memory_bytes=device_memory_bytes,
                         host_memory_bytes=host_memory_bytes)
  if full:
    return judged.verdict("memory", full,
                          [memory_advice(requested, cpu_bf16=cpu_bf16)])
  found = _input_verdict(requested, baseline, judged)
  if found is None and speedup is not None and (
      requested.scale > baseline.scale):
    found = _scaling_verdict(requested, baseline, judged, compute=compute,
                             cores=cores, pinned=pinned)
  return found or _compute_verdict(requested, judged, compute)


@dataclasses.dataclass(frozen=True)
class _Judgement:
  """What every rule's `Verdict` carries: the notes so far (rules add to
  the list), the speedup and the scaling efficiency (None without)."""
  notes: List[str]
  speedup: Optional[float]
  efficiency: Optional[float]

  def verdict(self, constraint: str, reasons: List[str],
              advice: List[str]) -> Verdict:
    return Verdict(constraint, reasons, advice, self.notes, self.speedup,
                   self.efficiency)


def _share(x: Optional[float]) -> str:
  return "unmeasured" if x is None else f"{x:.0%}"


def _disturbance_notes(requested: RunMeasurement,
                       baseline: Optional[RunMeasurement],
                       efficiency: Optional[float]) -> List[str]:
  """Notes saying the measurements look disturbed: a superlinear scaling
  efficiency, or log intervals whose throughputs differ too much."""
  notes = []
  if efficiency is not None and efficiency > SUPERLINEAR_EFFICIENCY:
    notes.append(
        f"a scaling efficiency of {efficiency:.0%} (above 100%) usually "
        "means the runs were disturbed (other jobs on the machine) rather "
        "than superlinear scaling: rerun with --repeats=3 and compare the "
        "ranges.")
  for run in (baseline, requested):
    spread = run.interval_examples_per_second if run else []
    if spread and min(spread) > 0 and max(spread) / min(spread) > (
        NOISY_INTERVAL_RATIO):
      notes.append(
          f"the {run.label} run's throughput ranged {min(spread):.0f}-"
          f"{max(spread):.0f} examples/sec between log intervals: the "
          "machine was busy; compare medians of --repeats runs.")
  return notes


def _memory_reasons(requested: RunMeasurement,
                    baseline: Optional[RunMeasurement], *,
                    model_fit: Optional[memory.Fit],
                    device_memory_bytes: Optional[int],
                    host_memory_bytes: Optional[int]) -> List[str]:
  """Rule 1: why memory binds (empty when it does not): the model does not
  fit, or a run's peak is above `MEMORY_FULL_SHARE` of its memory."""
  full = []
  if model_fit is not None and not model_fit.fits:
    full.append(model_fit.advice)
  for run in (requested, baseline):
    if run is None:
      continue
    if device_memory_bytes and run.device_memory_peak_bytes and (
        run.device_memory_peak_bytes > MEMORY_FULL_SHARE *
        device_memory_bytes):
      full.append(
          f"the {run.label} run's device memory peaked at "
          f"{memory.format_bytes(run.device_memory_peak_bytes)} of "
          f"{memory.format_bytes(device_memory_bytes)} "
          f"({run.device_memory_peak_bytes / device_memory_bytes:.0%}).")
    elif (_kind(run.device_kind) == "CPU" and host_memory_bytes and
          run.peak_rss_bytes and run.peak_rss_bytes * run.num_workers >
          MEMORY_FULL_SHARE * host_memory_bytes):
      full.append(
          f"the {run.label} run's processes peaked at "
          f"{memory.format_bytes(run.peak_rss_bytes * run.num_workers)} of "
          f"host memory ({memory.format_bytes(host_memory_bytes)}).")
  return full


def _input_verdict(requested: RunMeasurement,
                   baseline: Optional[RunMeasurement],
                   judged: _Judgement) -> Optional[Verdict]:
  """Rule 2: input-bound from `INPUT_BOUND_SHARE` of the step waiting for
  input; adds the moderately input-bound notes to `judged.notes`; None
  when input does not bind."""
  notes = judged.notes
  wait = requested.input_wait_fraction
  base_wait = baseline.input_wait_fraction if baseline else None
  if base_wait is not None and INPUT_MODERATE_SHARE <= base_wait < (
      INPUT_BOUND_SHARE):
    notes.append(f"the baseline waited {base_wait:.0%} of its step for input"
                 " (moderately input-bound: 5-20%).")
  if wait is not None and wait >= INPUT_BOUND_SHARE:
    reasons = [f"the {requested.label} run waited for input {wait:.0%} of "
               f"its step time ({requested.input_wait_seconds * 1000:.1f} "
               f"ms per step; input-bound from {INPUT_BOUND_SHARE:.0%})."]
    if base_wait is not None:
      reasons.append(f"the single-device baseline waited {base_wait:.0%}.")
    return judged.verdict("input", reasons, [INPUT_ADVICE])
  if wait is not None and wait >= INPUT_MODERATE_SHARE:
    notes.append(f"input wait {wait:.0%} of the step: moderately "
                 "input-bound (5-20%); " + INPUT_ADVICE + ".")
  return None


def _shared_cores(requested: RunMeasurement, *, cores: Optional[int],
                  pinned: bool) -> Optional[str]:
  """Why the requested run's replicas share cores (logical CPU devices, or
  unpinned workers on one machine), in words; None when they do not."""
  if requested.device_kind == "logical CPU":
    return (f"the {requested.scale} replicas are logical devices of one "
            f"CPU and share its {cores or 'few'} core(s)")
  if (requested.device_kind == "CPU" and not pinned and cores and
      requested.num_workers > 1):
    return (f"the {requested.num_workers} worker processes share "
            f"{cores} core(s), unpinned")
  return None


def _scaling_verdict(requested: RunMeasurement, baseline: RunMeasurement,
                     judged: _Judgement, *, compute: str,
                     cores: Optional[int], pinned: bool) -> Verdict:
  """Rule 3, with more replicas than the baseline: compute-bound when the
  replicas share cores (a logical-CPU speedup) or scale well enough,
  communication-bound below `COMMUNICATION_EFFICIENCY`."""
  speedup, efficiency = judged.speedup, judged.efficiency
  n = requested.scale / baseline.scale
  numbers = (f"{requested.examples_per_second:.1f} examples/sec on "
             f"{requested.scale} replicas against "
             f"{baseline.examples_per_second:.1f} on {baseline.scale}: "
             f"{speedup:.2f}x, {efficiency:.0%} scaling efficiency")
  shared = _shared_cores(requested, cores=cores, pinned=pinned)
  if shared:
    judged.notes.append(
        f"{speedup:.2f}x is a logical-CPU speedup, not scaling: "
        f"{shared}, so it measures how one step uses the cores, "
        "not what more devices would give. Measure on GPUs or TPUs"
        + (", or hosts (pinned workers: --pin_workers)."
           if requested.num_workers > 1 else "."))
    return judged.verdict("compute", [numbers + f" ({shared})."], [compute])
  if efficiency >= COMMUNICATION_EFFICIENCY:
    return judged.verdict("compute", [numbers + "."], [compute])
  step_base = baseline.step_time_seconds or 0.0
  step_req = requested.step_time_seconds or 0.0
  extra = (f"; each step took {step_req * 1000:.0f} ms against "
           f"{step_base * 1000:.0f} ms on one device"
           if step_base and step_req else "")
  return judged.verdict(
      "communication",
      [numbers + f", below {COMMUNICATION_EFFICIENCY:.0%} with the input"
       f" wait at {_share(requested.input_wait_fraction)}{extra}: the {n:g}x"
       " replicas spend the difference synchronizing."],
      [communication_advice(requested)])


def _compute_verdict(requested: RunMeasurement, judged: _Judgement,
                     compute: str) -> Verdict:
  """Rule 4: nothing else binds, so the step itself is the limit."""
  reason = (f"the input wait is {_share(requested.input_wait_fraction)} of "
            "the step")
  if requested.examples_per_second:
    reason += (f" at {requested.examples_per_second:.1f} examples/sec "
               f"on {requested.scale} replica(s)")
  return judged.verdict("compute",
                        [reason + ": the step itself is the limit."],
                        [compute])


# --- the table ----------------------------------------------------------------
def _malloc_note(rows: Sequence[RunMeasurement]) -> str:
  """`, malloc tuning on` (or off, or per run) from the runs' manifests
  (`tfdist.runtime.allocator`: it changes resident memory); empty if unknown."""
  known = {r.label: r.malloc_tuning for r in rows
           if r.malloc_tuning is not None}
  if not known:
    return ""
  if len(set(known.values())) == 1:
    return f", malloc tuning {'on' if next(iter(known.values())) else 'off'}"
  return ", malloc tuning " + ", ".join(
      f"{'on' if on else 'off'} ({label})" for label, on in known.items())


def render_table(rows: Sequence[RunMeasurement],
                 baseline: Optional[RunMeasurement]) -> str:
  """The measurements as a fixed-width table (speedup and efficiency
  against `baseline`)."""
  header = ("run", "strategy", "devices", "global batch", "examples/sec",
            "range", "step ms", "input wait", "peak RSS", "device peak",
            "speedup", "efficiency")
  table = [header]
  for r in rows:
    speedup, efficiency = scaling(baseline, r)
    spread = r.interval_examples_per_second
    table.append((
        r.label, r.strategy, f"{r.num_replicas} {r.device_kind}",
        str(r.global_batch_size),
        f"{r.examples_per_second:.1f}" if r.examples_per_second else "-",
        f"{min(spread):.0f}-{max(spread):.0f}" if spread else "-",
        f"{r.step_time_seconds * 1000:.1f}" if r.step_time_seconds else "-",
        f"{r.input_wait_fraction:.1%}" if r.input_wait_fraction is not None
        else "-",
        memory.format_bytes(r.peak_rss_bytes),
        memory.format_bytes(r.device_memory_peak_bytes),
        f"{speedup:.2f}x" if speedup is not None else "-",
        f"{efficiency:.0%}" if efficiency is not None else "-"))
  widths = [max(len(row[i]) for row in table) for i in range(len(header))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                   for row in table)


# --- running children ---------------------------------------------------------
def _runs_folder_note(root: str, keep: bool) -> str:
  """Where the runs' logs and manifests are; a temporary folder, deleted at
  the end, is not named."""
  if keep:
    return f"Logs and manifests: {root}."
  return ("Logs and manifests were not kept (give --model_dir=DIR among the "
          "train flags to keep them).")


def _flag_name(arg: str) -> Optional[str]:
  if not arg.startswith("--"):
    return None
  return arg[2:].split("=", 1)[0]


def split_flags(args: Sequence[str], names: Sequence[str],
                booleans: Sequence[str] = _BOOLEAN_DROPS
                ) -> Tuple[List[str], List[str]]:
  """`(kept, taken)`: `args` without the flags `names`, and those flags as
  given (`--name value` joined into one string), in any of absl's
  spellings: `--name=value`, `--name value`, and for `booleans` `--name`
  and `--noname`."""
  kept, taken, take_value = [], [], False
  for arg in args:
    if take_value:
      take_value = False
      taken[-1] += f" {arg}"
      continue
    name = _flag_name(arg)
    if name in booleans or (name and name.startswith("no") and
                            name[2:] in booleans):
      taken.append(arg)
      continue
    if name in names:
      take_value = "=" not in arg
      taken.append(arg)
      continue
    kept.append(arg)
  return kept, taken


def without_flags(args: Sequence[str], names: Sequence[str],
                  booleans: Sequence[str] = _BOOLEAN_DROPS) -> List[str]:
  """`args` without the flags `names` (see `split_flags`)."""
  return split_flags(args, names, booleans)[0]


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """How to start one training run.

  Attributes:
    label: the run's name in tables.
    train_args: `tfdist.train` flags (no `--model_dir`).
    num_workers: training processes (> 1 or `num_ps`: through
      `tfdist.launch`).
    num_ps: parameter-server tasks.
    pin: pin each worker to a core of its own (`--pin_workers`; a single
      process to the first core).
    env: extra environment variables for the children.
  """
  label: str
  train_args: tuple
  num_workers: int = 1
  num_ps: int = 0
  pin: bool = False
  env: tuple = ()


def command_for(spec: RunSpec, model_dir: str) -> List[str]:
  """The child command line of `spec`."""
  train = [*spec.train_args, f"--model_dir={model_dir}"]
  if spec.num_workers > 1 or spec.num_ps:
    launch = [sys.executable, "-m", "tfdist.launch",
              f"--num_workers={spec.num_workers}", f"--num_ps={spec.num_ps}"]
    if spec.pin:
      launch.append("--pin_workers")
    return launch + ["--", *train]
  return [sys.executable, "-m", "tfdist.train", *train]


def run_training(spec: RunSpec, model_dir: str, *,
                 timeout_seconds: float = 900) -> RunMeasurement:
  """Runs `spec` as a child process into `model_dir`; returns its
  measurement. Output goes to `<model_dir>.log`.

  Raises:
    DiagnoseError: the child failed, timed out or wrote no manifest (the
      message holds the end of its output).
  """
  if os.path.exists(model_dir):
    shutil.rmtree(model_dir)
  os.makedirs(os.path.dirname(model_dir) or ".", exist_ok=True)
  log_path = model_dir.rstrip("/") + ".log"
  env = dict(os.environ)
  env.update(dict(spec.env))
  # The children import this checkout's tfdist (and its `flags`).
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  with open(log_path, "wb") as log:
    proc = subprocess.Popen(command_for(spec, model_dir), cwd=root, env=env,
                            stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    if spec.pin and spec.num_workers <= 1 and not spec.num_ps:
      # Before the child imports TensorFlow (which sizes its thread pools
      # from the cores it may use), as tfdist.launch --pin_workers does.
      os.sched_setaffinity(proc.pid, {sorted(os.sched_getaffinity(0))[0]})
    try:
      code = proc.wait(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, 9)
      proc.wait()
      code = None
  if code != 0:
    with open(log_path, errors="replace") as f:
      tail = f.read()[-3000:]
    what = (f"timed out after {timeout_seconds:g} s" if code is None else
            f"exited with status {code}")
    raise errors.DiagnoseError(
        f"The {spec.label} run {what}; the end of its output "
        f"({log_path}):\n{tail}")
  return measurement_from_run(model_dir, spec.label)


def baseline_args(train_args: Sequence[str], per_replica_batch_size: int
                  ) -> List[str]:
  """The single-device baseline's flags: the requested run's, without its
  strategy, batch and what applies only to several replicas
  (`MULTI_REPLICA_FLAGS`: devices, ZeRO sharding, collectives, the
  cluster, parameter servers, TPUs), on `one_device` (the first GPU when
  there is one, else the CPU) with the same per-replica batch."""
  return [*without_flags(train_args, _BASELINE_DROPS),
          f"--distribution_strategy={StrategyKind.ONE_DEVICE}",
          f"--per_replica_batch_size={per_replica_batch_size}"]


def baseline_dropped(train_args: Sequence[str]) -> List[str]:
  """The flags of `train_args` the baseline drops because they apply only
  to several replicas (`MULTI_REPLICA_FLAGS`), as given."""
  return split_flags(train_args, MULTI_REPLICA_FLAGS)[1]


@dataclasses.dataclass(frozen=True)
class ModelSizes:
  """What the layout table needs of a model, read from one build.

  Attributes:
    estimate: its unsharded `memory.ModelMemory` (one replica).
    activation_bytes_per_example: its layers' outputs for one example, in
      their compute dtype (`memory.activation_bytes_per_example`).
    tensor_parallel_bytes: bytes of the weights tensor-parallel layers
      would split (0: none can be split).
    pipeline_shares: P -> the heaviest of P pipeline stages' share of the
      weight bytes, from the model's cut (`pipeline.split_model`, balanced
      by weight bytes); P absent: the model cannot be cut into P.
  """
  estimate: memory.ModelMemory
  activation_bytes_per_example: int = 0
  tensor_parallel_bytes: int = 0
  pipeline_shares: Optional[Dict[int, float]] = None


def _pipeline_shares(model, most: int = 8) -> Dict[int, float]:
  """P -> the heaviest of P stages' share of `model`'s weight bytes, for
  P = 2 .. `most` while the model can be cut so (device names only name
  the stages: nothing is placed)."""
  from tfdist.parallel import pipeline  # pylint: disable=g-import-not-at-top
  shares = {}
  for p in range(2, most + 1):
    try:
      stages = pipeline.split_model(
          model, p, devices=[f"/device:CPU:{i}" for i in range(p)]).stages
    except (errors.PipelineConfigError, ValueError):
      break
    total = sum(s.param_bytes for s in stages)
    if total:
      shares[p] = max(s.param_bytes for s in stages) / total
  return shares


def model_memory_of(config) -> memory.ModelMemory:
  """Builds `config`'s model and optimizer on this host (no data, no
  strategy) and returns their `ModelMemory`.

  Raises:
    ConfigError: an unknown model or data set
      (`tfdist.training.task.from_names`).
  """
  return model_sizes_of(config).estimate


def model_sizes_of(config) -> ModelSizes:
  """`model_memory_of`, with the model's activations per example and the
  bytes tensor parallelism would split (`ModelSizes`).

  Raises:
    ConfigError: an unknown model or data set
      (`tfdist.training.task.from_names`).
  """
  # Imported here: they load TensorFlow and Keras, which this binary
  # imports quietly first (`tfdist.job_spec.parse_train_flags`, through
  # `tfdist.runtime.quiet_tensorflow`), and the parent process needs them only
  # now.
  import keras  # pylint: disable=g-import-not-at-top
  from tfdist import config as config_lib  # pylint: disable=g-import-not-at-top
  from tfdist.training import assembly  # pylint: disable=g-import-not-at-top
  from tfdist.training import lr_schedule  # pylint: disable=g-import-not-at-top
  from tfdist.training import precision  # pylint: disable=g-import-not-at-top
  from tfdist.training import task as task_lib  # pylint: disable=g-import-not-at-top
  dtype = config.dtype if config.dtype != "auto" else "fp32"
  precision.configure_precision(dtype)
  try:
    options = dataclasses.replace(assembly.AssemblyOptions.of(
        task=config.task, loop=config.loop, strategy=config.strategy,
        precision=config.precision, memory=config.memory,
        optimization=config.optimization, decisions=None,
        builder_config=config_lib.ModelBuilderConfig(config)), dtype=dtype)
    model = assembly.build_model(
        options, task=task_lib.from_names(task_lib.TaskNames.of(config.task)))
    # A schedule, as in every run (tfdist.training.lr_schedule): the
    # optimizer then keeps no learning-rate variable of its own.
    optimizer = assembly.run_optimizer(options,
                                       lr_schedule.ConstantLearningRate(0.1))
    optimizer.build(model.trainable_variables)
    from tfdist.parallel import tensor_parallel  # pylint: disable=g-import-not-at-top
    from tfdist.parallel import zero3  # pylint: disable=g-import-not-at-top
    return ModelSizes(
        memory.estimate_model_memory(
            model, optimizer,
            replicated_variables=zero3.replicated_variables(model)),
        memory.activation_bytes_per_example(model),
        tensor_parallel.splittable_weight_bytes(model),
        _pipeline_shares(model))
  finally:
    keras.mixed_precision.set_dtype_policy("float32")


# --- the plan: every run checked before any is measured -------------------
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
  kind = config_lib.requested_kind(config.distribution_strategy)
  if kind is not None:
    return kind
  from tfdist.distribute import auto_select  # pylint: disable=g-import-not-at-top
  cluster = num_workers > 1 or num_ps > 0
  return auto_select.decide_strategy(auto_select.DeviceInventory(
      gpus=(auto_select.GpuInfo(),) * gpus,
      cluster_source="tfdist.launch" if cluster else "",
      cluster_workers=num_workers if cluster else 0, cluster_ps=num_ps,
      num_cpu_devices=config.num_cpu_devices))[0]


def planned_replicas(kind: StrategyKind, *, num_workers: int, gpus: int,
                     num_cpu_devices: int) -> Optional[int]:
  """Replicas in sync under `kind` (parameter servers: 1, each worker's
  step), as `tfdist.backends`' `planned_replicas` count them; None for
  TPUs (only the TPU knows its cores)."""
  if kind.is_tpu:
    return None
  if kind is StrategyKind.MIRRORED:
    return gpus or max(num_cpu_devices, 1)
  if kind is StrategyKind.MULTI_WORKER_MIRRORED:
    return num_workers * max(gpus, 1)
  return 1  # One device, off, and parameter servers (per worker's step).


def check_cluster(kind: StrategyKind, *, num_workers: int,
                  num_ps: int) -> None:
  """Refuses a local cluster the requested strategy cannot use.

  Raises:
    ConfigError: `--num_workers` / `--num_ps` and the strategy disagree.
  """
  if (num_workers > 1 or num_ps) and kind.is_single_process:
    raise errors.ConfigError(
        f"--num_workers={num_workers} --num_ps={num_ps} start a cluster of "
        f"processes, but --distribution_strategy={kind} trains in one. Use "
        "--distribution_strategy=multi_worker_mirrored (parameter_server "
        "with --num_ps), or leave tfdist.diagnose's --num_workers and "
        "--num_ps out.")
  if kind.is_asynchronous and not num_ps:
    raise errors.ConfigError(
        f"--distribution_strategy={kind} needs parameter-server tasks: give "
        "tfdist.diagnose --num_ps=1 or more (and --num_workers).")
  if num_ps and not kind.is_asynchronous:
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
  from tfdist.training import batch_plan  # pylint: disable=g-import-not-at-top
  gpus = _local_gpus(config.num_gpus) if gpus is None else gpus
  kind = _planned_strategy(config, num_workers=num_workers, num_ps=num_ps,
                           gpus=gpus)
  check_cluster(kind, num_workers=num_workers, num_ps=num_ps)
  replicas = planned_replicas(kind, num_workers=num_workers, gpus=gpus,
                              num_cpu_devices=config.num_cpu_devices)
  per_replica = config.per_replica_batch_size
  if replicas is not None:
    per_replica = batch_plan.make_batch_plan(
        num_replicas_in_sync=replicas, batch_size=config.batch_size,
        per_replica_batch_size=config.per_replica_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        # As tfdist.training.run_plan: a pipeline per synchronous worker.
        num_input_pipelines=(1 if kind.is_asynchronous else
                             kind.num_input_pipelines(num_workers)),
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
      on_gpu=bool(gpus) and not kind.is_tpu)


# --- layouts: needed at this size, and at what cost ------------------------
# What ZeRO costs in traffic, per step, against data parallelism's
# all-reduce of the gradients (2 x the parameters' bytes, ring): stages 1-2
# a reduce-scatter and an all-gather, about the same bytes; stage 3 1.5x
# (the weights gathered in the forward and again in the backward pass).
# Rajbhandari et al. 2020, section 7.
ZERO_TRAFFIC = (
    "ZeRO stages 1-2 move about the same bytes per step as data "
    "parallelism's all-reduce where the collectives offer a reduce-scatter, "
    "stage 3 1.5x (Rajbhandari et al. 2020); TensorFlow offers tfdist no "
    "reduce-scatter, so it all-reduces the gradients and then all-gathers "
    "the updated weights: about 1.5x the bytes of plain data parallelism, "
    "and a flat copy of the gradients and weights every step")
# Stage 3 (`tfdist.parallel.zero3`): each block's weights gathered for its
# forward pass and again for its backward pass (which recomputes the
# block), their gradient all-reduced and sliced.
ZERO3_TRAFFIC = (
    "stage 3 gathers each block's weights for its forward pass and again "
    "for its backward pass, which recomputes the block, and all-reduces "
    "their gradients: about 2x the bytes of plain data parallelism "
    "(Rajbhandari et al. 2020 count 1.5x with a reduce-scatter, which "
    "TensorFlow does not offer) and about one more forward pass per step "
    "(--zero3_blocks=1: the whole model gathered once, no recomputation)")


def layout_notes(estimate: memory.ModelMemory, *, optimizer: str,
                 zero_stage: int, num_replicas: int, capacity_bytes: int,
                 replicas_sharing: int = 1, where: str = "device",
                 pipeline_stages: int = 1, num_microbatches: int = 1
                 ) -> List[str]:
  """Whether the run's layout is needed at this model's size, and what it
  costs, as sentences for the verdict's notes (empty for plain data
  parallelism, which `tfdist.training.memory.fits_data_parallel` judges).

  Args:
    estimate: the model's unsharded `memory.ModelMemory` per replica.
    optimizer: `--optimizer`'s name (its slots per parameter from
      `tfdist.training.optimizers`).
    zero_stage: the ZeRO stage in force (0: none).
    num_replicas: replicas the state is sharded over.
    capacity_bytes: the memory those replicas use (one GPU's, or the
      host's), bytes.
    replicas_sharing: replicas whose copies share `capacity_bytes`.
    where: the memory's name (`GPU`, `host`).
    pipeline_stages: the run's pipeline stages P (1: none), each on a
      device of its own.
    num_microbatches: its micro-batches M per step.

  Returns:
    Sentences (empty without a layout beyond data parallelism).
  """
  if pipeline_stages > 1:
    return [_pipeline_note(estimate, stages=pipeline_stages,
                           microbatches=num_microbatches,
                           capacity_bytes=capacity_bytes, where=where)]
  if not zero_stage:
    return []
  fmt = memory.format_bytes
  sharing = max(int(replicas_sharing), 1)
  flag = f"--zero_stage={zero_stage} ({memory.ZERO_STAGE_SWITCHES[zero_stage]})"
  if num_replicas <= 1:
    return [f"{flag} has one replica to shard over: it saves nothing; drop "
            "it, or add replicas."]
  slots = optimizers.optimizer_spec(optimizer).traits.slots_per_parameter
  plain = estimate.total_bytes * sharing
  share = plain / capacity_bytes if capacity_bytes else float("inf")
  sharded = memory.sharded_estimate(estimate, num_replicas=num_replicas,
                                    stage=zero_stage)
  state = (
      f"plain data parallelism holds {fmt(estimate.total_bytes)} per replica"
      f" (parameters {fmt(estimate.parameters_bytes)}, gradients "
      f"{fmt(estimate.gradients_bytes)}, {optimizer}'s state "
      f"{fmt(estimate.optimizer_bytes)}: {slots:g} slot(s) per parameter)" +
      (f", {sharing} replicas {fmt(plain)}" if sharing > 1 else "") +
      f": {share:.2%} of the {fmt(capacity_bytes)} of {where} memory")
  saving = (f"sharded over {num_replicas} replicas, the optimizer state is "
            f"{fmt(sharded.optimizer_bytes)} per replica instead of "
            f"{fmt(estimate.optimizer_bytes)}")
  traffic = ZERO_TRAFFIC
  if zero_stage >= 3:
    saving = (f"sharded over {num_replicas} replicas, the weights, gradients"
              f" and optimizer state are {fmt(sharded.total_bytes)} per "
              f"replica instead of {fmt(estimate.total_bytes)} (plus one "
              "block's gathered weights during a step)")
    traffic = ZERO3_TRAFFIC
  if plain <= memory.TIGHT_SHARE * capacity_bytes:
    return [f"ZeRO stage {zero_stage} is not needed at this size: {state}, "
            f"which fits unsharded; {saving}. What it costs: {traffic}."
            f" Drop {flag} unless the model grows."]
  fits = plain <= capacity_bytes
  return [f"ZeRO stage {zero_stage} is " +
          ("worth it" if fits else "needed") + f" at this size: {state}" +
          (" (above half: activations need the rest)" if fits else
           ", which does not fit unsharded") +
          f"; {saving}. What it costs: {traffic}."]


def _pipeline_note(estimate: memory.ModelMemory, *, stages: int,
                   microbatches: int, capacity_bytes: int, where: str) -> str:
  """Whether P pipeline stages are needed at this size, and their cost: a
  stage holds about 1/P of the weights, gradients and optimizer state (the
  cuts balance weight bytes), and each step idles (P-1)/(M+P-1) of its time
  (Huang et al. 2019)."""
  fmt = memory.format_bytes
  whole = estimate.total_bytes
  share = whole / capacity_bytes if capacity_bytes else float("inf")
  idle = stages - 1
  cost = (f"each step then idles: a bubble of {idle}/{microbatches + idle} = "
          f"{idle / (microbatches + idle):.0%} of each step (Huang et al. "
          "2019; more micro-batches shrink it), and batch normalization sees "
          "micro-batches")
  state = (f"the whole model's state is {fmt(whole)} ({share:.2%} of the "
           f"{fmt(capacity_bytes)} of {where} memory); {stages} stages keep "
           f"about {fmt(whole / stages)} per stage")
  if whole <= memory.TIGHT_SHARE * capacity_bytes:
    return (f"{stages} pipeline stages are not needed at this size: {state}"
            f", but it fits one device whole; {cost}. Drop "
            f"--pipeline_stages={stages} unless the model grows.")
  fits = whole <= capacity_bytes
  return (f"{stages} pipeline stages are " +
          ("worth it" if fits else "needed") + f" at this size: {state}" +
          (" (above half on one device: activations need the rest)" if fits
           else "; whole, it does not fit one device") + f"; {cost}.")


def device_memory_capacity() -> Optional[int]:
  """One GPU's memory (the smallest), or None without GPUs."""
  sizes = memory.gpu_memory_capacity_bytes()
  return min(sizes) if sizes else None


def diagnose(train_args: Sequence[str], *, num_workers: int = 1,
             num_ps: int = 0, pin: bool = False, repeats: int = 1,
             baseline: bool = True, steps: int = DEFAULT_STEPS,
             log_steps: int = DEFAULT_LOG_STEPS,
             model_dir: Optional[str] = None,
             timeout_seconds: float = 900, plan_only: bool = False,
             out=None) -> dict:
  """Runs the diagnosis of `train_args` (see the module docstring).

  Every run is planned and its flags checked first (`plan_measurements`),
  so a refusal comes in seconds, before anything is measured; the report
  prints the plan, a line as each run starts and ends, then the table and
  the verdict.

  Args:
    train_args: `tfdist.train` flags.
    num_workers, num_ps: a local cluster through `tfdist.launch`.
    pin: pin every worker (and the baseline) to a core of its own.
    repeats: runs of each, alternated (requested first).
    baseline: also run the single-device baseline.
    steps, log_steps: used unless `train_args` sets `--train_steps` /
      `--log_steps`.
    model_dir: keep the runs under this folder (default: a temporary one,
      deleted at the end unless a run failed: its log stays where the
      error says).
    timeout_seconds: per child run.
    plan_only: check and print the plan, the model's state and the layout
      notes, and measure nothing.
    out: where the report goes (default stdout).

  Returns:
    `{"requested", "baseline", "runs", "model_memory", "model_fit",
    "verdict", "plan"}` (JSON-ready); with `plan_only`, `{"plan",
    "model_memory", "model_fit", "layout"}`.

  Raises:
    tfdist.errors.JobSpecError: `train_args`, or the baseline made of
      them, are not valid tfdist.train flags.
    ConfigError: the cluster does not suit the strategy, or the batch does
      not split over the replicas (`plan_measurements`).
    DiagnoseError: a run failed.
  """
  out = out or sys.stdout
  given = {_flag_name(a) for a in train_args}
  args = _measured_args(train_args, given, steps=steps, log_steps=log_steps)
  root = model_dir or _model_dir_flag(train_args)
  # tfdist.train's own parser checks the flags before anything runs.
  config = job_spec.parse_train_flags(
      [*args, f"--model_dir={root or '/tmp/tfdist-diagnose'}"],
      where="the requested run", environ=dict(os.environ))
  plan = plan_measurements(args, config, num_workers=num_workers,
                           num_ps=num_ps, pin=pin, baseline=baseline)
  _say(out, plan.describe(repeats=repeats))
  facts = _train_facts(config)
  cores = len(os.sched_getaffinity(0))
  sizes = model_sizes_of(config)
  estimate = sizes.estimate
  gpu_bytes = device_memory_capacity()
  host_bytes = memory.host_memory_bytes()
  if plan_only:
    fitted = _fit_model(estimate, facts, on_gpu=plan.on_gpu,
                        num_replicas=plan.num_replicas or 1,
                        gpu_bytes=gpu_bytes, host_bytes=host_bytes)
    layout = _layout_notes(estimate, fitted, facts)
    choice = layout_choice(sizes, fitted, facts, plan)
    _say(out, "\n".join([_model_state_line(fitted, facts), *layout,
                         "", "Layouts (per device, state and activations):",
                         choice.render(), "Nothing measured (--plan_only)."]))
    return {"plan": _plan_record(plan), "model_memory":
            fitted.estimate.to_dict(),
            "model_fit": dataclasses.asdict(fitted.fit), "layout": layout,
            "layouts": choice.to_dict()}
  keep = root is not None
  root = root or tempfile.mkdtemp(prefix="tfdist-diagnose-")
  try:
    requested_runs, baseline_runs = _run_alternately(
        plan, root, repeats=repeats, timeout_seconds=timeout_seconds,
        out=out)
    requested = median_measurement(requested_runs)
    base = median_measurement(baseline_runs) if baseline_runs else None
    fitted = _fit_model(estimate, facts,
                        on_gpu=requested.device_kind == "GPU",
                        num_replicas=requested.num_replicas,
                        gpu_bytes=gpu_bytes, host_bytes=host_bytes)
    result = verdict(requested, base, model_fit=fitted.fit,
                     device_memory_bytes=gpu_bytes,
                     host_memory_bytes=host_bytes, cores=cores, pinned=pin,
                     cpu_bf16=cpu_has_bf16())
    result.notes.extend(_layout_notes(estimate, fitted, facts))
    choice = layout_choice(sizes, fitted, facts, plan)
    rows = [r for r in (base, requested) if r is not None]
    runs_line = _runs_line(
        steps=steps if "train_steps" not in given else facts.train_steps,
        repeats=repeats, cores=cores, pin=pin, rows=rows,
        log_steps=facts.log_steps)
    report = ["", render_table(rows, base), "",
              _model_state_line(fitted, facts),
              runs_line + _runs_folder_note(root, keep), "",
              "Layouts (per device, state and activations):",
              choice.render(), "", result.render()]
    _say(out, "\n".join(report))
    return {**_run_records(requested, base, requested_runs + baseline_runs,
                           keep=keep),
            "model_memory": fitted.estimate.to_dict(),
            "model_fit": dataclasses.asdict(fitted.fit), "cores": cores,
            "pinned": pin, "verdict": result.to_dict(),
            "plan": _plan_record(plan), "layouts": choice.to_dict()}
  except errors.DiagnoseError:
    # The failed run's log, which the message names, stays.
    keep = True
    raise
  finally:
    if not keep:
      shutil.rmtree(root, ignore_errors=True)


def _say(out, text: str) -> None:
  print(text, file=out, flush=True)


def _plan_record(plan: MeasurementPlan) -> dict:
  """The plan, JSON-ready."""
  return {"strategy": str(plan.strategy), "num_replicas": plan.num_replicas,
          "per_replica_batch_size": plan.per_replica_batch_size,
          "requested_args": list(plan.requested.train_args),
          "baseline_args": (list(plan.baseline.train_args)
                            if plan.baseline else None),
          "baseline_dropped": list(plan.dropped)}


def _layout_notes(estimate: memory.ModelMemory, fitted: "_FittedModel",
                  facts: "TrainFacts") -> List[str]:
  """`layout_notes` for the run's replicas and the memory they share."""
  return layout_notes(
      estimate, optimizer=facts.optimizer, zero_stage=facts.zero_stage,
      num_replicas=fitted.num_replicas,
      capacity_bytes=fitted.fit.capacity_bytes,
      replicas_sharing=fitted.sharing, where=fitted.where,
      pipeline_stages=facts.pipeline_stages,
      num_microbatches=facts.num_microbatches)


def layout_choice(sizes: ModelSizes, fitted: "_FittedModel",
                  facts: "TrainFacts", plan: MeasurementPlan
                  ) -> memory.LayoutChoice:
  """Every layout's bytes per device for the run's model, batch, dtype and
  devices, and the cheapest that fits (`memory.layout_table`).

  The devices are the requested run's replicas in sync (its pipeline
  stages, when it has more); the memory is one GPU's, or the host's that
  CPU devices share; the global batch is the requested run's per-replica
  batch times its replicas (per micro-step under gradient accumulation).
  """
  replicas = plan.num_replicas or 1
  devices = max(replicas, facts.pipeline_stages)
  global_batch = ((plan.per_replica_batch_size or 0) * replicas or
                  facts.global_batch_size or 1)
  return memory.layout_table(
      sizes.estimate, num_devices=devices,
      capacity_bytes=fitted.fit.capacity_bytes,
      shared_memory=fitted.where == "host", global_batch_size=global_batch,
      activation_bytes_per_example=sizes.activation_bytes_per_example,
      optimizer=facts.optimizer,
      gradient_accumulation=facts.gradient_accumulation_steps > 1,
      num_microbatches=(facts.num_microbatches
                        if facts.pipeline_stages > 1 else 0),
      pipeline_schedule=facts.pipeline_schedule,
      tensor_parallel_bytes=sizes.tensor_parallel_bytes,
      tensor_parallel_flag=tensor_parallel_options.flags_for(facts.model,
                                                             devices),
      refused=_refused_layouts(),
      pipeline_shares=sizes.pipeline_shares)


def _refused_layouts() -> dict:
  """Layouts this tfdist's configuration refuses whatever the run, with
  the first sentence of the refusal: ZeRO stage 3 where it is not offered
  (a config of Mirrored replicas with `--zero_stage=3`, checked)."""
  from tfdist import config as config_lib  # pylint: disable=g-import-not-at-top
  try:
    config_lib.TrainConfig(model_dir="/tmp/tfdist-diagnose", zero_stage=3,
                           distribution_strategy="mirrored")
  except errors.ConfigError as e:
    return {"ZeRO 3": str(e).split(":")[0]}
  return {}


def _model_dir_flag(train_args: Sequence[str]) -> Optional[str]:
  """The value of `--model_dir=DIR` among `train_args`, or None."""
  return next((a.split("=", 1)[1] for a in train_args
               if _flag_name(a) == "model_dir" and "=" in a), None)


def _run_records(requested: RunMeasurement,
                 base: Optional[RunMeasurement],
                 runs: Sequence[RunMeasurement], *, keep: bool) -> dict:
  """`{"requested", "baseline", "runs"}` of the result, JSON-ready; a
  run's folder is named only when it is kept."""

  def record(run):
    return {**run.to_dict(), "model_dir": run.model_dir if keep else None}

  return {"requested": record(requested),
          "baseline": record(base) if base else None,
          "runs": [record(r) for r in runs]}


@dataclasses.dataclass(frozen=True)
class TrainFacts:
  """What the diagnosis reads of the requested run's configuration.

  Attributes:
    optimizer: `--optimizer`'s name.
    zero_stage: the ZeRO stage in force (0: optimizer state not sharded).
    train_steps: `--train_steps` of each run.
    log_steps: `--log_steps` (the measurement interval, steps).
    pipeline_stages: `--pipeline_stages` (1: none).
    num_microbatches: the micro-batches per step of a pipelined run.
    pipeline_schedule: `--pipeline_schedule`.
    global_batch_size: `--batch_size` (0: the plan's).
    gradient_accumulation_steps: `--gradient_accumulation_steps`.
    model: `--model` (whether `--tensor_parallel` can split it).
  """
  optimizer: str
  zero_stage: int
  train_steps: int
  log_steps: int
  pipeline_stages: int = 1
  num_microbatches: int = 1
  pipeline_schedule: str = "gpipe"
  global_batch_size: int = 0
  gradient_accumulation_steps: int = 1
  model: str = ""


def _train_facts(config) -> TrainFacts:
  """The `TrainFacts` of a parsed `tfdist.config.TrainConfig`."""
  stages = int(getattr(config, "pipeline_stages", 1) or 1)
  return TrainFacts(optimizer=config.optimizer,
                    zero_stage=config.zero_stage_resolved,
                    train_steps=config.train_steps,
                    log_steps=config.log_steps, pipeline_stages=stages,
                    num_microbatches=int(getattr(config, "num_microbatches",
                                                 None) or stages),
                    pipeline_schedule=getattr(config, "pipeline_schedule",
                                              "gpipe") or "gpipe",
                    global_batch_size=int(config.batch_size or 0),
                    gradient_accumulation_steps=int(
                        config.gradient_accumulation_steps or 1),
                    model=str(getattr(config, "model", "") or ""))


def _measured_args(train_args: Sequence[str], given: set, *, steps: int,
                   log_steps: int) -> List[str]:
  """`train_args` without `--model_dir`, with the diagnosis' defaults for
  the steps, the log interval and one evaluation at the end where
  `given` (the flag names in `train_args`) lacks them."""
  args = [a for a in train_args if _flag_name(a) != "model_dir"]
  if "train_steps" not in given:
    args.append(f"--train_steps={steps}")
  if "log_steps" not in given:
    args.append(f"--log_steps={log_steps}")
  if "epochs_between_evals" not in given:
    args.append("--epochs_between_evals=1000")  # One evaluation, at the end.
  return args


def _run_alternately(plan: MeasurementPlan, root: str, *, repeats: int,
                     timeout_seconds: float, out=None):
  """Runs the plan's requested configuration and its baseline (if any),
  alternated, `repeats` times each, into folders under `root`, with a
  line to `out` as each run starts and ends.

  Returns:
    `(requested_runs, baseline_runs)`: lists of `RunMeasurement`
    (`baseline_runs` empty without a baseline).

  Raises:
    DiagnoseError: a run failed.
  """
  requested_runs, baseline_runs = [], []
  total = plan.num_runs * repeats
  for i in range(repeats):
    suffix = f"-{i}" if repeats > 1 else ""
    requested_runs.append(_run_with_progress(
        plan.requested, os.path.join(root, f"requested{suffix}"),
        number=len(requested_runs) + len(baseline_runs) + 1, total=total,
        timeout_seconds=timeout_seconds, out=out))
    if plan.baseline:
      # The requested run's measured per-replica batch (planned the same).
      base_spec = dataclasses.replace(plan.baseline, train_args=tuple(
          baseline_args(plan.requested.train_args,
                        requested_runs[0].per_replica_batch_size)))
      baseline_runs.append(_run_with_progress(
          base_spec, os.path.join(root, f"baseline{suffix}"),
          number=len(requested_runs) + len(baseline_runs) + 1, total=total,
          timeout_seconds=timeout_seconds, out=out))
  return requested_runs, baseline_runs


def _run_with_progress(spec: RunSpec, model_dir: str, *, number: int,
                       total: int, timeout_seconds: float,
                       out=None) -> RunMeasurement:
  """`run_training`, with a line to `out` when it starts and when it ends
  (elapsed seconds)."""
  out = out or sys.stdout
  what = ("tfdist.launch, " f"{spec.num_workers} worker(s)"
          + (f", {spec.num_ps} ps" if spec.num_ps else "")
          if spec.num_workers > 1 or spec.num_ps else "tfdist.train")
  _say(out, f"[{number}/{total}] {spec.label} run: started ({what}).")
  started = time.monotonic()
  try:
    run = run_training(spec, model_dir, timeout_seconds=timeout_seconds)
  except errors.DiagnoseError:
    _say(out, f"[{number}/{total}] {spec.label} run: failed after "
              f"{time.monotonic() - started:.0f} s.")
    raise
  eps = (f", {run.examples_per_second:.1f} examples/sec"
         if run.examples_per_second else "")
  _say(out, f"[{number}/{total}] {spec.label} run: finished in "
            f"{time.monotonic() - started:.0f} s{eps}.")
  return run


@dataclasses.dataclass(frozen=True)
class _FittedModel:
  """The model state per replica and whether it fits where it runs.

  Attributes:
    estimate: the `memory.ModelMemory` per replica (ZeRO-sharded).
    fit: `memory.fits_data_parallel`'s `Fit`.
    num_replicas: replicas in sync.
    sharing: replicas whose copies share one memory.
    where: `GPU` or `host`: the memory they share.
  """
  estimate: memory.ModelMemory
  fit: memory.Fit
  num_replicas: int
  sharing: int
  where: str


def _fit_model(estimate: memory.ModelMemory, facts: "TrainFacts", *,
               on_gpu: bool, num_replicas: int, gpu_bytes: Optional[int],
               host_bytes: Optional[int]) -> _FittedModel:
  """Whether the run's replicas' model state fits their memory (bytes:
  one GPU's, or the host's)."""
  # Replicas whose copies share one memory: a GPU holds one; CPU
  # replicas (logical devices, or the workers of a local cluster) each
  # hold a copy in this host's memory.
  on_gpu = bool(on_gpu and gpu_bytes)
  sharing = 1 if on_gpu else num_replicas
  fit = memory.fits_data_parallel(
      estimate, capacity_bytes=gpu_bytes if on_gpu else host_bytes,
      replicas_sharing=sharing, optimizer=facts.optimizer,
      num_replicas=num_replicas, zero_stage=facts.zero_stage)
  estimate = memory.sharded_estimate(
      estimate, num_replicas=num_replicas, stage=facts.zero_stage)
  return _FittedModel(estimate, fit, num_replicas, sharing,
                      "GPU" if on_gpu else "host")


def _model_state_line(fitted: _FittedModel, facts: TrainFacts) -> str:
  """The report's line on the model state per replica and its fit."""
  estimate, fit, stage = fitted.estimate, fitted.fit, facts.zero_stage
  return (
      f"Model state per replica: parameters "
      f"{memory.format_bytes(estimate.parameters_bytes)} "
      f"({estimate.num_parameters:,} values), gradients "
      f"{memory.format_bytes(estimate.gradients_bytes)}, optimizer "
      f"({facts.optimizer}"
      + (f", ZeRO stage {stage}" if stage else "") +
      f") {memory.format_bytes(estimate.optimizer_bytes)}"
      f": {memory.format_bytes(estimate.total_bytes)}; {fitted.sharing} "
      f"replica(s) on {memory.format_bytes(fit.capacity_bytes)} of "
      f"{fitted.where} memory: {fit.share:.2%}, "
      + ("fits under data parallelism." if fit.fits else "does not fit."))


def _runs_line(*, steps: int, repeats: int, cores: int, pin: bool,
               rows: Sequence[RunMeasurement], log_steps: int) -> str:
  """The report's line on how the runs ran and what the numbers mean (the
  runs folder's note follows it)."""
  return (
      f"Runs: {steps} steps each, {repeats} time(s) alternated, on {cores} "
      "core(s)"
      + (", each worker pinned to a core of its own" if pin else "") +
      _malloc_note(rows) +
      f"; throughput excludes each run's first {log_steps} steps "
      "(warm-up); input wait is the share of the compiled step's time "
      "spent waiting for the input iterator. ")


# --- the binary -------------------------------------------------------------
_FLAGS = flags.FlagValues()
flags.DEFINE_integer("num_workers", 1, "Training processes of the requested "
                     "run; more than 1 starts a local cluster through "
                     "tfdist.launch (multi_worker_mirrored, or "
                     "parameter_server with --num_ps).", flag_values=_FLAGS)
flags.DEFINE_integer("num_ps", 0, "Parameter-server tasks of the requested "
                     "run's local cluster.", flag_values=_FLAGS)
flags.DEFINE_bool("pin_workers", False, "Pin each worker (and the baseline) "
                  "to a CPU core of its own, as taskset -c does.",
                  flag_values=_FLAGS)
flags.DEFINE_integer("repeats", 1, "Runs of the requested configuration and "
                     "the baseline, alternated; the table shows medians and "
                     "the range of interval throughputs.", flag_values=_FLAGS)
flags.DEFINE_bool("baseline", True, "Also run the single-device baseline.",
                  flag_values=_FLAGS)
flags.DEFINE_integer("steps", DEFAULT_STEPS, "Training steps of each run "
                     "unless the train flags give --train_steps.",
                     flag_values=_FLAGS)
flags.DEFINE_integer("log_steps", DEFAULT_LOG_STEPS, "Measurement interval "
                     "(steps) unless the train flags give --log_steps; the "
                     "first interval is warm-up, left out.",
                     flag_values=_FLAGS)
flags.DEFINE_float("timeout_seconds", 900, "Limit of each child run.",
                   flag_values=_FLAGS)
flags.DEFINE_string("output", "", "Also write the measurements and the "
                    "verdict to this JSON file.", flag_values=_FLAGS)
flags.DEFINE_bool("plan_only", False, "Check every planned run's flags, "
                  "print the plan (what the baseline drops), the model's "
                  "state per replica and whether its layout (ZeRO) is "
                  "needed, and measure nothing.", flag_values=_FLAGS)


def _check_own_flags(options):
  for name, low in (("num_workers", 1), ("num_ps", 0), ("repeats", 1),
                    ("steps", 2), ("log_steps", 1)):
    value = getattr(options, name)
    if value < low:
      raise app.UsageError(f"--{name}={value} must be >= {low}.")
  if options.timeout_seconds <= 0:
    raise app.UsageError(
        f"--timeout_seconds={options.timeout_seconds} must be > 0.")


def _exit(message: str, status: int):
  """Ends the binary with `message` on stderr and `status`
  (`tfdist.errors`' table)."""
  print(f"tfdist.diagnose: error: {message}", file=sys.stderr, flush=True)
  sys.exit(status)


def main(argv):
  if "--" in argv:
    split = argv.index("--")
    head, train_args = argv[:split], argv[split + 1:]
  else:
    head, train_args = argv, []
  if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in head):
    print(f"{__doc__}\nFlags:\n{_FLAGS.get_help()}")
    return
  try:
    rest = _FLAGS(head)
    _check_own_flags(_FLAGS)
  except (flags.Error, app.UsageError) as e:
    _exit(str(e), errors.CONFIG)
  if len(rest) > 1:
    _exit(f"unexpected arguments {rest[1:]}; put tfdist.train's flags after "
          "`--`.", errors.CONFIG)
  try:
    result = diagnose(train_args, num_workers=_FLAGS.num_workers,
                      num_ps=_FLAGS.num_ps, pin=_FLAGS.pin_workers,
                      repeats=_FLAGS.repeats, baseline=_FLAGS.baseline,
                      steps=_FLAGS.steps, log_steps=_FLAGS.log_steps,
                      timeout_seconds=_FLAGS.timeout_seconds,
                      plan_only=_FLAGS.plan_only)
  except (errors.ConfigError, errors.DiagnoseError) as e:
    # Flags or a plan refused: CONFIG (2), before anything ran; a run that
    # failed: 1.
    _exit(str(e), errors.exit_code_for(e) or errors.UNEXPECTED)
  if _FLAGS.output:
    with open(_FLAGS.output, "w") as f:
      json.dump(result, f, indent=2, sort_keys=True)


def run():
  app.run(main, argv=sys.argv, flags_parser=job_spec.parse_own_flags_later)


if __name__ == "__main__":
  run()
