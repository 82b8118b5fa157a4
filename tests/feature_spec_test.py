"""Tests for tfdist.data.feature_spec: user TFRecords described by JSON.

Real records written with `tf.io.TFRecordWriter`, parsed through the spec's
`parse_fn` and checked by `check_files`, as `--feature_spec` does at start.
"""

import json
import os

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import pytest
import tensorflow as tf

from tests import testutil
from tfdist import errors
from tfdist.data import fashion_mnist
from tfdist.data import feature_spec

# Unit tests: also run on the oldest supported TensorFlow (tests/conftest.py).
pytestmark = pytest.mark.compat

SPEC = {
    "features": {
        "x": {"dtype": "float32", "shape": [3]},
        "pixels": {"dtype": "uint8", "shape": [2, 2, 1], "encoding": "raw"},
        "word": {"dtype": "string", "shape": [], "default": ""},
        "id": {"dtype": "int64", "shape": [], "default": -1},
        "a": {"dtype": "float32", "shape": []},
        "b": {"dtype": "float32", "shape": []},
    },
    "labels": ["a", "b"],
}


def _feature(kind, values):
  if kind == "float":
    return tf.train.Feature(float_list=tf.train.FloatList(value=values))
  if kind == "int":
    return tf.train.Feature(int64_list=tf.train.Int64List(value=values))
  return tf.train.Feature(bytes_list=tf.train.BytesList(value=values))


def _record(with_optional=True, **overrides):
  features = {"x": _feature("float", [1.0, 2.0, 3.0]),
              "pixels": _feature("bytes", [bytes([0, 64, 128, 255])]),
              "a": _feature("float", [1.0]), "b": _feature("float", [0.0])}
  if with_optional:
    features["word"] = _feature("bytes", [b"hello"])
    features["id"] = _feature("int", [7])
  features.update(overrides)
  features = {k: v for k, v in features.items() if v is not None}
  return tf.train.Example(features=tf.train.Features(
      feature=features)).SerializeToString()


def _write(records, name="data.tfrecord"):
  path = os.path.join(testutil.scratch_dir(), name)
  with tf.io.TFRecordWriter(path) as writer:
    for record in records:
      writer.write(record)
  return path


class ParseTest(absltest.TestCase):

  def test_parses_inputs_and_concatenated_labels(self):
    spec = feature_spec.from_dict(SPEC, path="spec.json")
    self.assertEqual(sorted(spec.inputs), ["id", "pixels", "word", "x"])
    self.assertEqual(spec.label_shape, (2,))
    inputs, label = spec.parse_fn()(tf.constant(_record()))
    np.testing.assert_allclose(inputs["x"], [1.0, 2.0, 3.0])
    self.assertEqual(inputs["pixels"].dtype, tf.uint8)
    np.testing.assert_array_equal(inputs["pixels"].numpy().ravel(),
                                  [0, 64, 128, 255])
    self.assertEqual(inputs["word"].numpy(), b"hello")
    self.assertEqual(int(inputs["id"]), 7)
    np.testing.assert_allclose(label, [1.0, 0.0])

  def test_optional_features_take_their_default(self):
    # `id` (and the others with a "default") may be absent from a record.
    spec = feature_spec.from_dict(SPEC)
    inputs, _ = spec.parse_fn()(tf.constant(_record(with_optional=False)))
    self.assertEqual(int(inputs["id"]), -1)
    self.assertEqual(inputs["word"].numpy(), b"")

  def test_one_label_keeps_its_shape(self):
    spec = feature_spec.from_dict({"features": {
        "x": {"dtype": "float32", "shape": [3]},
        "a": {"dtype": "float32", "shape": []}}, "labels": "a"})
    _, label = spec.parse_fn()(tf.constant(_record()))
    self.assertEqual(label.shape, [])
    self.assertEqual(spec.label_shape, ())

  def test_weight_feature_is_the_third_element(self):
    spec = feature_spec.from_dict({"features": {
        "x": {"dtype": "float32", "shape": [3]},
        "a": {"dtype": "float32", "shape": []},
        "b": {"dtype": "float32", "shape": []}}, "labels": ["a"],
        "weight": "b"})
    self.assertEqual(sorted(spec.inputs), ["x"])
    inputs, label, weight = spec.parse_fn()(tf.constant(_record(
        b=_feature("float", [0.25]))))
    self.assertEqual(sorted(inputs), ["x"])
    self.assertEqual(float(label), 1.0)
    self.assertEqual(float(weight), 0.25)

  def test_keras_inputs_are_named_after_the_features(self):
    spec = feature_spec.from_dict(SPEC)
    inputs = spec.keras_inputs()
    self.assertEqual(sorted(inputs), ["id", "pixels", "word", "x"])
    self.assertEqual(tuple(inputs["x"].shape), (None, 3))
    self.assertEqual(inputs["word"].dtype, "string")

  def test_dataset_spec_reads_files(self):
    spec = feature_spec.from_dict(SPEC, path="spec.json").dataset_spec()
    self.assertTrue(spec.reads_files)
    self.assertEqual(spec.name, "feature_spec")
    self.assertIsNone(spec.task)
    with self.assertRaisesRegex(
        errors.ConfigError, "--train_files and --eval_files"):
      spec.prepare("/data", "")

  def test_fashion_mnist_records_without_id_parse(self):
    # "id features are optional everywhere": training never reads them.
    record = tf.train.Example(features=tf.train.Features(feature={
        "image": _feature("bytes", [bytes(784)]),
        "label": _feature("int", [3])})).SerializeToString()
    image, label = fashion_mnist.parse_image_example(tf.constant(record))
    self.assertEqual((image.shape, int(label)), ((28, 28, 1), 3))
    _, _, example_id = fashion_mnist.parse_image_example(
        tf.constant(record), with_id=True)
    self.assertEqual(int(example_id), -1)


class MalformedSpecTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("not_an_object", [], "expected a JSON object"),
      ("unknown_key", {**SPEC, "label": "a"}, "unknown key\\(s\\) label"),
      ("no_features", {"features": {}, "labels": ["a"]}, "non-empty object"),
      ("bad_dtype", {"features": {"x": {"dtype": "float64", "shape": []},
                                  "y": {"dtype": "int64"}}, "labels": ["y"]},
       "feature 'x': \"dtype\": 'float64' is not one of"),
      ("bad_shape", {"features": {"x": {"dtype": "float32", "shape": [0]},
                                  "y": {"dtype": "int64"}}, "labels": ["y"]},
       "feature 'x': \"shape\" must be a list of positive"),
      ("unknown_label", {"features": {"x": {"dtype": "float32"}},
                         "labels": ["y"]}, "label 'y' is not a feature"),
      ("only_labels", {"features": {"x": {"dtype": "float32"}},
                       "labels": ["x"]}, "the model has no inputs"),
      ("unknown_weight", {**SPEC, "weight": "w"},
       "\"weight\": 'w' is not a feature"),
      ("weight_is_a_label", {**SPEC, "weight": "a"}, "is also a label"),
      ("weight_not_a_float_scalar", {**SPEC, "weight": "x"},
       "must be a float32 scalar feature"),
      ("mixed_label_dtypes", {"features": {
          "x": {"dtype": "float32"}, "a": {"dtype": "float32"},
          "b": {"dtype": "int64"}}, "labels": ["a", "b"]},
       "labels a, b have different dtypes"),
  )
  def test_errors_name_the_feature(self, data, message):
    with self.assertRaisesRegex(errors.ConfigError, message):
      feature_spec.from_dict(data, path="spec.json")

  def test_load_reports_bad_json_and_missing_file(self):
    path = os.path.join(testutil.scratch_dir(), "spec.json")
    with open(path, "w") as f:
      f.write("{not json")
    with self.assertRaisesRegex(
        errors.ConfigError, f"--feature_spec={path} is not "
                                "valid JSON"):
      feature_spec.load(path)
    with self.assertRaisesRegex(errors.ConfigError, "no such file"):
      feature_spec.load(path + ".missing")
    with open(path, "w") as f:
      json.dump(SPEC, f)
    self.assertEqual(feature_spec.load(path).labels, ("a", "b"))


class CheckFilesTest(absltest.TestCase):

  def test_matching_files_pass(self):
    spec = feature_spec.from_dict(SPEC, path="spec.json")
    spec.check_files([_write([_record()])], "--train_files")
    # Optional features may be absent; a warning names them (a misspelt
    # name would otherwise give every record the default, silently).
    with self.assertLogs(level="WARNING") as logs:
      spec.check_files([_write([_record(with_optional=False)])],
                       "--train_files")
    self.assertIn("optional feature(s) 'word', 'id' absent from the first "
                  "record", logs.output[0])

  def test_every_mismatch_is_named(self):
    spec = feature_spec.from_dict(SPEC, path="spec.json")
    path = _write([_record(x=_feature("float", [1.0, 2.0]),
                           a=_feature("int", [1]),
                           pixels=_feature("bytes", [bytes(3)]),
                           b=None)])
    with self.assertRaises(errors.ConfigError) as caught:
      spec.check_files([path], "--eval_files")
    message = str(caught.exception)
    self.assertIn(f"--feature_spec=spec.json does not match --eval_files "
                  f"(first record of {path})", message)
    self.assertIn("feature 'x': the spec says shape [3] (3 value(s)); the "
                  "record has 2", message)
    self.assertIn("feature 'a': the spec says float32 [], stored as "
                  "float_list; the record has int64_list", message)
    self.assertIn("feature 'pixels': the spec says uint8 [2, 2, 1] (raw "
                  "bytes), one bytes value of 4 bytes", message)
    self.assertIn("feature 'b' (float32 []) is missing: the record has "
                  "'a', 'id', 'pixels', 'word', 'x'", message)

  def test_gzip_files_are_read(self):
    spec = feature_spec.from_dict(SPEC, path="spec.json")
    path = os.path.join(testutil.scratch_dir(), "data.tfrecord.gz")
    with tf.io.TFRecordWriter(path, "GZIP") as writer:
      writer.write(_record(x=_feature("float", [1.0])))
    with self.assertRaisesRegex(errors.ConfigError, "feature 'x'"):
      spec.check_files([path], "--train_files")

  def test_an_uncompressed_file_named_gz_is_named(self):
    spec = feature_spec.from_dict(SPEC, path="spec.json")
    path = _write([_record()], name="plain.tfrecord.gz")
    with self.assertRaisesRegex(
        errors.DataError,
        rf"--train_files: file {path} is damaged: DataLossError: .*the name "
        r"ends in \.gz but the file is not GZIP data"):
      spec.check_files([path], "--train_files")

  def test_not_an_example(self):
    spec = feature_spec.from_dict(SPEC, path="spec.json")
    path = _write([b"\xff\xfe not a proto"])
    with self.assertRaisesRegex(
        errors.ConfigError, "is not a tf.train.Example"):
      spec.check_files([path], "--train_files")


if __name__ == "__main__":
  absltest.main()
