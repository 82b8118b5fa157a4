"""Start-up checks of the input files: every file read, a bad one named.

Run before anything is built (`tfdist.run_plan` calls `check_data` and the
data set's `check_files`), so that bad data stops a run in seconds, with the file and
what is wrong with it, instead of as a traceback from inside the first
training step or, for evaluation files, after training:

* every training and evaluation file is read to the end and its records
  counted (the counts are the run plan's example counts). A file cut
  mid-record or corrupted (TFRecord's CRC) raises `DataError` naming it,
  the error and the records before it;
* the first record is parsed as a `tf.train.Example` and its features are
  compared with those the data set's parser reads (`first_record_check`,
  the built-in data sets' `DatasetSpec.check_files`; `--feature_spec` data
  sets have their own, `tfdist.feature_spec`): a mismatch raises
  `DataError` printing the expected features against those found.

Files are read with TensorFlow's own TFRecord reader
(`tf.compat.v1.io.tf_record_iterator`, C++; local or `gs://`), which does
not start TensorFlow's eager runtime: the checks can run before a
MultiWorkerMirroredStrategy is built.
"""

import contextlib
import dataclasses
import logging as std_logging
from typing import Dict, Mapping, Optional, Sequence, Tuple

import tensorflow as tf

from tfdist.config import ConfigError


class DataError(ConfigError):
  """An input file is damaged or holds records of another schema."""


@dataclasses.dataclass(frozen=True)
class DataCounts:
  """Records per file, as read at start.

  Attributes:
    train: `(path, records)` of every training file, sorted by path.
    eval: the same for the evaluation files.
  """
  train: Tuple[Tuple[str, int], ...]
  eval: Tuple[Tuple[str, int], ...]

  @property
  def num_train_examples(self) -> int:
    return sum(n for _, n in self.train)

  @property
  def num_eval_examples(self) -> int:
    return sum(n for _, n in self.eval)


@contextlib.contextmanager
def _quiet_tensorflow_logger():
  """The TFRecord reader's deprecation notice is not for tfdist's users."""
  logger = std_logging.getLogger("tensorflow")
  level = logger.level
  logger.setLevel(std_logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def _records(path: str):
  options = tf.io.TFRecordOptions(
      compression_type="GZIP" if path.endswith(".gz") else "")
  with _quiet_tensorflow_logger():
    return tf.compat.v1.io.tf_record_iterator(path, options)


def _damaged(path: str, what: str, error: Exception, good: int
             ) -> DataError:
  first = str(error).splitlines()[0] if str(error) else ""
  return DataError(
      f"{what} {path} is damaged: {type(error).__name__}: {first} (after "
      f"{good} good record(s)). The file is cut short or corrupted: write "
      "it again (a --dataset converted under --data_dir: delete its folder "
      "there and run again to convert it anew), or leave it out of the "
      "file pattern.")


def count_file(path: str, *, what: str = "file") -> int:
  """Reads the TFRecord file `path` to its end; returns its record count.

  Raises:
    DataError: the file cannot be read, or is cut mid-record or corrupted;
      the message names `what` and `path`.
  """
  count = 0
  try:
    for _ in _records(path):
      count += 1
  except (tf.errors.OpError, OSError) as e:
    raise _damaged(path, what, e, count) from None
  return count


# --- the schema ---------------------------------------------------------------
_KINDS = {tf.string: "bytes", tf.int64: "int64", tf.float32: "float"}
_LISTS = {"bytes": "bytes_list", "int64": "int64_list", "float": "float_list"}


def _expected(features: Mapping) -> Dict[str, Tuple[str, Optional[int],
                                                     bool]]:
  """`{name: (kind, values or None, required)}` of a parsing spec."""
  out = {}
  for name, feature in features.items():
    kind = _KINDS.get(tf.as_dtype(feature.dtype), str(feature.dtype))
    if isinstance(feature, tf.io.FixedLenFeature):
      size = 1
      for dim in feature.shape:
        size *= int(dim)
      out[name] = (kind, size, feature.default_value is None)
    else:  # VarLenFeature and friends: any number of values.
      out[name] = (kind, None, False)
  return out


def _found(record: bytes) -> Dict[str, Tuple[str, int]]:
  """`{name: (kind, values)}` of a serialized `tf.train.Example`."""
  example = tf.train.Example.FromString(record)
  out = {}
  for name, feature in example.features.feature.items():
    kind = feature.WhichOneof("kind") or "empty"
    kind = {v: k for k, v in _LISTS.items()}.get(kind, kind)
    values = getattr(feature, _LISTS.get(kind, ""), None)
    out[name] = (kind, len(values.value) if values is not None else 0)
  return out


def _format_expected(spec) -> str:
  return ", ".join(
      f"{name} {kind}" + (f"[{size}]" if size is not None else "[*]") +
      ("" if required else " (optional)")
      for name, (kind, size, required) in sorted(spec.items()))


def _format_found(found) -> str:
  return ", ".join(f"{name} {kind}[{size}]"
                   for name, (kind, size) in sorted(found.items())) or "none"


def check_schema(path: str, record: bytes, features: Mapping, *, what: str,
                 dataset: str):
  """Compares one serialized record with the features a parser reads.

  Args:
    path: the file the record came from (for the message).
    record: the serialized `tf.train.Example`.
    features: the parser's spec, `{name: tf.io.FixedLenFeature(...)}`.
    what: e.g. "training file".
    dataset: the `--dataset` name (for the message).

  Raises:
    DataError: a required feature is missing, or a feature has another
      type or number of values; the message lists expected and found.
  """
  expected = _expected(features)
  try:
    found = _found(record)
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(f"{what} {path}: its first record is not a "
                    f"tf.train.Example ({type(e).__name__}: {e}); "
                    f"--dataset={dataset} reads tf.train.Example records."
                    ) from None
  problems = []
  for name, (kind, size, required) in sorted(expected.items()):
    if name not in found:
      if required:
        problems.append(f"{name} is missing")
      continue
    got_kind, got_size = found[name]
    if got_kind != kind:
      problems.append(f"{name} is {got_kind}, not {kind}")
    elif size is not None and got_size != size:
      problems.append(f"{name} has {got_size} value(s), not {size}")
  if problems:
    raise DataError(
        f"{what} {path} does not hold the records --dataset={dataset} "
        f"reads (its first record checked): {'; '.join(problems)}.\n"
        f"  expected: {_format_expected(expected)}\n"
        f"  found:    {_format_found(found)}\n"
        "Write the records with the expected feature names and types, or "
        "pick the --dataset whose records these are.")


def first_record_check(features: Mapping, *, dataset: str):
  """A `DatasetSpec.check_files` for TFRecord data sets of `tf.train.Example`
  records: the first record of the files is compared with `features`.

  Args:
    features: the parser's spec, `{name: tf.io.FixedLenFeature(...)}`.
    dataset: the `--dataset` name, for messages.

  Returns:
    `check_files(files, flag)`, raising `DataError` on a mismatch or when
    the first record cannot be read.
  """
  def check_files(files: Sequence[str], flag: str):
    what = "training file" if "train" in flag else "evaluation file"
    for path in files:
      try:
        record = next(iter(_records(path)), None)
      except (tf.errors.OpError, OSError) as e:
        raise _damaged(path, f"{flag}: {what}", e, 0) from None
      if record is not None:
        check_schema(path, record, features, what=f"{flag}: {what}",
                     dataset=dataset)
        return
  return check_files


def check_data(train_files: Sequence[str],
               eval_files: Sequence[str]) -> DataCounts:
  """Reads every file to its end and counts its records.

  Args:
    train_files, eval_files: the run's TFRecord files.

  Returns:
    `DataCounts`.

  Raises:
    DataError: a damaged file, named.
  """
  counts = {}
  for files, what in ((train_files, "training file"),
                      (eval_files, "evaluation file")):
    counts[what] = tuple((path, count_file(path, what=what))
                         for path in files)
  return DataCounts(train=counts["training file"],
                    eval=counts["evaluation file"])
