"""The verdict: the binding constraint of a run, from its measurements.
"""

import dataclasses
from typing import List, Optional

from tfdist.diagnose.advice import INPUT_ADVICE
from tfdist.diagnose.advice import communication_advice
from tfdist.diagnose.advice import compute_advice
from tfdist.diagnose.advice import memory_advice
from tfdist.diagnose.measure import RunMeasurement
from tfdist.diagnose.measure import device_family
from tfdist.training.plan import memory


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
    model_fit: `tfdist.training.plan.memory.fits_data_parallel` of the model, or
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
    elif (device_family(run.device_kind) == "CPU" and host_memory_bytes and
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
