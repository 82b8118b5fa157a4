"""The frozen run configuration, read once by the run assembly.

Flags are parsed only at the binary's edge (`flags/`, `tfdist/train.py`); they
become a `TrainConfig` once. The run assembly (`tfdist.experiment`) reads it
and hands each part below it (strategy, batch plan, learning rate, input
pipeline, training loop, artifacts) its own small options object or plain
arguments, converted in one place (`tfdist.training.run_options`). A
`TrainConfig` can therefore be built and used without absl.

Validation happens in `__post_init__`, before any expensive work starts, one
short validator per concern (`TrainConfig._validate` lists them in order of
precedence); every error names the flag, the bad value and the fix.
"""

import dataclasses
import json
import math
import os
import re
from typing import Optional, Tuple

from tfdist.distribute.strategy_kind import StrategyKind
from tfdist import errors
from tfdist.parallel import pipeline_options
from tfdist.parallel import tensor_parallel_options
from tfdist.training import decay_schedules
from tfdist.training import optimizers
from tfdist.training import reduce_dtype
from tfdist.training import training_checks

# `--distribution_strategy` values: every concrete kind, then `auto`
# (tfdist.distribute.auto_select picks a kind for it).
AUTO_STRATEGY = "auto"
STRATEGIES = tuple(kind.value for kind in StrategyKind) + (AUTO_STRATEGY,)
DTYPES = ("fp32", "bf16", "fp16", "auto")
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
                 "fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "auto": "auto"}
LR_SCALING_RULES = ("linear", "sqrt", "none")
# Strategies under which --zero_stage > 0 runs (auto resolves to one of
# them or is refused when the strategy is built: tfdist.training.assembly).
SHARDING_STRATEGIES = (AUTO_STRATEGY,) + tuple(
    kind.value for kind in StrategyKind if kind.is_mirrored)
ALL_REDUCE_ALGS = ("auto", "nccl", "hierarchical_copy", "ring")
PS_PARTITIONERS = ("min_size", "fixed", "max_size", "none")
# Flag values a data set recommends, applied by `flags.flags_to_config` to
# the flags the command line leaves unset (as Model Garden's experiment
# configs do). MovieLens: the ranking model, Adam (SGD with momentum updates
# every row of an embedding table at every step), and batches of 512 (a
# 500-step run then sees about 3 epochs and reaches a held-out AUC near 0.78).
# Clothing reviews: the Transformer with AdamW, batches of 64 (add
# --lr_schedule=cosine --warmup_epochs=0.5 --weight_decay=0.01).
DATASET_RECOMMENDED_FLAGS = {
    "movielens": (("model", "ranking"), ("batch_size", 512),
                  ("optimizer", "adam"), ("base_learning_rate", 0.002),
                  ("lr_scaling", "sqrt")),
    "clothing_reviews": (("model", "transformer"), ("batch_size", 64),
                         ("optimizer", "adamw"), ("base_learning_rate", 0.001),
                         ("lr_scaling", "sqrt")),
}
# What a run does (`--mode`): train and evaluate along the way (the
# default), train only, evaluate the latest checkpoint once, or evaluate
# every checkpoint as it appears (the side-car evaluator).
MODES = ("train_and_eval", "train", "eval", "continuous_eval")
# `dataset` when `--feature_spec` describes the data.
FEATURE_SPEC_DATASET = "feature_spec"
DEFAULT_DATASET = "fashion_mnist"
# `--hptune_metric` reports an evaluation value to Vertex AI's
# hyperparameter tuning: `eval_` and a key of the run's `eval_history`
# (`loss` or the name of one of the model's metrics; tfdist.cloud.hptune checks
# it against the model once built). tfdist's built-in models evaluate these
# (eval_auc for binary tasks such as --dataset=movielens).
HPTUNE_METRICS = ("eval_accuracy", "eval_loss", "eval_auc")
HPTUNE_METRIC_PATTERN = r"eval_[A-Za-z0-9_./-]+"
# Steps per `tf.function` call on TPU when --steps_per_execution is not
# given: each call is a host -> TPU round trip, so TPUs want many steps each.
TPU_DEFAULT_STEPS_PER_EXECUTION = 100
# Fields a data set may recommend: None means "unset", filled in
# `TrainConfig.__post_init__` from DATASET_RECOMMENDED_FLAGS, else from
# UNSET_DEFAULTS (batch_size stays None: 128 unless --per_replica_batch_size
# is given, see tfdist.training.batch_plan).
# The ZeRO switches (`zero_stage` says the same in DeepSpeed's terms).
SHARDING_SWITCHES = ("shard_optimizer_state", "shard_gradients",
                     "shard_parameters")
RECOMMENDABLE_FIELDS = ("model", "batch_size", "optimizer",
                        "base_learning_rate", "lr_scaling")
UNSET_DEFAULTS = {"model": "cnn", "optimizer": "sgd",
                  "base_learning_rate": 0.1, "lr_scaling": "linear"}


def _need(condition, message: str) -> None:
  """Raises `ConfigError(message)` unless `condition` holds."""
  if not condition:
    raise errors.ConfigError(message)


def requested_kind(strategy) -> Optional[StrategyKind]:
  """The `StrategyKind` a `--distribution_strategy` value names.

  Args:
    strategy: a flag value (any case) or a `StrategyKind`.

  Returns:
    The kind; None for `auto` (resolved later by
    `tfdist.distribute.auto_select`) and for names that are no strategy
    (`TrainConfig` rejects those).
  """
  try:
    return StrategyKind.parse(strategy)
  except ValueError:
    return None


def normalize_dtype(value: str) -> str:
  """Maps `--dtype` spellings (`float16`, `fp16`, ...) to `fp32|bf16|fp16|auto`.

  Raises:
    ConfigError: `value` is not a known spelling.
  """
  key = str(value).strip().lower()
  if key not in DTYPE_ALIASES:
    raise errors.ConfigError(
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
    raise errors.ConfigError(
        f"--loss_scale={value!r} is neither 'dynamic' nor a positive number. "
        "Use --loss_scale=dynamic or, for a fixed scale, e.g. --loss_scale=128.")
  return number


def check_tpu_precision(strategy: str, dtype: str, *, why: str = "") -> None:
  """The one check that TPUs get no fp16 (they have no float16 arithmetic).

  Args:
    strategy: the concrete or requested strategy name.
    dtype: the normalized dtype.
    why: how the strategy was chosen, for the message (e.g. "auto: a TPU
      answered").

  Raises:
    ConfigError: `strategy` is `tpu` and `dtype` is `fp16`.
  """
  kind = requested_kind(strategy)
  if kind is not None and kind.is_tpu and dtype == "fp16":
    how = f" ({why})" if why else ""
    raise errors.ConfigError(
        f"--dtype=fp16 is not supported with --distribution_strategy=tpu"
        f"{how}: fp16 is not supported on TPUs, which compute in bfloat16 "
        "and have no float16 arithmetic or loss scaling. Use --dtype=bf16 "
        "(the TPU default), --dtype=auto or --dtype=fp32.")


def parse_profile_steps(value) -> Tuple[int, ...]:
  """Parses `--profile_steps`: `START,END` (1-based training steps, both
  traced), a single `N` (that step alone), or empty (no trace).

  Returns:
    `(START, END)`, or `()`.

  Raises:
    ConfigError: not one or two integers with 1 <= START <= END.
  """
  items = _split_list(value)
  if not items:
    return ()
  try:
    steps = tuple(int(item) for item in items)
  except ValueError:
    steps = ()
  if len(steps) == 1:
    steps = steps * 2
  if len(steps) != 2 or not 1 <= steps[0] <= steps[1]:
    raise errors.ConfigError(
        f"--profile_steps={','.join(items)} is not a window of training "
        "steps. Use --profile_steps=START,END with 1 <= START <= END (steps "
        "are counted from 1 and both ends are traced), e.g. "
        "--profile_steps=20,25.")
  return steps


def parse_class_weight(value) -> Tuple[Tuple[int, float], ...]:
  """Parses `--class_weight`: a dict `{class id: weight}`, `ID:WEIGHT`
  items (a list, or one comma-separated string such as `0:1,1:4.5`),
  `(id, weight)` pairs, or empty (no class weights).

  Returns:
    `((id, weight), ...)` sorted by id: ids ints >= 0, weights floats >= 0.

  Raises:
    ConfigError: an item that is not `ID:WEIGHT`, an id given twice, a
      negative id or weight, a dict key that is a string or bool (which
      `keras.Model.fit` would ignore).
  """
  if isinstance(value, dict):
    named = [k for k in value if isinstance(k, (str, bytes, bool))]
    if named:
      raise errors.ConfigError(
          f"class_weight key {named[0]!r} is not a class id: keras.Model.fit "
          "looks class weights up by integer class id and would ignore it "
          "(every class weighing 1). Use integer keys, e.g. "
          "class_weight={0: 1.0, 1: 4.0} (or --class_weight=0:1.0,1:4.0).")
    items = list(value.items())
  elif value and all(isinstance(v, (tuple, list)) and len(v) == 2
                     for v in value) and not isinstance(value, str):
    items = [tuple(v) for v in value]
  else:
    items = [tuple(item.split(":", 1)) if ":" in item else (item,)
             for item in _split_list(value)]
  pairs = {}
  for item in items:
    try:
      key, weight = item
      key_float, weight = float(key), float(weight)
      if key_float != int(key_float) or key_float < 0 or weight < 0:
        raise ValueError
      key = int(key_float)
      if key in pairs:
        raise ValueError
    except (TypeError, ValueError):
      text = ":".join(map(str, item))
      raise errors.ConfigError(
          f"--class_weight item {text!r} is not CLASS_ID:WEIGHT with a class"
          " id (an integer >= 0, each once) and a weight >= 0. Example: "
          "--class_weight=0:1.0,1:4.0 (class 1 counts four times).") from None
    pairs[key] = weight
  return tuple(sorted(pairs.items()))


def check_accumulation_strategy(strategy: str, steps: int) -> None:
  """The one check that gradient accumulation runs under a synchronous
  strategy.

  Args:
    strategy: the concrete or requested strategy name (`auto` passes).
    steps: `--gradient_accumulation_steps`.

  Raises:
    ConfigError: `steps` > 1 under `parameter_server`.
  """
  kind = requested_kind(strategy)
  if steps > 1 and kind is not None and not kind.supports_gradient_accumulation:
    raise errors.ConfigError(
        f"--gradient_accumulation_steps={steps} is not supported with "
        "--distribution_strategy=parameter_server: there each worker step is "
        "its own asynchronous update of the shared weights, so there is no "
        "synchronous global batch to split into micro-batches, and "
        "accumulators would live on the ps tasks, shared by every worker. "
        "Raise --batch_size (examples per worker step) instead, or use "
        "multi_worker_mirrored.")


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
  # --- Model and data set ---
  # None: the data set's recommendation, else the default
  # (see UNSET_DEFAULTS and DATASET_RECOMMENDED_FLAGS). A model or data set
  # is a registered name or an import path `package.module:function`
  # (tfdist.training.registry). None for the data set: fashion_mnist, or
  # FEATURE_SPEC_DATASET with a feature_spec.
  model: Optional[str] = None
  dataset: Optional[str] = None
  data_dir: str = ""
  raw_data_dir: str = ""
  train_files: str = ""
  eval_files: str = ""
  shuffle_buffer_size: int = 10_000
  cache_dataset: bool = True
  # --- Recommendation models' embeddings (models/ranking.py) ---
  # The embedding width and the rows of each hashed id table.
  embedding_dim: int = 16
  hash_buckets: int = 100_000
  # The Transformer's encoder blocks (models/transformer.py).
  transformer_layers: int = 2
  # --- Output folders ---
  model_dir: str = ""
  checkpoint_dir: str = ""
  tensorboard_dir: str = ""
  export_dir: str = ""
  # --- Length of training, checkpoints, logging ---
  train_steps: int = 0
  train_epochs: int = 5
  epochs_between_evals: int = 1
  checkpoint_steps: int = 0
  max_checkpoints: int = 5
  log_steps: int = 100
  # None: 1, or TPU_DEFAULT_STEPS_PER_EXECUTION when the strategy is TPU.
  steps_per_execution: Optional[int] = None
  # --- Batch and gradient accumulation ---
  batch_size: Optional[int] = None
  per_replica_batch_size: Optional[int] = None
  gradient_accumulation_steps: int = 1
  # --- Strategy and devices ---
  distribution_strategy: str = "auto"
  num_gpus: int = -1
  num_cpu_devices: int = 0
  all_reduce_alg: str = "auto"
  bytes_per_pack: int = 0
  # The dtype gradients travel in between replicas (float32, bfloat16,
  # float16): tfdist/training/reduce_dtype.py.
  all_reduce_dtype: str = reduce_dtype.FLOAT32
  # --- Multi-worker cluster (tfdist/distribute/cluster.py: TF_CONFIG, CLUSTER_SPEC) ---
  worker_hosts: str = ""
  task_index: int = -1
  collective_timeout_seconds: float = 0.0
  cluster_start_timeout_seconds: float = 900.0
  preemption_grace_seconds: float = 30.0
  # --- Parameter-server variable sharding ---
  # How embedding tables are sharded over the ps
  # tasks (0 shards: one per ps task).
  ps_partitioner: str = "min_size"
  ps_min_shard_bytes: int = 256 << 10
  ps_max_shards: int = 0
  # --- Precision and compilation ---
  # None: fp32, or bf16 when the strategy is TPU (see `defaulted`).
  dtype: Optional[str] = None
  loss_scale: Optional[object] = None
  enable_xla: bool = False
  # --- TPU connection (Model Garden's names) ---
  tpu: str = ""
  tpu_zone: str = ""
  tpu_gcp_project: str = ""
  tpu_init_timeout: float = 300.0
  # --- Optimizer and learning-rate schedule ---
  optimizer: Optional[str] = None
  momentum: float = 0.9
  weight_decay: float = 0.0
  base_learning_rate: Optional[float] = None
  base_batch_size: int = 256
  lr_scaling: Optional[str] = None
  warmup_steps: Optional[int] = None
  warmup_epochs: Optional[float] = None
  warmup_start_learning_rate: float = 0.0
  lr_schedule: str = "constant"
  end_learning_rate_factor: float = 0.0
  piecewise_boundaries: Tuple[float, ...] = (0.5, 0.75)
  piecewise_multipliers: Tuple[float, ...] = (1.0, 0.1, 0.01)
  # --- Seed, eager execution, the flags as given ---
  seed: Optional[int] = 42
  run_eagerly: bool = False
  flags_snapshot: Tuple[Tuple[str, str], ...] = ()
  # --- Bookkeeping, set by __post_init__ ---
  # Fields left unset (None) and filled with their default; the hardware may
  # still change those (bf16 and more steps per execution on TPU). Set by
  # __post_init__, never by callers.
  defaulted: Tuple[str, ...] = ()
  # Fields left unset (None) and filled from the data set's recommendation
  # or the default (UNSET_DEFAULTS). Set by __post_init__, never by callers.
  unset_fields: Tuple[str, ...] = ()
  # --- Vertex AI: Reduction Server and hyperparameter tuning ---
  # Vertex AI's Reduction Server runs in worker pool 2: NCCL all-reduce under
  # multi_worker_mirrored (GPUs only); pool 2 is neither ps nor worker.
  reduction_server: bool = False
  # Report this evaluation metric to Vertex AI's hyperparameter tuning
  # (cloudml-hypertune) after each evaluation; None reports nothing.
  hptune_metric: Optional[str] = None
  # --- Gradient clipping and the skipped-step guard ---
  # Gradient clipping (Keras optimizer options), applied once per step to
  # the gradient summed over all replicas and unscaled (fp16). None: off.
  clipnorm: Optional[float] = None
  global_clipnorm: Optional[float] = None
  # Fail once this many steps in a row made no update (fp16 overflow);
  # 0: no limit (a run with no update at all still fails at its end).
  max_consecutive_skipped_steps: int = (
      training_checks.DEFAULT_MAX_CONSECUTIVE_SKIPPED_STEPS)
  # --- Batch normalization across replicas ---
  # Built-in models' batch normalization: statistics over the global batch
  # (synchronized across replicas) or per replica. None: synchronized under
  # synchronous strategies with more than one replica (see
  # tfdist.models.resolve_sync_batch_norm).
  sync_batch_norm: Optional[bool] = None
  # --- Activation recomputation and op determinism ---
  # The model's blocks recompute their activations in the backward pass
  # (--activation_recomputation, alias --gradient_checkpointing): built-in
  # cnn and resnet, and builders taking `activation_recomputation`.
  activation_recomputation: bool = False
  # Op determinism and a deterministic input order (needs --seed).
  deterministic: bool = False
  # --- Sharded data parallelism (ZeRO, Rajbhandari et al. 2020) ---
  # Each replica keeps the optimizer state of 1/N of the parameters (stage
  # 1); with shard_gradients also its shard of the gradient accumulators
  # (stage 2); with shard_parameters also the weights (stage 3,
  # tfdist/parallel/zero3.py). zero_stage (0-3) says the same in DeepSpeed's
  # terms;
  # None: from the two switches. The switches: None (unset) becomes False
  # (see `defaulted`), so a switch given as False can contradict
  # zero_stage. See `zero_stage_resolved` and
  # tfdist/training/sharded_optimizer.py.
  shard_optimizer_state: Optional[bool] = None
  shard_gradients: Optional[bool] = None
  shard_parameters: Optional[bool] = None
  zero_stage: Optional[int] = None
  # --- Pipeline parallelism (tfdist/parallel/pipeline_options.py) ---
  # P stages on P devices (1: off), M micro-batches per step (None: P),
  # the schedule, and the layers that begin stages 2..P (empty: balanced).
  pipeline_stages: int = 1
  num_microbatches: Optional[int] = None
  pipeline_schedule: str = "gpipe"
  pipeline_cuts: Tuple[str, ...] = ()
  # --- Tensor parallelism (tfdist/parallel/tensor_parallel_options.py) ---
  # N replicas of one host split the Transformer's heads and units (1: off).
  tensor_parallel: int = 1
  # --- Resuming mid-epoch ---
  # Checkpoints record the input order, and a resumed run continues its
  # epoch where it stopped (each worker recomputes its position from the
  # step; tfdist.data.input_pipeline). False: a resume starts its epoch over.
  checkpoint_input_position: bool = True
  # --- Your own model and data: feature spec, imports, weights, mode ---
  # A JSON feature spec describing --train_files/--eval_files records
  # (tfdist.data.feature_spec); the data set is then FEATURE_SPEC_DATASET.
  feature_spec: str = ""
  # Per-class training weights `{class id: weight}` (Keras's `fit(...,
  # class_weight=...)`): a dict, or `ID:WEIGHT` items (a list or one
  # comma-separated string); stored as sorted `(id, weight)` pairs.
  class_weight: Tuple[Tuple[int, float], ...] = ()
  # Modules imported before --model/--dataset are looked up (their
  # @tfdist.register_model / register_dataset calls run).
  import_modules: Tuple[str, ...] = ()
  # Weights loaded into the model before training starts (not when
  # resuming): a checkpoint (file prefix or folder) or a Keras
  # `.weights.h5` file.
  init_checkpoint: str = ""
  # One of MODES.
  mode: str = "train_and_eval"
  # --- Host memory allocator ---
  # glibc malloc settings that stop TensorFlow's per-step page-fault churn
  # (tfdist/runtime/allocator.py); False leaves malloc as it is.
  tune_allocator: bool = True
  # --- Profiler window ---
  # Trace training steps START..END (1-based, inclusive) with TensorFlow's
  # profiler into the TensorBoard folder; () traces nothing.
  profile_steps: Tuple[int, ...] = ()
  # --- Divergence warning, the --model_dir lease, resume checks ---
  # Warn when the training loss exceeds this multiple of its early value
  # (the first log point's mean loss); 0: no warning.
  loss_explosion_factor: float = 10.0
  # The chief's lease on --model_dir (tfdist.distribute.lease): renewed every
  # quarter of this; a lease not renewed for this long may be taken over.
  lease_timeout_seconds: float = 60.0
  # Resume even when the model or the global batch differs from the
  # checkpoint's run (tfdist.training.checkpointing.check_resume).
  allow_incompatible_resume: bool = False
  # --- Dry run ---
  # Run every start-up check, print the plan and return before building
  # the model.
  dry_run: bool = False

  def __post_init__(self):
    set_ = lambda name, value: object.__setattr__(self, name, value)
    defaulted = []
    for name, default in (("dtype", "fp32"), ("steps_per_execution", 1)):
      if getattr(self, name) is None:
        tpu_default = {"dtype": "bf16", "steps_per_execution":
                       TPU_DEFAULT_STEPS_PER_EXECUTION}[name]
        kind = requested_kind(self.distribution_strategy)
        set_(name, tpu_default if kind is not None and kind.is_tpu else
             default)
        defaulted.append(name)
    for name in SHARDING_SWITCHES:
      if getattr(self, name) is None:
        set_(name, False)
        defaulted.append(name)
    set_("defaulted", tuple(sorted(defaulted)))
    set_("import_modules", _split_list(self.import_modules))
    dataset_unset = self.dataset is None
    if dataset_unset:
      set_("dataset", FEATURE_SPEC_DATASET if self.feature_spec else
           DEFAULT_DATASET)
    # Fields the caller left unset: the data set's recommendation, else the
    # default. Flags and fields the caller set always win.
    recommended = dict(DATASET_RECOMMENDED_FLAGS.get(self.dataset, ()))
    if self.per_replica_batch_size is not None:
      recommended.pop("batch_size", None)
    unset = []
    for name in RECOMMENDABLE_FIELDS:
      if getattr(self, name) is None:
        value = recommended.get(name, UNSET_DEFAULTS.get(name))
        if value is not None or name in recommended:
          unset.append(name)
        set_(name, value)
    if dataset_unset:
      unset.append("dataset")
    set_("unset_fields", tuple(sorted(unset)))
    set_("dtype", normalize_dtype(self.dtype))
    set_("loss_scale", parse_loss_scale(self.loss_scale))
    set_("piecewise_boundaries",
         tuple(float(b) for b in _split_list(self.piecewise_boundaries)))
    set_("piecewise_multipliers",
         tuple(float(m) for m in _split_list(self.piecewise_multipliers)))
    set_("distribution_strategy", str(self.distribution_strategy).lower())
    set_("flags_snapshot", tuple(tuple(kv) for kv in self.flags_snapshot))
    set_("profile_steps", parse_profile_steps(self.profile_steps))
    set_("class_weight", parse_class_weight(self.class_weight))
    set_("pipeline_cuts", pipeline_options.parse_cuts(self.pipeline_cuts))
    self._validate()

  @property
  def recommended_applied(self) -> Tuple[Tuple[str, object], ...]:
    """`(field, value)` pairs the data set's recommendation filled in."""
    recommended = dict(DATASET_RECOMMENDED_FLAGS.get(self.dataset, ()))
    return tuple((name, getattr(self, name)) for name in self.unset_fields
                 if name in recommended and
                 getattr(self, name) == recommended[name])

  def require_model_dir(self):
    """Raises `ConfigError` when no output folder is known.

    Called once the environment is applied (`tfdist.distribute.environment`),
    since Vertex AI's `AIP_*` variables may supply it.
    """
    if not self.model_dir:
      raise errors.ConfigError(
          "--model_dir is required (or set AIP_CHECKPOINT_DIR as Vertex AI "
          "does). Example: "
          "--model_dir=/tmp/tfdist_run.")

  def require_data_files(self):
    """Raises `ConfigError` when `--feature_spec` has no files to read.

    Called once the environment is applied (`tfdist.distribute.environment`),
    since Vertex AI's `AIP_TRAINING_DATA_URI` / `AIP_VALIDATION_DATA_URI` may
    supply them.
    """
    if not self.feature_spec:
      return
    if not self.train_files and self.mode != "eval":
      raise errors.ConfigError(
          f"--feature_spec={self.feature_spec} describes your TFRecords: "
          "give them as --train_files (and --eval_files), or set "
          "AIP_TRAINING_DATA_URI with AIP_DATA_FORMAT=tf-record.")
    if not self.eval_files and self.mode != "train":
      raise errors.ConfigError(
          f"--feature_spec={self.feature_spec} describes your TFRecords: "
          "give the evaluation files as --eval_files (or set "
          "AIP_VALIDATION_DATA_URI with AIP_DATA_FORMAT=tf-record; or train "
          "only: --mode=train).")

  def _validate(self):
    """Runs every validator in order; the first broken rule raises.

    The order is the precedence of the messages for a config that is wrong
    in several ways: names first, then lengths, batch, learning rate, and so
    on down to precision.
    """
    for validate in (self._validate_choices, self._validate_length,
                     self._validate_batch, self._validate_determinism,
                     self._validate_learning_rate, self._validate_loop,
                     self._validate_cluster, self._validate_inputs,
                     self._validate_parameter_servers, self._validate_tpu,
                     self._validate_model_and_data,
                     self._validate_async_precision,
                     self._validate_vertex_ai, self._validate_clipping,
                     self._validate_sharding, self._validate_pipeline,
                     self._validate_tensor_parallel,
                     self._validate_step_guards,
                     self._validate_reliability, self._validate_loss_scale):
      validate()

  @property
  def _strategy_kind(self) -> Optional[StrategyKind]:
    """The requested strategy's kind; None for `auto` (not yet resolved)."""
    return requested_kind(self.distribution_strategy)

  def _validate_choices(self):
    """Flags that take one of a closed set of names."""
    for flag, value, choices in (
        ("distribution_strategy", self.distribution_strategy, STRATEGIES),
        ("lr_scaling", self.lr_scaling, LR_SCALING_RULES),
        ("all_reduce_alg", self.all_reduce_alg, ALL_REDUCE_ALGS)):
      _need(value in choices, f"--{flag}={value!r} is unknown. Use one of: "
            f"{', '.join(choices)}.")
    if self.optimizer is not None:
      optimizers.optimizer_spec(self.optimizer)  # Raises for an unknown one.
    decay_schedules.check_decay_schedule(self.lr_schedule)

  def _validate_length(self):
    """How long to train: steps or epochs."""
    _need(self.train_steps >= 0, f"--train_steps={self.train_steps} must be "
          ">= 0 (0: use --train_epochs).")
    _need(self.train_epochs >= 0,
          f"--train_epochs={self.train_epochs} must be >= 0.")
    _need(self.train_steps > 0 or self.train_epochs > 0,
          "Set how long to train: --train_steps=N or --train_epochs=N "
          f"(received --train_steps={self.train_steps}, "
          f"--train_epochs={self.train_epochs}).")

  def _validate_batch(self):
    """Batch sizes and gradient accumulation."""
    for name in ("batch_size", "per_replica_batch_size"):
      value = getattr(self, name)
      _need(value is None or value > 0,
            f"--{name}={value} must be a positive number of examples.")
    _need(self.gradient_accumulation_steps >= 1,
          f"--gradient_accumulation_steps={self.gradient_accumulation_steps} "
          "must be >= 1 (1: no accumulation).")
    check_accumulation_strategy(self.distribution_strategy,
                                self.gradient_accumulation_steps)

  def _validate_determinism(self):
    """--deterministic: needs a seed and a synchronous strategy."""
    _need(not self.deterministic or self.seed is not None,
          "--deterministic needs a --seed (the seed fixes the initial "
          "weights, dropout and the input order); received no seed. Pass "
          "e.g. --seed=42 or drop --deterministic.")
    kind = self._strategy_kind
    _need(not (self.deterministic and kind is not None and
               kind.is_asynchronous),
          "--deterministic is not supported with --distribution_strategy="
          "parameter_server: asynchronous workers apply their updates in "
          "whatever order they finish. Use a synchronous strategy "
          "(one_device, mirrored, multi_worker_mirrored) or drop "
          "--deterministic.")

  def _validate_learning_rate(self):
    """Base learning rate and batch, warmup, and the schedule's shape."""
    _need(self.base_batch_size > 0,
          f"--base_batch_size={self.base_batch_size} must be > 0.")
    _need(self.base_learning_rate > 0,
          f"--base_learning_rate={self.base_learning_rate} must be > 0.")
    _need(self.warmup_start_learning_rate >= 0,
          f"--warmup_start_learning_rate={self.warmup_start_learning_rate} "
          "must be >= 0.")
    _need(self.warmup_steps is None or self.warmup_epochs is None,
          f"--warmup_steps={self.warmup_steps} and --warmup_epochs="
          f"{self.warmup_epochs} were both given: pass only one.")
    _need(self.warmup_steps is None or self.warmup_steps >= 0,
          f"--warmup_steps={self.warmup_steps} must be >= 0.")
    _need(self.warmup_epochs is None or self.warmup_epochs >= 0,
          f"--warmup_epochs={self.warmup_epochs} must be >= 0.")
    _need(0.0 <= self.end_learning_rate_factor <= 1.0,
          f"--end_learning_rate_factor={self.end_learning_rate_factor} must "
          "be in [0, 1].")
    boundaries = self.piecewise_boundaries
    _need(len(self.piecewise_multipliers) == len(boundaries) + 1,
          "--piecewise_multipliers needs exactly one more value than "
          f"--piecewise_boundaries. Received {len(boundaries)} "
          f"boundaries and {len(self.piecewise_multipliers)} multipliers.")
    _need(all(0.0 < b < 1.0 for b in boundaries) and
          list(boundaries) == sorted(boundaries),
          f"--piecewise_boundaries={','.join(map(str, boundaries))}"
          " must be increasing fractions of training in (0, 1), e.g. "
          "0.5,0.75.")

  def _validate_loop(self):
    """Logging, steps per call, checkpoints and evaluations."""
    _need(self.log_steps > 0, f"--log_steps={self.log_steps} must be > 0.")
    _need(self.steps_per_execution > 0,
          f"--steps_per_execution={self.steps_per_execution} must be > 0.")
    _need(self.checkpoint_steps >= 0,
          f"--checkpoint_steps={self.checkpoint_steps} must be >= 0 "
          "(0: checkpoint at the end of every epoch).")
    _need(self.max_checkpoints > 0,
          f"--max_checkpoints={self.max_checkpoints} must be > 0.")
    _need(self.epochs_between_evals > 0,
          f"--epochs_between_evals={self.epochs_between_evals} must be > 0.")

  def _validate_cluster(self):
    """Devices, the task index and the cluster's timeouts."""
    _need(self.num_cpu_devices >= 0,
          f"--num_cpu_devices={self.num_cpu_devices} must be >= 0.")
    _need(self.task_index >= -1,
          f"--task_index={self.task_index} must be >= 0 (-1: unset).")
    _need(self.bytes_per_pack >= 0,
          f"--bytes_per_pack={self.bytes_per_pack} must be >= 0 (0: the "
          "gradients in one all-reduce).")
    if self.bytes_per_pack:
      kind = self._strategy_kind
      # `auto` is checked again once decided (tfdist.distribute.strategy).
      _need(kind is None or kind in (StrategyKind.OFF, StrategyKind.ONE_DEVICE,
                                     StrategyKind.MULTI_WORKER_MIRRORED),
            f"--bytes_per_pack={self.bytes_per_pack} applies to "
            f"multi_worker_mirrored, not {self.distribution_strategy} (its "
            "all-reduce does not split the gradients into packs). Drop "
            "--bytes_per_pack.")
      _need(not self.zero_stage_resolved,
            f"--bytes_per_pack={self.bytes_per_pack} does not apply with "
            f"--zero_stage={self.zero_stage_resolved} (ZeRO all-reduces its "
            "flat gradient buffer in one collective, then slices it). Drop "
            "one of them.")
    reduce_dtype.check_config(self.all_reduce_dtype,
                              strategy=self.distribution_strategy,
                              dtype=self.dtype)
    _need(self.collective_timeout_seconds >= 0,
          f"--collective_timeout_seconds={self.collective_timeout_seconds} "
          "must be > 0, or 0 for no per-collective timeout.")
    _need(self.cluster_start_timeout_seconds > 0,
          "--cluster_start_timeout_seconds="
          f"{self.cluster_start_timeout_seconds} must be > 0.")
    _need(self.preemption_grace_seconds > 0,
          f"--preemption_grace_seconds={self.preemption_grace_seconds} must "
          "be > 0.")
    _need(self.num_gpus >= -1,
          f"--num_gpus={self.num_gpus} must be -1 (all visible), 0 or more.")

  def _validate_inputs(self):
    """The input pipeline's buffer and the ranking model's tables."""
    _need(self.shuffle_buffer_size >= 0,
          f"--shuffle_buffer_size={self.shuffle_buffer_size} must be >= 0.")
    _need(self.embedding_dim > 0,
          f"--embedding_dim={self.embedding_dim} must be > 0.")
    _need(self.hash_buckets > 0,
          f"--hash_buckets={self.hash_buckets} must be > 0.")
    _need(self.transformer_layers > 0,
          f"--transformer_layers={self.transformer_layers} must be > 0.")

  def _validate_parameter_servers(self):
    """How parameter servers shard the variables."""
    _need(self.ps_partitioner in PS_PARTITIONERS,
          f"--ps_partitioner={self.ps_partitioner!r} is unknown. Use one of: "
          f"{', '.join(PS_PARTITIONERS)}.")
    _need(self.ps_min_shard_bytes > 0,
          f"--ps_min_shard_bytes={self.ps_min_shard_bytes} must be > 0 "
          "bytes.")
    _need(self.ps_max_shards >= 0,
          f"--ps_max_shards={self.ps_max_shards} must be >= 0 (0: one shard "
          "per ps task).")

  def _validate_tpu(self):
    """The TPU's start-up timeout and precision."""
    _need(self.tpu_init_timeout > 0,
          f"--tpu_init_timeout={self.tpu_init_timeout} must be > 0 seconds.")
    check_tpu_precision(self.distribution_strategy, self.dtype)

  def _validate_model_and_data(self):
    """The mode, the model and data set names, and the feature spec."""
    _need(self.mode in MODES,
          f"--mode={self.mode!r} is unknown. Use one of: {', '.join(MODES)}.")
    _need(bool(self.model), "--model must name a model: a registered name "
          "(e.g. cnn) or an import path package.module:build_fn.")
    _need(bool(self.dataset), "--dataset must name a data set: a registered "
          "name (e.g. fashion_mnist) or an import path "
          "package.module:dataset_fn.")
    if self.feature_spec:
      _need(self.dataset == FEATURE_SPEC_DATASET,
            f"--feature_spec={self.feature_spec} and --dataset="
            f"{self.dataset} both say where the data comes from: pass only "
            "one.")
      # Its --train_files/--eval_files are checked by `require_data_files`
      # once the environment is applied (Vertex AI's AIP_*_DATA_URI).
    else:
      _need(self.dataset != FEATURE_SPEC_DATASET,
            f"--dataset={FEATURE_SPEC_DATASET} needs --feature_spec="
            "FILE.json (the features of your TFRecords).")

  def _validate_async_precision(self):
    """fp16 needs a loss scale that asynchronous workers cannot share."""
    kind = self._strategy_kind
    _need(not (kind is not None and kind.is_asynchronous and
               self.dtype == "fp16"),
          "--dtype=fp16 is not supported with --distribution_strategy="
          "parameter_server: fp16 needs loss scaling, whose scale "
          "asynchronous workers cannot share. Use --dtype=bf16, fp32 or "
          "auto.")

  def _validate_vertex_ai(self):
    """Vertex AI's Reduction Server and hyperparameter-tuning metric."""
    if self.reduction_server:
      kind = self._strategy_kind
      _need(kind is None or kind is StrategyKind.MULTI_WORKER_MIRRORED,
            "--reduction_server needs --distribution_strategy="
            "multi_worker_mirrored or auto (Vertex AI's Reduction Server "
            "serves NCCL all-reduce between workers); received "
            f"--distribution_strategy={self.distribution_strategy}.")
      _need(self.all_reduce_alg in ("auto", "nccl"),
            f"--reduction_server implies --all_reduce_alg=nccl; received "
            f"--all_reduce_alg={self.all_reduce_alg}. Drop --all_reduce_alg "
            "or set it to nccl.")
    _need(not self.hptune_metric or re.fullmatch(HPTUNE_METRIC_PATTERN,
                                                 self.hptune_metric),
          f"--hptune_metric={self.hptune_metric!r} is not an evaluation "
          "metric: give eval_ and the metric's name, e.g. eval_loss or "
          f"{', '.join(n for n in HPTUNE_METRICS if n != 'eval_loss')} for "
          "tfdist's models, eval_<name> for a metric of your model.")

  def _validate_clipping(self):
    """Gradient clipping: positive norms, at most one of the two."""
    for name in ("clipnorm", "global_clipnorm"):
      value = getattr(self, name)
      _need(value is None or (math.isfinite(value) and value > 0),
            f"--{name}={value} must be a positive number (the largest "
            "gradient norm kept), or unset for no clipping.")
    _need(self.clipnorm is None or self.global_clipnorm is None,
          f"--clipnorm={self.clipnorm} and --global_clipnorm="
          f"{self.global_clipnorm} were both given: Keras optimizers take "
          "one. Use --global_clipnorm to clip the norm of all gradients "
          "together, --clipnorm to clip each variable's gradient alone.")

  def _validate_sharding(self):
    """ZeRO stages: offered, consistent, under a strategy that shards."""
    _need(self.zero_stage in (None, 0, 1, 2, 3),
          f"--zero_stage={self.zero_stage} is not offered: use 0 (off), 1 "
          "(shard optimizer state), 2 (also gradients) or 3 (also "
          "weights).")
    given = {name: getattr(self, name) for name in SHARDING_SWITCHES
             if name not in self.defaulted}
    said = " ".join(f"--{name}={value}" for name, value in given.items())
    _need(not (given.get("shard_gradients") and
               given.get("shard_optimizer_state") is False),
          f"{said} contradict each other: --shard_gradients (stage 2) "
          "shards the optimizer state too. Give --shard_gradients alone.")
    _need(not (given.get("shard_parameters") and False in (
               given.get("shard_gradients"),
               given.get("shard_optimizer_state"))),
          f"{said} contradict each other: --shard_parameters (stage 3) "
          "shards the optimizer state and gradients too. Give "
          "--shard_parameters alone.")
    if self.zero_stage is not None and given:
      # What each switch given says of the stage: True, the stage is at
      # least (optimizer state) or exactly (gradients) its own; False,
      # below it.
      agrees = {"shard_optimizer_state": lambda on: on == (
                    self.zero_stage >= 1),
                "shard_gradients": lambda on: on == (self.zero_stage >= 2),
                "shard_parameters": lambda on: on == (self.zero_stage == 3)}
      _need(all(agrees[name](on) for name, on in given.items()),
            f"--zero_stage={self.zero_stage} contradicts {said}. Give "
            "--zero_stage alone, or the switches alone (--shard_gradients "
            "implies stage 2, --shard_parameters stage 3).")
    stage = self.zero_stage_resolved
    if not stage:
      return
    kind = self._strategy_kind
    _need(kind is None or kind.is_mirrored,
          f"--zero_stage={stage} (--shard_optimizer_state) runs under "
          f"{' or '.join(SHARDING_STRATEGIES[1:])}; received "
          f"--distribution_strategy={self.distribution_strategy}. Use "
          "mirrored or multi_worker_mirrored (parameter_server partitions "
          "variables itself), or drop the flag.")
    traits = optimizers.optimizer_spec(self.optimizer).traits
    _need(traits.shardable,
          f"--optimizer={self.optimizer} cannot run with --zero_stage="
          f"{stage}: {traits.not_shardable_because}. Use --optimizer=adamw, "
          "or drop the flag.")
    _need(stage < 3 or not self.enable_xla,
          "--zero_stage=3 (--shard_parameters) and --enable_xla cannot be "
          "combined: stage 3 gathers the weights inside its own forward "
          "pass, which tfdist does not compile. Drop --enable_xla, or use "
          "--zero_stage=2.")
    # Keras embedding layers stay replicated at stage 3
    # (tfdist.parallel.zero3.replicated_variables); the ranking model's
    # tables are ShardedEmbedding's plain tf.Variables, which stage 3's
    # gathered weights cannot stand in for.
    _need(stage < 3 or self.model != "ranking",
          "--zero_stage=3 cannot train --model=ranking: its tables "
          "(ShardedEmbedding) are plain tf.Variables, outside the Keras "
          "variables stage 3 shards or keeps replicated. Use "
          "--distribution_strategy=parameter_server (it shards tables and "
          "sends only the rows used), or --zero_stage=2.")

  def _validate_pipeline(self):
    """Pipeline stages, micro-batches, schedule and cuts
    (`tfdist.parallel.pipeline_options.check_flags`)."""
    pipeline_options.check_flags(
        pipeline_stages=self.pipeline_stages,
        num_microbatches=self.num_microbatches,
        pipeline_schedule=self.pipeline_schedule,
        pipeline_cuts=self.pipeline_cuts,
        distribution_strategy=self.distribution_strategy,
        zero_stage=self.zero_stage_resolved, enable_xla=self.enable_xla)

  def _validate_tensor_parallel(self):
    """`--tensor_parallel` (`tensor_parallel_options.check_flags`)."""
    tensor_parallel_options.check_flags(
        tensor_parallel=self.tensor_parallel, model=self.model,
        distribution_strategy=self.distribution_strategy,
        zero_stage=self.zero_stage_resolved,
        pipeline_stages=self.pipeline_stages, enable_xla=self.enable_xla,
        dtype=self.dtype, clipnorm=self.clipnorm,
        global_clipnorm=self.global_clipnorm,
        init_checkpoint=self.init_checkpoint, num_gpus=self.num_gpus,
        num_cpu_devices=self.num_cpu_devices)

  def _validate_step_guards(self):
    """Skipped-step limit and the allocator switch."""
    _need(self.max_consecutive_skipped_steps >= 0,
          "--max_consecutive_skipped_steps="
          f"{self.max_consecutive_skipped_steps} must be >= 0 (0: no limit).")
    _need(isinstance(self.tune_allocator, bool),
          f"--tune_allocator={self.tune_allocator!r} must be true or false.")

  def _validate_reliability(self):
    """Divergence warning and the --model_dir lease."""
    factor = self.loss_explosion_factor
    _need(factor == 0 or (math.isfinite(factor) and factor > 1),
          f"--loss_explosion_factor={factor} must be > 1 (warn when the "
          "loss exceeds that multiple of its early value), or 0 for no "
          "warning.")
    _need(math.isfinite(self.lease_timeout_seconds) and
          self.lease_timeout_seconds > 0,
          f"--lease_timeout_seconds={self.lease_timeout_seconds} must be > 0 "
          "seconds.")

  def _validate_loss_scale(self):
    """A loss scale only means something under fp16."""
    _need(self.loss_scale is None or self.dtype in ("fp16", "auto"),
          f"--loss_scale={self.loss_scale} only applies to --dtype=fp16 "
          f"(received --dtype={self.dtype}). Drop --loss_scale or use "
          "--dtype=fp16.")

  @property
  def zero_stage_resolved(self) -> int:
    """The ZeRO stage: `zero_stage` if given, else 3 with
    `shard_parameters`, 2 with `shard_gradients`, 1 with
    `shard_optimizer_state`, else 0."""
    if self.zero_stage is not None:
      return int(self.zero_stage)
    return (3 if self.shard_parameters else
            2 if self.shard_gradients else
            1 if self.shard_optimizer_state else 0)

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
    """Returns a copy with `changes` applied (and validated again).

    Fields that were left unset stay unset unless changed, so a new
    `dataset` brings its own recommendations.
    """
    reset = {name: None for name in self.defaulted + self.unset_fields
             if name not in changes}
    return dataclasses.replace(self, **{**reset, **changes})

  def to_dict(self) -> dict:
    """A JSON-serializable dict of every field."""
    out = dataclasses.asdict(self)
    out["flags_snapshot"] = dict(self.flags_snapshot)
    return json.loads(json.dumps(out, default=str))
