"""`tfdist.fit`: train your own Keras model on your own data, distributed.

    import keras
    import tensorflow as tf
    import tfdist

    def build_model():                       # called in the strategy's scope
      model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
      model.compile(loss="mse", metrics=["mae"])   # loss and metrics used
      return model

    def make_dataset(training):             # one epoch of (features, labels)
      return tf.data.Dataset.from_tensor_slices((x, y))

    tfdist.fit(build_model, make_dataset, config=tfdist.TrainConfig(
        model_dir="/tmp/run", train_steps=500, batch_size=256))

    # Or in-memory arrays, as keras.Model.fit takes them:
    tfdist.fit(build_model, x=x, y=y, validation_split=0.2,
               config=tfdist.TrainConfig(model_dir="/tmp/run2",
                                         train_epochs=3, batch_size=256))

tfdist picks the strategy (one device, Mirrored, MultiWorkerMirrored from
`TF_CONFIG` or `tfdist.launch --module`, parameter servers, TPU), builds the
model in its scope, shards, caches, shuffles, repeats and batches the
examples (the batch is global; the learning rate is scaled to it), trains
with its own loop, evaluates, checkpoints and resumes, exports a SavedModel
and writes the run manifest, exactly as `python -m tfdist.train` does: the
config is the same `TrainConfig` (`tfdist.flags.flags_to_config()` makes
one from tfdist's flags in your own binary).

This module is an entry point, like the binaries: it runs
`tfdist.experiment` and reads the environment (`TF_CONFIG`, ...) when
called.
"""

import contextlib
import logging as std_logging
import os
from typing import Any, Callable, Optional, Sequence, Union

from absl import flags as absl_flags
from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfdist import experiment
from tfdist import errors
from tfdist import config as config_lib
from tfdist.config import TrainConfig
from tfdist.data import input_pipeline
from tfdist.data import input_position
from tfdist.data import python_inputs
from tfdist.core.dataset_spec import DatasetSpec
from tfdist.distribute import cluster as cluster_lib
from tfdist.distribute import environment as environment_lib
from tfdist.observability import progress
from tfdist.parallel import layout_map as layout_map_lib
from tfdist.runtime import console
from tfdist.runtime import script_exit
from tfdist.runtime import wording
from tfdist.training.state import keras_callbacks
from tfdist.core import registry
from tfdist.training import task as task_lib


def _leaves(name: str, value) -> list:
  """The arrays of `value` (an array, or a list/tuple/dict of arrays), each
  with a leading example dimension."""
  leaves = tf.nest.flatten(value)
  for leaf in leaves:
    if isinstance(leaf, (tf.data.Dataset,)) or callable(leaf):
      raise errors.ConfigError(
          f"{name} must be NumPy arrays or tensors (or a list or dict of "
          f"them); received {type(leaf).__name__}. Pass a dataset function "
          "as dataset_fn (or validation_data) instead.")
    if np.ndim(leaf) == 0:
      raise errors.ConfigError(
          f"{name} holds a scalar ({leaf!r}): every array "
          "needs a leading dimension of one row per example.")
  return leaves


def _length(name: str, value) -> int:
  """Rows of every array in `value`; `ConfigError` when they differ."""
  lengths = {int(np.shape(leaf)[0]) for leaf in _leaves(name, value)}
  if len(lengths) != 1:
    raise errors.ConfigError(
        f"{name}: the arrays have different numbers of rows "
        f"({sorted(lengths)}); give one row per example in "
        "each.")
  return lengths.pop()


def _examples(name: str, arrays: Sequence[Any]) -> tuple:
  """`arrays` (x, y[, sample_weight]; None entries dropped from the end)
  checked to hold the same number of rows; returns (arrays, rows)."""
  arrays = tuple(a for a in arrays if a is not None)
  names = ("x", "y", "sample_weight")
  lengths = [(f"{name}{names[i]}", _length(f"{name}{names[i]}", a))
             for i, a in enumerate(arrays)]
  if len({n for _, n in lengths}) != 1:
    raise errors.ConfigError(
        "Arrays of different lengths: " + ", ".join(
            f"{what} has {n} rows" for what, n in lengths) +
        ". Give one row per example in each (as keras.Model.fit requires).")
  return arrays, lengths[0][1]


def _split(value, start: int, stop: Optional[int]):
  return tf.nest.map_structure(lambda a: a[start:stop], value)


def _from_arrays(arrays: tuple, input_context):
  """This input pipeline's examples of `arrays`: example i goes to
  pipeline `i mod num_input_pipelines` (tfdist's sharding of a dataset
  function), so every example is read once per epoch by one worker."""
  ds = tf.data.Dataset.from_tensor_slices(
      arrays[0] if len(arrays) == 1 else arrays)
  return ds.shard(input_context.num_input_pipelines,
                  input_context.input_pipeline_id)


def _from_function(fn: Callable, *, training: bool, input_context):
  """`fn`'s split, this pipeline's share (tfdist shards it by example
  unless `fn` takes `input_context`)."""
  ds = input_pipeline.call_input_fn(fn, training=training,
                                    input_context=input_context)
  if input_pipeline.takes_input_context(fn):
    return ds
  return ds.shard(input_context.num_input_pipelines,
                  input_context.input_pipeline_id)


def in_memory_dataset(*, x=None, y=None, sample_weight=None,
                      dataset_fn: Optional[Callable] = None,
                      validation_data=None, validation_split: float = 0.0
                      ) -> tuple:
  """The dataset function for `fit`'s arrays and validation data.

  Follows `keras.Model.fit`: `validation_split` keeps the last fraction of
  the arrays (before any shuffling) for evaluation; `validation_data`
  (arrays `(x, y)`/`(x, y, sample_weight)`, or a dataset function called
  with `training=False`) overrides it.

  Args:
    x, y, sample_weight: arrays (NumPy or tensors; `x` may be a list or dict
      of them) with one row per example; or None with `dataset_fn`.
    dataset_fn: the training dataset function (its `training=True` split)
      when there are no arrays.
    validation_data: see above; None: no evaluation (as `fit` without it;
      the `eval` modes then evaluate the arrays `x, y` themselves).
    validation_split: in (0, 1), or 0 for none; arrays only.

  Returns:
    `(input_fn, has_validation)`: a dataset function taking `training` and
    `input_context` that returns this pipeline's disjoint share (examples
    `i, i + n, ...` of n pipelines, the same sharding tfdist gives a dataset
    function), and whether it has an evaluation split.

  Raises:
    ConfigError: arrays of different lengths, `y` without `x`,
      `validation_split` outside (0, 1) or given with a dataset function, a
      validation tuple not of 2 or 3 entries, or a split leaving no
      training or no validation example.
  """
  _check_array_args(x=x, y=y, sample_weight=sample_weight,
                    validation_split=validation_split)
  train = None
  if x is not None:
    train, rows = _examples("", (x, y, sample_weight))
  validation = None
  if validation_data is not None and not callable(validation_data):
    validation = _validation_arrays(validation_data)
  elif validation_data is None and validation_split:
    train, validation = _split_off_validation(train, rows, validation_split)

  def input_fn(training, input_context):
    if training:
      return (_from_arrays(train, input_context) if train is not None
              else _from_function(dataset_fn, training=True,
                                  input_context=input_context))
    if validation is not None:
      return _from_arrays(validation, input_context)
    if validation_data is not None:
      return _from_function(validation_data, training=False,
                            input_context=input_context)
    # No validation data: the eval modes evaluate the arrays (or the
    # dataset function's split) themselves, as Model.evaluate(x, y) would.
    if train is None:
      return _from_function(dataset_fn, training=False,
                            input_context=input_context)
    return _from_arrays(train, input_context)

  if train is not None or (dataset_fn is not None and
                           not input_pipeline.takes_input_context(dataset_fn)):
    # Its training split's shares are tfdist's (example i to pipeline i mod
    # n: the arrays, or a function that does not shard itself), so the
    # pipeline can align its epochs to steps; its checkpointed position
    # names it as in-memory input (`input_position.source_files`).
    setattr(input_fn, input_pipeline.SHARDS_BY_EXAMPLE, True)
    setattr(input_fn, input_position.IN_MEMORY, True)
  return input_fn, validation is not None or validation_data is not None


def _check_array_args(*, x, y, sample_weight, validation_split: float):
  """`in_memory_dataset`'s checks of the arrays and `validation_split`.

  Raises:
    ConfigError: `validation_split` outside [0, 1), `y` or `sample_weight`
      without `x`, or `validation_split` without arrays.
  """
  if not 0.0 <= validation_split < 1.0:
    raise errors.ConfigError(
        f"validation_split={validation_split!r} must be in "
        "(0, 1): the fraction of the arrays kept for "
        "evaluation (0: none), as keras.Model.fit takes it.")
  if x is None and (y is not None or sample_weight is not None):
    raise errors.ConfigError(
        "y or sample_weight given without x: pass the inputs "
        "as x (arrays), or the examples as dataset_fn.")
  if validation_split and x is None:
    raise errors.ConfigError(
        f"validation_split={validation_split} is only for arrays (x, y), as "
        "in keras.Model.fit; with a dataset function, pass validation_data "
        "or return the evaluation split for training=False.")


def _validation_arrays(validation_data) -> tuple:
  """The arrays of a `(x_val, y_val[, val_sample_weight])` tuple.

  Raises:
    ConfigError: not a tuple or list of 2 or 3 entries, or arrays of
      different lengths.
  """
  if (not isinstance(validation_data, (tuple, list)) or
      len(validation_data) not in (2, 3)):
    entries = ("" if not isinstance(validation_data, (tuple, list))
               else f" of {len(validation_data)} entries")
    raise errors.ConfigError(
        "validation_data must be a tuple (x_val, y_val) or (x_val, y_val, "
        "val_sample_weight) of arrays, or a dataset function; received "
        f"{type(validation_data).__name__}{entries}.")
  validation, _ = _examples("validation_data ", tuple(validation_data))
  return validation


def _split_off_validation(train: tuple, rows: int,
                          validation_split: float) -> tuple:
  """`(train, validation)`: the last `validation_split` of the `rows` rows
  of `train` (before any shuffling) is the validation split.

  Raises:
    ConfigError: the split leaves no training or no validation example.
  """
  kept = int(rows * (1.0 - validation_split))
  if kept <= 0 or kept >= rows:
    raise errors.ConfigError(
        f"validation_split={validation_split} of {rows} examples leaves "
        f"{kept} for training and {rows - kept} for evaluation; choose a "
        "split that leaves examples for both.")
  return _split(train, 0, kept), _split(train, kept, None)


def make_task(model_fn: Union[Callable, str],
              dataset_fn: Union[Callable, DatasetSpec, str, None] = None, *,
              config: TrainConfig, parse_fn: Optional[Callable] = None,
              loss: Any = None, metrics: Optional[Sequence[Any]] = None,
              layout_map: Any = None) -> task_lib.Task:
  """The `tfdist.training.task.Task` that `fit` trains (see `fit` for the args).

  Raises:
    ConfigError: no data or two kinds of data given.
  """
  given = [name for name, value in (("dataset_fn", dataset_fn),
                                    ("parse_fn", parse_fn),
                                    ("config.feature_spec",
                                     config.feature_spec)) if value]
  if len(given) > 1:
    raise errors.ConfigError(
        f"Pass one source of data; received {' and '.join(given)}"
        ". dataset_fn makes the examples; parse_fn or "
        "config.feature_spec read config.train_files and "
        "config.eval_files.")
  if dataset_fn is not None:
    if isinstance(dataset_fn, str):
      task_lib.load_builtins()
    dataset = (registry.get_dataset(dataset_fn) if isinstance(dataset_fn, str)
               else registry.as_dataset_spec(
                   dataset_fn, name=None if isinstance(dataset_fn, DatasetSpec)
                   else task_lib.describe_function(dataset_fn)))
  elif parse_fn is not None:
    dataset = DatasetSpec(name=task_lib.describe_function(parse_fn),
                          parse_fn=parse_fn)
  else:
    dataset = task_lib.dataset_from_names(config.task)
  if isinstance(model_fn, str):
    task_lib.load_builtins()
    model_name, builder = registry.get_model_builder(model_fn)
  elif callable(model_fn):
    model_name, builder = task_lib.describe_function(model_fn), model_fn
  else:
    raise errors.ConfigError(
        f"model_fn must be a function returning a keras.Model "
        f"(or a registered name); received {model_fn!r}.")
  return task_lib.Task(model_fn=builder, dataset=dataset,
                       model_name=model_name, loss=loss, metrics=metrics,
                       layout_map=layout_map)


# Errors and log lines name the `TrainConfig` field the caller typed
# (`batch_size=63`), not the flag of `tfdist.train` (`--batch_size=63`).
@wording.errors_in_field_terms(
    config_lib.flat_fields, (errors.ConfigError, errors.TrainingStalledError,
                             errors.TrainingDivergedError))
def fit(model_fn: Union[Callable, str],
        dataset_fn: Union[Callable, DatasetSpec, str, None] = None, *,
        config: TrainConfig, x: Any = None, y: Any = None,
        epochs: Optional[int] = None, batch_size: Optional[int] = None,
        sample_weight: Any = None, validation_data: Any = None,
        validation_split: float = 0.0, parse_fn: Optional[Callable] = None,
        loss: Any = None, metrics: Optional[Sequence[Any]] = None,
        callbacks: Sequence[Any] = (), environment=None,
        verbose: Union[str, int] = "auto",
        expert_parallel: Optional[int] = None,
        layout_map: Any = None) -> dict:
  """Trains `model_fn`'s model on `dataset_fn`'s examples, distributed.

  Args:
    model_fn: returns a `keras.Model`, compiled (its loss and metrics are
      used; the optimizer comes from `config`) or not. tfdist calls it in
      the strategy's scope, with the keyword arguments it names among `spec`
      (the data set's `DatasetSpec`) and `config`. A registered name works
      too. A model whose class overrides `train_step`, `test_step`,
      `compute_loss` or `compute_metrics` is trained and evaluated with
      its own step, as `keras.Model.fit` runs it
      (`tfdist.training.step.custom_step`).
    dataset_fn: returns a finite `tf.data.Dataset` of unbatched `(features,
      labels)` examples, one epoch of a split; called with the keyword
      arguments it names among `training` (True: training split, False:
      evaluation split) and `input_context` (a `tf.distribute.InputContext`:
      a function that takes it returns only its input pipeline's share;
      otherwise tfdist shards). A `DatasetSpec` or a registered name works
      too. None: read `config.train_files`/`config.eval_files` with
      `parse_fn` or `config.feature_spec`, else use `config.dataset`.
    config: the `TrainConfig` (`model_dir`, length, batch, strategy,
      precision, `mode`, ...).
    x, y, sample_weight: in-memory examples instead of `dataset_fn`, as
      `keras.Model.fit` takes them: NumPy arrays or tensors with one row per
      example (`x` may be a list or dict of arrays; `sample_weight` float
      [examples]). Each worker reads a disjoint share (example i goes to
      input pipeline `i mod n`), every example once an epoch. Without
      validation data (and `config.mode` "train_and_eval") the run only
      trains, as `fit` evaluates nothing then. `x` may also be a
      `keras.utils.PyDataset` (or `Sequence`), a generator or an iterator of
      `(x, y)` or `(x, y, sample_weight)` batches (without `y` and
      `sample_weight`): their batches are split into examples and batched
      by `config.batch_size`; one device and Mirrored only (refused at
      start for several workers or parameter servers); a generator is read
      to its end at start (it cannot be rewound). How often each is read,
      and what resuming does: `tfdist.data.python_inputs`.
    epochs: passes over the training examples, as `keras.Model.fit`'s
      `epochs` (int >= 1): sets `config.train_epochs`. None: the config's.
    batch_size: the global batch in examples (int >= 1; split over every
      replica of every worker, as Keras's `batch_size` is under a
      distribution strategy): sets `config.batch_size`, also for a dataset
      function (tfdist batches its unbatched examples). None: the config's.
    validation_data: the evaluation split: a tuple `(x_val, y_val)` or
      `(x_val, y_val, val_sample_weight)` of arrays, a dataset function
      (called with `training=False`), or a `PyDataset`, generator or
      iterator as `x` takes them; overrides `validation_split` and, with
      a `dataset_fn`, its `training=False` split.
    validation_split: in (0, 1): the last fraction of the arrays' rows,
      taken before any shuffling (as `fit` takes it), is the evaluation
      split; 0: none. Arrays only.
    parse_fn: maps one serialized record of `config.train_files` /
      `config.eval_files` (TFRecord; `.gz`: GZIP) to `(features, labels)`.
    loss: a Keras loss, loss function or name; overrides the model's
      compiled loss.
    metrics: Keras metrics or names; override the compiled ones.
    callbacks: Keras callbacks, a list or a `keras.callbacks.CallbackList`
      (see `tfdist.experiment.run_experiment` and
      `docs/guides/fit-conformance.md`: each class works as in `fit` or is
      refused at start).
    environment: a `tfdist.distribute.environment.RunEnvironment`; None reads
      `os.environ` (`TF_CONFIG`, Vertex AI's variables) now.
    verbose: as `keras.Model.fit`'s. 1 (or True): a progress bar per
      epoch on stdout (`keras.callbacks.ProgbarLogger`, as `fit(verbose=1)`
      shows it: `Epoch 2/5`, steps of the epoch, ETA, the epoch's loss,
      metrics and `val_*` values) on the chief, and tfdist's other lines
      (the plan at start, warnings, checkpoints) on stderr, without the
      step and evaluation lines the bar repeats. 2: tfdist's lines, a line
      every `config.log_steps` steps (`tfdist: epoch E/N, step S/T: ...,
      ETA 1m12s`, epochs counted from 1 as Keras's callbacks count them)
      and each evaluation (one line with the step line at its step).
      "auto" (the default): 1 when stdout is a terminal or a notebook's,
      else 2 (`tfdist.observability.progress.resolve_verbose`). 1 and 2
      print the lines on stderr also in a plain script, where absl's
      logging is not set up (its default WARNING level: `_info_lines`),
      and the final evaluation on stdout; 0 (or False) prints neither and
      leaves logging as it is. Under `absl.app.run` absl's own flags
      (`--verbosity`, `--logtostderr`) decide which lines show.
    expert_parallel: E_p (int >= 1): sets `config.expert_parallel`, the
      replicas each `MixtureOfExperts` layer's experts are split over
      (`tfdist.parallel.experts.mode`; docs/guides/experts.md). None: the
      config's.
    layout_map: a `keras.distribution.LayoutMap` over a `DeviceMesh` with
      axes `batch` and `model`: the model (functional or Sequential) is
      split over the `model` axis's T replicas as the map says (sets
      `config.tensor_parallel` to T): each Dense whose kernel it splits by
      columns or rows becomes a `ColumnParallelDense` or
      `RowParallelDense`, each MultiHeadAttention split by heads a
      `ParallelMultiHeadAttention` (`tfdist.parallel.tensor.from_layout_map`;
      docs/guides/tensor-parallelism.md). The replicas are
      `config.num_gpus` or `config.num_cpu_devices` (a multiple of T;
      default T), not the mesh's batch axis. A
      `keras.distribution.ModelParallel` is read as its layout map. None:
      no split, unless `config.layout_map` names a function returning a
      map (`--layout_map`, e.g. from `tfdist.flags.flags_to_config()` in a
      binary of one's own), which is read the same way.

  Returns:
    The run manifest (as `run_manifest.json` holds it) on the chief and
    every training worker, with `history`: what `keras.Model.fit`'s
    returned `History.history` holds (`{"loss": [one value per epoch],
    "val_loss": [...], <metric>: [...], ...}`, the epochs this call
    trained); `{"role": "evaluator", "results": [...]}` for
    the `eval`/`continuous_eval` modes and evaluator tasks;
    `{"role": "worker"|"ps", ...}` for parameter-server tasks.

  Raises:
    ConfigError: bad arguments or configuration, found before the model is
      built or trained; its message names the `TrainConfig` field
      (`batch_size=63`), not `tfdist.train`'s flag (e.g. a `verbose` other than "auto", 0, 1 or 2,
      `epochs` with `config.train_steps` or another `config.train_epochs`,
      `batch_size` with another `config.batch_size` or with
      `config.per_replica_batch_size`,
      arrays of different lengths, a `PyDataset` or generator for a run of
      several workers or parameter servers, a
      `validation_split` outside (0, 1) or with a dataset function, no loss
      anywhere, a model that cannot take the features, a setting that a
      model with its own `train_step` cannot take, a `layout_map` whose
      `model` axis is not `config.tensor_parallel` or that splits what
      `tfdist.parallel.tensor.from_layout_map` refuses, a `layout_map`
      given with `config.layout_map`).
    tfdist.errors.PreemptedError: SIGTERM or SIGINT stopped training after
      every worker saved a checkpoint (call again with the same
      `config.model_dir` to resume). Uncaught, it ends the script as
      `tfdist.train` ends: its message as one line on stderr, no
      traceback, exit status 130 (SIGINT) or 143 (SIGTERM), through the
      `sys.excepthook` that `fit` installs then
      (`tfdist.runtime.script_exit`).
    tfdist.errors.StoppedAtStartError: SIGTERM or SIGINT arrived while this
      task waited for its cluster's peers (nothing trained); uncaught, it
      ends the script the same way.
  """
  _check_verbose(verbose)
  layout_map = _layout_map_given(config, layout_map)
  config = _with_fit_keywords(config, expert_parallel=expert_parallel,
                              epochs=epochs, batch_size=batch_size,
                              layout_map=layout_map)
  python = python_inputs.python_input_names(x=x,
                                            validation_data=validation_data)
  if python is not None:
    environment = environment or environment_lib.read_environment()
    _check_one_host(python, config=config, environment=environment)
    x, y, sample_weight, dataset_fn, validation_data = python_inputs.resolve(
        x=x, y=y, sample_weight=sample_weight,
        validation_data=validation_data, dataset_fn=dataset_fn,
        validation_split=validation_split)
  arrays = x is not None or y is not None or sample_weight is not None
  if (arrays or validation_data is not None or validation_split or
      python is not None):
    dataset_fn, config = _in_memory_source(
        dataset_fn, config=config, parse_fn=parse_fn, x=x, y=y,
        sample_weight=sample_weight, validation_data=validation_data,
        validation_split=validation_split)
    if python is not None and python[0] == "x" and not isinstance(
        python[1], keras.utils.PyDataset):
      setattr(dataset_fn.input_fn, input_position.RESUME_NOTE,
              python_inputs.GENERATOR_RESUME_NOTE)
  config = _with_callbacks_warmup(config, callbacks)
  task = make_task(model_fn, dataset_fn, config=config, parse_fn=parse_fn,
                   loss=loss, metrics=metrics,
                   layout_map=(layout_map if config.layout_map_entries
                               else None))
  history = keras.callbacks.History()
  verbose = progress.resolve_verbose(verbose)
  callbacks = _with_progress_bar(callbacks, verbose=verbose)
  try:
    with _info_lines(verbose != 0, without_progress=verbose == 1):
      result = experiment.run_experiment(_named_config(config, task),
                                         callbacks=[*callbacks, history],
                                         environment=environment, task=task,
                                         print_final_eval=verbose != 0)
  except errors.PreemptedError as e:
    raise _stopped_in_fit(e, config) from None
  except errors.StoppedAtStartError:
    script_exit.install_stop_hook()  # Nothing trained: one line, 128 + sig.
    raise
  return _with_history(result, history)


def _with_callbacks_warmup(config: TrainConfig, callbacks) -> TrainConfig:
  """`config` with the warmup that Keras rate callbacks among `callbacks`
  leave (`keras_callbacks.warmup_for_rate_callbacks`); unchanged without
  one."""
  warmup = keras_callbacks.warmup_for_rate_callbacks(
      callbacks, warmup_steps=config.warmup_steps,
      warmup_epochs=config.warmup_epochs,
      warmup_start_learning_rate=config.warmup_start_learning_rate)
  return config if warmup is None else config.replace(warmup_steps=warmup)


def _with_fit_keywords(config: TrainConfig, *, expert_parallel, epochs,
                       batch_size, layout_map) -> TrainConfig:
  """`config` with what `fit`'s keywords set: `expert_parallel`, Keras's
  `epochs` and `batch_size` (`with_keras_length`), and the tensor-parallel
  degree and recorded entries of a `layout_map`
  (`from_layout_map.config_changes`, through
  `tfdist.training.task.layout_map_changes`: its messages name
  `--layout_map` when the map came from `config.layout_map`).

  Raises:
    ConfigError: a keyword's bad value, or one that contradicts `config`.
  """
  if expert_parallel is not None:
    config = config.replace(
        expert_parallel=_positive_int("expert_parallel", expert_parallel))
  config = with_keras_length(config, epochs=epochs, batch_size=batch_size)
  if layout_map is not None:
    config = config.replace(**task_lib.layout_map_changes(
        config, layout_map, path=config.task.layout_map))
  return config


def _layout_map_given(config: TrainConfig, layout_map):
  """The layout map `fit` splits the model by: its `layout_map` keyword
  (a `keras.distribution.ModelParallel` read as its layout map), or the
  one `config.layout_map` (`--layout_map` in a binary of one's own) names
  (`tfdist.training.task.load_layout_map`); None: neither.

  Raises:
    ConfigError: both given, or `load_layout_map`'s refusals.
  """
  path = config.task.layout_map
  if not path:
    return None if layout_map is None else layout_map_lib.layout_map_of(
        layout_map)
  if layout_map is not None:
    raise errors.ConfigError(
        f"--layout_map={path} and tfdist.fit(..., layout_map=...) both give "
        "a layout map. Pass one: the keyword (and leave the config's "
        "layout_map empty), or the function in the config.")
  return task_lib.load_layout_map(path)


def _check_verbose(verbose) -> None:
  """Refuses a `fit(verbose=...)` other than "auto", 0, 1 or 2.

  Raises:
    ConfigError: naming the value and the ones `fit` takes.
  """
  if (isinstance(verbose, float) or verbose is None
      or verbose not in ("auto", 0, 1, 2)):
    raise errors.ConfigError(
        f"tfdist.fit(verbose={verbose!r}): use \"auto\", 1 or "
        "2 (tfdist's log lines) or 0 (logging as it is).")


def _with_progress_bar(callbacks: Sequence[Any], *, verbose: int) -> list:
  """`callbacks` flattened to a list, with a `keras.callbacks.ProgbarLogger`
  appended for `verbose` 1 (resolved) unless one is there already."""
  callbacks = keras_callbacks.flatten(callbacks)
  if verbose == 1 and not any(isinstance(c, keras.callbacks.ProgbarLogger)
                              for c in callbacks):
    callbacks.append(keras.callbacks.ProgbarLogger())
  return callbacks


def _stopped_in_fit(error: errors.PreemptedError,
                    config: TrainConfig) -> errors.PreemptedError:
  """`error` saying how to resume in a script's terms, with the hook that
  ends an uncaught one as `tfdist.train` ends (`script_exit`) installed."""
  script_exit.install_stop_hook()
  return errors.PreemptedError(
      signum=error.signum, step=error.step, checkpoint=error.checkpoint,
      resume=("Run the script again with the same model_dir in its "
              f"TrainConfig (model_dir={config.model_dir!r}) to resume."))


def _positive_int(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or (
      value < 1):
    raise errors.ConfigError(f"tfdist.fit({name}={value!r}): {name} must be an "
                             "integer >= 1, as keras.Model.fit takes it.")
  return int(value)


def with_keras_length(config: TrainConfig, *, epochs: Optional[int] = None,
                      batch_size: Optional[int] = None) -> TrainConfig:
  """`config` with `keras.Model.fit`'s `epochs` and `batch_size` (`fit`'s
  args) as its `train_epochs` and `batch_size`.

  Raises:
    ConfigError: a value that is not an integer >= 1, or one the config
      sets otherwise: `epochs` with `train_steps` > 0 (steps decide the
      length then) or another `train_epochs`; `batch_size` with another
      `batch_size` or with `per_replica_batch_size`.
  """
  changes = {}
  if epochs is not None:
    epochs = _positive_int("epochs", epochs)
    if config.train_steps:
      raise errors.ConfigError(
          f"tfdist.fit(epochs={epochs}) and TrainConfig(train_steps="
          f"{config.train_steps}) both set how long to train: drop one "
          "(train_steps=0 lets epochs decide).")
    default = config_lib.flat_fields()["train_epochs"].default
    if config.train_epochs not in (default, epochs):
      raise errors.ConfigError(
          f"tfdist.fit(epochs={epochs}) and TrainConfig(train_epochs="
          f"{config.train_epochs}) disagree: set the number of epochs in one "
          "place.")
    changes["train_epochs"] = epochs
  if batch_size is not None:
    batch_size = _positive_int("batch_size", batch_size)
    if config.per_replica_batch_size is not None:
      raise errors.ConfigError(
          f"tfdist.fit(batch_size={batch_size}) is the global batch, and "
          "TrainConfig(per_replica_batch_size="
          f"{config.per_replica_batch_size}) sets it per replica: give one.")
    if ("batch_size" not in config.unset_fields and
        config.batch_size not in (None, batch_size)):
      raise errors.ConfigError(
          f"tfdist.fit(batch_size={batch_size}) and TrainConfig(batch_size="
          f"{config.batch_size}) disagree: set the global batch in one "
          "place.")
    changes["batch_size"] = batch_size
  return config.replace(**changes) if changes else config
def _check_one_host(python: tuple, *, config: TrainConfig,
                    environment: environment_lib.RunEnvironment):
  """Refuses a Python input (`(name, value)`) for a run of several workers
  or parameter servers (`python_inputs.check_one_host`), from the cluster
  the run will resolve.

  Raises:
    ConfigError: as `python_inputs.check_one_host`, or a malformed cluster.
  """
  cluster = cluster_lib.resolve_cluster(
      worker_hosts=config.worker_hosts, task_index=config.task_index,
      environ=environment.variables,
      reduction_server=config.reduction_server)
  name, value = python
  python_inputs.check_one_host(
      name=name, value=value,
      distribution_strategy=config.distribution_strategy,
      # A pipeline's chief alone reads the input, across a cluster too.
      num_workers=1 if config.pipeline_stages > 1 else cluster.num_workers,
      num_ps=cluster.num_ps)


_TFDIST_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _tfdist_lines(record: std_logging.LogRecord) -> bool:
  """tfdist's own records, and every warning."""
  return (record.levelno >= std_logging.WARNING or
          os.path.abspath(record.pathname).startswith(_TFDIST_DIR))


def _not_progress(record: std_logging.LogRecord) -> bool:
  """Not a line a progress bar shows already."""
  return not progress.is_progress_line(record)


@contextlib.contextmanager
def _info_lines(wanted: bool, *, without_progress: bool = False):
  """tfdist's INFO lines on stderr while the block runs, where nothing asked
  for them: outside an absl app (its flags unparsed), with absl's logger
  above INFO (its default: WARNING, from Python's root logger), the level
  is INFO and, unless absl's handler is on the root logger already, absl's
  logger writes through that handler alone (not also through a handler
  Python's `logging.warning` put on the root logger); `without_progress`
  leaves out the step and evaluation lines a progress bar shows
  (`progress.PROGRESS`); the lines read like Keras's
  (`console.keras_like_lines`: plain, never inside a progress bar, each of
  TensorFlow's warnings once). Everything is restored after the block.
  Where the caller's logging shows INFO already, only the progress-bar
  newline and TensorFlow's warnings once apply; not `wanted`, nothing
  changes."""
  absl_logger = logging.get_absl_logger()
  if not wanted:
    yield
    return
  if (absl_flags.FLAGS.is_parsed()
      or absl_logger.getEffectiveLevel() <= std_logging.INFO):
    with console.keras_like_lines(None, plain=False):
      yield
    return
  handler = logging.get_absl_handler()
  verbosity, level = logging.get_verbosity(), absl_logger.level
  propagate = absl_logger.propagate
  own_handler = handler not in std_logging.getLogger().handlers
  logging.set_verbosity(logging.INFO)
  if own_handler:
    absl_logger.addHandler(handler)
    absl_logger.propagate = False
    # TensorFlow's and Keras's own INFO lines (saver timings and the like)
    # stay as hidden as before; their warnings show.
    handler.addFilter(_tfdist_lines)
    if without_progress:
      handler.addFilter(_not_progress)
  try:
    # Plain lines (no glog header), never inside a progress bar, each of
    # TensorFlow's warnings once (`tfdist.runtime.console`).
    with console.keras_like_lines(handler if own_handler else None,
                                  plain=own_handler):
      yield
  finally:
    if own_handler:
      handler.removeFilter(_not_progress)
      handler.removeFilter(_tfdist_lines)
      absl_logger.removeHandler(handler)
      absl_logger.propagate = propagate
    logging.set_verbosity(verbosity)
    absl_logger.setLevel(level)


def _with_history(result, history: keras.callbacks.History):
  """A training run's `result` (a manifest dict) with `history`: each
  logged value's list of per-epoch floats; any other result as it is."""
  if isinstance(result, dict) and "role" not in result:
    return {**result, "history": {k: [float(v) for v in values]
                                  for k, values in history.history.items()}}
  return result


def _named_config(config: TrainConfig, task: task_lib.Task) -> TrainConfig:
  """`config` naming `task`'s model, and its data set unless
  `config.feature_spec` describes the data."""
  names = {"model": task.model_name}
  if not config.feature_spec:
    names["dataset"] = task.dataset.name
  return config.replace(**names)


def _in_memory_source(dataset_fn, *, config: TrainConfig,
                      parse_fn: Optional[Callable], x, y, sample_weight,
                      validation_data, validation_split: float) -> tuple:
  """`fit`'s data source for arrays or validation data (`fit`'s args).

  Returns:
    `(dataset_spec, config)`: a `DatasetSpec` over `in_memory_dataset`'s
    dataset function, and `config` (its `mode` "train" when it was
    "train_and_eval" without validation data, as `keras.Model.fit`
    evaluates nothing then).

  Raises:
    ConfigError: arrays and `dataset_fn` both given, arrays or validation
      data with `parse_fn` or `config.feature_spec`, `sample_weight` with
      `config.class_weight`, a `dataset_fn` that is not a function, or
      `in_memory_dataset`'s errors.
  """
  arrays = x is not None or y is not None or sample_weight is not None
  if arrays and dataset_fn is not None:
    raise errors.ConfigError(
        "Pass the examples once: arrays (x, y) or dataset_fn"
        ", not both.")
  if parse_fn is not None or config.feature_spec:
    raise errors.ConfigError(
        "x, y, validation_data and validation_split go with arrays or a "
        "dataset function; parse_fn and config.feature_spec read "
        "config.train_files and config.eval_files (give the evaluation "
        "files there).")
  if sample_weight is not None and config.class_weight:
    given = ",".join(f"{k}:{w}" for k, w in config.class_weight)
    raise errors.ConfigError(
        f"--class_weight={given} and sample weights in "
        "fit(sample_weight=...) cannot be used together (as in Keras's "
        "fit). Fold the class weights into the sample weights, or drop "
        "one.")
  if dataset_fn is not None and not callable(dataset_fn):
    raise errors.ConfigError("validation_data and validation_split need "
                             "dataset_fn to be a function; received "
                             f"{dataset_fn!r}.")
  input_fn, has_validation = in_memory_dataset(
      x=x, y=y, sample_weight=sample_weight, dataset_fn=dataset_fn,
      validation_data=validation_data, validation_split=validation_split)
  name = ("arrays" if arrays else task_lib.describe_function(dataset_fn))
  if not has_validation and config.mode == "train_and_eval":
    # keras.Model.fit evaluates nothing without validation data.
    config = config.replace(mode="train")
  return DatasetSpec(name=name, input_fn=input_fn), config
