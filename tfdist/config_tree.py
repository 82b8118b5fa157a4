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
  traits: what else is true of the setting, a tuple of `TRAITS` names
    (`()`: nothing); None: not stated (`tests/config_test.py` fails on
    such a setting). The lists of settings other modules keep (what a
    resume ignores, the paths a run checks, what the environment fills)
    are derived from them (`with_trait`), never written by hand.
"""

import dataclasses
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple

FLAG_TYPES = ("string", "integer", "float", "bool", "enum", "list")

# The traits a setting may state, each with what it means and who reads it.
TRAITS = {
    "operational": (
        "does not change what is trained (paths, logging, cluster plumbing, "
        "timeouts, how the work is laid out over devices): a resume with "
        "another value is not reported (tfdist.training.state.checkpointing)"),
    "model": (
        "defines the model: a checkpoint of one does not fit another "
        "(tfdist.training.state.checkpointing.check_resume)"),
    "multi_replica": (
        "applies only to several replicas or devices, a cluster or another "
        "strategy: the diagnose one-device baseline drops it"),
    "path": (
        "names paths the run reads or writes (tfdist.data.filesystems "
        "checks their file systems)"),
    "folder": "a folder (a local one is made absolute by tfdist.ray)",
    "files": "comma-separated file patterns (tfdist.ray makes them absolute)",
    "output_folder": (
        "an output folder of the run: a tuning trial nests it, Ray Tune "
        "trials may not share it (tfdist.distribute.environment, tfdist.ray)"),
    "from_environment": (
        "filled from the environment when unset (Vertex AI's variables, "
        "$TPU_NAME: tfdist.distribute.environment)"),
    "decided": (
        "preparing a run may decide it (auto, the environment, a tuning "
        "trial): read it from tfdist.distribute.decisions.Decisions"),
    "recommendable": (
        "None means unset, filled from the data set's recommendation or "
        "the default (tfdist.config.DATASET_RECOMMENDED_FLAGS)"),
    "zero_switch": (
        "a ZeRO switch (None: unset), which --zero_stage says in "
        "DeepSpeed's terms"),
    "cluster_given": (
        "the launcher or the cluster gives it: a Ray Tune trial may not "
        "set it (tfdist.ray)"),
}


def setting(default: Any, flag: str, group: str, *,
            help: Any,  # pylint: disable=redefined-builtin
            choices: Any = None, key: bool = False,
            case_sensitive: bool = True,
            alias: Optional[str] = None,
            traits: Optional[Tuple[str, ...]] = None) -> Any:
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
    traits: the setting's traits (names in `TRAITS`; `()`: none); None
      leaves them unstated, which `tests/config_test.py` refuses.

  Returns:
    A `dataclasses.Field`.

  Raises:
    ValueError: `flag` is not one of `FLAG_TYPES`, an enum without
      choices, or a trait that is not in `TRAITS`.
  """
  if flag not in FLAG_TYPES or (flag == "enum") != (choices is not None):
    raise ValueError(f"setting(flag={flag!r}, choices={choices!r}): flag "
                     f"must be one of {', '.join(FLAG_TYPES)}, with choices "
                     "exactly when it is 'enum'.")
  unknown = [t for t in traits or () if t not in TRAITS]
  if unknown or isinstance(traits, str):
    raise ValueError(f"setting(traits={traits!r}): a tuple of trait names, "
                     f"each one of {', '.join(TRAITS)}.")
  return dataclasses.field(default=default, metadata={
      "flag": flag, "group": group, "help": help, "choices": choices,
      "key": key, "case_sensitive": case_sensitive, "alias": alias,
      "traits": None if traits is None else tuple(traits)})


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


def traits_of(field: dataclasses.Field) -> Optional[Tuple[str, ...]]:
  """The traits a setting states (None: it states none)."""
  return field.metadata.get("traits")


def with_trait(cls: type, trait: str) -> Tuple[str, ...]:
  """The names of the settings below section class `cls` that state
  `trait`, in tree order.

  Raises:
    ValueError: `trait` is not in `TRAITS`.
  """
  if trait not in TRAITS:
    raise ValueError(f"trait {trait!r} is none of {', '.join(TRAITS)}.")
  return tuple(field.name for _, field in settings(cls)
               if trait in (traits_of(field) or ()))


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
