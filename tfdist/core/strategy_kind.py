"""The kind of `tf.distribute` strategy a run uses: a name, decided once.

`--distribution_strategy` (or `auto`'s decision,
`tfdist.distribute.auto_select`) is parsed into a kind in one place,
`StrategyKind.parse`. A kind is only a name: every question about the
strategy ("is it asynchronous?", "which task writes `--model_dir`?", "how
many input pipelines?", "how is it built?") is asked of its backend,
`tfdist.backends.registry.backend_for(kind)`, never answered by comparing
kinds. Keras 3's trainer and Model Garden's `_AsyncTrainer` decide such
facts once in the same way (`_is_async`).

`StrategyKind` holds the built-in names. A kind written outside tfdist is
registered by name (`register_kind`): it is then parsed like a built-in one
and gets its backend with `tfdist.backends.registry.register_backend`.

Kinds are `str`-valued, so a kind prints, formats and serializes to JSON as
the flag value it came from (`multi_worker_mirrored`).
"""

import enum
from typing import Dict, Union


class StrategyKind(str, enum.Enum):
  """A concrete built-in strategy: what `--distribution_strategy` resolved
  to.

  `auto` is a request, not a kind: `tfdist.distribute.auto_select` turns it into
  one of these before any strategy is built.
  """

  OFF = "off"
  ONE_DEVICE = "one_device"
  MIRRORED = "mirrored"
  MULTI_WORKER_MIRRORED = "multi_worker_mirrored"
  PARAMETER_SERVER = "parameter_server"
  TPU = "tpu"

  def __str__(self) -> str:
    return self.value

  def __format__(self, spec: str) -> str:
    return format(self.value, spec)

  @classmethod
  def parse(cls, name: Union[str, "StrategyKind", "RegisteredKind"]
            ) -> Union["StrategyKind", "RegisteredKind"]:
    """The kind named by a flag value (case-insensitive).

    Args:
      name: a `--distribution_strategy` value other than `auto`, a kind,
        or the name of a kind registered with `register_kind`.

    Returns:
      The `StrategyKind` member, or the `RegisteredKind` of that name.

    Raises:
      ValueError: `name` is not a concrete strategy name (the message names
        the flag, the value and the choices). `auto` is refused: resolve it
        with `tfdist.distribute.auto_select` first.
    """
    if isinstance(name, (cls, RegisteredKind)):
      return name
    text = str(name).strip().lower()
    for kind in cls:
      if kind.value == text:
        return kind
    if text in _REGISTERED:
      return _REGISTERED[text]
    raise ValueError(
        f"--distribution_strategy={name!r} is not a concrete strategy; use one"
        f" of: {', '.join(names())} (auto is resolved by "
        "tfdist.distribute.auto_select before a kind is parsed).")

class RegisteredKind(str):
  """A strategy kind written outside tfdist (`register_kind`): a `str` that
  prints, formats and serializes as its name, as a `StrategyKind` does."""

  @property
  def value(self) -> str:
    """The name (as `StrategyKind.value`)."""
    return str.__str__(self)

  def __repr__(self) -> str:
    return f"RegisteredKind({self.value!r})"


_REGISTERED: Dict[str, RegisteredKind] = {}


def register_kind(name: str) -> RegisteredKind:
  """Registers a strategy kind written outside tfdist; returns it.

  Registering a name again returns the same kind. Register its backend
  next (`tfdist.backends.registry.register_backend(kind, MyBackend)`), and
  a selection rule (`tfdist.distribute.auto_select.register_rule`) for
  `auto` to choose it.

  Args:
    name: the kind's name: lower case letters, digits and `_`, starting
      with a letter; not `auto` nor a built-in name.

  Raises:
    ValueError: a name of another form, `auto`, or a built-in name.
  """
  text = str(name)
  if not (text[:1].isalpha() and text.islower() and
          text.replace("_", "").isalnum()):
    raise ValueError(
        f"register_kind({name!r}): a strategy kind's name is lower case "
        "letters, digits and `_`, starting with a letter (e.g. "
        "'my_strategy').")
  if text == "auto" or text in {k.value for k in StrategyKind}:
    raise ValueError(
        f"register_kind({name!r}): {text} is already a "
        "--distribution_strategy value; choose another name (replace a "
        "built-in strategy's behaviour with register_backend instead).")
  return _REGISTERED.setdefault(text, RegisteredKind(text))


def unregister_kind(name: str) -> None:
  """Forgets a kind `register_kind` added (tests); no error when unknown."""
  _REGISTERED.pop(str(name), None)


def names() -> tuple:
  """Every concrete kind's name: the built-in ones, then the registered."""
  return tuple(k.value for k in StrategyKind) + tuple(_REGISTERED)
