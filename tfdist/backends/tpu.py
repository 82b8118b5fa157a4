"""`TPUStrategy`: one process drives the TPU's cores."""

from typing import Tuple

from tfdist.backends import base
from tfdist.backends import synchronous
from tfdist.distribute import strategy as strategy_lib
from tfdist.distribute import tpu as tpu_lib
from tfdist.distribute.strategy_kind import StrategyKind
from tfdist.training import run_plan as run_plan_lib


@base.register_backend(StrategyKind.TPU)
class TPUBackend(synchronous.SynchronousBackend):
  """Static shapes: the model is built for the TPU and the last evaluation
  batches are padded (masked in the metrics)."""

  on_tpu = True

  def validate(self, config, decisions, *, dataset) -> None:
    """Raises ConfigError: fp16, or local input files with a remote TPU
    (`tfdist.distribute.tpu.validate_tpu_config`)."""
    tpu_lib.validate_tpu_config(
        decisions.tpu, data_patterns=run_plan_lib.data_patterns(
            run_plan_lib.decided_data(config.task.data, decisions), dataset))

  def planned_replicas(self, config, decisions, *, cluster) -> Tuple[int, int]:
    # Only the TPU knows its cores: asked, boundedly.
    choice = strategy_lib.make_strategy(
        strategy_lib.StrategyOptions.of(
            config.strategy, decisions,
            reduction_server=config.cloud.reduction_server),
        cluster=cluster)
    return (choice.strategy.num_replicas_in_sync,
            self.training_workers(cluster))

  def evaluator_strategy(self, local_devices: int):
    del local_devices
    return StrategyKind.ONE_DEVICE, (
        "the run trains on TPU; the evaluator uses one local device")
