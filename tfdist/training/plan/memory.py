"""Memory: what a run used (host RSS, GPU memory) and what a model needs.

* `peak_rss_bytes`, `device_memory`, `format_bytes` and the other
  measurements: from `tfdist.observability.memory_use` (named here too).
* `estimate_model_memory`: the bytes of a model's parameters, their
  gradients and the optimizer's state (slots, iteration count, loss
  scale), from the variables' shapes and dtypes: what every replica holds
  under data parallelism, before activations. `fits_data_parallel` compares
  it with a device's memory and says which strategy fits when it does not.
* `sharded_estimate`: the same under ZeRO stage 1, 2 or 3
  (`--shard_optimizer_state`, `tfdist.parallel.data.sharded_optimizer`): each of N
  replicas keeps 1/N of the optimizer state (stage 3: also of the
  trainable weights and their gradients).
* `layout_table`: per-device bytes of plain data parallelism, ZeRO 1/2/3,
  pipeline stages and tensor parallelism side by side (state and
  activations), and the cheapest layout that fits, with its flags
  (`tfdist.diagnose` prints it).
"""

import dataclasses
import math
from typing import Dict, Optional, Tuple

from tfdist.core import optimizers
from tfdist.core import zero_stages
# The measurements live with the run log that reads them (one floor down);
# named here too for diagnose and the runner.
from tfdist.observability.memory_use import (  # noqa: F401
    device_memory, format_bytes, gpu_memory_capacity_bytes,
    host_memory_bytes, peak_device_bytes, peak_rss_bytes)


def _elements(variable) -> int:
  n = 1
  for dim in variable.shape:
    n *= int(dim)
  return n


def _variable_bytes(variables) -> int:
  """Bytes of `variables` (Keras or TensorFlow), from shape and dtype."""
  # Imported here: see `memory_use.device_memory`.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # Keras variables name their dtype as a string, TensorFlow's as a DType.
  return sum(_elements(v) * tf.as_dtype(v.dtype).size for v in variables)


@dataclasses.dataclass(frozen=True)
class ModelMemory:
  """Bytes one replica holds for a model under data parallelism.

  Attributes:
    parameters_bytes: every model variable (trainable and not, e.g. batch
      norm statistics), in its own dtype (float32 under Keras's mixed
      precision policies, which keep variables in float32).
    gradients_bytes: one gradient per trainable variable, in its dtype.
    optimizer_bytes: every optimizer variable: slots (momentum: 1 per
      trainable variable; Adam: 2), iteration count, loss scale.
    num_parameters: elements of the model's variables.
    replicated_bytes: the trainable bytes ZeRO stage 3 keeps whole on
      every replica (embedding tables:
      `tfdist.parallel.zero3.replicated_variables`); part of
      `parameters_bytes` and `gradients_bytes`.
  """
  parameters_bytes: int
  gradients_bytes: int
  optimizer_bytes: int
  num_parameters: int
  replicated_bytes: int = 0

  @property
  def total_bytes(self) -> int:
    return self.parameters_bytes + self.gradients_bytes + self.optimizer_bytes

  def to_dict(self) -> dict:
    return {**dataclasses.asdict(self), "total_bytes": self.total_bytes}


def estimate_model_memory(model, optimizer=None, *, sharded=None,
                          replicated_variables=()) -> ModelMemory:
  """The bytes of `model`'s parameters, gradients and `optimizer`'s state.

  From the variables' shapes and dtypes only (no values are read, so it
  works for variables on parameter servers too). Activations, which depend
  on the batch, are not included.

  Args:
    model: a built Keras model.
    optimizer: its optimizer, built (`optimizer.build(variables)`), or None.
    sharded: the run's `tfdist.parallel.data.sharded_optimizer.ShardedOptimizer`, or
      None: its per-replica state between steps (one replica's slots and
      gradient-accumulator shard) is added to `optimizer`'s own variables
      (iterations and loss scale: the slots live on the shards).
    replicated_variables: the trainable variables ZeRO stage 3 would keep
      whole (`tfdist.parallel.zero3.replicated_variables(model)`).

  Returns:
    A `ModelMemory`.
  """
  optimizer_bytes = (_variable_bytes(optimizer.variables)
                     if optimizer is not None else 0)
  if sharded is not None:
    optimizer_bytes += sharded.state_bytes_per_replica()
  return ModelMemory(
      parameters_bytes=_variable_bytes(model.variables),
      gradients_bytes=_variable_bytes(model.trainable_variables),
      optimizer_bytes=optimizer_bytes,
      num_parameters=sum(_elements(v) for v in model.variables),
      replicated_bytes=_variable_bytes(replicated_variables))


# The switch each ZeRO stage's `--zero_stage=N` stands for.
ZERO_STAGE_SWITCHES = zero_stages.ZERO_STAGE_SWITCHES


def sharded_estimate(estimate: ModelMemory, *, num_replicas: int,
                     stage: int = 1) -> ModelMemory:
  """`estimate` (unsharded) as one replica holds it under ZeRO `stage`.

  The optimizer's slots are split over `num_replicas` (N) replicas in
  shards of a flat buffer padded to a multiple of N: optimizer bytes
  become `ceil(optimizer / N)` (plus at most one shard's padding, N - 1
  elements per slot), i.e. per fp32 Adam parameter 4 + 4 + 8 / N instead
  of 16, as Rajbhandari et al. 2020 count stage 1 (Keras keeps float32
  variables, so the model's weights are the float32 master weights; the
  master shard the Keras optimizer updates is filled only during an
  update: transient, not counted here). Stage 2 also
  shards the gradient accumulators (gradient accumulation only), which
  `ModelMemory` does not count, and TensorFlow's per-step gradients are
  whole either way: the estimate is stage 1's for both stages. Stage 3
  also splits the trainable weights and their gradients (the gradients
  arrive shard-shaped): weights + gradients + optimizer state about
  16 bytes / N per fp32 Adam parameter (Rajbhandari et al. 2020's
  P_os+g+p); non-trainable weights (batch-norm statistics) and the
  tables stage 3 keeps replicated (`estimate.replicated_bytes`: embedding
  tables, with their whole gradients) stay whole.

  Args:
    estimate: from `estimate_model_memory` of an unsharded build.
    num_replicas: replicas in sync (N >= 1).
    stage: 1, 2 or 3 (0 returns `estimate`).

  Returns:
    A `ModelMemory`.
  """
  n = max(int(num_replicas), 1)
  if not stage:
    return estimate
  sharded = dataclasses.replace(
      estimate, optimizer_bytes=-(-estimate.optimizer_bytes // n))
  if stage < 3:
    return sharded
  split = estimate.gradients_bytes - estimate.replicated_bytes
  return dataclasses.replace(
      sharded,
      gradients_bytes=estimate.replicated_bytes + -(-split // n),
      parameters_bytes=estimate.parameters_bytes - split + -(-split // n))


def heaviest_stage(estimate: ModelMemory, stages) -> ModelMemory:
  """The model state of the pipeline stage that holds the most (bytes).

  Args:
    estimate: the whole model's (`estimate_model_memory`).
    stages: the `tfdist.parallel.pipeline.Stage`s (their `weights` and
      `trainable_variables`).

  Returns:
    A `ModelMemory`: the stage's weights and gradients, and the
    optimizer's state in proportion to its trainable bytes (slots are per
    trainable variable).
  """
  trainable = max(estimate.gradients_bytes, 1)
  best = None
  for stage in stages:
    grads = _variable_bytes(stage.trainable_variables)
    one = ModelMemory(
        parameters_bytes=_variable_bytes(stage.weights),
        gradients_bytes=grads,
        optimizer_bytes=-(-estimate.optimizer_bytes * grads // trainable),
        num_parameters=sum(_elements(v) for v in stage.weights))
    if best is None or one.total_bytes > best.total_bytes:
      best = one
  return best or estimate


@dataclasses.dataclass(frozen=True)
class Fit:
  """Whether a model's state fits a device under data parallelism.

  Attributes:
    fits: parameters, gradients and optimizer state of every replica that
      shares the memory fit in it.
    needed_bytes: what the replicas sharing `capacity_bytes` hold.
    capacity_bytes: the device's (or host's) memory.
    share: `needed_bytes / capacity_bytes`.
    advice: what to do when it does not fit (empty when it does).
  """
  fits: bool
  needed_bytes: int
  capacity_bytes: int
  share: float
  advice: str = ""


# Activations, workspace and the framework need the rest: a model whose
# state alone takes more than this share of a device is called tight.
TIGHT_SHARE = 0.5


def fits_data_parallel(estimate: ModelMemory, *, capacity_bytes: int,
                       replicas_sharing: int = 1,
                       optimizer: str = "", num_replicas: int = 1,
                       zero_stage: int = 0) -> Fit:
  """Says whether every replica's copy fits, and what fits if not.

  Under data parallelism (mirrored, multi_worker_mirrored, TPU) every
  replica holds all parameters, their gradients and the optimizer's state.
  Parameter servers hold the variables and optimizer slots sharded over the
  ps tasks; workers fetch what each step reads (for embedding tables, the
  looked-up rows only). Mixed precision (bf16/fp16) and activation
  recomputation shrink activations, not this state: Keras keeps variables
  in float32.

  Args:
    estimate: from `estimate_model_memory`.
    capacity_bytes: memory of one device (GPU memory; host memory for CPU
      replicas).
    replicas_sharing: replicas whose copies share that memory (logical CPU
      devices, or workers on one host: all of them; GPUs: 1).
    optimizer: the optimizer's name, for the advice.
    num_replicas: replicas in sync (all workers), over which
      `--shard_optimizer_state` would shard the optimizer state.
    zero_stage: the run's ZeRO stage (`--zero_stage`); > 0: `estimate` is
      taken as unsharded and sharded here (`sharded_estimate`).

  Returns:
    A `Fit`; when data parallelism does not fit but sharding the optimizer
    state over `num_replicas` would, its advice starts with the flag.
  """
  sharing = max(int(replicas_sharing), 1)
  if zero_stage:
    estimate = sharded_estimate(estimate, num_replicas=num_replicas,
                                stage=zero_stage)
  needed = estimate.total_bytes * sharing
  share = needed / capacity_bytes if capacity_bytes else math.inf
  if needed <= capacity_bytes:
    return Fit(True, needed, capacity_bytes, share)
  shard_advice = ""
  traits = optimizers.optimizer_spec(optimizer).traits if optimizer else None
  if (not zero_stage and num_replicas > 1 and
      (traits is None or traits.shardable)):
    sharded = sharded_estimate(estimate, num_replicas=num_replicas)
    if sharded.total_bytes * sharing <= capacity_bytes:
      shard_advice = (
          f"--shard_optimizer_state (--zero_stage=1) over the "
          f"{num_replicas} replicas keeps "
          f"{format_bytes(sharded.optimizer_bytes)} of optimizer state per "
          f"replica instead of {format_bytes(estimate.optimizer_bytes)}: "
          f"{format_bytes(sharded.total_bytes * sharing)} in all, which "
          "fits (same weights as unsharded training).")
  # Variables and slots sharded over ps tasks; gradients stay on workers.
  sharded = estimate.parameters_bytes + estimate.optimizer_bytes
  num_ps = max(1, math.ceil(sharded / max(capacity_bytes, 1)))
  advice = [
      f"parameters, gradients and optimizer state need {format_bytes(needed)}"
      f" against {format_bytes(capacity_bytes)}: data parallelism does not "
      "fit" + (f" (ZeRO stage {zero_stage} counted)." if zero_stage else "."),
      *([shard_advice] if shard_advice else []),
      f"--distribution_strategy=parameter_server with at least {num_ps} ps "
      f"task(s) holds the variables and optimizer slots "
      f"({format_bytes(sharded)}) sharded (--ps_partitioner); it suits models"
      " whose size is in embedding tables, of which each step reads a few "
      "rows."]
  # The layers' state split over consecutive devices (Huang et al. 2019).
  stages = max(2, math.ceil(estimate.total_bytes / max(capacity_bytes, 1)))
  advice.append(
      f"--pipeline_stages={stages} cuts the model into {stages} stages on "
      f"{stages} devices (GPUs; logical CPU devices share the host's "
      f"memory), each holding about {format_bytes(estimate.total_bytes / stages)}"
      " of parameters, gradients and optimizer state, at the cost of a "
      f"pipeline bubble of ({stages}-1)/(M+{stages}-1) of each step for M "
      "micro-batches (--num_microbatches).")
  if traits is not None and traits.slots_per_parameter > 1:
    advice.append(
        f"--optimizer={optimizer} keeps {traits.slots_per_parameter:g} slots"
        " per parameter; sgd with momentum keeps 1.")
  advice.append("Mixed precision (--dtype=bf16/fp16) and recomputation shrink"
                " activations only; Keras keeps variables in float32.")
  return Fit(False, needed, capacity_bytes, share, " ".join(advice))


# --- every layout side by side ------------------------------------------------
# The layouts in the order the advice prefers them when several fit: least
# communication and fewest constraints first. ZeRO 1-2 add a gather of the
# updated weights to data parallelism's all-reduce, ZeRO 3 gathers the
# weights again for every forward and backward pass (1.5x data
# parallelism's traffic by Rajbhandari et al. 2020's count, about 2x here
# without a reduce-scatter); pipeline stages idle a
# bubble of (P-1)/(M+P-1) of each step and forbid data parallelism here;
# tensor parallelism all-reduces activations twice per block forward and
# backward, which pays only on fast device links (NVLink).
LAYOUTS = ("data parallel", "ZeRO 1", "ZeRO 2", "ZeRO 3", "pipeline",
           "tensor parallel")
# Rows only for a model that has what they split: expert parallelism for a
# model with mixture-of-experts layers (after the others).
OPTIONAL_LAYOUTS = ("expert parallel", "expert parallel + ZeRO 1",
                    "expert parallel + ZeRO 2")


@dataclasses.dataclass(frozen=True)
class LayoutMemory:
  """One layout's bytes per device, and whether it fits.

  Attributes:
    layout: one of `LAYOUTS`.
    flags: the `tfdist.train` flags that choose it (empty for plain data
      parallelism).
    devices: devices the layout uses (replicas, or pipeline stages).
    parameters_bytes, gradients_bytes, optimizer_bytes: the model state one
      device holds (gradients include gradient accumulators, when
      accumulating).
    activations_bytes: activations one device keeps for its backward pass
      (see `activation_bytes_per_example`; 0 when unknown).
    needed_bytes: what the devices sharing one memory hold together
      (`per_device_bytes` times the devices sharing it).
    fits: `needed_bytes` <= the memory's capacity.
    available: the layout can run here (enough devices, a shardable
      optimizer, a model the layout can split).
    note: why it is not available, or what the figure leaves out.
  """
  layout: str
  flags: str
  devices: int
  parameters_bytes: int
  gradients_bytes: int
  optimizer_bytes: int
  activations_bytes: int
  needed_bytes: int
  fits: bool
  available: bool = True
  note: str = ""

  @property
  def per_device_bytes(self) -> int:
    return (self.parameters_bytes + self.gradients_bytes +
            self.optimizer_bytes + self.activations_bytes)

  def to_dict(self) -> dict:
    return {**dataclasses.asdict(self),
            "per_device_bytes": self.per_device_bytes}


@dataclasses.dataclass(frozen=True)
class LayoutChoice:
  """Every layout's `LayoutMemory` and the one recommended.

  Attributes:
    rows: one `LayoutMemory` per layout, in `LAYOUTS` order.
    recommended: the first available row (in `LAYOUTS` order: the cheapest
      in communication) that fits, or None when none does.
    capacity_bytes: the memory one device (or the shared host) has.
    facts: the `LayoutFacts` the rows were computed from (for the meshes
      of `tfdist.training.plan.mesh_plan`).
  """
  rows: tuple
  recommended: Optional[LayoutMemory]
  capacity_bytes: int
  facts: Optional["LayoutFacts"] = None

  def advice(self) -> str:
    """One sentence: the recommended layout with its flags, or what comes
    closest when nothing fits."""
    fmt = format_bytes
    if self.recommended is not None:
      row = self.recommended
      how = f" ({row.flags})" if row.flags else " (no extra flags)"
      return (f"Recommended layout: {row.layout}{how}: "
              f"{fmt(row.per_device_bytes)} per device, "
              f"{fmt(row.needed_bytes)} of {fmt(self.capacity_bytes)}.")
    usable = [r for r in self.rows if r.available] or list(self.rows)
    closest = min(usable, key=lambda r: r.needed_bytes)
    return (f"No layout fits {fmt(self.capacity_bytes)}: the smallest is "
            f"{closest.layout} ({closest.flags or 'no extra flags'}) at "
            f"{fmt(closest.needed_bytes)}; add devices, or shrink the batch "
            "or the model.")

  def render(self) -> str:
    """The rows as a text table, then `advice()`."""
    fmt = format_bytes
    header = ("layout", "flags", "devices", "weights", "gradients",
              "optimizer", "activations", "per device", "fits")
    lines = [header]
    for r in self.rows:
      lines.append((
          r.layout, r.flags or "-", str(r.devices), fmt(r.parameters_bytes),
          fmt(r.gradients_bytes), fmt(r.optimizer_bytes),
          fmt(r.activations_bytes), fmt(r.per_device_bytes),
          ("yes" if r.fits else "no") if r.available else
          f"n/a: {r.note}"))
    widths = [max(len(row[i]) for row in lines)
              for i in range(len(header) - 1)]
    # Indented: the rows read as a table under the report's heading.
    text = ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) +
            "  " + row[-1] for row in lines]
    return "\n".join([*text, self.advice()])

  def to_dict(self) -> dict:
    return {"rows": [r.to_dict() for r in self.rows],
            "recommended": (self.recommended.layout
                            if self.recommended else None),
            "recommended_flags": (self.recommended.flags
                                  if self.recommended else None),
            "capacity_bytes": self.capacity_bytes}


def _ceil_div(a: float, n: int) -> int:
  return int(-(-int(a) // max(int(n), 1)))


def model_facts(model) -> dict:
  """Every registered parallelism mode's measurements of an unsharded,
  built Keras `model` (`tfdist.parallel.mode.StepMode.model_facts`),
  merged: `replicated_variables` (ZeRO stage 3's whole embedding tables,
  for `estimate_model_memory`), `tensor_parallel_bytes` and
  `pipeline_shares` (for `layout_table`)."""
  from tfdist.parallel import modes  # pylint: disable=g-import-not-at-top
  facts = {}
  for name in modes.mode_names():
    facts.update(modes.get_mode(name).model_facts(model))
  return facts


@dataclasses.dataclass(frozen=True)
class LayoutFacts:
  """What every parallelism mode's `layout_table` rows are computed from
  (`tfdist.parallel.mode.StepMode.layout_rows`): `layout_table`'s
  arguments, with `shardable` (the optimizer can be sharded) resolved.
  Byte counts are ints; `num_devices` N, `global_batch_size` B,
  `activation_bytes_per_example` a."""
  estimate: ModelMemory
  num_devices: int
  capacity_bytes: int
  shared_memory: bool
  global_batch_size: int
  activation_bytes_per_example: int = 0
  optimizer: str = ""
  shardable: bool = True
  gradient_accumulation: bool = False
  num_microbatches: int = 0
  pipeline_schedule: str = "gpipe"
  tensor_parallel_bytes: int = 0
  tensor_parallel_flag: str = ""
  pipeline_shares: Dict[int, float] = dataclasses.field(default_factory=dict)
  expert_bytes: int = 0
  num_experts: int = 0
  layout_map: str = ""
  layout_map_degree: int = 0

  ceil_div = staticmethod(_ceil_div)

  def tensor_split(self, tensor: int, pipeline: int = 1) -> Tuple[str, str]:
    """`(flags, note)` of a layout splitting the model over T = `tensor`
    devices (P = `pipeline` stages beside it): the flags that choose the
    split, and why tfdist cannot run it ("" when it can).

    * a layout map named by `--layout_map` (`layout_map`, its model axis
      `layout_map_degree`): `--layout_map=...` (with
      `--distribution_strategy=mirrored` without a pipeline) at its T,
      and no other T;
    * the built-in Transformer (`tensor_parallel_flag`):
      `--distribution_strategy=mirrored --tensor_parallel=T`, not inside
      a pipeline's stages;
    * any other model a layout map could split (`tensor_parallel_bytes`):
      a layout map is needed (`--layout_map`, or `tfdist.fit(...,
      layout_map=...)`); the flags name the form.
    """
    mirrored = "--distribution_strategy=mirrored " if pipeline <= 1 else ""
    if not self.tensor_parallel_bytes:
      return "", "no layer of this model can be split"
    if self.layout_map:
      flag = f"--layout_map={self.layout_map}"
      if tensor != self.layout_map_degree:
        return f"{mirrored}{flag}", (
            f"{flag} has a 'model' axis of {self.layout_map_degree}: T = "
            f"{tensor} needs a map whose 'model' axis is {tensor}")
      return f"{mirrored}{flag}", ""
    if self.tensor_parallel_flag:
      if pipeline > 1:
        return f"--tensor_parallel={tensor}", (
            "the built-in Transformer's split (attention by heads, over "
            "replicas) does not run inside a pipeline's stages (a layout "
            "map's Dense split does: --layout_map=package.module:function "
            "with --pipeline_stages)")
      return f"{mirrored}--tensor_parallel={tensor}", ""
    return f"{mirrored}--layout_map=package.module:function", (
        "--tensor_parallel splits only --model=transformer: train this "
        "model split with tfdist.fit(..., layout_map=...) or "
        "--layout_map=package.module:function (a layout map is needed, "
        f"its 'model' axis {tensor})")

  @property
  def accumulators(self) -> int:
    """The gradient accumulators' bytes (0 without accumulation)."""
    return (self.estimate.gradients_bytes if self.gradient_accumulation
            else 0)

  @property
  def one_device_note(self) -> str:
    """Why a splitting layout is unavailable on one device ("": N > 1)."""
    return ("one device: nothing to split over" if self.num_devices == 1
            else "")

  @property
  def zero_note(self) -> str:
    """Why the ZeRO rows are unavailable ("": they are available)."""
    return self.one_device_note or (
        "" if self.shardable else
        f"--optimizer={self.optimizer} cannot be sharded")

  def stage_activations(self, stages: int, batch: float) -> int:
    """a*b*f/(P*M): one of P pipeline stages' activations for a batch of
    `batch` examples in M micro-batches (`num_microbatches`, else P), f of
    them in flight (GPipe all M, 1F1B at most P; the interleaved schedule
    is counted as 1F1B, a lower bound: its first stage holds up to
    (P(V+1)-1)/V stages' worth)."""
    m = self.num_microbatches or stages
    in_flight = m if self.pipeline_schedule == "gpipe" else min(stages, m)
    return _ceil_div(self.activation_bytes_per_example * batch * in_flight,
                     stages * m)

  @property
  def replica_activations(self) -> int:
    """a*B/N: one data-parallel replica's activations."""
    return _ceil_div(self.activation_bytes_per_example *
                     self.global_batch_size, self.num_devices)

  def row(self, layout: str, flags: str, devices: int, w: float, g: float,
          o: float, act: float, available: bool = True,
          note: str = "") -> "LayoutMemory":
    """A `LayoutMemory` of per-device weights `w`, gradients `g`,
    optimizer state `o` and activations `act` (bytes) on `devices`
    devices; it fits when available and the devices sharing the memory
    hold at most `capacity_bytes` together."""
    per_device = w + g + o + act
    needed = per_device * (devices if self.shared_memory else 1)
    return LayoutMemory(layout, flags, devices, int(w), int(g), int(o),
                        int(act), int(needed),
                        bool(available and needed <= self.capacity_bytes),
                        bool(available), note)


def activation_bytes_per_example(model) -> int:
  """Bytes of the outputs of `model`'s layers for one example: what a
  functional or Sequential model keeps for its backward pass, per example
  of the batch, in each layer's compute dtype (half under bf16/fp16).

  A lower bound: a layer's inner tensors (attention scores, a nested
  model's layers) are not counted. 0 for a subclassed model (no symbolic
  outputs).

  Args:
    model: a built Keras model.

  Returns:
    Bytes per example (int).
  """
  # Imported here: see `memory_use.device_memory`.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  total = 0
  for layer in getattr(model, "layers", []):
    if type(layer).__name__ == "InputLayer":
      continue
    try:
      outputs = tf.nest.flatten(layer.output)
    except (AttributeError, ValueError):
      continue
    for output in outputs:
      shape = getattr(output, "shape", None)
      if shape is None or any(d is None for d in list(shape)[1:]):
        continue
      elements = 1
      for dim in list(shape)[1:]:
        elements *= int(dim)
      total += elements * tf.as_dtype(output.dtype).size
  return total


def layout_table(estimate: ModelMemory, *, num_devices: int,
                 capacity_bytes: int, shared_memory: bool,
                 global_batch_size: int,
                 activation_bytes_per_example: int = 0,
                 optimizer: str = "", gradient_accumulation: bool = False,
                 num_microbatches: int = 0, pipeline_schedule: str = "gpipe",
                 tensor_parallel_bytes: int = 0,
                 tensor_parallel_flag: str = "",
                 refused: Optional[Dict[str, str]] = None,
                 pipeline_shares: Optional[Dict[int, float]] = None,
                 expert_bytes: int = 0, num_experts: int = 0,
                 layout_map: str = "", layout_map_degree: int = 0
                 ) -> LayoutChoice:
  """Per-device bytes of every layout on `num_devices` devices, side by side.

  With S = weights + gradients + optimizer state (`estimate`), T the
  trainable weights' bytes (= the gradients' bytes), a the activation bytes
  of one example, B the global batch and N the devices:

  * data parallel: S + a*B/N per replica.
  * ZeRO 1: the optimizer state / N (Rajbhandari et al. 2020's P_os: 4+4+8/N
    bytes per fp32 Adam parameter).
  * ZeRO 2: also the gradient accumulators / N (TensorFlow has no
    reduce-scatter, so each step's gradients stay whole: without
    `gradient_accumulation` ZeRO 2 equals ZeRO 1).
  * ZeRO 3: trainable weights, gradients and optimizer state all / N, about
    16 bytes / N per fp32 Adam parameter (P_os+g+p); non-trainable weights
    (batch-norm statistics) stay whole. The transient gather of one block's
    weights during its pass is not counted.
  * pipeline: P stages (the fewest, 2 <= P <= N, that fit; else N), no data
    parallelism: each stage about S/P, and the activations of the micro-
    batches it has in flight for the whole batch B: GPipe all M of them,
    a*B/P; 1F1B at most P on the first stage, a*B*min(P, M)/(P*M).
  * tensor parallel: the splittable layers' state (`tensor_parallel_bytes`
    of weights, their gradients and optimizer slots in proportion) / N, the
    rest whole; every replica runs the whole batch B, and its activations
    are counted whole (an upper bound: the split heads' are 1/N).
  * expert parallel (models with mixture-of-experts layers only): the
    experts' state (`expert_bytes` of weights, their gradients and slots
    in proportion) / E_p, E_p the largest divisor of both N and E, the rest
    whole; each replica a*B/N activations (the dispatched tokens' buffers
    not counted). Beside it ZeRO 1: the non-expert optimizer state / N,
    the experts' / E_p; ZeRO 2: also the non-expert gradient
    accumulators / N (`tfdist.parallel.experts.zero`).

  Args:
    estimate: the model's unsharded `ModelMemory` (one replica, plain data
      parallelism).
    num_devices: devices available (replicas in sync; stages at most).
    capacity_bytes: memory of one device, or of the host when the devices
      share it.
    shared_memory: the devices share `capacity_bytes` (logical CPU devices,
      workers of one host): a layout needs its per-device bytes times its
      devices.
    global_batch_size: examples per step over all replicas (B).
    activation_bytes_per_example: a (see `activation_bytes_per_example`).
    optimizer: `--optimizer`'s name: an optimizer that cannot be sharded
      makes the ZeRO rows unavailable.
    gradient_accumulation: `--gradient_accumulation_steps` > 1: replicas
      also keep an accumulator per gradient.
    num_microbatches: M for the pipeline row (0: as many as stages).
    pipeline_schedule: `gpipe`, `1f1b` or `interleaved` (counted as 1f1b).
    tensor_parallel_bytes: bytes of the weights the tensor-parallel layers
      would split (attention and feed-forward kernels); 0: the model cannot
      be split, the row is unavailable.
    tensor_parallel_flag: the flags that turn tensor parallelism on for
      this model (`tfdist.parallel.tensor.options.flags_for`:
      `--tensor_parallel=N` for the built-in Transformer); empty:
      unavailable (another model can use the layers as a library,
      `tfdist.parallel.tensor_parallel`).
    refused: layouts (`LAYOUTS` names) that this tfdist refuses, with the
      reason: shown, never recommended.
    pipeline_shares: P -> the share of the weight bytes the heaviest of P
      stages holds, from the model's real cut (one layer can outweigh the
      rest: a stage never holds less than its layers); P absent: 1/P.
    expert_bytes: bytes of the weights of the model's mixture-of-experts
      layers' experts (0: no experts; the expert-parallel row is left out).
    num_experts: E, the experts of each such layer (the fewest, when they
      differ).
    layout_map: `--layout_map`'s value (`package.module:function`) when a
      layout map splits the model (its rows' flags name it); "": none.
    layout_map_degree: that map's `model` axis T (the one tensor degree
      it runs).

  Returns:
    A `LayoutChoice`.

  Raises:
    ValueError: `num_devices` or `global_batch_size` < 1, or an unknown
      `pipeline_schedule`.
  """
  if num_devices < 1 or global_batch_size < 1:
    raise ValueError(
        "layout_table needs num_devices >= 1 and global_batch_size >= 1; "
        f"received num_devices={num_devices}, "
        f"global_batch_size={global_batch_size}.")
  if pipeline_schedule not in ("gpipe", "1f1b", "interleaved"):
    raise ValueError(
        "layout_table's pipeline_schedule is 'gpipe', '1f1b' or "
        "'interleaved'; received "
        f"pipeline_schedule={pipeline_schedule!r}.")
  shardable = True
  if optimizer:
    shardable = optimizers.optimizer_spec(optimizer).traits.shardable
  facts = LayoutFacts(
      estimate=estimate, num_devices=int(num_devices),
      capacity_bytes=int(capacity_bytes), shared_memory=shared_memory,
      global_batch_size=int(global_batch_size),
      activation_bytes_per_example=int(activation_bytes_per_example),
      optimizer=optimizer, shardable=shardable,
      gradient_accumulation=gradient_accumulation,
      num_microbatches=num_microbatches,
      pipeline_schedule=pipeline_schedule,
      tensor_parallel_bytes=tensor_parallel_bytes,
      tensor_parallel_flag=tensor_parallel_flag,
      pipeline_shares=dict(pipeline_shares or {}),
      expert_bytes=int(expert_bytes), num_experts=int(num_experts),
      layout_map=layout_map, layout_map_degree=int(layout_map_degree))
  # Each registered parallelism mode computes its own rows, in the modes'
  # order (`tfdist.parallel.modes`: the built-in ones first). Imported
  # here: the modes import TensorFlow, the rest of this module does not.
  from tfdist.parallel import modes  # pylint: disable=g-import-not-at-top
  rows = [r for name in modes.mode_names()
          for r in modes.get_mode(name).layout_rows(facts)]
  for name, reason in (refused or {}).items():
    rows = [dataclasses.replace(r, available=False, fits=False, note=reason)
            if r.layout == name and r.available else r for r in rows]
  recommended = next((r for r in rows if r.fits), None)
  return LayoutChoice(tuple(rows), recommended, int(capacity_bytes),
                      facts)
