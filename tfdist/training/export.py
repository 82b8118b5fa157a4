"""`tfdist.training.export`: SavedModel export now lives in
`tfdist.training.state.export` (what persists and leaves the run); this old
path is the same module object, kept because the serving guide tells users
to call `tfdist.training.export.signature(export_dir)` on an exported
model (docs/guides/serving.md), so scripts written against it name this
path."""

import sys

from tfdist.training.state import export

sys.modules[__name__] = export
