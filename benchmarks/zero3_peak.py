"""The step's peak per replica under ZeRO stage 3: whole-model against
block-by-block gathering, prefetch off and on.

Not a test: it prints figures and writes JSON. For N = 2 and 4 logical CPU
devices (MirroredStrategy), in a fresh process per configuration, it
builds a dense model (`--layers` hidden Dense layers of `--width`, fp32,
a small batch so the weights dominate), Adam, tfdist's `Trainer` at
stage 3 with `ShardingOptions(num_blocks=..., prefetch=...)`, runs two
warm-up steps, then one measured step, and reports per replica:

* `allocator_peak_bytes`: the peak of TensorFlow's CPU allocator during
  the measured step above what was allocated before it
  (`get_memory_info("CPU:0")`, BFC allocator, statistics reset before the
  step; logical CPU devices share one allocator, so divided by N);
* `gathered_estimate_bytes`: what the gathers alone hold at once by
  design: the whole buffer P' x 4 bytes (one block), the largest block's
  region N x S_b x 4 (blocks), twice that (prefetch);
* `rest_estimate_bytes`: `tfdist.training.plan.memory`'s estimate of the
  model state per replica at rest (weights, gradients, optimizer state);
* `step_seconds`: the median of 5 timed steps after the measured one.

Usage:
  python benchmarks/zero3_peak.py --out=benchmarks/results/zero3_peak.json
"""

import datetime
import json
import os
import statistics
import sys
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import machine  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_integer("width", 512, "Units of each hidden Dense layer.")
flags.DEFINE_integer("layers", 8, "Hidden Dense layers.")
flags.DEFINE_integer("num_blocks", 4, "Blocks of the block-wise runs.")
flags.DEFINE_list("replicas", ["2", "4"], "Logical CPU devices (N).")
flags.DEFINE_string("out", "", "Write the figures here as JSON.")
flags.DEFINE_string("child", "", "Internal: 'N,BLOCKS,PREFETCH'.")

MODES = ((1, 0), (None, 0), (None, 1))  # (blocks: None = --num_blocks, prefetch)


def _child(replicas: int, num_blocks: int, prefetch: bool, width: int,
           layers: int):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
  import keras  # pylint: disable=g-import-not-at-top
  from tfdist.parallel.zero3 import optimizer as zero3  # pylint: disable=g-import-not-at-top
  from tfdist.training.plan import memory  # pylint: disable=g-import-not-at-top
  from tfdist.parallel.data import sharded_optimizer  # pylint: disable=g-import-not-at-top
  from tfdist.training.step.train_loop import Trainer  # pylint: disable=g-import-not-at-top

  def info():
    return tf.config.experimental.get_memory_info("CPU:0")

  strategy = tf.distribute.MirroredStrategy(
      [f"/cpu:{i}" for i in range(replicas)])
  global_batch = 4 * replicas
  with strategy.scope():
    model = keras.Sequential(
        [keras.Input((width,))] +
        [keras.layers.Dense(width, activation="relu")
         for _ in range(layers)] + [keras.layers.Dense(10)])
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build([])
  trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                    global_batch_size=global_batch, time_steps=False,
                    sharding=sharded_optimizer.ShardingOptions(
                        stage=3, num_blocks=num_blocks,
                        prefetch=bool(prefetch)))
  layout = trainer.sharded.layout
  rng = np.random.default_rng(0)
  data = tf.data.Dataset.from_tensor_slices((
      rng.normal(size=(global_batch * 16, width)).astype("float32"),
      rng.integers(0, 10, size=global_batch * 16))).batch(
          global_batch).repeat()
  iterator = iter(strategy.experimental_distribute_dataset(data))
  one = tf.constant(1)
  for _ in range(2):
    trainer.train_function(iterator, one)
  before = info()["current"]
  tf.config.experimental.reset_memory_stats("CPU:0")
  trainer.train_function(iterator, one)
  peak = info()["peak"] - before
  times = []
  for _ in range(5):
    start = time.perf_counter()
    trainer.train_function(iterator, one)
    times.append(time.perf_counter() - start)
  blocks = len(layout.blocks)
  largest = 4 * replicas * max(layout.block_sizes)
  estimate = memory.sharded_estimate(
      memory.estimate_model_memory(model, optimizer,
                                   sharded=trainer.sharded),
      num_replicas=replicas, stage=zero3.STAGE)
  print(json.dumps({
      "replicas": replicas, "blocks": blocks, "prefetch": bool(prefetch),
      "parameters": layout.total,
      "allocator_peak_bytes": peak // replicas,
      "gathered_estimate_bytes": (4 * layout.padded_total if blocks == 1
                                  else largest * (2 if prefetch else 1)),
      "rest_estimate_bytes": int(estimate.total_bytes),
      "step_seconds": statistics.median(times)}), flush=True)


def main(argv):
  del argv
  if FLAGS.child:
    replicas, blocks, prefetch = (int(x) for x in FLAGS.child.split(","))
    _child(replicas, blocks, prefetch, FLAGS.width, FLAGS.layers)
    return
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0",
             TF_CPU_ALLOCATOR_USE_BFC="true",
             PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  rows = []
  for replicas in (int(r) for r in FLAGS.replicas):
    for blocks, prefetch in MODES:
      blocks = FLAGS.num_blocks if blocks is None else blocks
      load = machine.load_average()[0]
      row = machine.run_child(
          [os.path.abspath(__file__),
           f"--child={replicas},{blocks},{prefetch}",
           f"--width={FLAGS.width}", f"--layers={FLAGS.layers}"],
          timeout=170, what=f"N={replicas} blocks={blocks}", env=env)
      row["load_average_1min"] = load
      rows.append(row)
  mib = 1 << 20
  print(f"{'N':>2} {'blocks':>6} {'prefetch':>8} {'peak':>8} "
        f"{'gathered':>9} {'at rest':>8} {'step ms':>8} {'load':>5}  "
        "(MiB per replica; peak: allocator, above the step's start)")
  for r in rows:
    print(f"{r['replicas']:>2} {r['blocks']:>6} {str(r['prefetch']):>8}"
          f" {r['allocator_peak_bytes'] / mib:>8.2f}"
          f" {r['gathered_estimate_bytes'] / mib:>9.2f}"
          f" {r['rest_estimate_bytes'] / mib:>8.2f}"
          f" {1000 * r['step_seconds']:>8.1f} {r['load_average_1min']:>5.1f}")
  result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"), "load_average": machine.load_average(),
            "cores": os.cpu_count(), "cpu_model": machine.cpu_model(),
            "command": machine.command_line(),
            "width": FLAGS.width, "layers": FLAGS.layers, "rows": rows}
  if FLAGS.out:
    machine.write_json(FLAGS.out, result)


if __name__ == "__main__":
  app.run(main)
