"""Synchronous data parallelism: what one device, Mirrored, MultiWorkerMirrored
and TPU runs share.

Every training process calls the `Trainer`'s compiled step on its own
distributed input (`tfdist.training.step.step_runner.LocalStepRunner`), and
evaluates the held-out data under the same strategy.
"""

import dataclasses
from typing import Callable, Optional

from tfdist.backends import base
from tfdist.data import input_pipeline
from tfdist.data import input_position as input_position_lib
from tfdist.training.step import step_runner


class SynchronousBackend(base.Backend):
  """Every training process runs every step on its share of the batch."""

  def build_inputs(self, run: base.TrainingRun):
    return (local_runner(run, num_input_pipelines=self.num_input_pipelines(
        run.num_workers)), local_evaluation(run, pad=self.on_tpu), {})

  def export_model(self, run: base.TrainingRun):
    """The trained model, its per-replica batch-norm statistics averaged
    (`tfdist.training.step.moving_statistics`): what was last evaluated."""
    run.synchronize_statistics()
    return super().export_model(run)


def local_runner(run: base.TrainingRun, *, num_input_pipelines: int
                 ) -> step_runner.LocalStepRunner:
  """The step runner over this process's distributed training input.

  Args:
    run: the `TrainingRun`.
    num_input_pipelines: the `tf.data` pipelines that feed the run (a
      dataset function's epoch is split among them).
  """
  settings, plan, strategy = run.settings, run.plan, run.strategy
  input_position = run.input_position
  train_options = input_pipeline.options_for(
      run.task.dataset, files=plan.train_files,
      global_batch_size=plan.global_batch_size, is_training=True,
      shuffle_buffer_size=settings.shuffle_buffer_size,
      cache=settings.cache_dataset, seed=settings.seed,
      file_record_counts=plan.train_file_counts,
      gradient_accumulation_steps=plan.batch.gradient_accumulation_steps,
      # A resumable position needs a reproducible reading order.
      deterministic=settings.deterministic or input_position is not None,
      # A dataset function's epochs of whole steps (as files'): the
      # examples each pipeline reads per epoch.
      examples_per_epoch=(
          None if run.task.dataset.reads_files else
          plan.steps_per_epoch * plan.global_batch_size //
          num_input_pipelines))

  def train_iterator(restored_step: int):
    """The training input from the restored step's position: where the
    checkpoint left the epoch, or the start of that epoch."""
    replay = None
    if input_position is not None:
      start = input_position.resume_step(restored_step)
      # A resume on another worker count replays the checkpoint's order.
      replay = input_position.replay_pipelines
    else:
      start = input_position_lib.epoch_start(restored_step,
                                             plan.steps_per_epoch)
    return iter(input_pipeline.distribute(
        strategy, dataclasses.replace(train_options, start_step=start,
                                      replay_pipelines=replay)))

  return step_runner.LocalStepRunner(
      trainer=run.parts.trainer, iterator_fn=train_iterator,
      num_workers=run.num_workers)


def local_evaluation(run: base.TrainingRun, *,
                     pad: bool) -> Optional[Callable[..., dict]]:
  """Held-out evaluation under the run's strategy (None: `--mode=train`).

  Args:
    run: the `TrainingRun`.
    pad: pad the last batches to the static batch shape (masked in the
      metrics), as TPUs need.
  """
  if run.settings.mode == "train":
    return None
  plan, trainer = run.plan, run.parts.trainer
  eval_data = input_pipeline.distribute(
      run.strategy, input_pipeline.options_for(
          run.task.dataset, files=plan.eval_files,
          # Micro-batches: what a step's memory was sized for.
          global_batch_size=plan.eval_batch_size,
          is_training=False,
          cache=run.settings.cache_dataset,
          pad_to_static_batches=pad))

  def evaluate(**hooks):
    # The model evaluated is the one checkpointed and exported: one copy of
    # unsynchronized batch norm's per-replica statistics.
    run.synchronize_statistics()
    return trainer.evaluate(eval_data, **hooks)

  return evaluate
