"""`backend_for`: the registered backend of a strategy kind.

Importing this module registers the built-in backends
(`tfdist.backends.base` lists them); `register_backend` adds or replaces
one.
"""

from tfdist.backends import base
# Registered on import.
from tfdist.backends import multi_worker  # pylint: disable=unused-import
from tfdist.backends import parameter_server  # pylint: disable=unused-import
from tfdist.backends import pipeline
from tfdist.backends import single_process  # pylint: disable=unused-import
from tfdist.backends import tensor_parallel
from tfdist.backends import tpu  # pylint: disable=unused-import
from tfdist.backends import zero3

Backend = base.Backend
Role = base.Role
register_backend = base.register_backend


def backend_for(kind) -> base.Backend:
  """A new instance of the backend registered for `kind`.

  Args:
    kind: a `StrategyKind` or a concrete `--distribution_strategy` name.

  Raises:
    ValueError: `kind` is not a concrete strategy name, or no backend is
      registered for it.
  """
  cls = base.registered_backend(kind)
  if cls is None:
    raise ValueError(
        f"No backend is registered for --distribution_strategy={kind}: "
        "register one with tfdist.backends.registry.register_backend.")
  return cls()


def make_strategy(options, *, cluster=None):
  """The strategy of `options.kind`, built by its backend
  (`Backend.make_strategy`: `backend_for(options.kind).make_strategy`).

  Args:
    options: a `tfdist.distribute.strategy.StrategyOptions` with a
      concrete `kind`.
    cluster: the resolved `ClusterInfo` (for a strategy that spans
      processes).

  Raises:
    As `backend_for` and the backend's `make_strategy`.
  """
  return backend_for(options.kind).make_strategy(options, cluster=cluster)


def backend_for_run(kind, config, cluster=None) -> base.Backend:
  """The backend of a run: the pipeline's (`tfdist.backends.pipeline`)
  when `config` cuts the model into stages (`pipeline_stages > 1`), the
  tensor-parallel one (`tfdist.backends.tensor_parallel`) when it splits
  the layers (`tensor_parallel > 1`), ZeRO stage 3's
  (`tfdist.backends.zero3`) at `--zero_stage=3`, else `backend_for(kind)`.

  Args:
    kind: the decided `StrategyKind`.
    config: the run's `TrainConfig` (anything with `pipeline_stages`).
    cluster: the run's `ClusterInfo` (a pipeline's stages may span it).

  Raises:
    As `backend_for`.
  """
  if pipeline.uses_pipeline(config):
    return pipeline.PipelineBackend(cluster)
  if tensor_parallel.uses_tensor_parallel(config):
    return tensor_parallel.TensorParallelBackend()
  return zero3.backend_for(kind, config) or backend_for(kind)
