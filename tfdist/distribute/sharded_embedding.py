"""An embedding layer whose table ParameterServerStrategy can shard.

Keras 3's own `keras.layers.Embedding` stores its table in a Keras variable;
when `ParameterServerStrategy`'s variable partitioner splits that table into a
`ShardedVariable`, taking gradients fails (`'ShardedVariable' object has no
attribute 'handle'`). `ShardedEmbedding` owns a plain `tf.Variable` instead:

* under `ParameterServerStrategy` with a partitioner the table becomes a
  `ShardedVariable` whose shards (split along rows, "div" strategy: the first
  `rows % n` shards hold one extra row) live on different ps tasks, each shard
  initialized on its own ps (no full-size tensor is ever built on the
  coordinator, so tables far larger than the coordinator's memory work);
* lookups go through `tf.nn.embedding_lookup` over the shard list: one gather
  per shard, run in parallel on the ps tasks, stitched on the worker;
* the layer reports the shards themselves as its trainable weights, so
  `tape.gradient` returns one `tf.IndexedSlices` per shard (only the looked-up
  rows travel back), and a Keras optimizer built with those weights creates
  its slot variables colocated with, and shaped like, each shard;
* under every other strategy (none, one device, Mirrored, MultiWorker
  Mirrored, TPU) the table is one ordinary (or mirrored) variable and the
  layer computes exactly what `keras.layers.Embedding` computes.

Only tables created inside `sharding_scope()` (which this layer enters while
creating its table) may be partitioned by tfdist's partitioners
(`tfdist.distribute.parameter_server.make_partitioner`), so dense kernels and
optimizer slots created elsewhere always stay whole.
"""

import contextlib
import contextvars
from typing import List, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

_SHARDING_ALLOWED = contextvars.ContextVar("tfdist_sharding_allowed",
                                           default=False)


@contextlib.contextmanager
def sharding_scope():
  """Marks variables created inside as candidates for partitioning.

  tfdist's partitioners return one shard for any variable created outside
  this scope, so only embedding tables are ever split.
  """
  token = _SHARDING_ALLOWED.set(True)
  try:
    yield
  finally:
    _SHARDING_ALLOWED.reset(token)


def sharding_allowed() -> bool:
  """True inside `sharding_scope()`."""
  return _SHARDING_ALLOWED.get()


def _shard_initializer(initializer, row_offset: int):
  """`initializer` with a seed that differs per shard (same seed at row 0).

  Seeded Keras initializers are stateless: without this, every shard of the
  same shape would start with identical rows.
  """
  seed = getattr(initializer, "seed", None)
  if row_offset == 0 or not isinstance(seed, (int, np.integer)):
    return initializer
  config = initializer.get_config()
  config["seed"] = int((int(seed) * 1_000_003 + row_offset) % (2**31 - 1))
  return initializer.__class__.from_config(config)


def shard_variables(table) -> List[tf.Variable]:
  """The variables holding `table`: its shards, or `[table]` when whole."""
  if isinstance(table, tf.__internal__.distribute.ShardedVariable):
    return list(table.variables)
  return [table]


@keras.saving.register_keras_serializable(package="tfdist")
class ShardedEmbedding(keras.layers.Layer):
  """Maps integer ids to dense vectors, from a table the ps tasks can shard.

  The arguments follow `keras.layers.Embedding`. Regularizers and
  constraints on the whole table are not offered: on a table sharded over
  parameter servers they would read every row at every step.

  Args:
    input_dim: number of rows (ids are in `[0, input_dim)`), int > 0.
    output_dim: embedding width, int > 0.
    embeddings_initializer: Keras initializer (name, config or object) for
      the table. Defaults to `"uniform"` (as `keras.layers.Embedding`).
    mask_zero: treat id 0 as padding and emit a mask (as
      `keras.layers.Embedding`).
    **kwargs: base `keras.layers.Layer` arguments (`name`, `dtype`,
      `trainable`, `activity_regularizer`).

  Input: int tensor of any shape `[...]` (int32 or int64), values in
    `[0, input_dim)`. Out-of-range ids raise `InvalidArgumentError` on CPU.
  Output: `[..., output_dim]` in the layer's compute dtype.

  Raises:
    ValueError: `input_dim` or `output_dim` is not a positive int.
  """

  def __init__(self, input_dim: int, output_dim: int,
               embeddings_initializer="uniform", mask_zero: bool = False,
               **kwargs):
    for arg, value in (("input_dim", input_dim), ("output_dim", output_dim)):
      if (not isinstance(value, (int, np.integer)) or isinstance(value, bool)
          or value <= 0):
        raise ValueError(f"`{arg}` must be a positive integer. Received: "
                         f"{arg}={value!r} (of type {type(value).__name__}).")
    super().__init__(**kwargs)
    self.input_dim = int(input_dim)
    self.output_dim = int(output_dim)
    self.embeddings_initializer = keras.initializers.get(
        embeddings_initializer)
    self.mask_zero = bool(mask_zero)
    self.supports_masking = self.mask_zero
    self.embeddings = None

  # --- variables ---------------------------------------------------------
  def build(self, input_shape=None):
    if self.embeddings is not None:
      return
    shape = (self.input_dim, self.output_dim)
    dtype = tf.as_dtype(self.variable_dtype)
    initializer = self.embeddings_initializer

    def initial_value(partition_shape: Optional[Sequence[int]] = None,
                      partition_offset: Optional[Sequence[int]] = None):
      # ParameterServerStrategy calls this once per shard, on that shard's
      # ps, with the shard's shape and row offset; everyone else calls it
      # once with no arguments for the whole table.
      part = tuple(partition_shape) if partition_shape else shape
      offset = int(partition_offset[0]) if partition_offset else 0
      value = _shard_initializer(initializer, offset)(part, dtype=dtype.name)
      return tf.convert_to_tensor(value, dtype=dtype)

    with tf.init_scope(), sharding_scope():
      self.embeddings = tf.Variable(
          initial_value=initial_value, shape=shape, dtype=dtype,
          trainable=self.trainable, name="embeddings")
    for shard in self.shards:
      # Keras reads `.regularizer` of every weight when collecting losses.
      shard.regularizer = None
    self.built = True

  @property
  def shards(self) -> List[tf.Variable]:
    """The table's variables: its shards, or one variable when unsharded."""
    if self.embeddings is None:
      return []
    return shard_variables(self.embeddings)

  @property
  def num_shards(self) -> int:
    return len(self.shards)

  @property
  def weights(self):
    return list(self.shards) + list(super().weights)

  @property
  def variables(self):
    return list(self.shards) + list(super().variables)

  @property
  def trainable_weights(self):
    return self.weights if self.trainable else []

  @property
  def non_trainable_weights(self):
    return [] if self.trainable else self.weights

  @property
  def trainable_variables(self):
    return self.trainable_weights

  @property
  def non_trainable_variables(self):
    return self.non_trainable_weights

  # --- computation -------------------------------------------------------
  def call(self, inputs):
    ids = tf.convert_to_tensor(inputs)
    if not ids.dtype.is_integer:
      ids = tf.cast(ids, tf.int64)
    params = self.embeddings
    if isinstance(params, tf.__internal__.distribute.ShardedVariable):
      params = params.variables
    out = tf.nn.embedding_lookup(params, ids)
    return tf.cast(out, self.compute_dtype)

  def compute_mask(self, inputs, mask=None):
    if not self.mask_zero:
      return None
    return tf.not_equal(inputs, 0)

  def compute_output_shape(self, input_shape):
    return (*input_shape, self.output_dim)

  # --- serialization -----------------------------------------------------
  def get_config(self):
    config = super().get_config()
    config.update({
        "input_dim": self.input_dim,
        "output_dim": self.output_dim,
        "embeddings_initializer": keras.initializers.serialize(
            self.embeddings_initializer),
        "mask_zero": self.mask_zero,
    })
    return config

  def save_own_variables(self, store):
    # `.keras` / `.weights.h5` files hold the whole table, whatever the
    # shard count, so they load under any strategy.
    if self.embeddings is not None:
      store["0"] = tf.concat([tf.convert_to_tensor(v) for v in self.shards],
                             axis=0).numpy()

  def load_own_variables(self, store):
    if self.embeddings is None:
      self.build()
    value = np.asarray(store["0"])
    if value.shape != (self.input_dim, self.output_dim):
      raise ValueError(
          f"Layer {self.name!r} expects a table of shape "
          f"{(self.input_dim, self.output_dim)}; the file holds "
          f"{value.shape}.")
    start = 0
    for shard in self.shards:
      rows = int(shard.shape[0])
      shard.assign(value[start:start + rows])
      start += rows


def sharded_embedding_layers(model: keras.layers.Layer
                             ) -> List[ShardedEmbedding]:
  """Every `ShardedEmbedding` inside `model` (depth first, once each)."""
  found, seen = [], set()

  def visit(layer):
    if id(layer) in seen:
      return
    seen.add(id(layer))
    if isinstance(layer, ShardedEmbedding):
      found.append(layer)
    for sub in getattr(layer, "_layers", []) or []:
      visit(sub)

  visit(model)
  return found


def describe_shards(model: keras.layers.Layer) -> List[dict]:
  """Where each embedding table of `model` lives.

  Returns:
    One dict per `ShardedEmbedding`: `layer` (name), `shape` [rows, dim],
    `bytes` (whole table), `num_shards`, and `shards`: a list of
    `{"name", "shape", "device"}` per shard (device e.g.
    `/job:ps/replica:0/task:1/device:CPU:0`).
  """
  out = []
  for layer in sharded_embedding_layers(model):
    shards = layer.shards
    out.append({
        "layer": layer.name,
        "shape": [layer.input_dim, layer.output_dim],
        "bytes": int(layer.input_dim * layer.output_dim *
                     tf.as_dtype(layer.variable_dtype).size),
        "num_shards": len(shards),
        "shards": [{"name": v.name, "shape": [int(d) for d in v.shape],
                    "device": v.device} for v in shards],
    })
  return out
