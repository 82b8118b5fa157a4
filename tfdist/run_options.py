"""The one place where a `TrainConfig` becomes each part's own options.

The run assembly (`tfdist.experiment`) calls these converters; every module
below it takes the small frozen options object (or plain arguments) it
reads, never the whole `TrainConfig` (as Orbit's `Controller` takes its
`ControllerOptions`). Each converter is a pure function of the config.
"""

from typing import List, Tuple

from tfdist import config as config_lib  # noqa: F401  (the converters' input)
from tfdist import filesystems
from tfdist import input_pipeline
from tfdist import manifest
from tfdist import preflight

TrainConfig = config_lib.TrainConfig

# --- cluster and strategy ---

# --- inputs and data ---


def train_input_options(config: TrainConfig, spec, *, files, global_batch_size,
                        file_record_counts=None,
                        gradient_accumulation_steps: int = 1,
                        resumable: bool = False
                        ) -> input_pipeline.PipelineOptions:
  """The training split's `PipelineOptions` under a synchronous strategy.

  Args:
    config: the run's config (`shuffle_buffer_size`, `cache_dataset`,
      `seed`, `deterministic`).
    spec: the data set's `DatasetSpec`.
    files: the training TFRecord paths (ignored for a dataset function).
    global_batch_size: examples per update over all replicas.
    file_record_counts: records per file, or None.
    gradient_accumulation_steps: micro-batches per update.
    resumable: the input position is checkpointed, which needs a
      reproducible reading order (deterministic).
  """
  return input_pipeline.options_for(
      spec, files=files, global_batch_size=global_batch_size,
      is_training=True, shuffle_buffer_size=config.shuffle_buffer_size,
      cache=config.cache_dataset, seed=config.seed,
      file_record_counts=file_record_counts,
      gradient_accumulation_steps=gradient_accumulation_steps,
      deterministic=config.deterministic or resumable)


def parameter_server_input_options(config: TrainConfig, spec, *, files,
                                   global_batch_size
                                   ) -> input_pipeline.PipelineOptions:
  """The training split's `PipelineOptions` for parameter-server workers.

  Unseeded: each worker must shuffle its copy differently.
  """
  return input_pipeline.options_for(
      spec, files=files, global_batch_size=global_batch_size,
      is_training=True, shuffle_buffer_size=config.shuffle_buffer_size,
      cache=config.cache_dataset, seed=None)


def eval_input_options(config: TrainConfig, spec, *, files, global_batch_size,
                       pad_to_static_batches: bool = False
                       ) -> input_pipeline.PipelineOptions:
  """The evaluation split's `PipelineOptions`: read once, in order.

  Args:
    config: the run's config (`cache_dataset`).
    spec: the data set's `DatasetSpec`.
    files: the evaluation TFRecord paths (ignored for a dataset function).
    global_batch_size: examples per evaluation step over all replicas.
    pad_to_static_batches: pad the last batches (TPUs need static shapes).
  """
  return input_pipeline.options_for(
      spec, files=files, global_batch_size=global_batch_size,
      is_training=False, cache=config.cache_dataset,
      pad_to_static_batches=pad_to_static_batches)


# --- model, optimizer and training loop ---

# --- checkpoints and outputs ---
def run_record_settings(config: TrainConfig) -> dict:
  """The settings `tfdist.checkpointing.run_record` records beside the
  checkpoints: every config field by flag name, as JSON-serializable values
  (`TrainConfig.to_dict`)."""
  return config.to_dict()


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
