"""ZeRO stage 3 (`--zero_stage=3`) under mirrored and multi_worker_mirrored.

The strategy, inputs and step runner are the strategy's own; the trainer's
step gathers the sharded weights itself (`tfdist.parallel.zero3`). What
the backend adds: the weights are gathered into the Keras model before the
export (`zero3.materialize`), and under Mirrored also when the run ends,
so the SavedModel and the model a `tfdist.fit` caller gets back are the
unsharded model.
Registered for the `zero3` mode (`tfdist.backends.mode_backends`): the
run's backend is the kind's with `_GathersForExport` before it.
"""

import dataclasses

from tfdist.backends import mode_backends
from tfdist.core.strategy_kind import StrategyKind
from tfdist.parallel.zero3 import optimizer as zero3
from tfdist.training.plan import memory


class _GathersForExport:
  """ZeRO stage 3's needs of a Mirrored or MultiWorkerMirrored backend:
  the weights gathered into the model before the export (every task
  exports: the gather is collective as the save is) and, under Mirrored
  (one process), when the run ends, for `tfdist.fit`'s caller with or
  without an export. Not under MultiWorkerMirrored: the gather is a
  collective, and a task that failed would leave its peers waiting in it
  before the final barrier tells them."""

  def export_model(self, run):
    zero3.materialize(run.parts.trainer)
    return super().export_model(run)

  def leave_together(self, run, *, failed: bool = False) -> None:
    parts = getattr(run, "parts", None)
    if self.kind == StrategyKind.MIRRORED and not failed and (
        parts is not None):
      zero3.materialize(parts.trainer)
    super().leave_together(run, failed=failed)

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


def _zero3_backend(kind, kind_backend, cluster):
  """The kind's backend with `_GathersForExport` before it, under the
  mirrored kinds (the only ones `--zero_stage` runs under); else None
  (the kind's own)."""
  del kind, cluster
  if not kind_backend.mirrored:
    return None
  return mode_backends.composed_class(_GathersForExport, kind_backend)()


mode_backends.register_mode_backend(zero3.MODE_NAME, factory=_zero3_backend)
