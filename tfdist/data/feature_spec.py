"""User TFRecords without code: a JSON feature spec (`--feature_spec`).

A feature spec names the features of `tf.train.Example` records, their
dtypes and shapes, and which of them are labels:

    {
      "features": {
        "x":    {"dtype": "float32", "shape": [8]},
        "tags": {"dtype": "float32", "shape": [3]},
        "image": {"dtype": "uint8", "shape": [28, 28, 1], "encoding": "raw"},
        "id":   {"dtype": "int64", "shape": [], "default": -1}
      },
      "labels": ["tags"]
    }

* `dtype`: `float32`, `int64` or `string` (the three kinds of
  `tf.train.Feature`; `float`, `int`, `bytes` are accepted too). With
  `"encoding": "raw"` the feature is one bytes value holding `shape`'s
  elements of `dtype` (any numeric dtype, e.g. `uint8`), decoded with
  `tf.io.decode_raw`, as image data sets often store pixels.
* `shape`: the fixed shape of one example's value (`[]`: a scalar).
* `default`: makes the feature optional: records without it get this value
  (so an `id` may be present or not).
* `labels`: the label feature names. One label is given to the loss as it
  is; several are flattened and concatenated into one vector (same dtype),
  e.g. three scalar 0/1 columns into a multi-label target of shape [3].
* `weight` (optional): the name of a scalar float32 feature holding each
  example's sample weight. The parsed example is then `(inputs, label,
  weight)`, as Keras's `fit` takes `(x, y, sample_weight)`: the weight
  multiplies the example's loss (and its weighted metrics) in training and
  evaluation.

Every other feature of the spec is a model input: the parsed example is
`(inputs, label)`, `inputs` a dict from feature name to tensor (a
functional model takes it with one `keras.Input(name=...)` per feature:
`spec.features.keras_inputs()` makes them; Keras 3.12 refuses an input the
model does not use, so leave such features out of the spec). Features in
the records that the spec does not name (an `id`, say) are ignored.

At start the first record of the first training and evaluation file is
checked against the spec; every mismatch (a missing feature, another kind,
another number of values) is reported by name in one `ConfigError`, before
any training.
"""

import dataclasses
import json
import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

from absl import logging
import keras
import tensorflow as tf

from tfdist import errors
from tfdist.data import data_checks
from tfdist.core.dataset_spec import DatasetSpec

# The kinds of `tf.train.Feature`, by dtype name.
_KINDS = {"float32": "float_list", "int64": "int64_list",
          "string": "bytes_list"}
_ALIASES = {"float": "float32", "int": "int64", "bytes": "string",
            "str": "string"}
# Dtypes `tf.io.decode_raw` decodes (with "encoding": "raw").
_RAW_DTYPES = ("uint8", "int8", "uint16", "int16", "int32", "int64",
               "float16", "bfloat16", "float32", "float64")
_RAW_ITEMSIZE = {"uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "int32": 4,
                 "int64": 8, "float16": 2, "bfloat16": 2, "float32": 4,
                 "float64": 8}
_FEATURE_KEYS = ("dtype", "shape", "default", "encoding")


@dataclasses.dataclass(frozen=True)
class Feature:
  """One feature of a feature spec.

  Attributes:
    name: the feature's key in the records.
    dtype: `float32`, `int64`, `string`, or with `encoding="raw"` the
      numeric dtype of the decoded values.
    shape: one example's value shape.
    default: the value for records without the feature (None: required).
    encoding: `raw` (one bytes value decoded with `tf.io.decode_raw`) or
      None.
  """
  name: str
  dtype: str
  shape: Tuple[int, ...]
  default: object = None
  encoding: Optional[str] = None

  @property
  def size(self) -> int:
    """Values per example (the product of `shape`)."""
    return int(math.prod(self.shape))

  @property
  def kind(self) -> str:
    """The `tf.train.Feature` field holding it (`bytes_list`, ...)."""
    return "bytes_list" if self.encoding == "raw" else _KINDS[self.dtype]

  def describe(self) -> str:
    text = f"{self.dtype} {list(self.shape)}"
    return text + (" (raw bytes)" if self.encoding == "raw" else "")


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
  """A parsed feature spec (see the module docstring).

  Attributes:
    path: the JSON file it came from ("" when built from a dict).
    features: every feature, in the file's order.
    labels: the label feature names.
    weight: the sample-weight feature's name, or None.
  """
  path: str
  features: Tuple[Feature, ...]
  labels: Tuple[str, ...]
  weight: Optional[str] = None

  @property
  def inputs(self) -> Dict[str, Feature]:
    """The model inputs: every feature that is neither a label nor the
    weight, by name."""
    return {f.name: f for f in self.features
            if f.name not in self.labels and f.name != self.weight}

  @property
  def label_features(self) -> List[Feature]:
    by_name = {f.name: f for f in self.features}
    return [by_name[n] for n in self.labels]

  @property
  def label_shape(self) -> Tuple[int, ...]:
    """One example's label shape (several labels: one vector)."""
    labels = self.label_features
    if len(labels) == 1:
      return labels[0].shape
    return (sum(f.size for f in labels),)

  def keras_inputs(self) -> dict:
    """One `keras.Input` per input feature, named after it (a dict)."""
    return {name: keras.Input(shape=f.shape, name=name, dtype=f.dtype)
            for name, f in self.inputs.items()}

  # --- parsing ----------------------------------------------------------
  def parse_fn(self):
    """A function from one serialized record to `(inputs, label)`, or
    `(inputs, label, weight)` with a `weight` feature."""
    features = self.features
    labels = self.labels
    weight = self.weight

    def to_tf(feature: Feature):
      if feature.encoding == "raw":
        default = None if feature.default is None else b""
        return tf.io.FixedLenFeature([], tf.string, default_value=default)
      return tf.io.FixedLenFeature(list(feature.shape), feature.dtype,
                                   default_value=feature.default)

    description = {f.name: to_tf(f) for f in features}

    def decode(feature: Feature, value):
      if feature.encoding != "raw":
        return value
      decoded = tf.io.decode_raw(value, feature.dtype)
      if feature.default is not None:
        # An absent raw feature decodes to nothing: fill with the default.
        decoded = tf.cond(
            tf.size(decoded) > 0, lambda: decoded,
            lambda: tf.fill([feature.size], tf.cast(feature.default,
                                                    feature.dtype)))
      return tf.reshape(decoded, feature.shape)

    def parse(serialized):
      parsed = tf.io.parse_single_example(serialized, description)
      values = {f.name: decode(f, parsed[f.name]) for f in features}
      inputs = {n: v for n, v in values.items()
                if n not in labels and n != weight}
      if len(labels) == 1:
        label = values[labels[0]]
      else:
        label = tf.concat([tf.reshape(values[n], [-1]) for n in labels], 0)
      if weight is not None:
        return inputs, label, values[weight]
      return inputs, label

    return parse

  # --- checking files ---------------------------------------------------
  def mismatches(self, example) -> List[str]:
    """What in one `tf.train.Example` does not match the spec.

    Returns:
      One line per mismatch, naming the feature; empty when it matches.
    """
    present = example.features.feature
    problems = []
    for feature in self.features:
      if feature.name not in present:
        if feature.default is None:
          problems.append(
              f"feature {feature.name!r} ({feature.describe()}) is missing: "
              "the record has " + (", ".join(
                  f"{k!r}" for k in sorted(present)) or "no features") +
              ". Fix the name, or give it a \"default\" to make it optional.")
        continue
      value = present[feature.name]
      kind = value.WhichOneof("kind")
      values = list(getattr(value, kind).value) if kind else []
      if kind != feature.kind:
        problems.append(
            f"feature {feature.name!r}: the spec says {feature.describe()}, "
            f"stored as {feature.kind}; the record has "
            f"{kind or 'an empty feature'} ({_kind_dtype(kind)}). Fix its "
            "\"dtype\".")
        continue
      if feature.encoding == "raw":
        want = feature.size * _RAW_ITEMSIZE[feature.dtype]
        got = [len(v) for v in values]
        if got != [want]:
          problems.append(
              f"feature {feature.name!r}: the spec says {feature.describe()}"
              f", one bytes value of {want} bytes; the record has "
              f"{len(got)} value(s) of {got} bytes. Fix its \"shape\" or "
              "\"dtype\".")
      elif len(values) != feature.size:
        problems.append(
            f"feature {feature.name!r}: the spec says shape "
            f"{list(feature.shape)} ({feature.size} value(s)); the record "
            f"has {len(values)}. Fix its \"shape\".")
    return problems

  def check_files(self, files: Sequence[str], flag: str):
    """Checks the first record of the first of `files` against the spec.

    Args:
      files: TFRecord paths (`.gz`: GZIP).
      flag: the flag they came from, for the message.

    Raises:
      ConfigError: a mismatch (every one named), or a record that is not a
        `tf.train.Example`.
      tfdist.errors.DataError: the first record cannot be read (e.g. a file
        named `.gz` that is not GZIP data).
    """
    if not files:
      return
    path = files[0]
    compression = "GZIP" if path.endswith(".gz") else ""
    try:
      records = list(tf.data.TFRecordDataset(
          path, compression_type=compression).take(1).as_numpy_iterator())
    except tf.errors.OpError as e:
      raise data_checks.damaged_error(path, f"{flag}: file", e, 0) from None
    if not records:
      return  # An empty file has nothing to check.
    try:
      example = tf.train.Example.FromString(records[0])
    except Exception as e:  # pylint: disable=broad-except
      raise errors.ConfigError(
          f"{flag}: the first record of {path} is not a tf.train.Example "
          f"({type(e).__name__}), which --feature_spec={self.path} "
          "describes.") from None
    problems = self.mismatches(example)
    if problems:
      raise errors.ConfigError(
          f"--feature_spec={self.path} does not match {flag} (first record "
          f"of {path}):\n  " + "\n  ".join(problems))
    absent = [f.name for f in self.features if f.default is not None and
              f.name not in example.features.feature]
    if absent:
      # Optional, so not an error; but a misspelt name would silently give
      # every record the default.
      logging.warning(
          "--feature_spec=%s: optional feature(s) %s absent from the first "
          "record of %s (%s): records without them get their \"default\".",
          self.path, ", ".join(repr(n) for n in absent), path, flag)

  # --- the data set -----------------------------------------------------
  def dataset_spec(self, *, name: str = "feature_spec") -> DatasetSpec:
    """A `DatasetSpec` reading `--train_files`/`--eval_files` with this
    spec (no loss of its own: the model's `compile` gives it)."""
    return DatasetSpec(name=name, parse_fn=self.parse_fn(),
                       prepare=_needs_files(self.path),
                       check_files=self.check_files, features=self)


def _needs_files(path: str):
  def prepare(data_dir, raw_data_dir):
    del data_dir, raw_data_dir
    raise errors.ConfigError(f"--feature_spec={path} describes your TFRecords: "
                             "give them as --train_files and --eval_files.")
  return prepare


def _kind_dtype(kind: Optional[str]) -> str:
  return {"float_list": "float32", "int64_list": "int64",
          "bytes_list": "string or raw bytes"}.get(kind, "no values")


def from_dict(data: dict, *, path: str = "") -> FeatureSpec:
  """Builds a `FeatureSpec` from the JSON structure (see module docstring).

  Args:
    data: the parsed JSON: `{"features": {...}, "labels": [...],
      "weight": optional}`.
    path: the file it came from (`--feature_spec`), for messages.

  Returns:
    The `FeatureSpec`; features keep the JSON's order.

  Raises:
    ConfigError: anything malformed; the message names the feature. The
      first problem found is reported: the top-level keys, then each
      feature in order, the labels, the weight, the inputs left over.
  """
  where = f"--feature_spec={path}" if path else "feature spec"

  def fail(message):
    raise errors.ConfigError(f"{where}: {message}")

  _check_top_level(data, fail)
  features = [_parse_feature(name, entry, fail)
              for name, entry in data["features"].items()]
  labels = _parse_labels(data.get("labels"), features, fail)
  weight = data.get("weight")
  _check_weight(weight, labels, features, fail)
  _check_label_dtypes(labels, features, fail)
  return FeatureSpec(path=path, features=tuple(features),
                     labels=tuple(labels), weight=weight)


def _check_top_level(data, fail) -> None:
  """An object with `features` (non-empty), `labels`, optional `weight`."""
  if not isinstance(data, dict):
    fail(f"expected a JSON object with \"features\" and \"labels\"; found "
         f"{type(data).__name__}.")
  unknown = sorted(set(data) - {"features", "labels", "weight"})
  if unknown:
    fail(f"unknown key(s) {', '.join(unknown)}; a feature spec has "
         "\"features\", \"labels\" and optionally \"weight\".")
  raw_features = data.get("features")
  if not isinstance(raw_features, dict) or not raw_features:
    fail("\"features\" must be a non-empty object from feature name to "
         "{\"dtype\": ..., \"shape\": [...]}.")


def _parse_feature(name: str, entry, fail) -> Feature:
  """One feature's entry: keys, encoding, dtype, shape and default."""
  if not isinstance(entry, dict):
    fail(f"feature {name!r} must be an object such as "
         "{\"dtype\": \"float32\", \"shape\": [8]}.")
  extra = sorted(set(entry) - set(_FEATURE_KEYS))
  if extra:
    fail(f"feature {name!r} has unknown key(s) {', '.join(extra)}; use "
         f"{', '.join(_FEATURE_KEYS)}.")
  encoding = entry.get("encoding")
  dtype = str(entry.get("dtype", "")).lower()
  dtype = _ALIASES.get(dtype, dtype)
  if encoding not in (None, "raw"):
    fail(f"feature {name!r}: \"encoding\": {encoding!r} is unknown; the "
         "only encoding is \"raw\" (bytes decoded with tf.io.decode_raw).")
  allowed = _RAW_DTYPES if encoding == "raw" else tuple(_KINDS)
  if dtype not in allowed:
    fail(f"feature {name!r}: \"dtype\": {entry.get('dtype')!r} is not one "
         f"of {', '.join(allowed)}" + (
             "" if encoding == "raw" else
             " (or set \"encoding\": \"raw\" for packed numeric bytes)") +
         ".")
  shape = entry.get("shape", [])
  if (not isinstance(shape, list) or
      not all(isinstance(d, int) and not isinstance(d, bool) and d > 0
              for d in shape)):
    fail(f"feature {name!r}: \"shape\" must be a list of positive "
         f"integers ([] for a scalar); found {shape!r}.")
  default = entry.get("default")
  if default is not None and dtype == "string" and not isinstance(
      default, str):
    fail(f"feature {name!r}: a string feature's \"default\" must be a "
         f"string; found {default!r}.")
  if isinstance(default, str) and dtype == "string":
    default = default.encode()
  return Feature(name=name, dtype=dtype, shape=tuple(shape),
                 default=default, encoding=encoding)


def _parse_labels(labels, features: Sequence[Feature], fail) -> List[str]:
  """`labels`: one name or a non-empty list of feature names."""
  if isinstance(labels, str):
    labels = [labels]
  if not isinstance(labels, list) or not labels:
    fail("\"labels\" must list the label feature(s), e.g. \"labels\": "
         "[\"y\"].")
  names = [f.name for f in features]
  for label in labels:
    if label not in names:
      fail(f"label {label!r} is not a feature; features: "
           f"{', '.join(names)}.")
  return labels


def _check_weight(weight: Optional[str], labels: Sequence[str],
                  features: Sequence[Feature], fail) -> None:
  """`weight`: a float32 scalar feature, not a label; inputs remain."""
  by_name = {f.name: f for f in features}
  if weight is not None:
    if weight not in by_name:
      fail(f"\"weight\": {weight!r} is not a feature; features: "
           f"{', '.join(by_name)}.")
    if weight in labels:
      fail(f"\"weight\": {weight!r} is also a label; the sample weight is "
           "a feature of its own.")
    if by_name[weight].dtype != "float32" or by_name[weight].shape:
      fail(f"\"weight\": {weight!r} must be a float32 scalar feature "
           "(\"shape\": []), one weight per example; found "
           f"{by_name[weight].describe()}.")
  if len(labels) + (weight is not None) == len(features):
    fail("every feature is a label or the weight: the model has no inputs.")


def _check_label_dtypes(labels: Sequence[str], features: Sequence[Feature],
                        fail) -> None:
  """Several labels are concatenated into one vector: one dtype."""
  if len(labels) > 1:
    by_name = {f.name: f for f in features}
    dtypes = {by_name[n].dtype for n in labels}
    if len(dtypes) > 1:
      fail(f"labels {', '.join(labels)} have different dtypes "
           f"({', '.join(sorted(dtypes))}); several labels are concatenated "
           "into one vector, so they need one dtype.")


def load(path: str) -> FeatureSpec:
  """Reads a feature spec JSON file (local or `gs://`).

  Raises:
    ConfigError: the file is missing, cannot be read (TensorFlow's file
      system raised `tf.errors.OpError`: an unreachable or unauthorized
      `gs://` bucket) or is not valid JSON, or the spec is malformed.
  """
  try:
    if not tf.io.gfile.exists(path):
      raise errors.ConfigError(f"--feature_spec={path}: no such file (cwd "
                               f"{os.getcwd()}).")
    with tf.io.gfile.GFile(path) as f:
      text = f.read()
  except tf.errors.OpError as e:
    raise errors.ConfigError(
        f"--feature_spec={path} cannot be read: {type(e).__name__}: "
        f"{' '.join(e.message.split())}. Check that this machine can reach "
        "and read it (for gs://: the network and credentials), or give a "
        "local copy.") from e
  try:
    data = json.loads(text)
  except ValueError as e:
    raise errors.ConfigError(
        f"--feature_spec={path} is not valid JSON: {e}") from None
  return from_dict(data, path=path)
