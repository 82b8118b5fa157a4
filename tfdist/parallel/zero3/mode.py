"""The `zero3` step mode: ZeRO stage 3 (`--zero_stage=3`).

The trainer's `sharded` optimizer (a `tfdist.parallel.zero3.optimizer
.Zero3Optimizer`) holds one shard of every weight per replica; this mode
runs the trainer's forward and backward pass and its evaluation on the
gathered weights (whole, or block by block).
"""

from tfdist import errors
from tfdist.parallel import mode as mode_lib
from tfdist.parallel.zero3.optimizer import MODE_NAME
from tfdist.parallel.zero3.optimizer import replicated_variables
from tfdist.parallel.zero3.optimizer import state_variables
from tfdist.parallel.zero3.optimizer import Zero3Optimizer


@mode_lib.register_mode(MODE_NAME)
class Zero3Mode(mode_lib.StepMode):
  """The `zero3` step mode: the trainer's `sharded` optimizer (a
  `Zero3Optimizer`, `--zero_stage=3`) gathers the weights for each pass."""

  @classmethod
  def layout_rows(cls, facts) -> list:
    """ZeRO 3: trainable weights, gradients and optimizer state all / N,
    about 16 bytes / N per fp32 Adam parameter (P_os+g+p); non-trainable
    weights (batch-norm statistics) and embedding tables kept replicated
    stay whole. The transient gather of one block's weights during its
    pass is not counted."""
    e, n = facts.estimate, facts.num_devices
    trainable = e.gradients_bytes
    replicated = min(e.replicated_bytes, trainable)
    split = trainable - replicated
    note = facts.zero_note
    return [facts.row(
        "ZeRO 3", "--zero_stage=3", n,
        e.parameters_bytes - split + facts.ceil_div(split, n),
        replicated + facts.ceil_div(
            e.gradients_bytes - replicated + facts.accumulators, n),
        facts.ceil_div(e.optimizer_bytes, n), facts.replica_activations,
        not note, note)]

  @classmethod
  def model_facts(cls, model) -> dict:
    """`replicated_variables`: the embedding tables stage 3 keeps whole
    (for `tfdist.training.plan.memory.estimate_model_memory`)."""
    return {"replicated_variables": replicated_variables(model)}

  def bind(self, context) -> None:
    """Raises `tfdist.errors.ConfigError` unless the trainer shards at
    stage 3."""
    if not isinstance(context.sharded, Zero3Optimizer):
      raise errors.ConfigError(
          "The zero3 parallelism mode needs --zero_stage=3 (the trainer's "
          f"sharding). Received: sharding={context.sharded!r}. Pass "
          "sharding=ShardingOptions(stage=3), or another mode.")

  def variables(self, context) -> list:
    """The model's variables with the released weights replaced by this
    process's weight shards (`state_variables`)."""
    return state_variables(context.model, context)

  def forward_backward(self, context, inputs, labels, weights=None):
    return context.sharded.replica_forward_backward(context, inputs, labels,
                                                    weights)

  def eval_sums(self, context, inputs, labels, weights=None, mask=None):
    return context.sharded.replica_eval_sums(context, inputs, labels,
                                             weights, mask)
