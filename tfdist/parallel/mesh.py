"""A device mesh: data x pipeline x tensor parallelism over a device list.

`DeviceMesh.build(devices, pipeline=P, tensor=T)` lays N devices out as a
[pipeline, data, tensor] array in row-major order, the data degree
D = N / (P * T) derived unless given (the layout of Megatron-LM's
`initialize_model_parallel` and torchtitan's `ParallelDims`: tensor the
fastest-varying axis, so that a tensor-parallel group is T consecutive
devices, within one host when the list is ordered host by host; pipeline
the slowest, so that stage p holds devices [p*D*T, (p+1)*D*T)):

    index(d, p, t) = (p * D + d) * T + t

    mesh = DeviceMesh.build([f"/cpu:{i}" for i in range(8)],
                            pipeline=2, tensor=2)    # D = 2
    mesh.coordinates("/cpu:5")   # MeshCoordinates(data=0, pipeline=1,
                                 #   tensor=1, expert=0)
    mesh.groups("tensor")        # [("/cpu:0", "/cpu:1"), ...]: 4 groups

`groups(axis)` gives, for each axis, the devices that differ only along it:
what `tfdist.parallel.collectives.DeviceGroup` takes (each stage's
gradients are all-reduced over its data group; a tensor-parallel layer's
activations over its tensor group). An expert axis is reserved: its
degree is 1 (`expert=` other than 1 is refused until expert parallelism
lands).

This module describes the layout only (no TensorFlow, no training). The
trainer lays out `--tensor_parallel=T` on D x T replicas of one host with
it (`tfdist.parallel.tensor.groups`); pipelines do not use it yet.
`plan_lines()` is the `--dry_run` text (one line per device: its
coordinates); `factorizations(n)` lists every (data, pipeline, tensor)
whose product is n, for a planner.

Refusals raise `tfdist.errors.ConfigError` (exit status 2), naming the flag
(`--pipeline_stages`, `--tensor_parallel`), the value and the fix.
"""

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from tfdist import errors

# The axes, slowest-varying first in the device order (expert reserved).
AXES = ("pipeline", "data", "expert", "tensor")
# The flag that sets each degree (data: derived from the devices).
FLAGS = {"pipeline": "--pipeline_stages", "tensor": "--tensor_parallel",
         "data": "data", "expert": "expert"}


@dataclasses.dataclass(frozen=True)
class MeshCoordinates:
  """A device's position: each index in [0, that axis's degree)."""

  data: int
  pipeline: int
  tensor: int
  expert: int = 0


def _divisors(n: int) -> List[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(num_devices: int) -> List[Tuple[int, int, int]]:
  """Every (data, pipeline, tensor) with data * pipeline * tensor ==
  num_devices, sorted by data degree (largest first), then pipeline.

  Args:
    num_devices: the device count (>= 1).

  Returns:
    A list of (data, pipeline, tensor) triples; 8 devices give 10.

  Raises:
    tfdist.errors.ConfigError: num_devices < 1.
  """
  if num_devices < 1:
    raise errors.ConfigError(
        f"A mesh needs at least one device. Received: {num_devices}.")
  out = []
  for pipeline in _divisors(num_devices):
    for tensor in _divisors(num_devices // pipeline):
      out.append((num_devices // (pipeline * tensor), pipeline, tensor))
  return sorted(out, key=lambda f: (-f[0], f[1], f[2]))


def _check_degree(axis: str, value, num_devices: int):
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise errors.ConfigError(
        f"{FLAGS[axis]}={value!r} must be an integer >= 1 (1: no "
        f"{axis} parallelism).")
  if num_devices % value:
    raise errors.ConfigError(
        f"{FLAGS[axis]}={value} does not divide the {num_devices} devices. "
        f"Use one of {_divisors(num_devices)}, or run on a multiple of "
        f"{value} devices.")


@dataclasses.dataclass(frozen=True)
class DeviceMesh:
  """Devices laid out as [pipeline, data, expert, tensor] (row-major).

  Build one with `DeviceMesh.build`; the constructor checks that the
  degrees multiply to the device count.

  Attributes:
    devices: the ordered device names (a task's or the cluster's; order
      them host by host so tensor groups stay on one host).
    data: the data-parallel degree D.
    pipeline: the pipeline degree P (stages).
    tensor: the tensor-parallel degree T.
    expert: reserved; 1.
  """

  devices: Tuple[str, ...]
  data: int
  pipeline: int = 1
  tensor: int = 1
  expert: int = 1

  def __post_init__(self):
    object.__setattr__(self, "devices", tuple(self.devices))
    n = len(self.devices)
    if not n:
      raise errors.ConfigError("A mesh needs at least one device; the "
                               "device list is empty.")
    if len(set(self.devices)) != n:
      repeated = sorted({d for d in self.devices
                         if self.devices.count(d) > 1})
      raise errors.ConfigError(
          f"The mesh's device list names {repeated} more than once. Name "
          "each device once.")
    if self.expert != 1:
      raise errors.ConfigError(
          f"expert={self.expert!r}: the expert axis is reserved (degree 1) "
          "until expert parallelism is built. Use expert=1.")
    for axis in ("pipeline", "tensor", "data"):
      _check_degree(axis, getattr(self, axis), n)
    if self.data * self.pipeline * self.tensor != n:
      raise errors.ConfigError(
          f"data={self.data} x --pipeline_stages={self.pipeline} x "
          f"--tensor_parallel={self.tensor} = "
          f"{self.data * self.pipeline * self.tensor} devices, but there "
          f"are {n}. Leave the data degree out (it is then "
          f"{n} / (P x T)), or choose degrees whose product is {n}.")

  @classmethod
  def build(cls, devices: Sequence[str], *, pipeline: int = 1,
            tensor: int = 1, data: Optional[int] = None,
            expert: int = 1) -> "DeviceMesh":
    """A mesh over `devices`, the data degree derived unless given.

    Args:
      devices: ordered device names (N of them).
      pipeline: P, `--pipeline_stages` (>= 1; 1: no pipeline).
      tensor: T, `--tensor_parallel` (>= 1).
      data: D; defaults to N / (P * T).
      expert: reserved, 1.

    Returns:
      The `DeviceMesh`.

    Raises:
      tfdist.errors.ConfigError (status 2): a degree < 1; P, T or P * T
        not dividing N (the message names the flag, the value and the
        degrees that divide); D * P * T != N; expert != 1; an empty or
        repeated device list.
    """
    devices = tuple(devices)
    n = len(devices)
    if not n:
      raise errors.ConfigError("A mesh needs at least one device; the "
                               "device list is empty.")
    _check_degree("pipeline", pipeline, n)
    _check_degree("tensor", tensor, n)
    if n % (pipeline * tensor):
      raise errors.ConfigError(
          f"--pipeline_stages={pipeline} x --tensor_parallel={tensor} = "
          f"{pipeline * tensor} does not divide the {n} devices. With "
          f"--tensor_parallel={tensor} use --pipeline_stages in "
          f"{_divisors(n // tensor)}; with --pipeline_stages={pipeline} "
          f"use --tensor_parallel in {_divisors(n // pipeline)}.")
    if data is None:
      data = n // (pipeline * tensor)
    return cls(devices=devices, data=data, pipeline=pipeline, tensor=tensor,
               expert=expert)

  @property
  def size(self) -> int:
    """The number of devices."""
    return len(self.devices)

  @property
  def shape(self) -> Dict[str, int]:
    """`{"data": D, "pipeline": P, "tensor": T, "expert": 1}`."""
    return {"data": self.data, "pipeline": self.pipeline,
            "tensor": self.tensor, "expert": self.expert}

  def index(self, coordinates: MeshCoordinates) -> int:
    """The position in `devices` of the device at `coordinates`."""
    c = coordinates
    for axis in ("data", "pipeline", "tensor", "expert"):
      value = getattr(c, axis)
      if not 0 <= value < getattr(self, axis):
        raise errors.ConfigError(
            f"{axis}={value} is outside this mesh's {axis} degree "
            f"{getattr(self, axis)}.")
    return ((c.pipeline * self.data + c.data) * self.expert + c.expert
            ) * self.tensor + c.tensor

  def coordinates(self, device) -> MeshCoordinates:
    """The coordinates of `device` (a name in `devices`, or an index).

    Raises:
      tfdist.errors.ConfigError: a device not in the mesh.
    """
    if isinstance(device, int):
      if not 0 <= device < self.size:
        raise errors.ConfigError(
            f"Device index {device} is outside the mesh's {self.size} "
            "devices.")
      i = device
    elif device in self.devices:
      i = self.devices.index(device)
    else:
      raise errors.ConfigError(
          f"{device!r} is not a device of this mesh ({list(self.devices)}).")
    tensor = i % self.tensor
    rest = i // self.tensor
    expert = rest % self.expert
    rest //= self.expert
    return MeshCoordinates(data=rest % self.data,
                           pipeline=rest // self.data, tensor=tensor,
                           expert=expert)

  def groups(self, axis: str) -> List[Tuple[str, ...]]:
    """The device groups along `axis`: the devices that differ only in
    their `axis` coordinate, each group ordered by that coordinate.

    Args:
      axis: "data", "pipeline", "tensor" or "expert".

    Returns:
      N / degree groups of `degree` devices each, ordered by the other
      coordinates (pipeline, data, expert, tensor, slowest first). The
      groups of one axis partition the devices.

    Raises:
      tfdist.errors.ConfigError: an unknown axis.
    """
    if axis not in AXES:
      raise errors.ConfigError(
          f"axis={axis!r} is not one of {sorted(AXES)}.")
    by_rest = {}
    for i, device in enumerate(self.devices):
      c = dataclasses.asdict(self.coordinates(i))
      rest = tuple(c[a] for a in AXES if a != axis)
      by_rest.setdefault(rest, []).append((c[axis], device))
    return [tuple(d for _, d in sorted(members))
            for _, members in sorted(by_rest.items())]

  def group_of(self, axis: str, device) -> Tuple[str, ...]:
    """The group along `axis` that holds `device` (a name or index)."""
    name = self.devices[device] if isinstance(device, int) else device
    self.coordinates(name)
    return next(g for g in self.groups(axis) if name in g)

  def describe(self) -> str:
    """One line: `data 2 x pipeline 2 x tensor 2 over 8 devices`."""
    return (f"data {self.data} x pipeline {self.pipeline} x tensor "
            f"{self.tensor} over {self.size} devices")

  def plan_lines(self) -> List[str]:
    """The `--dry_run` text: a header, then one line per device with its
    coordinates, in device order."""
    width = max(len(d) for d in self.devices)
    lines = [f"mesh: {self.describe()} (tensor groups: consecutive "
             "devices; pipeline stages: blocks of data x tensor)"]
    for i, device in enumerate(self.devices):
      c = self.coordinates(i)
      lines.append(f"  {device:<{width}}  data {c.data}  pipeline "
                   f"{c.pipeline}  tensor {c.tensor}")
    return lines
