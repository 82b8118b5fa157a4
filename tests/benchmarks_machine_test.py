"""What the benchmarks share (`benchmarks/machine.py`): a child run's
result, its failures, and where the JSON record goes.

Real child processes (`python -c`, no TensorFlow: a fraction of a second
each).
"""

import json
import os

from absl.testing import absltest

from benchmarks import machine
from tests import testutil


class RunChildTest(absltest.TestCase):

  def test_the_last_result_line_is_parsed(self):
    code = ('print("noise {"); print("R {\\"a\\": 1}"); '
            'print("R {\\"a\\": 2}"); print("{\\"b\\": 3}")')
    self.assertEqual(machine.run_child(["-c", code], timeout=60, what="x",
                                       prefix="R "), {"a": 2})
    self.assertEqual(machine.run_child(["-c", code], timeout=60, what="x"),
                     {"b": 3})

  def test_a_failed_child_is_named_with_its_output(self):
    with self.assertRaisesRegex(SystemExit,
                                r"N=2 stage=1 failed \(exit 3\):\nboom"):
      machine.run_child(["-c", "import sys; print('boom'); sys.exit(3)"],
                        timeout=60, what="N=2 stage=1")
    with self.assertRaisesRegex(SystemExit, r"x failed \(exit 0\)"):
      machine.run_child(["-c", "print('no result')"], timeout=60, what="x")

  def test_a_child_out_of_time_names_the_flag(self):
    with self.assertRaisesRegex(
        SystemExit, r"keras/mirrored: no result in 1 s \(raise "
        r"--run_timeout, or use smaller settings\)"):
      machine.run_child(["-c", "import time; time.sleep(30)"], timeout=1,
                        what="keras/mirrored", timeout_flag="--run_timeout")


class WriteJsonTest(absltest.TestCase):

  def test_a_relative_path_is_taken_from_where_bazel_run_started(self):
    started = testutil.scratch_dir()
    before = os.environ.get("BUILD_WORKING_DIRECTORY")
    os.environ["BUILD_WORKING_DIRECTORY"] = started
    try:
      path = machine.write_json("out/r.json", {"a": [1]})
    finally:
      if before is None:
        del os.environ["BUILD_WORKING_DIRECTORY"]
      else:
        os.environ["BUILD_WORKING_DIRECTORY"] = before
    self.assertEqual(path, os.path.join(started, "out", "r.json"))
    with open(path) as f:
      self.assertEqual(json.load(f), {"a": [1]})


if __name__ == "__main__":
  absltest.main()
