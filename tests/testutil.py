"""Shared helpers for tfdist tests: small real data and running the binary."""

import json
import os
import re
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# tfdist's own modules (their log lines are not noise).
TFDIST_MODULES = frozenset(
    name for _, _, names in os.walk(os.path.join(REPO_ROOT, "tfdist"))
    for name in names if name.endswith(".py"))
# absl / glog line prefix: severity, date, time, thread, file:line.
LOG_PREFIX = re.compile(r"^(?P<sev>[IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ "
                        r"(?P<file>[^:\]\s]+):\d+\] ")
# The launcher's prefix of a task's line, e.g. `[worker:0] `.
_TASK_PREFIX = re.compile(r"^\[\w+:\d+\] ")


def noise(text: str) -> list:
  """Lines of TensorFlow, gRPC or Python (not tfdist) at WARNING or above
  (a launcher's `[task:i] ` prefixes are looked through)."""
  found = []
  for line in text.splitlines():
    body = _TASK_PREFIX.sub("", line, count=1)
    prefix = LOG_PREFIX.match(body)
    if prefix:
      if prefix["sev"] != "I" and prefix["file"] not in TFDIST_MODULES:
        found.append(line)
    elif (body.startswith(("WARNING", "ERROR", "FATAL")) or
          re.search(r"grpc_status|Connection refused|UNAVAILABLE|"
                    r"\w+Warning: |Traceback", body)):
      found.append(line)
  return found


_SUBSETS = {}
_CHILD_RESULTS = {}


def scratch_dir() -> str:
  """A writable temporary folder (Bazel's TEST_TMPDIR when set)."""
  base = os.environ.get("TEST_TMPDIR") or None
  return tempfile.mkdtemp(dir=base)


def fashion_mnist_subset(limit: int = 1024, train_shards: int = 4,
                         test_shards: int = 2) -> dict:
  """Converts the first `limit` real Fashion-MNIST examples of each split.

  Returns:
    `{"dir", "train", "eval"}`: the folder and the two file globs. Cached per
    process and size.
  """
  key = (limit, train_shards, test_shards)
  if key not in _SUBSETS:
    from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
    out = os.path.join(scratch_dir(), "fashion_mnist")
    datasets.convert_fashion_mnist(out, limit=limit, train_shards=train_shards,
                                   test_shards=test_shards)
    _SUBSETS[key] = {"dir": out,
                     "train": os.path.join(out, "train-*.tfrecord.gz"),
                     "eval": os.path.join(out, "test-*.tfrecord.gz")}
  return _SUBSETS[key]


def run_module(module: str, args, *, timeout: float = 300, env=None
               ) -> subprocess.CompletedProcess:
  """Runs `python -m module args` from the repository root; never hangs.

  Returns:
    The completed process (stdout and stderr merged into `.stdout`).
  """
  full_env = dict(os.environ)
  full_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  full_env["PYTHONPATH"] = REPO_ROOT + os.pathsep + full_env.get(
      "PYTHONPATH", "")
  if env:
    full_env.update(env)
  return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT,
                        env=full_env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=timeout)


def child_cases(script: str, env_name: str, *, timeout: float = 300
                ) -> dict:
  """Runs test file `script` once per test process as a child process
  with `env_name` set to the training-file glob of a small real
  Fashion-MNIST subset (256 examples, 2 shards; oneDNN off), for cases
  that need a process of their own (logical devices, op determinism).

  Returns:
    The last JSON line the child printed (a dict of cases by name),
    cached per `script`.

  Raises:
    AssertionError: the child failed or printed no JSON line.
    subprocess.TimeoutExpired: it ran longer than `timeout` seconds.
  """
  if script not in _CHILD_RESULTS:
    data = fashion_mnist_subset(limit=256, train_shards=2, test_shards=1)
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0",
               TF_CPP_MIN_LOG_LEVEL="2", **{env_name: data["train"]})
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, script], cwd=REPO_ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode or not lines:
      raise AssertionError(f"child failed ({proc.returncode}):\n"
                           f"{proc.stdout[-4000:]}")
    _CHILD_RESULTS[script] = json.loads(lines[-1])
  return _CHILD_RESULTS[script]


def child_case(test, script: str, env_name: str, name: str) -> dict:
  """Case `name` of `child_cases(script, env_name)`; fails `test` with the
  child's traceback when the case raised."""
  result = child_cases(script, env_name)[name]
  test.assertNotIn("error", result, result.get("error"))
  return result


def fp16_dense_model(strategy):
  """The fp16 overflow tests' model, built under `strategy.scope()`: a
  Dense(3) with weights of ones on float32 [batch, 4] inputs, and SGD(1e-3)
  with a dynamic loss scale. Set the `mixed_float16` policy first.

  Returns:
    `(model, optimizer)`, the optimizer built.
  """
  import keras  # pylint: disable=g-import-not-at-top
  from tfdist.training.step import precision  # pylint: disable=g-import-not-at-top
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        3, kernel_initializer="ones")])
    optimizer = precision.wrap_optimizer_for_precision(
        keras.optimizers.SGD(1e-3), dtype="fp16", loss_scale="dynamic")
    optimizer.build(model.trainable_variables)
  return model, optimizer


class VariableCreations:
  """Inside, records every `tf.Variable` created in this thread (through
  `tf.variable_creator_scope`), as `(name, shape, device)` in `created`:
  where a variable's storage was first made."""

  def __enter__(self):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    self.created = []

    def creator(next_creator, **kwargs):
      variable = next_creator(**kwargs)
      self.created.append((variable.name.split(":")[0],
                           tuple(variable.shape), variable.device))
      return variable

    self._scope = tf.variable_creator_scope(creator)
    self._scope.__enter__()  # pylint: disable=unnecessary-dunder-call
    return self

  def __exit__(self, *exc):
    return self._scope.__exit__(*exc)


# The source checkout itself (not Bazel's runfiles tree, whose files are
# links into it): what tools/setup.sh built next to it lives there.
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def setup_output(name: str) -> str:
  """The path of `name` (`.wheelhouse`, `.venv-tf217`) that tools/setup.sh
  makes in the source checkout; the calling test fails when it is missing.

  Raises:
    AssertionError: the path does not exist (run tools/setup.sh).
  """
  path = os.path.join(SOURCE_ROOT, name)
  if not os.path.exists(path):
    raise AssertionError(
        f"{path} is missing: run tools/setup.sh, which builds it (the TF 2.17 "
        "environment and its wheelhouse; tools/setup_tf217.sh alone also "
        "does).")
  return path


def shown_output(guide: str) -> list:
  """The lines of the first block a docs guide shows as "output of the
  command above" (`<!-- not run: output of the command above ... -->`
  before a `text` block), for a test comparing them with what tfdist
  prints.

  Args:
    guide: the page's path under `docs/`, e.g. `guides/experts.md`.
  """
  with open(os.path.join(REPO_ROOT, "docs", guide), encoding="utf-8") as f:
    page = f.read()
  return re.search(r"<!-- not run: output of the command above[^>]*-->\n"
                   r"```text\n(.*?)```", page, re.S).group(1).splitlines()


def two_logical_cpus() -> bool:
  """Splits this process's CPU into 2 logical devices
  (`tfdist.distribute.devices.configure_cpu_devices`), for a test file that
  runs its Mirrored cases in its own process when it can.

  Returns:
    True when split (or already split in two); False when TensorFlow's
    runtime already started here with another split (too late to split
    it: run the cases in a child process instead).
  """
  from tfdist.distribute import devices  # pylint: disable=g-import-not-at-top
  try:
    devices.configure_cpu_devices(2)
  except RuntimeError:
    return False
  return True
