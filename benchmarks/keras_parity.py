"""Keras parity benchmark: tfdist's loop against plain Keras `fit`, paired.

Not a test: it prints figures and writes JSON. Both sides train the same
model (`models.build_model("cnn")`), on the same input pipeline
(`tfdist.data.input_pipeline` on the same Fashion-MNIST TFRecords: shuffle
buffer, cache, batch, prefetch), with the same optimizer (SGD, constant
learning rate, momentum), global batch and `steps_per_execution`, in fp32
without XLA. The sides:

* `keras`: plain Keras 3 `model.compile` + `model.fit`, with the same glibc
  malloc settings tfdist applies (`tfdist.runtime.allocator.configure_allocator`):
  the fair baseline;
* `tfdist`: `tfdist.experiment.run_experiment` (what `python -m
  tfdist.train` runs), allocator tuning on, as shipped;
* `keras_stock`: plain Keras with malloc left as it is, reported apart
  (beating a handicapped baseline proves nothing);
* `tfdist_stock` (only when asked for in `--sides`): tfdist with
  `tune_allocator=False`.

Strategies: `one_device` (Keras without any strategy, as a plain user
writes it; tfdist's OneDeviceStrategy) and `mirrored` (MirroredStrategy over
2 logical CPU devices on both sides; Keras is given the same distributed
dataset, `input_pipeline.distribute`).

Each run is its own child process: malloc settings, and TensorFlow's
one-time malloc patch made by the first `GeneratorDataset` op, belong to the
whole process. Runs alternate (each pair in the opposite order of the last),
`--pairs` times per strategy. In each run the first `--warmup_steps` steps
are not measured; over the next `--steps` a Keras callback (the same class
on both sides) reads the clock, user and system CPU time and minor page
faults (`getrusage`), the main thread's CPU time (`time.thread_time`: the
training loop's Python and its calls into TensorFlow, apart from the
threads that run the ops and tf.data; the steadiest figure of what a loop
adds) and resident memory. Printed per strategy: each pair's throughput
ratio tfdist / keras and tfdist / keras_stock, their median and spread
(min..max), the same for CPU time per step (keras / tfdist: above 1 tfdist
spends less), and per side the medians of examples/sec, CPU milliseconds
per step (user, system, main thread), minor page faults per step and peak
resident memory (MiB, up to the end of the measured steps).

On a machine others are using, absolute speeds are noise; the ratios of
alternated runs are what count.

`--op_counts` times nothing: it traces both sides' one-device training step
(Keras's `make_train_function()`, and the `Trainer` tfdist builds for the
same model, loss, metric and optimizer) on the same input, and prints their
ops by type where they differ (the bodies of the functions they call
included): each op is dispatched at every step. `--input_only=N` trains
nothing: it reads N batches of each side's training input after its first
epoch (cached), alternated `--pairs` times in one process, and prints the
CPU time per batch.

Usage:
  python benchmarks/keras_parity.py --pairs=5 --steps=60 \
      --output=/tmp/keras_parity.json
  TF_ENABLE_ONEDNN_OPTS=0 python benchmarks/keras_parity.py   # see README
  python benchmarks/keras_parity.py --op_counts --output=/tmp/ops.json
  python benchmarks/keras_parity.py --input_only=400 --pairs=3 \
      --output=/tmp/input.json
"""

import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time

from absl import app
from absl import flags

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

from benchmarks import machine  # pylint: disable=g-import-not-at-top,wrong-import-position

SIDES = ("keras", "tfdist", "keras_stock", "tfdist_stock")
STRATEGIES = ("one_device", "mirrored")
_RESULT_PREFIX = "KERAS_PARITY_RESULT "

FLAGS = flags.FLAGS
flags.DEFINE_list("strategies", list(STRATEGIES),
                  "Strategies to compare: one_device, mirrored.")
flags.DEFINE_list("sides", ["keras", "tfdist", "keras_stock"],
                  f"Sides to run in each pair, from {', '.join(SIDES)}; "
                  "`keras` and `tfdist` are required (their ratio).")
flags.DEFINE_integer("pairs", 5, "Alternated rounds per strategy.")
flags.DEFINE_integer("steps", 60, "Measured training steps per run.")
flags.DEFINE_integer("warmup_steps", 10, "Unmeasured steps before them.")
flags.DEFINE_integer("batch_size", 128, "Global batch (examples per step).")
flags.DEFINE_integer("steps_per_execution", 1,
                     "Steps per tf.function call, on both sides.")
flags.DEFINE_float("learning_rate", 0.05, "SGD learning rate (constant).")
flags.DEFINE_float("momentum", 0.9, "SGD momentum.")
flags.DEFINE_string("data_dir", "",
                    "Where the Fashion-MNIST TFRecords are (converted there "
                    "first if missing); default: tfdist's data folder.")
flags.DEFINE_string("output", "keras_parity.json",
                    "Where to write the JSON results (relative paths: from "
                    "the directory `bazel run` was started in).")
flags.DEFINE_integer("run_timeout", 1200, "Seconds one child run may take.")
flags.DEFINE_bool("op_counts", False,
                  "Instead of timing: trace both sides' compiled training "
                  "step (one device) and print their ops by type, the "
                  "bodies of the functions they call included.")
flags.DEFINE_integer("input_only", 0,
                     "Instead of training: read this many batches of each "
                     "side's training input after its first epoch (cached), "
                     "alternated --pairs times in this process, and print "
                     "the CPU time per batch.")
flags.DEFINE_string("child", "", "Internal: run one side in this process.")
flags.DEFINE_string("child_strategy", "", "Internal.")
flags.DEFINE_string("child_train_files", "", "Internal.")
flags.DEFINE_string("child_eval_files", "", "Internal.")


# --- one run (child process) ----------------------------------------------
def _resident_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _snapshot() -> dict:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  # The meter runs on the main thread on both sides (a callback that is not
  # async-safe): `thread_time` is the training loop's own Python and op
  # dispatch, apart from TensorFlow's and tf.data's threads.
  return {"time": time.perf_counter(), "main_thread": time.thread_time(),
          "user": usage.ru_utime,
          "system": usage.ru_stime, "minflt": usage.ru_minflt,
          "majflt": usage.ru_majflt, "maxrss_bytes": usage.ru_maxrss * 1024}


def _make_meter(warmup_steps: int, steps: int):
  """A Keras callback that snapshots usage after the warm-up and after
  `steps` more steps (batch indices: Keras passes the last step of each
  execution, tfdist's controller the last step of each chunk)."""
  import keras  # pylint: disable=g-import-not-at-top

  class UsageMeter(keras.callbacks.Callback):

    def __init__(self):
      super().__init__()
      self.start = None
      self.end = None

    def on_train_batch_end(self, batch, logs=None):
      done = int(batch) + 1
      if self.start is None and done >= warmup_steps:
        self.start = dict(_snapshot(), steps_done=done)
      elif (self.start is not None and self.end is None and
            done >= warmup_steps + steps):
        self.end = dict(_snapshot(), steps_done=done,
                        resident_bytes=_resident_bytes())

  return UsageMeter()


def _pipeline_options(files):
  from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
  from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
  return input_pipeline.PipelineOptions(
      files=files, parse_fn=datasets.get_dataset_spec("fashion_mnist").parse_fn,
      global_batch_size=FLAGS.batch_size, is_training=True,
      shuffle_buffer_size=10_000, cache=True, seed=42)


def _run_keras(strategy_name: str, train_files, meter):
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
  from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
  from tfdist.distribute import devices  # pylint: disable=g-import-not-at-top
  spec = datasets.get_dataset_spec("fashion_mnist")
  options = _pipeline_options(train_files)
  if strategy_name == "mirrored":
    names = devices.configure_cpu_devices(2)
    strategy = tf.distribute.MirroredStrategy(names)
    data = input_pipeline.distribute(strategy, options)
  else:
    strategy = tf.distribute.get_strategy()  # None: plain Keras.
    data = input_pipeline.make_dataset(options)
  keras.utils.set_random_seed(42)
  with strategy.scope():
    model = models.build_model("cnn", input_shape=spec.input_shape,
                               num_classes=spec.num_classes)
    model.compile(
        optimizer=keras.optimizers.SGD(FLAGS.learning_rate,
                                       momentum=FLAGS.momentum),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], steps_per_execution=FLAGS.steps_per_execution,
        jit_compile=False)
  model.fit(data, epochs=1, verbose=0, callbacks=[meter],
            steps_per_epoch=FLAGS.warmup_steps + FLAGS.steps)


def _run_tfdist(strategy_name: str, train_files, eval_files, meter,
                tune_allocator: bool):
  from tfdist import experiment  # pylint: disable=g-import-not-at-top
  from tfdist.config import TrainConfig  # pylint: disable=g-import-not-at-top
  total = FLAGS.warmup_steps + FLAGS.steps
  strategy = ({"distribution_strategy": "mirrored", "num_cpu_devices": 2,
               "num_gpus": 0} if strategy_name == "mirrored" else
              {"distribution_strategy": "one_device", "num_gpus": -1})
  with tempfile.TemporaryDirectory() as model_dir:
    experiment.run_experiment(TrainConfig(
        model_dir=model_dir, model="cnn", dataset="fashion_mnist",
        train_files=",".join(train_files), eval_files=",".join(eval_files),
        batch_size=FLAGS.batch_size, train_steps=total, log_steps=total,
        # No evaluation: Model.fit's side evaluates nothing, and the meter
        # has read its figures by the last step.
        mode="train", optimizer="sgd",
        base_learning_rate=FLAGS.learning_rate,
        base_batch_size=FLAGS.batch_size, lr_scaling="none",
        lr_schedule="constant", warmup_steps=0, momentum=FLAGS.momentum,
        steps_per_execution=FLAGS.steps_per_execution, dtype="fp32",
        enable_xla=False, seed=42, tune_allocator=tune_allocator,
        **strategy), callbacks=[meter])


def run_child(side: str, strategy_name: str, train_files, eval_files) -> dict:
  """Trains one side in this process; returns its measured figures."""
  from tfdist.runtime import allocator  # pylint: disable=g-import-not-at-top
  if side == "keras":
    allocator.configure_allocator(True)  # What tfdist applies.
  meter = _make_meter(FLAGS.warmup_steps, FLAGS.steps)
  if side in ("keras", "keras_stock"):
    _run_keras(strategy_name, train_files, meter)
  else:
    _run_tfdist(strategy_name, train_files, eval_files, meter,
                tune_allocator=side == "tfdist")
  start, end = meter.start, meter.end
  if start is None or end is None:
    raise RuntimeError(f"{side}/{strategy_name}: the meter saw too few steps.")
  steps = end["steps_done"] - start["steps_done"]
  seconds = end["time"] - start["time"]
  return {
      "side": side, "strategy": strategy_name, "measured_steps": steps,
      "examples_per_second": steps * FLAGS.batch_size / seconds,
      "step_time_seconds": seconds / steps,
      "user_ms_per_step": 1000 * (end["user"] - start["user"]) / steps,
      "system_ms_per_step": 1000 * (end["system"] - start["system"]) / steps,
      "main_thread_ms_per_step": (
          1000 * (end["main_thread"] - start["main_thread"]) / steps),
      "minor_faults_per_step": (end["minflt"] - start["minflt"]) / steps,
      "major_faults_per_step": (end["majflt"] - start["majflt"]) / steps,
      "peak_rss_mib": end["maxrss_bytes"] / 2**20,
      "rss_mib_at_end": end["resident_bytes"] / 2**20,
      "allocator": allocator.state().to_dict(),
  }


# --- the compiled steps' ops ----------------------------------------------
def _op_types(concrete) -> dict:
  """Op type -> count in a concrete function's graph and the bodies of the
  functions it calls."""
  graph = concrete.graph.as_graph_def()
  counts = {}
  for node in list(graph.node) + [n for f in graph.library.function
                                  for n in f.node_def]:
    counts[node.op] = counts.get(node.op, 0) + 1
  return counts


def op_counts(train_files) -> dict:
  """Both sides' one-device training step traced on the same input (one
  step per call): `{"keras": {op: count}, "tfdist": {op: count}}`. Keras:
  `Model.make_train_function()`'s compiled function; tfdist: the `Trainer`
  `run_experiment` builds for this model, loss, metric and optimizer."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
  from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
  from tfdist.training.step import train_loop  # pylint: disable=g-import-not-at-top
  spec = datasets.get_dataset_spec("fashion_mnist")
  data = input_pipeline.make_dataset(_pipeline_options(train_files))

  def parts():
    keras.utils.set_random_seed(42)
    model = models.build_model("cnn", input_shape=spec.input_shape,
                               num_classes=spec.num_classes)
    return model, keras.optimizers.SGD(FLAGS.learning_rate,
                                       momentum=FLAGS.momentum)

  model, optimizer = parts()
  model.compile(optimizer=optimizer, metrics=["accuracy"], jit_compile=False,
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  model.make_train_function()
  # Keras wraps its compiled function in a plain one; the compiled one is
  # in its closure.
  compiled = [c.cell_contents for c in model.train_function.__closure__
              if isinstance(c.cell_contents,
                            tf.types.experimental.PolymorphicFunction)]
  counts = {"keras": _op_types(compiled[0].get_concrete_function(
      iter(data)))}
  strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
  with strategy.scope():
    model, optimizer = parts()
    optimizer.build(model.trainable_variables)
  trainer = train_loop.Trainer(strategy=strategy, model=model,
                               optimizer=optimizer,
                               global_batch_size=FLAGS.batch_size)
  counts["tfdist"] = _op_types(trainer.train_function.get_concrete_function(
      iter(data), tf.TensorSpec([], tf.int32), tf.TensorSpec([2], tf.float32)))
  return counts


def input_cpu(train_files) -> dict:
  """CPU milliseconds (all threads) per batch of each side's training
  input after its first epoch, `--input_only` batches per run, `--pairs`
  alternated runs: `{"keras": [...], "tfdist": [...]}`. Keras reads the
  benchmark's pipeline; tfdist the one `run_experiment` makes of the same
  files (record counts known, so epochs aligned to steps; ordered reading,
  for the input position)."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
  keras_options = _pipeline_options(train_files)
  options = {"keras": keras_options, "tfdist": dataclasses.replace(
      keras_options, deterministic=True,
      file_record_counts=input_pipeline.count_records_per_file(train_files))}
  batches_per_epoch = 60000 // FLAGS.batch_size
  out = {"keras": [], "tfdist": []}
  for i in range(FLAGS.pairs):
    for side in (("keras", "tfdist") if i % 2 == 0 else ("tfdist", "keras")):
      batches = iter(input_pipeline.make_dataset(options[side]))
      for _ in range(batches_per_epoch + 10):
        next(batches)
      started = time.process_time()
      for _ in range(FLAGS.input_only):
        next(batches)
      out[side].append(1000 * (time.process_time() - started) /
                       FLAGS.input_only)
      print(f"[input pair {i + 1}/{FLAGS.pairs}] {side:<7} "
            f"{out[side][-1]:.3f} ms of CPU per batch", flush=True)
  return out


def _print_op_counts(counts: dict):
  keras_ops, tfdist_ops = counts["keras"], counts["tfdist"]
  print(f"ops in the compiled step: keras {sum(keras_ops.values())}, "
        f"tfdist {sum(tfdist_ops.values())}; by type where they differ:")
  for op in sorted(set(keras_ops) | set(tfdist_ops)):
    k, t = keras_ops.get(op, 0), tfdist_ops.get(op, 0)
    if k != t:
      print(f"  {op:<34} keras {k:>4}  tfdist {t:>4}")


# --- the driver (parent process) ------------------------------------------
def _data_files():
  from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
  from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
  from tfdist.distribute import environment  # pylint: disable=g-import-not-at-top
  data_dir = (FLAGS.data_dir or
              environment.read_environment().default_data_dir)
  train, test = datasets.get_dataset_spec("fashion_mnist").prepare(data_dir,
                                                                   "")
  train_files = input_pipeline.list_files(train, flag="--data_dir")
  # The children train only (tfdist's with --mode=train, which reads no
  # evaluation files); one test shard is enough to pass.
  eval_files = input_pipeline.list_files(test, flag="--data_dir")[:1]
  return train_files, eval_files


def _launch(side: str, strategy_name: str, train_files, eval_files) -> dict:
  args = [os.path.abspath(__file__), f"--child={side}",
          f"--child_strategy={strategy_name}",
          f"--child_train_files={','.join(train_files)}",
          f"--child_eval_files={','.join(eval_files)}",
          f"--steps={FLAGS.steps}", f"--warmup_steps={FLAGS.warmup_steps}",
          f"--batch_size={FLAGS.batch_size}",
          f"--steps_per_execution={FLAGS.steps_per_execution}",
          f"--learning_rate={FLAGS.learning_rate}",
          f"--momentum={FLAGS.momentum}"]
  return machine.run_child(args, timeout=FLAGS.run_timeout,
                           what=f"{side}/{strategy_name}",
                           prefix=_RESULT_PREFIX,
                           timeout_flag="--run_timeout")


def _spread(values):
  return {"median": statistics.median(values), "min": min(values),
          "max": max(values), "values": values}


def _machine() -> dict:
  return {"cpu": machine.cpu_model(), "cpu_count": os.cpu_count(),
          "memory_gib": round(os.sysconf("SC_PAGE_SIZE") *
                              os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
          "avx512_vnni": "avx512_vnni" in machine.cpu_flags(),
          "platform": platform.platform(),
          "python": platform.python_version(),
          "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
          "load_average_at_start": machine.load_average()}


def _summarize(strategy_name: str, pairs) -> dict:
  sides = list(pairs[0])
  summary = {"strategy": strategy_name, "pairs": pairs, "sides": {}}
  for side in sides:
    runs = [p[side] for p in pairs]
    summary["sides"][side] = {
        key: statistics.median(r[key] for r in runs)
        for key in ("examples_per_second", "user_ms_per_step",
                    "system_ms_per_step", "main_thread_ms_per_step",
                    "minor_faults_per_step", "peak_rss_mib")}
  summary["ratios"] = {}
  summary["cpu_ratios"] = {}
  cpu = lambda r: r["user_ms_per_step"] + r["system_ms_per_step"]
  for base in [s for s in sides if s != "tfdist"]:
    summary["ratios"][f"tfdist/{base}"] = _spread(
        [p["tfdist"]["examples_per_second"] / p[base]["examples_per_second"]
         for p in pairs])
    # CPU time per step, base over tfdist (> 1: tfdist spends less).
    summary["cpu_ratios"][f"tfdist/{base}"] = _spread(
        [cpu(p[base]) / cpu(p["tfdist"]) for p in pairs])
  return summary


def _print_summary(summary: dict):
  name = summary["strategy"]
  print(f"\n== {name} ==")
  for title, ratios in (("throughput", summary["ratios"]),
                        ("CPU per step (base/tfdist)", summary["cpu_ratios"])):
    print(f"{title}:")
    for key, ratio in ratios.items():
      values = " ".join(f"{v:.3f}" for v in ratio["values"])
      print(f"  {key:<20} median {ratio['median']:.3f}  spread "
            f"{ratio['min']:.3f}..{ratio['max']:.3f}  pairs: {values}")
  print(f"{'side':<13} {'examples/s':>10} {'user ms':>8} {'sys ms':>7} "
        f"{'main ms':>7} {'faults/step':>11} {'peak RSS MiB':>12}   "
        "(medians)")
  for side, m in summary["sides"].items():
    print(f"{side:<13} {m['examples_per_second']:>10.1f} "
          f"{m['user_ms_per_step']:>8.1f} {m['system_ms_per_step']:>7.1f} "
          f"{m['main_thread_ms_per_step']:>7.2f} "
          f"{m['minor_faults_per_step']:>11.0f} {m['peak_rss_mib']:>12.0f}")


def main(argv):
  del argv
  if FLAGS.child:
    result = run_child(FLAGS.child, FLAGS.child_strategy,
                       FLAGS.child_train_files.split(","),
                       FLAGS.child_eval_files.split(","))
    print(_RESULT_PREFIX + json.dumps(result), flush=True)
    return
  sides = list(FLAGS.sides)
  unknown = sorted(set(sides) - set(SIDES))
  if unknown or not {"keras", "tfdist"} <= set(sides):
    raise app.UsageError(f"--sides={','.join(sides)}: use sides from "
                         f"{', '.join(SIDES)}, including keras and tfdist.")
  bad = sorted(set(FLAGS.strategies) - set(STRATEGIES))
  if bad:
    raise app.UsageError(f"--strategies: unknown {', '.join(bad)}; use "
                         f"{', '.join(STRATEGIES)}.")
  train_files, eval_files = _data_files()
  if FLAGS.input_only:
    per_batch = input_cpu(train_files)
    ratios = [k / t for k, t in zip(per_batch["keras"], per_batch["tfdist"])]
    print(f"CPU per batch, keras / tfdist: median "
          f"{statistics.median(ratios):.3f} ({min(ratios):.3f}.."
          f"{max(ratios):.3f}); medians keras "
          f"{statistics.median(per_batch['keras']):.3f} ms, tfdist "
          f"{statistics.median(per_batch['tfdist']):.3f} ms")
    machine.write_json(FLAGS.output, {
        "machine": _machine(), "input_cpu_ms_per_batch": per_batch,
        "cpu_ratio": _spread(ratios), "batches": FLAGS.input_only}, indent=2)
    return
  if FLAGS.op_counts:
    counts = op_counts(train_files)
    _print_op_counts(counts)
    machine.write_json(FLAGS.output, {"machine": _machine(),
                                      "op_counts": counts}, indent=2)
    return
  started = time.time()
  record = {"machine": _machine(), "settings": {
      "model": "cnn", "dataset": "fashion_mnist",
      "global_batch_size": FLAGS.batch_size, "steps": FLAGS.steps,
      "warmup_steps": FLAGS.warmup_steps, "pairs": FLAGS.pairs,
      "steps_per_execution": FLAGS.steps_per_execution,
      "optimizer": f"SGD({FLAGS.learning_rate}, momentum={FLAGS.momentum})",
      "sides": sides}, "results": []}
  for strategy_name in FLAGS.strategies:
    pairs = []
    for i in range(FLAGS.pairs):
      order = sides if i % 2 == 0 else sides[::-1]
      pair = {}
      for side in order:
        pair[side] = _launch(side, strategy_name, train_files, eval_files)
        r = pair[side]
        print(f"[{strategy_name} pair {i + 1}/{FLAGS.pairs}] {side:<12} "
              f"{r['examples_per_second']:8.1f} examples/s  "
              f"{r['user_ms_per_step']:6.1f} user ms  "
              f"{r['system_ms_per_step']:6.1f} sys ms  "
              f"{r['main_thread_ms_per_step']:5.2f} main ms  "
              f"{r['minor_faults_per_step']:8.0f} faults/step", flush=True)
      pairs.append({side: pair[side] for side in sides})
    summary = _summarize(strategy_name, pairs)
    record["results"].append(summary)
    _print_summary(summary)
  record["machine"]["load_average_at_end"] = machine.load_average()
  record["wall_seconds"] = time.time() - started
  machine.write_json(FLAGS.output, record, indent=2)
  print(f"{record['wall_seconds'] / 60:.1f} min.")


if __name__ == "__main__":
  app.run(main)
