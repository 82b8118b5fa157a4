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

`experts=E` (`--transformer_experts`) makes each block's feed-forward layer
a mixture of E experts (`tfdist.parallel.experts.layer.MixtureOfExperts`,
Switch Transformer / GShard): a float32 router sends each token to its
`experts_top_k` experts, each a GELU feed-forward pair as wide as the dense
one (`ff_dim`), so the parameters of the feed-forward layers grow E-fold
and the compute per token k-fold. Each example is one routing group (its
`sequence_length` tokens, padding included, in position order: a review's
words come before its padding), so an expert's capacity is
ceil(k * sequence_length * capacity_factor / E) tokens of each example and
does not depend on the batch or its split over replicas. The router's
load-balancing and z-losses are the model's `losses`, which the trainers
add to the training loss.
"""

import dataclasses

import keras

from tfdist.parallel import tensor_parallel as tp
from tfdist.parallel.experts import layer as experts_layer


@dataclasses.dataclass(frozen=True)
class ExpertsOptions:
  """The mixture-of-experts feed-forward layers' settings (`--transformer_
  experts` and the `--experts_*` flags); see `MixtureOfExperts`."""
  num_experts: int = 0  # 0: dense feed-forward layers.
  top_k: int = 2
  capacity_factor: float = 1.25
  load_balancing_loss_weight: float = 1e-2
  router_z_loss_weight: float = 1e-3


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


def _feed_forward(x, *, ff_dim, index, tensor_parallel, experts):
  """The block's feed-forward layer(s): a Dense pair (column- and
  row-parallel under tensor parallelism) or a mixture of experts."""
  if experts.num_experts:
    return experts_layer.MixtureOfExperts(
        experts.num_experts, ff_dim, top_k=experts.top_k,
        capacity_factor=experts.capacity_factor, group_size=x.shape[1],
        activation="gelu",
        load_balancing_loss_weight=experts.load_balancing_loss_weight,
        router_z_loss_weight=experts.router_z_loss_weight,
        name=f"block{index}_experts")(x)
  column, row = ((tp.ColumnParallelDense, tp.RowParallelDense)
                 if tensor_parallel else (keras.layers.Dense,) * 2)
  # The names end as `tensor_parallel.splittable_weight_bytes` expects.
  ff = column(ff_dim, activation="gelu",
              name=f"block{index}{tp.FEED_FORWARD_IN}")(x)
  return row(x.shape[-1], name=f"block{index}{tp.FEED_FORWARD_OUT}")(ff)


def _encoder_block(x, mask, *, num_heads, ff_dim, dropout, index,
                   tensor_parallel=False, experts=ExpertsOptions()):
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
  ff = _feed_forward(x, ff_dim=ff_dim, index=index,
                     tensor_parallel=tensor_parallel, experts=experts)
  ff = keras.layers.Dropout(dropout)(ff)
  return keras.layers.LayerNormalization(
      epsilon=1e-6, name=f"block{index}_ff_norm")(x + ff)


# The width of the embeddings and of every block (`build_transformer`'s
# default, which the built-in `--model=transformer` uses).
EMBED_DIM = 64


def build_transformer(*, sequence_length: int, vocabulary_size: int,
                      num_classes: int, embed_dim: int = EMBED_DIM,
                      num_heads: int = 4, ff_dim: int = 128,
                      num_layers: int = 2, dropout: float = 0.1,
                      tensor_parallel: bool = False,
                      experts: ExpertsOptions = ExpertsOptions()
                      ) -> keras.Model:
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
    experts: `ExpertsOptions`; `num_experts` > 0 makes each block's
      feed-forward layer a mixture of that many experts of width `ff_dim`
      (see the module docstring). Not with `tensor_parallel`.

  Returns:
    An uncompiled `keras.Model` named `transformer`.

  Raises:
    ValueError: `embed_dim` is not a multiple of `num_heads`, or a size is
      not positive, or `experts` out of range (`MixtureOfExperts`'s checks),
      or experts with `tensor_parallel`.
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
  if experts.num_experts and tensor_parallel:
    raise ValueError(
        f"build_transformer cannot split experts (experts.num_experts="
        f"{experts.num_experts}) with tensor_parallel=True: the expert "
        "layers have no tensor-parallel form. Pass one of the two.")
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
                       tensor_parallel=tensor_parallel, experts=experts)
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
