"""Tests for tfdist.training.step.step_runner: the `StepRunner` protocol, its
outputs, a real `LocalStepRunner` over a one-device `Trainer`, and the lost-task
errors.

The coordinator runner needs a cluster; `tests/controller_test.py` runs it
on an in-process one.
"""

import os
from unittest import mock

from absl.testing import absltest
import keras
import numpy as np
import tensorflow as tf

from tests import testutil
from tfdist import errors
from tfdist.distribute import parameter_server
from tfdist.training.step import step_runner
from tfdist.training.step.train_loop import Trainer


def _trainer(steps_per_execution=2):
  strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
  return Trainer(strategy=strategy, model=model, optimizer=optimizer,
                 global_batch_size=8, steps_per_execution=steps_per_execution)


def _data(trainer):
  rng = np.random.RandomState(0)
  dataset = tf.data.Dataset.from_tensor_slices(
      (rng.rand(64, 4).astype(np.float32),
       rng.randint(0, 3, 64).astype(np.int64))).repeat().batch(8)
  return trainer.strategy.experimental_distribute_dataset(dataset)


class StepOutputTest(absltest.TestCase):

  def test_signals_are_split_from_the_metric_sums(self):
    output = step_runner.StepOutput.from_sums({
        "loss": np.float64(3.0), "count": np.float64(16.0),
        "micro_steps": np.float64(2.0), "stop_signal": np.float64(1.0),
        "stop_training": np.float64(0.0), "skipped_steps": np.float64(2.0),
        "skipped_steps_at_end": np.float64(1.0)})
    self.assertEqual(sorted(output.sums), ["count", "loss", "micro_steps"])
    self.assertEqual(output.signals, step_runner.StepSignals(
        stop_signal=True, stop_training=False, skipped_steps=2.0,
        skipped_steps_at_end=1.0))

  def test_missing_signals_are_false_or_zero(self):
    output = step_runner.StepOutput.from_sums({"loss": np.float64(1.0)})
    self.assertEqual(output.signals, step_runner.StepSignals())
    self.assertFalse(output.signals.stop_signal)

  def test_the_protocol_needs_run(self):
    with self.assertRaises(TypeError):
      step_runner.StepRunner()  # pylint: disable=abstract-class-instantiated


class LocalStepRunnerTest(absltest.TestCase):

  def test_runs_the_steps_and_returns_their_sums(self):
    trainer = _trainer()
    runner = step_runner.LocalStepRunner(trainer=trainer,
                                         iterator=iter(_data(trainer)))
    self.assertIsInstance(runner, step_runner.StepRunner)
    self.assertEqual(runner.max_steps_per_call, 2)
    output = runner.run(2, start_step=0)
    self.assertEqual(int(trainer.global_step.numpy()), 2)
    self.assertEqual(float(output.sums["count"]), 16.0)
    self.assertTrue(np.isfinite(output.sums["loss"]))
    self.assertEqual(output.signals, step_runner.StepSignals())

  def test_stop_requests_come_back_as_signals(self):
    trainer = _trainer()
    runner = step_runner.LocalStepRunner(trainer=trainer,
                                         iterator=iter(_data(trainer)))
    output = runner.run(1, start_step=0, stop_signal=True)
    self.assertTrue(output.signals.stop_signal)
    self.assertFalse(output.signals.stop_training)
    output = runner.run(1, start_step=1, stop_training=True)
    self.assertEqual((output.signals.stop_signal,
                      output.signals.stop_training), (False, True))
    self.assertNotIn("stop_signal", output.sums)
    # The arguments of each value are made once and reused: a request
    # seen before comes back again, and none after it is none.
    output = runner.run(1, start_step=2, stop_signal=True)
    self.assertEqual((output.signals.stop_signal,
                      output.signals.stop_training), (True, False))
    output = runner.run(1, start_step=3)
    self.assertEqual(output.signals, step_runner.StepSignals())

  def test_iterator_fn_gets_the_first_start_step(self):
    trainer = _trainer()
    asked = []

    def iterator_fn(start_step):
      asked.append(start_step)
      return iter(_data(trainer))

    runner = step_runner.LocalStepRunner(trainer=trainer,
                                         iterator_fn=iterator_fn)
    trainer.global_step.assign(4)
    runner.run(1, start_step=4)
    runner.run(1, start_step=5)
    self.assertEqual(asked, [4])

  def test_takes_exactly_one_input(self):
    trainer = _trainer()
    with self.assertRaisesRegex(ValueError, "one of iterator and iterator_fn"):
      step_runner.LocalStepRunner(trainer=trainer)

  def test_one_worker_agrees_with_itself(self):
    trainer = _trainer()
    runner = step_runner.LocalStepRunner(trainer=trainer,
                                         iterator=iter(_data(trainer)))
    self.assertTrue(runner.agree(True))
    self.assertFalse(runner.agree(False))


class CoordinatorRereadTest(absltest.TestCase):
  """After a divergence, the parameter-server coordinator reads the input
  again (unshuffled) to name NaN or infinite values in it."""

  def _runner(self, reread_fn, batches=10):
    return step_runner.CoordinatorStepRunner(
        trainer=None, coordinator=None, iterator=None, reread_fn=reread_fn,
        reread_batches=batches)

  def test_names_the_batch_and_rows_of_a_nan_feature(self):
    x = np.zeros((12, 2), "float32")
    x[9, 1] = np.nan
    data = tf.data.Dataset.from_tensor_slices((x, np.zeros(12))).batch(4)
    self.assertEqual(
        self._runner(lambda: data).nonfinite_input(24, 36),
        "the training input holds 1 NaN in its features (rows [1] of "
        "replica 0's batch) in batch 2 of an unshuffled read "
        "(parameter-server workers' batches are not matched to steps)")

  def test_reads_at_most_reread_batches(self):
    x = np.zeros((12, 1), "float32")
    x[9] = np.inf
    data = tf.data.Dataset.from_tensor_slices((x, np.zeros(12))).batch(4)
    self.assertIsNone(self._runner(lambda: data, batches=2).nonfinite_input(
        None, 3))
    self.assertIn("1 infinite in its features", self._runner(
        lambda: data, batches=3).nonfinite_input(None, 3))

  def test_finite_or_unreadable_input_is_not_named(self):
    data = tf.data.Dataset.from_tensor_slices((np.ones((8, 1), "float32"),
                                               np.ones(8))).batch(4)
    self.assertIsNone(self._runner(lambda: data).nonfinite_input(0, 2))
    self.assertIsNone(self._runner(None).nonfinite_input(0, 2))

    def unreadable():
      raise OSError("gone")
    with self.assertLogs(level="WARNING") as logs:
      self.assertIsNone(self._runner(unreadable).nonfinite_input(0, 2))
    self.assertIn("Could not read the training input again", logs.output[0])


class LostTaskTest(absltest.TestCase):

  def test_lost_tasks_reads_the_heartbeat_list(self):
    error = tf.errors.UnavailableError(
        None, None, "from /job:worker/replica:0/task:0: tasks stopped "
        "sending heartbeats: /job:worker/replica:0/task:2 "
        "/job:worker/replica:0/task:1")
    self.assertEqual(step_runner.lost_tasks(error, own=("worker", 0)),
                     [("worker", 2), ("worker", 1)])

  def test_peer_lost_error_names_the_address_and_the_checkpoint(self):
    error = step_runner.peer_lost_error(
        tf.errors.UnavailableError(None, None, "/job:worker/task:1 gone"),
        after="step 40", last_checkpoint="/m/ckpt-40", own=("worker", 0),
        addresses={"worker": ["h0:1", "h1:2"]})
    self.assertIsInstance(error, errors.PeerLostError)
    self.assertIn("lost worker 1 at h1:2 after step 40", str(error))
    self.assertIn("/m/ckpt-40", str(error))

  def test_peer_lost_error_names_the_launchers_failed_task(self):
    # Under tfdist.launch, the lost task's exit status as the launcher saw
    # it (before: the chief's error named the task, not its status).
    from tfdist.distribute import worker_exit  # pylint: disable=g-import-not-at-top
    path = os.path.join(testutil.scratch_dir(), "lost-tasks")
    worker_exit.write_lost_peers(path, "worker:1 exited with status 137")
    with mock.patch.dict(os.environ, {worker_exit.LOST_FILE_ENV: path}):
      error = step_runner.peer_lost_error(
          tf.errors.UnavailableError(None, None, "/job:worker/task:1 gone"),
          after="step 40", last_checkpoint=None, own=("worker", 0),
          addresses={"worker": ["h0:1", "h1:2"]})
    self.assertIn("lost worker 1 at h1:2 (tfdist.launch: worker:1 exited "
                  "with status 137) after step 40", str(error))
    # Without the launcher's word: as before, after at most the wait.
    self.assertIsNone(worker_exit.lost_peers_note(
        wait_seconds=0.1, path=path + "-none"))

  def test_ps_lost_error_is_a_parameter_server_error(self):
    error = step_runner.ps_lost_error(
        tf.errors.UnavailableError(None, None, "ps down"), after="step 3",
        last_checkpoint=None)
    self.assertIsInstance(error, errors.ParameterServerError)
    self.assertIn("none yet (from step 0)", str(error))


if __name__ == "__main__":
  absltest.main()
