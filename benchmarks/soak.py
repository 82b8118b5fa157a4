"""Soak: a long two-worker MultiWorkerMirrored run, threads and memory sampled.

Not a test: it starts `python -m tfdist.launch --num_workers=2` (a chief and
a worker on 127.0.0.1, `tfdist.train` with
`--distribution_strategy=multi_worker_mirrored`) on bundled Fashion-MNIST,
and every time the chief logs a step (every `--sample_steps` steps) reads
each task's thread count (`Threads:` in `/proc/PID/status`) and resident
memory (`VmRSS:`, MiB). It prints the curve and writes JSON.

Other layouts for comparison: `--distribution_strategy=one_device` or
`mirrored` (one process), `--num_workers=1` (MultiWorkerMirrored in one
process: no collective leaves it), and any tfdist.train flag through
`--train_flag` (e.g. `--train_flag=--steps_per_execution=10`: ten steps per
call of the training function). `TFDIST_PER_CALL_INSTANCE_KEYS=1` in the
environment keeps TensorFlow's per-call collective instance keys, whose
memory grows about 10 KiB per call (docs/design/long-runs.md). `MALLOC_*`
and `TFDIST_*` variables of the environment are recorded in the JSON, with
each task's RSS (KiB) and CPU time (ms, user plus system) per step from the
first sample after the first checkpoint to the last.

A run whose per-collective timeout is on (`--collective_timeout_seconds`
greater than 0; TensorFlow keeps one sleeping thread per collective for that
long) shows the threads growing; the default (0) stays flat.

Usage:
  python benchmarks/soak.py --steps=5000 --sample_steps=250 \\
      --output=benchmarks/results/soak.json
  python benchmarks/soak.py --steps=600 --sample_steps=100 \\
      --collective_timeout_seconds=300 --output=/tmp/soak_300.json
  python benchmarks/soak.py --steps=5000 --sample_steps=250 \\
      --train_flag=--steps_per_execution=10 \\
      --output=benchmarks/results/soak_steps_per_execution_10.json
"""

import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 5000, "Training steps of the run.")
flags.DEFINE_integer("sample_steps", 250, "Sample threads and memory every "
                     "this many steps (the chief's --log_steps).")
flags.DEFINE_integer("batch_size", 16, "Global batch size (small: the run "
                     "is about steps, not examples).")
flags.DEFINE_string("model", "cnn", "--model of the run.")
flags.DEFINE_float("collective_timeout_seconds", 0.0,
                   "--collective_timeout_seconds of the run (0: tfdist's "
                   "default, no per-collective timeout).")
flags.DEFINE_enum("distribution_strategy", "multi_worker_mirrored",
                  ["multi_worker_mirrored", "parameter_server", "one_device",
                   "mirrored"],
                  "multi_worker_mirrored: a chief and --num_workers - 1 "
                  "workers; parameter_server: a chief (coordinator), 2 "
                  "workers and a ps task; one_device: one process (a "
                  "baseline for the memory curve); mirrored: one process, "
                  "2 logical CPU devices.")
flags.DEFINE_integer("num_workers", 2, "multi_worker_mirrored: processes "
                     "(1: one process, TensorFlow's collectives without "
                     "gRPC).")
flags.DEFINE_multi_string("train_flag", [], "Another flag for every task's "
                          "tfdist.train, e.g. --train_flag=--notune_allocator "
                          "(repeatable).")
flags.DEFINE_integer("timeout", 3600, "Seconds after which the run is "
                     "stopped (the result then says so).")
flags.DEFINE_string("output", "soak.json", "JSON written here (relative "
                    "paths: from the current directory; the recorded runs "
                    "are under benchmarks/results/).")

_STARTED = re.compile(r"^\[launch\] attempt \d+: started (\S+) pid (\d+)")
_STEP = re.compile(r"^\[chief:0\] .*step (\d+)/\d+: loss")


def read_status(pid: int) -> dict:
  """`{"threads": int, "rss_mib": float, "cpu_seconds": float}` of a live
  process (Linux `/proc/PID/status`; user plus system CPU time from
  `/proc/PID/stat`); {} once it has exited."""
  out = {}
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("Threads:"):
          out["threads"] = int(line.split()[1])
        elif line.startswith("VmRSS:"):
          out["rss_mib"] = round(int(line.split()[1]) / 1024, 1)
    with open(f"/proc/{pid}/stat") as f:
      # Fields 14 and 15 (utime, stime), counted after the parenthesised
      # command name, which may hold spaces.
      fields = f.read().rsplit(")", 1)[1].split()
    out["cpu_seconds"] = round(
        (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)
  except (FileNotFoundError, ProcessLookupError):
    return {}
  return out


def per_step_rates(samples: list, tasks: list, from_step: int) -> dict:
  """Resident memory (KiB) and CPU time (ms) per step, by task.

  Args:
    samples: the run's samples (`{"step": int, TASK: read_status(...)}`).
    tasks: task names, e.g. `["chief:0", "worker:0"]`.
    from_step: the first sample at or after this step starts the interval
      (the steps before it are warm-up: tracing, the first checkpoint).

  Returns:
    `{TASK: {"rss_kib_per_step", "cpu_ms_per_step", "from_step",
    "to_step"}}` between that sample and the last; {} with fewer than two
    samples after warm-up.
  """
  later = [s for s in samples if s["step"] >= from_step]
  if len(later) < 2:
    return {}
  first, last = later[0], later[-1]
  steps = last["step"] - first["step"]
  out = {}
  for task in tasks:
    a, b = first.get(task, {}), last.get(task, {})
    if "rss_mib" in a and "rss_mib" in b:
      out[task] = {
          "rss_kib_per_step": round((b["rss_mib"] - a["rss_mib"]) * 1024 /
                                    steps, 2),
          "cpu_ms_per_step": round((b["cpu_seconds"] - a["cpu_seconds"]) *
                                   1000 / steps, 2),
          "from_step": first["step"], "to_step": last["step"]}
  return out


def _data() -> dict:
  from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
  out = os.path.join(tempfile.mkdtemp(prefix="soak-data-"), "fashion_mnist")
  datasets.convert_fashion_mnist(out, limit=4096, train_shards=4,
                                 test_shards=2)
  return {"train": os.path.join(out, "train-*.tfrecord.gz"),
          "eval": os.path.join(out, "test-*.tfrecord.gz")}


def main(argv):
  del argv  # Unused.
  data = _data()
  model_dir = tempfile.mkdtemp(prefix="soak-run-")
  try:
    return _soak(data, model_dir)
  finally:  # The data and the run are the soak's own: nothing else uses them.
    shutil.rmtree(os.path.dirname(os.path.dirname(data["train"])),
                  ignore_errors=True)
    shutil.rmtree(model_dir, ignore_errors=True)


def _soak(data: dict, model_dir: str) -> int:
  """Runs the soak on `data` into `model_dir`; prints and writes the JSON;
  returns the exit status (0: the run succeeded)."""
  layout = {"multi_worker_mirrored": [f"--num_workers={FLAGS.num_workers}"],
            "parameter_server": ["--num_workers=2", "--num_ps=1"],
            "one_device": ["--num_workers=1"],
            "mirrored": ["--num_workers=1"]}[FLAGS.distribution_strategy]
  devices = (["--num_cpu_devices=2"]
             if FLAGS.distribution_strategy == "mirrored" else [])
  command = [
      sys.executable, "-m", "tfdist.launch", "--output=all", *layout,
      "--", f"--distribution_strategy={FLAGS.distribution_strategy}",
      f"--model={FLAGS.model}",
      f"--train_files={data['train']}", f"--eval_files={data['eval']}",
      f"--batch_size={FLAGS.batch_size}", f"--train_steps={FLAGS.steps}",
      f"--log_steps={FLAGS.sample_steps}",
      f"--checkpoint_steps={max(FLAGS.steps // 5, 1)}",
      f"--epochs_between_evals={10**6}",
      f"--collective_timeout_seconds={FLAGS.collective_timeout_seconds:g}",
      f"--model_dir={model_dir}", *devices, *FLAGS.train_flag]
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep +
             os.environ.get("PYTHONPATH", ""))
  started = time.time()
  proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True,
                          errors="replace")
  timer = threading.Timer(FLAGS.timeout, proc.kill)
  timer.start()
  pids, samples, tail = {}, [], []
  print(f"{'step':>6} {'seconds':>8}  task: threads, RSS MiB", flush=True)
  for line in proc.stdout:
    line = line.rstrip("\n")
    tail = (tail + [line])[-40:]
    match = _STARTED.match(line)
    if match:
      pids[match.group(1)] = int(match.group(2))
      continue
    match = _STEP.match(line)
    if not match:
      continue
    sample = {"step": int(match.group(1)),
              "seconds": round(time.time() - started, 1)}
    for task, pid in sorted(pids.items()):
      sample[task] = read_status(pid)
    samples.append(sample)
    print(f"{sample['step']:>6} {sample['seconds']:>8.1f}  " + "  ".join(
        f"{t}: {sample[t].get('threads', '-')}, "
        f"{sample[t].get('rss_mib', '-')}" for t in sorted(pids)), flush=True)
  status = proc.wait()
  timer.cancel()
  timed_out = time.time() - started >= FLAGS.timeout
  growth = {}
  if len(samples) >= 2:
    first, last = samples[0], samples[-1]
    for task in pids:
      if "threads" in first.get(task, {}) and "threads" in last.get(task, {}):
        growth[task] = {
            "threads": last[task]["threads"] - first[task]["threads"],
            "rss_mib": round(last[task]["rss_mib"] - first[task]["rss_mib"],
                             1),
            "from_step": first["step"], "to_step": last["step"]}
  rates = per_step_rates(samples, sorted(pids),
                         from_step=FLAGS.steps // 5 + FLAGS.sample_steps)
  result = {
      "command": " ".join(command),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                  "load_average": os.getloadavg()},
      "steps": FLAGS.steps, "sample_steps": FLAGS.sample_steps,
      "batch_size": FLAGS.batch_size, "model": FLAGS.model,
      "distribution_strategy": FLAGS.distribution_strategy,
      "num_workers": (FLAGS.num_workers if FLAGS.distribution_strategy ==
                      "multi_worker_mirrored" else None),
      "train_flags": FLAGS.train_flag,
      "malloc_environment": {k: v for k, v in os.environ.items()
                             if k.startswith("MALLOC_")},
      "tfdist_environment": {k: v for k, v in os.environ.items()
                             if k.startswith("TFDIST_")},
      "collective_timeout_seconds": FLAGS.collective_timeout_seconds,
      "exit_status": status, "timed_out": timed_out,
      "seconds": round(time.time() - started, 1),
      "samples": samples, "growth_first_to_last_sample": growth,
      "per_step_after_warmup": rates,
      "output_tail": tail if status else tail[-5:]}
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.output)), exist_ok=True)
  with open(FLAGS.output, "w") as f:
    json.dump(result, f, indent=1)
  print(f"exit status {status}{' (timed out)' if timed_out else ''} after "
        f"{result['seconds']:.0f} s; growth first to last sample: "
        f"{json.dumps(growth)}; per step after warm-up: {json.dumps(rates)}; "
        f"JSON: {FLAGS.output}", flush=True)
  if status:
    print("\n".join(tail), flush=True)
  return 0 if status == 0 else 1


if __name__ == "__main__":
  app.run(main)
