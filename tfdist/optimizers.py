"""Builds a Keras optimizer by name (`--optimizer`) around an LR schedule."""

import keras

from tfdist.config import ConfigError


def build_optimizer(name: str, learning_rate, *, momentum: float = 0.9,
                    weight_decay: float = 0.0) -> keras.optimizers.Optimizer:
  """Returns a Keras 3 optimizer.

  Args:
    name: `sgd` (plain), `momentum` (SGD with Nesterov-free momentum),
      `adam`, `adamw`, `rmsprop` or `lamb` (You et al. 2019, for very large
      batches).
    learning_rate: a float or a `LearningRateSchedule`.
    momentum: momentum for `sgd`/`momentum`/`rmsprop` (`sgd` uses it too when
      > 0, as Model Garden does).
    weight_decay: decoupled weight decay (0 disables it).

  Raises:
    ConfigError: unknown name.
  """
  decay = weight_decay or None
  if name in ("sgd", "momentum"):
    return keras.optimizers.SGD(learning_rate=learning_rate, momentum=momentum,
                                weight_decay=decay)
  if name == "adam":
    return keras.optimizers.Adam(learning_rate=learning_rate,
                                 weight_decay=decay)
  if name == "adamw":
    return keras.optimizers.AdamW(learning_rate=learning_rate,
                                  weight_decay=weight_decay or 0.004)
  if name == "rmsprop":
    return keras.optimizers.RMSprop(learning_rate=learning_rate,
                                    momentum=momentum, weight_decay=decay)
  if name == "lamb":
    return keras.optimizers.Lamb(learning_rate=learning_rate,
                                 weight_decay=decay)
  raise ConfigError(
      f"--optimizer={name!r} is unknown. Use sgd, momentum, adam, adamw, "
      "rmsprop or lamb.")
