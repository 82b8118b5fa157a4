"""tfdist.runtime.cli: a console script's usage text is the binary's, and help
exits 0; tfdist.train's edge: flags to config, errors to exit statuses."""

import contextlib
import io
import os
import signal
import subprocess
import sys
import textwrap

from absl import flags
from absl.testing import absltest
from absl.testing import flagsaver
from absl.testing import parameterized

from tests import testutil
from tfdist import errors
from tfdist import exit_codes
from tfdist import train
from tfdist.runtime import cli
from tfdist.runtime import preemption


class AdoptUsageTest(absltest.TestCase):

  def _run_wrapper(self, body: str) -> str:
    # A stand-in for pip's console-script wrapper, named like the
    # installed command.
    script = testutil.scratch_dir() + "/tfdist-example"
    with open(script, "w") as f:
      f.write(textwrap.dedent(body))
    proc = subprocess.run(
        [sys.executable, script, "--helpshort"], cwd=testutil.REPO_ROOT,
        env={"PYTHONPATH": testutil.REPO_ROOT}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=60)
    return proc.stdout

  def test_wrapper_prints_the_binary_usage_and_key_flags(self):
    # What pip writes for `tfdist-launch`.
    out = self._run_wrapper("""
        import sys
        from tfdist.launch import run
        sys.exit(run())
        """)
    self.assertIn("python -m tfdist.launch", out)
    self.assertIn("--num_workers", out)

  def test_without_it_the_wrapper_shows_neither(self):
    # The check above can fail: absl alone shows neither text nor flags.
    out = self._run_wrapper("""
        from absl import app
        from tfdist import launch
        launch.define_launch_flags()
        app.run(launch.main)
        """)
    self.assertNotIn("python -m tfdist.launch", out)
    self.assertNotIn("--num_workers", out)

  def test_replaces_the_trampoline_docstring_of_a_long_path(self):
    # Where the interpreter's path is too long for a #! line (Bazel's
    # sandbox), pip's wrapper starts with a shell trampoline, which Python
    # reads as the module's docstring.
    trampoline = "'''exec' /some/long/path/bin/python \"$0\" \"$@\"\n' '''\n"
    out = self._run_wrapper(trampoline + textwrap.dedent("""
        import sys
        from tfdist.launch import run
        sys.exit(run())
        """))
    self.assertIn("python -m tfdist.launch", out)
    self.assertNotIn("exec'", out)


@contextlib.contextmanager
def _environ_without(*names):
  saved = {n: os.environ.pop(n) for n in names if n in os.environ}
  try:
    yield
  finally:
    os.environ.update(saved)


class HelpExitsZeroTest(parameterized.TestCase):

  @parameterized.parameters("--help", "--helpshort", "--helpfull", "-?")
  def test_help_flags_exit_zero(self, arg):
    flag_values = flags.FlagValues()
    cli.define_help_flags(flag_values)
    with contextlib.redirect_stdout(io.StringIO()) as out:
      with self.assertRaises(SystemExit) as caught:
        flag_values(["prog", arg])
    self.assertEqual(caught.exception.code, 0)
    self.assertTrue(out.getvalue().strip())  # absl's help text.

  def test_nohelp_does_not_exit(self):
    flag_values = flags.FlagValues()
    cli.define_help_flags(flag_values)
    cli.define_help_flags(flag_values)  # Idempotent.
    self.assertEqual(flag_values(["prog", "--nohelp"]), ["prog"])

  @parameterized.named_parameters(
      ("train", "tfdist.train", "--helpshort", "python -m tfdist.train"),
      ("train_help", "tfdist.train", "--help", "python -m tfdist.train"),
      ("launch", "tfdist.launch", "--helpshort", "python -m tfdist.launch"),
      ("ray", "tfdist.ray", "--help", "python -m tfdist.ray"))
  def test_binary_help_exits_zero(self, module, arg, usage):
    proc = testutil.run_module(module, [arg], timeout=120)
    self.assertEqual(proc.returncode, 0, proc.stdout[-3000:])
    self.assertIn(usage, proc.stdout)


class UnknownFlagTest(parameterized.TestCase):
  """Every binary: an unknown flag is one line naming it, status 2 (it was
  absl's `FATAL Flags parsing error` and status 1 in tfdist.launch and
  tfdist.ray, and 1 with the whole usage text in tfdist.job_spec)."""

  @parameterized.parameters("tfdist.train", "tfdist.launch", "tfdist.ray",
                            "tfdist.job_spec", "tfdist.diagnose")
  def test_exits_2_naming_the_flag(self, binary):
    out = testutil.run_module(binary, ["--no_such_flag=3"], timeout=120)
    self.assertEqual(out.returncode, exit_codes.CONFIG, out.stdout)
    self.assertIn("no_such_flag", out.stdout)
    self.assertNotIn("FATAL", out.stdout)
    self.assertLess(len(out.stdout.splitlines()), 4, out.stdout)


class TrainEdgeTest(absltest.TestCase):
  """tfdist.train's edge, in process: no training runs."""

  def _exit_status(self, fn, *args):
    with contextlib.redirect_stderr(io.StringIO()) as err:
      with self.assertRaises(SystemExit) as caught:
        fn(*args)
    return caught.exception.code, err.getvalue()

  def test_unknown_flag_value_is_a_usage_error(self):
    with flagsaver.flagsaver():
      status, err = self._exit_status(
          train._parse_flags,  # pylint: disable=protected-access
          ["tfdist.train", "--distribution_strategy=mirrorred"])
    self.assertEqual(status, exit_codes.CONFIG)
    self.assertIn("tfdist.train: error:", err)
    self.assertIn("mirrorred", err)
    self.assertIn("--helpshort", err)

  def test_unexpected_argument_is_a_usage_error(self):
    status, err = self._exit_status(train.main, ["tfdist.train", "extra"])
    self.assertEqual(status, exit_codes.CONFIG)
    self.assertIn("Unexpected arguments: extra", err)

  def test_missing_model_dir_is_a_usage_error(self):
    with flagsaver.flagsaver(), _environ_without("AIP_MODEL_DIR",
                                                 "AIP_CHECKPOINT_DIR"):
      train._parse_flags(["tfdist.train", "--train_steps=5"])  # pylint: disable=protected-access
      status, err = self._exit_status(train.main, ["tfdist.train"])
    self.assertEqual(status, exit_codes.CONFIG)
    self.assertIn("--model_dir is required", err)

  def test_failure_message_prefix(self):
    error = RuntimeError("loss is NaN at step 7")
    self.assertEqual(train.failure_message(error, exit_codes.DIVERGED),
                     "tfdist.train: error: loss is NaN at step 7")
    preempted = errors.PreemptedError(signum=signal.SIGTERM, step=9,
                                          checkpoint="/tmp/run/ckpt-9")
    status = exit_codes.exit_code_for(preempted)
    self.assertEqual(status, 128 + signal.SIGTERM)
    self.assertEqual(train.failure_message(preempted, status),
                     f"tfdist.train: {preempted}")


if __name__ == "__main__":
  absltest.main()
