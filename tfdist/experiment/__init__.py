"""The run's assembly: from a `TrainConfig` to artifacts, one module a role.

Short wiring of one-job modules, in the order data flows:

    config + environment (tfdist.distribute.environment)
      -> task: model builder, data set, loss, metrics (tfdist.training.task)
      -> cluster (tfdist.distribute.cluster) -> decision: strategy and dtype
         (tfdist.distribute.auto_select, the one place that decides `auto`)
      -> backend: what the strategy does its own way (tfdist.backends)
      -> run plan: files, batch, learning rate (tfdist.training.plan.run_plan)
      -> model, optimizer, trainer, checkpoint (tfdist.training.assembly)
      -> input pipelines and step runner (the backend's)
         under one controller (tfdist.training.controller)
      -> artifacts: SavedModel (tfdist.training.state.export), manifest
         (tfdist.observability.manifest)

The modules, by role:

* `prepare`: the decisions every role makes first (`start_run`,
  `prepare_run`, `PreparedRun`);
* `runner`: a training process's run (`ExperimentRunner`, named build
  steps);
* `evaluator`: the side-car evaluator (`run_evaluator`, `EvaluatorRunner`,
  `evaluator_plan`);
* `dry_run`: `--dry_run` (`dry_run`, `planned_replicas`);
* `run`: `run_experiment`, which sends each process to its role.

No module here asks which strategy runs: the backend answers
(`tfdist.backends.base.Backend`), so a new strategy adds a backend, not a
branch here.
"""

from tfdist.experiment.dry_run import planned_replicas
from tfdist.experiment.evaluator import EvaluatorPlan
from tfdist.experiment.evaluator import EvaluatorRunner
from tfdist.experiment.evaluator import evaluator_plan
from tfdist.experiment.evaluator import run_evaluator
from tfdist.experiment.prepare import PreparedRun
from tfdist.experiment.prepare import prepare_run
from tfdist.experiment.prepare import start_run
from tfdist.experiment.prepare import training_workers
from tfdist.experiment.run import run_experiment
from tfdist.experiment.runner import CROSS_PROCESS_BYTES_PER_CALL
from tfdist.experiment.runner import CROSS_PROCESS_WARN_BYTES
from tfdist.experiment.runner import cross_process_memory_warning
from tfdist.experiment.runner import ExperimentRunner

__all__ = [
    "CROSS_PROCESS_BYTES_PER_CALL", "CROSS_PROCESS_WARN_BYTES",
    "EvaluatorPlan", "EvaluatorRunner", "ExperimentRunner", "PreparedRun",
    "cross_process_memory_warning", "evaluator_plan", "planned_replicas",
    "prepare_run", "run_evaluator", "run_experiment", "start_run",
    "training_workers",
]
