"""A small convolutional network for 28x28x1 images (Fashion-MNIST)."""

import keras
from keras import layers

from . import batch_norm
from . import recompute


def build_cnn(*, input_shape=(28, 28, 1), num_classes: int = 10,
              width: int = 32, convs_per_block: int = 1,
              dropout: float = 0.3,
              sync_batch_norm: bool = False,
              activation_recomputation: bool = False) -> keras.Model:
  """Two conv blocks (conv-BN-ReLU x `convs_per_block`, max-pool), dense head.

  Args:
    input_shape: one image, float32 in [0, 1], e.g. (28, 28, 1).
    num_classes: output logits.
    width: filters of the first block; the second has twice as many.
    convs_per_block: conv-BN-ReLU layers per block.
    dropout: dropout rate before the classifier.
    sync_batch_norm: batch normalization over the global batch: statistics
      summed across replicas at every training step (Keras's
      `synchronized=True`, its three all-reduces packed into one:
      `tfdist.models.batch_norm`); False: over each replica's share.
    activation_recomputation: the two conv blocks recompute their
      activations in the backward pass (`models.recompute`; the dense head,
      which holds the dropout, is not recomputed).

  Returns:
    A `keras.Model` mapping float32 [batch, *input_shape] to float32 logits
    [batch, num_classes] (about 0.42 M parameters with the defaults; about
    120 ms per training step of 128 examples on a 2-core CPU).
  """
  inputs = keras.Input(shape=input_shape, name="image")
  x = inputs
  block_outputs = []
  for filters in (width, 2 * width):
    for _ in range(convs_per_block):
      x = layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
      x = batch_norm.BatchNormalization(synchronized=sync_batch_norm)(x)
      x = layers.ReLU()(x)
    x = layers.MaxPooling2D()(x)
    block_outputs.append(x)
  x = layers.Flatten()(x)
  x = layers.Dense(128, activation="relu")(x)
  x = layers.Dropout(dropout)(x)
  x = layers.Dense(num_classes)(x)
  outputs = layers.Activation("linear", dtype="float32", name="logits")(x)
  if activation_recomputation:
    return recompute.recomputing_model(inputs, outputs,
                                       boundaries=block_outputs, name="cnn")
  return keras.Model(inputs, outputs, name="cnn")
