"""What preparing a run decides, kept beside the config: `Decisions`.

A `tfdist.config.TrainConfig` holds what the caller asked for (flags, a
`tfdist.fit` call); `tfdist.experiment.prepare.prepare_run` decides the rest
into one frozen `Decisions`, never written back into the config: typed
records, each built by a pure function of the config's sections, the
environment's changes, the cluster and `auto`'s choice from the device
inventory (`tfdist.distribute.auto_select.resolve`):

  * the strategy: `auto_select.Decision` (`choice`);
  * the precision: `decide_precision` -> `PrecisionDecision`;
  * the TPU: `decide_tpu` -> `TpuDecision` (its address, its steps per
    execution: the one place a TPU's default is applied);
  * the folders: `decide_folders` -> `Folders` (the environment's, a tuning
    trial's, the defaults under `--model_dir`);
  * the data files: `decide_data` -> `DataFiles`.

The parts read a decided value from it (`StrategyOptions.of(config.strategy,
decisions)`, ...) and the caller's settings from the config. The records
map to flag names in one place, `Decisions.field_values` (the run record,
the manifest).
"""

import dataclasses
from typing import Mapping, Optional, Tuple

from absl import logging

from tfdist import config as config_lib
from tfdist.distribute import auto_select
from tfdist.distribute import environment as environment_lib
from tfdist.core.strategy_kind import StrategyKind

# The settings whose values preparing a run decides (from the environment,
# a tuning trial, `auto`): `Decisions` holds them; the config keeps what
# the caller gave.
DECIDED_FIELDS = config_lib.settings_with("decided")
# Steps per `tf.function` call on a TPU when --steps_per_execution is not
# given (`decide_tpu`).
TPU_DEFAULT_STEPS_PER_EXECUTION = config_lib.TPU_DEFAULT_STEPS_PER_EXECUTION


@dataclasses.dataclass(frozen=True)
class PrecisionDecision:
  """The precision that runs.

  Attributes:
    dtype: `fp32`, `bf16` or `fp16` (never `auto`).
    loss_scale: `--loss_scale` under fp16 (None, 'dynamic' or a float > 0),
      else None.
  """
  dtype: str
  loss_scale: object = None


@dataclasses.dataclass(frozen=True)
class TpuDecision:
  """The TPU's address and the steps per `tf.function` call.

  Attributes:
    address: `--tpu`, `$TPU_NAME`, or what `auto` found; '' for none.
    steps_per_execution: `--steps_per_execution`, or a TPU's default
      (`TPU_DEFAULT_STEPS_PER_EXECUTION`) when it was not given.
  """
  address: str = ""
  steps_per_execution: int = 1


@dataclasses.dataclass(frozen=True)
class Folders:
  """The run's output folders, as set (by a flag, the environment or a
  tuning trial; '' when left to the default under `model_dir`).

  Attributes:
    model_dir, checkpoint_dir, tensorboard_dir, export_dir: as set.
  """
  model_dir: str = ""
  checkpoint_dir: str = ""
  tensorboard_dir: str = ""
  export_dir: str = ""

  def resolved(self, name: str) -> str:
    """The folder the run writes for `name` (its default when unset:
    `tfdist.config.resolve_folder`)."""
    if name == "model_dir":
      return self.model_dir
    return config_lib.resolve_folder(name, getattr(self, name),
                                     self.model_dir)

  def sources(self, filled: Tuple[Tuple[str, str], ...] = ()) -> dict:
    """Each output folder with the flag or variable that chose it
    (`tfdist.distribute.environment.folder_sources`; `filled`: the
    `(field, variable)` pairs the environment filled)."""
    return environment_lib.folder_sources(
        dataclasses.asdict(self),
        {f.name: self.resolved(f.name) for f in dataclasses.fields(self)},
        filled)


@dataclasses.dataclass(frozen=True)
class DataFiles:
  """The data the run reads.

  Attributes:
    train_files, eval_files: TFRecord file patterns, comma-separated
      (flags, or Vertex AI's `$AIP_TRAINING_DATA_URI` /
      `$AIP_VALIDATION_DATA_URI`).
    data_dir: where built-in data sets are read (flag or default).
  """
  train_files: str = ""
  eval_files: str = ""
  data_dir: str = ""


def choice_of(config) -> auto_select.Decision:
  """`auto_select.Decision` of a config naming its strategy and dtype
  itself (callers that build the parts without `prepare_run`: tests,
  `diagnose`); a TPU's dtype default applies when `--dtype` was not given.

  Raises:
    tfdist.errors.ConfigError: the config still says `auto`
      (`tfdist.config.refuse_auto`).
  """
  name = config.strategy.distribution_strategy
  config_lib.refuse_auto(name, config.precision.dtype)
  kind = StrategyKind.parse(name)
  dtype = config.precision.dtype
  if kind is StrategyKind.TPU and "dtype" in config.defaulted:
    dtype = "bf16"
  return auto_select.Decision(
      strategy=kind, strategy_reason="--distribution_strategy",
      dtype=dtype, dtype_reason="--dtype", tpu=config.strategy.tpu.tpu)


def decide_precision(choice: auto_select.Decision,
                     precision) -> PrecisionDecision:
  """The precision `choice` decided, with the precision section's loss
  scale (`tfdist.config.PrecisionConfig`): a `--loss_scale` outside fp16
  (given with `--dtype=auto`) is dropped, with a warning."""
  loss_scale = precision.loss_scale
  if choice.dtype != "fp16" and loss_scale is not None:
    logging.warning("--loss_scale=%s ignored: precision is %s (%s), not fp16.",
                    loss_scale, choice.dtype, choice.dtype_reason)
    loss_scale = None
  return PrecisionDecision(dtype=choice.dtype, loss_scale=loss_scale)


def decide_tpu(choice: auto_select.Decision, *, tpu: str,
               steps_per_execution: int,
               steps_per_execution_defaulted: bool) -> TpuDecision:
  """The TPU's address and the steps per execution.

  The one TPU steps rule: with a TPU strategy, an unset
  `--steps_per_execution` becomes `TPU_DEFAULT_STEPS_PER_EXECUTION` (each
  call is a host -> TPU round trip); an explicit 1 is kept, with a
  warning.

  Args:
    choice: the strategy decision.
    tpu: `--tpu`, or `$TPU_NAME` ('' takes the address `auto` found).
    steps_per_execution: `--steps_per_execution` as given or defaulted.
    steps_per_execution_defaulted: it was not given.
  """
  address = tpu or choice.tpu
  if choice.strategy is StrategyKind.TPU:
    if steps_per_execution_defaulted:
      steps_per_execution = TPU_DEFAULT_STEPS_PER_EXECUTION
    elif steps_per_execution == 1:
      logging.warning(
          "--steps_per_execution=1 on a TPU: every step is a host -> TPU "
          "round trip. Leave the flag unset (default %d) unless debugging.",
          TPU_DEFAULT_STEPS_PER_EXECUTION)
  return TpuDecision(address=address, steps_per_execution=steps_per_execution)


def decide_folders(outputs, changes: Mapping[str, str] = None) -> Folders:
  """The output folders: the outputs section's
  (`tfdist.config.OutputsConfig`), with `changes` (`{field: folder}`: the
  environment's, then a tuning trial's) in place."""
  changes = changes or {}
  return Folders(**{f.name: changes.get(f.name, getattr(outputs, f.name))
                    for f in dataclasses.fields(Folders)})


def decide_data(data, changes: Mapping[str, str] = None) -> DataFiles:
  """The data files and folder: the data section's
  (`tfdist.config.DataConfig`), with the environment's `changes`."""
  changes = changes or {}
  return DataFiles(**{f.name: changes.get(f.name, getattr(data, f.name))
                      for f in dataclasses.fields(DataFiles)})


@dataclasses.dataclass(frozen=True)
class Decisions:
  """What preparing a run decided, beside the caller's `TrainConfig` and
  never written into it (`prepare_run`): typed records.

  Attributes:
    choice: `auto`'s `tfdist.distribute.auto_select.Decision` (strategy,
      dtype and why).
    precision: the `PrecisionDecision`.
    accelerator: the `TpuDecision` (its address, the steps per execution).
    folders: the `Folders` as set.
    data: the `DataFiles`.
    environment_applied: the `(field, variable)` pairs the environment
      filled.
    trial_fields: the folder fields given a tuning trial's subfolder.

  The properties read one decided value each: `strategy` (a
  `StrategyKind`, never `auto`), `dtype`, `loss_scale`, `tpu`,
  `steps_per_execution`, `model_dir`, `checkpoint_dir`,
  `tensorboard_dir` and `export_dir` (the folders the run writes, defaults
  resolved), `train_files`, `eval_files`, `data_dir`.
  """
  choice: auto_select.Decision
  precision: PrecisionDecision
  accelerator: TpuDecision
  folders: Folders
  data: DataFiles
  environment_applied: Tuple[Tuple[str, str], ...] = ()
  trial_fields: Tuple[str, ...] = ()

  @classmethod
  def of(cls, config, *, choice: Optional[auto_select.Decision] = None,
         changes: Optional[Mapping[str, str]] = None,
         environment_applied=(), trial_fields=()) -> "Decisions":
    """The decisions for `config`, with `auto`'s `choice` and the
    environment's and a trial's `changes` applied, each by its pure
    function; the config's rules then run on the decided values
    (`TrainConfig.check_decided`: no copy of the config is made).

    Args:
      config: the caller's `tfdist.config.TrainConfig`.
      choice: `auto`'s decision (`auto_select.resolve`). None: `config`
        names its strategy and dtype itself (`choice_of`).
      changes: `{field: value}` the environment
        (`environment.environment_changes`) and a tuning trial
        (`environment.trial_changes`) set, a trial's last.
      environment_applied, trial_fields: as the attributes.

    Raises:
      tfdist.errors.ConfigError: `choice` None and `config` still says
        `auto`; a rule of the config the decided values break. The
        strategy's own rules (fp16 on a TPU, `--reduction_server`, ...)
        are its backend's (`tfdist.backends.base.Backend.validate`).
    """
    changes = dict(changes or {})
    if choice is None:
      choice = choice_of(config)
    decisions = cls(
        choice=choice,
        precision=decide_precision(choice, config.precision),
        accelerator=decide_tpu(
            choice, tpu=changes.get("tpu", config.strategy.tpu.tpu),
            steps_per_execution=config.loop.steps_per_execution,
            steps_per_execution_defaulted=(
                "steps_per_execution" in config.defaulted)),
        folders=decide_folders(config.outputs, changes),
        data=decide_data(config.task.data, changes),
        environment_applied=tuple(environment_applied),
        trial_fields=tuple(trial_fields))
    config.check_decided(decisions.field_values())
    return decisions

  # --- One decided value each ------------------------------------------------
  @property
  def strategy(self) -> StrategyKind:
    return self.choice.strategy

  @property
  def dtype(self) -> str:
    return self.precision.dtype

  @property
  def loss_scale(self):
    return self.precision.loss_scale

  @property
  def tpu(self) -> str:
    return self.accelerator.address

  @property
  def steps_per_execution(self) -> int:
    return self.accelerator.steps_per_execution

  @property
  def model_dir(self) -> str:
    return self.folders.model_dir

  @property
  def checkpoint_dir(self) -> str:
    return self.folders.resolved("checkpoint_dir")

  @property
  def tensorboard_dir(self) -> str:
    return self.folders.resolved("tensorboard_dir")

  @property
  def export_dir(self) -> str:
    return self.folders.resolved("export_dir")

  @property
  def train_files(self) -> str:
    return self.data.train_files

  @property
  def eval_files(self) -> str:
    return self.data.eval_files

  @property
  def data_dir(self) -> str:
    return self.data.data_dir

  def field_values(self) -> dict:
    """`{flag name: value}` of the `DECIDED_FIELDS` as flag values (a
    folder left to its default under `model_dir` stays ''), for the
    records that list a run's settings by flag name (the run record, the
    manifest): the one mapping from the records to flag names."""
    values = {"distribution_strategy": self.strategy.value,
              "dtype": self.dtype, "loss_scale": self.loss_scale,
              "tpu": self.tpu,
              "steps_per_execution": self.steps_per_execution,
              **dataclasses.asdict(self.folders),
              **dataclasses.asdict(self.data)}
    return {name: values[name] for name in DECIDED_FIELDS}

  def output_sources(self) -> dict:
    """Each output folder with the flag or variable that chose it
    (`Folders.sources`)."""
    return self.folders.sources(self.environment_applied)
