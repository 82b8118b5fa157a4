"""Activation recomputation (gradient checkpointing) for functional models.

`recomputing_model(inputs, outputs, boundaries=...)` builds the same
functional model as `keras.Model(inputs, outputs)`, with the same layers,
variables and checkpoint layout, but its training forward pass runs in
segments cut at `boundaries` (block outputs, e.g. each residual block's),
each wrapped in `tf.recompute_grad` (Chen et al. 2016, "Training Deep Nets
with Sublinear Memory Cost"): a segment keeps only its input for the
backward pass and runs its forward pass again there, so activations inside
blocks are not kept between the forward and the backward pass. The
gradients are the same (recomputing runs the same ops on the same inputs);
the cost is about one more forward pass per step.

Because the layers and their order are those of the plain model, a
checkpoint written with recomputation restores without it and back, and
the SavedModel is the same. Inference (`training=False`) runs the graph as
usual.

Stateful layers inside a recomputed segment:

* batch normalization would update its moving mean and variance twice per
  step (once more in the recomputation): during the recomputation its
  momentum is set to 1, so the moving statistics get exactly one update, as
  without recomputation;
* layers that draw random numbers (dropout, noise) would draw another mask
  in the recomputation, so the gradient would not match the forward pass:
  segments holding them are refused (`ValueError`); keep them outside the
  recomputed blocks (the built-in models have dropout only in their heads).

`tf.recompute_grad` inside a Keras 3 layer was measured to give identical
gradients and to train under MirroredStrategy (../shared notes).
"""

import contextlib
from typing import Sequence

import keras
import tensorflow as tf

from tfdist.runtime import private_api


def _layers_between(segment: keras.Model):
  return private_api.flatten_layers(segment, include_self=False)


@contextlib.contextmanager
def _one_statistics_update(batch_norms):
  """While the segment is recomputed, batch norm leaves its moving
  statistics as they are (momentum 1: `moving * 1 + batch * 0`)."""
  saved = [bn.momentum for bn in batch_norms]
  for bn in batch_norms:
    bn.momentum = 1.0
  try:
    yield
  finally:
    for bn, momentum in zip(batch_norms, saved):
      bn.momentum = momentum


class RecomputingModel(keras.Model):
  """A functional model whose training pass recomputes its segments.

  Construct with `recomputing_model` (it checks the segments).

  Args:
    inputs: the model's input KerasTensor (one tensor).
    outputs: its output KerasTensor.
    boundaries: KerasTensors between `inputs` and `outputs`, in graph order,
      where segments end (each segment is the graph from one boundary to
      the next; `inputs` starts the first, `outputs` ends the last). Each
      boundary must separate the graph: nothing after it may read a tensor
      from before it (a residual block's output does; a tensor inside a
      block does not).
    recompute_last: also recompute the last segment (to `outputs`, usually
      the head); default False.
    name: the model's name.
  """

  def __init__(self, inputs, outputs, boundaries: Sequence = (),
               recompute_last: bool = False, name=None, **kwargs):
    super().__init__(inputs, outputs, name=name, **kwargs)
    ends = list(boundaries) + [outputs]
    segments, start = [], inputs
    for end in ends:
      # A view of the same layers from `start` to `end` (Keras clones only
      # the graph nodes; layers and variables are shared).
      segments.append(keras.Model(start, end))
      start = end
    recompute = [True] * (len(segments) - 1) + [bool(recompute_last)]
    for segment, flag in zip(segments, recompute):
      if not flag:
        continue
      random_layers = [l.name for l in _layers_between(segment)
                       if getattr(l, "_seed_generators", None)]
      if random_layers:
        raise ValueError(
            f"Cannot recompute a segment with random layers "
            f"({', '.join(random_layers)}): the recomputation would draw "
            "other random numbers than the forward pass, so the gradient "
            "would not match it. Keep them outside the recomputed blocks.")
    # Not tracked (object.__setattr__): the segments share the model's
    # layers, so the checkpoint layout stays the plain model's.
    object.__setattr__(self, "_tfdist_segments", tuple(
        (segment, flag, [l for l in _layers_between(segment)
                         if isinstance(l, keras.layers.BatchNormalization)])
        for segment, flag in zip(segments, recompute)))

  @property
  def num_recomputed_segments(self) -> int:
    """Segments whose activations are recomputed in the backward pass."""
    return sum(1 for _, flag, _ in self._tfdist_segments if flag)

  def call(self, inputs, training=None, mask=None):
    if not training:
      return super().call(inputs, training=training, mask=mask)
    x = inputs
    for segment, flag, batch_norms in self._tfdist_segments:
      if flag:
        x = _recomputed(segment, batch_norms)(x)
      else:
        x = segment(x, training=True)
    return x


def _recomputed(segment, batch_norms):
  """`segment` wrapped in `tf.recompute_grad`; the second call of the
  wrapped function (the recomputation, in the backward pass) leaves batch
  norm's moving statistics alone."""
  calls = [0]

  def forward(x):
    calls[0] += 1
    if calls[0] == 1:
      return segment(x, training=True)
    with _one_statistics_update(batch_norms):
      return segment(x, training=True)

  return tf.recompute_grad(forward)


def recomputing_model(inputs, outputs, *, boundaries: Sequence,
                      name=None) -> RecomputingModel:
  """`keras.Model(inputs, outputs, name=name)` that recomputes activations.

  Args:
    inputs: one input KerasTensor.
    outputs: the output KerasTensor.
    boundaries: block outputs (KerasTensors) in graph order; every segment
      but the last (the head) is recomputed.
    name: the model's name.

  Returns:
    A `RecomputingModel` with the plain model's layers and variables.

  Raises:
    ValueError: no boundary, several inputs, or a recomputed segment with
      random layers.
  """
  if not boundaries:
    raise ValueError("recomputing_model needs at least one boundary.")
  if isinstance(inputs, (list, tuple, dict)):
    raise ValueError("recomputing_model takes one input tensor.")
  return RecomputingModel(inputs, outputs, boundaries=boundaries, name=name)
