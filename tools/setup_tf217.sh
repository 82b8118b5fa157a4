#!/usr/bin/env bash
# Builds the TensorFlow 2.17 environment, .venv-tf217, next to .venv (called
# by tools/setup.sh; runs alone as well).
#
# TF 2.17 on Python 3.10 is the oldest TensorFlow tfdist supports and what
# Vertex AI's newest prebuilt TensorFlow training container runs. The
# packages (tools/requirements-tf217.txt) are first saved as wheels in
# .wheelhouse/, then installed from there without the network; the sdist
# install test (tests/sdist_install_test.py) installs from the same
# wheelhouse with `pip install --no-index`. tfdist itself goes in editable
# and without dependencies.
#
# Safe to run again: a wheelhouse or environment made from the same
# requirements file is kept (a stamp file records the file's hash).
#
# Environment:
#   PYTHON310   the Python 3.10 interpreter to use. Default: python3.10 on
#               PATH, else the newest 3.10 under `pyenv root`/versions.
set -euo pipefail
cd "$(dirname "$0")/.."

REQUIREMENTS=tools/requirements-tf217.txt
WHEELHOUSE=.wheelhouse
VENV=.venv-tf217
PIP_QUIET=(-q --disable-pip-version-check)
# Kept in the wheelhouse, never installed here: an unsupported Keras, which
# tests/versions_test.py installs into a scratch folder, and tensorflow-io for
# Python 3.11 (the default .venv's), which tests/filesystems_test.py installs
# into a scratch folder to show that it does not load with TensorFlow 2.21.
WHEELHOUSE_ONLY=(keras==3.11.3)
WHEELHOUSE_ONLY_PY311=(tensorflow-io==0.37.1 tensorflow-io-gcs-filesystem==0.37.1)

is_python310() {
  [ -n "$1" ] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 10))' \
    >/dev/null 2>&1
}

find_python310() {
  if [ -n "${PYTHON310:-}" ]; then
    if is_python310 "$PYTHON310"; then echo "$PYTHON310"; return 0; fi
    echo "setup_tf217: PYTHON310=$PYTHON310 is not a Python 3.10" \
      "interpreter. Point it at one (e.g. PYTHON310=/usr/bin/python3.10)." >&2
    return 1
  fi
  local candidate root
  candidate="$(command -v python3.10 || true)"
  if is_python310 "$candidate"; then echo "$candidate"; return 0; fi
  root="${PYENV_ROOT:-}"
  if [ -z "$root" ] && command -v pyenv >/dev/null 2>&1; then
    root="$(pyenv root)"
  fi
  if [ -n "$root" ]; then
    candidate="$(ls -d "$root"/versions/3.10.*/bin/python3.10 2>/dev/null \
      | sort -V | tail -n 1 || true)"
    if is_python310 "$candidate"; then echo "$candidate"; return 0; fi
  fi
  echo "setup_tf217: no Python 3.10 found (looked for python3.10 on PATH and" \
    "under \`pyenv root\`/versions/3.10.*). Install one (\`pyenv install" \
    "3.10\`, or Debian/Ubuntu's python3.10 with python3.10-venv) or set" \
    "PYTHON310 to its path; TFDIST_TF217=0 tools/setup.sh skips this" \
    "environment." >&2
  return 1
}

PY310="$(find_python310)"
stamp="$(sha256sum "$REQUIREMENTS" | cut -d' ' -f1)"
wheelhouse_stamp="$(echo "$stamp ${WHEELHOUSE_ONLY[*]} py311:" \
  "${WHEELHOUSE_ONLY_PY311[*]}" | sha256sum | cut -d' ' -f1)"

if [ "$(cat "$WHEELHOUSE/.stamp" 2>/dev/null || true)" != "$wheelhouse_stamp" ]; then
  echo "setup_tf217: saving wheels for $REQUIREMENTS into $WHEELHOUSE/"
  mkdir -p "$WHEELHOUSE"
  # `pip wheel` downloads wheels and builds any sdist (cloudml-hypertune)
  # into a wheel, so that installing needs neither network nor compiler.
  "$PY310" -m pip wheel "${PIP_QUIET[@]}" --use-pep517 -w "$WHEELHOUSE" \
    -r "$REQUIREMENTS"
  "$PY310" -m pip download "${PIP_QUIET[@]}" --no-deps -d "$WHEELHOUSE" \
    "${WHEELHOUSE_ONLY[@]}"
  "$PY310" -m pip download "${PIP_QUIET[@]}" --no-deps -d "$WHEELHOUSE" \
    --only-binary=:all: --python-version 3.11 "${WHEELHOUSE_ONLY_PY311[@]}"
  echo "$wheelhouse_stamp" > "$WHEELHOUSE/.stamp"
fi

if [ "$(cat "$VENV/.stamp" 2>/dev/null || true)" != "$stamp" ]; then
  echo "setup_tf217: creating $VENV with $("$PY310" --version) from $WHEELHOUSE/"
  rm -rf "$VENV"
  "$PY310" -m venv "$VENV"
  "$VENV/bin/python" -m pip install "${PIP_QUIET[@]}" --no-index \
    --find-links "$WHEELHOUSE" -r "$REQUIREMENTS"
  echo "$stamp" > "$VENV/.stamp"
fi
echo "setup_tf217: installing tfdist (editable, no dependencies) into $VENV"
"$VENV/bin/python" -m pip install "${PIP_QUIET[@]}" --no-index \
  --find-links "$WHEELHOUSE" --no-deps -e .
TF_CPP_MIN_LOG_LEVEL=2 "$VENV/bin/python" - <<'EOF'
import tensorflow as tf, keras, tensorflow_io  # noqa: E401  (fails loudly)
print(f"setup_tf217: .venv-tf217 has TensorFlow {tf.__version__}, "
      f"Keras {keras.__version__}, tensorflow-io {tensorflow_io.__version__}")
EOF
