"""The loss and metrics of a run: from arguments, `compile`, or the data set.

tfdist's loop takes one Keras loss and any Keras metrics, from the first of:

1. `tfdist.fit(..., loss=..., metrics=...)`;
2. the model's own `compile(loss=..., metrics=...)` (a builder may return a
   compiled model: its loss and metrics are used, its optimizer is not:
   tfdist builds the optimizer from the config, scaled to the batch);
3. the data set's `DatasetSpec.loss` / `metrics`;
4. the data set's `task` (`TASKS`: `multiclass`, `binary`).

Identifiers are resolved as Keras's `compile` resolves them
(`keras/src/trainers/compile_utils.py`, `get_metric` and `get_loss`):
`"accuracy"`/`"acc"` becomes binary, sparse categorical or categorical
accuracy from the label and output shapes, `"crossentropy"`/`"ce"` likewise;
other strings and functions go through `keras.losses.get` /
`keras.metrics.get`, functions are wrapped (`LossFunctionWrapper`,
`MeanMetricWrapper`), and a string keeps its spelling as the metric's name.

**Why sums are enough under every strategy.** Keras metrics keep their
state in variables aggregated by `sum` (`Metric.add_variable(...,
aggregation="sum")`): the state of a metric over many batches is the sum of
its states over each batch. tfdist's step therefore computes each metric's
state for its replica's batch (statelessly, from the initial state), the
strategy sums the states over replicas and workers, the controller sums
them over steps, and `Metric.stateless_result` turns the sum into the
value: the same value one device would compute on all the data. A metric
with a variable that is not summed is refused with its name.
"""

import dataclasses
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from tfdist import errors

# Default losses and metrics by `DatasetSpec.task`.
TASKS = ("multiclass", "binary")
# ROC AUC thresholds of the binary task's default `auc` metric (within
# about 1/1000 of the exact area).
AUC_THRESHOLDS = 1001


def task_defaults(task: str) -> Tuple[keras.losses.Loss, List]:
  """`(loss, metrics)` for a data set's `task`.

  Raises:
    ValueError: unknown `task`.
  """
  if task == "multiclass":
    return (keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            [keras.metrics.SparseCategoricalAccuracy(name="accuracy")])
  if task == "binary":
    return (keras.losses.BinaryCrossentropy(),
            [keras.metrics.BinaryAccuracy(name="accuracy", threshold=0.5),
             keras.metrics.AUC(name="auc", num_thresholds=AUC_THRESHOLDS)])
  raise ValueError(f"task must be one of {TASKS}. Received: task={task!r}")


def compiled_loss_and_metrics(model: keras.Model) -> Tuple[Any, Any, Any]:
  """`(loss, metrics, weighted_metrics)` the model was compiled with (None,
  None, None if not).

  The objects given to `compile` are read as given (Keras keeps them in
  its compile config); without that, from `get_compile_config()`.
  """
  if not getattr(model, "compiled", False):
    return None, None, None
  raw = getattr(getattr(model, "_compile_config", None), "config", None)
  if raw is None:
    raw = model.get_compile_config() or {}
    raw = {"loss": keras.losses.deserialize(raw["loss"]) if raw.get("loss")
                   else None,
           "metrics": [keras.metrics.deserialize(m) if isinstance(m, dict)
                       else m for m in raw.get("metrics") or []],
           "weighted_metrics": [keras.metrics.deserialize(m)
                                if isinstance(m, dict) else m
                                for m in raw.get("weighted_metrics") or []]}
  return (raw.get("loss") or getattr(model, "loss", None),
          list(_as_list(raw.get("metrics"))),
          list(_as_list(raw.get("weighted_metrics"))))


def _as_list(value) -> Sequence:
  if value is None:
    return ()
  if isinstance(value, dict):
    raise errors.ConfigError(
        "Metrics per output (a dict) are not supported: tfdist trains models "
        "with one output. Pass a list of metrics.")
  return value if isinstance(value, (list, tuple)) else (value,)


def _binary_or_sparse(y_true: tf.TensorShape, y_pred: tf.TensorShape):
  """Keras's `is_binary_or_sparse_categorical` (compile_utils.py)."""
  is_binary = y_pred[-1] == 1 if y_pred.rank else False
  is_sparse = (y_true.rank < y_pred.rank or
               (y_true.rank and y_true[-1] == 1 and y_pred[-1] > 1))
  return is_binary, bool(is_sparse)


# How Keras's `fit` turns a loss's values into the loss it differentiates
# (`keras.losses.Loss.reduction`, after `compile`'s wrapping), as tfdist
# applies it over the global batch (`loss_values`, and
# `tfdist.training.step.train_loop.Trainer`):
#   "sum_over_batch_size": sum(weight x loss) / examples in the global batch
#     (also Keras's "mean"); the loss reported is that value.
#   "sum": sum(weight x loss) over the global batch, reported as is.
#   "none": the loss's values are not reduced (`reduction=None`): fit's
#     gradient is that of their sum (`GradientTape.gradient` sums a
#     non-scalar target), and the loss it reports is their mean.
#   "mean_with_sample_weight": sum(weight x loss) / sum(weight); without
#     sample or class weights, "sum_over_batch_size" (tfdist refuses it
#     with weights: `check_reduction`).
REDUCTIONS = ("sum_over_batch_size", "sum", "none", "mean_with_sample_weight")
_FIT_REDUCTION = {None: "none", "none": "none", "mean": "sum_over_batch_size",
                  "sum_over_batch_size": "sum_over_batch_size", "sum": "sum",
                  "mean_with_sample_weight": "mean_with_sample_weight"}


def _scope_name(name: str) -> str:
  """`name` made a valid TensorFlow name scope (Keras opens one named after
  the loss): a function's `__name__` such as `<lambda>` becomes `lambda`."""
  name = re.sub(r"[^A-Za-z0-9_.\-]", "_", str(name)).strip("_")
  return name if name and name[0].isalnum() else "loss"


class FunctionLoss(keras.losses.Loss):
  """A loss function `fn(y_true, y_pred) -> losses` as a Keras `Loss` with
  one value per example (`reduction=None`), labels brought to the
  prediction's rank first as Keras's own wrapper does ([batch] against
  [batch, 1]). A function returning one value for the whole batch (a
  scalar) is handled by `loss_values`.

  Attributes:
    fit_reduction: how `fit` reduces the values (`REDUCTIONS`): a function
      given to `compile` is reduced as `"sum_over_batch_size"`.
  """

  def __init__(self, fn, name: str = "loss"):
    super().__init__(name=_scope_name(name), reduction=None)
    self.fn = fn
    self.fit_reduction = "sum_over_batch_size"

  def call(self, y_true, y_pred):
    true_rank, pred_rank = len(y_true.shape), len(y_pred.shape)
    if pred_rank == true_rank + 1 and y_pred.shape[-1] == 1:
      y_true = keras.ops.expand_dims(y_true, -1)
    elif true_rank == pred_rank + 1 and y_true.shape[-1] == 1:
      y_true = keras.ops.squeeze(y_true, -1)
    return self.fn(y_true, y_pred)


class PerExampleLoss(keras.losses.Loss):
  """A Keras `Loss` whose values are not reduced: `loss.call` (its values
  per element, before the reduction `Loss.__call__` applies), with the
  wrapped loss's name and dtype, and `reduction=None`.

  Attributes:
    inner: the wrapped loss.
    fit_reduction: how `fit` reduces the wrapped loss's values
      (`REDUCTIONS`), from its `reduction`.
  """

  def __init__(self, loss: keras.losses.Loss):
    super().__init__(name=_scope_name(loss.name), reduction=None,
                     dtype=loss.dtype)
    self.inner = loss
    self.fit_reduction = _FIT_REDUCTION[loss.reduction]

  def call(self, y_true, y_pred):
    return self.inner.call(y_true, y_pred)


def fit_reduction(loss: keras.losses.Loss) -> str:
  """How `fit` reduces `loss`'s values (`REDUCTIONS`): a loss made by
  `resolve_loss` says; any other is taken as per-example values reduced by
  `"sum_over_batch_size"`."""
  return getattr(loss, "fit_reduction", "sum_over_batch_size")


def loss_values(loss: keras.losses.Loss, y_true, y_pred
                ) -> Tuple[tf.Tensor, tf.Tensor, str]:
  """One batch's loss values as the step reduces them (tf.function-safe).

  Args:
    loss: a loss from `resolve_loss` (`reduction=None`).
    y_true, y_pred: the batch's labels and float32 outputs [batch, ...].

  Returns:
    `(values, elements, reduction)`: `values` float32 [batch], each
    example's loss (its values over trailing axes averaged); `elements`
    float32 scalar, the values per example (the product of the trailing
    axes: 1 for one value per example), so that `values * elements` sums
    them; `reduction`, the `REDUCTIONS` entry to apply. A loss that returns
    one value for the whole batch (a scalar, e.g.
    `lambda y, p: tf.reduce_mean(tf.square(y - p))`) is the batch's loss,
    as in `fit`: every example gets that value and the reduction is
    `"sum_over_batch_size"`, so the batch's loss is the value itself (times
    the mean sample weight, as `fit` weighs it), and under N replicas each
    replica's value weighs 1/N (its share of the global batch).
  """
  values = tf.cast(loss(y_true, y_pred), tf.float32)
  if values.shape.rank == 0:
    return (tf.fill(tf.shape(y_pred)[:1], values), tf.constant(1.0),
            "sum_over_batch_size")
  elements = tf.constant(1.0)
  if values.shape.rank and values.shape.rank > 1:
    axes = list(range(1, values.shape.rank))
    elements = tf.cast(tf.reduce_prod(tf.shape(values)[1:]), tf.float32)
    values = tf.reduce_mean(values, axis=axes)
  return values, elements, fit_reduction(loss)


def check_reduction(loss: keras.losses.Loss, *, weighted: bool,
                    what: str = "The loss") -> None:
  """Refuses `reduction="mean_with_sample_weight"` when the examples carry
  sample or class weights (`weighted`): its divisor, the global batch's
  sum of weights, is not known to a replica before the step.

  Raises:
    ConfigError: that reduction with weights.
  """
  if weighted and fit_reduction(loss) == "mean_with_sample_weight":
    raise errors.ConfigError(
        f"{what} {loss.name!r} has reduction='mean_with_sample_weight' and "
        "the examples carry sample or class weights: tfdist does not divide "
        "by the global batch's sum of weights. Use "
        "reduction='sum_over_batch_size' (the default), or 'sum' and "
        "normalize the weights in the data.")


def resolve_loss(identifier, *, y_true: tf.TensorShape,
                 y_pred: tf.TensorShape) -> keras.losses.Loss:
  """A Keras `Loss` returning the loss's values unreduced
  (`reduction=None`), with `fit_reduction` saying how `fit` reduces them.

  Args:
    identifier: a `keras.losses.Loss` (any `reduction` of `REDUCTIONS`),
      a loss function `fn(y_true, y_pred) -> per-example losses` (or one
      value for the batch, see `loss_values`), or a name (`"mse"`,
      `"binary_crossentropy"`, `"crossentropy"`, ...).
    y_true, y_pred: batched shapes of the labels and the model's output.

  Raises:
    ConfigError: an unknown name, or losses per output (dict/list).
  """
  if isinstance(identifier, (FunctionLoss, PerExampleLoss)):
    return identifier  # Resolved already.
  if isinstance(identifier, (dict, list, tuple)):
    raise errors.ConfigError(
        "Losses per output (a dict or list) are not supported: tfdist "
        "trains models with one output and one loss. Combine them in one "
        "custom loss function.")
  if isinstance(identifier, str) and identifier.lower() in ("crossentropy",
                                                             "ce"):
    is_binary, is_sparse = _binary_or_sparse(y_true, y_pred)
    identifier = ("binary_crossentropy" if is_binary else
                  "sparse_categorical_crossentropy" if is_sparse else
                  "categorical_crossentropy")
  if isinstance(identifier, str):
    try:
      loss = keras.losses.get(identifier)
    except ValueError:
      raise errors.ConfigError(
          f"loss={identifier!r} is not a Keras loss name (see "
          "keras.losses).") from None
  else:
    loss = identifier
  if isinstance(loss, keras.losses.Loss):
    return PerExampleLoss(loss)
  if callable(loss):
    name = identifier if isinstance(identifier, str) else getattr(
        loss, "__name__", "loss")
    return FunctionLoss(loss, name=name)
  raise errors.ConfigError(
      f"loss={identifier!r} is neither a Keras loss, a loss "
      "function nor a loss name.")


def resolve_metric(identifier, *, y_true: tf.TensorShape,
                   y_pred: tf.TensorShape) -> keras.metrics.Metric:
  """A Keras `Metric` for `identifier`, as `compile` resolves it.

  Raises:
    ConfigError: an unknown name.
  """
  if isinstance(identifier, keras.metrics.Metric):
    return identifier
  if isinstance(identifier, str) and identifier.lower() in ("accuracy",
                                                             "acc"):
    is_binary, is_sparse = _binary_or_sparse(y_true, y_pred)
    cls = (keras.metrics.BinaryAccuracy if is_binary else
           keras.metrics.SparseCategoricalAccuracy if is_sparse else
           keras.metrics.CategoricalAccuracy)
    return cls(name=identifier)
  try:
    metric = keras.metrics.get(identifier)
  except ValueError:
    raise errors.ConfigError(
        f"metric {identifier!r} is not a Keras metric name "
        "(see keras.metrics).") from None
  if not isinstance(metric, keras.metrics.Metric):
    metric = keras.metrics.MeanMetricWrapper(
        metric, name=getattr(metric, "__name__", "metric"))
  if isinstance(identifier, str):
    metric.name = identifier
  return metric


@dataclasses.dataclass(frozen=True)
class Objectives:
  """The resolved loss and metrics of a run.

  Attributes:
    loss: a Keras `Loss` with `reduction=None` (unreduced values) and a
      `fit_reduction` (`resolve_loss`).
    metrics: Keras `Metric`s, names unique.
    source: where they came from (`arguments`, `compile`, `dataset`, or
      `task <name>`), for the log.
    weighted: for each of `metrics`, whether it takes the examples' sample
      (and class) weights: True for `compile(weighted_metrics=...)`, False
      for `compile(metrics=...)` and every other source, as in Keras's
      `Model.fit`. Empty: none weighted.
  """
  loss: keras.losses.Loss
  metrics: Tuple[keras.metrics.Metric, ...]
  source: str
  weighted: Tuple[bool, ...] = ()

  @property
  def metric_names(self) -> Tuple[str, ...]:
    return tuple(m.name for m in self.metrics)


def resolve(*, loss=None, metrics=None, model: Optional[keras.Model] = None,
            dataset=None, y_true: tf.TensorShape = tf.TensorShape([None]),
            y_pred: tf.TensorShape = tf.TensorShape([None, None]),
            what: str = "the model") -> Objectives:
  """Chooses and resolves the loss and metrics (see the module docstring).

  Args:
    loss, metrics: given by the caller (None: not given).
    model: the built model (its `compile` arguments count).
    dataset: the run's `DatasetSpec` (its `loss`, `metrics`, `task`).
    y_true, y_pred: batched shapes of the labels and the model's output
      (for `"accuracy"` and `"crossentropy"`).
    what: how messages name the model (e.g. `--model=cnn`).

  Raises:
    ConfigError: no loss from anywhere; unknown names.
  """
  compiled_loss, compiled_metrics, compiled_weighted = (
      compiled_loss_and_metrics(model) if model is not None
      else (None, None, None))
  task = getattr(dataset, "task", None)
  if loss is not None:
    source = "arguments"
  elif compiled_loss is not None:
    source, loss = "compile", compiled_loss
  elif getattr(dataset, "loss", None) is not None:
    source, loss = "dataset", dataset.loss
  elif task:
    source, loss = f"task {task}", task_defaults(task)[0]
  else:
    raise errors.ConfigError(
        f"{what} has no loss: compile it (model.compile(loss=..., "
        "metrics=[...]) in the builder), pass loss= to tfdist.fit, or use a "
        f"data set that gives one (--dataset={getattr(dataset, 'name', '?')}"
        " has none).")
  weighted_metrics = []
  if metrics is None:
    if compiled_loss is not None or compiled_metrics or compiled_weighted:
      metrics = compiled_metrics or []
      weighted_metrics = compiled_weighted or []
    elif getattr(dataset, "metrics", None) is not None:
      metrics = dataset.metrics
    elif task:
      metrics = task_defaults(task)[1]
    else:
      metrics = []
  resolved = [resolve_metric(m, y_true=y_true, y_pred=y_pred)
              for m in list(_as_list(metrics)) + list(weighted_metrics)]
  weighted = tuple(i >= len(resolved) - len(weighted_metrics)
                   for i in range(len(resolved)))
  seen = {"loss", "num_examples", "step"}
  for metric, is_weighted in zip(resolved, weighted):
    if is_weighted and metric.name in seen:
      # Keras's name for a weighted metric that an unweighted one already
      # names (compile_utils.CompileMetrics.result).
      metric.name = f"weighted_{metric.name}"
    base, i = metric.name, 1
    while metric.name in seen:
      metric.name = f"{base}_{i}"
      i += 1
    seen.add(metric.name)
  return Objectives(loss=resolve_loss(loss, y_true=y_true, y_pred=y_pred),
                    metrics=tuple(resolved), source=source,
                    weighted=weighted)


def output_shape(model: keras.Model, features_spec) -> tf.TensorShape:
  """The model's batched output shape for inputs of `features_spec`
  (unbatched `tf.TensorSpec`s, possibly nested), computed symbolically."""
  outputs = getattr(model, "outputs", None)
  if outputs and len(outputs) == 1 and outputs[0].shape is not None:
    return tf.TensorShape(outputs[0].shape)
  inputs = tf.nest.map_structure(
      lambda s: keras.KerasTensor((1,) + tuple(s.shape), dtype=s.dtype.name),
      features_spec)
  out = model.compute_output_spec(inputs)
  if isinstance(out, (list, tuple, dict)):
    raise errors.ConfigError(
        "The model has several outputs; tfdist trains models with one "
        "output and one loss.")
  return tf.TensorShape(out.shape)


def batch_valued_metrics(metrics: Sequence[keras.metrics.Metric], *,
                         y_true: tf.TensorSpec, y_pred: tf.TensorSpec
                         ) -> List[str]:
  """Names of the metrics whose function gives one value per batch.

  A metric function (wrapped in `keras.metrics.MeanMetricWrapper`, as
  `compile` wraps functions) that returns a scalar for the whole batch,
  e.g. `max(y_pred) - min(y_pred)`, is averaged over batches: under N
  replicas (or K accumulated micro-batches) tfdist's batches are the
  per-replica ones, so its value depends on the replica count, unlike a
  function returning one value per example (every built-in one), whose
  state sums exactly. Found by tracing each function on batches of the
  `y_true` / `y_pred` specs (batch dimension unknown).
  """
  names = []
  for metric in metrics:
    fn = getattr(metric, "_fn", None)
    if not isinstance(metric, keras.metrics.MeanMetricWrapper) or fn is None:
      continue
    try:
      out = tf.function(lambda t, p, fn=fn: fn(t, p)).get_concrete_function(
          tf.TensorSpec([None] + list(y_true.shape[1:]), y_true.dtype),
          tf.TensorSpec([None] + list(y_pred.shape[1:]), y_pred.dtype)
      ).structured_outputs
    except Exception:  # pylint: disable=broad-except
      continue  # Not traceable alone: left to the step, which traces it.
    if getattr(out, "shape", None) is not None and out.shape.rank == 0:
      names.append(metric.name)
  return names


def batch_valued_loss(loss: keras.losses.Loss, *, y_true: tf.TensorSpec,
                      y_pred: tf.TensorSpec) -> bool:
  """Whether `loss` (from `resolve_loss`) gives one value for the whole
  batch (a scalar), e.g. `lambda y, p: tf.reduce_mean(tf.square(y - p))`:
  `loss_values` then takes that value as the batch's loss, as `fit` does.
  Found by tracing it on batches of the `y_true` / `y_pred` specs (batch
  dimension unknown); False when it cannot be traced alone."""
  try:
    out = tf.function(lambda t, p: loss(t, p)).get_concrete_function(
        tf.TensorSpec([None] + list(y_true.shape[1:]), y_true.dtype),
        tf.TensorSpec([None] + list(y_pred.shape[1:]), y_pred.dtype)
    ).structured_outputs
  except Exception:  # pylint: disable=broad-except
    return False  # Not traceable alone: the step handles it when traced.
  return getattr(out, "shape", None) is not None and out.shape.rank == 0


# --- metric state as sums ---------------------------------------------------
class MetricSums:
  """Keras metrics computed from summed state (see the module docstring).

  Args:
    metrics: Keras `Metric`s. Those that size their state from their first
      batch (`AUC(multi_label=True)`, `F1Score`, `R2Score`) are built here
      with a zero batch of the `y_true`/`y_pred` shapes, then reset.
    y_true, y_pred: `tf.TensorSpec`s of one batch of labels and outputs
      (batch dimension included, any size), for building.
    weighted: for each metric, whether `batch_sums` gives it the sample
      weights (`Objectives.weighted`); empty or None: none is weighted.

  Raises:
    ConfigError: a metric variable aggregated otherwise than by sum; a
      metric to build without `y_true` and `y_pred`.
  """

  PREFIX = "metric/"

  def __init__(self, metrics: Sequence[keras.metrics.Metric], *,
               y_true: Optional[tf.TensorSpec] = None,
               y_pred: Optional[tf.TensorSpec] = None,
               weighted: Optional[Sequence[bool]] = None):
    self.metrics = tuple(metrics)
    self.y_true, self.y_pred = y_true, y_pred
    self.weighted = tuple(bool(w) for w in weighted or ())
    if self.weighted and len(self.weighted) != len(self.metrics):
      raise ValueError(f"weighted has {len(self.weighted)} entries for "
                       f"{len(self.metrics)} metrics.")
    self.weighted = self.weighted or (False,) * len(self.metrics)
    for metric in self.metrics:
      if getattr(metric, "_built", True) is False:
        if y_true is None or y_pred is None:
          raise errors.ConfigError(
              f"Metric {metric.name!r} sizes its state from its first batch:"
              " give MetricSums the y_true and y_pred specs to build it with "
              "(tfdist.training.assembly does), or build it first.")
        _build(metric, y_true, y_pred)
      for variable in metric.variables:
        aggregation = str(getattr(variable, "aggregation", "sum")).lower()
        if "sum" not in aggregation:
          raise errors.ConfigError(
              f"Metric {metric.name!r} keeps its variable {variable.name!r} "
              f"with aggregation={aggregation!r}: tfdist sums metric state "
              "over replicas and workers, which only works for states "
              "aggregated by sum (every built-in Keras metric's).")
    # The state each metric starts from (constant: the step is stateless).
    self.initial = [[np.array(keras.ops.convert_to_numpy(v)) for v in
                     m.variables] for m in self.metrics]

  def _key(self, i: int, j: int) -> str:
    return f"{self.PREFIX}{i}/{j}"

  # Plain TensorFlow ops, no Python control flow on tensors: called as is
  # inside the step's tf.function, not converted by AutoGraph.
  @tf.autograph.experimental.do_not_convert
  def zeros(self) -> Dict[str, tf.Tensor]:
    """Zero sums (the totals a chunk of steps starts from)."""
    return {self._key(i, j): tf.zeros(v.shape, v.dtype)
            for i, state in enumerate(self.initial)
            for j, v in enumerate(state)}

  @tf.autograph.experimental.do_not_convert
  def batch_sums(self, y_true, y_pred, mask=None, sample_weight=None
                 ) -> Dict[str, tf.Tensor]:
    """Each metric's state contribution from one batch (tf.function-safe):
    the state after updating the initial state with this batch, minus the
    initial state.

    Args:
      y_true, y_pred: the batch's labels and outputs.
      mask: float32 [batch], 1 for real examples and 0 for padding, or
        None; every metric is weighted by it.
      sample_weight: float32 [batch], the examples' sample (or class)
        weights, or None; only the weighted metrics take them (times
        `mask`), as `compile(weighted_metrics=...)` does in Keras.
    """
    out = {}
    weighted_mask = (mask if sample_weight is None else sample_weight
                     if mask is None else sample_weight * mask)
    for i, (metric, state) in enumerate(zip(self.metrics, self.initial)):
      start = [tf.constant(v) for v in state]
      new = metric.stateless_update_state(
          start, y_true, y_pred,
          sample_weight=weighted_mask if self.weighted[i] else mask)
      for j, (value, begin) in enumerate(zip(new, start)):
        out[self._key(i, j)] = tf.convert_to_tensor(value) - begin
    return out

  def results(self, sums: Dict[str, Any]) -> Dict[str, float]:
    """`{metric name: value}` from summed contributions (host side).

    Keys missing from `sums` count as zero; a metric returning a vector
    (e.g. `F1Score(average=None)`) gives its mean.
    """
    out = {}
    for i, (metric, state) in enumerate(zip(self.metrics, self.initial)):
      total = [tf.constant(np.asarray(begin) + np.asarray(
          sums.get(self._key(i, j), 0.0), begin.dtype))
               for j, begin in enumerate(state)]
      value = metric.stateless_result(total)
      if isinstance(value, dict):
        for key, v in value.items():
          out[f"{metric.name}/{key}"] = float(np.mean(
              keras.ops.convert_to_numpy(v)))
      else:
        out[metric.name] = float(np.mean(keras.ops.convert_to_numpy(value)))
    return out


def _build(metric: keras.metrics.Metric, y_true: tf.TensorSpec,
           y_pred: tf.TensorSpec):
  """Builds a metric whose state is sized by its first batch, then resets."""
  def zeros(spec):
    shape = [1 if d is None else d for d in spec.shape]
    return tf.zeros(shape, spec.dtype)

  with tf.init_scope():
    metric.update_state(zeros(y_true), zeros(y_pred))
    metric.reset_state()
