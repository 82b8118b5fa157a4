"""`--mode=export`: a checkpoint's model as a SavedModel, no step trained.

`run_export` builds the model as the side-car evaluator does (one device,
no optimizer), restores the newest checkpoint in `--checkpoint_dir` (by
default `<model_dir>/checkpoints`) into it, and writes the SavedModel that
the end of training writes (`tfdist.training.state.export`, to `--export_dir`,
by default `<model_dir>/saved_model`), marked with the checkpoint's step.
Nothing is trained, no checkpoint is written, no lease is taken (no run
writes the checkpoints meanwhile, as for `--mode=eval`). `tfdist.fit`
does the same for `TrainConfig(mode="export")`.
"""

import os

import tensorflow as tf

from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.core.strategy_kind import StrategyKind
from tfdist.experiment import evaluator as evaluator_lib
from tfdist.experiment import prepare
from tfdist.training import assembly
from tfdist.training.state import checkpoint_paths
from tfdist.training.state import export
from tfdist.training.step import precision
from tfdist.training import task as task_lib


def run_export(config: TrainConfig, *, task: task_lib.Task, cluster,
               decisions) -> dict:
  """Exports the newest checkpoint's model; returns what it wrote.

  Args:
    config: the run's `TrainConfig` (`mode="export"`).
    task: the model and data set (the data set gives the features'
      signature; no example is read for a dataset function's spec beyond
      one call).
    cluster: this process's `ClusterInfo` (one process: a member of a
      training cluster is refused).
    decisions: the run's `Decisions` (folders, dtype).

  Returns:
    `{"role": "export", "checkpoint": path, "step": int, "saved_model":
    folder}`; with `config.dry_run` only the checks run (the cluster, the
    checkpoint, the export folder) and `saved_model` is None.

  Raises:
    ConfigError: a member of a training cluster (export runs in one
      process), or no checkpoint to export.
    tfdist.errors.DamagedCheckpointError: the checkpoint does not hold this
      model's weights.
    tfdist.errors.ExportRefusedError: the model cannot be exported on its
      features, or the export folder holds something else.
  """
  if cluster.num_workers > 1 or cluster.num_ps:
    raise errors.ConfigError(
        "--mode=export exports in one process; this one is "
        f"{cluster.task_type} {cluster.task_index} of a training cluster. "
        "Run it without TF_CONFIG/--worker_hosts.")
  checkpoint_dir = decisions.checkpoint_dir
  latest = tf.train.latest_checkpoint(checkpoint_dir)
  if not latest:
    raise errors.ConfigError(
        f"--mode=export: no checkpoint in {checkpoint_dir} to export. Train "
        "first (same --model_dir), or point --checkpoint_dir at one.")
  source = decisions.output_sources()["export_dir"][1]
  export.check_export_dir(decisions.export_dir, source=source)
  step = checkpoint_paths.checkpoint_step(latest)
  if config.reliability.dry_run:
    print(f"Dry run: --mode=export would export {latest} (step {step}) to "
          f"{decisions.export_dir}.", flush=True)
    return {"role": "export", "checkpoint": latest, "step": step,
            "saved_model": None}
  precision.configure_precision(decisions.dtype)
  strategy = evaluator_lib.local_strategy(
      config, decisions, StrategyKind.ONE_DEVICE).strategy
  with strategy.scope():
    parts = assembly.evaluation_parts(
        prepare.assembly_options(config, decisions), task=task)
  model = parts.model
  status = tf.train.Checkpoint(model=model).restore(latest)
  try:
    status.assert_existing_objects_matched()
  except AssertionError as e:
    raise errors.DamagedCheckpointError(
        f"--mode=export: {latest} does not hold the weights of "
        f"--model={task.model_name} ({errors.first_line(e)}). Export with "
        "the model and flags that trained it.") from None
  status.expect_partial()  # The optimizer's slots stay unread.
  features, _ = task_lib.example_spec(task.dataset)
  reason = export.exportable(model, features)
  if reason is not None:
    raise errors.ExportRefusedError(
        f"--mode=export: no SavedModel of {latest}: {reason}. Restore the "
        "model from the checkpoint and export the parts you serve.")
  path = export.export_saved_model(
      model, decisions.export_dir, source=source,
      details={"step": step, "model": task.model_name,
               "checkpoint": os.path.basename(latest)},
      last_checkpoint=latest)
  # The run's one line of its result (a logged copy said it twice).
  print(f"Exported {latest} (step {step}) to {path}; nothing trained.",
        flush=True)
  return {"role": "export", "checkpoint": latest, "step": step,
          "saved_model": path}
