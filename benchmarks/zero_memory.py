"""Optimizer memory per replica under ZeRO stages 0, 1 and 2.

Not a test: it prints figures and writes JSON. For N = 1, 2, 4 logical CPU
devices (MirroredStrategy) and each stage, in a fresh process per
configuration, it builds the model (`--model`: `transformer`, the built-in
Transformer text classifier of `--dataset=clothing_reviews`'s shapes,
1,355,201 parameters, fed random token ids and labels, which do not change
the state's size; or `dense`, `--layers` hidden layers of `--width`),
fp32 Adam, with tfdist's `Trainer` and reports the optimizer state each
replica holds:

* `estimate_bytes`: `tfdist.training.plan.memory`'s estimate from an unsharded
  build (`estimate_model_memory`), sharded by `memory.sharded_estimate`;
* `built_bytes`: what the run built, per replica, from the variables'
  shapes (`estimate_model_memory(..., sharded=trainer.sharded)`);
* `allocator_bytes`: the growth of TensorFlow's CPU allocator
  (`tf.config.experimental.get_memory_info("CPU:0")["current"]`; logical
  CPU devices share one allocator, so divided by N) while the optimizer
  state is built and each replica's copy written once (copies on logical
  CPU devices share their initial buffer until written), and
  `step_peak_bytes`, the allocator's peak above the
  model's weights during the measured steps (weights' gradients,
  activations and the summed gradient included), divided by N;
* at rest, after the measured steps: `rest_bytes`, the allocator's bytes
  above what it held before the model was built, divided by N (weights,
  optimizer state and, at stage 2, the accumulator shard: TensorFlow holds
  no gradient between steps), beside `rest_estimate_bytes`,
  `tfdist.training.plan.memory`'s parameters + optimizer state (+ the
  accumulator shard, 4 bytes per parameter / N, at stage 2), and
  `function_bytes`, what the allocator frees when the compiled step
  function is released (what the function itself keeps between calls),
  divided by N.

Usage:
  python benchmarks/zero_memory.py --out=benchmarks/results/zero_memory.json
"""

import datetime
import gc
import json
import os
import sys
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import machine  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "transformer", ["transformer", "dense"],
                  "The model measured.")
flags.DEFINE_integer("width", 1024, "Units of each hidden Dense layer.")
flags.DEFINE_integer("layers", 3, "Hidden Dense layers.")
flags.DEFINE_integer("steps", 2, "Measured updates per configuration.")
flags.DEFINE_list("replicas", ["1", "2", "4"], "Logical CPU devices (N).")
flags.DEFINE_list("stages", ["0", "1", "2"], "ZeRO stages measured.")
flags.DEFINE_string("out", "", "Write the figures here as JSON.")
flags.DEFINE_string("child", "", "Internal: run one configuration, "
                    "'N,STAGE'.")


def _child(replicas: int, stage: int, model_name: str, width: int,
           layers: int, steps: int):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
  import keras  # pylint: disable=g-import-not-at-top
  from models import transformer  # pylint: disable=g-import-not-at-top
  from tfdist.data import clothing_reviews  # pylint: disable=g-import-not-at-top
  from tfdist.training.plan import memory  # pylint: disable=g-import-not-at-top
  from tfdist.parallel.data import sharded_optimizer  # pylint: disable=g-import-not-at-top
  from tfdist.training.step.train_loop import Trainer  # pylint: disable=g-import-not-at-top

  def current():
    gc.collect()
    # Buffers of the collectives' threads are released shortly after a
    # step returns: a reading straight after varied by a few MiB.
    time.sleep(0.5)
    return tf.config.experimental.get_memory_info("CPU:0")["current"]

  def touch(variables):
    """Rewrites every replica's copy of `variables` on its own device.
    Logical CPU devices share host memory, so a mirrored variable's copies
    start out sharing their initial buffer (copy-on-write) until first
    written: without this the unsharded copies would not be counted."""
    for v in variables:
      if isinstance(v, keras.Variable):
        v = v.value
      for component in getattr(v, "values", None) or [v]:
        if not component.dtype.is_floating:
          continue
        with tf.device(component.device):
          component.assign(component * 1.0)

  strategy = tf.distribute.MirroredStrategy(
      [f"/cpu:{i}" for i in range(replicas)])
  global_batch = 8 * replicas
  empty = current()
  with strategy.scope():
    if model_name == "transformer":
      model = transformer.build_transformer(
          sequence_length=clothing_reviews.SEQUENCE_LENGTH,
          vocabulary_size=clothing_reviews.VOCABULARY_SIZE, num_classes=2)
    else:
      model = keras.Sequential(
          [keras.Input((width,))] +
          [keras.layers.Dense(width, activation="relu")
           for _ in range(layers)] + [keras.layers.Dense(10)])
  # The estimate: an unsharded build on the host, outside the strategy.
  probe = keras.models.clone_model(model)
  probe_optimizer = keras.optimizers.Adam(1e-3)
  probe_optimizer.build(probe.trainable_variables)
  unsharded = memory.estimate_model_memory(probe, probe_optimizer)
  estimate = memory.sharded_estimate(unsharded, num_replicas=replicas,
                                     stage=stage)
  del probe, probe_optimizer
  touch(model.variables)
  before = current()
  with strategy.scope():
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build([] if stage else model.trainable_variables)
  trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                    global_batch_size=global_batch, time_steps=False,
                    gradient_accumulation_steps=2 if stage == 2 else 1,
                    sharding=sharded_optimizer.ShardingOptions(stage=stage))
  state = list(optimizer.variables)
  if trainer.sharded is not None:
    state += [v for copy in trainer.sharded.copies for v in copy.variables]
    if trainer.sharded.grad_accumulator is not None:
      state.append(trainer.sharded.grad_accumulator)
  touch(state)
  built_allocator = current() - before
  built = memory.estimate_model_memory(model, optimizer,
                                       sharded=trainer.sharded)
  rng = np.random.default_rng(0)
  k = 2 if stage == 2 else 1
  examples = global_batch * (steps + 1)
  if model_name == "transformer":
    features = rng.integers(
        2, clothing_reviews.VOCABULARY_SIZE,
        size=(examples, clothing_reviews.SEQUENCE_LENGTH)).astype("int64")
    labels = rng.integers(0, 2, size=examples)
  else:
    features = rng.normal(size=(examples, width)).astype("float32")
    labels = rng.integers(0, 10, size=examples)
  data = tf.data.Dataset.from_tensor_slices((features, labels)).batch(
          global_batch // k)
  iterator = iter(strategy.experimental_distribute_dataset(data))
  trainer.train_function(iterator, tf.constant(1))  # Traces; not measured.
  tf.config.experimental.reset_memory_stats("CPU:0")
  resting = current()
  for _ in range(steps):
    trainer.train_function(iterator, tf.constant(1))
  peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
  at_rest = current()
  trainer.train_function = None
  function_bytes = at_rest - current()
  accumulator = (4 * -(-(unsharded.gradients_bytes // 4) // replicas)
                 if stage == 2 and k > 1 else 0)
  print(json.dumps({
      "replicas": replicas, "stage": stage,
      "gradient_accumulation_steps": k,
      "parameters": int(unsharded.gradients_bytes // 4),
      "unsharded_optimizer_bytes": unsharded.optimizer_bytes,
      "estimate_bytes": estimate.optimizer_bytes,
      "built_bytes": built.optimizer_bytes,
      "allocator_bytes": built_allocator // replicas,
      "step_peak_bytes": (peak - resting) // replicas,
      "rest_bytes": (at_rest - empty) // replicas,
      "rest_estimate_bytes": (unsharded.parameters_bytes +
                              estimate.optimizer_bytes + accumulator),
      "function_bytes": function_bytes // replicas,
      "sixteen_psi_bytes": estimate.total_bytes,
      "tensorflow": tf.__version__, "keras": keras.__version__,
      "shard_padding": (trainer.sharded.layout.padding
                        if trainer.sharded else 0)}), flush=True)


def main(argv):
  del argv
  if FLAGS.child:
    replicas, stage = (int(x) for x in FLAGS.child.split(","))
    _child(replicas, stage, FLAGS.model, FLAGS.width, FLAGS.layers,
           FLAGS.steps)
    return
  rows = []
  for replicas in (int(r) for r in FLAGS.replicas):
    for stage in (int(s) for s in FLAGS.stages):
      rows.append(machine.run_child(
          [os.path.abspath(__file__), f"--child={replicas},{stage}",
           f"--model={FLAGS.model}", f"--width={FLAGS.width}",
           f"--layers={FLAGS.layers}", f"--steps={FLAGS.steps}"],
          timeout=900, what=f"N={replicas} stage={stage}"))
  mib = 1 << 20
  print(f"{'N':>2} {'stage':>5} {'estimate':>10} {'built':>10} "
        f"{'allocator':>10} {'step peak':>10} {'rest est.':>10} "
        f"{'rest':>10} {'function':>10}  (MiB per replica: optimizer "
        "state; step peak above the resting state; the whole state at "
        "rest, estimated and measured; kept by the step function)")
  for r in rows:
    print(f"{r['replicas']:>2} {r['stage']:>5} "
          f"{r['estimate_bytes'] / mib:>10.2f} {r['built_bytes'] / mib:>10.2f}"
          f" {r['allocator_bytes'] / mib:>10.2f} "
          f"{r['step_peak_bytes'] / mib:>10.2f} "
          f"{r['rest_estimate_bytes'] / mib:>10.2f} "
          f"{r['rest_bytes'] / mib:>10.2f} {r['function_bytes'] / mib:>10.2f}")
  result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"), "load_average": machine.load_average(),
            "cores": os.cpu_count(), "cpu_model": machine.cpu_model(),
            "tensorflow": rows[0]["tensorflow"], "keras": rows[0]["keras"],
            "model": FLAGS.model,
            "command": machine.command_line(),
            "width": FLAGS.width, "layers": FLAGS.layers, "optimizer": "adam",
            "rows": rows}
  if FLAGS.out:
    machine.write_json(FLAGS.out, result)


if __name__ == "__main__":
  app.run(main)
