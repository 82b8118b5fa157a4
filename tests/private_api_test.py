"""The fence around tfdist's private Keras/TensorFlow uses
(`tfdist.runtime.private_api`).

* Every listed name still exists on its owner in the installed
  TensorFlow/Keras (this file is marked `compat`: it also runs on TF 2.17).
  A name tfdist calls or overrides must still be a method or function
  taking the parameters the entry lists. The failure names the entry, the
  versions and what in tfdist breaks (the entry's purpose).
* No file of `tfdist/` or `models/` uses a private Keras/TensorFlow name the
  list does not hold: attributes read on anything but `self`/`cls`
  (`x._name`, `getattr(x, "_name")`, any string that is a private name, as
  code keeps one for a later `getattr`), methods overriding a private one
  of a Keras/TensorFlow base class, imports of `tensorflow.python`,
  `tensorflow.core` or `keras.src` and each name read from such a module,
  `tf.__internal__` names; in a class that subclasses a Keras/TensorFlow
  class, also `self._name` where a Keras/TensorFlow class above it has that
  name (in its class, or as `self._name` in its source: an attribute it
  sets); and every file the list names still uses its name.
"""

import ast
import functools
import importlib
import inspect
import pathlib
import re

from absl.testing import absltest
import pytest

from tfdist.runtime import private_api

pytestmark = pytest.mark.compat

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_TREES = ("tfdist", "models")
_PRIVATE_MODULES = ("tensorflow.python", "tensorflow.core", "keras.src")
_INTERNAL = re.compile(r"__internal__(\.\w+){1,2}$")
_IDENTIFIER = re.compile(r"_+[A-Za-z][A-Za-z0-9_]*")


def _private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def _scan(source: str):
  """(accessed private names, names of private methods defined in classes,
  private modules imported and the names read from them or from
  `tf.__internal__`) of one file's source."""
  accessed, defined, imported = set(), set(), set()
  tree = ast.parse(source)
  aliases = _private_module_aliases(tree)
  # The literal pieces of f-strings (`f"{name}_kernel"`) are no names.
  pieces = {id(value) for node in ast.walk(tree)
            if isinstance(node, ast.JoinedStr) for value in node.values}
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and
        isinstance(node.value, ast.Name) and node.value.id in aliases):
      imported.add(f"{aliases[node.value.id]}.{node.attr}")
    if isinstance(node, ast.Attribute):
      # `tf.__internal__.tracking.Trackable`: TensorFlow's internal API.
      internal = _INTERNAL.search(ast.unparse(node))
      if internal:
        imported.add(f"tensorflow.{internal.group(0)}")
    if isinstance(node, ast.Attribute) and _private(node.attr):
      if not (isinstance(node.value, ast.Name) and
              node.value.id in ("self", "cls")):
        accessed.add(node.attr)
    elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and
          id(node) not in pieces and _IDENTIFIER.fullmatch(node.value) and
          _private(node.value)):
      # `getattr(x, "_name")`, or a name kept in a string for later
      # `getattr`/`setattr` calls.
      accessed.add(node.value)
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


def _private_module_aliases(tree) -> dict:
  """{local name: private module} of a file's imports of whole modules."""
  aliases = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      aliases.update((a.asname or a.name, a.name) for a in node.names
                     if a.name.startswith(_PRIVATE_MODULES))
    elif (isinstance(node, ast.ImportFrom) and node.module and
          node.module.startswith(_PRIVATE_MODULES)):
      aliases.update((a.asname or a.name, f"{node.module}.{a.name}")
                     for a in node.names)
  return aliases


def _module_name(where: str) -> str:
  name = where[:-len(".py")].replace("/", ".")
  name = name[:-len(".__init__")] if name.endswith(".__init__") else name
  # models/ is installed and imported as tfdist.models.
  return f"tfdist.{name}" if name.startswith("models") else name


def _keras_tf_ancestors(cls) -> list:
  return [base for base in cls.__mro__[1:]
          if base.__module__.split(".")[0] in ("keras", "tensorflow")]


def _names_in_class(node: ast.ClassDef) -> set:
  """Private names a class body defines or reads/sets on `self`/`cls`."""
  names = {item.name for item in node.body
           if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
  names |= {target.id for item in node.body if isinstance(item, ast.Assign)
            for target in item.targets if isinstance(target, ast.Name)}
  names |= {n.attr for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and
            isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")}
  return {name for name in names if _private(name)}


def _inherited_uses(where: str, source: str) -> set:
  """(class, name) of each private name a class of the file uses that a
  Keras/TensorFlow class above it has: an attribute of that class, or an
  attribute its source sets or reads on `self`. A file that imports an
  optional extra not installed here (`ray` on TF 2.17) is scanned where
  it is installed."""
  classes = {node.name: names for node in ast.parse(source).body
             if isinstance(node, ast.ClassDef) and node.bases
             for names in [{name for name in _names_in_class(node)
                            if not name.startswith(
                                private_api.TFDIST_PREFIX)}] if names}
  if not classes:
    return set()
  try:
    module = importlib.import_module(_module_name(where))
  except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] in ("tfdist", "keras", "tensorflow"):
      raise
    return set()
  uses = set()
  for cls, names in classes.items():
    ancestors = _keras_tf_ancestors(getattr(module, cls))
    for name in names if ancestors else ():
      pattern = re.compile(rf"\bself\.{name}\b")
      if any(name in vars(base) or pattern.search(_source(base))
             for base in ancestors):
        uses.add((cls, name))
  return uses


@functools.lru_cache(maxsize=None)
def _source(cls) -> str:
  try:
    return inspect.getsource(cls)
  except (OSError, TypeError):
    return ""


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
    import keras  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    versions = f"TensorFlow {tf.__version__}, Keras {keras.__version__}"
    gone = [f"{use.access} {use.owner}.{use.name} on {versions}: {why}. "
            f"Breaks: {use.purpose} ({', '.join(use.where)})"
            for use in private_api.USES
            for why in [private_api.missing(use)] if why]
    self.assertEqual(gone, [], "private Keras/TensorFlow names tfdist uses "
                     "are gone or changed in this version: adapt the files "
                     "named and tfdist/runtime/private_api.py")

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
      owner = use.owner.replace(":", ".")
      for key in (module, f"{module}.{use.name}", owner,
                  f"{owner}.{use.name}"):
        modules.setdefault(key, set()).update(use.where)
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
      for cls, name in sorted(_inherited_uses(where, source)):
        if where not in names.get(name, ()):
          unlisted.append(f"{where}: {cls} uses or shadows its Keras/"
                          f"TensorFlow base's {name}")
    self.assertEqual(
        unlisted, [], "private Keras/TensorFlow uses not fenced: list each "
        "in tfdist/runtime/private_api.py USES (owner, name, purpose, file), "
        "or, if the name is tfdist's own, in its TFDIST_OWN")

  def test_overrides_take_the_listed_parameters(self):
    # What `missing` checks against Keras/TensorFlow, checked against
    # tfdist's own definitions: each override in the files named.
    wrong = []
    for use in private_api.USES:
      if use.access != "override" or use.params is None:
        continue
      found = [node for where in use.where
               for node in ast.walk(ast.parse((_ROOT / where).read_text()))
               if isinstance(node, ast.FunctionDef) and node.name == use.name]
      taken = {tuple(a.arg for a in node.args.args[1:]) for node in found}
      if taken != {use.params}:
        wrong.append(f"{use.name} in {', '.join(use.where)} takes "
                     f"{sorted(taken)}, the list says {use.params}")
    self.assertEqual(wrong, [])

  def test_the_docs_example_entry_is_listed_and_holds(self):
    page = (_ROOT / "docs/reference/packaging.md").read_text()
    example = re.search(
        r"<!-- run: tests/private_api_test.py entry-example -->\n"
        r"```python\n(.*?)```", page, re.S).group(1)
    scope = {}
    code = compile(example, "docs/reference/packaging.md (entry-example)",
                   "exec")
    exec(code, scope)  # pylint: disable=exec-used
    self.assertIn(scope["entry"], private_api.USES)
    self.assertIsNone(private_api.missing(scope["entry"]))

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
        "FIELDS = ('best', '_kept_for_setattr', 'not _a name', '_')\n"
        "w = f'{name}_kernel'\n"
        "z = a.__dict__\n")
    self.assertEqual(accessed,
                     {"_new_private", "_other", "_kept_for_setattr"})
    self.assertEqual(defined, {"_moments"})
    self.assertEqual(imported, {"tensorflow.python.ops.array_ops",
                                "keras.src.utils"})
    _, _, imported = _scan(
        "from tensorflow.python.eager import context as context_lib\n"
        "import keras.src.backend as kb\n"
        "context_lib.context().x\n"
        "kb.any_name\n"
        "tf.__internal__.tracking.Trackable\n")
    self.assertEqual(imported, {"tensorflow.python.eager.context",
                                "tensorflow.python.eager.context.context",
                                "keras.src.backend",
                                "keras.src.backend.any_name",
                                "tensorflow.__internal__.tracking",
                                "tensorflow.__internal__.tracking.Trackable"})

  def test_the_subclass_scan_finds_inherited_privates(self):
    # A Keras subclass reading a private attribute its base sets in
    # __init__ (`_reduction_axes`), calling an inherited private method
    # (`_track_variable`) or overriding one, and its own private name.
    source = (_ROOT / "models/batch_norm.py").read_text()
    self.assertIn(("BatchNormalization", "_reduction_axes"),
                  _inherited_uses("models/batch_norm.py", source))
    self.assertIn(("BatchNormalization", "_moments"),
                  _inherited_uses("models/batch_norm.py", source))
    source = (_ROOT / "tfdist/parallel/experts/layer.py").read_text()
    uses = _inherited_uses("tfdist/parallel/experts/layer.py", source)
    self.assertIn(("MixtureOfExperts", "_track_variable"), uses)
    self.assertNotIn(("MixtureOfExperts", "_num_local_experts"), uses)

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
