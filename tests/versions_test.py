"""Supported TensorFlow and Keras versions (tfdist/observability/versions.py).

The binary test installs a real unsupported Keras (3.11.3, from the
wheelhouse tools/setup.sh fills; no download) into a scratch folder put
first on the path, and checks that `python -m tfdist.train` stops at start.
"""

import os
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tests import testutil
from tfdist import errors
from tfdist.observability import versions

# Also run on the oldest supported TensorFlow (see tests/conftest.py).
pytestmark = pytest.mark.compat

UNSUPPORTED_KERAS = "3.11.3"


class CheckVersionsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("oldest", "2.17.1", "3.12.4"),
      ("default_install", "2.21.0", "3.15.1"),
      ("release_candidate", "2.19.0-rc1", "3.13.0"),
      ("keras_dev_build", "2.20.0", "3.14.0.dev2025010103"),
  )
  def test_supported_pairs_pass(self, tf_version, keras_version):
    found = versions.Versions(tf_version, keras_version, "3.10.13")
    self.assertEqual(versions.check_versions(found), found)

  @parameterized.named_parameters(
      ("tensorflow_too_old", "2.16.2", "3.12.4",
       "TensorFlow 2.16.2 is not supported"),
      ("tensorflow_too_new", "2.22.0", "3.15.1",
       "TensorFlow 2.22.0 is not supported"),
      ("keras_2", "2.17.1", "2.15.0", "Keras 2.15.0 is not supported"),
      ("keras_too_old", "2.17.1", "3.11.3", "Keras 3.11.3 is not supported"),
      ("keras_4", "2.21.0", "4.0.0", "Keras 4.0.0 is not supported"),
      ("unreadable", "nightly", "3.12.0", "TensorFlow nightly is not"),
  )
  def test_unsupported_names_found_range_and_fix(self, tf_version,
                                                 keras_version, problem):
    with self.assertRaises(errors.UnsupportedVersionError) as caught:
      versions.check_versions(
          versions.Versions(tf_version, keras_version, "3.11.7"))
    message = str(caught.exception)
    self.assertIn(problem, message)
    self.assertIn(f"found TensorFlow {tf_version}, Keras {keras_version}, "
                  "Python 3.11.7", message)
    self.assertIn("TensorFlow 2.17 to 2.21 with Keras 3 (3.12 or newer)",
                  message)
    self.assertIn("pip install 'tfdist[cpu]'", message)

  def test_both_problems_are_named(self):
    with self.assertRaisesRegex(
        errors.UnsupportedVersionError,
        "TensorFlow 2.15.1 is not supported; Keras 2.15.0 is not supported"):
      versions.check_versions(versions.Versions("2.15.1", "2.15.0", "3.10.1"))

  def test_this_process_runs_a_supported_pair(self):
    import keras  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    found = versions.check_installed_versions()
    self.assertEqual((found.tensorflow, found.keras),
                     (tf.__version__, keras.__version__))


class BinaryTest(absltest.TestCase):

  def test_unsupported_keras_stops_the_binary_at_start(self):
    target = os.path.join(testutil.scratch_dir(), "old_keras")
    wheelhouse = testutil.setup_output(".wheelhouse")
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index",
         "--no-deps", "--disable-pip-version-check", "--find-links",
         wheelhouse, "--target", target, f"keras=={UNSUPPORTED_KERAS}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=120)
    self.assertEqual(pip.returncode, 0, pip.stdout)
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    proc = testutil.run_module(
        "tfdist.train", [f"--model_dir={model_dir}", "--train_steps=5"],
        timeout=120, env={"PYTHONPATH": target + os.pathsep +
                          testutil.REPO_ROOT})
    self.assertNotEqual(proc.returncode, 0, proc.stdout[-3000:])
    self.assertIn(f"tfdist.train: error: Keras {UNSUPPORTED_KERAS} is not "
                  "supported", proc.stdout)
    self.assertIn("TensorFlow 2.17 to 2.21 with Keras 3 (3.12 or newer)",
                  proc.stdout)
    # Stopped before any work: no data converted, nothing written.
    self.assertFalse(os.path.exists(model_dir))


if __name__ == "__main__":
  absltest.main()
