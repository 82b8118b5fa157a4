"""Optimizers by name (`--optimizer`): a registry, with each one's traits.

Every fact about an optimizer that tfdist acts on is written once, here, as
its `OptimizerTraits`, and read by the config validation (ZeRO stages), the
sharded optimizer (`tfdist.parallel.data.sharded_optimizer.check_optimizer`), the
memory estimate's advice (`tfdist.training.plan.memory`), the flag help and
`tfdist.diagnose`:

| name | Keras class | slots per parameter | shardable (ZeRO 1-2) |
|---|---|---|---|
| `sgd`, `momentum` | `SGD` | 1 (momentum; 0 without) | yes |
| `adam`, `adamw`, `nadam`, `adamax` | `Adam`, `AdamW`, `Nadam`, `Adamax` | 2 | yes |
| `rmsprop` | `RMSprop` | 1 (2 with momentum) | yes |
| `adagrad`, `lion` | `Adagrad`, `Lion` | 1 | yes |
| `adadelta`, `ftrl` | `Adadelta`, `Ftrl` | 2 | yes |
| `lamb` | `Lamb` | 2 | no: a whole variable's norm (You et al. 2019) |
| `adafactor` | `Adafactor` | < 1 (factored) | no: row and column statistics |
| `muon` | `Muon` | 2 | no: orthogonalizes whole matrices |

Any other name that `keras.optimizers.get` accepts also works: it is built
with the learning rate, weight decay and clipping, its slot count is
measured, and it is taken as not shardable (tfdist cannot know that its
update is element-wise). `register_optimizer` adds a name, or replaces one,
from outside tfdist:

    from tfdist.core import optimizers

    @optimizers.register_optimizer("sgd_nesterov", slots_per_parameter=1)
    def _sgd_nesterov(learning_rate, *, momentum, weight_decay, **clip):
      return keras.optimizers.SGD(learning_rate, momentum=momentum,
                                  nesterov=True, weight_decay=weight_decay,
                                  **clip)

Keras is imported when an optimizer is built, not with this module (the
config validation reads the traits).
"""

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

from tfdist import errors


@dataclasses.dataclass(frozen=True)
class OptimizerTraits:
  """What tfdist needs to know of an optimizer.

  Attributes:
    slots_per_parameter: float32 values the optimizer keeps per trainable
      parameter (momentum: 1; Adam: 2), with its default options.
    shardable: ZeRO stages 1-2 may run it on flat shards that cut across
      variables: each element's update depends only on that element's
      gradient and slots (Rajbhandari et al. 2020).
    not_shardable_because: why not, when not (said in the refusal).
  """
  slots_per_parameter: float
  shardable: bool = True
  not_shardable_because: str = ""


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  """A registered optimizer.

  Attributes:
    name: its `--optimizer` name.
    build: `(learning_rate, *, momentum, weight_decay, clipnorm,
      global_clipnorm) -> keras.optimizers.Optimizer`.
    traits: its `OptimizerTraits`.
    class_name: the Keras class it builds (recognizes built optimizers).
  """
  name: str
  build: Callable[..., Any]
  traits: OptimizerTraits
  class_name: str


_OPTIMIZERS: Dict[str, OptimizerSpec] = {}

_UNKNOWN_UPDATE = ("tfdist does not know that its update is element-wise; "
                   "register it with tfdist.training.optimizers."
                   "register_optimizer(..., shardable=True) if it is")


def register_optimizer(name: str, *, slots_per_parameter: float,
                       class_name: Optional[str] = None,
                       shardable: bool = True,
                       not_shardable_because: str = ""):
  """Registers an optimizer builder under `name` (a decorator).

  Args:
    name: the `--optimizer` value (lower case).
    slots_per_parameter: see `OptimizerTraits`.
    class_name: the Keras class the builder returns (None: the builder's
      result's class is not checked by name; built optimizers of that class
      are then not recognized as this one).
    shardable: see `OptimizerTraits`.
    not_shardable_because: see `OptimizerTraits`.

  Returns:
    A decorator that registers its function and returns it unchanged.

  Raises:
    ValueError: an empty or upper-case name.
  """
  if not name or name != name.lower():
    raise ValueError(f"register_optimizer({name!r}): names are lower case "
                     "and not empty (as --optimizer takes them).")

  def register(build):
    _OPTIMIZERS[name] = OptimizerSpec(
        name=name, build=build, class_name=class_name or "",
        traits=OptimizerTraits(slots_per_parameter, shardable,
                               not_shardable_because))
    return build

  return register


def registered_optimizers() -> Tuple[str, ...]:
  """The registered names, in registration order."""
  return tuple(_OPTIMIZERS)


def not_shardable() -> Tuple[str, ...]:
  """The registered names ZeRO stages 1-2 refuse."""
  return tuple(n for n, s in _OPTIMIZERS.items() if not s.traits.shardable)


def optimizer_spec(name: str) -> OptimizerSpec:
  """The spec of `--optimizer=name`: registered, or Keras's own.

  Raises:
    ConfigError: neither registered nor accepted by `keras.optimizers.get`.
  """
  spec = _OPTIMIZERS.get(name)
  if spec is not None:
    return spec
  import keras  # pylint: disable=g-import-not-at-top
  try:
    cls = type(keras.optimizers.get(name))
  except (ValueError, TypeError):
    raise errors.ConfigError(
        f"--optimizer={name!r} is unknown. Use one of: "
        f"{', '.join(registered_optimizers())}, or a name that "
        "keras.optimizers.get accepts.") from None

  def build(learning_rate, *, momentum, weight_decay, clipnorm=None,
            global_clipnorm=None):
    del momentum  # Keras's defaults for this optimizer.
    return cls(learning_rate=learning_rate, weight_decay=weight_decay,
               clipnorm=clipnorm, global_clipnorm=global_clipnorm)

  return OptimizerSpec(
      name=name, build=build, class_name=cls.__name__,
      traits=OptimizerTraits(_measured_slots(cls), shardable=False,
                             not_shardable_because=_UNKNOWN_UPDATE))


def _measured_slots(cls) -> float:
  """Slot values per parameter of a Keras optimizer class, measured on a
  4x4 variable (its iteration count and learning rate left out)."""
  import keras  # pylint: disable=g-import-not-at-top
  variable = keras.Variable(keras.ops.zeros((4, 4)))
  optimizer = cls()
  optimizer.build([variable])
  own = {id(optimizer.iterations)}
  rate = getattr(optimizer, "_learning_rate", None)
  if rate is not None:
    own.add(id(rate))
  values = sum(int(v.numpy().size) for v in optimizer.variables
               if id(v) not in own)
  return values / 16.0


def spec_of(optimizer) -> OptimizerSpec:
  """The spec of a built Keras optimizer (under a `LossScaleOptimizer`, the
  inner one): the registered name whose class it is, else Keras's own by
  its class name."""
  inner = getattr(optimizer, "inner_optimizer", None) or optimizer
  class_name = type(inner).__name__
  for spec in _OPTIMIZERS.values():
    if spec.class_name == class_name:
      return spec
  return OptimizerSpec(
      name=class_name.lower(), build=None, class_name=class_name,
      traits=OptimizerTraits(_measured_slots(type(inner)), shardable=False,
                             not_shardable_because=_UNKNOWN_UPDATE))


def build_optimizer(name: str, learning_rate, *, momentum: float = 0.9,
                    weight_decay: float = 0.0,
                    clipnorm: Optional[float] = None,
                    global_clipnorm: Optional[float] = None):
  """Returns a Keras 3 optimizer.

  Args:
    name: a registered name (`registered_optimizers`) or one that
      `keras.optimizers.get` accepts.
    learning_rate: a float or a `LearningRateSchedule`.
    momentum: momentum for `sgd`/`momentum`/`rmsprop` (`sgd` uses it too when
      > 0, as Model Garden does).
    weight_decay: decoupled weight decay (0 disables it; `adamw` then uses
      0.004, Keras's default).
    clipnorm, global_clipnorm: Keras's gradient clipping (at most one;
      None: off). Under `tfdist.training.step.train_loop.Trainer` the optimizer
      clips the gradient summed over all replicas (and unscaled under
      fp16), once.

  Returns:
    A `keras.optimizers.Optimizer`.

  Raises:
    ConfigError: an unknown name.
  """
  return optimizer_spec(name).build(
      learning_rate, momentum=momentum, weight_decay=weight_decay or None,
      clipnorm=clipnorm, global_clipnorm=global_clipnorm)


def _keras():
  import keras  # pylint: disable=g-import-not-at-top
  return keras.optimizers


@register_optimizer("sgd", slots_per_parameter=1, class_name="SGD")
def _sgd(learning_rate, *, momentum, weight_decay, **clip):
  return _keras().SGD(learning_rate=learning_rate, momentum=momentum,
                      weight_decay=weight_decay, **clip)


register_optimizer("momentum", slots_per_parameter=1,
                   class_name="SGD")(_sgd)


@register_optimizer("adam", slots_per_parameter=2, class_name="Adam")
def _adam(learning_rate, *, momentum, weight_decay, **clip):
  del momentum
  return _keras().Adam(learning_rate=learning_rate,
                       weight_decay=weight_decay, **clip)


@register_optimizer("adamw", slots_per_parameter=2, class_name="AdamW")
def _adamw(learning_rate, *, momentum, weight_decay, **clip):
  del momentum
  return _keras().AdamW(learning_rate=learning_rate,
                        weight_decay=weight_decay or 0.004, **clip)


@register_optimizer("rmsprop", slots_per_parameter=1, class_name="RMSprop")
def _rmsprop(learning_rate, *, momentum, weight_decay, **clip):
  return _keras().RMSprop(learning_rate=learning_rate, momentum=momentum,
                          weight_decay=weight_decay, **clip)


@register_optimizer(
    "lamb", slots_per_parameter=2, class_name="Lamb", shardable=False,
    not_shardable_because=(
        "LAMB's trust ratio (You et al. 2019) needs each whole variable's "
        "norm, and the shards cut across variables"))
def _lamb(learning_rate, *, momentum, weight_decay, **clip):
  del momentum
  return _keras().Lamb(learning_rate=learning_rate,
                       weight_decay=weight_decay, **clip)


def _keras_default(class_name: str):
  """A builder of Keras's `class_name` with its own defaults."""

  def build(learning_rate, *, momentum, weight_decay, **clip):
    del momentum
    return getattr(_keras(), class_name)(
        learning_rate=learning_rate, weight_decay=weight_decay, **clip)

  return build


for _name, _cls, _slots in (("nadam", "Nadam", 2), ("adamax", "Adamax", 2),
                            ("adagrad", "Adagrad", 1), ("lion", "Lion", 1),
                            ("adadelta", "Adadelta", 2),
                            ("ftrl", "Ftrl", 2)):
  register_optimizer(_name, slots_per_parameter=_slots,
                     class_name=_cls)(_keras_default(_cls))

register_optimizer(
    "adafactor", slots_per_parameter=0.5, class_name="Adafactor",
    shardable=False, not_shardable_because=(
        "Adafactor factors its second moments into each matrix's row and "
        "column statistics (Shazeer and Stern 2018), which a flat shard "
        "does not hold"))(_keras_default("Adafactor"))
register_optimizer(
    "muon", slots_per_parameter=2, class_name="Muon", shardable=False,
    not_shardable_because=(
        "Muon orthogonalizes each whole matrix's update (Newton-Schulz "
        "iterations)"))(_keras_default("Muon"))
