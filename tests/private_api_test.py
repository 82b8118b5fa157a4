"""The fence around tfdist's private Keras/TensorFlow uses
(`tfdist.runtime.private_api`).

* Every listed name still exists on its owner in the installed
  TensorFlow/Keras (this file is marked `compat`: it also runs on TF 2.17).
* No file of `tfdist/` or `models/` uses a private Keras/TensorFlow name the
  list does not hold: attributes read on anything but `self`/`cls`
  (`x._name`, `getattr(x, "_name")`), methods overriding a private one of a
  Keras/TensorFlow base class, and imports of `tensorflow.python`,
  `tensorflow.core` or `keras.src`; and every file the list names still
  uses its name.
"""

import ast
import pathlib

from absl.testing import absltest
import pytest

from tfdist.runtime import private_api

pytestmark = pytest.mark.compat

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_TREES = ("tfdist", "models")
_PRIVATE_MODULES = ("tensorflow.python", "tensorflow.core", "keras.src")
_GETTERS = ("getattr", "hasattr", "setattr", "delattr")


def _private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def _scan(source: str):
  """(accessed private names, names of private methods defined in classes,
  private modules imported) of one file's source."""
  accessed, defined, imported = set(), set(), set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Attribute) and _private(node.attr):
      if not (isinstance(node.value, ast.Name) and
              node.value.id in ("self", "cls")):
        accessed.add(node.attr)
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and
          node.func.id in _GETTERS and len(node.args) >= 2 and
          isinstance(node.args[1], ast.Constant) and
          isinstance(node.args[1].value, str) and
          _private(node.args[1].value)):
      accessed.add(node.args[1].value)
    elif isinstance(node, ast.ClassDef):
      defined.update(item.name for item in node.body
                     if isinstance(item, ast.FunctionDef) and
                     _private(item.name))
    elif isinstance(node, ast.Import):
      imported.update(a.name for a in node.names
                      if a.name.startswith(_PRIVATE_MODULES))
    elif isinstance(node, ast.ImportFrom) and node.module:
      if node.module.startswith(_PRIVATE_MODULES):
        imported.update(f"{node.module}.{a.name}" for a in node.names)
  return accessed, defined, imported


def _files():
  for tree in _TREES:
    for path in sorted((_ROOT / tree).rglob("*.py")):
      yield str(path.relative_to(_ROOT)), path.read_text()


def _keras_tf_bases():
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return (keras.layers.Layer, keras.Model, keras.Sequential,
          keras.optimizers.Optimizer, keras.metrics.Metric,
          keras.losses.Loss, keras.callbacks.Callback, keras.Variable,
          keras.initializers.Initializer,
          keras.optimizers.schedules.LearningRateSchedule,
          keras.layers.BatchNormalization, keras.layers.Dense,
          keras.layers.EinsumDense, keras.layers.Embedding, tf.Variable,
          tf.Module, tf.__internal__.tracking.Trackable,
          tf.__internal__.tracking.AutoTrackable, tf.distribute.Strategy)


class PrivateApiTest(absltest.TestCase):

  def test_every_listed_name_exists_in_the_installed_versions(self):
    gone = [f"{use.owner}.{use.name} ({', '.join(use.where)}): {why}"
            for use in private_api.USES
            for why in [private_api.missing(use)] if why]
    self.assertEqual(gone, [], "private Keras/TensorFlow names tfdist uses "
                     "are gone in this version: adapt the files named and "
                     "tfdist/runtime/private_api.py")

  def test_the_variable_attributes_stage3_replaces_are_on_a_variable(self):
    # The instance attributes ZeRO stage 3 and the pipeline set, on a real
    # Keras variable (set in __init__, so absent from the class).
    import keras  # pylint: disable=g-import-not-at-top
    variable = keras.Variable([1.0, 2.0])
    for name in ("_value", "_initializer", "_autocast", "_shared_name",
                 "_initialize", "_direct_assign", "_serialize_to_tensors",
                 "_restore_from_tensors"):
      self.assertTrue(hasattr(variable, name), name)
    layer = keras.layers.Dropout(0.5)
    self.assertTrue(layer._seed_generators)  # pylint: disable=protected-access
    self.assertIn(layer, private_api.flatten_layers(layer))

  def test_entries_are_well_formed(self):
    for use in private_api.USES:
      self.assertIn(use.access, private_api.ACCESSES, use)
      self.assertTrue(use.purpose and use.where, use)
      self.assertTrue(use.name, use)

  def test_every_listed_file_still_uses_its_name(self):
    stale = []
    for use in private_api.USES:
      needle = use.name
      for where in use.where:
        path = _ROOT / where
        if not path.exists() or needle not in path.read_text():
          stale.append(f"{where} no longer uses {use.owner}.{needle}")
    self.assertEqual(stale, [], "drop these files from their entries in "
                     "tfdist/runtime/private_api.py")

  def test_no_unlisted_private_use_in_the_tree(self):
    # Each use must be listed with its file: a listed name used in a file
    # the entry does not name is a new use too.
    names, modules = {}, {}
    for use in private_api.USES:
      names.setdefault(use.name, set()).update(use.where)
      module = use.owner.split(":")[0]
      modules.setdefault(module, set()).update(use.where)
      modules.setdefault(f"{module}.{use.name}", set()).update(use.where)
    overridable = set()
    for base in _keras_tf_bases():
      overridable.update(n for n in dir(base) if _private(n))
    unlisted = []
    for where, source in _files():
      if where == "tfdist/runtime/private_api.py":
        continue
      accessed, defined, imported = _scan(source)
      for name in sorted(accessed):
        if (where not in names.get(name, ()) and
            name not in private_api.TFDIST_OWN and
            not name.startswith(private_api.TFDIST_PREFIX)):
          unlisted.append(f"{where}: reads or sets {name}")
      for name in sorted(defined & overridable):
        if where not in names.get(name, ()):
          unlisted.append(f"{where}: overrides Keras/TensorFlow's {name}")
      for module in sorted(imported):
        if where not in modules.get(module, ()):
          unlisted.append(f"{where}: imports {module}")
    self.assertEqual(
        unlisted, [], "private Keras/TensorFlow uses not fenced: list each "
        "in tfdist/runtime/private_api.py USES (owner, name, purpose, file), "
        "or, if the name is tfdist's own, in its TFDIST_OWN")

  def test_tfdist_own_names_are_still_used(self):
    used = set()
    for _, source in _files():
      used |= _scan(source)[0]
    self.assertEqual(set(private_api.TFDIST_OWN) - used, set(),
                     "remove these from TFDIST_OWN")

  def test_the_scan_finds_what_it_must(self):
    # The second check's own proof: each kind of use is seen.
    accessed, defined, imported = _scan(
        "from tensorflow.python.ops import array_ops\n"
        "import keras.src.utils\n"
        "class A(B):\n"
        "  def _moments(self):\n"
        "    self._ok = 1\n"
        "x = layer._new_private\n"
        "y = getattr(v, '_other', None)\n"
        "z = a.__dict__\n")
    self.assertEqual(accessed, {"_new_private", "_other"})
    self.assertEqual(defined, {"_moments"})
    self.assertEqual(imported, {"tensorflow.python.ops.array_ops",
                                "keras.src.utils"})

  def test_the_module_imports_no_tensorflow(self):
    source = (_ROOT / "tfdist/runtime/private_api.py").read_text()
    _, _, imported = _scan(source)
    tree = ast.parse(source)
    top = {a.name for node in tree.body if isinstance(node, ast.Import)
           for a in node.names}
    top |= {node.module for node in tree.body
            if isinstance(node, ast.ImportFrom)}
    self.assertFalse({"tensorflow", "keras"} & top, top)
    self.assertEqual(imported, set())


if __name__ == "__main__":
  absltest.main()
