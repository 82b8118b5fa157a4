"""Throughput of ZeRO-sharded training against unsharded, paired.

Not a test: it prints figures and writes JSON. It trains the Transformer
(`--dataset=clothing_reviews`, `--model=transformer`, AdamW) for
`--steps` steps per run, alternating an unsharded run and a sharded one
(`--zero_stage`) `--pairs` times, in a fresh process each, for each setup:

* `mirrored`: MirroredStrategy on 2 logical CPU devices, one process;
* `mwms`: two MultiWorkerMirrored workers, each pinned to its own core
  (`python -m tfdist.launch --num_workers=2 --pin_workers`).

Each run's throughput is its manifest's `throughput.examples_per_second`
(the log intervals after the first, warm-up one). The figure is the ratio
sharded / unsharded of each pair (alternated, so slow drifts of a shared
machine fall on both sides), with the median over pairs. The load average
is printed: compare only figures taken on a quiet machine.

Usage:
  python benchmarks/zero_throughput.py --pairs=3 \
    --out=benchmarks/results/zero_throughput.json
"""

import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

FLAGS = flags.FLAGS
flags.DEFINE_integer("pairs", 3, "Unsharded/sharded pairs per setup.")
flags.DEFINE_integer("steps", 80, "Training steps per run.")
flags.DEFINE_integer("log_steps", 10, "Steps per measured interval.")
flags.DEFINE_integer("zero_stage", 1, "The sharded runs' ZeRO stage (1, 2).")
flags.DEFINE_list("setups", ["mirrored", "mwms"], "mirrored, mwms.")
flags.DEFINE_string("data_dir", "", "Converted data sets (default: a "
                    "temporary folder).")
flags.DEFINE_string("out", "", "Write the figures here as JSON.")


def _train_flags(data_dir, model_dir, steps, log_steps, stage):
  return ["--dataset=clothing_reviews", f"--data_dir={data_dir}",
          f"--model_dir={model_dir}", f"--train_steps={steps}",
          f"--log_steps={log_steps}", "--mode=train", "--seed=1",
          f"--zero_stage={stage}"]


def _run(setup: str, stage: int, data_dir: str) -> float:
  model_dir = tempfile.mkdtemp(prefix=f"zero_{setup}_{stage}_")
  train = _train_flags(data_dir, model_dir, FLAGS.steps, FLAGS.log_steps,
                       stage)
  if setup == "mirrored":
    cmd = [sys.executable, "-m", "tfdist.train",
           "--distribution_strategy=mirrored", "--num_cpu_devices=2", *train]
  else:
    cmd = [sys.executable, "-m", "tfdist.launch", "--num_workers=2",
           "--pin_workers", "--",
           "--distribution_strategy=multi_worker_mirrored", *train]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                        timeout=1800, check=False,
                        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
  manifest = os.path.join(model_dir, "run_manifest.json")
  if proc.returncode != 0 or not os.path.exists(manifest):
    raise SystemExit(f"{setup} stage {stage}: exit {proc.returncode}\n"
                     f"{(proc.stdout + proc.stderr)[-3000:]}")
  with open(manifest) as f:
    return float(json.load(f)["throughput"]["examples_per_second"])


def main(argv):
  del argv
  data_dir = FLAGS.data_dir or tempfile.mkdtemp(prefix="zero_data_")
  from tfdist.data import clothing_reviews  # pylint: disable=g-import-not-at-top
  clothing_reviews.prepare(data_dir, "")
  result = {"date": datetime.date.today().isoformat(),
            "command": " ".join(["python", "benchmarks/zero_throughput.py",
                                 *sys.argv[1:]]),
            "load_average_at_start": os.getloadavg(),
            "zero_stage": FLAGS.zero_stage, "steps": FLAGS.steps,
            "setups": {}}
  for setup in FLAGS.setups:
    pairs = []
    for _ in range(FLAGS.pairs):
      unsharded = _run(setup, 0, data_dir)
      sharded = _run(setup, FLAGS.zero_stage, data_dir)
      pairs.append({"unsharded": unsharded, "sharded": sharded,
                    "ratio": sharded / unsharded})
      print(f"{setup}: unsharded {unsharded:.1f}, stage {FLAGS.zero_stage} "
            f"{sharded:.1f} examples/s, ratio {sharded / unsharded:.3f}",
            flush=True)
    ratios = [p["ratio"] for p in pairs]
    result["setups"][setup] = {"pairs": pairs,
                               "median_ratio": statistics.median(ratios),
                               "min_ratio": min(ratios),
                               "max_ratio": max(ratios)}
    print(f"{setup}: median ratio {statistics.median(ratios):.3f} "
          f"({min(ratios):.3f}..{max(ratios):.3f})")
  result["load_average_at_end"] = os.getloadavg()
  print(f"load average at start {result['load_average_at_start'][0]:.1f}, "
        f"at end {result['load_average_at_end'][0]:.1f}")
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=2)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
