#!/usr/bin/env bash
# Runs the whole test suite: pytest over tests/, then every Bazel test target
# (`bazel test //tests/...`, each test file once more, in Bazel's sandbox).
#
# Environment:
#   TFDIST_PYTEST=all     pytest runs every test file (the default)
#   TFDIST_PYTEST=small   pytest runs only the files whose Bazel target is
#                         size "small"; the slower ones run under Bazel only
#   TFDIST_PYTEST=none    no plain pytest run
#   TFDIST_BAZEL=0        skip Bazel (a quick local run; CI never sets it)
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
PY=.venv/bin/python

# A pytest failure does not stop the Bazel pass; the exit status is
# non-zero if either failed.
pytest_status=0
case "${TFDIST_PYTEST:-all}" in
  all) "$PY" -m pytest tests -q -p no:cacheprovider "$@" || pytest_status=$? ;;
  small)
    mapfile -t files < <("$PY" -m tests.bazel_targets --list-tests=small)
    "$PY" -m pytest "${files[@]}" -q -p no:cacheprovider "$@" \
      || pytest_status=$? ;;
  none) ;;
  *) echo "test.sh: TFDIST_PYTEST must be all, small or none;" \
       "got ${TFDIST_PYTEST}" >&2; exit 2 ;;
esac

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
# Two cores: two tests at a time; plain progress lines, at most every 30 s.
bazel test //tests/... \
  --local_cpu_resources=2 --local_test_jobs=2 \
  --test_output=errors --test_summary=short \
  --curses=no --color=no --show_progress_rate_limit=30 \
  2>&1 | tee "$log" || status=$?
passed=$(grep -cE '^//\S+ .*PASSED in ' "$log" || true)
failed=$(grep -cE '^//\S+ .*(FAILED|TIMEOUT|NO STATUS|INCOMPLETE|FLAKY)' \
  "$log" || true)
rm -f "$log"
echo "bazel: ${passed} passed, ${failed} failed"
if [ "$pytest_status" != 0 ]; then
  echo "test.sh: pytest failed (exit ${pytest_status}); see above."
  exit "$pytest_status"
fi
exit "$status"
