"""`python -m tests.input_position_testlib <tfdist.train flags> --ids_file=P`.

tfdist's own binary (`tfdist.train.main`) with the training input's example
ids recorded: `record_example_ids(path)` wraps
`tfdist.data.input_pipeline.make_dataset` so that training datasets also parse
each Fashion-MNIST example's `id` (a third element of every batch, which
the trainer ignores: it takes `batch[:2]`) and append each per-replica
batch's ids, in the order the pipeline hands them out, as one JSON line to
`<path>.<task>` (`chief-0`, `worker-0`, or `single`). The pipeline runs
ahead of training (prefetching), so the batches training used are the
first `steps x local replicas x gradient_accumulation_steps` lines
(`consumed_ids`). Started directly or by
`tfdist.launch --module=tests.input_position_testlib`.
"""

import dataclasses
import functools
import json
import os
from typing import List

from absl import app
from absl import flags

from tfdist import train

flags.DEFINE_string("ids_file", "", "Record training example ids here "
                    "(one file per task: <ids_file>.<task>).")
FLAGS = flags.FLAGS

_PATH = [""]


def _task() -> str:
  task = json.loads(os.environ.get("TF_CONFIG") or "{}").get("task")
  return f"{task['type']}-{task['index']}" if task else "single"


def record_example_ids(path: str):
  """Training datasets built from now on record their ids under `path`
  (`path` "" stops recording)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.data import fashion_mnist  # pylint: disable=g-import-not-at-top
  from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
  _PATH[0] = path
  if getattr(input_pipeline.make_dataset, "records_ids", False):
    return
  make_dataset = input_pipeline.make_dataset

  @functools.wraps(make_dataset)
  def recording(options, input_context=None):
    if not options.is_training or not _PATH[0]:
      return make_dataset(options, input_context)
    out = f"{_PATH[0]}.{_task()}"
    options = dataclasses.replace(
        options, parse_fn=functools.partial(
            fashion_mnist.parse_image_example, with_id=True))

    def write(ids):
      with open(out, "a") as f:
        f.write(json.dumps(ids.numpy().tolist()) + "\n")
      return 0

    def tap(*batch):
      written = tf.py_function(write, [batch[2]], tf.int32)
      with tf.control_dependencies([written]):
        return tuple(tf.identity(t) for t in batch)

    # One element at a time: the lines keep the pipeline's order.
    return make_dataset(options, input_context).map(tap)

  recording.records_ids = True
  input_pipeline.make_dataset = recording


def consumed_ids(path: str, batches: int) -> List[List[int]]:
  """The first `batches` recorded batches of `path` (a task's file)."""
  with open(path) as f:
    lines = [json.loads(line) for line in f if line.strip()]
  if len(lines) < batches:
    raise AssertionError(f"{path}: {len(lines)} batches recorded, "
                         f"{batches} expected")
  return lines[:batches]


# The resumed runs of input_position_test (2 workers) and
# input_position_one_process_test (one device, Mirrored): run A trains
# STEPS steps uninterrupted (checkpoints every STOP steps), run B resumes
# from A's step-STOP checkpoint; 160 training examples, global batch 32:
# 5 steps per epoch.
LIMIT, BATCH, STEPS, STOP = 160, 32, 8, 3
TIMEOUT_S = 300
# With dropout (in its head): Keras 3 keeps a dropout layer's seed state out
# of the model's checkpoint, so tfdist saves it beside the model
# (`tfdist.training.step.train_loop.random_state`); without it a resumed run's
# masks differ from an uninterrupted run's and so do the weights.
MODEL = "cnn"


def compare_runs(test, ids_a, ids_b, weights: float, batches_per_step: int,
                 label: str):
  """Asserts that run B (`ids_b`: task -> its ids file) trained on run A's
  batches from step `STOP` on, each epoch using every example at most once
  across the restart, and ended with A's weights (`weights`: their largest
  relative difference, at most 1e-6)."""
  for task in ids_a:
    with test.subTest(label=label, task=task):
      a = consumed_ids(ids_a[task], STEPS * batches_per_step)
      b = consumed_ids(ids_b[task], (STEPS - STOP) * batches_per_step)
      test.assertEqual(b, a[STOP * batches_per_step:])
      # Each epoch of 5 steps used every example at most once, across the
      # restart too.
      resumed = a[:STOP * batches_per_step] + b
      per_epoch = 5 * batches_per_step
      for start in (0, per_epoch):
        epoch = [i for batch in resumed[start:start + per_epoch]
                 for i in batch]
        test.assertLen(set(epoch), len(epoch))
  test.assertLessEqual(weights, 1e-6, label)


def copy_checkpoint(src_dir: str, dst_dir: str, step: int):
  """`dst_dir/checkpoints` holding only `src_dir`'s checkpoint `step`, as a
  run stopped after `step` leaves it."""
  import glob  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  src, dst = (os.path.join(d, "checkpoints") for d in (src_dir, dst_dir))
  os.makedirs(dst)
  for path in glob.glob(os.path.join(src, f"ckpt-{step}.*")):
    shutil.copy(path, dst)
  with open(os.path.join(dst, "checkpoint"), "w") as f:
    f.write(f'model_checkpoint_path: "ckpt-{step}"\n'
            f'all_model_checkpoint_paths: "ckpt-{step}"\n')


def max_weight_difference(path_a: str, path_b: str) -> float:
  """Largest relative difference between two checkpoints' float variables
  (weights, optimizer slots, batch-norm statistics). A folder stands for
  its latest checkpoint."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  readers = [tf.train.load_checkpoint(
      tf.train.latest_checkpoint(os.path.join(p, "checkpoints"))
      if os.path.isdir(p) else p) for p in (path_a, path_b)]
  keys = [k for k, dtype in readers[0].get_variable_to_dtype_map().items()
          if dtype.is_floating]
  assert len(keys) > 10, keys
  return max(float(np.abs(readers[0].get_tensor(k) -
                          readers[1].get_tensor(k)).max() /
                   max(np.abs(readers[0].get_tensor(k)).max(), 1e-12))
             for k in keys)


def main(argv):
  if FLAGS.ids_file:
    record_example_ids(FLAGS.ids_file)
  train.main(argv)


if __name__ == "__main__":
  app.run(main)
