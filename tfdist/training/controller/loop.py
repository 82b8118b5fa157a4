"""The `Controller`: the outer loop that runs chunks of steps and threads
each chunk's record through the actions.
"""

import math
import time
from typing import Callable, List, Optional, Sequence

from absl import logging
import keras
import tensorflow as tf

from tfdist import errors
from tfdist.observability import run_log as run_log_lib
from tfdist.parallel.experts import layer as moe_layer
from tfdist.training.state import callback_state as callback_state_lib
from tfdist.training.state import keras_callbacks
from tfdist.training.step import step_runner
from tfdist.training.step import training_checks
from tfdist.training.controller import evaluator
from tfdist.training.controller.actions.health import DivergenceCheck
from tfdist.training.controller.actions.health import SkippedStepWatch
from tfdist.training.controller.actions.keras_hooks import KerasBatchEnd
from tfdist.training.controller.actions.keras_hooks import KerasEpochEnd
from tfdist.training.controller.actions.keras_hooks import KerasTrainHooks
from tfdist.training.controller.actions.periodic import Evaluate
from tfdist.training.controller.actions.periodic import SaveCheckpoint
from tfdist.training.controller.actions.reporting import ProfilerWindow
from tfdist.training.controller.actions.reporting import RoutingLog
from tfdist.training.controller.actions.reporting import TrainLog
from tfdist.training.controller.actions.stops import PreemptionStop
from tfdist.training.controller.actions.stops import PreemptionStopAfterEpoch
from tfdist.training.controller.actions.stops import StopOnRequest
from tfdist.training.controller.checkpoints import Checkpoints
from tfdist.training.controller.protocol import Action
from tfdist.training.controller.protocol import check_hooks_take_one_record
from tfdist.training.controller.protocol import with_results
from tfdist.training.controller.records import Chunk
from tfdist.training.controller.records import ControllerOptions
from tfdist.training.controller.records import ControllerResult
from tfdist.training.controller.records import Progress
from tfdist.training.controller.records import StepRequest
from tfdist.training.controller.records import next_boundary


def _after(loop: Progress, chunk: Chunk) -> Progress:
  """Where the loop stands after `chunk` and its actions' results: the
  epoch begun before its steps, the next one once it produced
  `epoch_logs`."""
  ended = chunk.epoch_logs is not None
  return Progress(
      step=chunk.step, epoch=loop.epoch + 1 if ended else loop.epoch,
      epoch_begun=not ended,
      last_eval=(chunk.evaluation if chunk.evaluation is not None
                 else loop.last_eval),
      epoch_logs=chunk.epoch_logs if ended else loop.epoch_logs)


class Controller:
  """Trains to `total_steps` with any step runner; or evaluates checkpoints.

  Training is a short loop: the runner runs a chunk of steps up to the
  next boundary, then each `Action` (see `actions`) does its side work.

  Args:
    runner: a `tfdist.training.step.step_runner.StepRunner`
      (`LocalStepRunner` or `CoordinatorStepRunner`); None for an
      evaluation-only controller.
    options: a `ControllerOptions`.
    checkpoints: a `tfdist.training.state.checkpointing.CheckpointKeeper`;
      None for an evaluation-only controller.
    step_counter: the global step variable (read after restoring).
    run_log: the `tfdist.observability.run_log.RunLog`.
    evaluate: a function returning one evaluation of the current weights
      (`{"loss", <metric>: value, ..., "num_examples"}`), or None; called
      with `on_batch_begin` and `on_batch_end` (as
      `tfdist.training.step.train_loop.Trainer.evaluate` takes them) when a
      callback overrides Keras's `on_test_batch_*` hooks.
    model: the Keras model (callbacks read it; `stop_training`).
    learning_rate: returns the current learning rate (float).
    loss_scale: returns the current loss scale, or None without one.
    callbacks: Keras callbacks.
    preemption: a `tfdist.runtime.preemption.PreemptionWatcher`, or None.
    profiler: a `tfdist.observability.profiling.ProfileWindow`, or None.
    train_actions: the caller's `Action`s, run after the built-in ones
      (Orbit's `Controller(train_actions=...)`): each gets every hook of
      `Action`: `Progress` between chunks, and after each chunk the
      `Chunk` record (its steps, `StepOutput`, and the built-in actions'
      results: `saved`, `evaluation`, `epoch_logs`, `stop_requested`,
      ...), once the controller's own work for that chunk (its log,
      checkpoint, evaluation and epoch end) is done.
    eval_actions: the caller's callables `(result: dict) -> None`, each
      given every evaluation's result (`loss`, each metric,
      `num_examples`, `step`) after it is logged, during training and in
      `evaluate_continuously`, in order.

  Raises:
    ValueError: `options` with a non-positive step count.
    TypeError: a train action that is not an `Action`, or an eval action
      that is not callable.
  """

  def __init__(self, *, runner: Optional[step_runner.StepRunner] = None,
               options: ControllerOptions,
               checkpoints=None, step_counter: Optional[tf.Variable] = None,
               run_log: run_log_lib.RunLog,
               evaluate: Optional[Callable[[], dict]] = None,
               model: Optional[keras.Model] = None,
               learning_rate: Callable[[], float] = lambda: float("nan"),
               loss_scale: Callable[[], Optional[float]] = lambda: None,
               callbacks: Sequence[keras.callbacks.Callback] = (),
               preemption=None, profiler=None,
               train_actions: Sequence["Action"] = (),
               eval_actions: Sequence[Callable[[dict], None]] = ()):
    for action in train_actions:
      if not isinstance(action, Action):
        raise TypeError(
            f"Controller(train_actions=...): {action!r} is not a "
            "tfdist.training.controller.Action; subclass Action and "
            "override the hooks it needs.")
      check_hooks_take_one_record(action)
    for action in eval_actions:
      if not callable(action):
        raise TypeError(
            f"Controller(eval_actions=...): {action!r} is not callable; "
            "give functions of one argument, the evaluation's result.")
    self.eval_actions = tuple(eval_actions)
    for name in ("total_steps", "steps_per_epoch", "log_steps",
                 "epochs_between_evals"):
      if getattr(options, name) <= 0:
        raise ValueError(f"ControllerOptions.{name} must be > 0; received "
                         f"{getattr(options, name)}.")
    self.runner = runner
    self.options = options
    self.checkpoints = checkpoints
    self.step_counter = step_counter
    self.run_log = run_log
    self.evaluate_fn = evaluate
    self.profiler = profiler
    # The last step trained (while `run` runs, for error messages).
    self.step = 0
    self.actions: List[Action] = []
    self._skipped = SkippedStepWatch(options, loss_scale)
    if checkpoints is not None:
      self.actions = self._make_actions(
          Checkpoints(checkpoints, learning_rate=learning_rate,
                      loss_scale=loss_scale,
                      nonfinite_input=getattr(runner, "nonfinite_input",
                                              None),
                      callback_state=callback_state_lib.attach(
                          checkpoints.checkpoint,
                          keras_callbacks.flatten(callbacks))),
          keras.callbacks.CallbackList(list(callbacks), model=model),
          model=model, preemption=preemption) + list(train_actions)

  def _make_actions(self, saver: Checkpoints, callbacks, *, model,
                    preemption) -> List[Action]:
    """The built-in side work after each chunk, in the order it runs.

    Each action reads the `Chunk` fields that the ones before it produced
    (and returns its own), so the order is the order of that data:

    1. `KerasTrainHooks`: Keras's train, epoch-begin and batch-begin hooks;
       before the steps, produces `stop_training` (a batch hook's request)
       for the `StepRequest`; at the end, `last_eval=None` when
       EarlyStopping restored other weights (saved again).
    2. `ProfilerWindow` (with `--profile_steps`).
    3. `DivergenceCheck`: a non-finite loss stops here, before anything
       reads the chunk's metrics.
    4. `SkippedStepWatch`: fp16 steps skipped; reads the chunk's signals,
       produces `skipped_steps` and `total_skipped`.
    5. `KerasBatchEnd`: Keras's batch-end hooks; produces `stop_requested`
       (agreed by every worker).
    6. `TrainLog`: the log line and scalars of a log point; reads
       `skipped_steps`, `total_skipped` and `stop_requested` (a line held
       for this step's evaluation).
    6b. `RoutingLog` (a model with `tfdist.MixtureOfExperts` layers): the
        routing of each log point's step; reads and produces nothing.
    7. `SaveCheckpoint`: produces `saved` at checkpoint boundaries.
    8. `PreemptionStop`: before the steps, produces `stop_signal`; after,
       reads `saved`, saves if needed, raises (at an epoch end: produces
       `saved` and `preempted` instead).
    9. `Evaluate`: reads `stop_requested`; produces `evaluation` at
       evaluation boundaries (at the end, `last_eval` when the last one is
       not of the last step).
    10. `KerasEpochEnd`: reads `evaluation` and `saved`; produces
        `epoch_logs`, `stop_requested` and, when a callback changed what a
        checkpoint holds, `saved` at epoch ends.
    11. `PreemptionStopAfterEpoch`: reads `preempted` and `saved`, raises.
    12. `StopOnRequest`: reads `stop_requested` and `saved`; produces
        `stopped_early` (and `saved`).

    The caller's `train_actions` follow, in their order, and receive the
    record with all of the above.
    """
    opts = self.options
    actions = [KerasTrainHooks(callbacks, model=model, options=opts,
                               checkpoints=saver)]
    if self.profiler is not None:
      actions.append(ProfilerWindow(self.profiler))
    actions += [
        DivergenceCheck(saver), self._skipped,
        KerasBatchEnd(callbacks, opts, summarize=(
            self.run_log.summarize
            if keras_callbacks.reads_batch_metrics(callbacks) else None),
                      model=model, runner=self.runner),
        TrainLog(self.run_log, options=opts, checkpoints=saver,
                 evaluates=self.evaluate_fn is not None)]
    routed = moe_layer.moe_layers(model, built_only=True)
    if routed:
      actions.append(RoutingLog(self.run_log, routed, options=opts))
    actions += [SaveCheckpoint(saver, opts)]
    if preemption is not None:
      actions.append(PreemptionStop(preemption, checkpoints=saver,
                                    callbacks=callbacks, options=opts))
    actions += [
        Evaluate(self.evaluate, opts, callbacks),
        KerasEpochEnd(callbacks, model=model, run_log=self.run_log,
                      runner=self.runner, checkpoints=saver, options=opts)]
    if preemption is not None:
      actions.append(PreemptionStopAfterEpoch(preemption,
                                              callbacks=callbacks))
    actions.append(StopOnRequest(saver, opts))
    return actions

  @property
  def skipped(self) -> training_checks.SkippedStepMonitor:
    """The skipped-step monitor of the current (or last) run."""
    return self._skipped.monitor

  # --- evaluation ------------------------------------------------------------
  def evaluate(self, step: int,
               callbacks: Optional[keras.callbacks.CallbackList] = None, *,
               check_loss: bool = True) -> Optional[dict]:
    """Evaluates the current weights; logs and returns the result.

    Args:
      step: the step of the weights.
      callbacks: Keras callbacks to get `on_test_begin`, `on_test_end` (with
        the loss and metrics) and, when one overrides them
        (`keras_callbacks.reads_test_batches`), `on_test_batch_begin` and
        `on_test_batch_end` with the running logs (the `evaluate`
        function is then called with `on_batch_begin` and `on_batch_end`);
        None: no hooks.
      check_loss: raise when the loss is not finite (False: the run has
        diverged already and this evaluation is for the callbacks).

    Returns:
      The evaluation (`loss`, each metric, `num_examples`, `step`), or None
      without an `evaluate` function.

    Raises:
      tfdist.errors.TrainingDivergedError: the evaluation loss is not
        finite, nor the model's state (while the state is finite, a warning
        names the evaluation data and training goes on).
    """
    if self.evaluate_fn is None:
      return None
    if callbacks is None:
      result = dict(self.evaluate_fn())
    else:
      callbacks.on_test_begin()
      hooks = (dict(on_batch_begin=callbacks.on_test_batch_begin,
                    on_batch_end=callbacks.on_test_batch_end)
               if keras_callbacks.reads_test_batches(callbacks) else {})
      result = dict(self.evaluate_fn(**hooks))
      callbacks.on_test_end(run_log_lib.metric_values(result))
    result["step"] = step
    self.run_log.log_eval(step, result)
    for action in self.eval_actions:
      action(dict(result))
    # A model's own test_step may report no loss (custom_step).
    if check_loss and "loss" in result:
      finite_state = None
      if (not math.isfinite(result["loss"]) and
          self.checkpoints is not None):
        # Every worker has the same (reduced) loss, so all check together.
        finite_state = self.checkpoints.state_is_finite()
      training_checks.check_eval_loss(result["loss"], step=step,
                                      state_is_finite=finite_state)
    return result

  # --- training --------------------------------------------------------------
  def _current_step(self) -> int:
    return int(self.step_counter.numpy()) if self.step_counter is not None \
        else 0

  def run(self) -> ControllerResult:
    """Restores, then trains to `total_steps` (or until stopped).

    Returns:
      A `ControllerResult`.

    Raises:
      ValueError: an evaluation-only controller (no runner or checkpoints).
      tfdist.errors.PreemptedError: a stop signal reached this or
        another worker; a checkpoint at the step every worker stopped at was
        saved first.
      tfdist.errors.TrainingDivergedError: the training loss (checked
        after every chunk of steps) or the state to be saved (checked before
        every checkpoint) became NaN or infinite; nothing was saved after the
        last good checkpoint, which the message names.
      tfdist.errors.ParameterServerError: (coordinator
        runner) a ps task was lost.
    """
    if self.runner is None or self.checkpoints is None:
      raise ValueError("Controller.run needs a runner and checkpoints; this "
                       "controller was built for evaluation only.")
    try:
      return self._run()
    finally:
      self.run_log.release()  # A step line held for a failed evaluation.
      if self.profiler is not None:
        self.profiler.stop()  # Training stopped inside the window.

  def _run(self) -> ControllerResult:
    restored = self.checkpoints.restore()
    self.step = self._current_step()
    loop = Progress(step=self.step,
                    epoch=self.step // self.options.steps_per_epoch)
    if restored:
      logging.info("tfdist: restored %s: resuming at step %d", restored,
                   loop.step)
    self.run_log.resume(loop.step)
    started = time.time()
    for action in self.actions:
      action.on_begin(loop)
    micro_steps = 0
    stopped_early = False
    while loop.step < self.options.total_steps and not stopped_early:
      chunk = self._run_chunk(loop)
      micro_steps += int(chunk.output.sums.get("micro_steps",
                                               chunk.num_steps))
      stopped_early = chunk.stopped_early
      loop = _after(loop, chunk)
    for action in self.actions:
      loop = with_results(loop, action, action.on_end(loop))
    self.run_log.flush()
    return ControllerResult(
        step=loop.step, final_eval=loop.last_eval,
        stopped_early=stopped_early, restored_from=restored,
        train_seconds=time.time() - started,
        skipped_steps=self.skipped.total_skipped,
        micro_steps=micro_steps)

  def _run_chunk(self, loop: Progress) -> Chunk:
    """Runs the steps up to the next boundary, then threads the chunk's
    record through every action; returns the record with their results."""
    extra = [b for action in self.actions for b in action.boundaries(
        loop.step)]
    num_steps = next_boundary(loop.step, self.options, extra) - loop.step
    if self.runner.max_steps_per_call:
      num_steps = min(num_steps, self.runner.max_steps_per_call)
    request = StepRequest()
    for action in self.actions:
      asked = with_results(StepRequest(), action, action.before_steps(loop))
      # Each request stands: one action's False clears none.
      request = StepRequest(
          stop_signal=request.stop_signal or asked.stop_signal,
          stop_training=request.stop_training or asked.stop_training)
    output = self.runner.run(num_steps, start_step=loop.step,
                             stop_signal=request.stop_signal,
                             stop_training=request.stop_training)
    self.step = loop.step + num_steps
    chunk = Chunk(step=self.step, first_step=loop.step, epoch=loop.epoch,
                  output=output,
                  stop_requested=output.signals.stop_training)
    for index, action in enumerate(self.actions):
      try:
        chunk = with_results(chunk, action, action(chunk))
      except errors.TrainingDivergedError:
        self._wind_down(chunk, self.actions[index + 1:])
        raise
    return chunk

  def _wind_down(self, chunk: Chunk, rest: Sequence[Action]) -> None:
    """After a divergence error of an action: the actions after it end the
    epoch and the run as `fit` ends a run that TerminateOnNaN stops
    (`Action.on_diverged`); the caller then raises the error. A failure
    here is logged and does not replace that error."""
    try:
      for action in rest:
        chunk = with_results(chunk, action, action.on_diverged(chunk))
    except Exception:  # pylint: disable=broad-except
      logging.exception("tfdist: ending the diverged run at step %d failed "
                        "(the divergence error follows):", chunk.step)

  # --- the side-car evaluator ------------------------------------------------
  def evaluate_continuously(self, *, checkpoint_dir: str, results_dir: str,
                            restore: Callable[[str], None],
                            final_step: int,
                            finished: Callable[[], bool] = lambda: False,
                            poll_seconds: float = 2.0,
                            idle_timeout: Optional[float] = None
                            ) -> List[dict]:
    """Evaluates every checkpoint in `checkpoint_dir` once, in step order
    (`tfdist.training.controller.evaluator.evaluate_continuously`, with
    this controller's `evaluate` and run log; the arguments are its)."""
    return evaluator.evaluate_continuously(
        self.evaluate, self.run_log, checkpoint_dir=checkpoint_dir,
        results_dir=results_dir, restore=restore, final_step=final_step,
        finished=finished, poll_seconds=poll_seconds,
        idle_timeout=idle_timeout)
