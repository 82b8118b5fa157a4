"""Importing TensorFlow without its import-time notices.

TensorFlow's native code prints, while it is imported and whatever
`TF_CPP_MIN_LOG_LEVEL` says, absl's notice that logging is not initialized
(a line starting "WARNING:") and the oneDNN and CPU-feature notices. The
binaries (`tfdist.train`, `tfdist.job_spec`) import TensorFlow through
`import_tensorflow`, which leaves exactly those lines out of stderr and
writes everything else through. In library use `import tfdist` calls
`quiet_library_import`, so a script that imports tfdist before TensorFlow
(or Keras) gets the same. `TF_CPP_MIN_LOG_LEVEL=0` shows them all.

Standard library only: imported before TensorFlow.
"""

import contextlib
import importlib.machinery
import os
import re
import sys
import tempfile

LEVEL_VARIABLE = "TF_CPP_MIN_LOG_LEVEL"
IMPORT_NOTICES = re.compile(
    r"All log messages before absl::InitializeLog\(\) is called|"
    r"port\.cc:\d+\] oneDNN custom operations are on|"
    r"cpu_feature_guard\.cc:\d+\]|"
    r"^To enable the following instructions: .* rebuild TensorFlow")


def quiet_requested() -> bool:
  """False only when the user asked for every line
  (`TF_CPP_MIN_LOG_LEVEL=0`)."""
  return os.environ.get(LEVEL_VARIABLE, "").strip() != "0"


def default_log_level():
  """TensorFlow's C++ INFO and WARNING lines (tf.data graph-rewrite notes,
  allocator notices) are not for tfdist's users; its errors still show.
  Sets `TF_CPP_MIN_LOG_LEVEL=2` unless the user set a value (read when
  TensorFlow loads)."""
  if not os.environ.get(LEVEL_VARIABLE, "").strip():
    os.environ[LEVEL_VARIABLE] = "2"


@contextlib.contextmanager
def _notices_left_out():
  """Captures file descriptor 2 meanwhile; writes it through afterwards,
  less `IMPORT_NOTICES`."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      for line in captured.read().decode(errors="replace").splitlines(True):
        if not IMPORT_NOTICES.search(line):
          sys.stderr.write(line)
      sys.stderr.flush()


class _QuietTensorflowFinder:
  """A `sys.meta_path` finder for `tensorflow` alone: finds it as Python
  would and runs its import with the notices left out (once; it then
  leaves `sys.meta_path`)."""

  def find_spec(self, name, path=None, target=None):
    del target
    if name != "tensorflow":
      return None
    if self in sys.meta_path:
      sys.meta_path.remove(self)
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
      return spec
    run = spec.loader.exec_module

    def exec_module(module):
      with _notices_left_out():
        run(module)

    spec.loader.exec_module = exec_module
    return spec


def quiet_on_import():
  """Makes this process's first `import tensorflow`, wherever it comes
  from (e.g. Ray's `ray.train.tensorflow` in a Ray worker process), leave
  out the import-time notices, as `import_tensorflow` does. Nothing when
  TensorFlow is imported already or `TF_CPP_MIN_LOG_LEVEL=0`."""
  if "tensorflow" in sys.modules or not quiet_requested():
    return
  if not any(isinstance(f, _QuietTensorflowFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _QuietTensorflowFinder())


def import_tensorflow():
  """Imports TensorFlow with its import-time notices left out of stderr.

  Everything else written to stderr meanwhile is written through afterwards.
  An import that fails is not raised here: the caller's own import (or
  `tfdist.observability.versions.check_installed_versions`) reports it.
  """
  if "tensorflow" in sys.modules or not quiet_requested():
    return
  with _notices_left_out():
    try:
      # The one import this module exists for, with the notices left out.
      import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
    except Exception:  # pylint: disable=broad-except
      pass


def quiet_library_import():
  """What `import tfdist` does for a script that has not imported
  TensorFlow yet: `default_log_level` and `quiet_on_import`, so neither the
  import-time notices nor TensorFlow's C++ INFO and WARNING lines reach
  stderr. Nothing when TensorFlow is imported already (its C++ log level
  is then fixed) or `TF_CPP_MIN_LOG_LEVEL=0`; a level the user set is
  kept."""
  if "tensorflow" in sys.modules or not quiet_requested():
    return
  default_log_level()
  quiet_on_import()
