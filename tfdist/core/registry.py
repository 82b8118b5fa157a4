"""Names that `--model` and `--dataset` accept: registries and import paths.

A model builder is a function returning a `keras.Model` (compiled or not);
a data set is a `tfdist.core.dataset_spec.DatasetSpec`, or a dataset function
returning a `tf.data.Dataset` of `(features, labels)` examples (see
`DatasetSpec.input_fn`). Both reach tfdist in one of three ways:

* registered under a name, with the public decorators::

      @tfdist.register_model("my_model")
      def build(spec):             # or build(), build(spec, config)
        ...

      @tfdist.register_dataset("my_data")
      def examples(input_context, training):
        ...

  and chosen with `--model=my_model --dataset=my_data` once the module is
  imported (`--import_modules=my_project.registrations`);
* named by import path, `--model=package.module:build_fn` and
  `--dataset=package.module:dataset_fn` (imported on use, no registration);
* passed as objects to `tfdist.fit`.

tfdist calls model builders and dataset functions with the keyword
arguments they name, as Keras calls a layer's `call` with `training` only
when it takes one (see `call_with_accepted`).

This module is a leaf (it imports only the config and the data set spec):
tfdist's own models and data sets register themselves here on import
(`tfdist.models`, `tfdist.data.datasets`), and `tfdist.training.task` resolves
names after importing them.
"""

import dataclasses
import importlib
import inspect
import os
from typing import Callable, Dict, Iterable, Mapping, Optional, Tuple, Union

from tfdist import errors
from tfdist.core.dataset_spec import DatasetSpec

_MODELS: Dict[str, Callable] = {}
_DATASETS: Dict[str, DatasetSpec] = {}


def _same_definition(a, b) -> bool:
  """True for one function seen twice: the same object, or the same
  qualified name in the same source file (a module imported twice, e.g.
  under two names, or reloaded)."""
  if a is b:
    return True
  code_a, code_b = getattr(a, "__code__", None), getattr(b, "__code__", None)
  return (code_a is not None and code_b is not None and
          getattr(a, "__qualname__", None) == getattr(b, "__qualname__", 0)
          and os.path.realpath(code_a.co_filename) ==
          os.path.realpath(code_b.co_filename))


def _describe(obj) -> str:
  return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', obj)}"


def _add(table: dict, kind: str, name: str, value, key=None):
  if not isinstance(name, str) or not name or ":" in name:
    raise ValueError(f"A {kind} name must be a non-empty string without ':' "
                     f"(':' marks an import path). Received: name={name!r}")
  key = key or (lambda v: v)
  old = table.get(name)
  if old is not None and not _same_definition(key(old), key(value)):
    raise ValueError(
        f"The {kind} name {name!r} is already registered (by "
        f"{_describe(key(old))}); register {_describe(key(value))} under "
        "another name.")
  table[name] = value


def register_model(name: Union[str, Callable, None] = None):
  """Registers a model builder under `name` (default: the function's name).

  Use as `@register_model`, `@register_model("name")`, or call
  `register_model("name")(build_fn)`. The builder returns a `keras.Model`
  (compiled with a loss and metrics, or not: then the data set's defaults
  or `tfdist.fit`'s arguments give them) and may take the keyword
  arguments `spec` (the run's `DatasetSpec`) and `config` (its
  `TrainConfig`). tfdist calls it inside the strategy's scope.

  Returns:
    The decorator (it returns the builder unchanged).

  Raises:
    ValueError: the name is taken by another builder, or contains ':'.
  """
  if callable(name):
    return register_model(None)(name)

  def decorator(build_fn: Callable) -> Callable:
    if not callable(build_fn):
      raise TypeError(f"register_model expects a function; received "
                      f"{build_fn!r}.")
    _add(_MODELS, "model", name or build_fn.__name__, build_fn)
    return build_fn

  return decorator


def register_dataset(name: Union[str, Callable, DatasetSpec, None] = None,
                     **spec_fields):
  """Registers a data set under `name`.

  Use as `@register_dataset` or `@register_dataset("name", **fields)` on a
  dataset function (see `DatasetSpec.input_fn`), or call
  `register_dataset(spec)` with a whole `DatasetSpec` (registered under
  `spec.name`).

  Args:
    name: the `--dataset` name (default: the function's name); or the
      function or `DatasetSpec` itself.
    **spec_fields: further `DatasetSpec` fields for a dataset function,
      e.g. `task="binary"` (its default loss and metrics) or
      `metrics=("mae",)`.

  Returns:
    The decorator (it returns its argument unchanged).

  Raises:
    ValueError: the name is taken by another data set, or contains ':'.
  """
  if isinstance(name, DatasetSpec) or callable(name):
    return register_dataset(None, **spec_fields)(name)

  def decorator(dataset):
    spec = as_dataset_spec(dataset, name=name, **spec_fields)
    _add(_DATASETS, "dataset", spec.name, spec, key=_spec_source)
    return dataset

  return decorator


def _spec_source(spec: DatasetSpec):
  return spec.input_fn or spec.parse_fn or spec


def as_dataset_spec(dataset, *, name: Optional[str] = None,
                    **spec_fields) -> DatasetSpec:
  """A `DatasetSpec` from a spec or a dataset function.

  Raises:
    TypeError: `dataset` is neither.
  """
  if isinstance(dataset, DatasetSpec):
    if spec_fields or (name and name != dataset.name):
      return dataclasses.replace(dataset, name=name or dataset.name,
                                 **spec_fields)
    return dataset
  if callable(dataset):
    return DatasetSpec(name=name or getattr(dataset, "__name__", "dataset"),
                       input_fn=dataset, **spec_fields)
  raise TypeError(f"A data set is a DatasetSpec or a dataset function "
                  f"(input_context, training) -> tf.data.Dataset; received "
                  f"{dataset!r}.")


def model_names() -> Tuple[str, ...]:
  """The registered model names, sorted."""
  return tuple(sorted(_MODELS))


def dataset_names() -> Tuple[str, ...]:
  """The registered data set names, sorted."""
  return tuple(sorted(_DATASETS))


def is_import_path(value: str) -> bool:
  """`package.module:attribute`, as `--model` and `--dataset` take it."""
  return isinstance(value, str) and ":" in value


def load_object(path: str, *, flag: str):
  """Imports `package.module:attribute` (the attribute may be dotted).

  Args:
    path: the import path.
    flag: the flag it came from, for messages (e.g. `--model`).

  Returns:
    The attribute.

  Raises:
    ConfigError: malformed path, module not found, no such attribute.
    Exception: whatever importing the user's module raises otherwise (an
      error inside it keeps its traceback).
  """
  module_name, _, attribute = path.partition(":")
  if not module_name or not attribute:
    raise errors.ConfigError(f"{flag}={path!r} is not an import path: write "
                             "package.module:function, e.g. "
                             f"{flag}=my_project.models:build_model.")
  module = _import(module_name, flag=f"{flag}={path}")
  obj = module
  for part in attribute.split("."):
    if not hasattr(obj, part):
      public = sorted(n for n in dir(module) if not n.startswith("_")
                      and callable(getattr(module, n)))
      raise errors.ConfigError(
          f"{flag}={path!r}: module {module_name} has no attribute "
          f"{attribute!r}. It has: {', '.join(public) or 'nothing callable'}.")
    obj = getattr(obj, part)
  return obj


def _import(module_name: str, *, flag: str):
  try:
    return importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    missing = e.name or ""
    if module_name == missing or module_name.startswith(missing + "."):
      raise errors.ConfigError(
          f"{flag}: cannot import {module_name} (no module named "
          f"{missing!r}). Run from the folder that holds it, or add that "
          "folder to PYTHONPATH.") from e
    raise


def import_modules(names: Iterable[str], *, flag: str = "--import_modules"):
  """Imports each module of `names` (registration modules), once.

  Raises:
    ConfigError: a module cannot be found (the message names it).
  """
  for name in names:
    if name:
      _import(name, flag=f"{flag}={name}")


def _unknown(kind: str, flag: str, value: str, known: Iterable[str],
             decorator: str, example: str) -> errors.ConfigError:
  return errors.ConfigError(
      f"{flag}={value!r} is unknown. Registered: {', '.join(known)}. Give a "
      f"registered name, an import path ({flag}={example}), or register "
      f"your {kind} with @tfdist.{decorator} in a module named by "
      "--import_modules.")


def get_model_builder(name: str) -> Tuple[str, Callable]:
  """`(name, builder)` for `--model=name`: registered, or an import path.

  Raises:
    ConfigError: unknown name (the message lists the registered ones), or
      an import path that cannot be loaded.
  """
  if is_import_path(name):
    builder = load_object(name, flag="--model")
    if not callable(builder):
      raise errors.ConfigError(
          f"--model={name!r} names {builder!r}, which is not a "
          "function returning a keras.Model.")
    return name, builder
  if name not in _MODELS:
    raise _unknown("model", "--model", name, model_names(), "register_model",
                   "my_project.models:build_model")
  return name, _MODELS[name]


def get_dataset(name: str) -> DatasetSpec:
  """The `DatasetSpec` for `--dataset=name`: registered, or an import path
  to a `DatasetSpec` or a dataset function.

  Raises:
    ConfigError: unknown name (the message lists the registered ones), or
      an import path that cannot be loaded.
  """
  if is_import_path(name):
    obj = load_object(name, flag="--dataset")
    try:
      return as_dataset_spec(obj, name=name)
    except TypeError as e:
      raise errors.ConfigError(f"--dataset={name!r}: {e}") from None
  if name not in _DATASETS:
    raise _unknown("data set", "--dataset", name, dataset_names(),
                   "register_dataset", "my_project.data:make_dataset")
  return _DATASETS[name]


def accepts(fn: Callable, name: str) -> bool:
  """True when `fn` takes a keyword argument `name` (by that name, or
  through `**kwargs`), so that `call_with_accepted` would pass it."""
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False
  param = params.get(name)
  return (param is not None and param.kind is not param.POSITIONAL_ONLY) or (
      any(p.kind is p.VAR_KEYWORD for p in params.values()))


def unfilled_parameters(fn: Callable, names: Iterable[str] = ()):
  """`(signature, missing)`: `fn`'s signature (None when it cannot be read:
  some built-ins) and its required parameters that keyword arguments
  chosen from `names` cannot fill (positional-only ones never can)."""
  names = tuple(names)
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):
    return None, []
  return signature, [
      name for name, param in signature.parameters.items()
      if param.default is param.empty and param.kind not in (
          param.VAR_POSITIONAL, param.VAR_KEYWORD) and (
              name not in names or param.kind is param.POSITIONAL_ONLY)]


def check_accepted(fn: Callable, names: Iterable[str], *, what: str):
  """Checks, without calling it, that `fn` can be called with keyword
  arguments chosen from `names` (as `call_with_accepted` calls it): every
  parameter without a default must be one of `names`, by name, even when
  `fn` also takes `**kwargs`. A callable whose signature cannot be read
  (some built-ins) passes.

  Raises:
    ConfigError: `fn` has a required parameter tfdist cannot fill; the
      message names `what`, the signature and what tfdist passes.
  """
  names = tuple(names)
  signature, missing = unfilled_parameters(fn, names)
  if missing:
    raise errors.ConfigError(
        f"{what}: {getattr(fn, '__name__', fn)}{signature} has required "
        f"parameter(s) {', '.join(missing)} that tfdist cannot fill; it "
        f"passes, by name, only: {', '.join(names)}. Name a function that "
        "takes only those, by name (or none).")


def call_with_accepted(fn: Callable, available: Mapping[str, object], *,
                       what: str):
  """Calls `fn` with the keyword arguments of `available` it names.

  A function with `**kwargs` gets them all; one that names none gets none.
  This is how Keras passes `training` and `mask` to a layer's `call` only
  when its signature has them.

  Args:
    fn: the user's function.
    available: what tfdist can pass, by name.
    what: how messages name `fn` (e.g. "--model=my_project.models:build").

  Raises:
    ConfigError: `fn` has a required parameter tfdist cannot fill.
  """
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):
    return fn(**available)
  check_accepted(fn, available, what=what)
  params = signature.parameters
  if any(p.kind is p.VAR_KEYWORD for p in params.values()):
    return fn(**available)
  kwargs = {name: available[name] for name, param in params.items()
            if name in available and param.kind not in (
                param.POSITIONAL_ONLY, param.VAR_POSITIONAL)}
  return fn(**kwargs)
