"""Offline stand-in for @rules_python//python:defs.bzl.

Forwards to Bazel's native Python rules, with the same names and labels as
the real rules_python, so the project's BUILD files load the Python rules
through `@rules_python` and work unchanged when the real repository is
swapped in on a newer Bazel.
"""

load(
    "@bazel_tools//tools/python:toolchain.bzl",
    _py_runtime_pair = "py_runtime_pair",
)

# py_runtime_pair is a Starlark rule of @bazel_tools, not a native rule.
py_runtime_pair = _py_runtime_pair

def py_library(**attrs):
    native.py_library(**attrs)

def py_binary(**attrs):
    native.py_binary(**attrs)

def py_test(**attrs):
    native.py_test(**attrs)

def py_runtime(**attrs):
    native.py_runtime(**attrs)
