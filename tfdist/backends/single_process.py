"""The one-process strategies: `off` (TensorFlow's default strategy),
`one_device` and `mirrored` (all-reduce over this host's devices)."""

from typing import Tuple

import tensorflow as tf

from tfdist import errors
from tfdist.backends import base
from tfdist.backends import synchronous
from tfdist.core.strategy_kind import StrategyKind


@base.register_backend(StrategyKind.OFF)
class DefaultStrategyBackend(synchronous.SynchronousBackend):
  """TensorFlow's default strategy: no `tf.distribute` wrapping."""

  # One replica: nothing to all-reduce, so the flag has no effect.
  accepts_bytes_per_pack = True

  def new_strategy(self, options, *, cluster):
    del options, cluster  # The default strategy has nothing to choose.
    return tf.distribute.get_strategy(), ("default",)


@base.register_backend(StrategyKind.ONE_DEVICE)
class OneDeviceBackend(synchronous.SynchronousBackend):
  """`OneDeviceStrategy`: one GPU, or the CPU."""

  # One replica: nothing to all-reduce, so the flag has no effect.
  accepts_bytes_per_pack = True

  def new_strategy(self, options, *, cluster):
    """The first GPU `--num_gpus` allows, else the CPU.

    Raises:
      ConfigError: `--num_gpus` above the visible GPUs.
    """
    del cluster  # Single process.
    section = options.strategy
    gpus = _gpus(section.num_gpus) if section.num_gpus != 0 else []
    device = gpus[0] if gpus else "/cpu:0"
    return tf.distribute.OneDeviceStrategy(device), (device,)


@base.register_backend(StrategyKind.MIRRORED)
class MirroredBackend(synchronous.SynchronousBackend):
  """`MirroredStrategy`: one replica per local GPU (or logical CPU device)."""

  mirrored = True

  def new_strategy(self, options, *, cluster):
    """Over `--num_gpus` GPUs, else every logical CPU device.

    Raises:
      ConfigError: `--num_gpus` above the visible GPUs, logical CPU
        devices other than `--num_cpu_devices`, or an `--all_reduce_alg`
        that does not apply.
    """
    del cluster  # Single process.
    section = options.strategy
    gpus = _gpus(section.num_gpus) if section.num_gpus != 0 else []
    if gpus:
      devices = gpus
    else:
      devices = [d.name for d in tf.config.list_logical_devices("CPU")]
      wanted = section.num_cpu_devices
      if wanted > 1 and len(devices) != wanted:
        raise errors.ConfigError(
            f"--num_cpu_devices={wanted} but "
            f"{len(devices)} logical CPU device(s) exist: call "
            "tfdist.distribute.devices.configure_cpu_devices before building "
            "the strategy.")
    strategy = tf.distribute.MirroredStrategy(
        devices=devices,
        cross_device_ops=_all_reduce(section.all_reduce_alg, bool(gpus)))
    return strategy, tuple(devices)

  def planned_replicas(self, config, decisions, *, cluster) -> Tuple[int, int]:
    gpus = base.local_accelerators(config.strategy.num_gpus)
    return (gpus or max(config.strategy.num_cpu_devices, 1),
            self.training_workers(cluster))


def _gpus(num_gpus: int):
  """The logical GPUs `--num_gpus` selects (-1: all).

  Raises:
    ConfigError: more than are visible.
  """
  gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
  if num_gpus == -1:
    return gpus
  if num_gpus > len(gpus):
    raise errors.ConfigError(
        f"--num_gpus={num_gpus} but only {len(gpus)} GPU(s) are visible. "
        f"Use --num_gpus={len(gpus)} or -1 for all.")
  return gpus[:num_gpus]


def _all_reduce(alg: str, on_gpu: bool):
  """Mirrored's cross-device ops for `--all_reduce_alg` (None: TensorFlow's
  choice on GPUs).

  Raises:
    ConfigError: `nccl` without GPUs, or `ring` (multi_worker_mirrored's).
  """
  if alg == "nccl":
    if not on_gpu:
      raise errors.ConfigError(
          "--all_reduce_alg=nccl needs GPUs; on CPU devices use "
          "--all_reduce_alg=auto.")
    return tf.distribute.NcclAllReduce()
  if alg == "hierarchical_copy":
    return tf.distribute.HierarchicalCopyAllReduce()
  if alg == "ring":
    raise errors.ConfigError(
        "--all_reduce_alg=ring applies to multi_worker_mirrored; for "
        "mirrored use auto, nccl or hierarchical_copy.")
  return None if on_gpu else tf.distribute.ReductionToOneDevice()
