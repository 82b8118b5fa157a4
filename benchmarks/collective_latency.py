"""What one all-reduce costs between two MultiWorkerMirrored workers.

Not a test: it starts `python -m tfdist.launch --num_workers=2 --pin_workers`
(a chief and a worker on 127.0.0.1, each pinned to a core of its own), and
each task builds the strategy as `tfdist.train` does
(`tfdist.backends.registry.make_strategy`: ring all-reduce over gRPC,
instance keys fixed at trace time) and times a compiled function that
all-reduces one float32 tensor of each `--sizes` (bytes) `--calls` times,
alternating the sizes round by round. The chief prints the median wall
time and CPU time (all threads) per all-reduce of each size and writes
JSON: what a step's gradient all-reduce (the CNN's 1.7 MB) and each small
one (metric sums, synchronized batch norm) cost on this machine, with
nothing else running.

Usage:
  python benchmarks/collective_latency.py \\
      --output=benchmarks/results/collective_latency.json
"""

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["4", "1024", "65536", "1700000"],
                  "Bytes per all-reduce (float32 tensors).")
flags.DEFINE_integer("calls", 100, "All-reduces per size and round.")
flags.DEFINE_integer("rounds", 5, "Alternated rounds over the sizes.")
flags.DEFINE_string("output", "collective_latency.json",
                    "JSON results (the chief writes it).")
flags.DEFINE_bool("task", False, "Internal: run as one task of the cluster.")
flags.DEFINE_float("timeout_seconds", 600, "Limit of the whole run.")


def _cpu_seconds() -> float:
  times = os.times()
  return times.user + times.system


def run_task():
  """One task: times the all-reduces; the chief writes `--output`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.distribute import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from tfdist.distribute import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
  from tfdist.backends import registry as backend_registry  # pylint: disable=g-import-not-at-top
  cluster = cluster_lib.resolve_cluster()
  strategy = backend_registry.make_strategy(
      strategy_lib.StrategyOptions(kind="multi_worker_mirrored", num_gpus=0),
      cluster=cluster).strategy
  sizes = [int(s) for s in FLAGS.sizes]
  functions = {}
  for size in sizes:

    @tf.function
    def reduce_many(elements=max(size // 4, 1)):
      def replica():
        context = tf.distribute.get_replica_context()
        out = tf.ones([elements], tf.float32)
        for _ in range(FLAGS.calls):
          # Each all-reduce depends on the one before: one at a time, as a
          # step's collectives that wait on each other.
          out = context.all_reduce(tf.distribute.ReduceOp.SUM, out) * 0.5
        return out
      return strategy.run(replica)

    functions[size] = reduce_many
    reduce_many()  # Trace and warm up.
  wall = {size: [] for size in sizes}
  cpu = {size: [] for size in sizes}
  for r in range(FLAGS.rounds):
    for size in (sizes if r % 2 == 0 else sizes[::-1]):
      started, cpu_started = time.perf_counter(), _cpu_seconds()
      functions[size]()
      wall[size].append((time.perf_counter() - started) / FLAGS.calls)
      cpu[size].append((_cpu_seconds() - cpu_started) / FLAGS.calls)
  if not cluster.is_chief:
    return
  results = [{"bytes": size,
              "wall_ms_median": 1e3 * statistics.median(wall[size]),
              "wall_ms": [1e3 * w for w in wall[size]],
              "cpu_ms_median": 1e3 * statistics.median(cpu[size])}
             for size in sizes]
  print(f"{'bytes':>10} {'wall ms':>9} {'CPU ms':>8}  (median per "
        "all-reduce, chief)")
  for r in results:
    print(f"{r['bytes']:>10} {r['wall_ms_median']:9.3f} "
          f"{r['cpu_ms_median']:8.3f}")
  record = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "command": "python benchmarks/collective_latency.py " + " ".join(
          a for a in sys.argv[1:] if a != "--task"),
      "machine": {"cpu_count": os.cpu_count(),
                  "platform": platform.platform(),
                  "load_average": os.getloadavg(),
                  "tensorflow": tf.__version__},
      "settings": {"calls": FLAGS.calls, "rounds": FLAGS.rounds,
                   "workers": 2, "pinned": True, "implementation": "ring"},
      "results": results}
  with open(FLAGS.output, "w") as f:
    json.dump(record, f, indent=2)
  print(f"Wrote {FLAGS.output}.")


def main(argv):
  del argv
  if FLAGS.task:
    run_task()
    return
  output = os.path.abspath(FLAGS.output)
  command = [sys.executable, "-m", "tfdist.launch", "--num_workers=2",
             "--pin_workers", f"--module=benchmarks.collective_latency",
             "--", "--task", f"--output={output}",
             f"--sizes={','.join(FLAGS.sizes)}", f"--calls={FLAGS.calls}",
             f"--rounds={FLAGS.rounds}"]
  print(f"load average at start: {os.getloadavg()}")
  completed = subprocess.run(command, cwd=REPO, timeout=FLAGS.timeout_seconds,
                             check=False)
  print(f"load average at end: {os.getloadavg()}")
  sys.exit(completed.returncode)


if __name__ == "__main__":
  app.run(main)
