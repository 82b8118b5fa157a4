"""Memory benchmark: activation recomputation and gradient accumulation.

Not a test: it prints figures and writes JSON. It trains the built-in
ResNet (`--model=resnet`: stem, 3 stages of 2 basic blocks, 32/64/128
filters, 28x28x1 Fashion-MNIST images; 0.70 M parameters) with tfdist's own
step (`tfdist.training.step.train_loop.Trainer`, SGD with momentum, fp32), one
configuration per fresh process, alternating, and reports for each:

* `peak_bytes`: the peak of TensorFlow's CPU allocator during the measured
  steps (`tf.config.experimental.get_memory_info("CPU:0")["peak"]`, reset
  after the warm-up steps, so tracing is not counted): what the step
  itself holds at once (weights, optimizer slots, accumulators,
  activations, gradients);
* `max_rss_bytes`: the process's peak resident set (`ru_maxrss`): the
  allocator's peak plus TensorFlow's runtime, the data and the allocator's
  own behaviour;
* `examples_per_second`: over the measured steps (a ratio between the
  configurations is what to read, on a shared machine).

Configurations: recomputation off/on at global batch B with K=1, and K=1
against K=4 at the same effective global batch B (micro-batch B/4), each
also with recomputation; all on one device.

Allocator setting: `--tune_allocator` (default off, as the README's figures
were measured: glibc malloc's defaults) applies `tfdist.runtime.allocator`'s
settings, which `tfdist.train` applies by default, in every configuration's
process; the JSON records the setting in force (`allocator`) and any
`MALLOC_*` variables of the environment.

Usage:
  python benchmarks/memory_levers_benchmark.py --global_batch_size=256 \
    --steps=6 --out=/tmp/memory_levers.json
"""

import json
import os
import platform
import resource
import subprocess
import sys
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

FLAGS = flags.FLAGS
flags.DEFINE_integer("global_batch_size", 256, "Examples per update.")
flags.DEFINE_integer("steps", 6, "Measured updates per configuration.")
flags.DEFINE_integer("warmup_steps", 2, "Updates before measuring.")
flags.DEFINE_string("model", "resnet", "Built-in model (cnn or resnet).")
flags.DEFINE_string("data_dir", "", "Where Fashion-MNIST TFRecords live "
                    "(default: tfdist's).")
flags.DEFINE_string("out", "", "Write the figures here as JSON.")
flags.DEFINE_integer("repeats", 1, "Rounds over the configurations.")
flags.DEFINE_bool("tune_allocator", False, "Apply tfdist.runtime.allocator's glibc "
                  "malloc settings in each configuration's process (as "
                  "tfdist.train does by default).")

# (name, recompute, K)
CONFIGS = (("baseline", False, 1), ("recompute", True, 1),
           ("accumulate_k4", False, 4), ("accumulate_k4_recompute", True, 4))


def measure(recompute: bool, k: int, *, global_batch: int, steps: int,
            warmup: int, model_name: str, data_dir: str) -> dict:
  """One configuration, in this process (a fresh one per configuration)."""
  from tfdist.runtime import allocator  # pylint: disable=g-import-not-at-top
  allocator_state = allocator.configure_allocator(FLAGS.tune_allocator)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  from tfdist import models  # pylint: disable=g-import-not-at-top
  from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
  from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
  from tfdist.training.step.train_loop import Trainer  # pylint: disable=g-import-not-at-top
  spec = datasets.get_dataset_spec("fashion_mnist")
  train_glob, _ = spec.prepare(data_dir or os.path.expanduser(
      "~/.cache/tfdist/datasets"), "")
  files = input_pipeline.list_files(train_glob)
  strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
  keras.utils.set_random_seed(1)
  with strategy.scope():
    model = models.build_model(model_name, spec=spec,
                               activation_recomputation=recompute)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    optimizer.build(model.trainable_variables)
  trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                    global_batch_size=global_batch,
                    gradient_accumulation_steps=k)
  data = input_pipeline.distribute(strategy, input_pipeline.PipelineOptions(
      files=files, parse_fn=spec.parse_fn, global_batch_size=global_batch,
      is_training=True, seed=1, gradient_accumulation_steps=k,
      # No cache and a small shuffle buffer: the input's own tensors stay
      # small and constant, not growing while the steps are measured.
      cache=False, shuffle_buffer_size=1000,
      file_record_counts=input_pipeline.count_records_per_file(files)))
  iterator = iter(data)
  one = tf.constant(1, tf.int32)
  for _ in range(warmup):
    trainer.train_function(iterator, one)
  tf.config.experimental.reset_memory_stats("CPU:0")
  started = time.perf_counter()
  for _ in range(steps):
    sums = trainer.train_function(iterator, one)
  float(sums["loss"])
  seconds = time.perf_counter() - started
  return {"recompute": recompute, "gradient_accumulation_steps": k,
          "micro_batch": global_batch // k, "global_batch_size": global_batch,
          "parameters": int(sum(v.numpy().size
                                for v in model.trainable_variables)),
          "peak_bytes": int(tf.config.experimental.get_memory_info(
              "CPU:0")["peak"]),
          "max_rss_bytes": resource.getrusage(
              resource.RUSAGE_SELF).ru_maxrss * 1024,
          "examples_per_second": steps * global_batch / seconds,
          "step_seconds": seconds / steps,
          "allocator": allocator_state.to_dict()}


def main(argv):
  del argv
  if os.environ.get("TFDIST_MEMORY_CHILD"):
    name, recompute, k = json.loads(os.environ["TFDIST_MEMORY_CHILD"])
    print(json.dumps(dict(name=name, **measure(
        recompute, k, global_batch=FLAGS.global_batch_size,
        steps=FLAGS.steps, warmup=FLAGS.warmup_steps,
        model_name=FLAGS.model, data_dir=FLAGS.data_dir))), flush=True)
    return
  results = []
  for _ in range(FLAGS.repeats):
    for config in CONFIGS:
      env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                 TFDIST_MEMORY_CHILD=json.dumps(config))
      proc = subprocess.run([sys.executable, os.path.abspath(__file__),
                             *sys.argv[1:]], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, timeout=3600, check=False)
      lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
      if proc.returncode or not lines:
        sys.exit(f"{config[0]} failed:\n{proc.stderr[-3000:]}")
      results.append(json.loads(lines[-1]))
  best = {}
  for r in results:  # Smallest peak of the repeats (they agree closely).
    if r["name"] not in best or r["peak_bytes"] < best[r["name"]][
        "peak_bytes"]:
      best[r["name"]] = r
  base = best["baseline"]
  mib = lambda b: b / 2**20
  print(f"{FLAGS.model} ({base['parameters']:,} parameters), global batch "
        f"{FLAGS.global_batch_size}, {FLAGS.steps} measured updates, one "
        "CPU device, fp32")
  print(f"{'configuration':26} {'micro':>5} {'K':>2} {'peak MiB':>9} "
        f"{'vs base':>7} {'max RSS MiB':>11} {'ex/s':>7} {'vs base':>7}")
  for name, *_ in CONFIGS:
    r = best[name]
    print(f"{name:26} {r['micro_batch']:5d} "
          f"{r['gradient_accumulation_steps']:2d} {mib(r['peak_bytes']):9.1f} "
          f"{r['peak_bytes'] / base['peak_bytes']:7.2f} "
          f"{mib(r['max_rss_bytes']):11.1f} {r['examples_per_second']:7.1f} "
          f"{r['examples_per_second'] / base['examples_per_second']:7.2f}")
  malloc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
  report = {
      "model": FLAGS.model, "global_batch_size": FLAGS.global_batch_size,
      "steps": FLAGS.steps, "machine": {
          "cpus": os.cpu_count(), "platform": platform.platform(),
          "processor": platform.processor() or platform.machine()},
      "allocator": {"malloc_environment": malloc or "none",
                    "tune_allocator": FLAGS.tune_allocator,
                    "in_force": base["allocator"]},
      "results": results, "best": best}
  print(f"allocator: {report['allocator']}")
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  app.run(main)
