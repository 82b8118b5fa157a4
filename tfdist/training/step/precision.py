"""Mixed precision: the Keras dtype policy and loss scaling.

`--dtype` maps to a Keras global policy: `fp32` -> `float32`, `bf16` ->
`mixed_bfloat16`, `fp16` -> `mixed_float16` (Micikevicius et al. 2018,
"Mixed Precision Training"). Under a mixed policy layers compute in the low
precision and keep float32 variables; models end in a float32 activation and
the loss runs in float32. fp16 needs loss scaling, which
`wrap_optimizer_for_precision` adds (Keras's `LossScaleOptimizer`; dynamic by
default, or a fixed scale).

Under a `tf.distribute` strategy the `LossScaleOptimizer` must be given the
gradient already summed over all replicas and workers (as
`tfdist.training.step.train_loop.Trainer` does): Keras decides "finite" from the
gradients it is given, before its own all-reduce, so from each replica's
share alone. One replica's overflow then wrote inf into the weights under
MirroredStrategy, and under MultiWorkerMirroredStrategy one worker entered
the all-reduce while the other skipped it (`DeadlineExceededError`). On the
summed gradient every replica and worker takes the same decision
(`step_skipped`).
"""

import os
from typing import Optional, Union

from absl import logging
import keras
import tensorflow as tf

POLICY_BY_DTYPE = {
    "fp32": "float32",
    "bf16": "mixed_bfloat16",
    "fp16": "mixed_float16",
}


def policy_name(dtype: str) -> str:
  """The Keras policy name for a normalized `--dtype` (`fp32|bf16|fp16`).

  Raises:
    ValueError: `dtype` is not one of `fp32`, `bf16`, `fp16`.
  """
  if dtype not in POLICY_BY_DTYPE:
    raise ValueError(
        f"--dtype={dtype!r} has no Keras policy; use fp32, bf16 or fp16.")
  return POLICY_BY_DTYPE[dtype]


def configure_precision(dtype: str) -> keras.DTypePolicy:
  """Sets the Keras global dtype policy for `dtype` and returns it.

  Call before building the model. On a machine without a GPU, fp16 with
  TensorFlow's oneDNN ops is extremely slow (a fused fp16 matmul took about
  770 ms against 1.7 ms in float32, measured on a 2-core CPU); a warning
  explains how to avoid it.

  Raises:
    ValueError: unknown `dtype`.
  """
  name = policy_name(dtype)
  keras.mixed_precision.set_global_policy(name)
  if (dtype == "fp16" and not tf.config.list_physical_devices("GPU") and
      os.environ.get("TF_ENABLE_ONEDNN_OPTS") != "0"):
    logging.warning(
        "--dtype=fp16 on a CPU with TensorFlow's oneDNN ops enabled is very "
        "slow (fp16 matmuls run hundreds of times slower than fp32). Start "
        "the process with TF_ENABLE_ONEDNN_OPTS=0 (it must be set before "
        "TensorFlow is imported), or use --dtype=fp32 on CPUs.")
  return keras.mixed_precision.global_policy()


@keras.saving.register_keras_serializable(package="tfdist")
class FixedLossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
  """A `LossScaleOptimizer` whose scale never changes (`--loss_scale=N`).

  The loss is multiplied by `initial_scale` and gradients divided by it, as in
  the dynamic optimizer; a step whose gradients are not finite is skipped,
  but the scale is neither lowered nor raised.
  """

  def __init__(self, inner_optimizer, initial_scale=2.0**15, **kwargs):
    kwargs.pop("dynamic_growth_steps", None)
    super().__init__(inner_optimizer, initial_scale=initial_scale,
                     dynamic_growth_steps=2**31 - 1, **kwargs)

  def _stateful_handle_non_finite_grads(self):
    pass  # Skip the update; keep the scale.

  def _stateful_handle_finite_grads(self, grads, trainable_variables):
    tvs = trainable_variables or self._trainable_variables
    unscaled = [
        g if g is None or self._overwrite_variable_with_gradient(v) else
        keras.ops.divide(g, self.dynamic_scale) for g, v in zip(grads, tvs)
    ]
    self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)


def wrap_optimizer_for_precision(
    optimizer: keras.optimizers.Optimizer, *, dtype: str,
    loss_scale: Optional[Union[str, float]] = None
) -> keras.optimizers.Optimizer:
  """Adds loss scaling to `optimizer` when `dtype` is `fp16`.

  Args:
    optimizer: the inner Keras optimizer.
    dtype: normalized `--dtype`.
    loss_scale: None or `'dynamic'` (Keras's dynamic scaling: start at 2**15,
      halve on overflow and skip the step, double after 2000 finite steps),
      or a positive float (fixed scale).

  Returns:
    `optimizer` itself for fp32/bf16, else a `LossScaleOptimizer`.
  """
  if dtype != "fp16":
    return optimizer
  if loss_scale is None or loss_scale == "dynamic":
    return keras.optimizers.LossScaleOptimizer(optimizer)
  return FixedLossScaleOptimizer(optimizer, initial_scale=float(loss_scale))


def step_skipped(optimizer, summed_grads) -> tf.Tensor:
  """Whether `optimizer` skips the update for `summed_grads`.

  Args:
    optimizer: the run's optimizer.
    summed_grads: the step's gradients (tensors, `IndexedSlices` or None),
      already summed over all replicas and workers, so that every replica
      computes the same answer.

  Returns:
    float32 scalar: 1.0 when `optimizer` is a `LossScaleOptimizer` and a
    gradient is not finite (the step is skipped and, if dynamic, the scale
    halves), else 0.0.
  """
  if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
    return tf.constant(0.0)
  return 1.0 - tf.cast(optimizer.check_finite(summed_grads), tf.float32)


def current_loss_scale(optimizer) -> Optional[float]:
  """The optimizer's current loss scale, or None without loss scaling."""
  if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
    return float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
  return None
