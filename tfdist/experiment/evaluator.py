"""The side-car evaluator: evaluates each checkpoint as the run evaluates.

`run_evaluator` (an `evaluator` task of any strategy, `--mode=eval`,
`--mode=continuous_eval`) runs an `EvaluatorRunner`; `evaluator_plan`
chooses its strategy and batch from the run's strategy's backend.
"""

import dataclasses
import os
import time
from typing import Any, Optional, Sequence, Tuple

from absl import logging
import tensorflow as tf

from tfdist.backends import registry as backends
from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.data import input_pipeline
from tfdist.distribute import strategy as strategy_lib
from tfdist.core.strategy_kind import StrategyKind
from tfdist.experiment import prepare
from tfdist.observability import run_log as run_log_lib
from tfdist.training import assembly
from tfdist.training.state import checkpoint_paths
from tfdist.training.state import checkpointing
from tfdist.training import controller as controller_lib
from tfdist.distribute import done_marker
from tfdist.training.step import precision
from tfdist.training.plan import run_plan as run_plan_lib
from tfdist.training import task as task_lib
from tfdist.training.controller import Controller, ControllerOptions

MIN_EVAL_BATCH_SIZE = run_plan_lib.MIN_EVAL_BATCH_SIZE


@dataclasses.dataclass(frozen=True)
class EvaluatorPlan:
  """How an evaluator process evaluates: as the run evaluates, where it can.

  Attributes:
    strategy: the `StrategyKind` it evaluates under (`mirrored`,
      `one_device`, or `off`: the default strategy); equal to its name.
    global_batch_size: examples per evaluation batch, over all its replicas.
    batch_source: where the batch came from, for the log.
    reason: why this strategy.
  """
  strategy: str
  global_batch_size: int
  batch_source: str
  reason: str


def _local_devices(config: TrainConfig) -> int:
  """Devices a mirrored evaluator would use in this process."""
  gpus = len(tf.config.list_physical_devices("GPU"))
  strategy = config.strategy
  if strategy.num_gpus != 0 and gpus:
    return gpus if strategy.num_gpus < 0 else min(gpus, strategy.num_gpus)
  return max(1, strategy.num_cpu_devices)


def _recorded_backend(record: Optional[dict]):
  """The backend of the strategy a run record names, or None (no record,
  no name, or a name this version does not know)."""
  try:
    return backends.backend_for(record["strategy"])
  except (TypeError, KeyError, ValueError):
    return None


def _evaluation_batch(config: TrainConfig, *, backend,
                      run_record: Optional[dict]) -> Tuple[int, str]:
  """`(global batch, where it came from)` for `evaluator_plan`."""
  if run_record and run_record.get("eval_batch_size"):
    return int(run_record["eval_batch_size"]), "the run's record"
  if run_record and run_record.get("global_batch_size"):
    batch = int(run_record["global_batch_size"])
    recorded = _recorded_backend(run_record)
    if recorded is not None:
      batch = recorded.evaluation_batch(batch)
    return batch, "the run's record (global batch)"
  if config.loop.batch_size and backend.asynchronous:
    # An evaluator task may start before the chief records the run: the
    # same flags give the coordinator's rule.
    return (backend.evaluation_batch(config.loop.batch_size),
            "--batch_size (the coordinator's rule)")
  if config.loop.batch_size:
    return (max(1, config.loop.batch_size //
                config.loop.gradient_accumulation_steps),
            "--batch_size / --gradient_accumulation_steps")
  return MIN_EVAL_BATCH_SIZE, "the default"


def evaluator_plan(config: TrainConfig, *, run_strategy: str,
                   run_record: Optional[dict]) -> EvaluatorPlan:
  """The strategy and batch an evaluator (`--mode=eval`,
  `--mode=continuous_eval`, an `evaluator` task) uses: the run's.

  Strategy: the run's where this process holds its devices (`mirrored`,
  `one_device`, `off`); under `multi_worker_mirrored` or
  `parameter_server` the evaluator is one process outside the cluster, so
  it mirrors over its local devices (`mirrored` when there are several,
  else `one_device`); under `tpu`, `one_device` (a TPU evaluator would
  hold the TPU the run trains on).

  Batch: the run's evaluation batch (`RunPlan.eval_batch_size`, recorded in
  the checkpoint folder's run record), else the record's
  `global_batch_size`, else the same rule on `config.loop.batch_size` (an
  evaluator task may start before the chief writes the record; it has the
  job's flags), else `MIN_EVAL_BATCH_SIZE`. A mirrored evaluator whose
  replicas do not divide the batch evaluates on one device instead (the
  batch is kept: the
  metrics do not depend on it, summed over examples, but a per-batch
  metric would; `run_evaluator` checks this once the strategy is built).

  Args:
    config: the evaluator's `TrainConfig`.
    run_strategy: the run's strategy name (`--distribution_strategy`, or
      the one the run recorded when the evaluator was given `auto`), or its
      `StrategyKind`.
    run_record: `run_config.json` of the checkpoint folder, or None.

  Raises:
    ValueError: `run_strategy` is no concrete strategy name.
  """
  backend = backends.backend_for(StrategyKind.parse(run_strategy))
  batch, source = _evaluation_batch(config, backend=backend,
                                    run_record=run_record)
  name, reason = backend.evaluator_strategy(_local_devices(config))
  return EvaluatorPlan(strategy=name, global_batch_size=batch,
                       batch_source=source, reason=reason)


def local_strategy(config: TrainConfig, decisions, kind: StrategyKind):
  """A one-process strategy `kind`, as its backend builds it (the
  evaluator's; `--mode=export`'s)."""
  return backends.backend_for(kind).build_strategy(
      config, dataclasses.replace(decisions, choice=dataclasses.replace(
          decisions.choice, strategy=kind)), cluster=None)


class EvaluatorRunner:
  """The side-car evaluator's run, built by named steps (as
  `ExperimentRunner`): `run()` calls `build_plan`, `build_strategy`,
  `build_model`, `build_controller`, then `evaluate_once` or
  `evaluate_continuously`. Override a step by subclassing.

  Attributes:
    config, task, cluster, decisions: as `run_evaluator` takes them.
    decision: `decisions.choice`.
    once: evaluate the latest checkpoint and stop (`--mode=eval`).
    latest: that checkpoint (None unless `once`).
    final_step, eval_files, how: set by `build_plan` (`how`: the
      `EvaluatorPlan`).
    choice, strategy, parts, trainer, dataset, run_log, controller: set by
      the later steps.

  Raises:
    ConfigError: `once` and no checkpoint to evaluate (in `__init__`).
  """

  def __init__(self, config: TrainConfig, *, task: task_lib.Task, cluster,
               decisions, poll_seconds: float = 2.0,
               idle_timeout: Optional[float] = None, once: bool = False):
    self.started = time.time()
    self.config, self.task = config, task
    self.cluster, self.decisions = cluster, decisions
    self.decision = decisions.choice
    self.poll_seconds, self.idle_timeout, self.once = (poll_seconds,
                                                       idle_timeout, once)
    self.checkpoint_dir = decisions.checkpoint_dir
    self.latest = (tf.train.latest_checkpoint(self.checkpoint_dir) if once
                   else None)
    if once and not self.latest:
      raise errors.ConfigError(
          f"--mode=eval: no checkpoint in {self.checkpoint_dir} to evaluate."
          " Train first (same --model_dir), or point --checkpoint_dir at "
          "one.")
    self.final_step = self.eval_files = self.how = None
    self.choice = self.strategy = self.parts = self.trainer = None
    self.dataset = self.run_log = self.controller = None

  def run(self) -> dict:
    """Returns `{"role": "evaluator", "results": [...]}`."""
    self.final_step, self.eval_files, self.how = self.build_plan()
    self.choice = self.build_strategy()
    self.strategy = self.choice.strategy
    self.parts, self.trainer, self.dataset = self.build_model()
    self.run_log = self.build_run_log()
    self.controller = self.build_controller()
    if self.once:
      return self.evaluate_once()
    return self.evaluate_continuously()

  def build_plan(self) -> Tuple[int, Sequence[str], EvaluatorPlan]:
    """`(final step, evaluation files, EvaluatorPlan)`."""
    config, spec = self.config, self.task.dataset
    plan = run_plan_lib.make_run_plan(
        prepare.plan_options(config, self.decisions), spec,
        num_replicas_in_sync=1,
        num_workers=1,
        asynchronous=True, decision=self.decision) if (
            config.loop.train_steps <= 0 and not self.once) else None
    final_step = (checkpoint_paths.checkpoint_step(self.latest) if self.once
                  else config.loop.train_steps
                  if config.loop.train_steps > 0 else
                  plan.total_steps)
    eval_files = (plan.eval_files if plan else
                  run_plan_lib.resolve_data_files(
                      run_plan_lib.decided_data(config.task.data,
                                                self.decisions),
                      spec)[1])
    record = checkpointing.read_run_record(self.checkpoint_dir,
                                           self.decisions.model_dir)
    # Told no strategy (`auto`), it evaluates with the one the run recorded.
    run_strategy = (record["strategy"] if record and record.get("strategy")
                    and self.decision.strategy_reason.startswith("auto")
                    else self.decision.strategy)
    how = evaluator_plan(config, run_strategy=run_strategy,
                         run_record=record)
    return final_step, eval_files, how

  def build_strategy(self) -> strategy_lib.StrategyChoice:
    """The plan's strategy; one device when its replicas do not divide the
    evaluation batch (`how` then says so)."""
    config, how = self.config, self.how
    precision.configure_precision(self.decisions.dtype)
    choice = local_strategy(config, self.decisions, how.strategy)
    replicas = choice.strategy.num_replicas_in_sync
    if how.global_batch_size % replicas:
      self.how = dataclasses.replace(
          how, strategy=StrategyKind.ONE_DEVICE, reason=(
              f"{replicas} local replicas do not divide the run's "
              f"evaluation batch {how.global_batch_size}"))
      choice = local_strategy(config, self.decisions,
                               StrategyKind.ONE_DEVICE)
    logging.info("Evaluator: %s, %d replica(s) (%s); global batch %d (from "
                 "%s)", self.how.strategy,
                 choice.strategy.num_replicas_in_sync, self.how.reason,
                 self.how.global_batch_size, self.how.batch_source)
    return choice

  def build_model(self) -> Tuple[assembly.Parts, Any, Any]:
    """`(parts, trainer, dataset)`: the model with its loss and metrics,
    what evaluates it, and the distributed evaluation data."""
    strategy, batch = self.strategy, self.how.global_batch_size
    with strategy.scope():
      parts = assembly.evaluation_parts(
          prepare.assembly_options(self.config, self.decisions),
          task=self.task)
    trainer = assembly.evaluation_trainer(parts, global_batch_size=batch,
                                          strategy=strategy)
    dataset = input_pipeline.distribute(strategy, input_pipeline.options_for(
        self.task.dataset, files=self.eval_files, global_batch_size=batch,
        is_training=False, cache=self.config.task.cache_dataset))
    return parts, trainer, dataset

  def build_run_log(self) -> run_log_lib.RunLog:
    """TensorBoard scalars under `<tensorboard_dir>/eval/`."""
    return run_log_lib.RunLog(
        tensorboard_dir=self.decisions.tensorboard_dir,
        metrics_dir=None, global_batch_size=self.how.global_batch_size,
        total_steps=self.final_step, eval_subdir="eval")

  def build_controller(self) -> Controller:
    """A controller that only evaluates; each result says how."""
    how, trainer, dataset = self.how, self.trainer, self.dataset
    evaluated_with = {"strategy": str(how.strategy),
                      "num_replicas_in_sync":
                          self.strategy.num_replicas_in_sync,
                      "global_batch_size": how.global_batch_size,
                      "reason": how.reason}
    return Controller(
        options=ControllerOptions(total_steps=max(self.final_step, 1),
                                  steps_per_epoch=1),
        run_log=self.run_log,
        evaluate=lambda: {**trainer.evaluate(dataset),
                          "evaluated_with": evaluated_with},
        model=self.parts.model)

  def restore(self, path: str) -> None:
    tf.train.Checkpoint(model=self.parts.model).restore(path).expect_partial()

  @property
  def results_dir(self) -> str:
    return os.path.join(self.decisions.model_dir, "eval")

  def evaluate_once(self) -> dict:
    """`--mode=eval`: the latest checkpoint, once."""
    self.restore(self.latest)
    result = self.controller.evaluate(self.final_step)
    result.update(checkpoint=self.latest)
    controller_lib.append_eval_result(self.results_dir, result)
    self.run_log.flush()
    print(f"Eval of {self.latest}: {run_log_lib.format_eval(result)}",
          flush=True)
    return {"role": "evaluator", "results": [result]}

  def evaluate_continuously(self) -> dict:
    """Each new checkpoint once, until the final step's, the done marker,
    or `idle_timeout`."""
    config = self.config
    logging.info("Evaluator for %d training worker(s): final step %d%s",
                 prepare.training_workers(
                     StrategyKind.parse(self.decision.strategy),
                     self.cluster), self.final_step,
                 "" if config.loop.train_steps > 0 else
                 " (from --train_epochs; the chief's done marker also ends "
                 "the evaluation)")
    results = self.controller.evaluate_continuously(
        checkpoint_dir=self.checkpoint_dir, results_dir=self.results_dir,
        restore=self.restore, final_step=self.final_step,
        finished=lambda: done_marker.marked_done_since(
            self.decisions.model_dir, self.started),
        poll_seconds=self.poll_seconds, idle_timeout=self.idle_timeout)
    return {"role": "evaluator", "results": results}


def run_evaluator(config: TrainConfig, *, task, cluster, decisions,
                  poll_seconds: float = 2.0,
                  idle_timeout: Optional[float] = None,
                  once: bool = False) -> dict:
  """The side-car evaluator: evaluates each checkpoint once, in step order.

  For an `evaluator` task of any strategy (it is never a cluster member: it
  joins no collective and writes no checkpoint, SavedModel or manifest),
  and for `--mode=continuous_eval`. It stops after the final step's
  checkpoint, once the chief marks the run done, or after `idle_timeout`
  seconds without a new checkpoint. With `once` (`--mode=eval`) it
  evaluates the latest checkpoint and returns. Results go to
  `<model_dir>/eval/eval_results.jsonl` and TensorBoard scalars to
  `<tensorboard_dir>/eval/`. It evaluates as the run does
  (`evaluator_plan`): the run's strategy where this process has its
  devices (else `mirrored`/`one_device` over the local devices) and the
  run's evaluation batch, so one checkpoint gives the run's numbers; each
  result records them under `evaluated_with`. Checkpoints of every
  strategy load into the local model (parameter servers' sharded tables
  included). The steps are `EvaluatorRunner`'s.

  Returns:
    `{"role": "evaluator", "results": [...]}`.

  Raises:
    ConfigError: `once` and no checkpoint to evaluate.
  """
  return EvaluatorRunner(config, task=task, cluster=cluster,
                         decisions=decisions, poll_seconds=poll_seconds,
                         idle_timeout=idle_timeout, once=once).run()
