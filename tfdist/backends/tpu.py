"""`TPUStrategy`: one process drives the TPU's cores."""

from typing import Tuple

from tfdist.backends import base
from tfdist.backends import synchronous
from tfdist.distribute import tpu as tpu_lib
from tfdist.core.strategy_kind import StrategyKind
from tfdist.training.plan import run_plan as run_plan_lib


@base.register_backend(StrategyKind.TPU)
class TPUBackend(synchronous.SynchronousBackend):
  """Static shapes: the model is built for the TPU and the last evaluation
  batches are padded (masked in the metrics)."""

  on_tpu = True

  def new_strategy(self, options, *, cluster):
    """`TPUStrategy` over the TPU at `options.tpu` (`auto` filled it with
    the address it found: tfdist.distribute.tpu's one rule).

    Raises:
      tfdist.errors.TPUNotAvailableError: no TPU reachable (raised within
        `--tpu_init_timeout` seconds).
    """
    del cluster  # The TPU system is found by its address.
    tpu = options.tpu
    system = tpu_lib.connect_tpu(
        tpu_lib.resolve_tpu_address(tpu.tpu), zone=tpu.tpu_zone,
        project=tpu.tpu_gcp_project, init_timeout=tpu.tpu_init_timeout)
    strategy = tpu_lib.make_tpu_strategy(system)
    return strategy, tuple(strategy.extended.worker_devices)

  def validate(self, config, decisions, *, dataset) -> None:
    """Raises ConfigError: as `Backend.validate`; fp16, or local input
    files with a remote TPU (`tfdist.distribute.tpu.validate_tpu_config`)."""
    super().validate(config, decisions, dataset=dataset)
    tpu_lib.validate_tpu_config(
        decisions.tpu, data_patterns=run_plan_lib.data_patterns(
            run_plan_lib.decided_data(config.task.data, decisions), dataset))

  def planned_replicas(self, config, decisions, *, cluster) -> Tuple[int, int]:
    # Only the TPU knows its cores: asked, boundedly.
    choice = self.make_strategy(self.strategy_options(config, decisions),
                                cluster=cluster)
    return (choice.strategy.num_replicas_in_sync,
            self.training_workers(cluster))

  def evaluator_strategy(self, local_devices: int):
    del local_devices
    return StrategyKind.ONE_DEVICE, (
        "the run trains on TPU; the evaluator uses one local device")
