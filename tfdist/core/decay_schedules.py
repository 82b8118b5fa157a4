"""Learning-rate decay after warmup by name (`--lr_schedule`): a registry.

`tfdist.training.plan.lr_schedule.build_lr_schedule` wraps the decay in linear
warmup (Goyal et al. 2017). A decay builder takes the peak learning rate
(already batch-scaled), the optimizer updates after warmup and the
schedule options of the run, and returns a Keras `LearningRateSchedule`
counting from 0 at the end of warmup:

| name | decay |
|---|---|
| `constant` | the peak, always |
| `cosine` | Keras `CosineDecay` to `peak * end_learning_rate_factor` |
| `piecewise` | Keras `PiecewiseConstantDecay`: the peak times each of `piecewise_multipliers`, at `piecewise_boundaries` (fractions of the steps after warmup) |

`register_decay_schedule` adds a name, or replaces one, from outside
tfdist (as `tfdist.core.optimizers.register_optimizer` does for
optimizers):

    from tfdist.core import decay_schedules

    @decay_schedules.register_decay_schedule("exponential")
    def _exponential(peak_learning_rate, decay_steps, **options):
      return keras.optimizers.schedules.ExponentialDecay(
          peak_learning_rate, decay_steps=decay_steps, decay_rate=0.01)

Keras is imported when a schedule is built, not with this module (the
config validation reads the names).
"""

from typing import Callable, Dict, Tuple

from tfdist import errors

_SCHEDULES: Dict[str, Callable] = {}


def register_decay_schedule(name: str):
  """Registers a decay builder under `name` (a decorator).

  The builder is called as `build(peak_learning_rate, decay_steps,
  **options)`: `peak_learning_rate` a float, `decay_steps` the optimizer
  updates after warmup (>= 1), `options` the run's schedule options
  (`end_learning_rate_factor`, `piecewise_boundaries`,
  `piecewise_multipliers`; a builder ignores the ones it does not use). It
  returns a `keras.optimizers.schedules.LearningRateSchedule` with a
  complete `get_config` (the checkpoint and the SavedModel keep it).

  Raises:
    ValueError: an empty or upper-case name.
  """
  if not name or name != name.lower():
    raise ValueError(f"register_decay_schedule({name!r}): names are lower "
                     "case and not empty (as --lr_schedule takes them).")

  def register(build):
    _SCHEDULES[name] = build
    return build

  return register


def registered_decay_schedules() -> Tuple[str, ...]:
  """The registered names, in registration order."""
  return tuple(_SCHEDULES)


def check_decay_schedule(name: str) -> None:
  """Raises ConfigError for a name that is not registered."""
  if name not in _SCHEDULES:
    raise errors.ConfigError(
        f"--lr_schedule={name!r} is unknown. Use one of: "
        f"{', '.join(_SCHEDULES)} (tfdist.training.decay_schedules."
        "register_decay_schedule adds more).")


def build_decay(name: str, peak_learning_rate: float, decay_steps: int,
                **options):
  """The decay `name` from `peak_learning_rate` over `decay_steps`.

  Raises:
    ConfigError: an unknown name.
  """
  check_decay_schedule(name)
  return _SCHEDULES[name](peak_learning_rate, max(int(decay_steps), 1),
                          **options)


@register_decay_schedule("constant")
def _constant(peak_learning_rate, decay_steps, **options):
  del decay_steps, options
  from tfdist.core import constant_schedule  # pylint: disable=g-import-not-at-top
  return constant_schedule.ConstantLearningRate(peak_learning_rate)


@register_decay_schedule("cosine")
def _cosine(peak_learning_rate, decay_steps, *, end_learning_rate_factor=0.0,
            **options):
  del options
  import keras  # pylint: disable=g-import-not-at-top
  return keras.optimizers.schedules.CosineDecay(
      initial_learning_rate=peak_learning_rate, decay_steps=decay_steps,
      alpha=end_learning_rate_factor)


@register_decay_schedule("piecewise")
def _piecewise(peak_learning_rate, decay_steps, *,
               piecewise_boundaries=(0.5, 0.75),
               piecewise_multipliers=(1.0, 0.1, 0.01), **options):
  del options
  import keras  # pylint: disable=g-import-not-at-top
  return keras.optimizers.schedules.PiecewiseConstantDecay(
      boundaries=[int(round(b * decay_steps)) for b in piecewise_boundaries],
      values=[peak_learning_rate * m for m in piecewise_multipliers])
