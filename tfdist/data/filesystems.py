"""File systems beyond TensorFlow's own: tensorflow-io's, checked at start.

TensorFlow reads local paths, `gs://` and `ram://` by itself. tensorflow-io
(`pip install 'tfdist[io]'`) adds `s3://`, `hdfs://`, `viewfs://`, `har://`,
`az://`, `http(s)://` and `oss://` when it is imported, and only where its
shared libraries load: tensorflow-io 0.37.1, its last release, loads with
TensorFlow 2.16 and 2.17 and not with 2.18 to 2.21 (measured: undefined
symbols, its file systems stay unregistered).

`require_file_systems` runs before anything expensive (at the binary's edge
and at the start of `run_experiment`, in every task of a cluster, since
each task opens files itself): it imports tensorflow-io when a path needs
it, and stops with `FileSystemUnavailableError` naming the flag, the path,
the package, the TensorFlow versions it loads with and the fix when the
scheme is still not there.

tensorflow-io's S3 file system makes the process abort at exit ("pure
virtual method called", exit status 134: tensorflow/io#2039, open for
0.37.1), after the work is done. `used_tensorflow_io()` says whether this
process loaded it; `tfdist.train` then ends with `os._exit` and the real
exit status.
"""

import re
import sys
import warnings
from typing import Iterable, List, Tuple

from tfdist import config as config_lib
from tfdist import errors
from tfdist.errors import first_line

TENSORFLOW_IO_PACKAGE = "tensorflow-io"
TENSORFLOW_IO_VERSION = "0.37.1"
# The TensorFlow versions tensorflow-io 0.37.1 loads with (2.16 by its own
# metadata, 2.17 measured; 2.18.1, 2.19.1, 2.20.0 and 2.21.0 measured not).
TENSORFLOW_IO_LOADS_WITH = "TensorFlow 2.16 and 2.17"
# Schemes that tensorflow-io 0.37.1 registers on import (measured with
# TensorFlow 2.17.1).
TENSORFLOW_IO_SCHEMES = ("s3", "hdfs", "viewfs", "har", "az", "http", "https",
                         "oss")

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_used_tensorflow_io = False


def scheme_of(path: str) -> str:
  """`'s3'` for `s3://bucket/x`, `''` for a local path."""
  match = _SCHEME.match(path.strip())
  return match.group(1).lower() if match else ""


def split_paths(flag: str, value: str) -> List[Tuple[str, str]]:
  """`(flag, path)` for each comma-separated entry of a flag value."""
  return [(flag, p.strip()) for p in str(value or "").split(",") if p.strip()]


def _registered_schemes() -> set:
  return set(_tensorflow().io.gfile.get_registered_schemes())


def _tensorflow():
  """The `tensorflow` module, imported on first use.

  Imported here rather than at the top: checking paths that need no extra
  file system (local paths, or none) never loads TensorFlow, so the
  module stays cheap to import where TensorFlow is not wanted yet.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf


def _import_tensorflow_io() -> str:
  """Imports tensorflow-io; returns '' or why its file systems are missing."""
  global _used_tensorflow_io
  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      # An optional dependency (`tfdist[io]`), imported only when a path
      # needs one of its schemes.
      import tensorflow_io  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    return (f"{TENSORFLOW_IO_PACKAGE} is not installed ({type(e).__name__}: "
            f"{e})")
  except Exception as e:  # pylint: disable=broad-except
    return f"{TENSORFLOW_IO_PACKAGE} fails to import ({type(e).__name__}: {e})"
  _used_tensorflow_io = True
  problems = [str(w.message) for w in caught
              if "not loaded" in str(w.message) or
              "unable to load" in str(w.message)]
  if not problems:
    return ""
  symbol = re.search(r"undefined symbol: \S+?(?=['\]\s]|$)",
                     "\n".join(problems))
  return (f"{TENSORFLOW_IO_PACKAGE} "
          f"{getattr(tensorflow_io, '__version__', '?')} is installed but "
          "its libraries do not load with this TensorFlow ("
          f"{symbol.group(0) if symbol else first_line(problems[0])})")


CONFIG_PATH_FIELDS = config_lib.settings_with("path")


def config_paths(config, decisions=None) -> List[Tuple[str, str]]:
  """`(flag, path)` of every path a run reads or writes, for
  `require_file_systems`.

  Args:
    config: the run's `tfdist.config.TrainConfig` (its `CONFIG_PATH_FIELDS`
      by flat name; comma-separated flags give one pair per entry).
    decisions: the run's `tfdist.distribute.decisions.Decisions`: the
      folders and files they chose (the environment's, a trial's) in place
      of the flags'; None: the flags'.
  """
  values = {name: getattr(config, name) for name in CONFIG_PATH_FIELDS}
  if decisions is not None:
    values.update({name: value for name, value
                   in decisions.field_values().items() if name in values})
  out = []
  for name in CONFIG_PATH_FIELDS:
    out += split_paths(f"--{name}", values[name])
  return out


def require_file_systems(paths: Iterable[Tuple[str, str]]) -> Tuple[str, ...]:
  """Makes sure TensorFlow can open every path's scheme, or explains why not.

  Imports tensorflow-io when a path uses one of its schemes (`s3://`, ...).

  Args:
    paths: `(flag, path)` pairs, e.g.
      `config_paths(config)`; local paths and
      TensorFlow's own schemes (`gs://`, `ram://`, `file://`) pass as they
      are.

  Returns:
    The schemes that tensorflow-io provided (empty when none was needed).

  Raises:
    FileSystemUnavailableError: a scheme is not registered after importing
      tensorflow-io (not installed, or it does not load with this
      TensorFlow), or no package tfdist knows provides it.
  """
  paths = list(paths)
  wanted = {}
  for flag, path in paths:
    scheme = scheme_of(path)
    if scheme and scheme != "file":
      wanted.setdefault(scheme, (flag, path))
  if not wanted:
    return ()
  registered = _registered_schemes()
  missing = {s: fp for s, fp in wanted.items() if s not in registered}
  if not missing:
    return tuple(sorted(s for s in wanted if s in TENSORFLOW_IO_SCHEMES))
  why = ""
  if any(s in TENSORFLOW_IO_SCHEMES for s in missing):
    why = _import_tensorflow_io()
    registered = _registered_schemes()
  for scheme, (flag, path) in sorted(missing.items()):
    if scheme in registered:
      continue
    tf = _tensorflow()
    if scheme in TENSORFLOW_IO_SCHEMES:
      raise errors.FileSystemUnavailableError(
          f"{flag}={path!r}: TensorFlow {tf.__version__} has no '{scheme}://' "
          f"file system. The package {TENSORFLOW_IO_PACKAGE} provides it, and "
          f"{TENSORFLOW_IO_PACKAGE} {TENSORFLOW_IO_VERSION} (its last release) "
          f"loads with {TENSORFLOW_IO_LOADS_WITH} only; here {why}. "
          "Fix: use TensorFlow 2.17 (e.g. Vertex AI's tf-cpu.2-17.py310 "
          "container) with `pip install 'tfdist[io]'`, or copy the data to "
          "a local or gs:// path.")
    raise errors.FileSystemUnavailableError(
        f"{flag}={path!r}: TensorFlow {tf.__version__} has no '{scheme}://' "
        f"file system (registered: "
        f"{', '.join(sorted(s + '://' for s in registered if s))}; local "
        "paths need no scheme). Fix the path, or install the package that "
        "registers that scheme.")
  return tuple(sorted(s for s in wanted if s in TENSORFLOW_IO_SCHEMES))


def used_tensorflow_io() -> bool:
  """Whether this process imported tensorflow-io through tfdist."""
  return _used_tensorflow_io or "tensorflow_io" in sys.modules

