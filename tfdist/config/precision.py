"""The precision section (`config.precision`): `--dtype`, the loss scale and
XLA, and the parsers of their flag values.

Consumers: `tfdist.distribute.decisions` (the hardware's dtype and loss
scale) and the assembly (`tfdist.training.assembly`: the Keras policy,
loss scaling, the compiled step).
"""

import dataclasses
import math
from typing import Optional

from tfdist import errors
from tfdist.config.values import _need
from tfdist.config.values import _set
from tfdist.config_tree import setting


DTYPES = ("fp32", "bf16", "fp16", "auto")
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
                 "fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "auto": "auto"}


def normalize_dtype(value: str) -> str:
  """Maps `--dtype` spellings (`float16`, `fp16`, ...) to `fp32|bf16|fp16|auto`.

  Raises:
    ConfigError: `value` is not a known spelling.
  """
  key = str(value).strip().lower()
  if key not in DTYPE_ALIASES:
    raise errors.ConfigError(
        f"--dtype={value!r} is not a known precision. Use one of "
        f"{', '.join(sorted(DTYPE_ALIASES))}.")
  return DTYPE_ALIASES[key]


def parse_loss_scale(value) -> Optional[object]:
  """Parses `--loss_scale`: None, `'dynamic'`, or a positive number.

  Returns:
    None, the string `'dynamic'`, or a float > 0.

  Raises:
    ConfigError: the value is neither `dynamic` nor a positive number.
  """
  if value is None or value == "":
    return None
  if isinstance(value, str) and value.strip().lower() == "dynamic":
    return "dynamic"
  try:
    number = float(value)
  except (TypeError, ValueError):
    number = float("nan")
  if not math.isfinite(number) or number <= 0:
    raise errors.ConfigError(
        f"--loss_scale={value!r} is neither 'dynamic' nor a positive number. "
        "Use --loss_scale=dynamic or, for a fixed scale, e.g. --loss_scale=128.")
  return number


DTYPE_FLAG_VALUES = ("fp32", "bf16", "fp16", "auto", "float32", "bfloat16",
                     "float16")


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
  """Precision and compilation. `dtype` None: not given (`TrainConfig`
  makes it fp32; the decisions make it bf16 on a TPU,
  `tfdist.distribute.decisions`).
  """
  # Stored normalized: fp32, bf16, fp16 or auto (`normalize_dtype`).
  dtype: Optional[str] = setting(
      None, "enum", "performance", choices=DTYPE_FLAG_VALUES, key=True,
      case_sensitive=False,
      help=("Precision: fp32; bf16 (Keras policy mixed_bfloat16); fp16 "
            "(mixed_float16 with loss scaling; not on TPUs); auto: chosen "
            "from the hardware (bf16 on TPUs and GPUs of compute capability "
            ">= 8.0, fp16 on 7.x GPUs, fp32 on CPUs) and printed. Default: "
            "bf16 with --distribution_strategy=tpu, else fp32."),
      traits=("decided",))
  # Stored as None, 'dynamic' or a float > 0 (`parse_loss_scale`).
  loss_scale: Optional[object] = setting(
      None, "string", "performance", key=True,
      help=("fp16 only: 'dynamic' (the default with --dtype=fp16) or a fixed "
            "positive number such as 128."),
      traits=("decided",))
  enable_xla: bool = setting(
      False, "bool", "performance",
      help=("Jit-compile the training step with XLA. Keras 3 turns XLA off "
            "under a tf.distribute strategy, so tfdist compiles its own per-"
            "replica step (TPUs always compile with XLA)."),
      traits=())

  def __post_init__(self):
    if self.dtype is not None:
      _set(self, "dtype", normalize_dtype(self.dtype))
    _set(self, "loss_scale", parse_loss_scale(self.loss_scale))
    # A loss scale only means something under fp16.
    _need(self.loss_scale is None or self.dtype in (None, "fp16", "auto"),
          f"--loss_scale={self.loss_scale} only applies to --dtype=fp16 "
          f"(received --dtype={self.dtype}). Drop --loss_scale or use "
          "--dtype=fp16.")
