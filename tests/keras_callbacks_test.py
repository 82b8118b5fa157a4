"""Tests for tfdist.training.keras_callbacks: refused callbacks and per-task copies."""

import os
import tempfile

from absl.testing import absltest
import keras

from tfdist.config import ConfigError
from tfdist.training import keras_callbacks


class CheckCallbacksTest(absltest.TestCase):

  def test_refuses_backup_and_restore_with_the_alternative(self):
    with self.assertRaisesRegex(
        ConfigError, r"BackupAndRestore is not supported.*Instead, drop it: "
        "rerun with the same --model_dir"):
      keras_callbacks.check_callbacks(
          [keras.callbacks.BackupAndRestore(backup_dir="/tmp/unused")])

  def test_refuses_swap_ema_weights(self):
    with self.assertRaisesRegex(ConfigError, "SwapEMAWeights"):
      keras_callbacks.check_callbacks([keras.callbacks.SwapEMAWeights()])

  def test_accepts_the_others(self):
    keras_callbacks.check_callbacks([keras.callbacks.EarlyStopping(),
                                     keras.callbacks.TerminateOnNaN()])


class ForThisTaskTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    self.csv = keras.callbacks.CSVLogger(os.path.join(self.dir, "log.csv"))
    self.stopper = keras.callbacks.EarlyStopping()
    self.remote = keras.callbacks.RemoteMonitor()
    self.callbacks = [self.csv, self.stopper, self.remote]

  def test_the_chief_runs_every_callback_as_given(self):
    mine = keras_callbacks.for_this_task(self.callbacks, scratch_dir=None)
    self.assertEqual(mine, self.callbacks)
    self.assertIsNot(mine, self.callbacks)

  def test_another_worker_writes_into_its_scratch_folder(self):
    scratch = os.path.join(self.dir, "scratch")
    mine = keras_callbacks.for_this_task(self.callbacks, scratch_dir=scratch)
    self.assertLen(mine, 2)  # RemoteMonitor runs on the chief only.
    csv, stopper = mine
    folder = os.path.join(scratch, "callbacks", "0-CSVLogger")
    self.assertEqual(csv.filename, os.path.join(folder, "log.csv"))
    self.assertTrue(os.path.isdir(folder))
    self.assertEqual(self.csv.filename, os.path.join(self.dir, "log.csv"))
    self.assertIs(stopper, self.stopper)

  def test_a_folder_path_keeps_its_last_component(self):
    board = keras.callbacks.TensorBoard(log_dir=os.path.join(self.dir, "tb/"))
    (mine,) = keras_callbacks.for_this_task(
        [board], scratch_dir=os.path.join(self.dir, "scratch"))
    self.assertEqual(mine.log_dir, os.path.join(
        self.dir, "scratch", "callbacks", "0-TensorBoard", "tb"))


if __name__ == "__main__":
  absltest.main()
