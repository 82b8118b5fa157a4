"""Throughput of ZeRO-sharded training against unsharded, paired.

Not a test: it prints figures and writes JSON. It trains the Transformer
(`--dataset=clothing_reviews`, `--model=transformer`, AdamW) for
`--steps` steps per run, alternating an unsharded run (or one at
`--baseline_stage`) and a sharded one (`--zero_stage`) `--pairs` times, in a fresh process each, for each setup:

* `mirrored`: MirroredStrategy on 2 logical CPU devices, one process;
* `mwms`: two MultiWorkerMirrored workers, each pinned to its own core
  (`python -m tfdist.launch --num_workers=2 --pin_workers`).

Each run's throughput is the median of its manifest's log intervals
(`throughput.this_process.intervals`, the first, warm-up one excluded):
an interval a shared machine's other work stole falls out of the median.
Each run's CPU time per step (`throughput.cpu_seconds_per_step`, every
thread of the process) is kept too: it is what the step costs, whatever
else the machine runs. The figures are the ratios sharded / unsharded of
each pair (alternated, so slow drifts fall on both sides), with their
median over pairs. The load average is printed: compare throughput only
from a quiet machine.

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
flags.DEFINE_integer("zero_stage", 1,
                     "The sharded runs' ZeRO stage (1, 2, 3).")
flags.DEFINE_integer("baseline_stage", 0,
                     "The other runs' ZeRO stage (0: unsharded; 1: stage 3 "
                     "against stage 1).")
flags.DEFINE_list("setups", ["mirrored", "mwms"], "mirrored, mwms.")
flags.DEFINE_string("data_dir", "", "Converted data sets (default: a "
                    "temporary folder).")
flags.DEFINE_string("out", "", "Write the figures here as JSON.")


def _train_flags(data_dir, model_dir, steps, log_steps, stage):
  return ["--dataset=clothing_reviews", f"--data_dir={data_dir}",
          f"--model_dir={model_dir}", f"--train_steps={steps}",
          f"--log_steps={log_steps}", "--mode=train", "--seed=1",
          f"--zero_stage={stage}"]


def _run(setup: str, stage: int, data_dir: str) -> dict:
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
    throughput = json.load(f)["throughput"]
  intervals = [i["examples_per_second"]
               for i in throughput["this_process"]["intervals"]
               if not i["excluded"]]
  return {"examples_per_second": statistics.median(intervals),
          "cpu_seconds_per_step": throughput["cpu_seconds_per_step"]}


def main(argv):
  del argv
  data_dir = FLAGS.data_dir or tempfile.mkdtemp(prefix="zero_data_")
  from tfdist.data import clothing_reviews  # pylint: disable=g-import-not-at-top
  clothing_reviews.prepare(data_dir, "")
  result = {"date": datetime.date.today().isoformat(),
            "command": " ".join(["python", "benchmarks/zero_throughput.py",
                                 *sys.argv[1:]]),
            "load_average_at_start": os.getloadavg(),
            "zero_stage": FLAGS.zero_stage,
            "baseline_stage": FLAGS.baseline_stage, "steps": FLAGS.steps,
            "setups": {}}
  for setup in FLAGS.setups:
    pairs = []
    for _ in range(FLAGS.pairs):
      unsharded = _run(setup, FLAGS.baseline_stage, data_dir)
      sharded = _run(setup, FLAGS.zero_stage, data_dir)
      pair = {"unsharded": unsharded, "sharded": sharded,
              "ratio": (sharded["examples_per_second"] /
                        unsharded["examples_per_second"]),
              "cpu_ratio": (sharded["cpu_seconds_per_step"] /
                            unsharded["cpu_seconds_per_step"]),
              "load_average": os.getloadavg()[0]}
      pairs.append(pair)
      print(f"{setup}: stage {FLAGS.baseline_stage} "
            f"{unsharded['examples_per_second']:.1f}, "
            f"stage {FLAGS.zero_stage} {sharded['examples_per_second']:.1f} "
            f"examples/s, ratio {pair['ratio']:.3f}; CPU per step "
            f"{unsharded['cpu_seconds_per_step'] * 1e3:.0f} vs "
            f"{sharded['cpu_seconds_per_step'] * 1e3:.0f} ms, ratio "
            f"{pair['cpu_ratio']:.3f}; load {pair['load_average']:.1f}",
            flush=True)
    summary = {"pairs": pairs}
    for key in ("ratio", "cpu_ratio"):
      values = [p[key] for p in pairs]
      summary[f"median_{key}"] = statistics.median(values)
      summary[f"min_{key}"] = min(values)
      summary[f"max_{key}"] = max(values)
    result["setups"][setup] = summary
    print(f"{setup}: throughput ratio median {summary['median_ratio']:.3f} "
          f"({summary['min_ratio']:.3f}..{summary['max_ratio']:.3f}); CPU "
          f"per step ratio median {summary['median_cpu_ratio']:.3f} "
          f"({summary['min_cpu_ratio']:.3f}..{summary['max_cpu_ratio']:.3f})")
  result["load_average_at_end"] = os.getloadavg()
  print(f"load average at start {result['load_average_at_start'][0]:.1f}, "
        f"at end {result['load_average_at_end'][0]:.1f}")
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=2)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
