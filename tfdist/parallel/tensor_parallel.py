"""`tfdist.parallel.tensor_parallel`: the documented name of
`tfdist.parallel.tensor.layers` (docs/guides/tensor-parallelism.md), the
same module object."""

import sys

from tfdist.parallel.tensor import layers

sys.modules[__name__] = layers
