"""Checks that the Bazel BUILD files cover the source tree, without Bazel.

Reads every BUILD file of the workspace as Python syntax (Starlark's BUILD
dialect is a subset) and reports, as one line each:

  * a test file under tests/ (`*_test.py`, `test_*.py`) that no `py_test`
    target runs: `bazel test //tests/...` would skip it;
  * a test file that two targets run (the suite would pay for it twice);
  * a "small" `tfdist_py_test` in a package that has a
    `tfdist_py_test_group`: unit tests join the group, which runs them all
    in one process (one TensorFlow start-up instead of one per file);
  * where a package has a `tfdist_py_test_compat` (the `compat` tests in
    TensorFlow 2.17), a test file that marks tests `compat` but is not in
    its `srcs`, or one in its `srcs` that marks none;
  * a target whose `srcs` or `main` names a file that is gone, or whose
    `deps` name a target that does not exist;
  * a Python file of a first-party package (a top-level folder with an
    `__init__.py`: tfdist/, models/, flags/, tests/), or directly in another
    package folder (benchmarks/), that is in no target (pytest's
    conftest.py files excepted: they travel as data);
  * an import of a first-party module (at module level or inside a
    function), or a string naming one (`"-m", "tfdist.train"`: a module run
    in a subprocess), that the target does not reach through its `deps`:
    it passes under pytest and fails under Bazel, whose runfiles hold only
    what the deps name. A lazy import back into a target that depends on
    the importer (a cycle deps cannot express) is accepted. A package
    attribute that the package's `__getattr__` imports lazily (`tfdist.fit`
    imports tfdist.api) counts as an import of that module, and a test's
    imports include those of the docs' Python blocks it runs (marked
    `<!-- run: tests/X_test.py NAME -->`, see tests/docs_test.py);
  * a test target without the docs pages its file reads (the blocks it
    runs, or a page it names in a string) in its `data`: the sandbox
    holds only those.

For a test file without a target it suggests what to add with the deps its
imports need: its name in the group's `srcs` where the package has a group,
else a `tfdist_py_test` stanza.

Usage:
  python -m tests.bazel_targets [WORKSPACE_ROOT]      check; exit 1 on problems
  python -m tests.bazel_targets --list-tests=SIZE[,SIZE...] [WORKSPACE_ROOT]
      print the test files whose targets have one of those sizes (a
      group's files count with the size of their own targets, "small");
      what tools/test.sh's TFDIST_PYTEST=small gives pytest

//tests:bazel_targets_test runs the check on the workspace, under pytest and
under `bazel test` (there on the runfiles, which carry every BUILD and .py
file through the `build_inputs` filegroups).
"""

import ast
import dataclasses
import fnmatch
import os
import re
import sys
import textwrap
from typing import Dict, Iterable, List, Optional, Set, Tuple

# Rules whose `srcs` are Python files that Bazel puts on the import path.
PY_RULES = ("py_library", "py_binary", "py_test")
# The test macro of //tests:defs.bzl: `name` runs `<package>/<name>.py`
# with //tests:pytest_main.py and always depends on //tests:init.
TEST_MACRO = "tfdist_py_test"
TEST_MACRO_MAIN = "tests/pytest_main.py"
TEST_MACRO_DEPS = ("//tests:init",)
# The group macro of //tests:defs.bzl: runs every file of `srcs` in one
# pytest process, with the same entry point and deps.
TEST_GROUP_MACRO = "tfdist_py_test_group"
# The group also declares one "manual" target per file, named after it (run
# alone with `bazel test //tests:<name>`; `bazel test //tests/...` skips
# it). Its files and imports are checked on these per-file targets.
TEST_GROUP_MEMBER = "tfdist_py_test_group member"
# The compat macro of //tests:defs.bzl: the `compat` tests of its files once
# more, in another virtual environment (TensorFlow 2.17). Its files are run
# by other targets too, so it does not count as their runner.
TEST_COMPAT_MACRO = "tfdist_py_test_compat"
COMPAT_MARK = re.compile(r"pytest\.mark\.compat\b")
# Compat tests that run several processes at once are also marked
# `cluster`; a compat target whose marker expression selects them ("compat
# and cluster", not "... and not cluster") runs them apart from the rest.
CLUSTER_MARK = re.compile(r"pytest\.mark\.cluster\b")
CLUSTER_SELECTED = re.compile(r"(?<!not )\bcluster\b")
TEST_KINDS = ("py_test", TEST_MACRO, TEST_GROUP_MACRO)
# Rules whose `srcs` (and imports) this check reads.
SOURCE_RULES = PY_RULES + (TEST_MACRO, TEST_GROUP_MEMBER, TEST_COMPAT_MACRO)
TEST_FILE_PATTERNS = ("*_test.py", "test_*.py")
SKIP_DIRS = (".git", ".venv", "third_party", "node_modules", "__pycache__")


@dataclasses.dataclass
class Target:
  """One rule call in a BUILD file, with its files as workspace paths."""
  label: str
  kind: str
  build_file: str
  srcs: List[str] = dataclasses.field(default_factory=list)
  deps: List[str] = dataclasses.field(default_factory=list)
  main: Optional[str] = None
  size: Optional[str] = None
  # The BUILD variable that `srcs` names (`srcs = UNIT_TESTS`), if any.
  srcs_variable: Optional[str] = None
  # A compat target's pytest marker expression (its `marker`).
  marker: Optional[str] = None
  # Its `data` labels, canonical (`//:docs`).
  data: List[str] = dataclasses.field(default_factory=list)


class BuildFileError(ValueError):
  """A BUILD file could not be read as Python syntax."""


def _is_test_file(name: str) -> bool:
  return any(fnmatch.fnmatch(name, p) for p in TEST_FILE_PATTERNS)


def _walk(root: str):
  """os.walk over the workspace, skipping tool and output folders."""
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames
                         if d not in SKIP_DIRS and not d.startswith("bazel-")
                         and not d.startswith("."))
    yield dirpath, dirnames, filenames


def find_packages(root: str) -> List[str]:
  """Workspace-relative folders holding a BUILD file ("" is the root)."""
  packages = []
  for dirpath, _, filenames in _walk(root):
    if "BUILD" in filenames or "BUILD.bazel" in filenames:
      rel = os.path.relpath(dirpath, root)
      packages.append("" if rel == "." else rel)
  return packages


def _glob(root: str, package: str, packages: Set[str], include, exclude):
  """Evaluates `glob(include, exclude)` in `package` like Bazel does."""
  base = os.path.join(root, package)
  found = set()
  for dirpath, dirnames, filenames in _walk(base):
    rel_dir = os.path.relpath(dirpath, base)
    if rel_dir != "." and os.path.join(package, rel_dir).lstrip(
        "/") in packages:
      dirnames[:] = []
      continue
    for name in filenames:
      rel = name if rel_dir == "." else os.path.join(rel_dir, name)
      if (any(_glob_match(rel, p) for p in include)
          and not any(_glob_match(rel, p) for p in exclude)):
        found.add(rel)
  return sorted(found)


def _glob_match(path: str, pattern: str) -> bool:
  """Bazel's glob match: `*` stays within one folder, `**` spans many."""
  if "**" not in pattern and path.count("/") != pattern.count("/"):
    return False
  return fnmatch.fnmatch(path, pattern)


class _Evaluator:
  """Evaluates the literal parts of BUILD expressions (strings, lists, +,
  glob, and names assigned earlier in the file: `UNIT_TESTS = [...]`)."""

  def __init__(self, root, package, packages):
    self.root, self.package, self.packages = root, package, packages
    self.variables = {}

  def value(self, node):
    """Returns a str, a list of str, or None for what it cannot evaluate."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
      return node.value
    if isinstance(node, ast.Name):
      return self.variables.get(node.id)
    if isinstance(node, ast.List):
      items = [self.value(e) for e in node.elts]
      return [i for i in items if isinstance(i, str)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
      left, right = self.value(node.left), self.value(node.right)
      if isinstance(left, list) and isinstance(right, list):
        return left + right
      if isinstance(left, str) and isinstance(right, str):
        return left + right
      return None
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        and node.func.id == "glob"):
      args = [self.value(a) for a in node.args]
      kw = {k.arg: self.value(k.value) for k in node.keywords}
      include = args[0] if args else kw.get("include")
      exclude = args[1] if len(args) > 1 else kw.get("exclude") or []
      if not isinstance(include, list):
        return None
      return _glob(self.root, self.package, self.packages, include, exclude)
    return None


def resolve_label(label: str, package: str) -> Optional[Tuple[str, str]]:
  """`(package, name)` of a label written in `package`; None if external."""
  if label.startswith("@"):
    return None
  if label.startswith("//"):
    pkg, _, name = label[2:].partition(":")
    return pkg, name or os.path.basename(pkg)
  if label.startswith(":"):
    return package, label[1:]
  return package, label


def _canonical(pkg: str, name: str) -> str:
  return f"//{pkg}:{name}"


def short_label(label: str, package: str) -> str:
  """`label` as written in `package`'s BUILD: `:x`, `//pkg` or `//pkg:x`."""
  pkg, _, name = label[2:].partition(":")
  if pkg == package:
    return ":" + name
  if name == os.path.basename(pkg):
    return "//" + pkg
  return label


def parse_build_file(root: str, package: str,
                     packages: Set[str]) -> List[Target]:
  """Reads the rule calls of `package`'s BUILD file.

  Returns:
    The targets, with `srcs` as workspace-relative paths and `deps` as
    canonical labels (`//pkg:name`).

  Raises:
    BuildFileError: the file is not valid Python syntax.
  """
  name = "BUILD" if os.path.exists(
      os.path.join(root, package, "BUILD")) else "BUILD.bazel"
  build_file = os.path.join(package, name)
  with open(os.path.join(root, build_file)) as f:
    text = f.read()
  try:
    tree = ast.parse(text, filename=build_file)
  except SyntaxError as e:
    raise BuildFileError(f"{build_file}:{e.lineno}: cannot parse: {e.msg}")
  ev = _Evaluator(root, package, packages)
  targets = []
  for stmt in tree.body:
    if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Name)):
      ev.variables[stmt.targets[0].id] = ev.value(stmt.value)
      continue
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
      continue
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    target_name = ev.value(kw["name"]) if "name" in kw else None
    if not isinstance(target_name, str):
      continue
    kind = call.func.id
    target = Target(label=_canonical(package, target_name), kind=kind,
                    build_file=build_file)

    def files(attr):
      value = ev.value(kw[attr]) if attr in kw else None
      if isinstance(value, str):
        value = [value]
      out = []
      for item in value or []:
        resolved = resolve_label(item, package)
        if resolved:
          out.append(os.path.join(*[p for p in resolved if p]))
      return out

    def labels(attr):
      value = ev.value(kw[attr]) if attr in kw else None
      out = []
      for item in value or []:
        resolved = resolve_label(item, package)
        if resolved:
          out.append(_canonical(*resolved))
      return out

    target.srcs = files("srcs")
    if isinstance(kw.get("srcs"), ast.Name):
      target.srcs_variable = kw["srcs"].id
    target.deps = labels("deps")
    target.data = labels("data")
    main = files("main")
    target.main = main[0] if main else None
    size = ev.value(kw["size"]) if "size" in kw else None
    target.size = size if isinstance(size, str) else None
    if kind == TEST_MACRO:
      target.srcs = [os.path.join(package, target_name + ".py"),
                     TEST_MACRO_MAIN]
      target.main = TEST_MACRO_MAIN
      target.deps += list(TEST_MACRO_DEPS)
    elif kind == TEST_GROUP_MACRO:
      target.deps += list(TEST_MACRO_DEPS)
      member_size = ev.value(kw["member_size"]) if "member_size" in kw else (
          "small")
      for src in target.srcs:
        targets.append(dataclasses.replace(
            target, label=_canonical(package, os.path.basename(src)[:-3]),
            kind=TEST_GROUP_MEMBER, srcs=[src, TEST_MACRO_MAIN],
            main=TEST_MACRO_MAIN, deps=list(target.deps), size=member_size,
            data=list(target.data)))
      target.srcs.append(TEST_MACRO_MAIN)
      target.main = TEST_MACRO_MAIN
    elif kind == TEST_COMPAT_MACRO:
      marker = ev.value(kw["marker"]) if "marker" in kw else "compat"
      target.marker = marker if isinstance(marker, str) else None
      target.srcs.append(TEST_MACRO_MAIN)
      target.main = TEST_MACRO_MAIN
      target.deps += list(TEST_MACRO_DEPS)
    targets.append(target)
  return targets


def first_party_roots(root: str) -> List[str]:
  """Top-level folders of the workspace that are Python packages."""
  return sorted(d for d in os.listdir(root)
                if d not in SKIP_DIRS and not d.startswith(".")
                and os.path.isfile(os.path.join(root, d, "__init__.py")))


# Packages installed under another name than their folder's (setup.py's
# package_dir; tfdist/__init__.py finds them in a source tree): the module
# `tfdist.models.cnn` is the file models/cnn.py. (Names built, not written
# out: a literal dotted name would read as a module this file runs.)
PACKAGE_ALIASES = {".".join(("tfdist", name)): name
                   for name in ("models", "flags")}


def _unalias(dotted: str) -> str:
  for alias, folder in PACKAGE_ALIASES.items():
    if dotted == alias or dotted.startswith(alias + "."):
      return folder + dotted[len(alias):]
  return dotted


def _module_file(root: str, dotted: str) -> Optional[str]:
  parts = _unalias(dotted).split(".")
  for candidate in (os.path.join(*parts) + ".py",
                    os.path.join(*parts, "__init__.py")):
    if os.path.isfile(os.path.join(root, candidate)):
      return candidate
  return None


_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


def module_imports(root: str, path: str, roots: Iterable[str]) -> List[
    Tuple[str, List[str]]]:
  """First-party modules that `path` imports (at module level or lazily) or
  names in a string of its own (a module run as `python -m tfdist.train`).

  Returns:
    `(dotted_name, files)` pairs: the files that the import runs (the
    `__init__.py` of each enclosing package, then the module), as
    workspace-relative paths; `files` is empty when the module is not in
    the workspace.
  """
  roots = set(roots)
  with open(os.path.join(root, path)) as f:
    trees = [ast.parse(f.read(), filename=path)]
  trees += [ast.parse(code, filename=where)
            for where, code in docs_blocks_run_by(root, path)]
  package_parts = os.path.dirname(path).split(os.sep)
  names = []
  lazy = {r: lazy_attributes(root, r) for r in roots}
  for node in (n for tree in trees for n in ast.walk(tree)):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.attr in lazy.get(node.value.id, {})):
      # `tfdist.fit`: the package's `__getattr__` imports tfdist.api.
      names.append(lazy[node.value.id][node.attr])
    elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
        and _DOTTED.match(node.value)
        and node.value.split(".")[0] in roots
        and _module_file(root, node.value)):
      # A module run by name, as in [sys.executable, "-m", "tfdist.train"].
      names.append(node.value)
    elif isinstance(node, ast.Import):
      names.extend(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        up = package_parts[:len(package_parts) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
      for alias in node.names:
        sub = f"{base}.{alias.name}"
        names.append(sub if _module_file(root, sub) else base)
  out = []
  for name in dict.fromkeys(names):
    if name.split(".")[0] not in roots:
      continue
    parts = _unalias(name).split(".")
    files = []
    for i in range(1, len(parts)):
      init = os.path.join(*parts[:i], "__init__.py")
      if os.path.isfile(os.path.join(root, init)):
        files.append(init)
    module = _module_file(root, name)
    if module:
      files.append(module)
    out.append((name, files if module else []))
  return out


_RUN_BLOCK = r"<!-- run: {path} [^>]*-->\s*\n\s*```(?:python|py)\n(.*?)```"


def docs_blocks_run_by(root: str, path: str) -> List[Tuple[str, str]]:
  """The Python code blocks of README.md and docs/ that the test file
  `path` runs (those marked `<!-- run: <path> NAME -->`, see
  tests/docs_test.py): their imports are the test's imports under Bazel.

  Returns:
    `(page, code)` pairs; empty for a file that runs none.
  """
  if not _is_test_file(os.path.basename(path)):
    return []
  pages = [os.path.join(root, "README.md")]
  for dirpath, _, filenames in _walk(os.path.join(root, "docs")):
    pages += [os.path.join(dirpath, n) for n in sorted(filenames)
              if n.endswith(".md")]
  pattern = re.compile(_RUN_BLOCK.format(path=re.escape(path)), re.S)
  out = []
  for page in pages:
    if os.path.isfile(page):
      with open(page) as f:
        out += [(os.path.relpath(page, root), textwrap.dedent(code))
                for code in pattern.findall(f.read())]
  return out


def docs_pages(root: str) -> List[str]:
  """README.md and every page under docs/, workspace-relative."""
  pages = ["README.md"] if os.path.isfile(
      os.path.join(root, "README.md")) else []
  for dirpath, _, filenames in _walk(os.path.join(root, "docs")):
    pages += [os.path.relpath(os.path.join(dirpath, n), root)
              for n in sorted(filenames) if n.endswith(".md")]
  return pages


def pages_read_by(root: str, path: str, pages: List[str]) -> List[str]:
  """The docs pages (of `pages`) the test file `path` reads: those whose
  blocks it runs, and those a string of its own names by a path ending in
  the page's path under docs/ or the workspace (`"guides/x.md"`,
  `"x.md"` where one page has that name). README.md counts only when
  named with a folder (`"docs/README.md"`) or as the workspace's."""
  out = [page for page, _ in docs_blocks_run_by(root, path)]
  with open(os.path.join(root, path)) as f:
    tree = ast.parse(f.read(), filename=path)
  names = {node.value for node in ast.walk(tree)
           if isinstance(node, ast.Constant) and isinstance(node.value, str)
           and node.value.endswith(".md") and "\n" not in node.value}
  for name in names:
    name = name.lstrip("./")
    found = [p for p in pages
             if p == name or p.endswith("/" + name)]
    if os.path.basename(name) == "README.md" and "/" not in name:
      found = []  # Ambiguous; the README's own tests carry //:docs.
    if len(found) == 1:
      out.append(found[0])
  return list(dict.fromkeys(out))


def lazy_attributes(root: str, package: str) -> Dict[str, str]:
  """The attributes that `package`'s `__init__.py` imports lazily in its
  module `__getattr__` (`if name == "fit": from tfdist import api`), as
  {attribute: the dotted module it imports}; empty without one."""
  init = os.path.join(root, package, "__init__.py")
  if not os.path.isfile(init):
    return {}
  with open(init) as f:
    text = f.read()
  key = (os.path.abspath(init), text)
  if key not in _LAZY_ATTRIBUTES:
    _LAZY_ATTRIBUTES[key] = _lazy_attributes_of(root, init, text)
  return dict(_LAZY_ATTRIBUTES[key])


# lazy_attributes' answers by (`__init__.py` path, its text): module_imports
# asks for every root package once per file it reads (about 2,300 parses of
# the same few files per check of this workspace, a quarter of its time).
# Keyed by the text, so an edited `__init__.py` is read afresh.
_LAZY_ATTRIBUTES: Dict[Tuple[str, str], Dict[str, str]] = {}


def _lazy_attributes_of(root: str, init: str, text: str) -> Dict[str, str]:
  """lazy_attributes of the `__init__.py` at `init`, whose text is `text`."""
  tree = ast.parse(text, filename=init)
  out = {}
  for func in tree.body:
    if not (isinstance(func, ast.FunctionDef) and func.name == "__getattr__"):
      continue
    for branch in (n for n in ast.walk(func) if isinstance(n, ast.If)):
      test = branch.test
      if not (isinstance(test, ast.Compare) and len(test.comparators) == 1):
        continue
      values = [n.value for n in ast.walk(test.comparators[0])
                if isinstance(n, ast.Constant) and isinstance(n.value, str)]
      imported = next((n for n in branch.body
                       if isinstance(n, ast.ImportFrom) and n.module), None)
      if imported:
        module = f"{imported.module}.{imported.names[0].name}"
        if not _module_file(root, module):
          module = imported.module
        out.update(dict.fromkeys(values, module))
  return out


class Workspace:
  """The parsed BUILD files of a workspace and the checks over them."""

  def __init__(self, root: str):
    self.root = root
    self.problems: List[str] = []
    packages = find_packages(root)
    self.packages = packages
    self.targets: Dict[str, Target] = {}
    for package in packages:
      try:
        for target in parse_build_file(root, package, set(packages)):
          self.targets[target.label] = target
      except BuildFileError as e:
        self.problems.append(str(e))
    self.roots = first_party_roots(root)
    # module_imports by file: a unit-test file is in its group's srcs and
    # in its own member target's, read once for both.
    self._imports: Dict[str, List[Tuple[str, List[str]]]] = {}
    self.owners: Dict[str, List[str]] = {}
    for target in self.targets.values():
      if target.kind in SOURCE_RULES:
        for src in target.srcs:
          self.owners.setdefault(src, []).append(target.label)

  def _python_files(self) -> List[str]:
    """.py files that belong in a target: all of each first-party package,
    and those directly in any other package folder but the root (e.g.
    benchmarks/); test files and conftest.py are left to the other checks.
    """
    paths = set()
    for root_dir in self.roots:
      for dirpath, _, filenames in _walk(os.path.join(self.root, root_dir)):
        paths.update(os.path.relpath(os.path.join(dirpath, n), self.root)
                     for n in filenames if n.endswith(".py"))
    for package in self.packages:
      if package:
        paths.update(os.path.join(package, n)
                     for n in os.listdir(os.path.join(self.root, package))
                     if n.endswith(".py"))
    return sorted(p for p in paths if os.path.basename(p) != "conftest.py"
                  and not _is_test_file(os.path.basename(p)))

  def _module_imports(self, path: str) -> List[Tuple[str, List[str]]]:
    """module_imports of `path` in this workspace, read once."""
    if path not in self._imports:
      self._imports[path] = module_imports(self.root, path, self.roots)
    return self._imports[path]

  def _exists(self, path: str) -> bool:
    return os.path.isfile(os.path.join(self.root, path))

  def _closure(self, label: str) -> Set[str]:
    seen, todo = set(), [label]
    while todo:
      current = todo.pop()
      if current in seen or current not in self.targets:
        continue
      seen.add(current)
      todo.extend(self.targets[current].deps)
    return seen

  def _library_for(self, path: str) -> Optional[str]:
    """The smallest py_library holding `path`, to suggest as a dep."""
    libs = [self.targets[l] for l in self.owners.get(path, [])
            if self.targets[l].kind == "py_library"]
    if not libs:
      return None
    best = min(libs, key=lambda t: (len(t.srcs), t.label))
    return best.label

  def test_files(self) -> List[str]:
    """Test files under tests/, workspace-relative."""
    out = []
    base = os.path.join(self.root, "tests")
    for dirpath, _, filenames in _walk(base):
      for name in sorted(filenames):
        if _is_test_file(name):
          out.append(os.path.relpath(os.path.join(dirpath, name), self.root))
    return out

  def group_of(self, package: str) -> Optional[Target]:
    """The `tfdist_py_test_group` of `package` (the first, if several)."""
    groups = sorted((t for t in self.targets.values()
                     if t.kind == TEST_GROUP_MACRO
                     and t.label.startswith(f"//{package}:")),
                    key=lambda t: t.label)
    return groups[0] if groups else None

  def _needed_deps(self, path: str) -> Set[str]:
    """The py_library labels that the imports of `path` need."""
    deps = set()
    for _, files in self._module_imports(path):
      if files:
        lib = self._library_for(files[-1])
        if lib and lib not in TEST_MACRO_DEPS:
          deps.add(lib)
    return deps

  def suggest_group_entry(self, path: str, group: Target) -> str:
    """How the test file `path` joins the unit-test `group`."""
    package = os.path.dirname(path)
    missing = sorted(short_label(d, package)
                     for d in self._needed_deps(path) - set(group.deps))
    name = short_label(group.label, package)
    where = (f"{group.srcs_variable} (the srcs of {name})"
             if group.srcs_variable else f"the srcs of {name}")
    text = (f'add "{os.path.basename(path)}" to {where}, the unit-test '
            "group (one pytest process for all of them)")
    if missing:
      text += " and to its deps: " + ", ".join(f'"{d}"' for d in missing)
    return text + "."

  def suggest_target(self, path: str, size: str = "small") -> str:
    """A tfdist_py_test stanza for the test file `path`."""
    deps = self._needed_deps(path)
    package = os.path.dirname(path)
    shown = sorted((short_label(d, package) for d in deps),
                   key=lambda l: (not l.startswith(":"), l))
    name = os.path.splitext(os.path.basename(path))[0]
    lines = ["tfdist_py_test(", f'    name = "{name}",',
             f'    size = "{size}",  # '
             + ('"medium" or "large" if it runs longer' if size == "small"
                else '"large" if it runs longer'),
             "    deps = [" + ("]," if not shown else "")]
    if shown:
      lines += [f'        "{d}",' for d in shown] + ["    ],"]
    lines.append(")")
    return "\n".join(lines)

  def check(self) -> List[str]:
    """Runs every check.

    Returns:
      One line per problem (multi-line for a suggested stanza), sorted by
      kind; empty when the BUILD files cover the tree.
    """
    problems = list(self.problems)
    problems += self._check_test_files()
    for target in sorted(self.targets.values(), key=lambda t: t.label):
      if target.kind not in SOURCE_RULES + (TEST_GROUP_MACRO,):
        continue
      # A group's files are reported on its per-file targets, and their
      # deps (the group's) on the group.
      if target.kind != TEST_GROUP_MACRO:
        for src in target.srcs + ([target.main] if target.main else []):
          if not self._exists(src):
            problems.append(f"{target.label} ({target.build_file}) names "
                            f"{src}, which does not exist.")
      if target.kind == TEST_GROUP_MEMBER:
        continue
      for dep in target.deps:
        if dep not in self.targets:
          problems.append(f"{target.label} ({target.build_file}) depends on "
                          f"{dep}, which is not a target.")
    for path in self._python_files():
      if path not in self.owners:
        problems.append(f"{path} is in no BUILD target: add a py_library "
                        f"(or py_binary) to {os.path.dirname(path)}/BUILD.")
    problems += self._check_imports()
    problems += self._check_cycles()
    return problems

  def _check_cycles(self) -> List[str]:
    """Dependency cycles among the targets: Bazel refuses to analyze any
    target that reaches one ("cycle in dependency graph"), so no test runs,
    though every import resolves under pytest."""
    problems, state, stack = [], {}, []

    def visit(label):
      state[label] = "active"
      stack.append(label)
      for dep in sorted(self.targets[label].deps):
        if dep not in self.targets:
          continue
        if state.get(dep) == "active":
          cycle = stack[stack.index(dep):] + [dep]
          problems.append("dependency cycle (Bazel analyzes no target that "
                          "reaches it): " + " -> ".join(cycle) +
                          ". Drop the dep that no import needs.")
        elif dep not in state:
          visit(dep)
      stack.pop()
      state[label] = "done"

    for label in sorted(self.targets):
      if label not in state:
        visit(label)
    return problems

  def _check_test_files(self) -> List[str]:
    """Test files run by no target or by two; small tests outside a group."""
    problems = []
    runners: Dict[str, List[str]] = {}
    for target in sorted(self.targets.values(), key=lambda t: t.label):
      if target.kind in TEST_KINDS:
        for src in target.srcs:
          if _is_test_file(os.path.basename(src)):
            runners.setdefault(src, []).append(target.label)
    for path in self.test_files():
      package = os.path.dirname(path)
      group = self.group_of(package)
      if path not in runners:
        if group:
          problems.append(
              f"{path} has no py_test target: `bazel test //tests/...` "
              f"skips it. In {package}/BUILD, "
              + self.suggest_group_entry(path, group)
              + " A file that runs for more than seconds or starts "
              "processes gets its own target instead:\n"
              + self.suggest_target(path, size="medium"))
        else:
          problems.append(
              f"{path} has no py_test target: `bazel test //tests/...` "
              f"skips it. Add to {package}/BUILD:\n"
              + self.suggest_target(path))
      elif len(runners[path]) > 1:
        problems.append(f"{path} is run by {len(runners[path])} targets "
                        f"({', '.join(runners[path])}): keep one.")
    problems += self._check_compat()
    problems += self._check_docs_data()
    for target in sorted(self.targets.values(), key=lambda t: t.label):
      package = target.label[2:].partition(":")[0]
      group = self.group_of(package)
      if target.kind == TEST_MACRO and target.size == "small" and group:
        problems.append(
            f"{target.label} is a small test outside the group "
            f"{short_label(group.label, package)}: in {target.build_file}, "
            "delete its tfdist_py_test and "
            + self.suggest_group_entry(target.srcs[0], group))
    return problems

  def _check_docs_data(self) -> List[str]:
    """Each test target carries the docs pages its file reads: those whose
    blocks it runs (`docs_blocks_run_by`) and those it names in a string
    (`"guides/device-mesh.md"`, `"docs/reference/flags.md"`). Under pytest
    the checkout has them; in Bazel's sandbox only the target's `data` do
    (`//:docs`, or the page's own label): without it the test fails there
    with FileNotFoundError (pipeline_test in the CI of 7 December 2026)."""
    problems = []
    pages = docs_pages(self.root)
    for target in sorted(self.targets.values(), key=lambda t: t.label):
      if target.kind not in (TEST_MACRO, TEST_GROUP_MEMBER, "py_test"):
        continue
      have = set(target.data)
      if "//:docs" in have:
        continue
      for src in target.srcs:
        if not _is_test_file(os.path.basename(src)) or not self._exists(src):
          continue
        for page in pages_read_by(self.root, src, pages):
          if f"//:{page}" not in have:
            problems.append(
                f"{target.label} ({target.build_file}) reads {page} "
                f"({src}), which is not in its data: Bazel's sandbox lacks "
                f"it. Add data = [\"//:docs\"] (or \"//:{page}\") to the "
                "target.")
    return problems

  def _check_compat(self) -> List[str]:
    """The compat targets list exactly the files that mark tests `compat`.

    A package may split its compat tests between targets by marker (the
    multi-process ones, marked `cluster` too, in a target of their own):
    together the targets must list every file that marks a test `compat`;
    a target whose marker expression selects `cluster` tests lists exactly
    the files that mark both, and no target lists a file that marks none.
    """
    problems = []
    by_package = {}
    for target in sorted(self.targets.values(), key=lambda t: t.label):
      if target.kind == TEST_COMPAT_MACRO:
        package = target.label[2:].partition(":")[0]
        by_package.setdefault(package, []).append(target)
    for package, targets in sorted(by_package.items()):
      listed = {}
      for target in targets:
        for src in target.srcs:
          if src != TEST_MACRO_MAIN:
            listed.setdefault(src, []).append(target)
      for path in self.test_files():
        if os.path.dirname(path) != package:
          continue
        with open(os.path.join(self.root, path)) as f:
          text = f.read()
        marked = bool(COMPAT_MARK.search(text))
        cluster = marked and bool(CLUSTER_MARK.search(text))
        if marked and path not in listed:
          target = targets[0]
          where = target.srcs_variable or f"the srcs of {target.label}"
          problems.append(
              f"{path} marks tests `compat`, but {target.label} does not "
              f'run them: add "{os.path.basename(path)}" to {where} in '
              f"{target.build_file} (and the libraries it imports to the "
              "target's deps).")
        for target in listed.get(path, []) if not marked else []:
          where = target.srcs_variable or f"the srcs of {target.label}"
          problems.append(
              f"{path} is in {where} ({target.build_file}) but marks no "
              f'test `compat`: remove "{os.path.basename(path)}" there.')
        for target in targets:
          if not CLUSTER_SELECTED.search(target.marker or ""):
            continue
          where = target.srcs_variable or f"the srcs of {target.label}"
          if cluster and target not in listed.get(path, []):
            problems.append(
                f"{path} marks compat tests `cluster`, but {target.label} "
                f'does not run them: add "{os.path.basename(path)}" to '
                f"{where} in {target.build_file}.")
          elif not cluster and target in listed.get(path, []):
            problems.append(
                f"{path} is in {where} ({target.build_file}) but marks no "
                f'compat test `cluster`: remove "{os.path.basename(path)}" '
                "there.")
    return problems

  def _check_imports(self) -> List[str]:
    problems = []
    for target in sorted(self.targets.values(), key=lambda t: t.label):
      if target.kind not in SOURCE_RULES:
        continue
      closure = self._closure(target.label)
      reachable = set()
      for label in closure:
        reachable.update(self.targets[label].srcs)
      for src in target.srcs:
        if not src.endswith(".py") or not self._exists(src):
          continue
        for module, files in self._module_imports(src):
          if not files:
            problems.append(f"{src} imports {module}, which is not in the "
                            "workspace.")
            continue
          for file in files:
            if file in reachable or any(
                target.label in self._closure(owner)
                for owner in self.owners.get(file, [])):
              # The second case is a cycle that deps cannot express (A
              # imports B lazily, B depends on A): whatever loads A through
              # B's target has B already.
              continue
            lib = self._library_for(file)
            fix = (f"add {lib} to its deps" if lib else
                   f"add a py_library for {file} and depend on it")
            problems.append(
                f"{target.label}: {src} imports or runs {module}, but {file} "
                f"is not in its deps: {fix} (under Bazel the import fails).")
    return list(dict.fromkeys(problems))


def tests_of_size(root: str, sizes: Iterable[str]) -> List[str]:
  """The test files run by py_test targets of the given sizes.

  Returns:
    Workspace-relative paths, sorted (the entry point left out).
  """
  sizes = set(sizes)
  out = set()
  for target in Workspace(root).targets.values():
    if (target.kind in TEST_KINDS + (TEST_GROUP_MEMBER,)
        and target.size in sizes):
      out.update(s for s in target.srcs
                 if s != TEST_MACRO_MAIN and _is_test_file(
                     os.path.basename(s)))
  return sorted(out)


def check_workspace(root: str) -> List[str]:
  """Runs every check on the workspace at `root`.

  Returns:
    The problems, one string each; empty when all is well.
  """
  return Workspace(root).check()


def default_root() -> str:
  """The workspace holding this file (the runfiles tree under Bazel)."""
  return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv) -> int:
  """The command line (see the module docstring).

  Raises:
    SystemExit: an unknown option.
  """
  args = list(argv[1:])
  sizes = None
  for arg in list(args):
    if arg in ("-h", "--help"):
      print(__doc__)
      return 0
    if arg.startswith("--list-tests="):
      sizes = arg.split("=", 1)[1].split(",")
      args.remove(arg)
    elif arg.startswith("-"):
      raise SystemExit(f"bazel_targets: unknown option {arg}. Options: "
                       "--list-tests=SIZE[,SIZE...], --help.")
  root = args[0] if args else default_root()
  if sizes is not None:
    for path in tests_of_size(root, sizes):
      print(path)
    return 0
  problems = check_workspace(root)
  for problem in problems:
    print(problem)
  if problems:
    print(f"bazel_targets: {len(problems)} problem(s) in {root}")
    return 1
  print(f"bazel_targets: BUILD files cover {root}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
