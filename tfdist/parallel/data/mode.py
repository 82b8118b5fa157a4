"""The `data` step mode: data parallelism (ZeRO stages 0-2 included).

Every replica runs the whole model on its share of the batch; the trainer
sums the gradients over replicas (`all_reduces_gradients`). Under
`--enable_xla` the forward and backward pass is one XLA-compiled function
(`compiled_pass`); the optimizer update stays outside it (its
cross-replica all-reduce cannot be compiled into one replica's cluster).
"""

import tensorflow as tf

from tfdist.parallel import mode as mode_lib


@mode_lib.register_mode("data")
class DataParallel(mode_lib.StepMode):
  """The whole model's pass on one replica's batch.

  Attributes:
    compiled_pass: after `bind`, the function `forward_backward` calls:
      `StepContext.model_forward_backward`, wrapped in
      `tf.function(jit_compile=True)` when the trainer applies XLA.
  """

  def __init__(self):
    self.compiled_pass = None

  @classmethod
  def layout_rows(cls, facts) -> list:
    """Data parallelism, ZeRO 1 (the optimizer state / N, Rajbhandari et
    al. 2020's P_os: 4+4+8/N bytes per fp32 Adam parameter) and ZeRO 2
    (also the gradient accumulators / N; TensorFlow has no reduce-scatter,
    so each step's gradients stay whole: without accumulation ZeRO 2
    equals ZeRO 1). Each replica holds a*B/N activations."""
    e, n = facts.estimate, facts.num_devices
    grads, acc, opt = (e.gradients_bytes, facts.accumulators,
                       e.optimizer_bytes)
    act, note = facts.replica_activations, facts.zero_note
    return [
        facts.row("data parallel", "", n, e.parameters_bytes, grads + acc,
                  opt, act),
        facts.row("ZeRO 1", "--zero_stage=1", n, e.parameters_bytes,
                  grads + acc, facts.ceil_div(opt, n), act, not note, note),
        facts.row("ZeRO 2", "--zero_stage=2", n, e.parameters_bytes,
                  grads + facts.ceil_div(acc, n), facts.ceil_div(opt, n),
                  act, not note, note)]

  def bind(self, context) -> None:
    self.compiled_pass = (
        tf.function(context.model_forward_backward, jit_compile=True)
        if context.xla_applied else context.model_forward_backward)

  def forward_backward(self, context, inputs, labels, weights=None):
    del context  # Bound in `bind`.
    return self.compiled_pass(inputs, labels, weights)
