"""What a model builder asking for `config` receives
(`ModelBuilderConfig`): the task section, read by flat name as before.

Consumer: the model builders (`tfdist.training.task`, through the
assembly's `builder_config`).
"""

import dataclasses
import warnings

from tfdist.config.root import _SETTINGS
from tfdist.config.root import TrainConfig
from tfdist.config.task import TaskConfig


# The settings a model builder's `config` holds: the model and data section.
_MODEL_OPTION_NAMES = frozenset(
    name for name, (path, _) in _SETTINGS.items() if path[:1] == ("task",))


class ModelBuilderConfig:
  """What a model builder asking for `config` receives: the model options.

  `build(spec, config)` (a registered builder or `--model=module:fn`) is
  given the run's model and data section (`TrainConfig.task`: `model`,
  `embedding_dim`, `hash_buckets`, `transformer_layers`,
  `sync_batch_norm`, the data files, ...), read by flat name as before
  (`config.embedding_dim`) or as the section (`config.task`), plus
  `activation_recomputation`. Reading another setting (`config.batch_size`,
  `config.dtype`) still answers the setting as the run was given it (None
  where it was left to a default the run decides later, as
  `--batch_size`), with a `FutureWarning` (a deprecation shown to the
  script's user, as Python's `DeprecationWarning` outside `__main__` is
  not): a model is built from its options, and what else it needs is the
  builder's own argument (`spec`, `sync_batch_norm`, ...) or the script's;
  tfdist 0.2 drops the old form.

  Args:
    config: the run's `TrainConfig`.
  """

  def __init__(self, config: "TrainConfig"):
    object.__setattr__(self, "_config", config)

  @property
  def task(self) -> TaskConfig:
    """The model and data section itself."""
    return self._config.task

  def __getattr__(self, name: str):
    if name.startswith("_"):
      raise AttributeError(name)
    config = self._config
    if name in _MODEL_OPTION_NAMES or name == "activation_recomputation":
      return getattr(config, name)
    if hasattr(config.task, name):
      return getattr(config.task, name)
    if name not in _SETTINGS and not hasattr(config, name):
      raise AttributeError(
          f"a model builder's config has no {name!r}; it holds the model "
          f"options (config.task: {', '.join(sorted(_MODEL_OPTION_NAMES))})"
          ".")
    warnings.warn(
        f"a model builder read config.{name}, which is not a model option: "
        "a builder's `config` is the model and data section "
        "(tfdist.config.ModelBuilderConfig; config.task). Take what else "
        "the model needs as a builder argument (spec, sync_batch_norm, "
        "activation_recomputation) or from your script; reading other "
        "settings here stops working in tfdist 0.2.",
        FutureWarning, stacklevel=2)
    return getattr(config, name)

  def __setattr__(self, name, value):
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

  def __repr__(self) -> str:
    return f"ModelBuilderConfig({self._config.task!r})"
