"""The step-mode protocol: how one replica's batch runs, per parallelism.

A parallelism mode is one object the `tfdist.training.step.train_loop.Trainer`
is given, not a patch on its step (T5X's injected partitioner, torchtitan's
`distributed/`): the trainer calls `mode.forward_backward(context, ...)`
once per (micro-)batch and `mode.eval_sums(context, ...)` once per
evaluation batch, without knowing which layout the mode holds. Each mode
lives in its own package under `tfdist/parallel/` and registers itself by
name:

  data      `tfdist.parallel.data`: the whole model on every replica
            (ZeRO stages 0-2 shard only the optimizer's state and the
            accumulated gradients, `tfdist.parallel.data.sharded_optimizer`).
  zero3     `tfdist.parallel.zero3`: ZeRO stage 3, the weights sharded too
            and gathered by the step.
  pipeline  `tfdist.parallel.pipeline`: the model cut into stages on
            consecutive devices, micro-batched.
  tensor    `tfdist.parallel.tensor`: Megatron-style layers split over one
            host's replicas.
  experts   `tfdist.parallel.experts`: mixture-of-experts layers' experts
            split over one host's replicas (all-to-all dispatch).

A mode written elsewhere registers with `@register_mode("name")` and is
passed to the trainer (`Trainer(..., mode=MyMode())`). Importing
`tfdist.parallel.modes` registers the five built-in ones.

This module is the bottom of the parallel floor: it imports neither
TensorFlow nor `tfdist.training` or `tfdist.backends`.
"""

import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Type

from tfdist import errors

_MODES: Dict[str, type] = {}


class StepContext:
  """What the trainer gives a mode (the `Trainer` itself provides it).

  Attributes a mode may read: `model` (the Keras model), `optimizer` (the
  Keras optimizer), `strategy`, `global_batch_size`,
  `gradient_accumulation_steps` (K), `uses_loss_scale`, `xla_applied`
  (`--enable_xla`), `sharded` (the ZeRO optimizer of stages 1-3, or
  None).

  Methods, all in replica context:
    losses(labels, outputs, weights=None) -> (objective, reported): one
      replica's share of the step's loss (float32 scalars), the first to
      differentiate, the second to report; `model.losses` not included.
    regularization_loss() -> float32 scalar or None: `model.losses` of the
      last forward pass, summed.
    scale_loss(objective) -> the objective times the fp16 loss scale (as
      is without one).
    model_forward_backward(inputs, labels, weights=None) -> (loss, grads,
      outputs): the whole model's pass (the data-parallel one).
    eval_sums(inputs, labels, weights=None, mask=None, outputs=None) ->
      {"loss_sum", "regularization_sum", "count", metric sums...}.
    empty_eval_sums() -> the same keys, zeros (an empty batch).

  This class documents the interface; it is not instantiated.
  """


@dataclasses.dataclass(frozen=True)
class PlanFacts:
  """What a mode's lines of the run plan read (`StepMode.plan_lines`):
  decided before anything is built, no TensorFlow.

  Attributes:
    parallelism: the config's parallelism section
      (`tfdist.config.ParallelismConfig`: `pipeline_stages`,
      `tensor_parallel`, `expert_parallel`, ...).
    num_replicas_in_sync: R, the replicas of one update.
    per_replica_batch_size: examples one replica computes per micro-step.
    gradient_accumulation_steps: K, micro-steps per update.
    compute_bytes: bytes of one activation element in the compute dtype
      (4 for fp32; 2 under `mixed_bfloat16` or `mixed_float16`).
    pipeline: the run's resolved `tfdist.parallel.pipeline.options.
      PipelineOptions` when the model is cut into stages, else None.
    experts: the `tfdist.parallel.experts.traffic.ExpertsShape` of the
      built-in model's mixture-of-experts layers when the flags give them
      (`--model=transformer --transformer_experts=E`), else None (a
      model of one's own: known once it is built).
    zero_stage: the ZeRO stage (`--zero_stage`, the switches resolved).
  """
  parallelism: Any
  num_replicas_in_sync: int = 1
  per_replica_batch_size: int = 1
  gradient_accumulation_steps: int = 1
  compute_bytes: int = 4
  pipeline: Any = None
  experts: Any = None
  zero_stage: int = 0


class StepMode:
  """One parallelism mode: the base class of every registered mode.

  The start-up parts (class methods; no TensorFlow, no model): `validate`,
  `devices`, `layout_rows` (its memory per device), `plan_lines` (its
  lines of the run plan) and the backend trait `replaces_step_runner`.
  The step's parts (instance methods; the trainer calls
  `sharded_optimizer` (under ZeRO) and `bind` once at construction, the
  others while its step is traced, in replica context):
  `forward_backward`, `eval_sums`, and the views `variables`,
  `checkpoint_model`, `checkpoint_optimizer`, `exported_model`.

  Class attributes:
    name: the registered name (set by `register_mode`).
    all_reduces_gradients: whether the trainer sums the gradients over
      replicas (False: each replica's gradients are its own, as tensor
      parallelism's shards).
    replaces_step_runner: whether the mode needs a backend of its own
      that runs the step (a pipeline driving its stages from one process)
      instead of the strategy kind's: `tfdist.backends.mode_backends`
      refuses such a mode without a registered backend factory.
  """

  name: str = ""
  all_reduces_gradients: bool = True
  replaces_step_runner: bool = False

  # --- start-up (no TensorFlow) -------------------------------------------
  @classmethod
  def validate(cls, settings: Mapping[str, Any]) -> None:
    """Start-up checks of the settings this mode runs with (pure Python,
    no TensorFlow, no model).

    Args:
      settings: the run's settings by flag name (`{"pipeline_stages": 2,
        "zero_stage": 0, ...}`); a mode reads those it checks.

    Raises:
      tfdist.errors.ConfigError: a combination the mode cannot run, naming
        the flags and the fix. KeyError: a setting the mode checks is
        missing. The base class accepts everything.
    """
    del settings

  @classmethod
  def devices(cls, settings: Mapping[str, Any]) -> int:
    """Devices one copy of the model spans under `settings` (by flag
    name): 1 for the base class (one replica's device)."""
    del settings
    return 1

  @classmethod
  def layout_rows(cls, facts) -> list:
    """This mode's rows of the memory plan
    (`tfdist.training.plan.memory.layout_table`): the bytes one device holds
    under each layout the mode offers, computed from `facts` (a
    `tfdist.training.plan.memory.LayoutFacts`: the model's unsharded
    `ModelMemory`, the devices, the batch, the settings) with
    `facts.row(...)`.

    Returns:
      A list of `tfdist.training.plan.memory.LayoutMemory` (the base class:
      none, the mode is not planned).
    """
    del facts
    return []

  @classmethod
  def plan_lines(cls, facts: PlanFacts) -> List[str]:
    """This mode's lines of the run plan (`--dry_run` and the log at
    start; `tfdist.training.plan.run_plan`), each indented two spaces as the
    plan's others: its layout and what it moves per step, from `facts`
    (a `PlanFacts`). The base class: none."""
    del facts
    return []

  @classmethod
  def model_facts(cls, model) -> Dict[str, Any]:
    """What this mode measures of an unsharded, built Keras `model` for
    the memory plan (`tfdist.training.plan.memory.model_facts` merges every
    mode's): keys of `LayoutFacts` or of `estimate_model_memory`. The base
    class: none."""
    del model
    return {}

  # --- the step (replica context) ---------------------------------------
  def sharded_optimizer(self, stage_class: type, **kwargs):
    """The ZeRO optimizer of stages 1-3 this mode's trainer runs with,
    called once by the trainer before `bind`.

    Args:
      stage_class: the stage's optimizer class
        (`tfdist.parallel.data.sharded_optimizer.optimizer_class`:
        `ShardedOptimizer`, or stage 3's `Zero3Optimizer`).
      **kwargs: its constructor's arguments (`strategy`, `optimizer`,
        `variables`: the model's trainable variables, `options`,
        `all_reduce_dtype`, `model`).

    Returns:
      `stage_class(**kwargs)` for the base class; a mode whose replicas
      hold different weights shards only those they share (the `experts`
      mode: `tfdist.parallel.experts.zero`), or shards within groups of
      replicas (the `tensor` mode's data groups, hybrid sharding:
      `tfdist.parallel.tensor.zero`).
    """
    return stage_class(**kwargs)

  def bind(self, context) -> None:
    """Called once by the trainer that runs this mode (`StepContext`),
    before its step is traced. Raises `tfdist.errors.ConfigError` on a
    trainer the mode cannot run with."""
    del context

  def forward_backward(self, context, inputs, labels, weights=None):
    """Loss, gradients and outputs of one replica's batch (no update).

    Args:
      context: the `StepContext` (the trainer).
      inputs: the replica's inputs, [b, ...] (a tensor or a nest).
      labels: [b, ...].
      weights: the examples' training weights, float32 [b], or None.

    Returns:
      `(loss, grads, outputs)`: the reported loss (float32 scalar), one
      gradient per entry of the variables the optimizer updates (loss
      scaled under fp16), the outputs as float32 [b, ...].
    """
    return context.model_forward_backward(inputs, labels, weights)

  def eval_sums(self, context, inputs, labels, weights=None, mask=None):
    """Summed loss, count and metric state of one replica's evaluation
    batch (`StepContext.eval_sums`'s keys). The base class skips the model
    on an empty batch (the last round's spare replicas): TensorFlow 2.21's
    oneDNN CPU kernels fail on those."""
    return eval_sums_skipping_empty(context, inputs, labels, weights, mask)

  # --- views ---------------------------------------------------------------
  def variables(self, context) -> list:
    """The model's state as this mode holds it: the variables a
    checkpoint's finite check reads (`context.model.variables` by
    default; ZeRO stage 3 the local weight shards in place of the
    released weights)."""
    return list(context.model.variables)

  def checkpoint_model(self, context):
    """The model the checkpoint saves (the trainer's by default)."""
    return context.model

  def checkpoint_optimizer(self, context):
    """The optimizer the checkpoint saves: the ZeRO optimizer's view when
    sharded, else the trainer's."""
    if context.sharded is not None:
      return context.sharded.checkpoint_view()
    return context.optimizer

  def exported_model(self, context):
    """The whole model holding the trained weights, for export."""
    return context.model


def eval_sums_skipping_empty(context, inputs, labels, weights=None,
                             mask=None):
  """`context.eval_sums` of a replica's batch, or `context.empty_eval_sums`
  when the batch is empty (a `tf.cond`: the model is not run on it)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.cond(tf.shape(labels)[0] > 0,
                 lambda: context.eval_sums(inputs, labels, weights, mask),
                 context.empty_eval_sums)


def register_mode(name: str) -> Callable[[type], type]:
  """Registers a `StepMode` subclass under `name` (a class decorator).

  Raises:
    ValueError: an empty name, a class that is not a `StepMode`, or a name
      already taken by another class.
  """
  if not name or not isinstance(name, str):
    raise ValueError(f"A mode's name must be a non-empty string. Received: "
                     f"name={name!r}")

  def register(cls: type) -> type:
    if not (isinstance(cls, type) and issubclass(cls, StepMode)):
      raise ValueError(f"register_mode({name!r}) takes a subclass of "
                       f"tfdist.parallel.mode.StepMode. Received: {cls!r}")
    taken = _MODES.get(name)
    if taken is not None and taken is not cls and (
        taken.__qualname__ != cls.__qualname__ or
        taken.__module__ != cls.__module__):
      raise ValueError(f"The mode name {name!r} is taken by "
                       f"{taken.__module__}.{taken.__qualname__}. Pick "
                       "another name.")
    cls.name = name
    _MODES[name] = cls
    return cls

  return register


def unregister_mode(name: str) -> None:
  """Removes a mode registered by `register_mode` (tests)."""
  _MODES.pop(name, None)


def mode_names() -> Tuple[str, ...]:
  """Every registered mode's name, in registration order
  (`tfdist.parallel.modes.mode_names`: the built-in ones first)."""
  return tuple(_MODES)


def get_mode(name: str) -> Type[StepMode]:
  """The mode class registered under `name` (the built-in ones are
  registered by importing `tfdist.parallel.modes`).

  Raises:
    tfdist.errors.ConfigError: an unknown name; the message lists the
      registered ones.
  """
  if name not in _MODES:
    raise errors.ConfigError(
        f"Unknown parallelism mode {name!r}. Registered modes: "
        f"{', '.join(sorted(_MODES)) or 'none'}. Import "
        "tfdist.parallel.modes for the built-in ones, or register a new "
        "one with tfdist.parallel.mode.register_mode.")
  return _MODES[name]


def mode_of(trainer, name: str) -> Optional[StepMode]:
  """`trainer`'s mode when it is the one registered as `name`, else None
  (also for a trainer with no mode: a model's own `train_step`)."""
  mode = getattr(trainer, "mode", None)
  return mode if getattr(mode, "name", None) == name else None


def mode_name_for(*, zero_stage: int = 0, pipeline_stages: int = 1,
                  tensor_parallel: int = 1, expert_parallel: int = 1) -> str:
  """The mode the parallelism settings choose: `pipeline` with
  `--pipeline_stages` > 1, `tensor` with `--tensor_parallel` > 1,
  `experts` with `--expert_parallel` > 1, `zero3` with `--zero_stage=3`,
  else `data` (ZeRO stages 0-2 included). The settings' own checks
  (`--zero_stage=3` with stages, ...) stay with the config and with each
  mode's `validate`."""
  if pipeline_stages > 1:
    return "pipeline"
  if tensor_parallel > 1:
    return "tensor"
  if expert_parallel > 1:
    return "experts"
  if zero_stage == 3:
    return "zero3"
  return "data"


def mode_name_of(parallelism, memory) -> str:
  """`mode_name_for` the config's parallelism section
  (`tfdist.config.ParallelismConfig`: `pipeline_stages`,
  `tensor_parallel`, `expert_parallel`) and memory section
  (`tfdist.config.MemoryConfig`: `zero_stage_resolved`)."""
  return mode_name_for(
      zero_stage=memory.zero_stage_resolved,
      pipeline_stages=parallelism.pipeline_stages,
      tensor_parallel=parallelism.tensor_parallel,
      expert_parallel=parallelism.expert_parallel)


def mode_for(settings: Mapping[str, Any]) -> Type[StepMode]:
  """The mode class `settings` (by flag name: `zero_stage`,
  `pipeline_stages`, `tensor_parallel`; absent ones count as off)
  choose, validated against them (`StepMode.validate`).

  Raises:
    tfdist.errors.ConfigError: an unknown mode, or the mode refuses the
      settings.
  """
  cls = get_mode(mode_name_for(
      zero_stage=settings.get("zero_stage", 0),
      pipeline_stages=settings.get("pipeline_stages", 1),
      tensor_parallel=settings.get("tensor_parallel", 1),
      expert_parallel=settings.get("expert_parallel", 1)))
  cls.validate(settings)
  return cls


def state_variables(trainer, model) -> list:
  """`model`'s state as `trainer`'s mode holds it (`StepMode.variables`);
  `model.variables` for a trainer without a mode (a model's own
  `train_step`)."""
  mode = getattr(trainer, "mode", None)
  return list(model.variables) if mode is None else mode.variables(trainer)
