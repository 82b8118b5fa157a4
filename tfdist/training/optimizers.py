"""Builds a Keras optimizer by name (`--optimizer`) around an LR schedule."""

from typing import Optional

import keras

from tfdist.config import ConfigError


def build_optimizer(name: str, learning_rate, *, momentum: float = 0.9,
                    weight_decay: float = 0.0,
                    clipnorm: Optional[float] = None,
                    global_clipnorm: Optional[float] = None
                    ) -> keras.optimizers.Optimizer:
  """Returns a Keras 3 optimizer.

  Args:
    name: `sgd` (plain), `momentum` (SGD with Nesterov-free momentum),
      `adam`, `adamw`, `rmsprop` or `lamb` (You et al. 2019, for very large
      batches).
    learning_rate: a float or a `LearningRateSchedule`.
    momentum: momentum for `sgd`/`momentum`/`rmsprop` (`sgd` uses it too when
      > 0, as Model Garden does).
    weight_decay: decoupled weight decay (0 disables it).
    clipnorm, global_clipnorm: Keras's gradient clipping (at most one;
      None: off). Under `tfdist.training.train_loop.Trainer` the optimizer clips
        the
      gradient summed over all replicas (and unscaled under fp16), once.

  Raises:
    ConfigError: unknown name.
  """
  decay = weight_decay or None
  clip = {"clipnorm": clipnorm, "global_clipnorm": global_clipnorm}
  if name in ("sgd", "momentum"):
    return keras.optimizers.SGD(learning_rate=learning_rate, momentum=momentum,
                                weight_decay=decay, **clip)
  if name == "adam":
    return keras.optimizers.Adam(learning_rate=learning_rate,
                                 weight_decay=decay, **clip)
  if name == "adamw":
    return keras.optimizers.AdamW(learning_rate=learning_rate,
                                  weight_decay=weight_decay or 0.004, **clip)
  if name == "rmsprop":
    return keras.optimizers.RMSprop(learning_rate=learning_rate,
                                    momentum=momentum, weight_decay=decay,
                                    **clip)
  if name == "lamb":
    return keras.optimizers.Lamb(learning_rate=learning_rate,
                                 weight_decay=decay, **clip)
  raise ConfigError(
      f"--optimizer={name!r} is unknown. Use sgd, momentum, adam, adamw, "
      "rmsprop or lamb.")
