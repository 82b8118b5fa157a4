"""tfdist.parallel.data: data parallelism, the whole model on every replica.

Modules:
  mode      the `data` step mode (`tfdist.parallel.mode.StepMode`): the
            model's own forward and backward pass, XLA-compiled under
            `--enable_xla`; the trainer sums the gradients over replicas.

ZeRO stages 1-2 (`--zero_stage`) shard the optimizer's state and the
accumulated gradients under this mode (`tfdist.training.sharded_optimizer`).
Nothing is imported here: import the module you use.
"""
