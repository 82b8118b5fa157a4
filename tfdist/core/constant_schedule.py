"""A constant learning rate as a Keras schedule (`--lr_schedule=constant`)."""

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tfdist")
class ConstantLearningRate(keras.optimizers.schedules.LearningRateSchedule):
  """A constant learning rate, as a schedule (so it serializes with the rest).

  Args:
    learning_rate: the value returned for every step.
  """

  def __init__(self, learning_rate: float):
    self.learning_rate = float(learning_rate)

  def __call__(self, step):
    del step
    return tf.constant(self.learning_rate, tf.float32)

  def get_config(self):
    return {"learning_rate": self.learning_rate}
