"""Benchmark: one very large hashed embedding table on 2 parameter servers.

Not a test. Starts a local cluster (ps and worker `tf.distribute.Server`s in
child processes of this script, on 127.0.0.1 with portpicker ports; this
process is the coordinator), builds one `ShardedEmbedding` table of
`--rows` x `--dim` float32 split into `--shards` shards spread round-robin
over the `--num_ps` ps tasks (each shard initialized on its own ps; the
coordinator never holds the table), then trains a tiny click model on it
asynchronously and reports, for each worker count in `--workers`:

* resident memory (RSS) of every task after the table was built and after
  training (from /proc through psutil);
* examples/second over `--steps` steps after `--warmup_steps`;
* the speed-up of N workers over the first entry.

Every process (ps, workers, coordinator) applies tfdist's malloc settings
(`tfdist.runtime.allocator`) as `tfdist.train` does, unless `--notune_allocator`;
the JSON records which.

Input: synthetic hashed ids, `--ids_per_example` per example drawn uniformly
from the whole table (the worst case for locality: nearly every looked-up row
is distinct), labels from a fixed hash of the first id. The optimizer is
plain SGD, whose update is sparse (only looked-up rows travel and change):
momentum or Adam would update every row of the table at every step.

Usage:
  python benchmarks/ps_embedding_benchmark.py --rows=100000000 --dim=16 \
      --num_ps=2 --workers=1,2
"""

import json
import os
import subprocess
import sys
import time

from absl import app
from absl import flags

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

FLAGS = flags.FLAGS
flags.DEFINE_integer("rows", 100_000_000, "Rows of the hashed table.")
flags.DEFINE_integer("dim", 16, "Embedding width.")
flags.DEFINE_integer("num_ps", 2, "Parameter-server tasks.")
flags.DEFINE_integer("shards", 8,
                     "Shards of the table (round-robin over the ps tasks; "
                     "more shards lower each ps's peak memory while a shard "
                     "is initialized).")
flags.DEFINE_list("workers", ["1", "2"], "Worker counts to compare.")
flags.DEFINE_integer("batch_size", 1024, "Examples per worker step.")
flags.DEFINE_integer("ids_per_example", 8, "Hashed ids looked up per example.")
flags.DEFINE_integer("steps", 200, "Measured steps per worker count.")
flags.DEFINE_integer("warmup_steps", 40, "Unmeasured steps first.")
flags.DEFINE_integer("steps_per_execution", 10, "Steps per scheduled call.")
flags.DEFINE_float("learning_rate", 0.1, "SGD learning rate.")
flags.DEFINE_string("output", "", "Also write the results as JSON here.")
flags.DEFINE_bool("tune_allocator", True,
                  "Apply tfdist.runtime.allocator's malloc settings in every process "
                  "(as tfdist.train does).")
flags.DEFINE_string("serve", "", "Internal: 'job:index:cluster_json' to serve.")


def _serve(spec: str):
  from tfdist.runtime import allocator  # pylint: disable=g-import-not-at-top
  allocator.configure_allocator(FLAGS.tune_allocator)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  job, index, cluster = spec.split(":", 2)
  server = tf.distribute.Server(tf.train.ClusterSpec(json.loads(cluster)),
                                job_name=job, task_index=int(index),
                                protocol="grpc", start=True)
  print(f"serving {job}:{index}", flush=True)
  server.join()


def _rss_mib(pid: int) -> float:
  import psutil  # pylint: disable=g-import-not-at-top
  return psutil.Process(pid).memory_info().rss / 2**20


def _start_cluster(num_workers: int, num_ps: int):
  import portpicker  # pylint: disable=g-import-not-at-top
  ports = [portpicker.pick_unused_port() for _ in range(1 + num_workers +
                                                         num_ps)]
  cluster = {"chief": [f"127.0.0.1:{ports[0]}"],
             "worker": [f"127.0.0.1:{p}" for p in ports[1:1 + num_workers]],
             "ps": [f"127.0.0.1:{p}" for p in ports[1 + num_workers:]]}
  env = dict(os.environ, GRPC_FAIL_FAST="use_caller",
             TF_CPP_MIN_LOG_LEVEL="2")
  procs = {}
  for job in ("ps", "worker"):
    for i in range(len(cluster[job])):
      procs[f"{job}:{i}"] = subprocess.Popen(
          [sys.executable, os.path.abspath(__file__),
           f"--serve={job}:{i}:{json.dumps(cluster)}",
           f"--tune_allocator={FLAGS.tune_allocator}"], env=env,
          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  return cluster, procs


def _stop(procs):
  for proc in procs.values():
    if proc.poll() is None:
      proc.kill()
  for proc in procs.values():
    proc.wait(timeout=60)


def _run(num_workers: int) -> dict:
  """One cluster, one table, one measurement (run in a fresh process)."""
  os.environ["GRPC_FAIL_FAST"] = "use_caller"
  from tfdist.runtime import allocator  # pylint: disable=g-import-not-at-top
  allocator.configure_allocator(FLAGS.tune_allocator)
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.distribute import parameter_server as ps_lib  # pylint: disable=g-import-not-at-top
  from tfdist.distribute.sharded_embedding import ShardedEmbedding  # pylint: disable=g-import-not-at-top

  cluster, procs = _start_cluster(num_workers, FLAGS.num_ps)
  result = {"workers": num_workers, "num_ps": FLAGS.num_ps,
            "allocator": allocator.state().to_dict()}
  try:
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0,
        rpc_layer="grpc")
    partitioner = ps_lib.make_partitioner(
        "fixed", num_ps=FLAGS.num_ps, shard_bytes=1, max_shards=FLAGS.shards)
    strategy = tf.distribute.ParameterServerStrategy(
        resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    started = time.time()
    with strategy.scope():
      table = ShardedEmbedding(
          FLAGS.rows, FLAGS.dim, name="hashed_ids",
          embeddings_initializer=keras.initializers.RandomUniform(
              -0.01, 0.01, seed=1))
      dense = keras.layers.Dense(1, name="click")
      ids_in = keras.Input(shape=(FLAGS.ids_per_example,), dtype="int64")
      pooled = keras.layers.GlobalAveragePooling1D()(table(ids_in))
      model = keras.Model(ids_in, dense(pooled))
      optimizer = keras.optimizers.SGD(FLAGS.learning_rate)
      optimizer.build(model.trainable_variables)
    result["build_seconds"] = time.time() - started
    result["table"] = {
        "rows": FLAGS.rows, "dim": FLAGS.dim,
        "gib": FLAGS.rows * FLAGS.dim * 4 / 2**30,
        "shards": [{"rows": int(v.shape[0]),
                    "task": ps_lib.task_of(v.device)} for v in table.shards]}
    result["rss_mib_after_build"] = {
        name: round(_rss_mib(p.pid)) for name, p in procs.items()}
    result["rss_mib_after_build"]["chief"] = round(_rss_mib(os.getpid()))

    rows, k, batch = FLAGS.rows, FLAGS.ids_per_example, FLAGS.batch_size

    def dataset_fn(_):
      ds = tf.data.Dataset.random().batch(batch * k).map(
          lambda r: tf.reshape(r % rows, [batch, k]))
      ds = ds.map(lambda ids: (ids, tf.cast(
          tf.reshape(ids[:, 0] % 2, [batch, 1]), tf.float32)))
      return ds.prefetch(4)

    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: strategy.distribute_datasets_from_function(dataset_fn)))
    loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    @tf.function
    def train(iterator, n):
      def replica(ids, labels):
        with tf.GradientTape() as tape:
          loss = loss_fn(labels, model(ids, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
      loss = tf.constant(0.0)
      for _ in tf.range(n):
        ids, labels = next(iterator)
        loss = strategy.run(replica, args=(ids, labels))
      return loss

    spe = FLAGS.steps_per_execution
    for _ in range(max(FLAGS.warmup_steps // spe, 1)):
      coordinator.schedule(train, args=(iterator, tf.constant(spe)))
    coordinator.join()
    started = time.time()
    calls = max(FLAGS.steps // spe, 1)
    for _ in range(calls):
      last = coordinator.schedule(train, args=(iterator, tf.constant(spe)))
    coordinator.join()
    seconds = time.time() - started
    result["measured_steps"] = calls * spe
    result["seconds"] = seconds
    result["examples_per_second"] = calls * spe * batch / seconds
    result["final_loss"] = float(last.fetch())
    result["rss_mib_after_training"] = {
        name: round(_rss_mib(p.pid)) for name, p in procs.items()}
    result["rss_mib_after_training"]["chief"] = round(_rss_mib(os.getpid()))
  finally:
    _stop(procs)
  return result


def main(argv):
  del argv
  if FLAGS.serve:
    _serve(FLAGS.serve)
    return
  if os.environ.get("TFDIST_BENCH_CHILD"):
    result = _run(int(os.environ["TFDIST_BENCH_CHILD"]))
    print("RESULT " + json.dumps(result), flush=True)
    return
  results = []
  for workers in [int(w) for w in FLAGS.workers]:
    # A fresh coordinator process per cluster: a process connects to one
    # cluster only.
    env = dict(os.environ, TFDIST_BENCH_CHILD=str(workers),
               TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)] +
                          sys.argv[1:], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode or not lines:
      print(proc.stdout[-3000:])
      raise SystemExit(f"benchmark with {workers} worker(s) failed "
                       f"(exit {proc.returncode})")
    result = json.loads(lines[-1][len("RESULT "):])
    results.append(result)
    print(f"{workers} worker(s): table {result['table']['rows']:,} x "
          f"{result['table']['dim']} ({result['table']['gib']:.2f} GiB) in "
          f"{len(result['table']['shards'])} shards over {result['num_ps']} "
          f"ps; built in {result['build_seconds']:.0f} s; "
          f"{result['examples_per_second']:.0f} examples/sec over "
          f"{result['measured_steps']} steps; RSS MiB after build "
          f"{result['rss_mib_after_build']}, after training "
          f"{result['rss_mib_after_training']} (malloc tuning "
          f"{'on' if result['allocator']['applied'] else 'off'})", flush=True)
  base = results[0]["examples_per_second"]
  for r in results:
    r["speedup_vs_first"] = r["examples_per_second"] / base
    print(f"{r['workers']} worker(s): {r['examples_per_second']:.0f} "
          f"examples/sec, speed-up {r['speedup_vs_first']:.2f}x", flush=True)
  if FLAGS.output:
    with open(FLAGS.output, "w") as f:
      json.dump({"flags": {k: FLAGS[k].value for k in (
          "rows", "dim", "num_ps", "shards", "batch_size", "ids_per_example",
          "steps", "steps_per_execution", "tune_allocator")},
                 "results": results}, f, indent=2)


if __name__ == "__main__":
  app.run(main)
