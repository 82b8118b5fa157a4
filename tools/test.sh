#!/usr/bin/env bash
# Runs the whole test suite: pytest over tests/, then every Bazel test target.
set -euo pipefail
cd "$(dirname "$0")/.."
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
.venv/bin/python -m pytest tests -q -p no:cacheprovider "$@"
