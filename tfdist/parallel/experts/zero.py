"""ZeRO stages 1-2 beside expert parallelism (`--expert_parallel=E_p
--zero_stage=1` or `2`, `--shard_optimizer_state`).

Under expert parallelism the replicas hold different weights: each
`MixtureOfExperts` layer's experts live on the replicas of their slot
(`tfdist.parallel.experts.placement`), the other weights on every
replica. ZeRO (Rajbhandari et al. 2020) shards a flat list of weights
every replica holds, so here it shards the non-expert ones only, as
DeepSpeed-MoE (Rajbhandari et al. 2022) shards the non-expert state with
ZeRO beside expert parallelism: `ExpertsShardedOptimizer` runs

* the stage's own `tfdist.parallel.data.sharded_optimizer.ShardedOptimizer`
  (not a copy of it) on the non-expert trainable variables: their
  gradients summed over every replica and sliced, their optimizer state
  1/R per replica (R replicas), the updated shards all-gathered;
* a copy of the user's optimizer (`sharded_optimizer.copy_config`, built
  in the strategy's scope on the expert variables) on the experts: each
  replica updates its own experts with their gradients (already summed
  over the replicas of the same slot by the mode), so each replica keeps
  the slots of its experts only. The copy follows the user's optimizer's
  iterations and learning rate (`sharded_optimizer.follow`) before each
  update, read before the ZeRO update advances them.

Per replica between steps, optimizer state: (the non-expert slots) / R,
padded to whole shards, plus the slots of the replica's E / E_p experts
of each layer (`state_bytes_per_replica`). Stage 2 also shards the
non-expert gradient accumulators under `--gradient_accumulation_steps`;
the experts' accumulators are per replica (each replica's experts only).

Checkpoints are the `experts` mode's (`ExpertParallelStep.
checkpoint_optimizer`): one device's keys, each expert's slots under one
name, the non-expert slots read from and restored into the shards.
"""

from typing import List, Sequence

import numpy as np
import tensorflow as tf

from tfdist import errors
from tfdist.parallel.data import sharded_optimizer


class ExpertsShardedOptimizer:
  """ZeRO stages 1-2 on the non-expert weights, the experts' optimizer per
  replica (module docstring). The trainer's `sharded`: the interface of
  `ShardedOptimizer` the trainer and the run read.

  Args:
    stage_class: the stage's optimizer class (`ShardedOptimizer`; stage 3
      is refused).
    expert_ids: `id()`s of the expert variables among `variables`.
    strategy, optimizer, variables, options, all_reduce_dtype, model:
      `ShardedOptimizer`'s arguments; `variables` every trainable
      variable of the expert-parallel model (float32; the expert ones
      sync-on-read, one value per replica).

  Attributes:
    zero: the `ShardedOptimizer` of the non-expert variables.
    experts: the copy of the user's optimizer built on the expert
      variables (its slots: one component per replica, each replica's
      experts' own).
    expert_variables: the expert variables, in `variables`' order.

  Raises:
    tfdist.errors.ConfigError: stage 3; as `ShardedOptimizer` (LAMB, a
      variable that is not float32).
  """

  def __init__(self, stage_class: type, expert_ids, *, strategy, optimizer,
               variables: Sequence, options, all_reduce_dtype, model=None):
    if options.stage not in (1, 2) or not issubclass(
        stage_class, sharded_optimizer.ShardedOptimizer):
      raise errors.ConfigError(
          f"--expert_parallel runs with --zero_stage=1 or 2; --zero_stage="
          f"{options.stage} is refused. Use --zero_stage=2 (or 1).")
    variables = list(variables)
    self._is_expert = [id(v) in expert_ids for v in variables]
    shared = [v for v, e in zip(variables, self._is_expert) if not e]
    self.expert_variables = [v for v, e in zip(variables, self._is_expert)
                             if e]
    self.zero = stage_class(strategy=strategy, optimizer=optimizer,
                            variables=shared, options=options,
                            all_reduce_dtype=all_reduce_dtype, model=model)
    with strategy.scope():
      self.experts = type(self.zero.inner).from_config(
          sharded_optimizer.copy_config(self.zero.inner))
      self.experts.build(self.expert_variables)
    # Its gradients arrive summed (over the replicas of each slot): Keras's
    # own all-reduce over every replica would mix different experts.
    self.experts._all_reduce_sum_gradients = list  # pylint: disable=protected-access
    self.strategy = strategy
    self.options = options
    self.expert_accumulators = None

  # --- what the trainer and the run read of a ShardedOptimizer -------------
  @property
  def layout(self):
    """The non-expert weights' `FlatLayout`."""
    return self.zero.layout

  @property
  def groups(self):
    """The non-expert weights' `ShardGroups` (every replica)."""
    return self.zero.groups

  @property
  def grad_accumulator(self):
    return self.zero.grad_accumulator

  def attach(self, trainer) -> None:
    self.zero.attach(trainer)

  def checkpoint_view(self):
    raise NotImplementedError(
        "The experts mode saves its own optimizer view "
        "(ExpertParallelStep.checkpoint_optimizer).")

  def expert_slot_bytes_per_replica(self) -> int:
    """Bytes of one replica's expert slots: one component of each slot of
    `experts` (iterations and learning rate not counted)."""
    own = {id(self.experts.iterations),
           id(getattr(self.experts, "_learning_rate", None))}
    return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
               for v in self.experts.variables if id(v) not in own)

  def state_bytes_per_replica(self) -> int:
    """Bytes one replica keeps between steps: the non-expert shard's
    (`ShardedOptimizer.state_bytes_per_replica`) and its experts' slots
    (and, at stage 2 under accumulation, their accumulators)."""
    total = (self.zero.state_bytes_per_replica() +
             self.expert_slot_bytes_per_replica())
    for v in self.expert_accumulators or ():
      total += int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
    return total

  # --- replica context ------------------------------------------------------
  def _split(self, values) -> tuple:
    """`(non-expert, expert)` entries of `values` (one per variable)."""
    shared = [x for x, e in zip(values, self._is_expert) if not e]
    return shared, [x for x, e in zip(values, self._is_expert) if e]

  def make_gradient_accumulator(self):
    """Stage 2 under accumulation: the non-expert shard accumulator and
    one per-replica accumulator per expert variable. In the strategy's
    scope."""
    self.expert_accumulators = [
        tf.Variable(tf.zeros(v.shape, tf.float32), trainable=False,
                    name="expert_gradient_accumulator",
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.NONE)
        for v in self.expert_variables]
    return self.zero.make_gradient_accumulator()

  def replica_accumulate(self, grads) -> None:
    shared, experts = self._split(grads)
    self.zero.replica_accumulate(shared)
    for accumulator, grad in zip(self.expert_accumulators, experts):
      if grad is not None:
        accumulator.assign_add(tf.convert_to_tensor(grad))

  def replica_take_accumulated(self) -> tf.Tensor:
    return self.zero.replica_take_accumulated()

  def _take_expert_accumulated(self) -> List[tf.Tensor]:
    out = []
    for accumulator in self.expert_accumulators:
      value = accumulator.read_value()
      with tf.control_dependencies([value]):
        accumulator.assign(tf.zeros_like(value))
      out.append(tf.identity(value))
    return out

  def replica_prepare(self, grads=None, shard=None):
    """`ShardedOptimizer.replica_prepare` on the non-expert gradients (or
    the accumulated `shard`); this replica's experts updated here by
    `experts`. Replica context.

    Args:
      grads: this replica's gradients, one per variable of `variables`
        (float32, each its variable's shape, or None; the non-expert ones
        unreduced, the expert ones summed over their slot's replicas), or
        None with
      shard: stage 2's accumulated non-expert shard, float32 [S] (the
        experts' from their own accumulators).

    Returns:
      `ShardedOptimizer.replica_prepare`'s `(skipped, update)`: float32
      scalar (0.0: fp16 is refused beside expert parallelism), and the
      non-expert shard's update for `apply`.
    """
    if grads is None:
      shared, experts = None, self._take_expert_accumulated()
    else:
      shared, experts = self._split(grads)
    skipped, update = self.zero.replica_prepare(shared, shard)
    # Before the ZeRO update (cross-replica, after this) advances them.
    sharded_optimizer.follow(self.experts, self.zero.inner)
    self.experts.apply(experts, self.expert_variables)
    return skipped, update

  # --- cross-replica context ------------------------------------------------
  def apply(self, update) -> None:
    """`ShardedOptimizer.apply`: the non-expert shards' update and
    all-gather."""
    self.zero.apply(update)
