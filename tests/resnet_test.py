"""Unit tests of models/resnet.py: shapes, stages, recomputation."""

import keras
import numpy as np
import tensorflow as tf

from models import recompute
from models import resnet


def test_logits_for_a_batch_of_images():
  model = resnet.build_resnet(input_shape=(28, 28, 1), num_classes=10,
                              stage_filters=(4, 8), blocks_per_stage=1)
  logits = model(np.zeros((2, 28, 28, 1), np.float32), training=False)
  assert logits.shape == (2, 10) and logits.dtype == tf.float32
  assert model.name == "resnet"


def test_later_stages_halve_the_spatial_size():
  model = resnet.build_resnet(stage_filters=(4, 8, 16), blocks_per_stage=1)
  pooled = [l for l in model.layers
            if isinstance(l, keras.layers.GlobalAveragePooling2D)][0]
  # 28 -> 14 -> 7 over the two strided stages, 16 filters in the last.
  assert tuple(pooled.input.shape) == (None, 7, 7, 16)


def test_a_projection_shortcut_only_where_the_shape_changes():
  model = resnet.build_resnet(stage_filters=(4, 8), blocks_per_stage=2)
  one_by_one = [l for l in model.layers if isinstance(l, keras.layers.Conv2D)
                and l.kernel_size == (1, 1)]
  assert len(one_by_one) == 1


def test_recomputation_wraps_the_stem_and_every_block():
  model = resnet.build_resnet(stage_filters=(4, 8), blocks_per_stage=2,
                              activation_recomputation=True)
  assert isinstance(model, recompute.RecomputingModel)
  assert model.num_recomputed_segments == 1 + 2 * 2
