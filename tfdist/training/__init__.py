"""tfdist.training: the training step and its state: the loop, step runners,
the controller, checkpoints, schedules, precision, memory levers, export.
The optimizer, decay-schedule and model/data-set registries live on the
bottom floor (`tfdist.core`); `optimizers`, `decay_schedules`, `registry`,
`reduce_dtype` and `sharded_embedding` here are their old names, the same
module objects.

Modules:
  assembly
  batch_plan
  checkpoint_paths
  checkpointing
  controller
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
