"""tfdist.cli.adopt_usage: a console script's usage text is the binary's."""

import subprocess
import sys
import textwrap

from absl.testing import absltest

from tests import testutil


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

if __name__ == "__main__":
  absltest.main()
