"""A wide & deep ranking model for like/dislike prediction (MovieLens).

Cheng et al. 2016, "Wide & Deep Learning for Recommender Systems": a deep
part (an MLP over learned embeddings of every id feature and the dense
features) and a wide part (one learned scalar per id, i.e. per-user,
per-item, ... biases) are summed into one logit, squashed by a sigmoid.

Ids are strings hashed by `keras.layers.Hashing` inside the model, so the
model is built under the strategy scope with everything else and the
hashing runs on the workers (no lookup table, no RPC to the coordinator).
Every table is a `tfdist.distribute.sharded_embedding.ShardedEmbedding`: under
ParameterServerStrategy the large ones (user and item, `hash_buckets` rows
each) are sharded across the ps tasks; the dense layers stay whole.
"""

from typing import Sequence

import keras
from keras import layers

from tfdist.distribute.sharded_embedding import ShardedEmbedding

# Ids that get `hash_buckets` rows; the other id features are low
# cardinality and get `side_buckets` rows.
LARGE_ID_FEATURES = ("user_id", "item_id")


def build_ranking(*, id_features: Sequence[str], num_dense: int,
                  num_classes: int = 1,
                  embedding_dim: int = 16, hash_buckets: int = 100_000,
                  side_buckets: int = 1_000,
                  hidden_units: Sequence[int] = (64, 32),
                  dropout: float = 0.0) -> keras.Model:
  """Builds the wide & deep model.

  Args:
    id_features: names of the string id inputs (each [batch, 1]), e.g.
      `tfdist.data.movielens.ID_FEATURES` (from the data set's `DatasetSpec`).
    num_dense: width of the float32 `dense` input (0: no dense input).
    num_classes: must be 1 (one sigmoid output).
    embedding_dim: width of every deep embedding.
    hash_buckets: rows of the user and item tables (ids are hashed into
      them; make it large to exercise sharding, e.g. 10**8).
    side_buckets: rows of each small side-feature table.
    hidden_units: widths of the deep MLP's hidden layers.
    dropout: dropout rate after each hidden layer.

  Returns:
    A `keras.Model` taking a dict of `id_features` (string [batch, 1]) and
    `dense` (float32 [batch, num_dense]) and returning float32
    probabilities [batch, 1].

  Raises:
    ValueError: `num_classes` is not 1, or a non-positive size.
  """
  if num_classes != 1:
    raise ValueError(f"The ranking model has one sigmoid output; received "
                     f"num_classes={num_classes}.")
  for name, value in (("embedding_dim", embedding_dim),
                      ("hash_buckets", hash_buckets),
                      ("side_buckets", side_buckets)):
    if value <= 0:
      raise ValueError(f"{name} must be > 0. Received: {name}={value}")
  if not id_features:
    raise ValueError("The ranking model needs id features; received none. "
                     "Use it with a data set that has them (movielens).")
  inputs = {name: keras.Input(shape=(1,), dtype="string", name=name)
            for name in id_features}
  dense_inputs = []
  if num_dense:
    inputs["dense"] = keras.Input(shape=(num_dense,), name="dense")
    dense_inputs = [inputs["dense"]]
  deep, wide = [], []
  for name in id_features:
    buckets = hash_buckets if name in LARGE_ID_FEATURES else side_buckets
    ids = layers.Hashing(num_bins=buckets, name=f"{name}_hash")(inputs[name])
    vectors = ShardedEmbedding(buckets, embedding_dim,
                               name=f"{name}_embedding")(ids)
    deep.append(layers.Reshape((embedding_dim,))(vectors))
    bias = ShardedEmbedding(buckets, 1, embeddings_initializer="zeros",
                            name=f"{name}_bias")(ids)
    wide.append(layers.Reshape((1,))(bias))
  x = layers.Concatenate(name="deep_inputs")(deep + dense_inputs)
  for i, units in enumerate(hidden_units):
    x = layers.Dense(units, activation="relu", name=f"hidden_{i}")(x)
    if dropout:
      x = layers.Dropout(dropout)(x)
  deep_logit = layers.Dense(1, name="deep_logit")(x)
  logit = layers.Add(name="logit")([deep_logit] + wide)
  outputs = layers.Activation("sigmoid", dtype="float32",
                              name="probability")(logit)
  return keras.Model(inputs, outputs, name="ranking")
