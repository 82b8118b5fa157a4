"""What a data set is to the trainer: `DatasetSpec`, and its errors.

The spec is the one description every other step reads: the input pipeline
takes its `parse_fn` (TFRecord files) or its `input_fn` (a dataset function),
the model builders its shapes and feature names, the training step its
default loss and metrics. It imports nothing of tfdist's but the config
error, so data set modules (`tfdist.data.fashion_mnist`,
`tfdist.data.movielens`, `tfdist.data.feature_spec`) and model builders depend
on it and never on each other.
"""

import dataclasses
from typing import Any, Callable, Optional, Sequence, Tuple

from tfdist import errors

# `dataset_info.json`: written last into a converted data set's folder.
INFO_FILE = "dataset_info.json"


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """What the trainer needs to know about a data set.

  A data set comes from TFRecord files (`parse_fn`, with `prepare` or the
  `--train_files`/`--eval_files` globs) or from a dataset function
  (`input_fn`); tfdist shards (unless the function does), caches, shuffles,
  repeats, batches and prefetches either.

  Attributes:
    name: the `--dataset` value (a registered name or an import path).
    input_shape: shape of one example's input, e.g. (28, 28, 1); `()` when
      the inputs are a dict of named features or unknown.
    num_classes: number of label classes (1 for a binary task; 0: not a
      classification data set, or unknown).
    parse_fn: maps one serialized record (a scalar string tensor) to
      `(inputs, label)`; for TFRecord data sets.
    prepare: `prepare(data_dir, raw_data_dir) -> (train_pattern,
      eval_pattern)`: makes the TFRecord files if needed and returns globs
      (None: the files must be given as `--train_files`/`--eval_files`).
    task: the default loss and metrics when neither the model's `compile`
      nor the caller gives them (`tfdist.training.step.objectives.TASKS`):
      `multiclass` (the model emits logits [batch, num_classes]; sparse
      categorical cross-entropy, accuracy) or `binary` (sigmoid probabilities
      [batch, 1], labels in {0, 1}; binary cross-entropy, accuracy at 0.5
      and ROC AUC); None: no default.
    id_features: names of the string id features (each string [batch, 1])
      in the inputs dict, for models that embed ids.
    num_dense: width of the float32 `dense` input [batch, num_dense] in the
      inputs dict (0: none).
    input_fn: a dataset function. tfdist calls it with the keyword
      arguments it names among `input_context` (the
      `tf.distribute.InputContext` of this input pipeline) and `training`
      (True for the training split, False for the evaluation split); it
      returns a finite `tf.data.Dataset` of unbatched `(features, labels)`
      examples: one epoch of its split. A function that takes
      `input_context` returns only its pipeline's share (e.g. with
      `ds.shard(input_context.num_input_pipelines,
      input_context.input_pipeline_id)`); otherwise tfdist shards the
      examples itself. Evaluation reads every example once, in order.
    loss: the data set's default loss (a Keras loss, its name or a
      function); overrides `task`'s.
    metrics: the data set's default metrics (Keras metrics or names);
      overrides `task`'s.
    check_files: `check_files(files, flag)`, run on the listed files at
      start; raises `ConfigError` naming what does not match.
    features: the `tfdist.data.feature_spec.FeatureSpec` the data comes from
      (for model builders: `spec.features.keras_inputs()`), or None.
    vocabulary_size: for text data sets whose inputs are token ids
      (int64 [batch, input_shape[0]]): the number of ids, padding (0) and
      unknown (1) included; 0 otherwise.
  """
  name: str
  input_shape: Tuple[int, ...] = ()
  num_classes: int = 0
  parse_fn: Optional[Callable] = None
  prepare: Optional[Callable] = None
  task: Optional[str] = None
  id_features: Tuple[str, ...] = ()
  num_dense: int = 0
  input_fn: Optional[Callable] = None
  loss: Any = None
  metrics: Optional[Sequence[Any]] = None
  check_files: Optional[Callable] = None
  features: Any = None
  vocabulary_size: int = 0

  def __post_init__(self):
    if (self.parse_fn is None) == (self.input_fn is None):
      raise ValueError(
          f"DatasetSpec {self.name!r} needs exactly one source: parse_fn "
          "(TFRecord files) or input_fn (a dataset function). Received "
          f"parse_fn={self.parse_fn!r}, input_fn={self.input_fn!r}.")

  @property
  def reads_files(self) -> bool:
    """True for TFRecord data sets (`parse_fn`), False for `input_fn`."""
    return self.parse_fn is not None
