"""The frozen run configuration: the one object every tfdist module reads.

Flags are parsed only at the binary's edge (`flags/`, `tfdist/train.py`); they
become a `TrainConfig` once, and everything downstream (strategy, batch plan,
learning rate, input pipeline, training loop, artifacts) takes that object or
plain arguments. A `TrainConfig` can therefore be built and used without absl.

Validation happens in `__post_init__`, before any expensive work starts; every
error names the flag, the bad value and the fix.
"""

import dataclasses
import json
import math
import os
from typing import Optional, Tuple

STRATEGIES = ("off", "one_device", "mirrored", "multi_worker_mirrored",
              "parameter_server", "tpu", "auto")
DTYPES = ("fp32", "bf16", "fp16", "auto")
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
                 "fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "auto": "auto"}
LR_SCALING_RULES = ("linear", "sqrt", "none")
LR_SCHEDULES = ("constant", "cosine", "piecewise")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "rmsprop", "lamb")
ALL_REDUCE_ALGS = ("auto", "nccl", "hierarchical_copy", "ring")
PS_PARTITIONERS = ("min_size", "fixed", "max_size", "none")
# Flag values a data set recommends, applied by `flags.flags_to_config` to
# the flags the command line leaves unset (as Model Garden's experiment
# configs do). MovieLens: the ranking model, Adam (SGD with momentum updates
# every row of an embedding table at every step), and batches of 512 (a
# 500-step run then sees about 3 epochs and reaches a held-out AUC near 0.78).
DATASET_RECOMMENDED_FLAGS = {
    "movielens": (("model", "ranking"), ("batch_size", 512),
                  ("optimizer", "adam"), ("base_learning_rate", 0.002),
                  ("lr_scaling", "sqrt")),
}
# Steps per `tf.function` call on TPU when --steps_per_execution is not
# given: each call is a host -> TPU round trip, so TPUs want many steps each.
TPU_DEFAULT_STEPS_PER_EXECUTION = 100


class ConfigError(ValueError):
  """A configuration value is invalid. The message names flag, value and fix."""


def normalize_dtype(value: str) -> str:
  """Maps `--dtype` spellings (`float16`, `fp16`, ...) to `fp32|bf16|fp16|auto`.

  Raises:
    ConfigError: `value` is not a known spelling.
  """
  key = str(value).strip().lower()
  if key not in DTYPE_ALIASES:
    raise ConfigError(
        f"--dtype={value!r} is not a known precision. Use one of "
        f"{', '.join(sorted(DTYPE_ALIASES))}.")
  return DTYPE_ALIASES[key]


def parse_loss_scale(value) -> Optional[object]:
  """Parses `--loss_scale`: None, `'dynamic'`, or a positive number.

  Returns:
    None, the string `'dynamic'`, or a float > 0.

  Raises:
    ConfigError: the value is neither `dynamic` nor a positive number.
  """
  if value is None or value == "":
    return None
  if isinstance(value, str) and value.strip().lower() == "dynamic":
    return "dynamic"
  try:
    number = float(value)
  except (TypeError, ValueError):
    number = float("nan")
  if not math.isfinite(number) or number <= 0:
    raise ConfigError(
        f"--loss_scale={value!r} is neither 'dynamic' nor a positive number. "
        "Use --loss_scale=dynamic or, for a fixed scale, e.g. --loss_scale=128.")
  return number


def _split_list(value) -> Tuple[str, ...]:
  if value is None:
    return ()
  if isinstance(value, (list, tuple)):
    items = value
  else:
    items = str(value).split(",")
  return tuple(str(item).strip() for item in items if str(item).strip())


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything one training run needs, validated and immutable.

  Field names follow the flags of the same name (`--model_dir` is
  `model_dir`). See `flags/` for the help text of each. Units: steps are
  optimizer updates; batch sizes are examples; learning rates are per step.

  Raises (on construction):
    ConfigError: a field is out of range or inconsistent with another; the
      message names the flag, the value and how to fix it.
  """
  # Model and data.
  model: str = "cnn"
  dataset: str = "fashion_mnist"
  data_dir: str = ""
  raw_data_dir: str = ""
  train_files: str = ""
  eval_files: str = ""
  shuffle_buffer_size: int = 10_000
  cache_dataset: bool = True
  # Recommendation models (models/ranking.py): embedding width and rows of
  # each hashed id table.
  embedding_dim: int = 16
  hash_buckets: int = 100_000
  # Where artifacts go.
  model_dir: str = ""
  checkpoint_dir: str = ""
  tensorboard_dir: str = ""
  export_dir: str = ""
  # Length of training.
  train_steps: int = 0
  train_epochs: int = 0
  epochs_between_evals: int = 1
  checkpoint_steps: int = 0
  max_checkpoints: int = 5
  log_steps: int = 100
  # None: 1, or TPU_DEFAULT_STEPS_PER_EXECUTION when the strategy is TPU.
  steps_per_execution: Optional[int] = None
  # Batch.
  batch_size: Optional[int] = None
  per_replica_batch_size: Optional[int] = None
  gradient_accumulation_steps: int = 1
  # Strategy and devices.
  distribution_strategy: str = "auto"
  num_gpus: int = -1
  num_cpu_devices: int = 0
  all_reduce_alg: str = "auto"
  # Multi-worker cluster (see tfdist/cluster.py for TF_CONFIG/CLUSTER_SPEC).
  worker_hosts: str = ""
  task_index: int = -1
  collective_timeout_seconds: float = 300.0
  cluster_start_timeout_seconds: float = 900.0
  preemption_grace_seconds: float = 30.0
  # Parameter-server training: how embedding tables are sharded over the ps
  # tasks (0 shards: one per ps task).
  ps_partitioner: str = "min_size"
  ps_min_shard_bytes: int = 256 << 10
  ps_max_shards: int = 0
  # Precision.
  # None: fp32, or bf16 when the strategy is TPU (see `defaulted`).
  dtype: Optional[str] = None
  loss_scale: Optional[object] = None
  enable_xla: bool = False
  # TPU (Model Garden's names).
  tpu: str = ""
  tpu_zone: str = ""
  tpu_gcp_project: str = ""
  tpu_init_timeout: float = 300.0
  # Optimizer and learning rate.
  optimizer: str = "sgd"
  momentum: float = 0.9
  weight_decay: float = 0.0
  base_learning_rate: float = 0.1
  base_batch_size: int = 256
  lr_scaling: str = "linear"
  warmup_steps: Optional[int] = None
  warmup_epochs: Optional[float] = None
  warmup_start_learning_rate: float = 0.0
  lr_schedule: str = "constant"
  end_learning_rate_factor: float = 0.0
  piecewise_boundaries: Tuple[float, ...] = (0.5, 0.75)
  piecewise_multipliers: Tuple[float, ...] = (1.0, 0.1, 0.01)
  # Misc.
  seed: Optional[int] = 42
  run_eagerly: bool = False
  flags_snapshot: Tuple[Tuple[str, str], ...] = ()
  # Fields left unset (None) and filled with their default; the hardware may
  # still change those (bf16 and more steps per execution on TPU). Set by
  # __post_init__, never by callers.
  defaulted: Tuple[str, ...] = ()
  # glibc malloc settings that stop TensorFlow's per-step page-fault churn
  # (tfdist/allocator.py); False leaves malloc as it is.
  tune_allocator: bool = True

  def __post_init__(self):
    set_ = lambda name, value: object.__setattr__(self, name, value)
    defaulted = set(self.defaulted)
    for name, default in (("dtype", "fp32"), ("steps_per_execution", 1)):
      if getattr(self, name) is None:
        tpu_default = {"dtype": "bf16", "steps_per_execution":
                       TPU_DEFAULT_STEPS_PER_EXECUTION}[name]
        set_(name, tpu_default if str(self.distribution_strategy).lower() ==
             "tpu" else default)
        defaulted.add(name)
    set_("defaulted", tuple(sorted(defaulted)))
    set_("dtype", normalize_dtype(self.dtype))
    set_("loss_scale", parse_loss_scale(self.loss_scale))
    set_("piecewise_boundaries",
         tuple(float(b) for b in _split_list(self.piecewise_boundaries)))
    set_("piecewise_multipliers",
         tuple(float(m) for m in _split_list(self.piecewise_multipliers)))
    set_("distribution_strategy", str(self.distribution_strategy).lower())
    set_("flags_snapshot", tuple(tuple(kv) for kv in self.flags_snapshot))
    self._apply_vertex_environment()
    self._validate()

  # --- Vertex AI -----------------------------------------------------------
  def _apply_vertex_environment(self):
    """Fills unset output folders from Vertex AI's AIP_* variables."""
    set_ = lambda name, value: object.__setattr__(self, name, value)
    env = os.environ
    if not self.model_dir:
      base = env.get("AIP_CHECKPOINT_DIR") or env.get("AIP_MODEL_DIR")
      if base:
        set_("model_dir", base)
    if not self.checkpoint_dir and env.get("AIP_CHECKPOINT_DIR"):
      set_("checkpoint_dir", env["AIP_CHECKPOINT_DIR"])
    if not self.tensorboard_dir and env.get("AIP_TENSORBOARD_LOG_DIR"):
      set_("tensorboard_dir", env["AIP_TENSORBOARD_LOG_DIR"])
    if not self.export_dir and env.get("AIP_MODEL_DIR"):
      set_("export_dir", env["AIP_MODEL_DIR"])

  def _validate(self):
    def need(cond, message):
      if not cond:
        raise ConfigError(message)

    need(self.model_dir,
         "--model_dir is required (or set AIP_MODEL_DIR / AIP_CHECKPOINT_DIR "
         "as Vertex AI does). Example: --model_dir=/tmp/tfdist_run.")
    need(self.distribution_strategy in STRATEGIES,
         f"--distribution_strategy={self.distribution_strategy!r} is unknown. "
         f"Use one of: {', '.join(STRATEGIES)}.")
    need(self.lr_scaling in LR_SCALING_RULES,
         f"--lr_scaling={self.lr_scaling!r} is unknown. Use one of: "
         f"{', '.join(LR_SCALING_RULES)}.")
    need(self.lr_schedule in LR_SCHEDULES,
         f"--lr_schedule={self.lr_schedule!r} is unknown. Use one of: "
         f"{', '.join(LR_SCHEDULES)}.")
    need(self.optimizer in OPTIMIZERS,
         f"--optimizer={self.optimizer!r} is unknown. Use one of: "
         f"{', '.join(OPTIMIZERS)}.")
    need(self.all_reduce_alg in ALL_REDUCE_ALGS,
         f"--all_reduce_alg={self.all_reduce_alg!r} is unknown. Use one of: "
         f"{', '.join(ALL_REDUCE_ALGS)}.")
    need(self.train_steps >= 0,
         f"--train_steps={self.train_steps} must be >= 0 (0: use --train_epochs).")
    need(self.train_epochs >= 0,
         f"--train_epochs={self.train_epochs} must be >= 0.")
    need(self.train_steps > 0 or self.train_epochs > 0,
         "Set how long to train: --train_steps=N or --train_epochs=N "
         f"(received --train_steps={self.train_steps}, "
         f"--train_epochs={self.train_epochs}).")
    for name in ("batch_size", "per_replica_batch_size"):
      value = getattr(self, name)
      need(value is None or value > 0,
           f"--{name}={value} must be a positive number of examples.")
    need(self.gradient_accumulation_steps == 1,
         f"--gradient_accumulation_steps={self.gradient_accumulation_steps}: "
         "only 1 is supported so far.")
    need(self.base_batch_size > 0,
         f"--base_batch_size={self.base_batch_size} must be > 0.")
    need(self.base_learning_rate > 0,
         f"--base_learning_rate={self.base_learning_rate} must be > 0.")
    need(self.warmup_start_learning_rate >= 0,
         f"--warmup_start_learning_rate={self.warmup_start_learning_rate} "
         "must be >= 0.")
    need(self.warmup_steps is None or self.warmup_epochs is None,
         f"--warmup_steps={self.warmup_steps} and --warmup_epochs="
         f"{self.warmup_epochs} were both given: pass only one.")
    need(self.warmup_steps is None or self.warmup_steps >= 0,
         f"--warmup_steps={self.warmup_steps} must be >= 0.")
    need(self.warmup_epochs is None or self.warmup_epochs >= 0,
         f"--warmup_epochs={self.warmup_epochs} must be >= 0.")
    need(0.0 <= self.end_learning_rate_factor <= 1.0,
         f"--end_learning_rate_factor={self.end_learning_rate_factor} must be "
         "in [0, 1].")
    need(len(self.piecewise_multipliers) == len(self.piecewise_boundaries) + 1,
         "--piecewise_multipliers needs exactly one more value than "
         f"--piecewise_boundaries. Received {len(self.piecewise_boundaries)} "
         f"boundaries and {len(self.piecewise_multipliers)} multipliers.")
    need(all(0.0 < b < 1.0 for b in self.piecewise_boundaries) and
         list(self.piecewise_boundaries) == sorted(self.piecewise_boundaries),
         f"--piecewise_boundaries={','.join(map(str, self.piecewise_boundaries))}"
         " must be increasing fractions of training in (0, 1), e.g. 0.5,0.75.")
    need(self.log_steps > 0, f"--log_steps={self.log_steps} must be > 0.")
    need(self.steps_per_execution > 0,
         f"--steps_per_execution={self.steps_per_execution} must be > 0.")
    need(self.checkpoint_steps >= 0,
         f"--checkpoint_steps={self.checkpoint_steps} must be >= 0 "
         "(0: checkpoint at the end of every epoch).")
    need(self.max_checkpoints > 0,
         f"--max_checkpoints={self.max_checkpoints} must be > 0.")
    need(self.epochs_between_evals > 0,
         f"--epochs_between_evals={self.epochs_between_evals} must be > 0.")
    need(self.num_cpu_devices >= 0,
         f"--num_cpu_devices={self.num_cpu_devices} must be >= 0.")
    need(self.task_index >= -1,
         f"--task_index={self.task_index} must be >= 0 (-1: unset).")
    need(self.collective_timeout_seconds > 0,
         f"--collective_timeout_seconds={self.collective_timeout_seconds} "
         "must be > 0.")
    need(self.cluster_start_timeout_seconds > 0,
         "--cluster_start_timeout_seconds="
         f"{self.cluster_start_timeout_seconds} must be > 0.")
    need(self.preemption_grace_seconds > 0,
         f"--preemption_grace_seconds={self.preemption_grace_seconds} must be "
         "> 0.")
    need(self.num_gpus >= -1,
         f"--num_gpus={self.num_gpus} must be -1 (all visible), 0 or more.")
    need(self.shuffle_buffer_size >= 0,
         f"--shuffle_buffer_size={self.shuffle_buffer_size} must be >= 0.")
    need(self.embedding_dim > 0,
         f"--embedding_dim={self.embedding_dim} must be > 0.")
    need(self.hash_buckets > 0,
         f"--hash_buckets={self.hash_buckets} must be > 0.")
    need(self.ps_partitioner in PS_PARTITIONERS,
         f"--ps_partitioner={self.ps_partitioner!r} is unknown. Use one of: "
         f"{', '.join(PS_PARTITIONERS)}.")
    need(self.ps_min_shard_bytes > 0,
         f"--ps_min_shard_bytes={self.ps_min_shard_bytes} must be > 0 bytes.")
    need(self.ps_max_shards >= 0,
         f"--ps_max_shards={self.ps_max_shards} must be >= 0 (0: one shard "
         "per ps task).")
    need(self.tpu_init_timeout > 0,
         f"--tpu_init_timeout={self.tpu_init_timeout} must be > 0 seconds.")
    need(self.distribution_strategy != "tpu" or self.tpu.strip() or
         os.environ.get("TPU_NAME"),
         "--distribution_strategy=tpu needs --tpu: `local` on a Cloud TPU "
         "VM, the TPU's name (with --tpu_zone and --tpu_gcp_project), or "
         "grpc://HOST:8470 (or set $TPU_NAME).")
    if self.distribution_strategy == "tpu" and self.dtype == "fp16":
      raise ConfigError(
          "--dtype=fp16 is not supported with --distribution_strategy=tpu: "
          "TPUs compute in bfloat16 and have no float16 arithmetic. Use "
          "--dtype=bf16 (the TPU default), --dtype=auto or --dtype=fp32.")
    need(isinstance(self.tune_allocator, bool),
         f"--tune_allocator={self.tune_allocator!r} must be true or false.")
    if self.loss_scale is not None and self.dtype not in ("fp16", "auto"):
      raise ConfigError(
          f"--loss_scale={self.loss_scale} only applies to --dtype=fp16 "
          f"(received --dtype={self.dtype}). Drop --loss_scale or use "
          "--dtype=fp16.")

  # --- Derived paths -------------------------------------------------------
  @property
  def resolved_checkpoint_dir(self) -> str:
    return self.checkpoint_dir or os.path.join(self.model_dir, "checkpoints")

  @property
  def resolved_tensorboard_dir(self) -> str:
    return self.tensorboard_dir or self.model_dir

  @property
  def resolved_export_dir(self) -> str:
    return self.export_dir or os.path.join(self.model_dir, "saved_model")

  def replace(self, **changes) -> "TrainConfig":
    """Returns a copy with `changes` applied (and validated again)."""
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict:
    """A JSON-serializable dict of every field."""
    out = dataclasses.asdict(self)
    out["flags_snapshot"] = dict(self.flags_snapshot)
    return json.loads(json.dumps(out, default=str))
