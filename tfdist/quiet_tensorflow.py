"""Importing TensorFlow without its import-time notices (binaries only).

TensorFlow's native code prints, while it is imported and whatever
`TF_CPP_MIN_LOG_LEVEL` says, absl's notice that logging is not initialized
(a line starting "WARNING:") and the oneDNN and CPU-feature notices. The
binaries (`tfdist.train`, `tfdist.job_spec`) import TensorFlow through
`import_tensorflow`, which leaves exactly those lines out of stderr and
writes everything else through. `TF_CPP_MIN_LOG_LEVEL=0` shows them all.

Standard library only: imported before TensorFlow.
"""

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


def import_tensorflow():
  """Imports TensorFlow with its import-time notices left out of stderr.

  Everything else written to stderr meanwhile is written through afterwards.
  An import that fails is not raised here: the caller's own import (or
  `tfdist.versions.check_installed_versions`) reports it.
  """
  if "tensorflow" in sys.modules or not quiet_requested():
    return
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
    except Exception:  # pylint: disable=broad-except
      pass
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      for line in captured.read().decode(errors="replace").splitlines(True):
        if not IMPORT_NOTICES.search(line):
          sys.stderr.write(line)
      sys.stderr.flush()
