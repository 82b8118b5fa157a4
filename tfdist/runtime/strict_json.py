"""Values made strict JSON: the run manifest, the run log, evaluation results.

`json.dumps(..., allow_nan=False)` refuses the NaN and infinities a run can
produce (a NaN AUC, an infinite loss); `json_safe` turns them into None (null)
and NumPy scalars into Python numbers.
"""

import math
from typing import Any


def json_safe(value: Any) -> Any:
  """A copy of `value` (dicts, lists, numbers, strings) with every
  non-finite float (inf, -inf, NaN) replaced by None and NumPy scalars made
  Python numbers, so `json.dumps(..., allow_nan=False)` accepts it.

  Tuples become lists (as JSON writes them); other values are returned as
  they are.
  """
  if isinstance(value, dict):
    return {k: json_safe(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [json_safe(v) for v in value]
  if hasattr(value, "item") and getattr(value, "shape", None) == ():
    value = value.item()  # NumPy scalar.
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value
