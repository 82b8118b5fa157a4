"""tfdist.training.step: the training step and what runs in it or reads
what it returns: the compiled step, the step runners, a model's own
`train_step`, the loss and metrics, precision, batch norm's moving
statistics, and the checks of each chunk of steps.

Modules:
  train_loop         the inner training loop: one `tf.function` step run
                     with `strategy.run` (`Trainer`).
  step_runner        step runners: "run N training steps", the one thing
                     strategies differ in.
  custom_step        a model's own `train_step` and `test_step`, run as
                     Keras's `fit` runs them.
  objectives         the loss and metrics of a run: from arguments,
                     `compile`, or the data set.
  precision          mixed precision: the Keras dtype policy and loss
                     scaling.
  moving_statistics  batch normalization's moving statistics, made one
                     over the replicas.
  training_checks    checks the outer loop runs between chunks of steps:
                     skipped steps, a non-finite evaluation loss.

Nothing is imported here: import the module you use
(`from tfdist.training.step import train_loop`).
"""
