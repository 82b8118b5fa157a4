"""The fit-contract table of docs/guides/fit-conformance.md is whole.

Each cell is checked by the test that measures it
(`conformance_table.check_cell`); this file checks, without running
anything, that the guide has every row of `conformance_table.ROWS` in
order, that no cell is left "not measured", and that each cell's test file
names the row (so a row cannot lose its measurement unnoticed). For the
guide's first table (the `fit` arguments and callbacks, checked cell by
cell by the two fit_conformance files), that it has every row of
`fit_conformance_testlib.FEATURES` and each cell one of those files.
"""

import os
import re
import shutil
import sys
import tempfile
import types
from unittest import mock

from absl.testing import absltest

from tests import conformance_table
from tests import fit_conformance_testlib


class ContractTableTest(absltest.TestCase):

  def test_every_row_and_cell_is_there_and_measured(self):
    with open(conformance_table.DOC) as f:
      cells = conformance_table.read_cells(f.read())
    self.assertEqual(list(cells), [key for key, _, _ in
                                   conformance_table.ROWS])
    for key, row in cells.items():
      self.assertEqual(list(row), list(conformance_table.COLUMNS), key)
      for column, text in row.items():
        self.assertNotEqual(text, "not measured", (key, column))

  def test_each_cells_test_file_names_its_row(self):
    # In the file, or in a tests/ module it imports (its cases' library).
    def text(name):
      with open(os.path.join(conformance_table.REPO_ROOT, "tests",
                             name + ".py")) as f:
        return f.read()
    for key, _, owners in conformance_table.ROWS:
      for column, owner in owners.items():
        own = text(owner)
        imported = [text(name) for name in
                    re.findall(r"^from tests import (\w+)", own, re.M)]
        self.assertTrue(any(f'"{key}"' in t for t in [own, *imported]),
                        f"{owner} ({column}) does not name row {key}")

  def test_render_then_read_gives_the_cells_back(self):
    cells = {"own_step_frozen": {"one_device": "works"},
             "failed_export": {"mirrored": "refused at start (why)"}}
    doc = ("intro\n<!-- contract-table -->\n" +
           conformance_table.render(cells) + "\n<!-- /contract-table -->\n")
    read = conformance_table.read_cells(doc)
    self.assertEqual(read["own_step_frozen"]["one_device"], "works")
    self.assertEqual(read["own_step_frozen"]["mirrored"], "not measured")
    self.assertEqual(read["failed_export"]["mirrored"],
                     "refused at start (why)")
    with self.assertRaisesRegex(ValueError, "no <!-- contract-table -->"):
      conformance_table.read_cells("no table")


class FitTableTest(absltest.TestCase):

  def test_every_row_is_there_and_each_cell_has_a_test_file(self):
    lib = fit_conformance_testlib
    with open(lib.DOC) as f:
      cells = lib.read_table(f.read())
    self.assertEqual(list(cells), [key for key, _ in lib.FEATURES])
    for key, row in cells.items():
      self.assertEqual(list(row), list(lib.STRATEGIES), key)
    owners = {lib.table_owner(key, strategy) for key, _ in lib.FEATURES
              for strategy in lib.STRATEGIES}
    self.assertEqual(owners, {lib.ONE_PROCESS_TEST, lib.CLUSTER_TEST})
    for owner in owners:
      self.assertTrue(os.path.exists(os.path.join(
          conformance_table.REPO_ROOT, "tests", owner + ".py")), owner)

  def _measured_by(self, name: str):
    """A test case whose class is in a module named `name` (the file
    `check_table` takes the measurer from)."""
    module = types.ModuleType(name)
    module.__file__ = os.path.join(conformance_table.REPO_ROOT, "tests",
                                   name + ".py")
    # Only this name comes and goes: mock.patch.dict(sys.modules) would
    # also drop every module imported meanwhile (tfdist.train among them,
    # whose flags a later import would then define twice).
    sys.modules[name] = module
    self.addCleanup(sys.modules.pop, name, None)
    case = type("Case", (absltest.TestCase,), {"runTest": lambda _: None,
                                               "__module__": name})
    return case()

  def test_each_file_checks_and_writes_its_own_cells(self):
    lib = fit_conformance_testlib
    folder = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, folder)
    doc = os.path.join(folder, "guide.md")
    shutil.copy(lib.DOC, doc)
    self.enter_context(mock.patch.object(lib, "DOC", doc))
    with open(doc) as f:
      table = lib.read_table(f.read())
    one = self._measured_by(lib.ONE_PROCESS_TEST)
    cluster = self._measured_by(lib.CLUSTER_TEST)
    mine = {f: {s: v for s, v in row.items()
                if lib.table_owner(f, s) == lib.ONE_PROCESS_TEST}
            for f, row in table.items()}
    lib.check_table(one, mine)
    # A cell that differs, one left unmeasured, one of the other file's.
    changed = {**mine, "history": {**mine["history"], "mirrored": "fails"}}
    with self.assertRaisesRegex(AssertionError, "differs from what "
                                "fit_conformance_one_process_test measured"):
      lib.check_table(one, changed)
    with self.assertRaisesRegex(AssertionError, "differs"):
      lib.check_table(one, {f: row for f, row in mine.items()
                            if f != "history"})
    with self.assertRaisesRegex(AssertionError, "owned by another file"):
      lib.check_table(cluster, mine)
    # Writing: the file's own cells change, the other file's stay.
    with mock.patch.dict(os.environ, {lib.WRITE_ENV: "1"}):
      lib.check_table(one, changed)
    with open(doc) as f:
      written = lib.read_table(f.read())
    self.assertEqual(written["history"], {**table["history"],
                                          "mirrored": "fails"})
    self.assertEqual({f: row for f, row in written.items() if f != "history"},
                     {f: row for f, row in table.items() if f != "history"})


if __name__ == "__main__":
  absltest.main()
