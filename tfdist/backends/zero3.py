"""ZeRO stage 3 (`--zero_stage=3`) under mirrored and multi_worker_mirrored.

The strategy, inputs and step runner are the strategy's own; the trainer's
step gathers the sharded weights itself (`tfdist.parallel.zero3`). What
the backend adds: the weights are gathered into the Keras model before the
export (`zero3.materialize`), and under Mirrored also when the run ends,
so the SavedModel and the model a `tfdist.fit` caller gets back are the
unsharded model.
`backend_for_run` chooses these backends for a config with
`zero_stage_resolved == 3`.
"""

import dataclasses

from tfdist.backends import multi_worker
from tfdist.backends import single_process
from tfdist.distribute.strategy_kind import StrategyKind
from tfdist.parallel.zero3 import optimizer as zero3
from tfdist.training import memory


class _GathersForExport:
  """Gathers the weights into the model before the export (every task
  exports: the gather is collective as the save is)."""

  def export_model(self, run):
    zero3.materialize(run.parts.trainer)
    return super().export_model(run)

  def model_memory(self, parts, *, num_replicas: int):
    """Weights and gradients as stage 3 holds them (1/N, embedding tables
    whole: `memory.sharded_estimate`), the optimizer's per-replica shards
    as stage 1 holds them."""
    estimate = memory.estimate_model_memory(
        parts.model, parts.optimizer, sharded=parts.trainer.sharded,
        replicated_variables=zero3.replicated_variables(parts.model))
    staged = memory.sharded_estimate(estimate, num_replicas=num_replicas,
                                     stage=zero3.STAGE)
    return dataclasses.replace(staged,
                               optimizer_bytes=estimate.optimizer_bytes)


class Zero3MirroredBackend(_GathersForExport,
                           single_process.MirroredBackend):
  """MirroredStrategy, weights sharded over its replicas; the weights are
  also gathered into the model when the run ends (for `tfdist.fit`'s
  caller, with or without an export)."""

  def leave_together(self, run, *, failed: bool = False) -> None:
    parts = getattr(run, "parts", None)
    if not failed and parts is not None:
      zero3.materialize(parts.trainer)
    super().leave_together(run, failed=failed)


class Zero3MultiWorkerBackend(_GathersForExport,
                              multi_worker.MultiWorkerMirroredBackend):
  """MultiWorkerMirroredStrategy, weights sharded over every replica of
  every worker. Not gathered when the run ends without an export: the
  gather is a collective, and a task that failed would leave its peers
  waiting in it before the final barrier tells them."""


def backend_for(kind, config):
  """The stage-3 backend of `kind` when `config` asks for stage 3
  (`zero_stage_resolved == 3`), else None."""
  if getattr(config, "zero_stage_resolved", 0) != zero3.STAGE:
    return None
  if kind == StrategyKind.MIRRORED:
    return Zero3MirroredBackend()
  if kind == StrategyKind.MULTI_WORKER_MIRRORED:
    return Zero3MultiWorkerBackend()
  return None
