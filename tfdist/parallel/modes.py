"""The built-in parallelism modes, registered: import this module to look
them up by name (`tfdist.parallel.mode.get_mode`).

Importing it registers (`mode_names` lists them in this order, the
memory plan's row order):
`data` (`tfdist.parallel.data.mode`), `zero3` (`tfdist.parallel.zero3
.mode`), `pipeline` (`tfdist.parallel.pipeline.mode`), `tensor`
(`tfdist.parallel.tensor.mode`) and `experts`
(`tfdist.parallel.experts.mode`). A new built-in mode is one more import
here; a mode written elsewhere needs none (`register_mode`).
"""

from tfdist.parallel import mode
# Registered on import, in this order.
from tfdist.parallel.data import mode as data_mode  # pylint: disable=unused-import
from tfdist.parallel.zero3 import mode as zero3_mode  # pylint: disable=unused-import
from tfdist.parallel.pipeline import mode as pipeline_mode  # pylint: disable=unused-import
from tfdist.parallel.tensor import mode as tensor_mode  # pylint: disable=unused-import
from tfdist.parallel.experts import mode as experts_mode  # pylint: disable=unused-import

BUILTIN_MODES = ("data", "zero3", "pipeline", "tensor", "experts")

get_mode = mode.get_mode
mode_for = mode.mode_for
mode_name_for = mode.mode_name_for
mode_name_of = mode.mode_name_of
register_mode = mode.register_mode
PlanFacts = mode.PlanFacts


def mode_names() -> tuple:
  """Every registered mode's name: `BUILTIN_MODES` first (the memory
  plan's row order, whatever imported them first), then the others in
  registration order."""
  return BUILTIN_MODES + tuple(n for n in mode.mode_names()
                               if n not in BUILTIN_MODES)
