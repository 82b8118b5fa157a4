"""tfdist.parallel: model parallelism beside the data-parallel trainer.

Modules:
  pipeline  cuts a Keras functional or Sequential model into stages on
            consecutive devices and trains it with micro-batches (GPipe
            or 1F1B schedules), equal to the unsplit model's step.

Nothing is imported here: import the module you use
(`from tfdist.parallel import pipeline`).
"""
