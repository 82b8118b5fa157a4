"""`--tensor_parallel=T`, checked at start (pure Python, no TensorFlow).

T > 1 splits the built-in Transformer's attention heads and feed-forward
units over T replicas of a `MirroredStrategy` on one host (Megatron's
layers, `tfdist.parallel.tensor_parallel`), or, given
`tfdist.fit(..., layout_map=...)`, a model of the user's as its Keras
`LayoutMap` says (`tfdist.parallel.tensor.from_layout_map`). The run has N replicas
(`replicas`: `--num_gpus` or `--num_cpu_devices` when given above 1,
else T), laid out as D = N / T data-parallel copies of T
(`tfdist.parallel.mesh.DeviceMesh.build(devices, tensor=T)`): each copy
trains on its 1/D of the global batch and the gradients are summed over
the copies; `--zero_stage=1` or 2 shards the optimizer state (and the
gradient accumulators) over each data group's D replicas
(`tfdist.parallel.tensor.zero`). `check_flags` refuses what that cannot run, naming the flag,
the value and the fix, before anything is built; `tfdist.config` calls it
while it validates a `TrainConfig`. The backend is
`tfdist.backends.tensor_parallel`, the trainer's step
`tfdist.parallel.tensor.mode`.

With `--pipeline_stages=P` and a layout map, each stage's Dense layers
split over T devices instead: N = D x P x T devices
(`tfdist.parallel.pipeline.tensor`, `tfdist.parallel.pipeline.options`).
"""

from typing import Optional, Union

from tfdist import errors
from tfdist.core import zero_stages

# The one model built from the tensor-parallel layers.
MODELS = ("transformer",)
# Strategies it runs under: one host's replicas are the data x tensor
# mesh (the sub-group collectives of `tfdist.parallel.collectives` run
# inside one process's `strategy.run`; across workers the trainer does not
# yet use them).
STRATEGIES = ("auto", "mirrored")
# What each rank gets a share of in the built-in Transformer
# (models/transformer.py's defaults): its 4 attention heads and 128
# feed-forward units, so N must divide both.
SPLIT_SIZES = {"attention heads": 4, "feed-forward units": 128}


def divides(n: int) -> bool:
  """Whether N ranks can split the built-in Transformer evenly."""
  return all(size % n == 0 for size in SPLIT_SIZES.values())


def flags_for(model: str, num_devices: int) -> str:
  """The flags that split `model` over `num_devices` replicas of one host,
  or "" when `--tensor_parallel` cannot (another model, one device)."""
  if model not in MODELS or num_devices < 2 or not divides(num_devices):
    return ""
  return f"--distribution_strategy=mirrored --tensor_parallel={num_devices}"


def replicas(tensor_parallel: int, *, num_gpus: int,
             num_cpu_devices: int) -> int:
  """N, the replicas of a `--tensor_parallel=T` run: `--num_gpus` when
  above 0, else `--num_cpu_devices` when above 1, else T (one tensor
  group, D = 1)."""
  if num_gpus > 0:
    return num_gpus
  return num_cpu_devices if num_cpu_devices > 1 else tensor_parallel


# The settings (flag names) `check_flags` reads, for the step mode's
# `validate` (`tfdist.parallel.mode.StepMode.validate`).
CHECKED_SETTINGS = (
    "tensor_parallel",
    "model",
    "distribution_strategy",
    "zero_stage",
    "pipeline_stages",
    "enable_xla",
    "dtype",
    "clipnorm",
    "global_clipnorm",
    "init_checkpoint",
    "num_gpus",
    "num_cpu_devices",
)


def _named(n: int, layout_map) -> str:
  """How the messages name T: with a layout map (tfdist.fit's keyword or
  --layout_map) its mesh set T, else --tensor_parallel did."""
  if isinstance(layout_map, str) and layout_map:
    return (f"--layout_map={layout_map} (its DeviceMesh's 'model' axis: "
            f"T = {n})")
  if layout_map:
    return f"layout_map (its DeviceMesh's 'model' axis: T = {n})"
  return f"--tensor_parallel={n}"


def _check_builtin_split(flag: str, n: int, *, model: str, model_given: bool,
                         pipeline_stages: int) -> None:
  """Without a layout map, T splits the built-in Transformer only, outside a
  pipeline, and must divide its heads and feed-forward units.

  Raises:
    errors.ConfigError: any of those broken, naming `flag` and the fix.
  """
  if pipeline_stages > 1:
    _refuse_pipeline(flag, pipeline_stages=pipeline_stages, model=model)
  if model not in MODELS:
    which = (f"--model={model} has no tensor-parallel layers" if model_given
             else f"no --model is given (the default, {model}, has no "
             "tensor-parallel layers)")
    raise errors.ConfigError(
        f"{flag} splits the built-in Transformer's attention heads and "
        f"feed-forward units; {which}. Use --model=transformer; for a "
        "model of your own, leave --tensor_parallel out and pass "
        "tfdist.fit(..., layout_map=keras.distribution.LayoutMap(...)) or "
        "--layout_map=package.module:function (a function returning one), "
        "whose mesh's model axis sets it (its Dense and MultiHeadAttention "
        "layers are split as the map says), or build the model from "
        "tfdist.parallel.tensor_parallel's layers and drop the flag.")
  if not divides(n):
    sizes = ", ".join(f"{size} {what}" for what, size in SPLIT_SIZES.items())
    fits = [k for k in range(2, 9) if divides(k)]
    raise errors.ConfigError(
        f"{flag} cannot split the built-in Transformer evenly: each rank "
        f"takes an equal share of its {sizes}. Use --tensor_parallel="
        f"{' or '.join(map(str, fits))}.")


def check_flags(*, tensor_parallel: int, model: str,
                distribution_strategy: str, zero_stage: int,
                pipeline_stages: int, enable_xla: bool, dtype: str,
                clipnorm: Optional[float], global_clipnorm: Optional[float],
                init_checkpoint: Optional[str], num_gpus: int,
                num_cpu_devices: int, layout_map: Union[bool, str] = False,
                model_given: bool = True) -> None:
  """Refuses `--tensor_parallel` settings that cannot run.

  Args:
    tensor_parallel: N (1: off).
    model, distribution_strategy, zero_stage, pipeline_stages, enable_xla,
      dtype, clipnorm, global_clipnorm, init_checkpoint, num_gpus,
      num_cpu_devices: the run's flags of those names.
    layout_map: a Keras `LayoutMap` splits the model: True
      (`tfdist.fit(layout_map=...)` gave one), or the import path
      `--layout_map` gave (the messages name it). Any model is split as it
      says (its sizes are checked against T when the model is built,
      `tfdist.parallel.tensor.from_layout_map`), so the model and the
      Transformer's sizes are not checked here.
    model_given: `--model` was given (False: `model` is the default; a
      `TrainConfig` made for `tfdist.fit`, whose own model takes its T
      from the layout map, is told so).

  Raises:
    errors.ConfigError: T < 1; without a layout map, T not dividing the
      Transformer's heads and feed-forward units, or another model than
      the built-in Transformer; without a layout map, pipeline stages;
      T > 1 without a pipeline and with another strategy than mirrored
      (or auto), ZeRO stage 3 (stages 1-2 run: hybrid sharding, with
      more replicas than T), XLA, fp16, gradient clipping,
      --init_checkpoint, or a device count (--num_gpus, --num_cpu_devices)
      that T (P x T with P pipeline stages) does not divide.
  """
  if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
    raise errors.ConfigError(f"--tensor_parallel={tensor_parallel} must be "
                             "a positive integer (1: off).")
  n = tensor_parallel
  if n == 1:
    return
  flag = _named(n, layout_map)
  if not layout_map:
    _check_builtin_split(flag, n, model=model, model_given=model_given,
                         pipeline_stages=pipeline_stages)
  if pipeline_stages <= 1 and distribution_strategy not in STRATEGIES:
    raise errors.ConfigError(
        f"{flag} runs under --distribution_strategy=mirrored on one host "
        f"(its replicas are a data x tensor mesh); received "
        f"--distribution_strategy={distribution_strategy}: the trainer "
        "does not yet run the mesh's sub-group collectives across workers. "
        "Use --distribution_strategy=mirrored (data parallelism beside it "
        "on this host: --num_gpus or --num_cpu_devices a multiple of "
        f"{n}), or drop --tensor_parallel.")
  _check_devices(flag, n, num_gpus=num_gpus, num_cpu_devices=num_cpu_devices,
                 copies=2 if zero_stage in (1, 2) else 1,
                 pipeline_stages=pipeline_stages)
  if zero_stage in (1, 2) and replicas(
      n, num_gpus=num_gpus, num_cpu_devices=num_cpu_devices) == n:
    name = "--num_gpus" if num_gpus > 0 else "--num_cpu_devices"
    raise errors.ConfigError(
        f"{flag} with {zero_stages.stage_flags(zero_stage)} on {n} "
        f"replicas: ZeRO shards within each data group, and {n} replicas "
        f"make one copy of the model (D = 1), so there is nothing to shard "
        f"over. Pass {name}={2 * n} (or another multiple of {n}) for D = 2 "
        "data-parallel copies, or drop the ZeRO flag.")
  _check_incompatible_settings(
      flag, zero_stage=zero_stage, enable_xla=enable_xla, dtype=dtype,
      clipnorm=clipnorm, global_clipnorm=global_clipnorm, init_checkpoint=init_checkpoint)


def _refuse_pipeline(flag: str, *, pipeline_stages: int, model: str) -> None:
  """Refuses T > 1 (`flag`) beside P = `pipeline_stages` > 1 stages
  without a layout map. With a map, each stage's Dense layers split over
  its T devices (`tfdist.parallel.pipeline.tensor`); without one, T splits
  the built-in Transformer's layers (attention by heads) as tf.distribute
  replicas, which a pipeline's stages (placed by one process) are not.

  Raises:
    errors.ConfigError: always, naming both flags, the model and the fix.
  """
  raise errors.ConfigError(
      f"{flag} with --pipeline_stages={pipeline_stages} needs a Keras "
      "LayoutMap: inside a pipeline's stages tfdist splits the Dense layers "
      f"a map names by columns or rows; without one (--model={model}) "
      "--tensor_parallel splits the built-in Transformer's attention by "
      "heads over tf.distribute replicas, which a pipeline's stages are "
      "not. Pass tfdist.fit(model_fn, ..., layout_map=keras.distribution."
      "LayoutMap(...)) or --layout_map=package.module:function (a "
      "function returning one), whose model axis is the tensor degree, or "
      "drop "
      "--pipeline_stages (the Transformer split over replicas) or "
      "--tensor_parallel (a pipeline of whole layers).")


def _check_devices(flag: str, n: int, *, num_gpus: int,
                   num_cpu_devices: int, copies: int = 1,
                   pipeline_stages: int = 1) -> None:
  """Refuses a device count the T tensor-parallel ranks (`flag`, T = `n`)
  do not divide: the replicas are D = devices / T copies of T (with P =
  `pipeline_stages` > 1, D = devices / (P x T) copies of the pipeline,
  each stage on T devices); the counts offered instead give at least
  `copies` copies (2 under ZeRO).

  Raises:
    errors.ConfigError: --num_gpus (or --num_cpu_devices) > 1 and not a
      multiple of T (of P x T with a pipeline).
  """
  group = n * max(1, pipeline_stages)
  devices = (replicas(n, num_gpus=num_gpus, num_cpu_devices=num_cpu_devices)
             if pipeline_stages <= 1 or num_gpus > 0 or num_cpu_devices > 1
             else group)
  if devices % group:
    name = "--num_gpus" if num_gpus > 0 else "--num_cpu_devices"
    lower, higher = devices - devices % group, devices - devices % group + group
    if lower < copies * group:
      lower, higher = 0, max(higher, copies * group)
    what = (f"copies of {n} tensor-parallel ranks each" if group == n else
            f"copies of a --pipeline_stages={pipeline_stages} pipeline whose "
            f"stages each split over {n} devices")
    unit = "replicas" if group == n else "devices"
    raise errors.ConfigError(
        f"{flag} with {name}={devices}: the {unit} are data-parallel "
        f"{what}, so their number must be a multiple of {group}. Pass "
        f"{name}=" + (f"{lower} or {higher}" if lower else f"{higher}")
        + (f", or a --tensor_parallel that divides {devices}." if group == n
           else f", or --pipeline_stages and --tensor_parallel whose product "
           f"divides {devices}."))


def _check_incompatible_settings(
    flag: str, *, zero_stage: int, enable_xla: bool,
    dtype: str, clipnorm: Optional[float], global_clipnorm: Optional[float],
    init_checkpoint: Optional[str]) -> None:
  """Refuses the settings that cannot run beside N > 1 (`flag`). ZeRO
  stages 1 and 2 run (hybrid sharding over each data group,
  `tfdist.parallel.tensor.zero`); stage 3 does not. Pipeline stages are
  checked before (`_refuse_pipeline`, `_check_devices`).

  Raises:
    errors.ConfigError: ZeRO stage 3, XLA, fp16, gradient clipping or
      --init_checkpoint, naming the one given.
  """
  if zero_stage == 3:
    raise errors.ConfigError(
        f"{flag} cannot run with {zero_stages.stage_flags(3)}: ZeRO stage 3 "
        "gathers each block's weights over every replica, which here hold "
        "different tensor shards. Use --zero_stage=1 or 2 "
        f"({zero_stages.ZERO_STAGE_SWITCHES[1]}, "
        f"{zero_stages.ZERO_STAGE_SWITCHES[2]}: the optimizer state, and "
        "the gradient accumulators, sharded over each data group), or drop "
        f"{flag} for stage 3.")
  for given, name, why in (
      (enable_xla, "--enable_xla",
       "the tensor-parallel layers all-reduce inside the forward pass, "
       "which one replica's XLA cluster cannot compile"),
      (dtype == "fp16", "--dtype=fp16",
       "the loss scale's finite check would see only this replica's shards"),
      (clipnorm is not None, f"--clipnorm={clipnorm}",
       "each replica would clip its shard by the shard's own norm"),
      (global_clipnorm is not None, f"--global_clipnorm={global_clipnorm}",
       "each replica would clip by its shards' norm, not the whole "
       "model's"),
      (init_checkpoint, f"--init_checkpoint={init_checkpoint}",
       "warm starts load into an unsharded model only (resuming from "
       "--model_dir's own checkpoints works)")):
    if given:
      raise errors.ConfigError(
          f"{flag} cannot run with {name}: {why}. Drop one of the two.")
