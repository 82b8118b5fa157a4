"""What preparing a run decides, kept beside the config: `Decisions`.

A `tfdist.config.TrainConfig` holds what the caller asked for (flags, a
`tfdist.fit` call); `tfdist.experiment.prepare.prepare_run` decides the rest
(`auto`'s strategy and dtype, the folders and data files Vertex AI's
variables fill, a tuning trial's folders) into one frozen `Decisions`,
never written back into the config. The parts read a decided value from
it (`StrategyOptions.of(config.strategy, decisions)`, ...) and the caller's
settings from the config.
"""

import dataclasses
from typing import Optional, Tuple

from tfdist import config as config_lib
from tfdist import errors
from tfdist.distribute import auto_select
from tfdist.distribute import environment as environment_lib
from tfdist.distribute.strategy_kind import StrategyKind

# The fields of a `TrainConfig` whose values preparing a run decides (from
# the environment, a tuning trial, `auto`): `Decisions` holds them; the
# config keeps what the caller gave.
DECIDED_FIELDS = config_lib.settings_with("decided")


@dataclasses.dataclass(frozen=True)
class Decisions:
  """What preparing a run decided, beside the caller's `TrainConfig` and
  never written into it (`prepare_run`).

  Attributes:
    choice: `auto`'s `tfdist.distribute.auto_select.Decision` (strategy,
      dtype and why).
    strategy: the strategy that runs (a `StrategyKind`, never `auto`).
    dtype: `fp32`, `bf16` or `fp16` (never `auto`).
    tpu: the TPU address (`--tpu`, `$TPU_NAME`, or what `auto` found), or ''.
    loss_scale: `--loss_scale` under fp16, else None.
    steps_per_execution: steps per `tf.function` call (a TPU's default
      when `--steps_per_execution` was not given).
    model_dir: the run's folder (`--model_dir`, Vertex AI's
      `$AIP_CHECKPOINT_DIR`/`$AIP_MODEL_DIR`, a tuning trial's subfolder).
    checkpoint_dir, tensorboard_dir, export_dir: the folders the run
      writes (given, from the environment, or their defaults under
      `model_dir`), each a tuning trial's own.
    train_files, eval_files: the TFRecord paths (flags or Vertex AI's
      `$AIP_TRAINING_DATA_URI`/`$AIP_VALIDATION_DATA_URI`), comma-separated
      file patterns.
    data_dir: where built-in data sets are read (flag or default).
    environment_applied: the `(field, variable)` pairs the environment
      filled.
    trial_fields: the folder fields given a tuning trial's subfolder.
    values: `(field, value)` of the `DECIDED_FIELDS` as flag values (a
      folder left to its default under `model_dir` stays unset).
  """
  choice: auto_select.Decision
  strategy: StrategyKind
  dtype: str
  tpu: str
  loss_scale: object
  steps_per_execution: int
  model_dir: str
  checkpoint_dir: str
  tensorboard_dir: str
  export_dir: str
  train_files: str
  eval_files: str
  data_dir: str
  environment_applied: Tuple[Tuple[str, str], ...] = ()
  trial_fields: Tuple[str, ...] = ()
  values: Tuple[Tuple[str, object], ...] = ()

  @classmethod
  def of(cls, config, *, choice: Optional[auto_select.Decision] = None,
         environment_applied=(), trial_fields=()) -> "Decisions":
    """The decisions for `config`, with `auto`'s `choice` applied.

    Args:
      config: a `tfdist.config.TrainConfig` with the environment's and a
        tuning trial's folders set (`prepare_run` makes this copy only to
        validate and normalize them, then drops it).
      choice: `auto`'s decision (`auto_select.resolve`): its strategy and
        dtype, its TPU address, and what follows from them
        (`auto_select.decision_changes`: a TPU's steps per execution, a
        loss scale dropped outside fp16); validated with the config's
        rules. None: `config` names its strategy and dtype itself (a
        caller that builds the parts without `prepare_run`: tests,
        `diagnose`).
      environment_applied, trial_fields: as the attributes.

    Raises:
      tfdist.errors.ConfigError: `choice` None and `config` still says
        `auto`; `--reduction_server` when `choice` is not
        multi_worker_mirrored; a rule of the config the decided values
        break (fp16 on a TPU, ...).
    """
    if choice is None:
      if "auto" in (config.distribution_strategy, config.dtype):
        raise errors.ConfigError(
            "the strategy is built from concrete values; decide `auto` "
            "first with tfdist.experiment.prepare_run "
            "(tfdist.distribute.auto_select.resolve).")
      settled = config
      choice = auto_select.Decision(
          strategy=StrategyKind.parse(config.distribution_strategy),
          strategy_reason="--distribution_strategy",
          dtype=config.dtype, dtype_reason="--dtype", tpu=config.tpu)
    else:
      settled = config.replace(**auto_select.decision_changes(
          choice, tpu=config.tpu, loss_scale=config.loss_scale,
          steps_per_execution=config.steps_per_execution,
          steps_per_execution_defaulted=(
              "steps_per_execution" in config.defaulted),
          reduction_server=bool(getattr(config, "reduction_server", False))))
    return cls(
        choice=choice, strategy=choice.strategy, dtype=settled.dtype,
        tpu=settled.tpu, loss_scale=settled.loss_scale,
        steps_per_execution=settled.steps_per_execution,
        model_dir=settled.model_dir,
        checkpoint_dir=settled.resolved_checkpoint_dir,
        tensorboard_dir=settled.resolved_tensorboard_dir,
        export_dir=settled.resolved_export_dir,
        train_files=settled.train_files,
        eval_files=settled.eval_files, data_dir=settled.data_dir,
        environment_applied=tuple(environment_applied),
        trial_fields=tuple(trial_fields),
        values=tuple((f, getattr(settled, f)) for f in DECIDED_FIELDS))

  def field_values(self) -> dict:
    """`{field: value}` of the `DECIDED_FIELDS` as flag values, for the
    records that list a run's settings by flag name (the run record, the
    manifest)."""
    return dict(self.values)

  def output_sources(self) -> dict:
    """Each output folder with the flag or variable that chose it
    (`tfdist.distribute.environment.folder_sources`)."""
    values = self.field_values()
    return environment_lib.folder_sources(
        {f: values[f] for f in environment_lib.TRIAL_FOLDER_FIELDS},
        {"export_dir": self.export_dir, "model_dir": self.model_dir,
         "checkpoint_dir": self.checkpoint_dir,
         "tensorboard_dir": self.tensorboard_dir},
        self.environment_applied)
