"""`tfdist.parallel.tensor_parallel_options`: the old name of
`tfdist.parallel.tensor.options`, the same module object. Kept only while
`tfdist/diagnose.py` (being split into a package) imports it; delete it
when that import reads `from tfdist.parallel.tensor import options`."""

import sys

from tfdist.parallel.tensor import options

sys.modules[__name__] = options
