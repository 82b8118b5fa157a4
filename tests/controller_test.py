"""Tests for tfdist.training.controller: the one outer loop, driven in milliseconds.

As Orbit's own controller test does, most tests drive the `Controller` with
a fake step runner (it only counts steps and returns sums), real checkpoints
on disk, real Keras callbacks and a real signal. Both real step runners are
then run under the same controller: `LocalStepRunner` over a one-device
`Trainer`, and `CoordinatorStepRunner` over an in-process parameter-server
cluster (a worker and a ps as `tf.distribute.Server`s on 127.0.0.1).
"""

import contextlib
import dataclasses
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile

from absl import logging as absl_logging
from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import portpicker
import tensorflow as tf

from tests import testutil
from tfdist import errors
from tfdist.observability import profiling
from tfdist.observability import run_log as run_log_lib
from tfdist.runtime import preemption
from tfdist.training.state import checkpointing
from tfdist.training import controller as controller_lib
from tfdist.training.step import step_runner
from tfdist.training.controller import Controller, ControllerOptions
from tfdist.training.step.train_loop import Trainer


class FakeRunner(step_runner.StepRunner):
  """Counts steps; each step's loss is `loss_at(step)`, accuracy 1/2."""

  def __init__(self, step: tf.Variable, *, max_steps_per_call=None,
               loss_at=lambda step: 1.0, on_step=None):
    self.step = step
    self.max_steps_per_call = max_steps_per_call
    self.loss_at = loss_at
    self.on_step = on_step
    self.calls = []
    self.agreed = []

  def agree(self, flag):
    self.agreed.append(flag)
    return flag

  def run(self, num_steps, *, start_step, stop_signal=False,
          stop_training=False):
    assert start_step == int(self.step.numpy())
    self.calls.append((start_step, num_steps))
    loss = sum(self.loss_at(start_step + i) for i in range(num_steps))
    self.step.assign_add(num_steps)
    if self.on_step:
      self.on_step(int(self.step.numpy()))
    return step_runner.StepOutput(
        sums={"loss": np.float64(loss), "correct": np.float64(num_steps),
              "count": np.float64(2 * num_steps)},
        signals=step_runner.StepSignals(stop_signal=stop_signal,
                                        stop_training=stop_training))


class ControllerTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    self.step = tf.Variable(0, dtype=tf.int64)
    self.evaluations = []

  def _controller(self, runner, *, total=20, per_epoch=10, log=5,
                  checkpoint_steps=0, callbacks=(), preemption_watcher=None,
                  evals_every=1, model=None, profiler=None, keeper=None,
                  train_actions=(), eval_actions=()):
    keeper = keeper or checkpointing.CheckpointKeeper(
        checkpoint=tf.train.Checkpoint(step=self.step),
        directory=os.path.join(self.dir, "checkpoints"),
        step_counter=self.step, max_to_keep=100)
    self.keeper = keeper
    self.log = run_log_lib.RunLog(
        tensorboard_dir=os.path.join(self.dir, "tb"), metrics_dir=self.dir,
        global_batch_size=2, total_steps=total, steps_per_epoch=per_epoch)

    def evaluate():
      self.evaluations.append(int(self.step.numpy()))
      return {"loss": 0.5, "accuracy": 0.75, "num_examples": 8}

    return Controller(
        runner=runner,
        options=ControllerOptions(total_steps=total, steps_per_epoch=per_epoch,
                                  log_steps=log,
                                  checkpoint_steps=checkpoint_steps,
                                  epochs_between_evals=evals_every),
        checkpoints=keeper, step_counter=self.step, run_log=self.log,
        evaluate=evaluate, model=model or keras.Sequential(),
        learning_rate=lambda: 0.1, callbacks=callbacks,
        preemption=preemption_watcher, profiler=profiler,
        train_actions=train_actions, eval_actions=eval_actions)

  def _saved_steps(self):
    state = tf.train.get_checkpoint_state(os.path.join(self.dir,
                                                       "checkpoints"))
    return [int(p.rsplit("-", 1)[1]) for p in
            state.all_model_checkpoint_paths] if state else []

  @parameterized.named_parameters(
      # A local runner runs at most steps_per_execution steps per call.
      ("local", 3, [(0, 3), (3, 2), (5, 3), (8, 2), (10, 3), (13, 2),
                    (15, 3), (18, 2)]),
      # A coordinator runner joins only at boundaries (log every 5 steps).
      ("coordinator", None, [(0, 5), (5, 5), (10, 5), (15, 5)]))
  def test_boundaries_are_hit_exactly(self, max_steps, calls):
    runner = FakeRunner(self.step, max_steps_per_call=max_steps)
    result = self._controller(runner).run()
    self.assertEqual(runner.calls, calls)
    self.assertEqual(result.step, 20)
    self.assertEqual([r["step"] for r in self.log.history], [5, 10, 15, 20])
    self.assertEqual(self.evaluations, [10, 20])  # Each epoch end.
    self.assertEqual(result.final_eval["step"], 20)

  def test_the_callers_actions_run_after_the_controllers_own(self):
    seen = []

    class EveryChunk(controller_lib.Action):
      """A user's action, defined outside tfdist."""

      def on_begin(self, progress):
        seen.append(("begin", progress.step))

      def boundaries(self, step):
        return (7,) if step < 7 else ()

      def __call__(self, chunk):
        # After the built-in actions: the log line and the checkpoint of
        # this chunk exist already, and the record holds their results.
        seen.append((chunk.step, chunk.saved is not None,
                     float(chunk.output.sums["loss"]),
                     chunk.evaluation and chunk.evaluation["step"]))

      def on_end(self, progress):
        seen.append(("end", progress.step, progress.last_eval["step"]))

    evaluated = []
    runner = FakeRunner(self.step)
    result = self._controller(
        runner, checkpoint_steps=10, train_actions=[EveryChunk()],
        eval_actions=[evaluated.append]).run()
    self.assertEqual(result.step, 20)
    # Its boundary (7) ends a chunk as the controller's own do.
    self.assertEqual([c for c in runner.calls], [(0, 5), (5, 2), (7, 3),
                                                 (10, 5), (15, 5)])
    self.assertEqual(seen, [("begin", 0), (5, False, 5.0, None),
                            (7, False, 2.0, None), (10, True, 3.0, 10),
                            (15, False, 5.0, None), (20, True, 5.0, 20),
                            ("end", 20, 20)])
    self.assertEqual([(r["step"], r["loss"]) for r in evaluated],
                     [(10, 0.5), (20, 0.5)])

  def test_actions_of_other_types_are_refused(self):
    with self.assertRaisesRegex(TypeError, "not a tfdist.training.controller"
                                ".Action"):
      self._controller(FakeRunner(self.step), train_actions=[print])
    with self.assertRaisesRegex(TypeError, "not callable"):
      self._controller(FakeRunner(self.step), eval_actions=["loss"])

    class TwoArguments(controller_lib.Action):

      def __call__(self, state, output):
        del state, output

    with self.assertRaisesRegex(
        TypeError, r"TwoArguments.__call__\(state, output\) does not take "
        r"one argument; .*Write e.g. `def __call__\(self, chunk\):`"):
      self._controller(FakeRunner(self.step), train_actions=[TwoArguments()])

  def test_actions_share_no_mutable_state(self):
    # Each action gets an immutable record and returns what it produces;
    # a result the record has no field for is refused, naming the action.
    chunk = controller_lib.Chunk(step=5, first_step=0, epoch=0,
                                 output=_output())
    with self.assertRaises(dataclasses.FrozenInstanceError):
      chunk.saved = "ckpt-5"  # pytype: disable=not-writable

    class MovesTheStep(controller_lib.Action):

      def __call__(self, chunk):
        return {"step": chunk.step + 1, "saved": None}

    with self.assertRaisesRegex(
        TypeError, r"MovesTheStep returned step, which no action produces "
        r"for the Chunk; it may produce stop_requested, saved, evaluation"):
      self._controller(FakeRunner(self.step),
                       train_actions=[MovesTheStep()]).run()

    class AsksToStop(controller_lib.Action):
      """Produces a result the next user action reads."""

      def __call__(self, chunk):
        return {"stopped_early": chunk.step == 5}

    class Reads(controller_lib.Action):

      def __init__(self):
        self.seen = []

      def __call__(self, chunk):
        self.seen.append((chunk.step, chunk.stopped_early))

    self.setUp()  # A new run from step 0.
    reads = Reads()
    result = self._controller(FakeRunner(self.step),
                              train_actions=[AsksToStop(), reads]).run()
    self.assertEqual(reads.seen, [(5, True)])
    self.assertEqual(result.step, 5)
    self.assertTrue(result.stopped_early)

  def test_a_profiler_window_traces_exactly_its_steps(self):
    # --profile_steps=7,9: the trace starts after step 6 and stops after
    # step 9, so chunks end there too.
    window = profiling.ProfileWindow((7, 9),
                                     os.path.join(self.dir, "tb", "train"))
    runner = FakeRunner(self.step, max_steps_per_call=4)
    self._controller(runner, profiler=window).run()
    self.assertEqual(runner.calls, [(0, 4), (4, 1), (5, 1), (6, 3), (9, 1),
                                    (10, 4), (14, 1), (15, 4), (19, 1)])
    self.assertTrue(window.done)
    self.assertFalse(window.active)
    self.assertRegex(window.latest_trace,
                     r"/tb/train/plugins/profile/[^/]+/[^/]+\.xplane\.pb$")
    self.assertEqual(controller_lib.next_boundary(
        6, ControllerOptions(total_steps=20, steps_per_epoch=10,
                             log_steps=5), extra=(6, 9)), 9)

  def test_checkpoint_cadence(self):
    self._controller(FakeRunner(self.step), checkpoint_steps=4,
                     log=100).run()
    self.assertEqual(self._saved_steps(), [4, 8, 12, 16, 20])
    self.step.assign(0)
    self.setUp()
    self._controller(FakeRunner(self.step), log=100).run()
    self.assertEqual(self._saved_steps(), [10, 20])  # Every epoch end.

  def test_epochs_between_evals(self):
    self._controller(FakeRunner(self.step), total=40, evals_every=2).run()
    self.assertEqual(self.evaluations, [20, 40])

  def test_resume_continues_and_keeps_the_history_whole(self):
    runner = FakeRunner(self.step)
    self._controller(runner, total=10, checkpoint_steps=5).run()
    self.step.assign(0)  # A new process: state comes from the checkpoint.
    runner = FakeRunner(self.step)
    result = self._controller(runner, total=20, checkpoint_steps=5).run()
    self.assertEqual(runner.calls[0][0], 10)
    self.assertTrue(result.restored_from.endswith("ckpt-10"))
    records = self.log.all_records("train")
    self.assertEqual([r["step"] for r in records], [5, 10, 15, 20])
    self.assertLen({r["process"] for r in records}, 2)
    lines = run_log_lib.read_metrics(self.dir)
    self.assertEqual([r["step"] for r in lines if r["kind"] == "eval"],
                     [10, 20])

  def test_callbacks_see_keras_hooks_and_params(self):
    seen = []

    class Recorder(keras.callbacks.Callback):

      def on_train_begin(self, logs=None):
        seen.append(("train_begin", dict(self.params)))

      def on_epoch_end(self, epoch, logs=None):
        seen.append(("epoch_end", epoch, sorted(logs)))

      def on_train_end(self, logs=None):
        seen.append(("train_end",))

    self._controller(FakeRunner(self.step), callbacks=[Recorder()]).run()
    self.assertEqual(seen[0], ("train_begin",
                               {"verbose": 0, "steps": 10, "epochs": 2}))
    self.assertEqual(seen[1], ("epoch_end", 0, ["accuracy", "loss",
                                                "val_accuracy", "val_loss"]))
    self.assertEqual(seen[-1], ("train_end",))

  def test_early_stopping_stops_training(self):
    # The loss stops improving after epoch 1: EarlyStopping (patience 1)
    # sets model.stop_training at epoch 2's end.
    model = keras.Sequential()
    runner = FakeRunner(self.step, loss_at=lambda s: 1.0 if s < 10 else 2.0)
    stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=1)
    result = self._controller(runner, total=100, model=model,
                              callbacks=[stopper]).run()
    self.assertTrue(result.stopped_early)
    self.assertEqual(result.step, 20)
    self.assertIn(20, self._saved_steps())  # Stopped with a checkpoint.
    self.assertEqual(runner.agreed[-1], True)  # Every worker agrees.

  def test_epochs_are_numbered_as_keras_early_stopping_numbers_them(self):
    # Epoch 1 is the best, epoch 2 is worse: EarlyStopping stops after
    # epoch 2 and puts epoch 1's weights back, and says so counting from 1.
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    runner = FakeRunner(self.step, loss_at=lambda s: 1.0 if s < 10 else 2.0)
    stopper = keras.callbacks.EarlyStopping(
        monitor="loss", patience=1, restore_best_weights=True, verbose=1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), self.assertLogs(
        absl_logging.get_absl_logger(), "INFO") as logs:
      self._controller(runner, total=100, model=model,
                       callbacks=[stopper]).run()
    keras_best = re.search(r"best epoch: (\d+)", printed.getvalue())[1]
    keras_stopped = re.search(r"Epoch (\d+): early stopping",
                              printed.getvalue())[1]
    self.assertEqual((keras_best, keras_stopped), ("1", "2"))
    lines = "\n".join(r.getMessage() for r in logs.records)
    self.assertIn(f"restored the weights of epoch {keras_best}:", lines)
    self.assertIn(f"Stopping at step 20 of 100 (epoch {keras_stopped}, ",
                  lines)
    # The step lines at the ends of those epochs (each with its epoch's
    # evaluation) name the same epochs.
    self.assertRegex(lines, rf"tfdist: epoch {keras_best}/10, step 10/100: "
                     r"[^\n]*; held-out evaluation at step 10: ")
    self.assertRegex(lines, rf"tfdist: epoch {keras_stopped}/10, step "
                     r"20/100: [^\n]*; held-out evaluation at step 20: ")

  def test_terminate_on_nan_stops_after_the_nan_chunk(self):
    runner = FakeRunner(self.step, max_steps_per_call=2,
                        loss_at=lambda s: float("nan") if s >= 6 else 1.0)
    result = self._controller(runner, total=20, log=100,
                              callbacks=[keras.callbacks.TerminateOnNaN()]
                              ).run()
    self.assertTrue(result.stopped_early)
    # NaN in the chunk ending at step 8: TerminateOnNaN sets the flag in
    # that chunk's batch hook, and the workers agree on it right after, so
    # training stops after step 8, as fit stops after that batch.
    self.assertEqual(result.step, 8)

  def test_a_divergence_ends_the_epoch_and_the_run_as_fit_does(self):
    # The loss and a model variable go NaN in the chunk ending at step 7:
    # the callbacks get that chunk's batch end (NaN loss), the epoch's
    # validation, its end and the end of training (a CSVLogger closes its
    # file), as fit gives them when TerminateOnNaN stops it; then the
    # error, with nothing saved after step 5 (epoch 0's checkpoint).
    weight = tf.Variable(1.0)
    runner = FakeRunner(
        self.step, max_steps_per_call=2,
        loss_at=lambda s: float("nan") if s >= 5 else 1.0,
        on_step=lambda s: weight.assign(float("nan") if s >= 6 else 1.0))
    hooks = []

    def note(name):
      return lambda *args, **kwargs: hooks.append(
          (name, args[0] if args and isinstance(args[0], int) else None))
    recorder = keras.callbacks.LambdaCallback(**{
        name: note(name) for name in (
            "on_train_batch_end", "on_test_begin", "on_test_end",
            "on_epoch_end", "on_train_end")})
    csv_path = os.path.join(self.dir, "log.csv")
    csv = keras.callbacks.CSVLogger(csv_path)
    keeper = checkpointing.CheckpointKeeper(
        checkpoint=tf.train.Checkpoint(step=self.step, w=weight),
        directory=os.path.join(self.dir, "checkpoints"),
        step_counter=self.step, max_to_keep=100, variables=[weight])
    controller = self._controller(
        runner, total=20, per_epoch=5, log=100, keeper=keeper,
        callbacks=[recorder, csv, keras.callbacks.TerminateOnNaN()])
    with self.assertRaisesRegex(errors.TrainingDivergedError,
                                r"at step 7 \(in steps 6-7\).*ckpt-5"):
      controller.run()
    self.assertEqual(hooks[-5:], [
        ("on_train_batch_end", 1), ("on_test_begin", None),
        ("on_test_end", None), ("on_epoch_end", 1), ("on_train_end", None)])
    self.assertEqual(self._saved_steps(), [5])
    self.assertIsNone(csv.writer)  # Closed by on_train_end.
    with open(csv_path) as f:
      self.assertEqual([row.split(",")[0] for row in f.read().splitlines()],
                       ["epoch", "0", "1"])

  def test_a_callback_whose_hook_comes_from_getattribute_gets_metrics(self):
    seen = []

    class Dynamic(keras.callbacks.Callback):

      def __getattribute__(self, name):
        if name == "on_train_batch_end":
          return lambda batch, logs=None: seen.append(sorted(logs))
        return super().__getattribute__(name)

    self._controller(FakeRunner(self.step), total=4, per_epoch=2, log=2,
                     callbacks=[Dynamic()]).run()
    # Every batch metric (the fake runner's accuracy), not the loss alone.
    self.assertEqual(seen, [["accuracy", "loss"]] * 2)

  def test_divergence_is_one_clear_error(self):
    runner = FakeRunner(self.step, loss_at=lambda s: float("inf"))
    with self.assertRaisesRegex(errors.TrainingDivergedError,
                                "diverged at step 5.*--base_learning_rate"):
      self._controller(runner).run()

  def test_sigterm_saves_and_raises_preempted(self):
    watcher = preemption.PreemptionWatcher(grace_seconds=60).install()
    self.addCleanup(watcher.uninstall)
    self.addCleanup(watcher.cancel_deadline)

    def signal_at(step):
      if step == 4:
        os.kill(os.getpid(), signal.SIGTERM)

    runner = FakeRunner(self.step, max_steps_per_call=2, on_step=signal_at)
    with self.assertRaises(errors.PreemptedError) as caught:
      self._controller(runner, preemption_watcher=watcher).run()
    # The signal reached the host after step 4; the next chunk (up to the
    # log point at 5) carried it, so every worker stops after step 5, with a
    # checkpoint there.
    self.assertEqual(caught.exception.step, 5)
    self.assertEqual(caught.exception.exit_code, 128 + signal.SIGTERM)
    self.assertIn(5, self._saved_steps())

  def test_a_peer_signal_stops_this_worker_too(self):
    watcher = preemption.PreemptionWatcher(grace_seconds=60)
    self.addCleanup(watcher.cancel_deadline)

    class PeerRunner(FakeRunner):

      def run(self, num_steps, **kwargs):
        output = super().run(num_steps, **kwargs)
        if int(self.step.numpy()) >= 4:
          # Another worker's request.
          output = dataclasses.replace(output, signals=dataclasses.replace(
              output.signals, stop_signal=True))
        return output

    with self.assertRaises(errors.PreemptedError) as caught:
      self._controller(PeerRunner(self.step, max_steps_per_call=2),
                       preemption_watcher=watcher).run()
    self.assertEqual(caught.exception.step, 4)
    self.assertEqual(caught.exception.signum, signal.SIGTERM)


def _output(loss=2.0, **signals):
  return step_runner.StepOutput(sums={"loss": np.float64(loss)},
                                signals=step_runner.StepSignals(**signals))


class ActionsTest(absltest.TestCase):
  """Each action on its own, over a hand-made `Chunk` record."""

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    self.step = tf.Variable(0, dtype=tf.int64)
    self.weight = tf.Variable(1.0)
    self.keeper = checkpointing.CheckpointKeeper(
        checkpoint=tf.train.Checkpoint(step=self.step, w=self.weight),
        directory=os.path.join(self.dir, "checkpoints"),
        step_counter=self.step, variables=[self.weight])
    self.saver = controller_lib.Checkpoints(
        self.keeper, learning_rate=lambda: 0.1, loss_scale=lambda: None)
    self.options = ControllerOptions(total_steps=20, steps_per_epoch=10,
                                     log_steps=5, checkpoint_steps=4)

  def _chunk(self, step, first_step=None, output=None, **results):
    self.step.assign(step)
    return controller_lib.Chunk(
        step=step, epoch=(step - 1) // 10,
        first_step=step - 1 if first_step is None else first_step,
        output=output or _output(), **results)

  def test_options_name_the_boundaries(self):
    self.assertEqual([s for s in range(1, 21)
                      if self.options.is_checkpoint_step(s)],
                     [4, 8, 12, 16, 20])
    by_epoch = ControllerOptions(total_steps=25, steps_per_epoch=10)
    self.assertEqual(
        [s for s in range(1, 26) if by_epoch.is_checkpoint_step(s)],
        [10, 20, 25])
    self.assertTrue(by_epoch.is_epoch_end(20))
    self.assertTrue(by_epoch.is_last(25))

  def test_save_checkpoint_saves_only_at_its_steps(self):
    action = controller_lib.SaveCheckpoint(self.saver, self.options)
    self.assertIsNone(action(self._chunk(3)))
    self.assertTrue(action(self._chunk(4))["saved"].endswith("ckpt-4"))

  def test_a_non_finite_state_is_not_saved_but_diverged(self):
    action = controller_lib.SaveCheckpoint(self.saver, self.options)
    self.weight.assign(float("nan"))
    with self.assertRaisesRegex(errors.TrainingDivergedError,
                                "diverged at step 8.*starts from step 0"):
      action(self._chunk(8))

  def test_a_state_found_non_finite_rereads_the_input_since_the_last_save(
      self):
    asked = []
    saver = controller_lib.Checkpoints(
        self.keeper, learning_rate=lambda: 0.1, loss_scale=lambda: None,
        nonfinite_input=lambda after, step: asked.append((after, step)) or
        "the batch of step 6 on this worker holds 1 NaN in its features")
    action = controller_lib.SaveCheckpoint(saver, self.options)
    action(self._chunk(4))
    self.weight.assign(float("nan"))  # A NaN the loss did not show.
    with self.assertRaisesRegex(
        errors.TrainingDivergedError,
        r"diverged at step 8: the model or optimizer state holds NaN or "
        r"infinite values\. The training data is the likely cause: the "
        r"batch of step 6 on this worker holds 1 NaN in its features\. "
        r".*tf\.debugging\.check_numerics.*ckpt-4, is kept"):
      action(self._chunk(8))
    self.assertEqual(asked, [(4, 8)])  # The steps since the last save.

  def test_divergence_check_reads_the_state_only_for_a_bad_loss(self):
    action = controller_lib.DivergenceCheck(self.saver)
    self.weight.assign(float("nan"))
    action(self._chunk(3, output=_output(loss=1.0)))  # Finite: no check.
    with self.assertRaisesRegex(errors.TrainingDivergedError,
                                r"at step 6 \(in steps 4-6\): the training "
                                "loss is nan"):
      action(self._chunk(6, first_step=3, output=_output(loss=float("nan"))))
    self.weight.assign(1.0)
    action(self._chunk(9, output=_output(loss=float("nan"))))  # State finite.

  def test_skipped_step_watch_counts_the_signals(self):
    action = controller_lib.SkippedStepWatch(self.options, lambda: None)
    action.on_begin(controller_lib.Progress(step=0, epoch=0))
    action(self._chunk(5, first_step=0, output=_output(
        skipped_steps=2.0, skipped_steps_at_end=1.0)))
    self.assertEqual(action.monitor.total_skipped, 2)

  def test_skipped_steps_reach_the_log_through_the_records(self):
    # The log used to take the interval's count from the watch's monitor
    # (resetting it there); now the watch produces the counts into the
    # chunk record and the log sums them over its own interval.
    watch = controller_lib.SkippedStepWatch(self.options, lambda: None)
    watch.on_begin(controller_lib.Progress(step=0, epoch=0))
    log = run_log_lib.RunLog(tensorboard_dir=None, metrics_dir=self.dir,
                             global_batch_size=2, total_steps=20)
    log.resume(0)
    train_log = controller_lib.TrainLog(
        log, options=ControllerOptions(total_steps=20, steps_per_epoch=10,
                                       log_steps=10),
        checkpoints=self.saver)
    for step, skipped in ((3, 2.0), (6, 0.0), (10, 1.0)):
      chunk = self._chunk(step, first_step=step - 3 if step < 10 else 6,
                          output=_output(skipped_steps=skipped))
      produced = watch(chunk)
      train_log(dataclasses.replace(chunk, **produced))
    self.assertEqual(produced, {"skipped_steps": 1, "total_skipped": 3})
    self.assertEqual(watch.monitor.interval_skipped, 3)  # Not reset by it.
    log.flush()
    with open(os.path.join(self.dir, "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f]
    self.assertEqual([r.get("skipped_steps") for r in records
                      if r.get("step") == 10], [3])

  def test_stop_on_request_saves_once_and_stops(self):
    action = controller_lib.StopOnRequest(self.saver, self.options)
    produced = action(self._chunk(7, stop_requested=True))
    self.assertEqual(produced, {"saved": self.keeper.latest,
                                "stopped_early": True})
    self.assertEqual(self.keeper.latest.rsplit("-", 1)[1], "7")
    # Saved already (by an action before it): not again.
    self.assertEqual(action(self._chunk(8, stop_requested=True,
                                        saved="ckpt-8")),
                     {"stopped_early": True})
    self.assertEqual(self.keeper.latest.rsplit("-", 1)[1], "7")
    # The end: no early stop.
    self.assertIsNone(action(self._chunk(20, stop_requested=True)))

  def test_evaluate_at_eval_epochs_and_again_at_the_end(self):
    steps = []
    action = controller_lib.Evaluate(
        lambda step: steps.append(step) or {"loss": 0.0, "step": step},
        ControllerOptions(total_steps=30, steps_per_epoch=10,
                          epochs_between_evals=2))
    produced = [action(self._chunk(step)) for step in (10, 15, 20)]
    self.assertEqual(steps, [20])
    self.assertEqual(produced, [None, None,
                                {"evaluation": {"loss": 0.0, "step": 20}}])
    # Stopped early after the last evaluation.
    progress = controller_lib.Progress(step=25, epoch=2,
                                       last_eval=produced[2]["evaluation"])
    self.assertEqual(action.on_end(progress),
                     {"last_eval": {"loss": 0.0, "step": 25}})
    self.assertEqual(steps, [20, 25])
    progress = dataclasses.replace(progress, last_eval={"step": 25})
    self.assertIsNone(action.on_end(progress))  # Of the last step already.
    self.assertEqual(steps, [20, 25])

  def test_keras_batch_end_gets_the_chunks_mean_loss(self):
    seen = []

    class Recorder(keras.callbacks.Callback):

      def on_train_batch_end(self, batch, logs=None):
        seen.append((batch, logs))

    action = controller_lib.KerasBatchEnd(
        keras.callbacks.CallbackList([Recorder()]), self.options)
    action(self._chunk(14, first_step=10, output=_output(loss=8.0)))
    self.assertEqual(seen, [(3, {"loss": 2.0})])

  def test_preemption_stop_saves_ends_callbacks_and_raises(self):
    ended = []

    class Recorder(keras.callbacks.Callback):

      def on_train_end(self, logs=None):
        ended.append(True)

    watcher = preemption.PreemptionWatcher(grace_seconds=60)
    callbacks = keras.callbacks.CallbackList([Recorder()])
    callbacks.on_train_begin()
    action = controller_lib.PreemptionStop(
        watcher, checkpoints=self.saver, callbacks=callbacks,
        options=self.options)
    self.assertEqual(action.before_steps(
        controller_lib.Progress(step=3, epoch=0)), {"stop_signal": False})
    self.assertIsNone(action(self._chunk(3)))  # No signal: nothing.
    with self.assertRaises(errors.PreemptedError) as caught:
      action(self._chunk(3, output=_output(stop_signal=True)))
    self.assertEqual(caught.exception.step, 3)
    self.assertTrue(caught.exception.checkpoint.endswith("ckpt-3"))
    self.assertEqual(ended, [True])

  def test_preemption_at_an_epoch_end_raises_after_the_epoch_ends(self):
    # The resumed run starts with the next epoch, so this one's evaluation
    # and on_epoch_end run first; the checkpoint is saved before them.
    ended = []

    class Recorder(keras.callbacks.Callback):

      def on_train_end(self, logs=None):
        ended.append(True)

    watcher = preemption.PreemptionWatcher(grace_seconds=60)
    callbacks = keras.callbacks.CallbackList([Recorder()])
    callbacks.on_train_begin()
    stop = controller_lib.PreemptionStop(
        watcher, checkpoints=self.saver, callbacks=callbacks,
        options=self.options)
    after = controller_lib.PreemptionStopAfterEpoch(watcher,
                                                    callbacks=callbacks)
    step = self.options.steps_per_epoch
    chunk = self._chunk(step, output=_output(stop_signal=True))
    produced = stop(chunk)  # Saves, defers the stop.
    self.assertTrue(produced["preempted"].endswith(f"ckpt-{step}"))
    self.assertEqual(produced["saved"], produced["preempted"])
    self.assertEqual(ended, [])
    # KerasEpochEnd saved again after on_epoch_end.
    chunk = dataclasses.replace(chunk, preempted=produced["preempted"],
                                saved="resaved-after-on_epoch_end")
    with self.assertRaises(errors.PreemptedError) as caught:
      after(chunk)
    self.assertEqual((caught.exception.step, caught.exception.checkpoint),
                     (step, "resaved-after-on_epoch_end"))
    self.assertEqual(ended, [True])

  def test_no_built_in_action_holds_another(self):
    # Actions exchange values only through the records: none keeps a
    # reference to another action (the log once reset the skipped-step
    # watch's counter; the after-epoch preemption stop read the other
    # stop's watcher and callbacks).
    controller = Controller(
        runner=FakeRunner(self.step),
        options=ControllerOptions(total_steps=20, steps_per_epoch=10),
        checkpoints=self.keeper, step_counter=self.step,
        run_log=run_log_lib.RunLog(tensorboard_dir=None, metrics_dir=None,
                                   global_batch_size=2, total_steps=20),
        evaluate=lambda: {"loss": 0.5, "num_examples": 2},
        preemption=preemption.PreemptionWatcher(grace_seconds=60))
    names = [type(a).__name__ for a in controller.actions]
    self.assertIn("PreemptionStopAfterEpoch", names)
    self.assertIn("TrainLog", names)
    for action in controller.actions:
      held = [name for name, value in vars(action).items()
              if isinstance(value, controller_lib.Action)]
      self.assertEqual(held, [], f"{type(action).__name__} holds {held}")


class EvaluateContinuouslyTest(absltest.TestCase):

  def test_every_checkpoint_once_in_order(self):
    tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    ckpt_dir = os.path.join(tmp, "checkpoints")
    weight = tf.Variable(0.0)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(w=weight),
                                         ckpt_dir, max_to_keep=10)
    for step in (5, 10, 15):
      weight.assign(float(step))
      manager.save(checkpoint_number=step)
    restored = tf.Variable(-1.0)
    log = run_log_lib.RunLog(tensorboard_dir=os.path.join(tmp, "tb"),
                             metrics_dir=None, global_batch_size=1,
                             total_steps=15, eval_subdir="eval")
    controller = Controller(
        options=ControllerOptions(total_steps=15, steps_per_epoch=1),
        run_log=log,
        evaluate=lambda: {"loss": float(restored.numpy()), "accuracy": 1.0,
                          "num_examples": 1})
    results = controller.evaluate_continuously(
        checkpoint_dir=ckpt_dir, results_dir=os.path.join(tmp, "eval"),
        restore=lambda path: tf.train.Checkpoint(w=restored).restore(path),
        final_step=15, poll_seconds=0.01)
    self.assertEqual([(r["step"], r["loss"]) for r in results],
                     [(5, 5.0), (10, 10.0), (15, 15.0)])
    with open(os.path.join(tmp, "eval",
                           controller_lib.EVAL_RESULTS_FILE)) as f:
      self.assertEqual([json.loads(l)["step"] for l in f], [5, 10, 15])
    # A restarted evaluator skips what is done.
    again = controller.evaluate_continuously(
        checkpoint_dir=ckpt_dir, results_dir=os.path.join(tmp, "eval"),
        restore=lambda path: self.fail("evaluated twice"), final_step=15,
        poll_seconds=0.01)
    self.assertLen(again, 3)
    self.assertTrue(os.listdir(os.path.join(tmp, "tb", "eval")))


class RunLogTest(absltest.TestCase):

  def test_accumulation_log_line_counts_the_interval(self):
    # `step 40/40 (40 micro-steps in 20 updates)` read as if the whole run
    # had 20 updates; the counts are the log interval's.
    log = run_log_lib.RunLog(tensorboard_dir=None, metrics_dir=None,
                             global_batch_size=8, total_steps=40)
    log.resume(20)
    # An earlier test in the same process may have lowered absl's verbosity
    # (a quiet tfdist.train run). The logger's own level comes back after
    # (not get_verbosity(), the effective level: restoring that would pin
    # absl's logger at WARNING, so a later tfdist.fit in this process
    # takes its caller's logging for a quiet one and logs past the root
    # logger).
    absl_logger = absl_logging.get_absl_logger()
    self.addCleanup(absl_logger.setLevel, absl_logger.level)
    absl_logging.set_verbosity(absl_logging.INFO)
    with self.assertLogs(level="INFO") as logs:
      record = log.log_train(40, {"loss": 20.0, "micro_steps": 40.0}, 20,
                             learning_rate=0.1)
    self.assertEqual(record["micro_steps"], 40)
    self.assertTrue(any(
        "step 40/40 (40 micro-steps in the last 20 updates):" in line
        for line in logs.output), logs.output)


def _tiny_trainer(strategy, *, steps_per_execution=2):
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
  return Trainer(strategy=strategy, model=model, optimizer=optimizer,
                 global_batch_size=8, steps_per_execution=steps_per_execution)


def _tiny_dataset(_=None):
  rng = np.random.RandomState(0)
  x = rng.rand(64, 4).astype(np.float32)
  y = rng.randint(0, 3, 64).astype(np.int64)
  return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8)


def _run_controller(runner, trainer, tmp, *, check_state=False):
  """Runs 10 steps (epochs of 5) under a real controller; returns
  `(ControllerResult, RunLog)`. `check_state`: the checkpoints check the
  model's variables (a NaN weight is a divergence)."""
  keeper = checkpointing.CheckpointKeeper(
      checkpoint=tf.train.Checkpoint(model=trainer.model,
                                     optimizer=trainer.optimizer,
                                     global_step=trainer.global_step),
      directory=os.path.join(tmp, "checkpoints"),
      step_counter=trainer.global_step,
      variables=list(trainer.model.variables) if check_state else None)
  log = run_log_lib.RunLog(tensorboard_dir=None, metrics_dir=tmp,
                           global_batch_size=8, total_steps=10)
  return Controller(
      runner=runner,
      options=ControllerOptions(total_steps=10, steps_per_epoch=5,
                                log_steps=5),
      checkpoints=keeper, step_counter=trainer.global_step, run_log=log,
      model=trainer.model, learning_rate=lambda: 0.1).run(), log


class RealRunnersTest(absltest.TestCase):
  """The same controller over both real step runners."""

  def test_local_runner(self):
    tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    trainer = _tiny_trainer(strategy)
    data = strategy.experimental_distribute_dataset(_tiny_dataset())
    runner = step_runner.LocalStepRunner(trainer=trainer,
                                         iterator=iter(data))
    result, log = _run_controller(runner, trainer, tmp)
    self.assertEqual(result.step, 10)
    self.assertEqual(int(trainer.optimizer.iterations.numpy()), 10)
    self.assertEqual([r["step"] for r in log.history], [5, 10])
    self.assertTrue(all(np.isfinite(r["loss"]) for r in log.history))

  def test_a_nan_feature_is_named_after_the_divergence(self):
    # Row 2 of batch 6 (step 7's) holds a NaN feature: the loss of the
    # chunk of steps 6-7 is NaN, and the error names the data, not the
    # learning rate.
    tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    trainer = _tiny_trainer(strategy)
    rng = np.random.RandomState(0)
    x = rng.rand(64, 4).astype(np.float32)
    x[6 * 8 + 2, 1] = np.nan
    y = rng.randint(0, 3, 64).astype(np.int64)
    starts = []

    def iterator_fn(start):
      starts.append(start)
      return iter(strategy.experimental_distribute_dataset(
          tf.data.Dataset.from_tensor_slices((x, y)).batch(8)))
    runner = step_runner.LocalStepRunner(trainer=trainer,
                                         iterator_fn=iterator_fn)
    with self.assertRaisesRegex(
        errors.TrainingDivergedError,
        r"at step 7 \(in steps 6-7\): the training loss is nan .* The "
        r"training data is the likely cause: the batch of step 7 on this "
        r"worker holds 1 NaN in its features \(rows \[2\] of replica 0's "
        r"batch\)\.") as raised:
      _run_controller(runner, trainer, tmp, check_state=True)
    self.assertNotIn("--base_learning_rate", str(raised.exception))
    self.assertEqual(starts, [0, 0])  # Read again once, from the start.

  def test_non_finite_values_name_the_part_and_the_rows(self):
    batch = ({"a": tf.constant([[1.0], [np.inf]]), "b": tf.constant([1, 2])},
             tf.constant([np.nan, 1.0]))
    self.assertEqual(step_runner.nonfinite_values(batch),
                     "1 infinite in its features (`a`; rows [1] of replica "
                     "0's batch); 1 NaN in its labels (rows [0] of replica "
                     "0's batch)")
    self.assertIsNone(step_runner.nonfinite_values(
        (tf.ones([2, 1]), tf.ones([2]), tf.ones([2]))))

  def test_coordinator_runner_on_an_in_process_cluster(self):
    # In a child process: connecting this process's eager context to a
    # cluster is global, and would turn later in-process Mirrored tests
    # into "in-graph multi-worker" ones.
    child = subprocess.run(
        [sys.executable, "-c",
         "from tests import controller_test; "
         "controller_test.coordinator_child()"],
        cwd=testutil.REPO_ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": testutil.REPO_ROOT + os.pathsep +
             os.environ.get("PYTHONPATH", ""),
             "TF_CPP_MIN_LOG_LEVEL": "2"})
    self.assertEqual(child.returncode, 0, child.stderr[-3000:])
    result = json.loads(child.stdout.strip().splitlines()[-1])
    self.assertEqual(result["step"], 10)
    self.assertEqual(result["global_step"], 10)
    self.assertEqual(result["logged_steps"], [5, 10])
    self.assertEqual(result["first_interval_steps"], 5)
    self.assertIn("/job:ps", result["variable_device"])


def coordinator_child():
  """The same controller over a `CoordinatorStepRunner` and an in-process
  parameter-server cluster (a worker and a ps on 127.0.0.1); prints one
  JSON line with what the parent asserts."""
  tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
  spec = tf.train.ClusterSpec({
      "worker": [f"127.0.0.1:{portpicker.pick_unused_port()}"],
      "ps": [f"127.0.0.1:{portpicker.pick_unused_port()}"]})
  servers = [tf.distribute.Server(spec, job_name=job, task_index=0,
                                  protocol="grpc", start=True)
             for job in ("worker", "ps")]
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      spec, rpc_layer="grpc")
  strategy = tf.distribute.ParameterServerStrategy(resolver)
  trainer = _tiny_trainer(strategy)
  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
  iterator = iter(coordinator.create_per_worker_dataset(
      lambda: strategy.distribute_datasets_from_function(_tiny_dataset)))
  runner = step_runner.CoordinatorStepRunner(
      trainer=trainer, coordinator=coordinator, iterator=iterator)
  result, log = _run_controller(runner, trainer, tmp)
  print(json.dumps({
      "step": result.step, "global_step": int(trainer.global_step.numpy()),
      "logged_steps": [r["step"] for r in log.history],
      "first_interval_steps": log.history[0]["steps"],
      "variable_device": trainer.model.trainable_variables[0].value.device,
      "servers": len(servers)}), flush=True)


if __name__ == "__main__":
  absltest.main()
