"""The outputs section (`config.outputs`): where the run writes, and the
profiler's window.

Consumers: the run's output folders and checkpoints
(`tfdist.experiment.runner`, `tfdist.training.plan.preflight`'s probes), which
the environment may fill (`tfdist.distribute.environment`,
`tfdist.distribute.decisions`: Vertex AI's `AIP_*` folders).
"""

import dataclasses
import os
from typing import Tuple

from tfdist import errors
from tfdist.config.values import _set
from tfdist.config.values import _split_list
from tfdist.config_tree import setting


# Where an output folder left unset goes, under `--model_dir`.
_DEFAULT_SUBFOLDERS = {"checkpoint_dir": "checkpoints", "tensorboard_dir": "",
                       "export_dir": "saved_model"}


def resolve_folder(name: str, value: str, model_dir: str) -> str:
  """The folder output setting `name` (`checkpoint_dir`, `tensorboard_dir`,
  `export_dir`) names: `value`, or its default under `model_dir` when
  unset ('' or None): `checkpoints/`, `model_dir` itself, `saved_model/`."""
  if value:
    return value
  sub = _DEFAULT_SUBFOLDERS[name]
  return os.path.join(model_dir, sub) if sub else model_dir


def require_model_dir(model_dir: str) -> None:
  """Raises `ConfigError` when no output folder is known.

  Called once the environment is read (`tfdist.distribute.environment`),
  since Vertex AI's `AIP_*` variables may supply it.
  """
  if not model_dir:
    raise errors.ConfigError(
        "--model_dir is required (or set AIP_CHECKPOINT_DIR as Vertex AI "
        "does). Example: "
        "--model_dir=/tmp/tfdist_run.")


def parse_profile_steps(value) -> Tuple[int, ...]:
  """Parses `--profile_steps`: `START,END` (1-based training steps, both
  traced), a single `N` (that step alone), or empty (no trace).

  Returns:
    `(START, END)`, or `()`.

  Raises:
    ConfigError: not one or two integers with 1 <= START <= END.
  """
  items = _split_list(value)
  if not items:
    return ()
  try:
    steps = tuple(int(item) for item in items)
  except ValueError:
    steps = ()
  if len(steps) == 1:
    steps = steps * 2
  if len(steps) != 2 or not 1 <= steps[0] <= steps[1]:
    raise errors.ConfigError(
        f"--profile_steps={','.join(items)} is not a window of training "
        "steps. Use --profile_steps=START,END with 1 <= START <= END (steps "
        "are counted from 1 and both ends are traced), e.g. "
        "--profile_steps=20,25.")
  return steps


@dataclasses.dataclass(frozen=True)
class OutputsConfig:
  """Where the run writes: its folders and the profiler's window."""
  model_dir: str = setting(
      "", "string", "base", key=True,
      help=("Output folder for checkpoints, TensorBoard logs, the SavedModel "
            "and run_manifest.json. Required unless Vertex AI's "
            "AIP_CHECKPOINT_DIR is set (AIP_MODEL_DIR is the SavedModel's own"
            " folder). Running again with the same folder resumes. In a "
            "Vertex AI hyperparameter-tuning trial (a trial id in "
            "CLUSTER_SPEC or TF_CONFIG) a given folder gets the subfolder "
            "trial_<id>."),
      traits=("operational", "path", "folder", "output_folder",
              "from_environment", "decided"))
  checkpoint_dir: str = setting(
      "", "string", "base",
      help=("Where checkpoints go. Default: $AIP_CHECKPOINT_DIR, else "
            "<model_dir>/checkpoints."),
      traits=("operational", "path", "folder", "output_folder",
              "from_environment", "decided"))
  tensorboard_dir: str = setting(
      "", "string", "base",
      help=("Where TensorBoard logs go (train/, validation/, eval/ below it)."
            " Default: $AIP_TENSORBOARD_LOG_DIR, else <model_dir>."),
      traits=("operational", "path", "folder", "output_folder",
              "from_environment", "decided"))
  export_dir: str = setting(
      "", "string", "base",
      help=("Where the SavedModel goes. Default: $AIP_MODEL_DIR, else "
            "<model_dir>/saved_model."),
      traits=("operational", "path", "folder", "output_folder",
              "from_environment", "decided"))
  # Stored as `(START, END)`, or () for no trace (`parse_profile_steps`).
  profile_steps: Tuple[int, ...] = setting(
      (), "list", "measure", key=True,
      help=("Trace training steps START,END (counted from 1, both included) "
            "with TensorFlow's profiler into "
            "<tensorboard_dir>/train/plugins/profile/ (TensorBoard's Profile "
            "tab, from the tensorboard-plugin-profile package). The chief "
            "traces its own process. Empty: no trace."),
      traits=())

  def __post_init__(self):
    _set(self, "profile_steps", parse_profile_steps(self.profile_steps))

  @property
  def resolved_checkpoint_dir(self) -> str:
    return resolve_folder("checkpoint_dir", self.checkpoint_dir,
                          self.model_dir)

  @property
  def resolved_tensorboard_dir(self) -> str:
    return resolve_folder("tensorboard_dir", self.tensorboard_dir,
                          self.model_dir)

  @property
  def resolved_export_dir(self) -> str:
    return resolve_folder("export_dir", self.export_dir, self.model_dir)
