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

Inside `strategy.run` (a MirroredStrategy's or MultiWorkerMirrored's
replica function, traced by `tf.function`), each replica makes only its
own device's op: the `replica_` functions take that replica's one tensor
and return its result (`replica_all_reduce`, `replica_all_gather`,
`replica_all_to_all`, `replica_copy_to_group`,
`replica_reduce_from_group`), with the same gradients:

    rid = ...  # the replica's index; its tensor-parallel group:
    y = collectives.replica_reduce_from_group(tensor_groups[rid // 2], x)

Each device counts its own collectives of a group for the instance keys,
so the replicas' ops of one collective meet whether they were made by one
call or by one trace per replica.

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
  executor names them /job:localhost): not supported. Under a
  `MultiWorkerMirroredStrategy` itself the `replica_` functions span the
  workers (tests/experts_workers_test.py: expert parallelism's
  all-to-all), but the list functions do not work: there
  `tf.config.list_logical_devices()` lists every task's devices (measured
  December 2026, 2 workers: each lists the chief's and worker 0's CPU),
  so `local_devices` is the whole group and a task cannot pass the other
  task's tensors.
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
# The next instance key of each (group key, device).
_INSTANCE_KEYS: Dict[Tuple[int, str], "itertools.count"] = {}
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


def _next_instance_key(group_key: int, device: str) -> int:
  """The next instance key of `device` in the group `group_key`: each
  device counts its own collectives, so the n-th collective of a group
  gets the same key on every device, whether one caller makes every
  device's op (the list functions) or each replica makes its own (the
  `replica_` functions, traced once per replica)."""
  with _LOCK:
    keys = _INSTANCE_KEYS.setdefault((group_key, device),
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
    each task runs its own program (`enable_collective_ops` alone, as
    tests/collectives_workers_test.py runs it), this task's. Under a
    MultiWorkerMirroredStrategy every task's (its runtime lists the
    remote devices): use the `replica_` functions there.

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
def _op_kwargs(group: DeviceGroup, device: str) -> dict:
  return dict(group_size=group.size, group_key=group.group_key,
              instance_key=_next_instance_key(group.group_key, device),
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


# Each takes `devices`: the devices whose ops this call makes, one per
# tensor of `xs` (`group.local_devices` for the list functions, the
# calling replica's one device for the `replica_` functions).
def _raw_reduce(group, xs, op, devices):
  final = "Div" if op == "mean" else "Id"
  out = []
  for device, x in zip(devices, xs):
    with tf.device(device):
      out.append(tf.raw_ops.CollectiveReduceV2(
          input=x, merge_op="Add", final_op=final,
          **_op_kwargs(group, device)))
  return out


def _raw_gather(group, xs, axis, devices):
  out = []
  for device, x in zip(devices, xs):
    with tf.device(device):
      front, inverse = _to_front(x, axis)
      out.append(_from_front(tf.raw_ops.CollectiveGatherV2(
          input=front, **_op_kwargs(group, device)), inverse))
  return out


def _raw_reduce_scatter(group, xs, op, axis, devices):
  if not group.native_reduce_scatter:
    # No CPU kernel: all-reduce, then each device keeps its chunk.
    out = []
    for device, x in zip(devices, _raw_reduce(group, xs, op, devices)):
      with tf.device(device):
        out.append(tf.split(x, group.size, axis=axis)[group.rank(device)])
    return out
  final = "Div" if op == "mean" else "Id"
  out = []
  for device, x in zip(devices, xs):
    with tf.device(device):
      front, inverse = _to_front(x, axis)
      out.append(_from_front(tf.raw_ops.CollectiveReduceScatterV2(
          input=front, merge_op="Add", final_op=final,
          **_op_kwargs(group, device)), inverse))
  return out


def _raw_all_to_all(group, xs, split_axis, concat_axis, devices):
  n = group.size
  out = []
  for device, x in zip(devices, xs):
    with tf.device(device):
      front, inverse = _to_front(x, split_axis)
      # Device i receives chunk i of every device, in rank order, along
      # the first axis, whose size must be the group size: [N, rest].
      received = tf.reshape(tf.raw_ops.CollectiveAllToAllV2(
          input=tf.reshape(front, [n, -1]),
          **_op_kwargs(group, device)), tf.shape(front))
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


# --- forward and backward of each collective ---------------------------------
# Each pair takes (xs, devices): one tensor per device whose op the call
# makes. The backward of each is the collective that undoes its effect on
# the gradients (the module docstring, "Gradients").
def _all_reduce_ops(group, op):
  return (lambda xs, ds: _raw_reduce(group, xs, op, ds),
          lambda dys, ds: _raw_reduce(group, dys, op, ds))


def _all_gather_ops(group, axis):
  return (lambda xs, ds: _raw_gather(group, xs, axis, ds),
          lambda dys, ds: _raw_reduce_scatter(group, dys, "sum", axis, ds))


def _reduce_scatter_ops(group, op, axis):
  def backward(dys, ds):
    gathered = _raw_gather(group, dys, axis, ds)
    if op == "mean":
      gathered = [g / tf.cast(group.size, g.dtype) for g in gathered]
    return gathered
  return (lambda xs, ds: _raw_reduce_scatter(group, xs, op, axis, ds),
          backward)


def _all_to_all_ops(group, split_axis, concat_axis):
  return (lambda xs, ds: _raw_all_to_all(group, xs, split_axis, concat_axis,
                                         ds),
          lambda dys, ds: _raw_all_to_all(group, dys, concat_axis,
                                          split_axis, ds))


def _copy_to_group_ops(group):
  return (lambda xs, ds: [tf.identity(x) for x in xs],
          lambda dys, ds: _raw_reduce(group, dys, "sum", ds))


def _reduce_from_group_ops(group):
  return (lambda xs, ds: _raw_reduce(group, xs, "sum", ds),
          lambda dys, ds: [tf.identity(d) for d in dys])


def _list_call(kind: str, group: DeviceGroup, tensors, params: tuple,
               forward: Callable, backward: Callable) -> List[tf.Tensor]:
  """`forward` on every local device's tensor, with `backward` as its
  gradient, each result made on its device (`_call`: traced, or eagerly
  through a cached function)."""
  devices = group.local_devices

  def body(xs):
    @tf.custom_gradient
    def collective(*xs):
      def grad(*dys):
        return backward(list(dys), devices)
      return forward(list(xs), devices), grad
    return _placed(group, collective(*xs))
  return _call(kind, group, tensors, params, body)


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

  return _list_call("all_reduce", group, tensors, (op,),
                    *_all_reduce_ops(group, op))


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

  return _list_call("all_gather", group, tensors, (axis,),
                    *_all_gather_ops(group, axis))


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

  return _list_call("reduce_scatter", group, tensors, (op, axis),
                    *_reduce_scatter_ops(group, op, axis))


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

  return _list_call("all_to_all", group, tensors, (split_axis, concat_axis),
                    *_all_to_all_ops(group, split_axis, concat_axis))


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

  return _list_call("copy_to_group", group, tensors, (),
                    *_copy_to_group_ops(group))


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

  return _list_call("reduce_from_group", group, tensors, (),
                    *_reduce_from_group_ops(group))


# --- one replica's side (inside `strategy.run`) -------------------------------
# A `tf.distribute` strategy traces its replica function once per replica;
# each trace makes the op of its own device only. The instance keys match
# because each device counts its own collectives (`_next_instance_key`).
def replica_device(what: str = "a replica collective") -> str:
  """The full name of the device the calling replica's ops run on.

  Args:
    what: the caller, named in the error.

  Returns:
    e.g. `"/job:localhost/replica:0/task:0/device:CPU:1"`.

  Raises:
    tfdist.errors.ConfigError: called outside a replica function traced
      by `tf.function` (cross-replica context, or eagerly: each replica's
      eager op would wait for the others, which run one at a time).
  """
  if (not tf.distribute.has_strategy()
      or tf.distribute.in_cross_replica_context()):
    raise errors.ConfigError(
        f"{what} runs inside `strategy.run` (replica context), and was "
        "called outside it (cross-replica context). Call it from the replica "
        "function, or use the list form (one tensor per device).")
  if tf.executing_eagerly():
    raise errors.ConfigError(
        f"{what} runs in a `tf.function`: eagerly, each replica's "
        "collective would wait for the others forever. Wrap the "
        "`strategy.run` call in a `tf.function`.")
  device = tf.identity(tf.constant(0)).device
  if not device:
    raise errors.ConfigError(
        f"{what}: the replica's ops have no device (a default strategy?). "
        "Call it inside a strategy's `strategy.run` whose replicas are "
        "the group's devices.")
  return _canonical(device)


def _replica_call(kind: str, group: DeviceGroup, x, forward: Callable,
                  backward: Callable):
  if not isinstance(group, DeviceGroup):
    raise errors.ConfigError(
        f"replica_{kind}: group={group!r} is not a DeviceGroup. Pass "
        "collectives.DeviceGroup([...devices...]).")
  device = replica_device(f"replica_{kind}")
  if device not in group.devices:
    raise errors.ConfigError(
        f"replica_{kind}: this replica's device {device} is not in "
        f"{group.describe()}. Call it from the replicas of the group's "
        "devices only (`DeviceMesh.group_of(axis, device)`).")
  with tf.device(device):
    x = tf.convert_to_tensor(x)

    @tf.custom_gradient
    def collective(t):
      def grad(dy):
        return backward([dy], [device])[0]
      return forward([t], [device])[0], grad
    return tf.identity(collective(x))


def replica_all_reduce(group: DeviceGroup, x, op: str = "sum") -> tf.Tensor:
  """`all_reduce` from one replica: the sum (mean) of `x` over the
  group's replicas, each replica passing its own `x` of one shape and
  dtype. Gradient: the same all-reduce. Raises `tfdist.errors.ConfigError`
  as `replica_device`, for a replica outside the group or a bad `op`."""
  _check_op(op, "replica_all_reduce")
  return _replica_call("all_reduce", group, x, *_all_reduce_ops(group, op))


def replica_all_gather(group: DeviceGroup, x, axis: int = 0) -> tf.Tensor:
  """`all_gather` from one replica: `x` [..., d, ...] of each replica
  concatenated along `axis` in the group's order, [..., N*d, ...].
  Gradient: reduce-scatter (sum). Raises as `replica_all_reduce`."""
  x = tf.convert_to_tensor(x)
  axis = _check_axis(x, axis, "axis", "replica_all_gather")
  return _replica_call("all_gather", group, x, *_all_gather_ops(group, axis))


def replica_all_to_all(group: DeviceGroup, x, split_axis: int = 0,
                       concat_axis: Optional[int] = None) -> tf.Tensor:
  """`all_to_all` from one replica: `x` cut into N chunks along
  `split_axis`, chunk i sent to the group's i-th device; the result is the
  chunks received, in group order, concatenated along `concat_axis`
  (default `split_axis`). Gradient: the inverse all-to-all. Raises as
  `replica_all_reduce`, or for a `split_axis` dimension not divisible by
  N."""
  x = tf.convert_to_tensor(x)
  split_axis = _check_axis(x, split_axis, "split_axis",
                           "replica_all_to_all", group.size)
  concat_axis = split_axis if concat_axis is None else _check_axis(
      x, concat_axis, "concat_axis", "replica_all_to_all")
  return _replica_call("all_to_all", group, x,
                       *_all_to_all_ops(group, split_axis, concat_axis))


def replica_copy_to_group(group: DeviceGroup, x) -> tf.Tensor:
  """Megatron's f from one replica: `x` unchanged; its gradient summed
  over the group. Raises as `replica_all_reduce`."""
  return _replica_call("copy_to_group", group, x, *_copy_to_group_ops(group))


def replica_reduce_from_group(group: DeviceGroup, x) -> tf.Tensor:
  """Megatron's g from one replica: `x` summed over the group; its
  gradient passed through unchanged. Raises as `replica_all_reduce`."""
  return _replica_call("reduce_from_group", group, x,
                       *_reduce_from_group_ops(group))
