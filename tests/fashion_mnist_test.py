"""Unit tests of tfdist.data.fashion_mnist on a slice of Debian's Fashion-MNIST."""

import os

import numpy as np
import pytest
import tensorflow as tf

from tfdist.data import fashion_mnist
from tfdist import errors

RAW = fashion_mnist.DEBIAN_FASHION_MNIST_DIR
pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(RAW, "t10k-labels-idx1-ubyte.gz")),
    reason="needs Debian's dataset-fashion-mnist")


def test_read_idx_gives_the_test_split_as_uint8():
  labels = fashion_mnist.read_idx(os.path.join(RAW, "t10k-labels-idx1-ubyte.gz"))
  assert labels.dtype == np.uint8 and labels.shape == (10_000,)
  # Fashion-MNIST's ten classes are balanced: 1,000 test images each.
  assert np.bincount(labels).tolist() == [1_000] * 10


def test_read_idx_of_a_missing_file_says_how_to_install(tmp_path):
  with pytest.raises(errors.DataNotFoundError, match="dataset-fashion-mnist"):
    fashion_mnist.read_idx(str(tmp_path / "missing.gz"))


def test_convert_a_slice_and_parse_it_back(tmp_path):
  out_dir = str(tmp_path / "fashion_mnist")
  info = fashion_mnist.convert_fashion_mnist(
      out_dir, train_shards=2, test_shards=1, limit=6)
  assert info["splits"] == {
      "train": {"num_examples": 6, "num_shards": 2, "first_id": 0},
      "test": {"num_examples": 6, "num_shards": 1, "first_id": 60_000}}
  files = sorted(tf.io.gfile.glob(os.path.join(out_dir, "train-*.gz")))
  assert [os.path.basename(f) for f in files] == [
      "train-00000-of-00002.tfrecord.gz", "train-00001-of-00002.tfrecord.gz"]
  records = list(tf.data.TFRecordDataset(files[0], compression_type="GZIP"))
  assert len(records) == 3  # examples 0, 2, 4
  image, label, example_id = fashion_mnist.parse_image_example(
      records[1], with_id=True)
  assert image.shape == (28, 28, 1) and image.dtype == tf.float32
  assert 0.0 <= float(tf.reduce_min(image)) <= float(tf.reduce_max(image)) <= 1
  raw_labels = fashion_mnist.read_idx(
      os.path.join(RAW, "train-labels-idx1-ubyte.gz"))
  assert int(example_id) == 2 and int(label) == int(raw_labels[2])
  # Converted once: a second call reads the info back and writes nothing.
  again = fashion_mnist.convert_fashion_mnist(out_dir, limit=1)
  assert again == info


def test_prepare_reuses_a_conversion_and_returns_both_globs(tmp_path):
  fashion_mnist.convert_fashion_mnist(str(tmp_path / "fashion_mnist"),
                                      train_shards=1, test_shards=1, limit=2)
  train, test = fashion_mnist.prepare(str(tmp_path), "")
  assert len(tf.io.gfile.glob(train)) == 1
  assert len(tf.io.gfile.glob(test)) == 1
  assert train.endswith("fashion_mnist/train-*.tfrecord.gz")
  assert test.endswith("fashion_mnist/test-*.tfrecord.gz")
