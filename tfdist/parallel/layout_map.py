"""A Keras `LayoutMap` read as a tensor-parallel plan for a built model.

A Keras user describes tensor parallelism for JAX with
`keras.distribution.LayoutMap` over a `keras.distribution.DeviceMesh` whose
axes are named `batch` and `model` (under the TensorFlow backend these
objects construct and resolve, but `set_distribution` does nothing: they
are data). `read_layout_map(model, layout_map)` decides, for each variable
of the model's `Dense`, `EinsumDense`, `MultiHeadAttention` and `Embedding`
layers, how it would be split over the `model` axis (T devices):

* `column`: a Dense kernel `(None, "model")`, an EinsumDense kernel split
  on an output dimension, an Embedding table `(None, "model")`. Each
  device holds out/T output features; the input passes through
  Megatron's f (all-reduce backward).
* `row`: a Dense kernel `("model", None)`, an EinsumDense kernel split on
  a contracted dimension. Each device holds in/T input features; the
  output passes through g (all-reduce forward).
* `heads`: MultiHeadAttention's query, key and value kernels and biases
  split on their heads axis, its output kernel on its heads axis. Each
  device holds heads/T heads: column then row inside the layer, one pair.
* `vocabulary`: an Embedding table `("model", None)`. Each device holds
  vocabulary/T rows; the looked-up vectors are all-reduced forward.
* `replicated`: no entry, or an entry of `None`s: the whole variable.

A bias follows its kernel: split with a column kernel's outputs, whole with
a row kernel (added after the all-reduce).

Megatron pairs (Shoeybi et al. 2019, section 3): a column-parallel layer
whose output reaches a row-parallel layer through elementwise layers only
(`Activation`, `Dropout`, `ReLU`, ...) forms a pair: one all-reduce in the
forward pass (g) and one in the backward pass (f). Each attention layer
split by heads is a pair by itself.

Refusals (`tfdist.errors.ConfigError`, status 2), each naming the map
entry or variable path, the value and the fix:

* a split whose output would need a gather: a column-parallel layer whose
  output reaches anything but a row-parallel layer (another column layer,
  a normalization, the model's output), a row-parallel layer whose input
  is not split, a row layer's bias split over `model`, attention split on
  anything but the heads axis or with its output projection not split by
  heads;
* a map entry that names no variable of the model;
* a split that does not divide its dimension (units, heads, vocabulary) by
  T, or a variable split on two axes;
* a variable of any other layer split over `model` (no tensor-parallel
  rule), weights split over `batch` (not supported), a mesh without a
  `model` axis, a layout whose rank is not the variable's.

`read_distribution(model, distribution)` reads a
`keras.distribution.ModelParallel` the same way. Nothing here trains: the
plan is what `tfdist.fit(model_fn, ..., layout_map=...)` splits the model
by (`tfdist.parallel.tensor.from_layout_map`: Dense split by columns or
rows, MultiHeadAttention by heads; the tensor mode trains it).
"""

import dataclasses
import re
from typing import Dict, List, Optional, Sequence, Tuple

import keras

from tfdist import errors

MODEL_AXIS = "model"
BATCH_AXIS = "batch"
SPLITS = ("column", "row", "heads", "vocabulary", "replicated")
# Layers that act on each feature alone: a split output passes through.
_ELEMENTWISE = ("Activation", "Dropout", "ReLU", "LeakyReLU", "ELU",
                "PReLU", "Softmax", "Identity", "GaussianDropout",
                "GaussianNoise", "AlphaDropout", "SpatialDropout1D")
_RULE_LAYERS = ("Dense", "EinsumDense", "MultiHeadAttention", "Embedding")


@dataclasses.dataclass(frozen=True)
class VariableSplit:
  """How one variable is split.

  Attributes:
    path: the variable's path (`"dense/kernel"`).
    layer: its layer's name.
    split: one of `SPLITS`.
    axis: the split dimension of the variable (None when replicated).
    entry: the map entry (key) that gave its layout, or None.
  """

  path: str
  layer: str
  split: str
  axis: Optional[int] = None
  entry: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class TensorParallelPlan:
  """The splits of a model's variables over the `model` axis.

  Attributes:
    degree: T, the size of the mesh's `model` axis.
    splits: each variable's split, by path.
    layers: each split layer's kind (`column`, `row`, `heads`,
      `vocabulary`), by layer name.
    pairs: (column layer, row layer) Megatron pairs, in model order; an
      attention layer split by heads is `(name, name)`.
  """

  degree: int
  splits: Dict[str, VariableSplit]
  layers: Dict[str, str]
  pairs: Tuple[Tuple[str, str], ...]

  @property
  def all_reduces(self) -> Dict[str, int]:
    """Per training step: `{"forward": n, "backward": n}` all-reduces of
    activations (one each per pair; one forward per embedding split by
    vocabulary)."""
    vocab = sum(1 for k in self.layers.values() if k == "vocabulary")
    return {"forward": len(self.pairs) + vocab,
            "backward": len(self.pairs)}


def _refuse(message: str):
  raise errors.ConfigError(message)


def model_degree(layout_map) -> int:
  """T, the size of the map's mesh axis `model`.

  Raises:
    tfdist.errors.ConfigError: the mesh has no axis named `model`, or an
      axis other than `batch` and `model` (a `data` axis would otherwise be
      read as no data-parallel axis at all).
  """
  mesh = layout_map.device_mesh
  names = list(mesh.axis_names)
  if MODEL_AXIS not in names:
    _refuse(f"The layout map's DeviceMesh has axes {names}; tensor "
            f"parallelism splits over an axis named {MODEL_AXIS!r}. Build "
            "the mesh with axis_names=['batch', 'model'].")
  other = [n for n in names if n not in (BATCH_AXIS, MODEL_AXIS)]
  if other:
    _refuse(f"The layout map's DeviceMesh has axes {names}: tfdist reads "
            f"the data-parallel axis as {BATCH_AXIS!r} and the "
            f"tensor-parallel one as {MODEL_AXIS!r}, and has no other. "
            f"Rename {other[0]!r} to {BATCH_AXIS!r} (axis_names=['batch', "
            "'model']), or leave it out (tfdist derives the data-parallel "
            "copies from the devices).")
  return int(mesh.shape[names.index(MODEL_AXIS)])


def batch_degree(layout_map) -> int:
  """The size of the map's mesh axis `batch` (1 without one): the number
  of data-parallel copies its author meant. tfdist derives D from the
  devices (D = replicas / T) and only compares (`batch_axis_note`)."""
  mesh = layout_map.device_mesh
  names = list(mesh.axis_names)
  return int(mesh.shape[names.index(BATCH_AXIS)]) if BATCH_AXIS in names else 1


def batch_axis_note(layout_map, data: int) -> Optional[str]:
  """A warning when the map's `batch` axis is not the run's D, else None.

  Args:
    layout_map: the `keras.distribution.LayoutMap`.
    data: D, the run's data-parallel copies (replicas / T).
  """
  batch, tensor = batch_degree(layout_map), model_degree(layout_map)
  if batch == data:
    return None
  devices = batch * tensor
  return (f"The layout map's DeviceMesh has a 'batch' axis of {batch}, but "
          f"this run has {data * tensor} replica(s): D = {data} "
          f"data-parallel cop{'y' if data == 1 else 'ies'} of T = {tensor} "
          "(tfdist derives D from the devices). For D = "
          f"{batch}, pass num_cpu_devices={devices} (CPUs) or "
          f"num_gpus={devices}; or build the mesh with a 'batch' axis of "
          f"{data}.")


def axes_of(layout) -> Optional[Tuple]:
  """A layout's axis names (a `TensorLayout`'s `axes`, or the tuple
  itself); None for None."""
  if layout is None:
    return None
  return tuple(getattr(layout, "axes", layout))


def _lookup(layout_map, path: str):
  """Keras's own rule (`LayoutMap.__getitem__`, Keras 3.15): the exact
  key, else the one key that `re.fullmatch`es the path."""
  try:
    return layout_map[path]
  except ValueError as e:
    _refuse(f"Variable {path!r} matches several layout map entries ({e}). "
            "Make the entries' patterns match it once.")


def _entry_for(layout_map, path: str) -> Optional[str]:
  keys = list(layout_map.keys())
  if path in keys:
    return path
  found = [k for k in keys if re.fullmatch(k, path)]
  return found[0] if found else None


def _split_axis(path: str, entry, axes: Tuple, shape, degree: int
                ) -> Optional[int]:
  if len(axes) != len(shape):
    _refuse(f"Layout map entry {entry!r} gives {path!r} the layout {axes}, "
            f"of rank {len(axes)}, but the variable has shape {tuple(shape)}."
            " Give one axis name or None per dimension.")
  if BATCH_AXIS in axes:
    _refuse(f"Layout map entry {entry!r} splits {path!r} over 'batch' "
            f"({axes}): weights split over the data-parallel axis are not "
            "supported here. Use None for that dimension (ZeRO shards "
            "weights over the data axis: --zero_stage).")
  unknown = [a for a in axes if a not in (None, MODEL_AXIS)]
  if unknown:
    _refuse(f"Layout map entry {entry!r} names axes {unknown} for {path!r};"
            f" the mesh's axes are {BATCH_AXIS!r} and {MODEL_AXIS!r}.")
  split = [i for i, a in enumerate(axes) if a == MODEL_AXIS]
  if not split:
    return None
  if len(split) > 1:
    _refuse(f"Layout map entry {entry!r} splits {path!r} over 'model' on "
            f"{len(split)} dimensions ({axes}). Split one dimension.")
  axis = split[0]
  if shape[axis] % degree:
    _refuse(f"Layout map entry {entry!r} splits dimension {axis} of "
            f"{path!r} (size {shape[axis]}) over {degree} 'model' devices, "
            f"which does not divide it. Use a 'model' axis of a size that "
            f"divides {shape[axis]}, or change the layer's size.")
  return axis


def _einsum_kind(layer, axis: int) -> str:
  """`column` if the kernel's split letter is an output letter, `row` if
  it is contracted."""
  inputs, output = layer.equation.split("->")
  kernel = inputs.split(",")[1]
  letter = kernel[axis]
  return "column" if letter in output else "row"


def _layer_plan(layer, degree: int, layout_map) -> Tuple[Optional[str],
                                                          List[VariableSplit]]:
  """(the layer's kind or None, its variables' splits)."""
  kind_name = type(layer).__name__
  if kind_name == "MultiHeadAttention" and layer.num_heads % degree:
    _refuse(f"MultiHeadAttention {layer.name!r} has num_heads="
            f"{layer.num_heads}, which does not divide by the {degree} "
            f"'model' devices. Use a 'model' axis of a size dividing "
            f"{layer.num_heads}, or leave the layer replicated.")
  found = {}
  for v in layer.weights:
    entry = _entry_for(layout_map, v.path)
    axes = axes_of(_lookup(layout_map, v.path))
    axis = None if axes is None else _split_axis(
        v.path, entry, axes, v.shape, degree)
    found[v.path] = (v, entry, axis)
  split_any = [p for p, (_, _, a) in found.items() if a is not None]
  if not split_any:
    return None, [VariableSplit(p, layer.name, "replicated", None, e)
                  for p, (_, e, _) in found.items()]
  if kind_name not in _RULE_LAYERS:
    path = split_any[0]
    _refuse(f"Layout map entry {found[path][1]!r} splits {path!r} of a "
            f"{kind_name} layer over 'model': tfdist has no tensor-parallel "
            f"rule for {kind_name} (only {', '.join(_RULE_LAYERS)}). Remove "
            "the entry, or use None for every dimension.")
  short = {p.rsplit("/", 1)[-1]: p for p in found}
  if kind_name == "MultiHeadAttention":
    return _attention_plan(layer, found, degree)
  if kind_name == "Embedding":
    path = short.get("embeddings")
    _, entry, axis = found[path]
    kind = "vocabulary" if axis == 0 else "column"
    return kind, [VariableSplit(path, layer.name, kind, axis, entry)]
  kernel = short.get("kernel")
  if kernel is None or found[kernel][2] is None:
    path = split_any[0]
    _refuse(f"Layout map entry {found[path][1]!r} splits {path!r} but not "
            f"the kernel of {layer.name!r}: a bias is split with its kernel."
            " Split the kernel too, or leave the bias replicated.")
  _, k_entry, k_axis = found[kernel]
  if kind_name == "Dense":
    kind = "column" if k_axis == 1 else "row"
  else:
    kind = _einsum_kind(layer, k_axis)
  out = [VariableSplit(kernel, layer.name, kind, k_axis, k_entry)]
  for path, (v, entry, axis) in found.items():
    if path == kernel:
      continue
    if kind == "row" and axis is not None:
      _refuse(f"Layout map entry {entry!r} splits {path!r}, the bias of the "
              f"row-parallel layer {layer.name!r}: it is added after the "
              "all-reduce and would need a gather. Leave it replicated "
              "(None).")
    if kind == "column":
      # The bias follows the kernel's output split (its last dimension).
      out.append(VariableSplit(path, layer.name, "column",
                               len(v.shape) - 1, entry))
    else:
      out.append(VariableSplit(path, layer.name, "replicated", None, entry))
  return kind, out


def _attention_plan(layer, found, degree):
  del degree  # checked by the caller
  out = []
  for path, (v, entry, axis) in found.items():
    sub = path.split("/")[-2]
    # query/key/value kernels [d, heads, dim], biases [heads, dim];
    # attention_output kernel [heads, dim, d], bias [d].
    if sub == "attention_output":
      want = 0 if path.endswith("kernel") else None
    else:
      want = len(v.shape) - 2
    if axis != want:
      if want is None:
        what = "it is added after the all-reduce: leave it replicated"
      else:
        what = (f"split dimension {want} (the heads) on every projection "
                "of the layer")
      _refuse(f"Layout map entry {entry!r} gives {path!r} the split "
              f"{'none' if axis is None else 'on dimension ' + str(axis)}; "
              f"attention is split by heads only, so this would need a "
              f"gather. {what[0].upper() + what[1:]}.")
    out.append(VariableSplit(path, layer.name,
                             "replicated" if axis is None else "heads",
                             axis, entry))
  return "heads", out


def layer_consumers(model) -> Dict[str, List[str]]:
  """Each layer's consumers (layer names; None: the model's output), from
  the functional graph; in a Sequential or subclassed model without one,
  the next layer."""
  producers = {}
  layers = [l for l in model.layers
            if type(l).__name__ != "InputLayer"]
  names = [l.name for l in layers]
  chain = {n: [names[i + 1]] if i + 1 < len(names) else [None]
           for i, n in enumerate(names)}
  if isinstance(model, keras.Sequential):
    return chain
  try:
    for l in layers:
      for t in keras.tree.flatten(l.output):
        producers[id(t)] = l.name
    consumers = {l.name: [] for l in layers}
    for l in layers:
      for t in keras.tree.flatten(l.input):
        if id(t) in producers and l.name not in consumers[producers[id(t)]]:
          consumers[producers[id(t)]].append(l.name)
    outputs = {id(t) for t in keras.tree.flatten(model.outputs)}
    for l in layers:
      if any(id(t) in outputs for t in keras.tree.flatten(l.output)):
        consumers[l.name].append(None)
    return consumers
  except (AttributeError, ValueError):
    return chain


def _pairs(model, kinds: Dict[str, str], splits) -> List[Tuple[str, str]]:
  consumers = layer_consumers(model)
  by_name = {l.name: l for l in model.layers}
  kernel_of = {}
  for s in splits.values():  # a layer's kernel comes before its bias
    if s.split in ("column", "row") and s.axis is not None:
      kernel_of.setdefault(s.layer, s.path)
  pairs, fed = [], set()
  for name in consumers:
    kind = kinds.get(name)
    if kind == "heads":
      pairs.append((name, name))
      continue
    if kind != "column":
      continue
    reached, frontier = set(), list(consumers[name])
    while frontier:
      nxt = frontier.pop()
      if nxt is not None and type(by_name[nxt]).__name__ in _ELEMENTWISE:
        frontier.extend(consumers[nxt])
      else:
        reached.add(nxt)
    bad = sorted(str(r) if r is not None else "the model's output"
                 for r in reached if r is None or kinds.get(r) != "row")
    if bad:
      _refuse(f"{kernel_of[name]!r} is column-parallel, but the output of "
              f"{name!r} reaches {', '.join(bad)}, which is not a "
              "row-parallel layer: its split output would need a gather. "
              "Split the next Dense by rows (('model', None)), or leave "
              f"{name!r} replicated.")
    for r in sorted(reached):
      pairs.append((name, r))
      fed.add(r)
  for name, kind in kinds.items():
    if kind == "row" and name not in fed:
      _refuse(f"{kernel_of[name]!r} is row-parallel, but the input of "
              f"{name!r} does not come split from a column-parallel layer: "
              "each device would first need its slice of a whole input. "
              "Split the layer before it by columns ((None, 'model')), or "
              f"leave {name!r} replicated.")
  return pairs


def read_layout_map(model, layout_map) -> TensorParallelPlan:
  """The tensor-parallel plan a `keras.distribution.LayoutMap` gives a
  built Keras model.

  Args:
    model: a built `keras.Model` (functional or Sequential; a subclassed
      model's layers are taken in order, each feeding the next).
    layout_map: a `keras.distribution.LayoutMap` over a
      `keras.distribution.DeviceMesh` with axes `batch` and `model`; its
      keys are variable paths or regular expressions that match a whole
      path (Keras's rule, `re.fullmatch`), its values `TensorLayout`s or
      axis tuples.

  Returns:
    A `TensorParallelPlan`: every variable's split, each split layer's
    kind, the Megatron pairs.

  Raises:
    tfdist.errors.ConfigError (status 2): see the module docstring; each
      message names the map entry or variable, the value and the fix.
  """
  degree = model_degree(layout_map)
  splits, kinds = {}, {}
  for layer in model.layers:
    if not layer.weights or type(layer).__name__ in ("Sequential",
                                                     "Functional"):
      continue
    kind, found = _layer_plan(layer, degree, layout_map)
    for s in found:
      splits[s.path] = s
    if kind:
      kinds[layer.name] = kind
  paths = [v.path for v in model.weights]
  for key in layout_map.keys():
    if not any(key == p or re.fullmatch(key, p) for p in paths):
      _refuse(f"Layout map entry {key!r} names no variable of model "
              f"{model.name!r} (its variables: {paths[:8]}"
              f"{' ...' if len(paths) > 8 else ''}). Fix the path or "
              "pattern, or remove the entry.")
  pairs = _pairs(model, kinds, splits)
  return TensorParallelPlan(degree=degree, splits=splits, layers=kinds,
                            pairs=tuple(pairs))


def layout_map_of(distribution):
  """The `keras.distribution.LayoutMap` of a `ModelParallel` (its layout
  map, batch axis named `batch`); anything else is returned as it is
  (`tfdist.parallel.tensor.from_layout_map.degree` refuses what is not a
  `LayoutMap`).

  Raises:
    tfdist.errors.ConfigError: a ModelParallel without a layout map, or
      whose batch dimension is not named `batch`.
  """
  if not isinstance(distribution, keras.distribution.ModelParallel):
    return distribution
  layout_map = getattr(distribution, "_layout_map", None)
  if layout_map is None:
    _refuse("The ModelParallel has no layout map. Pass ModelParallel("
            "layout_map=..., batch_dim_name='batch').")
  batch = getattr(distribution, "batch_dim_name", BATCH_AXIS)
  if batch != BATCH_AXIS:
    _refuse(f"ModelParallel(batch_dim_name={batch!r}): tfdist reads the "
            f"data-parallel axis as {BATCH_AXIS!r}. Name it 'batch'.")
  return layout_map


def read_distribution(model, distribution) -> TensorParallelPlan:
  """`read_layout_map` for a `keras.distribution.ModelParallel`.

  Raises:
    tfdist.errors.ConfigError: not a ModelParallel (or one without a
      layout map), its batch dimension not named `batch`, or any refusal
      of `read_layout_map`.
  """
  if not isinstance(distribution, keras.distribution.ModelParallel):
    _refuse(f"distribution={type(distribution).__name__} is not a "
            "keras.distribution.ModelParallel. Pass ModelParallel("
            "layout_map=..., batch_dim_name='batch').")
  return read_layout_map(model, layout_map_of(distribution))
