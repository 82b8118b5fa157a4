"""A small ResNet (He et al. 2016, "Deep Residual Learning") for 28x28 images."""

import keras
from keras import layers

from . import batch_norm as batch_norm_lib
from . import recompute


def _residual_block(x, filters: int, stride: int, batch_norm):
  shortcut = x
  y = layers.Conv2D(filters, 3, strides=stride, padding="same",
                    use_bias=False)(x)
  y = batch_norm()(y)
  y = layers.ReLU()(y)
  y = layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
  y = batch_norm()(y)
  if stride != 1 or shortcut.shape[-1] != filters:
    shortcut = layers.Conv2D(filters, 1, strides=stride, use_bias=False)(x)
    shortcut = batch_norm()(shortcut)
  return layers.ReLU()(layers.Add()([y, shortcut]))


def build_resnet(*, input_shape=(28, 28, 1), num_classes: int = 10,
                 stage_filters=(32, 64, 128),
                 blocks_per_stage: int = 2,
                 sync_batch_norm: bool = False,
                 activation_recomputation: bool = False) -> keras.Model:
  """A ResNet of basic blocks: stem, 3 stages, global pooling, classifier.

  Args:
    input_shape: one image, float32, e.g. (28, 28, 1).
    num_classes: output logits.
    stage_filters: filters per stage; stages after the first halve the
      spatial size.
    blocks_per_stage: basic residual blocks per stage.
    sync_batch_norm: batch normalization over the global batch: statistics
      summed across replicas at every training step (Keras's
      `synchronized=True`, its three all-reduces packed into one:
      `tfdist.models.batch_norm`); False: over each replica's share.
    activation_recomputation: the stem and every residual block recompute
      their activations in the backward pass (`models.recompute`: same
      layers, variables, checkpoints and gradients; less memory, about one
      more forward pass of compute).

  Returns:
    A `keras.Model` mapping float32 [batch, *input_shape] to float32 logits
    [batch, num_classes].
  """
  batch_norm = lambda: batch_norm_lib.BatchNormalization(
      synchronized=sync_batch_norm)
  inputs = keras.Input(shape=input_shape, name="image")
  x = layers.Conv2D(stage_filters[0], 3, padding="same", use_bias=False)(inputs)
  x = batch_norm()(x)
  x = layers.ReLU()(x)
  block_outputs = [x]
  for stage, filters in enumerate(stage_filters):
    for block in range(blocks_per_stage):
      stride = 2 if stage > 0 and block == 0 else 1
      x = _residual_block(x, filters, stride, batch_norm)
      block_outputs.append(x)
  x = layers.GlobalAveragePooling2D()(x)
  x = layers.Dense(num_classes)(x)
  outputs = layers.Activation("linear", dtype="float32", name="logits")(x)
  if activation_recomputation:
    return recompute.recomputing_model(inputs, outputs,
                                       boundaries=block_outputs,
                                       name="resnet")
  return keras.Model(inputs, outputs, name="resnet")
