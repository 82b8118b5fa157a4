"""`backend_for`: the registered backend of a strategy kind.

Importing this module registers the built-in backends
(`tfdist.backends.base` lists them); `register_backend` adds or replaces
one.
"""

from tfdist.backends import base
from tfdist.backends import mode_backends
# Registered on import (the kinds' backends, then the modes' needs).
from tfdist.backends import multi_worker  # pylint: disable=unused-import
from tfdist.backends import parameter_server  # pylint: disable=unused-import
from tfdist.backends import pipeline  # pylint: disable=unused-import
from tfdist.backends import single_process  # pylint: disable=unused-import
from tfdist.backends import tensor_parallel  # pylint: disable=unused-import
from tfdist.backends import experts  # pylint: disable=unused-import
from tfdist.backends import tpu  # pylint: disable=unused-import
from tfdist.backends import zero3  # pylint: disable=unused-import
from tfdist.distribute import decisions as decisions_lib
from tfdist.parallel import modes

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
  """The backend of a run: the kind's (`backend_for`) composed with what
  the run's parallelism mode needs of it (`tfdist.backends.mode_backends`;
  the mode `tfdist.parallel.mode.mode_name_for` chooses from `config`'s
  memory section (`zero_stage_resolved`) and parallelism section
  (`pipeline_stages`, `tensor_parallel`)): the
  pipeline's backend (`tfdist.backends.pipeline`) with stages, the
  tensor-parallel one (`tfdist.backends.tensor_parallel`) with split
  layers, the kind's with ZeRO stage 3's export gather
  (`tfdist.backends.zero3`) at `--zero_stage=3`.

  Args:
    kind: the decided `StrategyKind`.
    config: the run's `TrainConfig` (anything with its `memory` and
      `strategy.parallelism` sections).
    cluster: the run's `ClusterInfo` (a pipeline's stages may span it).

  Raises:
    As `backend_for`.
  """
  mode = modes.get_mode(modes.mode_name_of(config.strategy.parallelism,
                                            config.memory))
  cls = base.registered_backend(kind)
  if cls is None:
    backend_for(kind)  # Raises its error.
  return mode_backends.compose(mode, kind, cls, cluster)


def check_strategy_rules(config, decisions=None, *, dataset=None,
                         cluster=None):
  """Runs the strategy's rules on `config` as preparing a run does
  (`tfdist.experiment.prepare.prepare_run`): the decided backend's
  `validate` (`backend_for_run`), without resolving a cluster or building
  anything. The strategy's rules live in its backend, not in
  `TrainConfig`: a `TrainConfig` naming `parameter_server` with
  `--deterministic` is built, and refused here.

  Args:
    config: a `TrainConfig`.
    decisions: its `tfdist.distribute.decisions.Decisions`; None: those of
      a config that names its strategy and dtype (`Decisions.of(config)`).
    dataset: the run's `DatasetSpec`, or None.
    cluster: the run's `ClusterInfo`, or None.

  Returns:
    The decisions the rules ran on.

  Raises:
    tfdist.errors.ConfigError: a rule the decided strategy's backend holds
      (or, with `decisions` None, `config` still says `auto`).
  """
  if decisions is None:
    decisions = decisions_lib.Decisions.of(config)
  backend_for_run(decisions.strategy, config, cluster).validate(
      config, decisions, dataset=dataset)
  return decisions
