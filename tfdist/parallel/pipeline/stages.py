"""Pipeline parallelism for Keras 3 models on TensorFlow (GPipe, 1F1B and
interleaved 1F1B).

A Keras functional or Sequential model is cut into P stages of consecutive
layers (`split_model`); stage i runs under `tf.device(devices[i])`. A
training step (`Pipeline.train_step`, called inside the caller's
`tf.function`) splits the global batch into M micro-batches, runs each
micro-batch's forward pass stage by stage on its own `tf.GradientTape`,
passes the gradient of each stage's outputs to the stage before it with
`output_gradients`, sums the variables' gradients over the micro-batches and
applies ONE optimizer update. The loss is the mean over the global batch,
as in the unsplit step, so the update equals the unsplit model's (up to
float summation order).

TensorFlow does not pipeline by itself: ops run when their inputs are
ready, so without ordering all micro-batches of a stage would run at once.
The schedule (`schedule_order`) is imposed with one control-dependency chain
per stage (device): each forward (F) or backward (B) task of a stage starts
after the stage's previous task has produced its outputs.

* `gpipe` (Huang et al. 2019): all forwards, then all backwards; a stage
  holds the activations of all M micro-batches at once.
* `1f1b` (Narayanan et al. 2019, PipeDream-flush): stage s runs P-s-1
  warm-up forwards, then alternates one forward and one backward; it holds
  at most P-s micro-batches' activations. Same bubble as GPipe.
* `interleaved` (Narayanan et al. 2021, Megatron-LM's interleaved 1F1B;
  `split_model(..., virtual_stages=V)`): the model is cut into P*V chunks,
  chunk c on stage c mod P, and each stage runs its V chunks' tasks in
  Megatron's order (`interleaved_order`) on its one chain. M must be a
  multiple of P.

The idle fraction of each stage (the bubble) is (P-1)/(M+P-1) for equal
stage costs, (P-1)/(V*M+P-1) under `interleaved`, for V times more
transfers between stages (`benchmarks/pipeline_bubble.py` measures it).

The variables stay where Keras created them unless
`Pipeline.place_variables` moves each stage's to its device (then an
optimizer built afterwards keeps its state there too). A model built
inside `deferred_variables()` gets variables without storage, and
`place_variables(deferred)` creates each stage's from its initializer
directly on the stage's device: the whole model is never held by one
device. D copies of the pipeline on a data x pipeline mesh, each on 1/D of
the batch, are `tfdist.parallel.pipeline.copies.DataCopies`
(`train_step(..., copies=...)`). Batch
normalization sees micro-batches (its statistics are those of B/M
examples), as under gradient accumulation; `model.losses` (activity and
weight regularizers) are not added to the loss.

Example (inside your `tf.function`):

    pipe = pipeline.split_model(model, num_stages=2)
    loss = pipe.train_step(x, y, loss_fn=keras.losses.MeanSquaredError(),
                           optimizer=optimizer, num_microbatches=4,
                           schedule="1f1b")
"""

import contextlib
import dataclasses
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops  # pylint: disable=g-direct-tensorflow-import

from tfdist import errors
from tfdist.parallel import cutting
from tfdist.parallel.cutting import balanced_cuts  # pylint: disable=unused-import  (in __all__)
from tfdist.parallel.pipeline.options import GPIPE
from tfdist.parallel.pipeline.options import INTERLEAVED
from tfdist.parallel.pipeline.options import ONE_F_ONE_B
from tfdist.parallel.pipeline.options import SCHEDULES

__all__ = [
    "GPIPE", "INTERLEAVED", "ONE_F_ONE_B", "SCHEDULES", "Pipeline",
    "ActivationEstimate", "DeferredVariables", "DeviceLoad", "Stage",
    "balanced_cuts",
    "bubble_fraction", "check_microbatches", "check_virtual_stages",
    "deferred_variables", "interleaved_order", "peak_in_flight",
    "schedule_order", "split_model",
]


# --- schedules (pure) ---------------------------------------------------------
def schedule_order(num_stages: int, num_microbatches: int,
                   schedule: str = GPIPE, virtual_stages: int = 1
                   ) -> List[List[tuple]]:
  """Each stage's tasks in the order it runs them.

  Args:
    num_stages: P >= 1.
    num_microbatches: M >= 1 (a multiple of P for `interleaved`).
    schedule: "gpipe", "1f1b" or "interleaved".
    virtual_stages: V, the chunks each stage holds: 1 for "gpipe" and
      "1f1b", >= 2 for "interleaved".

  Returns:
    A list of P lists. Under "gpipe" and "1f1b", list s holds ("F", m) and
    ("B", m) pairs, the forward and backward pass of micro-batch m on
    stage s, 2*M of them; under "interleaved", `interleaved_order`'s
    ("F", m, chunk) and ("B", m, chunk) triples, 2*V*M of them.

  Raises:
    PipelineConfigError: an unknown schedule, P or M below 1, or V, M and
      the schedule disagreeing (`check_virtual_stages`).
  """
  cutting.check_positive("num_stages", num_stages)
  cutting.check_positive("num_microbatches", num_microbatches)
  check_schedule(schedule)
  check_virtual_stages(num_stages, num_microbatches, schedule,
                       virtual_stages)
  if schedule == INTERLEAVED:
    return interleaved_order(num_stages, num_microbatches, virtual_stages)
  orders = []
  for s in range(num_stages):
    if schedule == GPIPE:
      order = [("F", m) for m in range(num_microbatches)]
      order += [("B", m) for m in range(num_microbatches)]
    else:
      order = _warmup_then_alternate(
          num_microbatches, min(num_stages - s - 1, num_microbatches),
          lambda kind, m: (kind, m))
    orders.append(order)
  return orders


def _warmup_then_alternate(tasks: int, warmup: int,
                           task: Callable[[str, int], tuple]) -> List[tuple]:
  """One stage's 1F1B order over `tasks` forwards and as many backwards:
  `warmup` forwards, then one forward and one backward alternately, then
  the remaining backwards; `task(kind, k)` names the k-th forward ("F")
  or backward ("B") of the stage (1F1B: micro-batch k; interleaved: a
  micro-batch on a chunk)."""
  order = [task("F", k) for k in range(warmup)]
  for i in range(tasks - warmup):
    order += [task("F", warmup + i), task("B", i)]
  return order + [task("B", k) for k in range(tasks - warmup, tasks)]


def interleaved_order(num_stages: int, num_microbatches: int,
                      virtual_stages: int) -> List[List[Tuple[str, int, int]]]:
  """Each stage's tasks under Megatron-LM's interleaved 1F1B.

  Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on
  GPU Clusters", section 2.2), as Megatron-LM's
  `forward_backward_pipelining_with_interleaving`: the model is cut into
  P*V chunks, chunk c on stage c mod P (stage s holds chunks s, s+P, ...,
  s+(V-1)P). Stage s runs V*M forwards and V*M backwards; its k-th
  forward is of its local chunk j = (k mod PV) // P on micro-batch
  m = (k // PV) * P + k mod P (P micro-batches through one chunk, then
  the same P through its next chunk), its k-th backward the same with
  the chunks in reverse (j -> V-1-j). It runs min(2(P-s-1) + (V-1)P, VM)
  warm-up forwards, then alternates one forward and one backward, then
  the remaining backwards.

  Args:
    num_stages: P >= 1.
    num_microbatches: M, a multiple of P.
    virtual_stages: V >= 1 (`schedule_order` asks for V >= 2; with V = 1
      the warm-up is still Megatron's 2(P-s-1), twice 1F1B's).

  Returns:
    A list of P lists; list s holds ("F", m, c) and ("B", m, c): the
    forward and backward pass of micro-batch m on chunk c (a global chunk
    index, c mod P = s).

  Raises:
    PipelineConfigError: P, M or V below 1, or M not a multiple of P.
  """
  p, m_total, v = num_stages, num_microbatches, virtual_stages
  for name, value in (("num_stages", p), ("num_microbatches", m_total),
                      ("virtual_stages", v)):
    cutting.check_positive(name, value)
  _check_microbatch_groups(p, m_total)
  group = p * v
  tasks = v * m_total

  def task(kind: str, k: int, s: int) -> Tuple[str, int, int]:
    local = (k % group) // p
    if kind == "B":
      local = v - 1 - local
    return (kind, (k // group) * p + k % p, local * p + s)

  orders = []
  for s in range(p):
    orders.append(_warmup_then_alternate(
        tasks, min(2 * (p - s - 1) + (v - 1) * p, tasks),
        lambda kind, k, s=s: task(kind, k, s)))
  return orders


def peak_in_flight(order: Sequence[tuple]) -> int:
  """The most micro-batches whose activations one stage holds at once.

  Args:
    order: one stage's tasks (an element of `schedule_order`'s result;
      under `interleaved`, one micro-batch on one chunk counts once).

  Returns:
    The largest number of forwards done whose backward has not run: M for
    GPipe, at most P - s for 1F1B on stage s, at most 2(P-s-1) + (V-1)P + 1
    chunk micro-batches for the interleaved order.
  """
  alive = peak = 0
  for task in order:
    alive += 1 if task[0] == "F" else -1
    peak = max(peak, alive)
  return peak


def bubble_fraction(num_stages: int, num_microbatches: int,
                    virtual_stages: int = 1) -> float:
  """The ideal idle fraction of each stage, (P-1)/(V*M+P-1) (V = 1:
  GPipe and 1F1B; V chunks per stage: the interleaved schedule)."""
  return (num_stages - 1) / (
      virtual_stages * num_microbatches + num_stages - 1)


def check_schedule(schedule: str) -> str:
  """Returns `schedule` if it is a known one, else raises
  PipelineConfigError naming the valid names."""
  if schedule not in SCHEDULES:
    raise errors.PipelineConfigError(
        f"pipeline schedule={schedule!r} is not offered: choose one of "
        f"{', '.join(SCHEDULES)}.")
  return schedule


def check_virtual_stages(num_stages: int, num_microbatches: int,
                         schedule: str, virtual_stages: int) -> None:
  """Refuses V >= 2 without the interleaved schedule, the interleaved
  schedule with V < 2, and, for it, M not a multiple of P.

  Raises:
    PipelineConfigError: naming the values and the fix.
  """
  cutting.check_positive("virtual_stages", virtual_stages)
  if schedule == INTERLEAVED and virtual_stages < 2:
    raise errors.PipelineConfigError(
        f"schedule='interleaved' needs virtual_stages >= 2 (received "
        f"{virtual_stages}): split the model with split_model(..., "
        "virtual_stages=2) or more, or use schedule='1f1b'.")
  if schedule != INTERLEAVED and virtual_stages > 1:
    raise errors.PipelineConfigError(
        f"a pipeline of virtual_stages={virtual_stages} chunks per stage "
        f"runs schedule='interleaved', not {schedule!r}: pass "
        "schedule='interleaved', or split the model with virtual_stages=1.")
  if schedule == INTERLEAVED:
    _check_microbatch_groups(num_stages, num_microbatches)


def _check_microbatch_groups(num_stages: int, num_microbatches: int) -> None:
  """Refuses M not a multiple of P (the interleaved order's groups)."""
  if num_microbatches % num_stages:
    raise errors.PipelineConfigError(
        f"the interleaved schedule needs num_microbatches (received "
        f"{num_microbatches}) to be a multiple of num_stages={num_stages}: "
        "each chunk runs the micro-batches in groups of P. Choose "
        f"num_microbatches among {num_stages}, {2 * num_stages}, "
        f"{3 * num_stages}, ...")


def _stage_tasks(num_stages: int, num_microbatches: int, schedule: str,
                 virtual_stages: int) -> List[List[Tuple[str, int, int]]]:
  """`schedule_order` as ("F" or "B", micro-batch, chunk) triples (chunk =
  stage under GPipe and 1F1B), what `_StepTasks.build` walks."""
  orders = schedule_order(num_stages, num_microbatches, schedule,
                          virtual_stages)
  if schedule == INTERLEAVED:
    return orders
  return [[(kind, m, s) for kind, m in order]
          for s, order in enumerate(orders)]


def check_microbatches(batch_size: int, num_microbatches: int) -> int:
  """The micro-batch size, B / M.

  Args:
    batch_size: B, the global batch of one step (examples).
    num_microbatches: M.

  Returns:
    B // M.

  Raises:
    PipelineConfigError: M < 1 or M does not divide B.
  """
  cutting.check_positive("num_microbatches", num_microbatches)
  if batch_size % num_microbatches:
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    raise errors.PipelineConfigError(
        f"num_microbatches={num_microbatches} does not divide the batch of "
        f"{batch_size} examples: every micro-batch must have the same size "
        f"for the update to equal the unsplit one. Choose num_microbatches "
        f"among {divisors} or a batch size that is a multiple of "
        f"{num_microbatches}.")
  return batch_size // num_microbatches


# The attribute of a variable holding tensor shard t of a layer split
# inside a stage (`tfdist.parallel.pipeline.tensor.StageSplitDense`): it
# lives on device t of its stage's tensor group.
TENSOR_SHARD = "_tfdist_stage_tensor_shard"
# ... and the device `Pipeline.place_variables` put it on (its layer
# computes the shard there).
SHARD_DEVICE = "_tfdist_stage_shard_device"


def shard_of(variable) -> int:
  """The tensor shard t a stage's variable holds (0: a whole weight)."""
  return getattr(variable, TENSOR_SHARD, 0)


def _param_bytes(variables) -> int:
  return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
             for v in variables)


# --- variables created without storage until their stage is known -----------
class DeferredVariables:
  """The variables a model got inside `deferred_variables()`: TensorFlow
  resource handles without storage, each with the initializer that would
  have filled it.

  Keras's TensorFlow variables create their `tf.Variable` from a callable
  (their initializer on their shape and dtype); inside the scope that call
  makes an uninitialized variable of the same shape, dtype and name
  instead, and keeps the callable. `Pipeline.place_variables(deferred)`
  then creates each stage's variables with their initializer under the
  stage's device, in creation order, and `initialize_rest` fills the
  others (metrics, seed states) where they were made. The initializers
  draw the values they would have drawn at creation (Keras seeds them when
  the layer is made), so the model equals one built without the scope.

  Until then the model's variables cannot be read eagerly: one reads as an
  empty tensor, so a builder that runs the model on data fails in its
  first op (a `tf.errors.OpError`; `tfdist.parallel.pipeline.mode.
  build_model` then builds the model again, whole). A variable the builder
  assigns (loads weights into) gets storage where it was made, and
  `place_variables` moves it as any other.
  """

  def __init__(self):
    # id(placeholder) -> (placeholder, tf.Variable keyword arguments).
    self._pending: Dict[int, Tuple[tf.Variable, dict]] = {}

  def __len__(self) -> int:
    return len(self._pending)

  def _create(self, next_creator, **kwargs):
    initial_value = kwargs.get("initial_value")
    if not callable(initial_value) or not tf.executing_eagerly():
      return next_creator(**kwargs)
    # The value's shape and dtype without computing it: a trace.
    spec = tf.function(initial_value, autograph=False
                       ).get_concrete_function().structured_outputs
    if not isinstance(spec, tf.Tensor) or not spec.shape.is_fully_defined():
      return next_creator(**kwargs)
    placeholder = resource_variable_ops.UninitializedVariable(
        shape=spec.shape, dtype=kwargs.get("dtype") or spec.dtype,
        name=kwargs.get("name"), trainable=kwargs.get("trainable"),
        aggregation=kwargs.get("aggregation"),
        synchronization=kwargs.get("synchronization"))
    self._pending[id(placeholder)] = (placeholder, kwargs)
    return placeholder

  def owns(self, variable) -> bool:
    """Whether `variable` (a `tf.Variable`) is one of these, still without
    storage."""
    entry = self._pending.get(id(variable))
    return entry is not None and entry[0] is variable and not bool(
        variable.is_initialized())

  def initialize(self, devices: Optional[Dict[int, Tuple[Any, str]]] = None
                 ) -> None:
    """Gives every pending variable storage, in creation order.

    Args:
      devices: `{id(placeholder): (keras_variable, device)}`: these are
        created from their initializer under `tf.device(device)` and
        replace the placeholder in `keras_variable`; the others are filled
        in place (on the device they were made on).
    """
    devices = devices or {}
    pending, self._pending = self._pending, {}
    for key, (placeholder, kwargs) in pending.items():
      if key in devices and not bool(placeholder.is_initialized()):
        keras_variable, device = devices[key]
        # Its name as made (within its layer's name scope, if any).
        kwargs = dict(kwargs, name=placeholder.name.split(":")[0])
        with tf.init_scope(), tf.device(device):
          keras_variable._value = tf.Variable(**kwargs)  # pylint: disable=protected-access
      elif not bool(placeholder.is_initialized()):
        with tf.init_scope():
          placeholder.assign(kwargs["initial_value"]())

  def initialize_rest(self) -> None:
    """Fills every pending variable in place (where it was made)."""
    self.initialize()


@contextlib.contextmanager
def deferred_variables():
  """Variables created inside get no storage until `place_variables`.

  Build the model inside, cut it (`split_model` needs only shapes and
  dtypes), then call `Pipeline.place_variables(deferred)`: each stage's
  variables are created directly on its device.

  Yields:
    A `DeferredVariables`.
  """
  deferred = DeferredVariables()
  with tf.variable_creator_scope(deferred._create):  # pylint: disable=protected-access
    yield deferred


# --- stages and the pipeline -------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ActivationEstimate:
  """Activations alive on each stage at its peak (`Pipeline.activation_estimate`).

  Attributes:
    bytes_per_stage: bytes, stage s at index s.
    in_flight: the micro-batches stage s holds then.
  """
  bytes_per_stage: Tuple[int, ...]
  in_flight: Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class DeviceLoad:
  """The variables one device of a pipeline holds (`Pipeline.device_loads`).

  Attributes:
    weights: all its chunks' weights.
    trainable_variables: their trainable variables.
  """
  weights: Tuple[Any, ...]
  trainable_variables: Tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Stage:
  """Consecutive layer calls of the model that run on one device.

  Attributes:
    index: the stage's position, 0 .. P-1.
    device: the device its ops run on (a `tf.device` name).
    layer_names: the names of its layers, in call order.
    trainable_variables: its layers' trainable variables: the model's own
      objects (same names), in the model's order.
    weights: all its layers' variables (trainable or not).
    param_bytes: bytes of all its layers' weights (trainable or not).
    input_keys: the graph tensors it receives (from the stage before or,
      for stage 0, the model's inputs), in a fixed order.
    output_keys: the graph tensors it hands on: what later stages use,
      including tensors it only carries (a skip connection across a cut),
      or the model's outputs for the last stage.
    activation_bytes_per_example: bytes of its layer calls' outputs for
      one example (the Keras graph's static shapes and dtypes; unknown
      dimensions count 0): what one micro-batch in flight keeps alive, at
      least (a layer's tape may keep inner tensors too).
  """
  index: int
  device: str
  layer_names: Tuple[str, ...]
  trainable_variables: Tuple[Any, ...]
  weights: Tuple[Any, ...]
  param_bytes: int
  input_keys: Tuple[Hashable, ...]
  output_keys: Tuple[Hashable, ...]
  calls: Tuple[cutting.Call, ...] = dataclasses.field(repr=False)

  @property
  def activation_bytes_per_example(self) -> int:
    return sum(call.activation_bytes for call in self.calls)

  def run(self, inputs: Sequence[tf.Tensor],
          training: Optional[bool] = None) -> List[tf.Tensor]:
    """The stage's layers on `inputs` (tensors for `input_keys`).

    Returns:
      Tensors for `output_keys`, on the caller's device scope.
    """
    tensors = dict(zip(self.input_keys, inputs))
    for call in self.calls:
      call.run(tensors, training)
    return [tensors[k] for k in self.output_keys]



def _add_gradients(total, gradient):
  """`total + gradient`, either None; `tf.IndexedSlices` (an embedding's
  gradient) are summed by concatenating their rows, as Keras optimizers
  take repeated indices, so a sparse gradient stays sparse."""
  if total is None:
    return gradient
  if gradient is None:
    return total
  if isinstance(total, tf.IndexedSlices) and isinstance(
      gradient, tf.IndexedSlices):
    return tf.IndexedSlices(
        tf.concat([total.values, gradient.values], axis=0),
        tf.concat([total.indices, gradient.indices], axis=0),
        total.dense_shape)
  return tf.convert_to_tensor(total) + tf.convert_to_tensor(gradient)


def _dense_part(gradient):
  """A tensor to order on: an `IndexedSlices`' values, else the gradient."""
  if isinstance(gradient, tf.IndexedSlices):
    return gradient.values
  return gradient


def _is_float(t) -> bool:
  return tf.as_dtype(t.dtype).is_floating


@dataclasses.dataclass
class _Forward:
  tape: tf.GradientTape
  inputs: List[tf.Tensor]
  outputs: List[tf.Tensor]  # stage outputs, or [scaled loss] on the last


class _StepTasks:
  """The forward and backward tasks of one pipelined step, built into the
  graph one at a time (`Pipeline.forward_backward`), with what they hand
  each other.

  Tasks are indexed by the pipeline's `Stage`s (its chunks under the
  interleaved schedule: chunk c runs on stage, i.e. device, c mod P).

  Attributes:
    forwards: `{(chunk, micro-batch): _Forward}` of the forward tasks
      whose backward task is still to come.
    input_grads: `{(chunk, micro-batch): gradients}` of a chunk's inputs,
      for the chunk before's backward task.
    sums: per chunk, the summed gradient of each of its trainable
      variables (None until one is added).
    chain: per device (stage s = chunk mod P), the tensors of its latest
      task, of whichever chunk: its next task waits on them.
    losses: the micro-batches' weighed losses, scalars.
    final_outputs: `{micro-batch: the last stage's outputs}`.
  """

  def __init__(self, pipeline: "Pipeline", *, micro_x, micro_y, micro_w,
               loss_fn: Callable[..., tf.Tensor], scale: float,
               copies=None, copy: int = 0):
    self.pipeline = pipeline
    # Data x pipeline: this copy's devices and variables (`DataCopies`).
    self.copies, self.copy = copies, copy
    self.stages = pipeline.stages
    self.num_devices = pipeline.num_stages
    self.last = len(self.stages) - 1
    self.micro_x, self.micro_y, self.micro_w = micro_x, micro_y, micro_w
    self.loss_fn = loss_fn
    self.scale = scale
    self.forwards: Dict[Tuple[int, int], _Forward] = {}
    self.input_grads: Dict[Tuple[int, int], List[tf.Tensor]] = {}
    self.sums: List[List[Optional[tf.Tensor]]] = [
        [None] * len(s.trainable_variables) for s in self.stages]
    self.chain: List[List[tf.Tensor]] = [[] for _ in range(self.num_devices)]
    self.losses = []
    self.final_outputs: Dict[int, List[tf.Tensor]] = {}

  def forward(self, s: int, m: int) -> None:
    """Chunk `s`'s forward task on micro-batch `m` (the loss on the last)."""
    stage = self.stages[s]
    chain = s % self.num_devices
    with tf.device(self.device(s)), tf.control_dependencies(self.chain[chain]):
      received = (self.micro_x[m] if s == 0
                  else self.forwards[(s - 1, m)].outputs)
      received = [tf.identity(t) for t in received]
      with tf.GradientTape() as tape:
        tape.watch([t for t in received if _is_float(t)])
        if self.copy:
          tape.watch(self.variables(s))
        with (self.copies.scope(self.copy, s) if self.copies
              else contextlib.nullcontext()):
          outputs = [tf.identity(t) for t in stage.run(received, True)]
        if s == self.last:
          outputs = self._loss(m, outputs)
    self.forwards[(s, m)] = _Forward(tape, received, outputs)
    self.chain[chain] = outputs

  def device(self, s: int) -> str:
    """Where stage `s` of this copy runs."""
    return (self.copies.device(self.copy, s) if self.copies
            else self.stages[s].device)

  def variables(self, s: int) -> list:
    """This copy's trainable variables of stage `s` (the model's own for
    copy 0), in `Stage.trainable_variables` order."""
    return (self.copies.trainable(self.copy, s) if self.copies
            else list(self.stages[s].trainable_variables))

  def _loss(self, m: int, outputs: List[tf.Tensor]) -> List[tf.Tensor]:
    """`[weighed loss]` of micro-batch `m` on the last stage's `outputs`
    (kept in `final_outputs`), in the forward task's tape."""
    self.final_outputs[m] = outputs
    args = (self.micro_y[m], self.pipeline.pack(outputs))
    if self.micro_w is not None:
      args += (self.micro_w[m],)
    loss = tf.cast(self.loss_fn(*args), tf.float32)
    self.losses.append(loss * self.scale)
    return [self.losses[-1]]

  def backward(self, s: int, m: int) -> None:
    """Chunk `s`'s backward task on micro-batch `m`: adds its variables'
    gradients to `sums` and hands its inputs' to the chunk before."""
    done = self.forwards.pop((s, m))
    chain = s % self.num_devices
    with tf.device(self.device(s)), tf.control_dependencies(self.chain[chain]):
      if s == self.last:
        targets, upstream = done.outputs, None
      else:
        upstream = self.input_grads.pop((s + 1, m))
        pairs = [(o, g) for o, g in zip(done.outputs, upstream)
                 if g is not None]
        targets, upstream = [p[0] for p in pairs], [p[1] for p in pairs]
      sources = [t for t in done.inputs if _is_float(t)] if s else []
      grads = done.tape.gradient(
          targets, sources + self.variables(s),
          output_gradients=upstream,
          unconnected_gradients=tf.UnconnectedGradients.ZERO)
      if s:
        it = iter(grads[:len(sources)])
        self.input_grads[(s, m)] = [next(it) if _is_float(t) else None
                                    for t in done.inputs]
      var_grads = grads[len(sources):]
      for j, g in enumerate(var_grads):
        self.sums[s][j] = _add_gradients(self.sums[s][j], g)
      self.chain[chain] = ([_dense_part(g) for g in grads if g is not None]
                           or self.chain[chain])

  def ready(self, s: int, kind: str, m: int) -> bool:
    """Whether the task (`kind` "F" or "B") has what it takes."""
    if kind == "F":
      return s == 0 or (s - 1, m) in self.forwards
    return (s, m) in self.forwards and (
        s == self.last or (s + 1, m) in self.input_grads)

  def build(self, orders: Sequence[Sequence[Tuple[str, int, int]]],
            schedule: str) -> None:
    """Builds every device's tasks of `orders` (`_stage_tasks`'s: per
    device, (kind, micro-batch, chunk)) in an order that respects both
    the data and each device's chain (a topological order of the
    schedule).

    Raises:
      RuntimeError: the schedule deadlocks (a bug in tfdist).
    """
    position = [0] * len(orders)
    while any(p < len(o) for p, o in zip(position, orders)):
      progressed = False
      for s, order in enumerate(orders):
        while position[s] < len(order):
          kind, m, chunk = order[position[s]]
          if not self.ready(chunk, kind, m):
            break
          (self.forward if kind == "F" else self.backward)(chunk, m)
          position[s] += 1
          progressed = True
      if not progressed:
        raise RuntimeError(f"pipeline schedule {schedule!r} deadlocks at "
                           f"tasks {position} (a bug in tfdist)")

  def gradients(self, variables) -> List[Optional[tf.Tensor]]:
    """The summed gradients for `variables` (the model's trainable ones),
    in their order; None for a variable no stage uses."""
    grads_by_var = {}
    for stage, stage_sums in zip(self.stages, self.sums):
      for v, g in zip(stage.trainable_variables, stage_sums):
        grads_by_var[id(v)] = g
    return [grads_by_var.get(id(v)) for v in variables]

  def outputs(self, num_microbatches: int) -> List[tf.Tensor]:
    """The last stage's outputs of the micro-batches, concatenated in
    batch order."""
    return [tf.concat([self.final_outputs[m][i]
                       for m in range(num_microbatches)], axis=0)
            for i in range(len(self.final_outputs[0]))]


class Pipeline:
  """A Keras model cut into stages on consecutive devices.

  Build it with `split_model`. The model keeps its variables: training
  through the pipeline updates the model itself, and its checkpoints,
  weights files and exports are those of the unsplit model.

  Attributes:
    model: the Keras model.
    stages: the `Stage`s, P of them; with V virtual stages, the P * V
      chunks in call order, chunk c on the device of stage c mod P.
    num_stages: P, the pipeline's devices.
    virtual_stages: V, the chunks each device holds (1: one stage each).
  """

  def __init__(self, model, stages: Sequence[Stage], input_dtypes,
               virtual_stages: int = 1):
    self.model = model
    self.stages = tuple(stages)
    self.virtual_stages = int(virtual_stages)
    self.num_stages = len(self.stages) // self.virtual_stages
    self._input_dtypes = list(input_dtypes)

  def describe(self, micro_batch: int = 0, num_microbatches: int = 1,
               schedule: str = GPIPE) -> List[dict]:
    """Per stage (per chunk, with virtual stages): index, device, layer
    names, parameter bytes, the number of tensors it receives and hands
    on, and, given a step's shape, its device's activation estimate
    (`activation_estimate`).

    Args:
      micro_batch: examples per micro-batch (0: no activation estimate).
      num_microbatches: M.
      schedule: `gpipe`, `1f1b` or `interleaved`.
    """
    held = (self.activation_estimate(micro_batch, num_microbatches, schedule)
            if micro_batch else None)
    p = self.num_stages
    return [dict(index=s.index, device=s.device, layers=list(s.layer_names),
                 param_bytes=s.param_bytes, inputs=len(s.input_keys),
                 outputs=len(s.output_keys),
                 **({"activation_bytes": held.bytes_per_stage[s.index % p],
                     "microbatches_in_flight": held.in_flight[s.index % p]}
                    if held else {})) for s in self.stages]

  def activation_estimate(self, micro_batch: int, num_microbatches: int,
                          schedule: str = GPIPE) -> "ActivationEstimate":
    """Each stage's (device's) activations alive at its peak, in bytes:
    its layer calls' output bytes per example x `micro_batch` x the
    micro-batches the schedule keeps in flight on it (`peak_in_flight`: M
    under GPipe, at most P - s under 1F1B; under `interleaved`, the most
    bytes of its chunks' micro-batches alive at once). A lower bound: a
    layer's tape may keep inner tensors too, and TensorFlow's workspace is
    not counted.

    Args:
      micro_batch: examples per micro-batch.
      num_microbatches: M.
      schedule: `gpipe`, `1f1b` or `interleaved`.

    Returns:
      An `ActivationEstimate` (P byte counts, P micro-batch counts: chunk
      micro-batches under `interleaved`).

    Raises:
      PipelineConfigError: an unknown schedule, M below 1, or a schedule
        that does not fit the pipeline's virtual stages.
    """
    orders = _stage_tasks(self.num_stages, num_microbatches, schedule,
                          self.virtual_stages)
    peak_bytes = []
    for order in orders:
      alive = peak = 0
      for kind, _, c in order:
        size = self.stages[c].activation_bytes_per_example * micro_batch
        alive += size if kind == "F" else -size
        peak = max(peak, alive)
      peak_bytes.append(peak)
    return ActivationEstimate(
        tuple(peak_bytes), tuple(peak_in_flight(o) for o in orders))

  def device_loads(self) -> List["DeviceLoad"]:
    """Per device (stage index s), the weights of the chunks it holds:
    stage s's alone without virtual stages, chunks s, s+P, ... with."""
    return [DeviceLoad(
        weights=tuple(v for c in self.stages[s::self.num_stages]
                      for v in c.weights),
        trainable_variables=tuple(v for c in self.stages[s::self.num_stages]
                                  for v in c.trainable_variables))
            for s in range(self.num_stages)]

  def flat_inputs(self, x) -> List[tf.Tensor]:
    # A dict flattens by sorted key, as Keras flattens a model's dict of
    # inputs into `model.inputs`.
    flat = (keras.tree.flatten(x) if isinstance(x, dict) else
            list(x) if isinstance(x, (list, tuple)) else [x])
    if len(flat) != len(self._input_dtypes):
      raise errors.PipelineConfigError(
          f"the pipeline of model {self.model.name!r} takes "
          f"{len(self._input_dtypes)} input tensor(s) and got {len(flat)}: "
          "pass one tensor, or a list in the order of model.inputs.")
    out = []
    for value, dtype in zip(flat, self._input_dtypes):
      value = tf.convert_to_tensor(value)
      if dtype is not None and value.dtype != tf.as_dtype(dtype):
        value = tf.cast(value, dtype)
      out.append(value)
    return out

  def place_variables(self, deferred: Optional[DeferredVariables] = None,
                      tensor_devices: Optional[Sequence[Sequence[str]]] = None
                      ) -> Dict[str, int]:
    """Puts each stage's variables on its device; returns bytes per device.

    The model's variables stay the same Keras objects with the same names
    (checkpoints are unchanged). A variable of `deferred` (the model was
    built inside `deferred_variables()`) is created from its initializer
    on its stage's device, so its values never exist elsewhere; any other
    is re-created there with its value. `deferred`'s variables outside the
    stages (metrics, seed states) are filled where they were made. Keras
    creates an optimizer's slot variables beside their variable, so an
    optimizer built afterwards keeps its state on the stage devices too.

    Call it once, right after `split_model`: before the optimizer is built
    and before any `tf.function` has used the model (a traced function
    would keep the old variables).

    Args:
      deferred: the `DeferredVariables` the model was built with, or None.
      tensor_devices: with layers split inside the stages
        (`tfdist.parallel.pipeline.tensor`), per stage p its T devices:
        a variable holding tensor shard t (`shard_of`) goes to
        `tensor_devices[p][t]` (`tensor.tensor_devices(mesh)`); None: each
        stage's variables on its device.

    Returns:
      `{device: bytes of the model's variables placed there}`.

    Raises:
      PipelineConfigError: the Keras variables are not TensorFlow-backed
        ones this function knows how to move (another Keras backend or
        version).
    """
    per_device, created = {}, {}
    for stage in self.stages:
      for v in stage.weights:
        device = (stage.device if tensor_devices is None else
                  tensor_devices[stage.index % self.num_stages][shard_of(v)])
        want = tf.DeviceSpec.from_string(device)
        current = getattr(v, "_value", None)
        if not isinstance(current, tf.Variable):
          raise errors.PipelineConfigError(
              f"variable {v.path!r} ({type(v).__name__}) does not wrap a "
              f"tf.Variable, so place_variables cannot move it to "
              f"{device} (Keras {keras.__version__}, backend "
              f"{keras.backend.backend()}): use the TensorFlow backend, or "
              "leave the variables where Keras made them.")
        per_device[device] = per_device.get(device, 0) + _param_bytes([v])
        if hasattr(v, TENSOR_SHARD):
          setattr(v, SHARD_DEVICE, device)
        if deferred is not None and deferred.owns(current):
          created[id(current)] = (v, device)
          continue
        have = tf.DeviceSpec.from_string(current.device)
        # A field the stage's device leaves open (a local name has no job
        # or task) matches any; a remote stage's task must match too.
        fields = ("job", "replica", "task", "device_type", "device_index")
        if any(getattr(want, f) is not None and
               getattr(want, f) != getattr(have, f) for f in fields):
          with tf.init_scope(), tf.device(device):
            moved = tf.Variable(
                current.read_value(), dtype=current.dtype,
                trainable=current.trainable, name=v.name,
                aggregation=current.aggregation,
                synchronization=current.synchronization)
          v._value = moved  # pylint: disable=protected-access
    if deferred is not None:
      deferred.initialize(created)
    return per_device

  def check_step(self, batch_size: int, num_microbatches: int,
                 schedule: str = GPIPE) -> int:
    """Checks a step's batch, micro-batches, schedule and the pipeline's
    virtual stages before tracing.

    `train_step` makes the same checks while it is traced, but autograph
    (on by default in `tf.function`) re-raises errors raised while tracing
    as its own `StagingError`: call this at the edge, first.

    Args:
      batch_size: B, the global batch of one step (examples).
      num_microbatches: M.
      schedule: "gpipe", "1f1b" or "interleaved" (a pipeline split with
        virtual_stages >= 2 runs "interleaved" only).

    Returns:
      The micro-batch size, B // M.

    Raises:
      PipelineConfigError: M does not divide B, an unknown schedule, or
        one that does not fit the virtual stages (`check_virtual_stages`).
    """
    check_schedule(schedule)
    check_virtual_stages(self.num_stages, num_microbatches, schedule,
                         self.virtual_stages)
    return check_microbatches(batch_size, num_microbatches)

  @staticmethod
  def pack(outputs):
    return outputs[0] if len(outputs) == 1 else list(outputs)

  def __call__(self, x, training: Optional[bool] = None):
    """The model's outputs for batch `x`, stage after stage (no
    micro-batches): the same values as `model(x, training=training)`.

    Args:
      x: a tensor, or a list of tensors in the order of `model.inputs`;
        shape [batch, ...].
      training: passed to the layers that take it.
    """
    tensors = self.flat_inputs(x)
    for stage in self.stages:
      with tf.device(stage.device):
        tensors = [tf.identity(t) for t in stage.run(tensors, training)]
    return self.pack(tensors)

  def train_step(self, x, y, *, loss_fn: Callable[[Any, Any], tf.Tensor],
                 optimizer, num_microbatches: int,
                 schedule: str = GPIPE, copies=None) -> tf.Tensor:
    """One pipelined training step: M micro-batches, ONE optimizer update.

    Call it inside a `tf.function` (the schedule's ordering is a graph's
    control dependencies; eagerly the tasks simply run in schedule order).
    It has no tensor-dependent Python control flow, so
    `tf.function(..., autograph=False)` traces it as well and lets its
    errors through unwrapped; check the arguments first with
    `check_step`.

    Args:
      x: the global batch's inputs: a tensor, a list of tensors in the
        order of `model.inputs`, or a dict of them by input name (a model
        built on a dict of inputs), each [B, ...] with B known when
        traced.
      y: the targets, a tensor [B, ...].
      loss_fn: `loss_fn(y_true, y_pred)` -> a scalar float32 tensor, the
        MEAN loss over the examples it is given (a `keras.losses.Loss`
        with its default reduction does this). The step's loss is the
        mean over the B examples, as in the unsplit step.
      optimizer: a Keras optimizer; it gets the summed gradients of all
        the model's trainable variables once.
      num_microbatches: M, dividing B.
      schedule: "gpipe", "1f1b" or "interleaved" (a pipeline split with
        virtual_stages >= 2 runs "interleaved" only).
      copies: None, or the `DataCopies` of a data x pipeline mesh
        (`forward_backward`): the optimizer updates copy 0 (the model),
        which the other copies read at the next step's start.

    Returns:
      The loss, a scalar: the mean over the global batch.

    Raises:
      PipelineConfigError: M does not divide B, B is not known when
        traced, x has another number of tensors than the model's inputs,
        an unknown schedule, or one that does not fit the virtual stages.
    """
    loss, grads, _ = self.forward_backward(
        x, y, loss_fn=loss_fn, num_microbatches=num_microbatches,
        schedule=schedule, copies=copies)
    optimizer.apply_gradients(
        [(g, v) for g, v in zip(grads, self.model.trainable_variables)
         if g is not None])
    return loss

  def forward_backward(self, x, y, *, loss_fn: Callable[..., tf.Tensor],
                       num_microbatches: int, schedule: str = GPIPE,
                       sample_weight=None, mean_loss: bool = True,
                       copies=None
                       ) -> Tuple[tf.Tensor, List[Optional[tf.Tensor]],
                                  Any]:
    """The loss, gradients and outputs of one pipelined step; no update.

    As `train_step` (the same schedule, micro-batches and ordering), for a
    caller that applies the gradients itself (tfdist's `Trainer`: its
    all-reduce, loss scaling, accumulation and metrics stay its own).

    Args:
      x: the global batch's inputs, as `train_step`'s.
      y: the targets, a tensor [B, ...].
      loss_fn: `loss_fn(y_true, y_pred)`, or `loss_fn(y_true, y_pred,
        sample_weight)` when `sample_weight` is given: a scalar float32
        tensor for one micro-batch, the one differentiated.
      num_microbatches: M, dividing B.
      schedule: "gpipe", "1f1b" or "interleaved" (a pipeline split with
        virtual_stages >= 2 runs "interleaved" only).
      sample_weight: None, or a tensor [B] split with the batch and passed
        to `loss_fn` per micro-batch.
      mean_loss: `loss_fn` returns the micro-batch's MEAN loss, so each is
        weighed 1/(D*M) (the mean over B); False: `loss_fn` returns the
        micro-batch's share of the global batch's loss already (e.g. its
        sum divided by B), and the shares are added.
      copies: None (one copy), or the `tfdist.parallel.pipeline.copies.
        DataCopies` of a data x pipeline mesh: the batch is cut into D
        shares of B/D, copy d runs its share's M micro-batches on its
        devices, and each stage's gradients are all-reduced across the
        copies (D*M must divide B).

    Returns:
      `(loss, grads, outputs)`: the loss (a scalar, the sum of the
      micro-batches' weighed losses), the gradients of that loss for each
      of `model.trainable_variables` in its order (None for a variable no
      stage uses), and the model's outputs on the whole batch (the last
      stage's outputs of the micro-batches, concatenated in batch order).
      With `copies`, the gradients are the sums over the copies, on copy
      0's devices.

    Raises:
      As `train_step`.
    """
    inputs = self.flat_inputs(x)
    batch = inputs[0].shape[0]
    if batch is None:
      raise errors.PipelineConfigError(
          "the pipeline's batch size is not known when the step is traced: "
          "give the tf.function an input_signature with a fixed batch, or "
          "a dataset with drop_remainder=True.")
    data = copies.data if copies is not None else 1
    if data > 1 and int(batch) % (data * num_microbatches):
      raise errors.PipelineConfigError(
          f"{data} copies x num_microbatches={num_microbatches} do not "
          f"divide the batch of {batch} examples: each copy gets 1/{data} "
          f"of it, cut into {num_microbatches} equal micro-batches. Use a "
          f"batch size that is a multiple of {data * num_microbatches}.")
    check_microbatches(int(batch), num_microbatches)
    orders = _stage_tasks(self.num_stages, num_microbatches, schedule,
                          self.virtual_stages)
    if copies is not None:
      copies.sync()
    # Copy d's share: examples [d*B/D, (d+1)*B/D), then its M micro-batches.
    pieces = data * num_microbatches
    micro_x = list(zip(*[tf.split(t, pieces) for t in inputs]))
    micro_y = tf.split(tf.convert_to_tensor(y), pieces)
    micro_w = (tf.split(tf.convert_to_tensor(sample_weight), pieces)
               if sample_weight is not None else None)
    scale = 1.0 / pieces if mean_loss else 1.0
    copy_tasks = []
    for d in range(data):
      share = slice(d * num_microbatches, (d + 1) * num_microbatches)
      tasks = _StepTasks(self, micro_x=micro_x[share],
                         micro_y=micro_y[share],
                         micro_w=micro_w[share] if micro_w else None,
                         loss_fn=loss_fn, scale=scale, copies=copies, copy=d)
      tasks.build(orders, schedule)
      copy_tasks.append(tasks)
    if copies is not None:  # Copy 0's gradients: the sum over the copies.
      copy_tasks[0].sums = copies.all_reduce([t.sums for t in copy_tasks])
    grads = copy_tasks[0].gradients(self.model.trainable_variables)
    outputs = [tf.concat(parts, axis=0) for parts in zip(
        *[t.outputs(num_microbatches) for t in copy_tasks])]
    return (tf.add_n([l for t in copy_tasks for l in t.losses]), grads,
            self.pack(outputs))


def _default_devices() -> List[str]:
  gpus = tf.config.list_logical_devices("GPU")
  return [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]


def split_model(model, num_stages: Optional[int] = None, *,
                cuts: Optional[Sequence[str]] = None,
                devices: Optional[Sequence[str]] = None,
                activation_examples: int = 0,
                virtual_stages: int = 1) -> Pipeline:
  """Cuts a Keras functional or Sequential model into pipeline stages.

  Stages are contiguous runs of the model's layer calls in execution
  order. With `cuts`, each named layer begins a new stage (as
  `torch.distributed.pipelining`'s default split point); without, the
  calls are split into `num_stages` runs with the smallest largest cost,
  a call's cost being its layer's weight bytes plus
  `activation_examples` x its outputs' bytes per example. A tensor used
  by a later stage than the next (a skip connection across a cut) is
  carried through the stages between. With `virtual_stages=V` (the
  interleaved schedule) the calls are cut into P * V chunks the same way
  (balanced, or at `cuts`), chunk c on `devices[c mod P]`.

  Args:
    model: a built `keras.Model` made with the functional API, or a built
      `keras.Sequential`.
    num_stages: P, 1 <= P <= the number of layer calls and of devices.
      Optional with `cuts` (then len(cuts) + 1, and must agree).
    cuts: layer names, each the first layer of a stage (a chunk, with
      virtual stages) after the first, in the model's call order (e.g.
      ["block_3", "block_6"]): P * V - 1 of them.
    devices: P or more device names; stage i runs on devices[i]. Defaults
      to this process's logical GPUs, else its logical CPUs.
    activation_examples: examples' worth of activations to count in the
      balance (e.g. the micro-batch size times the micro-batches in
      flight); 0 balances weight bytes alone.
    virtual_stages: V, the chunks each of the P devices holds (>= 2 for
      the interleaved schedule; 1: one stage per device).

  Returns:
    A `Pipeline` over the model's own variables.

  Raises:
    PipelineConfigError: a subclassed model without a functional graph, an
      unbuilt Sequential model, P below 1 or above the number of devices,
      P * V above the number of layer calls, V below 1, unknown or
      out-of-order cut names, cuts that disagree with num_stages (times
      V), or a layer (or variable) used in two stages (chunks).
  """
  calls, input_keys, input_dtypes, output_keys = cutting.model_calls(model)
  names = [c.layer.name for c in calls]
  cutting.check_positive("virtual_stages", virtual_stages)
  if cuts is not None:
    cuts = list(cuts)
    if num_stages is None and (len(cuts) + 1) % virtual_stages == 0:
      num_stages = (len(cuts) + 1) // virtual_stages
    starts = _cut_starts(model, names, cuts, num_stages, virtual_stages)
  _check_num_stages(model, num_stages, num_calls=len(calls),
                    virtual_stages=virtual_stages)
  devices = list(devices) if devices is not None else _default_devices()
  _check_enough_devices(num_stages, devices)
  chunks = num_stages * virtual_stages
  if cuts is None:
    starts = _balanced_starts(calls, chunks, activation_examples)
  bounds = [0] + starts + [len(calls)]
  groups = [calls[a:b] for a, b in zip(bounds, bounds[1:])]
  _check_one_stage_each(groups)
  stages = _make_stages(
      model, groups, input_keys=input_keys, output_keys=output_keys,
      devices=[devices[c % num_stages] for c in range(chunks)])
  return Pipeline(model, stages, input_dtypes, virtual_stages)


def _cut_starts(model, names: Sequence[str], cuts: Sequence[str],
                num_stages: Optional[int],
                virtual_stages: int = 1) -> List[int]:
  """The positions among the layer calls (`names`) where the stages (the
  chunks, with `virtual_stages` > 1) after the first begin, from
  `split_model`'s `cuts`.

  Raises:
    PipelineConfigError: an unknown cut name, cuts out of the call order
      or naming the first layer, cuts that disagree with `num_stages`.
  """
  starts = []
  for name in cuts:
    if name not in names:
      raise errors.PipelineConfigError(
          f"pipeline cut {name!r} is not a layer of model {model.name!r}: "
          f"give layer names among {names[:30]}"
          f"{' ...' if len(names) > 30 else ''}.")
    starts.append(names.index(name))
  if starts != sorted(set(starts)) or (starts and starts[0] == 0):
    raise errors.PipelineConfigError(
        f"pipeline cuts={','.join(cuts)} must name distinct layers in the "
        f"model's call order, none of them its first layer "
        f"({names[0]!r}): the layers run in the order {names[:30]}.")
  if virtual_stages > 1 and (num_stages is None or
                             num_stages * virtual_stages != len(cuts) + 1):
    raise errors.PipelineConfigError(
        f"num_stages={num_stages} x virtual_stages={virtual_stages} "
        f"disagrees with cuts={','.join(cuts)} ({len(cuts) + 1} chunks): "
        f"give num_stages x virtual_stages - 1 cuts, each the first layer "
        "of a chunk after the first.")
  if num_stages is not None and num_stages != len(cuts) + 1 and (
      virtual_stages == 1):
    raise errors.PipelineConfigError(
        f"num_stages={num_stages} disagrees with cuts={','.join(cuts)} "
        f"({len(cuts) + 1} stages): give one of them, or "
        f"{num_stages - 1} cut(s).")
  return starts


def _check_num_stages(model, num_stages: Optional[int], *,
                      num_calls: int, virtual_stages: int = 1) -> None:
  """Refuses a `num_stages` that is missing, below 1, or (times
  `virtual_stages`) above the model's `num_calls` layer calls.

  Raises:
    PipelineConfigError: naming the value and the bound.
  """
  if num_stages is None:
    raise errors.PipelineConfigError(
        "split_model needs num_stages or cuts: give the number of stages "
        "(e.g. num_stages=2) or the layers that begin stages.")
  cutting.check_positive("num_stages", num_stages)
  chunks = num_stages * virtual_stages
  if virtual_stages > 1 and chunks > num_calls:
    raise errors.PipelineConfigError(
        f"num_stages={num_stages} x virtual_stages={virtual_stages} = "
        f"{chunks} chunks is more than the {num_calls} layer call(s) of "
        f"model {model.name!r}: each chunk needs at least one; choose "
        f"num_stages x virtual_stages <= {num_calls}.")
  if num_stages > num_calls:
    raise errors.PipelineConfigError(
        f"num_stages={num_stages} is more than the {num_calls} layer "
        f"call(s) of model {model.name!r}: each stage needs at least one; "
        f"choose num_stages <= {num_calls}.")


def _check_enough_devices(num_stages: int, devices: Sequence[str]) -> None:
  """Refuses more stages than `devices` (stage i runs on device i).

  Raises:
    PipelineConfigError: naming both and the fix.
  """
  if num_stages > len(devices):
    raise errors.PipelineConfigError(
        f"num_stages={num_stages} is more than the {len(devices)} "
        f"device(s) {devices}: stage i runs on device i. Lower num_stages, "
        f"or on a CPU split it into logical devices before TensorFlow "
        f"starts (tfdist.distribute.devices.configure_cpu_devices("
        f"{num_stages}), --num_cpu_devices={num_stages}).")


def _balanced_starts(calls, num_stages: int,
                     activation_examples: int) -> List[int]:
  """Where the stages after the first begin, for the smallest largest
  stage cost (a call's cost: its layer's weight bytes, counted at its
  first call, plus `activation_examples` x its outputs' bytes per
  example)."""
  seen, costs = set(), []
  for call in calls:
    weights = getattr(call.layer, "weights", [])
    own = 0 if id(call.layer) in seen else _param_bytes(weights)
    seen.add(id(call.layer))
    costs.append(own + activation_examples * call.activation_bytes)
  return cutting.balanced_cuts(costs, num_stages)


def _check_one_stage_each(groups) -> None:
  """Refuses a layer, or a variable, used in two stages' `groups` of calls.

  Raises:
    PipelineConfigError: naming the layer (or variable) and the stages.
  """
  stage_of_layer, stage_of_var = {}, {}
  for s, group in enumerate(groups):
    for call in group:
      other = stage_of_layer.setdefault(id(call.layer), s)
      if other != s:
        raise errors.PipelineConfigError(
            f"layer {call.layer.name!r} is called in pipeline stages {other} "
            f"and {s}: a layer's weights live in one stage. Choose cuts "
            f"that keep all its calls in one stage, or give each call its "
            f"own layer.")
      for v in getattr(call.layer, "weights", []):
        other = stage_of_var.setdefault(id(v), s)
        if other != s:
          raise errors.PipelineConfigError(
              f"variable {v.path!r} is used by layers in pipeline stages "
              f"{other} and {s} (a shared or tied weight): choose cuts that "
              f"keep its layers in one stage.")


def _make_stages(model, groups, *, input_keys, output_keys,
                 devices: Sequence[str]) -> List[Stage]:
  """A `Stage` for each group of consecutive calls, on `devices[s]`.

  Carried tensors: stage s hands on what stages after it (or the model's
  outputs) use, among the tensors known by its end.
  """
  produced = [set(input_keys)]
  for group in groups:
    produced.append(produced[-1] | {k for c in group for k in c.out_keys})
  rank = {k: i for i, k in enumerate(
      list(input_keys) + [k for g in groups for c in g for k in c.out_keys])}
  stages = []
  received = tuple(input_keys)
  model_vars = {id(v): i for i, v in enumerate(model.trainable_variables)}
  for s, group in enumerate(groups):
    if s == len(groups) - 1:
      handed = tuple(output_keys)
    else:
      later = {k for g in groups[s + 1:] for c in g for k in c.in_keys}
      later |= set(output_keys)
      handed = tuple(sorted(later & produced[s + 1], key=rank.__getitem__))
    layers, variables, weights = _stage_contents(group, model_vars)
    ordered = sorted(variables.values(), key=lambda v: model_vars[id(v)])
    stages.append(Stage(
        index=s, device=devices[s], layer_names=tuple(layers),
        trainable_variables=tuple(ordered),
        weights=tuple(weights.values()),
        param_bytes=_param_bytes(weights.values()), input_keys=received,
        output_keys=handed, calls=tuple(group)))
    received = handed
  return stages


def _stage_contents(group, model_vars: Dict[int, int]):
  """`(layer names, {id: trainable variable}, {id: weight})` of a stage's
  `group` of calls: its layers in call order, the model's trainable
  variables among theirs (`model_vars`: by id), all their weights."""
  layers, variables, weights = [], {}, {}
  for call in group:
    if call.layer.name not in layers:
      layers.append(call.layer.name)
    for v in getattr(call.layer, "trainable_variables", []):
      if id(v) in model_vars:
        variables[id(v)] = v
    for v in getattr(call.layer, "weights", []):
      weights[id(v)] = v
  return layers, variables, weights
