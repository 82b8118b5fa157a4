"""Pipeline parallelism in one process (`--pipeline_stages=P`, P > 1).

The model's stages run on this process's devices, stage i on GPU i or, on a
CPU-only host, on logical CPU device i (configured here: P of them). The
run is otherwise a one-device run: one replica, the trainer's loop,
checkpoints and export, with the trainer's per-replica forward and backward
pass replaced by the pipeline's micro-batched one
(`tfdist.training.pipeline_step`). The strategy is TensorFlow's default
one: `OneDeviceStrategy` would place every variable on its one device,
where the stages' variables must live on theirs.

`backend_for_run` chooses this backend for a config with
`pipeline_stages > 1` (the flags allow it only with `--distribution_strategy`
auto, one_device or off; `tfdist.parallel.pipeline_options`).
"""

from typing import List, Tuple

import tensorflow as tf

from tfdist.backends import base
from tfdist.backends import single_process
from tfdist.distribute import devices as devices_lib
from tfdist.distribute import strategy as strategy_lib
from tfdist.distribute.strategy_kind import StrategyKind
from tfdist import errors


def stage_devices(num_stages: int, num_gpus: int = -1) -> List[str]:
  """The devices of P stages: the first P logical GPUs, or, without GPUs,
  the first P logical CPU devices (configured when there are fewer).

  Args:
    num_stages: P.
    num_gpus: `--num_gpus` (-1: all visible; 0: none).

  Raises:
    ConfigError: fewer than P GPUs, or the CPU already split into fewer
      than P logical devices (TensorFlow's runtime started).
  """
  gpus = base.local_accelerators(num_gpus) if num_gpus != 0 else 0
  if gpus:
    names = [d.name for d in tf.config.list_logical_devices("GPU")][:gpus]
    if len(names) < num_stages:
      raise errors.ConfigError(
          f"--pipeline_stages={num_stages} needs {num_stages} GPUs (stage i "
          f"runs on GPU i); this process sees {len(names)}. Lower "
          f"--pipeline_stages to {len(names)} or fewer, or pass "
          "--num_gpus=0 to run the stages on logical CPU devices.")
    return names[:num_stages]
  cpus = tf.config.list_logical_devices("CPU")
  if len(cpus) < num_stages:
    try:
      devices_lib.configure_cpu_devices(num_stages)
    except RuntimeError as e:
      raise errors.ConfigError(
          f"--pipeline_stages={num_stages} needs {num_stages} logical CPU "
          f"devices, and TensorFlow already started with {len(cpus)}: "
          "run the pipeline in a fresh process, or call "
          f"tfdist.distribute.devices.configure_cpu_devices({num_stages}) "
          "before any TensorFlow op.") from e
    cpus = tf.config.list_logical_devices("CPU")
  return [d.name for d in cpus][:num_stages]


class PipelineBackend(single_process.OneDeviceBackend):
  """One process, one replica; the model's stages on P devices."""

  kind = StrategyKind.ONE_DEVICE

  def validate(self, config, *, dataset) -> None:
    """Refuses more stages than GPUs before anything is built (logical
    CPU devices are made as needed).

    Raises:
      ConfigError: a host with GPUs, fewer of them than `pipeline_stages`.
    """
    del dataset
    gpus = base.local_accelerators(config.num_gpus)
    if 0 < gpus < config.pipeline_stages:
      raise errors.ConfigError(
          f"--pipeline_stages={config.pipeline_stages} needs "
          f"{config.pipeline_stages} GPUs (stage i runs on GPU i); this "
          f"host has {gpus}. Lower --pipeline_stages to {gpus} or fewer, or "
          "pass --num_gpus=0 to run the stages on logical CPU devices.")

  def build_strategy(self, config, *, cluster,
                     lease=None) -> strategy_lib.StrategyChoice:
    """TensorFlow's default strategy, with the stages' devices ready."""
    del cluster, lease
    if config.num_cpu_devices > config.pipeline_stages:
      devices_lib.configure_cpu_devices(config.num_cpu_devices)
    names = stage_devices(config.pipeline_stages, config.num_gpus)
    return strategy_lib.StrategyChoice(
        tf.distribute.get_strategy(),
        StrategyKind.parse(config.distribution_strategy),
        f"--pipeline_stages={config.pipeline_stages}: one process, stage i "
        f"on {names[0].rsplit(':', 2)[-2]} device i", tuple(names))

  def build_inputs(self, run):
    """The one-device runner and evaluation; the manifest's strategy
    details list the stages (device, layers, weight bytes)."""
    runner, evaluate, details = super().build_inputs(run)
    pipeline = getattr(run.parts.trainer, "pipeline", None)
    if pipeline is not None:
      details = {**details, "pipeline_stages": pipeline.pipeline.describe()}
    return runner, evaluate, details

  def planned_replicas(self, config, *, cluster) -> Tuple[int, int]:
    del config
    return 1, self.training_workers(cluster)


def uses_pipeline(config) -> bool:
  """Whether `config` cuts the model into stages (`pipeline_stages > 1`)."""
  return getattr(config, "pipeline_stages", 1) > 1
