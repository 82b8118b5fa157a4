"""Converting a data set once: whole or absent, safe when processes race.

A built-in data set (`tfdist.data.fashion_mnist`, `tfdist.data.movielens`) is
turned into TFRecord files the first time a run asks for it. The files are
written into a temporary sibling folder that is renamed into place once
complete, with `dataset_info.json` (`INFO_FILE`) written last: a folder holding
that file is a finished conversion, and one without it is never read. When
several workers convert at once, the first rename wins and the others drop
their copies.
"""

import json
import os
import uuid
from typing import Callable, Iterable, List, Optional, Tuple

import tensorflow as tf

from tfdist.core.dataset_spec import INFO_FILE


def converted_info(out_dir: str) -> Optional[dict]:
  """The `dataset_info.json` of a finished conversion in `out_dir`.

  Args:
    out_dir: the data set's folder (local or `gs://`).

  Returns:
    The parsed JSON dict, or None when `out_dir` holds no finished
    conversion.
  """
  info_path = os.path.join(out_dir, INFO_FILE)
  if not tf.io.gfile.exists(info_path):
    return None
  with tf.io.gfile.GFile(info_path) as f:
    return json.load(f)


def publish_conversion(out_dir: str, write: Callable[[str], dict]) -> dict:
  """Runs `write` into a temporary sibling of `out_dir`, then renames it.

  Args:
    out_dir: the data set's folder (local or `gs://`); its parent is
      created when missing.
    write: `write(tmp_dir) -> info`: writes the data set's files into
      `tmp_dir` and returns the JSON-serializable info, written as
      `INFO_FILE` after it returns.

  Returns:
    The info `write` returned.

  Raises:
    Whatever `write` raises; `tf.errors.OpError` or `OSError` when the
    rename fails and no other process's finished copy is in place.
  """
  parent = os.path.dirname(out_dir.rstrip("/")) or "."
  tmp_dir = os.path.join(parent, f".tmp-{os.path.basename(out_dir)}-"
                         f"{uuid.uuid4().hex[:8]}")
  tf.io.gfile.makedirs(tmp_dir)
  info = write(tmp_dir)
  with tf.io.gfile.GFile(os.path.join(tmp_dir, INFO_FILE), "w") as f:
    json.dump(info, f, indent=2)
  try:
    tf.io.gfile.rename(tmp_dir, out_dir)
  except (tf.errors.OpError, OSError):
    # Another process finished first; its copy is complete (renamed whole).
    tf.io.gfile.rmtree(tmp_dir)
    if not tf.io.gfile.exists(os.path.join(out_dir, INFO_FILE)):
      raise
  return info


def write_shards(out_dir: str, split: str, records: Iterable[bytes], *,
                 num_shards: int) -> Tuple[List[str], int]:
  """Writes serialized records round-robin into GZIP TFRecord files.

  Files are named `{split}-{i:05d}-of-{n:05d}.tfrecord.gz` in `out_dir`;
  record `k` goes to shard `k % num_shards`.

  Args:
    out_dir: an existing folder (local or `gs://`).
    split: the file name prefix (`train`, `test`).
    records: serialized `tf.train.Example`s (bytes), in order.
    num_shards: files to write (>= 1).

  Returns:
    `(paths, count)`: the files written and the records written.
  """
  options = tf.io.TFRecordOptions(compression_type="GZIP")
  paths = [os.path.join(out_dir, f"{split}-{i:05d}-of-{num_shards:05d}"
                        ".tfrecord.gz") for i in range(num_shards)]
  writers = [tf.io.TFRecordWriter(p, options) for p in paths]
  count = 0
  try:
    for record in records:
      writers[count % num_shards].write(record)
      count += 1
  finally:
    for w in writers:
      w.close()
  return paths, count
