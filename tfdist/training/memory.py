"""Memory: what a run used (host RSS, GPU memory) and what a model needs.

* `peak_rss_bytes`: the process's peak resident set size (host memory),
  from `getrusage`; cheap, read at every log point.
* `device_memory`: current and peak bytes of each visible GPU
  (`tf.config.experimental.get_memory_info`), read at every log point on
  GPU machines. Untested here: the machines tfdist is tested on have no
  GPU, so this path has only run where it returns `{}`.
* `estimate_model_memory`: the bytes of a model's parameters, their
  gradients and the optimizer's state (slots, iteration count, loss
  scale), from the variables' shapes and dtypes: what every replica holds
  under data parallelism, before activations. `fits_data_parallel` compares
  it with a device's memory and says which strategy fits when it does not.
* `sharded_estimate`: the same under ZeRO stage 1 or 2
  (`--shard_optimizer_state`, `tfdist.training.sharded_optimizer`): each of N
  replicas keeps 1/N of the optimizer state.
"""

import dataclasses
import math
import os
import resource
import shutil
import subprocess
from typing import Dict, List, Optional, Sequence

from tfdist.training import optimizers

# Linux reports ru_maxrss in KiB.
_RUSAGE_UNIT_BYTES = 1024


def peak_rss_bytes() -> int:
  """Peak resident set size of this process so far (bytes)."""
  return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss *
             _RUSAGE_UNIT_BYTES)


def host_memory_bytes() -> int:
  """Physical memory of this host (bytes)."""
  return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def device_memory() -> Dict[str, Dict[str, int]]:
  """Current and peak memory of each visible GPU, as TensorFlow's allocator
  counts it: `{"GPU:0": {"current": bytes, "peak": bytes}, ...}`; `{}`
  without GPUs. Untested here (no GPU on the test machines)."""
  # Imported here: the host-memory readings (`peak_rss_bytes`, the run log's
  # and `tfdist.diagnose`'s) stay TensorFlow-free.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  out = {}
  for index, _ in enumerate(tf.config.list_logical_devices("GPU")):
    name = f"GPU:{index}"
    try:
      info = tf.config.experimental.get_memory_info(name)
    except (ValueError, RuntimeError):
      continue
    out[name] = {"current": int(info["current"]), "peak": int(info["peak"])}
  return out


def gpu_memory_capacity_bytes() -> List[int]:
  """Total memory of each NVIDIA GPU (bytes), from `nvidia-smi`; `[]` when
  there is none (TensorFlow reports usage, not capacity). Untested here."""
  binary = shutil.which("nvidia-smi")
  if not binary:
    return []
  try:
    out = subprocess.run(
        [binary, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=20, check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return []
  return [int(float(line)) << 20 for line in out.split() if line.strip()]


def _elements(variable) -> int:
  n = 1
  for dim in variable.shape:
    n *= int(dim)
  return n


def _variable_bytes(variables) -> int:
  """Bytes of `variables` (Keras or TensorFlow), from shape and dtype."""
  # Imported here: see `device_memory`.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # Keras variables name their dtype as a string, TensorFlow's as a DType.
  return sum(_elements(v) * tf.as_dtype(v.dtype).size for v in variables)


@dataclasses.dataclass(frozen=True)
class ModelMemory:
  """Bytes one replica holds for a model under data parallelism.

  Attributes:
    parameters_bytes: every model variable (trainable and not, e.g. batch
      norm statistics), in its own dtype (float32 under Keras's mixed
      precision policies, which keep variables in float32).
    gradients_bytes: one gradient per trainable variable, in its dtype.
    optimizer_bytes: every optimizer variable: slots (momentum: 1 per
      trainable variable; Adam: 2), iteration count, loss scale.
    num_parameters: elements of the model's variables.
  """
  parameters_bytes: int
  gradients_bytes: int
  optimizer_bytes: int
  num_parameters: int

  @property
  def total_bytes(self) -> int:
    return self.parameters_bytes + self.gradients_bytes + self.optimizer_bytes

  def to_dict(self) -> dict:
    return {**dataclasses.asdict(self), "total_bytes": self.total_bytes}


def estimate_model_memory(model, optimizer=None, *,
                          sharded=None) -> ModelMemory:
  """The bytes of `model`'s parameters, gradients and `optimizer`'s state.

  From the variables' shapes and dtypes only (no values are read, so it
  works for variables on parameter servers too). Activations, which depend
  on the batch, are not included.

  Args:
    model: a built Keras model.
    optimizer: its optimizer, built (`optimizer.build(variables)`), or None.
    sharded: the run's `tfdist.training.sharded_optimizer.ShardedOptimizer`, or
      None: its per-replica state between steps (one replica's slots and
      gradient-accumulator shard) is added to `optimizer`'s own variables
      (iterations and loss scale: the slots live on the shards).

  Returns:
    A `ModelMemory`.
  """
  optimizer_bytes = (_variable_bytes(optimizer.variables)
                     if optimizer is not None else 0)
  if sharded is not None:
    optimizer_bytes += sharded.state_bytes_per_replica()
  return ModelMemory(
      parameters_bytes=_variable_bytes(model.variables),
      gradients_bytes=_variable_bytes(model.trainable_variables),
      optimizer_bytes=optimizer_bytes,
      num_parameters=sum(_elements(v) for v in model.variables))


def sharded_estimate(estimate: ModelMemory, *, num_replicas: int,
                     stage: int = 1) -> ModelMemory:
  """`estimate` (unsharded) as one replica holds it under ZeRO `stage`.

  The optimizer's slots are split over `num_replicas` (N) replicas in
  shards of a flat buffer padded to a multiple of N: optimizer bytes
  become `ceil(optimizer / N)` (plus at most one shard's padding, N - 1
  elements per slot), i.e. per fp32 Adam parameter 4 + 4 + 8 / N instead
  of 16, as Rajbhandari et al. 2020 count stage 1 (Keras keeps float32
  variables, so the model's weights are the float32 master weights; the
  master shard the Keras optimizer updates is filled only during an
  update: transient, not counted here). Stage 2 also
  shards the gradient accumulators (gradient accumulation only), which
  `ModelMemory` does not count, and TensorFlow's per-step gradients are
  whole either way: the estimate is stage 1's for both stages.

  Args:
    estimate: from `estimate_model_memory` of an unsharded build.
    num_replicas: replicas in sync (N >= 1).
    stage: 1 or 2 (0 returns `estimate`).

  Returns:
    A `ModelMemory`.
  """
  n = max(int(num_replicas), 1)
  if not stage:
    return estimate
  return dataclasses.replace(
      estimate, optimizer_bytes=-(-estimate.optimizer_bytes // n))


@dataclasses.dataclass(frozen=True)
class Fit:
  """Whether a model's state fits a device under data parallelism.

  Attributes:
    fits: parameters, gradients and optimizer state of every replica that
      shares the memory fit in it.
    needed_bytes: what the replicas sharing `capacity_bytes` hold.
    capacity_bytes: the device's (or host's) memory.
    share: `needed_bytes / capacity_bytes`.
    advice: what to do when it does not fit (empty when it does).
  """
  fits: bool
  needed_bytes: int
  capacity_bytes: int
  share: float
  advice: str = ""


# Activations, workspace and the framework need the rest: a model whose
# state alone takes more than this share of a device is called tight.
TIGHT_SHARE = 0.5


def fits_data_parallel(estimate: ModelMemory, *, capacity_bytes: int,
                       replicas_sharing: int = 1,
                       optimizer: str = "", num_replicas: int = 1,
                       zero_stage: int = 0) -> Fit:
  """Says whether every replica's copy fits, and what fits if not.

  Under data parallelism (mirrored, multi_worker_mirrored, TPU) every
  replica holds all parameters, their gradients and the optimizer's state.
  Parameter servers hold the variables and optimizer slots sharded over the
  ps tasks; workers fetch what each step reads (for embedding tables, the
  looked-up rows only). Mixed precision (bf16/fp16) and activation
  recomputation shrink activations, not this state: Keras keeps variables
  in float32.

  Args:
    estimate: from `estimate_model_memory`.
    capacity_bytes: memory of one device (GPU memory; host memory for CPU
      replicas).
    replicas_sharing: replicas whose copies share that memory (logical CPU
      devices, or workers on one host: all of them; GPUs: 1).
    optimizer: the optimizer's name, for the advice.
    num_replicas: replicas in sync (all workers), over which
      `--shard_optimizer_state` would shard the optimizer state.
    zero_stage: the run's ZeRO stage (`--zero_stage`); > 0: `estimate` is
      taken as unsharded and sharded here (`sharded_estimate`).

  Returns:
    A `Fit`; when data parallelism does not fit but sharding the optimizer
    state over `num_replicas` would, its advice starts with the flag.
  """
  sharing = max(int(replicas_sharing), 1)
  if zero_stage:
    estimate = sharded_estimate(estimate, num_replicas=num_replicas,
                                stage=zero_stage)
  needed = estimate.total_bytes * sharing
  share = needed / capacity_bytes if capacity_bytes else math.inf
  if needed <= capacity_bytes:
    return Fit(True, needed, capacity_bytes, share)
  shard_advice = ""
  traits = optimizers.optimizer_spec(optimizer).traits if optimizer else None
  if (not zero_stage and num_replicas > 1 and
      (traits is None or traits.shardable)):
    sharded = sharded_estimate(estimate, num_replicas=num_replicas)
    if sharded.total_bytes * sharing <= capacity_bytes:
      shard_advice = (
          f"--shard_optimizer_state (--zero_stage=1) over the "
          f"{num_replicas} replicas keeps "
          f"{format_bytes(sharded.optimizer_bytes)} of optimizer state per "
          f"replica instead of {format_bytes(estimate.optimizer_bytes)}: "
          f"{format_bytes(sharded.total_bytes * sharing)} in all, which "
          "fits (same weights as unsharded training).")
  # Variables and slots sharded over ps tasks; gradients stay on workers.
  sharded = estimate.parameters_bytes + estimate.optimizer_bytes
  num_ps = max(1, math.ceil(sharded / max(capacity_bytes, 1)))
  advice = [
      f"parameters, gradients and optimizer state need {format_bytes(needed)}"
      f" against {format_bytes(capacity_bytes)}: data parallelism does not "
      "fit" + (f" (ZeRO stage {zero_stage} counted)." if zero_stage else "."),
      *([shard_advice] if shard_advice else []),
      f"--distribution_strategy=parameter_server with at least {num_ps} ps "
      f"task(s) holds the variables and optimizer slots "
      f"({format_bytes(sharded)}) sharded (--ps_partitioner); it suits models"
      " whose size is in embedding tables, of which each step reads a few "
      "rows."]
  # The layers' state split over consecutive devices (Huang et al. 2019).
  stages = max(2, math.ceil(estimate.total_bytes / max(capacity_bytes, 1)))
  advice.append(
      f"--pipeline_stages={stages} cuts the model into {stages} stages on "
      f"{stages} devices (GPUs; logical CPU devices share the host's "
      f"memory), each holding about {format_bytes(estimate.total_bytes / stages)}"
      " of parameters, gradients and optimizer state, at the cost of a "
      f"pipeline bubble of ({stages}-1)/(M+{stages}-1) of each step for M "
      "micro-batches (--num_microbatches).")
  if traits is not None and traits.slots_per_parameter > 1:
    advice.append(
        f"--optimizer={optimizer} keeps {traits.slots_per_parameter:g} slots"
        " per parameter; sgd with momentum keeps 1.")
  advice.append("Mixed precision (--dtype=bf16/fp16) and recomputation shrink"
                " activations only; Keras keeps variables in float32.")
  return Fit(False, needed, capacity_bytes, share, " ".join(advice))


def format_bytes(n: Optional[float]) -> str:
  """`1.5 GiB`, `812 MiB`, `3.2 KiB`; `-` for None."""
  if n is None:
    return "-"
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(n) >= size:
      return f"{n / size:.1f} {unit}"
  return f"{int(n)} B"


def peak_device_bytes(devices: Dict[str, Dict[str, int]]) -> Optional[int]:
  """The largest peak over `device_memory()`'s devices, or None."""
  peaks: Sequence[int] = [d["peak"] for d in devices.values()]
  return max(peaks) if peaks else None
