#!/usr/bin/env bash
# Runs the whole test suite: every Bazel test target (`bazel test
# //tests/...`: every test file once, in Bazel's sandbox, two targets at a
# time). In tests/BUILD:
#   * //tests:unit_tests runs the unit-test files together (one pytest
#     process: one TensorFlow start-up for all of them);
#   * //tests:compat_tf217 and //tests:compat_tf217_cluster run the tests
#     marked `compat` (tests/conftest.py: every module's unit tests, one
#     short training run per strategy, the tensorflow-io tests) once more in
#     .venv-tf217 (TensorFlow 2.17, which tools/setup.sh builds): the
#     multi-process ones (also marked `cluster`) in the second, the rest in
#     the first, beside the other targets;
#   * every other test file has its own target.
#
# No pytest pass runs beside Bazel by default: Bazel runs every file already,
# and a pass before it would keep one of the two cores idle. Without Bazel
# (TFDIST_BAZEL=0), pytest runs every file, then the TF 2.17 pass. The TF
# 2.17 pass on its own:
#   TFDIST_VENV=.venv-tf217 TFDIST_PYTEST=compat TFDIST_BAZEL=0 bash tools/test.sh
#
# Environment:
#   TFDIST_VENV=DIR       the virtual environment of pytest and of Bazel's
#                         Python toolchain (default .venv)
#   TFDIST_PYTEST=small   pytest runs the unit-test files (those of
#                         //tests:unit_tests and of any "small" target)
#   TFDIST_PYTEST=all     pytest runs every test file (the default when
#                         TFDIST_BAZEL=0)
#   TFDIST_PYTEST=compat  pytest runs the tests marked `compat`
#   TFDIST_PYTEST=none    no pytest pass (the default when Bazel runs)
#   TFDIST_TF217=0        no TF 2.17 tests: Bazel leaves out
#                         //tests:compat_tf217(_cluster), and without Bazel there is
#                         no TF 2.17 pass (for a set-up without .venv-tf217,
#                         tools/setup.sh's TFDIST_TF217=0)
#   TFDIST_BAZEL=0        skip Bazel (a local run without Bazel)
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
suite_started=$SECONDS
VENV="${TFDIST_VENV:-.venv}"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  echo "test.sh: $PY not found; run tools/setup.sh (it builds .venv and" \
    ".venv-tf217)." >&2
  exit 1
fi

# A pytest failure does not stop the Bazel pass; the exit status is
# non-zero if either failed.
pytest_status=0
if [ "${TFDIST_BAZEL:-1}" = 0 ]; then
  pytest_scope="${TFDIST_PYTEST:-all}"
else
  pytest_scope="${TFDIST_PYTEST:-none}"
fi
case "$pytest_scope" in
  all) "$PY" -m pytest tests -q -p no:cacheprovider "$@" || pytest_status=$? ;;
  small)
    mapfile -t files < <("$PY" -m tests.bazel_targets --list-tests=small)
    if [ ${#files[@]} -gt 0 ]; then
      "$PY" -m pytest "${files[@]}" -q -p no:cacheprovider "$@" \
        || pytest_status=$?
    fi ;;
  compat)
    # Only files that tag tests `compat` are collected (so a file that
    # imports what this environment lacks is never imported here).
    mapfile -t files < <(grep -lE 'pytest\.mark\.compat' tests/*_test.py)
    started=$SECONDS
    "$PY" -m pytest "${files[@]}" -m compat -q -p no:cacheprovider "$@" \
      || pytest_status=$?
    echo "test.sh: compat tests in $VENV took $((SECONDS - started)) s" ;;
  none) ;;
  *) echo "test.sh: TFDIST_PYTEST must be all, small, compat or none;" \
       "got ${TFDIST_PYTEST}" >&2; exit 2 ;;
esac

# The oldest supported TensorFlow (2.17, Python 3.10): the `compat` tests,
# as a pytest pass when Bazel does not run //tests:compat_tf217.
if [ -z "${TFDIST_VENV:-}" ] && [ "${TFDIST_TF217:-1}" != 0 ] \
    && [ "${TFDIST_BAZEL:-1}" = 0 ]; then
  TFDIST_VENV=.venv-tf217 TFDIST_PYTEST=compat TFDIST_BAZEL=0 \
    bash tools/test.sh "$@" || pytest_status=$?
fi

if [ "${TFDIST_BAZEL:-1}" = 0 ]; then
  exit "$pytest_status"
fi
if ! command -v bazel >/dev/null 2>&1; then
  echo "test.sh: bazel not found; run tools/setup.sh (it installs Debian's" \
    "bazel-bootstrap), or set TFDIST_BAZEL=0 to skip the Bazel tests." >&2
  exit 1
fi
if [ -n "${CI:-}" ]; then
  # Stop this workspace's Bazel server when done, rather than leave it idle.
  trap 'bazel shutdown >/dev/null 2>&1 || true' EXIT
fi
log="$(mktemp)"
status=0
# The target patterns, last: after `--` everything is one (a leading `-`
# subtracts).
targets=(-- //tests/...)
if [ "${TFDIST_TF217:-1}" = 0 ]; then
  targets+=(-//tests:compat_tf217 -//tests:compat_tf217_cluster)
fi
# Tests are scheduled by CPU: a multi-process test (tags cpu:2) takes two
# of three CPU units, a single-process one one, so two multi-process tests
# never run at once and one single-process target runs beside each (while
# a cluster waits on start-up or a peer, its core is not idle). No
# --local_test_jobs: with it Bazel counts every test as one job and ignores
# cpu:N tags (TestTargetProperties.getLocalResourceUsage). --jobs=48 (one
# slot per target and more): a test waiting for CPU units holds one of
# Bazel's job slots (by default one per core). With 4 slots, three
# multi-process tests waiting behind a fourth held them all, and one test
# ran on a machine at load average 1.7 while single-process ones waited;
# CPU units alone bound what runs. Plain progress lines, at most every 30 s
# (timeouts per size come from .bazelrc).
bazel test \
  --local_cpu_resources=3 --jobs=48 \
  --test_output=errors --test_summary=short \
  --curses=no --color=no --show_progress_rate_limit=30 \
  "${targets[@]}" 2>&1 | tee "$log" || status=$?
passed=$(grep -cE '^//\S+ .*PASSED in ' "$log" || true)
failed=$(grep -cE '^//\S+ .*(FAILED|TIMEOUT|NO STATUS|INCOMPLETE|FLAKY)' \
  "$log" || true)
echo "bazel: ${passed} passed, ${failed} failed"
# The slowest targets (Bazel's own timing of each test run).
echo "test.sh: slowest Bazel targets:"
grep -oE '^//\S+ .* in [0-9.]+s' "$log" \
  | sed -E 's/^(\S+) .* in ([0-9.]+)s$/\2 \1/' | sort -rn | head -8 \
  | awk '{printf "  %7.1f s  %s\n", $1, $2}' || true
# Their sum (targets overlap: the Bazel pass takes less).
grep -oE '^//\S+ .* in [0-9.]+s' "$log" \
  | sed -E 's/.* in ([0-9.]+)s$/\1/' \
  | awk '{s += $1} END {if (NR) printf "test.sh: the targets took %.0f s" \
      " in all (%d targets)\n", s, NR}' || true
rm -f "$log"
echo "test.sh: total $((SECONDS - suite_started)) s (pytest and Bazel)"
if [ "$pytest_status" != 0 ]; then
  echo "test.sh: pytest failed (exit ${pytest_status}); see above."
  exit "$pytest_status"
fi
exit "$status"
