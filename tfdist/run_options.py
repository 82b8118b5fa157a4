"""The one place where a `TrainConfig` becomes each part's own options.

The run assembly (`tfdist.experiment`) calls these converters; every module
below it takes the small frozen options object (or plain arguments) it
reads, never the whole `TrainConfig` (as Orbit's `Controller` takes its
`ControllerOptions`). Each converter is a pure function of the config.
"""

from tfdist import config as config_lib  # noqa: F401  (the converters' input)
from tfdist import input_pipeline

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

# --- cloud engines (Ray, Vertex AI, Kubernetes) ---
