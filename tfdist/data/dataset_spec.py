"""`tfdist.data.dataset_spec`: `DatasetSpec` now lives in
`tfdist.core.dataset_spec` (the bottom floor, docs/design/architecture.md);
this old path is the same module object, kept because user code builds
`tfdist.data.dataset_spec.DatasetSpec`."""

import sys

from tfdist.core import dataset_spec

sys.modules[__name__] = dataset_spec
