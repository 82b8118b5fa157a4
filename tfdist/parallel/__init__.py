"""tfdist.parallel: model parallelism beside the data-parallel trainer.

Modules:
  collectives      all-reduce, all-gather, reduce-scatter and all-to-all
                   over a named sub-group of devices (raw collective ops,
                   per-device ordering tokens, own key range, gradients).
  mesh             the data x pipeline x tensor device mesh: each
                   device's coordinates and the groups along each axis.
  layout_map       a Keras LayoutMap (or ModelParallel) read as each
                   variable's tensor-parallel split and the Megatron pairs.
  pipeline         cuts a Keras functional or Sequential model into stages
                   on consecutive devices and trains it with micro-batches
                   (GPipe or 1F1B schedules), equal to the unsplit model's
                   step.
  tensor_parallel  Megatron-style column- and row-parallel Dense layers and
                   a parallel multi-head attention, each replica holding
                   1/N of their weights.

Nothing is imported here: import the module you use
(`from tfdist.parallel import pipeline`).
"""
