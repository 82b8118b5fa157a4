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
| `TF_CONFIG`, `CLUSTER_SPEC` | the cluster (`tfdist.cluster.resolve_cluster`) |
| `AIP_MODEL_DIR` | Vertex AI: the SavedModel folder (`--export_dir`), and `--model_dir` when `AIP_CHECKPOINT_DIR` is unset |
| `AIP_CHECKPOINT_DIR` | Vertex AI: `--model_dir` and the checkpoint folder |
| `AIP_TENSORBOARD_LOG_DIR` | Vertex AI: the TensorBoard folder |
| `TPU_NAME` | `--tpu` when unset |
| `TPU_NAME`, `TPU_ACCELERATOR_TYPE`, `TPU_WORKER_HOSTNAMES` | signs of a TPU for `auto` (`tfdist.tpu.tpu_hints`) |
| `TFDIST_DATA_DIR`, `HOME`, `TEST_TMPDIR` | the default `--data_dir` |

A flag (a config field) always wins over a variable.
"""

import dataclasses
import os
import types
from typing import Mapping, Optional, Tuple

# The variables tfdist reads (and records in the manifest).
VARIABLES = (
    "TF_CONFIG", "CLUSTER_SPEC",
    "AIP_MODEL_DIR", "AIP_CHECKPOINT_DIR", "AIP_TENSORBOARD_LOG_DIR",
    "TPU_NAME", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES",
    "TFDIST_DATA_DIR", "HOME", "TEST_TMPDIR",
)


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


def apply_environment(config, environment: RunEnvironment):
  """Fills the fields `config` leaves unset from `environment`.

  * `model_dir` <- `AIP_CHECKPOINT_DIR`, else `AIP_MODEL_DIR` (Vertex AI);
  * `checkpoint_dir` <- `AIP_CHECKPOINT_DIR`;
  * `tensorboard_dir` <- `AIP_TENSORBOARD_LOG_DIR`;
  * `export_dir` <- `AIP_MODEL_DIR`;
  * `tpu` <- `TPU_NAME`;
  * `data_dir` <- `environment.default_data_dir`.

  Args:
    config: a `tfdist.config.TrainConfig`.
    environment: from `read_environment`.

  Returns:
    `(config, filled)`: the updated config and the `(field, variable)` pairs
    that were applied, for the log and the manifest.
  """
  changes, filled = {}, []

  def fill(field: str, *variables: str):
    if getattr(config, field):
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
  fill("tpu", "TPU_NAME")
  if not config.data_dir:
    changes["data_dir"] = environment.default_data_dir
  filled_t: Tuple[Tuple[str, str], ...] = tuple(filled)
  return (config.replace(**changes) if changes else config), filled_t
