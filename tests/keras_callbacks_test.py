"""Tests for tfdist.training.state.keras_callbacks: refused callbacks, per-task
copies, callback lists and which callbacks read batch metrics."""

import os
import tempfile

from absl.testing import absltest
import keras

from tfdist import errors
from tfdist.training.state import keras_callbacks


class CheckCallbacksTest(absltest.TestCase):

  def test_refuses_backup_and_restore_with_the_alternative(self):
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"BackupAndRestore is not supported.*Instead, drop it: "
        "rerun with the same --model_dir"):
      keras_callbacks.check_callbacks(
          [keras.callbacks.BackupAndRestore(backup_dir="/tmp/unused")])

  def test_refuses_swap_ema_weights(self):
    with self.assertRaisesRegex(errors.ConfigError, "SwapEMAWeights"):
      keras_callbacks.check_callbacks([keras.callbacks.SwapEMAWeights()])

  def test_accepts_the_others(self):
    keras_callbacks.check_callbacks([keras.callbacks.EarlyStopping(),
                                     keras.callbacks.TerminateOnNaN()])

  def test_refuses_whole_model_checkpoints_and_keeps_weights_files(self):
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"ModelCheckpoint\(filepath='/unused/m.keras'\) saves "
        r"whole .keras models, and is not supported: .*records the optimizer "
        r"the model was compiled with.*a filepath ending in .weights.h5"):
      keras_callbacks.check_callbacks(
          [keras.callbacks.ModelCheckpoint("/unused/m.keras")])
    keras_callbacks.check_callbacks([
        keras.callbacks.ModelCheckpoint("/unused/m.weights.h5",
                                        save_weights_only=True),
        keras.callbacks.ModelCheckpoint("/unused/w.weights.h5")])

  def test_refuses_what_a_callback_list_holds(self):
    with self.assertRaisesRegex(errors.ConfigError, "SwapEMAWeights"):
      keras_callbacks.check_callbacks([keras.callbacks.CallbackList(
          [keras.callbacks.History(), keras.callbacks.SwapEMAWeights()])])

  @absltest.skipUnless(hasattr(keras.callbacks, "OrbaxCheckpoint"),
                       "Keras < 3.13 has no OrbaxCheckpoint")
  def test_refuses_orbax_checkpoint(self):
    cls = keras.callbacks.OrbaxCheckpoint
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"OrbaxCheckpoint is not supported: it would save the "
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


class CallbackStateTest(absltest.TestCase):
  """`tfdist.training.state.callback_state`: the callbacks' state through a real
  `tf.train.Checkpoint` save and restore."""

  def _round_trip(self, before, after):
    """Saves `before`'s state, restores it for `after` (fresh callbacks of
    a resumed run, after their `on_train_begin`); returns `apply`'s keys."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdist.training.state import callback_state  # pylint: disable=g-import-not-at-top
    prefix = os.path.join(tempfile.mkdtemp(), "ckpt")
    saved = tf.train.Checkpoint()
    self.assertIsNotNone(callback_state.attach(saved, before))
    path = saved.save(prefix)
    restored = tf.train.Checkpoint()
    state = callback_state.attach(restored, after)
    restored.restore(path).assert_existing_objects_matched()
    for callback in after:
      callback.on_train_begin()
    return state.apply()

  def test_keras_callbacks_and_best_weights_come_back(self):
    import numpy as np  # pylint: disable=g-import-not-at-top
    early = keras.callbacks.EarlyStopping(restore_best_weights=True)
    early.on_train_begin()
    early.best, early.wait, early.best_epoch = 0.25, 2, 3
    early.best_weights = [np.arange(6, dtype="float32").reshape(2, 3),
                          np.float32(7)]
    plateau = keras.callbacks.ReduceLROnPlateau(cooldown=2)
    plateau.best, plateau.wait, plateau.cooldown_counter = 0.5, 1, 2
    checkpoint = keras.callbacks.ModelCheckpoint(
        os.path.join(tempfile.mkdtemp(), "w.weights.h5"),
        save_best_only=True)
    checkpoint.best = float("inf")
    fresh = [keras.callbacks.EarlyStopping(restore_best_weights=True),
             keras.callbacks.ReduceLROnPlateau(cooldown=2),
             keras.callbacks.ModelCheckpoint(checkpoint.filepath,
                                             save_best_only=True)]
    self.assertEqual(self._round_trip([early, plateau, checkpoint], fresh),
                     ["0-EarlyStopping", "1-ReduceLROnPlateau",
                      "2-ModelCheckpoint"])
    self.assertEqual((fresh[0].best, fresh[0].wait, fresh[0].best_epoch),
                     (0.25, 2, 3))
    self.assertLen(fresh[0].best_weights, 2)
    np.testing.assert_array_equal(fresh[0].best_weights[0],
                                  early.best_weights[0])
    self.assertEqual(float(fresh[0].best_weights[1]), 7.0)
    self.assertEqual((fresh[1].best, fresh[1].wait,
                      fresh[1].cooldown_counter), (0.5, 1, 2))
    self.assertEqual(fresh[2].best, float("inf"))

  def test_a_callback_with_the_hook_gets_its_state_back(self):

    class Counter(keras.callbacks.Callback):

      def __init__(self, seen=0):
        super().__init__()
        self.seen = seen

      def get_state(self):
        return {"seen": self.seen}

      def set_state(self, state):
        self.seen = state["seen"]

    fresh = Counter()
    self.assertEqual(self._round_trip([Counter(5)], [fresh]), ["0-Counter"])
    self.assertEqual(fresh.seen, 5)

  def test_a_hook_returning_what_json_cannot_hold_fails_before_a_step(self):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdist.training.state import callback_state  # pylint: disable=g-import-not-at-top

    class Bad(keras.callbacks.Callback):

      def get_state(self):
        return {"when": object()}

      def set_state(self, state):
        pass

    state = callback_state.attach(tf.train.Checkpoint(), [Bad()])
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"callbacks: Bad.get_state\(\) returned a dict JSON "
        r"cannot hold .*Instead, return numbers"):
      callback_state.after_train_begin(state, [Bad()], resumed=False)

  def test_no_stateful_callback_adds_nothing_to_the_checkpoint(self):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdist.training.state import callback_state  # pylint: disable=g-import-not-at-top
    checkpoint = tf.train.Checkpoint()
    self.assertIsNone(callback_state.attach(
        checkpoint, [keras.callbacks.TerminateOnNaN()]))
    self.assertFalse(hasattr(checkpoint, callback_state.PART))

  def test_state_that_is_lost_is_named(self):
    from tfdist.training.state import callback_state  # pylint: disable=g-import-not-at-top

    class Mine(keras.callbacks.Callback):

      def __init__(self):
        super().__init__()
        self.total = 0

    lost = callback_state.unkept_warnings([
        keras.callbacks.CSVLogger("/unused/log.csv"),
        keras.callbacks.CSVLogger("/unused/log.csv", append=True),
        keras.callbacks.TensorBoard("/unused/tb", update_freq=10),
        keras.callbacks.TerminateOnNaN(), Mine()])
    self.assertLen(lost, 3)
    self.assertRegex(lost[0], r"CSVLogger\(filename='/unused/log.csv', "
                     r"append=False\) .*pass append=True")
    self.assertRegex(lost[1], r"TensorBoard\(update_freq=10\)")
    self.assertRegex(lost[2], r"Mine \(attributes total\) has no "
                     r"get_state\(\)/set_state\(\) hook")

  def test_the_guides_hook_example_keeps_its_state(self):
    # The block of docs/guides/fit-conformance.md marked
    # callback_state_hook, as written.
    import re  # pylint: disable=g-import-not-at-top
    from tests import testutil  # pylint: disable=g-import-not-at-top
    path = os.path.join(testutil.REPO_ROOT, "docs", "guides",
                        "fit-conformance.md")
    with open(path, encoding="utf-8") as f:
      blocks = re.findall(r"^<!-- run: tests/keras_callbacks_test.py "
                          r"callback_state_hook -->\n```py\n(.*?)^```$",
                          f.read(), re.M | re.S)
    self.assertLen(blocks, 1)
    namespace = {}
    exec(blocks[0], namespace)  # pylint: disable=exec-used
    before = namespace["BestSoFar"]()
    before.on_train_begin()
    for epoch, loss in enumerate((0.5, 0.4, 0.45)):
      before.on_epoch_end(epoch, {"val_loss": loss})
    after = namespace["BestSoFar"]()
    self.assertEqual(self._round_trip([before], [after]), ["0-BestSoFar"])
    self.assertEqual((after.best, after.improved), (0.4, 2))
