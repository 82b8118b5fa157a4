"""`python -m tests.faults_testlib <tfdist.train flags> --block_at_step=N`.

tfdist's own binary (`tfdist.train.main`) with one Keras callback that makes
a step slow on purpose: when the global step reaches N, the next step
begins by waiting on an empty TensorFlow queue. The wait is in TensorFlow's
C++ runtime, so the main thread never returns to the Python interpreter and
no Python signal handler can run, as during a long first-step trace. Before
it blocks it prints `faults_testlib: blocking at step N` (flushed).
"""

import functools

from absl import app
from absl import flags

from tfdist import train  # First: it imports TensorFlow quietly.

import keras  # pylint: disable=g-bad-import-order,wrong-import-order
import tensorflow as tf  # pylint: disable=g-bad-import-order,wrong-import-order

flags.DEFINE_integer("block_at_step", -1,
                     "Block in C++ before the step after this one (< 0: "
                     "never).")
FLAGS = flags.FLAGS


class BlockInCpp(keras.callbacks.Callback):
  """Blocks the main thread inside TensorFlow at a given global step."""

  def __init__(self, step: int):
    super().__init__()
    self.step = step

  def on_train_batch_begin(self, batch, logs=None):
    del batch, logs  # Unused.
    if int(self.model.optimizer.iterations.numpy()) == self.step:
      print(f"faults_testlib: blocking at step {self.step}", flush=True)
      tf.queue.FIFOQueue(1, tf.int32).dequeue()  # Never returns.


def main(argv):
  callbacks = []
  if FLAGS.block_at_step >= 0:
    callbacks.append(BlockInCpp(FLAGS.block_at_step))
  train.main(argv, callbacks=callbacks)


if __name__ == "__main__":
  app.run(functools.partial(main))
