"""What a data set is to the trainer: `DatasetSpec`, and its errors.

The spec is the one description every other step reads: the input pipeline
takes its `parse_fn`, the model builders its shapes and feature names, the
training step its `task`. It imports nothing of tfdist's but the config
error, so data set modules (`tfdist.fashion_mnist`, `tfdist.movielens`) and
model builders depend on it and never on each other.
"""

import dataclasses
from typing import Callable, Tuple

from tfdist.config import ConfigError

# `dataset_info.json`: written last into a converted data set's folder.
INFO_FILE = "dataset_info.json"


class DataNotFoundError(ConfigError):
  """A data set or a file pattern could not be found."""


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """What the trainer needs to know about a named data set.

  Attributes:
    name: the `--dataset` value.
    input_shape: shape of one example's input, e.g. (28, 28, 1); `()` when
      the inputs are a dict of named features.
    num_classes: number of label classes (1 for a binary task).
    parse_fn: maps one serialized `tf.train.Example` (a scalar string
      tensor) to `(inputs, label)`; inputs float32 of `input_shape` (or a
      dict of named features), label int64 scalar.
    prepare: `prepare(data_dir, raw_data_dir) -> (train_pattern,
      eval_pattern)`: makes the TFRecord files if needed and returns globs.
    task: `multiclass` (the model emits logits [batch, num_classes]; sparse
      categorical cross-entropy, accuracy) or `binary` (the model emits
      sigmoid probabilities [batch, 1], labels in {0, 1}; binary
      cross-entropy, accuracy at 0.5 and ROC AUC).
    id_features: names of the string id features (each string [batch, 1])
      in the inputs dict, for models that embed ids.
    num_dense: width of the float32 `dense` input [batch, num_dense] in the
      inputs dict (0: none).
  """
  name: str
  input_shape: Tuple[int, ...]
  num_classes: int
  parse_fn: Callable
  prepare: Callable
  task: str = "multiclass"
  id_features: Tuple[str, ...] = ()
  num_dense: int = 0
