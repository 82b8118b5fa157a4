"""ZeRO stages by name (Rajbhandari et al. 2020): the switch each
`--zero_stage=N` stands for, for messages that name what the user typed.
No TensorFlow, nothing first-party: the bottom floor, read by the config's
pieces (the parallel modes' light option checks) and the memory plan."""

from typing import Dict

# The switch each ZeRO stage's `--zero_stage=N` stands for.
ZERO_STAGE_SWITCHES: Dict[int, str] = {
    1: "--shard_optimizer_state", 2: "--shard_gradients",
    3: "--shard_parameters"}


def stage_flags(stage: int) -> str:
  """`--zero_stage=N (--switch)`, the flag and the switch that sets it
  (e.g. `--zero_stage=3 (--shard_parameters)`); `--zero_stage=N` for a
  stage without a switch (0)."""
  switch = ZERO_STAGE_SWITCHES.get(stage)
  return f"--zero_stage={stage}" + (f" ({switch})" if switch else "")
