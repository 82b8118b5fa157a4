"""The cloud section (`config.cloud`): Vertex AI's Reduction Server and
hyperparameter tuning.

Consumers: the backends (the Reduction Server's cluster),
`tfdist.cloud.hptune` (the reported metric) and
`tfdist.training.plan.preflight`.
"""

import dataclasses
import re
from typing import Optional

from tfdist.config.values import _need
from tfdist.config_tree import setting


# `--hptune_metric` reports an evaluation value to Vertex AI's
# hyperparameter tuning: `eval_` and a key of the run's `eval_history`
# (`loss` or the name of one of the model's metrics; tfdist.cloud.hptune checks
# it against the model once built). tfdist's built-in models evaluate these
# (eval_auc for binary tasks such as --dataset=movielens).
HPTUNE_METRICS = ("eval_accuracy", "eval_loss", "eval_auc")
HPTUNE_METRIC_PATTERN = r"eval_[A-Za-z0-9_./-]+"


@dataclasses.dataclass(frozen=True)
class CloudConfig:
  """Vertex AI: the Reduction Server and hyperparameter tuning."""
  reduction_server: bool = setting(
      False, "bool", "vertex",
      help=("Vertex AI Reduction Server in worker pool 2: "
            "multi_worker_mirrored with NCCL all-reduce (implies "
            "--all_reduce_alg=nccl; GPUs only), and pool 2 is neither ps nor "
            "worker. Detected by itself when CLUSTER_SPEC's job description "
            "names the Reduction Server image."),
      traits=("operational", "multi_replica"))
  hptune_metric: Optional[str] = setting(
      None, "string", "vertex", key=True,
      help=("Report this value of each evaluation to Vertex AI hyperparameter"
            " tuning through cloudml-hypertune (pip install 'tfdist[vertex]';"
            " preinstalled in Vertex's prebuilt containers), from the chief: "
            "eval_loss, or eval_ and the name of one of the model's metrics "
            f"({', '.join(HPTUNE_METRICS)} for tfdist's models). "
            "Checked against the model before training. Unset: no reporting."),
      traits=("operational",))

  def __post_init__(self):
    _need(not self.hptune_metric or re.fullmatch(HPTUNE_METRIC_PATTERN,
                                                 self.hptune_metric),
          f"--hptune_metric={self.hptune_metric!r} is not an evaluation "
          "metric: give eval_ and the metric's name, e.g. eval_loss or "
          f"{', '.join(n for n in HPTUNE_METRICS if n != 'eval_loss')} for "
          "tfdist's models, eval_<name> for a metric of your model.")
