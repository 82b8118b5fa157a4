"""Ctrl-C from a terminal: SIGINT to the whole foreground process group.

A shell starts a job as a process group of its own and a terminal's Ctrl-C
sends SIGINT to every process in it: the main process and every helper it
started there (the grace-period watcher of `tfdist.runtime.watchdog`). Each
case starts one such group (`LauncherWatch(own_group=True)`), waits for a
few steps, sends SIGINT to the group and checks the end: status 130, one
"Stopped by SIGINT" line, a checkpoint, and no traceback or ignored
exception from any process.

The launcher's case (2 workers of a `tfdist.fit` script, Ctrl-C to the
launcher's group, each task stopped once by the launcher's forwarded
SIGINT): tests/launch_test.py `FitScriptStopTest`.
"""

import os
import pty
import re
import select
import signal
import sys
import time

from absl.testing import absltest

from tests import multi_worker_testlib as testlib
from tests import testutil

TIMEOUT = 180
# What no process may print after Ctrl-C: a helper's KeyboardInterrupt, the
# main process's broken wakeup pipe.
_FORBIDDEN = ("Traceback", "Exception ignored", "BrokenPipeError",
              "KeyboardInterrupt")
# absl's glog header (`I1206 19:48:44.075923 139643060059008 file.py:12] `).
_GLOG_HEADER = r"(^|\n)[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] "


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
    output = self._interrupt(
        watch, r"step 10/100000: loss",
        r"^fit_stop_testlib\.py: Stopped by SIGINT at step \d+")
    self._check_keras_like(output)

  def _check_keras_like(self, output: str):
    """A `tfdist.fit` script's lines read like Keras's: no absl notice, no
    glog header, the stop said once."""
    self.assertNotIn("Logging before flag parsing", output)
    self.assertNotRegex(output, _GLOG_HEADER)
    self.assertNotIn("Stopped at step", output)  # Said once, by the error.
    self.assertRegex(output, r"(^|\n)tfdist: received SIGINT: saving")

  def test_a_fit_script_in_a_terminal(self):
    # In a terminal `tfdist.fit` shows Keras's progress bar: the SIGINT
    # notice and tfdist's lines start on a line of their own.
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    pid, fd = pty.fork()
    if pid == 0:  # The child: a session (and process group) of its own.
      try:
        os.chdir(testutil.REPO_ROOT)
        os.execve(sys.executable,
                  [sys.executable, "-m", "tests.fit_stop_testlib", model_dir,
                   "100000"], testlib._env())  # pylint: disable=protected-access
      finally:
        os._exit(127)  # pylint: disable=protected-access
    output, sent, deadline = b"", False, time.time() + TIMEOUT
    try:
      while time.time() < deadline:
        if not sent and output.count(b"/step - loss") >= 20:
          os.killpg(pid, signal.SIGINT)  # The bar is open: Ctrl-C.
          sent = True
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
          try:
            data = os.read(fd, 65536)
          except OSError:  # The child is gone (EIO).
            break
          if not data:
            break
          output += data
    finally:
      if not sent or time.time() >= deadline:
        os.kill(pid, signal.SIGKILL)
      _, status = os.waitpid(pid, 0)
      os.close(fd)
    text = output.decode(errors="replace").replace("\r\n", "\n")
    self.assertTrue(sent, text[-4000:])
    self.assertEqual(os.waitstatus_to_exitcode(status), 128 + signal.SIGINT,
                     text[-4000:])
    for forbidden in _FORBIDDEN:
      self.assertNotIn(forbidden, text, text[-4000:])
    self._check_keras_like(text)
    self.assertLen(re.findall(r"(^|\n)fit_stop_testlib\.py: Stopped by "
                              r"SIGINT at step \d+", text), 1, text[-4000:])
    # Every tfdist line starts a line, never after a bar's text.
    for line in text.split("\n"):
      if "\x1b[" in line or "\b" in line:  # A progress bar's line.
        self.assertNotRegex(line, r"tfdist|Saved checkpoint|WARNING",
                            repr(line))

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


if __name__ == "__main__":
  absltest.main()
