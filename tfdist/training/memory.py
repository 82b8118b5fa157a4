"""`tfdist.training.memory`: the memory estimates now live in
`tfdist.training.plan.memory` (what a run decides before it starts); this
old path is the same module object, kept because the guides name its
functions for users to call on their own model (`layout_table`,
`sharded_estimate`: docs/guides/does-not-fit.md,
docs/guides/sharded-training.md), so scripts written against them name this
path."""

import sys

from tfdist.training.plan import memory

sys.modules[__name__] = memory
