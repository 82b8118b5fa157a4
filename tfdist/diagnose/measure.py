"""What one training run measured: read from its manifest and
`metrics.jsonl`, and the median of repeats.
"""

import dataclasses
import os
import statistics
from typing import List, Optional, Sequence

from tfdist import errors
from tfdist.core.strategy_kind import StrategyKind


def device_family(device_kind: str) -> str:
  return "CPU" if device_kind in ("CPU", "logical CPU") else device_kind


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
    model_memory: `tfdist.training.plan.memory.ModelMemory.to_dict()`, or None.
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


def backend_of(kind: StrategyKind):
  """The backend registered for `kind`
  (`tfdist.backends.registry.backend_for`): the diagnosis asks it for the
  strategy's traits (`on_tpu`, `asynchronous`) and counts
  (`planned_replicas`, `training_workers`, `num_input_pipelines`) rather
  than restating them.

  Raises:
    ValueError: no backend is registered for `kind`.
  """
  # Imported here: it loads TensorFlow, which this binary imports quietly
  # first (`tfdist.job_spec.parse_train_flags`).
  from tfdist.backends import registry  # pylint: disable=g-import-not-at-top
  return registry.backend_for(kind)


def _run_backend(manifest: dict):
  """The backend of the manifest's strategy; None if it names none."""
  kind = _strategy_kind(manifest)
  try:
    return backend_of(kind) if kind else None
  except ValueError:  # A strategy name with no backend (not a run's).
    return None


def _device_kind(manifest: dict) -> str:
  devices = [str(d).upper() for d in manifest.get("replica_devices", [])]
  backend = _run_backend(manifest)
  if (backend and backend.on_tpu) or any("TPU" in d for d in devices):
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
  backend = _run_backend(manifest)
  if backend and backend.asynchronous:  # A speedup is over workers.
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
