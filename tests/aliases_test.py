"""The flat layout's import paths still import the moved modules."""

import importlib
import os
import subprocess
import sys
import warnings

import pytest

import tfdist
from tfdist import _aliases

OLD_NAMES = sorted(_aliases.MOVED)


@pytest.mark.compat
def test_every_alias_names_a_module_that_exists():
  # The files, not imports: a Bazel target's runfiles carry every file of
  # tfdist (//tfdist:build_inputs) but import only what its deps name.
  root = os.path.dirname(os.path.abspath(tfdist.__file__))
  for old, new in _aliases.MOVED.items():
    parts = new.split(".")
    assert parts[0] == "tfdist", new
    assert os.path.isfile(os.path.join(root, *parts[1:-1], parts[-1] + ".py")
                          ), (old, new)
    assert not os.path.exists(os.path.join(root, old + ".py")), old
    assert importlib.util.find_spec(f"tfdist.{old}") is not None, old


@pytest.mark.compat
def test_old_path_is_the_same_module_and_warns():
  # A fresh interpreter: this process may have imported the module already.
  code = (
      "import warnings, importlib\n"
      "warnings.simplefilter('always')\n"
      "with warnings.catch_warnings(record=True) as seen:\n"
      "  import tfdist.lr_schedule as old\n"
      "new = importlib.import_module('tfdist.training.lr_schedule')\n"
      "assert old is new, (old, new)\n"
      "assert old.__spec__.name == 'tfdist.training.lr_schedule'\n"
      "assert any(issubclass(w.category, DeprecationWarning) and\n"
      "           'tfdist.training.lr_schedule' in str(w.message)\n"
      "           for w in seen), [str(w.message) for w in seen]\n"
      "from tfdist import checkpointing\n"
      "assert checkpointing.__name__ == 'tfdist.training.checkpointing'\n"
      "print('ok')\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=120, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().endswith("ok")


@pytest.mark.compat
def test_old_class_paths_share_identity():
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    old = importlib.import_module("tfdist.strategy_kind")
  new = importlib.import_module("tfdist.distribute.strategy_kind")
  assert old.StrategyKind is new.StrategyKind


@pytest.mark.compat
def test_unknown_names_are_not_answered():
  with pytest.raises(ModuleNotFoundError):
    importlib.import_module("tfdist.no_such_module")
  assert "no_such_module" not in _aliases.MOVED
  assert tfdist.__name__ == "tfdist"
