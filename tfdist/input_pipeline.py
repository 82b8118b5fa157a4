"""tf.data input pipelines over TFRecord shards, sharded for a strategy.

One pipeline runs per host (`tf.distribute.InputContext.input_pipeline_id`
of `num_input_pipelines`). Each host reads a disjoint part of the data
(`plan_sharding`):

* training, from the record count of every file (known at start):
  - by file, when the files dealt round-robin (host i reads files
    `i, i + n, i + 2n, ...`) give every host the same number of records;
  - otherwise by balanced record ranges: the files, in order, hold records
    0..N-1, and host i reads records `[i * N // n, (i + 1) * N // n)` (only
    the files that overlap its range), so shares differ by at most one
    record;
* evaluation: by file when there are at least as many files as hosts, else
  by data (every host reads every file and keeps records `i, i + n, ...`);
  uneven shares are harmless there: every example is read exactly once;
* a dataset function that takes `input_context` shards its examples itself;
  one that does not is sharded by example (host i keeps examples
  `i, i + n, ...`). Its training epochs are not aligned to steps: each host
  repeats its share.

Training epochs. With N training records and global batch B, an epoch is
`steps_per_epoch = N // B` steps. In each epoch every host reshuffles its
share and reads exactly `steps_per_epoch * B / n` records of it, then starts
the next epoch from its whole share again. So within an epoch no example is
read twice, and exactly `N % B` examples (the remainder) are left out: on
each host the ones its shuffle put last (with a shuffle buffer at least as
large as the share, a fresh uniformly random choice every epoch; without
shuffling, the same ones every epoch). A left-out example is not carried
over: the next epoch draws from every record again. Without record counts a
single pipeline just repeats its files (epochs not aligned to steps).

Within a host the strategy hands one per-replica batch to each local replica.
"""

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple

from absl import logging
import tensorflow as tf

from tfdist import registry
from tfdist.config import ConfigError
from tfdist.dataset_spec import DataNotFoundError
from tfdist.dataset_spec import DatasetSpec

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
  return sum(count_records_per_file(files))


def count_records_per_file(files: Sequence[str]) -> List[int]:
  """Records in each of the TFRecord `files`, in order (reads every file
  once, up to 8 in parallel)."""
  paths = list(files)
  compression = compression_of(paths)

  def count(index, path):
    records = tf.data.TFRecordDataset(path, compression_type=compression)
    return tf.data.Dataset.from_tensors(
        (index, records.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1)))

  ds = tf.data.Dataset.from_tensor_slices(
      (tf.range(len(paths), dtype=tf.int64), paths)).interleave(
          count, cycle_length=min(len(paths), 8),
          num_parallel_calls=AUTOTUNE)
  counts = [0] * len(paths)
  for index, n in ds:
    counts[int(index)] = int(n)
  return counts


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
  """How to read one split.

  Attributes:
    files: TFRecord paths (empty with `input_fn`).
    parse_fn: serialized example -> tuple of tensors (None with
      `input_fn`).
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
    file_record_counts: records in each of `files`
      (`count_records_per_file`). Training uses them to choose a sharding
      that gives every host the same share and to align epochs to steps
      (module docstring). None: counted when the dataset is built (one more
      read) if there are several hosts; with one host, epochs are then not
      aligned.
    input_fn: instead of files, a data set's dataset function
      (`DatasetSpec.input_fn`), called by `call_input_fn`.
    name: the data set's name, for messages.
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
  file_record_counts: Optional[Sequence[int]] = None
  input_fn: Optional[Callable] = None
  name: str = ""


def options_for(spec: DatasetSpec, *, files: Sequence[str] = (),
                **kwargs) -> PipelineOptions:
  """`PipelineOptions` reading the data set `spec`: its TFRecord `files`
  through `parse_fn`, or its dataset function; `kwargs` are the other
  `PipelineOptions` fields."""
  if spec.reads_files:
    return PipelineOptions(files=files, parse_fn=spec.parse_fn,
                           name=spec.name, **kwargs)
  return PipelineOptions(files=(), parse_fn=None, input_fn=spec.input_fn,
                         name=spec.name, **kwargs)


def takes_input_context(input_fn: Callable) -> bool:
  """True when a dataset function names `input_context` (it then shards its
  examples itself)."""
  import inspect  # pylint: disable=g-import-not-at-top
  try:
    params = inspect.signature(input_fn).parameters
  except (TypeError, ValueError):
    return False
  return "input_context" in params or any(
      p.kind is p.VAR_KEYWORD for p in params.values())


def call_input_fn(spec_or_fn, *, training: bool,
                  input_context: Optional[tf.distribute.InputContext] = None,
                  name: str = "") -> tf.data.Dataset:
  """Calls a dataset function with the arguments it names.

  Args:
    spec_or_fn: a `DatasetSpec` with `input_fn`, or the function.
    training: the training split (True) or the evaluation split.
    input_context: this input pipeline's context (None: the only one).
    name: the data set's name, for messages.

  Raises:
    ConfigError: it did not return a `tf.data.Dataset`.
  """
  fn = spec_or_fn
  if isinstance(spec_or_fn, DatasetSpec):
    fn, name = spec_or_fn.input_fn, spec_or_fn.name
  if input_context is None:
    input_context = tf.distribute.InputContext(
        num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1)
  what = f"--dataset={name or getattr(fn, '__name__', fn)}"
  ds = registry.call_with_accepted(
      fn, {"input_context": input_context, "training": training}, what=what)
  if not isinstance(ds, tf.data.Dataset):
    raise ConfigError(f"{what} returned {type(ds).__name__}, not a "
                      "tf.data.Dataset of (features, labels) examples.")
  return ds


def count_examples(spec: DatasetSpec) -> int:
  """Examples in one epoch of a dataset function's training split.

  Uses the dataset's cardinality when tf.data knows it, else reads it once.

  Raises:
    ConfigError: the dataset is infinite (the function must return one
      epoch; tfdist repeats it), or empty.
  """
  ds = call_input_fn(spec, training=True)
  cardinality = int(ds.cardinality())
  if cardinality == int(tf.data.INFINITE_CARDINALITY):
    raise ConfigError(
        f"--dataset={spec.name} returns an infinite dataset: return one "
        "epoch of examples (no .repeat()); tfdist repeats, shuffles and "
        "batches it.")
  if cardinality < 0:
    cardinality = int(ds.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))
  if cardinality == 0:
    raise DataNotFoundError(f"--dataset={spec.name}: the training split has "
                            "no examples.")
  return cardinality


def shard_mode(num_files: int, num_input_pipelines: int) -> str:
  """The evaluation rule: `'file'` if every host can get at least one whole
  file, else `'data'` (`'none'` for one host)."""
  if num_input_pipelines <= 1:
    return "none"
  return "file" if num_files >= num_input_pipelines else "data"


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
  """How the hosts split one split's records, and why.

  Attributes:
    mode: `none` (one host reads everything), `file` (whole files,
      round-robin), `range` (balanced contiguous record ranges) or `data`
      (every host reads everything and keeps every n-th record); for a
      dataset function, `function` (it shards by its `input_context`) or
      `example` (every n-th example).
    reason: one sentence for the printed plan.
    records_per_pipeline: records in each host's share (None if unknown).
    examples_per_epoch: training: records each host reads per epoch,
      `(N // B) * B / n` for N records and global batch B (None: not
      aligned, or evaluation).
  """
  mode: str
  reason: str
  records_per_pipeline: Optional[Tuple[int, ...]] = None
  examples_per_epoch: Optional[int] = None

  def describe(self) -> str:
    return f"by {self.mode}: {self.reason}" if self.mode != "none" else (
        self.reason)


def plan_sharding(file_record_counts: Optional[Sequence[int]], *,
                  num_files: int, num_input_pipelines: int,
                  global_batch_size: int, is_training: bool) -> ShardingPlan:
  """Chooses how `num_input_pipelines` workers split the files (module
  docstring: file sharding only when it gives every worker the same number of
  records, otherwise balanced record ranges).

  Args:
    file_record_counts: records per file (None: unknown; training with
      several workers needs them).
    num_files: the number of files.
    num_input_pipelines: workers.
    global_batch_size: examples per step over all workers.
    is_training: training (aligned epochs, equal shares) or evaluation.

  Returns:
    A `ShardingPlan`.

  Raises:
    ValueError: training with several workers and no counts; one epoch holds
      fewer records than one global batch.
  """
  n = max(1, int(num_input_pipelines))
  if not is_training or (file_record_counts is None and n == 1):
    mode = shard_mode(num_files, n)
    why = {"none": "one worker reads every file",
           "file": f"{num_files} files over {n} workers (evaluation reads "
                   "every example once; shares may differ)",
           "data": f"{num_files} file(s) for {n} workers: every worker "
                   "reads every file and keeps every n-th record"}[mode]
    return ShardingPlan(mode, why)
  if file_record_counts is None:
    raise ValueError(
        f"Sharding training data over {n} workers needs the record count of "
        "each file (input_pipeline.count_records_per_file).")
  counts = [int(c) for c in file_record_counts]
  total = sum(counts)
  steps = total // global_batch_size
  if steps < 1:
    raise ValueError(
        f"The global batch {global_batch_size} is larger than the "
        f"{total} training records: lower --batch_size.")
  per_epoch = steps * global_batch_size // n
  remainder = total - per_epoch * n
  epoch = (f"{per_epoch} per epoch" +
           (f" ({remainder} of {total} left out each epoch: {total} mod "
            f"{global_batch_size})" if remainder else ""))
  if n == 1:
    return ShardingPlan("none", f"one worker reads all {total} records, "
                        f"{epoch}", (total,), per_epoch)
  by_file = [sum(counts[i::n]) for i in range(n)]
  if len(counts) >= n and len(set(by_file)) == 1:
    return ShardingPlan(
        "file", f"{len(counts)} files give each of {n} workers {by_file[0]} "
        f"records; each reads {epoch}", tuple(by_file), per_epoch)
  shares = tuple((i + 1) * total // n - i * total // n for i in range(n))
  if len(counts) < n:
    why = f"{len(counts)} file(s) for {n} workers"
  else:
    why = (f"by file, the {len(counts)} files would give the {n} workers "
           f"{', '.join(map(str, by_file))} records")
  size = (str(shares[0]) if min(shares) == max(shares) else
          f"{min(shares)}-{max(shares)}")
  return ShardingPlan(
      "range", f"{why}; balanced record ranges give each {size} records; "
      f"each reads {epoch}", shares, per_epoch)


def function_sharding(input_fn: Callable, *,
                      num_input_pipelines: int) -> ShardingPlan:
  """How the hosts split a dataset function's examples (module docstring):
  the function itself when it takes `input_context`, else by example."""
  n = max(1, int(num_input_pipelines))
  if n == 1:
    return ShardingPlan("none", "one worker reads every example of the "
                        "dataset function")
  if takes_input_context(input_fn):
    return ShardingPlan("function", f"the dataset function shards its "
                        f"examples over {n} workers (it takes input_context)")
  return ShardingPlan("example", f"every one of {n} workers keeps every "
                      f"{n}-th example of the dataset function")


def _segments(plan: ShardingPlan, files: Sequence[str],
              counts: Optional[Sequence[int]], pipeline_id: int,
              num_pipelines: int) -> List[Tuple[str, int, int]]:
  """`(file, records to skip, records to read (-1: all))` of one host."""
  if plan.mode == "file":
    return [(f, 0, -1) for f in list(files)[pipeline_id::num_pipelines]]
  if plan.mode != "range":
    return [(f, 0, -1) for f in files]
  total = sum(counts)
  lo = pipeline_id * total // num_pipelines
  hi = (pipeline_id + 1) * total // num_pipelines
  out, start = [], 0
  for f, count in zip(files, counts):
    first, last = max(lo, start), min(hi, start + count)
    if last > first:
      out.append((f, first - start, last - first))
    start += count
  return out


def make_dataset(options: PipelineOptions,
                 input_context: Optional[tf.distribute.InputContext] = None
                 ) -> tf.data.Dataset:
  """Builds the per-host dataset of per-replica batches.

  Args:
    options: a `PipelineOptions`.
    input_context: given by `strategy.distribute_datasets_from_function`;
      None means one pipeline and one replica.

  Returns:
    A `tf.data.Dataset` of batches of examples (`parse_fn`'s or the dataset
    function's), each of `global_batch_size / num_replicas_in_sync`
    examples (the last evaluation batch may be smaller).
  """
  num_pipelines = input_context.num_input_pipelines if input_context else 1
  pipeline_id = input_context.input_pipeline_id if input_context else 0
  batch = (input_context.get_per_replica_batch_size(options.global_batch_size)
           if input_context else options.global_batch_size)
  if options.input_fn is not None:
    ds = _examples_from_function(options, input_context, num_pipelines,
                                 pipeline_id, batch)
    plan = None
  else:
    ds, plan = _examples_from_files(options, num_pipelines, pipeline_id,
                                    batch)
  return _batch(ds, options, plan, input_context, num_pipelines,
                pipeline_id, batch)


def _examples_from_function(options: PipelineOptions, input_context,
                            num_pipelines: int, pipeline_id: int,
                            batch: int) -> tf.data.Dataset:
  """One host's examples from a dataset function (sharded by example
  unless the function takes `input_context`)."""
  shards_itself = takes_input_context(options.input_fn)
  plan = function_sharding(options.input_fn,
                           num_input_pipelines=num_pipelines)
  logging.info("Input pipeline %d/%d: dataset function %s, sharded %s; "
               "per-replica batch %d", pipeline_id, num_pipelines,
               options.name or getattr(options.input_fn, "__name__", "?"),
               plan.describe(), batch)
  ds = call_input_fn(options.input_fn, training=options.is_training,
                     input_context=input_context, name=options.name)
  if num_pipelines > 1 and not shards_itself:
    ds = ds.shard(num_pipelines, pipeline_id)
  return ds


def _examples_from_files(options: PipelineOptions, num_pipelines: int,
                         pipeline_id: int, batch: int):
  """`(examples, ShardingPlan)` of one host's share of the files."""
  files = list(options.files)
  counts = options.file_record_counts
  if (counts is None and options.is_training and num_pipelines > 1 and
      tf.executing_eagerly()):
    counts = count_records_per_file(files)
  plan = plan_sharding(counts, num_files=len(files),
                       num_input_pipelines=num_pipelines,
                       global_batch_size=options.global_batch_size,
                       is_training=options.is_training)
  mode = plan.mode
  logging.info("Input pipeline %d/%d: %d files, sharded %s; per-replica "
               "batch %d", pipeline_id, num_pipelines, len(files),
               plan.describe(), batch)
  compression = compression_of(files)
  segments = _segments(plan, files, counts, pipeline_id, num_pipelines)
  seg_ds = tf.data.Dataset.from_tensor_slices((
      [f for f, _, _ in segments],
      tf.constant([skip for _, skip, _ in segments], tf.int64),
      tf.constant([take for _, _, take in segments], tf.int64)))
  # Sharding by data keeps every n-th record, so every host must see the
  # records in the same order: no file shuffle (the example shuffle below
  # still randomizes) and a deterministic interleave.
  same_order_everywhere = mode == "data"
  if (options.is_training and options.shuffle_buffer_size and
      not same_order_everywhere):
    seg_ds = seg_ds.shuffle(len(segments), seed=options.seed,
                            reshuffle_each_iteration=True)
  ds = seg_ds.interleave(
      lambda f, skip, take: tf.data.TFRecordDataset(
          f, compression_type=compression).skip(skip).take(take),
      cycle_length=min(len(segments), 8), block_length=1,
      num_parallel_calls=AUTOTUNE,
      deterministic=(options.deterministic or not options.is_training or
                     same_order_everywhere))
  if mode == "data":
    ds = ds.shard(num_pipelines, pipeline_id)
  ds = ds.map(options.parse_fn, num_parallel_calls=AUTOTUNE,
              deterministic=options.deterministic or not options.is_training)
  return ds, plan


def _batch(ds: tf.data.Dataset, options: PipelineOptions,
           plan: Optional["ShardingPlan"], input_context, num_pipelines: int,
           pipeline_id: int, batch: int) -> tf.data.Dataset:
  """Caches, shuffles, repeats (training, epochs aligned to steps when
  `plan` says how), batches and prefetches one host's examples."""
  if options.cache:
    ds = ds.cache()
  if options.is_training:
    if options.shuffle_buffer_size:
      ds = ds.shuffle(options.shuffle_buffer_size, seed=options.seed,
                      reshuffle_each_iteration=True)
    share = (plan.records_per_pipeline[pipeline_id]
             if plan is not None and plan.records_per_pipeline else None)
    if (plan is not None and plan.examples_per_epoch is not None and
        share != plan.examples_per_epoch):
      # One epoch reads exactly `examples_per_epoch` records of this host's
      # (reshuffled) share; the rest is left out of this epoch. Filtering
      # (not `take`) reads the whole share, so that `cache` completes.
      keep = plan.examples_per_epoch
      ds = ds.enumerate().filter(lambda i, _: i < keep).map(
          lambda _, example: example)
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
    ds: a finite dataset of examples (tuples of tensors or nests of them,
      e.g. `(image, label)` or `({"x": ..., "id": ...}, label)`).
    batch_size: examples per batch (per replica).
    replicas: replicas this host feeds per round.

  Returns:
    A dataset of `(*components, weights)` batches, each component
    `[batch_size, ...]` and `weights` float32 `[batch_size]`.
  """
  def add_weight(*example):
    return (*example, tf.constant(1.0, tf.float32))

  def pad(*components):
    return tf.nest.map_structure(lambda c: _pad_leading(c, batch_size),
                                 components)

  ds = ds.map(add_weight).batch(batch_size).map(pad)
  if replicas > 1:
    def pad_round(*components):
      return tf.nest.map_structure(lambda c: _pad_leading(c, replicas),
                                   components)
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
