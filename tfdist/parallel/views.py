"""Checkpoint views of a split model's optimizer.

The modes that split a model (tensor, experts, pipeline x tensor, hybrid
ZeRO beside tensor parallelism) save their checkpoints under a one-device
run's keys: the unsharded model, and an optimizer of the trainer's class
and configuration built on it, whose variables each mode then makes save
the joined value of its own (`tfdist.parallel.tensor.mode._gather_through`).
"""

import keras
import tensorflow as tf


def optimizer_view(optimizer: keras.optimizers.Optimizer,
                   unsharded: keras.Model) -> keras.optimizers.Optimizer:
  """An optimizer of `optimizer`'s class and configuration, built on
  `unsharded`'s trainable variables on the host CPU: one variable (slot,
  iteration count, ...) in its one-device shape for each of a one-device
  run's, for a mode to pair with its own."""
  with tf.device("/cpu:0"):
    view = type(optimizer).from_config(optimizer.get_config())
    view.build(unsharded.trainable_variables)
  return view
