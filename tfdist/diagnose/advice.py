"""What to try, for each binding constraint and the hardware measured.
"""

from typing import Optional

from tfdist.diagnose.measure import RunMeasurement
from tfdist.diagnose.measure import device_family


INPUT_ADVICE = (
    "input pipeline knobs: keep --cache_dataset on (parsed examples cached in "
    "memory after the first epoch), split the data into more --train_files "
    "shards than hosts (parallel reads), lower --shuffle_buffer_size if the "
    "wait is at start, move heavy preprocessing offline (into the TFRecords) "
    "or to tf.data service; tfdist already reads, parses and prefetches in "
    "parallel (tf.data AUTOTUNE)")


COMMUNICATION_ADVICE = (
    "fewer all-reduces per example: a larger per-replica batch "
    "(--per_replica_batch_size), gradient accumulation "
    "(--gradient_accumulation_steps), --nosync_batch_norm (batch norm's "
    "per-layer all-reduces){gpu}; more steps per host round trip "
    "(--steps_per_execution)")


_COMMUNICATION_GPU = (
    ", NCCL (--all_reduce_alg=nccl) or Vertex AI's Reduction Server "
    "(--reduction_server)")


# What adds compute, by the device kind measured (`RunMeasurement.
# device_kind`), and mixed precision where the hardware runs it faster:
# bf16 on TPUs, on GPUs of compute capability >= 8.0 (fp16 on 7.x), and on
# CPUs with bf16 matrix instructions (AVX-512 BF16, AMX), which oneDNN
# uses; XLA (--enable_xla) on GPUs (TPUs always compile with it).
_MORE_COMPUTE = {
    "GPU": "add GPUs while efficiency holds",
    "TPU": "a larger TPU slice while efficiency holds, more steps per call "
           "(--steps_per_execution)",
    "CPU": "more cores per worker: workers on machines of their own "
           "(Vertex AI, a TFJob, Ray), or on one machine a core each "
           "(--pin_workers)",
}


# The same for a run of one process: no cluster advice (more processes is
# another setup, measured with tfdist.diagnose --num_workers).
_MORE_COMPUTE_ONE_PROCESS = {
    "CPU": "a machine with more cores (one process already uses all of "
           "this one's), or GPUs",
}


_MIXED_PRECISION = {
    "GPU": "mixed precision (--dtype=bf16 on GPUs of compute capability >= "
           "8.0, fp16 on 7.x)",
    "TPU": "mixed precision (--dtype=bf16)",
    "CPU": "mixed precision (--dtype=bf16: this CPU has bf16 matrix "
           "instructions)",
}


MEMORY_ADVICE = (
    "{mixed}activation recomputation, a smaller per-replica batch with "
    "gradient accumulation{sharded}")


# Where the optimizer state can be split: over several replicas (ZeRO), or
# over ps tasks (a cluster).
_MEMORY_ZERO = (
    "sharded optimizer state (--shard_optimizer_state: each replica keeps "
    "1/N of it)")


_MEMORY_PS = (
    "parameter servers (--distribution_strategy=parameter_server: variables "
    "and optimizer slots sharded over ps tasks)")


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
  """Whether this machine's CPU has bf16 matrix instructions (the
  `avx512_bf16` or `amx_bf16` flag of `/proc/cpuinfo`)."""
  try:
    with open(cpuinfo) as f:
      flags_line = next((line for line in f if line.startswith("flags")), "")
  except OSError:
    return False
  return bool({"avx512_bf16", "amx_bf16"} & set(flags_line.split()))


def _mixed_precision(run: RunMeasurement, cpu_bf16: bool) -> Optional[str]:
  """Mixed-precision advice for `run`'s hardware; None where it does not
  apply (already bf16/fp16, or a CPU without bf16 instructions)."""
  kind = device_family(run.device_kind)
  if run.dtype in ("bf16", "fp16") or (kind == "CPU" and not cpu_bf16):
    return None
  return _MIXED_PRECISION.get(kind)


def compute_advice(run: RunMeasurement, *, cpu_bf16: bool = False) -> str:
  """What to try on a compute-bound `run`, for the hardware it ran on (no
  cluster advice for a run of one process)."""
  kind = device_family(run.device_kind)
  more = _MORE_COMPUTE.get(kind, "add devices while efficiency holds")
  if run.num_workers <= 1:
    more = _MORE_COMPUTE_ONE_PROCESS.get(kind, more)
  parts = ["the devices are busy computing: " + more]
  mixed = _mixed_precision(run, cpu_bf16)
  if mixed:
    parts.append(mixed)
  if kind == "GPU":
    parts.append("XLA (--enable_xla)")
  return ", ".join(parts)


def communication_advice(run: RunMeasurement) -> str:
  """What to try on a communication-bound `run` (NCCL only for GPUs; the
  Reduction Server, which sums between hosts, only for GPU workers)."""
  gpu = ""
  if device_family(run.device_kind) == "GPU":
    gpu = (_COMMUNICATION_GPU if run.num_workers > 1 else
           ", NCCL (--all_reduce_alg=nccl)")
  return COMMUNICATION_ADVICE.format(gpu=gpu)


def memory_advice(run: RunMeasurement, *, cpu_bf16: bool = False) -> str:
  """What to try on a memory-bound `run`, for its hardware: sharded
  optimizer state only with several replicas, parameter servers only for
  a cluster."""
  mixed = _mixed_precision(run, cpu_bf16)
  sharded = [text for text, applies in ((_MEMORY_ZERO, run.num_replicas > 1),
                                        (_MEMORY_PS, run.num_workers > 1))
             if applies]
  return MEMORY_ADVICE.format(
      mixed=f"{mixed[:-1]}: half-size activations), " if mixed else "",
      sharded="".join(f", {text}" for text in sharded[:-1]) +
      (f", or {sharded[-1]}" if sharded else ""))
