"""The flags of `tfdist.train`, generated from `tfdist.config`'s settings.

Each setting of the config tree (`tfdist.config.TrainConfig`) is one
dataclass field whose metadata (`tfdist.config_tree.setting`) gives its flag
type, group, help text and choices; the flag has the setting's name and
default. The `define_*` functions define one group each, in the order of
the tree, so a new setting is one field. Names follow TensorFlow Model
Garden where it has one (`--model_dir`, `--batch_size` (global),
`--train_epochs`, `--distribution_strategy`, `--num_gpus`,
`--all_reduce_alg`, `--dtype`, `--loss_scale`, `--log_steps`,
`--enable_xla`, `--run_eagerly`, `--export_dir`, `--epochs_between_evals`).
"""

from typing import List

from absl import flags

from tfdist import config_tree
from tfdist import errors
from tfdist import config as config_lib

FLAGS = flags.FLAGS
_DEFAULTS = config_lib.flat_fields()


def _loss_scale_parses(value) -> bool:
  try:
    config_lib.parse_loss_scale(value)
    return True
  except errors.ConfigError:
    return False


# Checks absl runs when a flag is parsed (a bad value is a usage error, exit
# status 2), before the config's own validation: {flag: (message, check)}.
_PARSE_CHECKS = {
    "loss_scale": ("--loss_scale must be 'dynamic' or a positive number.",
                   _loss_scale_parses),
    "tpu_init_timeout": ("--tpu_init_timeout must be > 0.",
                         lambda value: value > 0),
    "task_index": ("--task_index must be >= 0, or -1 (unset).",
                   lambda value: value is None or value >= -1),
    "lease_timeout_seconds": ("--lease_timeout_seconds must be > 0.",
                              lambda value: value > 0),
}


def _flag_default(field):
  """A field's default as its flag's: a list flag's items as strings
  (`(id, weight)` pairs as `ID:WEIGHT`)."""
  if field.metadata["flag"] != "list":
    return field.default
  return [":".join(map(str, item)) if isinstance(item, tuple) else str(item)
          for item in field.default]


def _define_setting(name: str, field,
                    flag_values: flags.FlagValues = FLAGS) -> None:
  """Defines the flag of setting `name` from its field's metadata
  (`tfdist.config_tree.setting`) in `flag_values`.

  Raises:
    absl.flags.DuplicateFlagError: the flag is defined already.
  """
  meta = field.metadata
  kind, default = meta["flag"], _flag_default(field)
  text = config_tree.resolve(meta["help"])
  if kind == "enum":
    extra = {} if meta["case_sensitive"] else {"case_sensitive": False}
    flags.DEFINE_enum(name, default,
                      list(config_tree.resolve(meta["choices"])), text,
                      flag_values=flag_values, **extra)
  else:
    define = {"string": flags.DEFINE_string, "integer": flags.DEFINE_integer,
              "float": flags.DEFINE_float, "bool": flags.DEFINE_bool,
              "list": flags.DEFINE_list}[kind]
    define(name, default, text, flag_values=flag_values)
  if meta["alias"]:
    flags.DEFINE_alias(meta["alias"], name, flag_values=flag_values)
  if name in _PARSE_CHECKS:
    message, check = _PARSE_CHECKS[name]
    flags.register_validator(name, check, message, flag_values=flag_values)


def _define_group(group: str) -> List[str]:
  """Defines the flags of every setting in `group`, in the tree's order.

  Returns:
    The names of the group's key flags (absl's `--helpshort` lists them).
  """
  keys = []
  for name, field in _DEFAULTS.items():
    if field.metadata.get("group") == group:
      _define_setting(name, field)
      if field.metadata["key"]:
        keys.append(name)
  return keys


def define_base_flags() -> List[str]:
  """Model, data and output locations.

  Returns:
    The names of the group's key flags (absl's `--helpshort` lists them).
  """
  return _define_group("base")


def define_train_flags() -> List[str]:
  """Length of training, batch, logging, checkpoints."""
  return _define_group("train")


def define_distribution_flags() -> List[str]:
  """Strategy and devices."""
  return _define_group("distribution")


def define_performance_flags() -> List[str]:
  """Precision, XLA, steps per execution, memory levers and step guards.

  Returns:
    The names of the group's key flags (absl's `--helpshort` lists them).
  """
  return _define_group("performance")


def define_pipeline_flags() -> List[str]:
  """Pipeline parallelism: the model's layers cut into stages on devices."""
  return _define_group("pipeline")


def define_tpu_flags() -> List[str]:
  """TPU address and initialization (Model Garden's names)."""
  return _define_group("tpu")


def define_lr_flags() -> List[str]:
  """Optimizer, learning-rate scaling, warmup and schedule."""
  return _define_group("lr")


def define_cluster_flags() -> List[str]:
  """Multi-worker cluster, collective timeouts and preemption.

  The cluster comes from the first source present: --worker_hosts (with
  --task_index), TF_CONFIG, Vertex AI's CLUSTER_SPEC (see
  tfdist/distribute/cluster.py).
  """
  return _define_group("cluster")


def define_vertex_flags() -> List[str]:
  """Vertex AI: Reduction Server and hyperparameter tuning."""
  return _define_group("vertex")


def define_measure_flags() -> List[str]:
  """Measurement: the profiler window."""
  return _define_group("measure")


def define_reliability_flags() -> List[str]:
  """Divergence, the --model_dir lease, resumption and dry runs."""
  return _define_group("reliability")


# Every group `tfdist.train` uses, in order (the flags reference,
# docs/reference/flags.md, is generated from them: tfdist.flags.reference).
GROUPS = (define_base_flags, define_train_flags, define_distribution_flags,
          define_cluster_flags, define_performance_flags, define_tpu_flags,
          define_lr_flags, define_pipeline_flags, define_vertex_flags,
          define_measure_flags, define_reliability_flags)


def define_all_flags() -> List[str]:
  """Defines every group `tfdist.train` uses; returns the key flag names."""
  names = []
  for define in GROUPS:
    names += define()
  return names


# TrainConfig fields that have no flag: set by the library itself, or only
# by library callers. Every other field has a flag of the same name
# (tests/flags_test.py checks both ways).
LIBRARY_ONLY_FIELDS = config_lib.BOOKKEEPING_FIELDS


def config_flag_names() -> List[str]:
  """The flags that map to `TrainConfig` fields (same names), sorted."""
  return sorted(name for name in _DEFAULTS if name not in LIBRARY_ONLY_FIELDS)


def flags_to_config(flag_values=FLAGS) -> config_lib.TrainConfig:
  """Reads parsed flags once into a frozen `TrainConfig`.

  Only flags that were given (on the command line, in a --flagfile, or set
  in code to a value other than their default) are passed, so the config's
  own defaults and the data set's recommendations fill the rest
  (`TrainConfig.unset_fields`), exactly as for library callers.

  Raises:
    tfdist.errors.ConfigError: invalid or inconsistent values.
  """
  kwargs, snapshot = {}, []
  for name in config_flag_names():
    if name not in flag_values:
      continue
    flag = flag_values[name]
    snapshot.append((name, str(flag.value)))
    if flag.present or flag.value != flag.default:
      kwargs[name] = flag.value
  config = config_lib.TrainConfig(**kwargs)
  if config.recommended_applied:
    # The snapshot records the values that took effect.
    applied = dict(config.recommended_applied)
    snapshot = [(n, str(applied[n]) if n in applied else v)
                for n, v in snapshot]
  return config.replace(flags_snapshot=tuple(sorted(snapshot)))
