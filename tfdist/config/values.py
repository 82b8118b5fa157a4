"""The names the config's sections share: the checks' one error form
(`_need`), the frozen sections' build-time setter, the list parser, and the
data sets' recommendations (`DATASET_RECOMMENDED_FLAGS`, `UNSET_DEFAULTS`),
which the task and optimization sections name in their help and the root
config (`tfdist.config.root`) applies to the settings left unset.
"""

from typing import Tuple

from tfdist import errors


# Flag values a data set recommends, applied by `flags.flags_to_config` to
# the flags the command line leaves unset (as Model Garden's experiment
# configs do). MovieLens: the ranking model, Adam (SGD with momentum updates
# every row of an embedding table at every step), and batches of 512 (a
# 500-step run then sees about 3 epochs and reaches a held-out AUC near 0.78).
# Clothing reviews: the Transformer with AdamW, batches of 64 (add
# --lr_schedule=cosine --warmup_epochs=0.5 --weight_decay=0.01).
DATASET_RECOMMENDED_FLAGS = {
    "movielens": (("model", "ranking"), ("batch_size", 512),
                  ("optimizer", "adam"), ("base_learning_rate", 0.002),
                  ("lr_scaling", "sqrt")),
    "clothing_reviews": (("model", "transformer"), ("batch_size", 64),
                         ("optimizer", "adamw"), ("base_learning_rate", 0.001),
                         ("lr_scaling", "sqrt")),
}
# The defaults of the recommendable settings a data set does not recommend
# (`RECOMMENDABLE_FIELDS`).
UNSET_DEFAULTS = {"model": "cnn", "optimizer": "sgd",
                  "base_learning_rate": 0.1, "lr_scaling": "linear"}


def _need(condition, message: str) -> None:
  """Raises `ConfigError(message)` unless `condition` holds."""
  if not condition:
    raise errors.ConfigError(message)


def _split_list(value) -> Tuple[str, ...]:
  if value is None:
    return ()
  if isinstance(value, (list, tuple)):
    items = value
  else:
    items = str(value).split(",")
  return tuple(str(item).strip() for item in items if str(item).strip())


def _set(obj, name: str, value) -> None:
  """Sets a field of a frozen dataclass while it is being built."""
  object.__setattr__(obj, name, value)
