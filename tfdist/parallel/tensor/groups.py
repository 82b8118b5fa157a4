"""The tensor and data groups of one host's replicas (D x T = N).

`--tensor_parallel=T` on N = D * T replicas of a `MirroredStrategy` lays
the replicas out with `tfdist.parallel.mesh.DeviceMesh.build(devices,
tensor=T)`: tensor the fastest axis, so replica r (the strategy's r-th
device) holds tensor shard t = r mod T of data copy d = r // T. With 4
replicas and T = 2 the tensor groups are {0, 1} and {2, 3} (each one copy
of the model, split in two), the data groups {0, 2} and {1, 3} (the same
shard on each copy).

`TensorGroups` names those groups as `tfdist.parallel.collectives`
`DeviceGroup`s; inside `strategy.run` (traced by `tf.function`),
`TensorGroups.here()` gives the calling replica's place: its coordinates,
its tensor group (Megatron's f and g, the batch's all-gather) and its data
group (the gradients' all-reduce). With D = 1 the tensor group is every
replica, and the layers use `tf.distribute`'s own `ReplicaContext`
collectives instead (as before the mesh, and also eagerly).

`split_over(T)` is the scope in which the tensor-parallel layers are
built for T-way shards (outside it they split over every replica).
"""

import contextlib
import dataclasses
import threading
from typing import Dict, Iterator, Optional, Sequence, Tuple

from tfdist import errors
from tfdist.parallel import collectives
from tfdist.parallel import mesh as mesh_lib

_SCOPE = threading.local()


@contextlib.contextmanager
def split_over(tensor: Optional[int]) -> Iterator[None]:
  """Tensor-parallel layers built inside split their weights T ways
  (`tensor`; None: over every replica of the strategy), the strategy's N
  replicas forming N / T data-parallel copies.

  Args:
    tensor: T (>= 1), or None.
  """
  previous = getattr(_SCOPE, "tensor", None)
  _SCOPE.tensor = tensor
  try:
    yield
  finally:
    _SCOPE.tensor = previous


def current_degree() -> Optional[int]:
  """T of the innermost `split_over` scope, or None outside one."""
  return getattr(_SCOPE, "tensor", None)


@dataclasses.dataclass(frozen=True)
class Placement:
  """One replica's place in the mesh (`TensorGroups.here`).

  Attributes:
    device: its device's full name.
    data: its data-parallel copy d in [0, D).
    tensor: its shard t in [0, T).
    tensor_group: the `DeviceGroup` of its copy's T replicas.
    data_group: the `DeviceGroup` of the D replicas holding shard t.
  """

  device: str
  data: int
  tensor: int
  tensor_group: collectives.DeviceGroup
  data_group: collectives.DeviceGroup


@dataclasses.dataclass(frozen=True)
class TensorGroups:
  """The replicas of one host laid out as data x tensor.

  Build with `TensorGroups.of(devices, tensor)`.

  Attributes:
    mesh: the `DeviceMesh` over the replicas' full device names, in
      replica order.
    places: each device's `Placement`, by full device name.
  """

  mesh: mesh_lib.DeviceMesh
  places: Dict[str, Placement]

  @classmethod
  def of(cls, devices: Sequence[str], tensor: int) -> "TensorGroups":
    """The groups of `devices` (the strategy's replica devices, in replica
    order) split `tensor` ways.

    Raises:
      tfdist.errors.ConfigError: `tensor` does not divide the replicas
        (naming `--tensor_parallel`, from `DeviceMesh.build`), or a
        group's devices are not in replica order in TensorFlow's rank
        order (its all-gather would put the examples out of order).
    """
    # pylint: disable=protected-access
    names = tuple(collectives._canonical(d) for d in devices)
    # pylint: enable=protected-access
    mesh = mesh_lib.DeviceMesh.build(names, tensor=tensor)
    places = {}
    if mesh.data == 1:  # One group: tf.distribute's own collectives.
      return cls(mesh, places)
    tensor_groups = {g: collectives.DeviceGroup(g, name=f"tensor[{i}]")
                     for i, g in enumerate(mesh.groups("tensor"))}
    data_groups = {g: collectives.DeviceGroup(g, name=f"data[{i}]")
                   for i, g in enumerate(mesh.groups("data"))}
    for members, group in tensor_groups.items():
      if group.devices != members:
        raise errors.ConfigError(
            f"--tensor_parallel={tensor}: the tensor group {list(members)} "
            f"is not in TensorFlow's rank order ({list(group.devices)}). "
            "List the replicas' devices in index order.")
    for i, device in enumerate(names):
      c = mesh.coordinates(i)
      places[device] = Placement(
          device, c.data, c.tensor,
          tensor_groups[mesh.group_of("tensor", device)],
          data_groups[mesh.group_of("data", device)])
    return cls(mesh, places)

  @property
  def tensor(self) -> int:
    """T: the shards of each split weight."""
    return self.mesh.tensor

  @property
  def data(self) -> int:
    """D: the data-parallel copies."""
    return self.mesh.data

  @property
  def replicas(self) -> int:
    """N = D * T."""
    return self.mesh.size

  def shard_of_replica(self, replica: int) -> int:
    """The shard t replica `replica` holds (r mod T)."""
    return replica % self.tensor

  def here(self, what: str = "a tensor-parallel layer") -> Placement:
    """The calling replica's `Placement` (inside `strategy.run` traced by
    `tf.function`, D > 1).

    Raises:
      tfdist.errors.ConfigError: outside a replica function
        (`collectives.replica_device`), or on a device not in the mesh.
    """
    device = collectives.replica_device(what)
    place = self.places.get(device)
    if place is None:
      raise errors.ConfigError(
          f"{what} runs on {device}, which is not one of the mesh's "
          f"replicas {list(self.mesh.devices)}. Call it under the strategy "
          "it was built under.")
    return place


_CACHE: Dict[Tuple[Tuple[str, ...], int], TensorGroups] = {}


def groups_for(devices: Sequence[str], tensor: int) -> TensorGroups:
  """`TensorGroups.of(devices, tensor)`, made once per process for each
  (devices, tensor)."""
  key = (tuple(devices), int(tensor))
  if key not in _CACHE:
    _CACHE[key] = TensorGroups.of(devices, tensor)
  return _CACHE[key]
