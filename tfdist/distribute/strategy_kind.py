"""`tfdist.distribute.strategy_kind`: the strategy kinds now live in
`tfdist.core.strategy_kind` (the bottom floor, docs/design/architecture.md);
this old path is the same module object, kept because user code adds a kind
with `tfdist.distribute.strategy_kind.register_kind`."""

import sys

from tfdist.core import strategy_kind

sys.modules[__name__] = strategy_kind
