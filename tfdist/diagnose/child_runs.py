"""The child runs: their flags (the baseline's made from the requested
run's), their command lines, and running them.
"""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import List, Optional, Sequence, Tuple

from tfdist import config as config_lib
from tfdist import errors
from tfdist.diagnose.measure import RunMeasurement
from tfdist.diagnose.measure import measurement_from_run
from tfdist.core.strategy_kind import StrategyKind


DEFAULT_STEPS = 60


DEFAULT_LOG_STEPS = 10


# Flags the baseline sets itself: its strategy and batch, and where it
# writes (not reported as dropped: the baseline always sets them).
_BASELINE_SETS = ("distribution_strategy", "batch_size",
                  "per_replica_batch_size",
                  *config_lib.settings_with("output_folder"), "profile_steps")


# Flags that apply only to several replicas or devices, a cluster or another
# strategy: the devices, ZeRO's sharding, collectives, the cluster,
# parameter servers, TPUs and pipeline stages. The one-device baseline drops
# them and says so.
MULTI_REPLICA_FLAGS = config_lib.settings_with("multi_replica")


_BASELINE_DROPS = _BASELINE_SETS + MULTI_REPLICA_FLAGS


# Boolean flags among them (`--name`, `--noname`: no separate value).
_BOOLEAN_DROPS = tuple(
    n for n in _BASELINE_DROPS
    if config_lib.flat_fields()[n].metadata["flag"] == "bool")


def flag_name(arg: str) -> Optional[str]:
  if not arg.startswith("--"):
    return None
  return arg[2:].split("=", 1)[0]


def split_flags(args: Sequence[str], names: Sequence[str],
                booleans: Sequence[str] = _BOOLEAN_DROPS
                ) -> Tuple[List[str], List[str]]:
  """`(kept, taken)`: `args` without the flags `names`, and those flags as
  given (`--name value` joined into one string), in any of absl's
  spellings: `--name=value`, `--name value`, and for `booleans` `--name`
  and `--noname`."""
  kept, taken, take_value = [], [], False
  for arg in args:
    if take_value:
      take_value = False
      taken[-1] += f" {arg}"
      continue
    name = flag_name(arg)
    if name in booleans or (name and name.startswith("no") and
                            name[2:] in booleans):
      taken.append(arg)
      continue
    if name in names:
      take_value = "=" not in arg
      taken.append(arg)
      continue
    kept.append(arg)
  return kept, taken


def without_flags(args: Sequence[str], names: Sequence[str],
                  booleans: Sequence[str] = _BOOLEAN_DROPS) -> List[str]:
  """`args` without the flags `names` (see `split_flags`)."""
  return split_flags(args, names, booleans)[0]


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """How to start one training run.

  Attributes:
    label: the run's name in tables.
    train_args: `tfdist.train` flags (no `--model_dir`).
    num_workers: training processes (> 1 or `num_ps`: through
      `tfdist.launch`).
    num_ps: parameter-server tasks.
    pin: pin each worker to a core of its own (`--pin_workers`; a single
      process to the first core).
    env: extra environment variables for the children.
  """
  label: str
  train_args: tuple
  num_workers: int = 1
  num_ps: int = 0
  pin: bool = False
  env: tuple = ()


def command_for(spec: RunSpec, model_dir: str) -> List[str]:
  """The child command line of `spec`."""
  train = [*spec.train_args, f"--model_dir={model_dir}"]
  if spec.num_workers > 1 or spec.num_ps:
    launch = [sys.executable, "-m", "tfdist.launch",
              f"--num_workers={spec.num_workers}", f"--num_ps={spec.num_ps}"]
    if spec.pin:
      launch.append("--pin_workers")
    return launch + ["--", *train]
  return [sys.executable, "-m", "tfdist.train", *train]


# A line that states an error: a Python exception (`ValueError: ...`,
# `tfdist.errors.ConfigError: ...`) or a binary's `...: error: ...`.
_ERROR_LINE = re.compile(r"^(\S*(Error|Exception|Exit)\b:|.*\berror: |"
                         r"E\d{4} |FATAL)")


def last_error_line(output: str) -> str:
  """The last line of a run's `output` that states an error (an
  exception's line, `error: ...`, an absl `E....` line), else its last
  non-empty line ("" for no output)."""
  lines = [line.strip() for line in output.splitlines() if line.strip()]
  return next((line for line in reversed(lines) if _ERROR_LINE.match(line)),
              lines[-1] if lines else "")


def child_environment(spec: RunSpec) -> Tuple[str, dict]:
  """`(cwd, env)` of a child run: the caller's working directory, and its
  import path (`sys.path`, `""` as that directory) after this checkout's
  root on `PYTHONPATH`, so `--model=mymodel:build` imports in the
  measured runs as it does in `--plan_only` from the same folder."""
  cwd = os.getcwd()
  env = dict(os.environ)
  env.update(dict(spec.env))
  # The children import this checkout's tfdist (and its `flags`) first.
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  path = [root, *(os.path.abspath(p) if p else cwd for p in sys.path)]
  path += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
  env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
  return cwd, env


def _failure(spec: RunSpec, code: Optional[int], log_path: str,
             timeout_seconds: float) -> errors.DiagnoseError:
  """The `DiagnoseError` of a failed run, with `exit_code` (the status
  `tfdist.diagnose` ends with: the run's own, from `tfdist.train`'s table;
  `errors.KILLED` past its time limit) and `last_error` (the run's last
  error line, `last_error_line`)."""
  with open(log_path, errors="replace") as f:
    output = f.read()
  last = last_error_line(output)
  what = (f"timed out after {timeout_seconds:g} s" if code is None else
          f"exited with status {code}")
  status = errors.KILLED if code is None else (
      code if 0 < code < 256 else errors.KILLED)
  error = errors.DiagnoseError(
      f"The {spec.label} run {what}: {last}\nThe end of its output "
      f"({log_path}):\n{output[-3000:]}")
  error.exit_code, error.last_error = status, last
  return error


def _wait(proc, *, timeout_seconds: float, progress=None,
          every_seconds: float = 10.0) -> Optional[int]:
  """The status of `proc`, None after killing its group past
  `timeout_seconds`; `progress()` is called every `every_seconds`."""
  deadline = time.monotonic() + timeout_seconds
  while True:
    left = deadline - time.monotonic()
    try:
      return proc.wait(timeout=max(0.0, min(left, every_seconds)))
    except subprocess.TimeoutExpired:
      if left <= every_seconds:
        os.killpg(proc.pid, 9)
        proc.wait()
        return None
      if progress is not None:
        progress()


def run_training(spec: RunSpec, model_dir: str, *,
                 timeout_seconds: float = 900, progress=None,
                 progress_seconds: float = 10.0) -> RunMeasurement:
  """Runs `spec` as a child process into `model_dir`; returns its
  measurement. Output goes to `<model_dir>.log`. The child starts in the
  caller's working directory with its import path (`child_environment`).

  Args:
    spec: the run.
    model_dir: its `--model_dir`.
    timeout_seconds: its time limit (seconds).
    progress: called with no argument every `progress_seconds` while it
      runs (None: nothing).
    progress_seconds: the interval of `progress` (seconds).

  Raises:
    DiagnoseError: the child failed or timed out (the message holds its
      last error line and the end of its output; the error's `exit_code`
      is its status, `last_error` that line), or it wrote no manifest (no
      `exit_code`).
  """
  if os.path.exists(model_dir):
    shutil.rmtree(model_dir)
  os.makedirs(os.path.dirname(model_dir) or ".", exist_ok=True)
  log_path = model_dir.rstrip("/") + ".log"
  cwd, env = child_environment(spec)
  with open(log_path, "wb") as log:
    proc = subprocess.Popen(command_for(spec, model_dir), cwd=cwd, env=env,
                            stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    if spec.pin and spec.num_workers <= 1 and not spec.num_ps:
      # Before the child imports TensorFlow (which sizes its thread pools
      # from the cores it may use), as tfdist.launch --pin_workers does.
      os.sched_setaffinity(proc.pid, {sorted(os.sched_getaffinity(0))[0]})
    code = _wait(proc, timeout_seconds=timeout_seconds, progress=progress,
                 every_seconds=progress_seconds)
  if code != 0:
    raise _failure(spec, code, log_path, timeout_seconds)
  return measurement_from_run(model_dir, spec.label)


def steps_done(model_dir: str) -> Optional[int]:
  """The last training step `<model_dir>/metrics.jsonl` records so far
  (None before the first log point); read without TensorFlow."""
  path = os.path.join(model_dir, "metrics.jsonl")
  step = None
  try:
    with open(path, errors="replace") as f:
      for line in f:
        try:
          record = json.loads(line)
        except ValueError:
          continue  # A line being written.
        if record.get("kind") == "train" and "step" in record:
          step = int(record["step"])
  except OSError:
    return None
  return step


def train_steps_of(train_args: Sequence[str]) -> Optional[int]:
  """The value of `--train_steps=N` among `train_args`, or None."""
  value = next((a.split("=", 1)[1] for a in train_args
                if flag_name(a) == "train_steps" and "=" in a), None)
  return int(value) if value and value.isdigit() else None


def baseline_args(train_args: Sequence[str], per_replica_batch_size: int
                  ) -> List[str]:
  """The single-device baseline's flags: the requested run's, without its
  strategy, batch and what applies only to several replicas
  (`MULTI_REPLICA_FLAGS`: devices, ZeRO sharding, collectives, the
  cluster, parameter servers, TPUs), on `one_device` (the first GPU when
  there is one, else the CPU) with the same per-replica batch."""
  return [*without_flags(train_args, _BASELINE_DROPS),
          f"--distribution_strategy={StrategyKind.ONE_DEVICE}",
          f"--per_replica_batch_size={per_replica_batch_size}"]


def baseline_dropped(train_args: Sequence[str]) -> List[str]:
  """The flags of `train_args` the baseline drops because they apply only
  to several replicas (`MULTI_REPLICA_FLAGS`), as given."""
  return split_flags(train_args, MULTI_REPLICA_FLAGS)[1]


def model_dir_flag(train_args: Sequence[str]) -> Optional[str]:
  """The value of `--model_dir=DIR` among `train_args`, or None."""
  return next((a.split("=", 1)[1] for a in train_args
               if flag_name(a) == "model_dir" and "=" in a), None)


def measured_args(train_args: Sequence[str], given: set, *, steps: int,
                  log_steps: int) -> List[str]:
  """`train_args` without `--model_dir`, with the diagnosis' defaults for
  the steps, the log interval and one evaluation at the end where
  `given` (the flag names in `train_args`) lacks them."""
  args = [a for a in train_args if flag_name(a) != "model_dir"]
  if "train_steps" not in given:
    args.append(f"--train_steps={steps}")
  if "log_steps" not in given:
    args.append(f"--log_steps={log_steps}")
  if "epochs_between_evals" not in given:
    args.append("--epochs_between_evals=1000")  # One evaluation, at the end.
  return args
