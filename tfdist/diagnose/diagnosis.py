"""`diagnose`: the plan, the runs, the table and the verdict, in order.
"""

import dataclasses
import os
import shutil
import sys
import tempfile
import time
from typing import Optional, Sequence

from tfdist import errors
from tfdist import job_spec
from tfdist.diagnose.advice import cpu_has_bf16
from tfdist.diagnose.child_runs import baseline_args
from tfdist.diagnose.child_runs import DEFAULT_LOG_STEPS
from tfdist.diagnose.child_runs import DEFAULT_STEPS
from tfdist.diagnose.child_runs import flag_name
from tfdist.diagnose.child_runs import measured_args
from tfdist.diagnose.child_runs import model_dir_flag
from tfdist.diagnose.child_runs import run_training
from tfdist.diagnose.child_runs import RunSpec
from tfdist.diagnose.child_runs import steps_done
from tfdist.diagnose.child_runs import train_steps_of
from tfdist.diagnose.layouts import FittedModel
from tfdist.diagnose.layouts import ModelSizes
from tfdist.diagnose.layouts import TrainFacts
from tfdist.diagnose.layouts import device_memory_capacity
from tfdist.diagnose.layouts import fit_model
from tfdist.diagnose.layouts import layout_choice
from tfdist.diagnose.layouts import model_sizes_of
from tfdist.diagnose.layouts import run_layout_notes
from tfdist.diagnose.layouts import tensor_split_note
from tfdist.diagnose.layouts import train_facts
from tfdist.diagnose.measure import median_measurement
from tfdist.diagnose.measure import RunMeasurement
from tfdist.diagnose.plan import MeasurementPlan
from tfdist.diagnose.plan import plan_measurements
from tfdist.diagnose.report import model_state_line
from tfdist.diagnose.report import plan_record
from tfdist.diagnose.report import render_table
from tfdist.diagnose.report import run_records
from tfdist.diagnose.report import runs_folder_note
from tfdist.diagnose.report import runs_line
from tfdist.diagnose.report import say
from tfdist.training.plan import mesh_plan
from tfdist.diagnose.verdicts import verdict
from tfdist.training.plan import memory


def diagnose(train_args: Sequence[str], *, num_workers: int = 1,
             num_ps: int = 0, pin: bool = False, repeats: int = 1,
             baseline: bool = True, steps: int = DEFAULT_STEPS,
             log_steps: int = DEFAULT_LOG_STEPS,
             model_dir: Optional[str] = None,
             timeout_seconds: float = 900, plan_only: bool = False,
             out=None, progress_seconds: float = 10.0) -> dict:
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
    progress_seconds: seconds between the progress lines of a measuring
      run (steps done of its total, time left).

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
  given = {flag_name(a) for a in train_args}
  args = measured_args(train_args, given, steps=steps, log_steps=log_steps)
  root = model_dir or model_dir_flag(train_args)
  # tfdist.train's own parser checks the flags before anything runs.
  config = job_spec.parse_train_flags(
      [*args, f"--model_dir={root or '/tmp/tfdist-diagnose'}"],
      where="the requested run", environ=dict(os.environ))
  plan = plan_measurements(args, config, num_workers=num_workers,
                           num_ps=num_ps, pin=pin, baseline=baseline)
  say(out, plan.describe(repeats=repeats))
  model = _Model.of(config, tensor_degree=plan.num_replicas or 2)
  if plan_only:
    return _report_plan(plan, model, out=out)
  keep = root is not None
  root = root or tempfile.mkdtemp(prefix="tfdist-diagnose-")
  try:
    requested_runs, baseline_runs = run_alternately(
        plan, root, repeats=repeats, timeout_seconds=timeout_seconds,
        out=out, progress_seconds=progress_seconds)
    return _report_runs(
        plan, model, requested_runs, baseline_runs, root=root, keep=keep,
        steps=(steps if "train_steps" not in given else
               model.facts.train_steps), repeats=repeats, pin=pin, out=out)
  except errors.DiagnoseError:
    # The failed run's log, which the message names, stays.
    keep = True
    raise
  finally:
    if not keep:
      shutil.rmtree(root, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class _Model:
  """What the report needs of the requested run's model and this host.

  Attributes:
    facts: the run's `TrainFacts`.
    sizes: the model's `ModelSizes` (one build on this host).
    gpu_bytes: one GPU's memory, or None without GPUs.
    host_bytes: this host's memory.
    cores: CPU cores this process may use.
  """
  facts: TrainFacts
  sizes: ModelSizes
  gpu_bytes: Optional[int]
  host_bytes: Optional[int]
  cores: int

  @classmethod
  def of(cls, config, *, tensor_degree: int = 2) -> "_Model":
    """The model built once, its tensor split over `tensor_degree`
    devices (at least 2)."""
    return cls(train_facts(config),
               model_sizes_of(config, tensor_degree=tensor_degree),
               device_memory_capacity(), memory.host_memory_bytes(),
               len(os.sched_getaffinity(0)))

  def fit(self, *, on_gpu: bool, num_replicas: int) -> FittedModel:
    """`fit_model` for `num_replicas` replicas (on GPUs or the host)."""
    return fit_model(self.sizes.estimate, self.facts, on_gpu=on_gpu,
                     num_replicas=num_replicas, gpu_bytes=self.gpu_bytes,
                     host_bytes=self.host_bytes)


def _report_plan(plan: MeasurementPlan, model: _Model, *, out) -> dict:
  """`--plan_only`: the model's state, the layout notes and every layout
  for the planned run, to `out`; returns the plan's record."""
  facts = model.facts
  fitted = model.fit(on_gpu=plan.on_gpu, num_replicas=plan.num_replicas or 1)
  layout = run_layout_notes(model.sizes.estimate, fitted, facts)
  choice = layout_choice(model.sizes, fitted, facts, plan)
  meshes = mesh_plan.mesh_layouts(choice.facts)
  say(out, "\n".join([model_state_line(fitted, facts), *layout,
                      "", "Layouts (per device, state and activations):",
                      choice.render(), tensor_split_note(model.sizes, facts),
                      *_mesh_lines(choice, meshes),
                      "Nothing measured (--plan_only)."]))
  return {"plan": plan_record(plan), "model_memory":
          fitted.estimate.to_dict(),
          "model_fit": dataclasses.asdict(fitted.fit), "layout": layout,
          "layouts": choice.to_dict(), "meshes": _mesh_record(meshes),
          "tensor_split": _split_record(model)}


def _mesh_lines(choice, meshes) -> list:
  """The meshes' table (`tfdist.training.plan.mesh_plan`) under its heading,
  when the devices allow more than one mesh."""
  if choice.facts.num_devices < 2:
    return []
  return ["", f"Meshes of {choice.facts.num_devices} devices (data x "
          "pipeline x tensor, ZeRO within each data group; per device):",
          mesh_plan.render(meshes, choice.capacity_bytes)]


def _mesh_record(meshes) -> dict:
  best = mesh_plan.recommended(meshes)
  return {"rows": [m.to_dict() for m in meshes],
          "recommended": best.name if best else None,
          "recommended_flags": best.memory.flags if best else None}


def _split_record(model: _Model) -> Optional[dict]:
  split = model.sizes.tensor_split
  return split.to_dict() if split else None


def _report_runs(plan: MeasurementPlan, model: _Model,
                 requested_runs: Sequence[RunMeasurement],
                 baseline_runs: Sequence[RunMeasurement], *, root: str,
                 keep: bool, steps: int, repeats: int, pin: bool,
                 out) -> dict:
  """The table, the model's state, the layouts and the verdict of the
  measured runs, to `out`; returns the diagnosis' record."""
  facts = model.facts
  requested = median_measurement(requested_runs)
  base = median_measurement(baseline_runs) if baseline_runs else None
  fitted = model.fit(on_gpu=requested.device_kind == "GPU",
                     num_replicas=requested.num_replicas)
  result = verdict(requested, base, model_fit=fitted.fit,
                   device_memory_bytes=model.gpu_bytes,
                   host_memory_bytes=model.host_bytes, cores=model.cores,
                   pinned=pin, cpu_bf16=cpu_has_bf16())
  result.notes.extend(run_layout_notes(model.sizes.estimate, fitted, facts))
  choice = layout_choice(model.sizes, fitted, facts, plan)
  meshes = mesh_plan.mesh_layouts(choice.facts)
  rows = [r for r in (base, requested) if r is not None]
  how = runs_line(steps=steps, repeats=repeats, cores=model.cores, pin=pin,
                  rows=rows, log_steps=facts.log_steps)
  report = ["", render_table(rows, base), "",
            model_state_line(fitted, facts),
            how + runs_folder_note(root, keep), "",
            "Layouts (per device, state and activations):",
            choice.render(), tensor_split_note(model.sizes, facts),
            *_mesh_lines(choice, meshes), "", result.render()]
  say(out, "\n".join(report))
  return {**run_records(requested, base,
                        [*requested_runs, *baseline_runs], keep=keep),
          "model_memory": fitted.estimate.to_dict(),
          "model_fit": dataclasses.asdict(fitted.fit), "cores": model.cores,
          "pinned": pin, "verdict": result.to_dict(),
          "plan": plan_record(plan), "layouts": choice.to_dict(),
          "meshes": _mesh_record(meshes),
          "tensor_split": _split_record(model)}


def run_alternately(plan: MeasurementPlan, root: str, *, repeats: int,
                    timeout_seconds: float, out=None,
                    progress_seconds: float = 10.0):
  """Runs the plan's requested configuration and its baseline (if any),
  alternated, `repeats` times each, into folders under `root`, with a
  line to `out` as each run starts and ends and every `progress_seconds`
  while it runs.

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
        timeout_seconds=timeout_seconds, out=out,
        progress_seconds=progress_seconds))
    if plan.baseline:
      # The requested run's measured per-replica batch (planned the same).
      base_spec = dataclasses.replace(plan.baseline, train_args=tuple(
          baseline_args(plan.requested.train_args,
                        requested_runs[0].per_replica_batch_size)))
      baseline_runs.append(_run_with_progress(
          base_spec, os.path.join(root, f"baseline{suffix}"),
          number=len(requested_runs) + len(baseline_runs) + 1, total=total,
          timeout_seconds=timeout_seconds, out=out,
        progress_seconds=progress_seconds))
  return requested_runs, baseline_runs


def _run_with_progress(spec: RunSpec, model_dir: str, *, number: int,
                       total: int, timeout_seconds: float, out=None,
                       progress_seconds: float = 10.0) -> RunMeasurement:
  """`run_training`, with a line to `out` when it starts, every
  `progress_seconds` while
  it runs (`_Progress`: steps done of its total, time left) and when it
  ends (elapsed seconds; a failure's status and last error line)."""
  out = out or sys.stdout
  what = ("tfdist.launch, " f"{spec.num_workers} worker(s)"
          + (f", {spec.num_ps} ps" if spec.num_ps else "")
          if spec.num_workers > 1 or spec.num_ps else "tfdist.train")
  prefix = f"[{number}/{total}] {spec.label} run:"
  say(out, f"{prefix} started ({what}).")
  started = time.monotonic()
  progress = _Progress(prefix, model_dir, train_steps_of(spec.train_args),
                       out=out)
  try:
    run = run_training(spec, model_dir, timeout_seconds=timeout_seconds,
                       progress=progress,
                       progress_seconds=progress_seconds)
  except errors.DiagnoseError as e:
    status = getattr(e, "exit_code", None)
    say(out, f"{prefix} failed after {time.monotonic() - started:.0f} s" +
        (f" (status {status}): {e.last_error}" if status else "."))
    raise
  eps = (f", {run.examples_per_second:.1f} examples/sec"
         if run.examples_per_second else "")
  say(out, f"{prefix} finished in {time.monotonic() - started:.0f} s{eps}.")
  return run


class _Progress:
  """Called while a run measures: one line to `out` of the steps its
  `metrics.jsonl` records so far, of `total`, and the time left at the
  rate since the first recorded step."""

  def __init__(self, prefix: str, model_dir: str, total: Optional[int], *,
               out):
    self._prefix, self._model_dir, self._total = prefix, model_dir, total
    self._out, self._started = out, time.monotonic()
    self._first = None  # (time, step) of the first step seen.

  def __call__(self):
    now = time.monotonic()
    elapsed = now - self._started
    step = steps_done(self._model_dir)
    if step is None:
      say(self._out, f"{self._prefix} {elapsed:.0f} s, starting (building "
                     "the model and input; no step logged yet).")
      return
    if self._first is None:
      self._first = (now, step)
    of = f"/{self._total}" if self._total else ""
    left = ""
    seen_time, seen_step = self._first
    if self._total and step > seen_step and now > seen_time:
      rate = (step - seen_step) / (now - seen_time)
      left = f", about {max(0, self._total - step) / rate:.0f} s left"
    say(self._out, f"{self._prefix} step {step}{of} after {elapsed:.0f} s"
                   f"{left or ', time left after the next log point'}.")
