"""The mixture-of-experts Transformer against the dense Transformer of the
same active parameters per token, on the clothing reviews.

Not a test: it prints figures and writes JSON. Two configurations of
`python -m tfdist.train --dataset=clothing_reviews` (AdamW, batches of 64,
a cosine schedule after warmup, one device), each in a fresh process:

* moe: `--transformer_experts=E --experts_top_k=K`: each block's
  feed-forward layer is E experts of width 128 (the builder's `ff_dim`), a
  token going to K of them;
* dense: the same Transformer with one feed-forward layer of width
  K * 128 (`dense_same_active`, given as `--model=benchmarks.
  moe_transformer:dense_same_active`): per token the same feed-forward
  parameters as the MoE model's K experts (the router's d_model x E
  weights aside), while the MoE model holds E/K times as many in all.

The two run alternately (`--repeats` pairs, the order swapped every other
pair, so that a drift of the machine's load hits both alike), and each
run's held-out loss, accuracy and AUC and its training throughput
(examples/sec over the measured intervals, the run manifest's
`throughput`) are recorded, with the machine (`benchmarks/machine.py`).

Usage:
  python benchmarks/moe_transformer.py --repeats=2 --train_epochs=1 \\
    --out=/tmp/moe_transformer.json
"""

import datetime
import json
import os
import subprocess
import sys
import tempfile

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import machine  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS


def _define_flags():
  """The benchmark's flags: defined only when it runs, since its dense
  model's child runs import this module beside tfdist.train's flags."""
  flags.DEFINE_string("data_dir", "", "Converted data sets (default: a "
                      "temporary folder).")
  flags.DEFINE_integer("experts", 8, "Experts per block of the MoE model.")
  flags.DEFINE_integer("top_k", 2, "Experts per token (1 or 2).")
  flags.DEFINE_float("capacity_factor", 1.25, "--experts_capacity_factor.")
  flags.DEFINE_integer("train_epochs", 1, "Epochs of each run.")
  flags.DEFINE_integer("repeats", 2, "Pairs of runs (moe and dense).")
  flags.DEFINE_integer("run_timeout", 3600, "Seconds one run may take.")
  flags.DEFINE_string("out", "", "Write the figures here as JSON.")


# The built-in Transformer's feed-forward width (`build_transformer`).
FF_DIM = 128


def dense_same_active(spec):
  """The built-in Transformer with feed-forward width `top_k * FF_DIM`
  (`--model=benchmarks.moe_transformer:dense_same_active`; `top_k` from
  `MOE_BENCHMARK_TOP_K`, set by this benchmark for its child runs)."""
  from tfdist.models import transformer  # pylint: disable=g-import-not-at-top
  top_k = int(os.environ.get("MOE_BENCHMARK_TOP_K", "2"))
  return transformer.build_transformer(
      sequence_length=spec.input_shape[0],
      vocabulary_size=spec.vocabulary_size,
      num_classes=max(1, spec.num_classes), ff_dim=top_k * FF_DIM)


def _run(name: str, data_dir: str) -> dict:
  model_dir = tempfile.mkdtemp(prefix=f"moe_benchmark_{name}_")
  common = ["-m", "tfdist.train", "--dataset=clothing_reviews",
            f"--data_dir={data_dir}", f"--model_dir={model_dir}",
            f"--train_epochs={FLAGS.train_epochs}", "--lr_schedule=cosine",
            "--warmup_epochs=0.2", "--weight_decay=0.01", "--seed=0",
            "--log_steps=50", "--distribution_strategy=one_device"]
  if name == "moe":
    extra = [f"--transformer_experts={FLAGS.experts}",
             f"--experts_top_k={FLAGS.top_k}",
             f"--experts_capacity_factor={FLAGS.capacity_factor}"]
  else:
    extra = ["--model=benchmarks.moe_transformer:dense_same_active"]
  env = {**os.environ, "MOE_BENCHMARK_TOP_K": str(FLAGS.top_k),
         "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  started = datetime.datetime.now()
  try:
    # tfdist.train ends its process without Python's teardown, so it runs
    # as a child and its manifest is read afterwards.
    proc = subprocess.run([sys.executable, *common, *extra], cwd=REPO,
                          env=env, capture_output=True, text=True,
                          timeout=FLAGS.run_timeout, check=False)
  except subprocess.TimeoutExpired as e:
    raise SystemExit(f"{name}: no result in {FLAGS.run_timeout} s (raise "
                     "--run_timeout, or train fewer --train_epochs)") from e
  manifest = os.path.join(model_dir, "run_manifest.json")
  if proc.returncode or not os.path.exists(manifest):
    raise SystemExit(f"{name} failed (exit {proc.returncode}):\n"
                     f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
  seconds = (datetime.datetime.now() - started).total_seconds()
  with open(manifest) as f:
    result = json.load(f)
  metrics, throughput = result["final_metrics"], result["throughput"]
  return {"model": name, "flags": common[2:] + extra, "seconds": seconds,
          "final_step": result.get("final_step"),
          "eval_loss": metrics.get("eval_loss"),
          "eval_accuracy": metrics.get("eval_accuracy"),
          "eval_auc": metrics.get("eval_auc"),
          "examples_per_second": throughput.get("examples_per_second"),
          "step_time_seconds": throughput.get("step_time_seconds")}


def _parameters() -> dict:
  """Total and active-per-token parameters of both models."""
  from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
  from tfdist.models import transformer  # pylint: disable=g-import-not-at-top
  spec = datasets.get_dataset_spec("clothing_reviews")
  os.environ["MOE_BENCHMARK_TOP_K"] = str(FLAGS.top_k)
  dense = dense_same_active(spec)
  moe = transformer.build_transformer(
      sequence_length=spec.input_shape[0],
      vocabulary_size=spec.vocabulary_size,
      num_classes=max(1, spec.num_classes),
      experts=transformer.ExpertsOptions(
          num_experts=FLAGS.experts, top_k=FLAGS.top_k,
          capacity_factor=FLAGS.capacity_factor))
  trainable = lambda m: sum(int(w.numpy().size) for w in m.trainable_weights)
  # Per token the MoE model runs top_k of its experts (and the router).
  expert = sum(int(w.numpy().size) for w in moe.trainable_weights
               if "/expert_" in w.path)
  active = trainable(moe) - expert * (FLAGS.experts - FLAGS.top_k) // (
      FLAGS.experts)
  return {"dense_total": trainable(dense), "dense_active": trainable(dense),
          "moe_total": trainable(moe), "moe_active": active}


def main(argv):
  del argv
  data_dir = FLAGS.data_dir or tempfile.mkdtemp(prefix="moe_data_")
  from tfdist.data import clothing_reviews  # pylint: disable=g-import-not-at-top
  clothing_reviews.prepare(data_dir, "")
  load = machine.load_average()
  parameters = _parameters()
  print(f"parameters: {parameters}")
  runs = []
  for repeat in range(FLAGS.repeats):
    order = ("moe", "dense") if repeat % 2 == 0 else ("dense", "moe")
    for name in order:
      run = _run(name, data_dir)
      runs.append({"repeat": repeat, **run})
      print(f"{name}: accuracy {run['eval_accuracy']}, AUC "
            f"{run['eval_auc']}, {run['examples_per_second']} examples/s "
            f"({run['seconds']:.0f} s)")
  result = {"date": datetime.date.today().isoformat(),
            "command": machine.command_line(), "cpu": machine.cpu_model(),
            "load_average_at_start": load,
            "load_average_at_end": machine.load_average(),
            "experts": FLAGS.experts, "top_k": FLAGS.top_k,
            "capacity_factor": FLAGS.capacity_factor,
            "parameters": parameters, "runs": runs}
  if FLAGS.out:
    machine.write_json(FLAGS.out, result, indent=2)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
