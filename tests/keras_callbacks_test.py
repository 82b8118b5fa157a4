"""Tests for tfdist.training.keras_callbacks: refused callbacks, per-task
copies, callback lists and which callbacks read batch metrics."""

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

  def test_refuses_whole_model_checkpoints_and_keeps_weights_files(self):
    with self.assertRaisesRegex(
        ConfigError, r"ModelCheckpoint\(filepath='/unused/m.keras'\) saves "
        r"whole .keras models, and is not supported: .*records the optimizer "
        r"the model was compiled with.*a filepath ending in .weights.h5"):
      keras_callbacks.check_callbacks(
          [keras.callbacks.ModelCheckpoint("/unused/m.keras")])
    keras_callbacks.check_callbacks([
        keras.callbacks.ModelCheckpoint("/unused/m.weights.h5",
                                        save_weights_only=True),
        keras.callbacks.ModelCheckpoint("/unused/w.weights.h5")])

  def test_refuses_what_a_callback_list_holds(self):
    with self.assertRaisesRegex(ConfigError, "SwapEMAWeights"):
      keras_callbacks.check_callbacks([keras.callbacks.CallbackList(
          [keras.callbacks.History(), keras.callbacks.SwapEMAWeights()])])

  @absltest.skipUnless(hasattr(keras.callbacks, "OrbaxCheckpoint"),
                       "Keras < 3.13 has no OrbaxCheckpoint")
  def test_refuses_orbax_checkpoint(self):
    cls = keras.callbacks.OrbaxCheckpoint
    with self.assertRaisesRegex(
        ConfigError, r"OrbaxCheckpoint is not supported: it would save the "
        "model state from every process.*use keras.callbacks."
        "ModelCheckpoint"):
      # Its constructor needs the orbax package; the check reads the class.
      keras_callbacks.check_callbacks([cls.__new__(cls)])


class FlattenTest(absltest.TestCase):

  def test_callback_lists_are_opened_in_order(self):
    a, b, c = (keras.callbacks.History() for _ in range(3))
    self.assertEqual(keras_callbacks.flatten(keras.callbacks.CallbackList(
        [a, keras.callbacks.CallbackList([b]), c])), [a, b, c])
    self.assertEqual(keras_callbacks.flatten((a, b)), [a, b])


class ReadsBatchMetricsTest(absltest.TestCase):

  def test_only_batch_end_hooks_that_may_read_metrics(self):
    quiet = [keras.callbacks.History(), keras.callbacks.TerminateOnNaN(),
             keras.callbacks.EarlyStopping(),
             keras.callbacks.TensorBoard(log_dir="/unused"),
             keras.callbacks.ModelCheckpoint("/unused/m.keras"),
             keras.callbacks.LambdaCallback(on_epoch_end=print)]
    self.assertFalse(keras_callbacks.reads_batch_metrics(quiet))
    self.assertFalse(keras_callbacks.reads_batch_metrics(
        keras.callbacks.CallbackList(quiet)))

    class Mine(keras.callbacks.Callback):

      def on_batch_end(self, batch, logs=None):
        del batch, logs

    for reader in (keras.callbacks.LambdaCallback(on_train_batch_end=print),
                   keras.callbacks.ProgbarLogger(), Mine(),
                   keras.callbacks.TensorBoard(log_dir="/unused",
                                               update_freq="batch"),
                   keras.callbacks.ModelCheckpoint("/unused/m.keras",
                                                   save_freq=10)):
      with self.subTest(reader=type(reader).__name__):
        self.assertTrue(keras_callbacks.reads_batch_metrics(
            [*quiet, reader]))


  def test_hooks_not_defined_in_the_class_count_as_reading(self):
    # tfdist cannot see these hooks in the class: they must get every
    # metric (and may stop training), not the loss alone.

    class Dynamic(keras.callbacks.Callback):

      def __getattribute__(self, name):
        if name == "on_train_batch_end":
          return lambda batch, logs=None: None
        return super().__getattribute__(name)

    class MyTerminateOnNaN(keras.callbacks.TerminateOnNaN):

      def on_train_batch_end(self, batch, logs=None):
        del batch, logs

    on_the_instance = keras.callbacks.TerminateOnNaN()
    on_the_instance.on_batch_end = lambda batch, logs=None: None
    for reader in (Dynamic(), MyTerminateOnNaN(), on_the_instance):
      with self.subTest(reader=type(reader).__name__):
        self.assertTrue(keras_callbacks.reads_batch_metrics([reader]))
        self.assertTrue(keras_callbacks.may_stop_in_batch_hooks([reader]))
    self.assertFalse(keras_callbacks.may_stop_in_batch_hooks(
        [keras.callbacks.EarlyStopping(), keras.callbacks.Callback()]))


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

  def test_progress_bars_print_on_the_chief_only(self):
    bar = keras.callbacks.ProgbarLogger()
    (mine,) = keras_callbacks.for_this_task([bar], scratch_dir=None)
    # tfdist's params say verbose=0; Model.fit's default gives it 1.
    mine.set_params({"verbose": 0, "epochs": 2, "steps": 5})
    self.assertEqual((mine.verbose, mine.epochs, mine.target), (1, 2, 5))
    self.assertIsNot(mine, bar)
    self.assertEqual(keras_callbacks.for_this_task(
        [bar], scratch_dir=os.path.join(self.dir, "scratch")), [])

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
