"""tfdist.parallel.data: data parallelism, the whole model on every replica.

Modules:
  mode               the `data` step mode (`tfdist.parallel.mode.StepMode`):
                     the model's own forward and backward pass,
                     XLA-compiled under `--enable_xla`; the trainer sums
                     the gradients over replicas.
  sharded_optimizer  ZeRO stages 1 and 2 (`--zero_stage`): the optimizer's
                     state and the accumulated gradients sharded over the
                     replicas (`ShardingOptions`, `ShardedOptimizer`,
                     `FlatLayout`).

Nothing is imported here: import the module you use.
"""
