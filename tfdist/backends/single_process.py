"""The one-process strategies: `off` (TensorFlow's default strategy),
`one_device` and `mirrored` (all-reduce over this host's devices)."""

from typing import Tuple

from tfdist.backends import base
from tfdist.backends import synchronous
from tfdist.distribute.strategy_kind import StrategyKind


@base.register_backend(StrategyKind.OFF)
class DefaultStrategyBackend(synchronous.SynchronousBackend):
  """TensorFlow's default strategy: no `tf.distribute` wrapping."""


@base.register_backend(StrategyKind.ONE_DEVICE)
class OneDeviceBackend(synchronous.SynchronousBackend):
  """`OneDeviceStrategy`: one GPU, or the CPU."""


@base.register_backend(StrategyKind.MIRRORED)
class MirroredBackend(synchronous.SynchronousBackend):
  """`MirroredStrategy`: one replica per local GPU (or logical CPU device)."""

  def planned_replicas(self, config, decisions, *, cluster) -> Tuple[int, int]:
    gpus = base.local_accelerators(config.num_gpus)
    return (gpus or max(config.num_cpu_devices, 1),
            self.training_workers(cluster))
