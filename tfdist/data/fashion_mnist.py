"""Fashion-MNIST: the one-time conversion to TFRecord, and its parser.

Fashion-MNIST (Xiao et al. 2017; MIT licence) comes from Debian's
`dataset-fashion-mnist` package as the original gzipped IDX files. tfdist
converts it once into sharded, GZIP-compressed TFRecord files of
`tf.train.Example` records with the features

    image: bytes, 784 raw uint8 pixels (28 x 28, row-major)
    label: int64 in [0, 10)
    id:    int64, unique per example (train 0..59999, test 60000..69999);
           optional when reading: records without it parse too

The conversion writes into a temporary folder and renames it into place, so
a converted data set is either whole or absent.
"""

import gzip
import os
from typing import Optional

from absl import logging
import numpy as np
import tensorflow as tf

from tfdist.data import conversion
from tfdist.data import data_checks
from tfdist import errors
from tfdist.core.dataset_spec import DatasetSpec

DEBIAN_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


# Records of this schema written elsewhere may lack the `id` (training
# never reads it): it is parsed only when asked for, and -1 when absent.
_FEATURES = {
    "image": tf.io.FixedLenFeature([], tf.string),
    "label": tf.io.FixedLenFeature([], tf.int64),
}
_FEATURES_WITH_ID = {**_FEATURES,
                     "id": tf.io.FixedLenFeature([], tf.int64,
                                                 default_value=-1)}


def parse_image_example(serialized, with_id: bool = False):
  """Parses one Fashion-MNIST record.

  Returns:
    `(image, label)`: image float32 [28, 28, 1] scaled to [0, 1] (pixel /
    255), label int64 scalar; with `with_id`, `(image, label, id)`, id
    int64 scalar (-1 when the record has none).
  """
  parsed = tf.io.parse_single_example(
      serialized, _FEATURES_WITH_ID if with_id else _FEATURES)
  image = tf.io.decode_raw(parsed["image"], tf.uint8)
  image = tf.cast(tf.reshape(image, [28, 28, 1]), tf.float32) / 255.0
  if with_id:
    return image, parsed["label"], parsed["id"]
  return image, parsed["label"]


def read_idx(path: str) -> np.ndarray:
  """Reads a gzipped IDX file (the MNIST format) into a uint8 array.

  Raises:
    DataNotFoundError: the file does not exist.
    ValueError: the file is not an IDX file of unsigned bytes.
  """
  if not tf.io.gfile.exists(path):
    raise errors.DataNotFoundError(
        f"{path} does not exist. Install Debian's dataset-fashion-mnist "
        "(apt-get install -y dataset-fashion-mnist) or point --raw_data_dir "
        "at a folder holding the four Fashion-MNIST .gz files.")
  with tf.io.gfile.GFile(path, "rb") as f:
    data = gzip.decompress(f.read())
  magic = int.from_bytes(data[0:4], "big")
  if magic >> 8 != 0x08:
    raise ValueError(f"{path}: not an IDX file of uint8 (magic {magic:#x}).")
  ndim = magic & 0xFF
  dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
  return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _example(image: np.ndarray, label: int, example_id: int) -> bytes:
  feature = {
      "image": tf.train.Feature(bytes_list=tf.train.BytesList(
          value=[image.tobytes()])),
      "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
      "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[example_id])),
  }
  return tf.train.Example(features=tf.train.Features(
      feature=feature)).SerializeToString()


def write_image_shards(out_dir: str, split: str, images: np.ndarray,
                       labels: np.ndarray, *, num_shards: int,
                       first_id: int = 0) -> list:
  """Writes `images`/`labels` as `num_shards` GZIP TFRecord files.

  Files are named `{split}-{i:05d}-of-{n:05d}.tfrecord.gz`; example `k`
  goes to shard `k % num_shards`, with id `first_id + k`.

  Returns:
    The written paths.
  """
  paths, _ = conversion.write_shards(
      out_dir, split, (_example(image, int(label), first_id + k)
                       for k, (image, label) in enumerate(zip(images, labels))),
      num_shards=num_shards)
  return paths


def convert_fashion_mnist(out_dir: str, *, raw_data_dir: str = "",
                          train_shards: int = 8, test_shards: int = 2,
                          limit: Optional[int] = None) -> dict:
  """Converts the Fashion-MNIST IDX files into TFRecord shards, once.

  If `out_dir/dataset_info.json` exists the data set is already there and
  nothing is written. Otherwise the shards are written to a temporary sibling
  folder that is renamed to `out_dir` when complete.

  Args:
    out_dir: destination folder (local or `gs://`).
    raw_data_dir: folder with the four `.gz` files; defaults to Debian's
      `/usr/share/datasets/fashion-mnist`.
    train_shards: TFRecord files for the 60,000 training examples.
    test_shards: TFRecord files for the 10,000 test examples.
    limit: keep only the first `limit` examples of each split (for tests).

  Returns:
    The contents of `dataset_info.json` (counts, shards, source).

  Raises:
    DataNotFoundError: the IDX files are missing.
  """
  info = conversion.converted_info(out_dir)
  if info is not None:
    return info
  raw = raw_data_dir or DEBIAN_FASHION_MNIST_DIR
  logging.info("Converting Fashion-MNIST from %s into %s", raw, out_dir)

  def write(tmp_dir: str) -> dict:
    info = {"name": "fashion_mnist", "source": raw, "splits": {}}
    first_id = 0
    for split, shards in (("train", train_shards), ("test", test_shards)):
      image_file, label_file = FASHION_MNIST_FILES[split]
      images = read_idx(os.path.join(raw, image_file))
      labels = read_idx(os.path.join(raw, label_file))
      if limit:
        images, labels = images[:limit], labels[:limit]
      write_image_shards(tmp_dir, split, images, labels, num_shards=shards,
                         first_id=first_id)
      info["splits"][split] = {"num_examples": int(len(labels)),
                               "num_shards": shards, "first_id": first_id}
      first_id += 60_000
    return info

  return conversion.publish_conversion(out_dir, write)


def prepare(data_dir: str, raw_data_dir: str):
  out_dir = os.path.join(data_dir, "fashion_mnist")
  convert_fashion_mnist(out_dir, raw_data_dir=raw_data_dir)
  return (os.path.join(out_dir, "train-*.tfrecord.gz"),
          os.path.join(out_dir, "test-*.tfrecord.gz"))


SPEC = DatasetSpec(name="fashion_mnist", input_shape=(28, 28, 1),
                   num_classes=10, parse_fn=parse_image_example,
                   prepare=prepare, task="multiclass",
                   check_files=data_checks.first_record_check(
                       _FEATURES_WITH_ID, dataset="fashion_mnist"))
