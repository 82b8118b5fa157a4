"""What a run trains: a `Task` (model builder, data set, loss and metrics).

The binary's `--model`, `--dataset`, `--feature_spec` and `--import_modules`
and the Python API's objects (`tfdist.fit`) both become one `Task`; every
later step (the run plan, assembly, input pipelines, export) reads it and
never the names again:

    config.task (the model and data section, `tfdist.config.TaskConfig`)
           --(from_names)--> Task(model_fn, dataset, loss, metrics)
    tfdist.fit(model_fn, dataset_fn, ...) --> Task

`build_model` calls the builder with the arguments it names (`spec`,
`config`) and checks that it returned a `keras.Model`; `example_spec`
gives the shapes of one example (for resolving `"accuracy"` and for
building metrics) without reading data.
"""

import dataclasses
from typing import Any, Callable, Optional, Sequence, Tuple

import keras
import tensorflow as tf

from tfdist import errors
from tfdist.data import feature_spec as feature_spec_lib
from tfdist.data import input_pipeline
from tfdist.core.dataset_spec import DatasetSpec
from tfdist.core import registry


@dataclasses.dataclass(frozen=True)
class Task:
  """A model builder, a data set, and (optionally) the loss and metrics.

  Attributes:
    model_fn: returns a `keras.Model` (compiled or not); called inside the
      strategy's scope with the keyword arguments it names among `spec` (the
      `DatasetSpec`) and `config` (the run's model options,
      `tfdist.config.ModelBuilderConfig`).
    dataset: the `DatasetSpec` (TFRecord files or a dataset function).
    model_name: how the model is named in logs and the manifest (a
      registered name or `module:function`).
    loss: the loss (a Keras loss, loss function or name); None: from the
      model's `compile`, else the data set's defaults.
    metrics: Keras metrics or names; None: as for `loss`.
    layout_map: a `keras.distribution.LayoutMap` that splits the model
      under `tensor_parallel` (`tfdist.fit(layout_map=...)`,
      `tfdist.parallel.tensor.from_layout_map`); None: none.
  """
  model_fn: Callable
  dataset: DatasetSpec
  model_name: str
  loss: Any = None
  metrics: Optional[Sequence[Any]] = None
  layout_map: Any = None


def load_builtins():
  """Registers tfdist's own models and data sets (importing them does).

  Imported here, not at the top: importing them fills the registries, and
  the callers decide when that happens (`dataset_from_names` imports the
  user's `--import_modules` first, as the registrations always ran).
  """
  from tfdist import models  # pylint: disable=g-import-not-at-top,unused-import
  from tfdist.data import datasets  # pylint: disable=g-import-not-at-top,unused-import


def dataset_from_names(task) -> DatasetSpec:
  """The `DatasetSpec` that `--dataset`/`--feature_spec` name.

  Args:
    task: the config's model and data section (`tfdist.config.TaskConfig`:
      `data.dataset`, `feature_spec`, `import_modules`).

  Raises:
    ConfigError: unknown name, a malformed feature spec, an import path
      that cannot be loaded.
  """
  registry.import_modules(tuple(task.import_modules))
  load_builtins()
  if task.feature_spec:
    return feature_spec_lib.load(task.feature_spec).dataset_spec(
        name=task.data.dataset)
  return registry.get_dataset(task.data.dataset)


# The keyword arguments `build_model` can give a model builder.
MODEL_BUILDER_ARGUMENTS = ("spec", "config", "sync_batch_norm",
                           "activation_recomputation")


def from_names(task) -> Task:
  """The `Task` the names give (imports `--import_modules` first).

  Args:
    task: the config's model and data section (`tfdist.config.TaskConfig`:
      `model`, `data.dataset`, `feature_spec`, `import_modules`).

  Raises:
    ConfigError: an unknown model or data set (the message lists the
      registered names), an import path that cannot be loaded, a model
      builder with a required parameter tfdist cannot fill
      (`registry.check_accepted`).
  """
  dataset = dataset_from_names(task)
  name, builder = registry.get_model_builder(task.model)
  # At start, not after the plan: a callable that is no model builder.
  registry.check_accepted(builder, MODEL_BUILDER_ARGUMENTS,
                          what=f"--model={name}")
  return Task(model_fn=builder, dataset=dataset, model_name=name)


def describe_function(fn) -> str:
  """`module:qualname` of a function (its import path when it has one)."""
  return (f"{getattr(fn, '__module__', '?')}:"
          f"{getattr(fn, '__qualname__', getattr(fn, '__name__', fn))}")


def build_model(task: Task, model_options, *, sync_batch_norm: bool = False,
                activation_recomputation: Optional[bool] = None,
                tensor_parallel: bool = False):
  """Calls the task's builder (in the current scope); checks the result.

  The builder gets, by name, what it asks for of `spec` (the data set's
  `DatasetSpec`), `config` (the run's model options,
  `tfdist.config.ModelBuilderConfig`), `sync_batch_norm`
  (whether batch normalization should use the global batch: the run plan's
  decision, see `tfdist.models.resolve_sync_batch_norm`) and
  `activation_recomputation` (`--activation_recomputation`: recompute its
  blocks' activations in the backward pass; refused before this call for a
  builder without it, see `tfdist.models.check_recomputation`).

  Args:
    task: the `Task` whose `model_fn` is called.
    model_options: what a builder asking for `config` receives (the run's
      model options, `tfdist.config.ModelBuilderConfig`: its model
      section, read by flat name; or None); read for the built-in models'
      shape (`embedding_dim`, `hash_buckets`, `transformer_layers`) and
      nothing else.
    sync_batch_norm: given to builders that take it.
    activation_recomputation: given to builders that take it; None: the
      `activation_recomputation` attribute of `model_options` (False
      without one).
    tensor_parallel: given to builders that take it (the built-in
      Transformer: build from the tensor-parallel layers).

  Returns:
    The `keras.Model` the builder returned.

  Raises:
    ConfigError: the builder needs arguments tfdist cannot give, or did not
      return a `keras.Model`.
  """
  what = f"--model={task.model_name}"
  if activation_recomputation is None:
    activation_recomputation = getattr(model_options,
                                       "activation_recomputation", False)
  options = model_options
  model = registry.call_with_accepted(
      task.model_fn, {"spec": task.dataset, "config": options,
                      "embedding_dim": getattr(options, "embedding_dim", 16),
                      "hash_buckets": getattr(options, "hash_buckets",
                                              100_000),
                      "transformer_layers": getattr(
                          options, "transformer_layers", 2),
                      "sync_batch_norm": bool(sync_batch_norm),
                      "activation_recomputation": bool(
                          activation_recomputation),
                      "tensor_parallel": bool(tensor_parallel)},
      what=what)
  if not isinstance(model, keras.Model):
    raise errors.ConfigError(
        f"{what} returned {type(model).__name__}, not a "
        "keras.Model. Return the model (built, or buildable "
        "from its first batch).")
  return model


def sample_weight_spec(dataset: DatasetSpec) -> Any:
  """The `tf.TensorSpec` of one example's sample weight: the third element
  of `(features, labels, sample_weight)` examples (as Keras's `fit` reads a
  dataset), or None for pairs.

  Raises:
    ConfigError: the third element is not numeric (Keras would take it as
      the sample weight).
  """
  spec = _element_spec(dataset)
  if not isinstance(spec, tuple) or len(spec) < 3:
    return None
  weight = spec[2]
  dtype = getattr(weight, "dtype", None)
  if dtype is None or not (dtype.is_floating or dtype.is_integer):
    raise errors.ConfigError(
        f"--dataset={dataset.name} yields examples of {len(spec)} elements;"
        f" the third is taken as the sample weight (as Keras's fit takes "
        f"(x, y, sample_weight)) but is {weight}, not a number. Return "
        "(features, labels) or (features, labels, weight) with a float "
        "weight per example.")
  return weight


def _element_spec(dataset: DatasetSpec):
  if dataset.reads_files:
    return tf.data.Dataset.from_tensors(tf.constant(b"")).map(
        dataset.parse_fn).element_spec
  return input_pipeline.call_input_fn(dataset, training=False).element_spec


def example_spec(dataset: DatasetSpec, *, files: Sequence[str] = ()
                 ) -> Tuple[Any, Any]:
  """`(features, labels)` `tf.TensorSpec`s of one unbatched example.

  Reads no data: TFRecord data sets trace `parse_fn`; a dataset function is
  called once (for the evaluation split, as one input pipeline) and its
  `element_spec` read.

  Raises:
    ConfigError: the examples are not `(features, labels)` pairs.
  """
  if dataset.reads_files:
    ds = tf.data.Dataset.from_tensors(tf.constant(b"")).map(dataset.parse_fn)
    spec = ds.element_spec
    del files
  else:
    spec = input_pipeline.call_input_fn(dataset, training=False).element_spec
  if not isinstance(spec, tuple) or len(spec) < 2:
    raise errors.ConfigError(
        f"--dataset={dataset.name} yields {spec}, not (features, labels) "
        "pairs: return a tf.data.Dataset of (features, labels) examples.")
  return spec[0], spec[1]
