"""Expert parallelism (`--expert_parallel=E_p`, E_p > 1) under Mirrored and
MultiWorkerMirrored.

The strategy, inputs and step runner are the kind's own (every replica
trains on its share of the batch; under MultiWorkerMirrored every worker
holds its replicas' experts and the all-to-all crosses the processes);
the trainer's step is the `experts` mode's
(`tfdist.parallel.experts.mode`). What the backend adds: the SavedModel
(and the model a `tfdist.fit` caller gets back) is the unsharded model
holding every expert, gathered from the replicas (across workers a
collective: every worker exports, as it saves its checkpoints).

Registered for the `experts` mode (`tfdist.backends.mode_backends`): the
run's backend is the kind's with `_GathersExperts` before it.
"""

from tfdist.backends import mode_backends


class _GathersExperts(mode_backends.ExportsGatheredModel):
  """The experts gathered into the unsharded model for the export; the
  manifest's strategy details say how they are laid out."""

  split_mode = "experts"
  details_key = "expert_parallel"


def _experts_backend(kind, kind_backend, cluster):
  """The kind's backend with `_GathersExperts` before it, under a mirrored
  kind (Mirrored or MultiWorkerMirrored, those `--expert_parallel` runs
  under); else None (the kind's own, whose strategy the flags already
  refused)."""
  del kind, cluster
  if not kind_backend.mirrored:
    return None
  return mode_backends.composed_class(_GathersExperts, kind_backend)()


mode_backends.register_mode_backend("experts", factory=_experts_backend)
