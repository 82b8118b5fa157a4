"""Per-replica memory at rest under ZeRO stage 3 against unsharded training.

Not a test: it prints figures and writes JSON. For N = 1, 2, 4 logical
CPU devices (MirroredStrategy) and stages 0 and 3, in a fresh process per
configuration, it builds a dense model (`--layers` hidden Dense layers of
`--width`, fp32), Adam, tfdist's `Trainer` with gradient accumulation
(K = 2, so gradient accumulators exist between steps, as the 16 bytes per
parameter of Rajbhandari et al. 2020 count them: 4 weights, 4 gradients,
8 Adam moments), runs two updates, and reports per replica at rest:

* `variable_bytes`: the bytes of every variable component on replica 0's
  device (weights or the weight shard, the optimizer's slots or their
  shards, the gradient accumulators or their shard), from shapes;
* `allocator_bytes`: the growth of TensorFlow's CPU allocator
  (`get_memory_info("CPU:0")["current"]`, BFC allocator on; logical CPU devices share one
  allocator, so divided by N) from before the model was built to after
  the updates, every replica's copies written once (copies on logical
  devices share their initial buffer until written): what stays alive,
  buffers the compiled step keeps included;
* `ideal_bytes`: 16 P / N (P parameters; stage 0: 16 P).

Usage:
  python benchmarks/zero3_memory.py --out=benchmarks/results/zero3_memory.json
"""

import datetime
import json
import os
import subprocess
import sys

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

FLAGS = flags.FLAGS
flags.DEFINE_integer("width", 512, "Units of each hidden Dense layer.")
flags.DEFINE_integer("layers", 4, "Hidden Dense layers.")
flags.DEFINE_list("replicas", ["1", "2", "4"], "Logical CPU devices (N).")
flags.DEFINE_string("out", "", "Write the figures here as JSON.")
flags.DEFINE_string("child", "", "Internal: one configuration, 'N,STAGE'.")


def _child(replicas: int, stage: int, width: int, layers: int):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
  import keras  # pylint: disable=g-import-not-at-top
  from tfdist.parallel.zero3 import optimizer as zero3  # pylint: disable=g-import-not-at-top
  from tfdist.parallel.data import sharded_optimizer  # pylint: disable=g-import-not-at-top
  from tfdist.training.step.train_loop import Trainer  # pylint: disable=g-import-not-at-top

  def current():
    return tf.config.experimental.get_memory_info("CPU:0")["current"]

  def components(variables):
    for v in variables:
      if isinstance(v, keras.Variable):
        if v._value is None:  # pylint: disable=protected-access
          continue  # Released by stage 3.
        v = v.value
      yield from getattr(v, "values", None) or [v]

  def touch(variables):
    for c in components(variables):
      if c.dtype.is_floating and np.size(c.numpy()):
        with tf.device(c.device):
          c.assign(c * 1.0)

  strategy = tf.distribute.MirroredStrategy(
      [f"/cpu:{i}" for i in range(replicas)])
  global_batch = 8 * replicas
  before = current()
  with strategy.scope():
    model = keras.Sequential(
        [keras.Input((width,))] +
        [keras.layers.Dense(width, activation="relu")
         for _ in range(layers)] + [keras.layers.Dense(10)])
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build([] if stage else model.trainable_variables)
  parameters = int(sum(np.prod(v.shape) for v in model.trainable_variables))
  trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                    global_batch_size=global_batch, time_steps=False,
                    gradient_accumulation_steps=2,
                    sharding=sharded_optimizer.ShardingOptions(stage=stage))
  state = list(model.variables) + list(optimizer.variables)
  if trainer.sharded is not None:
    state += [v for copy in trainer.sharded.copies for v in copy.variables]
    state.append(trainer.sharded.master)
    state.append(trainer.sharded.grad_accumulator)
  else:
    state += trainer._accumulators[0]  # pylint: disable=protected-access
  touch(state)
  rng = np.random.default_rng(0)
  data = tf.data.Dataset.from_tensor_slices((
      rng.normal(size=(global_batch * 4, width)).astype("float32"),
      rng.integers(0, 10, size=global_batch * 4))).batch(global_batch // 2)
  iterator = iter(strategy.experimental_distribute_dataset(data))
  for _ in range(2):
    trainer.train_function(iterator, tf.constant(1))
  resting = current() - before
  seen, variable_bytes = set(), 0
  for c in components(state):
    spec = tf.DeviceSpec.from_string(c.device)
    if id(c) in seen or (spec.device_index or 0) != 0:
      continue  # Counted, or another replica's.
    seen.add(id(c))
    variable_bytes += int(np.size(c.numpy())) * c.dtype.size
  print(json.dumps({
      "replicas": replicas, "stage": stage, "parameters": parameters,
      "variable_bytes": variable_bytes,
      "allocator_bytes": resting // replicas,
      "ideal_bytes": 16 * parameters // (replicas if stage == 3 else 1),
      "shard_padding": (trainer.sharded.layout.padding
                        if trainer.sharded else 0),
      "released": (isinstance(trainer.sharded, zero3.Zero3Optimizer))}),
        flush=True)


def main(argv):
  del argv
  if FLAGS.child:
    replicas, stage = (int(x) for x in FLAGS.child.split(","))
    _child(replicas, stage, FLAGS.width, FLAGS.layers)
    return
  rows = []
  # The BFC allocator keeps the statistics `get_memory_info` reads.
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0",
             TF_CPU_ALLOCATOR_USE_BFC="true",
             PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  for replicas in (int(r) for r in FLAGS.replicas):
    for stage in (0, 3):
      proc = subprocess.run(
          [sys.executable, os.path.abspath(__file__),
           f"--child={replicas},{stage}", f"--width={FLAGS.width}",
           f"--layers={FLAGS.layers}"],
          env=env, capture_output=True, text=True, timeout=170, check=False)
      lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
      if proc.returncode or not lines:
        raise SystemExit(f"N={replicas} stage={stage} failed:\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
      rows.append(json.loads(lines[-1]))
  mib = 1 << 20
  print(f"{'N':>2} {'stage':>5} {'16P/N':>8} {'variables':>10} "
        f"{'allocator':>10}  (MiB per replica at rest)")
  for r in rows:
    print(f"{r['replicas']:>2} {r['stage']:>5} {r['ideal_bytes'] / mib:>8.2f}"
          f" {r['variable_bytes'] / mib:>10.2f}"
          f" {r['allocator_bytes'] / mib:>10.2f}")
  result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"), "load_average": os.getloadavg(),
            "cores": os.cpu_count(),
            "command": " ".join(["python", "benchmarks/zero3_memory.py",
                                 *sys.argv[1:]]),
            "width": FLAGS.width, "layers": FLAGS.layers,
            "optimizer": "adam", "gradient_accumulation_steps": 2,
            "rows": rows}
  if FLAGS.out:
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=1)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
