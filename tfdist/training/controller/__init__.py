"""The outer loop: one controller for every strategy.

Orbit-style split: a step runner (`tfdist.training.step.step_runner`) runs steps
(a local call of the compiled step, or chunks scheduled on a
`ClusterCoordinator`); the `Controller` owns everything between steps, the same
way for every strategy:

* boundaries: it runs up to the next log, checkpoint, epoch or final step
  (and, for a local runner, at most `steps_per_execution` steps per call),
  so every boundary is hit exactly;
* logging (`tfdist.observability.run_log.RunLog`: one formatter, one set of
  TensorBoard scalars, one divergence check);
* checkpoints (`tfdist.training.state.checkpointing.CheckpointKeeper`): restore
  at start, save every `checkpoint_steps` (or at each epoch end) and at the end;
* evaluation every `epochs_between_evals` epochs and at the end;
* Keras callbacks (`set_params`, train/epoch/batch hooks with Keras's logs,
  the `on_test_*` hooks around each evaluation during training,
  `model.stop_training` honoured where `fit` honours it: EarlyStopping,
  TerminateOnNaN);
* preemption (`tfdist.runtime.preemption.PreemptionWatcher`): a signal on any
  worker stops every worker after the same step, with a checkpoint;
* a profiler window (`tfdist.observability.profiling.ProfileWindow`,
  `--profile_steps`): its edges are boundaries too, so the trace holds exactly
  those steps.

Where the time goes (examples/sec, step time, input wait, memory) is
logged at every log point by `tfdist.observability.run_log.RunLog` from the step
sums and the host's clock: the controller adds no host synchronization of its
own.

The loop itself is short (`Controller._run`): the step runner runs a chunk
up to the next boundary, then each `Action` does its side work, in order:
the profiler window, the divergence check, the skipped-step watch, Keras's
batch hooks, the log, the checkpoint, the preemption stop, the evaluation,
Keras's epoch hooks and the stop on a callback's request. The actions share
no mutable state: each receives an immutable record (`Progress` between
chunks, `StepRequest` before one, `Chunk` after one) with what the actions
before it produced, and returns what it produces (`{"saved": path}`);
the controller threads the results from one action to the next.

Stop requests (a signal, a callback's `model.stop_training`) ride with the
next chunk's step sums, which every worker reduces anyway, so workers agree
without a host synchronization of their own; they come back apart from the
metrics, as `tfdist.training.step.step_runner.StepSignals`. At epoch ends, where
callbacks decide, one all-reduce of one number makes them agree
(multi-worker only); after the batch hooks too, when a callback may stop
there (`keras_callbacks.may_stop_in_batch_hooks`), so training stops after
the call in whose hooks the flag was set, as `fit` stops after that batch
(its epoch then ends there: evaluated and given `on_epoch_end`).

Skipped steps (fp16 updates skipped for a non-finite summed gradient) come
back from the compiled step with each chunk's signals; the controller logs
them and stops a run whose optimizer no longer updates
(`tfdist.training.step.training_checks.SkippedStepMonitor`). A non-finite
training or evaluation loss stops the run as diverged: the actions after the one
that found it end the epoch and the run for the callbacks (`Action.on_diverged`,
as `fit` ends a run that TerminateOnNaN stops), then the error is raised;
it names the data as the cause when the batches concerned, read again
(`StepRunner.nonfinite_input`), hold NaN or infinite values.

`Controller.evaluate_continuously` is the one side-car evaluator: it
evaluates every checkpoint once, in step order (evaluator tasks of every
strategy, `tfdist.train --mode=continuous_eval`; `--mode=eval` evaluates
the latest checkpoint once).

The package, one module per role: `records` (the options, the result and
the records the actions exchange), `protocol` (`Action`), `checkpoints`
(the checkpoint service), `actions/` (the built-in actions, one module per
family: `keras_hooks`, `health`, `reporting`, `periodic`, `stops`),
`loop` (`Controller`), `evaluator` (the side-car evaluator) and
`eval_results` (the evaluations file). Every name is importable from here.
"""

from tfdist.training.controller.actions.health import DivergenceCheck
from tfdist.training.controller.actions.health import SkippedStepWatch
from tfdist.training.controller.actions.keras_hooks import KerasBatchEnd
from tfdist.training.controller.actions.keras_hooks import KerasEpochEnd
from tfdist.training.controller.actions.keras_hooks import KerasTrainHooks
from tfdist.training.controller.actions.periodic import Evaluate
from tfdist.training.controller.actions.periodic import SaveCheckpoint
from tfdist.training.controller.actions.reporting import ProfilerWindow
from tfdist.training.controller.actions.reporting import TrainLog
from tfdist.training.controller.actions.stops import PreemptionStop
from tfdist.training.controller.actions.stops import PreemptionStopAfterEpoch
from tfdist.training.controller.actions.stops import StopOnRequest
from tfdist.training.controller.checkpoints import Checkpoints
from tfdist.training.controller.eval_results import EVAL_RESULTS_FILE
from tfdist.training.controller.eval_results import append_eval_result
from tfdist.training.controller.eval_results import read_eval_results
from tfdist.training.controller.loop import Controller
from tfdist.training.controller.protocol import Action
from tfdist.training.controller.protocol import Produced
from tfdist.training.controller.protocol import with_results
from tfdist.training.controller.records import Chunk
from tfdist.training.controller.records import ControllerOptions
from tfdist.training.controller.records import ControllerResult
from tfdist.training.controller.records import Progress
from tfdist.training.controller.records import StepRequest
from tfdist.training.controller.records import next_boundary

__all__ = [
    "Action", "Checkpoints", "Chunk", "Controller", "ControllerOptions",
    "ControllerResult", "DivergenceCheck", "EVAL_RESULTS_FILE", "Evaluate",
    "KerasBatchEnd", "KerasEpochEnd", "KerasTrainHooks",
    "PreemptionStop", "PreemptionStopAfterEpoch", "Produced",
    "ProfilerWindow", "Progress", "SaveCheckpoint", "SkippedStepWatch",
    "StepRequest", "StopOnRequest", "TrainLog", "append_eval_result",
    "next_boundary", "read_eval_results", "with_results",
]
