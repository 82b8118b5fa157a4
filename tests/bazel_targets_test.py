"""The BUILD files cover the tree: every test file has a py_test target.

Runs tests/bazel_targets.py on the workspace (no Bazel needed), and shows on
temporary copies and small made-up workspaces that the check fails when a
test file has no target, a target names a missing file, a module is in no
target, or a target misses a dep that its imports need.
"""

import os
import shutil
import textwrap

from absl.testing import absltest

from tests import bazel_targets
from tests import testutil

_TEST_BUILD_HEADER = 'load("//tests:defs.bzl", "tfdist_py_test")\n'
_DOCS_DATA_PROBLEM = (
    '//tests:core_test (tests/BUILD) reads docs/guide.md '
    '(tests/core_test.py), which is not in its data: Bazel\'s sandbox lacks '
    'it. Add data = ["//:docs"] (or "//:docs/guide.md") to the target.')


def _copy_build_inputs(src_root: str, dst_root: str) -> None:
  """Copies the BUILD, .bzl and .py files of a workspace (nothing else)."""
  for dirpath, _, filenames in bazel_targets._walk(src_root):  # pylint: disable=protected-access
    rel = os.path.relpath(dirpath, src_root)
    for name in filenames:
      if name in ("BUILD", "BUILD.bazel", "WORKSPACE") or name.endswith(
          (".py", ".bzl")):
        os.makedirs(os.path.join(dst_root, rel), exist_ok=True)
        shutil.copyfile(os.path.join(dirpath, name),
                        os.path.join(dst_root, rel, name))


def _write(root: str, path: str, text: str) -> None:
  full = os.path.join(root, path)
  os.makedirs(os.path.dirname(full), exist_ok=True)
  with open(full, "w") as f:
    f.write(textwrap.dedent(text))


def _small_workspace(root: str) -> None:
  """A clean workspace: package `lib`, one test of it, tests/ as in tfdist."""
  _write(root, "lib/__init__.py", "")
  _write(root, "lib/core.py", "VALUE = 1\n")
  _write(root, "lib/BUILD", """\
      py_library(name = "init", srcs = ["__init__.py"])
      py_library(name = "core", srcs = ["core.py"], deps = [":init"])
      """)
  _write(root, "tests/__init__.py", "")
  _write(root, "tests/pytest_main.py", "")
  _write(root, "tests/core_test.py", "from lib import core\n")
  _write(root, "tests/BUILD", _TEST_BUILD_HEADER + textwrap.dedent("""\
      exports_files(["pytest_main.py"])
      py_library(name = "init", srcs = ["__init__.py"])
      tfdist_py_test(
          name = "core_test",
          size = "small",
          deps = ["//lib:core"],
      )
      """))


class WorkspaceTest(absltest.TestCase):
  """The check on this workspace (the runfiles tree under Bazel)."""

  def test_build_files_cover_the_workspace(self):
    problems = bazel_targets.check_workspace(bazel_targets.default_root())
    if problems:
      self.fail("The BUILD files do not cover the tree (fix each, then rerun "
                "python -m tests.bazel_targets):\n" + "\n".join(problems))

  def test_every_test_file_in_tests_is_found(self):
    workspace = bazel_targets.Workspace(bazel_targets.default_root())
    self.assertIn(os.path.join("tests", "bazel_targets_test.py"),
                  workspace.test_files())
    self.assertIn("//tests:bazel_targets_test", workspace.targets)


class OrphanOnCopyTest(absltest.TestCase):
  """Adds files to a temporary copy of this workspace, never to the repo."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # One check of an unchanged copy for the class (a check of the whole
    # workspace takes seconds); each test edits a fresh copy of it.
    cls.pristine = os.path.join(testutil.scratch_dir(), "workspace")
    _copy_build_inputs(bazel_targets.default_root(), cls.pristine)
    cls.baseline = set(bazel_targets.check_workspace(cls.pristine))

  def setUp(self):
    super().setUp()
    self.copy = os.path.join(testutil.scratch_dir(), "workspace")
    shutil.copytree(self.pristine, self.copy)

  def test_orphan_test_file_fails_the_check(self):
    _write(self.copy, "tests/orphan_test.py", """\
        from absl.testing import absltest
        from tfdist import config
        """)
    new = [p for p in bazel_targets.check_workspace(self.copy)
           if p not in self.baseline]
    self.assertLen(new, 1, new)
    self.assertStartsWith(new[0], "tests/orphan_test.py has no py_test target")
    self.assertIn('name = "orphan_test"', new[0])
    self.assertIn('"//tfdist:config"', new[0])
    self.assertFalse(os.path.exists(os.path.join(
        bazel_targets.default_root(), "tests", "orphan_test.py")))

  def test_orphan_fails_the_command_line(self):
    _write(self.copy, "tests/test_orphan.py", "")
    self.assertEqual(bazel_targets.main(["bazel_targets", self.copy]), 1)

  def test_target_whose_file_is_gone_fails_the_check(self):
    os.remove(os.path.join(self.copy, "tests", "bazel_targets_test.py"))
    new = [p for p in bazel_targets.check_workspace(self.copy)
           if p not in self.baseline]
    self.assertEqual(new, [
        "//tests:bazel_targets_test (tests/BUILD) names "
        "tests/bazel_targets_test.py, which does not exist."])


class CheckTest(absltest.TestCase):
  """Each kind of problem, on a small made-up workspace."""

  def setUp(self):
    super().setUp()
    self.root = os.path.join(testutil.scratch_dir(), "ws")
    _small_workspace(self.root)

  def test_clean_workspace_passes(self):
    self.assertEqual(bazel_targets.check_workspace(self.root), [])
    self.assertEqual(bazel_targets.main(["bazel_targets", self.root]), 0)

  def test_tests_of_size(self):
    self.assertEqual(bazel_targets.tests_of_size(self.root, ["small"]),
                     ["tests/core_test.py"])
    self.assertEqual(bazel_targets.tests_of_size(self.root, ["large"]), [])

  def test_orphan_with_suggested_stanza(self):
    _write(self.root, "tests/sub/test_more.py", "import lib.core\n")
    problems = bazel_targets.check_workspace(self.root)
    self.assertLen(problems, 1)
    self.assertEqual(problems[0], textwrap.dedent("""\
        tests/sub/test_more.py has no py_test target: `bazel test //tests/...` \
skips it. Add to tests/sub/BUILD:
        tfdist_py_test(
            name = "test_more",
            size = "small",  # "medium" or "large" if it runs longer
            deps = [
                "//lib:core",
            ],
        )"""))

  def test_missing_dep_fails(self):
    _write(self.root, "lib/extra.py", "")
    _write(self.root, "lib/BUILD", """\
        py_library(name = "init", srcs = ["__init__.py"])
        py_library(name = "core", srcs = ["core.py"], deps = [":init"])
        py_library(name = "extra", srcs = ["extra.py"], deps = [":init"])
        """)
    _write(self.root, "tests/core_test.py", """\
        from lib import core
        def test_lazy():
          from lib import extra  # inside a function: checked all the same
        """)
    self.assertEqual(bazel_targets.check_workspace(self.root), [
        "//tests:core_test: tests/core_test.py imports or runs lib.extra, "
        "but lib/extra.py is not in its deps: add //lib:extra to its deps "
        "(under Bazel the import fails)."])

  def test_module_run_by_name_needs_a_dep(self):
    _write(self.root, "lib/tool.py", "")
    _write(self.root, "lib/BUILD", """\
        py_library(name = "init", srcs = ["__init__.py"])
        py_library(name = "core", srcs = ["core.py"], deps = [":init"])
        py_library(name = "tool", srcs = ["tool.py"], deps = [":init"])
        """)
    _write(self.root, "tests/core_test.py", """\
        import sys
        from lib import core
        ARGS = [sys.executable, "-m", "lib.tool"]
        HELP = "run python -m lib.tool"  # not a module name by itself
        OTHER = "lib.not_a_module"
        """)
    self.assertEqual(bazel_targets.check_workspace(self.root), [
        "//tests:core_test: tests/core_test.py imports or runs lib.tool, "
        "but lib/tool.py is not in its deps: add //lib:tool to its deps "
        "(under Bazel the import fails)."])

  def _lazy_package(self):
    """`lib` gains `lib.fit`, imported lazily by the package's own
    `__getattr__` (as `tfdist.fit` is), from a library of its own."""
    _write(self.root, "lib/__init__.py", """\
        def __getattr__(name):
          if name == "fit":
            from lib import api
            return api.fit
          raise AttributeError(name)
        """)
    _write(self.root, "lib/api.py", "def fit():\n  pass\n")
    _write(self.root, "lib/BUILD", """\
        py_library(name = "init", srcs = ["__init__.py"])
        py_library(name = "core", srcs = ["core.py"], deps = [":init"])
        py_library(name = "api", srcs = ["api.py"], deps = [":init"])
        """)

  def test_lazy_package_attribute_needs_its_module(self):
    self._lazy_package()
    _write(self.root, "tests/core_test.py", """\
        import lib
        from lib import core
        def test_fit():
          lib.fit()
        """)
    self.assertEqual(bazel_targets.check_workspace(self.root), [
        "//tests:core_test: tests/core_test.py imports or runs lib.api, "
        "but lib/api.py is not in its deps: add //lib:api to its deps "
        "(under Bazel the import fails)."])

  def test_docs_block_a_test_runs_counts_as_its_imports(self):
    # The failure that reached CI three times: a guide's example, run by a
    # test, called the lazy `tfdist.fit`, and the target lacked tfdist.api.
    self._lazy_package()
    _write(self.root, "docs/guide.md", """\
        Text.

        <!-- run: tests/core_test.py example -->
        ```python
        import lib
        lib.fit()
        ```

        <!-- run: tests/other_test.py example -->
        ```python
        from lib import nothing_here
        ```
        """)
    self.assertEqual(bazel_targets.check_workspace(self.root), [
        _DOCS_DATA_PROBLEM,
        "//tests:core_test: tests/core_test.py imports or runs lib.api, "
        "but lib/api.py is not in its deps: add //lib:api to its deps "
        "(under Bazel the import fails)."])
    _write(self.root, "tests/BUILD", _TEST_BUILD_HEADER + textwrap.dedent("""\
        exports_files(["pytest_main.py"])
        py_library(name = "init", srcs = ["__init__.py"])
        tfdist_py_test(
            name = "core_test",
            size = "small",
            data = ["//:docs"],
            deps = ["//lib:api", "//lib:core"],
        )
        """))
    self.assertEqual(bazel_targets.check_workspace(self.root), [])

  def test_docs_page_a_test_reads_must_be_in_its_data(self):
    # The CI of 7 December 2026 failed pipeline_test in Bazel's sandbox
    # only: it ran a guide's blocks (FileNotFoundError) without //:docs.
    _write(self.root, "docs/guide.md", """\
        <!-- run: tests/core_test.py example -->
        ```python
        from lib import core
        ```
        """)
    self.assertEqual(bazel_targets.check_workspace(self.root),
                     [_DOCS_DATA_PROBLEM])
    # A page named in a string counts too; its own label is enough.
    _write(self.root, "docs/guide.md", "No blocks.\n")
    _write(self.root, "tests/core_test.py", """\
        import os
        from lib import core
        PAGE = os.path.join("docs", "guide.md")
        """)
    self.assertEqual(bazel_targets.check_workspace(self.root),
                     [_DOCS_DATA_PROBLEM])
    for data in ('"//:docs"', '"//:docs/guide.md"'):
      _write(self.root, "tests/BUILD", _TEST_BUILD_HEADER + textwrap.dedent(
          f"""\
          exports_files(["pytest_main.py"])
          py_library(name = "init", srcs = ["__init__.py"])
          tfdist_py_test(
              name = "core_test",
              size = "small",
              data = [{data}],
              deps = ["//lib:core"],
          )
          """))
      self.assertEqual(bazel_targets.check_workspace(self.root), [], data)

  def test_import_of_module_not_in_workspace_fails(self):
    _write(self.root, "tests/core_test.py", "from lib import core\n"
           "import lib.gone\n")
    self.assertEqual(bazel_targets.check_workspace(self.root), [
        "tests/core_test.py imports lib.gone, which is not in the "
        "workspace."])

  def test_lazy_import_back_into_a_dependent_is_accepted(self):
    _write(self.root, "lib/runner.py", """\
        def run():
          from lib import core  # core depends on runner: a cycle
        """)
    _write(self.root, "lib/core.py", "from lib import runner\n")
    _write(self.root, "lib/BUILD", """\
        py_library(name = "init", srcs = ["__init__.py"])
        py_library(name = "runner", srcs = ["runner.py"], deps = [":init"])
        py_library(
            name = "core",
            srcs = ["core.py"],
            deps = [":init", ":runner"],
        )
        """)
    self.assertEqual(bazel_targets.check_workspace(self.root), [])

  def test_module_in_no_target_fails(self):
    _write(self.root, "lib/new_module.py", "")
    self.assertEqual(bazel_targets.check_workspace(self.root), [
        "lib/new_module.py is in no BUILD target: add a py_library (or "
        "py_binary) to lib/BUILD."])

  def test_script_in_a_plain_package_folder_is_covered(self):
    _write(self.root, "bench/BUILD", "")
    _write(self.root, "bench/run_bench.py", "")
    _write(self.root, "scripts/not_a_package.py", "")
    self.assertEqual(bazel_targets.check_workspace(self.root), [
        "bench/run_bench.py is in no BUILD target: add a py_library (or "
        "py_binary) to bench/BUILD."])

  def test_dep_on_missing_target_fails(self):
    _write(self.root, "tests/BUILD", _TEST_BUILD_HEADER + textwrap.dedent("""\
        py_library(name = "init", srcs = ["__init__.py"])
        tfdist_py_test(
            name = "core_test",
            size = "small",
            deps = ["//lib:core", "//lib:gone"],
        )
        """))
    self.assertEqual(bazel_targets.check_workspace(self.root), [
        "//tests:core_test (tests/BUILD) depends on //lib:gone, which is not "
        "a target."])

  def test_dependency_cycle_fails(self):
    # As //tfdist:config -> :training_checks -> :config did: every import
    # resolved, but Bazel analyzed no test.
    _write(self.root, "lib/extra.py", "")
    _write(self.root, "lib/BUILD", """\
        py_library(name = "init", srcs = ["__init__.py"])
        py_library(name = "core", srcs = ["core.py"],
                   deps = [":init", ":extra"])
        py_library(name = "extra", srcs = ["extra.py"],
                   deps = [":init", ":core"])
        """)
    self.assertEqual(bazel_targets.check_workspace(self.root), [
        "dependency cycle (Bazel analyzes no target that reaches it): "
        "//lib:core -> //lib:extra -> //lib:core. Drop the dep that no "
        "import needs."])

  def test_glob_and_concatenation_are_evaluated(self):
    _write(self.root, "lib/BUILD", """\
        py_library(name = "init", srcs = ["__init__.py"])
        py_library(
            name = "core",
            srcs = glob(["*.py"], exclude = ["__init__.py"]) + [],
            deps = [":init"],
        )
        """)
    _write(self.root, "lib/more.py", "")
    _write(self.root, "lib/data/not_a_src.py", "")
    workspace = bazel_targets.Workspace(self.root)
    self.assertEqual(workspace.targets["//lib:core"].srcs,
                     ["lib/core.py", "lib/more.py"])
    self.assertEqual(workspace.check(), [
        "lib/data/not_a_src.py is in no BUILD target: add a py_library (or "
        "py_binary) to lib/data/BUILD."])

  def test_unparsable_build_file_is_reported(self):
    _write(self.root, "lib/BUILD", "py_library(name = \n")
    problems = bazel_targets.check_workspace(self.root)
    self.assertTrue(problems[0].startswith("lib/BUILD:"), problems)


_GROUP_BUILD = textwrap.dedent("""\
    load("//tests:defs.bzl", "tfdist_py_test", "tfdist_py_test_group")
    exports_files(["pytest_main.py"])
    py_library(name = "init", srcs = ["__init__.py"])
    UNIT_TESTS = ["core_test.py"]
    tfdist_py_test_group(
        name = "unit_tests",
        size = "medium",
        srcs = UNIT_TESTS,
        deps = ["//lib:core"],
    )
    """)


class GroupTest(absltest.TestCase):
  """tfdist_py_test_group: many unit-test files in one target."""

  def setUp(self):
    super().setUp()
    self.root = os.path.join(testutil.scratch_dir(), "ws")
    _small_workspace(self.root)
    _write(self.root, "lib/extra.py", "")
    _write(self.root, "lib/BUILD", """\
        py_library(name = "init", srcs = ["__init__.py"])
        py_library(name = "core", srcs = ["core.py"], deps = [":init"])
        py_library(name = "extra", srcs = ["extra.py"], deps = [":init"])
        """)
    _write(self.root, "tests/BUILD", _GROUP_BUILD)

  def test_group_covers_its_files(self):
    workspace = bazel_targets.Workspace(self.root)
    group = workspace.targets["//tests:unit_tests"]
    self.assertEqual(group.srcs, ["tests/core_test.py", "tests/pytest_main.py"])
    self.assertEqual(group.srcs_variable, "UNIT_TESTS")
    self.assertEqual(workspace.check(), [])
    self.assertEqual(bazel_targets.tests_of_size(self.root, ["medium"]),
                     ["tests/core_test.py"])
    self.assertEqual(bazel_targets.tests_of_size(self.root, ["small"]),
                     ["tests/core_test.py"])

  def test_orphan_is_told_to_join_the_group(self):
    _write(self.root, "tests/extra_test.py", "from lib import extra\n")
    self.assertEqual(bazel_targets.check_workspace(self.root), [
        "tests/extra_test.py has no py_test target: `bazel test //tests/...` "
        'skips it. In tests/BUILD, add "extra_test.py" to UNIT_TESTS (the '
        "srcs of :unit_tests), the unit-test group (one pytest process for "
        'all of them) and to its deps: "//lib:extra". A file that runs for '
        "more than seconds or starts processes gets its own target "
        "instead:\n"
        "tfdist_py_test(\n"
        '    name = "extra_test",\n'
        '    size = "medium",  # "large" if it runs longer\n'
        "    deps = [\n"
        '        "//lib:extra",\n'
        "    ],\n"
        ")"])

  def test_missing_dep_of_a_grouped_file_fails(self):
    _write(self.root, "tests/core_test.py", "from lib import extra\n")
    problems = bazel_targets.check_workspace(self.root)
    self.assertLen(problems, 1)
    self.assertIn("//tests:core_test: tests/core_test.py imports or runs "
                  "lib.extra", problems[0])

  def test_each_file_has_a_manual_target_of_its_own(self):
    workspace = bazel_targets.Workspace(self.root)
    member = workspace.targets["//tests:core_test"]
    self.assertEqual(member.kind, bazel_targets.TEST_GROUP_MEMBER)
    self.assertEqual(member.srcs, ["tests/core_test.py", "tests/pytest_main.py"])
    os.remove(os.path.join(self.root, "tests", "core_test.py"))
    self.assertEqual(bazel_targets.check_workspace(self.root), [
        "//tests:core_test (tests/BUILD) names tests/core_test.py, which "
        "does not exist."])

  def test_missing_dep_target_of_a_group_is_reported_once(self):
    _write(self.root, "tests/BUILD", _GROUP_BUILD.replace(
        '"//lib:core"', '"//lib:core", "//lib:gone"'))
    self.assertEqual(bazel_targets.check_workspace(self.root), [
        "//tests:unit_tests (tests/BUILD) depends on //lib:gone, which is "
        "not a target."])

  def test_small_target_beside_a_group_fails(self):
    _write(self.root, "tests/extra_test.py", "from lib import extra\n")
    _write(self.root, "tests/BUILD", _GROUP_BUILD + textwrap.dedent("""\
        tfdist_py_test(
            name = "extra_test",
            size = "small",
            deps = ["//lib:extra"],
        )
        """))
    problems = bazel_targets.check_workspace(self.root)
    self.assertLen(problems, 1)
    self.assertTrue(problems[0].startswith(
        "//tests:extra_test is a small test outside the group :unit_tests: "
        "in tests/BUILD, delete its tfdist_py_test and add "
        '"extra_test.py" to UNIT_TESTS'), problems[0])

  def test_file_run_by_two_targets_fails(self):
    _write(self.root, "tests/BUILD", _GROUP_BUILD + textwrap.dedent("""\
        tfdist_py_test(
            name = "core_test",
            size = "medium",
            deps = ["//lib:core"],
        )
        """))
    self.assertEqual(bazel_targets.check_workspace(self.root), [
        "tests/core_test.py is run by 2 targets (//tests:core_test, "
        "//tests:unit_tests): keep one."])


# Built, not written out: this file marks no test `compat` itself.
_COMPAT_MARK = "pytest.mark." + "compat"


def _compat_workspace() -> str:
  """A small workspace whose tests/core_test.py marks its tests `compat`."""
  root = os.path.join(testutil.scratch_dir(), "ws")
  _small_workspace(root)
  _write(root, "tests/core_test.py",
         f"import pytest\nfrom lib import core\n"
         f"pytestmark = {_COMPAT_MARK}\n")
  return root


class CompatTest(absltest.TestCase):
  """tfdist_py_test_compat lists exactly the files with `compat` tests."""

  def setUp(self):
    super().setUp()
    self.root = _compat_workspace()
    _write(self.root, "tests/other_test.py", "from lib import core\n")
    _write(self.root, "tests/BUILD", textwrap.dedent("""\
        load("//tests:defs.bzl", "tfdist_py_test", "tfdist_py_test_compat")
        exports_files(["pytest_main.py"])
        py_library(name = "init", srcs = ["__init__.py"])
        tfdist_py_test(name = "core_test", size = "small",
                       deps = ["//lib:core"])
        tfdist_py_test(name = "other_test", size = "small",
                       deps = ["//lib:core"])
        COMPAT_TESTS = ["core_test.py"]
        tfdist_py_test_compat(
            name = "compat_old",
            size = "large",
            srcs = COMPAT_TESTS,
            venv = ".venv-old",
            deps = ["//lib:core"],
        )
        """))

  def test_listed_files_pass_and_are_not_a_second_runner(self):
    self.assertEqual(bazel_targets.check_workspace(self.root), [])

  def test_a_file_with_compat_tests_must_be_listed(self):
    _write(self.root, "tests/other_test.py",
           f"import pytest\nfrom lib import core\n"
           f"@{_COMPAT_MARK}\ndef test_x():\n  pass\n")
    self.assertEqual(bazel_targets.check_workspace(self.root), [
        "tests/other_test.py marks tests `compat`, but //tests:compat_old "
        'does not run them: add "other_test.py" to COMPAT_TESTS in '
        "tests/BUILD (and the libraries it imports to the target's deps)."])

  def test_a_listed_file_without_compat_tests_is_reported(self):
    _write(self.root, "tests/core_test.py", "from lib import core\n")
    self.assertEqual(bazel_targets.check_workspace(self.root), [
        "tests/core_test.py is in COMPAT_TESTS (tests/BUILD) but marks no "
        'test `compat`: remove "core_test.py" there.'])

  def test_its_imports_need_its_deps(self):
    _write(self.root, "lib/extra.py", "")
    _write(self.root, "lib/BUILD", """\
        py_library(name = "init", srcs = ["__init__.py"])
        py_library(name = "core", srcs = ["core.py"], deps = [":init"])
        py_library(name = "extra", srcs = ["extra.py"], deps = [":init"])
        """)
    _write(self.root, "tests/core_test.py",
           f"import pytest\nfrom lib import extra\n"
           f"pytestmark = {_COMPAT_MARK}\n")
    problems = bazel_targets.check_workspace(self.root)
    self.assertLen(problems, 2, problems)
    self.assertTrue(all("imports or runs lib.extra" in p for p in problems))
    self.assertEqual(sorted(p.split(":")[1] for p in problems),
                     ["compat_old", "core_test"])


_CLUSTER_MARK = "pytest.mark." + "cluster"


class CompatClusterTest(absltest.TestCase):
  """Compat tests marked `cluster` run in a target of their own."""

  def setUp(self):
    super().setUp()
    self.root = _compat_workspace()
    _write(self.root, "tests/run_test.py",
           f"import pytest\nfrom lib import core\n"
           f"pytestmark = {_COMPAT_MARK}\n"
           f"@{_CLUSTER_MARK}\ndef test_x():\n  pass\n")
    self.build = textwrap.dedent("""\
        load("//tests:defs.bzl", "tfdist_py_test", "tfdist_py_test_compat")
        exports_files(["pytest_main.py"])
        py_library(name = "init", srcs = ["__init__.py"])
        tfdist_py_test(name = "core_test", size = "small",
                       deps = ["//lib:core"])
        tfdist_py_test(name = "run_test", size = "small",
                       deps = ["//lib:core"])
        COMPAT_TESTS = ["core_test.py", "run_test.py"]
        tfdist_py_test_compat(
            name = "compat_old",
            size = "large",
            srcs = COMPAT_TESTS,
            venv = ".venv-old",
            marker = "compat and not cluster",
            deps = ["//lib:core"],
        )
        COMPAT_CLUSTER_TESTS = ["run_test.py"]
        tfdist_py_test_compat(
            name = "compat_old_cluster",
            size = "large",
            srcs = COMPAT_CLUSTER_TESTS,
            venv = ".venv-old",
            marker = "compat and cluster",
            deps = ["//lib:core"],
        )
        """)
    _write(self.root, "tests/BUILD", self.build)

  def test_split_targets_pass(self):
    self.assertEqual(bazel_targets.check_workspace(self.root), [])

  def test_a_file_with_cluster_tests_must_be_in_the_cluster_target(self):
    _write(self.root, "tests/BUILD", self.build.replace(
        'COMPAT_CLUSTER_TESTS = ["run_test.py"]',
        "COMPAT_CLUSTER_TESTS = []"))
    self.assertEqual(bazel_targets.check_workspace(self.root), [
        "tests/run_test.py marks compat tests `cluster`, but "
        '//tests:compat_old_cluster does not run them: add "run_test.py" to '
        "COMPAT_CLUSTER_TESTS in tests/BUILD."])

  def test_a_file_without_cluster_tests_is_not_in_the_cluster_target(self):
    _write(self.root, "tests/BUILD", self.build.replace(
        'COMPAT_CLUSTER_TESTS = ["run_test.py"]',
        'COMPAT_CLUSTER_TESTS = ["core_test.py", "run_test.py"]'))
    self.assertEqual(bazel_targets.check_workspace(self.root), [
        "tests/core_test.py is in COMPAT_CLUSTER_TESTS (tests/BUILD) but "
        'marks no compat test `cluster`: remove "core_test.py" there.'])


if __name__ == "__main__":
  absltest.main()
