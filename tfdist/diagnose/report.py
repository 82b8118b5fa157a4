"""The report's table and lines.
"""

from typing import Optional, Sequence

from tfdist.diagnose.layouts import FittedModel
from tfdist.diagnose.layouts import TrainFacts
from tfdist.diagnose.measure import RunMeasurement
from tfdist.diagnose.plan import MeasurementPlan
from tfdist.diagnose.verdicts import scaling
from tfdist.training.plan import memory


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


def runs_folder_note(root: str, keep: bool) -> str:
  """Where the runs' logs and manifests are; a temporary folder, deleted at
  the end, is not named."""
  if keep:
    return f"Logs and manifests: {root}."
  return ("Logs and manifests were not kept (give --model_dir=DIR among the "
          "train flags to keep them).")


def say(out, text: str) -> None:
  print(text, file=out, flush=True)


def plan_record(plan: MeasurementPlan) -> dict:
  """The plan, JSON-ready."""
  return {"strategy": str(plan.strategy), "num_replicas": plan.num_replicas,
          "per_replica_batch_size": plan.per_replica_batch_size,
          "requested_args": list(plan.requested.train_args),
          "baseline_args": (list(plan.baseline.train_args)
                            if plan.baseline else None),
          "baseline_dropped": list(plan.dropped)}


def run_records(requested: RunMeasurement,
                base: Optional[RunMeasurement],
                runs: Sequence[RunMeasurement], *, keep: bool) -> dict:
  """`{"requested", "baseline", "runs"}` of the result, JSON-ready; a
  run's folder is named only when it is kept."""

  def record(run):
    return {**run.to_dict(), "model_dir": run.model_dir if keep else None}

  return {"requested": record(requested),
          "baseline": record(base) if base else None,
          "runs": [record(r) for r in runs]}


def model_state_line(fitted: FittedModel, facts: TrainFacts) -> str:
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


def runs_line(*, steps: int, repeats: int, cores: int, pin: bool,
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
