"""The backend protocol: everything one `tf.distribute` strategy does its own way.

A run's wiring (`tfdist.experiment`) asks its backend, never the strategy's
kind: how many processes step, which one writes `--model_dir`, how the
strategy is built, what feeds it and runs its steps, how its failures read,
what it exports and how its processes finish together. A new strategy is
its kind (a `StrategyKind` member, or a name registered with
`tfdist.core.strategy_kind.register_kind` from outside tfdist), one
module with a `Backend` subclass registered for that kind
(`register_backend`) that builds the strategy (`new_strategy`) and states
its traits, its test, and its selection rule for `auto`
(`tfdist.distribute.auto_select.register_rule`, or a line of
`auto_select.decide_strategy` for a built-in one). The built-in backends:

| kind | module |
|---|---|
| `off`, `one_device`, `mirrored` | `tfdist.backends.single_process` |
| `multi_worker_mirrored` | `tfdist.backends.multi_worker` |
| `parameter_server` | `tfdist.backends.parameter_server` |
| `tpu` | `tfdist.backends.tpu` |

A run with `--pipeline_stages` > 1 gets `tfdist.backends.pipeline`'s
backend instead (`tfdist.backends.registry.backend_for_run`), in one
process or across a cluster's chief and workers.

The pattern is Keras's backend-neutral `Trainer` with a thin
`TensorFlowTrainer` subclass: the shared loop lives once, above; what one
strategy does differently lives in one subclass.
"""

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

from absl import logging
import tensorflow as tf

from tfdist import config as config_lib
from tfdist import errors
from tfdist.distribute import devices
from tfdist.distribute import strategy as strategy_lib
from tfdist.core import strategy_kind
from tfdist.core.strategy_kind import StrategyKind


@dataclasses.dataclass(frozen=True)
class Role:
  """What this process does in the run: the one answer to chief/worker
  questions.

  Attributes:
    task_type: the cluster task's type (`chief`, `worker`, `ps`,
      `evaluator`; `chief` outside a cluster).
    task_index: its index in that job.
    is_writer: this process writes `--model_dir` (checkpoints, TensorBoard,
      SavedModel, manifest): the only process of a one-process run, the
      MultiWorkerMirrored chief, the parameter-server coordinator. Other
      training processes write into a scratch folder.
    num_workers: the processes that run training steps
      (`Backend.training_workers`).
    serves: this process only serves the cluster until the run ends (a
      parameter-server cluster's `worker` and `ps` tasks).
  """
  task_type: str
  task_index: int
  is_writer: bool
  num_workers: int
  serves: bool = False


@dataclasses.dataclass(frozen=True)
class InputSettings:
  """The settings a run's inputs are read with (the runner copies them
  from the config).

  Attributes:
    mode: `--mode` (`train` builds no held-out evaluation).
    shuffle_buffer_size: `--shuffle_buffer_size` (examples; 0: none).
    cache_dataset: `--cache_dataset`.
    seed: `--seed` (None: unseeded).
    deterministic: `--deterministic` (one reading order).
  """
  mode: str = "train_and_eval"
  shuffle_buffer_size: int = 0
  cache_dataset: bool = False
  seed: Optional[int] = None
  deterministic: bool = False


@dataclasses.dataclass(frozen=True)
class TrainingRun:
  """What a backend's `build_inputs` and `export_model` read of a training
  run once its parts are built; `tfdist.experiment.runner.ExperimentRunner.
  training_run` makes it.

  Attributes:
    task: the run's `tfdist.training.task.Task` (its `dataset` spec, its
      model builder).
    plan: its `tfdist.training.plan.run_plan.RunPlan`.
    strategy: the built `tf.distribute.Strategy`.
    parts: its `tfdist.training.assembly.Parts` (model, optimizer, trainer).
    cluster: its `tfdist.distribute.cluster.ClusterInfo`.
    num_workers: the processes that run training steps.
    settings: its `InputSettings`.
    input_position: the `tfdist.data.input_position.InputPosition` its
      checkpoints record, or None.
    latest_checkpoint: `() -> path or None`: the newest checkpoint now.
    synchronize_statistics: `() -> None`: averages unsynchronized batch
      norm's per-replica moving statistics
      (`tfdist.training.step.moving_statistics`).
    strategy_options: the `StrategyOptions` the strategy was built from
      (the parameter servers' partitioner among them).
    checkpoint_dir: the decided `--checkpoint_dir`.
    steps_per_execution: the decided steps per call of the step function.
    assembly_options: the run's `tfdist.training.assembly.AssemblyOptions`
      (a parameter-server export builds a local copy of the model).
  """
  task: Any
  plan: Any
  strategy: tf.distribute.Strategy
  parts: Any
  cluster: Any
  num_workers: int
  settings: InputSettings
  input_position: Any
  latest_checkpoint: Callable[[], Optional[str]]
  synchronize_statistics: Callable[[], None]
  strategy_options: strategy_lib.StrategyOptions
  checkpoint_dir: str
  steps_per_execution: int
  assembly_options: Any


@dataclasses.dataclass(frozen=True)
class RunEnding:
  """What a backend's `leave_together` reads as the run ends;
  `tfdist.experiment.runner.ExperimentRunner.run_ending` makes it.

  Attributes:
    strategy: the built `tf.distribute.Strategy`.
    parts: the run's `tfdist.training.assembly.Parts` (None when not built).
    cluster: its `ClusterInfo`.
    num_workers: the processes that run training steps.
    is_writer: this process writes `--model_dir`.
    exit_plan: the binary's `tfdist.distribute.worker_exit.ExitPlan` (None
      in library use: the process is the caller's).
    latest_checkpoint: `() -> path or None`: the newest checkpoint now.
    close: `() -> None`: releases what the run holds (the `--model_dir`
      lease, the signal handlers) before a process ends itself.
    model_dir: the decided `--model_dir` (its done marker).
  """
  strategy: tf.distribute.Strategy
  parts: Any
  cluster: Any
  num_workers: int
  is_writer: bool
  exit_plan: Any
  latest_checkpoint: Callable[[], Optional[str]]
  close: Callable[[], None]
  model_dir: str


class Backend:
  """One strategy's behaviour. Subclass it and register the subclass for a
  `StrategyKind` with `register_backend`.

  The defaults are those of a synchronous strategy in one process (one
  device, Mirrored); each built-in subclass overrides only what its
  strategy does otherwise.

  Class attributes (the strategy's traits, asked of the backend, never of
  the kind):
    kind: the kind this backend serves (a `StrategyKind` or a registered
      kind; set by `register_backend`).
    asynchronous: workers step independently, scheduled by a coordinator
      (the run plan sizes batches per worker step; no gradient
      accumulation, no shared loss scale).
    multi_process: the strategy spans the processes of a `tf.distribute`
      cluster (it needs the resolved cluster; one input pipeline per
      worker).
    mirrored: synchronous all-reduce data parallelism over replicas that
      hold mirrored copies of the variables (what ZeRO shards).
    on_tpu: the model is built for a TPU (static shapes, padded
      evaluation batches).
    keeps_input_position: checkpoints record where the input stands, so a
      resumed run continues the epoch (needs one deterministic reading
      order).
    accepts_bytes_per_pack: `--bytes_per_pack` applies (its all-reduce
      splits the gradients into packs) or has no effect (one replica);
      False: refused.
  """

  kind = StrategyKind.ONE_DEVICE
  asynchronous: bool = False
  multi_process: bool = False
  mirrored: bool = False
  on_tpu: bool = False
  keeps_input_position: bool = True
  accepts_bytes_per_pack: bool = False

  @property
  def accumulates_gradients(self) -> bool:
    """`--gradient_accumulation_steps` > 1 runs (a synchronous step)."""
    return not self.asynchronous

  # -- Roles -----------------------------------------------------------------

  def training_workers(self, cluster) -> int:
    """The processes that run training steps (1 in one process).

    Args:
      cluster: the run's `tfdist.distribute.cluster.ClusterInfo`.
    """
    del cluster
    return 1

  def writes_model_dir(self, cluster) -> bool:
    """Whether this process writes `--model_dir` (see `Role.is_writer`)."""
    del cluster
    return True

  def serves(self, cluster) -> bool:
    """Whether this process only serves the cluster (see `Role.serves`)."""
    del cluster
    return False

  def role(self, cluster) -> Role:
    """This process's `Role` in the run."""
    return Role(task_type=cluster.task_type, task_index=cluster.task_index,
                is_writer=self.writes_model_dir(cluster),
                num_workers=self.training_workers(cluster),
                serves=self.serves(cluster))

  def num_input_pipelines(self, num_workers: int) -> int:
    """How many `tf.data` pipelines feed the run (one per reading process).

    Args:
      num_workers: the run's training workers (`Cluster.num_workers`; 1
        outside a cluster).

    Returns:
      One per worker when the strategy spans processes (each worker reads
      its own shard); 1 otherwise.
    """
    return max(1, int(num_workers)) if self.multi_process else 1

  def cross_process_collectives(self, num_workers: int) -> bool:
    """Whether a training step's collectives reach another process."""
    del num_workers
    return False

  # -- Start-up ----------------------------------------------------------------

  def validate(self, config, decisions, *, dataset) -> None:
    """The rules that depend on the strategy, run once for the decided
    backend (`auto`'s choice or the flag's) before anything is built
    (`tfdist.experiment.prepare.prepare_run`, so `--dry_run` and
    `tfdist.fit` refuse before building a model). A subclass adds its own
    and calls this one. Each rule reads the backend's traits, never the
    kind, so a kind registered outside tfdist gets them from its backend:

    * `--bytes_per_pack` only where it applies or has no effect
      (`accepts_bytes_per_pack`);
    * `--gradient_accumulation_steps` > 1 only with a synchronous step
      (`accumulates_gradients`);
    * `--deterministic` and `--dtype=fp16` not with asynchronous workers
      (`asynchronous`: they apply updates in whatever order they finish,
      and cannot share a loss scale);
    * no fp16 on a TPU (`on_tpu`: TPUs have no float16 arithmetic);
    * `--reduction_server` only across the processes of an all-reduce
      (`mirrored` and `multi_process`: Vertex AI's Reduction Server serves
      NCCL all-reduce between workers);
    * `--zero_stage` > 0 only over mirrored replicas (`mirrored`: what
      ZeRO shards).

    Args:
      config: the run's `TrainConfig`, as the caller gave it.
      decisions: what preparing the run decided
        (`tfdist.distribute.decisions.Decisions`: the strategy, dtype,
        TPU, folders and files that run); None: the config's own values.
      dataset: the run's `DatasetSpec`, or None when not known.

    Raises:
      ConfigError: the configuration cannot run under this strategy (exit
        status 2; the message names the flags, values and the fix).
    """
    del dataset
    packs = config.strategy.bytes_per_pack
    if packs and not self.accepts_bytes_per_pack:
      raise errors.ConfigError(
          f"--bytes_per_pack={packs} applies to multi_worker_mirrored, not "
          f"{self.kind} (its all-reduce does not split the gradients into "
          "packs). Drop --bytes_per_pack.")
    kind = self.kind if decisions is None else decisions.strategy
    steps = config.loop.gradient_accumulation_steps
    if steps > 1 and not self.accumulates_gradients:
      raise errors.ConfigError(
          f"--gradient_accumulation_steps={steps} is not supported with "
          f"--distribution_strategy={kind}: there each worker step is "
          "its own asynchronous update of the shared weights, so there is "
          "no synchronous global batch to split into micro-batches, and "
          "accumulators would live on the ps tasks, shared by every worker. "
          "Raise --batch_size (examples per worker step) instead, or use "
          "multi_worker_mirrored.")
    if config.loop.deterministic and self.asynchronous:
      raise errors.ConfigError(
          "--deterministic is not supported with --distribution_strategy="
          f"{kind}: asynchronous workers apply their updates in whatever "
          "order they finish. Use a synchronous strategy (one_device, "
          "mirrored, multi_worker_mirrored) or drop --deterministic.")
    self._check_precision(config, decisions, kind)
    self._check_reduction_server(config, decisions, kind)
    self._check_sharding(config, kind)

  def _check_precision(self, config, decisions, kind) -> None:
    """fp16 on a TPU, or with asynchronous workers (`validate`)."""
    dtype = config.precision.dtype if decisions is None else decisions.dtype
    if dtype != "fp16":
      return
    if self.on_tpu:
      reason = "" if decisions is None else decisions.choice.strategy_reason
      how = f" ({reason})" if reason.startswith("auto") else ""
      raise errors.ConfigError(
          f"--dtype=fp16 is not supported with --distribution_strategy="
          f"{kind}{how}: fp16 is not supported on TPUs, which compute in "
          "bfloat16 and have no float16 arithmetic or loss scaling. Use "
          "--dtype=bf16 (the TPU default), --dtype=auto or --dtype=fp32.")
    if self.asynchronous:
      raise errors.ConfigError(
          "--dtype=fp16 is not supported with --distribution_strategy="
          f"{kind}: fp16 needs loss scaling, whose scale asynchronous "
          "workers cannot share. Use --dtype=bf16, fp32 or auto.")

  def _check_reduction_server(self, config, decisions, kind) -> None:
    """`--reduction_server` needs the all-reduce of workers in several
    processes (`validate`); the message says how `auto` decided."""
    if not config.cloud.reduction_server or (
        self.mirrored and self.multi_process):
      return
    if (decisions is not None and
        config.strategy.distribution_strategy == "auto"):
      raise errors.ConfigError(
          "--reduction_server needs a multi-worker cluster under "
          f"multi_worker_mirrored, but this run resolved to {kind}"
          f" ({decisions.choice.strategy_reason}). Vertex AI sets "
          "CLUSTER_SPEC for a job with a chief and workers (python -m "
          "tfdist.job_spec vertex --num_workers=N "
          "--reduction_server_replicas=R); drop --reduction_server for a "
          "single-process run.")
    raise errors.ConfigError(
        "--reduction_server needs --distribution_strategy="
        "multi_worker_mirrored or auto (Vertex AI's Reduction Server "
        "serves NCCL all-reduce between workers); received "
        f"--distribution_strategy={kind}.")

  def _check_sharding(self, config, kind) -> None:
    """`--zero_stage` > 0 shards mirrored replicas' state (`validate`)."""
    stage = config.zero_stage_resolved
    if not stage or self.mirrored:
      return
    sharding = " or ".join(
        name for name in strategy_kind.names()
        if getattr(_BACKENDS.get(StrategyKind.parse(name)),
                   "mirrored", False))
    raise errors.ConfigError(
        f"--zero_stage={stage} (--{config_lib.SHARDING_SWITCHES[stage - 1]})"
        f" runs under {sharding}; received --distribution_strategy={kind}. Use "
        "mirrored or multi_worker_mirrored (parameter_server partitions "
        "variables itself), or drop the flag.")

  def serve(self, config, decisions, cluster) -> Optional[dict]:
    """Runs a serving process's part until the run ends; returns its result
    (None: this process trains or evaluates instead). Arguments as
    `validate`'s, and the run's `ClusterInfo`."""
    del config, decisions, cluster
    return None

  def build_strategy(self, config, decisions, *, cluster,
                     lease=None) -> strategy_lib.StrategyChoice:
    """The run's `tf.distribute` strategy, with the CPU devices configured.

    Args:
      config: the run's `TrainConfig`.
      decisions: its `tfdist.distribute.decisions.Decisions`.
      cluster: its `ClusterInfo` (None for a lone evaluator).
      lease: the writer's `--model_dir` lease (None elsewhere); a backend
        that waits for peers extends it while it waits.

    Raises:
      ConfigError: as `make_strategy`.
    """
    del lease
    devices.configure_cpu_devices(config.strategy.num_cpu_devices)
    return self.make_strategy(self.strategy_options(config, decisions),
                              cluster=cluster)

  def strategy_options(self, config, decisions
                       ) -> strategy_lib.StrategyOptions:
    """The `StrategyOptions` of `config` with its decided values."""
    return strategy_lib.StrategyOptions.of(
        config.strategy, decisions,
        reduction_server=config.cloud.reduction_server)

  def make_strategy(self, options: strategy_lib.StrategyOptions, *,
                    cluster=None) -> strategy_lib.StrategyChoice:
    """Builds this backend's strategy from `options` (`new_strategy`),
    named by its kind, once it has the cluster it needs (the rules of the
    run's settings are `validate`'s).

    Args:
      options: a `StrategyOptions` whose `kind` is this backend's (`auto`
        is decided first by `tfdist.distribute.auto_select.resolve`; the
        config's strategy section becomes options with
        `StrategyOptions.of`).
      cluster: the resolved `tfdist.distribute.cluster.ClusterInfo`; needed
        when the strategy spans processes (`multi_process`).

    Returns:
      A `StrategyChoice` named by this backend's kind (its `reason` says
      what was asked; the caller replaces it with the decision's reason).

    Raises:
      ConfigError: a multi-process strategy without a cluster, or what
        `new_strategy` refuses.
      ValueError: `options.kind` is not this backend's kind.
    """
    kind = strategy_kind.StrategyKind.parse(options.kind)
    if kind != self.kind:
      raise ValueError(
          f"{type(self).__name__} builds --distribution_strategy="
          f"{self.kind}, not {kind}: ask tfdist.backends.registry."
          f"backend_for({str(kind)!r}).")
    if self.multi_process and cluster is None:
      raise errors.ConfigError(
          f"--distribution_strategy={kind} needs the resolved "
          "cluster (tfdist.distribute.cluster.resolve_cluster).")
    strategy, names = self.new_strategy(options, cluster=cluster)
    choice = strategy_lib.StrategyChoice(
        strategy, kind, f"--distribution_strategy={kind}", tuple(names))
    logging.info("Strategy: %s; %d replica(s) on %s", choice.name,
                 choice.strategy.num_replicas_in_sync,
                 ", ".join(choice.devices))
    return choice

  def new_strategy(self, options: strategy_lib.StrategyOptions, *,
                   cluster) -> Tuple[tf.distribute.Strategy, Tuple[str, ...]]:
    """`(strategy, device names)`: the strategy itself, built from
    `options` (`make_strategy` made its shared checks). Every backend
    that builds its strategy from options overrides it.

    Args:
      options: the run's `StrategyOptions`.
      cluster: the run's `ClusterInfo` (None in one process).
    """
    del options, cluster
    raise NotImplementedError(
        f"{type(self).__name__} (the {self.kind} backend) builds no "
        "strategy: implement new_strategy (or build_strategy).")

  def planned_replicas(self, config, decisions, *, cluster) -> Tuple[int, int]:
    """`(num_replicas_in_sync, num_workers)` a run will have, without
    building the strategy (for `--dry_run`); arguments as `validate`'s."""
    del config, decisions
    return 1, self.training_workers(cluster)

  def assembly_options(self, options, *, choice):
    """The run's `tfdist.training.assembly.AssemblyOptions` as this backend
    needs them, once its strategy is built (default: unchanged).

    Args:
      options: the options made from the config.
      choice: the `StrategyChoice` that `build_strategy` returned.
    """
    del choice
    return options

  def model_memory(self, parts, *, num_replicas: int):
    """The model state one replica holds
    (`tfdist.training.plan.memory.ModelMemory`, bytes): the run's "Model state
    per replica" line and manifest.

    Args:
      parts: the run's `tfdist.training.assembly.Parts` (model, optimizer,
        trainer).
      num_replicas: `num_replicas_in_sync`.
    """
    del num_replicas
    from tfdist.training.plan import memory  # pylint: disable=g-import-not-at-top
    return memory.estimate_model_memory(parts.model, parts.optimizer,
                                        sharded=parts.trainer.sharded)

  # -- Training ----------------------------------------------------------------

  def build_inputs(self, run: TrainingRun
                   ) -> Tuple[Any, Optional[Callable[..., dict]],
                              Dict[str, Any]]:
    """`(step_runner, evaluate, strategy_details)` for a training run.

    Args:
      run: the `TrainingRun`: its strategy, plan, parts, input position.

    Returns:
      The `tfdist.training.step.step_runner.StepRunner`, the held-out evaluation
      (None under `--mode=train`), and the manifest's `strategy_details`.
    """
    raise NotImplementedError(
        f"{type(self).__name__} (the {self.kind} backend) builds no inputs: "
        "subclass tfdist.backends.synchronous.SynchronousBackend or "
        "implement build_inputs.")

  def translate_failure(self, error: Exception, *, after: str,
                        last_checkpoint: Optional[str],
                        cluster) -> Optional[Exception]:
    """The tfdist error for a TensorFlow failure noticed outside the steps
    (a save, an evaluation, the final barrier), or None to let it through.

    Args:
      error: what TensorFlow raised.
      after: where training was, e.g. "step 40".
      last_checkpoint: the checkpoint a restart resumes from.
      cluster: the run's `ClusterInfo`.
    """
    del error, after, last_checkpoint, cluster
    return None

  def export_model(self, run: TrainingRun):
    """The Keras model the SavedModel is made of (the trained one).

    Args:
      run: the `TrainingRun`.
    """
    return run.parts.model

  def leave_together(self, run: RunEnding, *, failed: bool = False) -> None:
    """Ends the run's processes together (nothing to do in one process).

    Args:
      run: the `RunEnding`.
      failed: this task's export or outputs failed (its error follows);
        a backend of several processes tells the others, whose
        `leave_together` then raises `tfdist.errors.PeerStoppedError`.
    """
    del run, failed

  # -- Evaluators ----------------------------------------------------------------

  def evaluation_batch(self, global_batch_size: int) -> int:
    """A side-car evaluator's batch for a run of this strategy whose
    global batch is `global_batch_size`."""
    return global_batch_size

  def evaluator_strategy(self, local_devices: int
                         ) -> Tuple[StrategyKind, str]:
    """`(strategy, reason)` a side-car evaluator of this strategy's runs
    uses in its one process with `local_devices` devices."""
    del local_devices
    return self.kind, "the run's strategy"


def local_accelerators(num_gpus: int) -> int:
  """The GPUs a run of this process uses (`--num_gpus`; -1: all)."""
  gpus = len(tf.config.list_physical_devices("GPU"))
  if num_gpus >= 0:
    gpus = min(gpus, num_gpus)
  return gpus


def first_gpus(n: int, num_gpus: int = -1) -> Optional[List[str]]:
  """The logical device names of this host's first `n` GPUs that a run of
  this process uses (`--num_gpus`; -1: all; 0: none), or None when it
  uses none. Fewer than `n` names when it has fewer: the caller refuses
  that with its own flag's message."""
  gpus = local_accelerators(num_gpus) if num_gpus != 0 else 0
  if not gpus:
    return None
  names = [d.name for d in tf.config.list_logical_devices("GPU")]
  return names[:min(gpus, n)]


# Keyed by kind: a `StrategyKind` or a `RegisteredKind`.
_BACKENDS: Dict[str, Type[Backend]] = {}


def register_backend(kind, backend: Optional[Type[Backend]] = None):
  """Registers `backend` (a `Backend` subclass) for `kind`.

  Usable as a decorator (`@register_backend(StrategyKind.MIRRORED)`) or a
  call; a later registration for the same kind replaces the earlier one
  (a user's subclass replacing a built-in backend).

  Args:
    kind: a `StrategyKind`, a kind registered with
      `tfdist.core.strategy_kind.register_kind`, or its name.
    backend: the class; omitted when used as a decorator.

  Returns:
    `backend` (or the decorator).

  Raises:
    TypeError: `backend` is not a `Backend` subclass.
    ValueError: `kind` is not a concrete strategy name.
  """
  kind = StrategyKind.parse(kind)

  def register(cls):
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
      raise TypeError(f"register_backend({kind}, {cls!r}): the backend must "
                      "be a subclass of tfdist.backends.base.Backend.")
    cls.kind = kind
    _BACKENDS[kind] = cls
    return cls

  return register if backend is None else register(backend)


def registered_backend(kind) -> Optional[Type[Backend]]:
  """The class registered for `kind`, or None."""
  return _BACKENDS.get(StrategyKind.parse(kind))


def unregister_backend(kind) -> None:
  """Forgets the backend registered for `kind` (a kind registered outside
  tfdist, when its test ends); no error when none is."""
  _BACKENDS.pop(StrategyKind.parse(kind), None)
