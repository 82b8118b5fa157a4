"""Meshes in the memory plan: every data x pipeline x tensor layout of N
devices, with each ZeRO stage, per device, and the one to use.

`mesh_layouts(facts)` takes the `tfdist.training.plan.memory.LayoutFacts` the
single-axis table is computed from and returns one `MeshLayout` per
factorization N = D x P x T (`tfdist.parallel.mesh.factorizations`) and
ZeRO stage z (0 always; 1-3 where D > 1 and the optimizer can be sharded).
With S the unsharded state (weights W, gradients G and accumulators A,
optimizer state O: `estimate_model_memory`), a the activation bytes of one
example, B the global batch, and

  s_P = the share of the weights the heaviest of P stages holds (the
        model's real cut where measured, else 1/P);
  t_T = 1 - x (T-1)/T, where x is the share of the trainable weights the
        tensor-parallel layers split (Megatron's column/row pairs: those
        weights / T, the rest whole);

one device holds (Rajbhandari et al. 2020 for the ZeRO stages, over the D
copies of its shard of the model):

  weights      W s_P t_T               (z = 3: the trainable part / D,
                                       embedding tables kept whole aside)
  gradients    (G + A) s_P t_T         (z = 2: A / D; z = 3: all / D;
                                       D x P: + G s_P, the packed buffer
                                       of the stage's all-reduce)
  optimizer    O s_P t_T               (z >= 1: / D)
  activations  a (B/D) f / (P M)       with a pipeline (M micro-batches,
                                       f in flight: GPipe M, 1F1B min(P, M))
               a (B/D)                 otherwise (whole under tensor
                                       parallelism: an upper bound).

Each layout also gets the bytes one device moves per step over its data
group, as tfdist's collectives run it (ring collectives, g the gradient
bytes it holds): 2 (D-1)/D g for the gradients' all-reduce; ZeRO 1-2 add
an all-gather of the updated weights, (D-1)/D g, since TensorFlow offers
no reduce-scatter to replace the all-reduce (3 (D-1)/D g; Rajbhandari et
al. 2020 count 2 with one); stage 3 gathers each block's weights for the
forward and again for the backward pass (4 (D-1)/D g; their 3 with a
reduce-scatter). Pipeline and tensor parallelism add activation traffic
this plan does not estimate in bytes (Narayanan et al. 2021 section 3):
they are ranked instead.

The recommended layout is the first that fits and tfdist can run, in the
order of what each axis costs in communication (the order Megatron-LM and
torchtitan advise): data parallelism, then ZeRO 1, 2, 3, then pipelines,
then tensor parallelism (activations all-reduced in every block, worth it
only over fast links), then both; within one kind, the smaller model-
parallel degrees first (more data parallelism).

No TensorFlow here: arithmetic on the facts.
"""

import dataclasses
import math
from typing import List, Optional, Sequence

from tfdist.parallel import mesh as mesh_lib
from tfdist.training.plan import memory

ZERO_STAGES = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True)
class MeshLayout:
  """One mesh and ZeRO stage: its bytes per device and whether it fits.

  Attributes:
    data, pipeline, tensor: the degrees D, P, T (D * P * T = N).
    zero_stage: z, the ZeRO stage within each data-parallel group.
    memory: its `tfdist.training.plan.memory.LayoutMemory` (layout `"mesh"`;
      `flags` the `tfdist.train` flags that choose it; `fits`,
      `available` and `note` as in the single-axis table).
    data_traffic_bytes: the bytes one device moves per step over its data
      group (the module docstring; 0 when D = 1).
  """

  data: int
  pipeline: int
  tensor: int
  zero_stage: int
  memory: memory.LayoutMemory
  data_traffic_bytes: int

  @property
  def name(self) -> str:
    """`D2 x P2 x T1, ZeRO 1`."""
    zero = f", ZeRO {self.zero_stage}" if self.zero_stage else ""
    return f"D{self.data} x P{self.pipeline} x T{self.tensor}{zero}"

  @property
  def cost_rank(self) -> tuple:
    """The recommendation order (module docstring): no model parallelism,
    then pipelines, then tensor parallelism, then both; ZeRO stage; then
    the smaller degrees."""
    kind = (self.tensor > 1) * 2 + (self.pipeline > 1)
    return (kind, self.zero_stage, self.tensor, self.pipeline)

  def to_dict(self) -> dict:
    return {"data": self.data, "pipeline": self.pipeline,
            "tensor": self.tensor, "zero_stage": self.zero_stage,
            "data_traffic_bytes": self.data_traffic_bytes,
            **self.memory.to_dict()}


def unavailable_reason(data: int, pipeline: int, tensor: int,
                       zero_stage: int, facts: memory.LayoutFacts) -> str:
  """Why tfdist cannot run this mesh here ("" when it can).

  The rules, one per missing piece: ZeRO needs D > 1 and an optimizer that
  can be sharded; tensor parallelism needs a model its layers split and
  the means to split it (`LayoutFacts.tensor_split`): a layout map named
  by `--layout_map`, at its own T only (inside a pipeline's stages too:
  `tfdist.parallel.pipeline.tensor`), the built-in Transformer's
  `--tensor_parallel` (not inside a pipeline's stages), or for any other
  model a layout map to give; a ZeRO stage beside a pipeline and ZeRO
  stage 3 beside tensor parallelism are not built yet. Data x pipeline
  runs in one process (`tfdist.parallel.pipeline.copies`), data x tensor
  on one host's Mirrored replicas (`tfdist.parallel.tensor.groups`), with
  ZeRO stages 1-2 inside each data group (hybrid sharding,
  `tfdist.parallel.tensor.zero`), data x pipeline x tensor in one process
  with a layout map.
  """
  if zero_stage and data == 1:
    return "ZeRO needs data parallelism (D > 1)"
  if zero_stage and not facts.shardable:
    return f"--optimizer={facts.optimizer} cannot be sharded"
  if tensor > 1:
    note = facts.tensor_split(tensor, pipeline)[1]
    if note:
      return note
  if zero_stage and pipeline > 1:
    return "ZeRO beside a pipeline is not built yet"
  if zero_stage == 3 and tensor > 1:
    return "ZeRO stage 3 beside tensor parallelism is not built yet"
  return ""


def _flags(data: int, pipeline: int, tensor: int, zero_stage: int,
           facts: memory.LayoutFacts) -> str:
  parts = []
  if pipeline > 1:
    parts.append(f"--pipeline_stages={pipeline}")
  if tensor > 1:
    split = facts.tensor_split(tensor, pipeline)[0]
    if split:
      parts.append(split)
  if data > 1 and (pipeline > 1 or tensor > 1):
    # The copies of a model-parallel layout: the devices asked for.
    devices = "--num_cpu_devices" if facts.shared_memory else "--num_gpus"
    parts.append(f"{devices}={data * pipeline * tensor}")
  if zero_stage:
    parts.append(f"--zero_stage={zero_stage}")
  return " ".join(parts)


def _layout(data: int, pipeline: int, tensor: int, zero_stage: int,
            facts: memory.LayoutFacts) -> MeshLayout:
  e = facts.estimate
  stage = facts.pipeline_shares.get(pipeline, 1 / pipeline)
  trainable = e.gradients_bytes
  split = min(max(int(facts.tensor_parallel_bytes), 0), trainable)
  kept = 1 - (split / trainable if trainable else 0.0) * (tensor - 1) / tensor
  scale = stage * kept
  weights = e.parameters_bytes * scale
  grads, accumulators = trainable * scale, facts.accumulators * scale
  optimizer = e.optimizer_bytes * scale
  if pipeline > 1 and data > 1:
    # Each stage's gradients packed into one vector for their all-reduce
    # over the copies (`tfdist.parallel.pipeline.copies`).
    grads += trainable * scale
  if zero_stage >= 1:
    optimizer /= data
  if zero_stage >= 2:
    accumulators /= data
  if zero_stage == 3:
    # Embedding tables stage 3 keeps whole stay replicated.
    sharded = grads - min(e.replicated_bytes, trainable) * scale
    weights -= sharded * (data - 1) / data
    grads -= sharded * (data - 1) / data
  batch = facts.global_batch_size / data
  activations = (facts.stage_activations(pipeline, batch) if pipeline > 1
                 else facts.activation_bytes_per_example * batch)
  note = unavailable_reason(data, pipeline, tensor, zero_stage, facts)
  row = facts.row("mesh", _flags(data, pipeline, tensor, zero_stage, facts),
                  data * pipeline * tensor, math.ceil(weights),
                  math.ceil(grads + accumulators), math.ceil(optimizer),
                  math.ceil(activations), not note, note)
  # All-reduce 2, + all-gather of the updated weights 1 (ZeRO 1-2), + the
  # forward and backward gathers 2 (stage 3): times (D-1)/D of g.
  ring = (2, 3, 3, 4)[zero_stage] * (data - 1) / data
  return MeshLayout(data, pipeline, tensor, zero_stage, row,
                    math.ceil(ring * trainable * scale))


def mesh_layouts(facts: memory.LayoutFacts,
                 zero_stages: Sequence[int] = ZERO_STAGES
                 ) -> List[MeshLayout]:
  """Every mesh of `facts.num_devices` devices with each ZeRO stage (z > 0
  only where D > 1), in recommendation order (`MeshLayout.cost_rank`).

  Args:
    facts: the model's unsharded state, the devices, their memory, the
      batch (`tfdist.training.plan.memory.LayoutFacts`).
    zero_stages: the stages to list (default 0-3).

  Returns:
    A list of `MeshLayout`; 4 devices give 6 meshes and 15 layouts.

  Raises:
    tfdist.errors.ConfigError: fewer than one device.
  """
  out = []
  for data, pipeline, tensor in mesh_lib.factorizations(facts.num_devices):
    for z in zero_stages:
      if z and data == 1:
        continue
      out.append(_layout(data, pipeline, tensor, z, facts))
  return sorted(out, key=lambda m: (m.cost_rank, -m.data))


def recommended(layouts: Sequence[MeshLayout]) -> Optional[MeshLayout]:
  """The first layout (in recommendation order) that tfdist can run and
  that fits, or None."""
  return next((m for m in layouts if m.memory.fits), None)


def render(layouts: Sequence[MeshLayout], capacity_bytes: int) -> str:
  """The meshes as a text table (one row each), then the recommendation,
  or the smallest runnable layout when none fits."""
  fmt = memory.format_bytes
  header = ("mesh", "flags", "weights", "gradients", "optimizer",
            "activations", "per device", "data traffic", "fits")
  lines = [header]
  for m in layouts:
    r = m.memory
    lines.append((m.name, r.flags or "-", fmt(r.parameters_bytes),
                  fmt(r.gradients_bytes), fmt(r.optimizer_bytes),
                  fmt(r.activations_bytes), fmt(r.per_device_bytes),
                  fmt(m.data_traffic_bytes),
                  ("yes" if r.fits else "no") if r.available else
                  f"n/a: {r.note}"))
  widths = [max(len(row[i]) for row in lines)
            for i in range(len(header) - 1)]
  text = ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " +
          row[-1] for row in lines]
  best = recommended(layouts)
  if best is not None:
    advice = (f"Recommended mesh: {best.name} "
              f"({best.memory.flags or 'no extra flags'}): "
              f"{fmt(best.memory.per_device_bytes)} per device, "
              f"{fmt(best.memory.needed_bytes)} of {fmt(capacity_bytes)}.")
  else:
    runnable = [m for m in layouts if m.memory.available] or list(layouts)
    small = min(runnable, key=lambda m: m.memory.needed_bytes)
    advice = (f"No mesh fits {fmt(capacity_bytes)}: the smallest tfdist "
              f"runs is {small.name} at {fmt(small.memory.needed_bytes)}; "
              "add devices, or shrink the batch or the model.")
  return "\n".join([*text, advice])
