"""`tfdist_py_test`: a py_test that runs one pytest file.

Every file `tests/<name>.py` of tests has a target

    tfdist_py_test(
        name = "<name>",
        size = "small",  # or "medium", "large": sets the timeout
        deps = ["//tfdist:<module>"],
    )

which runs `pytest tests/<name>.py` through //tests:pytest_main.py (JUnit
XML for Bazel, caches in TEST_TMPDIR). //tests:bazel_targets_test fails
when a test file has no target.
"""

load("@rules_python//python:defs.bzl", "py_test")

def tfdist_py_test(name, size, deps = [], data = [], args = [], **kwargs):
    """Declares the py_test `name` for the pytest file `name + ".py"`.

    Args:
      name: the target name; the test file is `name + ".py"`.
      size: "small", "medium", "large" or "enormous"; sets the timeout
        (120 s, 600 s, 1800 s, 3600 s with tfdist's .bazelrc). Required:
        say what the test costs.
      deps: py_library targets the test file imports.
      data: files the test reads at run time.
      args: extra pytest arguments, after the test file.
      **kwargs: passed to py_test (tags, shard_count, flaky, ...).
    """
    src = name + ".py"
    py_test(
        name = name,
        size = size,
        srcs = [
            src,
            "//tests:pytest_main.py",
        ],
        main = "//tests:pytest_main.py",
        args = ["$(rootpath %s)" % src] + args,
        python_version = "PY3",
        deps = deps + ["//tests:init"],
        data = data + [
            "//:pytest_config",
            "//tests:conftest",
        ],
        **kwargs
    )
