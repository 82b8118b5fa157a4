"""What the benchmarks share: the machine they ran on, and their child runs.

Not a benchmark: `cpu_model`, `cpu_flags`, `load_average` and
`command_line` describe the machine and the command for a benchmark's
JSON record, and `write_json` writes that record; `run_child` runs one
configuration in a fresh Python process (logical devices and environment
variables must be set before TensorFlow starts) and returns the JSON
result it printed.
"""

import json
import os
import platform
import subprocess
import sys
from typing import List, Mapping, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cpuinfo(field: str) -> str:
  """The first CPU's `field` in `/proc/cpuinfo`; "" when absent."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.split(":", 1)[0].strip() == field:
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return ""


def cpu_model() -> str:
  """The CPU's model name (`/proc/cpuinfo`), else `platform.processor()`
  or "unknown", for a benchmark's record."""
  return _cpuinfo("model name") or platform.processor() or "unknown"


def cpu_flags() -> List[str]:
  """The CPU's feature flags (`/proc/cpuinfo`: `avx512_vnni`, ...); empty
  when unknown."""
  return _cpuinfo("flags").split()


def load_average() -> List[float]:
  """The 1, 5 and 15 minute load averages, as a JSON list."""
  return list(os.getloadavg())


def command_line() -> str:
  """This benchmark's command as run from the repository's root
  (`python benchmarks/NAME.py FLAGS...`), for its record."""
  script = os.path.basename(sys.argv[0])
  return " ".join(["python", f"benchmarks/{script}", *sys.argv[1:]])


def write_json(path: str, record: dict, *, indent: int = 1,
               sort_keys: bool = False) -> str:
  """Writes `record` as JSON to `path`, its folder made if missing, and
  says so; returns the path. A relative path is taken from where the
  command was started (under `bazel run`, `BUILD_WORKING_DIRECTORY`, not
  the runfiles)."""
  if not os.path.isabs(path):
    path = os.path.join(os.environ.get("BUILD_WORKING_DIRECTORY",
                                       os.getcwd()), path)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(record, f, indent=indent, sort_keys=sort_keys)
  print(f"wrote {path}")
  return path


def run_child(args: Sequence[str], *, timeout: float, what: str,
              env: Optional[Mapping[str, str]] = None, prefix: str = "{",
              timeout_flag: str = "") -> dict:
  """Runs `python ARGS` from the repository's root, with the repository
  on `PYTHONPATH` and `TF_CPP_MIN_LOG_LEVEL=2` unless set, and returns the
  JSON of the last line it printed that starts with `prefix` (the prefix
  removed unless it is `{`).

  Args:
    args: the script and its arguments (after `python`).
    timeout: seconds the child may take.
    what: the configuration, as the failure names it (`"N=2 stage=1"`).
    env: the environment (default: this process's).
    prefix: what marks the result line.
    timeout_flag: the benchmark's flag that sets `timeout`, named when
      the child runs out of time (`--run_timeout`); none: a fixed limit.

  Returns:
    The parsed result.

  Raises:
    SystemExit: the child failed, timed out or printed no result line;
      the message names `what` and ends with the child's output.
  """
  env = dict(os.environ if env is None else env)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  try:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout,
                          check=False)
  except subprocess.TimeoutExpired as e:
    fix = f"raise {timeout_flag}, or use" if timeout_flag else "use"
    raise SystemExit(f"{what}: no result in {timeout:.0f} s ({fix} "
                     f"smaller settings):\n"
                     f"{_text(e.stdout)[-2000:]}{_text(e.stderr)[-3000:]}"
                     ) from e
  keep = 0 if prefix == "{" else len(prefix)
  lines = [line[keep:] for line in proc.stdout.splitlines()
           if line.startswith(prefix)]
  if proc.returncode or not lines:
    raise SystemExit(f"{what} failed (exit {proc.returncode}):\n"
                     f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
  return json.loads(lines[-1])


def _text(output) -> str:
  if isinstance(output, bytes):
    return output.decode(errors="replace")
  return output or ""
