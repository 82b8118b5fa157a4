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


def main(argv):
  if FLAGS.ids_file:
    record_example_ids(FLAGS.ids_file)
  train.main(argv)


if __name__ == "__main__":
  app.run(main)
