#!/usr/bin/env bash
# Runs the whole test suite: every Bazel test target of //tests/... (every
# test file once, in Bazel's sandbox), in two lanes at once (below: the
# multi-process targets one at a time, the others one at a time beside
# them). In tests/BUILD:
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
#   TFDIST_BAZEL_SINGLES_BASE=DIR
#                         the output base of the second Bazel server (the
#                         single-process lane; default under
#                         ~/.cache/bazel, one per checkout)
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
# Two lanes, each its own Bazel server (output base), at the same time:
#   the cluster lane: the multi-process targets (tags cpu:2) one at a time
#     (--local_cpu_resources=2: each takes both units), after a few
#     single-process targets (CLUSTER_LANE_SINGLES, two at a time, while
#     the other lane starts);
#   the single lane: every other target, one at a time
#     (--local_cpu_resources=1).
# So a cluster never runs beside another one, and one single-process
# target runs beside each. In one Bazel server with three CPU units,
# single-process targets, each fitting the one unit left free, kept taking
# it before a multi-process one found two free: every multi-process target
# waited until the single-process ones had all run, and the last 15
# minutes of the suite ran them alone with a unit idle (1,678 s of tests
# on 1-2 December 2026). The lanes hold about the same work: in the fresh
# clone of 7 December 2026 (03:27 UTC) the single lane ended 320 s after
# the cluster lane (1,840 s against about 1,520 s), so ZeRO stage 3 and
# the MoE Transformer (about 135 s) moved to the cluster lane's singles;
# later that day the TPU and reduction-server tests (single-process) joined
# the unit-test group and the allocator test (about 30-50 s) took their
# place; on 7 December 2026 (17:00 UTC) the single lane gained about 65 s
# (hybrid ZeRO in tensor_parallel_test, experts with ZeRO in
# experts_parallel_test), so api_test (about 45 s) moved across. The suite
# prints both lanes' lengths at the end.
# No --local_test_jobs: with it Bazel counts every test as one job and
# ignores cpu:N tags (TestTargetProperties.getLocalResourceUsage).
# --jobs=48 (one slot per target and more): a test waiting for CPU units
# holds one of Bazel's job slots (by default one per core). Plain progress
# lines, at most every 30 s (timeouts per size come from .bazelrc).
CLUSTER_LANE_SINGLES=(//tests:compat_tf217 //tests:allocator_test
                      //tests:zero3_test //tests:moe_transformer_test
                      //tests:api_test)
singles_base="${TFDIST_BAZEL_SINGLES_BASE:-${HOME:-/tmp}/.cache/bazel/tfdist-singles-$(
  printf '%s' "$PWD" | md5sum | cut -c1-12)}"
if [ -n "${CI:-}" ]; then
  # Stop this workspace's Bazel servers when done, rather than leave them
  # idle.
  trap 'bazel shutdown >/dev/null 2>&1 || true;
        bazel --output_base="$singles_base" shutdown >/dev/null 2>&1 || true' \
    EXIT
fi
mapfile -t cluster_targets < <(bazel query --noshow_progress \
  'attr(tags, "cpu:2", tests(//tests/...))' 2>/dev/null)
if [ ${#cluster_targets[@]} -eq 0 ]; then
  echo "test.sh: bazel query found no multi-process (cpu:2) test targets" >&2
  exit 1
fi
cluster_lane=("${cluster_targets[@]}" "${CLUSTER_LANE_SINGLES[@]}")
if [ "${TFDIST_TF217:-1}" = 0 ]; then
  cluster_lane=("${cluster_lane[@]/\/\/tests:compat_tf217*/}")
fi
single_lane=(//tests/...)
for target in "${cluster_lane[@]}" //tests:compat_tf217 \
    //tests:compat_tf217_cluster; do
  [ -n "$target" ] && single_lane+=("-$target")
done
common=(--jobs=48 --test_output=errors --test_summary=short --curses=no
        --color=no --show_progress_rate_limit=30)
log="$(mktemp)"
singles_log="$(mktemp)"
status=0
singles_status=0
singles_ended="$(mktemp)"
lanes_started=$SECONDS
{
  singles_rc=0
  bazel --output_base="$singles_base" test --local_cpu_resources=1 \
    "${common[@]}" -- "${single_lane[@]}" >"$singles_log" 2>&1 \
    || singles_rc=$?
  echo "$SECONDS" >"$singles_ended"
  exit "$singles_rc"
} &
singles_pid=$!
# The cluster lane's progress shows as it runs; the single lane's log
# follows when both are done.
bazel test --local_cpu_resources=2 "${common[@]}" \
  -- $(printf '%s ' "${cluster_lane[@]}") 2>&1 | tee "$log" || status=$?
cluster_lane_took=$((SECONDS - lanes_started))
wait "$singles_pid" || singles_status=$?
# Each lane's length: the one that ends first leaves a core idle until the
# other ends (move targets between the lanes, CLUSTER_LANE_SINGLES, when
# they differ by more than a minute or so).
echo "test.sh: the cluster lane took ${cluster_lane_took} s, the single" \
  "lane $(( $(cat "$singles_ended") - lanes_started )) s"
rm -f "$singles_ended"
echo "test.sh: the single-process lane (exit ${singles_status}):"
cat "$singles_log"
cat "$singles_log" >>"$log"
rm -f "$singles_log"
if [ "$status" = 0 ]; then
  status=$singles_status
fi
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
