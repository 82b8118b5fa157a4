"""`tfdist.training.train_loop`: the inner training loop now lives in
`tfdist.training.step.train_loop` (the step and what runs in it); this old
path is the same module object, kept because the sharded-training guide
tells users below `tfdist.fit` to build `tfdist.training.train_loop.Trainer`
themselves (docs/guides/sharded-training.md), so scripts written against it
name this path."""

import sys

from tfdist.training.step import train_loop

sys.modules[__name__] = train_loop
