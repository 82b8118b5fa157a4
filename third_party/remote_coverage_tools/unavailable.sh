#!/bin/sh
# Stand-in for Bazel's downloaded coverage tools (see third_party/README.md).
echo "remote_coverage_tools: bazel coverage is unavailable offline;" \
  "use pytest --cov instead." >&2
exit 1
