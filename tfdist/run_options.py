"""The one place where a `TrainConfig` becomes each part's own options.

The run assembly (`tfdist.experiment`) calls these converters; every module
below it takes the small frozen options object (or plain arguments) it
reads, never the whole `TrainConfig` (as Orbit's `Controller` takes its
`ControllerOptions`). Each converter is a pure function of the config.
"""

from typing import List, Tuple

from tfdist import config as config_lib  # noqa: F401  (the converters' input)
from tfdist import filesystems
from tfdist import manifest
from tfdist import preflight

TrainConfig = config_lib.TrainConfig

# --- cluster and strategy ---

# --- inputs and data ---

# --- model, optimizer and training loop ---

# --- checkpoints and outputs ---

# --- observability (run log, manifest, diagnose) ---


def manifest_options(config: TrainConfig) -> manifest.ManifestOptions:
  """What `tfdist.manifest.build_manifest` records of `config`."""
  return manifest.ManifestOptions(
      flags=tuple(config.flags_snapshot), config=config.to_dict(),
      base_learning_rate=config.base_learning_rate,
      base_batch_size=config.base_batch_size, lr_scaling=config.lr_scaling,
      model=config.model, dataset=config.dataset,
      feature_spec=config.feature_spec)


def name_options(config: TrainConfig) -> preflight.NameOptions:
  """The registry names `tfdist.preflight.check_names` checks."""
  return preflight.NameOptions(
      model=config.model, dataset=config.dataset,
      feature_spec=config.feature_spec,
      import_modules=tuple(config.import_modules),
      hptune_metric=config.hptune_metric)


def output_options(config: TrainConfig) -> preflight.OutputOptions:
  """The output folders `tfdist.preflight.probe_outputs` probes."""
  return preflight.OutputOptions(
      model_dir=config.model_dir, checkpoint_dir=config.checkpoint_dir,
      tensorboard_dir=config.tensorboard_dir, export_dir=config.export_dir,
      resolved_checkpoint_dir=config.resolved_checkpoint_dir,
      resolved_tensorboard_dir=config.resolved_tensorboard_dir,
      resolved_export_dir=config.resolved_export_dir)


def config_paths(config: TrainConfig) -> List[Tuple[str, str]]:
  """`(flag, path)` of every path `config` reads or writes, for
  `tfdist.filesystems.require_file_systems` (comma-separated flags give
  one pair per entry)."""
  out = []
  for flag, value in (("--train_files", config.train_files),
                      ("--eval_files", config.eval_files),
                      ("--data_dir", config.data_dir),
                      ("--raw_data_dir", config.raw_data_dir),
                      ("--model_dir", config.model_dir),
                      ("--checkpoint_dir", config.checkpoint_dir),
                      ("--tensorboard_dir", config.tensorboard_dir),
                      ("--export_dir", config.export_dir),
                      ("--feature_spec", config.feature_spec),
                      ("--init_checkpoint", config.init_checkpoint)):
    out += filesystems.split_paths(flag, value)
  return out

# --- cloud engines (Ray, Vertex AI, Kubernetes) ---
