"""Every private Keras and TensorFlow name tfdist reads, sets or overrides.

Keras and TensorFlow keep no promise about their private names (a leading
underscore, `tensorflow.python.*`, `keras.src.*`, `tf.__internal__`): an
upgrade may rename or drop one, and code that reads it with a default, or
sets it on an object that no longer looks at it, goes on silently wrong.
tfdist's uses of them are fenced here:

* `USES` lists each one: the owner (a module, or `module:Class`, importable
  on every supported version), the name, how tfdist uses it (`read`, `set`,
  `call`, `override`, `import`), what for, the files that do so, and for
  a call or an override the parameters tfdist relies on. `CHECKED_ON` gives the TensorFlow/Keras pairs the list was checked on.
* `tests/private_api_test.py` (marked `compat`, so it also runs on the
  oldest supported TensorFlow) fails when a listed name disappears from its
  owner in the installed TensorFlow/Keras or no longer takes the listed
  parameters (`missing(use)`), and when a file
  of `tfdist/` or `models/` uses a private Keras/TensorFlow name this list
  does not hold, or names a file that no longer uses it.
* Some uses go through the accessors below (`flatten_layers`, which every
  layer walk calls, and `ZERO3_VARIABLE_OVERRIDES`), so the list and the
  code cannot drift; deep patches (ZeRO stage 3's released variables, the pipeline's deferred
  variables) stay where they are and are listed with their file.

A private name tfdist defines itself but reads on another object or keeps
in a string (for example `_full_value` of tfdist/parallel/tensor/layers.py)
is in `TFDIST_OWN`.

Standard library only: TensorFlow is imported only by `missing` and by the
accessors, when called.
"""

import dataclasses
import importlib
import inspect
from typing import Iterable, Optional, Tuple

# The TensorFlow and Keras versions this list was checked on (the test ran
# in both environments): the newest and the oldest supported.
CHECKED_ON = (("2.21.0", "3.15.1"), ("2.17.1", "3.12.4"))

ACCESSES = ("read", "set", "call", "override", "import")


@dataclasses.dataclass(frozen=True)
class PrivateUse:
  """One private Keras/TensorFlow name tfdist relies on.

  Attributes:
    owner: where the name lives: a module (`absl.logging`) or a class
      (`keras.src.layers.layer:Layer`), importable on every version of
      `CHECKED_ON`.
    name: the attribute on `owner` (a module's member for `import`).
    access: how tfdist uses it, one of `ACCESSES`.
    purpose: what tfdist uses it for.
    where: the files (relative to the repository root) that use it.
    params: for a `call` or an `override`, the parameters tfdist relies
      on (`self` left out): a call passes them (each must be one of the
      callable's parameters), an override takes exactly them (the owner's
      method must have these and no others, as its callers pass them).
      None where the signature is not checked (`*args, **kwargs`, a
      protobuf class).
  """
  owner: str
  name: str
  access: str
  purpose: str
  where: Tuple[str, ...]
  params: Optional[Tuple[str, ...]] = None


_VARIABLE = "keras.src.backend.tensorflow.core:Variable"
_LAYER = "keras.src.layers.layer:Layer"
_MODEL = "keras.src.models.model:Model"
_OPTIMIZER = "keras.src.optimizers.base_optimizer:BaseOptimizer"
_TF_OPTIMIZER = "keras.src.backend.tensorflow.optimizer:TFOptimizer"
_LOSS_SCALE = "keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer"
_TRACKABLE = "tensorflow.python.trackable.base:Trackable"
_ZERO3 = "tfdist/parallel/zero3/optimizer.py"
_STAGES = "tfdist/parallel/pipeline/stages.py"
_SHARDED_OPTIMIZER = "tfdist/parallel/data/sharded_optimizer.py"
_HERE = "tfdist/runtime/private_api.py"

USES = (
    # ---- Keras variables: ZeRO stage 3 and the pipeline swap storage ----
    PrivateUse(_VARIABLE, "_value", "set",
               "the tf.Variable behind a Keras variable: stage 3 drops it "
               "when it releases a sharded weight; the pipeline puts the "
               "stage's variable (on its device) there",
               (_ZERO3, _STAGES)),
    PrivateUse(_VARIABLE, "_initializer", "set",
               "stage 3: a released weight's deferred initializer (raises "
               "if read) and cleared when the weight is materialized again",
               (_ZERO3,)),
    PrivateUse(_VARIABLE, "_initialize", "call",
               "stage 3: gives a released weight storage again "
               "(materialize) with its gathered value", (_ZERO3,),
               params=("value",)),
    PrivateUse(_VARIABLE, "_shared_name", "read",
               "stage 3: the name TensorFlow records for a released "
               "weight's name-based restore", (_ZERO3,)),
    PrivateUse(_VARIABLE, "_direct_assign", "set",
               "stage 3: `variable.assign` outside a step writes the shards "
               "(replaced per instance; Keras's `assign` calls it with "
               "the value)", (_ZERO3, _HERE), params=("value",)),
    PrivateUse("tensorflow.python.training.saving.saveable_object_util",
               "_save_slice_info", "set",
               "stage 3: TensorFlow's savers read a variable's "
               "`_save_slice_info.full_name` for its checkpoint key; set on "
               "a released weight", (_ZERO3, _HERE)),
    PrivateUse("keras.src.backend.common.variables:Variable", "_autocast",
               "read", "stage 3: which weights mixed precision autocasts",
               (_ZERO3,)),
    PrivateUse("tensorflow.python.ops.resource_variable_ops",
               "UninitializedVariable", "import",
               "the pipeline's deferred variables: a placeholder with no "
               "storage until its stage's device is known", (_STAGES,)),
    PrivateUse("tensorflow.python.ops.resource_variable_ops",
               "ResourceVariable", "import",
               "collectives: a token variable placed on one device",
               ("tfdist/parallel/collectives.py",)),
    # ---- Keras layers and models ----
    PrivateUse(_LAYER, "_flatten_layers", "call",
               "every sublayer of a model (nested ones included): seeds, "
               "moving statistics, manifests, sharding, the experts' and "
               "recomputation's layers; every caller goes through "
               "`flatten_layers`", (_HERE,),
               params=("include_self", "recursive")),
    PrivateUse(_LAYER, "_seed_generators", "read",
               "a layer's SeedGenerators (dropout): reseeded per replica or "
               "per shard, copied into a pipeline x tensor split clone, and "
               "kept out of recomputed segments",
               ("models/recompute.py", "tfdist/parallel/pipeline/tensor.py",
                "tfdist/parallel/tensor/mode.py",
                "tfdist/training/step/train_loop.py")),
    PrivateUse(_LAYER, "_trainable_variables", "read",
               "stage 3: a layer's own trainable weights (not its "
               "sublayers')", (_ZERO3,)),
    PrivateUse(_LAYER, "_layers", "read",
               "the direct sublayers of a layer, to find ShardedEmbedding "
               "layers", ("tfdist/distribute/sharded_embedding.py",)),
    PrivateUse(_LAYER, "_call_context_args", "read",
               "whether a layer's call takes `training` (a cut model's "
               "pieces are called with it)", ("tfdist/parallel/cutting.py",)),
    PrivateUse("keras.src.layers.normalization.batch_normalization:"
               "BatchNormalization", "_moments", "override",
               "models.batch_norm: packed synchronized moments (one "
               "all-reduce)", ("models/batch_norm.py",),
               params=("inputs", "mask")),
    PrivateUse("keras.src.layers.normalization.batch_normalization:"
               "BatchNormalization", "_reduction_axes", "read",
               "models.batch_norm: the axes Keras's build chose to reduce "
               "over (the packed moments reduce over the same)",
               ("models/batch_norm.py",)),
    PrivateUse(_LAYER, "_track_variable", "call",
               "MixtureOfExperts: a weight created outside `add_weight` "
               "(the experts' stacked kernels) tracked as the layer's",
               ("tfdist/parallel/experts/layer.py",), params=("variable",)),
    PrivateUse("keras.src.models.functional:Functional", "_nodes_by_depth",
               "read", "pipeline cutting: a functional model's graph in "
               "topological order", ("tfdist/parallel/cutting.py",)),
    PrivateUse("keras.src.trainers.trainer:Trainer", "_symbolic_build",
               "call", "a custom step builds the model's metrics and "
               "optimizer before its first step, as `fit` does",
               ("tfdist/training/step/custom_step.py",),
               params=("data_batch",)),
    PrivateUse(_LAYER, "_build_shapes_dict", "read",
               "export: the shapes a subclassed model was built with",
               ("tfdist/training/state/export.py",)),
    PrivateUse(_LAYER, "_called", "read",
               "export: whether a model was ever called",
               ("tfdist/training/state/export.py",)),
    PrivateUse("keras.src.trainers.trainer:Trainer", "_compile_config",
               "read", "the loss and metrics `compile` was given",
               ("tfdist/training/step/objectives.py",)),
    PrivateUse("keras.src.trainers.trainer:Trainer", "_jit_compile", "read",
               "training checks: whether the user asked for XLA",
               ("tfdist/training/step/training_checks.py",)),
    PrivateUse("keras.src.metrics.reduction_metrics:MeanMetricWrapper",
               "_fn", "read", "the function a metric wraps",
               ("tfdist/training/step/objectives.py",)),
    PrivateUse("keras.src.metrics.regression_metrics:R2Score", "_built",
               "read", "metrics that build on their first batch (R2Score)",
               ("tfdist/training/step/objectives.py",)),
    PrivateUse("keras.src.distribution.distribution_lib:ModelParallel",
               "_layout_map", "read",
               "the LayoutMap of a user's ModelParallel distribution",
               ("tfdist/parallel/layout_map.py",)),
    PrivateUse("keras.src.backend.common", "global_state", "import",
               "the pipeline calls a model builder twice and must "
               "get the same model: Keras's automatic-name counters "
               "(`object_name_uids`) are saved and restored around it",
               ("tfdist/parallel/pipeline/mode.py",)),
    PrivateUse("keras.src.backend.common.global_state",
               "get_global_attribute", "call", "as above",
               ("tfdist/parallel/pipeline/mode.py",), params=("name",)),
    PrivateUse("keras.src.backend.common.global_state",
               "set_global_attribute", "call", "as above",
               ("tfdist/parallel/pipeline/mode.py",),
               params=("name", "value")),
    # ---- Keras optimizers ----
    PrivateUse(_OPTIMIZER, "_learning_rate", "read",
               "the optimizer's learning rate (a variable or a schedule) "
               "without calling it", (_SHARDED_OPTIMIZER,
                                      "tfdist/core/optimizers.py",
                                      "tfdist/parallel/experts/zero.py")),
    PrivateUse(_OPTIMIZER, "_trainable_variables", "set",
               "the sharded optimizer: a copy of the user's optimizer that "
               "updates one shard", (_SHARDED_OPTIMIZER,)),
    PrivateUse(_OPTIMIZER, "_trainable_variables_indices", "set",
               "as above: the copy's variable index", (_SHARDED_OPTIMIZER,)),
    PrivateUse(_OPTIMIZER, "_var_key", "call",
               "as above: the index's key of a variable",
               (_SHARDED_OPTIMIZER,), params=("variable",)),
    PrivateUse(_OPTIMIZER, "_trainable_variables", "read",
               "FixedLossScaleOptimizer (--loss_scale=N): the variables "
               "its unscaled gradients pair with when none are passed",
               ("tfdist/training/step/precision.py",)),
    PrivateUse(_OPTIMIZER, "_overwrite_variable_with_gradient", "call",
               "FixedLossScaleOptimizer: a variable whose 'gradient' is "
               "its new value (a moving statistic) is not unscaled",
               ("tfdist/training/step/precision.py",),
               params=("variable",)),
    PrivateUse(_OPTIMIZER, "_variables", "read",
               "the sharded optimizer's checkpoint view: the name of the "
               "slot list among the optimizer's trackable children",
               (_SHARDED_OPTIMIZER,)),
    PrivateUse(_LOSS_SCALE, "_stateful_handle_finite_grads", "override",
               "FixedLossScaleOptimizer (--loss_scale=N): a finite step "
               "applies the unscaled gradients and leaves the scale as it "
               "is (renamed, the scale would grow as the dynamic one does)",
               ("tfdist/training/step/precision.py",),
               params=("grads", "trainable_variables")),
    PrivateUse(_LOSS_SCALE, "_stateful_handle_non_finite_grads", "override",
               "FixedLossScaleOptimizer: a skipped step leaves the scale "
               "as it is (renamed, the scale would halve)",
               ("tfdist/training/step/precision.py",), params=()),
    PrivateUse(_TF_OPTIMIZER, "_all_reduce_sum_gradients", "set",
               "modes that reduce gradients themselves turn Keras's "
               "all-reduce in `apply_gradients` off for a step (the "
               "experts' optimizer under ZeRO for good: its gradients "
               "arrive summed over their slot's replicas)",
               ("tfdist/training/step/train_loop.py",
                "tfdist/parallel/experts/zero.py")),
    PrivateUse("keras.src.callbacks.model_checkpoint:ModelCheckpoint",
               "_batches_seen_since_last_saving", "set",
               "callback state: read at every checkpoint and set on "
               "resume, so `save_freq=N` batches counts on (renamed, "
               "getattr's default would save None)",
               ("tfdist/training/state/callback_state.py",)),
    PrivateUse("keras.src.callbacks.model_checkpoint:ModelCheckpoint",
               "_last_batch_seen", "set", "as above",
               ("tfdist/training/state/callback_state.py",)),
    # ---- TensorFlow checkpointing and tracking ----
    PrivateUse(_TRACKABLE, "_trackable_children", "call",
               "the sharded optimizer's checkpoint view: the user's "
               "optimizer's children", (_SHARDED_OPTIMIZER,),
               params=()),
    PrivateUse(_TRACKABLE, "_serialize_to_tensors", "override",
               "tensor parallelism's gathered view saves unsharded values",
               ("tfdist/parallel/tensor/mode.py",), params=()),
    PrivateUse(_TRACKABLE, "_restore_from_tensors", "override",
               "as above: restore by slicing into the shards",
               ("tfdist/parallel/tensor/mode.py",),
               params=("restored_tensors",)),
    PrivateUse(_TRACKABLE, "_gather_saveables_for_checkpoint", "override",
               "ZeRO's sharded slots and stage 3's released weights (their "
               "class swapped for a subclass defining it) save as slices of "
               "their unsharded shape, one SaveableObject per slice: the "
               "only route that restores a key saved as several slices",
               (_SHARDED_OPTIMIZER, _ZERO3), params=()),
    PrivateUse("tensorflow.python.training.saving.saveable_object",
               "SaveableObject", "import",
               "ZeRO: one slice of a sharded slot or weight, saved where it "
               "lives and restored into its shard", (_SHARDED_OPTIMIZER,),
               params=("op", "specs", "name")),
    PrivateUse("tensorflow.python.training.saving.saveable_object:"
               "SaveableObject", "restore", "override",
               "as above: the saver restores a slice through it",
               (_SHARDED_OPTIMIZER,),
               params=("restored_tensors", "restored_shapes")),
    PrivateUse("tensorflow.python.training.saving.saveable_object",
               "SaveSpec", "call",
               "as above: a slice's tensor, slice spec, key and device",
               (_SHARDED_OPTIMIZER,),
               params=("tensor", "slice_spec", "name", "dtype", "device")),
    PrivateUse("tensorflow.python.trackable.data_structures:ListWrapper",
               "_storage", "read", "the sharded optimizer's checkpoint "
               "view: a tracked list child", (_SHARDED_OPTIMIZER,)),
    PrivateUse("tensorflow:__internal__.tracking", "Trackable", "read",
               "the sharded optimizer's checkpoint objects: a full slot's "
               "base class", (_SHARDED_OPTIMIZER,)),
    PrivateUse("tensorflow:__internal__.tracking", "AutoTrackable", "call",
               "the sharded optimizer's checkpoint view of the user's "
               "optimizer", (_SHARDED_OPTIMIZER,), params=()),
    PrivateUse("tensorflow:__internal__.distribute", "ShardedVariable",
               "read", "a parameter-server sharded embedding table, told "
               "apart from a whole one",
               ("tfdist/distribute/sharded_embedding.py",)),
    PrivateUse("tensorflow.python.trackable.constants",
               "_CHECKPOINTABLE_OBJECT_GRAPH", "read",
               "the checkpoint key of the object graph "
               "(`OBJECT_GRAPH_PROTO_KEY`'s value): which parts a "
               "checkpoint holds", ("tfdist/training/state/checkpointing.py",)),
    PrivateUse("tensorflow.core.protobuf.trackable_object_graph_pb2",
               "TrackableObjectGraph", "import",
               "reads a checkpoint's object graph",
               ("tfdist/training/state/checkpointing.py",)),
    PrivateUse("tensorflow.core.protobuf.saved_model_pb2", "SavedModel",
               "import", "reads an exported SavedModel's proto",
               ("tfdist/training/state/export.py",)),
    # ---- TensorFlow distribution and runtime ----
    PrivateUse("tensorflow.python.distribute.cross_device_utils:"
               "CollectiveReplicaLauncher", "_prefer_unique_instance_key",
               "set", "collective instance keys fixed at trace time (flat "
               "memory) unless the environment asks for per-call keys",
               ("tfdist/distribute/strategy.py",)),
    PrivateUse("tensorflow.python.distribute.device_util", "canonicalize",
               "call", "a device string in TensorFlow's full form",
               ("tfdist/parallel/collectives.py",), params=("d",)),
    PrivateUse("tensorflow.python.eager.context", "context", "call",
               "the eager context: its coordination-service store, its "
               "op-seed generator and its address space (below)",
               ("tfdist/data/input_pipeline.py",
                "tfdist/distribute/worker_exit.py",
                "tfdist/parallel/pipeline/copies.py"), params=()),
    PrivateUse("tensorflow.python.eager.context:Context",
               "host_address_space", "call",
               "this process's task (`/job:chief/replica:0/task:0` for a "
               "cluster's client): a pipeline's data groups on it cannot "
               "run collectives", ("tfdist/parallel/pipeline/copies.py",),
               params=()),
    PrivateUse("tensorflow.python.eager.context:Context",
               "set_config_key_value", "call",
               "a worker's exit through the coordination service's "
               "key-value store", ("tfdist/distribute/worker_exit.py",),
               params=("key", "value")),
    PrivateUse("tensorflow.python.eager.context:Context",
               "get_config_key_value", "call", "as above",
               ("tfdist/distribute/worker_exit.py",),
               params=("key", "timeout_in_ms")),
    PrivateUse("tensorflow.python.eager.context:Context", "_rng", "read",
               "the eager op-seed generator (`tf.random.set_seed`'s): a "
               "resume on another worker count builds each replayed "
               "worker's input from the state that worker's process had",
               ("tfdist/data/input_pipeline.py",)),
    PrivateUse("tensorflow.python.framework.random_seed",
               "DEFAULT_GRAPH_SEED", "read",
               "the input pipeline's graph seed when none is set",
               ("tfdist/data/input_pipeline.py",)),
    # ---- absl (installed with TensorFlow) ----
    PrivateUse("absl.logging", "_warn_preinit_stderr", "set",
               "the console silences absl's pre-init warning",
               ("tfdist/runtime/console.py",)),
    PrivateUse("absl.logging:ABSLHandler", "_current_handler", "read",
               "the console's plain formatter: the handler absl delegates "
               "to", ("tfdist/runtime/console.py",)),
)

# Private names tfdist defines itself (or the standard library's) that
# tfdist code reads on an object other than `self`, or spells in a string:
# not Keras/TensorFlow's.
TFDIST_OWN = {
    "_SHARD_AXIS": "tfdist/parallel/tensor/layers.py",
    "_assign_full": "tfdist/parallel/tensor/layers.py",
    "_components": "tfdist/parallel/tensor/layers.py",
    "_full_value": "tfdist/parallel/tensor/layers.py",
    "_create": "tfdist/parallel/pipeline/stages.py (deferred variables)",
    "_sharded_indices": "tfdist/parallel/zero3/optimizer.py",
    "_validate": "tfdist/config/root.py (TrainConfig)",
    "_stream": "tfdist/runtime/console.py (its line tracker)",
    "_exit": "os._exit (the standard library)",
    "_gather_through": "tfdist/parallel/tensor/mode.py (the gathered view)",
    "_same_streams": "tfdist/parallel/tensor/mode.py",
    "_num_local_experts": "tfdist/parallel/experts/layer.py",
    "_canonical": "tfdist/parallel/collectives.py",
    "_local_devices": "tfdist/parallel/tensor/layers.py",
    "_whole": "tfdist/parallel/pipeline/tensor.py (StageSplitDense)",
    # Names tfdist keeps in strings (a key, an annotation, a layer suffix).
    "_config": "tfdist/config/model_builder.py (ModelBuilderConfig)",
    "_Model": "tfdist/diagnose/diagnosis.py (a class, as an annotation)",
    "_ff_in": "tfdist/parallel/tensor/layers.py (a layer name's suffix)",
    "_ff_out": "tfdist/parallel/tensor/layers.py (a layer name's suffix)",
    "_shard_update": "tfdist/training/step/train_loop.py (a step's sums)",
    "_summed": "tfdist/training/step/train_loop.py (a step's sums)",
}
# Attributes tfdist sets on Keras objects under its own prefix.
TFDIST_PREFIX = "_tfdist_"

# The per-instance replacements ZeRO stage 3 puts on a released weight
# (its `_release`) and removes when it materializes it again (it also
# swaps the weight's class for one defining `_gather_saveables_for_checkpoint`,
# and swaps it back).
ZERO3_VARIABLE_OVERRIDES = ("_save_slice_info", "_direct_assign")


def flatten_layers(model, include_self: bool = True,
                   recursive: bool = True) -> list:
  """Every layer of `model` (`Layer._flatten_layers`): `model` itself first
  when `include_self`, then its sublayers, nested ones too when
  `recursive`. A model without the private method (not a Keras layer)
  gives `model.layers`."""
  if not hasattr(model, "_flatten_layers"):
    return list(getattr(model, "layers", ()))
  return list(model._flatten_layers(  # pylint: disable=protected-access
      include_self=include_self, recursive=recursive))


def resolve(owner: str):
  """The module or class `owner` names (`module` or `module:Class`).

  Raises:
    ImportError: the module is gone; AttributeError: the class is gone.
  """
  module_name, _, qualname = owner.partition(":")
  target = importlib.import_module(module_name)
  for part in filter(None, qualname.split(".")):
    target = getattr(target, part)
  return target


def _sources(target) -> Iterable[str]:
  classes = inspect.getmro(target) if inspect.isclass(target) else (target,)
  for cls in classes:
    if cls is object:
      continue
    try:
      yield inspect.getsource(cls)
    except (OSError, TypeError):
      continue


def _signature_problem(use: PrivateUse, target) -> Optional[str]:
  """Why `target`'s signature does not take `use.params`, or None."""
  try:
    signature = inspect.signature(target)
  except (TypeError, ValueError):
    return f"{use.owner}.{use.name} has no signature to check"
  names = [name for name in signature.parameters if name != "self"]
  if use.access == "override":
    if tuple(names) != use.params:
      return (f"{use.owner}.{use.name} takes ({', '.join(names)}); "
              f"tfdist's override takes ({', '.join(use.params)})")
    return None
  lacking = [name for name in use.params if name not in names]
  if lacking:
    return (f"{use.owner}.{use.name} takes ({', '.join(names)}): no "
            f"{', '.join(lacking)}")
  return None


def missing(use: PrivateUse) -> Optional[str]:
  """Why `use` no longer holds in the installed TensorFlow/Keras, or None.

  A name tfdist calls or overrides must be a callable attribute of its
  owner, with the parameters of `use.params`. A name read or set holds
  when its owner has it as an attribute, or (an attribute set in
  `__init__`, or one TensorFlow reads from other objects) when the source
  of the owner (a class with its bases, or a module) names it.
  """
  try:
    target = resolve(use.owner)
  except (ImportError, AttributeError) as e:
    return f"{use.owner} is gone: {e}"
  if use.access in ("call", "override") or use.params is not None:
    if not callable(getattr(target, use.name, None)):
      return f"{use.owner} has no method or function {use.name}"
    if use.params is None:
      return None
    return _signature_problem(use, getattr(target, use.name))
  if hasattr(target, use.name):
    return None
  for source in _sources(target):
    if use.name in source:
      return None
  return f"{use.owner} has no {use.name}"
