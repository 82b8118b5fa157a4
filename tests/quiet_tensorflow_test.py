"""Importing TensorFlow without its import-time notices (quiet_tensorflow).

The real import runs in a child process (this one has TensorFlow imported
already, and the notices come from native code writing to descriptor 2).
"""

import os
import subprocess
import sys

from absl.testing import absltest

from tests import testutil
from tfdist.runtime import quiet_tensorflow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child_stderr(code: str, **env) -> str:
  """The stderr of `python -c code` with this checkout's tfdist."""
  environ = {**os.environ, "PYTHONPATH": ROOT, **env}
  environ.pop(quiet_tensorflow.LEVEL_VARIABLE, None)
  environ.update(env)
  out = subprocess.run([sys.executable, "-c", code], env=environ, cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       check=True)
  return out.stderr


class NoticeFilterTest(absltest.TestCase):

  def test_the_notices_match_and_other_lines_do_not(self):
    for line in (
        "WARNING: All log messages before absl::InitializeLog() is called "
        "are written to STDERR",
        "I0000 00:00:1.0  1 port.cc:153] oneDNN custom operations are on.",
        "I0000 00:00:1.0  1 cpu_feature_guard.cc:210] This TensorFlow ...",
        "To enable the following instructions: AVX512F, in other "
        "operations, rebuild TensorFlow with the appropriate compiler "
        "flags."):
      self.assertRegex(line, quiet_tensorflow.IMPORT_NOTICES)
    for line in ("E0000 something failed", "Traceback (most recent call)"):
      self.assertNotRegex(line, quiet_tensorflow.IMPORT_NOTICES)

  def test_quiet_unless_level_zero(self):
    old = os.environ.get(quiet_tensorflow.LEVEL_VARIABLE)
    self.addCleanup(
        lambda: os.environ.pop(quiet_tensorflow.LEVEL_VARIABLE, None)
        if old is None else os.environ.update(
            {quiet_tensorflow.LEVEL_VARIABLE: old}))
    os.environ[quiet_tensorflow.LEVEL_VARIABLE] = "0"
    self.assertFalse(quiet_tensorflow.quiet_requested())
    os.environ[quiet_tensorflow.LEVEL_VARIABLE] = "2"
    self.assertTrue(quiet_tensorflow.quiet_requested())

  def test_default_log_level_keeps_the_users_value(self):
    old = os.environ.get(quiet_tensorflow.LEVEL_VARIABLE)
    self.addCleanup(
        lambda: os.environ.pop(quiet_tensorflow.LEVEL_VARIABLE, None)
        if old is None else os.environ.update(
            {quiet_tensorflow.LEVEL_VARIABLE: old}))
    os.environ.pop(quiet_tensorflow.LEVEL_VARIABLE, None)
    quiet_tensorflow.default_log_level()
    self.assertEqual(os.environ[quiet_tensorflow.LEVEL_VARIABLE], "2")
    os.environ[quiet_tensorflow.LEVEL_VARIABLE] = "1"
    quiet_tensorflow.default_log_level()
    self.assertEqual(os.environ[quiet_tensorflow.LEVEL_VARIABLE], "1")


class ImportTest(absltest.TestCase):

  def test_a_plain_import_prints_the_notices(self):
    # The control: what import_tensorflow leaves out is there without it.
    self.assertRegex(_child_stderr("import tensorflow\n"),
                     quiet_tensorflow.IMPORT_NOTICES)

  def test_import_tensorflow_leaves_out_only_the_notices(self):
    stderr = _child_stderr(
        "import sys\n"
        "from tfdist.runtime import quiet_tensorflow\n"
        "quiet_tensorflow.import_tensorflow()\n"
        "assert 'tensorflow' in sys.modules\n"
        "sys.stderr.write('after the import\\n')\n")
    self.assertNotRegex(stderr, quiet_tensorflow.IMPORT_NOTICES)
    self.assertIn("after the import", stderr)

  def test_quiet_on_import_applies_to_a_later_plain_import(self):
    stderr = _child_stderr(
        "import sys\n"
        "from tfdist.runtime import quiet_tensorflow\n"
        "quiet_tensorflow.quiet_on_import()\n"
        "import tensorflow\n"
        "assert not any(isinstance(f, quiet_tensorflow._QuietTensorflowFinder)"
        " for f in sys.meta_path)\n")
    self.assertNotRegex(stderr, quiet_tensorflow.IMPORT_NOTICES)


# A tiny `tfdist.fit` script as a user writes it: tfdist imported first.
_FIT_SCRIPT = """
import sys
import tfdist
import keras
import numpy as np
import tensorflow as tf

def build_model():
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
  model.compile(loss="mse")
  return model

x = np.random.default_rng(0).random((128, 4), dtype="float32")

def make_dataset(training):
  return tf.data.Dataset.from_tensor_slices((x, x.sum(axis=1)))

tfdist.fit(build_model, make_dataset, verbose=2, config=tfdist.TrainConfig(
    model_dir=sys.argv[1], train_steps=2, batch_size=64))
"""
# TensorFlow's C++ log lines (its import notices are IMPORT_NOTICES).
_NATIVE_LOG_LINE = r"(?m)^[IWEF]\d{4} [\d:.]+ +\d+ \S+\.(cc|h):\d+\] "


class LibraryUseTest(absltest.TestCase):
  """`import tfdist` before TensorFlow: a script shows none of
  TensorFlow's start-up or C++ lines (tfdist/__init__.py)."""

  def test_a_fit_script_shows_no_tensorflow_lines(self):
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    environ = {**os.environ, "PYTHONPATH": ROOT}
    environ.pop(quiet_tensorflow.LEVEL_VARIABLE, None)
    out = subprocess.run([sys.executable, "-c", _FIT_SCRIPT, model_dir],
                         env=environ, cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=False)
    self.assertEqual(out.returncode, 0, out.stderr[-4000:])
    self.assertIn("Final eval: loss", out.stdout)
    self.assertIn("tfdist: epoch 1/1, step 2/2", out.stderr)
    self.assertNotRegex(out.stderr, quiet_tensorflow.IMPORT_NOTICES)
    self.assertNotRegex(out.stderr, _NATIVE_LOG_LINE)

  def test_the_users_level_is_kept_and_zero_shows_everything(self):
    code = ("import os, tfdist\n"
            "print(os.environ.get('TF_CPP_MIN_LOG_LEVEL'))\n")
    for level, expected in (("", "2"), ("1", "1")):
      environ = {**os.environ, "PYTHONPATH": ROOT,
                 quiet_tensorflow.LEVEL_VARIABLE: level}
      out = subprocess.run([sys.executable, "-c", code], env=environ,
                           cwd=ROOT, capture_output=True, text=True,
                           timeout=60, check=True)
      self.assertEqual(out.stdout.strip(), expected)
    self.assertRegex(
        _child_stderr("import tfdist\nimport tensorflow\n",
                      TF_CPP_MIN_LOG_LEVEL="0"),
        quiet_tensorflow.IMPORT_NOTICES)


if __name__ == "__main__":
  absltest.main()
