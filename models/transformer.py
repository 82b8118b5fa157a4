"""A Transformer encoder text classifier (`--model=transformer`).

The encoder of Vaswani et al. 2017 ("Attention Is All You Need"), as BERT
uses it for classification (Devlin et al. 2019) but small and randomly
initialized (nothing is downloaded): token embeddings plus learned position
embeddings, `num_layers` post-norm blocks of multi-head self-attention and
a GELU feed-forward layer, each with dropout and a residual connection,
then the mean over the non-padding positions and one output layer. Every
layer is Keras's own (`keras.layers.MultiHeadAttention`, `Embedding`,
`LayerNormalization`, `Dense`); only the position embedding, which Keras
core lacks (KerasHub has `PositionEmbedding`, not installed here), is a
small layer of this module.

With Adam, its training state is 16 bytes per parameter on every replica
(weights, gradients, two moments): the model the ZeRO benchmark measures
(`--zero_stage`, `benchmarks/zero_memory.py`).

`tensor_parallel=True` builds the same model with Megatron's layers
(`tfdist.parallel.tensor_parallel`): each block's attention is a
`ParallelMultiHeadAttention` (heads split over the replicas), its
feed-forward pair a `ColumnParallelDense` then a `RowParallelDense`; the
embeddings, norms and output layer stay whole on every replica. Its
gathered weights (`tensor_parallel.gathered_weights`) are the unsharded
model's `get_weights()`, in the same order and shapes.
"""

import keras

from tfdist.parallel import tensor_parallel as tp


@keras.saving.register_keras_serializable(package="tfdist")
class PositionEmbedding(keras.layers.Layer):
  """Adds a learned embedding of each position: [batch, length, dim] in,
  same shape and dtype out (the weights are float32 under mixed precision,
  cast to the compute dtype)."""

  def __init__(self, sequence_length: int, **kwargs):
    super().__init__(**kwargs)
    self.sequence_length = int(sequence_length)

  def build(self, input_shape):
    self.position_embeddings = self.add_weight(
        name="embeddings", shape=(self.sequence_length, input_shape[-1]),
        initializer=keras.initializers.RandomNormal(stddev=0.02))

  def call(self, inputs):
    length = keras.ops.shape(inputs)[1]
    table = keras.ops.cast(self.position_embeddings[:length], inputs.dtype)
    return inputs + table[None, :, :]

  def get_config(self):
    return {**super().get_config(), "sequence_length": self.sequence_length}


def _encoder_block(x, mask, *, num_heads, ff_dim, dropout, index,
                   tensor_parallel=False):
  dim = x.shape[-1]
  if tensor_parallel:
    attention = tp.ParallelMultiHeadAttention(
        num_heads=num_heads, key_dim=dim // num_heads, dropout=dropout,
        name=f"block{index}_attention")(x, x, attention_mask=mask)
  else:
    attention = keras.layers.MultiHeadAttention(
        num_heads=num_heads, key_dim=dim // num_heads, dropout=dropout,
        name=f"block{index}_attention")(x, x, attention_mask=mask)
  attention = keras.layers.Dropout(dropout)(attention)
  x = keras.layers.LayerNormalization(
      epsilon=1e-6, name=f"block{index}_attention_norm")(x + attention)
  column, row = ((tp.ColumnParallelDense, tp.RowParallelDense)
                 if tensor_parallel else (keras.layers.Dense,) * 2)
  # The names end as `tensor_parallel.splittable_weight_bytes` expects.
  ff = column(ff_dim, activation="gelu",
              name=f"block{index}{tp.FEED_FORWARD_IN}")(x)
  ff = row(dim, name=f"block{index}{tp.FEED_FORWARD_OUT}")(ff)
  ff = keras.layers.Dropout(dropout)(ff)
  return keras.layers.LayerNormalization(
      epsilon=1e-6, name=f"block{index}_ff_norm")(x + ff)


def build_transformer(*, sequence_length: int, vocabulary_size: int,
                      num_classes: int, embed_dim: int = 64,
                      num_heads: int = 4, ff_dim: int = 128,
                      num_layers: int = 2, dropout: float = 0.1,
                      tensor_parallel: bool = False) -> keras.Model:
  """Builds the classifier.

  Args:
    sequence_length: tokens per example; the input is int64 token ids
      [batch, sequence_length], 0 for padding (masked out of attention and
      of the mean).
    vocabulary_size: number of token ids (padding and unknown included).
    num_classes: 1 for a binary task (the output is a sigmoid probability
      [batch, 1]); >= 2 for logits [batch, num_classes]. float32 under any
      mixed precision policy.
    embed_dim: width of the embeddings and of every block; a multiple of
      `num_heads`.
    num_heads: attention heads per block.
    ff_dim: width of the feed-forward layer of each block.
    num_layers: encoder blocks.
    dropout: dropout rate after attention and feed-forward layers and of
      the attention probabilities.
    tensor_parallel: split each block's attention heads and feed-forward
      units over the replicas of the current `tf.distribute.MirroredStrategy`
      (see the module docstring). Build inside `strategy.scope()`, call
      inside `strategy.run` with the same batch on every replica, and train
      with `tfdist.parallel.tensor_parallel.ReplicaOptimizer` (or let
      `tfdist.train --tensor_parallel=N` train it).

  Returns:
    An uncompiled `keras.Model` named `transformer`.

  Raises:
    ValueError: `embed_dim` is not a multiple of `num_heads`, or a size is
      not positive.
    tfdist.errors.ConfigError: with `tensor_parallel`, `num_heads` or
      `ff_dim` not a multiple of the replicas, or built inside
      `strategy.run` or under a strategy spanning hosts.
  """
  if min(sequence_length, vocabulary_size, embed_dim, num_heads, ff_dim,
         num_layers, num_classes) < 1 or embed_dim % num_heads:
    raise ValueError(
        f"build_transformer needs positive sizes and embed_dim ({embed_dim}) "
        f"a multiple of num_heads ({num_heads}); got sequence_length="
        f"{sequence_length}, vocabulary_size={vocabulary_size}, ff_dim="
        f"{ff_dim}, num_layers={num_layers}, num_classes={num_classes}.")
  tokens = keras.Input((sequence_length,), dtype="int64", name="tokens")
  keep = keras.ops.not_equal(tokens, 0)
  x = keras.layers.Embedding(vocabulary_size, embed_dim,
                             name="token_embedding")(tokens)
  x = PositionEmbedding(sequence_length, name="position_embedding")(x)
  x = keras.layers.Dropout(dropout)(x)
  mask = keep[:, None, :]
  for index in range(num_layers):
    x = _encoder_block(x, mask, num_heads=num_heads, ff_dim=ff_dim,
                       dropout=dropout, index=index,
                       tensor_parallel=tensor_parallel)
  x = keras.layers.GlobalAveragePooling1D(name="mean_over_tokens")(
      x, mask=keep)
  x = keras.layers.Dropout(dropout)(x)
  if num_classes == 1:
    logits = keras.layers.Dense(1, name="logits")(x)
    outputs = keras.layers.Activation("sigmoid", dtype="float32",
                                      name="probability")(logits)
  else:
    logits = keras.layers.Dense(num_classes, name="logits_mixed")(x)
    outputs = keras.layers.Activation("linear", dtype="float32",
                                      name="logits")(logits)
  return keras.Model(tokens, outputs, name="transformer")
