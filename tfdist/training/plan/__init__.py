"""tfdist.training.plan: what a run decides and checks before or at its
start: the batch plan, the learning rate, the run plan, the memory plan and
its meshes, the start-up checks, and the differences from one device's
`Model.fit` the run says at start.

Modules:
  batch_plan   how the global batch splits across replicas and steps.
  lr_schedule  learning-rate scaling and warmup schedules.
  run_plan     the run plan: files, example counts, batch plan and
               learning rate, once (`make_run_plan`).
  memory       what a model needs (`estimate_model_memory`,
               `sharded_estimate`, `layout_table`); the measurements of
               what a run used are `tfdist.observability.memory_use`'s.
  mesh_plan    every data x pipeline x tensor layout of N devices, with
               each ZeRO stage, per device, and the one to use.
  preflight    start-up checks that need neither data nor a model: names
               and outputs.
  differences  where a run differs from one device's `Model.fit`: one
               table, said in the run.

Nothing is imported here: import the module you use
(`from tfdist.training.plan import run_plan`).
"""
