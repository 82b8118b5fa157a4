"""What a compiled step keeps between calls when it gathers a shard.

Not a test: it prints figures and writes JSON. Under MirroredStrategy on
2 logical CPU devices, each replica holds a float32 shard of `--elements`
elements in a sync-on-read variable; a `tf.function` step builds the full
vector from the shards, takes the dot product with a weight vector, and
(with `grad`) differentiates it with respect to the shard, then writes
the shard. The full vector comes from

* `concat`: the local shard concatenated N times (no collective; the
  baseline);
* `all_gather`: `ReplicaContext.all_gather`, with its built-in gradient
  (the all-reduced gradient, then `tf.gather` at `tf.range(begin, end)`);
* `all_gather_slice`: the same gather with a custom gradient: all-reduce,
  then `tf.slice` at `replica_id_in_sync_group x S`.

Each configuration runs in a fresh process. `function_bytes`: what
TensorFlow's CPU allocator (`tf.config.experimental.get_memory_info`)
frees when the step function is released after 5 steps, divided by N:
the buffers the function itself keeps between calls.

Usage:
  python benchmarks/gather_memory.py --out=benchmarks/results/gather_memory.json
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
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from benchmarks import machine  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_integer("elements", 1 << 20, "Elements of each replica's shard.")
flags.DEFINE_integer("replicas", 2, "Logical CPU devices (N).")
flags.DEFINE_string("out", "", "Write the figures here as JSON.")
flags.DEFINE_string("child", "", "Internal: run one configuration, "
                    "'VARIANT,GRAD'.")

VARIANTS = ("concat", "all_gather", "all_gather_slice")


def _child(variant: str, grad: bool, elements: int, replicas: int) -> dict:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)

  def current():
    gc.collect()
    time.sleep(0.5)  # Collective threads release buffers just after a step.
    return tf.config.experimental.get_memory_info("CPU:0")["current"]

  strategy = tf.distribute.MirroredStrategy(
      [f"/cpu:{i}" for i in range(replicas)])
  size = elements
  with strategy.scope():
    shard = tf.Variable(
        tf.random.normal([size]),
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.NONE)
    weights = tf.Variable(tf.random.normal([replicas * size]))

  def full_vector(context, x):
    if variant == "concat":
      return tf.concat([x] * replicas, axis=0)
    if variant == "all_gather":
      return context.all_gather(x, axis=0)

    @tf.custom_gradient
    def gathered(value):
      def gradient(upstream):
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, upstream)
        return tf.slice(summed, [context.replica_id_in_sync_group * size],
                        [size])
      return context.all_gather(value, axis=0), gradient
    return gathered(x)

  def replica_step():
    context = tf.distribute.get_replica_context()
    x = tf.ensure_shape(shard.read_value(), [size])
    with tf.GradientTape() as tape:
      tape.watch(x)
      # A dot product: its gradient (the weights) is no constant that
      # Grappler could fold into the function.
      loss = tf.tensordot(full_vector(context, x), weights.read_value(), 1)
    if grad:
      shard.assign_sub(1e-6 * tape.gradient(loss, x))
    else:
      shard.assign(x * 0.999 + 1e-6 * loss)
    return loss

  @tf.function
  def step():
    return strategy.run(replica_step)

  for _ in range(5):
    step()
  at_rest = current()
  del step
  released = current()
  return {"variant": variant, "grad": grad, "replicas": replicas,
          "shard_bytes": 4 * size,
          "function_bytes": (at_rest - released) // replicas,
          "tensorflow": tf.__version__}


def main(argv):
  del argv
  if FLAGS.child:
    variant, grad = FLAGS.child.split(",")
    print(json.dumps(_child(variant, grad == "1", FLAGS.elements,
                            FLAGS.replicas)), flush=True)
    return
  rows = []
  for grad in (0, 1):
    for variant in VARIANTS:
      rows.append(machine.run_child(
          [os.path.abspath(__file__), f"--child={variant},{grad}",
           f"--elements={FLAGS.elements}", f"--replicas={FLAGS.replicas}"],
          timeout=600, what=f"{variant} grad={grad}"))
  mib = 1 << 20
  print(f"{'variant':>18} {'gradient':>8} {'kept by the step':>18}  (MiB per "
        f"replica; shard {4 * FLAGS.elements / mib:.2f} MiB)")
  for r in rows:
    print(f"{r['variant']:>18} {str(r['grad']):>8} "
          f"{r['function_bytes'] / mib:>18.2f}")
  result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"), "load_average": machine.load_average(),
            "cores": os.cpu_count(), "cpu_model": machine.cpu_model(),
            "tensorflow": rows[0]["tensorflow"],
            "command": machine.command_line(), "rows": rows}
  if FLAGS.out:
    machine.write_json(FLAGS.out, result)


if __name__ == "__main__":
  app.run(main)
