"""Tests for tests/pytest_main.py, the entry point of every Bazel test.

The last class runs only under `bazel test` and checks the sandbox set-up
from the inside: HOME and caches in TEST_TMPDIR, imports from the runfiles.
"""

import os
import signal
import subprocess
import sys

from absl.testing import absltest

from tests import pytest_main


class PytestArgsTest(absltest.TestCase):

  def test_plain_run(self):
    self.assertEqual(
        pytest_main.pytest_args(["pytest_main.py", "tests/a_test.py"], {}),
        ["tests/a_test.py", "-p", "no:cacheprovider", "-q"])

  def test_bazel_xml_filter_and_extra_args(self):
    env = {"XML_OUTPUT_FILE": "/out/test.xml",
           "TESTBRIDGE_TEST_ONLY": "warmup and not cosine"}
    self.assertEqual(
        pytest_main.pytest_args(
            ["pytest_main.py", "tests/a_test.py", "-x"], env),
        ["tests/a_test.py", "-p", "no:cacheprovider", "-q",
         "--junitxml=/out/test.xml", "-k", "warmup and not cosine", "-x"])

  def test_several_files_end_at_the_first_option(self):
    self.assertEqual(
        pytest_main.pytest_args(
            ["pytest_main.py", "tests/a_test.py", "tests/b_test.py", "-x",
             "tests/c_test.py"], {"TESTBRIDGE_TEST_ONLY": "fast"}),
        ["tests/a_test.py", "tests/b_test.py", "-p", "no:cacheprovider",
         "-q", "-k", "fast", "-x", "tests/c_test.py"])

  def test_a_shard_runs_every_nth_file(self):
    argv = ["pytest_main.py", "a_test.py", "b_test.py", "c_test.py", "-x"]
    shard = lambda i: pytest_main.pytest_args(
        argv, {"TEST_TOTAL_SHARDS": "2", "TEST_SHARD_INDEX": str(i)})
    self.assertEqual(shard(0), ["a_test.py", "c_test.py", "-p",
                                "no:cacheprovider", "-q", "-x"])
    self.assertEqual(shard(1), ["b_test.py", "-p", "no:cacheprovider", "-q",
                                "-x"])
    self.assertEqual(pytest_main.pytest_args(
        ["pytest_main.py", "a_test.py"],
        {"TEST_TOTAL_SHARDS": "2", "TEST_SHARD_INDEX": "1"}), [])

  def test_test_file_is_required(self):
    with self.assertRaisesRegex(SystemExit, "usage: pytest_main.py TEST_FILE"):
      pytest_main.pytest_args(["pytest_main.py"], {})


class UseTestTmpdirTest(absltest.TestCase):

  def test_home_and_caches_go_to_test_tmpdir(self):
    env = {"TEST_TMPDIR": "/sandbox/tmp"}
    pytest_main._use_test_tmpdir(env)  # pylint: disable=protected-access
    self.assertEqual(env, {"TEST_TMPDIR": "/sandbox/tmp",
                           "HOME": "/sandbox/tmp",
                           "KERAS_HOME": "/sandbox/tmp/.keras",
                           "XDG_CACHE_HOME": "/sandbox/tmp/.cache"})

  def test_values_given_with_test_env_are_kept(self):
    env = {"TEST_TMPDIR": "/t", "HOME": "/home/me", "KERAS_HOME": "/k"}
    pytest_main._use_test_tmpdir(env)  # pylint: disable=protected-access
    self.assertEqual(env["HOME"], "/home/me")
    self.assertEqual(env["KERAS_HOME"], "/k")

  def test_nothing_changes_outside_bazel(self):
    env = {"HOME": "/home/me"}
    pytest_main._use_test_tmpdir(env)  # pylint: disable=protected-access
    self.assertEqual(env, {"HOME": "/home/me"})


@absltest.skipUnless(os.environ.get("TEST_SRCDIR"),
                     "checks Bazel's sandbox; runs under `bazel test` only")
class InsideBazelTest(absltest.TestCase):

  def test_home_and_keras_home_are_writable_in_test_tmpdir(self):
    tmp = os.environ["TEST_TMPDIR"]
    self.assertEqual(os.environ["HOME"], tmp)
    keras_home = os.environ["KERAS_HOME"]
    self.assertTrue(keras_home.startswith(tmp))
    os.makedirs(keras_home, exist_ok=True)
    with open(os.path.join(keras_home, "probe"), "w") as f:
      f.write("ok")

  def test_imports_come_from_the_runfiles(self):
    import tfdist  # pylint: disable=g-import-not-at-top
    runfiles = os.environ["TEST_SRCDIR"]
    self.assertTrue(os.path.abspath(tfdist.__file__).startswith(
        os.path.abspath(runfiles)), tfdist.__file__)
    source_tests = os.path.dirname(os.path.realpath(pytest_main.__file__))
    self.assertNotIn(source_tests, [os.path.realpath(p) for p in sys.path if p])

  def test_ctrl_c_is_handled_here_and_in_subprocesses(self):
    # Bazel's test-setup.sh runs the test with job control on (`set -m`), so
    # SIGINT is not ignored and signal tests behave as in a terminal.
    self.assertIs(signal.getsignal(signal.SIGINT), signal.default_int_handler)
    child = subprocess.run(
        [sys.executable, "-c",
         "import signal; print(signal.getsignal(signal.SIGINT) is "
         "signal.default_int_handler)"],
        stdout=subprocess.PIPE, text=True, timeout=60, check=True)
    self.assertEqual(child.stdout.strip(), "True")

  def test_the_interpreter_is_a_virtual_environment(self):
    self.assertNotEqual(sys.prefix, sys.base_prefix)


if __name__ == "__main__":
  absltest.main()
