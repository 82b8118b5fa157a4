"""What a run trains: a `Task` (model builder, data set, loss and metrics).

The binary's `--model`, `--layout_map`, `--dataset`, `--feature_spec` and
`--import_modules` and the Python API's objects (`tfdist.fit`) both become
one `Task`; every later step (the run plan, assembly, input pipelines,
export) reads it and never the names again:

    config.task (the model and data section, `tfdist.config.TaskConfig`)
           --(from_names)--> Task(model_fn, dataset, loss, metrics,
                                  layout_map)
    tfdist.fit(model_fn, dataset_fn, ..., layout_map=...) --> Task

A layout map changes the config too (`tensor_parallel` T and the map's
entries, `layout_map_changes`): `split_by_layout_map` applies it where
the run starts (`tfdist.experiment.prepare.start_run`), `tfdist.fit`
before it.

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
from tfdist.parallel import layout_map as layout_map_lib
from tfdist.parallel.tensor import from_layout_map


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
      under `tensor_parallel` (`tfdist.fit(layout_map=...)`, or what the
      function `--layout_map` names returns: `load_layout_map`;
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
      `model`, `data.dataset`, `feature_spec`, `import_modules`,
      `layout_map`).

  Returns:
    The `Task`; its `layout_map` the map `--layout_map`'s function returns
    (`load_layout_map`), None without the flag. The config's
    `tensor_parallel` is not changed here: `split_by_layout_map` does it.

  Raises:
    ConfigError: an unknown model or data set (the message lists the
      registered names), an import path that cannot be loaded, a model
      builder with a required parameter tfdist cannot fill
      (`registry.check_accepted`), `load_layout_map`'s refusals.
  """
  dataset = dataset_from_names(task)
  name, builder = registry.get_model_builder(task.model)
  # At start, not after the plan: a callable that is no model builder.
  registry.check_accepted(builder, MODEL_BUILDER_ARGUMENTS,
                          what=f"--model={name}")
  path = getattr(task, "layout_map", "")
  layout_map = load_layout_map(path) if path else None
  return Task(model_fn=builder, dataset=dataset, model_name=name,
              layout_map=layout_map)


def _refuse_layout_map(path: str, message: str):
  raise errors.ConfigError(f"--layout_map={path}: {message}") from None


def load_layout_map(path: str) -> keras.distribution.LayoutMap:
  """The Keras layout map `--layout_map=package.module:function` gives:
  the function imported and called with no arguments, its
  `keras.distribution.LayoutMap` (or a `keras.distribution.ModelParallel`'s
  layout map, `tfdist.parallel.layout_map.layout_map_of`). Nothing is
  built; the map is not read against the model yet (that is
  `tfdist.parallel.tensor.from_layout_map.check`, when the model is
  built).

  Args:
    path: `package.module:function` (the attribute may be dotted).

  Returns:
    The `LayoutMap`, its mesh holding an axis named `model`.

  Raises:
    ConfigError: naming `--layout_map`, the value and the fix: not
      `module:function`, a module that cannot be found, no such attribute,
      not callable, a function with required parameters, one that returns
      something other than a `LayoutMap` or `ModelParallel`, a
      `ModelParallel` without a layout map or with its batch dimension not
      named `batch`, a mesh without a `model` axis (or with an axis other
      than `batch` and `model`).
    Exception: what importing the user's module or calling the function
      raises otherwise (its traceback kept), as `--model` does.
  """
  function = registry.load_object(path, flag="--layout_map")
  if not callable(function):
    _refuse_layout_map(
        path, f"{type(function).__name__} {function!r} is not a function. "
        "Name a function of no arguments that returns a "
        "keras.distribution.LayoutMap.")
  signature, required = registry.unfilled_parameters(function)
  if required:
    _refuse_layout_map(
        path, f"{getattr(function, '__name__', function)}{signature} has "
        f"required parameter(s) {', '.join(required)}; tfdist calls it with "
        "none. Give them defaults, or name a function of no arguments that "
        "returns a keras.distribution.LayoutMap.")
  value = function()
  try:
    layout_map = layout_map_lib.layout_map_of(value)
    if not isinstance(layout_map, keras.distribution.LayoutMap):
      raise errors.ConfigError(
          f"the function returned {type(value).__name__}, not a "
          "keras.distribution.LayoutMap (or ModelParallel). Return "
          "keras.distribution.LayoutMap(keras.distribution.DeviceMesh("
          "(1, T), ['batch', 'model'], devices=...)) with its entries "
          "(e.g. map['up/kernel'] = (None, 'model')).")
    from_layout_map.degree(layout_map)
  except errors.ConfigError as e:
    _refuse_layout_map(path, str(e))
  return layout_map


def layout_map_changes(config, layout_map, *, path: str = "") -> dict:
  """The `TrainConfig` changes of a run `layout_map` splits
  (`from_layout_map.config_changes`: `tensor_parallel` T and the map's
  entries; `{}` when T is 1): one reading for `tfdist.fit(layout_map=...)`
  and `--layout_map`.

  Args:
    config: the run's `TrainConfig`.
    layout_map: the `keras.distribution.LayoutMap`.
    path: `--layout_map`'s value when the map came from it (the messages
      name it); "": `tfdist.fit`'s keyword.

  Raises:
    ConfigError: `config_changes`'s (a `model` axis that is not the given
      `--tensor_parallel`), prefixed with `--layout_map=path` when given.
  """
  try:
    return from_layout_map.config_changes(config, layout_map)
  except errors.ConfigError as e:
    if not path:
      raise
    _refuse_layout_map(path, str(e))


def split_by_layout_map(config, task: Task) -> Tuple[Any, Task]:
  """`(config, task)` of a run whose `--layout_map` named a map
  (`from_names` loaded it into `task.layout_map`): the config with the
  map's T and entries (`layout_map_changes`, as `tfdist.fit(layout_map=
  ...)` sets them), the task without the map when it splits nothing (a
  `model` axis of 1). Both as given without `--layout_map`. Every start
  calls it, a resumed run's too, so the map is read again the same way.

  Raises:
    ConfigError: `layout_map_changes`'s, naming `--layout_map`.
  """
  path = config.task.layout_map
  if not path or task.layout_map is None:
    return config, task
  changes = layout_map_changes(config, task.layout_map, path=path)
  if not changes:
    return config, dataclasses.replace(task, layout_map=None)
  return config.replace(**changes), task


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
