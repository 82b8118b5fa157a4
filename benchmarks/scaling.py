"""Scaling figures: throughput and efficiency against workers, and precision.

Not a test: it prints a table, writes JSON and renders a PNG. Every run is a
`tfdist.train` child started by `tfdist.diagnose.run_training` (the one
implementation), on the same model (`--model`, the CNN by default) and data
(Fashion-MNIST), 128 examples per worker and step:

* `one_device`: one process pinned to one core (the baseline);
* `multi_worker_mirrored` with 1 and 2 workers on 127.0.0.1
  (`tfdist.launch --pin_workers`: each worker pinned to a core of its own);
* `parameter_server` with 1 and 2 workers and 1 ps task, each worker
  pinned to a core of its own (`tfdist.launch --pin_workers`); the chief
  (the coordinator) and the ps task share the cores left over, or, with
  none left (2 workers on 2 cores), every core, so on a machine with no
  more cores than workers the 2-worker figure pays for them out of the
  workers' cores (see the README's Parameter servers);
* `one_device_x2`: two `one_device` processes at once, each pinned to a
  core of its own, sharing nothing (their examples/sec summed): what the
  machine gives two workers that never communicate, the ceiling of any
  2-worker figure here;
* `mwms_2_bf16_reduce`: `mwms_2` with `--all_reduce_dtype=bfloat16` (the
  gradients travel in 2 bytes a value; compare with `mwms_2`, alternated);
* precision: `one_device` pinned with `--dtype=fp32`, `bf16` and `fp16`,
  all with TensorFlow's oneDNN ops off (`TF_ENABLE_ONEDNN_OPTS=0`: oneDNN's
  fp16 kernels are catastrophically slow on CPUs, see the shared notes).

Other jobs may share the machine, so the configurations run in alternation,
`--repeats` times; the table gives the median and the range (min-max) of
each configuration's runs, and speedups are ratios of medians.

Every child applies tfdist's glibc malloc settings in-process
(`tfdist.runtime.allocator`, on unless `--extra_train_flags=--notune_allocator`);
each configuration records whether its runs had them (`malloc_tuning`).
`--malloc_env` sets the environment variables the figures in
`benchmarks/results/` were measured with, before `tfdist.runtime.allocator` existed.

Usage:
  python benchmarks/scaling.py --repeats=3 --steps=100 \\
      --output=benchmarks/results/scaling.json \\
      --plot=benchmarks/results/scaling.png
"""

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from benchmarks import machine as machine_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdist import errors
from tfdist import diagnose  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_integer("repeats", 3, "Alternated rounds over every "
                     "configuration.")
flags.DEFINE_integer("steps", 100, "Training steps per run.")
flags.DEFINE_integer("log_steps", 20, "Throughput interval; the first is "
                     "warm-up, left out.")
flags.DEFINE_integer("per_worker_batch_size", 128, "Examples per worker and "
                     "step.")
flags.DEFINE_string("model", "cnn", "Model to train.")
flags.DEFINE_string("data_dir", "", "Where Fashion-MNIST TFRecords live "
                    "(default: tfdist's).")
CONFIGS = ["one_device", "one_device_x2", "mwms_1", "mwms_2", "mwms_2_no_timeout",
           "mwms_2_packs", "mwms_2_nosync_bn", "mwms_2_neither",
           "mwms_2_bf16_reduce", "ps_1", "ps_2", "fp32", "bf16", "fp16"]
flags.DEFINE_list("configs", CONFIGS,
                  "Configurations to run (see the module docstring).")
flags.DEFINE_integer("bytes_per_pack", 256 << 10, "--bytes_per_pack of the "
                     "mwms_2_packs configuration (gradients all-reduced in "
                     "packs while the backward pass runs).")
flags.DEFINE_list("extra_train_flags", [], "More tfdist.train flags for "
                  "every run, e.g. --extra_train_flags=--nosync_batch_norm.")
flags.DEFINE_bool("malloc_env", False, "Also set MALLOC_MMAP_THRESHOLD_ "
                  "and MALLOC_TOP_PAD_ to 512 MiB in the children (how the "
                  "recorded figures were measured, before tfdist.runtime.allocator "
                  "set malloc in-process).")
flags.DEFINE_float("timeout_seconds", 1200, "Limit of each run.")
flags.DEFINE_string("output", "", "JSON results file.")
flags.DEFINE_string("plot", "", "PNG of throughput and efficiency against "
                    "workers.")
flags.DEFINE_string("from_json", "", "Render --plot and the tables from this"
                    " results file (written by --output) without running.")

ONEDNN_OFF = (("TF_ENABLE_ONEDNN_OPTS", "0"),)
MALLOC = (("MALLOC_MMAP_THRESHOLD_", "536870912"),
          ("MALLOC_TOP_PAD_", "536870912"))


def specs(per_worker: int, extra) -> dict:
  """`{name: (RunSpec, workers, group)}` of every configuration."""
  env = MALLOC if FLAGS.malloc_env else ()
  common = [f"--model={FLAGS.model}", "--dataset=fashion_mnist",
            f"--train_steps={FLAGS.steps}", f"--log_steps={FLAGS.log_steps}",
            "--epochs_between_evals=1000", *extra]
  if FLAGS.data_dir:
    common.append(f"--data_dir={FLAGS.data_dir}")
  one = [*common, "--distribution_strategy=one_device",
         f"--batch_size={per_worker}"]

  def mwms(n, *more):
    return diagnose.RunSpec(
        f"mwms_{n}", tuple([*common, "--distribution_strategy="
                            "multi_worker_mirrored",
                            f"--batch_size={per_worker * n}", *more]),
        num_workers=n, pin=True, env=env)

  def ps(n):
    # Every worker takes whole global batches of `per_worker` examples.
    return diagnose.RunSpec(
        f"ps_{n}", tuple([*common, "--distribution_strategy=parameter_server",
                          f"--batch_size={per_worker}"]),
        num_workers=n, num_ps=1, pin=True, env=env)

  def dtype(name):
    return diagnose.RunSpec(name, tuple([*one, f"--dtype={name}"]), pin=True,
                            env=env + ONEDNN_OFF)

  return {
      "one_device": (diagnose.RunSpec("one_device", tuple(one), pin=True,
                                      env=env), 1, "baseline"),
      # Two copies of one_device at once, each on its own core (run by
      # `run_independent`, not by tfdist.launch).
      "one_device_x2": (diagnose.RunSpec("one_device_x2", tuple(one),
                                         pin=True, env=env), 2, "ceiling"),
      "mwms_1": (mwms(1), 1, "multi_worker_mirrored"),
      "mwms_2": (mwms(2), 2, "multi_worker_mirrored"),
      # What each collective costs (see the README): no per-collective
      # timeout (no sleeping thread per collective), per-replica batch
      # norm (no batch-norm all-reduces), both.
      "mwms_2_no_timeout": (mwms(2, "--collective_timeout_seconds=0"), 2,
                            "variant"),
      # Gradients all-reduced in packs, last layers first, overlapping the
      # backward pass.
      "mwms_2_packs": (mwms(2, f"--bytes_per_pack={FLAGS.bytes_per_pack}"),
                       2, "variant"),
      "mwms_2_nosync_bn": (mwms(2, "--nosync_batch_norm"), 2, "variant"),
      # Gradients all-reduced in bfloat16 (half the bytes), the step's
      # sums in a float32 all-reduce of their own.
      "mwms_2_bf16_reduce": (mwms(2, "--all_reduce_dtype=bfloat16"), 2,
                             "variant"),
      "mwms_2_neither": (mwms(2, "--collective_timeout_seconds=0",
                              "--nosync_batch_norm"), 2, "variant"),
      "ps_1": (ps(1), 1, "parameter_server"),
      "ps_2": (ps(2), 2, "parameter_server"),
      "fp32": (dtype("fp32"), 1, "precision"),
      "bf16": (dtype("bf16"), 1, "precision"),
      "fp16": (dtype("fp16"), 1, "precision"),
  }


def run_independent(spec, copies: int, model_dir: str, timeout_seconds: float
                    ) -> diagnose.RunMeasurement:
  """Runs `copies` of the single-process `spec` at once, copy i pinned to
  core i (before it imports TensorFlow); returns copy 0's measurement with
  `examples_per_second` summed over the copies (step and CPU times: copy
  0's).

  Raises:
    app.UsageError: fewer cores than copies.
    tfdist.errors.DiagnoseError: a copy failed or timed out.
  """
  cores = sorted(os.sched_getaffinity(0))
  if len(cores) < copies:
    raise app.UsageError(f"{spec.label} needs {copies} cores; this process "
                         f"may use {len(cores)}")
  env = {**os.environ, **dict(spec.env),
         "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
  procs = []
  for i in range(copies):
    path = f"{model_dir}-{i}"
    log = open(path + ".log", "wb")  # pylint: disable=consider-using-with
    proc = subprocess.Popen(diagnose.command_for(spec, path), cwd=REPO,
                            env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    os.sched_setaffinity(proc.pid, {cores[i]})
    procs.append((proc, log, path))
  deadline = time.time() + timeout_seconds
  failed = []
  for proc, log, path in procs:
    try:
      code = proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, 9)
      proc.wait()
      code = "timeout"
    log.close()
    if code != 0:
      failed.append(f"{path}.log ({code})")
  if failed:
    raise errors.DiagnoseError(f"{spec.label}: copies failed: {failed}")
  measured = [diagnose.measurement_from_run(path, spec.label)
              for _, _, path in procs]
  return dataclasses.replace(measured[0], examples_per_second=sum(
      m.examples_per_second for m in measured))


def summarize(runs) -> dict:
  eps = [r.examples_per_second for r in runs if r.examples_per_second]
  steps = [r.step_time_seconds for r in runs if r.step_time_seconds]
  cpu = [r.cpu_seconds_per_step for r in runs if r.cpu_seconds_per_step]
  waits = [r.input_wait_fraction for r in runs
           if r.input_wait_fraction is not None]
  return {"examples_per_second": statistics.median(eps) if eps else None,
          "min": min(eps) if eps else None, "max": max(eps) if eps else None,
          "step_time_seconds": statistics.median(steps) if steps else None,
          "input_wait_fraction": statistics.median(waits) if waits else None,
          "cpu_seconds_per_step": statistics.median(cpu) if cpu else None,
          "peak_rss_bytes": max((r.peak_rss_bytes or 0) for r in runs),
          # tfdist.runtime.allocator's settings, from the manifests (None: unknown).
          "malloc_tuning": (runs[0].malloc_tuning if len(
              {r.malloc_tuning for r in runs}) == 1 else None),
          "runs": [r.examples_per_second for r in runs]}


def markdown_table(record: dict) -> str:
  """The results as the README's Markdown table."""
  lines = ["| configuration | workers | examples/sec (median) | range "
           "| step ms | CPU ms/step (chief) | input wait | speedup "
           "| efficiency |",
           "|---|---|---|---|---|---|---|---|---|"]
  order = {name: i for i, name in enumerate(CONFIGS)}
  for name, r in sorted(record["results"].items(),
                        key=lambda kv: order.get(kv[0], len(order))):
    eps = r["examples_per_second"]
    lines.append(
        f"| `{name}` | {r['workers']} | {eps:.0f} | {r['min']:.0f}-"
        f"{r['max']:.0f} | {r['step_time_seconds'] * 1000:.0f} | "
        + (f"{r['cpu_seconds_per_step'] * 1000:.0f}"
           if r.get("cpu_seconds_per_step") else "-") + " | "
        + (f"{r['input_wait_fraction']:.1%}"
           if r.get("input_wait_fraction") is not None else "-") + " | "
        + (f"{r['speedup']:.2f}x" if r.get("speedup") else "-") + " | "
        + (f"{r['scaling_efficiency']:.0%}"
           if r.get("scaling_efficiency") else "-") + " |")
  return "\n".join(lines)


def machine() -> dict:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return {"cpu": machine_lib.cpu_model(),
          "cores": len(os.sched_getaffinity(0)),
          "memory_bytes": os.sysconf("SC_PHYS_PAGES") *
                          os.sysconf("SC_PAGE_SIZE"),
          "platform": platform.platform(), "python":
              platform.python_version(), "tensorflow": tf.__version__,
          "load_average_at_start": machine_lib.load_average()}


def plot(results: dict, path: str, title: str):
  """Throughput and scaling efficiency against workers (PNG).

  Multi-worker efficiency is against `one_device` (pinned, like each
  worker); parameter-server efficiency against its own 1-worker run (its
  workers pinned, its coordinator and ps task on the cores left over); the
  `mwms_2_*` variants and the `one_device_x2` ceiling are marked at 2
  workers.
  """
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise SystemExit(
        "scaling.py --plot needs matplotlib: set up with "
        "TFDIST_BENCHMARKS=1 bash tools/setup.sh (or pip install "
        "'.[benchmarks]'), or leave --plot out.") from None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  base = results["one_device"]["examples_per_second"]
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
  for group, marker, reference in (
      ("multi_worker_mirrored", "o", base),
      ("parameter_server", "s",
       results.get("ps_1", {}).get("examples_per_second"))):
    points = sorted((v["workers"], v) for v in results.values()
                    if v["group"] == group and v["examples_per_second"])
    if not points or not reference:
      continue
    workers = [w for w, _ in points]
    eps = [v["examples_per_second"] for _, v in points]
    low = [v["examples_per_second"] - v["min"] for _, v in points]
    high = [v["max"] - v["examples_per_second"] for _, v in points]
    label = (group if group == "multi_worker_mirrored" else
             "parameter_server (coordinator and ps on the spare cores)")
    left.errorbar(workers, eps, yerr=[low, high], marker=marker, capsize=4,
                  label=label)
    right.plot(workers, [e / (reference * w) for w, e in zip(workers, eps)],
               marker=marker,
               label=label + (" vs one_device" if reference == base else
                              " vs its 1 worker"))
  variants = [(name, v) for name, v in results.items()
              if v["group"] in ("variant", "ceiling")
              and v["examples_per_second"]]
  for i, (name, v) in enumerate(variants):
    x = 2 + 0.06 * (i + 1)
    left.errorbar([x], [v["examples_per_second"]],
                  yerr=[[v["examples_per_second"] - v["min"]],
                        [v["max"] - v["examples_per_second"]]],
                  marker="^", capsize=3, linestyle="none", label=name)
    right.plot([x], [v["examples_per_second"] / (2 * base)], marker="^",
               linestyle="none", label=name)
  left.plot([1, 2], [base, 2 * base], "k--", linewidth=1,
            label="ideal: one_device x workers")
  left.set(xlabel="workers (one core each)",
           ylabel="examples/sec", xticks=[1, 2],
           title="throughput (median, min-max)")
  right.axhline(1.0, color="k", linestyle="--", linewidth=1)
  right.axhline(0.925, color="grey", linestyle=":", linewidth=1,
                label="1.85x goal for 2 workers")
  right.set(xlabel="workers", ylabel="scaling efficiency (speedup/workers)",
            xticks=[1, 2], ylim=(0, 1.5), title="scaling efficiency")
  left.legend(fontsize=7)
  right.legend(fontsize=7)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _title(record: dict) -> str:
  info = record["machine"]
  load = info.get("load_average_at_start")
  return (f"tfdist {record.get('model', 'cnn')}, "
          f"{record['per_worker_batch_size']} examples per worker and step; "
          f"{info['cores']} cores ({info['cpu']})"
          + (f", load average {load[0]:.1f} at start" if load else "")
          + f"; medians of {record['repeats']} alternated runs")


def main(argv):
  del argv
  if FLAGS.from_json:
    with open(FLAGS.from_json) as f:
      record = json.load(f)
    print(markdown_table(record))
    if FLAGS.plot:
      plot(record["results"], FLAGS.plot, _title(record))
      print(f"Plot: {FLAGS.plot}")
    return
  table = specs(FLAGS.per_worker_batch_size, FLAGS.extra_train_flags)
  unknown = [c for c in FLAGS.configs if c not in table]
  if unknown:
    raise app.UsageError(f"--configs: unknown {unknown}; known: "
                         f"{sorted(table)}")
  info = machine()
  runs = {name: [] for name in FLAGS.configs}
  started = time.time()
  with tempfile.TemporaryDirectory(prefix="tfdist-scaling-") as tmp:
    for repeat in range(FLAGS.repeats):
      for name in FLAGS.configs:
        spec, workers, group = table[name]
        path = os.path.join(tmp, f"{name}-{repeat}")
        if group == "ceiling":
          measured = run_independent(spec, workers, path,
                                     FLAGS.timeout_seconds)
        else:
          measured = diagnose.run_training(
              spec, path, timeout_seconds=FLAGS.timeout_seconds)
        runs[name].append(measured)
        print(f"round {repeat + 1}/{FLAGS.repeats} {name}: "
              f"{measured.examples_per_second:.1f} examples/sec", flush=True)
  results = {}
  for name, measured in runs.items():
    _, workers, group = table[name]
    results[name] = {"workers": workers, "group": group,
                     **summarize(measured)}
  base = results.get("one_device", {}).get("examples_per_second")
  print(f"\n{'config':<18} {'workers':>7} {'examples/sec':>12} "
        f"{'range':>11} {'step ms':>8} {'CPU ms/step':>11} "
        f"{'input wait':>10} {'speedup':>8} {'efficiency':>10}")
  for name, r in results.items():
    eps = r["examples_per_second"]
    speedup = eps / base if base and eps else None
    r["speedup"] = speedup
    r["scaling_efficiency"] = speedup / r["workers"] if speedup else None
    print(f"{name:<18} {r['workers']:>7} {eps:>12.1f} "
          f"{r['min']:>5.0f}-{r['max']:<5.0f} "
          f"{r['step_time_seconds'] * 1000:>8.1f} "
          f"{(r['cpu_seconds_per_step'] or 0) * 1000:>11.1f} "
          f"{(r['input_wait_fraction'] or 0):>10.1%} "
          f"{(speedup or 0):>7.2f}x {(r['scaling_efficiency'] or 0):>10.0%}")
  record = {"machine": info, "seconds": time.time() - started,
            "model": FLAGS.model,
            "repeats": FLAGS.repeats, "steps": FLAGS.steps,
            "log_steps": FLAGS.log_steps,
            "per_worker_batch_size": FLAGS.per_worker_batch_size,
            "malloc_env": FLAGS.malloc_env,
            "extra_train_flags": FLAGS.extra_train_flags,
            "results": results}
  print("\n" + markdown_table(record))
  if FLAGS.output:
    machine_lib.write_json(FLAGS.output, record, indent=2, sort_keys=True)
  if FLAGS.plot and base:
    plot(results, FLAGS.plot, _title(record))
    print(f"Plot: {FLAGS.plot}")


if __name__ == "__main__":
  app.run(main)
