"""Assembly: the model, optimizer, trainer and checkpoint of a run, once.

`build` creates every variable under the strategy's scope (so
ParameterServerStrategy places tables, dense weights and optimizer slots on
the ps tasks, and Mirrored strategies mirror them), wraps the optimizer for
the precision, and returns the parts every strategy uses the same way.
"""

import dataclasses
from typing import Optional

from absl import logging
import keras
import tensorflow as tf

import models
from tfdist import optimizers
from tfdist import precision
from tfdist.config import ConfigError
from tfdist.train_loop import Trainer


@dataclasses.dataclass(frozen=True)
class Parts:
  """The trainable state of a run and what trains it.

  Attributes:
    model: the Keras model (built under the strategy's scope).
    optimizer: its optimizer (a `LossScaleOptimizer` for fp16), built.
    trainer: the `tfdist.train_loop.Trainer` owning the compiled steps.
    checkpoint: a `tf.train.Checkpoint` over model, optimizer and the
      trainer's global step: the whole training state.
  """
  model: keras.Model
  optimizer: Optional[keras.optimizers.Optimizer]
  trainer: Optional[Trainer]
  checkpoint: Optional[tf.train.Checkpoint]


def check_model_name(name: str):
  """Raises `ConfigError` for a `--model` that no builder has."""
  if name not in models.model_names():
    raise ConfigError(f"--model={name!r} is unknown. Known: "
                      f"{', '.join(models.model_names())}.")


def check_model_options(config):
  """Raises `ConfigError` for model options the `--model` cannot honour
  (`--activation_recomputation` on a model without blocks to recompute);
  checked before any data or model is built."""
  models.check_recomputation(config.model, config.activation_recomputation)


def build_model(config, *, spec, sync_batch_norm: bool = False
                ) -> keras.Model:
  """The `--model` for the data set `spec` (in the current scope);
  `sync_batch_norm` from the run plan."""
  check_model_name(config.model)
  return models.build_model(
      config.model, spec=spec, embedding_dim=config.embedding_dim,
      hash_buckets=config.hash_buckets, sync_batch_norm=sync_batch_norm,
      activation_recomputation=config.activation_recomputation)


def build(config, *, spec, strategy: tf.distribute.Strategy, plan,
          on_tpu: bool = False) -> Parts:
  """Builds model, optimizer, trainer and checkpoint under `strategy`.

  Args:
    config: the run's `TrainConfig` (model, optimizer and precision fields).
    spec: the data set's `DatasetSpec`.
    strategy: the run's strategy.
    plan: the `tfdist.run_plan.RunPlan` (global batch, LR schedule).
    on_tpu: the strategy is TPU (XLA everywhere; padded evaluation).

  Returns:
    `Parts`.
  """
  with strategy.scope():
    model = build_model(config, spec=spec,
                        sync_batch_norm=plan.sync_batch_norm)
    optimizer = precision.wrap_optimizer_for_precision(
        optimizers.build_optimizer(config.optimizer, plan.lr.schedule,
                                   momentum=config.momentum,
                                   weight_decay=config.weight_decay,
                                   clipnorm=config.clipnorm,
                                   global_clipnorm=config.global_clipnorm),
        dtype=config.dtype, loss_scale=config.loss_scale)
    # Every optimizer variable now, under the scope (created lazily in the
    # first step, ParameterServerStrategy would place it on the
    # coordinator).
    optimizer.build(model.trainable_variables)
  model.optimizer = optimizer  # Keras callbacks read `model.optimizer`.
  trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                    global_batch_size=plan.global_batch_size,
                    steps_per_execution=config.steps_per_execution,
                    # TPUs compile everything with XLA already.
                    enable_xla=config.enable_xla and not on_tpu,
                    run_eagerly=config.run_eagerly, task=spec.task,
                    eval_example_weights=on_tpu,
                    gradient_accumulation_steps=(
                        plan.batch.gradient_accumulation_steps))
  if config.enable_xla:
    logging.info(
        "--enable_xla: %s", "TPUs compile every step with XLA already."
        if on_tpu else "Keras 3 turns XLA off under a tf.distribute "
        "strategy, so tfdist jit-compiles its own per-replica forward and "
        "backward pass (the optimizer update stays outside XLA).")
  checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer,
                                   global_step=trainer.global_step)
  return Parts(model=model, optimizer=optimizer, trainer=trainer,
               checkpoint=checkpoint)


def evaluation_trainer(parts: Parts, *, spec, global_batch_size: int
                       ) -> Trainer:
  """A `Trainer` that evaluates `parts.model` in this process, with the
  default strategy (the parameter-server coordinator, the side-car
  evaluator)."""
  return Trainer(strategy=tf.distribute.get_strategy(), model=parts.model,
                 optimizer=parts.optimizer or keras.optimizers.SGD(),
                 global_batch_size=global_batch_size, task=spec.task)


def current_learning_rate(optimizer) -> float:
  """The learning rate the optimizer applies at its current step."""
  inner = getattr(optimizer, "inner_optimizer", optimizer)
  return float(keras.ops.convert_to_numpy(inner.learning_rate))
