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

from typing import Any, Callable, Optional, Sequence, Union

from tfdist import experiment
from tfdist import registry
from tfdist import task as task_lib
from tfdist.config import ConfigError
from tfdist.config import TrainConfig
from tfdist.dataset_spec import DatasetSpec


def make_task(model_fn: Union[Callable, str],
              dataset_fn: Union[Callable, DatasetSpec, str, None] = None, *,
              config: TrainConfig, parse_fn: Optional[Callable] = None,
              loss: Any = None, metrics: Optional[Sequence[Any]] = None
              ) -> task_lib.Task:
  """The `tfdist.task.Task` that `fit` trains (see `fit` for the args).

  Raises:
    ConfigError: no data or two kinds of data given.
  """
  given = [name for name, value in (("dataset_fn", dataset_fn),
                                    ("parse_fn", parse_fn),
                                    ("config.feature_spec",
                                     config.feature_spec)) if value]
  if len(given) > 1:
    raise ConfigError(f"Pass one source of data; received {' and '.join(given)}"
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
    dataset = task_lib.dataset_from_config(config)
  if isinstance(model_fn, str):
    task_lib.load_builtins()
    model_name, builder = registry.get_model_builder(model_fn)
  elif callable(model_fn):
    model_name, builder = task_lib.describe_function(model_fn), model_fn
  else:
    raise ConfigError(f"model_fn must be a function returning a keras.Model "
                      f"(or a registered name); received {model_fn!r}.")
  return task_lib.Task(model_fn=builder, dataset=dataset,
                       model_name=model_name, loss=loss, metrics=metrics)


def fit(model_fn: Union[Callable, str],
        dataset_fn: Union[Callable, DatasetSpec, str, None] = None, *,
        config: TrainConfig, parse_fn: Optional[Callable] = None,
        loss: Any = None, metrics: Optional[Sequence[Any]] = None,
        callbacks: Sequence[Any] = (), environment=None) -> dict:
  """Trains `model_fn`'s model on `dataset_fn`'s examples, distributed.

  Args:
    model_fn: returns a `keras.Model`, compiled (its loss and metrics are
      used; the optimizer comes from `config`) or not. tfdist calls it in
      the strategy's scope, with the keyword arguments it names among `spec`
      (the data set's `DatasetSpec`) and `config`. A registered name works
      too.
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
    parse_fn: maps one serialized record of `config.train_files` /
      `config.eval_files` (TFRecord; `.gz`: GZIP) to `(features, labels)`.
    loss: a Keras loss, loss function or name; overrides the model's
      compiled loss.
    metrics: Keras metrics or names; override the compiled ones.
    callbacks: Keras callbacks (see `tfdist.experiment.run_experiment`).
    environment: a `tfdist.environment.RunEnvironment`; None reads
      `os.environ` (`TF_CONFIG`, Vertex AI's variables) now.

  Returns:
    The run manifest (as `run_manifest.json` holds it) on the chief and
    every training worker, with `history`: what `keras.Model.fit`'s
    returned `History.history` holds (`{"loss": [one value per epoch],
    "val_loss": [...], <metric>: [...], ...}`, the epochs this call
    trained); `{"role": "evaluator", "results": [...]}` for
    the `eval`/`continuous_eval` modes and evaluator tasks;
    `{"role": "worker"|"ps", ...}` for parameter-server tasks.

  Raises:
    ConfigError: bad arguments or configuration, found before training
      (e.g. no loss anywhere, a model that cannot take the features).
    tfdist.preemption.PreemptedError: SIGTERM or SIGINT stopped training
      after a checkpoint (call again to resume).
  """
  task = make_task(model_fn, dataset_fn, config=config, parse_fn=parse_fn,
                   loss=loss, metrics=metrics)
  names = {"model": task.model_name}
  if not config.feature_spec:
    names["dataset"] = task.dataset.name
  import keras  # pylint: disable=g-import-not-at-top
  history = keras.callbacks.History()
  result = experiment.run_experiment(config.replace(**names),
                                     callbacks=[*callbacks, history],
                                     environment=environment, task=task)
  if isinstance(result, dict) and "role" not in result:
    result = {**result, "history": {k: [float(v) for v in values] for k, values
                                    in history.history.items()}}
  return result
