"""tfdist.core: the bottom floor under the configuration: the names and
registries the config validates against and every part builds from, with no
first-party imports above `tfdist.errors` (docs/design/architecture.md).

Modules:
  constant_schedule
  dataset_spec
  decay_schedules
  optimizers
  reduce_dtype
  registry
  strategy_kind

Nothing is imported here: import the module you use
(`from tfdist.core import optimizers`).
"""
