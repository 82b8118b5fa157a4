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
* a dataset function that takes `input_context` shards its examples itself
  (its training epochs are not aligned to steps: each host reads passes
  over its own share, pass p shuffled with the seed of `--seed` and p, and
  a resumed host skips the `step x B / n` examples it used,
  `_share_passes`); one that does not is sharded by example (host i keeps
  examples `i, i + n, ...`) and has the aligned epochs below.

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

Epochs are numbered, and epoch e's order is a function of `--seed` and e
alone (its shuffles are seeded with `_epoch_seed(seed, e)`; the parsed
share is read once, in a fixed order, and cached), so any epoch can be
rebuilt without reading the ones before it. That is how a resumed run
continues its epoch (`PipelineOptions.start_step`, `start_position`): after
S updates of `steps_per_epoch` each, every host starts epoch
`S // steps_per_epoch` and skips the `(S mod steps_per_epoch) x B / n`
examples of it that the updates before used: the same examples follow as
without the restart, provided the reading order is reproducible (a seed,
and `deterministic` interleave and parsing). No iterator state is saved:
each worker recomputes its own position from the step, so it needs no
storage of its own (only the chief writes checkpoints); the checkpoint
records the layout (`input_layout`) that makes the step mean the same
position, and `layout_change` names what changed (files, batch, seed, ...),
in which case the position is not used; after a change of the worker count
alone, every host replays the old hosts' order
(`PipelineOptions.replay_pipelines`).

Within a host the strategy hands one per-replica batch to each local replica.
"""

import dataclasses
import math
import os
from typing import Callable, List, Optional, Sequence, Tuple

from absl import logging
import tensorflow as tf
from tensorflow.python.eager import context as context_lib  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.framework import random_seed as random_seed_lib  # pylint: disable=g-direct-tensorflow-import

from tfdist import errors
from tfdist.core.dataset_spec import DatasetSpec
from tfdist.runtime import wording
from tfdist.data.input_position import input_layout, layout_change  # noqa: F401
from tfdist.core import registry

AUTOTUNE = tf.data.AUTOTUNE


def list_files(patterns: str, *, flag: str = "--train_files") -> List[str]:
  """Expands comma-separated glob patterns (local or `gs://`) into files.

  Returns:
    Sorted, de-duplicated file paths.

  Raises:
    DataNotFoundError: a pattern matches nothing, or its folder cannot be
      listed (TensorFlow's file system raised `tf.errors.OpError`: an
      unknown scheme, an unreachable or unauthorized `gs://` bucket); the
      message names the flag, the pattern and the error.
  """
  files = []
  for pattern in [p.strip() for p in patterns.split(",") if p.strip()]:
    try:
      matched = tf.io.gfile.glob(pattern)
    except tf.errors.OpError as e:
      raise errors.DataNotFoundError(
          f"{flag}={pattern!r} cannot be listed: {type(e).__name__}: "
          f"{' '.join(e.message.split())}. Check the path's scheme and that "
          "this machine can reach and read it (for gs://: the network and "
          "credentials, e.g. `gcloud auth application-default login` or "
          "the VM's service account), or copy the files to a local "
          "path.") from e
    if not matched:
      raise errors.DataNotFoundError(
          f"{flag}={pattern!r} matches no file. Check the path, or leave "
          f"{flag} empty to use the --dataset's own files.")
    files.extend(matched)
  if not files:
    raise errors.DataNotFoundError(
        f"{flag} is empty: give at least one file glob.")
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
    gradient_accumulation_steps: micro-batches per update (K): the dataset
      yields per-replica micro-batches of `global_batch_size / (replicas x
      K)` examples (`global_batch_size` is the effective one).
    start_step: training: updates already made; the host's input starts in
      the epoch that step falls in, after the examples the updates before
      it used (`start_position`; needs record counts). The same examples
      follow as in an uninterrupted run when the order is reproducible:
      `seed` set and `deterministic` (or a run whose reading order does not
      vary).
    input_fn: instead of files, a data set's dataset function
      (`DatasetSpec.input_fn`), called by `call_input_fn`.
    name: the data set's name, for messages.
    examples_per_epoch: training with `input_fn`: the examples each host
      reads per epoch (the run's `steps_per_epoch` x `global_batch_size` /
      hosts). Each epoch is then exactly that many examples of a fresh
      pass over the host's share, reshuffled with the epoch's seed, as for
      files: no example twice in an epoch, epochs aligned to steps. Used
      when tfdist shards the function's examples (or
      `SHARDS_BY_EXAMPLE` marks a function that shards them the same way
      itself); None: one endless reshuffled stream.
    replay_pipelines: training: the worker count (input pipelines) whose
      input order this run replays, when it differs from this run's (a run
      resumed on another worker count, `InputPosition.replay_pipelines`):
      every host rebuilds each of those pipelines' streams from
      `start_step` on, joins their shares of each global (micro-)batch in
      pipeline order and keeps its own slice of it, so every step trains on
      the examples it trained on before the worker count changed
      (`_replayed`). Each host then reads the whole training input. None:
      this run's own order.
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
  gradient_accumulation_steps: int = 1
  start_step: int = 0
  input_fn: Optional[Callable] = None
  name: str = ""
  examples_per_epoch: Optional[int] = None
  replay_pipelines: Optional[int] = None


# A dataset function with this attribute set (to True) shards its examples
# by its `input_context` as tfdist shards a dataset function (example i to
# host i mod n), so each host's share is known from the example count
# (`tfdist.api.in_memory_dataset`'s arrays).
SHARDS_BY_EXAMPLE = "tfdist_shards_by_example"


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
  return registry.accepts(input_fn, "input_context")


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
    raise errors.ConfigError(f"{what} returned {type(ds).__name__}, not a "
                             "tf.data.Dataset of (features, labels) examples.")
  return ds


def count_examples(spec: DatasetSpec, *, training: bool = True) -> int:
  """Examples in one epoch of a dataset function's split.

  Uses the dataset's cardinality when tf.data knows it, else reads it once.

  Args:
    spec: the data set (a dataset function's `DatasetSpec`).
    training: count the training split (True) or the evaluation split,
      which the run evaluates whole.

  Raises:
    ConfigError: the split is infinite (the function must return one
      epoch; tfdist repeats the training split), or the training split is
      empty (an empty evaluation split counts 0).
  """
  ds = call_input_fn(spec, training=training)
  split = "" if training else " evaluation (training=False)"
  cardinality = int(ds.cardinality())
  if cardinality == int(tf.data.INFINITE_CARDINALITY):
    raise errors.ConfigError(
        f"--dataset={spec.name} returns an infinite{split} dataset: return "
        "one epoch of examples (no .repeat()); tfdist repeats, shuffles and "
        "batches it.")
  if cardinality < 0:
    cardinality = int(ds.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))
  if cardinality == 0 and training:
    raise errors.DataNotFoundError(
        f"--dataset={spec.name}: the training split has "
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
                      f"{wording.ordinal(n)} example of the dataset function")


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
    function's), each of `global_batch_size / (num_replicas_in_sync x
    gradient_accumulation_steps)` examples (the last evaluation batch may
    be smaller).
  """
  num_pipelines = input_context.num_input_pipelines if input_context else 1
  pipeline_id = input_context.input_pipeline_id if input_context else 0
  micro_global_batch = (options.global_batch_size //
                        max(1, options.gradient_accumulation_steps))
  batch = (input_context.get_per_replica_batch_size(micro_global_batch)
           if input_context else micro_global_batch)
  batched = False
  if (options.is_training and options.replay_pipelines and
      options.replay_pipelines != num_pipelines):
    ds, batched = _replayed(options, input_context, num_pipelines,
                            pipeline_id, batch), True
  elif options.input_fn is not None:
    ds, batched = _examples_from_function(options, input_context,
                                          num_pipelines, pipeline_id, batch)
  else:
    ds, batched = _examples_from_files(options, num_pipelines, pipeline_id,
                                       batch)
  return _batch(ds, options, input_context, num_pipelines, batch,
                batched=batched)


def _split_name(options: PipelineOptions) -> str:
  """`training` or `evaluation`: which split a pipeline reads, for its
  log line (a run builds both, with otherwise the same line)."""
  return "training" if options.is_training else "evaluation"


def _examples_from_function(options: PipelineOptions, input_context,
                            num_pipelines: int, pipeline_id: int,
                            batch: int) -> Tuple[tf.data.Dataset, bool]:
  """One host's examples from a dataset function (sharded by example
  unless the function takes `input_context`); training: cached, shuffled
  and repeated, in epochs of `options.examples_per_epoch` examples when
  given and the share is known (`_training_epochs`), else as one endless
  stream (epochs not aligned to steps, no resumable position).

  Returns:
    `(dataset, batched)` as `_training_epochs` returns them (`batched`:
    already in batches of `batch`).
  """
  shards_itself = takes_input_context(options.input_fn)
  plan = function_sharding(options.input_fn,
                           num_input_pipelines=num_pipelines)
  logging.info("Input pipeline %d/%d (%s): dataset function %s, sharded "
               "%s; per-replica batch %d", pipeline_id, num_pipelines,
               _split_name(options),
               options.name or getattr(options.input_fn, "__name__", "?"),
               plan.describe(), batch)
  ds = call_input_fn(options.input_fn, training=options.is_training,
                     input_context=input_context, name=options.name)
  if num_pipelines > 1 and not shards_itself:
    ds = ds.shard(num_pipelines, pipeline_id)
  aligned = (options.is_training and options.examples_per_epoch and
             (not shards_itself or
              getattr(options.input_fn, SHARDS_BY_EXAMPLE, False)))
  if aligned:
    plan = dataclasses.replace(
        plan, examples_per_epoch=int(options.examples_per_epoch))
    return _training_epochs(options, plan, lambda seed: ds,
                            pipeline_id=pipeline_id,
                            num_pipelines=num_pipelines, batch=batch)
  if options.is_training:
    return _share_passes(ds, options, pipeline_id=pipeline_id,
                         num_pipelines=num_pipelines), False
  return (ds.cache() if options.cache else ds), False


def _share_size(ds: tf.data.Dataset):
  """Examples in one pass of `ds` (its cardinality when tf.data knows it,
  else one read: an int eagerly, an int64 scalar tensor when traced).

  Raises:
    DataNotFoundError: eagerly, `ds` is empty.
  """
  size = ds.cardinality()
  if tf.executing_eagerly() and int(size) >= 0:
    size = int(size)
  elif tf.executing_eagerly():
    size = int(ds.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))
  else:
    return tf.where(size >= 0, size, ds.reduce(
        tf.constant(0, tf.int64), lambda n, _: n + 1))
  if size == 0:
    raise errors.DataNotFoundError(
        "A dataset function returned no examples for this worker's "
        "input_context: give every worker at least one example.")
  return size


def _share_passes(ds: tf.data.Dataset, options: PipelineOptions, *,
                  pipeline_id: int, num_pipelines: int) -> tf.data.Dataset:
  """Endless training examples of a host whose dataset function shards
  itself (it takes `input_context`; its share, and so its passes, are not
  aligned to steps): pass p is the whole share (cached after its first
  read), shuffled with `_epoch_seed(seed, p)`, so any pass can be rebuilt.

  Resumed after `options.start_step` updates, the host has used `start_step
  x global_batch_size / hosts` examples of its stream (every host feeds the
  same number of replicas): it starts the pass that count falls in and skips
  what it used of that pass (one read to size the share, unless tf.data
  knows it). The same examples follow as without the restart when the
  function returns the same examples in the same order for the same
  `input_context` (a seeded replay; module docstring of
  `tfdist.data.input_position`).
  """
  cached = ds.cache() if options.cache else ds

  def one_pass(number):
    seed = _epoch_seed(options.seed, number)
    if seed is not None:
      _avoid_zero_graph_seed()
    if not options.shuffle_buffer_size:
      return cached
    return cached.shuffle(options.shuffle_buffer_size, seed=seed)

  first, skip = 0, 0
  if options.start_step:
    used = options.start_step * (options.global_batch_size // num_pipelines)
    # Counted on the cache (when tf.data does not know the size): that read
    # fills it, as the first pass fills it in an uninterrupted run, so a
    # function whose own shuffle reshuffles per read is read once as there.
    share = _share_size(cached)
    first, skip = used // share, used % share
    if isinstance(share, int):
      logging.info(
          "Input pipeline %d/%d: resuming at step %d: pass %d over this "
          "worker's %d examples of the dataset function, after %d of them.",
          pipeline_id, num_pipelines, options.start_step, first + 1, share,
          skip)
  out = tf.data.Dataset.range(first, _NO_LAST_EPOCH).flat_map(one_pass)
  return out.skip(skip)


def _replayed(options: PipelineOptions, input_context, num_pipelines: int,
              pipeline_id: int, batch: int) -> tf.data.Dataset:
  """One host's batches of `batch` examples in the input order of
  `options.replay_pipelines` pipelines (`PipelineOptions.replay_pipelines`).

  Each of the replayed pipelines' streams is built as that pipeline built it
  (its `input_context`, its share, its epochs and its position after
  `options.start_step`), in chunks of its examples per micro-step; the
  chunks of one micro-step, joined in pipeline order, are the global
  micro-batch, of which host `pipeline_id` of `num_pipelines` keeps the
  `pipeline_id`-th slice. The update of a step averages over the same
  examples as before the worker count changed (float round-off apart).

  Raises:
    ConfigError: the micro-batch does not split evenly over the replayed
      pipelines or this run's.
  """
  origin = int(options.replay_pipelines)
  micro = options.global_batch_size // max(1,
                                          options.gradient_accumulation_steps)
  if micro % origin or micro % num_pipelines:
    raise errors.ConfigError(
        f"--batch_size: the global micro-batch of {micro} examples does not "
        f"split evenly over the checkpoint's {origin} workers and this run's "
        f"{num_pipelines}, so the input order cannot be replayed; use a "
        f"micro-batch that {origin} and {num_pipelines} divide, or train on "
        f"{origin} workers.")
  chunk, mine = micro // origin, micro // num_pipelines
  replicas = input_context.num_replicas_in_sync if input_context else 1
  origin_options = dataclasses.replace(
      options, replay_pipelines=None, examples_per_epoch=(
          None if options.examples_per_epoch is None else
          options.examples_per_epoch * num_pipelines // origin))
  logging.info("Input pipeline %d/%d: replaying the input order of %d "
               "workers (the checkpoint's): this worker reads every one of "
               "their shares and keeps its %d of each step's %d examples.",
               pipeline_id, num_pipelines, origin, mine * max(
                   1, options.gradient_accumulation_steps),
               options.global_batch_size)
  # An op without a seed of its own (a dataset function's `shuffle()`) under
  # a global seed draws its seed from the eager op-seed generator, which
  # each replayed pipeline's process had in the state this one has now:
  # each stream is built from that state (`_op_seeds`).
  op_seeds = _op_seeds()
  state = op_seeds.getstate() if op_seeds is not None else None
  streams = []
  for index in range(origin):
    if state is not None:
      op_seeds.setstate(state)
    context = tf.distribute.InputContext(
        num_input_pipelines=origin, input_pipeline_id=index,
        num_replicas_in_sync=max(origin, replicas * origin // num_pipelines))
    if options.input_fn is not None:
      ds, batched = _examples_from_function(origin_options, context, origin,
                                            index, chunk)
    else:
      ds, batched = _examples_from_files(origin_options, origin, index,
                                         chunk)
    streams.append(ds if batched else ds.batch(chunk, drop_remainder=True))
  joined = tf.data.Dataset.zip(tuple(streams)).map(
      lambda *parts: tf.nest.map_structure(
          lambda *t: tf.concat(t, 0)[pipeline_id * mine:
                                     (pipeline_id + 1) * mine], *parts))
  if mine == batch:
    return joined
  return joined.unbatch().batch(batch, drop_remainder=True)


def _op_seeds():
  """TensorFlow's eager op-seed generator (a `random.Random`, set by
  `tf.random.set_seed`), or None (no global seed, or traced)."""
  if not tf.executing_eagerly():
    return None
  return getattr(context_lib.context(), "_rng", None)


def _examples_from_files(options: PipelineOptions, num_pipelines: int,
                         pipeline_id: int, batch: int
                         ) -> Tuple[tf.data.Dataset, bool]:
  """One host's share of the files, parsed; training: numbered epochs from
  `options.start_step` on (`_training_epochs`).

  Returns:
    `(dataset, batched)`: `batched` when `_training_epochs` made the
    dataset of batches of `batch` itself.
  """
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
  logging.info("Input pipeline %d/%d (%s): %d files, sharded %s; "
               "per-replica batch %d", pipeline_id, num_pipelines,
               _split_name(options), len(files), plan.describe(), batch)
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
  ordered = (options.deterministic or not options.is_training or
             same_order_everywhere)
  shuffle = options.is_training and options.shuffle_buffer_size > 0

  def read_share(file_seed):
    """This host's records, parsed, in one pass (files shuffled with
    `file_seed` when training shuffles)."""
    files_ds = seg_ds
    if shuffle and not same_order_everywhere:
      files_ds = files_ds.shuffle(len(segments), seed=file_seed)
    ds = files_ds.interleave(
        lambda f, skip, take: tf.data.TFRecordDataset(
            f, compression_type=compression).skip(skip).take(take),
        cycle_length=min(len(segments), 8), block_length=1,
        num_parallel_calls=AUTOTUNE, deterministic=ordered)
    if mode == "data":
      ds = ds.shard(num_pipelines, pipeline_id)
    return ds.map(options.parse_fn, num_parallel_calls=AUTOTUNE,
                  deterministic=ordered)

  if not options.is_training:
    ds = read_share(None)
    return (ds.cache() if options.cache else ds), False
  return _training_epochs(options, plan, read_share, pipeline_id=pipeline_id,
                          num_pipelines=num_pipelines, batch=batch)


def _batch(ds: tf.data.Dataset, options: PipelineOptions, input_context,
           num_pipelines: int, batch: int, *,
           batched: bool = False) -> tf.data.Dataset:
  """Batches (or pads to static batches) and prefetches one host's
  examples (`batched`: `ds` is of batches already; prefetches it)."""
  if batched:
    pass
  elif options.pad_to_static_batches and not options.is_training:
    local_replicas = 1
    if input_context:
      local_replicas = max(1, input_context.num_replicas_in_sync //
                           num_pipelines)
    ds = pad_to_static_batches(ds, batch, local_replicas)
  else:
    # Batches in order (records within them may still be reordered above):
    # out of order, a batch of the next epoch could come before the last of
    # this one, blurring the epoch boundary that "every example once per
    # epoch" and the input position (step -> epoch) rely on.
    ds = ds.batch(batch, drop_remainder=options.is_training,
                  num_parallel_calls=AUTOTUNE, deterministic=True)
  ds = ds.prefetch(AUTOTUNE)
  # Static where it can be known; inside a traced dataset function (the
  # parameter-server coordinator's) it is not, and nothing is asserted.
  cardinality = tf.get_static_value(ds.cardinality())
  if options.is_training and cardinality == tf.data.UNKNOWN_CARDINALITY:
    # Training input is endless (`repeat()`, or numbered epochs through
    # `flat_map`, whose cardinality tf.data does not know). Saying so keeps
    # a multi-worker distributed iterator off its partial-batch path, which
    # runs a cross-worker all-reduce of "has a batch" and a `tf.cond`
    # before every step (`_enable_get_next_as_optional` in TensorFlow's
    # input_lib). A dataset that ends anyway fails with tf.data's error.
    ds = ds.apply(tf.data.experimental.assert_cardinality(
        tf.data.INFINITE_CARDINALITY))
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


# Epoch numbers never reached (the training dataset is endless).
_NO_LAST_EPOCH = 2**62


def _epoch_seed(seed: Optional[int], epoch):
  """The shuffle seed of `epoch` (int64 scalar tensor): a function of
  `--seed` and the epoch number alone, so any epoch's order can be rebuilt
  without reading the epochs before it. None (unseeded) stays None."""
  if seed is None:
    return None
  return tf.constant(seed, tf.int64) * 1_000_003 + tf.cast(epoch, tf.int64)


def _avoid_zero_graph_seed() -> None:
  """Lets `Dataset.shuffle` take a tensor seed under a global seed of 0.

  TensorFlow's `random_seed.get_seed` compares `(global seed, op seed)` with
  `(0, 0)` in Python; with an op seed that is a tensor (each epoch's seed,
  `_epoch_seed`) and a global seed of 0 (`--seed=0`, which
  `keras.utils.set_random_seed` makes TensorFlow's) that comparison asks
  for a tensor's truth value and fails. In this traced function the
  graph's own seed stands in for the global one: a 0 there becomes
  TensorFlow's default graph seed, so the order is still fixed by `--seed`
  and the epoch.
  """
  graph = tf.compat.v1.get_default_graph()
  if graph.seed is not None and graph.seed % (2**31 - 1) == 0:
    graph.seed = random_seed_lib.DEFAULT_GRAPH_SEED


def start_position(start_step: int, plan: ShardingPlan, *,
                   global_batch_size: int, num_pipelines: int
                   ) -> Tuple[int, int]:
  """Where a host's training input resumes after `start_step` updates.

  Args:
    start_step: optimizer updates already made (the restored global step).
    plan: the training `ShardingPlan` (`examples_per_epoch` known).
    global_batch_size: examples per update over all hosts.
    num_pipelines: hosts.

  Returns:
    `(epoch, examples_to_skip)`: the epoch the step falls in, and how many
    of this host's examples of that epoch the updates before it used
    (`(start_step mod steps_per_epoch) x global_batch_size / hosts`). The
    same on every host: shares per epoch are equal.
  """
  per_epoch = plan.examples_per_epoch
  steps_per_epoch = per_epoch * num_pipelines // global_batch_size
  epoch, done = divmod(int(start_step), steps_per_epoch)
  return epoch, done * (global_batch_size // num_pipelines)


def _first_batches(ds: tf.data.Dataset, keep: int,
                   batch: int) -> tf.data.Dataset:
  """The first `keep` examples of `ds` in batches of `batch` (which
  divides `keep`), after reading all of it.

  `_first_examples` for an epoch aligned to whole batches, without its
  unbatching: the examples and their batches are the same, and a step's
  batch is not taken apart and put together again (about half a
  millisecond of CPU per 128-example Fashion-MNIST batch).
  """
  return ds.batch(batch, drop_remainder=True, num_parallel_calls=AUTOTUNE,
                  deterministic=True).enumerate().filter(
                      lambda i, _: i < keep // batch).map(
                          lambda _, examples: examples)


def _first_examples(ds: tf.data.Dataset, keep: int,
                    batch: int) -> tf.data.Dataset:
  """The first `keep` examples of `ds`, after reading all of it.

  Reading to the end lets a `cache` upstream complete (`take` would stop
  it part-way). The cut is made on groups of `gcd(keep, batch)` examples
  (`batch`: the per-replica batch, which divides `keep` when epochs are
  aligned to steps), not example by example: enumerate, filter and map
  each call a function per element, which per example cost a step's
  input several milliseconds of CPU (Fashion-MNIST, 128 examples), and per
  group a tenth of that. The examples and their order are the same.
  """
  group = math.gcd(keep, batch)
  return ds.batch(group).enumerate().filter(
      lambda i, _: i < keep // group).map(lambda _, examples: examples
                                          ).unbatch()


def _training_epochs(options: PipelineOptions, plan: ShardingPlan,
                     read_share: Callable, *, pipeline_id: int,
                     num_pipelines: int, batch: int
                     ) -> Tuple[tf.data.Dataset, bool]:
  """Endless training examples of one host, epoch after epoch, from
  `options.start_step` on (module docstring: epochs and resuming); `batch`:
  the per-replica batch they are batched into.

  Returns:
    `(dataset, batched)`. Epochs cut to whole batches, resumed after whole
    batches (`batched`): a dataset of those batches, made per epoch (the
    same batches as batching the examples afterwards). Otherwise: of
    examples.
  """
  share = (plan.records_per_pipeline[pipeline_id]
           if plan.records_per_pipeline else None)
  keep = plan.examples_per_epoch
  if keep is not None and share == keep:
    keep = None  # The whole share every epoch.
  cached = read_share(options.seed).cache() if options.cache else None

  def one_epoch(epoch):
    seed = _epoch_seed(options.seed, epoch)
    if seed is not None:
      _avoid_zero_graph_seed()
    ds = cached if cached is not None else read_share(seed)
    if options.shuffle_buffer_size:
      ds = ds.shuffle(options.shuffle_buffer_size, seed=seed)
    if keep is not None:
      # One epoch reads exactly `examples_per_epoch` records of this host's
      # (reshuffled) share; the rest is left out of this epoch.
      ds = (_first_batches(ds, keep, batch) if batched else
            _first_examples(ds, keep, batch))
    return ds

  epoch, skip = 0, 0
  if options.start_step:
    if plan.examples_per_epoch is None:
      logging.warning(
          "Input pipeline %d/%d: no record counts, so epochs are not aligned "
          "to steps and the position of step %d is unknown; reading from "
          "the start.", pipeline_id, num_pipelines, options.start_step)
    else:
      epoch, skip = start_position(
          options.start_step, plan, global_batch_size=options.global_batch_size,
          num_pipelines=num_pipelines)
      logging.info(
          "Input pipeline %d/%d: resuming at step %d: epoch %d, after %d of "
          "this worker's %d examples of that epoch.", pipeline_id,
          num_pipelines, options.start_step, epoch + 1, skip,
          plan.examples_per_epoch)
  # Read by `one_epoch` (traced by `flat_map` below).
  batched = keep is not None and keep % batch == 0 and skip % batch == 0
  ds = tf.data.Dataset.range(epoch, _NO_LAST_EPOCH).flat_map(one_epoch)
  if skip:
    ds = ds.skip(skip // batch if batched else skip)
  return ds, batched


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
  `tfdist.runtime.allocator`), for no copy to make.
  """
  if _one_host_cpu(strategy):
    return make_dataset(options)
  return strategy.distribute_datasets_from_function(
      lambda ctx: make_dataset(options, ctx))
