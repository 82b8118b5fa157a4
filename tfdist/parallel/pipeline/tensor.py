"""Tensor parallelism inside a pipeline's stages (pipeline x tensor, and
with `DataCopies` data x pipeline x tensor).

A pipeline (`tfdist.parallel.pipeline.stages`) is driven by one process:
each stage's ops are placed on its device by the stage's tasks, not run
as `tf.distribute` replicas. So the tensor-parallel split inside a stage
is placed the same way, by the layer itself: `StageSplitDense` holds the
T shards of a `keras.layers.Dense`'s kernel as T variables, shard t on
device t of the stage's tensor group, and computes each shard's product
there (its backward pass too: `_on_device`).

On a `tfdist.parallel.mesh.DeviceMesh` of D x P x T devices (index(d, p,
t) = (p * D + d) * T + t), stage p of copy d runs on device index(d, p,
0): its other layers (replicated: a LayerNorm, an embedding, a Dense the
map leaves whole) run there, and its split Dense layers fan out over the
devices index(d, p, t), t = 0 .. T-1:

* split by columns (kernel `(None, "model")`): shard t holds kernel[:,
  t*u/T:(t+1)*u/T] and that slice of the bias, and computes its units
  (the activation applied per unit) on device t from the input it is
  sent; the T slices are concatenated on the stage's device;
* split by rows (kernel `("model", None)`): shard t holds kernel[t*i/T:
  (t+1)*i/T, :] and multiplies the slice of the input it is sent on
  device t; the T partial products are summed on the stage's device,
  where the whole bias and the activation are added.

Gradients follow by automatic differentiation: the input's copies sent
to the shards sum their gradients (Megatron's f), the partial products'
sum hands each shard the whole gradient (g). Each shard's weights,
gradients and optimizer slots live on its device alone (1/T of the
layer's each); with D copies (`tfdist.parallel.pipeline.copies.
DataCopies`), copy d's shard t lives on index(d, p, t) and each shard's
gradient is all-reduced over its own data group (the D devices (·, p,
t)).

What this costs against Megatron's pairing (one all-reduce of the
row layer's output forward, one backward): the column layer's slices
are gathered on the stage's device and the row layer's input is sent
back out in slices, so a column-then-row pair moves its hidden
activations (units wide) twice each way instead of its output once.

`split_model(model, layout_map, tensor)` reads a Keras `LayoutMap` as
`tfdist.parallel.tensor.from_layout_map` does (its refusals), and clones
the model with each split Dense made a `StageSplitDense`, the unsharded
model's weights copied in. A `MultiHeadAttention` split by heads is
refused here (no stage-placed attention yet).
"""

from typing import Callable, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from tfdist import errors
from tfdist.parallel import mesh as mesh_lib
from tfdist.parallel.pipeline import stages as stages_lib
from tfdist.parallel.tensor import from_layout_map
from tfdist.parallel.tensor import layers as tp_lib

COLUMN, ROW = "column", "row"


def _device_of(value) -> Optional[str]:
  """The device a variable (or a tensor read from one) lives on, or None
  when it is not placed."""
  return getattr(value, "device", None) or None


def _on_device(device: Optional[str], fn: Callable, *xs):
  """`fn(*xs)` on `device`, its gradient computed there too (a tape's
  gradient ops are otherwise placed in the backward pass's device
  scope: the stage's first device)."""
  if device is None:
    return fn(*xs)

  @tf.custom_gradient
  def run(*args):
    with tf.device(device), tf.GradientTape() as tape:
      tape.watch(args)
      y = fn(*args)

    def grad(dy):
      with tf.device(device):
        return tape.gradient(y, args, output_gradients=dy)

    return y, grad

  return run(*xs)


def _read(variable):
  """`(value, device)`: `variable`'s value as a tensor and the device it
  lives on: inside a `keras.StatelessScope` (a data copy's,
  `DataCopies.scope`) the device its value was read on; else the one
  `Pipeline.place_variables` put the variable on (None: not placed)."""
  value = variable.value  # Keras's autocast reads it here, unplaced.
  return value, (_device_of(value) or
                 getattr(variable, stages_lib.SHARD_DEVICE, None))


@keras.saving.register_keras_serializable(package="tfdist")
class StageSplitDense(keras.layers.Layer):
  """`keras.layers.Dense` split T ways inside a pipeline stage, each shard
  on its own device (where `Pipeline.place_variables(tensor_devices=...)`
  puts it).

  Input: float [..., in]; output: float [..., units], as Dense's. Per
  shard t: kernel [in, units/T] and bias [units/T] (`split="column"`), or
  kernel [in/T, units] (`split="row"`; the whole bias [units] beside shard
  0). `full_weights` and `load_full_weights` convert to and from Dense's
  kernel and bias.

  Args:
    units: output units.
    split: "column" or "row".
    shards: T (>= 1), dividing `units` (column) or the input width (row).
    activation: a Keras activation; a column split applies it to each
      shard's units (it must not mix the features: refused by
      `split_model`). Defaults to None.
    use_bias: Defaults to True.
    kernel_initializer, bias_initializer: applied to the whole kernel and
      bias (as Dense) before they are split.

  Raises:
    ConfigError: an unknown split, T < 1, or T not dividing the split
      axis (at build).
  """

  def __init__(self, units: int, split: str, shards: int, activation=None,
               use_bias: bool = True, kernel_initializer="glorot_uniform",
               bias_initializer="zeros", **kwargs):
    super().__init__(**kwargs)
    if split not in (COLUMN, ROW):
      raise errors.ConfigError(f"StageSplitDense split={split!r}: use "
                               f"{COLUMN!r} or {ROW!r}.")
    if int(shards) < 1 or int(units) < 1:
      raise errors.ConfigError(
          f"StageSplitDense needs units >= 1 and shards >= 1. Received: "
          f"units={units}, shards={shards}.")
    self.units, self.split, self.shards = int(units), split, int(shards)
    self.activation = keras.activations.get(activation)
    self.use_bias = bool(use_bias)
    self.kernel_initializer = keras.initializers.get(kernel_initializer)
    self.bias_initializer = keras.initializers.get(bias_initializer)

  @property
  def axis(self) -> int:
    """The kernel's axis the shards split: 1 (columns) or 0 (rows)."""
    return 1 if self.split == COLUMN else 0

  def build(self, input_shape):
    full = (int(input_shape[-1]), self.units)
    if full[self.axis] % self.shards:
      what = "units" if self.split == COLUMN else "input width"
      raise errors.ConfigError(
          f"StageSplitDense {self.name!r} splits its {what} "
          f"{full[self.axis]} by {self.split}s {self.shards} ways: use a "
          f"tensor degree that divides {full[self.axis]}.")
    kernel = np.split(np.asarray(self.kernel_initializer(full)),
                      self.shards, axis=self.axis)
    self.kernels = [self._shard(f"kernel_{t}", piece, t)
                    for t, piece in enumerate(kernel)]
    self.biases = []
    if self.use_bias:
      bias = np.asarray(self.bias_initializer((self.units,)))
      self.biases = ([self._shard(f"bias_{t}", piece, t) for t, piece in
                      enumerate(np.split(bias, self.shards))]
                     if self.split == COLUMN else
                     [self._shard("bias", bias, 0)])

  def _shard(self, name: str, value: np.ndarray, t: int):
    variable = self.add_weight(
        name=name, shape=value.shape,
        initializer=lambda shape, dtype=None: tf.constant(value, dtype))
    setattr(variable, stages_lib.TENSOR_SHARD, t)
    return variable

  def compute_output_shape(self, input_shape):
    return tuple(input_shape[:-1]) + (self.units,)

  def call(self, inputs):
    kernels = [_read(k) for k in self.kernels]
    biases = [_read(b)[0] for b in self.biases]
    if self.split == COLUMN:
      def column(x, kernel, *bias):
        y = keras.ops.matmul(x, kernel)
        y = y + bias[0] if bias else y
        return self.activation(y) if self.activation is not None else y
      return tf.concat([
          _on_device(device, column, inputs, kernel, *biases[t:t + 1])
          for t, (kernel, device) in enumerate(kernels)], axis=-1)
    pieces = tf.split(inputs, self.shards, axis=-1)
    outputs = tf.add_n([
        _on_device(device, keras.ops.matmul, piece, kernel)
        for piece, (kernel, device) in zip(pieces, kernels)])
    if biases:
      outputs = outputs + biases[0]
    return self.activation(outputs) if self.activation is not None else (
        outputs)

  def full_weights(self) -> List[np.ndarray]:
    """Dense's `[kernel, bias]` (`[kernel]` without a bias): the shards
    concatenated."""
    return [join(parts, axis) for parts, axis in self._whole()]

  def load_full_weights(self, weights: Sequence[np.ndarray]) -> None:
    """Assigns Dense's `[kernel, bias]` to the shards."""
    for (parts, axis), value in zip(self._whole(), weights):
      assign_joined(parts, axis, value)

  def _whole(self) -> List[Tuple[List[keras.Variable], Optional[int]]]:
    """Dense's kernel (and bias) as `(the shards holding it, the axis
    they split it on; None: one holds it whole)`."""
    out = [(list(self.kernels), self.axis)]
    if self.use_bias:
      out.append((list(self.biases), 0 if self.split == COLUMN else None))
    return out

  def get_config(self):
    config = super().get_config()
    config.update(tp_lib.dense_config(self), split=self.split,
                  shards=self.shards)
    return config


def _stage_layer(layer, kind: str, entry: str, tensor: int):
  """`layer`'s `StageSplitDense` (`kind` column or row); an attention
  split by heads is refused."""
  if kind not in (COLUMN, ROW):
    raise errors.ConfigError(
        f"Layout map entry {entry!r} splits {type(layer).__name__} "
        f"{layer.name!r} by {kind}: inside a pipeline's stages "
        "(--pipeline_stages with --tensor_parallel) only Dense layers split "
        "by columns or rows are built yet. Leave it replicated (drop the "
        "entry), or drop --pipeline_stages to split it over the replicas.")
  config = layer.get_config()
  return StageSplitDense(
      units=config["units"], split=kind, shards=tensor,
      activation=config["activation"], use_bias=config["use_bias"],
      kernel_initializer=config["kernel_initializer"],
      bias_initializer=config["bias_initializer"], name=config["name"],
      dtype=config["dtype"])


def split_model(model, layout_map, tensor: int) -> keras.Model:
  """`model` cloned with each Dense the map splits made a
  `StageSplitDense` of T = `tensor` shards, `model`'s weights and its
  random layers' seed states copied in (the clone's dropout draws as
  `model`'s would).

  Then cut the clone (`stages.split_model(clone, P, devices=
  copy0_devices(mesh))`) and place it (`place_variables(tensor_devices=
  tensor_devices(mesh))`).

  Args:
    model: the unsharded, built model (functional or Sequential).
    layout_map: a `keras.distribution.LayoutMap` whose `model` axis is T.
    tensor: T.

  Raises:
    ConfigError: `from_layout_map.check`'s refusals, a `model` axis that
      is not T, or a split other than a Dense's by columns or rows.
  """
  split = from_layout_map.split_model(
      model, layout_map, tensor,
      parallel_layer=lambda layer, kind, entry: _stage_layer(
          layer, kind, entry, tensor))
  for layer, twin in _twins(split, model):
    if isinstance(layer, StageSplitDense):
      layer.load_full_weights(twin.get_weights())
    else:
      layer.set_weights(twin.get_weights())
    for mine, theirs in zip(getattr(layer, "_seed_generators", ()),
                            getattr(twin, "_seed_generators", ())):
      mine.state.assign(theirs.state.numpy())
  return split


def _twins(split, model):
  """`(layer, its twin)` for each layer of `split` (the clone of `model`
  `split_model` made) with weights or random state: the layer of `model`
  of the same name (an input layer, renamed by the clone, has neither).

  Raises:
    ValueError: a layer with weights or random state has no twin.
  """
  by_name = {layer.name: layer for layer in model.layers}
  for layer in split.layers:
    twin = by_name.get(layer.name)
    if twin is not None:
      yield layer, twin
    elif layer.weights or getattr(layer, "_seed_generators", ()):
      raise ValueError(f"layer {layer.name!r} of the split model has no "
                       f"layer of that name in model {model.name!r}")


def full_weights(model) -> List[np.ndarray]:
  """`model`'s weights as its unsharded twin's `get_weights()` lists them
  (each `StageSplitDense`'s shards concatenated)."""
  out = []
  for layer in model.layers:
    out += (layer.full_weights() if isinstance(layer, StageSplitDense)
            else layer.get_weights())
  return out


def tensor_devices(mesh: mesh_lib.DeviceMesh) -> List[List[str]]:
  """Per stage p, copy 0's T devices index(0, p, t), t = 0 .. T-1: what
  `Pipeline.place_variables(tensor_devices=...)` takes."""
  return [[mesh.devices[mesh.index(mesh_lib.MeshCoordinates(
      data=0, pipeline=p, tensor=t))] for t in range(mesh.tensor)]
          for p in range(mesh.pipeline)]


# (whole variable, the variables holding it, the axis they split it on;
# None: one variable holds it whole).
Pair = Tuple[keras.Variable, List[keras.Variable], Optional[int]]


def joined_pairs(model, unsharded) -> List[Pair]:
  """Each weight of `unsharded` (the model `split_model` cloned `model`
  from) with the variables of `model` that hold it: a `StageSplitDense`'s
  T kernels (and column biases) split on their axis, every other weight
  whole in the layer of the same name. What a checkpoint of `model` saves
  under `unsharded`'s names and shapes."""
  pairs = []
  for layer, twin in _twins(model, unsharded):
    if isinstance(layer, StageSplitDense):
      pairs += [(whole, parts, axis) for whole, (parts, axis) in zip(
          twin.weights, layer._whole())]  # pylint: disable=protected-access
    else:
      pairs += [(whole, [mine], None)
                for whole, mine in zip(twin.weights, layer.weights)]
  return pairs


def _slot_key(variable) -> str:
  """The part of an optimizer variable's name Keras derives from its
  model variable (`add_variable_from_reference`: the path with "/" made
  "_")."""
  return variable.path.replace("/", "_")


def optimizer_pairs(optimizer, view, pairs: Sequence[Pair]) -> List[Pair]:
  """Each variable of `view` (an optimizer of `optimizer`'s class and
  configuration built on the whole variables of `pairs`) with the
  variables of `optimizer` (built on the split model) that hold it: a
  slot of a split weight from the slots of its shards, named as Keras
  names slots (`<variable path with "_">_<slot>`); the others (the
  iteration count, the learning rate) by name.

  Raises:
    ValueError: a variable of `view` that pairs with none of `optimizer`'s.
  """
  ours = {v.name: v for v in optimizer.variables}
  split = sorted(((_slot_key(whole) + "_", [_slot_key(p) + "_" for p in parts],
                   axis) for whole, parts, axis in pairs if len(parts) > 1),
                 key=lambda item: -len(item[0]))
  out = []
  for theirs in view.variables:
    found = None
    for prefix, parts, axis in split:
      if theirs.name.startswith(prefix):
        slot = theirs.name[len(prefix):]
        if all(p + slot in ours for p in parts):
          found = (theirs, [ours[p + slot] for p in parts], axis)
          break
    if found is None and theirs.name in ours:
      found = (theirs, [ours[theirs.name]], None)
    if found is None:
      raise ValueError(
          f"the split model's optimizer has no variable for {theirs.name!r} "
          "of the whole model's (its slots are named after their variables' "
          "paths, as Keras names them)")
    out.append(found)
  return out


def join(parts: Sequence[keras.Variable], axis: Optional[int]) -> np.ndarray:
  """The whole value of `parts` (split on `axis`; None: `parts[0]`)."""
  values = [np.asarray(keras.ops.convert_to_numpy(p)) for p in parts]
  return values[0] if axis is None else np.concatenate(values, axis)


def assign_joined(parts: Sequence[keras.Variable], axis: Optional[int],
                  value) -> None:
  """Assigns the whole `value` to `parts` (split on `axis`)."""
  pieces = ([value] if axis is None else
            np.split(np.asarray(value), len(parts), axis=axis))
  for part, piece in zip(parts, pieces):
    part.assign(piece)
