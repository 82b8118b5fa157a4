"""The TensorFlow and Keras versions tfdist supports, checked at start.

Supported: TensorFlow 2.17 to 2.21 with Keras 3 (3.12 or newer), on Python
3.10 and 3.11. TensorFlow 2.21 is what `pip install tfdist[cpu]` installs;
2.17 on Python 3.10 is what Vertex AI's newest prebuilt TensorFlow training
container (`tf-cpu.2-17.py310`) runs. CI tests both (tools/test.sh).

`check_installed_versions()` runs at the binary's edge (`tfdist.train`) and
at the start of `run_experiment`, before anything expensive: an unsupported
TensorFlow or Keras stops the run with `UnsupportedVersionError`, naming the
versions found, the supported range and the fix, instead of failing later
inside TensorFlow or Keras with an unrelated error.
"""

import dataclasses
from importlib import metadata as importlib_metadata
import platform
import re
from typing import Optional, Tuple

from tfdist import errors

# Inclusive (major, minor) bounds.
TENSORFLOW_RANGE = ((2, 17), (2, 21))
# Keras 3 from 3.12 (what TensorFlow 2.21 asks for); Keras 4 is not Keras 3.
KERAS_MINIMUM = (3, 12)
KERAS_MAJOR = 3

SUPPORTED_TEXT = ("TensorFlow 2.17 to 2.21 with Keras 3 (3.12 or newer), on "
                  "Python 3.10 or 3.11")
FIX_TEXT = ("Install a supported pair, e.g. `pip install 'tfdist[cpu]'` "
            "(TensorFlow 2.21) or `pip install 'tensorflow-cpu==2.17.1' "
            "'keras>=3.12,<4'`; on Vertex AI use a prebuilt TensorFlow "
            "training container 2.17 or newer (tf-cpu.2-17.py310).")


@dataclasses.dataclass(frozen=True)
class Versions:
  """The versions a process runs, as strings (`tf.__version__` etc.)."""
  tensorflow: str
  keras: str
  python: str


def major_minor(version: str) -> Optional[Tuple[int, int]]:
  """`(major, minor)` of a version string such as `2.17.1`, `2.21.0-rc1` or
  `3.12.4.dev2025`; None when it does not start with two numbers."""
  match = re.match(r"\s*(\d+)\.(\d+)", str(version))
  return (int(match.group(1)), int(match.group(2))) if match else None


def _tensorflow_problem(version: str) -> str:
  """'' when TensorFlow `version` is supported, else what is wrong."""
  found = major_minor(version)
  low, high = TENSORFLOW_RANGE
  if found is None or not low <= found <= high:
    return f"TensorFlow {version} is not supported"
  return ""


def _keras_problem(version: str) -> str:
  """'' when Keras `version` is supported, else what is wrong."""
  found = major_minor(version)
  if found is None or found[0] != KERAS_MAJOR or found < KERAS_MINIMUM:
    return f"Keras {version} is not supported"
  return ""


def _unsupported(problems, tensorflow: str, keras: str,
                 python: str) -> errors.UnsupportedVersionError:
  return errors.UnsupportedVersionError(
      f"{'; '.join(problems)} (found TensorFlow {tensorflow}, Keras {keras}, "
      f"Python {python}). tfdist supports {SUPPORTED_TEXT}. {FIX_TEXT}")


def check_versions(versions: Versions) -> Versions:
  """Raises unless `versions` are supported; returns them otherwise.

  Args:
    versions: the TensorFlow and Keras versions to check (Python is not
      checked here: `setup.py`'s `python_requires` bounds it at install).

  Raises:
    UnsupportedVersionError: TensorFlow outside 2.17-2.21, Keras other than
      3.x with x >= 12, or a version that cannot be read; the message names
      what was found, the supported range and the fix.
  """
  problems = [p for p in (_tensorflow_problem(versions.tensorflow),
                          _keras_problem(versions.keras)) if p]
  if problems:
    raise _unsupported(problems, versions.tensorflow, versions.keras,
                       versions.python)
  return versions


def _distribution_version(name: str) -> str:
  """The installed version of distribution `name`, or 'unknown'."""
  try:
    return importlib_metadata.version(name)
  except importlib_metadata.PackageNotFoundError:
    return "unknown"


def installed_versions() -> Versions:
  """The versions this process imports (imports TensorFlow, then Keras).

  Raises:
    UnsupportedVersionError: TensorFlow is unsupported (checked before Keras
      is imported: an old TensorFlow can make the Keras import fail), or
      TensorFlow or Keras fails to import; the message says which, with the
      import error.
  """
  python = platform.python_version()
  # Imported here, not at the top: whether they import, and in which
  # order (TensorFlow first: an old one makes the Keras import fail), is
  # what this checks; the binaries call it before anything imports Keras.
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise errors.UnsupportedVersionError(
        f"TensorFlow does not import ({type(e).__name__}: {e}). tfdist "
        f"supports {SUPPORTED_TEXT}. {FIX_TEXT}") from e
  problem = _tensorflow_problem(tf.__version__)
  if problem:
    keras_version = _distribution_version("keras")
    raise _unsupported([problem] + [p for p in [_keras_problem(keras_version)]
                                    if p], tf.__version__, keras_version,
                       python)
  try:
    import keras  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise errors.UnsupportedVersionError(
        f"Keras {_distribution_version('keras')} does not import with "
        f"TensorFlow {tf.__version__} ({type(e).__name__}: {e}). tfdist "
        f"supports {SUPPORTED_TEXT}. {FIX_TEXT}") from e
  return Versions(tf.__version__, keras.__version__, python)


def check_installed_versions() -> Versions:
  """Checks the TensorFlow and Keras this process imports.

  Returns:
    The `Versions` found, when supported.

  Raises:
    UnsupportedVersionError: see `check_versions` and `installed_versions`.
  """
  return check_versions(installed_versions())
