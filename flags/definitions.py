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
from absl import logging

from tfdist import config as config_lib

FLAGS = flags.FLAGS
_DEFAULTS = config_lib.TrainConfig.__dataclass_fields__


def _default(name):
  return _DEFAULTS[name].default


def define_base_flags() -> List[str]:
  """Model, data and output locations."""
  flags.DEFINE_string("model", _default("model"),
                      "Model to build, by name: cnn, resnet, or ranking "
                      "(wide & deep over sharded embeddings, for "
                      "movielens); see models/.")
  flags.DEFINE_string("dataset", _default("dataset"),
                      "Named data set: fashion_mnist or movielens "
                      "(MovieLens-100k likes, from the recbole package; "
                      "unless given, it sets --model=ranking, "
                      "--batch_size=512, --optimizer=adam, "
                      "--base_learning_rate=0.002, --lr_scaling=sqrt).")
  flags.DEFINE_string(
      "data_dir", "",
      "Where named data sets are converted to TFRecord, once. Default: "
      "$TFDIST_DATA_DIR, else ~/.cache/tfdist/datasets.")
  flags.DEFINE_string(
      "raw_data_dir", "",
      "Folder with the original Fashion-MNIST .gz files. Default: Debian's "
      "/usr/share/datasets/fashion-mnist.")
  flags.DEFINE_string(
      "train_files", "",
      "Comma-separated globs of TFRecord files for training (local or gs://; "
      "files ending in .gz are read as GZIP). Default: the --dataset's files.")
  flags.DEFINE_string(
      "eval_files", "",
      "Comma-separated globs of TFRecord files for evaluation. Default: the "
      "--dataset's test files.")
  flags.DEFINE_string(
      "model_dir", None,
      "Output folder for checkpoints, TensorBoard logs, the SavedModel and "
      "run_manifest.json. Required unless Vertex AI's AIP_CHECKPOINT_DIR or "
      "AIP_MODEL_DIR is set. Running again with the same folder resumes.")
  flags.DEFINE_string(
      "export_dir", None,
      "Where the SavedModel goes. Default: $AIP_MODEL_DIR, else "
      "<model_dir>/saved_model.")
  flags.DEFINE_integer("shuffle_buffer_size", _default("shuffle_buffer_size"),
                       "Examples in the training shuffle buffer (0: none).")
  flags.DEFINE_bool("cache_dataset", _default("cache_dataset"),
                    "Cache parsed examples in memory after the first pass.")
  flags.DEFINE_integer(
      "embedding_dim", _default("embedding_dim"),
      "Ranking models (--model=ranking): width of each embedding.")
  flags.DEFINE_integer(
      "hash_buckets", _default("hash_buckets"),
      "Ranking models: rows of the user and item tables (ids are hashed "
      "into them). Large values make large tables, sharded across ps tasks "
      "under --distribution_strategy=parameter_server.")
  return ["model", "dataset", "train_files", "eval_files", "model_dir"]


def define_train_flags() -> List[str]:
  """Length of training, batch, logging, checkpoints."""
  flags.DEFINE_integer(
      "train_steps", 0,
      "Optimizer updates to train for; when > 0 it overrides --train_epochs.")
  flags.DEFINE_integer("train_epochs", 5,
                       "Epochs to train for when --train_steps is 0.")
  flags.DEFINE_integer("epochs_between_evals", 1,
                       "Evaluate after every this many epochs, and at the end.")
  flags.DEFINE_integer(
      "batch_size", None,
      "Global batch size: examples per update over all replicas. Give this "
      "or --per_replica_batch_size. Default (neither given): 128.")
  flags.DEFINE_integer(
      "per_replica_batch_size", None,
      "Examples per replica per step; the global batch is this times "
      "num_replicas_in_sync.")
  flags.DEFINE_integer("log_steps", _default("log_steps"),
                       "Log loss, learning rate, examples/sec and step time "
                       "every this many steps.")
  flags.DEFINE_integer(
      "checkpoint_steps", 0,
      "Save a checkpoint every this many steps; 0 saves at each epoch end. "
      "A checkpoint is always saved at the end.")
  flags.DEFINE_integer("max_checkpoints", _default("max_checkpoints"),
                       "Checkpoints to keep.")
  flags.DEFINE_integer("seed", _default("seed"),
                       "Random seed for weights and shuffling.")
  flags.DEFINE_bool("run_eagerly", False,
                    "Run the step without tf.function (for debugging).")
  return ["train_steps", "train_epochs", "batch_size",
          "per_replica_batch_size", "log_steps"]


def define_distribution_flags() -> List[str]:
  """Strategy and devices."""
  flags.DEFINE_enum(
      "distribution_strategy", "auto", list(config_lib.STRATEGIES),
      "tf.distribute strategy. off: none; one_device; mirrored: one host, "
      "all GPUs or --num_cpu_devices logical CPUs; multi_worker_mirrored; "
      "parameter_server; tpu; auto: chosen from the devices and cluster "
      "found, and the choice is printed.")
  flags.DEFINE_integer("num_gpus", -1,
                       "GPUs to use: -1 for all visible, 0 for none.")
  flags.DEFINE_integer(
      "num_cpu_devices", 0,
      "Split the host CPU into this many logical devices, so mirrored runs "
      "that many replicas on a CPU-only machine (0 or 1: no split).")
  flags.DEFINE_enum(
      "all_reduce_alg", "auto", list(config_lib.ALL_REDUCE_ALGS),
      "All-reduce. mirrored: nccl or hierarchical_copy (GPUs); "
      "multi_worker_mirrored: ring (gRPC, works on CPUs) or nccl (GPUs; what "
      "Vertex AI's Reduction Server needs); auto lets TensorFlow choose.")
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
  """Precision, XLA and steps per execution."""
  flags.DEFINE_enum(
      "dtype", None,
      ["fp32", "bf16", "fp16", "auto", "float32", "bfloat16", "float16"],
      "Precision: fp32; bf16 (Keras policy mixed_bfloat16); fp16 "
      "(mixed_float16 with loss scaling; not on TPUs); auto: chosen from the "
      "hardware (bf16 on TPUs and GPUs of compute capability >= 8.0, fp16 on "
      "7.x GPUs, fp32 on CPUs) and printed. Default: bf16 with "
      "--distribution_strategy=tpu, else fp32.",
      case_sensitive=False)
  flags.DEFINE_string(
      "loss_scale", None,
      "fp16 only: 'dynamic' (the default with --dtype=fp16) or a fixed "
      "positive number such as 128.")
  flags.DEFINE_bool(
      "enable_xla", False,
      "Jit-compile the training step with XLA. Keras 3 turns XLA off under a "
      "tf.distribute strategy, so tfdist compiles its own per-replica step "
      "(TPUs always compile with XLA).")
  flags.DEFINE_integer(
      "steps_per_execution", None,
      "Training steps run inside one tf.function call (fewer round trips). "
      f"Default: {config_lib.TPU_DEFAULT_STEPS_PER_EXECUTION} with "
      "--distribution_strategy=tpu, else 1.")

  flags.DEFINE_bool(
      "tune_allocator", _default("tune_allocator"),
      "Set glibc malloc so TensorFlow does not map and unmap every large "
      "tensor buffer at each step (M_MMAP_MAX=0, M_TOP_PAD=64 MiB; see "
      "tfdist/allocator.py). Costs resident memory: each malloc arena may "
      "keep up to 64 MiB of freed memory. --notune_allocator leaves malloc "
      "as it is.")

  @flags.validator("loss_scale",
                   "--loss_scale must be 'dynamic' or a positive number.")
  def _check_loss_scale(value):
    try:
      config_lib.parse_loss_scale(value)
      return True
    except config_lib.ConfigError:
      return False

  return ["dtype", "loss_scale"]


def define_tpu_flags() -> List[str]:
  """TPU address and initialization (Model Garden's names)."""
  flags.DEFINE_string(
      "tpu", "",
      "TPU for --distribution_strategy=tpu (or for auto to try): `local` on "
      "a Cloud TPU VM, the Cloud TPU's name, or grpc://HOST:8470. Empty: "
      "$TPU_NAME.")
  flags.DEFINE_string(
      "tpu_zone", "",
      "Zone of the Cloud TPU named by --tpu (default: this VM's zone).")
  flags.DEFINE_string(
      "tpu_gcp_project", "",
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
  flags.DEFINE_enum("optimizer", _default("optimizer"),
                    list(config_lib.OPTIMIZERS),
                    "Keras optimizer: sgd and momentum (SGD with --momentum), "
                    "adam, adamw, rmsprop, lamb.")
  flags.DEFINE_float("momentum", _default("momentum"),
                     "Momentum for sgd, momentum and rmsprop.")
  flags.DEFINE_float("weight_decay", _default("weight_decay"),
                     "Decoupled weight decay (0: none; adamw uses 0.004 "
                     "when 0).")
  flags.DEFINE_float(
      "base_learning_rate", _default("base_learning_rate"),
      "Learning rate tuned for --base_batch_size examples; scaled to the "
      "global batch by --lr_scaling.")
  flags.DEFINE_integer("base_batch_size", _default("base_batch_size"),
                       "The batch size --base_learning_rate was tuned for.")
  flags.DEFINE_enum(
      "lr_scaling", _default("lr_scaling"), list(config_lib.LR_SCALING_RULES),
      "linear: base_lr * global_batch / base_batch (Goyal et al. 2017, for "
      "SGD); sqrt: base_lr * sqrt(global_batch / base_batch) (for Adam-type "
      "optimizers); none.")
  flags.DEFINE_integer(
      "warmup_steps", None,
      "Steps of linear warmup to the peak LR (0: none). Default (with "
      "--warmup_epochs unset): the smaller of one epoch and a tenth of "
      "the run.")
  flags.DEFINE_float("warmup_epochs", None,
                     "Warmup length in epochs (instead of --warmup_steps).")
  flags.DEFINE_float("warmup_start_learning_rate", 0.0,
                     "Learning rate at step 0, where warmup starts.")
  flags.DEFINE_enum(
      "lr_schedule", _default("lr_schedule"), list(config_lib.LR_SCHEDULES),
      "Decay after warmup: constant; cosine (to end_learning_rate_factor x "
      "peak); piecewise (peak x --piecewise_multipliers at "
      "--piecewise_boundaries).")
  flags.DEFINE_float("end_learning_rate_factor", 0.0,
                     "cosine: final LR as a fraction of the peak.")
  flags.DEFINE_list("piecewise_boundaries", ["0.5", "0.75"],
                    "piecewise: boundaries as fractions of the steps after "
                    "warmup, increasing, in (0, 1).")
  flags.DEFINE_list("piecewise_multipliers", ["1.0", "0.1", "0.01"],
                    "piecewise: multipliers of the peak LR, one more than "
                    "boundaries.")
  return ["optimizer", "base_learning_rate", "lr_scaling", "warmup_steps",
          "warmup_epochs", "lr_schedule"]


def define_cluster_flags() -> List[str]:
  """Multi-worker cluster, collective timeouts and preemption.

  The cluster comes from the first source present: --worker_hosts (with
  --task_index), TF_CONFIG, Vertex AI's CLUSTER_SPEC (see tfdist/cluster.py).
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
      "finished after this many seconds fails instead of hanging.")
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


def define_all_flags() -> List[str]:
  """Defines every group `tfdist.train` uses; returns the key flag names."""
  names = []
  for define in (define_base_flags, define_train_flags,
                 define_distribution_flags, define_cluster_flags,
                 define_performance_flags,
                 define_tpu_flags, define_lr_flags):
    names += define()
  return names


def flags_to_config(flag_values=FLAGS) -> config_lib.TrainConfig:
  """Reads parsed flags once into a frozen `TrainConfig`.

  Raises:
    tfdist.config.ConfigError: invalid or inconsistent values.
  """
  fields = set(_DEFAULTS)
  kwargs = {}
  snapshot = []
  for name in fields:
    if name in flag_values and name != "flags_snapshot":
      value = flag_values[name].value
      snapshot.append((name, str(value)))
      if value is not None:
        kwargs[name] = value
  if flag_values["dtype"].value:
    kwargs["dtype"] = config_lib.normalize_dtype(flag_values["dtype"].value)
  # The data set's recommended values for flags not given on the command
  # line (config_lib.DATASET_RECOMMENDED_FLAGS).
  recommended = dict(config_lib.DATASET_RECOMMENDED_FLAGS.get(
      kwargs.get("dataset"), ()))
  if ("per_replica_batch_size" in flag_values and
      flag_values["per_replica_batch_size"].present):
    recommended.pop("batch_size", None)
  applied = []
  for name, value in recommended.items():
    if name in flag_values and not flag_values[name].present:
      kwargs[name] = value
      snapshot = [(n, v) for n, v in snapshot if n != name]
      snapshot.append((name, str(value)))
      applied.append(f"--{name}={value}")
  if applied:
    # Said out loud: a default that changes with --dataset must not be silent.
    logging.info("--dataset=%s sets flags left unset: %s (pass them to "
                 "override).", kwargs.get("dataset"), " ".join(applied))
  kwargs["flags_snapshot"] = tuple(sorted(snapshot))
  return config_lib.TrainConfig(**kwargs)
