"""The memory section (`config.memory`): activation recomputation, sharded
data parallelism (ZeRO) and the host allocator.

Consumers: the assembly (`tfdist.training.assembly`: ZeRO's optimizer and
stage 3), `tfdist.training.plan.run_plan` (recomputation in the memory plan),
the backends' ZeRO rules (`tfdist.backends`) and the allocator
(`tfdist.runtime.allocator`).
"""

import dataclasses
from typing import Optional

from tfdist.config.values import _need
from tfdist.config_tree import setting
from tfdist.core import optimizers


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
  """Memory levers: activation recomputation, sharded data parallelism
  (ZeRO, Rajbhandari et al. 2020: `zero_stage` says in DeepSpeed's terms
  what the three switches say; tfdist/parallel/data/sharded_optimizer.py), the
  host allocator.

  The switches None: unset (`TrainConfig` makes them False, so a switch
  given as False can contradict `zero_stage`).
  """
  activation_recomputation: bool = setting(
      False, "bool", "performance", alias="gradient_checkpointing",
      help=("The model recomputes the activations of each block in the "
            "backward pass instead of keeping them (tf.recompute_grad; the "
            "built-in cnn and resnet, or a builder taking "
            "activation_recomputation): less memory for about one more "
            "forward pass; same gradients, weights and checkpoints. Alias: "
            "--gradient_checkpointing."),
      traits=())
  shard_optimizer_state: Optional[bool] = setting(
      None, "bool", "performance",
      # A function: optimizers registered before the flags are defined count.
      help=lambda: (
          "ZeRO stage 1 (mirrored, multi_worker_mirrored): each of the N "
          "replicas keeps the optimizer slots of 1/N of the parameters; "
          "gradients are summed and sliced, each replica updates its shard, "
          "the shards are all-gathered. Same weights as unsharded; "
          "checkpoints interchangeable. Not with "
          f"{', '.join(optimizers.not_shardable())}."),
      traits=("multi_replica", "zero_switch"))
  shard_gradients: Optional[bool] = setting(
      None, "bool", "performance",
      help=("ZeRO stage 2: --shard_optimizer_state, and under "
            "--gradient_accumulation_steps > 1 each replica accumulates only "
            "its shard of the summed gradients (one all-reduce per micro-"
            "batch)."),
      traits=("multi_replica", "zero_switch"))
  shard_parameters: Optional[bool] = setting(
      None, "bool", "performance",
      help=("ZeRO stage 3 (mirrored, multi_worker_mirrored): "
            "--shard_gradients, and each replica keeps only 1/N of the "
            "weights, gathered block by block for each step's forward pass "
            "and again for its backward pass, which recomputes each block "
            "(about 2x the traffic of plain data parallelism). Embedding tables "
            "stay replicated (their optimizer state sharded). Not with a "
            "model's own train_step, --model=ranking, --enable_xla or "
            "--pipeline_stages."),
      traits=("multi_replica", "zero_switch"))
  zero_stage: Optional[int] = setting(
      None, "integer", "performance",
      help=("DeepSpeed's name for the three switches above: 0 off, 1 "
            "--shard_optimizer_state, 2 --shard_gradients, 3 "
            "--shard_parameters (sharded weights). Default: from the "
            "switches."),
      traits=("multi_replica",))
  zero3_blocks: int = setting(
      4, "integer", "performance",
      help=("ZeRO stage 3: the most blocks the model is cut into (about "
            "equal weight bytes); each gathers its weights just before it "
            "runs and again, recomputing itself, in the backward pass, so "
            "the step's peak holds one block's weights. 1: the whole model "
            "gathered once per step, no recomputation: faster, every weight "
            "at the peak."),
      traits=("operational",))
  zero3_prefetch: bool = setting(
      False, "bool", "performance",
      help=("ZeRO stage 3: gather each block's weights while the block "
            "before it computes (two blocks' weights at the peak); pays "
            "where collectives run beside compute (GPUs), not on CPUs."),
      traits=("operational",))
  tune_allocator: bool = setting(
      True, "bool", "performance",
      help=("Set glibc malloc so TensorFlow does not map and unmap every "
            "large tensor buffer at each step (M_MMAP_MAX=0, M_TOP_PAD=64 "
            "MiB; see tfdist/runtime/allocator.py). Costs resident memory: "
            "each malloc arena may keep up to 64 MiB of freed memory. "
            "--notune_allocator leaves malloc as it is."),
      traits=())

  def __post_init__(self):
    _need(self.zero_stage in (None, 0, 1, 2, 3),
          f"--zero_stage={self.zero_stage} is not offered: use 0 (off), 1 "
          "(shard optimizer state), 2 (also gradients) or 3 (also "
          "weights).")
    _need(isinstance(self.zero3_blocks, int) and self.zero3_blocks >= 1,
          f"--zero3_blocks={self.zero3_blocks!r} must be a positive integer"
          " (1: the whole model gathered at once).")
    _need(isinstance(self.tune_allocator, bool),
          f"--tune_allocator={self.tune_allocator!r} must be true or false.")

  @property
  def zero_stage_resolved(self) -> int:
    """The ZeRO stage: `zero_stage` if given, else 3 with
    `shard_parameters`, 2 with `shard_gradients`, 1 with
    `shard_optimizer_state`, else 0."""
    if self.zero_stage is not None:
      return int(self.zero_stage)
    return (3 if self.shard_parameters else
            2 if self.shard_gradients else
            1 if self.shard_optimizer_state else 0)
