"""Data x pipeline parallelism: D copies of a P-stage pipeline, driven by one
process (on its devices, or as a cluster's chief on the tasks' devices).

A `DeviceMesh` of N = D * P devices (`tfdist.parallel.mesh.DeviceMesh.build(
devices, pipeline=P)`) puts stage p of copy d on device index(d, p) =
p * D + d. Copy 0 is the Keras model itself: its stages' variables live on
devices index(0, p) (`Pipeline.place_variables`), and the optimizer updates
them (its slots live beside them). Copies 1 .. D-1 are `DataCopies`: for
each of their stages a `tf.Variable` per weight of the stage (trainable or
not), on that copy's device of the stage, created here (zeros, never a
whole model on one device).

One step (`Pipeline.forward_backward(..., copies=...)`):

1. each copy's variables are assigned copy 0's current values (`sync`):
   the D - 1 copies read the weights copy 0's optimizer produced, and a
   restored checkpoint reaches them the same way;
2. the step's batch of B examples is cut into D contiguous shares of B/D
   (copy d gets examples [d*B/D, (d+1)*B/D): every example exactly once),
   and each copy runs the micro-batch schedule on its own P devices, its
   layers reading its own variables (`keras.StatelessScope`; the weight
   updates a layer makes in the forward pass, such as batch
   normalization's moving statistics, are kept for copy 0 only);
3. each stage's summed gradients are all-reduced across its D copies with
   `tfdist.parallel.collectives.all_reduce` over the stage's data group
   (`mesh.groups("data")[p]`), packed into one vector per stage and dtype
   (an embedding's sparse gradient is made dense for it: the whole
   table's bytes); copy 0's sum is the step's gradient, which the caller
   applies to the model. Across a cluster, where this process is the
   client driving the other tasks' devices
   (`tf.config.experimental_connect_to_cluster`), a group of one remote
   task's devices is all-reduced so too; a group holding one of the
   client's own devices, or spanning tasks, cannot be (its collective
   executor names the client's devices /job:localhost: "unknown device";
   measured, `tfdist.parallel.collectives`), and is summed on copy 0's
   device instead (`collective_groups` says which).

Per device, in bytes (S_p: stage p's weights; O_p: its optimizer state):
copy 0's device of stage p holds S_p (weights) + S_p (gradients) + O_p +
S_p (the packed all-reduce buffer); every other copy's, S_p (its weights)
+ S_p (gradients) + S_p (buffer), no optimizer state. Each step moves S_p
from copy 0 to each other copy (the weight refresh) and all-reduces S_p
within each stage's data group.

Equal to one device's update (up to float summation order): the loss of
each micro-batch is its share of the global batch's loss, so the sum over
copies and micro-batches is the unsplit step's gradient.

With tensor-parallel stages (`tfdist.parallel.pipeline.tensor`: a
mesh of tensor degree T, `DeviceMesh.build(devices, pipeline=P,
tensor=T)`), stage p of copy d runs on index(d, p, 0) = (p * D + d) * T,
each copy's variable of shard t (`stages.shard_of`) lives on index(d, p,
t), and the gradients of shard t are packed and all-reduced over their
own data group, the D devices (·, p, t).

Known limits: layers that draw random numbers (dropout) in copies 1..D-1
draw from the model's own seed state, without advancing it; a layer's
`add_loss` losses are not added (as in the pipeline of one copy).
"""

import contextlib
from typing import Dict, List, Optional, Sequence, Tuple

import keras
import tensorflow as tf

from tfdist import errors
from tfdist.parallel import collectives
from tfdist.parallel import mesh as mesh_lib
from tfdist.parallel.pipeline import stages as pipeline_lib


def copy0_devices(mesh: mesh_lib.DeviceMesh) -> List[str]:
  """The devices of copy 0's stages, stage p's at index p: index(0, p)."""
  return [mesh.devices[mesh.index(mesh_lib.MeshCoordinates(
      data=0, pipeline=p, tensor=0))] for p in range(mesh.pipeline)]


class DataCopies:
  """The D - 1 extra copies of a `Pipeline`'s stages on a data x pipeline
  mesh, and the all-reduce of each stage's gradients across the D copies.

  Attributes:
    mesh: the `DeviceMesh` (data D, pipeline P, tensor T: the shards of
      the stages' split layers, 1 without).
    groups: `{(p, t): collectives.DeviceGroup}`, P x T of them: shard t of
      stage p's data group (the D devices index(., p, t)).
    variables: `{(d, p): [tf.Variable]}` for d >= 1, one per weight of
      stage p (in `Stage.weights` order), on device index(d, p, its
      shard).
  """

  def __init__(self, pipeline, mesh: mesh_lib.DeviceMesh):
    """Creates the copies' variables (zeros until the first `sync`).

    Args:
      pipeline: the `Pipeline` (copy 0), its stage p on index(0, p).
      mesh: a `DeviceMesh` with pipeline == P and tensor == the stages'
        shards (1 without split layers).

    Raises:
      PipelineConfigError: the pipeline has virtual stages (interleaved),
        the mesh's pipeline degree is not the pipeline's P, its tensor
        degree is not the shards of the stages' split layers
        (`tfdist.parallel.pipeline.tensor`; 1 without), or a stage is not
        on copy 0's device of the mesh.
    """
    if pipeline.virtual_stages > 1:
      raise errors.PipelineConfigError(
          f"copies of a pipeline of virtual_stages="
          f"{pipeline.virtual_stages} chunks per stage (the interleaved "
          "schedule) are not built yet: split the model with "
          "virtual_stages=1 (schedule gpipe or 1f1b) for copies, or train "
          "one copy.")
    shards = 1 + max((pipeline_lib.shard_of(v) for stage in pipeline.stages
                      for v in stage.weights), default=0)
    if mesh.pipeline != pipeline.num_stages or mesh.tensor != shards:
      raise errors.PipelineConfigError(
          f"the mesh ({mesh.describe()}) does not fit a pipeline of "
          f"{pipeline.num_stages} stages whose layers are split {shards} "
          f"way(s): build it with DeviceMesh.build(devices, pipeline="
          f"{pipeline.num_stages}, tensor={shards}).")
    want = copy0_devices(mesh)
    for stage, device in zip(pipeline.stages, want):
      if not _same_device(stage.device, device):
        raise errors.PipelineConfigError(
            f"stage {stage.index} runs on {stage.device}, but copy 0's "
            f"device of that stage in the mesh is {device}: split the "
            f"model with devices=copy0_devices(mesh) ({want}).")
    self.pipeline = pipeline
    self.mesh = mesh
    # Stage p's shard t: the data group of the D devices (., p, t).
    self.groups = {
        (p, t): collectives.DeviceGroup(
            mesh.group_of("data", self.device(0, p, t)),
            name=f"data[stage {p}]" + (f"[shard {t}]" if mesh.tensor > 1
                                        else ""))
        for p in range(mesh.pipeline) for t in range(mesh.tensor)}
    # Which groups run as collectives here (`collective_groups`).
    self.collective = {key: _runs_as_collective(g.devices)
                       for key, g in self.groups.items()}
    self.variables: Dict[Tuple[int, int], List[tf.Variable]] = {}
    for d in range(1, mesh.data):
      for stage in pipeline.stages:
        mine = []
        for v in stage.weights:
          with tf.init_scope(), tf.device(self.device(
              d, stage.index, pipeline_lib.shard_of(v))):
            mine.append(tf.Variable(tf.zeros(v.shape, v.dtype),
                                    trainable=False,
                                    name=f"copy{d}/{v.name}"))
        self.variables[(d, stage.index)] = mine

  def collective_groups(self) -> List[bool]:
    """Per stage, whether its data group is all-reduced with
    `tfdist.parallel.collectives` (True) or summed on copy 0's device
    (a group this process drives but cannot run collectives on)."""
    return [all(self.collective[(p, t)] for t in range(self.mesh.tensor))
            for p in range(self.mesh.pipeline)]

  @property
  def data(self) -> int:
    """D."""
    return self.mesh.data

  def device(self, d: int, p: int, t: int = 0) -> str:
    """The device of copy `d`'s stage `p` (of its tensor shard `t`):
    index(d, p, t) = (p * D + d) * T + t."""
    return self.mesh.devices[self.mesh.index(
        mesh_lib.MeshCoordinates(data=d, pipeline=p, tensor=t))]

  def bytes_per_device(self) -> Dict[str, int]:
    """`{device: bytes of the copies' weights there}` (copies 1..D-1)."""
    out = {}
    for variables in self.variables.values():
      for v in variables:
        out[v.device] = (out.get(v.device, 0) +
                         int(v.shape.num_elements()) * v.dtype.size)
    return out

  def sync(self) -> None:
    """Assigns copy 0's current weights to every other copy's variables
    (each on its own device)."""
    for (d, p), variables in self.variables.items():
      for v, mine in zip(self.pipeline.stages[p].weights, variables):
        with tf.device(mine.device):
          mine.assign(tf.convert_to_tensor(v.value))

  def scope(self, d: int, p: int):
    """The context in which stage `p`'s layers read copy `d`'s variables
    (`keras.StatelessScope`; nothing for copy 0). Enter it inside the
    tape: the reads it makes are what the gradients flow back to."""
    if d == 0:
      return contextlib.nullcontext()
    values = []
    for mine in self.variables[(d, p)]:
      # Placed where it lives (a read alone names no device): a split
      # layer computes its shard there (`tfdist.parallel.pipeline.tensor`).
      with tf.device(mine.device):
        values.append(tf.identity(mine))
    return keras.StatelessScope(list(zip(self.pipeline.stages[p].weights,
                                         values)))

  def trainable(self, d: int, p: int) -> List:
    """Copy `d`'s variables of stage `p`'s trainable variables, in
    `Stage.trainable_variables` order (copy 0: the model's own)."""
    stage = self.pipeline.stages[p]
    if d == 0:
      return list(stage.trainable_variables)
    mine = {id(v): m for v, m in zip(stage.weights, self.variables[(d, p)])}
    return [mine[id(v)] for v in stage.trainable_variables]

  def all_reduce(self, sums: Sequence[Sequence[Sequence[Optional[tf.Tensor]]]]
                 ) -> List[List[tf.Tensor]]:
    """Each stage's gradients summed across the copies.

    Args:
      sums: `sums[d][p][j]`: copy d's gradient of stage p's j-th trainable
        variable (a tensor, `tf.IndexedSlices` or None: zeros).

    Returns:
      `reduced[p][j]`: the sum over the D copies, dense, on copy 0's
      device of stage p (of the variable's tensor shard).
    """
    reduced = []
    for p, stage in enumerate(self.pipeline.stages):
      variables = stage.trainable_variables
      per_copy = [[_dense(g, v) for g, v in zip(sums[d][p], variables)]
                  for d in range(self.data)]
      out = [None] * len(variables)
      kinds = {(str(g.dtype), pipeline_lib.shard_of(v))
               for g, v in zip(per_copy[0], variables)}
      for dtype, t in sorted(kinds):
        js = [j for j, (g, v) in enumerate(zip(per_copy[0], variables))
              if str(g.dtype) == dtype and pipeline_lib.shard_of(v) == t]
        self._reduce_packed(p, t, per_copy, js, out)
      reduced.append(out)
    return reduced

  def _reduce_packed(self, p: int, t: int, per_copy, js: List[int],
                     out) -> None:
    """All-reduces the gradients `js` of stage `p`'s shard `t` (one
    dtype) as one vector per copy over that shard's data group; puts copy
    0's results, unpacked, into `out`."""
    group = self.groups[(p, t)]
    packed = [None] * self.data
    for d in range(self.data):
      with tf.device(self.device(d, p, t)):
        packed[group.rank(self.device(d, p, t))] = tf.concat(
            [tf.reshape(per_copy[d][j], [-1]) for j in js], axis=0)
    if self.collective[(p, t)]:
      summed = collectives.all_reduce(group, packed)[
          group.rank(self.device(0, p, t))]
    else:
      with tf.device(self.device(0, p, t)):
        summed = tf.add_n(packed)
    with tf.device(self.device(0, p, t)):
      sizes = [int(per_copy[0][j].shape.num_elements()) for j in js]
      for j, piece in zip(js, tf.split(summed, sizes)):
        out[j] = tf.reshape(piece, per_copy[0][j].shape)


def _runs_as_collective(devices: Sequence[str]) -> bool:
  """Whether this process can run a collective over `devices`: always in
  one process (every device under its own address space, or a task of a
  cluster running its own program); as a client driving a cluster, only
  over devices that all belong to one other task."""
  # pylint: disable=g-import-not-at-top
  from tensorflow.python.eager import context
  # pylint: enable=g-import-not-at-top
  host = _task_of(context.context().host_address_space())
  tasks = {_task_of(d) for d in devices}
  listed = {_task_of(d.name) for d in tf.config.list_logical_devices()}
  if listed <= {host}:
    return True  # Not a client of other tasks' devices.
  return len(tasks) == 1 and host not in tasks


def _task_of(device: str) -> Tuple:
  """(job, replica, task) of a device or task name."""
  spec = tf.DeviceSpec.from_string(device)
  return (spec.job or "localhost", spec.replica or 0, spec.task or 0)


def _same_device(a: str, b: str) -> bool:
  """Whether device names `a` and `b` name one device (a field either
  leaves open, such as a local name's job, matches any)."""
  x, y = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
  for field in ("job", "replica", "task", "device_type", "device_index"):
    u, v = getattr(x, field), getattr(y, field)
    if field == "device_type":
      u, v = (u or "").upper() or None, (v or "").upper() or None
    if u is not None and v is not None and u != v:
      return False
  return True


def _dense(gradient, variable) -> tf.Tensor:
  """A gradient as a dense tensor of the variable's shape (zeros: None)."""
  if gradient is None:
    return tf.zeros(variable.shape, variable.dtype)
  return tf.convert_to_tensor(gradient)
