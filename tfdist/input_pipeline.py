"""tf.data input pipelines over TFRecord shards, sharded for a strategy.

One pipeline runs per host (`tf.distribute.InputContext.input_pipeline_id`
of `num_input_pipelines`). Each host reads a disjoint part of the data:

* by file, when there are at least as many files as hosts (each host reads
  files `i, i + n, i + 2n, ...`);
* by data otherwise (every host reads every file and keeps records
  `i, i + n, ...`), which is slower but still disjoint.

Within a host the strategy hands one per-replica batch to each local replica.
"""

import dataclasses
from typing import Callable, List, Optional, Sequence

from absl import logging
import tensorflow as tf

from tfdist.datasets import DataNotFoundError

AUTOTUNE = tf.data.AUTOTUNE


def list_files(patterns: str, *, flag: str = "--train_files") -> List[str]:
  """Expands comma-separated glob patterns (local or `gs://`) into files.

  Returns:
    Sorted, de-duplicated file paths.

  Raises:
    DataNotFoundError: a pattern matches nothing; the message names the flag
      and the pattern.
  """
  files = []
  for pattern in [p.strip() for p in patterns.split(",") if p.strip()]:
    matched = tf.io.gfile.glob(pattern)
    if not matched:
      raise DataNotFoundError(
          f"{flag}={pattern!r} matches no file. Check the path, or leave "
          f"{flag} empty to use the --dataset's own files.")
    files.extend(matched)
  if not files:
    raise DataNotFoundError(f"{flag} is empty: give at least one file glob.")
  return sorted(set(files))


def compression_of(files: Sequence[str]) -> str:
  """`GZIP` when every file ends in `.gz`, `''` when none does.

  Raises:
    ValueError: a mix of compressed and uncompressed files.
  """
  gz = [f.endswith(".gz") for f in files]
  if all(gz):
    return "GZIP"
  if not any(gz):
    return ""
  raise ValueError("Mixed compressed (.gz) and uncompressed TFRecord files: "
                   f"{list(files)[:4]}... Use one kind per flag.")


def count_records(files: Sequence[str]) -> int:
  """Counts the records in TFRecord `files` (reads them once)."""
  ds = tf.data.TFRecordDataset(list(files), compression_type=compression_of(
      files), num_parallel_reads=AUTOTUNE)
  return int(ds.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
  """How to read one split.

  Attributes:
    files: TFRecord paths.
    parse_fn: serialized example -> tuple of tensors.
    global_batch_size: examples per step over all replicas.
    is_training: shuffle, repeat forever and drop the last partial batch; when
      False read once in order and keep every example.
    shuffle_buffer_size: examples in the shuffle buffer (0: no shuffle).
    cache: cache parsed examples in memory after the first epoch.
    seed: shuffle seed (None: non-deterministic order).
    deterministic: keep the element order reproducible (slower).
    pad_to_static_batches: evaluation only (TPUs need static shapes): every
      per-replica batch has exactly `global_batch_size / replicas` examples
      and every replica of the host gets one in each round; the padding
      examples are zeros. Each element then carries a third component,
      float32 weights [batch]: 1 for real examples, 0 for padding, so that
      metrics count every real example exactly once.
  """
  files: Sequence[str]
  parse_fn: Callable
  global_batch_size: int
  is_training: bool
  shuffle_buffer_size: int = 10_000
  cache: bool = True
  seed: Optional[int] = None
  deterministic: bool = False
  pad_to_static_batches: bool = False


def shard_mode(num_files: int, num_input_pipelines: int) -> str:
  """`'file'` if every host can get at least one whole file, else `'data'`."""
  if num_input_pipelines <= 1:
    return "none"
  return "file" if num_files >= num_input_pipelines else "data"


def make_dataset(options: PipelineOptions,
                 input_context: Optional[tf.distribute.InputContext] = None
                 ) -> tf.data.Dataset:
  """Builds the per-host dataset of per-replica batches.

  Args:
    options: a `PipelineOptions`.
    input_context: given by `strategy.distribute_datasets_from_function`;
      None means one pipeline and one replica.

  Returns:
    A `tf.data.Dataset` of batches of `parse_fn`'s outputs, each of
    `global_batch_size / num_replicas_in_sync` examples (the last evaluation
    batch may be smaller).
  """
  num_pipelines = input_context.num_input_pipelines if input_context else 1
  pipeline_id = input_context.input_pipeline_id if input_context else 0
  batch = (input_context.get_per_replica_batch_size(options.global_batch_size)
           if input_context else options.global_batch_size)
  files = list(options.files)
  mode = shard_mode(len(files), num_pipelines)
  logging.info("Input pipeline %d/%d: %d files, sharded by %s, per-replica "
               "batch %d", pipeline_id, num_pipelines, len(files), mode, batch)
  compression = compression_of(files)
  file_ds = tf.data.Dataset.from_tensor_slices(files)
  if mode == "file":
    file_ds = file_ds.shard(num_pipelines, pipeline_id)
  # Sharding by data keeps every n-th record, so every host must see the
  # records in the same order: no file shuffle (the example shuffle below
  # still randomizes) and a deterministic interleave.
  same_order_everywhere = mode == "data"
  if (options.is_training and options.shuffle_buffer_size and
      not same_order_everywhere):
    file_ds = file_ds.shuffle(len(files), seed=options.seed,
                              reshuffle_each_iteration=True)
  ds = file_ds.interleave(
      lambda f: tf.data.TFRecordDataset(f, compression_type=compression),
      cycle_length=min(len(files), 8), block_length=1,
      num_parallel_calls=AUTOTUNE,
      deterministic=(options.deterministic or not options.is_training or
                     same_order_everywhere))
  if mode == "data":
    ds = ds.shard(num_pipelines, pipeline_id)
  ds = ds.map(options.parse_fn, num_parallel_calls=AUTOTUNE,
              deterministic=options.deterministic or not options.is_training)
  if options.cache:
    ds = ds.cache()
  if options.is_training:
    if options.shuffle_buffer_size:
      ds = ds.shuffle(options.shuffle_buffer_size, seed=options.seed,
                      reshuffle_each_iteration=True)
    ds = ds.repeat()
  if options.pad_to_static_batches and not options.is_training:
    local_replicas = 1
    if input_context:
      local_replicas = max(1, input_context.num_replicas_in_sync //
                           num_pipelines)
    ds = pad_to_static_batches(ds, batch, local_replicas)
  else:
    ds = ds.batch(batch, drop_remainder=options.is_training,
                  num_parallel_calls=AUTOTUNE,
                  deterministic=options.deterministic or
                  not options.is_training)
  ds = ds.prefetch(AUTOTUNE)
  # The pipeline shards itself above; stop tf.data from sharding it again.
  data_options = tf.data.Options()
  data_options.experimental_distribute.auto_shard_policy = (
      tf.data.experimental.AutoShardPolicy.OFF)
  return ds.with_options(data_options)


def _pad_leading(tensor: tf.Tensor, size: int) -> tf.Tensor:
  """Zero-pads axis 0 of `tensor` to `size` and makes that size static."""
  missing = size - tf.shape(tensor)[0]
  paddings = [[0, missing]] + [[0, 0]] * (tensor.shape.rank - 1)
  padded = tf.pad(tensor, paddings)
  return tf.ensure_shape(padded, [size] + tensor.shape.as_list()[1:])


def pad_to_static_batches(ds: tf.data.Dataset, batch_size: int,
                          replicas: int = 1) -> tf.data.Dataset:
  """Batches a finite dataset into fixed-size, weighted batches.

  Every batch has exactly `batch_size` examples (static shape), and the
  number of batches is a multiple of `replicas` (so that every replica gets
  a batch in each round). Padding examples are zeros with weight 0.

  Args:
    ds: a finite dataset of examples (tuples of tensors, e.g.
      `(image, label)`).
    batch_size: examples per batch (per replica).
    replicas: replicas this host feeds per round.

  Returns:
    A dataset of `(*components, weights)` batches, each component
    `[batch_size, ...]` and `weights` float32 `[batch_size]`.
  """
  def add_weight(*example):
    return (*example, tf.constant(1.0, tf.float32))

  def pad(*components):
    return tuple(_pad_leading(c, batch_size) for c in components)

  ds = ds.map(add_weight).batch(batch_size).map(pad)
  if replicas > 1:
    def pad_round(*components):
      return tuple(_pad_leading(c, replicas) for c in components)
    ds = ds.batch(replicas).map(pad_round).unbatch()
  return ds


def _one_host_cpu(strategy: tf.distribute.Strategy) -> bool:
  """True for a `OneDeviceStrategy` on a CPU device."""
  if not isinstance(strategy, tf.distribute.OneDeviceStrategy):
    return False
  devices = strategy.extended.worker_devices
  return (len(devices) == 1 and
          tf.DeviceSpec.from_string(devices[0]).device_type == "CPU")


def distribute(strategy: tf.distribute.Strategy, options: PipelineOptions):
  """A distributed dataset: one `make_dataset` per host, split to replicas.

  With one replica on a CPU device (`OneDeviceStrategy("/cpu:0")`) it is the
  plain `make_dataset`, as plain Keras `fit` reads it there, and
  `strategy.run` takes its tensors as they are: a distributed iterator would
  add a buffer and a thread hand-off per batch (a `MultiDeviceIterator`,
  whose `GeneratorDataset` op also fixes glibc's mmap threshold, see
  `tfdist.allocator`), for no copy to make.
  """
  if _one_host_cpu(strategy):
    return make_dataset(options)
  return strategy.distribute_datasets_from_function(
      lambda ctx: make_dataset(options, ctx))
