"""Batch normalization whose synchronized statistics take one all-reduce.

Keras 3's `BatchNormalization(synchronized=True)` (TensorFlow backend)
all-reduces the batch sum, the sum of squares and the count one at a time:
3 collectives in the forward pass and 2 more for their gradients, per layer
and step (its source has a TODO to batch them). Under
MultiWorkerMirroredStrategy each collective is a round trip between workers
(1 to 25 ms each measured on two pinned CPU workers): 10 of the CNN's 12
collectives per step. `BatchNormalization` here packs the three into one
vector per layer, so a layer costs 1 all-reduce forward and 1 backward. The
statistics are the same sums of the same values; only the packing differs.
"""

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tfdist")
class BatchNormalization(keras.layers.BatchNormalization):
  """`keras.layers.BatchNormalization` with packed synchronized moments.

  Takes the same arguments; with `synchronized=True` in a replica context of
  several replicas, the local sum, sum of squares and count [channels each]
  are concatenated and summed over every replica in one all-reduce; mean =
  sum / count, variance = max(E[x^2] - mean^2, 0), as Keras computes them.
  Otherwise (one replica, a mask, not synchronized) Keras's own moments.
  """

  def _moments(self, inputs, mask):
    context = tf.distribute.get_replica_context()
    if (not self.synchronized or mask is not None or context is None or
        context.num_replicas_in_sync == 1):
      return super()._moments(inputs, mask)
    # Keras computes the statistics of half-precision inputs in float32.
    x = tf.cast(inputs, tf.float32)
    axes = list(self._reduction_axes)
    local = tf.concat([tf.reduce_sum(x, axis=axes),
                       tf.reduce_sum(tf.square(x), axis=axes),
                       tf.reduce_sum(tf.ones_like(x), axis=axes)], axis=0)
    total = context.all_reduce(tf.distribute.ReduceOp.SUM, local)
    total_sum, squared_sum, count = tf.split(total, 3)
    mean = tf.math.divide_no_nan(total_sum, count)
    variance = tf.maximum(
        tf.math.divide_no_nan(squared_sum, count) - tf.square(mean), 0.0)
    return (tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype))
