"""Runs pytest files as one Bazel test (see //tests:defs.bzl).

Usage: pytest_main.py TEST_FILE [TEST_FILE...] [PYTEST_ARGS...]

The test files are the leading arguments up to the first option (an
argument starting with "-"); `tfdist_py_test` gives one, and
`tfdist_py_test_group` several, run in one pytest process.

Under `bazel test` it also
  * writes JUnit XML to $XML_OUTPUT_FILE, where Bazel collects it;
  * points HOME, KERAS_HOME and the cache folders at $TEST_TMPDIR (the
    sandbox has no HOME and a read-only home folder);
  * runs only the tests matching `--test_filter` (a pytest `-k` expression);
  * with `shard_count = N` on the target, runs every N-th test file in
    each shard (Bazel's TEST_TOTAL_SHARDS and TEST_SHARD_INDEX; a shard
    left without a file passes);
  * hides a `pip install -e .` of this repository, so that a test imports
    only what its target's `deps` put in the runfiles (a missing dep fails
    under Bazel rather than passing by accident.
Outside Bazel it is plain `pytest TEST_FILE... -p no:cacheprovider`.
"""

import os
import sys


def _use_test_tmpdir(environ) -> None:
  """Sends HOME and the caches that Keras and TF write to TEST_TMPDIR."""
  tmp = environ.get("TEST_TMPDIR")
  if not tmp:
    return
  environ.setdefault("HOME", tmp)
  environ.setdefault("KERAS_HOME", os.path.join(tmp, ".keras"))
  environ.setdefault("XDG_CACHE_HOME", os.path.join(tmp, ".cache"))


def _hide_source_tree() -> None:
  """Drops import routes into the source tree that bypass the runfiles.

  Python puts this script's real folder (tests/ of the source tree) first on
  sys.path, and `pip install -e .` adds a finder for the source tree.
  """
  here = os.path.dirname(os.path.realpath(__file__))
  source_dirs = {here, os.path.dirname(here)}
  sys.meta_path[:] = [
      finder for finder in sys.meta_path
      if not getattr(finder, "__module__", "").startswith("__editable__")
      and not type(finder).__module__.startswith("__editable__")]
  sys.path[:] = [p for p in sys.path
                 if not p or os.path.realpath(p) not in source_dirs]


def pytest_args(argv, environ) -> list:
  """The arguments for `pytest.main`: the test files, then Bazel's wishes.

  Args:
    argv: the command line: the program, one or more test files, then
      extra pytest arguments (the first one starting with "-" ends the
      files).
    environ: the environment (Bazel's XML_OUTPUT_FILE and
      TESTBRIDGE_TEST_ONLY are read).

  Returns:
    The test files (this shard's, when Bazel shards the target), "-p
    no:cacheprovider -q", the JUnit XML and `-k` options Bazel asks for,
    then the extra arguments; an empty list when this shard has no file.

  Raises:
    SystemExit: no test file given.
  """
  rest = list(argv[1:])
  files = []
  while rest and not rest[0].startswith("-"):
    files.append(rest.pop(0))
  if not files:
    raise SystemExit("usage: pytest_main.py TEST_FILE [TEST_FILE...] "
                     "[PYTEST_ARGS...]")
  total = int(environ.get("TEST_TOTAL_SHARDS") or 1)
  if total > 1:
    files = files[int(environ.get("TEST_SHARD_INDEX") or 0)::total]
    if not files:
      return []
  args = files + ["-p", "no:cacheprovider", "-q"]
  if environ.get("XML_OUTPUT_FILE"):
    args.append("--junitxml=" + environ["XML_OUTPUT_FILE"])
  if environ.get("TESTBRIDGE_TEST_ONLY"):
    args += ["-k", environ["TESTBRIDGE_TEST_ONLY"]]
  return args + rest


def main() -> int:
  if os.environ.get("TEST_SRCDIR"):
    _use_test_tmpdir(os.environ)
    _hide_source_tree()
  # Imported once the source tree is hidden, so that pytest's start-up
  # imports nothing of this repository past the runfiles.
  import pytest  # pylint: disable=g-import-not-at-top
  if os.environ.get("TEST_SHARD_STATUS_FILE"):
    # Tells Bazel that this runner shards (see pytest_args).
    with open(os.environ["TEST_SHARD_STATUS_FILE"], "w"):
      pass
  args = pytest_args(sys.argv, os.environ)
  if not args:
    print("pytest_main.py: no test file in this shard")
    return 0
  return pytest.main(args)


if __name__ == "__main__":
  sys.exit(main())
