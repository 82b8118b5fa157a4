"""Unit tests of tfdist.data.movielens on a slice of recbole's MovieLens-100k."""

import importlib.util
import os

import pytest
import tensorflow as tf

from tfdist.data import movielens
from tfdist import errors

pytestmark = pytest.mark.skipif(importlib.util.find_spec("recbole") is None,
                                reason="needs recbole==1.2.1's data files")


def test_the_split_is_a_fixed_hash_of_the_pair():
  assert movielens.is_eval_pair("196", "242") == movielens.is_eval_pair(
      "196", "242")
  pairs = [(str(u), str(i)) for u in range(50) for i in range(50)]
  held_out = sum(movielens.is_eval_pair(u, i) for u, i in pairs)
  assert 0.15 < held_out / len(pairs) < 0.25


def test_read_ratings_joins_users_and_items():
  rows = movielens.read_ratings(movielens.default_raw_dir(), limit=5)
  assert len(rows) == 5
  features, is_eval = rows[0]
  assert is_eval == movielens.is_eval_pair(features["user_id"],
                                           features["item_id"])
  assert features["gender"] in ("M", "F")
  assert len(features["zip3"]) == 3
  assert len(features["genres"]) == len(movielens.GENRES)
  assert sum(features["genres"]) >= 1
  assert features["label"] == int(features["rating"] >= 4)


def test_missing_raw_files_say_how_to_install(tmp_path):
  with pytest.raises(errors.DataNotFoundError, match="recbole"):
    movielens.read_ratings(str(tmp_path))


def test_convert_a_slice_and_parse_it_back(tmp_path):
  out_dir = str(tmp_path / "movielens")
  info = movielens.convert_movielens(out_dir, train_shards=2, test_shards=1,
                                     limit=200)
  splits = info["splits"]
  assert splits["train"]["num_examples"] + splits["test"]["num_examples"] == 200
  assert splits["test"]["num_examples"] > 0
  files = tf.io.gfile.glob(os.path.join(out_dir, "test-*.tfrecord.gz"))
  records = list(tf.data.TFRecordDataset(files, compression_type="GZIP"))
  assert len(records) == splits["test"]["num_examples"]
  features, label = movielens.parse_example(records[0])
  assert sorted(features) == sorted(movielens.ID_FEATURES + ("dense",))
  assert features["user_id"].shape == (1,)
  assert features["user_id"].dtype == tf.string
  assert features["dense"].shape == (movielens.NUM_DENSE,)
  assert int(label) in (0, 1)
  assert movielens.convert_movielens(out_dir) == info
