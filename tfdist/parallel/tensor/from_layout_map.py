"""A model of the user's split as a Keras `LayoutMap` says
(`tfdist.fit(model_fn, ..., layout_map=keras.distribution.LayoutMap(...))`).

`tfdist.parallel.layout_map.read_layout_map` reads the map against the
unsharded model (the one the tensor mode, `tfdist.parallel.tensor.mode.build`,
builds first on the host CPU) into a plan; `split_model` then clones that
model (`keras.models.clone_model`: the user's `model_fn` is called once,
for the unsharded model) with each layer the plan splits replaced by its
tensor-parallel twin of `tfdist.parallel.tensor.layers`, with the same
units, activation, bias, initializers, dtype policy and name:

* a `keras.layers.Dense` split by columns (kernel `(None, "model")`):
  `ColumnParallelDense`; by rows (kernel `("model", None)`):
  `RowParallelDense`;
* a `keras.layers.MultiHeadAttention` split by heads (its query, key,
  value and output projections on their heads axis):
  `ParallelMultiHeadAttention`.

Every other layer is cloned as it is (`from_config`). The tensor mode
builds the clone in the strategy's scope under `groups.split_over(T)` and
copies the unsharded model's weights into it
(`layers.load_full_weights`: the clone's weights are in the unsharded
model's order), so checkpoints and the SavedModel are the unsharded
model's.

Refusals (`tfdist.errors.ConfigError`, status 2), when the model is built,
before anything trains; each names the layer, the map entry and what is
supported:

* a subclassed model (`clone_model` rebuilds only functional and
  Sequential models), or a nested model holding a split weight;
* an `Embedding` split over `model` (by vocabulary or by columns) or an
  `EinsumDense` split: no tensor-parallel layer of tfdist takes them;
* a split Dense with regularizers, constraints, LoRA, quantization, or
  frozen (`trainable=False`), or a subclass of Dense; a column-parallel
  Dense whose activation mixes the features (`softmax`, `log_softmax`,
  `glu`, `sparsemax`: each replica holds 1/T of them);
* a split MultiHeadAttention whose arguments the parallel layer does not
  take (`attention_axes`, `sliding_window`, `use_gate`, regularizers,
  constraints, an `output_shape` of several dimensions) or called with
  `query_mask`, `value_mask`, `key_mask` or `return_attention_scores`;
* every refusal of `read_layout_map` (a split that would need a gather, a
  size T does not divide, an entry that names no variable, ...);
* a map whose `model` axis disagrees with `TrainConfig.tensor_parallel`
  (`config_changes`).

Not checked: Keras masks carried by the attention's inputs (an `Embedding`
with `mask_zero=True` before it): `ParallelMultiHeadAttention` reads only
`attention_mask` and `use_causal_mask`, so pass the mask as
`attention_mask`. A `Dropout` between a column and a row layer draws its
mask per shard, not the unsharded model's: a warning at start names it
(`dropouts_inside_pairs`).
"""

from typing import Any, Dict, List

from absl import logging
import keras

from tfdist import errors
from tfdist.parallel import layout_map as lm_lib
from tfdist.parallel.tensor import layers as tp_lib

# What `fit(layout_map=...)` splits, for the messages.
SUPPORTED = ("Dense split by columns (kernel (None, 'model')) or rows "
             "(kernel ('model', None)), and MultiHeadAttention split by heads")
# Keras activations that mix the features (a column-parallel layer applies
# its activation to each replica's units alone).
_ACROSS_FEATURES = ("softmax", "log_softmax", "glu", "sparsemax")
# MultiHeadAttention's call arguments `ParallelMultiHeadAttention` takes.
_ATTENTION_CALL_ARGUMENTS = ("query", "value", "key", "attention_mask",
                             "use_causal_mask", "training")


def _refuse(message: str):
  raise errors.ConfigError(message)


def degree(layout_map) -> int:
  """T, the size of the map's mesh axis `model`.

  Raises:
    ConfigError: not a `keras.distribution.LayoutMap`, or its mesh has no
      axis named `model`.
  """
  if not isinstance(layout_map, keras.distribution.LayoutMap):
    _refuse(f"layout_map must be a keras.distribution.LayoutMap; received "
            f"{type(layout_map).__name__}. Build one over a DeviceMesh with "
            "axis_names=['batch', 'model'].")
  return lm_lib.model_degree(layout_map)


def entries(layout_map) -> tuple:
  """The map's entries as text, `((key, layout), ...)` in its order (what
  the run's config and manifest record)."""
  return tuple((key, str(lm_lib.axes_of(layout_map[key])))
               for key in layout_map.keys())


def config_changes(config, layout_map) -> Dict[str, Any]:
  """The `TrainConfig` changes of a run split by `layout_map`:
  `tensor_parallel` T and the map's `entries`; `{}` when T is 1 (the map
  splits nothing).

  Raises:
    ConfigError: `degree`'s, or `config.tensor_parallel` is above 1 and is
      not the map's T.
  """
  t = degree(layout_map)
  given = config.strategy.parallelism.tensor_parallel
  if given > 1 and given != t:
    # In flag terms: `tfdist.fit` says them as its fields.
    _refuse(f"--tensor_parallel={given} and the layout map's 'model' axis "
            f"of size {t} disagree: the map's mesh gives T. Drop "
            f"--tensor_parallel (or set it to {t}), or build the DeviceMesh "
            f"with a 'model' axis of {given}.")
  if t == 1:
    return {}
  return {"tensor_parallel": t, "layout_map_entries": entries(layout_map)}


def _check_model(model, layout_map) -> None:
  kind = type(model).__name__
  if kind not in ("Functional", "Sequential"):
    _refuse(f"layout_map splits a functional or Sequential model; model "
            f"{model.name!r} is a subclassed keras.Model (class {kind}), "
            "which keras.models.clone_model cannot rebuild layer by layer. "
            "Build it with keras.Model(inputs, outputs) or keras.Sequential, "
            "or build it from tfdist.parallel.tensor_parallel's layers.")
  for layer in model.layers:
    if not isinstance(layer, keras.Model):
      continue
    for variable in layer.weights:
      axes = lm_lib.axes_of(layout_map[variable.path])
      if axes and lm_lib.MODEL_AXIS in axes:
        _refuse(f"The layout map splits {variable.path!r} of the nested "
                f"model {layer.name!r}: layout_map splits the layers of the "
                "outer model only. Build the model without nesting "
                f"{layer.name!r}, or leave its weights replicated.")


def _entry(plan, layer_name: str) -> str:
  for split in plan.splits.values():
    if split.layer == layer_name and split.entry is not None:
      return split.entry
  return "?"


def _check_dense(layer, kind: str, entry: str) -> None:
  where = (f"Layout map entry {entry!r} splits Dense {layer.name!r} by "
           f"{kind}s")
  if type(layer) is not keras.layers.Dense:  # pylint: disable=unidiomatic-typecheck
    _refuse(f"{where}, but {layer.name!r} is a {type(layer).__name__} "
            "(a subclass of Dense, whose own call a tensor-parallel layer "
            f"would drop). layout_map splits: {SUPPORTED}.")
  given = [name for name in ("kernel_regularizer", "bias_regularizer",
                             "activity_regularizer", "kernel_constraint",
                             "bias_constraint")
           if getattr(layer, name, None) is not None]
  if getattr(layer, "lora_enabled", False):
    given.append("lora_rank")
  if getattr(layer.dtype_policy, "quantization_mode", None):
    given.append("quantization")
  if not layer.trainable:
    given.append("trainable=False")
  activation = layer.get_config().get("activation")
  if kind == "column" and activation in _ACROSS_FEATURES:
    # Each shard would normalize over its own units only.
    given.append(f"activation={activation!r} (not elementwise: each "
                 "replica holds 1/T of the units)")
  if given:
    _refuse(f"{where}, but it has {', '.join(given)}, which the "
            "tensor-parallel Dense does not take. Remove them from "
            f"{layer.name!r}, or leave it replicated (drop the entry).")


# MultiHeadAttention's arguments `ParallelMultiHeadAttention` does not take,
# and the values it behaves as (attention over axis 1 of [batch, sequence,
# features]: what a built layer's None becomes).
_ATTENTION_DEFAULTS = {"attention_axes": (None, (1,), [1]),
                       "sliding_window": (None,), "use_gate": (False, None),
                       "kernel_regularizer": (None,),
                       "bias_regularizer": (None,),
                       "activity_regularizer": (None,),
                       "kernel_constraint": (None,), "bias_constraint": (None,)}


def _attention_output_dim(layer, entry: str):
  shape = layer.get_config().get("output_shape")
  if shape is None or isinstance(shape, int):
    return shape
  shape = tuple(shape)
  if len(shape) != 1:
    _refuse(f"Layout map entry {entry!r} splits MultiHeadAttention "
            f"{layer.name!r} by heads, but its output_shape={shape} has "
            "several dimensions; ParallelMultiHeadAttention gives one. Use "
            "an int output_shape, or leave the layer replicated.")
  return int(shape[0])


def _check_attention(layer, entry: str) -> None:
  where = (f"Layout map entry {entry!r} splits MultiHeadAttention "
           f"{layer.name!r} by heads")
  if type(layer) is not keras.layers.MultiHeadAttention:  # pylint: disable=unidiomatic-typecheck
    _refuse(f"{where}, but it is a {type(layer).__name__} (a subclass). "
            f"layout_map splits: {SUPPORTED}.")
  config = layer.get_config()
  given = [f"{name}={config[name]!r}" for name, allowed in
           _ATTENTION_DEFAULTS.items()
           if name in config and config[name] not in allowed]
  if given:
    _refuse(f"{where}, but it has {', '.join(given)}, which "
            "ParallelMultiHeadAttention does not take (it attends over the "
            "sequence axis of [batch, sequence, features] inputs, without "
            "regularizers or constraints). Leave those at their defaults, "
            "or leave the layer replicated (drop its entries).")
  _attention_output_dim(layer, entry)


def check(model, layout_map) -> lm_lib.TensorParallelPlan:
  """The plan `split_model` follows, every refusal checked (nothing is
  built).

  Args:
    model: the unsharded, built Keras model.
    layout_map: the `keras.distribution.LayoutMap`.

  Returns:
    `read_layout_map`'s plan.

  Raises:
    ConfigError: see the module docstring.
  """
  degree(layout_map)
  _check_model(model, layout_map)
  plan = lm_lib.read_layout_map(model, layout_map)
  by_name = {layer.name: layer for layer in model.layers}
  for name, kind in plan.layers.items():
    layer, entry = by_name[name], _entry(plan, name)
    layer_kind = type(layer).__name__
    if kind in ("column", "row") and layer_kind == "Dense":
      _check_dense(layer, kind, entry)
    elif kind == "heads":
      _check_attention(layer, entry)
    else:
      what = ("by vocabulary (rows of the table)" if kind == "vocabulary"
              else f"by {kind}s")
      _refuse(f"Layout map entry {entry!r} splits {layer_kind} {name!r} "
              f"{what}: tfdist has no tensor-parallel {layer_kind} yet. "
              f"layout_map splits: {SUPPORTED}. Leave {name!r} replicated "
              "(drop the entry).")
  return plan


def _parallel_layer(layer, kind: str, entry: str):
  """`layer`'s tensor-parallel twin (`kind`: column, row or heads), with
  its arguments and name."""
  config = layer.get_config()
  common = {name: config[name] for name in ("use_bias", "name", "dtype",
                                            "kernel_initializer",
                                            "bias_initializer")}
  if kind == "heads":
    return tp_lib.ParallelMultiHeadAttention(
        num_heads=config["num_heads"], key_dim=config["key_dim"],
        value_dim=config["value_dim"], dropout=config["dropout"],
        output_shape=_attention_output_dim(layer, entry), **common)
  cls = (tp_lib.ColumnParallelDense if kind == "column" else
         tp_lib.RowParallelDense)
  return cls(units=config["units"], activation=config["activation"],
             **common)


def _call_attention(layer, *args, **kwargs):
  """`clone_model`'s call of each cloned layer: refuses call arguments a
  split attention does not take."""
  if isinstance(layer, tp_lib.ParallelMultiHeadAttention):
    given = [name for name, value in kwargs.items()
             if name not in _ATTENTION_CALL_ARGUMENTS and
             value not in (None, False)]
    if given:
      _refuse(f"MultiHeadAttention {layer.name!r} is split by heads, and "
              f"the model calls it with {', '.join(given)}, which "
              "ParallelMultiHeadAttention does not take (it takes query, "
              "value, key, attention_mask and use_causal_mask). Pass the "
              "mask as attention_mask, or leave the layer replicated.")
  return layer(*args, **kwargs)


def dropouts_inside_pairs(model, plan) -> List[str]:
  """The `Dropout` layers (rate > 0) between a column- and a row-parallel
  layer of `plan`'s pairs: each replica draws the mask of its 1/T of the
  units from the same random stream, so the shards share one pattern and
  the run is not one device's."""
  consumers = lm_lib.layer_consumers(model)
  by_name = {layer.name: layer for layer in model.layers}
  found = set()
  for column, row in plan.pairs:
    frontier = [] if column == row else list(consumers.get(column, ()))
    while frontier:
      name = frontier.pop()
      if name is None or name == row:
        continue
      layer = by_name[name]
      if isinstance(layer, keras.layers.Dropout) and layer.rate > 0:
        found.add(name)
      frontier.extend(consumers.get(name, ()))
  return sorted(found)


def split_model(model, layout_map, tensor: int, *,
                parallel_layer=None) -> keras.Model:
  """`model` cloned with the layers the map splits made tensor-parallel.

  Call in the strategy's scope under `groups.split_over(tensor)` (the
  parallel layers take T from it when they are built); then copy the
  unsharded weights in (`layers.load_full_weights(clone,
  model.get_weights())`: the clone lists its weights in `model`'s order).

  Args:
    model: the unsharded, built model (functional or Sequential).
    layout_map: the `keras.distribution.LayoutMap`.
    tensor: T, the run's `tensor_parallel`.
    parallel_layer: `parallel_layer(layer, kind, entry)` -> the split
      twin of `layer` (`kind`: column, row or heads; `entry`: the map's
      entry, for messages). Defaults to this module's replica layers
      (`tfdist.parallel.tensor.layers`); a pipeline's stages give theirs
      (`tfdist.parallel.pipeline.tensor`).

  Returns:
    The clone (compiled as `model` was, without an optimizer: the trainer
    brings its own).

  Raises:
    ConfigError: `check`'s refusals, or the map's `model` axis is not T.
  """
  plan = check(model, layout_map)
  if plan.degree != tensor:
    _refuse(f"The layout map's 'model' axis has size {plan.degree}; the run "
            f"splits its model {tensor} ways (tensor_parallel={tensor}). "
            "Give one T.")

  # A pipeline stage's split layers gather the column layer's units on
  # the stage's device, where a dropout draws one device's mask.
  inside = dropouts_inside_pairs(model, plan) if parallel_layer is None else []
  if inside:
    logging.warning(
        "Dropout %s lies between a column- and a row-parallel layer: each "
        "of the %d replicas draws the mask of its share of the units from "
        "the same random stream, so the run differs from one device's "
        "(it still trains). Put the dropout after the row-parallel layer "
        "to get one device's run.", ", ".join(map(repr, inside)), tensor)

  def clone(layer):
    kind = plan.layers.get(layer.name)
    if kind is None:
      return layer.__class__.from_config(layer.get_config())
    return (parallel_layer or _parallel_layer)(layer, kind,
                                               _entry(plan, layer.name))

  extra = {} if isinstance(model, keras.Sequential) else {
      "call_function": _call_attention}
  split = keras.models.clone_model(model, clone_function=clone, **extra)
  if getattr(split, "optimizer", None) is not None:
    # clone_model compiles the clone as `model` was (its loss and
    # metrics), with a new optimizer that tfdist does not use; untracked
    # as `tfdist.training.assembly.build_model` leaves the unsharded one.
    del split.optimizer
    split.optimizer = None
  return split
