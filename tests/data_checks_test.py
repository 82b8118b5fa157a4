"""Unit tests of tfdist.data.data_checks on small TFRecord files written here."""

import os

import pytest
import tensorflow as tf

from tfdist import errors
from tfdist.data import data_checks

FEATURES = {"x": tf.io.FixedLenFeature([2], tf.float32),
            "y": tf.io.FixedLenFeature([], tf.int64)}


def _example(x=(1.0, 2.0), y=1):
  return tf.train.Example(features=tf.train.Features(feature={
      "x": tf.train.Feature(float_list=tf.train.FloatList(value=list(x))),
      "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y])),
  })).SerializeToString()


def _write(path, records, compression=""):
  options = tf.io.TFRecordOptions(compression_type=compression)
  with tf.io.TFRecordWriter(str(path), options) as writer:
    for record in records:
      writer.write(record)
  return str(path)


def test_counts_of_good_files(tmp_path):
  train = _write(tmp_path / "train.tfrecord", [_example()] * 3)
  gz = _write(tmp_path / "eval.tfrecord.gz", [_example()] * 2, "GZIP")
  assert data_checks.check_framing(train, check_data=True) == 3
  assert data_checks.count_file(gz) == 2
  counts = data_checks.check_data([train], [gz])
  assert (counts.num_train_examples, counts.num_eval_examples) == (3, 2)
  assert counts.train == ((train, 3),)


def test_a_file_cut_inside_a_header_is_named_with_its_offset(tmp_path):
  path = _write(tmp_path / "cut.tfrecord", [_example()] * 2)
  size = os.path.getsize(path)
  with open(path, "ab") as f:
    f.write(b"\0" * 5)  # 5 bytes of a 12-byte header
  with pytest.raises(errors.DataError,
                     match=f"ends 5 byte\\(s\\) into a record's 12-byte "
                     f"header at byte {size} \\(record 3; after 2 good"):
    data_checks.count_file(path, what="training file")


def test_a_flipped_data_byte_fails_its_crc(tmp_path):
  path = _write(tmp_path / "bad.tfrecord", [_example()])
  data = bytearray(open(path, "rb").read())
  data[data_checks.HEADER_BYTES + 3] ^= 0xFF
  open(path, "wb").write(bytes(data))
  with pytest.raises(errors.DataError, match="data fails its CRC32C"):
    data_checks.check_framing(path, check_data=True)


def test_python_and_library_crc32c_agree_with_the_standard_check_value():
  # CRC-32C of "123456789" is 0xE3069283 (RFC 3720's check value).
  assert data_checks._python_crc32c(b"123456789") == 0xE3069283
  if data_checks.LIBRARY_CRC32C is not None:
    assert data_checks.LIBRARY_CRC32C(b"123456789") == 0xE3069283


def test_mixed_compression_is_refused():
  data_checks.check_compression(["a.gz", "b.gz"], flag="--train_files")
  with pytest.raises(errors.DataError, match="--train_files mixes GZIP"):
    data_checks.check_compression(["a.gz", "b"], flag="--train_files")


def test_first_record_check_names_each_mismatch(tmp_path):
  check = data_checks.first_record_check(FEATURES, dataset="toy")
  good = _write(tmp_path / "good.tfrecord", [_example()])
  check([good], "--train_files")
  other = tf.train.Example(features=tf.train.Features(feature={
      "x": tf.train.Feature(int64_list=tf.train.Int64List(value=[1, 2])),
  })).SerializeToString()
  bad = _write(tmp_path / "bad.tfrecord", [other])
  with pytest.raises(errors.DataError) as raised:
    check([bad], "--eval_files")
  message = str(raised.value)
  assert "--eval_files: evaluation file" in message
  assert "x is int64, not float; y is missing." in message
  assert "expected: x float[2], y int64[1]" in message
  assert isinstance(raised.value, errors.ConfigError)
