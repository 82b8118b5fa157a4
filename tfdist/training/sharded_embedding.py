"""`tfdist.training.sharded_embedding`: the parameter-server embedding layer
now lives in `tfdist.distribute.sharded_embedding` (the floor the parameter-
server code is on, docs/design/architecture.md); this old path is the same
module object, kept because user code and saved examples name
`tfdist.training.sharded_embedding.ShardedEmbedding`."""

import sys

from tfdist.distribute import sharded_embedding

sys.modules[__name__] = sharded_embedding
