"""The fit-contract table of docs/guides/fit-conformance.md is whole.

Each cell is checked by the test that measures it
(`conformance_table.check_cell`); this file checks, without running
anything, that the guide has every row of `conformance_table.ROWS` in
order, that no cell is left "not measured", and that each cell's test file
names the row (so a row cannot lose its measurement unnoticed).
"""

import os
import re

from absl.testing import absltest

from tests import conformance_table


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


if __name__ == "__main__":
  absltest.main()
