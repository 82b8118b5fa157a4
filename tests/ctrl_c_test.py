"""Ctrl-C from a terminal: SIGINT to the whole foreground process group.

A shell starts a job as a process group of its own and a terminal's Ctrl-C
sends SIGINT to every process in it: the main process and every helper it
started there (the grace-period watcher of `tfdist.runtime.watchdog`). Each
case starts one such group (`LauncherWatch(own_group=True)`), waits for a
few steps, sends SIGINT to the group and checks the end: status 130, one
"Stopped by SIGINT" line, a checkpoint, and no traceback or ignored
exception from any process.
"""

import os
import re
import signal
import sys

from absl.testing import absltest

from tests import multi_worker_testlib as testlib
from tests import testutil

TIMEOUT = 180
# What no process may print after Ctrl-C: a helper's KeyboardInterrupt, the
# main process's broken wakeup pipe.
_FORBIDDEN = ("Traceback", "Exception ignored", "BrokenPipeError",
              "KeyboardInterrupt")


class CtrlCTest(absltest.TestCase):

  def _interrupt(self, watch: testlib.LauncherWatch, step_pattern: str,
                 stopped_pattern: str):
    self.assertIsNotNone(watch.wait_for(step_pattern, 150),
                         watch.output()[-4000:])
    watch.ctrl_c()
    status = watch.wait()
    output = watch.output()
    self.assertEqual(status, 128 + signal.SIGINT, output[-6000:])
    for text in _FORBIDDEN:
      self.assertNotIn(text, output, output[-6000:])
    self.assertLen(re.findall(stopped_pattern, output, re.M), 1,
                   output[-6000:])
    return output

  def test_a_fit_script(self):
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    watch = testlib.LauncherWatch(
        [], [], timeout=TIMEOUT, own_group=True,
        command=[sys.executable, "-m", "tests.fit_stop_testlib", model_dir,
                 "100000"])
    self._interrupt(watch, r"step 10/100000: loss",
                    r"^fit_stop_testlib\.py: Stopped by SIGINT at step \d+")

  def test_the_train_binary(self):
    data = testutil.fashion_mnist_subset(limit=256)
    watch = testlib.LauncherWatch(
        [], [], timeout=TIMEOUT, own_group=True,
        command=[sys.executable, "-m", "tfdist.train",
                 "--distribution_strategy=one_device",
                 f"--train_files={data['train']}",
                 f"--eval_files={data['eval']}", "--batch_size=32",
                 "--train_steps=100000", "--log_steps=5",
                 "--epochs_between_evals=100000",
                 f"--model_dir={testutil.scratch_dir()}"])
    self._interrupt(watch, r"step 10/100000: loss",
                    r"^tfdist\.train: Stopped by SIGINT at step \d+")

  def test_the_launcher(self):
    # The launcher forwards the signal to its tasks, which run in sessions
    # of their own: each task hears it once, from the launcher.
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    watch = testlib.LauncherWatch(
        ["--num_workers=1", "--module=tests.fit_stop_testlib"],
        [model_dir, "100000"], timeout=TIMEOUT, own_group=True)
    output = self._interrupt(
        watch, r"\[chief:0\] .*step 10/100000: loss",
        r"^\[chief:0\] fit_stop_testlib\.py: Stopped by SIGINT at step \d+")
    self.assertIn("[launch] SIGINT: forwarding to every task", output)


if __name__ == "__main__":
  absltest.main()
