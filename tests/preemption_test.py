"""Tests for tfdist.runtime.preemption: real signals, a real watcher process.

Signals to this process are only sent while a `PreemptionWatcher` is
installed (its handler records them); the grace-period kill runs in a child
Python process.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

from absl.testing import absltest

from tests import testutil
from tfdist import errors
from tfdist.runtime import preemption


class PreemptionWatcherTest(absltest.TestCase):

  def test_rejects_a_non_positive_grace_period(self):
    with self.assertRaisesRegex(ValueError, "grace_seconds=0 must be > 0"):
      preemption.PreemptionWatcher(grace_seconds=0)

  def test_a_signal_is_recorded_with_its_arrival_time(self):
    watcher = preemption.PreemptionWatcher(grace_seconds=60).install()
    self.addCleanup(watcher.uninstall)
    self.addCleanup(watcher.cancel_deadline)
    self.assertTrue(watcher.installed)
    self.assertFalse(watcher.signal_received())
    sent = time.time()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)  # The handler runs at the next bytecode boundary.
    self.assertTrue(watcher.signal_received())
    self.assertEqual(watcher.signum, signal.SIGTERM)
    self.assertBetween(watcher.received_at, sent - 1, time.time())
    error = watcher.preempted(step=7, checkpoint="/tmp/ckpt-7")
    self.assertEqual((error.step, error.checkpoint, error.exit_code),
                     (7, "/tmp/ckpt-7", 128 + signal.SIGTERM))

  def test_uninstall_restores_the_previous_handler(self):
    previous = signal.getsignal(signal.SIGINT)
    watcher = preemption.PreemptionWatcher(grace_seconds=60).install()
    self.assertNotEqual(signal.getsignal(signal.SIGINT), previous)
    watcher.uninstall()
    self.assertEqual(signal.getsignal(signal.SIGINT), previous)
    self.assertIsNone(watcher._watcher)  # No stop under way: it ended.

  def test_off_the_main_thread_nothing_is_installed(self):
    watcher = preemption.PreemptionWatcher(grace_seconds=60)
    thread = threading.Thread(target=watcher.install)
    thread.start()
    thread.join()
    self.assertFalse(watcher.installed)
    self.assertIsNone(watcher._watcher)

  def test_a_peer_stop_counts_as_sigterm(self):
    watcher = preemption.PreemptionWatcher(grace_seconds=60)
    watcher.note_peer_stop()
    self.assertEqual(watcher.signum, signal.SIGTERM)
    error = watcher.preempted(step=3, checkpoint=None)
    self.assertEqual(error.exit_code, 143)
    self.assertIn("Stopped by SIGTERM at step 3", str(error))

  def test_ctrl_c_to_the_process_group_leaves_the_grace_deadline_running(
      self):
    # A terminal's Ctrl-C: SIGINT to every process of the foreground group,
    # the grace-period watcher included. The watcher ignores it (no
    # KeyboardInterrupt traceback, no broken wakeup pipe) and still ends a
    # process that does not stop within the grace period.
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import time
            from tfdist.runtime import preemption
            watcher = preemption.PreemptionWatcher(grace_seconds=1).install()
            status = "/proc/%d/status" % watcher._watcher.pid
            end = time.time() + 10  # Until the watcher's first line ran.
            while time.time() < end:
              with open(status) as f:
                ignored = [l for l in f if l.startswith("SigIgn:")][0]
              if int(ignored.split()[1], 16) & 2:  # Bit 1: SIGINT.
                break
              time.sleep(0.01)
            print("ready", flush=True)
            for _ in range(3000):  # Does not stop: the watcher must end it.
              time.sleep(0.01)
            """)], cwd=testutil.REPO_ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, preexec_fn=os.setpgrp,
        env={**os.environ, "PYTHONPATH": testutil.REPO_ROOT})
    try:
      self.assertEqual(child.stdout.readline(), "ready\n")
      os.killpg(child.pid, signal.SIGINT)
      _, stderr = child.communicate(timeout=15)
    finally:
      if child.poll() is None:
        child.kill()
        child.communicate()
    self.assertEqual(child.returncode, -signal.SIGKILL, stderr)
    self.assertIn("tfdist: received SIGINT", stderr)
    self.assertIn("still running", stderr)
    self.assertNotIn("Traceback", stderr)
    self.assertNotIn("Exception ignored", stderr)

  def test_the_grace_period_ends_a_process_that_does_not_stop(self):
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent("""
            import os, signal, time
            from tfdist.runtime import preemption
            preemption.PreemptionWatcher(grace_seconds=0.5).install()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
            """)], cwd=testutil.REPO_ROOT, capture_output=True, text=True,
        timeout=60, env={**os.environ, "PYTHONPATH": testutil.REPO_ROOT})
    self.assertEqual(child.returncode, -signal.SIGKILL, child.stderr)
    self.assertIn("tfdist: received SIGTERM", child.stderr)
    self.assertRegex(child.stderr,
                     r"still running 0\.\d s after SIGTERM "
                     r"\(--preemption_grace_seconds=0\.5\): ending the "
                     "process without a final checkpoint")


class _ReentrantStderr:
  """A `sys.stderr` whose writes fail as a buffered stream does when a
  signal handler writes to it in the middle of the main thread's write."""

  def write(self, text):
    raise RuntimeError("reentrant call inside <_io.BufferedWriter "
                       "name='<stderr>'>")

  def flush(self):
    pass


class SignalDuringLogLineTest(absltest.TestCase):

  def test_the_handler_never_writes_through_sys_stderr(self):
    # A signal that arrives while the main thread writes a log line: the
    # handler's own line must not go through the same buffered stream.
    watcher = preemption.PreemptionWatcher(grace_seconds=5)
    read_end, write_end = os.pipe()
    saved_fd, saved_stderr = os.dup(2), sys.stderr
    os.dup2(write_end, 2)
    sys.stderr = _ReentrantStderr()
    try:
      watcher._handle(signal.SIGTERM, None)  # pylint: disable=protected-access
    finally:
      sys.stderr = saved_stderr
      os.dup2(saved_fd, 2)
      os.close(saved_fd)
      os.close(write_end)
    with os.fdopen(read_end) as f:
      written = f.read()
    self.assertEqual(watcher.signum, signal.SIGTERM)
    self.assertIn("tfdist: received SIGTERM: saving a checkpoint", written)


class PreemptedErrorTest(absltest.TestCase):

  def test_exit_code_is_128_plus_the_signal(self):
    error = errors.PreemptedError(signum=signal.SIGINT, step=2,
                                      checkpoint="ckpt-2")
    self.assertEqual(error.exit_code, 130)
    self.assertIn("--model_dir to resume", str(error))

  def test_the_resume_sentence_can_be_the_callers(self):
    error = errors.PreemptedError(signum=signal.SIGTERM, step=2,
                                      checkpoint="ckpt-2",
                                      resume="Call fit again.")
    self.assertEqual(str(error), "Stopped by SIGTERM at step 2; checkpoint "
                     "ckpt-2. Call fit again.")


class StopHookTest(absltest.TestCase):
  """`tfdist.runtime.script_exit`'s hook in a real child script."""

  def _run(self, raised: str, install: str = "script_exit.install_stop_hook()"):
    script = textwrap.dedent(f"""
        import atexit, signal
        from tfdist import errors
        from tfdist.runtime import script_exit
        atexit.register(print, "atexit ran")
        print("installed", {install})
        raise {raised}
        """)
    return subprocess.run(
        [sys.executable, "-c", script], cwd=testutil.REPO_ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        timeout=60, env=dict(os.environ, PYTHONPATH=testutil.REPO_ROOT))

  def test_an_uncaught_stop_prints_one_line_and_exits_128_plus_signal(self):
    for signum in (signal.SIGINT, signal.SIGTERM):
      proc = self._run(f"errors.PreemptedError(signum={int(signum)}, step=7, "
                       "checkpoint='ckpt-7', resume='Run it again.')")
      self.assertEqual(proc.returncode, 128 + signum, proc.stderr)
      self.assertEqual(proc.stderr,
                       f"-c: Stopped by {signum.name} at step 7; checkpoint "
                       "ckpt-7. Run it again.\n")
      self.assertEqual(proc.stdout, "installed True\n")  # No teardown.

  def test_a_stop_at_start_exits_with_its_status(self):
    proc = self._run("errors.StoppedAtStartError('Stopped while waiting.', "
                     "signal.SIGTERM)")
    self.assertEqual(proc.returncode, 143, proc.stderr)
    self.assertEqual(proc.stderr, "-c: Stopped while waiting.\n")

  def test_other_errors_go_to_the_previous_hook(self):
    proc = self._run("ValueError('a bug')")
    self.assertEqual(proc.returncode, 1)
    self.assertIn("Traceback", proc.stderr)
    self.assertIn("ValueError: a bug", proc.stderr)
    self.assertIn("atexit ran", proc.stdout)

  def test_off_the_main_thread_no_hook_is_installed(self):
    proc = self._run(
        "errors.PreemptedError(signum=2, step=1, checkpoint=None)",
        install="(lambda t: (t.start(), t.join()))(__import__('threading')."
        "Thread(target=script_exit.install_stop_hook))")
    self.assertEqual(proc.returncode, 1)
    self.assertIn("Traceback", proc.stderr)


class CaughtStopTest(absltest.TestCase):
  """A `tfdist.fit` script that catches the stop and goes on (a notebook's
  Ctrl-C): the grace period no longer applies once `fit` has raised."""

  def test_a_caught_stop_lives_past_the_grace_period_and_resumes(self):
    script = textwrap.dedent("""
        import os, signal, sys, time
        import keras
        import numpy as np
        import tfdist
        from tfdist import errors

        class Interrupt(keras.callbacks.Callback):
          def on_train_batch_end(self, batch, logs=None):
            if batch == 2 and not os.environ.get("RESUMED"):
              os.kill(os.getpid(), signal.SIGINT)

        def build():
          model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
          model.compile(loss="mse")
          return model

        x = np.ones((64, 2), np.float32)
        config = tfdist.TrainConfig(
            model_dir=sys.argv[1], train_steps=12, batch_size=4,
            distribution_strategy="one_device", preemption_grace_seconds=2)
        try:
          tfdist.fit(build, x=x, y=x.sum(axis=1), config=config,
                     callbacks=[Interrupt()], verbose=0)
        except errors.PreemptedError as e:
          print("stopped at step", e.step, flush=True)
        time.sleep(3)  # Past the 2 s grace period (from the signal).
        os.environ["RESUMED"] = "1"
        result = tfdist.fit(build, x=x, y=x.sum(axis=1), config=config,
                            verbose=0)
        print("resumed to step", result["final_step"], flush=True)
        """)
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    proc = subprocess.run(
        [sys.executable, "-c", script, model_dir], cwd=testutil.REPO_ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        timeout=300, env=dict(os.environ, PYTHONPATH=testutil.REPO_ROOT,
                              TF_CPP_MIN_LOG_LEVEL="2"))
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    self.assertRegex(proc.stdout, r"stopped at step \d+\n")
    self.assertIn("resumed to step 12\n", proc.stdout)


if __name__ == "__main__":
  absltest.main()
