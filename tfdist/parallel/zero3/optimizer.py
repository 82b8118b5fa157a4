"""ZeRO stage 3 (`--zero_stage=3`): the weights themselves sharded.

Rajbhandari et al. 2020. Stages 1 and 2 (`tfdist.parallel.data.sharded_optimizer`)
keep a whole copy of every weight on every replica. Stage 3 keeps, per
replica, only its shard of a flat, padded float32 buffer laid out block
by block (`sharded_optimizer.FlatLayout` with `blocks`: the model is cut
into at most `ShardingOptions.num_blocks` (`--zero3_blocks`) blocks of consecutive layer
calls, `plan_blocks`; block b's weights padded to N x S_b, replica r
owning its elements [r x S_b, (r + 1) x S_b); the shard [S] is the
replica's slice of every block, in order):

* **Storage.** The shard is the master variable of stage 1 (sync-on-read,
  aggregation NONE: a different [S] on every replica), kept between steps
  instead of emptied. The model is built as usual (so its initial weights
  are those of an unsharded run with the same seed), its trainable weights
  are copied into the shards, and the Keras variables' own storage is then
  released: they keep their shape and dtype. Between steps, in eager code
  of a one-process run (a Keras callback's `get_weights`, `set_weights`),
  reading one gathers a temporary copy from the shards and assigning one
  writes into them; elsewhere (traced code, several workers) it raises
  `tfdist.errors.WeightsShardedError`.
* **Forward and backward, block by block** (`_replica_block`). Each
  block is a `tf.custom_gradient` of its inputs, the replica's slice of
  its weights [S_b], and the values of the replicated weights and the
  non-trainable state (batch-norm statistics, seed states) it reads. The
  forward pass all-gathers the slice ([S_b] -> [N x S_b]) once the block
  before has produced its output (a control dependency; with `prefetch`,
  once that block starts) and runs the block's layers under
  `keras.StatelessScope(state_mapping=...)`, which gives them the
  gathered tensors in place of their variables; nothing gathered is kept.
  The backward pass gathers again once the block's upstream gradient
  exists, recomputes the block under a tape (its seed states are inputs:
  the same dropout masks; the recomputation's state updates are dropped,
  the forward pass's written once after the pass), and all-reduces the
  gathered weights' gradient (in `--all_reduce_dtype`), keeping this
  replica's slice: the gradient is shard-shaped and summed over
  replicas. Under mixed precision the weights the layers autocast
  (`autocast_elements`) are gathered in the compute dtype, half the
  bytes, rounded as the layers would round them. Stage 1's update
  (`ShardedOptimizer.replica_prepare` with `shard=`: the fp16 finite
  check, unscaling, clipping, then the per-replica Keras optimizer copy)
  applies the gradient to the shard in place. No gather of updated
  weights follows: the next step's gathers read the shards.
* **One block** (a model `plan_blocks` cannot cut: subclassed without a
  functional graph, a layer called twice, a weight shared across
  blocks, weight regularizers, fewer than two layers with weights; or
  `--zero3_blocks=1`): the whole buffer is all-gathered once for the step and
  the model runs under the scope, differentiated as a whole (the
  all-gather's gradient written out in `_all_gather_shards`).
* **Replicated weights** (`replicated_variables`: embedding tables):
  mirrored as at stage 0 and read in place (gathering a table each step
  would move the whole vocabulary); their gradients are placed in the
  gradient of their block's gathered weights (of the whole buffer, as
  one block) before its all-reduce, their optimizer state is sharded
  as at stage 1 (their pieces of the master shard are refreshed from the
  variables before the update), and after it each replica's updated
  pieces are summed into every copy (one all-reduce of their size).
* **Non-trainable state** (batch-norm moving statistics, the random
  layers' seed states) keeps its ordinary mirrored variables: the updates
  the layers make inside the scope are written to them after the pass.
* **Evaluation** gathers block by block too (each block after the one
  before it has run; a replica with an empty batch runs the blocks on
  one example of zeros, dropped, so it joins every gather).
* **Checkpoints** write the shards where they live, with no gather: each
  weight under its unsharded key, as slices of its unsharded shape
  (`Zero3Optimizer.weight_saveables`: each replica's run of the weight's
  row-major elements cut into rectangular boxes, each saved with
  TensorFlow's slice spec, "full shape offset,length:..."), so
  `tf.train.list_variables` shows the full shape and
  `tf.train.load_checkpoint` reads the weight whole; restoring reads only
  the boxes the local replicas hold, so a stage-3 checkpoint restores into
  stages 0-2, one device and any replica count, and back. The optimizer's
  slots are saved as stage 1 saves them (slices too). With replicas on
  other workers a weight is still gathered and saved whole.
* **Export** (and a `tfdist.fit` caller) gets the weights back:
  `materialize` gathers them into the Keras variables again at the end of
  the run, so the SavedModel is the unsharded model's.

Costs: each block's weights are gathered twice per step (forward and
backward) and each block computed twice (the recomputation); the step's
peak holds the largest block's gathered weights (two blocks' with
prefetch) instead of the whole model's (`benchmarks/zero3_peak.py`;
measured in docs/guides/sharded-training.md, "Stage 3"), in evaluation
too. Traffic per step: the all-gathers (2 P'),
the gradients' all-reduces (2 P' on a ring): 2x plain data parallelism,
more than ZeRO's 1.5x (the same gathers, then a reduce-scatter of P')
because CPU collectives offer no reduce-scatter (the gradient is an
all-reduce, then a slice).

What is refused at start (`check_model`, and the flags:
`--model=ranking`, whose tables are plain `tf.Variable`s), with the
reason: a model with its own `train_step` (it runs its own forward pass on the unsharded
variables), non-float32 trainable variables, XLA, pipeline stages, and
optimizers that need a whole variable (LAMB, as stages 1-2).
"""

import dataclasses
import types
from typing import List, Optional, Tuple

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfdist import errors
from tfdist.parallel import cutting
from tfdist.parallel import mode as mode_lib
from tfdist.parallel.pipeline import stages as pipeline
from tfdist.runtime import private_api
from tfdist.training.step import custom_step
from tfdist.core import reduce_dtype
from tfdist.parallel.data import sharded_optimizer

STAGE = 3
# The step mode that runs on this optimizer (`tfdist.parallel.zero3.mode`).
MODE_NAME = "zero3"
_VARIABLE_VALUE = "VARIABLE_VALUE"


def _all_gather_shards(context, shard, cast=None) -> tf.Tensor:
  """Every replica's `shard` (float32 [S], the same S on all), concatenated
  in replica order: float32 [N x S]. Replica context.

  `cast` (from `autocast_elements`), if given: `(dtype, mask)`, mask a
  bool array [N x S]; the elements it marks travel in `dtype` (half the
  bytes of float32 for bfloat16 and float16) and come back rounded to it,
  still as float32: what the layers' autocast makes of them anyway.

  `ReplicaContext.all_gather`, with its gradient written here: the
  all-reduced gradient sliced at `replica_id_in_sync_group x S`. The
  built-in gradient takes the slice with `tf.gather` at
  `tf.range(begin, end)`, and a compiled step that differentiates it keeps
  a shard-sized buffer between calls (measured:
  `benchmarks/gather_memory.py`).
  """
  size = int(shard.shape[0])

  @tf.custom_gradient
  def gather(value):
    def gradient(upstream):
      summed = context.all_reduce(tf.distribute.ReduceOp.SUM, upstream)
      return tf.slice(summed, [context.replica_id_in_sync_group * size],
                      [size])
    if cast is None:
      return context.all_gather(value, axis=0), gradient
    return _gather_cast(context, value, *cast), gradient

  return gather(shard)


def _runs(marked: np.ndarray) -> list:
  """`(start, end, value)` of the runs of equal values in bool `marked`."""
  edges = [0] + list(np.flatnonzero(np.diff(marked)) + 1) + [marked.size]
  return [(a, b, bool(marked[a])) for a, b in zip(edges[:-1], edges[1:])]


def _gather_cast(context, shard, dtype, mask) -> tf.Tensor:
  """`_all_gather_shards` with the elements `mask` marks in `dtype`: two
  all-gathers (the marked elements of each shard, cast and padded to the
  most any shard has; the others in float32), put back in flat order.
  Static slices only: index arrays would be constants of the size of the
  buffer, kept by the compiled step."""
  replicas = mask.size // int(shard.shape[0])
  masks = mask.reshape(replicas, -1)
  sizes = {True: int(masks.sum(axis=1).max()),
           False: int((~masks).sum(axis=1).max())}
  sizes[True] += sizes[True] % 2  # Even: bfloat16 travels in pairs.
  replica = int(tf.get_static_value(context.replica_id_in_sync_group))
  runs = _runs(masks[replica])

  def gather(marked, part_dtype):
    pieces = [shard[a:b] for a, b, value in runs if value == marked]
    count = sum(int(p.shape[0]) for p in pieces)
    piece = tf.cast(tf.concat(pieces + [tf.zeros([sizes[marked] - count])],
                              axis=0), part_dtype)
    if part_dtype != tf.bfloat16:
      return context.all_gather(piece, axis=0)
    # CPU collectives refuse bfloat16: it travels as int32 (pairs of
    # elements' bits; a gather moves bits, no arithmetic).
    words = tf.bitcast(tf.reshape(piece, [-1, 2]), tf.int32)
    return tf.reshape(tf.bitcast(context.all_gather(words, axis=0),
                                 tf.bfloat16), [-1])

  gathered = {True: tf.cast(gather(True, dtype), tf.float32)}
  if sizes[False]:
    gathered[False] = gather(False, tf.float32)
  out = []
  for r in range(replicas):
    at = {True: r * sizes[True], False: r * sizes[False]}
    for a, b, value in _runs(masks[r]):
      out.append(gathered[value][at[value]:at[value] + b - a])
      at[value] += b - a
  return tf.concat(out, axis=0)


def autocast_elements(model: keras.Model, layout, variables):
  """`(dtype, mask)` for `_all_gather_shards`: the elements of the flat
  buffer (`layout` of `variables`: bool [P'], padding marked) whose
  weights the model's layers autocast to their compute dtype `dtype`
  when read (Keras: the variable's `autocast` is on and its layer's
  `autocast` too, with a float compute dtype other than float32; not
  batch or layer normalization, which keep float32). None when no
  weight is autocast, or layers autocast to different dtypes."""
  dtypes = {}
  for layer in private_api.flatten_layers(model, include_self=True):
    dtype = layer.compute_dtype
    if (layer.autocast and dtype != layer.variable_dtype and
        dtype in ("bfloat16", "float16")):
      for v in layer._trainable_variables:  # pylint: disable=protected-access
        if v._autocast:  # pylint: disable=protected-access
          dtypes[id(v)] = dtype
  if len(set(dtypes.values())) != 1:
    return None
  mask = np.ones([layout.padded_total], bool)
  for j, v in enumerate(variables):
    off, n = layout.offsets[j], layout.sizes[j]
    mask[off:off + n] = id(v) in dtypes
  return tf.as_dtype(next(iter(dtypes.values()))), mask


def check_model(model: keras.Model) -> None:
  """Refuses a model stage 3 cannot train, before anything is sharded.

  Embedding layers are not refused: their tables stay replicated
  (`replicated_variables`).

  Raises:
    tfdist.errors.ConfigError: a model overriding `train_step` (or
      `compute_loss`, ...: `tfdist.training.step.custom_step.overrides`), or a
      trainable variable that is not float32; each names `--zero_stage=3`
      and the fix.
  """
  own_step = custom_step.overrides(model)
  if own_step:
    raise errors.ConfigError(
        f"--zero_stage=3: model {model.name!r} defines its own step "
        f"({', '.join(own_step)}), which reads the model's variables "
        "directly, and stage 3 keeps no whole copy of them. Drop the "
        "override, or use --zero_stage=1 or 2.")
  for v in model.trainable_variables:
    if v.dtype != "float32":
      raise errors.ConfigError(
          f"--zero_stage=3 shards float32 variables; {v.path} is {v.dtype}. "
          "Keep trainable variables in float32 (Keras mixed precision "
          "does), or use --zero_stage=0.")


def replicated_variables(model: keras.Model) -> list:
  """The trainable variables stage 3 keeps replicated, not sharded: the
  tables of embedding layers (`keras.layers.Embedding` and subclasses).
  Gathering a table for each step would move the whole vocabulary; kept
  mirrored, it is read in place, as at stage 0, and only its optimizer
  state is sharded (as at stage 1)."""
  out, seen = [], set()
  for layer in private_api.flatten_layers(model, include_self=False):
    if isinstance(layer, keras.layers.Embedding):
      for v in layer.trainable_variables:
        if id(v) not in seen:
          seen.add(id(v))
          out.append(v)
  return out


_REGULARIZERS = ("kernel_regularizer", "bias_regularizer",
                 "activity_regularizer", "embeddings_regularizer",
                 "gamma_regularizer", "beta_regularizer",
                 "depthwise_regularizer", "pointwise_regularizer",
                 "recurrent_regularizer")


@dataclasses.dataclass(frozen=True)
class Block:
  """Consecutive layer calls of the model whose weights are gathered
  together (one `FlatLayout` block).

  Attributes:
    stage: the calls, as `tfdist.parallel.pipeline.split_model` cuts them
      (`stage.run` runs them; it carries tensors later blocks read).
    index: the block's index in the layout (`FlatLayout.blocks`).
    sharded: `(position in the block, variable)` of the weights read
      from the gathered region (released at rest).
    replicated: `(position in the block, variable)` of the weights kept
      replicated (`replicated_variables`), read from their own storage.
    state: the non-trainable variables its layers read and update (batch
      normalization's moving statistics, random layers' seed states).
  """
  stage: pipeline.Stage
  index: int
  sharded: Tuple[Tuple[int, object], ...]
  replicated: Tuple[Tuple[int, object], ...]
  state: Tuple[object, ...]


def _has_regularizers(model: keras.Model) -> bool:
  return any(getattr(layer, name, None) is not None
             for layer in private_api.flatten_layers(model, include_self=False)
             for name in _REGULARIZERS)


def _adds_losses(model: keras.Model) -> bool:
  """Whether a forward pass of `model` adds losses (`add_loss` in a
  layer's `call`): one pass on a batch of one example of zeros, its state
  updates and losses kept in a scope and dropped. False when the model
  cannot be called so (its inputs' shapes unknown)."""
  try:
    inputs = [np.zeros([1] + [d or 1 for d in t.shape[1:]],
                       keras.backend.standardize_dtype(t.dtype))
              for t in model.inputs]
  except (AttributeError, TypeError, ValueError):
    return False
  with keras.StatelessScope(collect_losses=True) as scope:
    model(inputs if len(inputs) > 1 else inputs[0], training=True)
  return bool(scope.losses)


def plan_blocks(model, variables, num_blocks: int, replicated=()):
  """Cuts `model` into at most `num_blocks` blocks of consecutive layer
  calls with about equal sharded weight bytes (the largest block's
  gathered weights are the step's peak), each holding trainable weights.

  Args:
    model: a built functional or Sequential Keras model.
    variables: its trainable variables (the layout's order).
    num_blocks: the most blocks; 1 keeps the whole model one block.
    replicated: the variables kept replicated (not counted in the
      balance: they are not gathered).

  Returns:
    `(split, blocks)`: the `pipeline.Pipeline` the blocks come from and
    a list of layout blocks (lists of indices into `variables`), or None
    when the model is one block: `num_blocks` 1, a subclassed model
    without a functional graph, a layer called twice or a weight shared
    across blocks, weight regularizers (their losses read every weight
    after the forward pass), a layer adding a loss as it runs
    (`add_loss`: a pass on one example of zeros says), or fewer than two
    layers with weights.
  """
  if num_blocks <= 1 or _has_regularizers(model) or _adds_losses(model):
    return None
  try:
    calls = cutting.model_calls(model)[0]
  except errors.PipelineConfigError:
    return None
  index = {id(v): j for j, v in enumerate(variables)}
  skip = {id(v) for v in replicated}
  seen, costs, weighted = set(), [], []
  for call in calls:
    own = [v for v in getattr(call.layer, "trainable_variables", [])
           if id(v) in index and id(v) not in seen]
    seen.update(id(v) for v in own)
    weighted.append(bool(own))
    costs.append(sum(int(np.prod(v.shape)) for v in own
                     if id(v) not in skip))
  count = min(int(num_blocks), sum(weighted))
  if count <= 1:
    return None
  starts = cutting.balanced_cuts(costs, count)
  # Each block holds trainable weights: one without is joined to the
  # block before it (the first, to the block after it).
  bounds = [0] + starts + [len(calls)]
  ranges = []
  for a, b in zip(bounds[:-1], bounds[1:]):
    if ranges and not any(weighted[a:b]):
      ranges[-1] = (ranges[-1][0], b)
    else:
      ranges.append((a, b))
  if len(ranges) > 1 and not any(weighted[slice(*ranges[0])]):
    ranges[:2] = [(ranges[0][0], ranges[1][1])]
  if len(ranges) <= 1:
    return None
  keep = [a for a, _ in ranges]
  names = [call.layer.name for call in calls]
  try:
    split = pipeline.split_model(model, cuts=[names[a] for a in keep[1:]],
                                 devices=[""] * len(keep))
  except errors.PipelineConfigError:
    return None
  blocks, placed = [], set()
  for stage in split.stages:
    block = [index[id(v)] for v in stage.trainable_variables
             if id(v) in index and index[id(v)] not in placed]
    placed.update(block)
    blocks.append(block)
  blocks[-1] += [j for j in range(len(variables)) if j not in placed]
  if not all(blocks):
    return None
  return split, blocks


def _released(path: str, owner: "Zero3Optimizer", index: int):
  """The initializer a released weight reads through: in eager code with
  every replica in this process (a callback's `get_weights`), the weight
  gathered from the shards, a temporary copy; elsewhere (a traced
  function, or replicas on other workers, which a read on one task would
  wait for) `tfdist.errors.WeightsShardedError`."""
  def initializer(shape, dtype=None):
    del shape
    if tf.executing_eagerly() and owner.all_local:
      return tf.cast(owner.full_weight(index), dtype or tf.float32)
    raise errors.WeightsShardedError(
        f"{path} is sharded (--zero_stage=3): each replica holds 1/N of it, "
        "and the whole weight exists only inside a training or evaluation "
        "step" + ("" if owner.all_local else
                  " (read between steps only with every replica in one "
                  "process)") + ". Read the weights from a checkpoint "
        "(saved unsharded) or after training ends (tfdist gathers them "
        "for the export).")
  return initializer


_RELEASED_CLASSES = {}


def _released_class(cls: type) -> type:
  """The subclass of a Keras variable class that a released weight takes
  (one per class, cached): TensorFlow checkpoints it through
  `_gather_saveables_for_checkpoint` (its owner's `weight_saveables`)
  rather than the class's `_serialize_to_tensors`. TensorFlow's savers
  take the first of the two they meet along the class's MRO; only the
  saveable route restores a key saved as several slices (the tensor
  route passes only the first slice of a key to `_restore_from_tensors`).
  `materialize` gives the variable its class back."""
  if cls not in _RELEASED_CLASSES:
    def _gather_saveables_for_checkpoint(self):
      owner, index, _ = self._tfdist_zero3  # pylint: disable=protected-access

      def factory(name):
        return owner.weight_saveables(index, name)
      return {_VARIABLE_VALUE: factory}

    _RELEASED_CLASSES[cls] = type(
        f"Released{cls.__name__}", (cls,),
        {"_gather_saveables_for_checkpoint": _gather_saveables_for_checkpoint,
         "__module__": __name__})
  return _RELEASED_CLASSES[cls]


class Zero3Optimizer(sharded_optimizer.ShardedOptimizer):
  """ZeRO stage 3: the master shards are the only copy of the weights.

  Constructed by the `Trainer` for `ShardingOptions(stage=3)` (registered
  with `sharded_optimizer.register_stage`); arguments as
  `ShardedOptimizer`'s. `variables` (the model's trainable variables)
  must hold the initial weights: they are copied into the shards and the
  variables' storage is released.

  Raises:
    tfdist.errors.ConfigError: as `ShardedOptimizer` (LAMB, non-float32
      variables).
  """

  def __init__(self, **kwargs):
    options = kwargs["options"]
    # `ShardingOptions.num_blocks` and `prefetch` (`_layout_blocks`, in
    # the base class's constructor, reads the first).
    self.num_blocks = options.num_blocks
    self.prefetch = options.prefetch
    self._split = None
    self.blocks: Optional[List[Block]] = None
    super().__init__(**kwargs)
    self.model = None
    self.materialized = False
    # Indices (into `variables`) of the weights kept replicated
    # (`replicated_variables`), chosen by `attach`; the others are
    # released and live only in the shards.
    self.replicated: List[int] = []
    self._sharded_indices = list(range(len(self.variables)))
    # `autocast_elements` of the model, set by `attach`.
    self.gather_cast = None

  def _layout_blocks(self, model):
    """The layout's blocks: `plan_blocks` of `model` (None: one block)."""
    if model is None:
      return None
    planned = plan_blocks(model, self.variables, self.num_blocks,
                          replicated_variables(model))
    if planned is None:
      return None
    self._split, layout_blocks = planned
    return layout_blocks

  def _make_blocks(self, model) -> None:
    """`self.blocks` from the split `_layout_blocks` made (after the
    replicated weights are chosen)."""
    if self._split is None:
      return
    keep = {id(self.variables[j]) for j in self.replicated}
    blocks = []
    for b, stage in enumerate(self._split.stages):
      members = [(p, self.variables[j])
                 for p, j in enumerate(self.layout.blocks[b])]
      trainable = {id(v) for v in self.variables}
      state, seen = [], set()
      for call in stage.calls:
        for v in getattr(call.layer, "variables", []):
          if id(v) not in trainable and id(v) not in seen:
            seen.add(id(v))
            state.append(v)
      blocks.append(Block(
          stage=stage, index=b,
          sharded=tuple((p, v) for p, v in members if id(v) not in keep),
          replicated=tuple((p, v) for p, v in members if id(v) in keep),
          state=tuple(state)))
    del model
    self.blocks = blocks

  def _block_cast(self, b: int):
    """`gather_cast` restricted to block b's region (None: nothing in it
    travels in the compute dtype)."""
    if self.gather_cast is None:
      return None
    dtype, mask = self.gather_cast
    start = self.layout.block_start(b)
    region = mask[start:start + self.layout.num_shards *
                  self.layout.block_sizes[b]]
    return (dtype, region) if region.any() else None

  def _shard_weights(self, replicated) -> None:
    """Copies every trainable weight into the shards (the replicated ones
    too: their optimizer state is sharded) and releases the storage of
    all but `replicated`."""
    keep = {id(v) for v in replicated}
    self.replicated = [j for j, v in enumerate(self.variables)
                       if id(v) in keep]
    self._sharded_indices = [j for j, v in enumerate(self.variables)
                             if id(v) not in keep]
    flat = self.layout.flatten([v.value for v in self.variables]).numpy()
    for component, replica in zip(self.master.values, self.replica_ids):
      with tf.device(component.device):
        # A copy: a tensor made from a slice of `flat` (itself a view of
        # the flattened tensor's buffer) can share that memory, and the
        # shard would keep the whole flat buffer alive.
        component.assign(tf.raw_ops.DeepCopy(
            x=tf.constant(self.layout.shard_of_array(flat, replica))))
    del flat
    for index in self._sharded_indices:
      self._release(self.variables[index], index)

  def _release(self, variable, index: int) -> None:
    """Drops `variable`'s storage and makes it save and restore through
    the shards: its class becomes `_released_class` of it (checkpointed
    as `weight_saveables`: slices under its unsharded key and shape)."""
    # pylint: disable=protected-access
    # The name TensorFlow records for name-based restores (read from the
    # storage, which `_shared_name` needs).
    variable._save_slice_info = types.SimpleNamespace(
        full_name=variable._shared_name)
    variable._value = None
    variable._initializer = _released(variable.path, self, index)
    variable._tfdist_zero3 = (self, index, type(variable))
    variable.__class__ = _released_class(type(variable))
    owner = self

    def direct_assign(self_, value):
      # `variable.assign` outside a step (`set_weights`, a callback
      # restoring its best weights): into the shards.
      del self_
      if not (tf.executing_eagerly() and owner.all_local):
        raise errors.WeightsShardedError(
            f"{variable.path} is sharded (--zero_stage=3): assign it in "
            "eager code of a one-process run, or restore a checkpoint.")
      owner.restore_weight(index, value)

    variable._direct_assign = types.MethodType(direct_assign, variable)
    # pylint: enable=protected-access

  def weight_saveables(self, index: int, name: str) -> list:
    """The `SaveableObject`s of released weight `index` under checkpoint
    key `name` (its unsharded key).

    With every replica in this process (`all_local`): the weight's slices
    (`sharded_optimizer.slice_saveables`), no gather. Each replica's
    piece of the weight, a contiguous run of its row-major elements (the
    layout pads only a block's end, after its last weight, so no padding
    is saved), is cut into at most 2 x rank - 1 boxes
    (`sharded_optimizer.row_major_boxes`: a partial row, whole rows, a
    partial row), each saved with its slice spec ("full shape
    offset,length:..."). The checkpoint then records the weight under its
    unsharded key with its full shape (`tf.train.list_variables`), reads
    it whole (`tf.train.load_checkpoint(...).get_tensor`: TensorFlow
    reassembles the slices), and a restore reads only the boxes the
    local replicas hold, under any replica count and layout (slices of
    an unsliced tensor, or of other slices).

    Otherwise (replicas on other workers): the weight gathered whole
    (`full_weight`) and restored by `restore_weight`, as each worker
    writes its own files.
    """
    if self.all_local and self.layout.sizes[index]:
      return sharded_optimizer.slice_saveables(
          self.layout, index, list(self.master.values), self.replica_ids,
          name)
    return [sharded_optimizer.WholeSaveable(
        lambda: self.full_weight(index),
        lambda value: self.restore_weight(index, value), name,
        self.master.values[0].device)]

  def attach(self, trainer) -> None:
    """Shards the weights of `trainer`'s model and plans its blocks; the
    `zero3` mode (`Zero3Mode`) then runs the trainer's passes on them.
    Changes nothing of the trainer.

    Raises:
      tfdist.errors.ConfigError: XLA (`trainer.xla_applied`), another
        parallelism mode (pipeline stages), or a model `check_model`
        refuses.
    """
    other = trainer.mode.name != MODE_NAME
    if trainer.xla_applied or other:
      raise errors.ConfigError(
          "--zero_stage=3 runs its own forward pass (gather, then the "
          "model): it cannot be combined with " +
          ("--enable_xla" if trainer.xla_applied else
           "--pipeline_stages" if trainer.mode.name == "pipeline" else
           f"the {trainer.mode.name!r} parallelism mode") +
          ". Drop one of them.")
    check_model(trainer.model)
    self.model = trainer.model
    self.gather_cast = autocast_elements(trainer.model, self.layout,
                                         self.variables)
    self._shard_weights(replicated_variables(trainer.model))
    self._make_blocks(trainer.model)
    sizes = self.layout.block_sizes
    logging.info(
        "ZeRO stage 3 gathers the weights in %d block(s) (the largest: %d "
        "elements per replica, %d gathered)%s.", len(sizes), max(sizes),
        max(sizes) * self.layout.num_shards,
        ", each block's gather issued while the block before it computes "
        "(prefetch)" if self.blocks and self.prefetch else "")

  def replica_eval_sums(self, trainer, inputs, labels, weights=None,
                        mask=None):
    """The trainer's evaluation sums on gathered weights. Gathered outside
    the empty-batch `tf.cond` (`StepMode.eval_sums`): every replica joins
    the collective."""
    if self.blocks:
      return self._replica_blocks_eval(trainer, inputs, labels, weights,
                                       mask)
    values = self._replica_gather_weights(self._replica_shard())
    with keras.StatelessScope(state_mapping=self._mapping(values)):
      return mode_lib.eval_sums_skipping_empty(trainer, inputs, labels,
                                               weights, mask)

  def weight_bytes_per_replica(self) -> int:
    """The weights one replica keeps: its shard (S float32) and the whole
    replicated weights (`replicated_variables`), beside
    `state_bytes_per_replica` (the optimizer's and accumulators' shards,
    as stages 1-2 count them for `tfdist.training.plan.memory`)."""
    return 4 * (self.layout.shard_size +
                sum(self.layout.sizes[j] for j in self.replicated))

  def replicated_paths(self) -> List[str]:
    """The paths of the weights kept replicated (for the log)."""
    return [self.variables[j].path for j in self.replicated]

  def _mapping(self, values) -> list:
    """`(variable, gathered value)` of every sharded weight (the
    replicated ones are read from their own storage)."""
    return [(self.variables[j], values[j]) for j in self._sharded_indices]

  # --- replica context ------------------------------------------------------
  def _replica_shard(self) -> tf.Tensor:
    return tf.ensure_shape(self.master.read_value(), [self.layout.shard_size])

  def _replica_gather_weights(self, shard: tf.Tensor) -> List[tf.Tensor]:
    """Every trainable weight in its shape, from this replica's `shard`
    [S] and the others' (one all-gather)."""
    return self.layout.unflatten(self._replica_gather_flat(shard))

  def _replica_gather_flat(self, shard: tf.Tensor) -> tf.Tensor:
    """float32 [P']: every replica's `shard` [S], in order (the weights
    the layers autocast gathered in their compute dtype)."""
    context = tf.distribute.get_replica_context()
    if len(self.layout.blocks) == 1:
      return _all_gather_shards(context, shard, self.gather_cast)
    return tf.concat(
        [_all_gather_shards(context, shard[o:o + size], self._block_cast(b))
         for b, (o, size) in enumerate(zip(self.layout.block_offsets,
                                           self.layout.block_sizes))],
        axis=0)

  def replica_forward_backward(self, trainer, inputs, labels, weights=None):
    """`Trainer._replica_forward_backward` on gathered weights.

    Returns:
      `(loss, [grad], outputs)`: the reported loss (float32 scalar), the
      gradient of this replica's shard (float32 [S], summed over all
      replicas; loss-scaled under fp16) in a list, the outputs as float32
      [B, ...].
    """
    if self.blocks:
      return self._replica_blocks_forward_backward(trainer, inputs, labels,
                                                   weights)
    model = trainer.model
    replicated = [self.variables[j] for j in self.replicated]
    with tf.GradientTape() as tape:
      # The gradient is taken with respect to the gathered buffer [P'],
      # then summed over replicas and sliced (`replica_shard`, in
      # `--all_reduce_dtype`): the all-gather's own gradient, with the
      # replicated weights' gradients added in their places first, so
      # one all-reduce carries both.
      gathered = self._replica_gather_flat(self._replica_shard())
      tape.watch(gathered)
      values = self.layout.unflatten(gathered)
      with keras.StatelessScope(
          state_mapping=self._mapping(values)) as scope:
        outputs = tf.cast(model(inputs, training=True), tf.float32)
        objective, loss = trainer.losses(labels, outputs, weights)
        regularization = trainer.regularization_loss()
      if regularization is not None:
        regularization = tf.nn.scale_regularization_loss(
            regularization) / trainer.gradient_accumulation_steps
        objective += regularization
        loss += regularization
      scaled = trainer.scale_loss(objective)
    flat_grad, *replicated_grads = tape.gradient(scaled,
                                                 [gathered] + replicated)
    if flat_grad is None:
      flat_grad = tf.zeros_like(gathered)
    if replicated:
      placed = [None] * len(self.variables)
      for j, grad in zip(self.replicated, replicated_grads):
        placed[j] = None if grad is None else tf.convert_to_tensor(grad)
      flat_grad += self.layout.flatten(placed)
    grad = self.replica_shard(flat_grad)
    self._write_state_updates(scope)
    return loss, [grad], outputs

  def _replica_blocks_forward_backward(self, trainer, inputs, labels,
                                       weights=None):
    """`replica_forward_backward` block by block (`self.blocks`): each
    block gathers its weights just before it runs and again in the
    backward pass (`_replica_block`). Returns as
    `replica_forward_backward`."""
    shard = self._replica_shard()
    layout = self.layout
    tensors = self._split.flat_inputs(inputs)
    updates = []
    with tf.GradientTape() as tape:
      slices = [shard[o:o + size] for o, size in
                zip(layout.block_offsets, layout.block_sizes)]
      tape.watch(slices)
      previous = tensors
      for block in self.blocks:
        # The gather waits for the previous block's output (or, with
        # prefetch, for its input: it then runs while that block computes).
        after = previous if self.prefetch else tensors
        previous = tensors
        tensors, states = self._replica_block(block, tensors,
                                              slices[block.index], after)
        updates += list(zip(block.state, states))
      outputs = tf.cast(self._split.pack(tensors), tf.float32)
      objective, loss = trainer.losses(labels, outputs, weights)
      scaled = trainer.scale_loss(objective)
    grads = tape.gradient(scaled, slices)
    grad = tf.concat([tf.zeros_like(s) if g is None else g
                      for s, g in zip(slices, grads)], axis=0)
    # The forward pass's updates of the non-trainable state (the
    # recomputation's are dropped): one update per step, as unsharded.
    for variable, value in updates:
      variable.assign(value)
    return loss, [grad], outputs

  def _replica_blocks_eval(self, trainer, inputs, labels, weights=None,
                           mask=None):
    """The trainer's evaluation step, block by block: each block gathers
    its weights after the block before it has run (or while it runs, with
    prefetch) and drops them after use, as in training, so evaluation's
    peak is one block's weights too. An empty batch (the last round's
    spare replicas) runs the blocks on one example of zeros, whose result
    is dropped: every replica joins every block's gather. Returns the
    trainer's summed loss, count and metric state."""
    present = tf.shape(labels)[0] > 0
    tensors = [tf.cond(present, lambda x=x: x,
                       lambda x=x: tf.zeros(tf.concat(
                           [[1], tf.shape(x)[1:]], 0), x.dtype))
               for x in self._split.flat_inputs(inputs)]
    shard, layout = self._replica_shard(), self.layout
    context = tf.distribute.get_replica_context()
    previous = tensors
    for block in self.blocks:
      after = previous if self.prefetch else tensors
      previous = tensors
      o, size = layout.block_offsets[block.index], layout.block_sizes[
          block.index]
      with tf.control_dependencies(after):
        region = self._gather_block(context, shard[o:o + size], block.index)
      tensors, _ = self._block_pass(
          block, tensors, region,
          [tf.identity(v.value) for _, v in block.replicated],
          [tf.identity(v.value) for v in block.state], training=False)
    outputs = tf.cast(self._split.pack(tensors), tf.float32)
    return tf.cond(
        present, lambda: trainer.eval_sums(
            inputs, labels, weights, mask, outputs=outputs),
        trainer.empty_eval_sums)

  def _gather_block(self, context, shard_slice, b: int) -> tf.Tensor:
    """Block b's weights, float32 [N x S_b]: every replica's `shard_slice`
    [S_b], the elements the layers autocast travelling in their compute
    dtype (`_block_cast`). Replica context; no gradient of its own."""
    cast = self._block_cast(b)
    if cast is None:
      return context.all_gather(shard_slice, axis=0)
    return _gather_cast(context, shard_slice, *cast)

  def _block_pass(self, block: Block, xs, region, replicated, states,
                  training: bool = True):
    """Runs `block`'s layers on `xs` with its weights from `region`
    (float32 [N x S_b], gathered), `replicated` and `states` (tensors for
    `block.replicated` and `block.state`). Returns `(outputs, new
    states)`.

    Raises:
      tfdist.errors.ConfigError: a layer of the block adds a loss
        (`add_loss`) while it runs, which the block's pass cannot carry
        (`plan_blocks` keeps such models one block; this catches what its
        probe missed, when the step is traced).
    """
    values = self.layout.unflatten_block(block.index, region)
    mapping = ([(v, values[p]) for p, v in block.sharded] +
               [(v, t) for (_, v), t in zip(block.replicated, replicated)] +
               list(zip(block.state, states)))
    with keras.StatelessScope(state_mapping=mapping,
                              collect_losses=True) as scope:
      outputs = block.stage.run(list(xs), training=training)
    if scope.losses:
      raise errors.ConfigError(
          f"--zero_stage=3: a layer among {', '.join(block.stage.layer_names)}"
          " adds a loss (add_loss) as it runs, which stage 3's block-by-block"
          " gathering cannot carry. Gather the whole model at once "
          "(--zero3_blocks=1), or use --zero_stage=2.")
    new_states = []
    for variable, old in zip(block.state, states):
      value = scope.get_current_value(variable)
      new_states.append(old if value is None else tf.convert_to_tensor(value))
    return list(outputs), new_states

  def _replica_block(self, block: Block, xs, shard_slice, after):
    """One block's forward pass, its backward pass written out:
    `tf.custom_gradient` of (the block's inputs `xs`, this replica's slice
    of its weights `shard_slice` [S_b], the replicated weights' and the
    non-trainable state's values).

    Forward: the slice is all-gathered (after the tensors `after`, so the
    executor cannot gather every block at the start of the step) and the
    block runs on the gathered weights, which are not kept. Backward:
    gathered again (after the upstream gradient arrives), the block is
    recomputed under a tape (its seed states are inputs: the same dropout
    masks), and the weights' gradient (the replicated weights' placed in
    it) is all-reduced in `--all_reduce_dtype`; the replica keeps its
    slice [S_b].

    Returns:
      `(outputs, new states)`: tensors for the stage's `output_keys`, and
      the values of `block.state` after the forward pass.
    """
    context = tf.distribute.get_replica_context()
    layout = self.layout
    b = block.index
    size = layout.block_sizes[b]
    replicated = [tf.identity(v.value) for _, v in block.replicated]
    states = [tf.identity(v.value) for v in block.state]
    n_in, n_rep = len(xs), len(replicated)
    float_in = [i for i, x in enumerate(xs) if x.dtype.is_floating]

    def gather(value):
      return self._gather_block(context, value, b)

    @tf.custom_gradient
    def run(*args):
      xs_, shard_, reps_ = (list(args[:n_in]), args[n_in],
                            list(args[n_in + 1:n_in + 1 + n_rep]))
      states_ = list(args[n_in + 1 + n_rep:])
      with tf.control_dependencies([t for t in after if t is not None]):
        region = gather(shard_)
      outputs, new_states = self._block_pass(block, xs_, region, reps_,
                                             states_)
      n_out = len(outputs)

      def gradient(*upstream):
        upstream = list(upstream[:n_out])
        with tf.control_dependencies([u for u in upstream if u is not None]):
          again = gather(shard_)
        sources = [xs_[i] for i in float_in] + [again] + reps_
        with tf.GradientTape() as tape:
          tape.watch(sources)
          recomputed, _ = self._block_pass(block, xs_, again, reps_, states_)
        targets, seeds = [], []
        for out, up in zip(recomputed, upstream):
          if out.dtype.is_floating:
            targets.append(out)
            seeds.append(tf.zeros_like(out) if up is None
                         else tf.cast(up, out.dtype))
        got = tape.gradient(targets, sources, output_gradients=seeds)
        x_grads = [None] * n_in
        for i, g in zip(float_in, got):
          x_grads[i] = g
        region_grad = got[len(float_in)]
        if region_grad is None:
          region_grad = tf.zeros_like(again)
        if block.replicated:
          placed = [None] * len(layout.blocks[b])
          for (p, _), g in zip(block.replicated, got[len(float_in) + 1:]):
            placed[p] = None if g is None else tf.convert_to_tensor(g)
          region_grad += layout.flatten_block(b, placed)
        summed, = reduce_dtype.all_reduce_sum(context, [region_grad],
                                              self.all_reduce_dtype)
        shard_grad = tf.slice(
            summed, [context.replica_id_in_sync_group * size], [size])
        return x_grads + [shard_grad] + [None] * (len(args) - n_in - 1)

      return outputs + new_states, gradient

    results = run(*(list(xs) + [shard_slice] + replicated + states))
    n_out = len(results) - len(states)
    return list(results[:n_out]), list(results[n_out:])

  def _write_state_updates(self, scope) -> None:
    """Writes the non-trainable updates the layers made inside `scope`
    (moving statistics, seed states) to their variables."""
    trainable = {id(v) for v in self.variables}
    for variable in self.model.variables:
      if id(variable) in trainable:
        continue
      value = scope.get_current_value(variable)
      if value is not None:
        variable.assign(value)

  def replica_prepare(self, grads=None, shard=None):
    """`ShardedOptimizer.replica_prepare` on a gradient that is already
    this replica's summed shard (`grads`: `[shard]`, float32 [S])."""
    return super().replica_prepare(None,
                                   grads[0] if shard is None else shard)

  def _replica_load_master(self, replica) -> None:
    """The replicated weights' pieces of the master shard refreshed from
    their own storage (assigned or restored since the last update); the
    sharded weights' pieces are the weights already. Replica context."""
    pieces = self._replicated_pieces(replica)
    if not pieces:
      return
    current = self._replica_shard()
    parts, at = [], 0
    for j, start, shard_start, length in pieces:
      parts.append(current[at:shard_start])
      parts.append(tf.reshape(tf.cast(self.variables[j], tf.float32),
                              [-1])[start:start + length])
      at = shard_start + length
    parts.append(current[at:])
    self.master.assign(tf.concat(parts, axis=0))

  def _replicated_pieces(self, replica) -> list:
    """`FlatLayout.pieces` of the replicated weights in shard `replica`
    (an int, or a tensor with a static value)."""
    if not self.replicated:
      return []
    replica = int(tf.get_static_value(replica))
    keep = set(self.replicated)
    return [p for p in self.layout.pieces(replica) if p[0] in keep]

  def _replica_gather_replicated(self) -> List[tf.Tensor]:
    """The replicated weights, updated, in their shapes: each replica
    places its pieces in zeros and one all-reduce sums them (one nonzero
    per element: exact). Replica context."""
    context = tf.distribute.get_replica_context()
    replica = context.replica_id_in_sync_group
    shard = self._replica_shard()
    by_variable = {j: [] for j in self.replicated}
    for j, start, shard_start, length in self._replicated_pieces(replica):
      by_variable[j].append((start, shard[shard_start:shard_start + length]))
    parts = []
    for j in self.replicated:
      at = 0
      for start, piece in by_variable[j]:
        parts += [tf.zeros([start - at], tf.float32), piece]
        at = start + int(piece.shape[0])
      parts.append(tf.zeros([self.layout.sizes[j] - at], tf.float32))
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                tf.concat(parts, axis=0))
    sizes = [self.layout.sizes[j] for j in self.replicated]
    return [tf.reshape(part, self.layout.shapes[j])
            for part, j in zip(tf.split(summed, sizes), self.replicated)]

  def replica_accumulate(self, grads) -> None:
    """Adds this micro-batch's shard gradient (already summed) to the
    shard accumulator (`grads`: `[shard]`, float32 [S])."""
    self.grad_accumulator.assign_add(grads[0])

  # --- cross-replica context ------------------------------------------------
  def _publish(self) -> None:
    """The updated replicated weights written into every replica's copy
    (`_replica_gather_replicated`); nothing else: the updated shards are
    the weights. Cross-replica context."""
    if not self.replicated:
      return
    gathered = self.strategy.run(self._replica_gather_replicated)
    for j, value in zip(self.replicated, gathered):
      variable = self.variables[j]
      self.strategy.extended.update(
          getattr(variable, "value", variable),
          lambda var, val: var.assign(val), args=(value,), group=False)

  def _flat_weights(self) -> np.ndarray:
    """The whole flat buffer [P'] (every replica's shard, in order)."""
    values = self.strategy.experimental_local_results(self.master)
    if len(self.replica_ids) == self.strategy.num_replicas_in_sync:
      parts = [None] * len(values)
      for replica, value in zip(self.replica_ids, values):
        parts[replica] = value.numpy()
      return self.layout.flat_from_shards(parts)
    base = self.replica_ids[0]
    gathered = self.strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.identity(values[ctx.replica_id_in_sync_group - base]))
    return self.layout.flat_from_shards(
        self.strategy.gather(gathered, axis=0).numpy())

  def full_weight(self, index: int) -> tf.Tensor:
    """Trainable variable `index` in its own shape (gathered)."""
    flat = self._flat_weights()
    off, n = self.layout.offsets[index], self.layout.sizes[index]
    return tf.constant(flat[off:off + n].reshape(
        self.layout.shapes[index].as_list()))

  def restore_weight(self, index: int, value) -> None:
    """Writes variable `index`'s restored value (its whole shape) into the
    local shards that hold part of it."""
    flat = tf.reshape(tf.cast(value, tf.float32), [-1])
    for component, replica in zip(self.master.values, self.replica_ids):
      for j, start, shard_start, length in self.layout.pieces(replica):
        if j == index:
          component[shard_start:shard_start + length].assign(
              flat[start:start + length])

  def materialize(self) -> None:
    """Gives the Keras variables storage again, holding the gathered
    weights (mirrored, under the strategy's scope): for the export and
    for the caller of `tfdist.fit` at the end of the run. Training must
    not continue afterwards (the step reads the shards, not these)."""
    if self.materialized:
      return
    flat = self._flat_weights()
    values = self.layout.unflatten(tf.constant(flat))
    with self.strategy.scope():
      for index in self._sharded_indices:
        variable, value = self.variables[index], values[index]
        # pylint: disable=protected-access
        variable._initializer = None
        variable._initialize(value)
        for name in private_api.ZERO3_VARIABLE_OVERRIDES:
          variable.__dict__.pop(name, None)
        variable.__class__ = variable.__dict__.pop("_tfdist_zero3")[2]
        # pylint: enable=protected-access
    self.materialized = True


def materialize(trainer) -> None:
  """`Zero3Optimizer.materialize` for `trainer`'s optimizer, if stage 3."""
  if isinstance(getattr(trainer, "sharded", None), Zero3Optimizer):
    trainer.sharded.materialize()


def state_variables(model: keras.Model, trainer) -> list:
  """`model.variables` with the released weights replaced by the local
  weight shards (for the checkpoint keeper's finite check); all of
  `model.variables` unless `trainer` runs stage 3 unmaterialized."""
  sharded = getattr(trainer, "sharded", None)
  if not isinstance(sharded, Zero3Optimizer) or sharded.materialized:
    return list(model.variables)
  released = {id(sharded.variables[j]) for j in sharded._sharded_indices}  # pylint: disable=protected-access
  return ([v for v in model.variables if id(v) not in released] +
          list(sharded.master.values))


sharded_optimizer.register_stage(STAGE, Zero3Optimizer)

