"""Collectives over a named sub-group of devices (one tensor per device).

`tf.distribute`'s `ReplicaContext.all_reduce` and `all_gather` always span
every replica of the strategy. A mesh of data x pipeline x tensor
parallelism (`tfdist.parallel.mesh`) needs collectives over sub-groups:
the 2 devices of one tensor-parallel group, the D copies of one pipeline
stage. This module runs them with TensorFlow's public raw collective ops
(`tf.raw_ops.CollectiveReduceV2`, `CollectiveGatherV2`,
`CollectiveReduceScatterV2`, `CollectiveAllToAllV2`), one op per device of
the group, inside one `tf.function` (or eagerly: each call then runs
through a cached `tf.function`, since eager ops run one at a time and the
first device's op would wait forever for the others).

    group = collectives.DeviceGroup(["/cpu:0", "/cpu:1"], name="tensor")
    summed = collectives.all_reduce(group, [x0, x1])   # [s, s], s = x0 + x1

Every function takes `tensors`, a list with one tensor per device of the
group that this process runs (`group.local_devices`: every device in one
process, this task's in a cluster where every task runs the same program),
in the group's order, each of the same shape and dtype, and returns a list
in the same order, each result made on its device. The group's order is
TensorFlow's rank order (by job, replica, task, device type and index:
`/cpu:10` after `/cpu:2`), whatever order the devices were given in:
all-gather concatenates in that order, and
reduce-scatter gives the i-th device the i-th chunk.

How they are made to work (measured, `../shared/notes/model-parallel.md`):

* Ordering tokens. Each device has one small resource variable (created
  once per process, outside any strategy's scope), and each collective on
  that device takes its handle as `ordering_token`, as TensorFlow's own
  `CollectiveReplicaLauncher` does. Without it, `tf.function`'s automatic
  control dependencies chain every device's collective in program order
  (device 1's waits for device 0's, which waits for device 1's) and they
  time out. With it, the collectives of one device run in program order
  and different groups (`{0,1}` and `{2,3}`, then `{0,2}` and `{1,3}`) run
  side by side in one function.
* Keys. A group key names one set of devices; instance keys name the
  collectives within a group (TensorFlow scopes instance keys under their
  group key). `tf.distribute`'s `MirroredStrategy` and
  `MultiWorkerMirroredStrategy` take their group keys from
  `cross_device_utils.CollectiveKeys(group_key_start=1 +
  _collective_key_base)`: 1, 2, 3, ... one per distinct device list, each
  strategy object counting from 1 again (`_collective_key_base` is 0
  except in TensorFlow's own tests, which add multiples of 100000), with
  instance keys from 100 (`INSTANCE_KEY_START_NUMBER`) within each group.
  The groups here take group keys in [`GROUP_KEY_START` = 2**30, 2**31)
  (2**30 plus the CRC-32 of the devices' names, modulo 2**30: the same set
  of devices gets the same key in every process, whatever order groups are
  made in; two sets that hash alike in one process are refused) and
  instance keys from `INSTANCE_KEY_START` = 2**30 upward within each group
  (one per collective traced or run eagerly), so they never meet a
  strategy's keys in the same program. Across processes, the tasks must
  trace the same collectives of a group in the same order (as
  MultiWorkerMirroredStrategy's workers do).
* Clusters. Proven (tests/collectives_workers_test.py) where every task
  runs the same program as a MultiWorkerMirroredStrategy worker does
  (`context.enable_collective_ops` with the cluster and a collective
  leader): each task passes its own devices' tensors and a group spans
  the tasks. One client driving a cluster
  (`tf.config.experimental_connect_to_cluster`) runs groups whose devices
  all belong to one remote task (tested); measured December 2026, a group
  spanning the client's and a remote task's devices timed out, and one of
  the client's own devices failed with "unknown device" (its collective
  executor names them /job:localhost): not supported.
* Gradients (`tf.custom_gradient`; TensorFlow registers none for the
  all-to-all and its all-gather gradient is an emulated reduce-scatter):
  all-reduce's gradient is the same all-reduce of the upstream gradients;
  all-gather's is a reduce-scatter (sum) along the same axis;
  reduce-scatter's is an all-gather (divided by the group size for a
  mean); all-to-all's is the inverse all-to-all (split and concatenation
  axes swapped). `copy_to_group` and `reduce_from_group` are Megatron's f
  and g (Shoeybi et al. 2019, arXiv:1909.08053, section 3): identity
  forward and all-reduce backward; all-reduce forward and identity
  backward.
* Reduce-scatter on CPU: TensorFlow has no CPU implementation of
  `CollectiveReduceScatterV2` ("did not find collective implementation").
  On a group of CPU devices `reduce_scatter` all-reduces the whole tensor
  and each device keeps its chunk: twice the bytes of a native
  reduce-scatter (a ring all-reduce moves 2(N-1)/N of the tensor per
  device, a ring reduce-scatter (N-1)/N). A group of GPUs runs the native
  op.
* Timeouts. Each group has a `timeout_seconds`: a collective whose peers
  do not all join within it fails with TensorFlow's `DeadlineExceededError`
  ("Collective has timed out waiting for other workers"). Eager calls raise
  `tfdist.errors.CollectiveTimeoutError` for it (exit status 200,
  retryable, like a lost MultiWorkerMirrored peer); a caller running its
  own `tf.function` gets the same by calling it inside
  `with collectives.timeouts_as_errors(group):`. After a timeout
  TensorFlow aborts the process's collective executor: later collectives
  in the same process fail too, so the process should exit (which is what
  the exit status is for).

Errors in the arguments (a tensor list of the wrong length, a dimension
that does not divide by the group size, duplicate devices) raise
`tfdist.errors.ConfigError` (status 2), naming the argument, the value and
the fix.
"""

import contextlib
import dataclasses
import itertools
import threading
import zlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from tfdist import errors

# Group keys: 2**30 upward (tf.distribute's strategies count from 1).
GROUP_KEY_START = 1 << 30
# Instance keys: 2**30 upward (tf.distribute's start at 100 per group).
INSTANCE_KEY_START = 1 << 30
# The default limit of one collective: generous for a first call in a
# cluster (group formation) and a slow step, short of a hang.
DEFAULT_TIMEOUT_SECONDS = 300.0

REDUCE_OPS = ("sum", "mean")

_LOCK = threading.Lock()
# The sets of devices given each group key in this process.
_GROUP_KEYS: Dict[int, Tuple[str, ...]] = {}
# The next instance key of each group key.
_INSTANCE_KEYS: Dict[int, "itertools.count"] = {}
_TOKENS: Dict[str, object] = {}
_EAGER_FUNCTIONS: Dict[tuple, Callable] = {}


def _canonical(device: str) -> str:
  """The full name of `device` (`/cpu:1` ->
  `/job:localhost/replica:0/task:0/device:CPU:1` in one process)."""
  # pylint: disable=g-import-not-at-top
  from tensorflow.python.distribute import device_util
  # pylint: enable=g-import-not-at-top
  return device_util.canonicalize(device)


def _rank_key(device: str):
  spec = tf.DeviceSpec.from_string(device)
  return (spec.job or "", spec.replica or 0, spec.task or 0,
          spec.device_type or "", spec.device_index or 0)


def _group_key(devices: Tuple[str, ...]) -> int:
  """A key in [GROUP_KEY_START, 2**31) from the devices' names (CRC-32):
  every process computes the same key for the same set, in any order."""
  key = GROUP_KEY_START + zlib.crc32(",".join(devices).encode()) % (
      (1 << 31) - GROUP_KEY_START)
  with _LOCK:
    known = _GROUP_KEYS.setdefault(key, devices)
  if known != devices:
    raise errors.ConfigError(
        f"The device groups {list(known)} and {list(devices)} hash to the "
        f"same group key {key}; this process cannot use both. Add or drop "
        "a device in one of them.")
  return key


def _next_instance_key(group_key: int) -> int:
  with _LOCK:
    keys = _INSTANCE_KEYS.setdefault(group_key,
                                     itertools.count(INSTANCE_KEY_START))
    return next(keys)


def _ordering_token(device: str):
  """The handle of `device`'s ordering-token variable (made once)."""
  with _LOCK:
    token = _TOKENS.get(device)
    if token is None:
      # pylint: disable=g-import-not-at-top
      from tensorflow.python.ops import resource_variable_ops
      # pylint: enable=g-import-not-at-top
      # ResourceVariable itself, not tf.Variable: no strategy's variable
      # creator (a MirroredVariable would not be one device's resource).
      with tf.init_scope(), tf.device(device):
        token = resource_variable_ops.ResourceVariable(
            0.0, trainable=False, name="collective_ordering_token")
      _TOKENS[device] = token
  return token.handle


@dataclasses.dataclass(frozen=True)
class DeviceGroup:
  """A named set of devices that run collectives together.

  Attributes:
    devices: the devices' full names in TensorFlow's rank order (job,
      replica, task, device type, index), however they were given.
    name: a name for messages (`"tensor"`, `"data[1]"`); defaults to
      `"group"`.
    timeout_seconds: the limit of each collective in seconds (> 0), or
      None for no limit. Defaults to `DEFAULT_TIMEOUT_SECONDS` (300).
    group_key: TensorFlow's group key in [`GROUP_KEY_START`, 2**31), from
      the devices' names: the same set gets the same key in every process.

  Args (the constructor's): `devices` (a sequence of device names such as
  `"/cpu:0"` or `"/job:worker/replica:0/task:1/device:CPU:0"`), then
  `name` and `timeout_seconds` as keywords.

  Raises:
    tfdist.errors.ConfigError: no devices, a device named twice, devices
      of different types, a timeout <= 0, or (most unlikely) a group key
      already taken by another set of devices in this process.
  """

  devices: Tuple[str, ...]
  name: str = "group"
  timeout_seconds: Optional[float] = DEFAULT_TIMEOUT_SECONDS
  group_key: int = dataclasses.field(default=0, compare=False)

  def __post_init__(self):
    given = tuple(self.devices)
    if not given:
      raise errors.ConfigError(
          f"DeviceGroup {self.name!r}: devices is empty. Name at least one "
          "device, e.g. devices=['/cpu:0', '/cpu:1'].")
    full = [_canonical(d) for d in given]
    repeated = sorted({d for d in full if full.count(d) > 1})
    if repeated:
      raise errors.ConfigError(
          f"DeviceGroup {self.name!r}: devices={list(given)} names "
          f"{repeated} more than once. Name each device once.")
    types = sorted({tf.DeviceSpec.from_string(d).device_type for d in full})
    if len(types) > 1:
      raise errors.ConfigError(
          f"DeviceGroup {self.name!r}: devices={list(given)} mixes device "
          f"types {types}. A collective group holds devices of one type.")
    if self.timeout_seconds is not None and not self.timeout_seconds > 0:
      raise errors.ConfigError(
          f"DeviceGroup {self.name!r}: timeout_seconds="
          f"{self.timeout_seconds} must be > 0 (or None for no limit).")
    ordered = tuple(sorted(full, key=_rank_key))
    object.__setattr__(self, "devices", ordered)
    object.__setattr__(self, "group_key", _group_key(ordered))

  @property
  def size(self) -> int:
    """The number of devices."""
    return len(self.devices)

  @property
  def device_type(self) -> str:
    """`"CPU"`, `"GPU"`, ... (one type per group)."""
    return tf.DeviceSpec.from_string(self.devices[0]).device_type

  @property
  def native_reduce_scatter(self) -> bool:
    """True where TensorFlow implements `CollectiveReduceScatterV2` (GPUs,
    NCCL); False on CPUs (all-reduce then slice: 2x the bytes)."""
    return self.device_type == "GPU"

  @property
  def local_devices(self) -> Tuple[str, ...]:
    """The group's devices this process runs collectives on, in group
    order: those `tf.config.list_logical_devices()` lists. In one process
    (and for a client of `tf.config.experimental_connect_to_cluster`,
    which lists the remote devices too) every device; in a cluster where
    each task runs its own program (`enable_collective_ops`, as
    MultiWorkerMirroredStrategy does), this task's.

    Raises:
      tfdist.errors.ConfigError: none of the group's devices is here.
    """
    here = {_canonical(d.name) for d in tf.config.list_logical_devices()}
    local = tuple(d for d in self.devices if d in here)
    if not local:
      raise errors.ConfigError(
          f"None of the devices of {self.describe()} is in this process "
          f"(it has {sorted(here)}). Run the group's collectives in the "
          "processes that hold its devices.")
    return local

  def rank(self, device: str) -> int:
    """`device`'s position in `devices` (its chunk in a reduce-scatter)."""
    return self.devices.index(_canonical(device))

  def describe(self) -> str:
    """One line: name, size, devices."""
    return f"group {self.name!r} ({self.size} devices: " + ", ".join(
        self.devices) + ")"


# --- the raw ops, one per device (no gradients) ------------------------------
def _op_kwargs(group: DeviceGroup, device: str, instance_key: int) -> dict:
  return dict(group_size=group.size, group_key=group.group_key,
              instance_key=instance_key,
              ordering_token=[_ordering_token(device)],
              timeout_seconds=float(group.timeout_seconds or 0))


def _to_front(x, axis: int):
  """`x` with `axis` moved first, and the permutation that undoes it."""
  if axis == 0:
    return x, None
  rank = x.shape.rank
  perm = [axis] + [i for i in range(rank) if i != axis]
  inverse = [perm.index(i) for i in range(rank)]
  return tf.transpose(x, perm), inverse


def _from_front(x, inverse):
  return x if inverse is None else tf.transpose(x, inverse)


def _raw_reduce(group, xs, op):
  key = _next_instance_key(group.group_key)
  final = "Div" if op == "mean" else "Id"
  out = []
  for device, x in zip(group.local_devices, xs):
    with tf.device(device):
      out.append(tf.raw_ops.CollectiveReduceV2(
          input=x, merge_op="Add", final_op=final,
          **_op_kwargs(group, device, key)))
  return out


def _raw_gather(group, xs, axis):
  key = _next_instance_key(group.group_key)
  out = []
  for device, x in zip(group.local_devices, xs):
    with tf.device(device):
      front, inverse = _to_front(x, axis)
      out.append(_from_front(tf.raw_ops.CollectiveGatherV2(
          input=front, **_op_kwargs(group, device, key)), inverse))
  return out


def _raw_reduce_scatter(group, xs, op, axis):
  if not group.native_reduce_scatter:
    # No CPU kernel: all-reduce, then each device keeps its chunk.
    out = []
    for device, x in zip(group.local_devices, _raw_reduce(group, xs, op)):
      with tf.device(device):
        out.append(tf.split(x, group.size, axis=axis)[group.rank(device)])
    return out
  key = _next_instance_key(group.group_key)
  final = "Div" if op == "mean" else "Id"
  out = []
  for device, x in zip(group.local_devices, xs):
    with tf.device(device):
      front, inverse = _to_front(x, axis)
      out.append(_from_front(tf.raw_ops.CollectiveReduceScatterV2(
          input=front, merge_op="Add", final_op=final,
          **_op_kwargs(group, device, key)), inverse))
  return out


def _raw_all_to_all(group, xs, split_axis, concat_axis):
  key = _next_instance_key(group.group_key)
  n = group.size
  out = []
  for device, x in zip(group.local_devices, xs):
    with tf.device(device):
      front, inverse = _to_front(x, split_axis)
      # Device i receives chunk i of every device, in rank order, along
      # the first axis, whose size must be the group size: [N, rest].
      received = tf.reshape(tf.raw_ops.CollectiveAllToAllV2(
          input=tf.reshape(front, [n, -1]),
          **_op_kwargs(group, device, key)), tf.shape(front))
      chunks = [_from_front(c, inverse) for c in tf.split(received, n, 0)]
      out.append(tf.concat(chunks, axis=concat_axis))
  return out


# --- arguments ---------------------------------------------------------------
def _check(group: DeviceGroup, tensors, what: str) -> List[tf.Tensor]:
  if not isinstance(group, DeviceGroup):
    raise errors.ConfigError(
        f"{what}: group={group!r} is not a DeviceGroup. Pass "
        "collectives.DeviceGroup([...devices...]).")
  tensors = list(tensors)
  if len(tensors) != len(group.local_devices):
    raise errors.ConfigError(
        f"{what}: {len(tensors)} tensors for {group.describe()}. Pass one "
        "tensor per device of the group in this process "
        f"({len(group.local_devices)}: group.local_devices), in that "
        "order.")
  out = []
  for device, t in zip(group.local_devices, tensors):
    with tf.device(device):
      out.append(tf.convert_to_tensor(t))
  shapes = {tuple(t.shape.as_list()) if t.shape.rank is not None else None
            for t in out}
  dtypes = {t.dtype for t in out}
  if len(shapes) > 1 or len(dtypes) > 1:
    raise errors.ConfigError(
        f"{what}: the tensors differ in shape or dtype "
        f"({sorted(map(str, shapes))}, {sorted(d.name for d in dtypes)}) "
        f"over {group.describe()}. Pass tensors of one shape and dtype.")
  return out


def _check_op(op: str, what: str):
  if op not in REDUCE_OPS:
    raise errors.ConfigError(
        f"{what}: op={op!r} is not one of {list(REDUCE_OPS)}.")


def _check_axis(tensor, axis: int, argument: str, what: str,
                divisor: Optional[int] = None) -> int:
  rank = tensor.shape.rank
  if rank is None or not -rank <= axis < max(rank, 1):
    raise errors.ConfigError(
        f"{what}: {argument}={axis} is outside the tensors' rank {rank}. "
        f"Pass an axis in [-{rank}, {rank}).")
  axis %= rank
  size = tensor.shape[axis]
  if divisor and size is not None and size % divisor:
    raise errors.ConfigError(
        f"{what}: dimension {axis} of the tensors ({size}) does not divide "
        f"by the group size {divisor} ({argument}={axis}). Pad it to a "
        f"multiple of {divisor}, or choose another axis.")
  return axis


def _placed(group: DeviceGroup, ys) -> List[tf.Tensor]:
  """`ys` each made on its device (`tf.custom_gradient`'s output
  identities carry no device of their own)."""
  out = []
  for device, y in zip(group.local_devices, ys):
    with tf.device(device):
      out.append(tf.identity(y))
  return out


# --- eager calls and timeouts ------------------------------------------------
@contextlib.contextmanager
def timeouts_as_errors(group: Optional[DeviceGroup] = None):
  """Turns a collective's timeout inside the block into tfdist's error.

  Wrap the call of a `tf.function` that runs these collectives (eager
  calls here do it themselves).

  Args:
    group: named in the message, if given.

  Raises:
    tfdist.errors.CollectiveTimeoutError: a `tf.errors.DeadlineExceeded
      Error` of a collective ("Collective has timed out ...") was raised
      in the block (exit status 200). Other errors pass unchanged.
  """
  try:
    yield
  except tf.errors.DeadlineExceededError as e:
    if "ollective" not in str(e):
      raise
    where = group.describe() if group is not None else "a device group"
    limit = (f"{group.timeout_seconds:g} s" if group is not None and
             group.timeout_seconds else "its timeout")
    raise errors.CollectiveTimeoutError(
        f"A collective over {where} timed out after {limit}: a device of "
        "the group never joined (a lost or stalled worker, or a device "
        "that did not run the same collectives in the same order). "
        "TensorFlow's error: " + errors.first_line(e) + " Restart the "
        "run; if steps are slow rather than stuck, raise timeout_seconds."
    ) from e


def _call(kind: str, group: DeviceGroup, tensors, params: tuple,
          body: Callable):
  """`body(tensors)` in a function: traced into the caller's function, or
  eagerly through a `tf.function` cached per kind, group and params."""
  if not tf.executing_eagerly():
    return body(tensors)
  cache_key = (kind, group, params)
  fn = _EAGER_FUNCTIONS.get(cache_key)
  if fn is None:
    fn = tf.function(lambda *xs: body(list(xs)))
    _EAGER_FUNCTIONS[cache_key] = fn
  with timeouts_as_errors(group):
    return list(fn(*tensors))


# --- the collectives ---------------------------------------------------------
def all_reduce(group: DeviceGroup, tensors: Sequence, op: str = "sum"
               ) -> List[tf.Tensor]:
  """Sum (or mean) of the devices' tensors, on every device.

  Args:
    group: the devices.
    tensors: one tensor per local device (`group.local_devices`), all of one
      shape and dtype (float or integer; a mean needs a float dtype).
    op: `"sum"` or `"mean"` (sum / group size).

  Returns:
    `group.size` tensors of the input shape and dtype, each on its device,
    all equal to the sum (mean).
    Gradient: the same all-reduce of the upstream gradients.

  Raises:
    tfdist.errors.ConfigError: bad arguments (the message names which).
    tfdist.errors.CollectiveTimeoutError: eagerly, a device never joined.
  """
  _check_op(op, "all_reduce")
  tensors = _check(group, tensors, "all_reduce")

  def body(xs):
    @tf.custom_gradient
    def reduce(*xs):
      def grad(*dys):
        return _raw_reduce(group, dys, op)
      return _raw_reduce(group, xs, op), grad
    return _placed(group, reduce(*xs))
  return _call("all_reduce", group, tensors, (op,), body)


def all_gather(group: DeviceGroup, tensors: Sequence, axis: int = 0
               ) -> List[tf.Tensor]:
  """The devices' tensors concatenated along `axis`, on every device.

  Args:
    group: the devices.
    tensors: one tensor per device, all of one shape [..., d, ...] (d at
      `axis`) and dtype.
    axis: the concatenation axis (negative counts from the end).

  Returns:
    `group.size` equal tensors of shape [..., N*d, ...], chunk i from
    device i (`group.devices` order).
    Gradient: a reduce-scatter (sum) of the upstream gradients along
    `axis` (device i gets the sum over devices of their chunk i).

  Raises:
    tfdist.errors.ConfigError: bad arguments.
    tfdist.errors.CollectiveTimeoutError: eagerly, a device never joined.
  """
  tensors = _check(group, tensors, "all_gather")
  axis = _check_axis(tensors[0], axis, "axis", "all_gather")

  def body(xs):
    @tf.custom_gradient
    def gather(*xs):
      def grad(*dys):
        return _raw_reduce_scatter(group, dys, "sum", axis)
      return _raw_gather(group, xs, axis), grad
    return _placed(group, gather(*xs))
  return _call("all_gather", group, tensors, (axis,), body)


def reduce_scatter(group: DeviceGroup, tensors: Sequence, op: str = "sum",
                   axis: int = 0) -> List[tf.Tensor]:
  """Chunk i (along `axis`) of the devices' sum (or mean), on device i.

  On GPUs TensorFlow's `CollectiveReduceScatterV2`; on CPUs, which have no
  implementation of it, an all-reduce of the whole tensor followed by a
  slice: twice the bytes of a native reduce-scatter.

  Args:
    group: the devices.
    tensors: one tensor per device, all of one shape [..., N*c, ...] (N*c
      at `axis`, N = group size) and dtype.
    op: `"sum"` or `"mean"`.
    axis: the axis cut into N equal chunks.

  Returns:
    `group.size` tensors of shape [..., c, ...]: device i's is chunk i of
    the sum (mean).
    Gradient: an all-gather of the upstream gradients along `axis`
    (divided by N for a mean).

  Raises:
    tfdist.errors.ConfigError: bad arguments, or the dimension at `axis`
      does not divide by N.
    tfdist.errors.CollectiveTimeoutError: eagerly, a device never joined.
  """
  _check_op(op, "reduce_scatter")
  tensors = _check(group, tensors, "reduce_scatter")
  axis = _check_axis(tensors[0], axis, "axis", "reduce_scatter", group.size)

  def body(xs):
    @tf.custom_gradient
    def scatter(*xs):
      def grad(*dys):
        gathered = _raw_gather(group, dys, axis)
        if op == "mean":
          gathered = [g / tf.cast(group.size, g.dtype) for g in gathered]
        return gathered
      return _raw_reduce_scatter(group, xs, op, axis), grad
    return _placed(group, scatter(*xs))
  return _call("reduce_scatter", group, tensors, (op, axis), body)


def all_to_all(group: DeviceGroup, tensors: Sequence, split_axis: int = 0,
               concat_axis: Optional[int] = None) -> List[tf.Tensor]:
  """Device i receives chunk i of every device's tensor.

  Each device's tensor is cut into N equal chunks along `split_axis`;
  device i's result is the N chunks i (from devices 0..N-1, in order)
  concatenated along `concat_axis` (the experts' dispatch: split by
  destination, concatenate by source).

  Args:
    group: the devices.
    tensors: one tensor per device, all of one shape and dtype; the
      dimension at `split_axis` divides by N (the group size).
    split_axis: the axis cut into chunks.
    concat_axis: the axis the received chunks are concatenated along;
      defaults to `split_axis` (the shape is then unchanged).

  Returns:
    `group.size` tensors: the input shape with dimension `split_axis`
    divided by N and dimension `concat_axis` multiplied by N.
    Gradient: the inverse all-to-all (the axes swapped) of the upstream
    gradients. (TensorFlow registers no gradient for the op.)

  Raises:
    tfdist.errors.ConfigError: bad arguments, or the dimension at
      `split_axis` does not divide by N.
    tfdist.errors.CollectiveTimeoutError: eagerly, a device never joined.
  """
  tensors = _check(group, tensors, "all_to_all")
  split_axis = _check_axis(tensors[0], split_axis, "split_axis",
                           "all_to_all", group.size)
  concat_axis = split_axis if concat_axis is None else _check_axis(
      tensors[0], concat_axis, "concat_axis", "all_to_all")

  def body(xs):
    @tf.custom_gradient
    def exchange(*xs):
      def grad(*dys):
        return _raw_all_to_all(group, dys, concat_axis, split_axis)
      return _raw_all_to_all(group, xs, split_axis, concat_axis), grad
    return _placed(group, exchange(*xs))
  return _call("all_to_all", group, tensors, (split_axis, concat_axis), body)


def copy_to_group(group: DeviceGroup, tensors: Sequence) -> List[tf.Tensor]:
  """Megatron's f (before a column-parallel layer): identity forward,
  all-reduce (sum) of the gradients backward.

  Args:
    group: the tensor-parallel devices.
    tensors: one tensor per device (the same activation on each).

  Returns:
    The tensors unchanged, each on its device. Gradient: the sum over the
    group of the upstream gradients, on every device (each device's
    gradient covers only its own columns).

  Raises:
    tfdist.errors.ConfigError: bad arguments.
  """
  tensors = _check(group, tensors, "copy_to_group")

  def body(xs):
    @tf.custom_gradient
    def f(*xs):
      def grad(*dys):
        return _raw_reduce(group, dys, "sum")
      return [tf.identity(x) for x in xs], grad
    return _placed(group, f(*xs))
  return _call("copy_to_group", group, tensors, (), body)


def reduce_from_group(group: DeviceGroup, tensors: Sequence
                      ) -> List[tf.Tensor]:
  """Megatron's g (after a row-parallel layer): all-reduce (sum) forward,
  identity backward.

  The backward pass is an identity because every device of a
  tensor-parallel group computes the same loss from the same reduced
  output; a plain `all_reduce` would multiply the gradients by N.

  Args:
    group: the tensor-parallel devices.
    tensors: one partial sum per device, all of one shape and dtype.

  Returns:
    `group.size` equal tensors: the sum. Gradient: each device's upstream
    gradient unchanged.

  Raises:
    tfdist.errors.ConfigError: bad arguments.
    tfdist.errors.CollectiveTimeoutError: eagerly, a device never joined.
  """
  tensors = _check(group, tensors, "reduce_from_group")

  def body(xs):
    @tf.custom_gradient
    def g(*xs):
      def grad(*dys):
        return [tf.identity(d) for d in dys]
      return _raw_reduce(group, xs, "sum"), grad
    return _placed(group, g(*xs))
  return _call("reduce_from_group", group, tensors, (), body)
