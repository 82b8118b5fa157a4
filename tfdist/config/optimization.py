"""The optimization section (`config.optimization`: the optimizer and
gradient clipping) and its learning-rate section
(`config.optimization.learning_rate`).

Consumers: the assembly builds the optimizer (`tfdist.training.assembly`,
`tfdist.core.optimizers`); `tfdist.training.plan.lr_schedule` takes
`config.optimization.learning_rate` as its `LROptions`.
"""

import dataclasses
import math
from typing import Optional, Tuple

from tfdist import config_tree
from tfdist.config.values import _need
from tfdist.config.values import _set
from tfdist.config.values import _split_list
from tfdist.config.values import UNSET_DEFAULTS
from tfdist.config_tree import setting
from tfdist.core import decay_schedules
from tfdist.core import optimizers


LR_SCALING_RULES = ("linear", "sqrt", "none")


def _optimizer_help() -> str:
  """`--optimizer`'s help: a function, so that optimizers registered before
  the flags are defined are named."""
  names = [name for name in optimizers.registered_optimizers()
           if name not in ("sgd", "momentum")]
  return ("Keras optimizer: sgd and momentum (SGD with --momentum), "
          f"{', '.join(names)} "
          "(tfdist.training.optimizers.register_optimizer adds more), or any "
          "name keras.optimizers.get accepts. Default: the --dataset's "
          f"recommendation, else {UNSET_DEFAULTS['optimizer']}.")


@dataclasses.dataclass(frozen=True)
class LearningRateConfig:
  """The learning rate: its base, scaling to the global batch, warmup and
  decay; the options of `tfdist.training.plan.lr_schedule` (`LROptions`).

  `base_learning_rate` and `lr_scaling` None: not resolved yet
  (`TrainConfig`).
  """
  base_learning_rate: Optional[float] = setting(
      None, "float", "lr", key=True,
      help=("Learning rate tuned for --base_batch_size examples; scaled to "
            "the global batch by --lr_scaling. Default: the --dataset's "
            "recommendation, else "
            f"{UNSET_DEFAULTS['base_learning_rate']}."),
      traits=("recommendable",))
  base_batch_size: int = setting(
      256, "integer", "lr",
      help="The batch size --base_learning_rate was tuned for.",
      traits=())
  lr_scaling: Optional[str] = setting(
      None, "enum", "lr", choices=LR_SCALING_RULES, key=True,
      help=("linear: base_lr * global_batch / base_batch (Goyal et al. 2017, "
            "for SGD); sqrt: base_lr * sqrt(global_batch / base_batch) (for "
            "Adam-type optimizers); none. Default: the --dataset's "
            "recommendation, else "
            f"{UNSET_DEFAULTS['lr_scaling']}."),
      traits=("recommendable",))
  warmup_steps: Optional[int] = setting(
      None, "integer", "lr", key=True,
      help=("Steps of linear warmup to the peak LR (0: none). Default (with "
            "--warmup_epochs unset): the smaller of one epoch and a tenth of "
            "the run."),
      traits=())
  warmup_epochs: Optional[float] = setting(
      None, "float", "lr", key=True,
      help="Warmup length in epochs (instead of --warmup_steps).",
      traits=())
  warmup_start_learning_rate: float = setting(
      0.0, "float", "lr",
      help="Learning rate at step 0, where warmup starts.",
      traits=())
  lr_schedule: str = setting(
      "constant", "enum", "lr", key=True,
      # A function: schedules registered before the flags are defined count.
      choices=decay_schedules.registered_decay_schedules,
      help=("Decay after warmup: constant; cosine (to "
            "end_learning_rate_factor x peak); piecewise (peak x "
            "--piecewise_multipliers at --piecewise_boundaries); or one "
            "registered with "
            "tfdist.training.decay_schedules.register_decay_schedule before "
            "the flags are defined."),
      traits=())
  end_learning_rate_factor: float = setting(
      0.0, "float", "lr",
      help="cosine: final LR as a fraction of the peak.",
      traits=())
  piecewise_boundaries: Tuple[float, ...] = setting(
      (0.5, 0.75), "list", "lr",
      help=("piecewise: boundaries as fractions of the steps after warmup, "
            "increasing, in (0, 1)."),
      traits=())
  piecewise_multipliers: Tuple[float, ...] = setting(
      (1.0, 0.1, 0.01), "list", "lr",
      help="piecewise: multipliers of the peak LR, one more than boundaries.",
      traits=())

  def __post_init__(self):
    _set(self, "piecewise_boundaries",
         tuple(float(b) for b in _split_list(self.piecewise_boundaries)))
    _set(self, "piecewise_multipliers",
         tuple(float(m) for m in _split_list(self.piecewise_multipliers)))
    _need(self.lr_scaling is None or self.lr_scaling in LR_SCALING_RULES,
          f"--lr_scaling={self.lr_scaling!r} is unknown. Use one of: "
          f"{', '.join(LR_SCALING_RULES)}.")
    decay_schedules.check_decay_schedule(self.lr_schedule)
    self._validate_learning_rate()

  def _validate_learning_rate(self):
    """Base learning rate and batch, warmup, and the schedule's shape."""
    _need(self.base_batch_size > 0,
          f"--base_batch_size={self.base_batch_size} must be > 0.")
    _need(self.base_learning_rate is None or self.base_learning_rate > 0,
          f"--base_learning_rate={self.base_learning_rate} must be > 0.")
    _need(self.warmup_start_learning_rate >= 0,
          f"--warmup_start_learning_rate={self.warmup_start_learning_rate} "
          "must be >= 0.")
    _need(self.warmup_steps is None or self.warmup_epochs is None,
          f"--warmup_steps={self.warmup_steps} and --warmup_epochs="
          f"{self.warmup_epochs} were both given: pass only one.")
    _need(self.warmup_steps is None or self.warmup_steps >= 0,
          f"--warmup_steps={self.warmup_steps} must be >= 0.")
    _need(self.warmup_epochs is None or self.warmup_epochs >= 0,
          f"--warmup_epochs={self.warmup_epochs} must be >= 0.")
    _need(0.0 <= self.end_learning_rate_factor <= 1.0,
          f"--end_learning_rate_factor={self.end_learning_rate_factor} must "
          "be in [0, 1].")
    boundaries = self.piecewise_boundaries
    _need(len(self.piecewise_multipliers) == len(boundaries) + 1,
          "--piecewise_multipliers needs exactly one more value than "
          f"--piecewise_boundaries. Received {len(boundaries)} "
          f"boundaries and {len(self.piecewise_multipliers)} multipliers.")
    _need(all(0.0 < b < 1.0 for b in boundaries) and
          list(boundaries) == sorted(boundaries),
          f"--piecewise_boundaries={','.join(map(str, boundaries))}"
          " must be increasing fractions of training in (0, 1), e.g. "
          "0.5,0.75.")


@dataclasses.dataclass(frozen=True)
class OptimizationConfig:
  """The optimizer, its learning rate and gradient clipping.

  `optimizer` None: not resolved yet (`TrainConfig`).
  """
  optimizer: Optional[str] = setting(
      None, "string", "lr", key=True, help=lambda: _optimizer_help(),
      traits=("recommendable",))
  momentum: float = setting(
      0.9, "float", "lr",
      help="Momentum for sgd, momentum and rmsprop.",
      traits=())
  weight_decay: float = setting(
      0.0, "float", "lr",
      help="Decoupled weight decay (0: none; adamw uses 0.004 when 0).",
      traits=())
  learning_rate: LearningRateConfig = config_tree.section(
      LearningRateConfig)
  global_clipnorm: Optional[float] = setting(
      None, "float", "lr",
      help=("Clip the gradient so that the global norm of all variables' "
            "gradients is at most this (Keras optimizer option). Applied once"
            " per step, to the gradient summed over all replicas and workers "
            "(and unscaled under fp16), so N replicas clip as one device "
            "would."),
      traits=())
  clipnorm: Optional[float] = setting(
      None, "float", "lr",
      help=("Clip each variable's gradient to at most this norm (Keras "
            "optimizer option); applied like --global_clipnorm, to the summed"
            " gradient. Give at most one of the two."),
      traits=())

  def __post_init__(self):
    if self.optimizer is not None:
      optimizers.optimizer_spec(self.optimizer)  # Raises for an unknown one.
    self._validate_clipping()

  def _validate_clipping(self):
    """Gradient clipping: positive norms, at most one of the two."""
    for name in ("clipnorm", "global_clipnorm"):
      value = getattr(self, name)
      _need(value is None or (math.isfinite(value) and value > 0),
            f"--{name}={value} must be a positive number (the largest "
            "gradient norm kept), or unset for no clipping.")
    _need(self.clipnorm is None or self.global_clipnorm is None,
          f"--clipnorm={self.clipnorm} and --global_clipnorm="
          f"{self.global_clipnorm} were both given: Keras optimizers take "
          "one. Use --global_clipnorm to clip the norm of all gradients "
          "together, --clipnorm to clip each variable's gradient alone.")
