"""tfdist.parallel.zero3: ZeRO stage 3, the weights sharded over replicas.

Modules:
  optimizer  `Zero3Optimizer`: the optimizer's state, the gradients and
             the weights sharded over the replicas (a flat buffer), each
             block's weights gathered for its forward and backward pass;
             its checks (`check_model`), its replicated embedding tables
             (`replicated_variables`), materializing the weights for
             export (`materialize`).
  mode       the `zero3` step mode (`tfdist.parallel.mode.StepMode`): the
             trainer's passes on the gathered weights.

Attributes of `optimizer` are also read here on first use
(`zero3.replicated_variables`), without importing TensorFlow before then.
"""


def __getattr__(name):
  from tfdist import parallel  # pylint: disable=g-import-not-at-top
  return parallel.attribute_of(__name__, "optimizer", name)
