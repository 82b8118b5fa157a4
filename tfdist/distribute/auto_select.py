"""`auto`: choose the strategy and the precision from the devices found.

Two halves, so that every situation can be tested without its hardware:

* `decide(inventory, ...)` is a pure function of a plain `DeviceInventory`
  (TPU, GPUs and their compute capability, the cluster in TF_CONFIG or
  CLUSTER_SPEC, logical CPU devices) and of what the flags asked; it returns
  a `Decision` with the strategy, the dtype and a reason for each.
* `take_inventory(config)` fills a `DeviceInventory` from the real machine
  (TensorFlow's device lists, environment variables, a bounded TPU probe).

Rules, in order, for `--distribution_strategy=auto`:

1. a TPU answered -> `tpu`;
2. the cluster lists parameter servers -> `parameter_server`;
3. the cluster lists more than one worker -> `multi_worker_mirrored`;
4. several GPUs -> `mirrored`; one GPU -> `one_device`;
5. `--num_cpu_devices` > 1 -> `mirrored` over logical CPUs;
6. else `one_device` on the CPU.

and for `--dtype=auto`, given the strategy:

* TPU -> `bf16` (TPU matrix units compute in bfloat16);
* GPUs, all of compute capability >= 8.0 (Ampere and later) -> `bf16`;
* GPUs of compute capability 7.x (Volta, Turing: fp16 Tensor Cores, no
  bf16) -> `fp16` with dynamic loss scaling;
* older GPUs, or GPUs of unknown capability -> `fp32` (no Tensor Cores);
* parameter_server: never `fp16` (its loss scale cannot be shared by
  asynchronous workers): `bf16` on GPUs of compute capability >= 8.0, else
  `fp32`;
* CPU only -> `fp32`: on CPUs bf16 trained about 1.6x slower than fp32 and
  fp16 (with oneDNN) hundreds of times slower (measured, 2-core x86).

Each choice is overridable by its flag: an explicit `--distribution_strategy`
or `--dtype` is kept, and the other is decided around it.
"""

import dataclasses
from typing import Callable, List, Optional, Tuple

from absl import logging

from tfdist import config as config_lib
from tfdist import errors
from tfdist.distribute import tpu as tpu_lib
from tfdist.core.strategy_kind import StrategyKind

# Compute capability from which GPUs have bfloat16 Tensor Cores (Ampere).
BF16_MIN_COMPUTE_CAPABILITY = (8, 0)
# Compute capability from which GPUs have float16 Tensor Cores (Volta).
FP16_MIN_COMPUTE_CAPABILITY = (7, 0)

_CPU_FP32_WHY = ("no GPU or TPU: on CPUs float32 is fastest (bf16 trained "
                 "about 1.6x slower, fp16 far slower)")


@dataclasses.dataclass(frozen=True)
class GpuInfo:
  """One GPU. `compute_capability` is `(major, minor)`, or None if unknown."""
  name: str = "GPU"
  compute_capability: Optional[Tuple[int, int]] = None


@dataclasses.dataclass(frozen=True)
class DeviceInventory:
  """What this process can use, as plain values.

  Attributes:
    tpu_cores: TPU cores of a connected TPU system (0: none).
    tpu_address: the `--tpu` address that answered (e.g. `local`), or ''.
    tpu_note: why there is no TPU (hint seen but probe failed), or ''.
    gpus: the GPUs the run may use (after `--num_gpus`).
    cluster_source: `TF_CONFIG`, `CLUSTER_SPEC` or '' (no cluster).
    cluster_workers: chief + workers in that cluster.
    cluster_ps: parameter-server tasks in that cluster.
    num_cpu_devices: logical CPU devices asked for (`--num_cpu_devices`).
  """
  tpu_cores: int = 0
  tpu_address: str = ""
  tpu_note: str = ""
  gpus: Tuple[GpuInfo, ...] = ()
  cluster_source: str = ""
  cluster_workers: int = 0
  cluster_ps: int = 0
  num_cpu_devices: int = 0


@dataclasses.dataclass(frozen=True)
class Decision:
  """The strategy and dtype a run uses, and why.

  Attributes:
    strategy: the concrete `StrategyKind` (never `auto`; it equals and
      prints as its flag value).
    strategy_reason: why, e.g. "auto: 4 GPUs are visible".
    dtype: `fp32`, `bf16` or `fp16` (never `auto`).
    dtype_reason: why, e.g. "auto: GPUs of compute capability 8.0".
    tpu: the TPU address `auto` found (for `--tpu` when it was empty), or ''.
  """
  strategy: StrategyKind
  strategy_reason: str
  dtype: str
  dtype_reason: str
  tpu: str = ""

  def describe(self) -> str:
    """One line for the log: the decision and its reasons."""
    return (f"tfdist decision: strategy {self.strategy} ({self.strategy_reason});"
            f" dtype {self.dtype} ({self.dtype_reason})")


def _cc(gpu: GpuInfo) -> str:
  if gpu.compute_capability is None:
    return "unknown"
  return "%d.%d" % gpu.compute_capability


# Selection rules of kinds registered outside tfdist (`register_rule`),
# asked in order before the built-in ones.
_RULES: List[Callable[[DeviceInventory], Optional[Tuple[str, str]]]] = []


def register_rule(rule: Callable[[DeviceInventory],
                                 Optional[Tuple[str, str]]]):
  """Adds a selection rule for `auto`, asked before the built-in ones.

  A strategy kind written outside tfdist is its kind
  (`tfdist.core.strategy_kind.register_kind`), its backend
  (`tfdist.backends.registry.register_backend`) and this rule. Usable as a
  decorator.

  Args:
    rule: `rule(inventory) -> (kind, reason)` when `auto` should choose
      `kind` (a registered kind or its name) for the `DeviceInventory`
      found, or None to leave the choice to the next rule. Pure: it reads
      only the inventory.

  Returns:
    `rule`.
  """
  _RULES.append(rule)
  return rule


def unregister_rule(rule) -> None:
  """Removes a rule `register_rule` added (tests); no error when absent."""
  if rule in _RULES:
    _RULES.remove(rule)


def decide_strategy(inventory: DeviceInventory
                    ) -> Tuple[StrategyKind, str]:
  """`auto`'s strategy for `inventory`: `(kind, reason)`. Pure.

  The registered rules (`register_rule`) are asked first, in order; then
  the built-in ones below.

  Raises:
    ValueError: a registered rule chose a kind that is not registered.
  """
  for rule in _RULES:
    chosen = rule(inventory)
    if chosen is not None:
      kind, reason = chosen
      return StrategyKind.parse(kind), reason
  inv = inventory
  if inv.tpu_cores > 0:
    return StrategyKind.TPU, f"a TPU with {inv.tpu_cores} cores answered"
  if inv.cluster_source and inv.cluster_ps > 0:
    return (StrategyKind.PARAMETER_SERVER,
            f"{inv.cluster_source} lists {inv.cluster_ps} parameter server(s)"
            f" and {inv.cluster_workers} worker(s)")
  if inv.cluster_source and inv.cluster_workers > 1:
    return (StrategyKind.MULTI_WORKER_MIRRORED,
            f"{inv.cluster_source} lists {inv.cluster_workers} workers")
  note = f"; {inv.tpu_note}" if inv.tpu_note else ""
  if len(inv.gpus) > 1:
    return StrategyKind.MIRRORED, f"{len(inv.gpus)} GPUs are visible{note}"
  if len(inv.gpus) == 1:
    return StrategyKind.ONE_DEVICE, f"one GPU is visible{note}"
  if inv.num_cpu_devices > 1:
    return (StrategyKind.MIRRORED,
            f"no GPU or TPU; --num_cpu_devices={inv.num_cpu_devices} logical "
            f"CPU devices{note}")
  return (StrategyKind.ONE_DEVICE,
          f"no GPU, TPU or cluster: one CPU device{note}")


def _uses_gpus(kind: StrategyKind, inventory: DeviceInventory) -> bool:
  return kind is not StrategyKind.TPU and bool(inventory.gpus)


def decide_dtype(strategy: StrategyKind,
                 inventory: DeviceInventory) -> Tuple[str, str]:
  """`auto`'s dtype for a run with `strategy` on `inventory`. Pure.

  Mixed GPUs are judged by the least capable one (all replicas run the same
  program).

  Args:
    strategy: the concrete `StrategyKind` (or its flag value).
    inventory: the devices found.

  Returns:
    `(dtype, reason)`, dtype one of `fp32`, `bf16`, `fp16`.

  Raises:
    ValueError: `strategy` is not a concrete strategy name.
  """
  strategy = StrategyKind.parse(strategy)
  if strategy is StrategyKind.TPU:
    return "bf16", "TPU: its matrix units compute in bfloat16"
  if strategy is StrategyKind.PARAMETER_SERVER and _uses_gpus(strategy, inventory):
    known = [g.compute_capability for g in inventory.gpus]
    if known and all(cc is not None and cc >= BF16_MIN_COMPUTE_CAPABILITY
                     for cc in known):
      return "bf16", ("parameter_server on GPUs of compute capability >= "
                      "8.0 (bfloat16 Tensor Cores; no loss scaling needed)")
    return "fp32", ("parameter_server: fp16 needs loss scaling, which "
                    "asynchronous workers cannot share; bf16 needs GPUs of "
                    "compute capability >= 8.0")
  if not _uses_gpus(strategy, inventory):
    return "fp32", _CPU_FP32_WHY
  known = [g.compute_capability for g in inventory.gpus]
  names = ", ".join(sorted({f"{g.name} (compute capability {_cc(g)})"
                            for g in inventory.gpus}))
  if any(cc is None for cc in known):
    return "fp32", (f"GPU compute capability unknown ({names}): float32 is "
                    "the safe choice; pass --dtype=bf16 or fp16 to override")
  lowest = min(known)
  if lowest >= BF16_MIN_COMPUTE_CAPABILITY:
    return "bf16", (f"GPUs of compute capability >= 8.0 have bfloat16 Tensor "
                    f"Cores: {names}")
  if lowest >= FP16_MIN_COMPUTE_CAPABILITY:
    return "fp16", (f"GPUs of compute capability 7.x have float16 but no "
                    f"bfloat16 Tensor Cores: {names}; with dynamic loss "
                    "scaling")
  return "fp32", (f"GPUs of compute capability < 7.0 have no Tensor Cores: "
                  f"{names}")


def decide(inventory: DeviceInventory, *, strategy: str = "auto",
           dtype: str = "auto", dtype_defaulted: bool = False) -> Decision:
  """Resolves `auto` in `strategy` and `dtype` for `inventory`. Pure.

  Args:
    inventory: the devices and cluster found.
    strategy: `--distribution_strategy` (`auto` or a concrete name, kept);
      the flag value is parsed into a `StrategyKind` here.
    dtype: `--dtype` (`auto` or `fp32|bf16|fp16`, kept unless defaulted).
    dtype_defaulted: `--dtype` was not given: the default is `fp32`, or
      `bf16` when the strategy is TPU.

  Returns:
    A `Decision`.

  Raises:
    ValueError: `strategy` is neither `auto` nor a strategy name.
  """
  tpu_address = ""
  if strategy == "auto":
    strategy, strategy_reason = decide_strategy(inventory)
    strategy_reason = f"auto: {strategy_reason}"
    if strategy is StrategyKind.TPU:
      tpu_address = inventory.tpu_address
  else:
    strategy = StrategyKind.parse(strategy)
    strategy_reason = f"--distribution_strategy={strategy}"
  if dtype == "auto":
    dtype, dtype_reason = decide_dtype(strategy, inventory)
    dtype_reason = f"auto: {dtype_reason}"
  elif dtype_defaulted and strategy is StrategyKind.TPU:
    dtype, dtype_reason = "bf16", "the TPU default (--dtype not given)"
  elif dtype_defaulted:
    dtype_reason = "the default (--dtype not given)"
  else:
    dtype_reason = f"--dtype={dtype}"
  return Decision(strategy, strategy_reason, dtype, dtype_reason,
                  tpu=tpu_address)


# --- The real inventory ----------------------------------------------------
def _parse_cc(value) -> Optional[Tuple[int, int]]:
  if isinstance(value, (tuple, list)) and len(value) == 2:
    return int(value[0]), int(value[1])
  if isinstance(value, str) and "." in value:
    major, minor = value.split(".", 1)
    return int(major), int(minor)
  return None


def gpu_inventory(num_gpus: int = -1, *, list_fn=None,
                  details_fn=None) -> Tuple[GpuInfo, ...]:
  """The GPUs a run may use, with name and compute capability.

  Args:
    num_gpus: `--num_gpus` (-1: all, 0: none, N: the first N).
    list_fn: returns physical GPU devices (default
      `tf.config.list_physical_devices('GPU')`).
    details_fn: device -> dict with `device_name`, `compute_capability`
      (default `tf.config.experimental.get_device_details`).
  """
  if num_gpus == 0:
    return ()
  if list_fn is None or details_fn is None:
    # Imported here: deciding with a given inventory (tests, `auto` with
    # explicit flags) stays TensorFlow-free.
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    list_fn = list_fn or (lambda: tf.config.list_physical_devices("GPU"))
    details_fn = details_fn or tf.config.experimental.get_device_details
  out = []
  for device in list_fn():
    try:
      details = details_fn(device) or {}
    except (ValueError, RuntimeError):
      details = {}
    out.append(GpuInfo(name=str(details.get("device_name") or "GPU"),
                       compute_capability=_parse_cc(
                           details.get("compute_capability"))))
  return tuple(out if num_gpus < 0 else out[:num_gpus])


@dataclasses.dataclass(frozen=True)
class SelectOptions:
  """What `auto` reads: the config's strategy and precision sections as
  given (the two settings it may decide, and what it looks at), and
  whether `--dtype` was given.

  Attributes:
    strategy: the strategy section (`tfdist.config.StrategyConfig`):
      `distribution_strategy` (`auto` or a concrete name), `num_gpus` (-1:
      all, 0: none, N: the first N), `num_cpu_devices`, the TPU section
      (probed under `auto`), and the parallelism section's
      `pipeline_stages` (above 1, `auto` is one_device: the stages run in
      one process, or across a cluster's chief and workers,
      `tfdist.backends.pipeline`, with `tensor_parallel` too) and
      `tensor_parallel` (above 1 without stages, `auto` is mirrored: one
      tensor-parallel group, `tfdist.backends.tensor_parallel`).
    precision: the precision section (`tfdist.config.PrecisionConfig`):
      its `dtype` as given (`auto`, `fp32`, `bf16`, `fp16`).
    dtype_defaulted: `--dtype` was not given (the TPU default is bf16;
      `"dtype" in TrainConfig.defaulted`).
  """
  strategy: config_lib.StrategyConfig = dataclasses.field(
      default_factory=config_lib.StrategyConfig)
  precision: config_lib.PrecisionConfig = dataclasses.field(
      default_factory=config_lib.PrecisionConfig)
  dtype_defaulted: bool = False

  @property
  def requested(self) -> str:
    """`--distribution_strategy` as given (`auto` or a concrete name)."""
    return self.strategy.distribution_strategy

  def with_strategy(self, **changes) -> "SelectOptions":
    """These options with the strategy section's `changes` (e.g. the TPU
    address a platform's variables give, or the strategy `auto` takes
    without looking)."""
    return dataclasses.replace(
        self, strategy=dataclasses.replace(self.strategy, **changes))


def probe_tpu(tpu: tpu_lib.TpuOptions, *, hints: Tuple[str, ...] = (),
              connect_fn=None) -> Tuple[int, str, str]:
  """Looks for a TPU for `auto`: `(cores, address, note)`.

  Connects (bounded) only when `--tpu` is given (or `$TPU_NAME`, which the
  binary's edge copies into it) or `hints` show a sign of a TPU; machines
  without one pay nothing.

  Args:
    tpu: the TPU flags (`--tpu`, `--tpu_zone`, `--tpu_gcp_project`,
      `--tpu_init_timeout`).
    hints: `tfdist.distribute.tpu.tpu_hints` of this machine.
    connect_fn: replaces `tpu.connect_tpu` (tests pass a fake resolver to
      it instead where possible).

  Returns:
    TPU cores (0: none), the address tried, and a note saying why none was
    used ('' if no sign of a TPU was seen).
  """
  address = tpu_lib.resolve_tpu_address(tpu.tpu, hints)
  if not address:
    return 0, "", ""
  connect = connect_fn or tpu_lib.connect_tpu
  try:
    system = connect(address, zone=tpu.tpu_zone, project=tpu.tpu_gcp_project,
                     init_timeout=tpu.tpu_init_timeout)
  except errors.ConfigError as e:
    why = f"--tpu={tpu.tpu}" if tpu.tpu else ", ".join(hints)
    logging.warning("auto: %s suggested a TPU, but: %s", why, e)
    return 0, address, f"{why} suggested a TPU but none answered"
  return system.num_cores, address, ""


def take_inventory(options: SelectOptions, *, cluster, environment=None,
                   connect_fn=None, gpu_list_fn=None,
                   gpu_details_fn=None) -> DeviceInventory:
  """Fills a `DeviceInventory` from this machine and process.

  Lists physical devices only (TensorFlow's runtime is not started, so a
  MultiWorkerMirroredStrategy can still be built afterwards). The TPU is
  probed only for `--distribution_strategy=auto`.

  Args:
    options: the `SelectOptions` (`num_gpus`, `num_cpu_devices`, TPU).
    cluster: the resolved `tfdist.distribute.cluster.ClusterInfo`.
    environment: the `tfdist.distribute.environment.RunEnvironment` (for TPU
      hints;
      None: no variables).
    connect_fn: replaces `tpu.connect_tpu` for the TPU probe.
    gpu_list_fn, gpu_details_fn: replace TensorFlow's GPU listing.
  """
  variables = environment.variables if environment is not None else {}
  cores, address, note = 0, "", ""
  strategy = options.strategy
  if options.requested == "auto":
    cores, address, note = probe_tpu(
        strategy.tpu, hints=tpu_lib.tpu_hints(variables), connect_fn=connect_fn)
  multi = cluster.source != "single_process" and (
      cluster.num_workers > 1 or cluster.num_ps > 0)
  return DeviceInventory(
      tpu_cores=cores, tpu_address=address, tpu_note=note,
      gpus=gpu_inventory(strategy.num_gpus, list_fn=gpu_list_fn,
                         details_fn=gpu_details_fn),
      cluster_source=cluster.source if multi else "",
      cluster_workers=cluster.num_workers if multi else 0,
      cluster_ps=cluster.num_ps if multi else 0,
      num_cpu_devices=strategy.num_cpu_devices)


def resolve(options: SelectOptions, *, cluster, environment=None,
            inventory: Optional[DeviceInventory] = None) -> Decision:
  """The one place that decides `auto`: the `Decision` for `options`.

  Every path calls this (single process, multi-worker, parameter server,
  TPU), before any strategy is built; the strategy factory never sees
  `auto`. Nothing is probed when neither the strategy nor the dtype is
  `auto` (the cluster still counts).

  Args:
    options: the run's `SelectOptions` (its strategy and precision
      sections).
    cluster: the resolved `tfdist.distribute.cluster.ClusterInfo`.
    environment: the `tfdist.distribute.environment.RunEnvironment` (TPU hints).
    inventory: use this instead of looking (tests).

  Raises:
    ConfigError: fp16 on a TPU.
  """
  # Decided without looking at the devices (looking starts TensorFlow's
  # runtime before the backend makes N logical CPU devices).
  parallelism = options.strategy.parallelism
  dtype = options.precision.dtype
  # Beside pipeline stages, T splits each stage's layers in one process
  # (`tfdist.parallel.pipeline.tensor`): the pipeline's one_device below.
  tensor_parallel = (options.requested == "auto" and
                     parallelism.tensor_parallel > 1 and
                     parallelism.pipeline_stages <= 1)
  if tensor_parallel:
    options = options.with_strategy(
        distribution_strategy=StrategyKind.MIRRORED.value)
  needs_inventory = "auto" in (options.requested, dtype)
  if inventory is None:
    if needs_inventory:
      inventory = take_inventory(options, cluster=cluster,
                                 environment=environment)
    else:
      inventory = DeviceInventory(
          num_cpu_devices=options.strategy.num_cpu_devices)
  if options.requested == "auto" and parallelism.pipeline_stages > 1:
    decision = decide(inventory, strategy=StrategyKind.ONE_DEVICE.value,
                      dtype=dtype, dtype_defaulted=options.dtype_defaulted)
    tensor = parallelism.tensor_parallel
    where = (f"in one process, each stage's split layers over {tensor} "
             "devices (a data x pipeline x tensor mesh)"
             if cluster.num_workers <= 1 and tensor > 1 else
             "in one process, stage i on GPU i or logical CPU device i"
             if cluster.num_workers <= 1 else
             f"on the {cluster.num_workers} chief and worker tasks of the "
             "cluster, driven by the chief")
    return dataclasses.replace(decision, strategy_reason=(
        f"auto: --pipeline_stages={parallelism.pipeline_stages} runs its "
        f"stages {where}"))
  decision = decide(inventory, strategy=options.requested, dtype=dtype,
                    dtype_defaulted=options.dtype_defaulted)
  if tensor_parallel:
    decision = dataclasses.replace(decision, strategy_reason=(
        f"auto: --tensor_parallel={parallelism.tensor_parallel} splits the "
        f"layers over {parallelism.tensor_parallel} replicas of one host"))
  return decision
