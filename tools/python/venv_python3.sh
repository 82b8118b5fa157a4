#!/bin/sh
# The Python interpreter of tfdist's Bazel toolchain (//tools/python).
#
# Execs the virtual environment's python3: $TFDIST_VENV when set (the path of
# a venv folder, absolute or relative to the workspace root), else the
# workspace's own .venv. Bazel runs this script through a symlink in a
# runfiles tree or a sandbox; readlink -f finds the checked-in file, and the
# workspace root is two folders above it.
#
# Tests see TFDIST_VENV only when it is passed on (.bazelrc has
# `test --test_env=TFDIST_VENV`); `bazel run` sees the caller's environment.
here="$(dirname "$(readlink -f "$0")")"
root="$(cd "$here/../.." && pwd)"
venv="${TFDIST_VENV:-$root/.venv}"
case "$venv" in
  /*) ;;
  *) venv="$root/$venv" ;;
esac
if [ ! -x "$venv/bin/python3" ]; then
  if [ -n "${TFDIST_VENV:-}" ]; then
    echo "tools/python/venv_python3.sh: TFDIST_VENV=$TFDIST_VENV has no" \
      "bin/python3; point it at a virtual environment folder, or unset it" \
      "to use $root/.venv." >&2
  else
    echo "tools/python/venv_python3.sh: no Python at $venv/bin/python3." \
      "Run tools/setup.sh to create it, or set TFDIST_VENV to a virtual" \
      "environment folder." >&2
  fi
  exit 127
fi
exec "$venv/bin/python3" "$@"
