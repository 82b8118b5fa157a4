"""`tfdist.training.optimizers`: the optimizer registry now lives in
`tfdist.core.optimizers` (the bottom floor, docs/design/architecture.md);
this old path is the same module object, kept because `--helpfull`
(--optimizer) and user code name
`tfdist.training.optimizers.register_optimizer`."""

import sys

from tfdist.core import optimizers

sys.modules[__name__] = optimizers
