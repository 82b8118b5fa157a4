"""The fit-contract table of `docs/guides/fit-conformance.md`, cell by cell.

The guide's second table (between its `contract-table` markers) has a row
for each part of the contract a Keras model states (a model's own
`train_step`, one loss value per batch, `model.losses`, unsynchronized batch
norm, Python inputs, loss reductions, silent drops, failed exports) and a
column for one device, MirroredStrategy (2 logical CPUs) and two
MultiWorkerMirrored workers. Each cell is measured by the test that runs
that feature (`ROWS` names the file), so no run is made twice for the
table: the test calls `check_cell` with what it measured, and the cell must
read so in the guide. With `TFDIST_WRITE_CONFORMANCE_TABLE=1` set,
`check_cell` writes the cell into the guide instead (rerun every file
`ROWS` names to rewrite the whole table).
"""

import inspect
import os
import re

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO_ROOT, "docs", "guides", "fit-conformance.md")
WRITE_ENV = "TFDIST_WRITE_CONFORMANCE_TABLE"
COLUMNS = ("one_device", "mirrored", "multi_worker_mirrored")
_ALL = COLUMNS
_LOSSES = {"one_device": "loss_semantics_test",
           "mirrored": "loss_semantics_test",
           "multi_worker_mirrored": "loss_semantics_multi_worker_test"}
# (row key, what the row says, {column: the test file measuring it}).
ROWS = (
    ("own_step_frozen", "a model's own `train_step` keeping a variable "
     "frozen", dict.fromkeys(_ALL, "custom_step_test")),
    ("own_step_two_optimizers", "a model's own `train_step` with two "
     "optimizers (GAN-style)", dict.fromkeys(_ALL, "custom_step_test")),
    ("own_compute_loss", "a `compute_loss` override",
     dict.fromkeys(_ALL, "custom_step_test")),
    ("own_step_no_loss", "a low-level `train_step`, compiled without a loss",
     dict.fromkeys(_ALL, "custom_step_test")),
    ("own_step_hand_added_term", "a model's own `train_step` adding a "
     "regularizer by hand (`loss = ... + penalty`)",
     dict.fromkeys(_ALL, "custom_step_test")),
    ("own_compute_loss_extra_term", "a `compute_loss` override adding a term "
     "to `super().compute_loss(...)`",
     dict.fromkeys(_ALL, "custom_step_test")),
    ("batch_valued_loss", "a loss returning one value per batch (a "
     "`lambda`)",
     _LOSSES),
    ("model_losses", "`model.losses` (a kernel regularizer and `add_loss`) "
     "in the evaluation loss",
     _LOSSES),
    ("reduction_sum", "`keras.losses.Loss(reduction=\"sum\")`",
     _LOSSES),
    ("reduction_none", "`keras.losses.Loss(reduction=None)`",
     _LOSSES),
    ("unsynchronized_batch_norm", "`BatchNormalization` not synchronized: "
     "the reported evaluation is the exported model's",
     dict.fromkeys(_ALL, "batch_norm_metrics_test")),
    ("py_dataset", "`x=keras.utils.PyDataset`", dict.fromkeys(
        _ALL, "api_test")),
    ("generator", "`x=` a Python generator", dict.fromkeys(_ALL, "api_test")),
    ("jit_compile", "`compile(jit_compile=True)`",
     _LOSSES),
    ("tf_config_without_cluster", "`TF_CONFIG` with a task but no `cluster` "
     "(Kubeflow's `sparseCluster`)", dict.fromkeys(_ALL, "api_test")),
    ("keras_distribution", "`keras.distribution.set_distribution(...)` in "
     "the script", dict.fromkeys(_ALL, "api_test")),
    ("failed_export", "a SavedModel export that fails (a full disk)",
     dict.fromkeys(_ALL, "multi_worker_test")),
)
_PATTERN = re.compile(r"(<!-- contract-table -->\n)(.*?)(\n<!-- "
                      r"/contract-table -->)", re.S)


def render(cells: dict) -> str:
  """The table's Markdown: `cells` is `{row key: {column: text}}`; a cell
  it lacks reads "not measured"."""
  lines = ["| the model or script states | " + " | ".join(COLUMNS) + " |",
           "|---" * (len(COLUMNS) + 1) + "|"]
  for key, text, _ in ROWS:
    row = [cells.get(key, {}).get(c, "not measured") for c in COLUMNS]
    lines.append(f"| {text} | " + " | ".join(row) + " |")
  return "\n".join(lines)


def read_cells(doc_text: str, *, strict: bool = True) -> dict:
  """`{row key: {column: text}}` as the guide's table has them (`strict`
  False: the rows of `ROWS` it has, in any order).

  Raises:
    ValueError: the guide has no contract table; with `strict`, its rows
      are not `ROWS` in order.
  """
  match = _PATTERN.search(doc_text)
  if not match:
    raise ValueError(f"{DOC} has no <!-- contract-table --> markers")
  rows = {}
  for line in match.group(2).splitlines()[2:]:
    text, *values = line[2:-2].split(" | ")
    rows[text] = dict(zip(COLUMNS, values))
  texts = [text for _, text, _ in ROWS]
  if strict and list(rows) != texts:
    raise ValueError(f"the contract table's rows are {list(rows)}, not "
                     f"{texts}: rewrite it with {WRITE_ENV}=1")
  return {key: rows[text] for key, text, _ in ROWS if text in rows}


def check_cell(test, row: str, column: str, text: str) -> None:
  """Asserts that the guide's cell (`row`, `column`) reads `text` (what
  `test` measured); writes it there instead when `WRITE_ENV` is set."""
  owners = {key: owner for key, _, owner in ROWS}
  test.assertIn(row, owners, "a row of conformance_table.ROWS")
  test.assertIn(column, COLUMNS)
  owner = owners[row][column]
  measurer = os.path.splitext(os.path.basename(inspect.getfile(type(test))))[0]
  test.assertEqual(owner, measurer,
                   f"cell ({row}, {column}) is measured by {owner}")
  with open(DOC) as f:
    doc_text = f.read()
  if os.environ.get(WRITE_ENV):
    cells = read_cells(doc_text, strict=False)
    cells.setdefault(row, {})[column] = text
    with open(DOC, "w") as f:
      f.write(_PATTERN.sub(lambda m: m.group(1) + render(cells) + m.group(3),
                           doc_text))
    return
  test.assertEqual(
      read_cells(doc_text)[row][column], text,
      f"the guide's cell ({row}, {column}) differs from what {owner} "
      f"measured: rerun it with {WRITE_ENV}=1 and commit the guide")
