"""tfdist.training: the training step and its state: the loop, step runners, the controller,
checkpoints, optimizers, schedules, precision, memory levers,
export.

Modules:
  assembly
  batch_plan
  checkpoint_paths
  checkpointing
  controller
  done_marker
  export
  keras_callbacks
  lr_schedule
  memory
  objectives
  optimizers
  precision
  registry
  run_plan
  sharded_embedding
  step_runner
  task
  train_loop
  training_checks

Nothing is imported here: import the module you use
(`from tfdist.training import assembly`).
"""
