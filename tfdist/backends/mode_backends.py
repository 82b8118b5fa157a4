"""What a parallelism mode needs of the backend, composed with the kind's.

A run's backend is the one registered for its strategy kind
(`tfdist.backends.base.register_backend`), composed with what its
parallelism mode (`tfdist.parallel.mode`) needs of it. A mode that needs
nothing registers nothing here (the `data` mode: the kind's backend as it
is). Otherwise the mode's backend module registers, under the mode's name,
either

* a mixin (`register_mode_backend(name, mixin=...)`): a class put before
  the kind's backend class (ZeRO stage 3 gathers the weights for the
  export), or
* a factory (`register_mode_backend(name, factory=...)`,
  `factory(kind, kind_backend_class, cluster)` returning a `Backend`, or None
  for the kind's as it is): a mode that replaces the kind's step runner or
  strategy (the pipeline drives its stages from one process; tensor
  parallelism is one Mirrored group of N replicas).

`compose(mode, kind, kind_backend_class, cluster)` returns the run's
backend instance (`tfdist.backends.registry.backend_for_run`).
"""

import functools
from typing import Callable, Dict, Optional, Type

from tfdist.backends import base
from tfdist.parallel import mode as mode_lib

_MIXINS: Dict[str, type] = {}
_FACTORIES: Dict[str, Callable] = {}


def register_mode_backend(mode_name: str, *, mixin: Optional[type] = None,
                          factory: Optional[Callable] = None) -> None:
  """Registers what the mode `mode_name` needs of the backend.

  Args:
    mode_name: a `tfdist.parallel.mode` name.
    mixin: a class whose methods go before the kind's backend's.
    factory: `factory(kind, kind_backend_class, cluster) -> Backend or
      None` (`kind`: the decided `StrategyKind`).

  Raises:
    ValueError: neither or both of `mixin` and `factory`.
  """
  if (mixin is None) == (factory is None):
    raise ValueError("register_mode_backend takes one of mixin= or "
                     f"factory=. Received: mixin={mixin!r}, "
                     f"factory={factory!r} for mode {mode_name!r}.")
  _MIXINS.pop(mode_name, None)
  _FACTORIES.pop(mode_name, None)
  if mixin is not None:
    _MIXINS[mode_name] = mixin
  else:
    _FACTORIES[mode_name] = factory


class ExportsGatheredModel:
  """A mixin for a mode that splits the model over replicas (tensor and
  expert parallelism): the manifest's strategy details carry the mode's
  `describe()` under `details_key`, and the SavedModel (and the model a
  `tfdist.fit` caller gets back) is the mode's `exported_model()`, the
  unsharded model holding the gathered weights. Without the mode in the
  trainer, the kind's own.

  Class attributes to set: `split_mode` (the `tfdist.parallel.mode`
  name) and `details_key`."""

  split_mode: str = ""
  details_key: str = ""

  def _split_step(self, run):
    return mode_lib.mode_of(run.parts.trainer, self.split_mode)

  def build_inputs(self, run):
    runner, evaluate, details = super().build_inputs(run)
    step = self._split_step(run)
    if step is not None:
      details = {**details, self.details_key: step.describe()}
    return runner, evaluate, details

  def export_model(self, run):
    step = self._split_step(run)
    if step is None:
      return super().export_model(run)
    return step.exported_model()


@functools.lru_cache(maxsize=None)
def composed_class(mixin: type, kind_backend: Type[base.Backend]) -> type:
  """The class `mixin` then `kind_backend` (one per pair), named after
  both (`Zero3MirroredBackend`-like names in logs and reprs)."""
  name = mixin.__name__.lstrip("_") + kind_backend.__name__
  return type(name, (mixin, kind_backend), {"__module__": mixin.__module__})


def compose(mode, kind, kind_backend: Type[base.Backend],
            cluster=None) -> base.Backend:
  """The run's backend: `kind_backend` (the backend class of the decided
  `kind`) composed with what the mode (a `tfdist.parallel.mode.StepMode`
  class) registered (nothing: a `kind_backend` instance).

  Raises:
    ValueError: a mode that `replaces_step_runner` with no factory
      registered.
  """
  mode_name = mode.name
  factory = _FACTORIES.get(mode_name)
  if factory is None and mode.replaces_step_runner:
    raise ValueError(
        f"The parallelism mode {mode_name!r} replaces the step runner: "
        "register its backend with tfdist.backends.mode_backends"
        f".register_mode_backend({mode_name!r}, factory=...).")
  if factory is not None:
    backend = factory(kind, kind_backend, cluster)
    if backend is not None:
      return backend
  mixin = _MIXINS.get(mode_name)
  if mixin is not None:
    return composed_class(mixin, kind_backend)()
  return kind_backend()
