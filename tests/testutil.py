"""Shared helpers for tfdist tests: small real data and running the binary."""

import os
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SUBSETS = {}


def scratch_dir() -> str:
  """A writable temporary folder (Bazel's TEST_TMPDIR when set)."""
  base = os.environ.get("TEST_TMPDIR") or None
  return tempfile.mkdtemp(dir=base)


def fashion_mnist_subset(limit: int = 1024, train_shards: int = 4,
                         test_shards: int = 2) -> dict:
  """Converts the first `limit` real Fashion-MNIST examples of each split.

  Returns:
    `{"dir", "train", "eval"}`: the folder and the two file globs. Cached per
    process and size.
  """
  key = (limit, train_shards, test_shards)
  if key not in _SUBSETS:
    from tfdist import datasets  # pylint: disable=g-import-not-at-top
    out = os.path.join(scratch_dir(), "fashion_mnist")
    datasets.convert_fashion_mnist(out, limit=limit, train_shards=train_shards,
                                   test_shards=test_shards)
    _SUBSETS[key] = {"dir": out,
                     "train": os.path.join(out, "train-*.tfrecord.gz"),
                     "eval": os.path.join(out, "test-*.tfrecord.gz")}
  return _SUBSETS[key]


def run_module(module: str, args, *, timeout: float = 300, env=None
               ) -> subprocess.CompletedProcess:
  """Runs `python -m module args` from the repository root; never hangs.

  Returns:
    The completed process (stdout and stderr merged into `.stdout`).
  """
  full_env = dict(os.environ)
  full_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  full_env["PYTHONPATH"] = REPO_ROOT + os.pathsep + full_env.get(
      "PYTHONPATH", "")
  if env:
    full_env.update(env)
  return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT,
                        env=full_env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=timeout)


# The source checkout itself (not Bazel's runfiles tree, whose files are
# links into it): what tools/setup.sh built next to it lives there.
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def setup_output(name: str) -> str:
  """The path of `name` (`.wheelhouse`, `.venv-tf217`) that tools/setup.sh
  makes in the source checkout; the calling test fails when it is missing.

  Raises:
    AssertionError: the path does not exist (run tools/setup.sh).
  """
  path = os.path.join(SOURCE_ROOT, name)
  if not os.path.exists(path):
    raise AssertionError(
        f"{path} is missing: run tools/setup.sh, which builds it (the TF 2.17 "
        "environment and its wheelhouse; tools/setup_tf217.sh alone also "
        "does).")
  return path
