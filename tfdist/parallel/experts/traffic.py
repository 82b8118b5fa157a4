"""What expert parallelism moves per step: the run plan's lines.

Pure Python (no TensorFlow): the `--dry_run` plan prints them before
anything is built. The traffic is the expert inputs' and outputs' round
trip of each `MixtureOfExperts` layer (`tfdist.parallel.experts.mode`):
each replica holds a `[E, groups, C, d_model]` tensor of dispatched
tokens (GShard's dense dispatch, Lepikhin et al. 2020), sends the
`(E_p - 1) / E_p` of it that belongs to the other replicas of its expert
group by one all-to-all, and gets as much back with the experts' outputs
by a second; the backward pass runs the two inverse all-to-alls. So per
layer and update each replica sends

  4 * (E_p - 1) / E_p * E * groups * C * d_model  elements

in the compute dtype, with `groups` = the replica's tokens of the update
(per-replica batch x micro-steps x tokens per example) over the tokens of
one routing group, and `C = capacity(group tokens, E, k, cf)`.
"""

import dataclasses
import math
from typing import List

# The all-to-alls per MixtureOfExperts layer and update: dispatch and
# combine forward, their inverses backward.
ALL_TO_ALLS_PER_LAYER = 4


def capacity(tokens: int, *, num_experts: int, top_k: int,
             capacity_factor: float) -> int:
  """Tokens each expert takes from a group: ceil(k * tokens * cf / E).

  The rule of GShard and the Switch Transformer (there
  `tokens_per_batch / num_experts * capacity_factor`, with k slots per
  token for top-k). Computed in float64.

  Args:
    tokens: tokens in one routing group (>= 1).
    num_experts: E.
    top_k: experts per token (k).
    capacity_factor: slots per expert over an even share (> 0).

  Returns:
    C, an int >= 1 for positive arguments.
  """
  return int(math.ceil(top_k * tokens * capacity_factor / num_experts))


@dataclasses.dataclass(frozen=True)
class ExpertsShape:
  """A model's mixture-of-experts layers, as the plan counts them.

  Attributes:
    layers: `MixtureOfExperts` layers in the model.
    num_experts: E, experts per layer.
    top_k: k, experts per token.
    capacity_factor: slots per expert over an even share.
    tokens_per_example: tokens one example brings to each layer.
    tokens_per_group: tokens of one routing group (the layer's
      `group_size`).
    d_model: the width of a token's activation (elements).
  """
  layers: int
  num_experts: int
  top_k: int
  capacity_factor: float
  tokens_per_example: int
  tokens_per_group: int
  d_model: int

  def groups(self, examples: int) -> int:
    """Routing groups of `examples` examples (whole groups: the last may
    be partial)."""
    return math.ceil(examples * self.tokens_per_example /
                     self.tokens_per_group)

  @property
  def capacity(self) -> int:
    """C, the slots each expert has in a group (`capacity`)."""
    return capacity(self.tokens_per_group, num_experts=self.num_experts,
                    top_k=self.top_k, capacity_factor=self.capacity_factor)


def all_to_all_bytes(shape: ExpertsShape, *, expert_parallel: int,
                     examples: int, compute_bytes: int) -> int:
  """Bytes one replica sends by all-to-all in one update.

  Args:
    shape: the model's `ExpertsShape`.
    expert_parallel: E_p, the replicas of one expert group.
    examples: the examples one replica computes in one update (per-replica
      batch x micro-steps).
    compute_bytes: bytes per element of the compute dtype (4: fp32, 2:
      bf16 or fp16).

  Returns:
    `layers * 4 * (E_p - 1) / E_p * E * groups * C * d_model *
    compute_bytes`, an int (0 for E_p = 1).
  """
  elements = (shape.num_experts * shape.groups(examples) * shape.capacity *
              shape.d_model)
  return (shape.layers * ALL_TO_ALLS_PER_LAYER * elements *
          (expert_parallel - 1) * compute_bytes) // expert_parallel


def zero_line(stage: int, *, expert_parallel: int, replicas: int) -> str:
  """The run plan's line of ZeRO stage 1 or 2 beside expert parallelism
  (`tfdist.parallel.experts.zero`): what one replica keeps of the
  optimizer state (and at stage 2 of the gradient accumulators)."""
  accumulators = (", and 1/{r} of the non-expert gradient accumulators "
                  "(with --gradient_accumulation_steps)".format(r=replicas)
                  if stage == 2 else "")
  return (f"  optimizer state        ZeRO stage {stage}: each replica keeps "
          f"1/{replicas} of the non-expert weights' optimizer state (one "
          f"shard of their flat buffer) and the whole state of its "
          f"1/{expert_parallel} of the experts{accumulators}")


def _mib(n: int) -> str:
  return f"{n / 2**20:.2f} MiB"


def plan_lines(facts) -> List[str]:
  """The run plan's lines for `--expert_parallel=E_p` (E_p > 1): the
  expert groups, and the all-to-all bytes one replica sends per update
  when the model's `ExpertsShape` is known (`facts.experts`), else the
  formula.

  Args:
    facts: a `tfdist.parallel.mode.PlanFacts`.
  """
  e_p = facts.parallelism.expert_parallel
  replicas = facts.num_replicas_in_sync
  groups = max(replicas // e_p, 1)
  lines = [
      f"  expert_parallel        {e_p}: each MixtureOfExperts layer's "
      f"experts split over {groups} expert group(s) of {e_p} consecutive "
      f"replicas; each replica holds 1/{e_p} of the experts and their "
      "optimizer state, the other weights stay data-parallel"]
  if facts.zero_stage in (1, 2):
    lines.append(zero_line(facts.zero_stage, expert_parallel=e_p,
                           replicas=replicas))
  shape = facts.experts
  if shape is None:
    lines.append(
        "  all-to-all per update  4 x (E_p-1)/E_p x E x groups x C x "
        "d_model elements per MixtureOfExperts layer and replica "
        "(the layers' shapes are known once the model is built)")
    return lines
  examples = facts.per_replica_batch_size * facts.gradient_accumulation_steps
  sent = all_to_all_bytes(shape, expert_parallel=e_p, examples=examples,
                          compute_bytes=facts.compute_bytes)
  lines.append(
      f"  all-to-all per update  {_mib(sent)} sent by each replica: "
      f"{shape.layers} layer(s) x {ALL_TO_ALLS_PER_LAYER} (2 forward, 2 "
      f"backward) x {e_p - 1}/{e_p} of [E={shape.num_experts}, "
      f"groups={shape.groups(examples)}, C={shape.capacity}, "
      f"d_model={shape.d_model}] x {facts.compute_bytes} bytes")
  return lines
