"""`python -m tests.callback_testlib <tfdist.train flags> [test flags]`.

tfdist's own binary (`tfdist.train.main`) with Keras callbacks added, as a
user's wrapper binary would add them: a recorder that appends every hook it
sees to `--events_file` (one JSON line each, tagged with the task), and,
with `--early_stopping_patience=N`, `keras.callbacks.EarlyStopping`.
Started directly or by `tfdist.launch --module=tests.callback_testlib`.
"""

import functools
import json
import os

from absl import app
from absl import flags
import keras

from tfdist import train

flags.DEFINE_string("events_file", "", "Append callback events here.")
flags.DEFINE_integer("early_stopping_patience", -1,
                     "Add EarlyStopping(monitor='loss', min_delta=10, "
                     "patience=N) when >= 0.")
FLAGS = flags.FLAGS


class Recorder(keras.callbacks.Callback):
  """Appends each hook's name, epoch and log keys to a file."""

  def __init__(self, path: str):
    super().__init__()
    self.path = path
    tf_config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    task = tf_config.get("task", {})
    self.task = f"{task.get('type', 'chief')}:{task.get('index', 0)}"

  def _write(self, **event):
    with open(self.path, "a") as f:
      f.write(json.dumps({"task": self.task, **event}) + "\n")

  def on_train_begin(self, logs=None):
    self._write(hook="train_begin", params=self.params)

  def on_epoch_end(self, epoch, logs=None):
    self._write(hook="epoch_end", epoch=epoch, logs=sorted(logs or {}),
                stop_training=bool(self.model.stop_training))

  def on_train_end(self, logs=None):
    self._write(hook="train_end")


def main(argv):
  callbacks = []
  if FLAGS.events_file:
    callbacks.append(Recorder(FLAGS.events_file))
  if FLAGS.early_stopping_patience >= 0:
    callbacks.append(keras.callbacks.EarlyStopping(
        monitor="loss", min_delta=10.0,
        patience=FLAGS.early_stopping_patience))
  train.main(argv, callbacks=callbacks)


if __name__ == "__main__":
  app.run(functools.partial(main))
