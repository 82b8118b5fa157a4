"""tools/gpu_check.sh: valid bash, and every flag it passes exists.

The script runs for real only on a GPU machine (and, in its CPU quick mode,
by hand: docs/benchmarks/gpu-check.md); this check is what CI can afford. It
reads the script's commands (continuation lines joined) and checks each
`--flag` against the program that receives it: `tfdist.train` (every flag
`tfdist.flags.define_all_flags` defines), `tfdist.diagnose` (its own flags
before `--`, tfdist.train's after) and `benchmarks/keras_parity.py` (the
flags its source defines). Neither TensorFlow nor a training run is needed.
"""

import os
import re
import subprocess

from absl import flags as absl_flags
from absl.testing import absltest

from tests import testutil
from tfdist import diagnose

SCRIPT = os.path.join(testutil.REPO_ROOT, "tools", "gpu_check.sh")
PARITY = os.path.join(testutil.REPO_ROOT, "benchmarks", "keras_parity.py")
# pip's own flags, passed to pip install.
PIP_FLAGS = {"no-index", "find-links", "no-deps"}


def _train_flags():
  """tfdist.train's flags: what `tfdist.flags.define_all_flags` defines.

  Through the binary's import, which defines them once per process (a
  second `define_all_flags` raises DuplicateFlagError, so a call here
  broke any later test file of the same process importing tfdist.train).
  """
  from tfdist import train  # pylint: disable=g-import-not-at-top
  del train
  return absl_flags.FLAGS


def _known(name, values):
  """Whether --name is one of `values` (a FlagValues or a set of names)."""
  names = set(values) if not isinstance(values, set) else values
  if name in names:
    return True
  if name.startswith("no") and name[2:] in names:  # --noflag of a bool.
    flag = values[name[2:]] if not isinstance(values, set) else None
    return flag is None or flag.boolean
  return False


def _flags(text):
  return re.findall(r"(?<![\w-])--([a-z][a-z0-9_-]*)", text)


class GpuCheckScriptTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    with open(SCRIPT) as f:
      text = f.read()
    # The commands, continuation lines joined, comments left out.
    cls.lines = [line for line in text.replace("\\\n", " ").splitlines()
                 if not line.lstrip().startswith("#")]
    cls.train = _train_flags()
    with open(PARITY) as f:
      cls.parity = set(re.findall(r'DEFINE_\w+\(\s*"(\w+)"', f.read()))

  def test_bash_parses_it(self):
    subprocess.run(["bash", "-n", SCRIPT], check=True, timeout=30)

  def test_each_flag_exists_in_the_program_that_receives_it(self):
    checked = {"train": 0, "diagnose": 0, "keras_parity": 0}
    unknown = []

    def check(program, names, values):
      for name in names:
        if name in PIP_FLAGS:
          continue
        checked[program] += 1
        if not _known(name, values):
          unknown.append(f"{program}: --{name}")

    for line in self.lines:
      if "tfdist.diagnose" in line or line.lstrip().startswith("DIAG="):
        head, _, tail = line.partition(" -- ")
        check("diagnose", _flags(head), diagnose.cli._FLAGS)
        check("train", _flags(tail), self.train)
      elif "keras_parity.py" in line or line.lstrip().startswith("PARITY="):
        check("keras_parity", _flags(line.split("keras_parity.py")[-1]),
              self.parity)
      elif ("${TRAIN[@]}" in line or "tfdist.train" in line or
            line.lstrip().startswith(("RESNET=", "PIPE="))):
        check("train", _flags(line), self.train)
    self.assertEqual(unknown, [])
    # Each program's command was found and read.
    for program, count in checked.items():
      self.assertGreater(count, 2, program)

  def test_an_unknown_flag_is_caught(self):
    self.assertFalse(_known("precision", self.train))
    self.assertTrue(_known("noenable_xla", self.train))
    self.assertFalse(_known("nomodel", self.train))  # Not a bool flag.


if __name__ == "__main__":
  absltest.main()
