"""Tensor parallelism on one host (`--tensor_parallel=T`, T > 1).

A `MirroredStrategy` over N devices of this process (the first N GPUs,
or N logical CPU devices, configured here; N from
`tfdist.parallel.tensor.options.replicas`: `--num_gpus` or
`--num_cpu_devices`, else T) whose replicas are D = N / T tensor groups of
T: the built-in Transformer's heads and feed-forward units are split over
each group (`tfdist.parallel.tensor_parallel`), each group trains on its
1/D of the global batch, and the trainer's step sums the gradients over
the data groups only (`tfdist.parallel.tensor.mode`). The SavedModel is
the unsharded Transformer holding the gathered weights.

Registered for the `tensor` mode (`tfdist.backends.mode_backends`):
`backend_for_run` chooses this backend for a config with
`tensor_parallel > 1` (the flags allow it only with
`--distribution_strategy` auto or mirrored and a multiple of T devices;
`tfdist.parallel.tensor.options`).
"""

from typing import List, Tuple

import tensorflow as tf

from tfdist.backends import base
from tfdist.backends import mode_backends
from tfdist.backends import single_process
from tfdist.distribute import devices as devices_lib
from tfdist.distribute import strategy as strategy_lib
from tfdist.parallel.tensor import options as tensor_options
from tfdist.core.strategy_kind import StrategyKind
from tfdist import errors


def _group_devices(n: int, num_gpus: int = -1) -> List[str]:
  """The first N GPUs, or (none) N logical CPU devices, configured before
  TensorFlow's runtime starts.

  Raises:
    errors.ConfigError: fewer than N GPUs, or the runtime already started
      with another number of CPU devices.
  """
  names = base.first_gpus(n, num_gpus)
  if names is not None:
    if len(names) < n:
      raise errors.ConfigError(
          f"--tensor_parallel with {n} replicas needs {n} GPUs of this "
          f"host; this process sees {len(names)}. Lower --num_gpus or "
          "--tensor_parallel, or pass --num_gpus=0 to run on logical CPU "
          "devices.")
    return names
  try:
    names = devices_lib.configure_cpu_devices(n)
  except RuntimeError as e:
    raise errors.ConfigError(
        f"--tensor_parallel with {n} replicas needs {n} logical CPU "
        "devices, and "
        f"TensorFlow already started with another number: {e} Run it in a "
        f"fresh process, or call tfdist.distribute.devices."
        f"configure_cpu_devices({n}) before any TensorFlow op.") from e
  return names[:n]


class TensorParallelBackend(mode_backends.ExportsGatheredModel,
                            single_process.MirroredBackend):
  """One process; its N replicas split the model's layers (the manifest
  says how; the SavedModel is the unsharded Transformer with the gathered
  weights)."""

  kind = StrategyKind.MIRRORED
  split_mode = "tensor"
  details_key = "tensor_parallel"

  def validate(self, config, decisions, *, dataset) -> None:
    """Refuses a host with GPUs, fewer than N of them, before anything
    is built (logical CPU devices are made as needed).

    Raises:
      errors.ConfigError: fewer GPUs than the replicas (`_replicas`).
    """
    super().validate(config, decisions, dataset=dataset)
    gpus = base.local_accelerators(config.strategy.num_gpus)
    n = _replicas(config)
    if 0 < gpus < n:
      raise errors.ConfigError(
          f"--tensor_parallel={config.strategy.parallelism.tensor_parallel} "
          f"on {n} replicas needs "
          f"{n} GPUs of this host; it has {gpus}. Lower --num_gpus or "
          f"--tensor_parallel to at most {gpus} (a divisor of the heads), "
          "or pass --num_gpus=0 to run on logical CPU devices.")

  def build_strategy(self, config, decisions, *, cluster,
                     lease=None) -> strategy_lib.StrategyChoice:
    """`MirroredStrategy` over the first N devices.

    Raises:
      errors.ConfigError: a cluster of several tasks (`TF_CONFIG`), or the
        devices cannot be made (`_group_devices`).
    """
    del lease
    t = config.strategy.parallelism.tensor_parallel
    if cluster is not None and getattr(cluster, "num_workers", 1) > 1:
      raise errors.ConfigError(
          f"--tensor_parallel={t} runs in one process "
          "on one host; this task is one of a cluster of "
          f"{cluster.num_workers} workers. Run it without TF_CONFIG.")
    n = _replicas(config)
    names = _group_devices(n, config.strategy.num_gpus)
    return strategy_lib.StrategyChoice(
        tf.distribute.MirroredStrategy(names), StrategyKind.MIRRORED,
        f"--tensor_parallel={t}: {n // t} data-parallel cop"
        f"{'y' if n == t else 'ies'} of {t} tensor-parallel replicas (heads "
        "and feed-forward units split; each copy trains on "
        + ("the whole batch)" if n == t else f"1/{n // t} of the batch)"),
        tuple(names))

  def planned_replicas(self, config, decisions, *, cluster) -> Tuple[int, int]:
    return _replicas(config), self.training_workers(cluster)


def _replicas(config) -> int:
  """N: the run's replicas (`tensor_options.replicas`)."""
  strategy = config.strategy
  return tensor_options.replicas(strategy.parallelism.tensor_parallel,
                                 num_gpus=strategy.num_gpus,
                                 num_cpu_devices=strategy.num_cpu_devices)


def _tensor_backend(kind, kind_backend, cluster) -> TensorParallelBackend:
  """Whatever the kind (mirrored or auto, as `--tensor_parallel`'s checks
  allow): one Mirrored group of N replicas."""
  del kind, kind_backend, cluster
  return TensorParallelBackend()


mode_backends.register_mode_backend("tensor", factory=_tensor_backend)
