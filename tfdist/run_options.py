"""The one place where a `TrainConfig` becomes each part's own options.

The run assembly (`tfdist.experiment`) calls these converters; every module
below it takes the small frozen options object (or plain arguments) it
reads, never the whole `TrainConfig` (as Orbit's `Controller` takes its
`ControllerOptions`). Each converter is a pure function of the config.
"""

from tfdist import config as config_lib  # noqa: F401  (the converters' input)

TrainConfig = config_lib.TrainConfig

# --- cluster and strategy ---

# --- inputs and data ---

# --- model, optimizer and training loop ---

# --- checkpoints and outputs ---
def run_record_settings(config: TrainConfig) -> dict:
  """The settings `tfdist.checkpointing.run_record` records beside the
  checkpoints: every config field by flag name, as JSON-serializable values
  (`TrainConfig.to_dict`)."""
  return config.to_dict()


# --- observability (run log, manifest, diagnose) ---

# --- cloud engines (Ray, Vertex AI, Kubernetes) ---
