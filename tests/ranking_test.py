"""Unit tests of models/ranking.py and its registered builder."""

import numpy as np
import pytest
import tensorflow as tf

import models
from models import ranking
from tfdist import errors
from tfdist.data import movielens
from tfdist.core.dataset_spec import DatasetSpec


def _features(batch):
  ids = {name: tf.constant([[f"{name}-{i}"] for i in range(batch)])
         for name in movielens.ID_FEATURES}
  return {**ids, "dense": tf.zeros([batch, movielens.NUM_DENSE])}


def test_probabilities_for_a_batch_of_ids():
  model = ranking.build_ranking(id_features=movielens.ID_FEATURES,
                                num_dense=movielens.NUM_DENSE,
                                embedding_dim=4, hash_buckets=50)
  probabilities = model(_features(3), training=False)
  assert probabilities.shape == (3, 1)
  assert probabilities.dtype == tf.float32
  assert np.all((probabilities.numpy() > 0) & (probabilities.numpy() < 1))


def test_large_ids_get_hash_buckets_rows_and_side_features_fewer():
  model = ranking.build_ranking(id_features=("user_id", "gender"),
                                num_dense=0, embedding_dim=4,
                                hash_buckets=50, side_buckets=7)
  rows = {l.name: l.input_dim for l in model.layers
          if l.name.endswith("_embedding")}
  assert rows == {"user_id_embedding": 50, "gender_embedding": 7}


@pytest.mark.parametrize("kwargs, match", [
    ({"num_classes": 2}, "one sigmoid output"),
    ({"embedding_dim": 0}, "embedding_dim must be > 0"),
    ({"id_features": ()}, "needs id features"),
])
def test_bad_arguments_are_refused(kwargs, match):
  args = {"id_features": ("user_id",), "num_dense": 0, **kwargs}
  with pytest.raises(ValueError, match=match):
    ranking.build_ranking(**args)


def test_the_registered_builder_takes_the_table_sizes():
  model = models.build_model("ranking", spec=movielens.SPEC,
                             embedding_dim=3, hash_buckets=20)
  user = model.get_layer("user_id_embedding")
  assert (user.input_dim, user.output_dim) == (20, 3)


def test_the_registered_builder_needs_id_features():
  spec = DatasetSpec(name="images", input_shape=(28, 28, 1), num_classes=10,
                     parse_fn=lambda serialized: serialized)
  with pytest.raises(errors.ConfigError, match="--dataset=movielens"):
    models.build_model("ranking", spec=spec)
