"""Start-up checks of the input files: every file read, a bad one named.

Run before anything is built (`tfdist.training.plan.run_plan` calls `check_data`
and the data set's `check_files`), so that bad data stops a run in seconds, with
the file and what is wrong with it, instead of as a traceback from inside the
first training step or, for evaluation files, after training:

* every training and evaluation file is read to the end and its records
  counted (the counts are the run plan's example counts). A file cut
  mid-record or corrupted (TFRecord's CRC) raises `DataError` naming it,
  the error and the records before it. An uncompressed file's framing is
  checked record by record (`check_framing`): each header's length and its
  masked CRC32C, each record's data CRC32C, and that the file ends on a
  record boundary (TensorFlow's reader takes a file cut inside a record's
  12-byte header for a whole file); the error names the byte offset. GZIP
  files are read by TensorFlow's reader, whose inflater catches a cut;
* the first record is parsed as a `tf.train.Example` and its features are
  compared with those the data set's parser reads (`first_record_check`,
  the built-in data sets' `DatasetSpec.check_files`; `--feature_spec` data
  sets have their own, `tfdist.data.feature_spec`): a mismatch raises
  `DataError` printing the expected features against those found.

Files are read with TensorFlow's own TFRecord reader
(`tf.compat.v1.io.tf_record_iterator`, C++; local or `gs://`) and
`tf.io.gfile`, neither of which starts TensorFlow's eager runtime: the
checks can run before a MultiWorkerMirroredStrategy is built.
"""

import contextlib
import dataclasses
import logging as std_logging
import re
import struct
import zlib
from typing import Dict, Mapping, Optional, Sequence, Tuple

import tensorflow as tf

from tfdist import errors
from tfdist.errors import first_line


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


# What every damaged-file error ends with.
_REWRITE_ADVICE = (
    "The file is cut short or corrupted: write it again (a --dataset "
    "converted under --data_dir: delete its folder there and run again to "
    "convert it anew), or leave it out of the file pattern.")

# TensorFlow's reader on a cut file: "truncated record at N' failed with
# EOF reached" (N: a byte offset; in a GZIP file, of the inflated stream).
_TRUNCATED = re.compile(r"truncated record at (\d+)")


def damaged_error(path: str, what: str, error: Exception, good: int
                  ) -> errors.DataError:
  """The `DataError` for TensorFlow's reader failing on `path` (`what`
  names it) after `good` records, with TensorFlow's cause in words."""
  first = first_line(error)
  truncated = _TRUNCATED.search(first)
  if path.endswith(".gz") and "incorrect header check" in first:
    first = (f"{type(error).__name__}: {first}: the name ends in .gz but "
             "the file is not GZIP data (an uncompressed TFRecord file must "
             "not be named .gz)")
  elif truncated and path.endswith(".gz"):
    first = (f"the GZIP data ends inside record {good + 1} (at byte "
             f"{truncated.group(1)} of the decompressed records)")
  elif truncated:
    first = f"the file ends inside the record at byte {truncated.group(1)}"
  else:
    first = f"{type(error).__name__}: {first}"
  return errors.DataError(
      f"{what} {path} is damaged: {first} (after {good} good "
      f"record(s)). {_REWRITE_ADVICE}")


def check_compression(files: Sequence[str], *, flag: str):
  """Checks that the files of one flag are all `.gz` or all uncompressed
  (one input pipeline reads them with one `compression_type`).

  Raises:
    DataError: a mix; the message names the flag, one file of each kind
      and the fix.
  """
  gz = [f for f in files if f.endswith(".gz")]
  plain = [f for f in files if not f.endswith(".gz")]
  if gz and plain:
    raise errors.DataError(
        f"{flag} mixes GZIP (.gz) and uncompressed TFRecord files "
        f"({len(gz)} like {gz[0]}, {len(plain)} like {plain[0]}): one flag's "
        "files are read with one compression. Compress them all (gzip, "
        "keeping the .gz name) or none, or narrow the glob to one kind.")


# --- TFRecord framing ---------------------------------------------------------
# A TFRecord file is a sequence of records, each
#   uint64 length | uint32 masked_crc32c(length) | data[length] |
#   uint32 masked_crc32c(data)
# little-endian, with CRC32C (Castagnoli) masked as
# ((crc >> 15) | (crc << 17)) + 0xa282ead8 (TensorFlow's
# tensorflow/core/lib/io/record_writer.h, tsl/lib/hash/crc32c.h).
HEADER_BYTES = 12
FOOTER_BYTES = 4
_MASK_DELTA = 0xA282EAD8
# Bytes read at a time: big reads keep gs:// round trips few.
_CHUNK_BYTES = 16 << 20


def _python_crc32c_table():
  table = []
  for i in range(256):
    crc = i
    for _ in range(8):
      crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    table.append(crc)
  return tuple(table)


_TABLE = _python_crc32c_table()


def _python_crc32c(data: bytes) -> int:
  """CRC32C in Python (about 1 µs per byte: for 8-byte headers only)."""
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def _library_crc32c():
  """google-crc32c's compiled CRC32C (installed with google-cloud-storage),
  or None when it is missing or only its pure-Python fallback is there."""
  try:
    # Optional dependency: the pure-Python CRC below serves without it.
    import google_crc32c  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  if getattr(google_crc32c, "implementation", "") != "c":
    return None
  return google_crc32c.value


# The compiled CRC32C, when installed: a remote uncompressed file is then
# read once, its CRCs checked in the framing pass.
LIBRARY_CRC32C = _library_crc32c()


def _masked(crc: int) -> int:
  return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


_HEADER = struct.Struct("<QI")
_FOOTER = struct.Struct("<I")


def check_framing(path: str, *, what: str = "file",
                  check_headers: bool = True,
                  check_data: Optional[bool] = None) -> int:
  """Walks the records of the uncompressed TFRecord file `path`.

  Checks that the file ends exactly where its last record does and, as
  asked, each header's and each record's data masked CRC32C. One
  sequential read in 16 MiB pieces (local or `gs://`).

  Args:
    path: an uncompressed TFRecord file.
    what: how the message names the file, e.g. "training file".
    check_headers: check each header's CRC (8 bytes: cheap even in
      Python), so that a damaged length is named as such.
    check_data: check each record's data CRC (with `LIBRARY_CRC32C` when
      installed, else in Python: about 1 µs per byte); None: when
      `LIBRARY_CRC32C` is installed.

  Returns:
    The number of records.

  Raises:
    DataError: naming `what`, `path`, the byte offset of the bad record,
      its number and what is wrong (a header or data CRC that fails, a
      record or header cut short by the end of the file).
  """
  if check_data is None:
    check_data = LIBRARY_CRC32C is not None
  crc32c = LIBRARY_CRC32C or _python_crc32c
  header, footer = _HEADER.unpack_from, _FOOTER.unpack_from
  count, base, pos, end, buf = 0, 0, 0, 0, b""

  def fail(problem: str, offset: int):
    return errors.DataError(
        f"{what} {path} is damaged: {problem} at byte {offset} (record "
        f"{count + 1}; after {count} good record(s)). {_REWRITE_ADVICE}")

  try:
    with tf.io.gfile.GFile(path, "rb") as f:
      while True:
        chunk = f.read(_CHUNK_BYTES)
        if chunk:
          buf, base, pos = buf[pos:] + chunk, base + pos, 0
        end = len(buf)
        while end - pos >= HEADER_BYTES:
          length, length_crc = header(buf, pos)
          if check_headers and _masked(crc32c(buf[pos:pos + 8])) != (
              length_crc):
            raise fail("a record header fails its CRC32C", base + pos)
          stop = pos + HEADER_BYTES + length + FOOTER_BYTES
          if stop > end:
            break
          if check_data and _masked(crc32c(
              buf[pos + HEADER_BYTES:stop - FOOTER_BYTES])) != footer(
                  buf, stop - FOOTER_BYTES)[0]:
            raise fail("a record's data fails its CRC32C", base + pos)
          count += 1
          pos = stop
        if not chunk:
          break
  except (tf.errors.OpError, OSError) as e:
    raise damaged_error(path, what, e, count) from None
  left = end - pos
  if left:
    if left < HEADER_BYTES:
      problem = (f"the file ends {left} byte(s) into a record's "
                 f"{HEADER_BYTES}-byte header")
    else:
      problem = (f"the file ends {left} byte(s) into a record of "
                 f"{HEADER_BYTES + header(buf, pos)[0] + FOOTER_BYTES} bytes")
    raise fail(problem, base + pos)
  return count


def count_file(path: str, *, what: str = "file") -> int:
  """Reads the TFRecord file `path` to its end; returns its record count.

  TensorFlow's reader (C++) counts the records and checks their CRCs; for
  an uncompressed file a second pass reads only the lengths
  (`check_framing`) and checks that the file ends on a record boundary,
  which the reader does not (a file cut inside a record's header reads as
  whole). On `gs://` and other remote file systems, with the compiled
  CRC32C installed, one `check_framing` pass with CRCs does both (a second
  read there is a second download). A `.gz` file is read by TensorFlow's
  reader alone (its inflater catches a cut). Measured costs:
  docs/design/nothing-lost.md.

  Raises:
    DataError: the file cannot be read, or is cut mid-record or corrupted;
      the message names `what`, `path` and, for an uncompressed file, the
      byte offset of the bad record.
  """
  plain = not path.endswith(".gz")
  if plain and "://" in path and LIBRARY_CRC32C is not None:
    return check_framing(path, what=what, check_data=True)
  count = 0
  inflated = 0  # Bytes of the decompressed records, framing included.
  try:
    for record in _records(path):
      count += 1
      inflated += HEADER_BYTES + len(record) + FOOTER_BYTES
  except (tf.errors.OpError, OSError) as e:
    if plain and isinstance(e, tf.errors.DataLossError):
      # Name what is wrong and where, from the record framing (the data
      # CRCs again only when that is fast).
      check_framing(path, what=what,
                    check_data=LIBRARY_CRC32C is not None)
    raise damaged_error(path, what, e, count) from None
  if plain:
    # The reader checked every CRC: only where the records end is left.
    check_framing(path, what=what, check_headers=False, check_data=False)
  else:
    check_gzip_end(path, inflated, what=what, count=count)
  return count


def check_gzip_end(path: str, inflated: int, *, what: str = "file",
                   count: int = 0):
  """Checks that the GZIP file `path` ends where its data ends.

  TensorFlow's reader stops without an error where a cut GZIP file happens
  to stop on a record boundary (or before the first record), so a cut file
  reads as a shorter whole one. A whole file ends with the size of its
  decompressed data (ISIZE, mod 2**32, RFC 1952): that is read (4 bytes)
  and compared with `inflated`; only when they differ (a cut file, or one
  made of several GZIP members) is the file decompressed again, in Python,
  to tell which.

  Args:
    path: a `.gz` TFRecord file (local or remote).
    inflated: the bytes its records take decompressed (framing included),
      as TensorFlow's reader read them.
    what: how the message names the file.
    count: the records read, for the message.

  Raises:
    DataError: the GZIP data ends before its end-of-stream mark, or holds
      more than the reader read.
  """
  damaged = lambda problem: errors.DataError(
      f"{what} {path} is damaged: {problem} (after {count} good "
      f"record(s)). {_REWRITE_ADVICE}")
  size = tf.io.gfile.stat(path).length
  with tf.io.gfile.GFile(path, "rb") as f:
    if size >= 18:  # The smallest GZIP member: 10 header + 8 trailer bytes.
      f.seek(size - 4)
      (isize,) = struct.unpack("<I", f.read(4))
      if isize == inflated % (1 << 32):
        return
    f.seek(0)
    total, inflater = 0, zlib.decompressobj(wbits=31)
    try:
      while True:
        chunk = f.read(_CHUNK_BYTES)
        if not chunk:
          break
        while chunk:
          total += len(inflater.decompress(chunk))
          chunk = b""
          if inflater.eof:  # The next member, if any.
            chunk = inflater.unused_data
            inflater = zlib.decompressobj(wbits=31) if chunk else inflater
    except zlib.error as e:
      raise damaged(f"the GZIP data is corrupted ({e})") from None
  if not inflater.eof:
    raise damaged(f"the GZIP data ends before its end-of-stream mark "
                  f"({size} bytes; {total} bytes of records decompressed)")
  if total != inflated:
    raise damaged(f"the GZIP data holds {total} bytes of records, the "
                  f"reader read {inflated}")


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
    raise errors.DataError(
        f"{what} {path}: its first record is not a "
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
    raise errors.DataError(
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
        raise damaged_error(path, f"{flag}: {what}", e, 0) from None
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
