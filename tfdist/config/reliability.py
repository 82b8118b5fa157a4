"""The reliability section (`config.reliability`): the guards of a long run
(skipped steps, divergence, the `--model_dir` lease, resumption checks,
the dry run).

Consumers: the runner (`tfdist.experiment.runner`: the lease, the dry
run, resumption) and the training checks
(`tfdist.training.step.training_checks`).
"""

import dataclasses
import math

from tfdist.config.values import _need
from tfdist.config_tree import setting


# `--max_consecutive_skipped_steps`' default (the skipped-step monitor,
# tfdist.training.step.training_checks, takes it from here).
DEFAULT_MAX_CONSECUTIVE_SKIPPED_STEPS = 100


@dataclasses.dataclass(frozen=True)
class ReliabilityConfig:
  """Guards of a long run: skipped steps, divergence, the --model_dir lease,
  resumption checks, the dry run.
  """
  max_consecutive_skipped_steps: int = setting(
      DEFAULT_MAX_CONSECUTIVE_SKIPPED_STEPS, "integer",
      "performance",
      help=("Fail once this many steps in a row made no update (fp16: the "
            "summed gradient was not finite, so the step was skipped). A "
            "dynamic loss scale skips a few steps while it settles; 0: no "
            "limit. A run whose every step was skipped fails at its end "
            "regardless."),
      traits=())
  loss_explosion_factor: float = setting(
      10.0, "float", "reliability",
      help=("Warn when the training loss exceeds this multiple of its early "
            "value (the mean loss at the first log point): a run can diverge "
            "without ever reaching NaN. 0: no warning."),
      traits=("operational",))
  lease_timeout_seconds: float = setting(
      60.0, "float", "reliability",
      help=("The training chief holds a lease on --model_dir (lease.json), "
            "renewed every quarter of this; a second run on the same "
            "--model_dir refuses while the lease is live, and a restarted job"
            " takes over a lease not renewed for this many seconds."),
      traits=("operational",))
  allow_incompatible_resume: bool = setting(
      False, "bool", "reliability",
      help=("Resume from --model_dir's checkpoint even when the model or the "
            "global batch size differs from the run that wrote it (refused by"
            " default; other changes are allowed and listed)."),
      traits=("operational",))
  dry_run: bool = setting(
      False, "bool", "reliability", key=True,
      help=("Run every start-up check (flags, cluster, output folders, the "
            "--model_dir lease, data files and schema, resumption), print the"
            " plan and exit 0 without building the model or training."),
      traits=("operational",))

  def __post_init__(self):
    _need(self.max_consecutive_skipped_steps >= 0,
          "--max_consecutive_skipped_steps="
          f"{self.max_consecutive_skipped_steps} must be >= 0 (0: no limit).")
    factor = self.loss_explosion_factor
    _need(factor == 0 or (math.isfinite(factor) and factor > 1),
          f"--loss_explosion_factor={factor} must be > 1 (warn when the "
          "loss exceeds that multiple of its early value), or 0 for no "
          "warning.")
    _need(math.isfinite(self.lease_timeout_seconds) and
          self.lease_timeout_seconds > 0,
          f"--lease_timeout_seconds={self.lease_timeout_seconds} must be > 0 "
          "seconds.")
