"""Megatron-style tensor-parallel Keras layers for the replicas of one host.

After Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter
Language Models Using Model Parallelism" (arXiv:1909.08053), section 3.
Every replica of a `tf.distribute.MirroredStrategy` (N =
`num_replicas_in_sync` devices of one host) runs the whole model on the
same batch; the layers here keep 1/N of their weights on each replica and
exchange activations instead of weights:

* `ColumnParallelDense` splits its kernel [in, units] by output columns:
  replica r holds `kernel[:, r*units/N:(r+1)*units/N]` and that slice of
  the bias, and returns its slice [..., units/N] of the output. Its input
  passes through f (`copy_to_tensor_parallel_region`): identity forward,
  all-reduce (sum) backward, because each replica's input gradient covers
  only its own columns.
* `RowParallelDense` splits its kernel [in, units] by input rows: it takes
  a column layer's per-replica output [..., in/N] and computes a partial
  product that g (`reduce_from_tensor_parallel_region`) sums over the
  replicas: all-reduce forward, identity backward. Its bias [units] is
  whole on every replica and added after the sum.
* `ParallelMultiHeadAttention` splits the heads (Megatron's figure 3b):
  the query, key and value projections are column-parallel over heads,
  attention runs locally on each replica's heads, and the output
  projection is row-parallel. A column layer followed by a row layer (an
  MLP, or the attention block) costs one all-reduce forward and one
  backward.

Both operators are written with `tf.custom_gradient`: the gradient of
`ReplicaContext.all_reduce` is itself an all-reduce, so with the same loss
on every replica a raw all-reduce in the forward pass multiplies all
gradients before it by N.

The shards live in trainable sync-on-read variables with aggregation
NONE: one different value per replica, read locally inside
`strategy.run`. Reading one in cross-replica context raises TensorFlow's
`ValueError` (no reduction for NONE); `gathered_weights` and
`load_full_weights` convert between the shards and the unsharded weights,
in the order and shapes of `keras.layers.Dense` and
`keras.layers.MultiHeadAttention`, for checkpoints and export.

Training: gradients are taken inside `strategy.run`, and `ReplicaOptimizer`
applies them outside it: one copy of the Keras optimizer per replica
updates that replica's variables (its shards, its copy of the whole
weights) with that replica's gradients, so its slots for a shard are
shard-sized. A Keras optimizer applied inside `strategy.run` (and so
`Model.fit`) sums every gradient over the replicas, which would add up
gradients of different shards: it is not supported. (tfdist's trainer
under `--tensor_parallel` applies the run's optimizer inside
`strategy.run` with that sum turned off, so each replica's variables get
that replica's gradients: `tfdist.parallel.tensor.mode`.)

Built inside `tfdist.parallel.tensor.groups.split_over(T)` on N = D * T
replicas, the layers split their weights T ways: replica r holds shard
r mod T, and each tensor group of T consecutive replicas (one data-parallel
copy) runs f, g and the gather over its own replicas with
`tfdist.parallel.collectives`' sub-group collectives (`replica_`
functions: inside `strategy.run` traced by `tf.function` only). Outside
that scope (or with T = N) every replica is one rank and the operators use
`ReplicaContext`'s collectives over all replicas.
"""

import math
from typing import List, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfdist import errors
from tfdist.parallel import collectives
from tfdist.parallel.tensor import groups as groups_lib
from tfdist.runtime import private_api

# The attribute of a sharded Keras variable naming the axis it is split on.
_SHARD_AXIS = "_tfdist_tensor_parallel_axis"
# ... and the number of shards T (replica r holds shard r mod T).
_NUM_SHARDS = "_tfdist_tensor_parallel_shards"


def _mesh_place(groups, what: str):
  """This replica's `groups_lib.Placement` when `groups` splits the
  replicas into several tensor groups (D > 1), else None."""
  if groups is None or groups.data == 1:
    return None
  return groups.here(what)


# --- the two operators (and a gather) ----------------------------------------
def _replica_context(what: str) -> tf.distribute.ReplicaContext:
  if tf.distribute.in_cross_replica_context():
    raise errors.ConfigError(
        f"{what} runs inside `strategy.run` (replica context), and was called "
        "in cross-replica context. Call the model inside "
        "`strategy.run(fn, args=...)`.")
  return tf.distribute.get_replica_context()


def copy_to_tensor_parallel_region(x: tf.Tensor, groups=None) -> tf.Tensor:
  """Megatron's f: identity forward, all-reduce (sum) backward.

  Put before a column-parallel computation whose input is the same on
  every replica of the tensor group. Call inside `strategy.run`.

  Args:
    x: any floating tensor, the same on every replica of the group.
    groups: the layer's `groups_lib.TensorGroups` (the all-reduce runs
      over this replica's tensor group); None: over every replica.

  Returns:
    `x` (same shape and dtype). Its gradient is the sum over replicas of
    the gradients flowing into the result.

  Raises:
    ConfigError: called in cross-replica context.
  """
  context = _replica_context("copy_to_tensor_parallel_region")
  place = _mesh_place(groups, "copy_to_tensor_parallel_region")
  if place is not None:
    return collectives.replica_copy_to_group(place.tensor_group, x)
  if context.num_replicas_in_sync == 1:
    return x

  @tf.custom_gradient
  def f(t):
    def grad(dy):
      return context.all_reduce(tf.distribute.ReduceOp.SUM, dy)
    return tf.identity(t), grad

  return f(x)


def reduce_from_tensor_parallel_region(x: tf.Tensor,
                                       groups=None) -> tf.Tensor:
  """Megatron's g: all-reduce (sum) forward, identity backward.

  Sums a row-parallel computation's partial results over the tensor
  group. Call inside `strategy.run`.

  Args:
    x: a floating tensor of the same shape on every replica (this
      replica's partial sum).
    groups: as `copy_to_tensor_parallel_region`'s.

  Returns:
    The sum of `x` over replicas (same shape and dtype). Its gradient is
    the upstream gradient unchanged (not summed again, unlike
    `ReplicaContext.all_reduce`'s own gradient).

  Raises:
    ConfigError: called in cross-replica context.
  """
  context = _replica_context("reduce_from_tensor_parallel_region")
  place = _mesh_place(groups, "reduce_from_tensor_parallel_region")
  if place is not None:
    return collectives.replica_reduce_from_group(place.tensor_group, x)
  if context.num_replicas_in_sync == 1:
    return x

  @tf.custom_gradient
  def g(t):
    def grad(dy):
      return tf.identity(dy)
    return context.all_reduce(tf.distribute.ReduceOp.SUM, t), grad

  return g(x)


def gather_from_tensor_parallel_region(x: tf.Tensor, axis: int = -1,
                                       groups=None) -> tf.Tensor:
  """All-gather forward, this replica's slice backward.

  Turns per-replica slices [..., d/N] into the whole [..., d] on every
  replica (`ColumnParallelDense(gather_output=True)`). Call inside
  `strategy.run`.

  Args:
    x: a tensor of the same shape on every replica; replica r holds slice
      r along `axis`.
    axis: the axis to concatenate along (static).
    groups: as `copy_to_tensor_parallel_region`'s (replica order within
      the tensor group).

  Returns:
    The slices concatenated in replica order along `axis`: the size of
    `axis` times N, same dtype. Its gradient is the upstream gradient's
    slice of this replica (`all_gather`'s own gradient would sum the
    slices over replicas first: N times too large here).

  Raises:
    ConfigError: called in cross-replica context.
  """
  context = _replica_context("gather_from_tensor_parallel_region")
  place = _mesh_place(groups, "gather_from_tensor_parallel_region")
  n = context.num_replicas_in_sync if place is None else (
      place.tensor_group.size)
  if n == 1:
    return x
  axis = axis % len(x.shape)
  rank = context.replica_id_in_sync_group if place is None else place.tensor

  @tf.custom_gradient
  def gather(t):
    def grad(dy):
      return tf.stack(tf.split(dy, n, axis=axis))[rank]
    if place is not None:
      return collectives.replica_all_gather(place.tensor_group, t, axis), grad
    return context.all_gather(t, axis), grad

  return gather(x)


# --- sharded weights ----------------------------------------------------------
def _local_devices(strategy: tf.distribute.Strategy) -> list:
  """This host's replica devices ([None] for the default strategy)."""
  try:
    return list(strategy.extended.worker_devices)
  except (AttributeError, NotImplementedError, RuntimeError):
    return [None]


def _num_shards(layer_name: str) -> groups_lib.TensorGroups:
  """The current strategy's replicas as data x tensor groups (T from the
  `groups_lib.split_over` scope, else every replica); refuses what cannot
  work."""
  strategy = tf.distribute.get_strategy()
  if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
    raise errors.ConfigError(
        f"{layer_name} was built inside `strategy.run`. Build the model in "
        "`strategy.scope()` first (call it on `keras.Input`s, or "
        "`layer.build(shape)`), then call it inside `strategy.run`.")
  n = strategy.num_replicas_in_sync
  devices = _local_devices(strategy)
  if n != len(devices):
    raise errors.ConfigError(
        f"{layer_name} splits its weights over the replicas of one host; "
        f"{type(strategy).__name__} has {n} replicas, {len(devices)} of them "
        "here. Use MirroredStrategy over this host's devices.")
  tensor = groups_lib.current_degree() or n
  if devices == [None]:
    devices = ["/cpu:0"]
  return groups_lib.groups_for(devices, tensor)


def _check_divides(layer_name: str, argument: str, value: int, n: int):
  if value % n:
    smaller = value - value % n
    raise errors.ConfigError(
        f"{layer_name} splits {argument} into {n} shards (one per replica "
        f"of a tensor group), and {argument}={value} is not a multiple of "
        f"{n}. Choose a multiple of {n} (e.g. {smaller or n} or "
        f"{smaller + n}), or a tensor-parallel degree that divides {value}.")


def _components(variable) -> tuple:
  """The per-replica tf.Variables of a (Keras) variable, in replica order."""
  value = variable.value if isinstance(variable, keras.Variable) else variable
  return tuple(getattr(value, "values", (value,)))


def _add_sharded_weight(layer, name: str, full_shape: Sequence[int],
                        axis: int, initializer, num_shards: int):
  """A trainable sync-on-read variable holding 1/T (`num_shards`) of
  `full_shape` along `axis` per replica (replica r: shard r mod T),
  initialized by slicing one full initialization."""
  shard_shape = list(full_shape)
  shard_shape[axis] //= num_shards
  with tf.init_scope(), keras.name_scope(layer.name, caller=layer):
    variable = keras.Variable(
        initializer="zeros", shape=shard_shape, dtype=layer.variable_dtype,
        trainable=True, synchronization="on_read", aggregation="none",
        name=name)
    full = keras.initializers.get(initializer)(tuple(full_shape),
                                               dtype=layer.variable_dtype)
  setattr(variable, _SHARD_AXIS, axis)
  setattr(variable, _NUM_SHARDS, num_shards)
  _assign_full(variable, np.asarray(full))
  return variable


def shard_components(variable) -> tuple:
  """The per-replica tf.Variables holding shards 0 ... T-1 of a sharded
  variable, in shard order (replicas 0 ... T-1: the first data copy's
  tensor group), or every component of another one."""
  components = _components(variable)
  if getattr(variable, _SHARD_AXIS, None) is None:
    return components
  return components[:getattr(variable, _NUM_SHARDS, len(components))]


def _full_value(variable) -> np.ndarray:
  axis = getattr(variable, _SHARD_AXIS, None)
  if axis is None:
    return np.asarray(variable.numpy())
  return np.concatenate([np.asarray(c.numpy())
                         for c in shard_components(variable)], axis=axis)


def _assign_full(variable, value: np.ndarray) -> None:
  axis = getattr(variable, _SHARD_AXIS, None)
  if axis is None:
    variable.assign(value)
    return
  components = _components(variable)
  t = getattr(variable, _NUM_SHARDS, len(components))
  full_shape = list(variable.shape)
  full_shape[axis] *= t
  if tuple(value.shape) != tuple(full_shape):
    raise ValueError(
        f"{variable.path}: the full weight has shape {tuple(full_shape)} "
        f"({t} shards of {tuple(variable.shape)} along axis "
        f"{axis}); received shape {tuple(value.shape)}.")
  pieces = np.split(value, t, axis=axis)
  for r, component in enumerate(components):
    component.assign(pieces[r % t])


def gathered_weights(layer: keras.layers.Layer) -> List[np.ndarray]:
  """The unsharded weights of a layer or model, as `get_weights()` lists
  them: each sharded weight's per-replica shards concatenated.

  A model whose tensor-parallel layers stand where the unsharded model has
  `keras.layers.Dense` and `keras.layers.MultiHeadAttention` gives that
  model's `get_weights()` list (same order, shapes and dtypes), so it can
  be set into it, saved and exported. Call outside `strategy.run`; it
  reads every replica's shard (one host).

  Args:
    layer: a built Keras layer or model.

  Returns:
    One numpy array per entry of `layer.weights`.
  """
  return [_full_value(v) for v in layer.weights]


def load_full_weights(layer: keras.layers.Layer,
                      weights: Sequence[np.ndarray]) -> None:
  """Sets a layer's or model's weights from unsharded values (the inverse
  of `gathered_weights`): each replica gets its shard of a sharded weight,
  every replica the whole of the others.

  Call outside `strategy.run`, e.g. with `unsharded_model.get_weights()`
  after `unsharded_model.load_weights(path)`.

  Args:
    layer: a built Keras layer or model.
    weights: one array per entry of `layer.weights`, of the unsharded
      shape.

  Raises:
    ValueError: the number of arrays, or an array's shape, does not match.
  """
  variables = layer.weights
  if len(weights) != len(variables):
    raise ValueError(
        f"{layer.name} has {len(variables)} weights; received "
        f"{len(weights)} arrays.")
  for variable, value in zip(variables, weights):
    _assign_full(variable, np.asarray(value))


# The feed-forward pair of a block that `splittable_weight_bytes` counts:
# `<block>_ff_in` column-parallel, `<block>_ff_out` row-parallel (the names
# the built-in Transformer gives them, `models/transformer.py`).
FEED_FORWARD_IN, FEED_FORWARD_OUT = "_ff_in", "_ff_out"


def splittable_weight_bytes(model: keras.Model) -> int:
  """Bytes of the weights of an unsharded model that tensor parallelism
  would split (N replicas then hold 1/N of them each).

  Counted: every `keras.layers.MultiHeadAttention` (its query, key and
  value kernels and biases and its output kernel: all but the output
  bias), and every `keras.layers.Dense` whose name ends in
  `FEED_FORWARD_IN` (kernel and bias, split by columns) or
  `FEED_FORWARD_OUT` (kernel, split by rows) when its block has both.

  Args:
    model: a built Keras model.

  Returns:
    Bytes (int), from shapes and dtypes; 0 when nothing can be split.
  """
  layers = {layer.name: layer
            for layer in private_api.flatten_layers(model, include_self=False)}
  total = 0

  def nbytes(variable):
    return int(np.prod(variable.shape)) * tf.as_dtype(variable.dtype).size

  for name, layer in layers.items():
    if isinstance(layer, keras.layers.MultiHeadAttention):
      weights = list(layer.weights)
      # MultiHeadAttention's last weight is its output bias, kept whole.
      if layer.use_bias:
        weights = weights[:-1]
      total += sum(nbytes(v) for v in weights)
    elif (isinstance(layer, keras.layers.Dense) and
          name.endswith(FEED_FORWARD_IN)):
      partner = layers.get(name[:-len(FEED_FORWARD_IN)] + FEED_FORWARD_OUT)
      if isinstance(partner, keras.layers.Dense):
        total += sum(nbytes(v) for v in layer.weights)
        total += nbytes(partner.kernel)
  return total


def dense_config(layer) -> dict:
  """The `keras.layers.Dense` arguments a split Dense layer keeps, for its
  `get_config`: `units`, `activation`, `use_bias` and the two
  initializers, serialized."""
  return dict(
      units=layer.units,
      activation=keras.activations.serialize(layer.activation),
      use_bias=layer.use_bias,
      kernel_initializer=keras.initializers.serialize(
          layer.kernel_initializer),
      bias_initializer=keras.initializers.serialize(layer.bias_initializer))


class _TensorParallelLayer(keras.layers.Layer):
  """Remembers the shard count T and the replicas' groups the shards were
  made for."""

  num_shards: Optional[int] = None
  groups: Optional[groups_lib.TensorGroups] = None

  def _set_num_shards(self) -> int:
    self.groups = _num_shards(type(self).__name__)
    self.num_shards = self.groups.tensor
    return self.num_shards

  def _replica_context(self) -> tf.distribute.ReplicaContext:
    context = _replica_context(f"{type(self).__name__} {self.name!r}")
    replicas = self.groups.replicas if self.groups else self.num_shards
    if context.num_replicas_in_sync != replicas:
      raise errors.ConfigError(
          f"{type(self).__name__} {self.name!r} holds {self.num_shards} "
          f"shards over {replicas} replicas and was called with "
          f"{context.num_replicas_in_sync} replicas in sync. Build and call "
          "it under the same strategy.")
    return context


@keras.saving.register_keras_serializable(package="tfdist")
class ColumnParallelDense(_TensorParallelLayer):
  """`keras.layers.Dense` with its output units split over the replicas.

  Input: float [..., in], the same on every replica. Output: this
  replica's units, float [..., units/N] (replica r holds units
  r*units/N ... (r+1)*units/N - 1), or all of them, [..., units], with
  `gather_output=True`. Per replica it stores kernel [in, units/N] and
  bias [units/N]; `gathered_weights` gives Dense's kernel [in, units] and
  bias [units]. Build in the strategy's scope, call inside `strategy.run`.

  Args:
    units: output units of the whole layer; a multiple of N.
    activation: applied to each output unit (any elementwise Keras
      activation). Defaults to None (linear).
    use_bias: whether to add a bias. Defaults to True.
    kernel_initializer, bias_initializer: Keras initializers, applied to
      the whole kernel [in, units] (as Dense) before it is split.
    gather_output: return all units on every replica (an all-gather)
      instead of this replica's slice. Defaults to False (feed a
      `RowParallelDense`).

  Raises:
    ConfigError: `units` <= 0; `units` is not a multiple of the replica
      count (at build); built inside `strategy.run` or under a strategy spanning
      hosts; called in cross-replica context or under another replica
      count.
  """

  def __init__(self, units: int, activation=None, use_bias: bool = True,
               kernel_initializer="glorot_uniform", bias_initializer="zeros",
               gather_output: bool = False, **kwargs):
    super().__init__(**kwargs)
    if int(units) <= 0:
      raise errors.ConfigError(
          f"ColumnParallelDense needs units > 0. Received: "
          f"units={units}.")
    self.units = int(units)
    self.activation = keras.activations.get(activation)
    self.use_bias = bool(use_bias)
    self.kernel_initializer = keras.initializers.get(kernel_initializer)
    self.bias_initializer = keras.initializers.get(bias_initializer)
    self.gather_output = bool(gather_output)

  def build(self, input_shape):
    n = self._set_num_shards()
    _check_divides(f"ColumnParallelDense {self.name!r}", "units", self.units,
                   n)
    self.kernel = _add_sharded_weight(self, "kernel",
                                      (input_shape[-1], self.units), 1,
                                      self.kernel_initializer, n)
    if self.use_bias:
      self.bias = _add_sharded_weight(self, "bias", (self.units,), 0,
                                      self.bias_initializer, n)

  def compute_output_shape(self, input_shape):
    units = self.units if self.gather_output else self.units // (
        self.num_shards or 1)
    return tuple(input_shape[:-1]) + (units,)

  def call(self, inputs):
    self._replica_context()
    outputs = tf.matmul(copy_to_tensor_parallel_region(inputs, self.groups),
                        self.kernel)
    if self.use_bias:
      outputs = outputs + self.bias
    if self.activation is not None:
      outputs = self.activation(outputs)
    if self.gather_output:
      outputs = gather_from_tensor_parallel_region(outputs, axis=-1,
                                                   groups=self.groups)
    return outputs

  def get_config(self):
    config = super().get_config()
    config.update(dense_config(self), gather_output=self.gather_output)
    return config


@keras.saving.register_keras_serializable(package="tfdist")
class RowParallelDense(_TensorParallelLayer):
  """`keras.layers.Dense` with its input rows split over the replicas.

  Input: this replica's slice, float [..., in/N] (a `ColumnParallelDense`'s
  output). Output: float [..., units], the sum over replicas (one
  all-reduce), the same on every replica. Per replica it stores kernel
  [in/N, units] and the whole bias [units] (added after the sum);
  `gathered_weights` gives Dense's kernel [in, units] and bias [units].
  Build in the strategy's scope, call inside `strategy.run`.

  Args:
    units: output units.
    activation: Keras activation applied after the sum and bias. Defaults
      to None (linear).
    use_bias: whether to add a bias. Defaults to True.
    kernel_initializer, bias_initializer: Keras initializers, applied to
      the whole kernel [in, units] (as Dense) before it is split.

  Raises:
    ConfigError: `units` <= 0; built inside `strategy.run` or under a
      strategy spanning hosts; called in cross-replica context or under
      another replica count.
  """

  def __init__(self, units: int, activation=None, use_bias: bool = True,
               kernel_initializer="glorot_uniform", bias_initializer="zeros",
               **kwargs):
    super().__init__(**kwargs)
    if int(units) <= 0:
      raise errors.ConfigError(f"RowParallelDense needs units > 0. Received: "
                               f"units={units}.")
    self.units = int(units)
    self.activation = keras.activations.get(activation)
    self.use_bias = bool(use_bias)
    self.kernel_initializer = keras.initializers.get(kernel_initializer)
    self.bias_initializer = keras.initializers.get(bias_initializer)

  def build(self, input_shape):
    n = self._set_num_shards()
    self.kernel = _add_sharded_weight(self, "kernel",
                                      (input_shape[-1] * n, self.units), 0,
                                      self.kernel_initializer, n)
    if self.use_bias:
      self.bias = self.add_weight(name="bias", shape=(self.units,),
                                  initializer=self.bias_initializer)

  def compute_output_shape(self, input_shape):
    return tuple(input_shape[:-1]) + (self.units,)

  def call(self, inputs):
    self._replica_context()
    outputs = reduce_from_tensor_parallel_region(
        tf.matmul(inputs, self.kernel), self.groups)
    if self.use_bias:
      outputs = outputs + self.bias
    if self.activation is not None:
      outputs = self.activation(outputs)
    return outputs

  def get_config(self):
    config = super().get_config()
    config.update(dense_config(self))
    return config


@keras.saving.register_keras_serializable(package="tfdist")
class ParallelMultiHeadAttention(_TensorParallelLayer):
  """`keras.layers.MultiHeadAttention` with its heads split over replicas.

  Replica r computes heads r*H/N ... (r+1)*H/N - 1: their query, key and
  value projections (column-parallel), their attention, and their part of
  the output projection, summed over replicas by one all-reduce.

  Inputs (the same on every replica): `query` float [B, T, dq], `value`
  float [B, S, dv], `key` float [B, S, dk] (defaults to `value`),
  `attention_mask` bool [B, T, S] (True: attend). Output: float
  [B, T, output_shape or dq], the same on every replica.

  Per replica it stores query kernel [dq, H/N, key_dim] and bias
  [H/N, key_dim], key kernel [dk, H/N, key_dim] and bias, value kernel
  [dv, H/N, value_dim] and bias [H/N, value_dim], output kernel
  [H/N, value_dim, out] and the whole output bias [out].
  `gathered_weights` gives `MultiHeadAttention`'s eight weights in its
  order (query, key, value, output; kernel then bias). Build in the
  strategy's scope, call inside `strategy.run`.

  Args:
    num_heads: H, heads of the whole layer; a multiple of N.
    key_dim: size of each query and key head.
    value_dim: size of each value head. Defaults to `key_dim`.
    dropout: dropout rate of the attention probabilities in training, as
      `MultiHeadAttention`'s. Each replica draws the mask of all H heads
      [B, H, T, S] and applies its heads' part, so with the same random
      stream on every replica the heads together get the mask an unsharded
      layer draws. Defaults to 0.
    use_bias: whether the projections have biases. Defaults to True.
    output_shape: last dimension of the output. Defaults to `dq`.
    kernel_initializer, bias_initializer: Keras initializers, applied to
      each whole weight before it is split.

  Raises:
    ConfigError: `num_heads`, `key_dim` or `value_dim` <= 0; `num_heads`
      is not a multiple of the replica count (at
      build); inputs not of rank 3; built inside `strategy.run` or under a
      strategy spanning hosts; called in cross-replica context or under
      another replica count.
  """

  def __init__(self, num_heads: int, key_dim: int,
               value_dim: Optional[int] = None, dropout: float = 0.0,
               use_bias: bool = True,
               output_shape: Optional[int] = None,
               kernel_initializer="glorot_uniform", bias_initializer="zeros",
               **kwargs):
    super().__init__(**kwargs)
    for argument, value in (("num_heads", num_heads), ("key_dim", key_dim),
                            ("value_dim", value_dim or key_dim)):
      if int(value) <= 0:
        raise errors.ConfigError(
            f"ParallelMultiHeadAttention needs {argument} > 0."
            f" Received: {argument}={value}.")
    self.num_heads = int(num_heads)
    self.key_dim = int(key_dim)
    self.value_dim = int(value_dim or key_dim)
    self.use_bias = bool(use_bias)
    self.dropout = float(dropout)
    if not 0.0 <= self.dropout < 1.0:
      raise errors.ConfigError(
          "ParallelMultiHeadAttention needs 0 <= dropout < 1. "
          f"Received: dropout={dropout}.")
    self.output_dim = None if output_shape is None else int(output_shape)
    self.kernel_initializer = keras.initializers.get(kernel_initializer)
    self.bias_initializer = keras.initializers.get(bias_initializer)

  def build(self, query_shape, value_shape, key_shape=None):
    key_shape = value_shape if key_shape is None else key_shape
    for name, shape in (("query", query_shape), ("value", value_shape),
                        ("key", key_shape)):
      if len(shape) != 3:
        raise errors.ConfigError(
            f"ParallelMultiHeadAttention {self.name!r} takes [batch, "
            f"sequence, features] inputs; {name} has shape {tuple(shape)}.")
    n = self._set_num_shards()
    _check_divides(f"ParallelMultiHeadAttention {self.name!r}", "num_heads",
                   self.num_heads, n)
    heads, out = self.num_heads, self.output_dim or query_shape[-1]

    def projection(name, in_dim, head_dim):
      kernel = _add_sharded_weight(self, f"{name}_kernel",
                                   (in_dim, heads, head_dim), 1,
                                   self.kernel_initializer, n)
      bias = (_add_sharded_weight(self, f"{name}_bias", (heads, head_dim), 0,
                                  self.bias_initializer, n)
              if self.use_bias else None)
      return kernel, bias

    self.query_kernel, self.query_bias = projection("query", query_shape[-1],
                                                    self.key_dim)
    self.key_kernel, self.key_bias = projection("key", key_shape[-1],
                                                self.key_dim)
    self.value_kernel, self.value_bias = projection("value", value_shape[-1],
                                                    self.value_dim)
    self.output_kernel = _add_sharded_weight(
        self, "output_kernel", (heads, self.value_dim, out), 0,
        self.kernel_initializer, n)
    if self.use_bias:
      self.output_bias = self.add_weight(name="output_bias", shape=(out,),
                                         initializer=self.bias_initializer)
    # As MultiHeadAttention, a Dropout with its own seed generator.
    self._dropout_layer = keras.layers.Dropout(self.dropout)

  def compute_output_shape(self, query_shape, value_shape, key_shape=None):
    return tuple(query_shape[:-1]) + (self.output_dim or query_shape[-1],)

  def _project(self, x, kernel, bias):
    y = tf.einsum("btd,dhk->bthk", x, kernel)
    return y + bias if bias is not None else y

  def call(self, query, value, key=None, attention_mask=None,
           use_causal_mask: bool = False, training=None):
    replica = self._replica_context()
    key = value if key is None else key
    # One f per distinct input: self-attention all-reduces one gradient.
    copied = {}

    def copy(x):
      if id(x) not in copied:
        copied[id(x)] = copy_to_tensor_parallel_region(x, self.groups)
      return copied[id(x)]

    q = self._project(copy(query), self.query_kernel, self.query_bias)
    k = self._project(copy(key), self.key_kernel, self.key_bias)
    v = self._project(copy(value), self.value_kernel, self.value_bias)
    q = q * tf.cast(1.0 / math.sqrt(float(self.key_dim)), q.dtype)
    scores = tf.einsum("bshk,bthk->bhts", k, q)  # [B, H/N, T, S]
    mask = None
    if attention_mask is not None:
      mask = tf.cast(attention_mask, tf.bool)[:, tf.newaxis]
    if use_causal_mask:
      t, s = tf.shape(q)[1], tf.shape(k)[1]
      causal = tf.linalg.band_part(tf.ones([t, s], tf.bool), -1, 0)
      mask = causal if mask is None else tf.logical_and(mask, causal)
    if mask is not None:
      scores = tf.where(mask, scores, tf.cast(-1e9, scores.dtype))
    weights = tf.nn.softmax(scores, axis=-1)
    if training and self.dropout > 0:
      weights = weights * self._head_dropout_mask(weights, replica)
    context = tf.einsum("bhts,bshv->bthv", weights, v)
    outputs = reduce_from_tensor_parallel_region(
        tf.einsum("bthv,hvo->bto", context, self.output_kernel), self.groups)
    if self.use_bias:
      outputs = outputs + self.output_bias
    return outputs

  def _head_dropout_mask(self, weights, replica):
    """This replica's heads' part of the dropout mask of all heads: 0 or
    1/(1-rate), of the shape of `weights` [B, H/N, T, S]."""
    shape = tf.shape(weights)
    n = self.num_shards or 1
    full = self._dropout_layer(
        tf.ones([shape[0], self.num_heads, shape[2], shape[3]],
                weights.dtype), training=True)
    if n == 1:
      return full
    full = tf.reshape(full, [shape[0], n, self.num_heads // n, shape[2],
                             shape[3]])
    # This replica's heads: those of its shard, r mod T.
    return tf.gather(full, tf.math.floormod(replica.replica_id_in_sync_group,
                                            n), axis=1)

  def get_config(self):
    config = super().get_config()
    config.update(
        num_heads=self.num_heads, key_dim=self.key_dim,
        value_dim=self.value_dim, dropout=self.dropout,
        use_bias=self.use_bias,
        output_shape=self.output_dim,
        kernel_initializer=keras.initializers.serialize(
            self.kernel_initializer),
        bias_initializer=keras.initializers.serialize(self.bias_initializer))
    return config


# --- the optimizer ------------------------------------------------------------
class ReplicaOptimizer:
  """A Keras optimizer applied per replica, for models with sharded layers.

  Keeps one copy of `optimizer` (its class and configuration) per replica,
  on that replica's device, built on that replica's components of
  `variables`: the shards of the tensor-parallel layers and its mirror of
  every other weight. `apply_gradients` updates each component with its
  own replica's gradient. With every replica computing the same loss on
  the same batch, the f and g operators make the gradients of the whole
  (mirrored) weights equal on all replicas, so the mirrors stay equal;
  no gradient is summed over replicas.

  The copies' slots (momentum, Adam's moments) of a shard are per replica
  and shard-sized. They are not in the model's weights: checkpoint the
  copies (`copies[r]`) to keep them.

  Args:
    optimizer: a Keras optimizer, used as a template (`from_config`).
      Gradient accumulation, EMA and loss scaling are not supported.
    variables: the variables to train, e.g. `model.trainable_variables`
      of a model built in `strategy.scope()`.
    strategy: the strategy the model was built under (one host).

  Raises:
    ConfigError: created inside a strategy's scope, with an optimizer
      option that is not supported, with a variable that does not have
      one component per replica of `strategy`, or with one split over a
      tensor group smaller than the replicas (D > 1, `split_over`).
  """

  def __init__(self, optimizer: keras.optimizers.Optimizer, variables,
               strategy: tf.distribute.Strategy):
    if tf.distribute.has_strategy():
      raise errors.ConfigError(
          "ReplicaOptimizer keeps plain per-replica optimizer copies: create "
          "it outside `strategy.scope()` (after building the model inside).")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
      raise errors.ConfigError(
          "ReplicaOptimizer does not support LossScaleOptimizer (mixed "
          "float16); train in float32 or mixed_bfloat16.")
    for option in ("gradient_accumulation_steps", "use_ema"):
      if getattr(optimizer, option, None):
        raise errors.ConfigError(
            f"ReplicaOptimizer does not support {option}="
            f"{getattr(optimizer, option)}; leave it unset.")
    self.strategy = strategy
    self.variables = list(variables)
    self.devices = _local_devices(strategy)
    per_variable = [_components(v) for v in self.variables]
    for v, components in zip(self.variables, per_variable):
      shards = getattr(v, _NUM_SHARDS, None)
      if shards is not None and shards != len(components):
        raise errors.ConfigError(
            f"ReplicaOptimizer: {getattr(v, 'path', v.name)} is split "
            f"{shards} ways over {len(components)} replicas (data x tensor): "
            "this optimizer does not sum gradients over the data-parallel "
            "copies. Build the model outside `split_over` (one tensor group "
            "of all replicas), or train it with tfdist's trainer "
            "(--tensor_parallel with more devices).")
      if len(components) != len(self.devices):
        raise errors.ConfigError(
            f"ReplicaOptimizer: {getattr(v, 'path', v.name)} has "
            f"{len(components)} component(s), the strategy "
            f"{len(self.devices)} replicas. Build the model inside "
            "`strategy.scope()` of the strategy passed here.")
    config = optimizer.get_config()
    self.copies = []
    self._components = []
    for r, device in enumerate(self.devices):
      components = [c[r] for c in per_variable]
      with tf.device(device):
        copy = type(optimizer).from_config(config)
        copy.build(components)
      self.copies.append(copy)
      self._components.append(components)

  def apply_gradients(self, grads) -> None:
    """Applies one step.

    Call outside `strategy.run` and outside `strategy.scope()` (in a
    `tf.function` or eagerly), with what `strategy.run` returned.

    Args:
      grads: one entry per variable, in the order of `variables`: the
        per-replica gradients `strategy.run` returned (None: no
        gradient).

    Raises:
      ConfigError: called inside a strategy's scope or `strategy.run`.
      ValueError: `grads` has another length than `variables`.
    """
    if tf.distribute.has_strategy():
      raise errors.ConfigError(
          "ReplicaOptimizer.apply_gradients updates each replica's "
          "variables with plain optimizers: call it outside `strategy.run` "
          "and outside `strategy.scope()`.")
    grads = list(grads)
    if len(grads) != len(self.variables):
      raise ValueError(
          f"ReplicaOptimizer trains {len(self.variables)} variables; "
          f"received {len(grads)} gradients.")
    local = [None if g is None else
             self.strategy.experimental_local_results(g) for g in grads]
    for r, (copy, device) in enumerate(zip(self.copies, self.devices)):
      pairs = [(g[r], v) for g, v in zip(local, self._components[r])
               if g is not None]
      with tf.device(device):
        copy.apply_gradients(pairs)
