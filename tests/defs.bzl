"""`tfdist_py_test` and `tfdist_py_test_group`: py_tests that run pytest.

Every file `tests/<name>.py` of tests is run by one target: a unit-test
file (seconds, no subprocess clusters) is a name in the `srcs` of the group

    tfdist_py_test_group(
        name = "unit_tests",
        size = "medium",
        srcs = ["<name>.py", ...],
        deps = ["//tfdist:<module>", ...],
    )

which runs all of them in ONE pytest process (one Python and TensorFlow
start-up, about 5-10 s, for all of them, not one per file), and also
declares `<name>` for each file alone, tagged "manual" (`bazel test
//tests/...` skips it; `bazel test //tests:<name> --test_filter=...` runs
it); any other test file has its own target

    tfdist_py_test(
        name = "<name>",
        size = "small",  # or "medium", "large": sets the timeout
        deps = ["//tfdist:<module>"],
    )

which runs `pytest tests/<name>.py` through //tests:pytest_main.py (JUnit
XML for Bazel, caches in TEST_TMPDIR). //tests:bazel_targets_test fails
when a test file has no target, when two targets run it, and when a
"small" `tfdist_py_test` sits in a package that has a group (it belongs in
the group's `srcs`).
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

def tfdist_py_test_group(
        name,
        size,
        srcs,
        deps = [],
        data = [],
        args = [],
        member_size = "small",
        **kwargs):
    """Declares the py_test `name` running the pytest files `srcs` together.

    One pytest process collects every file, so the files share one Python
    and TensorFlow start-up. They must not depend on running alone: a file
    that changes process-wide state (the Keras dtype policy, visible
    devices, absl flags) restores it when done.

    Each file also gets a target of its own, named after it, tagged "manual"
    so that `bazel test //tests/...` runs the file once (in the group) and
    `bazel test //tests:<file>_test` still runs it alone.

    Args:
      name: the target name (not a file name).
      size: "small", "medium", "large" or "enormous"; sets the timeout
        (120 s, 600 s, 1800 s, 3600 s with tfdist's .bazelrc) for all the
        files together.
      srcs: the test files, e.g. ["config_test.py", "strategy_test.py"].
      deps: py_library targets any of the files imports.
      data: files the tests read at run time.
      args: extra pytest arguments, after the test files.
      member_size: the size of each file's own target (one file alone).
      shard_count: run the files in this many processes (Bazel may run them
        at once), each taking every shard_count-th file; 1 by default.
        The per-file targets are not sharded.
      **kwargs: passed to py_test (flaky, ...).
    """
    tags = kwargs.pop("tags", [])
    shard_count = kwargs.pop("shard_count", 1)
    py_test(
        name = name,
        size = size,
        srcs = srcs + ["//tests:pytest_main.py"],
        main = "//tests:pytest_main.py",
        args = ["$(rootpath %s)" % src for src in srcs] + args,
        python_version = "PY3",
        deps = deps + ["//tests:init"],
        data = data + [
            "//:pytest_config",
            "//tests:conftest",
        ],
        tags = tags,
        shard_count = shard_count,
        **kwargs
    )
    for src in srcs:
        tfdist_py_test(
            name = src[:-len(".py")],
            size = member_size,
            deps = deps,
            data = data,
            args = args,
            tags = tags + ["manual"],
            **kwargs
        )

def tfdist_py_test_compat(
        name,
        size,
        srcs,
        venv,
        marker = "compat",
        deps = [],
        data = [],
        args = [],
        **kwargs):
    """Declares the py_test `name`: the `compat` tests of `srcs` in `venv`.

    One pytest process runs `pytest SRCS -m MARKER` with the interpreter of
    the virtual environment `venv` (the toolchain reads TFDIST_VENV), e.g.
    the oldest supported TensorFlow's. The files also have their own
    targets (or the unit-test group) in the default environment; this one
    runs only their tests marked `compat` (tests/conftest.py).

    Args:
      name: the target name (not a file name).
      size: "small", "medium", "large" or "enormous"; sets the timeout.
      srcs: the test files that mark tests `compat`.
      venv: the virtual environment folder, relative to the workspace root
        (".venv-tf217").
      marker: the pytest marker expression that selects the tests: "compat",
        or a part of them ("compat and cluster", "compat and not cluster").
      deps: py_library targets any of the files imports.
      data: files the tests read at run time.
      args: extra pytest arguments, after `-m MARKER`.
      **kwargs: passed to py_test (tags, shard_count, flaky, ...).
    """
    py_test(
        name = name,
        size = size,
        srcs = srcs + ["//tests:pytest_main.py"],
        main = "//tests:pytest_main.py",
        args = ["$(rootpath %s)" % src for src in srcs] + [
            "-m",
            # Bazel splits args as a shell would: one quoted word.
            "'%s'" % marker,
        ] + args,
        python_version = "PY3",
        deps = deps + ["//tests:init"],
        data = data + [
            "//:pytest_config",
            "//tests:conftest",
        ],
        env = {"TFDIST_VENV": venv},
        **kwargs
    )
