"""Assembly: the model, optimizer, trainer and checkpoint of a run, once.

`build` calls the task's model builder and creates every variable under the
strategy's scope (so ParameterServerStrategy places tables, dense weights
and optimizer slots on the ps tasks, and Mirrored strategies mirror them),
resolves the loss and metrics (`tfdist.training.step.objectives`), wraps the
optimizer for the precision, and returns the parts every strategy uses the same
way. `load_init_checkpoint` warm-starts the model (`--init_checkpoint`).
"""

import dataclasses
import functools
import os
from typing import Any, Optional, Tuple

from absl import logging
import keras
import tensorflow as tf

from tfdist import config as config_lib
from tfdist import models
from tfdist import errors
from tfdist.errors import first_line
from tfdist.parallel.pipeline import options as pipeline_options
from tfdist.parallel.zero3 import optimizer as zero3  # Registers ZeRO stage 3's optimizer.
from tfdist.runtime import wording
from tfdist.training.state import checkpointing
from tfdist.training.step import custom_step
from tfdist.training.plan import lr_schedule
from tfdist.training.plan import memory
from tfdist.training.step import objectives as objectives_lib
from tfdist.core import optimizers
from tfdist.parallel.pipeline import mode as pipeline_step
from tfdist.training.step import precision
from tfdist.core import reduce_dtype
from tfdist.parallel.data import sharded_optimizer
from tfdist.training import task as task_lib
from tfdist.parallel.tensor import mode as tensor_parallel_step
from tfdist.parallel.experts import mode as expert_parallel_step
from tfdist.training.step import train_loop
from tfdist.training.step import training_checks
from tfdist.training.step.train_loop import Trainer


@dataclasses.dataclass(frozen=True)
class AssemblyOptions:
  """What assembly reads of a run: the config's sections, each handed over
  as the config holds it (no field restated), and what the run decided.

  `tfdist.experiment.prepare.assembly_options` makes it for a run.

  Attributes:
    optimization: the `tfdist.config.OptimizationConfig`: `optimizer` (by
      name, `tfdist.core.optimizers.build_optimizer`), `momentum`,
      `weight_decay` (decoupled, per step), `clipnorm`, `global_clipnorm`.
    precision: the `tfdist.config.PrecisionConfig`: `enable_xla`
      (jit-compile the per-replica step).
    loop: the `tfdist.config.LoopConfig`: `run_eagerly` (debugging),
      `deterministic` (op determinism; the step is then not timed).
    memory: the `tfdist.config.MemoryConfig`: the resolved ZeRO stage
      (0-2: the optimizer state sharded; 3: the weights too,
      `tfdist.parallel.zero3`), `zero3_blocks`, `zero3_prefetch`
      (`tfdist.parallel.data.sharded_optimizer.ShardingOptions`),
      `activation_recomputation`.
    task: the `tfdist.config.TaskConfig`: `class_weight` (`((class id,
      weight), ...)`; empty: none).
    strategy: the `tfdist.config.StrategyConfig`: `bytes_per_pack` (the
      gradients' all-reduce packs, bytes; 0: one), `all_reduce_dtype`
      (`tfdist.core.reduce_dtype`), and its parallelism section
      (`tensor_parallel`: N replicas split the model's layers,
      `tfdist.parallel.tensor.mode`; `expert_parallel`: E_p replicas split
      each mixture-of-experts layer's experts, `tfdist.parallel.experts.
      mode`; 1: off).
    dtype: the precision policy's name the run decided (`fp32`, `fp16`,
      `bf16`).
    loss_scale: fp16's loss scale: None (dynamic), `dynamic` or a number.
    steps_per_execution: training steps per `tf.function` call (decided).
    pipeline: the model cut into pipeline stages
      (`tfdist.parallel.pipeline.options.PipelineOptions`, of the
      parallelism section, with the devices its backend found; None or
      one stage: not cut).
    builder_config: what a model builder asking for `config` receives (the
      run's `tfdist.config.ModelBuilderConfig`, passed through unread).
  """
  optimization: config_lib.OptimizationConfig = dataclasses.field(
      default_factory=config_lib.OptimizationConfig)
  precision: config_lib.PrecisionConfig = dataclasses.field(
      default_factory=config_lib.PrecisionConfig)
  loop: config_lib.LoopConfig = dataclasses.field(
      default_factory=config_lib.LoopConfig)
  memory: config_lib.MemoryConfig = dataclasses.field(
      default_factory=config_lib.MemoryConfig)
  task: config_lib.TaskConfig = dataclasses.field(
      default_factory=config_lib.TaskConfig)
  strategy: config_lib.StrategyConfig = dataclasses.field(
      default_factory=config_lib.StrategyConfig)
  dtype: str = "fp32"
  loss_scale: Any = None
  steps_per_execution: int = 1
  pipeline: Optional[pipeline_options.PipelineOptions] = None
  builder_config: Any = None


@dataclasses.dataclass(frozen=True)
class Parts:
  """The trainable state of a run and what trains it.

  Attributes:
    model: the Keras model (built under the strategy's scope).
    optimizer: its optimizer (a `LossScaleOptimizer` for fp16), built.
    trainer: the `tfdist.training.step.train_loop.Trainer` owning the
      compiled steps.
    checkpoint: a `tf.train.Checkpoint` over model, optimizer and the
      trainer's global step: the whole training state.
    objectives: the resolved loss and metrics
      (`tfdist.training.step.objectives.Objectives`).
    metric_sums: the metrics as a built
    `tfdist.training.step.objectives.MetricSums`.
  """
  model: keras.Model
  optimizer: Optional[keras.optimizers.Optimizer]
  trainer: Optional[Trainer]
  checkpoint: Optional[tf.train.Checkpoint]
  objectives: Optional[objectives_lib.Objectives] = None
  metric_sums: Optional[objectives_lib.MetricSums] = None


def _output_shape(model: keras.Model, task: task_lib.Task) -> tf.TensorShape:
  """The model's batched output shape on the task's features (computing it
  builds a model that builds lazily)."""
  features, _ = task_lib.example_spec(task.dataset)
  try:
    return objectives_lib.output_shape(model, features)
  except errors.ConfigError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    first = first_line(e)
    raise errors.ConfigError(
        f"--model={task.model_name} cannot take --dataset="
        f"{task.dataset.name}'s features {features}: {type(e).__name__}: "
        f"{first}") from e


def check_model_options(options: AssemblyOptions, *, task: task_lib.Task):
  """Raises `ConfigError` for model options the task's model cannot honour
  (`--activation_recomputation` for a builder that cannot recompute, see
  `tfdist.models.check_recomputation`); checked before any data or model is
  built."""
  models.check_recomputation(task.model_name,
                             options.memory.activation_recomputation,
                             builder=task.model_fn)


def build_model(options: AssemblyOptions, *, task: task_lib.Task,
                sync_batch_norm: bool = False,
                tensor_parallel: bool = False) -> keras.Model:
  """The task's model, built (in the current scope); `sync_batch_norm`
  from the run plan reaches builders that take it (the built-in models with
  batch normalization).

  Raises:
    ConfigError: the builder fails (see `tfdist.training.task.build_model`), or
      the model cannot take the data set's features.
  """
  model = task_lib.build_model(
      task, options.builder_config, sync_batch_norm=sync_batch_norm,
      activation_recomputation=options.memory.activation_recomputation,
      tensor_parallel=tensor_parallel)
  if custom_step.overrides(model):
    # Its own train_step reads the data: a model without a call on the
    # features (a GAN of Keras's tutorial) trains as under `fit`; only
    # its SavedModel is left out (said again at export).
    try:
      _output_shape(model, task)
    except errors.ConfigError as e:
      logging.warning("%s. Its own train_step trains it; the run writes no "
                      "SavedModel for it.", e)
  else:
    _output_shape(model, task)
  training_checks.check_steps_per_execution(
      model, steps_per_execution=options.steps_per_execution,
      model_name=f"--model={task.model_name}")
  training_checks.check_jit_compile(model,
                                    enable_xla=options.precision.enable_xla,
                                    model_name=f"--model={task.model_name}")
  if getattr(model, "optimizer", None) is not None:
    # compile's optimizer (RMSprop when compile names none) is not used:
    # tfdist builds its own from the config. Untracked (`del`: assigning
    # None keeps the checkpoint dependency), so that checkpoints hold only
    # tfdist's, which training assigns to `model.optimizer`.
    logging.info("--model=%s is compiled: tfdist uses its loss and metrics, "
                 "and trains with --optimizer=%s at the scaled learning rate "
                 "(not with compile's optimizer).", task.model_name,
                 options.optimization.optimizer)
    del model.optimizer
    model.optimizer = None
  return model


def resolve_objectives(model: keras.Model, *, task: task_lib.Task
                       ) -> Tuple[objectives_lib.Objectives,
                                  objectives_lib.MetricSums]:
  """The loss and metrics of `model` on the task's data, with the shapes of
  one example and of the model's output
  (`tfdist.training.step.objectives.resolve`).

  Raises:
    ConfigError: no loss is known; an unknown loss or metric name; a
      metric whose state is not summed.
  """
  _, labels = task_lib.example_spec(task.dataset)
  out_shape = _output_shape(model, task)
  y_true = tf.TensorShape([None]).concatenate(labels.shape)
  resolved = objectives_lib.resolve(
      loss=task.loss, metrics=task.metrics, model=model,
      dataset=task.dataset, y_true=y_true, y_pred=out_shape,
      what=f"--model={task.model_name}")
  metric_sums = objectives_lib.MetricSums(
      resolved.metrics, y_true=tf.TensorSpec(y_true, labels.dtype),
      y_pred=tf.TensorSpec(out_shape, tf.float32),
      weighted=resolved.weighted)
  logging.info("Loss %s, metrics [%s] (from %s)", resolved.loss.name,
               ", ".join(resolved.metric_names), resolved.source)
  objectives_lib.check_reduction(
      resolved.loss, weighted=task_lib.sample_weight_spec(task.dataset)
      is not None, what=f"--model={task.model_name}'s loss")
  # A loss returning one value per batch is said where it differs from
  # one device (more than one replica or micro-batch): the differences
  # table's `batch_valued_loss` warning, once.
  return resolved, metric_sums


def _warn_batch_valued_metrics(metric_sums: objectives_lib.MetricSums,
                               plan) -> None:
  """Warns, naming them, about metrics whose value depends on the
  per-replica batch (`tfdist.training.step.objectives.batch_valued_metrics`)."""
  splits = (plan.batch.num_replicas_in_sync *
            plan.batch.gradient_accumulation_steps)
  if splits <= 1 or metric_sums.y_true is None:
    return
  names = objectives_lib.batch_valued_metrics(
      metric_sums.metrics, y_true=metric_sums.y_true,
      y_pred=metric_sums.y_pred)
  if names:
    logging.warning(
        "Metric(s) %s return one value per batch, not per example: tfdist "
        "averages them over per-replica batches of %d examples (%d "
        "replicas x %d micro-batches per step), where one device's fit "
        "would average over batches of %d, so their values depend on the "
        "replica count. Return one value per example to get one device's "
        "value.", ", ".join(names), plan.global_batch_size // splits,
        plan.batch.num_replicas_in_sync,
        plan.batch.gradient_accumulation_steps, plan.global_batch_size)


def check_weights(options: AssemblyOptions, *,
                  task: task_lib.Task) -> Optional[dict]:
  """The run's class weights (`{class id: weight}`, or None), after
  checking that the examples do not carry sample weights too (Keras's
  `fit` refuses both: "You cannot `class_weight` and `sample_weight` at the
  same time").

  Raises:
    ConfigError: class weights and sample weights both given; a third
      example element that is not a number.
  """
  weight = task_lib.sample_weight_spec(task.dataset)
  if weight is not None:
    logging.info("Examples carry sample weights (%s): each weighs its loss "
                 "and weighted metrics.", weight)
  if not options.task.class_weight:
    return None
  if weight is not None:
    given = ",".join(f"{k}:{w}" for k, w in options.task.class_weight)
    raise errors.ConfigError(
        f"--class_weight={given}"
        f" and sample weights in --dataset={task.dataset.name}'s examples "
        "(a third element) cannot be used together (as in Keras's fit). "
        "Fold the class weights into the sample weights, or drop one.")
  return dict(options.task.class_weight)


def _sharding_for(options: AssemblyOptions,
                  strategy: tf.distribute.Strategy
                  ) -> sharded_optimizer.ShardingOptions:
  """The ZeRO sharding of the optimizer state, checked against `strategy`.

  Raises:
    ConfigError: a `zero_stage` above 0 under a strategy that is not
      Mirrored or MultiWorkerMirrored.
  """
  sharding = sharded_optimizer.ShardingOptions(
      stage=options.memory.zero_stage_resolved,
      num_blocks=options.memory.zero3_blocks,
      prefetch=options.memory.zero3_prefetch)
  if sharding.enabled and not isinstance(
      strategy, (tf.distribute.MirroredStrategy,
                 tf.distribute.MultiWorkerMirroredStrategy)):
    raise errors.ConfigError(
        f"--zero_stage={sharding.stage} "
        f"({memory.ZERO_STAGE_SWITCHES[sharding.stage]}) runs under "
        "mirrored or multi_worker_mirrored; this run's strategy is "
        f"{type(strategy).__name__}. Set --distribution_strategy=mirrored "
        "(or multi_worker_mirrored), or drop the flag.")
  return sharding


def run_optimizer(options: AssemblyOptions, learning_rate):
  """The run's optimizer for `learning_rate` (a schedule or a callable):
  the optimization section's `optimizer` by name (`tfdist.core.optimizers`),
  wrapped for the precision policy (fp16's loss scaling). Not built. The
  one way a run, `tfdist.diagnose` and the memory estimate make it."""
  optimization = options.optimization
  return precision.wrap_optimizer_for_precision(
      optimizers.build_optimizer(
          optimization.optimizer, learning_rate,
          momentum=optimization.momentum,
          weight_decay=optimization.weight_decay,
          clipnorm=optimization.clipnorm,
          global_clipnorm=optimization.global_clipnorm),
      dtype=options.dtype, loss_scale=options.loss_scale)


def _build_optimizer(options: AssemblyOptions, *, model: keras.Model, plan,
                     sharding: sharded_optimizer.ShardingOptions):
  """`(optimizer, learning_rate)`: the built optimizer (wrapped for the
  precision) and its `AdjustableLearningRate`, in the current scope."""
  # Settable by Keras's learning-rate callbacks (a checkpointed factor of the
  # schedule, see tfdist.training.plan.lr_schedule.AdjustableLearningRate).
  learning_rate = lr_schedule.AdjustableLearningRate(plan.lr.schedule)
  optimizer = run_optimizer(options, learning_rate)
  learning_rate.bind(sharded_optimizer.inner_optimizer(optimizer))
  # Every optimizer variable now, under the scope (created lazily in the
  # first step, ParameterServerStrategy would place it on the
  # coordinator). Sharded, its slots live on the shards instead
  # (tfdist.parallel.data.sharded_optimizer): built on no variables.
  optimizer.build([] if sharding.enabled else model.trainable_variables)
  return optimizer, learning_rate


def _log_trainer(trainer: Trainer, options: AssemblyOptions, *, plan,
                 sharding: sharded_optimizer.ShardingOptions,
                 on_tpu: bool) -> None:
  """Logs how the optimizer state is sharded, how the gradients travel and
  how XLA compiles."""
  if options.strategy.bytes_per_pack and not trainer.one_replica:
    logging.info(
        "--bytes_per_pack=%d: the gradients are all-reduced in packs of about "
        "%d bytes, last layers first, while the backward pass goes on.",
        options.strategy.bytes_per_pack, options.strategy.bytes_per_pack)
  if reduce_dtype.compresses(options.strategy.all_reduce_dtype):
    if trainer.strategy.num_replicas_in_sync == 1:
      logging.warning(
          "--all_reduce_dtype=%s has no effect: one replica in all, so "
          "nothing is all-reduced.", options.strategy.all_reduce_dtype)
    else:
      logging.info("--all_reduce_dtype=%s: %s.",
                   options.strategy.all_reduce_dtype,
                   reduce_dtype.describe(options.strategy.all_reduce_dtype))
  if trainer.sharded is not None:
    layout = trainer.sharded.layout
    logging.info(
        "ZeRO stage %d: each of the %d replicas keeps the optimizer state "
        "of %d of the %d parameters (one shard of a flat buffer, %s "
        "of padding)%s; %s, %s.",
        sharding.stage, layout.num_shards,
        layout.shard_size, layout.total,
        wording.count(layout.padding, "element"),
        ", and its shard of the gradient accumulators"
        if sharding.stage >= 2 and plan.batch.gradient_accumulation_steps > 1
        else "", trainer.sharded.groups.describe(sharding.stage),
        "its shard of the weights too, all-gathered for each step "
        "(tfdist.parallel.zero3)" if sharding.stage == zero3.STAGE
        else "the updated shards all-gathered")
    replicated = getattr(trainer.sharded, "replicated_paths", list)()
    if replicated:
      logging.info(
          "ZeRO stage 3 keeps %d embedding table(s) replicated (read in "
          "place, gradients all-reduced; their optimizer state sharded): "
          "%s.", len(replicated), ", ".join(replicated))
  if options.precision.enable_xla:
    logging.info(
        "--enable_xla: %s", "TPUs compile every step with XLA already."
        if on_tpu else "Keras 3 turns XLA off under a tf.distribute "
        "strategy, so tfdist jit-compiles its own per-replica forward and "
        "backward pass (the optimizer update stays outside XLA).")


def _training_checkpoint(model: keras.Model, *, trainer, learning_rate,
                         optimizer=None) -> tf.train.Checkpoint:
  """The whole training state: model, step, optimizer (each as the
  trainer's mode views it: `tfdist.parallel.mode.StepMode
  .checkpoint_model` and `checkpoint_optimizer`), LR factor and the random
  layers' seed-generator states. `optimizer`: given for a model's own
  `train_step` (`tfdist.training.step.custom_step`), whose trainer has no mode:
  the model and that optimizer are saved as they are."""
  # The random layers' seed-generator states too (Keras keeps them out of
  # the model's checkpoint dependencies): a resumed run then draws the same
  # dropout masks as an uninterrupted one.
  random_state = train_loop.random_state(model)
  # Sharded, the optimizer saves its slots in their unsharded shapes and
  # keys (any replica count, or none, restores them); tensor-parallel, the
  # model and optimizer through their gathered views.
  if optimizer is None:
    model = trainer.mode.checkpoint_model(trainer)
    optimizer = trainer.mode.checkpoint_optimizer(trainer)
  return tf.train.Checkpoint(
      model=model, global_step=trainer.global_step, optimizer=optimizer,
      lr_multiplier=learning_rate.multiplier,
      **({"random_state": random_state} if random_state else {}))


def _split_step(options: AssemblyOptions, *, task: task_lib.Task,
                strategy: tf.distribute.Strategy, plan):
  """The step mode of a model split over replicas, built with its model:
  tensor parallelism (`--tensor_parallel` > 1) or expert parallelism
  (`--expert_parallel` > 1); None for the others, and for tensor
  parallelism inside a pipeline's stages (`pipeline_step.build` splits
  those)."""
  parallelism = options.strategy.parallelism
  builder = functools.partial(build_model, options, task=task,
                              sync_batch_norm=plan.sync_batch_norm)
  if options.pipeline is not None and options.pipeline.enabled:
    return None
  if parallelism.tensor_parallel > 1:
    return tensor_parallel_step.build(builder, strategy,
                                      tensor=parallelism.tensor_parallel,
                                      layout_map=task.layout_map)
  if parallelism.expert_parallel > 1:
    return expert_parallel_step.build(builder, strategy,
                                      parallelism.expert_parallel)
  return None


def build(options: AssemblyOptions, *, task: task_lib.Task,
          strategy: tf.distribute.Strategy, plan,
          on_tpu: bool = False) -> Parts:
  """Builds model, optimizer, trainer and checkpoint under `strategy`.

  Args:
    options: the run's `AssemblyOptions` (its sections and decided values;
      `tfdist.experiment.prepare.assembly_options` makes them).
    task: the `tfdist.training.task.Task` (model builder, data set, loss,
      metrics).
    strategy: the run's strategy.
    plan: the `tfdist.training.plan.run_plan.RunPlan` (global batch, LR
      schedule).
    on_tpu: the strategy is TPU (XLA everywhere; padded evaluation).

  Returns:
    `Parts`.

  Raises:
    ConfigError: the builder fails tfdist's checks, or no loss is known.
  """
  sharding = _sharding_for(options, strategy)
  split = _split_step(options, task=task, strategy=strategy, plan=plan)
  with strategy.scope():
    if split is not None:
      model, deferred = split.model, None
    else:
      model, deferred = pipeline_step.build_model(
          functools.partial(build_model, options, task=task,
                            sync_batch_norm=plan.sync_batch_norm),
          options.pipeline)
    # Before the optimizer: its slots follow the stages' variables.
    pipeline = (pipeline_step.build(
        model, options.pipeline,
        micro_step_batch=plan.batch.per_replica_batch_size,
        gradient_accumulation_steps=plan.batch.gradient_accumulation_steps,
        deferred=deferred, layout_map=task.layout_map)
                if options.pipeline is not None else None)
    if pipeline is not None:
      # With tensor-split stages, the clone holding the split layers.
      model = pipeline.pipeline.model
    optimizer, learning_rate = _build_optimizer(
        options, model=model, plan=plan, sharding=sharding)
  # Keras callbacks read `model.optimizer`. Set without tracking it as the
  # model's checkpoint dependency: the optimizer is saved once, as the
  # checkpoint's own `optimizer`, and a model restored from the checkpoint
  # (`tf.train.Checkpoint(model=...)`, compiled with an optimizer of its own
  # or not) finds no optimizer of tfdist's under `model/`.
  object.__setattr__(model, "optimizer", optimizer)
  if sharding.stage == zero3.STAGE:
    zero3.check_model(model)
  if custom_step.overrides(model):
    return _custom_step_parts(options, model=model, task=task,
                              strategy=strategy, plan=plan, on_tpu=on_tpu,
                              learning_rate=learning_rate)
  resolved, metric_sums = resolve_objectives(model, task=task)
  class_weight = check_weights(options, task=task)
  _warn_batch_valued_metrics(metric_sums, plan)
  trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                    global_batch_size=plan.global_batch_size,
                    steps_per_execution=options.steps_per_execution,
                    # TPUs compile everything with XLA already.
                    enable_xla=options.precision.enable_xla and not on_tpu,
                    run_eagerly=options.loop.run_eagerly, loss=resolved.loss,
                    metrics=metric_sums, eval_example_weights=on_tpu,
                    gradient_accumulation_steps=(
                        plan.batch.gradient_accumulation_steps),
                    # Op determinism refuses tf.timestamp.
                    time_steps=not options.loop.deterministic,
                    sharding=sharding,
                    class_weight=class_weight,
                    bytes_per_pack=options.strategy.bytes_per_pack,
                    all_reduce_dtype=options.strategy.all_reduce_dtype,
                    mode=pipeline or split)
  _log_trainer(trainer, options, plan=plan, sharding=sharding, on_tpu=on_tpu)
  checkpoint = _training_checkpoint(model, trainer=trainer,
                                    learning_rate=learning_rate)
  return Parts(model=model, optimizer=optimizer, trainer=trainer,
               checkpoint=checkpoint, objectives=resolved,
               metric_sums=metric_sums)


def _custom_step_parts(options: AssemblyOptions, *, model: keras.Model,
                       task: task_lib.Task, strategy: tf.distribute.Strategy,
                       plan, on_tpu: bool, learning_rate) -> Parts:
  """`build`'s parts for a model that overrides its `train_step` (or
  `test_step`, `compute_loss`, `compute_metrics`): tfdist runs the model's
  own step (`tfdist.training.step.custom_step`); no objectives of tfdist's.

  Raises:
    ConfigError: a setting that needs tfdist's own step
      (`custom_step.check`).
  """
  found = custom_step.overrides(model)
  custom_step.check(
      found, model_name=task.model_name, compiled=model.compiled,
      gradient_accumulation_steps=plan.batch.gradient_accumulation_steps,
      zero_stage=options.memory.zero_stage_resolved,
      clipnorm=options.optimization.clipnorm,
      global_clipnorm=options.optimization.global_clipnorm,
      enable_xla=options.precision.enable_xla,
      class_weight=options.task.class_weight,
      loss_or_metrics_given=(task.loss is not None or
                             task.metrics is not None),
      strategy=strategy, on_tpu=on_tpu,
      loss_scaled=isinstance(model.optimizer,
                             keras.optimizers.LossScaleOptimizer))
  trainer = _custom_step_trainer(
      model, task=task, strategy=strategy,
      steps_per_epoch=plan.steps_per_epoch,
      steps_per_execution=options.steps_per_execution,
      run_eagerly=options.loop.run_eagerly)
  checkpoint = _training_checkpoint(model, trainer=trainer,
                                    optimizer=model.optimizer,
                                    learning_rate=learning_rate)
  return Parts(model=model, optimizer=model.optimizer, trainer=trainer,
               checkpoint=checkpoint, objectives=None,
               metric_sums=objectives_lib.MetricSums([]))


def _custom_step_trainer(model: keras.Model, *, task: task_lib.Task,
                         strategy: tf.distribute.Strategy, **kwargs
                         ) -> custom_step.CustomStepTrainer:
  """`custom_step.build_trainer` for `model` on the task's examples
  (`kwargs`: its step settings)."""
  features, labels = task_lib.example_spec(task.dataset)
  weight = task_lib.sample_weight_spec(task.dataset)
  return custom_step.build_trainer(
      model, custom_step.overrides(model), strategy=strategy,
      batch_spec=(features, labels) + ((weight,) if weight is not None
                                       else ()), **kwargs)


def evaluation_parts(options: AssemblyOptions, *, task: task_lib.Task
                     ) -> Parts:
  """A model (in the current scope) with its loss and metrics, and no
  optimizer: what the side-car evaluator and `--mode=eval` need."""
  model = build_model(options, task=task)
  if custom_step.overrides(model):  # It evaluates with its own test_step.
    return Parts(model=model, optimizer=None, checkpoint=None,
                 trainer=_custom_step_trainer(
                     model, task=task, strategy=tf.distribute.get_strategy()),
                 metric_sums=objectives_lib.MetricSums([]))
  resolved, metric_sums = resolve_objectives(model, task=task)
  return Parts(model=model, optimizer=None, trainer=None, checkpoint=None,
               objectives=resolved, metric_sums=metric_sums)


def evaluation_trainer(parts: Parts, *, global_batch_size: int,
                       strategy: Optional[tf.distribute.Strategy] = None
                       ) -> Trainer:
  """A `Trainer` that evaluates `parts.model` in this process, with the
  run's loss and metrics, under `strategy` (the one `parts.model` was built
  in; None: the current one, e.g. the default strategy on the
  parameter-server coordinator). A model with its own step
  (`tfdist.training.step.custom_step`) keeps its `parts.trainer`."""
  if isinstance(parts.trainer, custom_step.CustomStepTrainer):
    return parts.trainer
  return Trainer(strategy=strategy or tf.distribute.get_strategy(),
                 model=parts.model,
                 optimizer=parts.optimizer or keras.optimizers.SGD(),
                 global_batch_size=global_batch_size,
                 loss=parts.objectives.loss, metrics=parts.metric_sums)


def load_init_checkpoint(model: keras.Model, path: str) -> str:
  """Loads weights into `model` before training (`--init_checkpoint`).

  Args:
    model: the built model.
    path: a Keras `.weights.h5` file; a checkpoint prefix written by tfdist
      or by `tf.train.Checkpoint(model=...)` (`.../ckpt-N`); or a folder
      holding such checkpoints (its latest), e.g. another run's
      `--model_dir` or its `checkpoints/`.

  Returns:
    The file or checkpoint prefix loaded.

  Raises:
    ConfigError: nothing at `path`, a checkpoint without a model, or a
      variable of another shape. A checkpoint that holds only part of the
      model (layers added for fine-tuning) is loaded, and the first
      variable left out is named in a warning.
  """
  if path.endswith(".weights.h5"):
    if not tf.io.gfile.exists(path):
      raise errors.ConfigError(f"--init_checkpoint={path}: no such file.")
    model.load_weights(path)
    logging.info("--init_checkpoint: loaded %s", path)
    return path
  prefix = path
  if tf.io.gfile.isdir(path):
    prefix = (tf.train.latest_checkpoint(path) or
              tf.train.latest_checkpoint(os.path.join(path, "checkpoints")))
    if not prefix:
      raise errors.ConfigError(
          f"--init_checkpoint={path} is a folder without checkpoints (and "
          "without a checkpoints/ folder holding some). Give a checkpoint "
          "prefix (.../ckpt-N), a folder of checkpoints, or a .weights.h5 "
          "file.")
  elif not tf.io.gfile.exists(prefix + ".index"):
    raise errors.ConfigError(
        f"--init_checkpoint={path}: no checkpoint there ({path}.index is "
        "missing). Give a checkpoint prefix (.../ckpt-N), a folder of "
        "checkpoints, or a .weights.h5 file.")
  if "model" not in checkpointing.root_children(prefix):
    raise errors.ConfigError(
        f"--init_checkpoint={path}: {prefix} holds no model (tfdist loads "
        "checkpoints written as tf.train.Checkpoint(model=...), as tfdist "
        "writes them, or .weights.h5 files).")
  try:
    status = tf.train.Checkpoint(model=model).restore(prefix)
  except ValueError as e:  # A variable of another shape.
    raise errors.ConfigError(
        f"--init_checkpoint={path}: {prefix} does not fit the "
        f"model: {first_line(e)}") from None
  try:
    status.assert_existing_objects_matched()
  except AssertionError as e:
    logging.warning("--init_checkpoint: %s matches the model only in part; "
                    "the rest keeps its initial values: %s", prefix,
                    first_line(e))
  status.expect_partial()
  logging.info("--init_checkpoint: loaded the model's weights from %s",
               prefix)
  return prefix


def current_learning_rate(optimizer) -> float:
  """The learning rate the optimizer applies at its current step."""
  inner = getattr(optimizer, "inner_optimizer", optimizer)
  return float(keras.ops.convert_to_numpy(inner.learning_rate))
