"""`tfdist.training.reduce_dtype`: the all-reduce dtype names and checks now
live in `tfdist.core.reduce_dtype` (the bottom floor,
docs/design/architecture.md); this old path is the same module object, kept
because docstrings and user code name it."""

import sys

from tfdist.core import reduce_dtype

sys.modules[__name__] = reduce_dtype
