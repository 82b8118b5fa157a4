"""Measure before distributing: a baseline, the requested run, a verdict.

Usage:
  python -m tfdist.diagnose -- --dataset=fashion_mnist \\
      --distribution_strategy=mirrored --num_cpu_devices=2
  python -m tfdist.diagnose --num_workers=2 --pin_workers -- \\
      --distribution_strategy=multi_worker_mirrored --dataset=fashion_mnist

Everything after `--` is `tfdist.train` flags (checked by tfdist.train's own
parser before anything runs). The diagnosis:

1. estimates, from the model alone, the bytes of its parameters, gradients
   and optimizer state (`tfdist.training.memory`), and whether every replica's
   copy fits the device's memory under data parallelism (which strategy fits if
   not);
2. runs the requested configuration and a single-device baseline
   (`one_device`, the same model, data and per-replica batch) as child
   processes of `tfdist.train` (through `tfdist.launch` for a local cluster,
   `--num_workers` / `--num_ps`), for `--train_steps` steps (default 60),
   each in its own `--model_dir` (a temporary folder unless `--model_dir` is
   given; then `<model_dir>/baseline` and `<model_dir>/requested`), in
   alternation `--repeats` times;
3. reads their manifests and `metrics.jsonl`, prints a table (examples/sec,
   step time, input-wait share, peak memory, speedup, scaling efficiency;
   medians over repeats, with the range) and a verdict with the numbers
   behind it (`verdict`): memory-bound, input-bound, communication-bound or
   compute-bound, with what to try.

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
from typing import List, Optional, Sequence

from absl import app
from absl import flags
from absl import logging

from tfdist import job_spec
from tfdist.distribute.strategy_kind import StrategyKind
from tfdist.errors import DiagnoseError
from tfdist.training import memory

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
# Flags the baseline sets itself (or drops): the strategy and its devices,
# the batch, the cluster, and where it writes.
_BASELINE_DROPS = ("distribution_strategy", "num_cpu_devices", "num_gpus",
                   "batch_size", "per_replica_batch_size", "all_reduce_alg",
                   "bytes_per_pack", "all_reduce_dtype",
                   "worker_hosts", "task_index", "reduction_server",
                   "model_dir", "checkpoint_dir", "tensorboard_dir",
                   "export_dir", "profile_steps", "sync_batch_norm")
# Boolean flags among them (`--name`, `--noname`: no separate value).
_BOOLEAN_DROPS = ("reduction_server", "sync_batch_norm")

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
_MIXED_PRECISION = {
    "GPU": "mixed precision (--dtype=bf16 on GPUs of compute capability >= "
           "8.0, fp16 on 7.x)",
    "TPU": "mixed precision (--dtype=bf16)",
    "CPU": "mixed precision (--dtype=bf16: this CPU has bf16 matrix "
           "instructions)",
}
MEMORY_ADVICE = (
    "{mixed}activation recomputation, a smaller per-replica batch with "
    "gradient accumulation, sharded optimizer state "
    "(--shard_optimizer_state: each replica keeps 1/N of it), or parameter "
    "servers "
    "(--distribution_strategy=parameter_server: variables and optimizer "
    "slots sharded over ps tasks)")


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
  """What to try on a compute-bound `run`, for the hardware it ran on."""
  kind = _kind(run.device_kind)
  parts = ["the devices are busy computing: " + _MORE_COMPUTE.get(
      kind, "add devices while efficiency holds")]
  mixed = _mixed_precision(run, cpu_bf16)
  if mixed:
    parts.append(mixed)
  if kind == "GPU":
    parts.append("XLA (--enable_xla)")
  return ", ".join(parts)


def communication_advice(run: "RunMeasurement") -> str:
  """What to try on a communication-bound `run` (NCCL and the Reduction
  Server only for GPUs)."""
  return COMMUNICATION_ADVICE.format(
      gpu=_COMMUNICATION_GPU if _kind(run.device_kind) == "GPU" else "")


def memory_advice(run: "RunMeasurement", *, cpu_bf16: bool = False) -> str:
  """What to try on a memory-bound `run`, for its hardware."""
  mixed = _mixed_precision(run, cpu_bf16)
  return MEMORY_ADVICE.format(
      mixed=f"{mixed[:-1]}: half-size activations), " if mixed else "")


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
    raise DiagnoseError(f"{label}: no {path}: the run did not finish.")
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
        "not what more devices would give. Measure on GPUs, TPUs "
        "or hosts (pinned workers: --pin_workers).")
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


def without_flags(args: Sequence[str], names: Sequence[str],
                  booleans: Sequence[str] = _BOOLEAN_DROPS) -> List[str]:
  """`args` without the flags `names`, in any of absl's spellings:
  `--name=value`, `--name value`, and for `booleans` `--name` and
  `--noname`."""
  out, skip_value = [], False
  for arg in args:
    if skip_value:
      skip_value = False
      continue
    name = _flag_name(arg)
    if name in booleans or (name and name.startswith("no") and
                            name[2:] in booleans):
      continue
    if name in names:
      skip_value = "=" not in arg
      continue
    out.append(arg)
  return out


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
  started = time.time()
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
  logging.info("%s: %s in %.0f s (log: %s)", spec.label,
               "finished" if code == 0 else f"exit {code}",
               time.time() - started, log_path)
  if code != 0:
    with open(log_path, errors="replace") as f:
      tail = f.read()[-3000:]
    what = (f"timed out after {timeout_seconds:g} s" if code is None else
            f"exited with status {code}")
    raise DiagnoseError(f"The {spec.label} run {what}; the end of its output "
                        f"({log_path}):\n{tail}")
  return measurement_from_run(model_dir, spec.label)


def baseline_args(train_args: Sequence[str], per_replica_batch_size: int
                  ) -> List[str]:
  """The single-device baseline's flags: the requested run's, without its
  strategy, devices, batch and cluster, on `one_device` (the first GPU when
  there is one, else the CPU) with the same per-replica batch."""
  return [*without_flags(train_args, _BASELINE_DROPS),
          f"--distribution_strategy={StrategyKind.ONE_DEVICE}",
          f"--per_replica_batch_size={per_replica_batch_size}"]


def model_memory_of(config) -> memory.ModelMemory:
  """Builds `config`'s model and optimizer on this host (no data, no
  strategy) and returns their `ModelMemory`.

  Raises:
    ConfigError: an unknown model or data set
      (`tfdist.training.task.from_names`).
  """
  # Imported here: they load TensorFlow and Keras, which this binary
  # imports quietly first (`tfdist.job_spec.parse_train_flags`, through
  # `tfdist.runtime.quiet_tensorflow`), and the parent process needs them only
  # now.
  import keras  # pylint: disable=g-import-not-at-top
  from tfdist.runtime import run_options  # pylint: disable=g-import-not-at-top
  from tfdist.training import assembly  # pylint: disable=g-import-not-at-top
  from tfdist.training import lr_schedule  # pylint: disable=g-import-not-at-top
  from tfdist.training import optimizers  # pylint: disable=g-import-not-at-top
  from tfdist.training import precision  # pylint: disable=g-import-not-at-top
  from tfdist.training import task as task_lib  # pylint: disable=g-import-not-at-top
  dtype = config.dtype if config.dtype != "auto" else "fp32"
  precision.configure_precision(dtype)
  try:
    model = assembly.build_model(run_options.assembly_options(config),
                                 task=run_options.task(config))
    optimizer = precision.wrap_optimizer_for_precision(
        # A schedule, as in every run (tfdist.training.lr_schedule): the
        # optimizer then keeps no learning-rate variable of its own.
        optimizers.build_optimizer(config.optimizer,
                                   lr_schedule.ConstantLearningRate(0.1),
                                   momentum=config.momentum,
                                   weight_decay=config.weight_decay),
        dtype=dtype, loss_scale=config.loss_scale)
    optimizer.build(model.trainable_variables)
    return memory.estimate_model_memory(model, optimizer)
  finally:
    keras.mixed_precision.set_dtype_policy("float32")


def device_memory_capacity() -> Optional[int]:
  """One GPU's memory (the smallest), or None without GPUs."""
  sizes = memory.gpu_memory_capacity_bytes()
  return min(sizes) if sizes else None


def diagnose(train_args: Sequence[str], *, num_workers: int = 1,
             num_ps: int = 0, pin: bool = False, repeats: int = 1,
             baseline: bool = True, steps: int = DEFAULT_STEPS,
             log_steps: int = DEFAULT_LOG_STEPS,
             model_dir: Optional[str] = None,
             timeout_seconds: float = 900, out=None) -> dict:
  """Runs the diagnosis of `train_args` (see the module docstring).

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
    out: where the report goes (default stdout).

  Returns:
    `{"requested", "baseline", "runs", "model_memory", "model_fit",
    "verdict"}` (JSON-ready).

  Raises:
    tfdist.job_spec.JobSpecError: `train_args` are not valid tfdist.train
      flags.
    DiagnoseError: a run failed.
  """
  out = out or sys.stdout
  given = {_flag_name(a) for a in train_args}
  args = _measured_args(train_args, given, steps=steps, log_steps=log_steps)
  root = model_dir or _model_dir_flag(train_args)
  # tfdist.train's own parser checks the flags before anything runs.
  config = job_spec.parse_train_flags(
      [*args, f"--model_dir={root or '/tmp/tfdist-diagnose'}"],
      where="tfdist.diagnose", environ=dict(os.environ))
  facts = _train_facts(config)
  keep = root is not None
  root = root or tempfile.mkdtemp(prefix="tfdist-diagnose-")
  cores = len(os.sched_getaffinity(0))
  estimate = model_memory_of(config)
  gpu_bytes = device_memory_capacity()
  host_bytes = memory.host_memory_bytes()
  try:
    requested_runs, baseline_runs = _run_alternately(
        RunSpec("requested", tuple(args), num_workers=num_workers,
                num_ps=num_ps, pin=pin),
        root, repeats=repeats, baseline=baseline,
        timeout_seconds=timeout_seconds)
    requested = median_measurement(requested_runs)
    base = median_measurement(baseline_runs) if baseline_runs else None
    fitted = _fit_model(estimate, requested, facts, gpu_bytes=gpu_bytes,
                        host_bytes=host_bytes)
    result = verdict(requested, base, model_fit=fitted.fit,
                     device_memory_bytes=gpu_bytes,
                     host_memory_bytes=host_bytes, cores=cores, pinned=pin,
                     cpu_bf16=cpu_has_bf16())
    rows = [r for r in (base, requested) if r is not None]
    runs_line = _runs_line(
        steps=steps if "train_steps" not in given else facts.train_steps,
        repeats=repeats, cores=cores, pin=pin, rows=rows,
        log_steps=facts.log_steps)
    report = [render_table(rows, base), "", _model_state_line(fitted, facts),
              runs_line + _runs_folder_note(root, keep), "", result.render()]
    print("\n".join(report), file=out, flush=True)
    return {**_run_records(requested, base, requested_runs + baseline_runs,
                           keep=keep),
            "model_memory": fitted.estimate.to_dict(),
            "model_fit": dataclasses.asdict(fitted.fit), "cores": cores,
            "pinned": pin, "verdict": result.to_dict()}
  except DiagnoseError:
    # The failed run's log, which the message names, stays.
    keep = True
    raise
  finally:
    if not keep:
      shutil.rmtree(root, ignore_errors=True)


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
  """
  optimizer: str
  zero_stage: int
  train_steps: int
  log_steps: int


def _train_facts(config) -> TrainFacts:
  """The `TrainFacts` of a parsed `tfdist.config.TrainConfig`."""
  return TrainFacts(optimizer=config.optimizer,
                    zero_stage=config.zero_stage_resolved,
                    train_steps=config.train_steps,
                    log_steps=config.log_steps)


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


def _run_alternately(requested_spec: RunSpec, root: str, *, repeats: int,
                     baseline: bool, timeout_seconds: float):
  """Runs the requested configuration and (with `baseline`) the baseline,
  alternated, `repeats` times each, into folders under `root`.

  Returns:
    `(requested_runs, baseline_runs)`: lists of `RunMeasurement`
    (`baseline_runs` empty without `baseline`).

  Raises:
    DiagnoseError: a run failed.
  """
  requested_runs, baseline_runs = [], []
  for i in range(repeats):
    suffix = f"-{i}" if repeats > 1 else ""
    requested_runs.append(run_training(
        requested_spec, os.path.join(root, f"requested{suffix}"),
        timeout_seconds=timeout_seconds))
    if baseline:
      base_spec = RunSpec(
          "baseline", tuple(baseline_args(
              requested_spec.train_args,
              requested_runs[0].per_replica_batch_size)),
          pin=requested_spec.pin)
      baseline_runs.append(run_training(
          base_spec, os.path.join(root, f"baseline{suffix}"),
          timeout_seconds=timeout_seconds))
  return requested_runs, baseline_runs


@dataclasses.dataclass(frozen=True)
class _FittedModel:
  """The model state per replica and whether it fits where it runs.

  Attributes:
    estimate: the `memory.ModelMemory` per replica (ZeRO-sharded).
    fit: `memory.fits_data_parallel`'s `Fit`.
    sharing: replicas whose copies share one memory.
    where: `GPU` or `host`: the memory they share.
  """
  estimate: memory.ModelMemory
  fit: memory.Fit
  sharing: int
  where: str


def _fit_model(estimate: memory.ModelMemory, requested: RunMeasurement,
               facts: TrainFacts, *, gpu_bytes: Optional[int],
               host_bytes: Optional[int]) -> _FittedModel:
  """Whether the requested run's replicas' model state fits their memory
  (bytes: one GPU's, or the host's)."""
  # Replicas whose copies share one memory: a GPU holds one; CPU
  # replicas (logical devices, or the workers of a local cluster) each
  # hold a copy in this host's memory.
  on_gpu = bool(requested.device_kind == "GPU" and gpu_bytes)
  sharing = 1 if on_gpu else requested.num_replicas
  fit = memory.fits_data_parallel(
      estimate, capacity_bytes=gpu_bytes if on_gpu else host_bytes,
      replicas_sharing=sharing, optimizer=facts.optimizer,
      num_replicas=requested.num_replicas, zero_stage=facts.zero_stage)
  estimate = memory.sharded_estimate(
      estimate, num_replicas=requested.num_replicas, stage=facts.zero_stage)
  return _FittedModel(estimate, fit, sharing, "GPU" if on_gpu else "host")


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


def _check_own_flags(options):
  for name, low in (("num_workers", 1), ("num_ps", 0), ("repeats", 1),
                    ("steps", 2), ("log_steps", 1)):
    value = getattr(options, name)
    if value < low:
      raise app.UsageError(f"--{name}={value} must be >= {low}.")
  if options.timeout_seconds <= 0:
    raise app.UsageError(
        f"--timeout_seconds={options.timeout_seconds} must be > 0.")


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
    sys.exit(f"tfdist.diagnose: error: {e}")
  if len(rest) > 1:
    sys.exit(f"tfdist.diagnose: error: unexpected arguments {rest[1:]}; put "
             "tfdist.train's flags after `--`.")
  try:
    result = diagnose(train_args, num_workers=_FLAGS.num_workers,
                      num_ps=_FLAGS.num_ps, pin=_FLAGS.pin_workers,
                      repeats=_FLAGS.repeats, baseline=_FLAGS.baseline,
                      steps=_FLAGS.steps, log_steps=_FLAGS.log_steps,
                      timeout_seconds=_FLAGS.timeout_seconds)
  except (job_spec.JobSpecError, DiagnoseError) as e:
    sys.exit(f"tfdist.diagnose: error: {e}")
  if _FLAGS.output:
    with open(_FLAGS.output, "w") as f:
      json.dump(result, f, indent=2, sort_keys=True)


def run():
  app.run(main, argv=sys.argv, flags_parser=job_spec.parse_own_flags_later)


if __name__ == "__main__":
  run()
