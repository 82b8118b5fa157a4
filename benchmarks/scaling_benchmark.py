"""Scaling benchmark: examples/sec, step time, memory, speedup, efficiency.

Not a test: it prints figures. It runs `tfdist.train` once per replica
count (one_device for 1, mirrored over GPUs or logical CPUs for more) on the
same data and per-replica batch, then measures the input pipeline alone, and
says which constraint binds:

* input: the pipeline alone delivers fewer than 1.2x the examples/sec that
  training consumes;
* compute: otherwise. On a CPU-only machine, logical CPU replicas share the
  same cores, so efficiency near 1/N is expected there.

Usage:
  python benchmarks/scaling_benchmark.py --replicas=1,2 --train_steps=60
"""

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

FLAGS = flags.FLAGS
flags.DEFINE_list("replicas", ["1", "2"], "Replica counts to compare.")
flags.DEFINE_integer("per_replica_batch_size", 64, "Examples per replica.")
flags.DEFINE_integer("train_steps", 60, "Steps per run.")
flags.DEFINE_integer("log_steps", 10, "Throughput interval (steps).")
flags.DEFINE_string("model", "cnn", "Model to train.")
flags.DEFINE_string("data_dir", "", "Where Fashion-MNIST TFRecords live.")
flags.DEFINE_bool("use_gpus", False, "Use GPUs instead of logical CPUs.")


def _run(replicas: int, model_dir: str) -> dict:
  args = [sys.executable, "-m", "tfdist.train", f"--model_dir={model_dir}",
          f"--model={FLAGS.model}", f"--train_steps={FLAGS.train_steps}",
          f"--log_steps={FLAGS.log_steps}", "--epochs_between_evals=1000",
          f"--per_replica_batch_size={FLAGS.per_replica_batch_size}"]
  if FLAGS.data_dir:
    args.append(f"--data_dir={FLAGS.data_dir}")
  if replicas == 1:
    args += ["--distribution_strategy=one_device"]
  elif FLAGS.use_gpus:
    args += ["--distribution_strategy=mirrored", f"--num_gpus={replicas}"]
  else:
    args += ["--distribution_strategy=mirrored",
             f"--num_cpu_devices={replicas}", "--num_gpus=0"]
  before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
  started = time.time()
  subprocess.run(args, cwd=REPO, check=True, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL, timeout=3600)
  with open(os.path.join(model_dir, "run_manifest.json")) as f:
    manifest = json.load(f)
  peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
  return {"replicas": replicas,
          "global_batch_size": manifest["global_batch_size"],
          "examples_per_second":
              manifest["throughput"]["examples_per_second"],
          "step_time_seconds": manifest["throughput"]["step_time_seconds"],
          "peak_rss_bytes": max(peak, before) * 1024,
          "wall_seconds": time.time() - started,
          # Resident memory depends on tfdist's malloc settings.
          "malloc_tuning": bool(manifest.get("allocator", {}).get("applied")),
          "train_files": [f["path"] for f in manifest["data"]["train_files"]]}


def _input_only(files, batch: int, steps: int) -> float:
  """Examples/sec of the input pipeline alone (no model)."""
  from tfdist import datasets  # pylint: disable=g-import-not-at-top
  from tfdist import input_pipeline  # pylint: disable=g-import-not-at-top
  ds = input_pipeline.make_dataset(input_pipeline.PipelineOptions(
      files=files, parse_fn=datasets.parse_image_example,
      global_batch_size=batch, is_training=True, seed=0))
  it = iter(ds)
  for _ in range(steps):  # first pass fills the cache
    next(it)
  started = time.perf_counter()
  for _ in range(steps):
    next(it)
  return steps * batch / (time.perf_counter() - started)


def main(argv):
  del argv
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    for n in [int(r) for r in FLAGS.replicas]:
      results.append(_run(n, os.path.join(tmp, f"r{n}")))
  base = results[0]
  print(f"{'replicas':>8} {'global':>7} {'examples/s':>11} {'step ms':>8} "
        f"{'speedup':>8} {'efficiency':>10} {'peak RSS MiB':>12} "
        f"{'malloc tuning':>13}")
  for r in results:
    speedup = r["examples_per_second"] / base["examples_per_second"]
    efficiency = speedup / (r["replicas"] / base["replicas"])
    r.update(speedup=speedup, scaling_efficiency=efficiency)
    print(f"{r['replicas']:>8} {r['global_batch_size']:>7} "
          f"{r['examples_per_second']:>11.1f} "
          f"{r['step_time_seconds'] * 1000:>8.1f} {speedup:>8.2f} "
          f"{efficiency:>10.2f} {r['peak_rss_bytes'] / 2**20:>12.0f} "
          f"{'on' if r['malloc_tuning'] else 'off':>13}")
  best = max(results, key=lambda r: r["examples_per_second"])
  input_eps = _input_only(best["train_files"], best["global_batch_size"],
                          steps=50)
  ratio = input_eps / best["examples_per_second"]
  binding = "input" if ratio < 1.2 else "compute"
  print(f"input pipeline alone: {input_eps:.1f} examples/sec "
        f"({ratio:.1f}x what training consumes): the binding constraint is "
        f"{binding}.")
  if binding == "compute" and not FLAGS.use_gpus and len(results) > 1:
    print(f"(logical CPU replicas share {os.cpu_count()} cores, so "
          "efficiency near 1/N is expected without GPUs.)")


if __name__ == "__main__":
  app.run(main)
