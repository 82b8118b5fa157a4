"""The trainer's step through a pipeline (`--pipeline_stages=P`, P > 1).

`build` cuts the run's model into P stages (`tfdist.parallel.pipeline`)
on P devices, creates each stage's variables on its device (a model built
inside `deferred_variables`: from their initializers, never all on one
device; one built before: moved there) and checks the step's batch, all
before any optimizer or step is built. `PipelineStep`
replaces the `Trainer`'s per-replica forward and backward pass: the step's
batch is split into M micro-batches that flow through the stages under the
schedule, and it returns what the unsplit pass returns (the loss, the
gradients of every trainable variable, the outputs), so the trainer's
metrics, loss scaling, gradient accumulation, clipping, checkpoints,
callbacks and export stay as they are.

The loss differentiated per micro-batch is the trainer's own objective on
those examples (their share of the global batch's loss, sample or class
weights applied), so the summed gradients are the unsplit step's. Weight
regularizers (`kernel_regularizer`, ...) are added once per update, as the
unsplit step adds `model.losses`. Activity regularizers are refused at
start; losses a layer adds with `add_loss` are not added to the pipelined
loss.
"""

import collections
import copy
import dataclasses
import math
import random
from typing import Callable, Optional, Tuple

from absl import logging
import keras
from keras.src.backend.common import global_state  # pylint: disable=g-direct-keras-import
import numpy as np
import tensorflow as tf

from tfdist import errors
from tfdist.errors import first_line
from tfdist.parallel import mode as mode_lib
from tfdist.parallel import mesh as mesh_lib
from tfdist.parallel import views
from tfdist.parallel.pipeline import copies as copies_lib
from tfdist.parallel.pipeline import stages as pipeline_lib
from tfdist.parallel.pipeline import options as pipeline_options
from tfdist.parallel.pipeline import tensor as pipeline_tensor
from tfdist.parallel.tensor import mode as tensor_mode
from tfdist.runtime import private_api
from tfdist.training.step import custom_step


@mode_lib.register_mode("pipeline")
@dataclasses.dataclass
class PipelineStep(mode_lib.StepMode):
  """The `pipeline` step mode: the model's pipeline and how a step runs
  through it (evaluation runs the whole model, `StepMode.eval_sums`).

  Attributes:
    pipeline: the `tfdist.parallel.pipeline.Pipeline` over the run's model.
    num_microbatches: M.
    schedule: `gpipe`, `1f1b` or `interleaved` (the pipeline's
      `virtual_stages` chunks per stage).
    micro_batch: examples per micro-batch (0: unknown).
    copies: with D > 1 copies (a data x pipeline mesh), the
      `tfdist.parallel.pipeline.copies.DataCopies` of copies 1 .. D-1;
      None: one copy.
    mesh: the data x pipeline x tensor mesh, with D > 1 copies or T > 1
      devices a stage; None: neither.
    unsharded: with T > 1, the model as built (Dense layers whole), the
      view checkpoints and exports see (`pipeline_tensor.joined_pairs`);
      None: the pipeline's model is the whole model.
  """
  pipeline: pipeline_lib.Pipeline
  num_microbatches: int
  schedule: str
  micro_batch: int = 0
  copies: Optional[copies_lib.DataCopies] = None
  mesh: Optional[mesh_lib.DeviceMesh] = None
  unsharded: Optional[keras.Model] = None
  replaces_step_runner = True  # `tfdist.backends.pipeline` drives stages.

  @classmethod
  def model_facts(cls, model, most: int = 8) -> dict:
    """`pipeline_shares`: P -> the heaviest of P stages' share of
    `model`'s weight bytes, for P = 2 .. `most` while the model can be cut
    so (device names only name the stages: nothing is placed)."""
    shares = {}
    for p in range(2, most + 1):
      try:
        stages = pipeline_lib.split_model(
            model, p, devices=[f"/device:CPU:{i}" for i in range(p)]).stages
      except (errors.PipelineConfigError, ValueError):
        break
      total = sum(s.param_bytes for s in stages)
      if total:
        shares[p] = max(s.param_bytes for s in stages) / total
    return {"pipeline_shares": shares}

  @classmethod
  def plan_lines(cls, facts) -> list:
    """The pipeline's line of the run plan (`PipelineOptions.describe` and
    each stage's micro-batch), and with D copies or T devices a stage the
    data x pipeline x tensor mesh (`DeviceMesh.plan_lines`: each device's
    coordinates)."""
    pipeline = facts.pipeline
    if pipeline is None:
      return []
    micro = facts.per_replica_batch_size // (
        pipeline.data * pipeline.num_microbatches)
    lines = [f"  pipeline               {pipeline.describe()} of {micro} "
             "examples"]
    if pipeline.data > 1 or pipeline.tensor > 1:
      lines += ["  " + line for line in pipeline.mesh().plan_lines()]
    return lines

  @classmethod
  def validate(cls, settings) -> None:
    """`tfdist.parallel.pipeline.options.check_flags` on `settings`
    (`num_gpus`, `num_cpu_devices`, `pipeline_virtual_stages` and
    `tensor_parallel` may be absent: their defaults)."""
    defaults = {"num_gpus": -1, "num_cpu_devices": 0,
                "pipeline_virtual_stages": 1, "tensor_parallel": 1}
    pipeline_options.check_flags(**{
        name: settings[name] if name in settings else defaults[name]
        for name in pipeline_options.CHECKED_SETTINGS})

  @classmethod
  def devices(cls, settings) -> int:
    """D x P x T: T devices per stage (1 without `tensor_parallel`), D
    copies (`data_degree` of `num_gpus` and `num_cpu_devices`, 1 when
    absent)."""
    stages = int(settings["pipeline_stages"])
    tensor = int(settings.get("tensor_parallel", 1))
    return stages * tensor * pipeline_options.data_degree(
        stages, num_gpus=settings.get("num_gpus", -1),
        num_cpu_devices=settings.get("num_cpu_devices", 0), tensor=tensor)

  @classmethod
  def layout_rows(cls, facts) -> list:
    """The pipeline: P stages (the fewest, 2 <= P <= N, that fit; else
    N), no data parallelism: each stage about S/P (or the heaviest of the
    model's real cut, `facts.pipeline_shares`), and the activations of the
    micro-batches it has in flight for the whole batch B: GPipe all M of
    them, a*B/P; 1F1B at most P on the first stage, a*B*min(P, M)/(P*M)."""
    e, n = facts.estimate, facts.num_devices

    def stage_row(p):
      m = facts.num_microbatches or p
      act = facts.stage_activations(p, facts.global_batch_size)
      share = facts.pipeline_shares.get(p, 1 / p)
      # One copy of the pipeline: the planner does not propose D x P
      # (--num_gpus / --num_cpu_devices = D x P) yet.
      return facts.row("pipeline",
                       "--distribution_strategy=one_device "
                       f"--pipeline_stages={p} --num_microbatches={m}", p,
                       math.ceil(e.parameters_bytes * share),
                       math.ceil((e.gradients_bytes + facts.accumulators) *
                                 share),
                       math.ceil(e.optimizer_bytes * share), act, n > 1,
                       facts.one_device_note)

    stages = [stage_row(p) for p in range(2, n + 1)]
    return [next((r for r in stages if r.fits), None) or
            (stages[-1] if stages else stage_row(1))]

  def stages(self) -> list:
    """`Pipeline.describe` at this step's shape: per stage its device,
    layers, weight bytes and activation estimate (bytes, micro-batches in
    flight)."""
    return self.pipeline.describe(self.micro_batch, self.num_microbatches,
                                  self.schedule)

  def describe(self) -> str:
    """One line per stage (per chunk under the interleaved schedule): its
    device, layers, weight bytes and the activations its device holds at
    its peak (a lower bound); with D copies, the
    mesh (`DeviceMesh.plan_lines`) and what each copy's device holds."""
    lines = []
    if self.mesh is not None:
      lines = ["  " + line for line in self.mesh.plan_lines()]
    if self.copies is not None:
      lines.append(
          f"  copy 0 (the stages below) holds the weights, gradients and "
          f"optimizer state; copies 1..{self.copies.data - 1} hold their "
          "stage's weights (refreshed from copy 0 each step) and "
          "gradients, no optimizer state; " + _reduction_line(self.copies))
    chunks = self.pipeline.virtual_stages > 1
    stages = self.stages()

    def held(s):
      return (f"activations at least {s['activation_bytes']} bytes "
              f"({s['microbatches_in_flight']} "
              f"{'chunk ' if chunks else ''}micro-batch(es) of "
              f"{self.micro_batch} in flight)")

    lines += [
        f"  {'chunk' if chunks else 'stage'} {s['index']} on {s['device']}: "
        f"{len(s['layers'])} layer(s) {s['layers'][0]} .. "
        f"{s['layers'][-1]}, {s['param_bytes']} weight bytes" +
        (f", {held(s)}" if "activation_bytes" in s and not chunks else "")
        for s in stages]
    if chunks and stages and "activation_bytes" in stages[0]:
      # Under the interleaved schedule a device's activations are those
      # of all its chunks at its peak: one line per device, not per chunk.
      p = self.pipeline.num_stages
      lines += [
          f"  stage {s['index']} on {s['device']} (chunks "
          f"{', '.join(str(c['index']) for c in stages[s['index']::p])}): "
          f"{held(s)}" for s in stages[:p]]
    return "\n".join(lines)

  # --- the joined view (T > 1) ---------------------------------------------
  def exported_model(self, context):
    """The whole model: with T > 1, `unsharded` holding the trained
    weights (each split layer's shards joined)."""
    if self.unsharded is None:
      return context.model
    self.unsharded.set_weights(pipeline_tensor.full_weights(context.model))
    return self.unsharded

  def checkpoint_model(self, context):
    """With T > 1, `unsharded`, each of its variables saving the joined
    value of the split model's (`pipeline_tensor.joined_pairs`) and
    restoring into them: the checkpoint's `model` under a one-device
    run's keys and shapes. Else the trainer's model."""
    if self.unsharded is None:
      return context.model
    for whole, parts, axis in pipeline_tensor.joined_pairs(context.model,
                                                          self.unsharded):
      _join_through(whole, parts, axis)
    return self.unsharded

  def checkpoint_optimizer(self, context):
    """With T > 1, an optimizer of the trainer's class and configuration
    built on `unsharded`, each of its variables saving the joined value of
    the trainer's (a split weight's slot: its shards' slots joined,
    `pipeline_tensor.optimizer_pairs`) and restoring into them. Else the
    trainer's.

    Raises:
      ValueError: the two optimizers' variables do not pair up.
    """
    if self.unsharded is None:
      return super().checkpoint_optimizer(context)
    optimizer = context.optimizer
    view = views.optimizer_view(optimizer, self.unsharded)
    pairs = pipeline_tensor.joined_pairs(context.model, self.unsharded)
    for whole, parts, axis in pipeline_tensor.optimizer_pairs(
        optimizer, view, pairs):
      _join_through(whole, parts, axis)
    return view

  def forward_backward(self, trainer, inputs, labels, weights=None):
    """`StepContext.model_forward_backward` through the pipeline.

    Args:
      trainer: the `tfdist.parallel.mode.StepContext` (the trainer).
      inputs: the step's (micro-step's) inputs, [B, ...] (a tensor, or a
        list in the order of `model.inputs`).
      labels: [B, ...].
      weights: the examples' training weights, float32 [B], or None.

    Returns:
      `(loss, grads, outputs)` as the unsplit pass: the reported loss
      (float32 scalar), the gradients of `model.trainable_variables` (loss
      scaled under fp16's loss scale), the outputs as float32 [B, ...].
    """
    def loss_fn(y, prediction, w=None):
      objective, _ = trainer.losses(y, tf.cast(prediction, tf.float32), w)
      return trainer.scale_loss(objective)

    _, grads, outputs = self.pipeline.forward_backward(
        inputs, labels, loss_fn=loss_fn,
        num_microbatches=self.num_microbatches, schedule=self.schedule,
        sample_weight=weights, mean_loss=False, copies=self.copies)
    outputs = tf.cast(outputs, tf.float32)
    _, loss = trainer.losses(labels, outputs, weights)
    regularized = [v for v in trainer.model.trainable_variables
                   if getattr(v, "regularizer", None) is not None]
    if regularized:
      with tf.GradientTape() as tape:
        regularization = tf.add_n([
            tf.cast(tf.reduce_sum(v.regularizer(v)), tf.float32)
            for v in regularized])
        # Once per update: each of the K micro-steps adds 1/K of it.
        regularization = tf.nn.scale_regularization_loss(
            regularization) / trainer.gradient_accumulation_steps
        scaled = trainer.scale_loss(regularization)
      extra = tape.gradient(scaled, regularized)
      by_id = {id(v): g for v, g in zip(regularized, extra)}
      grads = [g if id(v) not in by_id or by_id[id(v)] is None else
               (by_id[id(v)] if g is None else g + by_id[id(v)])
               for v, g in zip(trainer.model.trainable_variables, grads)]
      loss += regularization
    return loss, grads, outputs


def _join_through(whole, parts, axis) -> None:
  """Makes the Keras variable `whole` save the joined value of `parts`
  (split on `axis`; None: `parts[0]` whole) and restore into them."""
  tensor_mode._gather_through(  # pylint: disable=protected-access
      whole, lambda: pipeline_tensor.join(parts, axis),
      lambda value: pipeline_tensor.assign_joined(parts, axis, value))


def _reduction_line(copies: copies_lib.DataCopies) -> str:
  """How each stage's gradients meet across the copies: all-reduced with
  `tfdist.parallel.collectives` over its data group, or (a group on the
  driving process's own devices in a cluster) summed on copy 0's
  device."""
  collective = copies.collective_groups()
  if all(collective):
    return "each stage's gradients are all-reduced over its data group"
  def stages(flag):
    return ", ".join(str(p) for p, c in enumerate(collective) if c == flag)
  reduced = (f"stage {stages(True)}'s gradients are all-reduced over its "
             "data group (collectives); " if any(collective) else "")
  return (f"{reduced}stage {stages(False)}'s are summed on copy 0's device "
          "(a group on this client's own devices, where collectives cannot "
          "run)")


def _flag_error(options: pipeline_options.PipelineOptions,
                error: errors.PipelineConfigError) -> errors.ConfigError:
  cuts = (f" --pipeline_cuts={','.join(options.cuts)}" if options.cuts
          else "")
  virtual = (f" --pipeline_virtual_stages={options.virtual_stages}"
             if options.virtual_stages > 1 else "")
  return errors.PipelineConfigError(
      f"--pipeline_stages={options.num_stages}{virtual}{cuts}: {error}")


def build_model(
    build: Callable[[], keras.Model],
    options: Optional[pipeline_options.PipelineOptions]
) -> Tuple[keras.Model, Optional[pipeline_lib.DeferredVariables]]:
  """Calls `build` so that, with stages, the model's variables get no
  storage until `build` (below) creates each on its stage's device
  (`tfdist.parallel.pipeline.deferred_variables`).

  A builder that runs TensorFlow ops on the weights before the cut (calls
  the model on data to build it, reads a weight) fails there, since a
  weight without storage reads as an empty tensor: it is then called
  again without deferral, its random state and Keras's layer names
  restored first (the same weights and names as one call), and the
  stages' variables are moved to their devices as for a model built
  before (the whole model must then fit one device once; a warning says
  so and why).

  With T > 1 devices a stage (`options.tensor`) the model is built whole,
  without deferral: `build` (below) clones it with its split layers
  (`pipeline_tensor.split_model`) and keeps it as the checkpoint's and
  export's view.

  Args:
    build: makes the run's model (the task's builder).
    options: the run's `PipelineOptions`, or None.

  Returns:
    `(model, deferred)`: `deferred` to give `build` (None without stages,
    with T > 1, or when the builder needed its weights).
  """
  if options is None or not options.enabled or options.tensor > 1:
    return build(), None
  state = _random_and_name_state()
  try:
    with pipeline_lib.deferred_variables() as deferred:
      return build(), deferred
  except tf.errors.OpError as e:
    logging.warning(
        "--pipeline_stages=%d: the model's builder runs TensorFlow ops on "
        "its weights before the model is cut (%s: %s), so they cannot be "
        "created on their stages' devices from the start: it is built "
        "again, whole, where Keras puts it, and each stage's weights are "
        "moved to their device afterwards (the whole model must fit there "
        "once). Build the model without calling it on data (give it a "
        "keras.Input) to avoid this.", options.num_stages,
        type(e).__name__, first_line(e)[:200])
    _restore(state)
    return build(), None


def _random_and_name_state():
  """What a second call of a builder must start from to make the same
  model: Python's and NumPy's random state (Keras draws its initializers'
  seeds from Python's) and Keras's counters of automatic names."""
  uids = global_state.get_global_attribute("object_name_uids")
  return (random.getstate(), np.random.get_state(),
          copy.copy(uids) if uids is not None else None)


def _restore(state) -> None:
  python_state, numpy_state, uids = state
  random.setstate(python_state)
  np.random.set_state(numpy_state)
  global_state.set_global_attribute(
      "object_name_uids",
      uids if uids is not None else collections.defaultdict(int))


def build(model: keras.Model, options: pipeline_options.PipelineOptions, *,
          micro_step_batch: int, gradient_accumulation_steps: int = 1,
          deferred: Optional[pipeline_lib.DeferredVariables] = None,
          layout_map=None) -> Optional[PipelineStep]:
  """Cuts `model` into the run's stages and places their variables; with
  T > 1 devices a stage (`options.tensor`), first splits the Dense layers
  `layout_map` names over them (`pipeline_tensor.split_model`): the
  step's `pipeline.model` is then that clone, the one to train.

  Call it right after the model is built, outside any strategy scope,
  before the optimizer is built (its slots then follow the variables to
  their stage's device) and before any step is traced.

  Args:
    model: the run's built Keras model (functional or Sequential).
    options: the run's `PipelineOptions`.
    micro_step_batch: examples of one step (one micro-step under gradient
      accumulation).
    gradient_accumulation_steps: K (named in errors).
    deferred: what `build_model` returned with the model
      (its variables are created on their stages' devices here; if the
      model cannot be cut, where they were made), or None.
    layout_map: with `options.tensor` > 1, the Keras `LayoutMap` that
      splits the model (`tfdist.fit(layout_map=...)`).

  Returns:
    The `PipelineStep`, or None when `options` has one stage.

  Raises:
    ConfigError (a `PipelineConfigError`, status 2): the model cannot be
      cut (subclassed, a layer shared across stages, unknown cuts, fewer
      layers or devices than stages), a model with its own `train_step`
      (`tfdist.training.step.custom_step`), an activity regularizer, or
      micro-batches that do not divide the batch; each names the flag. A
      ConfigError: T > 1 without a layout map, or one
      `pipeline_tensor.split_model` refuses (naming the map entry).
  """
  if not options.enabled:
    return None
  try:
    return _build(model, options, micro_step_batch=micro_step_batch,
                  gradient_accumulation_steps=gradient_accumulation_steps,
                  deferred=deferred, layout_map=layout_map)
  finally:
    if deferred is not None:
      deferred.initialize_rest()  # All of them when the cut was refused.


def _held_microbatches(options: pipeline_options.PipelineOptions) -> int:
  """The micro-batches a stage (a chunk) holds at once, to balance the
  cut on: M under GPipe, at most P under 1F1B, under the interleaved
  schedule the first stage's peak spread over its V chunks."""
  m, p = options.num_microbatches, options.num_stages
  if options.schedule == pipeline_options.GPIPE:
    return m
  if options.schedule == pipeline_options.ONE_F_ONE_B:
    return min(p, m)
  v = options.virtual_stages
  return -(-min(2 * (p - 1) + (v - 1) * p + 1, v * m) // v)


def _build(model, options, *, micro_step_batch, gradient_accumulation_steps,
           deferred, layout_map):
  micro = pipeline_options.check_batch(
      options, micro_step_batch=micro_step_batch,
      gradient_accumulation_steps=gradient_accumulation_steps)
  own_step = custom_step.overrides(model)
  if own_step:
    raise errors.PipelineConfigError(
        f"--pipeline_stages={options.num_stages}: model {model.name!r} "
        f"defines its own step ({', '.join(own_step)}), which runs the "
        "whole model, not tfdist's pipelined step. Drop --pipeline_stages, "
        "or the override (tfdist's step then trains it through the "
        "stages).")
  for layer in private_api.flatten_layers(model, include_self=False):
    if getattr(layer, "activity_regularizer", None) is not None:
      raise errors.PipelineConfigError(
          f"--pipeline_stages={options.num_stages}: layer {layer.name!r} "
          "has an activity regularizer, which the pipelined step does not "
          "add to the loss yet. Remove it (weight regularizers are "
          "supported), or drop --pipeline_stages.")
  unsharded = None
  if options.tensor > 1:
    if layout_map is None:
      raise errors.ConfigError(
          f"--pipeline_stages={options.num_stages} --tensor_parallel="
          f"{options.tensor} splits the Dense layers a Keras LayoutMap names "
          "inside each stage; this run has none. Pass tfdist.fit(..., "
          "layout_map=keras.distribution.LayoutMap(...)), or drop "
          "--tensor_parallel.")
    unsharded, model = model, pipeline_tensor.split_model(
        model, layout_map, options.tensor)
  mesh = options.mesh() if options.data > 1 or options.tensor > 1 else None
  try:
    pipe = pipeline_lib.split_model(
        model, options.num_stages, cuts=list(options.cuts) or None,
        devices=(copies_lib.copy0_devices(mesh) if mesh else
                 list(options.devices) or None),
        activation_examples=micro * _held_microbatches(options),
        virtual_stages=options.virtual_stages)
    pipe.check_step(micro_step_batch // options.data,
                    options.num_microbatches, options.schedule)
    placed = pipe.place_variables(
        deferred, tensor_devices=(pipeline_tensor.tensor_devices(mesh)
                                  if options.tensor > 1 else None))
    copies = (copies_lib.DataCopies(pipe, mesh) if options.data > 1
              else None)
  except errors.PipelineConfigError as e:
    raise _flag_error(options, e) from None
  if copies is not None:
    placed.update(copies.bytes_per_device())
  step = PipelineStep(pipe, options.num_microbatches, options.schedule,
                      micro_batch=micro, copies=copies, mesh=mesh,
                      unsharded=unsharded)
  logging.info("Pipeline: %s; weight bytes per device %s\n%s",
               options.describe(), placed, step.describe())
  return step
