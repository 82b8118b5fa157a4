"""What tensor parallelism could split in any model: a Keras `LayoutMap`
derived for the model and read by `tfdist.parallel.layout_map`.

`tensor_split_of(model, degree)` proposes, layer by layer in model order,
the splits of Megatron-LM (Shoeybi et al. 2019, section 3) over a `model`
axis of `degree` devices: each `MultiHeadAttention` by heads, each
`Embedding` by vocabulary, and each `Dense` or `EinsumDense` by columns
paired with the next one by rows. A proposal is kept only when
`layout_map.read_layout_map` accepts the map with it (no gather, every
split dimension divisible by the degree), so what is counted is what a
layout map could split in this model, whatever its layers are named.

Nothing here trains. `tfdist.train --tensor_parallel` trains the built-in
Transformer split (its attention heads and feed-forward units), and
`tfdist.fit(model_fn, ..., layout_map=...)` a model of one's own (its
`Dense` and `MultiHeadAttention` splits,
`tfdist.parallel.tensor.from_layout_map`): `trained_bytes` counts those
splits, not an `Embedding`'s or an `EinsumDense`'s, which a layout map can
describe but tfdist's trainer does not split yet.
"""

import dataclasses
from typing import Dict, List, Optional, Tuple

from tfdist import errors
from tfdist.runtime import private_api


@dataclasses.dataclass(frozen=True)
class TensorSplit:
  """The splits a derived layout map gives a model.

  Attributes:
    degree: T, the devices of the `model` axis.
    split_bytes: bytes of the weights split over T (each device holds
      1/T of them).
    weight_bytes: bytes of all the model's weights.
    layers: each split layer's kind (`column`, `row`, `heads`,
      `vocabulary`), by layer name, in model order.
    pairs: the Megatron pairs (column layer, row layer); an attention
      layer split by heads is `(name, name)`.
    trained_bytes: the part of `split_bytes` in the layers tfdist's
      trainer splits (`Dense` and `MultiHeadAttention`, `TRAINED_KINDS`).
    trained_layers: those layers' names, in model order.
  """
  degree: int
  split_bytes: int
  weight_bytes: int
  layers: Dict[str, str]
  pairs: Tuple[Tuple[str, str], ...] = ()
  trained_bytes: int = 0
  trained_layers: Tuple[str, ...] = ()

  def to_dict(self) -> dict:
    return {"degree": self.degree, "split_bytes": self.split_bytes,
            "weight_bytes": self.weight_bytes, "layers": dict(self.layers),
            "pairs": [list(p) for p in self.pairs],
            "trained_bytes": self.trained_bytes,
            "trained_layers": list(self.trained_layers)}


# The layer classes whose splits tfdist's trainer trains
# (`tfdist.parallel.tensor.from_layout_map.SUPPORTED`; the built-in
# Transformer's --tensor_parallel splits the same two).
TRAINED_KINDS = ("Dense", "MultiHeadAttention")


def _mesh_map(degree: int):
  import keras  # pylint: disable=g-import-not-at-top
  mesh = keras.distribution.DeviceMesh(
      (1, degree), ["batch", "model"],
      devices=[f"cpu:{i}" for i in range(degree)])
  return keras.distribution.LayoutMap(mesh)


def _plan(model, degree: int, entries: Dict[str, tuple]):
  """`read_layout_map`'s plan for `entries`, or None where it refuses."""
  from tfdist.parallel import layout_map  # pylint: disable=g-import-not-at-top
  spec = _mesh_map(degree)
  for path, axes in entries.items():
    spec[path] = axes
  try:
    return layout_map.read_layout_map(model, spec)
  except (errors.ConfigError, ValueError, TypeError, AttributeError):
    # Refused (a gather, a dimension T does not divide), or a model whose
    # graph the reader cannot walk: that split is not counted.
    return None


def _einsum_axis(layer, kind: str) -> Optional[int]:
  """The kernel axis of an EinsumDense `layer` that a `column` (an output
  letter, the last) or `row` (a contracted letter, the first) split
  takes; None if it has none."""
  inputs, output = layer.equation.split("->")
  kernel = inputs.split(",")[1]
  axes = [i for i, letter in enumerate(kernel)
          if (letter in output) == (kind == "column")]
  if not axes:
    return None
  return axes[-1] if kind == "column" else axes[0]


def _dense_entries(layer, kind: str) -> Dict[str, tuple]:
  """A Dense or EinsumDense `layer`'s entries for a `column` or `row`
  split ({} where it has none): the kernel's split axis, and a column
  layer's bias on its output."""
  kernel = layer.kernel
  rank = len(kernel.shape)
  if type(layer).__name__ == "Dense":
    axis = rank - 1 if kind == "column" else 0
  else:
    axis = _einsum_axis(layer, kind)
    if axis is None:
      return {}
  entries = {kernel.path: tuple("model" if i == axis else None
                                for i in range(rank))}
  bias = getattr(layer, "bias", None)
  if kind == "column" and bias is not None:
    entries[bias.path] = (None,) * (len(bias.shape) - 1) + ("model",)
  return entries


def _attention_entries(layer) -> Dict[str, tuple]:
  """MultiHeadAttention by heads: the query, key and value kernels
  `[d, heads, dim]` and biases `[heads, dim]` on their heads axis, the
  output kernel `[heads, dim, d]` on its first; the output bias whole."""
  entries = {}
  for v in layer.weights:
    rank = len(v.shape)
    if v.path.split("/")[-2] == "attention_output":
      axis = 0 if v.path.endswith("kernel") else None
    else:
      axis = rank - 2
    if axis is not None:
      entries[v.path] = tuple("model" if i == axis else None
                              for i in range(rank))
  return entries


def _proposals(model) -> List[Tuple[str, object, object]]:
  """`(kind, layer, next_dense)` in model order: each attention and
  embedding layer, and each Dense or EinsumDense with the next one."""
  layers = [l for l in model.layers if l.weights]
  dense = [l for l in layers
           if type(l).__name__ in ("Dense", "EinsumDense")]
  out = []
  for layer in layers:
    kind = type(layer).__name__
    if kind == "MultiHeadAttention":
      out.append(("heads", layer, None))
    elif kind == "Embedding":
      out.append(("vocabulary", layer, None))
    elif layer in dense and dense.index(layer) + 1 < len(dense):
      out.append(("pair", layer, dense[dense.index(layer) + 1]))
  return out


def derive_entries(model, degree: int) -> Dict[str, tuple]:
  """Layout map entries (variable path -> axes over `batch` and `model`)
  that split every layer of a built Keras `model` a Megatron split can
  take over `degree` devices (see the module docstring): each proposal
  kept where `layout_map.read_layout_map` accepts the map with it."""
  entries, taken = {}, set()
  for kind, layer, partner in _proposals(model):
    if layer.name in taken:
      continue
    if kind == "heads":
      unit = _attention_entries(layer)
    elif kind == "vocabulary":
      unit = {layer.embeddings.path: ("model", None)}
    else:
      row = _dense_entries(partner, "row")
      unit = {**_dense_entries(layer, "column"), **row} if row else {}
    if unit and _plan(model, degree, {**entries, **unit}) is not None:
      entries.update(unit)
      taken.add(layer.name)
      if partner is not None:
        taken.add(partner.name)
  return entries


def tensor_split_of(model, degree: int, layout_map=None) -> TensorSplit:
  """The `TensorSplit` of a built Keras `model` over `degree` (>= 2)
  devices, from `derive_entries`' layout map (or `layout_map`, the user's
  `keras.distribution.LayoutMap`, whose `model` axis is `degree`) read by
  `tfdist.parallel.layout_map.read_layout_map`. Byte counts from the
  variables' shapes and dtypes; `split_bytes` 0 where nothing splits.

  Raises:
    tfdist.errors.ConfigError: `read_layout_map`'s refusals of a given
      `layout_map` (a derived one is never refused).
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.parallel import layout_map as layout_map_lib  # pylint: disable=g-import-not-at-top

  def nbytes(v) -> int:
    return int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size

  weights = {v.path: v for v in model.weights}
  plan = (_plan(model, degree, derive_entries(model, degree))
          if layout_map is None else
          layout_map_lib.read_layout_map(model, layout_map))
  if plan is None:  # Not a model read_layout_map can read.
    return TensorSplit(degree, 0, sum(map(nbytes, weights.values())), {})
  split = sum(nbytes(weights[p]) for p, s in plan.splits.items()
              if s.split != "replicated" and p in weights)
  layers = {l.name: l for l in private_api.flatten_layers(model)}
  trained = tuple(name for name in plan.layers if name in layers and
                  type(layers[name]).__name__ in TRAINED_KINDS)
  owned = {id(w) for name in trained for w in layers[name].weights}
  trained_bytes = sum(
      nbytes(weights[p]) for p, s in plan.splits.items()
      if s.split != "replicated" and p in weights
      and id(weights[p]) in owned)
  return TensorSplit(degree, split, sum(map(nbytes, weights.values())),
                     dict(plan.layers), tuple(plan.pairs), trained_bytes,
                     trained)
