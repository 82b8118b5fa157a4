"""The frozen run configuration, read once by the run assembly: the root
config (`TrainConfig`), its composition of sections, the rules across
sections, and the flat names.

Flags are parsed only at the binary's edge (`flags/`, `tfdist/train.py`); they
become a `TrainConfig` once. The run assembly (`tfdist.experiment`) reads it
and hands each part below it (strategy, batch plan, learning rate, input
pipeline, training loop, artifacts) its own section(s), from which each part
builds its options (`StrategyOptions.of(config.strategy, decisions)`). A
`TrainConfig` can therefore be built and used without absl.

A `TrainConfig` is a tree of frozen sections, one per part of the run
(`task` with its `data`, `outputs`, `loop`, `strategy` with its `cluster`,
`parameter_servers`, `tpu` and `parallelism`, `precision`, `memory`,
`optimization` with its `learning_rate`, `reliability`, `cloud`), each
section's class in the module of its family beside this one
(`tfdist.config.task`, `.outputs`, `.loop`, `.strategy`, `.parallelism`,
`.precision`, `.memory`, `.optimization`, `.reliability`, `.cloud`). Each
setting is one field of its section, with the metadata its flag is
generated from (`tfdist.config_tree.setting`: flag type, group, help text,
choices); its name is the flag's. Adding a setting is adding that field
(and reading it where it is used). A part whose options are exactly one
section takes that section (`config.strategy.tpu` is the TPU part's
`TpuOptions`, `config.strategy.parameter_servers` its `PartitionerOptions`,
`config.optimization.learning_rate` the `LROptions`, `config.task.data`
the run plan's `DataOptions`).

The flat names (`config.train_steps`, `TrainConfig(train_steps=...)`,
`settings_with`, `flat_fields`) live here: they are the flags' and
`tfdist.fit`'s keywords.

Validation happens as the config is built, before any expensive work
starts: each section checks its own settings in `__post_init__`,
`TrainConfig._validate` the rules across sections; every error names the
flag, the bad value and the fix.
"""

import dataclasses
import inspect
import json
import types
from typing import Any, Dict, Mapping, Tuple

from tfdist import config_tree
from tfdist.config.cloud import CloudConfig
from tfdist.config.loop import LoopConfig
from tfdist.config.memory import MemoryConfig
from tfdist.config.optimization import OptimizationConfig
from tfdist.config.parallelism import check_expert_parallel
from tfdist.config.parallelism import check_pipeline
from tfdist.config.parallelism import check_tensor_parallel
from tfdist.config.outputs import OutputsConfig
from tfdist.config.outputs import require_model_dir
from tfdist.config.precision import PrecisionConfig
from tfdist.config.reliability import ReliabilityConfig
from tfdist.config.strategy import StrategyConfig
from tfdist.config.task import DEFAULT_DATASET
from tfdist.config.task import FEATURE_SPEC_DATASET
from tfdist.config.task import require_data_files
from tfdist.config.task import TaskConfig
from tfdist.config.values import DATASET_RECOMMENDED_FLAGS
from tfdist.config.values import _need
from tfdist.config.values import _set
from tfdist.config.values import UNSET_DEFAULTS
from tfdist.core import optimizers
from tfdist.core import reduce_dtype


@dataclasses.dataclass(frozen=True, init=False)
class TrainConfig:
  """Everything one training run needs, validated and immutable: a tree of
  sections, one per part of the run.

  `config.loop.train_steps` reads a setting in its section; each part is
  handed its own section. Every setting can also be read flat
  (`config.train_steps`, a read-only property), and the constructor and
  `replace` take flat keywords: `TrainConfig(model_dir=..., train_steps=...)`
  (a section object is accepted too: `TrainConfig(loop=LoopConfig(...))`).
  A setting's name is its flag's (`--train_steps`); `flat_fields()` lists
  them with their metadata (help text, choices). Units: steps are
  optimizer updates; batch sizes are examples; learning rates are per step.

  Settings left unset (None) are resolved here, before the sections are
  built: the data set's recommendation or the default (`unset_fields`),
  the defaults (`defaulted`; what depends on the hardware, a TPU's
  precision and steps per execution, is decided later, into
  `tfdist.distribute.decisions.Decisions`). Each section then validates its
  own settings as it is built, and `_validate` the rules across sections.

  Raises (on construction):
    TypeError: a keyword that is no setting, section or bookkeeping field.
    ConfigError: a setting is out of range or inconsistent with another;
      the message names the flag, the value and how to fix it.
  """
  task: TaskConfig = config_tree.section(TaskConfig)
  outputs: OutputsConfig = config_tree.section(OutputsConfig)
  loop: LoopConfig = config_tree.section(LoopConfig)
  strategy: StrategyConfig = config_tree.section(StrategyConfig)
  precision: PrecisionConfig = config_tree.section(PrecisionConfig)
  memory: MemoryConfig = config_tree.section(MemoryConfig)
  optimization: OptimizationConfig = config_tree.section(OptimizationConfig)
  reliability: ReliabilityConfig = config_tree.section(ReliabilityConfig)
  cloud: CloudConfig = config_tree.section(CloudConfig)
  # --- Bookkeeping (no flags) ---
  # The flags as given (`flags.flags_to_config`): (name, value) pairs.
  flags_snapshot: Tuple[Tuple[str, str], ...] = ()
  # Settings left unset (None) and filled with their default; the hardware
  # may still change those (bf16 and more steps per execution on TPU). Set
  # by the constructor, never by callers.
  defaulted: Tuple[str, ...] = ()
  # Settings left unset (None) and filled from the data set's
  # recommendation or the default (UNSET_DEFAULTS). Set by the
  # constructor, never by callers.
  unset_fields: Tuple[str, ...] = ()
  # The entries of the `keras.distribution.LayoutMap` that splits the
  # model (`tfdist.fit(layout_map=...)`, or the function `--layout_map`
  # names), as (key, layout) text pairs; () without one. Set when the map
  # is read (`tfdist.parallel.tensor.from_layout_map.config_changes`),
  # never by the flags: `--tensor_parallel` then splits a model of the
  # user's.
  layout_map_entries: Tuple[Tuple[str, str], ...] = ()

  def __init__(self, **given):
    values = _given_settings(given)
    _resolve_unset(values)
    for field in dataclasses.fields(self):
      if config_tree.is_section(field):
        _set(self, field.name,
             config_tree.build(field.metadata["section"], values))
    for name in _BOOKKEEPING:
      _set(self, name, values[name])
    self._validate()

  @property
  def recommended_applied(self) -> Tuple[Tuple[str, object], ...]:
    """`(field, value)` pairs the data set's recommendation filled in."""
    recommended = dict(DATASET_RECOMMENDED_FLAGS.get(self.dataset, ()))
    return tuple((name, getattr(self, name)) for name in self.unset_fields
                 if name in recommended and
                 getattr(self, name) == recommended[name])

  def require_model_dir(self):
    """Raises `ConfigError` when no output folder is known
    (`require_model_dir`)."""
    require_model_dir(self.model_dir)

  def require_data_files(self):
    """Raises `ConfigError` when `--feature_spec` has no files to read
    (`require_data_files`)."""
    require_data_files(self.feature_spec, self.train_files, self.eval_files,
                       self.mode)

  def check_decided(self, decided: Mapping[str, Any]) -> None:
    """Runs the config's rules that read a decidable setting on the values
    preparing a run decided (`tfdist.distribute.decisions.Decisions`):
    every rule across sections, with `decided`
    (`{flag name: value}`) read in place of the caller's settings. No copy
    of the config is made.

    Raises:
      ConfigError: a decided value breaks a rule (as the constructor's).
    """
    TrainConfig._validate(_DecidedView(self, decided))

  def _validate(self):
    """Runs every rule across sections in order; the first broken rule
    raises (each section's own rules ran as it was built)."""
    for validate in (self._validate_cluster, self._validate_vertex_ai,
                     self._validate_sharding,
                     self._validate_parallel_modes,
                     self._validate_experts_layout):
      validate()

  def _validate_cluster(self):
    """Gradient packs against ZeRO, and the all-reduce dtype."""
    if self.bytes_per_pack:
      _need(not self.zero_stage_resolved,
            f"--bytes_per_pack={self.bytes_per_pack} does not apply with "
            f"--zero_stage={self.zero_stage_resolved} (ZeRO all-reduces its "
            "flat gradient buffer in one collective, then slices it). Drop "
            "one of them.")
    reduce_dtype.check_config(self.all_reduce_dtype,
                              strategy=self.distribution_strategy,
                              dtype=self.dtype)

  def _validate_vertex_ai(self):
    """Vertex AI's Reduction Server: NCCL (its strategy is the backends'
    rule, `tfdist.backends.base.Backend.validate`)."""
    if self.reduction_server:
      _need(self.all_reduce_alg in ("auto", "nccl"),
            f"--reduction_server implies --all_reduce_alg=nccl; received "
            f"--all_reduce_alg={self.all_reduce_alg}. Drop --all_reduce_alg "
            "or set it to nccl.")

  def _validate_sharding(self):
    """ZeRO stages: consistent, under a strategy and optimizer that shard."""
    given = {name: getattr(self, name) for name in SHARDING_SWITCHES
             if name not in self.defaulted}
    said = " ".join(f"--{name}={value}" for name, value in given.items())
    _need(not (given.get("shard_gradients") and
               given.get("shard_optimizer_state") is False),
          f"{said} contradict each other: --shard_gradients (stage 2) "
          "shards the optimizer state too. Give --shard_gradients alone.")
    _need(not (given.get("shard_parameters") and False in (
               given.get("shard_gradients"),
               given.get("shard_optimizer_state"))),
          f"{said} contradict each other: --shard_parameters (stage 3) "
          "shards the optimizer state and gradients too. Give "
          "--shard_parameters alone.")
    if self.zero_stage is not None and given:
      # What each switch given says of the stage: True, the stage is at
      # least (optimizer state) or exactly (gradients) its own; False,
      # below it.
      agrees = {"shard_optimizer_state": lambda on: on == (
                    self.zero_stage >= 1),
                "shard_gradients": lambda on: on == (self.zero_stage >= 2),
                "shard_parameters": lambda on: on == (self.zero_stage == 3)}
      _need(all(agrees[name](on) for name, on in given.items()),
            f"--zero_stage={self.zero_stage} contradicts {said}. Give "
            "--zero_stage alone, or the switches alone (--shard_gradients "
            "implies stage 2, --shard_parameters stage 3).")
    stage = self.zero_stage_resolved
    if not stage:
      return
    # Under which strategies ZeRO runs is their backends' rule
    # (`tfdist.backends.base.Backend.validate`).
    traits = optimizers.optimizer_spec(self.optimizer).traits
    _need(traits.shardable,
          f"--optimizer={self.optimizer} cannot run with --zero_stage="
          f"{stage}: {traits.not_shardable_because}. Use --optimizer=adamw, "
          "or drop the flag.")
    _need(stage < 3 or not self.enable_xla,
          "--zero_stage=3 (--shard_parameters) and --enable_xla cannot be "
          "combined: stage 3 gathers the weights inside its own forward "
          "pass, which tfdist does not compile. Drop --enable_xla, or use "
          "--zero_stage=2.")
    # Keras embedding layers stay replicated at stage 3
    # (tfdist.parallel.zero3.replicated_variables); the ranking model's
    # tables are ShardedEmbedding's plain tf.Variables, which stage 3's
    # gathered weights cannot stand in for.
    _need(stage < 3 or self.model != "ranking",
          "--zero_stage=3 cannot train --model=ranking: its tables "
          "(ShardedEmbedding) are plain tf.Variables, outside the Keras "
          "variables stage 3 shards or keeps replicated. Use "
          "--distribution_strategy=parameter_server (it shards tables and "
          "sends only the rows used), or --zero_stage=2.")

  def _validate_parallel_modes(self):
    """The parallel modes' own checks across sections, in order: the
    pipeline, tensor parallelism, expert parallelism
    (`tfdist.config.parallelism`)."""
    check_pipeline(self)
    check_tensor_parallel(self)
    check_expert_parallel(self)

  def _validate_experts_layout(self):
    """The Transformer's experts (`--transformer_experts`) run data-parallel
    only: the pipelined step leaves out the router's `add_loss` losses, and
    the experts have no tensor-parallel form."""
    if not self.transformer_experts or self.model not in (None,
                                                          "transformer"):
      return
    for flag, value in (("pipeline_stages", self.pipeline_stages),
                        ("tensor_parallel", self.tensor_parallel)):
      _need(value <= 1,
            f"--transformer_experts={self.transformer_experts} cannot run "
            f"with --{flag}={value}: the experts' layers run data-parallel "
            "only (a pipeline would leave out their router losses; they "
            "have no tensor-parallel form). Drop one of the two.")

  @property
  def zero_stage_resolved(self) -> int:
    """The ZeRO stage (`MemoryConfig.zero_stage_resolved`)."""
    return self.memory.zero_stage_resolved

  # --- Derived paths (`OutputsConfig`) --------------------------------------
  @property
  def resolved_checkpoint_dir(self) -> str:
    return self.outputs.resolved_checkpoint_dir

  @property
  def resolved_tensorboard_dir(self) -> str:
    return self.outputs.resolved_tensorboard_dir

  @property
  def resolved_export_dir(self) -> str:
    return self.outputs.resolved_export_dir

  def flat(self) -> dict:
    """`{name: value}` of every setting and bookkeeping field (the keywords
    that rebuild this config)."""
    out = config_tree.flat_values(self)
    out.update((name, getattr(self, name)) for name in _BOOKKEEPING)
    return out

  def replace(self, **changes) -> "TrainConfig":
    """Returns a copy with `changes` (flat keywords) applied, validated
    again.

    Fields that were left unset stay unset unless changed, so a new
    `dataset` brings its own recommendations.

    Raises:
      TypeError: a keyword that is no setting.
      ConfigError: as the constructor.
    """
    reset = {name: None for name in self.defaulted + self.unset_fields
             if name not in changes}
    return TrainConfig(**{**self.flat(), **reset, **changes})

  def to_dict(self) -> dict:
    """A JSON-serializable dict of every setting and bookkeeping field, by
    flag name (flat, as the manifest and checkpoint metadata record it)."""
    out = self.flat()
    out["flags_snapshot"] = dict(self.flags_snapshot)
    return json.loads(json.dumps(out, default=str))


# The fields of a `TrainConfig` that are neither sections nor settings.
BOOKKEEPING_FIELDS = tuple(
    f.name for f in dataclasses.fields(TrainConfig)
    if not config_tree.is_section(f) and not config_tree.is_setting(f))
_BOOKKEEPING = BOOKKEEPING_FIELDS
_SECTION_NAMES = tuple(f.name for f in dataclasses.fields(TrainConfig)
                       if config_tree.is_section(f))
# Setting name -> (path of sections, field), in tree order.
_SETTINGS = {field.name: (path, field)
             for path, field in config_tree.settings(TrainConfig)}


def settings_with(trait: str) -> Tuple[str, ...]:
  """The names of the settings that state `trait` in their metadata
  (`tfdist.config_tree.TRAITS`), in tree order: the one source of every
  list of settings by trait (what a resume ignores, the paths a run
  checks, what the environment fills, ...).

  Raises:
    ValueError: `trait` is not in `tfdist.config_tree.TRAITS`.
  """
  return config_tree.with_trait(TrainConfig, trait)


# The ZeRO switches (`zero_stage` says the same in DeepSpeed's terms).
SHARDING_SWITCHES = settings_with("zero_switch")
# Fields a data set may recommend: None means "unset", filled in
# `TrainConfig.__init__` from DATASET_RECOMMENDED_FLAGS, else from
# UNSET_DEFAULTS (batch_size stays None: 128 unless --per_replica_batch_size
# is given, see tfdist.training.plan.batch_plan).
RECOMMENDABLE_FIELDS = settings_with("recommendable")


def flat_fields() -> Dict[str, dataclasses.Field]:
  """Every flat `TrainConfig` field by name: the settings in tree order (a
  flag each; their metadata: `tfdist.config_tree`), then the bookkeeping
  fields (no flags)."""
  fields = {name: field for name, (_, field) in _SETTINGS.items()}
  fields.update((f.name, f) for f in dataclasses.fields(TrainConfig)
                if f.name in _BOOKKEEPING)
  return fields


class _DecidedView:
  """A `TrainConfig` read with some settings' values replaced (`decided`,
  by flag name): what `TrainConfig.check_decided` runs the rules on. Its
  methods and properties run with the view as `self`."""

  def __init__(self, config: TrainConfig, decided: Mapping[str, Any]):
    self._config, self._decided = config, dict(decided)

  def __getattr__(self, name: str):
    if name in self._decided:
      return self._decided[name]
    attr = inspect.getattr_static(TrainConfig, name, None)
    if name not in _SETTINGS and isinstance(attr, property):
      return attr.fget(self)
    if inspect.isfunction(attr):
      return types.MethodType(attr, self)
    return getattr(self._config, name)


def section_of(name: str) -> Tuple[str, ...]:
  """The path of sections holding setting `name`, e.g. `("loop",)`.

  Raises:
    KeyError: `name` is no setting.
  """
  return _SETTINGS[name][0]


def _given_settings(given: dict) -> dict:
  """The flat values `TrainConfig(**given)` starts from: every setting's
  default, then the sections given, then the flat keywords given (which
  win, so `dataclasses.replace(config, train_steps=5)` works as
  `config.replace(train_steps=5)` does, short of keeping unset settings
  unset).

  Raises:
    TypeError: a keyword that is no setting, section or bookkeeping field.
  """
  values = {name: field.default for name, (_, field) in _SETTINGS.items()}
  values.update((name, ()) for name in _BOOKKEEPING)
  for name in given:
    if name not in values and name not in _SECTION_NAMES:
      raise TypeError(
          f"TrainConfig.__init__() got an unexpected keyword argument "
          f"'{name}'")
  for name in _SECTION_NAMES:
    if given.get(name) is None:
      continue
    # A section resolves nothing itself: its None is unset, as a flat one.
    values.update(config_tree.flat_values(given[name]))
  values.update((k, v) for k, v in given.items() if k not in _SECTION_NAMES)
  return values


def _resolve_unset(values: dict) -> None:
  """Fills the settings left unset (None) in `values`, in place: their
  defaults (`defaulted`: the decisions give a TPU its own,
  `tfdist.distribute.decisions`), the sharding switches, the data set and
  its recommendations (`unset_fields`). Nothing here depends on the
  hardware or the strategy."""
  defaulted = []
  for name, default in (("dtype", "fp32"), ("steps_per_execution", 1)):
    if values[name] is None:
      values[name] = default
      defaulted.append(name)
  for name in SHARDING_SWITCHES:
    if values[name] is None:
      values[name] = False
      defaulted.append(name)
  values["defaulted"] = tuple(sorted(defaulted))
  dataset_unset = values["dataset"] is None
  if dataset_unset:
    values["dataset"] = (FEATURE_SPEC_DATASET if values["feature_spec"] else
                         DEFAULT_DATASET)
  # Settings the caller left unset: the data set's recommendation, else
  # the default. Flags and settings the caller set always win.
  recommended = dict(DATASET_RECOMMENDED_FLAGS.get(values["dataset"], ()))
  if values["per_replica_batch_size"] is not None:
    recommended.pop("batch_size", None)
  unset = []
  for name in RECOMMENDABLE_FIELDS:
    if values[name] is None:
      value = recommended.get(name, UNSET_DEFAULTS.get(name))
      if value is not None or name in recommended:
        unset.append(name)
      values[name] = value
  if dataset_unset:
    unset.append("dataset")
  values["unset_fields"] = tuple(sorted(unset))
  values["flags_snapshot"] = tuple(tuple(kv)
                                   for kv in values["flags_snapshot"])
  values["layout_map_entries"] = tuple(
      tuple(kv) for kv in values["layout_map_entries"])


def _install_flat_reads() -> None:
  """A read-only property on `TrainConfig` for every setting
  (`config.train_steps` reads `config.loop.train_steps`)."""
  for name, (path, field) in _SETTINGS.items():
    if hasattr(TrainConfig, name):
      raise TypeError(f"setting {name!r} would hide TrainConfig.{name}")
    doc = f"`{'.'.join(path + (name,))}` (flat read)."
    setattr(TrainConfig, name,
            property(config_tree.flat_getter(path, name), doc=doc))


_install_flat_reads()
