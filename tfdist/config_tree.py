"""The machinery of a config tree: frozen sections of settings.

A section is a frozen dataclass whose fields are settings (`setting`: a
default and the metadata a command-line flag is generated from) or other
sections (`section`). A setting's name is unique across the whole tree and
is its flag's name, so a tree can be built from, and read as, one flat
`{name: value}` mapping (`settings`, `build`, `flat_values`):
`tfdist.config.TrainConfig` is such a tree, `flags.definitions` defines its
flags from the metadata.

Metadata keys of a setting (all read by `flags.definitions`):
  flag: the absl flag type: "string", "integer", "float", "bool", "enum"
    or "list".
  group: the flag group (`flags.definitions.GROUPS`) the flag is listed in.
  help: its help text, or a function returning it (called when the flags
    are defined, for text that names registered optimizers, say).
  choices: an enum's values: a sequence, or a function returning one.
  key: whether the flag is a key flag (`--helpshort` lists it).
  case_sensitive: an enum's matching (default True).
  alias: another flag name for the same setting, or None.
"""

import dataclasses
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple

FLAG_TYPES = ("string", "integer", "float", "bool", "enum", "list")


def setting(default: Any, flag: str, group: str, *,
            help: Any,  # pylint: disable=redefined-builtin
            choices: Any = None, key: bool = False,
            case_sensitive: bool = True,
            alias: Optional[str] = None) -> Any:
  """A dataclass field for one setting, with the metadata of its flag.

  Args:
    default: the field's default (immutable: a tuple for a list).
    flag: the absl flag type, one of `FLAG_TYPES`.
    group: the flag group's name.
    help: the help text (str), or a function of no arguments returning it.
    choices: an enum's values, or a function returning them.
    key: a key flag of its group.
    case_sensitive: an enum's matching.
    alias: another flag name for the setting.

  Returns:
    A `dataclasses.Field`.

  Raises:
    ValueError: `flag` is not one of `FLAG_TYPES`, or an enum without
      choices.
  """
  if flag not in FLAG_TYPES or (flag == "enum") != (choices is not None):
    raise ValueError(f"setting(flag={flag!r}, choices={choices!r}): flag "
                     f"must be one of {', '.join(FLAG_TYPES)}, with choices "
                     "exactly when it is 'enum'.")
  return dataclasses.field(default=default, metadata={
      "flag": flag, "group": group, "help": help, "choices": choices,
      "key": key, "case_sensitive": case_sensitive, "alias": alias})


def section(cls: type) -> Any:
  """A dataclass field holding a sub-section of class `cls` (defaults)."""
  return dataclasses.field(default_factory=cls, metadata={"section": cls})


def is_section(field: dataclasses.Field) -> bool:
  return "section" in field.metadata


def is_setting(field: dataclasses.Field) -> bool:
  return "flag" in field.metadata


def resolve(value: Any) -> Any:
  """A metadata value, called first when it is a function (help, choices)."""
  return value() if callable(value) else value


def settings(cls: type, path: Tuple[str, ...] = ()
             ) -> Iterator[Tuple[Tuple[str, ...], dataclasses.Field]]:
  """`(path, field)` of every setting below section class `cls`, in tree
  order (a section's own fields in order, sub-sections where they stand);
  `path` names the sections leading to the setting."""
  for field in dataclasses.fields(cls):
    if is_section(field):
      yield from settings(field.metadata["section"], path + (field.name,))
    elif is_setting(field):
      yield path, field


def build(cls: type, values: Mapping[str, Any]) -> Any:
  """A section of class `cls` holding `values` (by setting name), its
  sub-sections built the same way; settings not in `values` keep their
  default. Each section validates itself as it is built."""
  kwargs = {}
  for field in dataclasses.fields(cls):
    if is_section(field):
      kwargs[field.name] = build(field.metadata["section"], values)
    elif is_setting(field) and field.name in values:
      kwargs[field.name] = values[field.name]
  return cls(**kwargs)


def flat_values(node: Any) -> Dict[str, Any]:
  """`{setting name: value}` of every setting in the tree under `node`."""
  out = {}
  for field in dataclasses.fields(node):
    value = getattr(node, field.name)
    if is_section(field):
      out.update(flat_values(value))
    elif is_setting(field):
      out[field.name] = value
  return out


def flat_getter(path: Tuple[str, ...], name: str) -> Callable[[Any], Any]:
  """A function reading setting `name` at `path` below a tree's root."""
  def get(root):
    node = root
    for part in path:
      node = getattr(node, part)
    return getattr(node, name)
  return get
