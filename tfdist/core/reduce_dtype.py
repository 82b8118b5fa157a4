"""The precision gradients travel in: `--all_reduce_dtype`.

Under a synchronous strategy with more than one replica (Mirrored,
MultiWorkerMirrored, TPU) every step sums the gradients over all replicas
in one all-reduce. `--all_reduce_dtype=bfloat16` or `float16` casts the
float32 gradients to that 2-byte type before the all-reduce and the sum
back to the variables' dtype (float32) after it, so half the bytes travel,
as Horovod's fp16 compression, PyTorch DDP's `bf16_compress_hook` and
FSDP's `reduce_dtype` do. The collective itself adds in the wire dtype
(each hop of a ring adds two 2-byte values, as in those libraries); the
clipping, the fp16 finite check and the optimizer then see float32.

What stays float32: the step's own sums (loss, example count, metric
states, stop requests). They cannot share a collective with 2-byte values
(TensorFlow packs the values of one all-reduce into one tensor of one
dtype), so with a 2-byte wire dtype they take their own float32 all-reduce:
two collectives per step instead of one. ZeRO's gather of the updated
weight shards stays float32 too (those are the master weights; a 2-byte
gather would round every weight at every step).

float16 (5 exponent bits: largest value 65504, smallest subnormal 6e-8):
each replica's gradient is divided by the number of replicas N before the
cast and the sum multiplied by N after it (as DDP's `fp16_compress_hook`
divides first), so a sum of N values cannot overflow where its parts do
not. A part above 65504 still becomes inf: only dynamic loss scaling
(`--dtype=fp16`, Keras's `LossScaleOptimizer`) turns that into a skipped
step and a lower scale, so float16 is refused without it; gradients below
6e-8 x N flush to zero, which the loss scale also prevents. bfloat16 has
float32's exponent range (no overflow, no flush) and 8 bits of mantissa:
each gradient is rounded to about 3 significant digits.

Nothing to reduce: one replica in all (`off`, `one_device`, a one-device
`mirrored`) has no all-reduce, so the setting has no effect there (a
warning). Parameter servers apply each worker's gradients as they come,
with no all-reduce: refused.

This module holds the names and checks (no TensorFlow, so
`tfdist.config` can use it) and the casts (TensorFlow imported where they
run).
"""

from typing import List, Optional, Sequence

from tfdist import errors

FLOAT32 = "float32"
# `--all_reduce_dtype` values, the default first.
ALL_REDUCE_DTYPES = (FLOAT32, "bfloat16", "float16")
# Bytes per gradient value on the wire.
BYTES_PER_VALUE = {"float32": 4, "bfloat16": 2, "float16": 2}
# `--dtype` values (normalized) that bring dynamic loss scaling: float16
# communication needs it. `auto` is decided later and checked again then
# (`check_loss_scaling`).
_LOSS_SCALED_DTYPES = ("fp16", "auto")


def compresses(all_reduce_dtype: str) -> bool:
  """Whether `all_reduce_dtype` sends fewer bytes than float32."""
  return all_reduce_dtype != FLOAT32


def check_name(all_reduce_dtype: str) -> None:
  """Raises `ConfigError` unless `all_reduce_dtype` is one of
  `ALL_REDUCE_DTYPES`."""
  if all_reduce_dtype not in ALL_REDUCE_DTYPES:
    raise errors.ConfigError(
        f"--all_reduce_dtype={all_reduce_dtype!r} is unknown. Use one of: "
        f"{', '.join(ALL_REDUCE_DTYPES)}.")


def check_config(all_reduce_dtype: str, *, strategy: str,
                 dtype: str) -> None:
  """The start-up checks of `--all_reduce_dtype` against the other flags.

  Args:
    all_reduce_dtype: the `--all_reduce_dtype` value.
    strategy: the `--distribution_strategy` value (`auto` is checked again
      once decided: `check_strategy`).
    dtype: the normalized `--dtype` (`fp32`, `bf16`, `fp16`, `auto`).

  Raises:
    ConfigError: an unknown value; a 2-byte dtype with
      `--distribution_strategy=parameter_server`; float16 with a `--dtype`
      that has no loss scaling.
  """
  check_name(all_reduce_dtype)
  if not compresses(all_reduce_dtype):
    return
  check_strategy(all_reduce_dtype, str(strategy).lower())
  if all_reduce_dtype == "float16" and dtype not in _LOSS_SCALED_DTYPES:
    raise errors.ConfigError(_FLOAT16_UNSCALED.format(value=all_reduce_dtype,
                                                what=f"--dtype={dtype}"))


_FLOAT16_UNSCALED = (
    "--all_reduce_dtype={value} needs dynamic loss scaling (--dtype=fp16), "
    "received {what}: a gradient above 65504 becomes inf in float16, and "
    "only a loss scale turns that into a skipped step instead of a "
    "non-finite weight. Use --all_reduce_dtype=bfloat16 (float32's range, "
    "the same 2 bytes) or --dtype=fp16.")


def check_strategy(all_reduce_dtype: str, strategy: str) -> None:
  """Refuses a 2-byte `all_reduce_dtype` under parameter servers.

  Args:
    all_reduce_dtype: the `--all_reduce_dtype` value.
    strategy: a `--distribution_strategy` value (the requested or the
      decided one).

  Raises:
    ConfigError: `strategy` is `parameter_server` and `all_reduce_dtype`
      is not float32.
  """
  if compresses(all_reduce_dtype) and strategy == "parameter_server":
    raise errors.ConfigError(
        f"--all_reduce_dtype={all_reduce_dtype} does not apply to "
        "--distribution_strategy=parameter_server: its workers send their "
        "gradients to the parameter servers one by one, with no all-reduce "
        "to compress. Drop --all_reduce_dtype (or use mirrored or "
        "multi_worker_mirrored).")


def check_loss_scaling(all_reduce_dtype: str, loss_scaled: bool) -> None:
  """Refuses float16 communication without a `LossScaleOptimizer`.

  Raises:
    ConfigError: `all_reduce_dtype` is float16 and `loss_scaled` is False.
  """
  if all_reduce_dtype == "float16" and not loss_scaled:
    raise errors.ConfigError(_FLOAT16_UNSCALED.format(
        value=all_reduce_dtype,
        what="an optimizer without a LossScaleOptimizer"))


def describe(all_reduce_dtype: str) -> str:
  """One line for the run plan and the log: how the gradients travel."""
  if not compresses(all_reduce_dtype):
    return "gradients all-reduced in float32"
  return (f"gradients all-reduced in {all_reduce_dtype} (2 bytes a value, "
          "half of float32's), cast back to float32 after the sum; the "
          "step's sums in a float32 all-reduce of their own")


# --- the casts (replica context, inside the step) ---------------------------
def _wire_dtype(all_reduce_dtype: str):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.as_dtype(all_reduce_dtype)


def _compressible(value, wire) -> bool:
  """float32 and float64 values travel in `wire`; others as they are."""
  return value.dtype.is_floating and value.dtype.size > wire.size


def compress(values: Sequence, all_reduce_dtype: str,
             num_replicas: int) -> List:
  """`values` (dense tensors or `tf.IndexedSlices`, no None) as they
  travel: float32 and float64 ones cast to `all_reduce_dtype` (float16:
  divided by `num_replicas` first); others, and every value for float32,
  unchanged."""
  if not compresses(all_reduce_dtype):
    return list(values)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  wire = _wire_dtype(all_reduce_dtype)
  divide = wire == tf.float16 and num_replicas > 1

  def cast(tensor):
    if divide:
      tensor = tensor / tf.cast(num_replicas, tensor.dtype)
    return tf.cast(tensor, wire)

  out = []
  for value in values:
    if not _compressible(value, wire):
      out.append(value)
    elif isinstance(value, tf.IndexedSlices):
      out.append(tf.IndexedSlices(cast(value.values), value.indices,
                                  value.dense_shape))
    else:
      out.append(cast(value))
  return out


def decompress(summed: Sequence, originals: Sequence, all_reduce_dtype: str,
               num_replicas: int) -> List:
  """The all-reduced `summed` (from `compress(originals, ...)`) back in the
  dtypes of `originals` (float16: multiplied by `num_replicas` after the
  cast, undoing `compress`'s division)."""
  if not compresses(all_reduce_dtype):
    return list(summed)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  wire = _wire_dtype(all_reduce_dtype)
  multiply = wire == tf.float16 and num_replicas > 1

  def cast(tensor, dtype):
    tensor = tf.cast(tensor, dtype)
    return tensor * tf.cast(num_replicas, dtype) if multiply else tensor

  out = []
  for value, original in zip(summed, originals):
    if not _compressible(original, wire):
      out.append(value)
    elif isinstance(value, tf.IndexedSlices):
      out.append(tf.IndexedSlices(cast(value.values, original.dtype),
                                  value.indices, value.dense_shape))
    else:
      out.append(cast(value, original.dtype))
  return out


def all_reduce_sum(context, values: Sequence, all_reduce_dtype: str,
                   options: Optional[object] = None) -> List:
  """`context.all_reduce(SUM, values)` with `values` travelling in
  `all_reduce_dtype` (`compress`, then `decompress`). Replica context.

  Args:
    context: the `tf.distribute.ReplicaContext`.
    values: dense tensors or `tf.IndexedSlices` of one floating dtype.
    all_reduce_dtype: one of `ALL_REDUCE_DTYPES`.
    options: `tf.distribute.experimental.CommunicationOptions`, or None.

  Returns:
    The sums, a list like `values`, in their dtypes.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  n = context.num_replicas_in_sync
  summed = context.all_reduce(tf.distribute.ReduceOp.SUM,
                              compress(values, all_reduce_dtype, n),
                              options=options)
  return decompress(summed, values, all_reduce_dtype, n)
