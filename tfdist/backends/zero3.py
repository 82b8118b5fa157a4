"""ZeRO stage 3 (`--zero_stage=3`) under mirrored and multi_worker_mirrored.

The strategy, inputs and step runner are the strategy's own; the trainer's
step gathers the sharded weights itself (`tfdist.parallel.zero3`). What
the backend adds: the weights are gathered into the Keras model before the
export and when the run ends (`zero3.materialize`), so the SavedModel and
the model a `tfdist.fit` caller gets back are the unsharded model.
`backend_for_run` chooses these backends for a config with
`zero_stage_resolved == 3`.
"""

from tfdist.backends import multi_worker
from tfdist.backends import single_process
from tfdist.distribute.strategy_kind import StrategyKind
from tfdist.parallel import zero3


class _GathersAtEnd:
  """Gathers the weights into the model before the export and the end."""

  def export_model(self, run):
    zero3.materialize(run.parts.trainer)
    return super().export_model(run)

  def leave_together(self, run, *, failed: bool = False) -> None:
    parts = getattr(run, "parts", None)
    if not failed and parts is not None:
      zero3.materialize(parts.trainer)
    super().leave_together(run, failed=failed)


class Zero3MirroredBackend(_GathersAtEnd, single_process.MirroredBackend):
  """MirroredStrategy, weights sharded over its replicas."""


class Zero3MultiWorkerBackend(_GathersAtEnd,
                              multi_worker.MultiWorkerMirroredBackend):
  """MultiWorkerMirroredStrategy, weights sharded over every replica of
  every worker."""


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
