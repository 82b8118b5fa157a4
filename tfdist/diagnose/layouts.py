"""Layouts: the model's state per device under each layout, whether the
run's layout is needed at this size, and what it costs.
"""

import dataclasses
from typing import Dict, List, Optional

from tfdist import errors
from tfdist.diagnose.plan import MeasurementPlan
from tfdist.diagnose.tensor_split import TensorSplit
from tfdist.diagnose.tensor_split import tensor_split_of
from tfdist.parallel.tensor import options as tensor_parallel_options
from tfdist.training.plan import memory
from tfdist.core import optimizers


@dataclasses.dataclass(frozen=True)
class ModelSizes:
  """What the layout table needs of a model, read from one build.

  Attributes:
    estimate: its unsharded `memory.ModelMemory` (one replica).
    activation_bytes_per_example: its layers' outputs for one example, in
      their compute dtype (`memory.activation_bytes_per_example`).
    tensor_parallel_bytes: bytes of the weights tensor-parallel layers
      would split (0: none can be split).
    pipeline_shares: P -> the heaviest of P pipeline stages' share of the
      weight bytes, from the model's cut (`pipeline.split_model`, balanced
      by weight bytes); P absent: the model cannot be cut into P.
    tensor_split: what a layout map derived for the model could split
      (`tensor_split.tensor_split_of`), or None.
    expert_bytes: bytes of its mixture-of-experts layers' experts (0:
      none).
    num_experts: E of those layers (the fewest; 0: none).
    layout_map_degree: the `model` axis T of the layout map `--layout_map`
      names (`tensor_split` is then that map's split); 0: none.
  """
  estimate: memory.ModelMemory
  activation_bytes_per_example: int = 0
  tensor_parallel_bytes: int = 0
  pipeline_shares: Optional[Dict[int, float]] = None
  tensor_split: Optional[TensorSplit] = None
  expert_bytes: int = 0
  num_experts: int = 0
  layout_map_degree: int = 0


def model_memory_of(config) -> memory.ModelMemory:
  """Builds `config`'s model and optimizer on this host (no data, no
  strategy) and returns their `ModelMemory`.

  Raises:
    ConfigError: an unknown model or data set
      (`tfdist.training.task.from_names`).
  """
  return model_sizes_of(config).estimate


def model_sizes_of(config, *, tensor_degree: int = 2) -> ModelSizes:
  """`model_memory_of`, with the model's activations per example and the
  bytes tensor parallelism would split over `tensor_degree` devices
  (`ModelSizes`): what `--tensor_parallel` splits for the built-in
  Transformer, else what a layout map derived for the model could split
  (`tensor_split.tensor_split_of`: Megatron column/row, heads and
  vocabulary splits of its Dense, EinsumDense, MultiHeadAttention and
  Embedding layers), or, with `--layout_map`, what that map splits over
  its own `model` axis.

  Raises:
    ConfigError: an unknown model or data set, `--layout_map`'s refusals
      (`tfdist.training.task.from_names`), a map the model refuses
      (`tfdist.parallel.layout_map.read_layout_map`).
  """
  # Imported here: they load TensorFlow and Keras, which this binary
  # imports quietly first (`tfdist.job_spec.parse_train_flags`, through
  # `tfdist.runtime.quiet_tensorflow`), and the parent process needs them only
  # now.
  import keras  # pylint: disable=g-import-not-at-top
  from tfdist import config as config_lib  # pylint: disable=g-import-not-at-top
  from tfdist.training import assembly  # pylint: disable=g-import-not-at-top
  from tfdist.training.plan import lr_schedule  # pylint: disable=g-import-not-at-top
  from tfdist.training.step import precision  # pylint: disable=g-import-not-at-top
  from tfdist.training import task as task_lib  # pylint: disable=g-import-not-at-top
  from tfdist.parallel import layout_map as layout_map_lib  # pylint: disable=g-import-not-at-top
  dtype = config.precision.dtype
  dtype = dtype if dtype != "auto" else "fp32"
  precision.configure_precision(dtype)
  try:
    # The sections the assembly reads, as a run's assembly hands them over
    # (tfdist.experiment.prepare.assembly_options), at this dtype.
    options = assembly.AssemblyOptions(
        optimization=config.optimization, precision=config.precision,
        loop=config.loop, memory=config.memory, task=config.task,
        strategy=config.strategy, dtype=dtype,
        loss_scale=config.precision.loss_scale,
        steps_per_execution=config.loop.steps_per_execution,
        builder_config=config_lib.ModelBuilderConfig(config))
    task = task_lib.from_names(config.task)
    model = assembly.build_model(options, task=task)
    # A schedule, as in every run (tfdist.training.plan.lr_schedule): the
    # optimizer then keeps no learning-rate variable of its own.
    optimizer = assembly.run_optimizer(options,
                                       lr_schedule.ConstantLearningRate(0.1))
    optimizer.build(model.trainable_variables)
    facts = memory.model_facts(model)
    degree = (0 if task.layout_map is None else
              layout_map_lib.model_degree(task.layout_map))
    split = (tensor_split_of(model, degree, layout_map=task.layout_map)
             if degree > 1 else
             tensor_split_of(model, max(int(tensor_degree), 2)))
    return ModelSizes(
        memory.estimate_model_memory(
            model, optimizer,
            replicated_variables=facts["replicated_variables"]),
        memory.activation_bytes_per_example(model),
        facts["tensor_parallel_bytes"] or split.trained_bytes,
        facts["pipeline_shares"], split, facts.get("expert_bytes", 0),
        facts.get("num_experts", 0), degree)
  finally:
    keras.mixed_precision.set_dtype_policy("float32")


# What ZeRO costs in traffic, per step, against data parallelism's
# all-reduce of the gradients (2 x the parameters' bytes, ring): stages 1-2
# a reduce-scatter and an all-gather, about the same bytes; stage 3 1.5x
# (the weights gathered in the forward and again in the backward pass).
# Rajbhandari et al. 2020, section 7.
ZERO_TRAFFIC = (
    "ZeRO stages 1-2 move about the same bytes per step as data "
    "parallelism's all-reduce where the collectives offer a reduce-scatter, "
    "stage 3 1.5x (Rajbhandari et al. 2020); TensorFlow offers tfdist no "
    "reduce-scatter, so it all-reduces the gradients and then all-gathers "
    "the updated weights: about 1.5x the bytes of plain data parallelism, "
    "and a flat copy of the gradients and weights every step")


# Stage 3 (`tfdist.parallel.zero3`): each block's weights gathered for its
# forward pass and again for its backward pass (which recomputes the
# block), their gradient all-reduced and sliced.
ZERO3_TRAFFIC = (
    "stage 3 gathers each block's weights for its forward pass and again "
    "for its backward pass, which recomputes the block, and all-reduces "
    "their gradients: about 2x the bytes of plain data parallelism "
    "(Rajbhandari et al. 2020 count 1.5x with a reduce-scatter, which "
    "TensorFlow does not offer) and about one more forward pass per step "
    "(--zero3_blocks=1: the whole model gathered once, no recomputation)")


def layout_notes(estimate: memory.ModelMemory, *, optimizer: str,
                 zero_stage: int, num_replicas: int, capacity_bytes: int,
                 replicas_sharing: int = 1, where: str = "device",
                 pipeline_stages: int = 1, num_microbatches: int = 1
                 ) -> List[str]:
  """Whether the run's layout is needed at this model's size, and what it
  costs, as sentences for the verdict's notes (empty for plain data
  parallelism, which `tfdist.training.plan.memory.fits_data_parallel` judges).

  Args:
    estimate: the model's unsharded `memory.ModelMemory` per replica.
    optimizer: `--optimizer`'s name (its slots per parameter from
      `tfdist.core.optimizers`).
    zero_stage: the ZeRO stage in force (0: none).
    num_replicas: replicas the state is sharded over.
    capacity_bytes: the memory those replicas use (one GPU's, or the
      host's), bytes.
    replicas_sharing: replicas whose copies share `capacity_bytes`.
    where: the memory's name (`GPU`, `host`).
    pipeline_stages: the run's pipeline stages P (1: none), each on a
      device of its own.
    num_microbatches: its micro-batches M per step.

  Returns:
    Sentences (empty without a layout beyond data parallelism).
  """
  if pipeline_stages > 1:
    return [_pipeline_note(estimate, stages=pipeline_stages,
                           microbatches=num_microbatches,
                           capacity_bytes=capacity_bytes, where=where)]
  if not zero_stage:
    return []
  fmt = memory.format_bytes
  sharing = max(int(replicas_sharing), 1)
  flag = f"--zero_stage={zero_stage} ({memory.ZERO_STAGE_SWITCHES[zero_stage]})"
  if num_replicas <= 1:
    return [f"{flag} has one replica to shard over: it saves nothing; drop "
            "it, or add replicas."]
  slots = optimizers.optimizer_spec(optimizer).traits.slots_per_parameter
  plain = estimate.total_bytes * sharing
  share = plain / capacity_bytes if capacity_bytes else float("inf")
  sharded = memory.sharded_estimate(estimate, num_replicas=num_replicas,
                                    stage=zero_stage)
  state = (
      f"plain data parallelism holds {fmt(estimate.total_bytes)} per replica"
      f" (parameters {fmt(estimate.parameters_bytes)}, gradients "
      f"{fmt(estimate.gradients_bytes)}, {optimizer}'s state "
      f"{fmt(estimate.optimizer_bytes)}: {slots:g} slot(s) per parameter)" +
      (f", {sharing} replicas {fmt(plain)}" if sharing > 1 else "") +
      f": {share:.2%} of the {fmt(capacity_bytes)} of {where} memory")
  saving = (f"sharded over {num_replicas} replicas, the optimizer state is "
            f"{fmt(sharded.optimizer_bytes)} per replica instead of "
            f"{fmt(estimate.optimizer_bytes)}")
  traffic = ZERO_TRAFFIC
  if zero_stage >= 3:
    saving = (f"sharded over {num_replicas} replicas, the weights, gradients"
              f" and optimizer state are {fmt(sharded.total_bytes)} per "
              f"replica instead of {fmt(estimate.total_bytes)} (plus one "
              "block's gathered weights during a step)")
    traffic = ZERO3_TRAFFIC
  if plain <= memory.TIGHT_SHARE * capacity_bytes:
    return [f"ZeRO stage {zero_stage} is not needed at this size: {state}, "
            f"which fits unsharded; {saving}. What it costs: {traffic}."
            f" Drop {flag} unless the model grows."]
  fits = plain <= capacity_bytes
  return [f"ZeRO stage {zero_stage} is " +
          ("worth it" if fits else "needed") + f" at this size: {state}" +
          (" (above half: activations need the rest)" if fits else
           ", which does not fit unsharded") +
          f"; {saving}. What it costs: {traffic}."]


def _pipeline_note(estimate: memory.ModelMemory, *, stages: int,
                   microbatches: int, capacity_bytes: int, where: str) -> str:
  """Whether P pipeline stages are needed at this size, and their cost: a
  stage holds about 1/P of the weights, gradients and optimizer state (the
  cuts balance weight bytes), and each step idles (P-1)/(M+P-1) of its time
  (Huang et al. 2019)."""
  fmt = memory.format_bytes
  whole = estimate.total_bytes
  share = whole / capacity_bytes if capacity_bytes else float("inf")
  idle = stages - 1
  cost = (f"each step then idles: a bubble of {idle}/{microbatches + idle} = "
          f"{idle / (microbatches + idle):.0%} of each step (Huang et al. "
          "2019; more micro-batches shrink it), and batch normalization sees "
          "micro-batches")
  state = (f"the whole model's state is {fmt(whole)} ({share:.2%} of the "
           f"{fmt(capacity_bytes)} of {where} memory); {stages} stages keep "
           f"about {fmt(whole / stages)} per stage")
  if whole <= memory.TIGHT_SHARE * capacity_bytes:
    return (f"{stages} pipeline stages are not needed at this size: {state}"
            f", but it fits one device whole; {cost}. Drop "
            f"--pipeline_stages={stages} unless the model grows.")
  fits = whole <= capacity_bytes
  return (f"{stages} pipeline stages are " +
          ("worth it" if fits else "needed") + f" at this size: {state}" +
          (" (above half on one device: activations need the rest)" if fits
           else "; whole, it does not fit one device") + f"; {cost}.")


def device_memory_capacity() -> Optional[int]:
  """One GPU's memory (the smallest), or None without GPUs."""
  sizes = memory.gpu_memory_capacity_bytes()
  return min(sizes) if sizes else None


def run_layout_notes(estimate: memory.ModelMemory, fitted: "FittedModel",
                     facts: "TrainFacts") -> List[str]:
  """`layout_notes` for the run's replicas and the memory they share."""
  return layout_notes(
      estimate, optimizer=facts.optimizer, zero_stage=facts.zero_stage,
      num_replicas=fitted.num_replicas,
      capacity_bytes=fitted.fit.capacity_bytes,
      replicas_sharing=fitted.sharing, where=fitted.where,
      pipeline_stages=facts.pipeline_stages,
      num_microbatches=facts.num_microbatches)


def layout_choice(sizes: ModelSizes, fitted: "FittedModel",
                  facts: "TrainFacts", plan: MeasurementPlan
                  ) -> memory.LayoutChoice:
  """Every layout's bytes per device for the run's model, batch, dtype and
  devices, and the cheapest that fits (`memory.layout_table`).

  The devices are the requested run's replicas in sync (its pipeline
  stages, when it has more); the memory is one GPU's, or the host's that
  CPU devices share; the global batch is the requested run's per-replica
  batch times its replicas (per micro-step under gradient accumulation).
  """
  replicas = plan.num_replicas or 1
  devices = max(replicas, facts.pipeline_stages)
  global_batch = ((plan.per_replica_batch_size or 0) * replicas or
                  facts.global_batch_size or 1)
  return memory.layout_table(
      sizes.estimate, num_devices=devices,
      capacity_bytes=fitted.fit.capacity_bytes,
      shared_memory=fitted.where == "host", global_batch_size=global_batch,
      activation_bytes_per_example=sizes.activation_bytes_per_example,
      optimizer=facts.optimizer,
      gradient_accumulation=facts.gradient_accumulation_steps > 1,
      num_microbatches=(facts.num_microbatches
                        if facts.pipeline_stages > 1 else 0),
      pipeline_schedule=facts.pipeline_schedule,
      tensor_parallel_bytes=sizes.tensor_parallel_bytes,
      tensor_parallel_flag=tensor_parallel_options.flags_for(facts.model,
                                                             devices),
      refused=_refused_layouts(),
      pipeline_shares=sizes.pipeline_shares,
      expert_bytes=sizes.expert_bytes, num_experts=sizes.num_experts,
      layout_map=facts.layout_map, layout_map_degree=sizes.layout_map_degree)


def _refused_layouts() -> dict:
  """Layouts this tfdist's configuration refuses whatever the run, with
  the first sentence of the refusal: ZeRO stage 3 where it is not offered
  (a config of Mirrored replicas with `--zero_stage=3`, checked)."""
  from tfdist import config as config_lib  # pylint: disable=g-import-not-at-top
  try:
    config_lib.TrainConfig(model_dir="/tmp/tfdist-diagnose", zero_stage=3,
                           distribution_strategy="mirrored")
  except errors.ConfigError as e:
    return {"ZeRO 3": str(e).split(":")[0]}
  return {}


@dataclasses.dataclass(frozen=True)
class TrainFacts:
  """What the diagnosis reads of the requested run's configuration.

  Attributes:
    optimizer: `--optimizer`'s name.
    zero_stage: the ZeRO stage in force (0: optimizer state not sharded).
    train_steps: `--train_steps` of each run.
    log_steps: `--log_steps` (the measurement interval, steps).
    pipeline_stages: `--pipeline_stages` (1: none).
    num_microbatches: the micro-batches per step of a pipelined run.
    pipeline_schedule: `--pipeline_schedule`.
    global_batch_size: `--batch_size` (0: the plan's).
    gradient_accumulation_steps: `--gradient_accumulation_steps`.
    model: `--model` (whether `--tensor_parallel` can split it).
    layout_map: `--layout_map` (the function returning the layout map
      that splits the model; "": none).
  """
  optimizer: str
  zero_stage: int
  train_steps: int
  log_steps: int
  pipeline_stages: int = 1
  num_microbatches: int = 1
  pipeline_schedule: str = "gpipe"
  global_batch_size: int = 0
  gradient_accumulation_steps: int = 1
  model: str = ""
  layout_map: str = ""


def train_facts(config) -> TrainFacts:
  """The `TrainFacts` of a parsed `tfdist.config.TrainConfig` (read from
  its optimization, memory, loop, parallelism and task sections)."""
  loop, parallelism = config.loop, config.strategy.parallelism
  stages = int(parallelism.pipeline_stages or 1)
  return TrainFacts(optimizer=config.optimization.optimizer,
                    zero_stage=config.memory.zero_stage_resolved,
                    train_steps=loop.train_steps,
                    log_steps=loop.log_steps, pipeline_stages=stages,
                    num_microbatches=int(parallelism.num_microbatches
                                         or stages),
                    pipeline_schedule=(parallelism.pipeline_schedule
                                       or "gpipe"),
                    global_batch_size=int(loop.batch_size or 0),
                    gradient_accumulation_steps=int(
                        loop.gradient_accumulation_steps or 1),
                    model=str(config.task.model or ""),
                    layout_map=str(config.task.layout_map or ""))


@dataclasses.dataclass(frozen=True)
class FittedModel:
  """The model state per replica and whether it fits where it runs.

  Attributes:
    estimate: the `memory.ModelMemory` per replica (ZeRO-sharded).
    fit: `memory.fits_data_parallel`'s `Fit`.
    num_replicas: replicas in sync.
    sharing: replicas whose copies share one memory.
    where: `GPU` or `host`: the memory they share.
  """
  estimate: memory.ModelMemory
  fit: memory.Fit
  num_replicas: int
  sharing: int
  where: str


def fit_model(estimate: memory.ModelMemory, facts: "TrainFacts", *,
              on_gpu: bool, num_replicas: int, gpu_bytes: Optional[int],
              host_bytes: Optional[int]) -> FittedModel:
  """Whether the run's replicas' model state fits their memory (bytes:
  one GPU's, or the host's)."""
  # Replicas whose copies share one memory: a GPU holds one; CPU
  # replicas (logical devices, or the workers of a local cluster) each
  # hold a copy in this host's memory.
  on_gpu = bool(on_gpu and gpu_bytes)
  sharing = 1 if on_gpu else num_replicas
  fit = memory.fits_data_parallel(
      estimate, capacity_bytes=gpu_bytes if on_gpu else host_bytes,
      replicas_sharing=sharing, optimizer=facts.optimizer,
      num_replicas=num_replicas, zero_stage=facts.zero_stage)
  estimate = memory.sharded_estimate(
      estimate, num_replicas=num_replicas, stage=facts.zero_stage)
  return FittedModel(estimate, fit, num_replicas, sharing,
                     "GPU" if on_gpu else "host")


# What a layout map can split and tfdist's trainer does not (yet).
_NOT_TRAINED = "an Embedding by vocabulary, an EinsumDense"


def tensor_split_note(sizes: ModelSizes, facts: "TrainFacts") -> str:
  """One line: what a layout map derived for the model could split over
  `sizes.tensor_split.degree` devices (its layers, bytes, and the state
  per device it saves: the splits tfdist's trainer trains, `Dense` and
  `MultiHeadAttention`), and how tfdist trains it: `--tensor_parallel` for
  the built-in Transformer, `--layout_map` or `tfdist.fit(...,
  layout_map=...)` for a model of one's own (with `--layout_map` given,
  what its map splits). "" without a `tensor_split`."""
  split = sizes.tensor_split
  if split is None:
    return ""
  t, fmt = split.degree, memory.format_bytes
  head = (f"Tensor parallelism over {t} devices (a layout map derived for "
          "this model, read by tfdist.parallel.layout_map): ")
  flags = tensor_parallel_options.flags_for(facts.model, t)
  if facts.layout_map:
    head = (f"Tensor parallelism over {t} devices (the layout map of "
            f"--layout_map={facts.layout_map}, read by "
            "tfdist.parallel.layout_map): ")
    flags = f"--layout_map={facts.layout_map}"
  trainer = (f"This model trains so with {flags}." if flags else
             "A model of your own trains so through tfdist.fit(model_fn, "
             "..., layout_map=keras.distribution.LayoutMap(...)) or "
             "--layout_map=package.module:function returning one "
             "(docs/guides/tensor-parallelism.md).")
  if not split.split_bytes:
    return (head + "no Dense or EinsumDense pair, attention layer or "
            f"embedding of this model splits over {t} without a gather (or "
            f"{t} divides none of their sizes). " + trainer)
  e = sizes.estimate
  state = e.parameters_bytes + e.gradients_bytes + e.optimizer_bytes
  share = split.trained_bytes / max(split.weight_bytes, 1)
  saved = int(state * share * (t - 1) / t)
  trained = [name for name in split.layers if name in split.trained_layers]
  untrained = [name for name in split.layers
               if name not in split.trained_layers]
  covered = (", ".join(f"{name} ({split.layers[name]})" for name in trained)
             or "none of its layers")
  rest = (f" A layout map could also split {', '.join(untrained)} "
          f"({_NOT_TRAINED}), which tfdist's trainer does not split yet."
          if untrained else "")
  return (head + f"the splits tfdist trains cover {covered}: "
          f"{fmt(split.trained_bytes)} of its {fmt(split.weight_bytes)} of "
          f"weights ({share:.0%}), each device holding 1/{t} of them; "
          "weights, gradients and optimizer state per device "
          f"{fmt(state - saved)} instead of {fmt(state)} (saving "
          f"{fmt(saved)}).{rest} " + trainer)
