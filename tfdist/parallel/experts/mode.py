"""The trainer's step under expert parallelism (`--expert_parallel=E_p`).

`build` makes two models of the run: the unsharded one first (outside the
strategy, on the host CPU, so its initial weights are those of an
unsharded run with the same `--seed`), then the expert-parallel one in the
strategy's scope inside `placement.placement_scope`, where each
`MixtureOfExperts` keeps only its replica's L = E / E_p experts, their
weights sync-on-read with aggregation NONE (one value per replica, as
`tfdist.parallel.tensor` keeps its shards), set from the unsharded
weights. The expert-parallel model is the one trained; the unsharded one
is the *gathered view* checkpoints and the SavedModel see (each expert
under the unsharded layer's own name, `expert_<i>/...`, whatever E_p).

`ExpertParallelStep` changes the `Trainer`'s step in three places:

* forward and backward: each replica runs its share of the global batch
  (as under data parallelism); inside each `MixtureOfExperts` the tokens
  go to their experts' replicas and back by all-to-all within the
  replica's expert group, and the router's load-balancing statistics are
  summed over every replica (the loss of one device on the global batch);
* the gradients: the mode sums the non-expert ones over every replica
  itself (the trainer's all-reduce is off: `all_reduces_gradients` is
  False), and the expert ones only over the D = R / E_p replicas holding
  the same experts (none with D = 1): the all-to-all's backward already
  brought every token's gradient of the group to its expert's replica.
  The optimizer is applied per replica (as under tensor parallelism), so
  each expert's slots live on its replicas only; under ZeRO stages 1-2
  (`sharded_optimizer`, `tfdist.parallel.experts.zero`) the non-expert
  gradients are left to the stage's `ShardedOptimizer`, which sums and
  shards them and their optimizer state;
* evaluation: every replica runs the model (the all-to-all needs all of
  them), on its examples padded to the largest replica's count.

Routing groups never span replicas: with `group_size=None` a group is one
replica's tokens, so one device reproduces an E_p run only with
`group_size` = the tokens of one replica's batch (capacity is per group).
"""

import dataclasses
from typing import Callable, List, Tuple

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from tfdist import errors
from tfdist.parallel import collectives
from tfdist.parallel import mode as mode_lib
from tfdist.parallel import views
from tfdist.parallel.experts import layer as moe_layer
from tfdist.parallel.experts import options as expert_options
from tfdist.parallel.experts import placement as placement_lib
from tfdist.parallel.experts import traffic
from tfdist.parallel.experts import zero as experts_zero
# The gathered-view machinery of tensor parallelism, shared as it is.
from tfdist.parallel.tensor import layers as tp_lib
from tfdist.parallel.tensor import mode as tensor_mode

_components = tp_lib._components  # pylint: disable=protected-access


_gather_through = tensor_mode._gather_through  # pylint: disable=protected-access


@dataclasses.dataclass
class _Pair:
  """One weight of the gathered view and where it lives: `slot` None for
  a weight every replica holds whole, else the slot whose replicas hold
  this expert's weight in `variable`'s components."""
  view: object
  variable: object
  slot: object

  def read(self, placement) -> np.ndarray:
    """The value: a local component's; an expert's from a replica of its
    slot, gathered from the other tasks when none is here (a collective:
    every task of the run reads the same pairs in the same order)."""
    parts = _components(self.variable)
    if self.slot is None:
      return np.asarray(parts[0].numpy())
    here = {placement.replica_of(c.device): c for c in parts}
    owner = next(r for r in range(placement.num_replicas)
                 if placement.slot(r) == self.slot)
    if len(here) == placement.num_replicas:
      return np.asarray(here[owner].numpy())
    return _gathered_row(placement, self.variable, here, owner)

  def write(self, value, placement) -> None:
    """Assigns `value` to this task's components that hold it."""
    for component in _components(self.variable):
      if self.slot is None or placement.slot(
          placement.replica_of(component.device)) == self.slot:
        component.assign(value)


# One `tf.function` per (strategy, placement): an all-gather over every
# replica, traced per shape and dtype.
_GATHER_FUNCTIONS = {}


def _gathered_row(placement, variable, here: dict, owner: int
                  ) -> np.ndarray:
  """Replica `owner`'s value of the per-replica `variable`, whose
  components in this task are `here` ({replica: component}): each replica
  passes its own to an all-gather over every replica
  (`collectives.replica_all_gather` in `strategy.run`; every task must
  make the same reads in the same order)."""
  value = variable.value if isinstance(variable, keras.Variable) else variable
  strategy = value.distribute_strategy
  key = (id(strategy), placement)
  gather = _GATHER_FUNCTIONS.get(key)
  if gather is None:
    group = placement.all_group()

    def replica(x):
      return collectives.replica_all_gather(group, x[None], axis=0)

    gather = tf.function(lambda x: strategy.run(replica, args=(x,)))
    _GATHER_FUNCTIONS[key] = gather
  per_replica = strategy.experimental_distribute_values_from_function(
      lambda context: here[context.replica_id_in_sync_group].read_value())
  rows = strategy.experimental_local_results(gather(per_replica))[0]
  return np.asarray(rows[placement.all_group().rank(
      placement.devices[owner])].numpy())


def _check_same(what: str, ours, theirs) -> None:
  if len(ours) != len(theirs) or any(
      tuple(a.shape) != tuple(b.shape) for a, b in zip(ours, theirs)):
    raise ValueError(f"the expert-parallel model's {what} do not pair up "
                     "with the unsharded model's "
                     f"({[tuple(v.shape) for v in ours]} vs "
                     f"{[tuple(v.shape) for v in theirs]})")


def pair_weights(unsharded: keras.Model, model: keras.Model) -> List[_Pair]:
  """Every weight of `unsharded` with its home in `model` (the
  expert-parallel twin): expert i of a layer is local expert i mod L of
  slot i // L; the other weights pair in order.

  Raises:
    ValueError: the models' layers or weights do not pair up.
  """
  theirs, ours = moe_layer.moe_layers(unsharded), moe_layer.moe_layers(model)
  if len(theirs) != len(ours) or not ours:
    raise ValueError(f"the models have {len(theirs)} and {len(ours)} "
                     "MixtureOfExperts layers")
  pairs, taken = [], set()
  for twin, mine in zip(theirs, ours):
    local = mine._num_local_experts  # pylint: disable=protected-access
    for i, expert in enumerate(twin.experts):
      slot, j = divmod(i, local)
      mine_weights = mine.experts[j].weights
      _check_same(f"expert {i}'s weights", mine_weights, expert.weights)
      pairs += [_Pair(a, b, slot) for a, b in zip(expert.weights,
                                                  mine_weights)]
      taken |= {id(v) for v in expert.weights + mine_weights}
  rest_theirs = [v for v in unsharded.weights if id(v) not in taken]
  rest_ours = [v for v in model.weights if id(v) not in taken]
  _check_same("other weights", rest_ours, rest_theirs)
  return pairs + [_Pair(a, b, None) for a, b in zip(rest_theirs, rest_ours)]


def _slot_owners(optimizer, variables) -> dict:
  """`{optimizer variable name: (model variable, slot suffix)}` of the
  optimizer variables made from `variables` (Keras names them
  `<variable path with / as _>_<slot>`); others map to (None, name)."""
  prefixes = sorted(((v.path.replace("/", "_"), v) for v in variables),
                    key=lambda item: -len(item[0]))
  owners = {}
  for slot in optimizer.variables:
    owner = next(((v, slot.name[len(p) + 1:]) for p, v in prefixes
                  if slot.name.startswith(p + "_")), (None, slot.name))
    owners[slot.name] = owner
  return owners


def _shards_through(twin, zero, variable, kind: str) -> bool:
  """Makes the view's slot `twin` save and restore slot `kind` of
  `variable` through the ZeRO optimizer `zero` (`ShardedOptimizer`) when
  `zero` shards `variable`; False (nothing done) when it does not."""
  index = next((j for j, v in enumerate(zero.variables) if v is variable),
               None)
  if index is None:
    return False
  _gather_through(twin, lambda: zero.full_slot(kind, index).numpy(),
                  lambda value: zero.restore_slot(kind, index, value))
  return True


@mode_lib.register_mode("experts")
@dataclasses.dataclass
class ExpertParallelStep(mode_lib.StepMode):
  """The `experts` step mode: the expert-parallel model, its gathered
  view and the step's changes (module docstring).

  Attributes:
    model: the expert-parallel Keras model (trained; built in the
      strategy's scope).
    unsharded: the same model holding every expert (host CPU): the
      gathered view.
    placement: the `placement.ExpertPlacement` (E_p, the replicas).
  """
  model: keras.Model
  unsharded: keras.Model
  placement: placement_lib.ExpertPlacement
  all_reduces_gradients = False

  def __post_init__(self):
    self.pairs = pair_weights(self.unsharded, self.model)
    self._expert_ids = {id(p.variable) for p in self.pairs
                        if p.slot is not None}
    # Under ZeRO its optimizer sums the non-expert gradients (`bind`).
    self._sums_shared = True

  @classmethod
  def validate(cls, settings) -> None:
    """`tfdist.parallel.experts.options.check_flags` on `settings`."""
    expert_options.check_flags(**{
        name: settings[name] for name in expert_options.CHECKED_SETTINGS
        if name in settings})

  @classmethod
  def devices(cls, settings) -> int:
    """E_p: the replicas one copy of the experts spans."""
    return int(settings["expert_parallel"])

  @classmethod
  def plan_lines(cls, facts) -> list:
    """The expert groups and each replica's all-to-all bytes per update
    (`tfdist.parallel.experts.traffic.plan_lines`)."""
    return traffic.plan_lines(facts)

  @classmethod
  def model_facts(cls, model) -> dict:
    """`expert_bytes` (the weight bytes of every `MixtureOfExperts`
    layer's experts) and `num_experts` (the fewest experts of one such
    layer; 0 without one)."""
    layers = moe_layer.moe_layers(model)
    weights = [w for layer in layers for expert in layer.experts
               for w in expert.weights]
    return {"expert_bytes": sum(
        int(np.prod(w.shape)) * tf.as_dtype(w.dtype).size for w in weights),
            "num_experts": min((l.num_experts for l in layers), default=0)}

  @classmethod
  def layout_rows(cls, facts) -> list:
    """Expert parallelism, for a model with experts only: the experts'
    weights, their gradients and optimizer slots (in proportion to
    `facts.expert_bytes`) / E_p, E_p the largest divisor of both the
    devices N and the experts E (`--expert_parallel=E_p`), the rest whole;
    each replica a*B/N activations (the dispatched tokens' [E, C, d]
    buffers not counted). Beside it ZeRO 1 (`tfdist.parallel.experts.
    zero`): the non-expert optimizer state / N, the experts' / E_p; ZeRO
    2 also the non-expert gradient accumulators / N."""
    e, n = facts.estimate, facts.num_devices
    if not facts.expert_bytes:
      return []
    e_p = max(d for d in range(1, n + 1)
              if n % d == 0 and facts.num_experts % d == 0)
    trainable = e.gradients_bytes
    split = min(int(facts.expert_bytes), trainable)
    share = split / trainable if trainable else 0.0
    note = facts.one_device_note or (
        "" if e_p > 1 else f"{n} devices and {facts.num_experts} experts "
        "share no divisor above 1")

    def split_over(total: float, shared_over: int = 1) -> int:
      """`total` bytes, its experts' share / E_p, the rest / shared_over."""
      experts = total * share
      return (facts.ceil_div(total - experts, shared_over) +
              facts.ceil_div(experts, e_p))

    flags = f"--distribution_strategy=mirrored --expert_parallel={e_p}"
    weights = e.parameters_bytes - split + facts.ceil_div(split, e_p)
    grads = split_over(e.gradients_bytes + facts.accumulators)
    zero_note = note or facts.zero_note
    return [
        facts.row("expert parallel", flags, n, weights, grads,
                  split_over(e.optimizer_bytes), facts.replica_activations,
                  not note, note),
        facts.row("expert parallel + ZeRO 1", f"{flags} --zero_stage=1", n,
                  weights, grads, split_over(e.optimizer_bytes, n),
                  facts.replica_activations, not zero_note, zero_note),
        facts.row("expert parallel + ZeRO 2", f"{flags} --zero_stage=2", n,
                  weights, split_over(e.gradients_bytes) +
                  split_over(facts.accumulators, n),
                  split_over(e.optimizer_bytes, n),
                  facts.replica_activations, not zero_note, zero_note)]

  def describe(self) -> str:
    """One line for the manifest and the log."""
    p = self.placement
    layers = moe_layer.moe_layers(self.model)
    experts = sum(layer.num_experts for layer in layers)
    # Per layer: "of the 8 experts" read as one layer's when 2 layers of 4
    # held them (a new-user trial).
    return (f"{p.num_replicas} replicas in {p.copies} expert group(s) of "
            f"{p.expert_parallel}: each replica holds 1/{p.expert_parallel} "
            f"of each MixtureOfExperts layer's experts ({len(layers)} "
            f"layer(s), {experts} experts in all) and trains on its share "
            "of the batch")

  def load_unsharded(self) -> None:
    """Sets the expert-parallel model's weights from the unsharded one's."""
    for pair in self.pairs:
      pair.write(np.asarray(pair.view.numpy()), self.placement)

  # --- the step -----------------------------------------------------------
  def sharded_optimizer(self, stage_class, **kwargs):
    """ZeRO stages 1-2 on the non-expert weights, the experts' optimizer
    per replica (`tfdist.parallel.experts.zero.ExpertsShardedOptimizer`).

    Raises:
      tfdist.errors.ConfigError: stage 3.
    """
    return experts_zero.ExpertsShardedOptimizer(stage_class,
                                                self._expert_ids, **kwargs)

  def bind(self, context) -> None:
    """Under ZeRO the sharded optimizer sums the non-expert gradients
    (all-reduce, then its shard); the mode then sums only the experts'."""
    self._sums_shared = context.sharded is None

  def forward_backward(self, trainer, inputs, labels, weights=None):
    """`StepContext.model_forward_backward` on this replica's batch, the
    non-expert gradients summed over every replica (left to the ZeRO
    optimizer under ZeRO), the expert ones over the replicas of the same
    slot (D > 1).

    Returns:
      `(loss, grads, outputs)` as `StepMode.forward_backward`; the
      gradients already reduced (the trainer reduces none).
    """
    loss, grads, outputs = trainer.model_forward_backward(inputs, labels,
                                                          weights)
    return loss, self._reduce_gradients(grads), outputs

  def _reduce_gradients(self, grads) -> list:
    variables = self.model.trainable_variables
    context = tf.distribute.get_replica_context()
    shared = [i for i, (g, v) in enumerate(zip(grads, variables))
              if g is not None and id(v) not in self._expert_ids and
              self._sums_shared]
    grads = list(grads)
    if shared:
      summed = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                  [grads[i] for i in shared])
      for i, g in zip(shared, summed):
        grads[i] = g
    if self.placement.copies > 1:
      replica = self.placement.replica_of(
          collectives.replica_device("expert parallelism's gradients"))
      group = self.placement.slot_group(replica)
      for i, (g, v) in enumerate(zip(grads, variables)):
        if g is not None and id(v) in self._expert_ids:
          grads[i] = collectives.replica_all_reduce(
              group, tf.convert_to_tensor(g))
    return grads

  def eval_sums(self, trainer, inputs, labels, weights=None, mask=None):
    """`StepContext.eval_sums` of this replica's examples; the model runs
    on every replica (the all-to-all needs each), on the examples padded
    with zeros to the largest replica's count (at least 1)."""
    context = tf.distribute.get_replica_context()
    count = tf.shape(tf.nest.flatten(labels)[0])[0]
    largest = tf.maximum(tf.reduce_max(context.all_gather(
        tf.reshape(count, [1]), axis=0)), 1)

    def pad(x):
      rest = [[0, 0]] * (len(x.shape) - 1)
      return tf.pad(x, [[0, largest - count]] + rest)

    outputs = tf.cast(self.model(tf.nest.map_structure(pad, inputs),
                                 training=False), tf.float32)
    return trainer.eval_sums(inputs, labels, weights, mask,
                             outputs=outputs[:count])

  # --- the gathered view --------------------------------------------------
  def variables(self, context=None) -> list:
    """Every replica's own tf.Variables of the model (the checkpoint's
    finite check reads them in cross-replica context)."""
    del context
    return [c for v in self.model.variables for c in _components(v)]

  def gathered_model(self) -> keras.Model:
    """The unsharded model holding the trained weights (every expert)."""
    for pair in self.pairs:
      pair.view.assign(pair.read(self.placement))
    return self.unsharded

  def exported_model(self, context=None) -> keras.Model:
    """`gathered_model`: the whole model for export."""
    del context
    return self.gathered_model()

  def checkpoint_model(self, context=None) -> keras.Model:
    """The unsharded model, each variable saving its expert-parallel
    twin's value (an expert's from a replica of its slot) and restoring
    into every replica holding it."""
    del context
    for pair in self.pairs:
      _gather_through(pair.view,
                      lambda p=pair: p.read(self.placement),
                      lambda value, p=pair: p.write(value, self.placement))
    return self.unsharded

  def checkpoint_optimizer(self, context):
    """An optimizer of `context.optimizer`'s class and configuration
    built on the unsharded model, each slot saving the value of its twin
    (an expert's slot from a replica of its slot; under ZeRO a
    non-expert slot gathered from the shards, `ShardedOptimizer.
    full_slot`) and restoring into it: the checkpoint's `optimizer`,
    under an unsharded run's keys.

    Raises:
      ValueError: an optimizer variable has no twin.
    """
    optimizer, sharded = context.optimizer, context.sharded
    view = views.optimizer_view(optimizer, self.unsharded)
    by_view = {id(p.view): p for p in self.pairs}
    ours = {}
    for holder in [optimizer] + ([sharded.experts] if sharded else []):
      mine = _slot_owners(holder, self.model.trainable_variables)
      for slot in holder.variables:
        owner, suffix = mine[slot.name]
        ours.setdefault((None if owner is None else id(owner), suffix), slot)
    owners = _slot_owners(view, self.unsharded.trainable_variables)
    for twin in view.variables:
      owner, suffix = owners[twin.name]
      pair = by_view.get(id(owner)) if owner is not None else None
      if pair is not None and sharded and _shards_through(
          twin, sharded.zero, pair.variable, suffix):
        continue
      found = ours.get((id(pair.variable) if pair else None, suffix))
      if found is None:
        raise ValueError(f"the optimizer variable {twin.path} has no twin "
                         "in the expert-parallel optimizer")
      slot_pair = _Pair(twin, found, pair.slot if pair else None)
      _gather_through(twin, lambda p=slot_pair: p.read(self.placement),
                      lambda value, p=slot_pair: p.write(value,
                                                         self.placement))
    return view


def build(build_model: Callable[[], keras.Model],
          strategy: tf.distribute.Strategy,
          expert_parallel: int) -> ExpertParallelStep:
  """Builds the unsharded model, then the expert-parallel one from it.

  Call before anything else of the run is built, outside the strategy's
  scope (the unsharded model draws the initial values an unsharded run
  draws).

  Args:
    build_model: builds the run's model (no arguments; in the current
      scope).
    strategy: the run's `MirroredStrategy` or
      `MultiWorkerMirroredStrategy` (its replicas, in order: every task's,
      `placement.replica_devices`; each task builds its own replicas'
      experts).
    expert_parallel: E_p (>= 2, dividing the replicas).

  Returns:
    The `ExpertParallelStep`.

  Raises:
    tfdist.errors.ConfigError: E_p not dividing the replicas or a layer's
      experts; a model without `MixtureOfExperts`.
    ValueError: the two models' weights do not pair up.
  """
  if not isinstance(strategy, (tf.distribute.MirroredStrategy,
                               tf.distribute.MultiWorkerMirroredStrategy)):
    raise errors.ConfigError(
        f"--expert_parallel={expert_parallel} runs under MirroredStrategy "
        "or MultiWorkerMirroredStrategy; the run's strategy is "
        f"{type(strategy).__name__}. Use --distribution_strategy=mirrored "
        "(or multi_worker_mirrored), or drop --expert_parallel.")
  placement = placement_lib.ExpertPlacement(
      expert_parallel, placement_lib.replica_devices(strategy))
  with tf.device("/cpu:0"):
    unsharded = build_model()
  if not moe_layer.moe_layers(unsharded):
    raise errors.ConfigError(
        f"--expert_parallel={expert_parallel} splits MixtureOfExperts "
        "layers, and the model has none. Build it with "
        "tfdist.MixtureOfExperts (or --transformer_experts), or drop "
        "--expert_parallel.")
  with strategy.scope(), placement_lib.placement_scope(placement):
    model = build_model()
  step = ExpertParallelStep(model, unsharded, placement)
  step.load_unsharded()
  theirs = tensor_mode._same_streams(unsharded)  # pylint: disable=protected-access
  for mine, twin in zip(tensor_mode._same_streams(model), theirs):  # pylint: disable=protected-access
    mine.state.assign(twin.state.numpy())
  logging.info("Expert parallelism: %s.", step.describe())
  return step


def placements(num_replicas: int) -> Tuple[int, ...]:
  """The E_p (>= 2) that divide `num_replicas`."""
  return tuple(n for n in range(2, num_replicas + 1) if num_replicas % n == 0)
