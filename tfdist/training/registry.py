"""`tfdist.training.registry`: the model and data-set registry now lives in
`tfdist.core.registry` (the bottom floor, docs/design/architecture.md); this
old path is the same module object, kept because user code registers models
and data sets through `tfdist.training.registry.register_model` and
`register_dataset`."""

import sys

from tfdist.core import registry

sys.modules[__name__] = registry
