"""The modules of tfdist/, models/ and flags/ import each other one way,
and their floors read bottom-up (`FLOORS`).

Every import counts: at module level and inside functions (a lazy import
hides a cycle, it does not remove it). A package's own `__init__.py` is not
a node: importing any module imports it first anyway. Importing a package
whose `__init__.py` re-exports its modules' names (a facade, such as
`tfdist.training.controller`) counts as importing those modules.
"""

import ast
import json
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest

from tests import bazel_targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("tfdist", "models", "flags")
# Module names are built, not written out: a literal dotted name would read
# as a module this test runs (tests/bazel_targets.py).
WIRING = f"{PACKAGES[0]}.experiment"  # the assembly package
CONTROLLER = f"{PACKAGES[0]}.training.controller.loop"
# Entry points: the binaries (the Ray binary's through the part that runs
# on each Ray worker, tfdist.cloud.ray_worker), and `tfdist.fit` (tfdist.api), the
# Python API's edge, which runs the wiring as the binaries do.
BINARIES = (f"{PACKAGES[0]}.train", f"{PACKAGES[0]}.cloud.ray_worker",
            f"{PACKAGES[0]}.api")


def _module_files(root: str, package: str) -> list:
  """The package's module files (subpackages too), as paths from `root`."""
  found = []
  for folder, dirs, names in os.walk(os.path.join(root, package)):
    dirs[:] = sorted(d for d in dirs if d != "__pycache__")
    for name in sorted(names):
      if name.endswith(".py") and name != "__init__.py":
        found.append(os.path.relpath(os.path.join(folder, name), root))
  return found


def _edges(root: str, relpath: str, roots, module: str) -> set:
  """The first-party modules `relpath` (the module `module`) imports."""
  edges = set()
  for dotted, files in bazel_targets.module_imports(root, relpath, roots):
    if dotted == WIRING:
      # The assembly package itself: its `__init__.py` names its modules
      # for the binaries.
      edges.add(WIRING)
    elif (files and files[-1].endswith("__init__.py") and
          files[-1].count(os.sep) > 1 and files[-1] != relpath):
      # A facade package below the top ones: the modules its `__init__.py`
      # imports from inside itself.
      inside = os.path.dirname(files[-1])
      edges |= {m for m in _edges(root, files[-1], roots, module)
                if m.replace(".", os.sep).startswith(inside + os.sep)}
    for path in files:
      if path.endswith("__init__.py") or not path.endswith(".py"):
        continue
      target = path[:-3].replace(os.sep, ".")
      if target.split(".")[0] in PACKAGES and target != module:
        edges.add(target)
  return edges


def import_graph(root: str = ROOT) -> dict:
  """`{module: {module it imports}}` over the first-party packages (and the
  assembly package, `WIRING`, as a node of its own)."""
  roots = bazel_targets.first_party_roots(root)
  graph = {WIRING: _edges(root, os.path.join(*WIRING.split("."),
                                             "__init__.py"), roots, WIRING)}
  for package in PACKAGES:
    for relpath in _module_files(root, package):
      module = relpath[:-3].replace(os.sep, ".")
      graph[module] = _edges(root, relpath, roots, module)
  return graph


def find_cycles(graph: dict) -> list:
  """Every elementary cycle found by depth-first search, as module lists."""
  cycles, state, stack = [], {}, []

  def visit(node):
    state[node] = "active"
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "active":
        cycles.append(stack[stack.index(nxt):] + [nxt])
      elif nxt not in state:
        visit(nxt)
    stack.pop()
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node)
  return cycles


def _wiring(graph: dict) -> set:
  """The assembly package and its modules."""
  return {m for m in graph if m == WIRING or m.startswith(WIRING + ".")}


# The floors by folder, bottom-up (issue 43: config < parts < training <
# backends and assembly < entry points): each module imports from its own
# floor and those below, wherever it lives and whatever it imports (no
# exception for a module that imports nothing first-party). The first
# prefix that matches gives the floor.
_T = PACKAGES[0]
FLOORS = (
    # The vocabulary every floor uses: the errors and exit statuses.
    (f"{_T}.errors", 0),
    (f"{_T}.exit_codes", 0),
    # The configuration, and the names and registries it validates against
    # (optimizers, decay schedules, models and data sets, strategy kinds).
    (f"{_T}.core", 1),
    (f"{_T}.config", 1),
    (f"{_T}.config_tree", 1),
    # The parts of a run.
    (f"{_T}.cloud.hptune", 2),
    (f"{_T}.runtime", 2),
    (f"{_T}.observability", 2),
    (f"{_T}.data", 2),
    (f"{_T}.distribute", 2),
    # Training, its parallel modes and the models.
    (f"{_T}.training", 3),
    (f"{_T}.parallel", 3),
    (PACKAGES[1], 3),  # models
    # The backends and the run's assembly.
    (f"{_T}.backends", 4),
    (WIRING, 4),
    # The edges: binaries, `tfdist.fit`, job specs, Ray's workers,
    # diagnose, flags.
    (_T, 5),
    (PACKAGES[2], 5),
)
# At most this many imports point up the floors (issue 43: "floors that
# read bottom-up"), with no exceptions by name.
MAX_UPWARD_IMPORTS = 3


def floors(graph: dict) -> dict:
  """`{module: floor}` for every module of `graph`."""
  out = {}
  for module in graph:
    for prefix, floor in FLOORS:
      if module == prefix or module.startswith(prefix + "."):
        out[module] = floor
        break
    else:
      raise AssertionError(f"{module} is on no floor: add it to FLOORS.")
  return out


def upward_imports(graph: dict) -> list:
  """`[(importer, imported)]` whose floor is above the importer's."""
  floor = floors(graph)
  return sorted((a, b) for a, edges in graph.items() for b in edges
                if floor[b] > floor[a])


ERRORS_MODULE = os.path.join(PACKAGES[0], "errors.py")


def error_classes(root: str = ROOT) -> set:
  """The class names `tfdist/errors.py` defines."""
  with open(os.path.join(root, ERRORS_MODULE)) as f:
    tree = ast.parse(f.read())
  return {node.name for node in tree.body if isinstance(node, ast.ClassDef)}


def error_homes_outside(root: str = ROOT) -> list:
  """`path:line: what` for each place outside `tfdist/errors.py` that
  defines an exception class or binds an error class of tfdist.errors to a
  module-level name (an import of one by name, `X = errors.X`), so that
  `other_module.ConfigError` would work: the old-name re-exports."""
  names = error_classes(root)
  found = []
  for package in PACKAGES:
    for folder, dirs, files in os.walk(os.path.join(root, package)):
      dirs[:] = sorted(d for d in dirs if d != "__pycache__")
      for name in sorted(files):
        path = os.path.join(folder, name)
        rel = os.path.relpath(path, root)
        if not name.endswith(".py") or rel == ERRORS_MODULE:
          continue
        with open(path) as f:
          tree = ast.parse(f.read())
        for node in ast.walk(tree):
          if isinstance(node, ast.ClassDef) and any(
              (getattr(base, "id", None) or getattr(base, "attr", "")
               ).endswith(("Error", "Exception")) for base in node.bases):
            found.append(f"{rel}:{node.lineno}: defines {node.name}")
        for node in tree.body:  # module level
          if isinstance(node, ast.ImportFrom):
            for alias in node.names:
              if alias.name in names:
                found.append(f"{rel}:{node.lineno}: imports {alias.name} "
                             f"from {node.module}")
          elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            value = node.value
            if (getattr(value, "id", None) or
                getattr(value, "attr", None)) in names:
              found.append(f"{rel}:{node.lineno}: binds "
                           f"{ast.unparse(value)} to a module name")
  return found


class ErrorsHaveOneHomeTest(absltest.TestCase):
  """`tfdist.errors` is the one module that defines or exports the error
  classes: everything else says `errors.ConfigError`, so there is one
  name for each (no `tfdist.config.ConfigError`)."""

  def test_no_other_module_defines_or_re_exports_an_error(self):
    self.assertIn("ConfigError", error_classes())
    found = error_homes_outside()
    self.assertEqual(found, [], "\n".join(found))

  def test_a_re_export_is_found(self):
    root = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    for package in PACKAGES:
      os.makedirs(os.path.join(root, package))
    with open(os.path.join(root, ERRORS_MODULE), "w") as f:
      f.write("class ConfigError(ValueError):\n  pass\n")
    with open(os.path.join(root, PACKAGES[0], "config.py"), "w") as f:
      f.write("from tfdist import errors\n"
              "from tfdist.errors import ConfigError\n"
              "OldName = errors.ConfigError\n"
              "class OwnError(ValueError):\n  pass\n"
              "def f():\n  raise errors.ConfigError('fine')\n")
    path = os.path.join(PACKAGES[0], "config.py")
    self.assertEqual(error_homes_outside(root), [
        f"{path}:4: defines OwnError",
        f"{path}:2: imports ConfigError from tfdist.errors",
        f"{path}:3: binds errors.ConfigError to a module name"])


class ImportCycleTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # The tree's graph, read once for the class (seconds: every module
    # parsed); each test gets its own copy.
    cls._graph = import_graph()

  def _tree_graph(self) -> dict:
    return {module: set(edges) for module, edges in self._graph.items()}

  def test_no_import_cycle(self):
    graph = self._tree_graph()
    wiring = _wiring(graph)
    self.assertIn(f"{WIRING}.runner", wiring)
    self.assertIn(CONTROLLER, set().union(*(graph[m] for m in wiring)))
    cycles = find_cycles(graph)
    self.assertEqual(cycles, [], "\n".join(" -> ".join(c) for c in cycles))

  def test_nothing_imports_the_wiring_back(self):
    graph = self._tree_graph()
    wiring = _wiring(graph)
    importers = sorted(m for m, edges in graph.items()
                       if m not in wiring and edges & wiring)
    # Only the binaries' edge runs the wiring (through the package's
    # `__init__.py`, which names its modules).
    self.assertEqual(importers, sorted(BINARIES))

  def test_floors_read_bottom_up(self):
    upward = upward_imports(self._tree_graph())
    self.assertLessEqual(
        len(upward), MAX_UPWARD_IMPORTS,
        "imports pointing up the floors:\n" +
        "\n".join(f"{a} -> {b}" for a, b in upward))

  def test_an_upward_import_is_found(self):
    graph = {"tfdist.config": {"tfdist.errors"},
             "tfdist.training.x": {"tfdist.errors"},
             "tfdist.training.y": {"tfdist.training.x", "tfdist.config"},
             "tfdist.errors": set()}
    self.assertEqual(upward_imports(graph), [])
    # A module that imports nothing first-party keeps its folder's floor.
    self.assertEqual(floors(graph)["tfdist.training.x"], 3)
    graph["tfdist.config"] = {"tfdist.training.x"}
    self.assertEqual(upward_imports(graph),
                     [("tfdist.config", "tfdist.training.x")])

  def test_importing_a_facade_package_imports_its_modules(self):
    root = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    pkg = os.path.join(root, PACKAGES[0], "training", "loop")
    os.makedirs(pkg)
    files = {
        os.path.join(root, PACKAGES[0], "__init__.py"): "",
        os.path.join(root, PACKAGES[0], "training", "__init__.py"): "",
        os.path.join(pkg, "__init__.py"):
            "from tfdist.training.loop.core import Loop\n",
        os.path.join(pkg, "core.py"): "from tfdist import config\n",
        os.path.join(root, PACKAGES[0], "config.py"): "",
        os.path.join(root, PACKAGES[0], "user.py"):
            "from tfdist.training import loop\n",
    }
    for path, text in files.items():
      with open(path, "w") as f:
        f.write(text)
    edges = _edges(root, os.path.join(PACKAGES[0], "user.py"), [PACKAGES[0]],
                   f"{PACKAGES[0]}.user")
    self.assertEqual(edges, {f"{PACKAGES[0]}.training.loop.core"})

  def test_cycle_finder_finds_a_cycle(self):
    self.assertEqual(find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}),
                     [["a", "b", "c", "a"]])
    self.assertEqual(find_cycles({"a": {"b"}, "b": set()}), [])


# Modules that processes without a training run import: the launcher, flag
# parsing and config checks, the job-spec writers, tfdist.ray (whose
# `setup_local_worker_process` runs in every process of a local Ray
# cluster, Ray's own actors included), and the light options modules of
# the parallel packages. None may start TensorFlow (4-5 s of CPU and
# hundreds of MiB in each such process).
LIGHT_MODULES = (
    "tfdist", "tfdist.config", "tfdist.flags", "tfdist.launch",
    "tfdist.ray", "tfdist.cloud.vertex_spec", "tfdist.cloud.tfjob_spec",
    "tfdist.parallel.pipeline.options", "tfdist.parallel.tensor.options",
    "tfdist.parallel.experts.options", "tfdist.parallel.zero3",
    "tfdist.distribute.worker_exit")


def _run_python(code: str) -> subprocess.CompletedProcess:
  """`python -c code` from the repository root, in a fresh process."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, timeout=120, cwd=root,
                        env={**os.environ, "PYTHONPATH": root})


class LightModulesTest(absltest.TestCase):

  def test_light_modules_import_no_tensorflow(self):
    code = ("import importlib, json, sys\n"
            "out = {}\n"
            f"for name in {LIGHT_MODULES!r}:\n"
            "  importlib.import_module(name)\n"
            "  out[name] = sorted(m for m in ('tensorflow', 'keras')\n"
            "                     if m in sys.modules)\n"
            "print(json.dumps(out))\n")
    proc = _run_python(code)
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    # Cumulative: every module from the first that pulls TensorFlow in.
    self.assertEqual({k: v for k, v in loaded.items() if v}, {})

  def test_a_bad_flag_exits_before_tensorflow_starts(self):
    # tfdist.train imported TensorFlow at its top, so every refused flag
    # cost TensorFlow's start-up (about 4 s of CPU) before the message.
    code = ("import runpy, sys\n"
            "sys.argv = ['tfdist.train', '--train_steps=-3',\n"
            "            '--model_dir=/nonexistent/run']\n"
            "try:\n"
            "  runpy.run_module('tfdist.train', run_name='__main__')\n"
            "except SystemExit as e:\n"
            "  print(e.code, 'tensorflow' in sys.modules)\n")
    proc = _run_python(code)
    self.assertIn("--train_steps=-3", proc.stderr)
    self.assertEqual(proc.stdout.split()[-2:], ["2", "False"], proc.stderr)

  def test_a_package_attribute_that_is_a_submodule_imports_only_it(self):
    # `from tfdist.parallel.pipeline import options` once answered the
    # attribute through the package's __getattr__ by importing its
    # TensorFlow module (stages) first.
    from tfdist import parallel  # pylint: disable=g-import-not-at-top
    with self.assertRaises(AttributeError):
      parallel.attribute_of("tfdist.parallel.pipeline", "stages", "options")
    with self.assertRaises(AttributeError):
      parallel.attribute_of("tfdist.parallel.pipeline", "stages",
                            "__wrapped__")
    # A name of the module is read once, then kept on the package.
    from tfdist.parallel import zero3  # pylint: disable=g-import-not-at-top
    self.assertIs(zero3.replicated_variables,
                  zero3.optimizer.replicated_variables)
    self.assertIn("replicated_variables", vars(zero3))


if __name__ == "__main__":
  absltest.main()
