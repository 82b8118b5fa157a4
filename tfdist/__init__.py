"""tfdist: TensorFlow distributed training with Keras 3 models.

The binary is `python -m tfdist.train`; from Python, `tfdist.fit(model_fn,
dataset_fn, config=tfdist.TrainConfig(...))` trains your own Keras model on
your own data (see `tfdist.api`), and `tfdist.run_experiment(config)` runs
what a `TrainConfig` names. `register_model` and `register_dataset` add
names that `--model` and `--dataset` accept.

tfdist's model builders and flag definitions live in the repository's
top-level `models/` and `flags/` folders but are imported as
`tfdist.models` and `tfdist.flags` (`setup.py` installs them there), so a
project with its own `models` package or `flags.py` never shadows them, and
they never shadow the project's.
"""

import importlib.abc
import importlib.util
import os
import sys

__version__ = "0.1.0"

__all__ = ["__version__", "TrainConfig", "ConfigError", "DatasetSpec",
           "run_experiment", "fit", "register_model", "register_dataset",
           "MixtureOfExperts"]

# Subpackages kept outside this folder in the source tree (and in Bazel's
# runfiles), beside it: `tfdist.models` is `<root>/models`.
_SIBLING_PACKAGES = ("models", "flags")
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)


class _SiblingPackageFinder(importlib.abc.MetaPathFinder):
  """Finds `tfdist.models` and `tfdist.flags` in the source tree.

  An installed tfdist holds them as real subpackages (setup.py's
  `package_dir`); a source checkout (running from its root, PYTHONPATH,
  Bazel's runfiles) holds them beside `tfdist/`. This finder answers only
  for those two names and only for this copy of tfdist; their submodules
  are then found through the package's `__path__` as usual.
  """

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    package, _, name = fullname.partition(".")
    if package != __name__ or name not in _SIBLING_PACKAGES:
      return None
    folder = os.path.join(_ROOT, name)
    if not os.path.isfile(os.path.join(folder, "__init__.py")):
      return None
    return importlib.util.spec_from_file_location(
        fullname, os.path.join(folder, "__init__.py"),
        submodule_search_locations=[folder])


def _install_sibling_finder():
  if any(isinstance(f, _SiblingPackageFinder) for f in sys.meta_path):
    return
  if all(os.path.isdir(os.path.join(_HERE, n)) for n in _SIBLING_PACKAGES):
    return  # Installed: the subpackages are inside this folder.
  # Any one of them is enough: a Bazel target's runfiles hold only the
  # folders it depends on (//models without //flags, say).
  if any(os.path.isfile(os.path.join(_ROOT, n, "__init__.py"))
         for n in _SIBLING_PACKAGES):
    # First, so that this checkout's folders win over an editable install
    # of another checkout.
    sys.meta_path.insert(0, _SiblingPackageFinder())


_install_sibling_finder()

# Before any `import tensorflow` of the script that imports tfdist: hides
# TensorFlow's import-time notices and its C++ INFO and WARNING lines
# (`TF_CPP_MIN_LOG_LEVEL=0` keeps them). Standard library only.
from tfdist.runtime import quiet_tensorflow as _quiet_tensorflow  # pylint: disable=g-import-not-at-top,wrong-import-position

_quiet_tensorflow.quiet_library_import()

def __getattr__(name):
  # Imported lazily so `import tfdist` stays cheap (no TensorFlow import).
  if name == "TrainConfig":
    from tfdist import config  # pylint: disable=g-import-not-at-top
    return config.TrainConfig
  if name == "ConfigError":
    from tfdist import errors  # pylint: disable=g-import-not-at-top
    return errors.ConfigError
  if name == "DatasetSpec":
    from tfdist.core import dataset_spec  # pylint: disable=g-import-not-at-top
    return dataset_spec.DatasetSpec
  if name in ("register_model", "register_dataset"):
    from tfdist.core import registry  # pylint: disable=g-import-not-at-top
    return getattr(registry, name)
  if name == "fit":
    from tfdist import api  # pylint: disable=g-import-not-at-top
    return api.fit
  if name == "MixtureOfExperts":
    from tfdist.parallel.experts import layer  # pylint: disable=g-import-not-at-top
    return layer.MixtureOfExperts
  if name == "run_experiment":
    from tfdist import experiment  # pylint: disable=g-import-not-at-top
    return experiment.run_experiment
  raise AttributeError(f"module 'tfdist' has no attribute {name!r}")
