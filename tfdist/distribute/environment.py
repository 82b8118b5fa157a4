"""The process environment, read once at the binary's edge.

Everything tfdist takes from environment variables is read here, into a
frozen `RunEnvironment`, by `read_environment()`; nothing else in tfdist
calls `os.environ` for configuration. The binary (`tfdist.train`) reads it
right after parsing flags; library use (`run_experiment`) reads it at entry
unless the caller passes one. `apply_environment` then fills what the
config leaves unset, so one `TrainConfig` means the same run on every
machine, and the environment's part is stated in the log and the manifest.

Variables read:

| variable | used for |
|---|---|
| `TF_CONFIG`, `CLUSTER_SPEC` | the cluster (`tfdist.distribute.cluster.resolve_cluster`) |
| `AIP_MODEL_DIR` | Vertex AI: the SavedModel folder (`--export_dir`), and `--model_dir` when `AIP_CHECKPOINT_DIR` is unset (then refused at start: `tfdist.training.state.export.check_layout`) |
| `AIP_CHECKPOINT_DIR` | Vertex AI: `--model_dir` and the checkpoint folder |
| `AIP_TENSORBOARD_LOG_DIR` | Vertex AI: the TensorBoard folder |
| `AIP_TRAINING_DATA_URI`, `AIP_VALIDATION_DATA_URI` | Vertex AI managed datasets: `--train_files`, `--eval_files`, when `AIP_DATA_FORMAT` is `tf-record` (another format is an error) |
| `AIP_DATA_FORMAT` | Vertex AI managed datasets: the format of the files those URIs name |
| `TPU_NAME` | `--tpu` when unset |
| `TPU_NAME`, `TPU_ACCELERATOR_TYPE`, `TPU_WORKER_HOSTNAMES` | signs of a TPU for `auto` (`tfdist.distribute.tpu.tpu_hints`) |
| `TFDIST_DATA_DIR`, `HOME`, `TEST_TMPDIR` | the default `--data_dir` |

A flag (a config field) always wins over a variable.

Hyperparameter-tuning trials: `trial_folders` gives each trial its own
output folders (`--model_dir`, `--checkpoint_dir`, `--tensorboard_dir`,
`--export_dir`), whichever flag or variable gave them: `<dir>/trial_<id>`,
the trial id coming from `CLUSTER_SPEC`/`TF_CONFIG`
(`tfdist.distribute.cluster.ClusterInfo.trial`). A folder from `AIP_*` that
Vertex AI already nested per trial (`<base_output_dir>/<trial>/model/`, ...) is
left as it is.

`output_sources` names each output folder with the flag or variable that
chose it, for `tfdist.training.state.export.check_layout`.
"""

import dataclasses
import os
import types
from typing import Dict, Mapping, Optional, Tuple

from tfdist import config as config_lib
from tfdist import errors

# The variables tfdist reads (and records in the manifest).
VARIABLES = (
    "TF_CONFIG", "CLUSTER_SPEC",
    "AIP_MODEL_DIR", "AIP_CHECKPOINT_DIR", "AIP_TENSORBOARD_LOG_DIR",
    "AIP_DATA_FORMAT", "AIP_TRAINING_DATA_URI", "AIP_VALIDATION_DATA_URI",
    "TPU_NAME", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES",
    "TFDIST_DATA_DIR", "HOME", "TEST_TMPDIR",
)

# Vertex AI managed datasets: the `AIP_DATA_FORMAT` tfdist reads (TFRecord
# files of `tf.train.Example`), and the variable that fills each field, with
# the flag that wins over it. Vertex documents the URIs as Cloud Storage
# wildcards, e.g. `gs://bucket/path/training-*` (`jsonl`, `csv`, `tf-record`)
# or BigQuery tables, `bq://project.dataset.table` (`bigquery`).
TFRECORD_DATA_FORMAT = "tf-record"
DATA_URI_VARIABLES = (
    ("train_files", "AIP_TRAINING_DATA_URI"),
    ("eval_files", "AIP_VALIDATION_DATA_URI"),
)
# The output folders a hyperparameter-tuning trial nests when a flag gives
# them (`trial_folders`).
TRIAL_FOLDER_FIELDS = config_lib.settings_with("output_folder")


@dataclasses.dataclass(frozen=True)
class RunEnvironment:
  """The environment variables tfdist reads, as one immutable value.

  Attributes:
    variables: read-only mapping of the names in `VARIABLES` that are set
      (non-empty) to their values.
  """
  variables: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    object.__setattr__(self, "variables", types.MappingProxyType(
        {k: str(v) for k, v in dict(self.variables).items() if v}))

  def get(self, name: str, default: str = "") -> str:
    """The value of `name`, or `default` when it is unset or empty."""
    return self.variables.get(name, default)

  @property
  def default_data_dir(self) -> str:
    """`$TFDIST_DATA_DIR`, else `~/.cache/tfdist/datasets` (HOME, else
    TEST_TMPDIR, else /tmp)."""
    if self.get("TFDIST_DATA_DIR"):
      return self.get("TFDIST_DATA_DIR")
    home = self.get("HOME") or self.get("TEST_TMPDIR") or "/tmp"
    return os.path.join(home, ".cache", "tfdist", "datasets")


def read_environment(environ: Optional[Mapping[str, str]] = None
                     ) -> RunEnvironment:
  """Reads the variables in `VARIABLES` from `environ` (default `os.environ`).

  Returns:
    A `RunEnvironment` holding the ones that are set.
  """
  env = os.environ if environ is None else environ
  return RunEnvironment({name: env.get(name, "") for name in VARIABLES})


# The fields `environment_changes` may fill, each only when it is unset.
ENVIRONMENT_FIELDS = config_lib.settings_with("from_environment")


def environment_changes(given: Mapping[str, str], environment: RunEnvironment
                        ) -> Tuple[Dict[str, str], Tuple[Tuple[str, str], ...]]:
  """The values `environment` gives the fields that `given` leaves unset.

  * `model_dir` <- `AIP_CHECKPOINT_DIR`, else `AIP_MODEL_DIR` (Vertex AI);
  * `checkpoint_dir` <- `AIP_CHECKPOINT_DIR`;
  * `tensorboard_dir` <- `AIP_TENSORBOARD_LOG_DIR`;
  * `export_dir` <- `AIP_MODEL_DIR`;
  * `train_files` <- `AIP_TRAINING_DATA_URI`, `eval_files` <-
    `AIP_VALIDATION_DATA_URI` (Vertex AI managed datasets), when
    `AIP_DATA_FORMAT` is `tf-record` (`check_data_format`);
  * `tpu` <- `TPU_NAME`;
  * `data_dir` <- `environment.default_data_dir`.

  Args:
    given: `{field: value}` of the `ENVIRONMENT_FIELDS` as the flags set
      them ('' or None: unset; a missing field counts as unset).
    environment: from `read_environment`.

  Returns:
    `(changes, filled)`: `{field: value}` to set, and the `(field,
    variable)` pairs that were applied, for the log and the manifest
    (`data_dir`'s default is a change but names no variable).

  Raises:
    ConfigError: a data URI would fill an unset field but `AIP_DATA_FORMAT`
      is not `tf-record` (`check_data_format`).
  """
  changes, filled = {}, []

  def fill(field: str, *variables: str):
    if given.get(field):
      return
    for var in variables:
      if environment.get(var):
        changes[field] = environment.get(var)
        filled.append((field, var))
        return

  fill("model_dir", "AIP_CHECKPOINT_DIR", "AIP_MODEL_DIR")
  fill("checkpoint_dir", "AIP_CHECKPOINT_DIR")
  fill("tensorboard_dir", "AIP_TENSORBOARD_LOG_DIR")
  fill("export_dir", "AIP_MODEL_DIR")
  for field, variable in DATA_URI_VARIABLES:
    if not given.get(field) and environment.get(variable):
      check_data_format(environment, variable)
      fill(field, variable)
  fill("tpu", "TPU_NAME")
  if not given.get("data_dir"):
    changes["data_dir"] = environment.default_data_dir
  return changes, tuple(filled)


def apply_environment(config, environment: RunEnvironment):
  """Fills the fields `config` leaves unset from `environment`.

  The binary's edge adapter of `environment_changes`: it reads the
  `ENVIRONMENT_FIELDS` of `config` by name and `replace`s the changed ones
  (the TensorFlow-free `tfdist.job_spec` calls it too).

  Args:
    config: a `tfdist.config.TrainConfig` (any object with the
      `ENVIRONMENT_FIELDS` and `replace(**changes)`).
    environment: from `read_environment`.

  Returns:
    `(config, filled)`: the updated config and the `(field, variable)` pairs
    that were applied, for the log and the manifest.

  Raises:
    ConfigError: as `environment_changes`.
  """
  changes, filled = environment_changes(
      {field: getattr(config, field) for field in ENVIRONMENT_FIELDS},
      environment)
  return (config.replace(**changes) if changes else config), filled


def check_data_format(environment: RunEnvironment, variable: str):
  """Checks that the Vertex AI data URI in `variable` names TFRecord files.

  Vertex AI exports a managed dataset for custom training as `jsonl`, `csv`
  or `bigquery` (tabular and other data sets), or as `tf-record`, and says
  which in `AIP_DATA_FORMAT` ("Use managed datasets", Vertex AI custom
  training documentation). tfdist's input pipeline reads TFRecord files of
  `tf.train.Example` only.

  Args:
    environment: from `read_environment`.
    variable: `AIP_TRAINING_DATA_URI` or `AIP_VALIDATION_DATA_URI`.

  Raises:
    ConfigError: `AIP_DATA_FORMAT` is not `tf-record` (or is unset); the
      message names both variables, their values and the fix.
  """
  data_format = environment.get("AIP_DATA_FORMAT")
  if data_format == TFRECORD_DATA_FORMAT:
    return
  flag = "--" + dict((v, f) for f, v in DATA_URI_VARIABLES)[variable]
  given = (f"AIP_DATA_FORMAT={data_format!r}" if data_format else
           "AIP_DATA_FORMAT is unset")
  raise errors.ConfigError(
      f"${variable}={environment.get(variable)!r} names a Vertex AI managed "
      f"dataset, but {given}: tfdist reads TFRecord files of "
      f"tf.train.Example only (AIP_DATA_FORMAT={TFRECORD_DATA_FORMAT!r}). "
      "Export the dataset as TFRecords, or convert it to TFRecord files and "
      f"pass them as {flag} (a flag wins over ${variable}).")


def trial_subfolder(trial: str) -> str:
  """The folder name of hyperparameter-tuning trial `trial`: `trial_<id>`."""
  return f"trial_{trial}"


def _names_trial(folder: str, trial: str, *, from_environment: bool
                 ) -> bool:
  """True when `folder` is already this trial's own: it ends in
  `trial_<id>`, or (a folder from `AIP_*`) it is in Vertex AI's per-trial
  layout, `<base_output_dir>/<trial>/<model|checkpoints|logs>`."""
  parts = [p for p in folder.rstrip("/").split("/") if p]
  if parts and parts[-1] == trial_subfolder(trial):
    return True
  return from_environment and len(parts) >= 2 and parts[-2] == trial


def trial_changes(folders: Mapping[str, str], *, trial: str,
                  filled: Tuple[Tuple[str, str], ...] = ()) -> Dict[str, str]:
  """The output folders a hyperparameter-tuning trial nests: `{field: new}`.

  Every field of `TRIAL_FOLDER_FIELDS` that is set, by a flag or by a
  variable (`filled`), gets the subfolder `trial_subfolder(trial)`:
  `--model_dir=gs://b/run` becomes `gs://b/run/trial_7` in trial 7, and so
  does `AIP_CHECKPOINT_DIR=gs://b/run`, so trials never share a checkpoint.
  Left as they are: a folder that already ends in that subfolder (applying
  twice changes nothing), and a folder from `AIP_*` in Vertex AI's
  per-trial layout (`gs://b/out/7/checkpoints/` in trial 7: Vertex nests
  its folders per trial when it runs a tuning job).

  Args:
    folders: `{field: folder}` of the `TRIAL_FOLDER_FIELDS` (''/None or
      missing: unset), after `environment_changes`.
    trial: the trial id (`tfdist.distribute.cluster.ClusterInfo.trial`); ''
      outside a tuning job, which changes nothing.
    filled: the `(field, variable)` pairs `environment_changes` returned.

  Returns:
    The changed fields and their folders, in `TRIAL_FOLDER_FIELDS` order.
  """
  if not trial:
    return {}
  from_environment = {field for field, _ in filled}
  subfolder = trial_subfolder(trial)
  changes = {}
  for field in TRIAL_FOLDER_FIELDS:
    value = folders.get(field)
    if not value or _names_trial(
        value, trial, from_environment=field in from_environment):
      continue
    changes[field] = value.rstrip("/") + "/" + subfolder
  return changes


def trial_folders(config, *, trial: str,
                  filled: Tuple[Tuple[str, str], ...] = ()):
  """Gives a hyperparameter-tuning trial its own output folders.

  The edge adapter of `trial_changes` (see there for the rule).

  Args:
    config: a `tfdist.config.TrainConfig`, after `apply_environment`.
    trial: the trial id; '' changes nothing.
    filled: the `(field, variable)` pairs `apply_environment` returned.

  Returns:
    `(config, fields)`: the updated config and the fields given the
    subfolder, in `TRIAL_FOLDER_FIELDS` order.
  """
  changes = trial_changes(
      {field: getattr(config, field) for field in TRIAL_FOLDER_FIELDS},
      trial=trial, filled=filled)
  if not changes:
    return config, ()
  return config.replace(**changes), tuple(changes)


def folder_sources(given: Mapping[str, str], resolved: Mapping[str, str],
                   filled: Tuple[Tuple[str, str], ...] = ()):
  """Each output folder with the flag or variable that chose it.

  Args:
    given: `{field: folder}` of the `TRIAL_FOLDER_FIELDS` as set ('' or
      None: left to its default under `--model_dir`).
    resolved: `{field: folder}` the run writes to, for the same fields.
    filled: the `(field, variable)` pairs `environment_changes` returned.

  Returns:
    `{"export_dir": (folder, source), "model_dir": ..., "checkpoint_dir":
    ..., "tensorboard_dir": ...}`; a source reads `--model_dir`,
    `$AIP_MODEL_DIR (--export_dir)` or `--checkpoint_dir (default, under
    --model_dir)`.
  """
  variables = dict(filled)

  def source(field: str) -> str:
    if field in variables:
      return f"${variables[field]} (--{field})"
    if given.get(field) or field == "model_dir":
      return f"--{field}"
    return f"--{field} (default, under {source('model_dir')})"

  return {field: (resolved[field], source(field)) for field in (
      "export_dir", "model_dir", "checkpoint_dir", "tensorboard_dir")}


def output_sources(config, filled: Tuple[Tuple[str, str], ...] = ()):
  """Each output folder of `config` with the flag or variable that chose
  it: the keyword arguments of `tfdist.training.state.export.check_layout`.

  The edge adapter of `folder_sources`.

  Args:
    config: a `tfdist.config.TrainConfig` after `apply_environment` (and
      `trial_folders`).
    filled: the `(field, variable)` pairs `apply_environment` returned.

  Returns:
    As `folder_sources`.
  """
  return folder_sources(
      {field: getattr(config, field) for field in TRIAL_FOLDER_FIELDS},
      {"export_dir": config.resolved_export_dir,
       "model_dir": config.outputs.model_dir,
       "checkpoint_dir": config.resolved_checkpoint_dir,
       "tensorboard_dir": config.resolved_tensorboard_dir}, filled)
