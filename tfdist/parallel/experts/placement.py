"""Where the experts live under expert parallelism (`--expert_parallel`).

R replicas (a `MirroredStrategy`'s on one host, or a
`MultiWorkerMirroredStrategy`'s over its workers: `replica_devices`) are
cut into R / E_p
*expert groups* of E_p consecutive replicas (replicas g*E_p ..
(g+1)*E_p - 1); within a group, the replica of rank s (its *slot*)
holds experts s*L .. (s+1)*L - 1, L = E / E_p. Replicas of the same slot
in different groups hold the same experts (a data-parallel copy): their
gradients are summed over that *slot group* of R / E_p replicas.

`ExpertPlacement` names the groups (`tfdist.parallel.collectives
.DeviceGroup`s); `placement_scope` makes `MixtureOfExperts` layers
constructed inside it expert-parallel; `per_replica_variables` makes the
variables created inside it sync-on-read with aggregation NONE (one
different value per replica, as `tfdist.parallel.tensor.layers` keeps
its shards): each replica's copy holds its own slot's experts.
"""

import contextlib
import dataclasses
import threading
from typing import Optional, Sequence, Tuple

import tensorflow as tf

from tfdist import errors
from tfdist.parallel import collectives

_STATE = threading.local()


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
  """The expert groups of R replicas, E_p replicas each.

  Attributes:
    expert_parallel: E_p (>= 2), the replicas one set of experts is split
      over.
    devices: the R replicas' devices, in replica order (every task's,
      under MultiWorkerMirrored: `replica_devices`).
  """
  expert_parallel: int
  devices: Tuple[str, ...]

  def __post_init__(self):
    n, r = self.expert_parallel, len(self.devices)
    if n < 2 or r % n:
      raise errors.ConfigError(
          f"--expert_parallel={n} must be >= 2 and divide the {r} replicas "
          f"in sync. Use a divisor of {r}, or 1 (off).")
    object.__setattr__(self, "devices", tuple(
        collectives._canonical(d) for d in self.devices))  # pylint: disable=protected-access

  @property
  def num_replicas(self) -> int:
    return len(self.devices)

  @property
  def copies(self) -> int:
    """D = R / E_p: the data-parallel copies of each expert."""
    return self.num_replicas // self.expert_parallel

  def slot(self, replica: int) -> int:
    """The slot (rank in its expert group) of replica `replica`."""
    return replica % self.expert_parallel

  def replica_of(self, device: str) -> int:
    """The replica index of `device` (a full device name)."""
    return self.devices.index(collectives._canonical(device))  # pylint: disable=protected-access

  def expert_group(self, replica: int) -> collectives.DeviceGroup:
    """The E_p replicas that exchange tokens with `replica`."""
    start = replica - self.slot(replica)
    return collectives.DeviceGroup(
        self.devices[start:start + self.expert_parallel],
        name=f"experts[{start // self.expert_parallel}]")

  def slot_group(self, replica: int) -> collectives.DeviceGroup:
    """The D replicas holding the same experts as `replica`."""
    return collectives.DeviceGroup(
        self.devices[self.slot(replica)::self.expert_parallel],
        name=f"expert_slot[{self.slot(replica)}]")

  def all_group(self) -> collectives.DeviceGroup:
    """Every replica (the global batch's router statistics)."""
    return collectives.DeviceGroup(self.devices, name="experts_all")


def replica_devices(strategy: tf.distribute.Strategy) -> Tuple[str, ...]:
  """Every replica's device, in replica order (`replica_id_in_sync_group`).

  A `MirroredStrategy`'s devices are its replicas. A
  `MultiWorkerMirroredStrategy` lists only this task's devices; its
  replicas are every task's, numbered as TensorFlow numbers them (the
  chief first, then the workers by index; each task's devices in its own
  order, every task holding as many): this task's device names, renamed
  to each task.
  """
  local = tuple(strategy.extended.worker_devices)
  if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    return local
  cluster = strategy.cluster_resolver.cluster_spec().as_dict()
  tasks = [(job, index) for job in ("chief", "worker")
           for index in range(len(cluster.get(job, ())))]
  if not tasks:
    return local  # No cluster: one local worker.
  return tuple(
      tf.DeviceSpec.from_string(device).replace(
          job=job, replica=0, task=index).to_string()
      for job, index in tasks for device in local)


def current() -> Optional[ExpertPlacement]:
  """The placement of the innermost `placement_scope`, or None."""
  return getattr(_STATE, "placement", None)


@contextlib.contextmanager
def placement_scope(placement: ExpertPlacement):
  """`MixtureOfExperts` layers constructed inside are expert-parallel over
  `placement` (their experts split over each expert group's replicas)."""
  before = current()
  _STATE.placement = placement
  try:
    yield placement
  finally:
    _STATE.placement = before


@contextlib.contextmanager
def per_replica_variables():
  """Variables created inside (in a `MirroredStrategy`'s scope) are
  sync-on-read with aggregation NONE: one independent value per replica,
  read locally in replica context, refused in cross-replica context."""
  def creator(next_creator, **kwargs):
    kwargs["synchronization"] = tf.VariableSynchronization.ON_READ
    kwargs["aggregation"] = tf.VariableAggregation.NONE
    return next_creator(**kwargs)

  with tf.variable_creator_scope(creator):
    yield


def split_experts(values: Sequence, placement: ExpertPlacement) -> list:
  """Per replica, the values of its slot: `values` is one entry per
  expert (E of them), the result one list of L entries per replica."""
  per_slot = len(values) // placement.expert_parallel
  return [list(values[placement.slot(r) * per_slot:
                      (placement.slot(r) + 1) * per_slot])
          for r in range(placement.num_replicas)]
