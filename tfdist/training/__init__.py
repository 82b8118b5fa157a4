"""tfdist.training: the training step and its state, by role.

Subpackages:
  plan        what a run decides and checks before or at its start: the
              batch plan, the learning rate, the run plan, the memory plan
              and its meshes, the start-up checks, the differences from one
              device's `fit` said at start.
  step        the step and what runs in it: the compiled step
              (`train_loop`), the step runners, a model's own `train_step`,
              the loss and metrics, precision, batch norm's moving
              statistics, the checks of each chunk of steps.
  state       what persists and leaves the run: checkpoints and their file
              names, the Keras callbacks' state and files, the export.
  controller  the outer loop: one controller for every strategy.

Modules:
  assembly    the model, optimizer, trainer and checkpoint of a run, once.
  task        what a run trains: a `Task` (model builder, data set, loss
              and metrics).

Old names, the same module objects as their new homes: `optimizers`,
`decay_schedules`, `registry` and `reduce_dtype` (now in `tfdist.core`),
`sharded_embedding` (now in `tfdist.distribute`), and `export`, `memory`,
`lr_schedule` and `train_loop` (now in `state`, `plan` and `step`), each
kept because users' code or files name it (its docstring says where).

Nothing is imported here: import the module you use
(`from tfdist.training import assembly`,
`from tfdist.training.plan import run_plan`).
"""
