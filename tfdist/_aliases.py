"""The modules' old import paths, from before tfdist had subpackages.

tfdist's modules live in subpackages by stage (`tfdist.data`,
`tfdist.training`, `tfdist.distribute`, `tfdist.observability`,
`tfdist.cloud`, `tfdist.runtime`). A program written against the flat
layout (`from tfdist import checkpointing`, `import tfdist.lr_schedule`)
still runs: `MovedModuleFinder` answers each old name with the module
itself (the same object, so its classes, registries and `isinstance`
checks are shared) and warns once with a `DeprecationWarning` naming the
new path. New code imports the new path.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# Old module name (under `tfdist.`) -> its new full name.
MOVED = {
    "allocator": "tfdist.runtime.allocator",
    "assembly": "tfdist.training.assembly",
    "auto_select": "tfdist.distribute.auto_select",
    "batch_plan": "tfdist.training.batch_plan",
    "checkpoint_paths": "tfdist.training.checkpoint_paths",
    "checkpointing": "tfdist.training.checkpointing",
    "cli": "tfdist.runtime.cli",
    "clothing_reviews": "tfdist.data.clothing_reviews",
    "cluster": "tfdist.distribute.cluster",
    "controller": "tfdist.training.controller",
    "conversion": "tfdist.data.conversion",
    "data_checks": "tfdist.data.data_checks",
    "dataset_spec": "tfdist.data.dataset_spec",
    "datasets": "tfdist.data.datasets",
    "devices": "tfdist.distribute.devices",
    "done_marker": "tfdist.training.done_marker",
    "environment": "tfdist.distribute.environment",
    "export": "tfdist.training.export",
    "failures": "tfdist.runtime.failures",
    "fashion_mnist": "tfdist.data.fashion_mnist",
    "feature_spec": "tfdist.data.feature_spec",
    "filesystems": "tfdist.data.filesystems",
    "hptune": "tfdist.cloud.hptune",
    "input_pipeline": "tfdist.data.input_pipeline",
    "input_position": "tfdist.data.input_position",
    "job_plan": "tfdist.cloud.job_plan",
    "keras_callbacks": "tfdist.training.keras_callbacks",
    "lease": "tfdist.distribute.lease",
    "lr_schedule": "tfdist.training.lr_schedule",
    "manifest": "tfdist.observability.manifest",
    "memory": "tfdist.training.memory",
    "movielens": "tfdist.data.movielens",
    "objectives": "tfdist.training.objectives",
    "optimizers": "tfdist.training.optimizers",
    "parameter_server": "tfdist.distribute.parameter_server",
    "precision": "tfdist.training.precision",
    "preemption": "tfdist.runtime.preemption",
    "preflight": "tfdist.runtime.preflight",
    "profiling": "tfdist.observability.profiling",
    "quiet_tensorflow": "tfdist.runtime.quiet_tensorflow",
    "ray_worker": "tfdist.cloud.ray_worker",
    "registry": "tfdist.training.registry",
    "rendezvous": "tfdist.distribute.rendezvous",
    "run_log": "tfdist.observability.run_log",
    "run_options": "tfdist.runtime.run_options",
    "run_plan": "tfdist.training.run_plan",
    "sharded_embedding": "tfdist.training.sharded_embedding",
    "sharded_optimizer": "tfdist.training.sharded_optimizer",
    "step_runner": "tfdist.training.step_runner",
    "strategy": "tfdist.distribute.strategy",
    "strategy_kind": "tfdist.distribute.strategy_kind",
    "strict_json": "tfdist.runtime.strict_json",
    "task": "tfdist.training.task",
    "tfjob_spec": "tfdist.cloud.tfjob_spec",
    "throughput": "tfdist.observability.throughput",
    "tpu": "tfdist.distribute.tpu",
    "train_loop": "tfdist.training.train_loop",
    "training_checks": "tfdist.training.training_checks",
    "versions": "tfdist.observability.versions",
    "vertex_spec": "tfdist.cloud.vertex_spec",
    "watchdog": "tfdist.runtime.watchdog",
    "worker_exit": "tfdist.distribute.worker_exit",
}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Imports `tfdist.<old>` as the module `MOVED[<old>]` names."""

  def __init__(self, package: str):
    self._package = package
    self._own_specs = {}

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    package, _, name = fullname.partition(".")
    if package != self._package or name not in MOVED:
      return None
    return importlib.util.spec_from_loader(fullname, self)

  def create_module(self, spec):
    new_name = MOVED[spec.name.partition(".")[2]]
    warnings.warn(
        f"{spec.name} moved to {new_name}; import {new_name} (the old path "
        "is a deprecated alias)", DeprecationWarning, stacklevel=2)
    module = importlib.import_module(new_name)
    self._own_specs[new_name] = module.__spec__
    return module

  def exec_module(self, module):
    # The import system has just set the alias's spec on the module: give
    # the module back its own (reload and pickling read it).
    module.__spec__ = self._own_specs.get(module.__name__, module.__spec__)


def install(package: str) -> None:
  """Adds the finder for `package` (`tfdist`) to `sys.meta_path`, once."""
  if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
    # First: an editable install of an older checkout must not answer an
    # old name with its own flat file.
    sys.meta_path.insert(0, MovedModuleFinder(package))
