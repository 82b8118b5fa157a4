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
import platform
import re
from typing import Optional, Tuple

from tfdist.config import ConfigError

# Inclusive (major, minor) bounds.
TENSORFLOW_RANGE = ((2, 17), (2, 21))
# Keras 3 from 3.12 (what TensorFlow 2.21 asks for); Keras 4 is not Keras 3.
KERAS_MINIMUM = (3, 12)
KERAS_MAJOR = 3
PYTHON_RANGE = ((3, 10), (3, 11))

SUPPORTED_TEXT = ("TensorFlow 2.17 to 2.21 with Keras 3 (3.12 or newer), on "
                  "Python 3.10 or 3.11")
FIX_TEXT = ("Install a supported pair, e.g. `pip install 'tfdist[cpu]'` "
            "(TensorFlow 2.21) or `pip install 'tensorflow-cpu==2.17.1' "
            "'keras>=3.12,<4'`; on Vertex AI use a prebuilt TensorFlow "
            "training container 2.17 or newer (tf-cpu.2-17.py310).")


class UnsupportedVersionError(ConfigError):
  """TensorFlow or Keras is outside the supported range (or fails to import).

  The message names the versions found, the supported range and the fix.
  """


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
  problems = []
  tf_version = major_minor(versions.tensorflow)
  low, high = TENSORFLOW_RANGE
  if tf_version is None or not low <= tf_version <= high:
    problems.append(f"TensorFlow {versions.tensorflow} is not supported")
  keras_version = major_minor(versions.keras)
  if (keras_version is None or keras_version[0] != KERAS_MAJOR or
      keras_version < KERAS_MINIMUM):
    problems.append(f"Keras {versions.keras} is not supported")
  if problems:
    raise UnsupportedVersionError(
        f"{'; '.join(problems)} (found TensorFlow {versions.tensorflow}, "
        f"Keras {versions.keras}, Python {versions.python}). tfdist supports "
        f"{SUPPORTED_TEXT}. {FIX_TEXT}")
  return versions


def installed_versions() -> Versions:
  """The versions this process imports (imports TensorFlow, then Keras).

  Raises:
    UnsupportedVersionError: TensorFlow or Keras fails to import (e.g. a
      Keras too new for the TensorFlow installed); the message says which,
      with the import error.
  """
  python = platform.python_version()
  try:
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise UnsupportedVersionError(
        f"TensorFlow does not import ({type(e).__name__}: {e}). tfdist "
        f"supports {SUPPORTED_TEXT}. {FIX_TEXT}") from e
  # An unsupported TensorFlow is named before Keras is imported: Keras may
  # fail to import with it.
  check_versions(Versions(tf.__version__, f"{KERAS_MINIMUM[0]}."
                                          f"{KERAS_MINIMUM[1]}", python))
  try:
    import keras  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise UnsupportedVersionError(
        f"Keras does not import with TensorFlow {tf.__version__} "
        f"({type(e).__name__}: {e}). tfdist supports {SUPPORTED_TEXT}. "
        f"{FIX_TEXT}") from e
  return Versions(tf.__version__, keras.__version__, python)


def check_installed_versions() -> Versions:
  """Checks the TensorFlow and Keras this process imports.

  Returns:
    The `Versions` found, when supported.

  Raises:
    UnsupportedVersionError: see `check_versions` and `installed_versions`.
  """
  return check_versions(installed_versions())
