"""Cutting a Keras model into consecutive pieces: shared by the modes.

A Keras functional or Sequential model is read as a list of layer calls in
an order where every call's inputs come first (`model_calls`), and a
sequence of costs is cut into contiguous pieces with the smallest largest
sum (`balanced_cuts`). The pipeline (`tfdist.parallel.pipeline.stages`)
cuts the model into stages on devices; ZeRO stage 3
(`tfdist.parallel.zero3.optimizer.plan_blocks`) into blocks whose weights
are gathered one after another.
"""

import dataclasses
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from tfdist import errors


def balanced_cuts(costs: Sequence[float], num_stages: int) -> List[int]:
  """Cuts a sequence into contiguous stages with the smallest largest sum.

  Args:
    costs: the cost of each item, in order (bytes, >= 0).
    num_stages: P, 1 <= P <= len(costs).

  Returns:
    P-1 increasing indices: the first item of stages 1..P-1.

  Raises:
    PipelineConfigError: P below 1 or above len(costs).
  """
  n = len(costs)
  check_positive("num_stages", num_stages)
  if num_stages > n:
    raise errors.PipelineConfigError(
        f"num_stages={num_stages} is more than the {n} items to cut: "
        f"choose num_stages <= {n}.")
  prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, float))])
  inf = float("inf")
  best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
  start = [[0] * (n + 1) for _ in range(num_stages + 1)]
  best[0][0] = 0.0
  for k in range(1, num_stages + 1):
    for i in range(k, n - (num_stages - k) + 1):
      for j in range(k - 1, i):
        cost = max(best[k - 1][j], prefix[i] - prefix[j])
        if cost < best[k][i]:
          best[k][i], start[k][i] = cost, j
  cuts, i = [], n
  for k in range(num_stages, 0, -1):
    i = start[k][i]
    cuts.append(i)
  return sorted(cuts)[1:]


def check_positive(name: str, value: int) -> None:
  """Raises `tfdist.errors.PipelineConfigError` unless `value` is an int
  >= 1 (`name` names the argument)."""
  if not isinstance(value, int) or value < 1:
    raise errors.PipelineConfigError(
        f"{name}={value!r} must be a positive integer.")


# --- the model's graph as a list of layer calls ----------------------------
@dataclasses.dataclass(frozen=True)
class Call:
  """One call of a layer (or Keras operation) in the model's graph."""
  layer: Any
  in_keys: Tuple[Hashable, ...]
  out_keys: Tuple[Hashable, ...]
  run: Callable[[Dict[Hashable, Any], Optional[bool]], None]
  activation_bytes: int  # of the outputs, per example


def nbytes_per_example(keras_tensors) -> int:
  """Bytes per example of `keras_tensors` (symbolic; unknown dims skip)."""
  total = 0
  for t in keras_tensors:
    try:
      dims = [d for d in t.shape[1:]]
      if any(d is None for d in dims):
        continue
      total += int(np.prod(dims)) * tf.as_dtype(t.dtype).size
    except (AttributeError, TypeError, ValueError):
      continue
  return total


def with_training(layer, kwargs, training):
  """`kwargs` with `training` added when `layer`'s call takes it."""
  if training is not None and "training" in getattr(
      layer, "_call_context_args", ()):
    kwargs["training"] = training
  return kwargs


def functional_calls(model):
  """`(calls, input_keys, input_dtypes, output_keys)` of a functional
  model, in an order where every call's inputs come first."""
  nodes = []
  for depth in sorted(model._nodes_by_depth, reverse=True):  # pylint: disable=protected-access
    nodes.extend(model._nodes_by_depth[depth])  # pylint: disable=protected-access
  input_keys = tuple(id(t) for t in model.inputs)
  known = set(input_keys)
  calls = []
  for node in nodes:
    if not node.operation or node.is_input:
      continue
    in_keys = tuple(id(t) for t in node.input_tensors)
    if any(k not in known for k in in_keys):
      continue  # not reachable from the model's inputs (as Keras skips it)
    out_keys = tuple(id(t) for t in node.outputs)
    known.update(out_keys)

    def run(tensors, training, node=node):
      args, kwargs = node.arguments.fill_in(tensors)
      kwargs = with_training(node.operation, kwargs, training)
      outputs = node.operation(*args, **kwargs)
      for t, value in zip(node.outputs, keras.tree.flatten(outputs)):
        tensors[id(t)] = value

    calls.append(Call(node.operation, in_keys, out_keys, run,
                       nbytes_per_example(node.outputs)))
  return (calls, input_keys, [t.dtype for t in model.inputs],
          tuple(id(t) for t in model.outputs))


def sequential_calls(model):
  """The same for a Sequential model: a chain of its layers."""
  calls = []
  for i, layer in enumerate(model.layers):

    def run(tensors, training, layer=layer, i=i):
      tensors[i] = layer(tensors[i - 1],
                         **with_training(layer, {}, training))

    try:
      outputs = keras.tree.flatten(layer.output)
    except (AttributeError, ValueError):
      outputs = []
    calls.append(Call(layer, (i - 1,), (i,), run,
                       nbytes_per_example(outputs)))
  try:
    dtypes = [model.inputs[0].dtype]
  except (AttributeError, ValueError, TypeError, IndexError):
    dtypes = [None]
  return calls, (-1,), dtypes, (len(model.layers) - 1,)


def model_calls(model):
  """`(calls, input_keys, input_dtypes, output_keys)` of a Sequential or
  functional model (`Call`s in an order where every call's inputs come
  first).

  Raises:
    tfdist.errors.PipelineConfigError: an unbuilt Sequential model, or a
      subclassed model without a functional graph.
  """
  if isinstance(model, keras.Sequential):
    if not model.built or not model.layers:
      raise errors.PipelineConfigError(
          f"model {model.name!r} is a Sequential model that is not built: "
          "give it a keras.Input(shape) first (or call it once on a batch) "
          "before splitting it into pipeline stages.")
    return sequential_calls(model)
  if hasattr(model, "_nodes_by_depth") and getattr(model, "inputs", None):
    return functional_calls(model)
  raise errors.PipelineConfigError(
      f"model {model.name!r} ({type(model).__name__}) is a subclassed model "
      "without a functional graph, so it cannot be cut into pipeline "
      "stages: build it with the functional API (keras.Model(inputs, "
      "outputs)) or as keras.Sequential.")
