"""What the input position costs: checkpoint bytes and resume time.

Not a test: it prints figures and writes JSON. On Fashion-MNIST's 60,000
training images (tfdist's converted shards) with tfdist's training
pipeline (cache on, `--shuffle_buffer_size` 10,000, one worker, global
batch `--global_batch_size`), it measures

* what tfdist's input position adds to a checkpoint of the `cnn` with its
  optimizer: the checkpoint's bytes with and without `InputPosition` (the
  layout as JSON; each worker recomputes its position from the step);
* what the alternative, saving the tf.data iterator in the checkpoint
  (`tf.train.Checkpoint(iterator=...)`), would add: the iterator's
  checkpoint bytes early in the first epoch (the cache still filling),
  after one whole epoch (the cache full), with the default shuffle buffer
  and without a cache; under MultiWorkerMirrored each worker would have to
  write its own (its shard's) to a place of its own;
* what recomputing the position costs at resume: seconds to the first
  batch when the pipeline starts at the first step of an epoch, and at
  steps in the middle and at the end of one (it skips the examples the
  earlier steps of that epoch used), with a fresh cache as after a restart.

Usage:
  python benchmarks/input_position_benchmark.py --out=/tmp/input_position.json
"""

import json
import os
import platform
import sys
import tempfile
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

FLAGS = flags.FLAGS
flags.DEFINE_integer("global_batch_size", 256, "Examples per update.")
flags.DEFINE_string("data_dir", "", "Where Fashion-MNIST TFRecords live "
                    "(default: tfdist's).")
flags.DEFINE_string("out", "", "Write the figures here as JSON.")


def _bytes(prefix: str) -> int:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return sum(tf.io.gfile.stat(p).length for p in tf.io.gfile.glob(
      prefix + ".*"))


def main(argv):
  del argv
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  from tfdist import models  # pylint: disable=g-import-not-at-top
  from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
  from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
  from tfdist.training.state import checkpointing  # pylint: disable=g-import-not-at-top
  spec = datasets.get_dataset_spec("fashion_mnist")
  train_glob, _ = spec.prepare(FLAGS.data_dir or os.path.expanduser(
      "~/.cache/tfdist/datasets"), "")
  files = input_pipeline.list_files(train_glob)
  counts = input_pipeline.count_records_per_file(files)
  batch = FLAGS.global_batch_size
  steps_per_epoch = sum(counts) // batch
  out = tempfile.mkdtemp()
  report = {"examples": sum(counts), "files": len(files),
            "global_batch_size": batch, "steps_per_epoch": steps_per_epoch,
            "machine": {"cpus": os.cpu_count(),
                        "platform": platform.platform()}}

  def options(**changes):
    base = dict(files=files, parse_fn=spec.parse_fn, global_batch_size=batch,
                is_training=True, seed=42, deterministic=True,
                file_record_counts=counts)
    base.update(changes)
    return input_pipeline.PipelineOptions(**base)

  # 1. tfdist's position: the layout in the checkpoint.
  model = models.build_model("cnn", spec=spec)
  optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
  optimizer.build(model.trainable_variables)
  layout = input_pipeline.input_layout(
      files=files, file_record_counts=counts, num_input_pipelines=1,
      global_batch_size=batch, seed=42, shuffle_buffer_size=10_000,
      cache=True)
  plain = tf.train.Checkpoint(model=model, optimizer=optimizer)
  with_position = tf.train.Checkpoint(model=model, optimizer=optimizer)
  with_position.input_position = checkpointing.InputPosition(
      layout, steps_per_epoch=steps_per_epoch)
  sizes = {name: _bytes(ckpt.write(os.path.join(out, name)))
           for name, ckpt in (("plain", plain),
                              ("with_position", with_position))}
  report["tfdist_position"] = {
      "checkpoint_bytes": sizes["plain"],
      "added_bytes": sizes["with_position"] - sizes["plain"],
      "layout_json_bytes": len(json.dumps(layout, sort_keys=True))}

  # 2. The alternative: the iterator in the checkpoint. tfdist's own
  # pipeline cannot be saved so (its per-epoch shuffle seeds make tf.data
  # refuse: a stateful seed generator); measured on the same stages as
  # tfdist's pipeline had before (interleave, parse, cache, shuffle with
  # reshuffling, repeat, batch, prefetch), which tf.data can save.
  try:
    iterator = iter(input_pipeline.make_dataset(options()))
    next(iterator)
    tf.train.Checkpoint(iterator=iterator).write(os.path.join(out, "own"))
    report["tfdist_pipeline_iterator_saveable"] = True
  except tf.errors.FailedPreconditionError as e:
    report["tfdist_pipeline_iterator_saveable"] = (
        f"{type(e).__name__}: {str(e).split('}}')[-1].split('[')[0].strip()}")

  def classic(cache, shuffle=10_000):
    ds = tf.data.Dataset.from_tensor_slices(files).interleave(
        lambda f: tf.data.TFRecordDataset(f, compression_type="GZIP"),
        cycle_length=8, num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True).map(spec.parse_fn,
                                num_parallel_calls=tf.data.AUTOTUNE)
    if cache:
      ds = ds.cache()
    return ds.shuffle(shuffle, seed=42).repeat().batch(
        batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

  def iterator_bytes(name, steps, cache):
    iterator = iter(classic(cache))
    for _ in range(steps):
      next(iterator)
    prefix = tf.train.Checkpoint(iterator=iterator).write(
        os.path.join(out, name))
    return _bytes(prefix)

  early = 20
  report["iterator_checkpoint_bytes"] = {
      f"cache_and_shuffle_after_{early}_steps": iterator_bytes(
          "early", early, True),
      f"cache_and_shuffle_after_{steps_per_epoch + 1}_steps_one_epoch":
          iterator_bytes("epoch", steps_per_epoch + 1, True),
      f"shuffle_only_no_cache_after_{early}_steps": iterator_bytes(
          "nocache", early, False),
  }

  # 3. Resume time: seconds to the first batch (fresh pipeline and cache).
  def first_batch_seconds(start_step):
    started = time.perf_counter()
    next(iter(input_pipeline.make_dataset(options(start_step=start_step))))
    return time.perf_counter() - started

  report["seconds_to_first_batch"] = {
      f"step_{s}": first_batch_seconds(s)
      for s in (steps_per_epoch, steps_per_epoch + steps_per_epoch // 2,
                2 * steps_per_epoch - 1)}

  mib = lambda b: b / 2**20
  pos = report["tfdist_position"]
  print(f"Fashion-MNIST: {report['examples']} training examples in "
        f"{len(files)} files, global batch {batch}, {steps_per_epoch} steps "
        "per epoch, cache on, shuffle buffer 10000")
  print(f"tfdist's input position adds {pos['added_bytes']} bytes to a "
        f"{mib(pos['checkpoint_bytes']):.1f} MiB checkpoint (cnn + SGD "
        "momentum)")
  print("tfdist's pipeline saved as an iterator: "
        f"{report['tfdist_pipeline_iterator_saveable']}")
  for name, size in report["iterator_checkpoint_bytes"].items():
    print(f"iterator in the checkpoint, {name}: {mib(size):.1f} MiB")
  for name, seconds in report["seconds_to_first_batch"].items():
    print(f"resume at {name}: first batch after {seconds:.2f} s")
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  app.run(main)
