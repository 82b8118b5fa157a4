"""The one place where a `TrainConfig` becomes each part's own options.

The run assembly (`tfdist.experiment`) calls these converters; every module
below it takes the small frozen options object (or plain arguments) it
reads, never the whole `TrainConfig` (as Orbit's `Controller` takes its
`ControllerOptions`). Each converter is a pure function of the config.
"""

from tfdist import assembly
from tfdist import config as config_lib  # noqa: F401  (the converters' input)
from tfdist import task as task_lib

TrainConfig = config_lib.TrainConfig

# --- cluster and strategy ---

# --- inputs and data ---

# --- model, optimizer and training loop ---


def assembly_options(config: TrainConfig) -> assembly.AssemblyOptions:
  """The model, optimizer and precision settings `tfdist.assembly` reads.

  Args:
    config: a normalized `TrainConfig` (`steps_per_execution` and `dtype`
      set, `auto` decided).

  Returns:
    `assembly.AssemblyOptions`; model builders asking for `config` get
    `config` itself.
  """
  return assembly.AssemblyOptions(
      optimizer=config.optimizer,
      momentum=config.momentum,
      weight_decay=config.weight_decay,
      clipnorm=config.clipnorm,
      global_clipnorm=config.global_clipnorm,
      dtype=config.dtype,
      loss_scale=config.loss_scale,
      steps_per_execution=config.steps_per_execution,
      enable_xla=config.enable_xla,
      run_eagerly=config.run_eagerly,
      deterministic=config.deterministic,
      zero_stage=config.zero_stage_resolved,
      class_weight=tuple(config.class_weight),
      activation_recomputation=config.activation_recomputation,
      builder_config=config)


def task_names(config: TrainConfig) -> task_lib.TaskNames:
  """The names the run's task comes from (`--model`, `--dataset`,
  `--feature_spec`, `--import_modules`): `tfdist.task.from_names` reads
  them."""
  return task_lib.TaskNames(model=config.model, dataset=config.dataset,
                            feature_spec=config.feature_spec,
                            import_modules=tuple(config.import_modules))

# --- checkpoints and outputs ---

# --- observability (run log, manifest, diagnose) ---

# --- cloud engines (Ray, Vertex AI, Kubernetes) ---
