"""A local parameter-server cluster for tests: one process per task.

Every task runs `python -m tfdist.train` with the same flags and its own
TF_CONFIG on 127.0.0.1 (ports from portpicker). Output goes to one log file
per task. Only the processes started here are ever signalled, by PID.
"""

import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

import portpicker

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_launcher(test_case, launch_args: List[str], train_args: List[str],
                   log_path: str) -> subprocess.Popen:
  """Starts `python -m tfdist.launch LAUNCH_ARGS -- TRAIN_ARGS` in a session
  of its own, output to `log_path`; a cleanup of `test_case` kills that
  session's process group (only what was started here)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
  with open(log_path, "wb") as log:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfdist.launch", "--output=all", *launch_args,
         "--",
         *train_args], cwd=REPO_ROOT, env=env, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True)

  def cleanup():
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait(timeout=30)
  test_case.addCleanup(cleanup)
  return proc


class LocalCluster:
  """Starts chief, workers, ps tasks and optionally an evaluator.

  Args:
    flags: `tfdist.train` flags shared by every task.
    log_dir: folder for `<task>.log` files.
    num_workers, num_ps: cluster size.
    evaluator: also start a side-car evaluator task.
  """

  def __init__(self, flags: List[str], log_dir: str, *, num_workers: int = 2,
               num_ps: int = 2, evaluator: bool = False,
               env: Optional[Dict[str, str]] = None):
    self.flags = list(flags)
    self.log_dir = log_dir
    os.makedirs(log_dir, exist_ok=True)
    ports = [portpicker.pick_unused_port()
             for _ in range(1 + num_workers + num_ps)]
    addr = [f"127.0.0.1:{p}" for p in ports]
    self.cluster = {"chief": addr[:1], "worker": addr[1:1 + num_workers],
                    "ps": addr[1 + num_workers:]}
    self.tasks = [("ps", i) for i in range(num_ps)]
    self.tasks += [("worker", i) for i in range(num_workers)]
    if evaluator:
      self.tasks.append(("evaluator", 0))
    self.tasks.append(("chief", 0))
    self.env = dict(env or {})
    self.procs: Dict[str, subprocess.Popen] = {}

  def start(self):
    for task_type, index in self.tasks:
      self.start_task(task_type, index)
    return self

  def start_task(self, task_type: str, index: int):
    name = f"{task_type}-{index}"
    env = dict(os.environ)
    env.update(self.env)
    env["TF_CONFIG"] = json.dumps({"cluster": self.cluster, "task": {
        "type": task_type, "index": index}})
    env["GRPC_FAIL_FAST"] = "use_caller"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    log = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
    self.procs[name] = subprocess.Popen(
        [sys.executable, "-m", "tfdist.train", *self.flags], cwd=REPO_ROOT,
        env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return self.procs[name]

  def log(self, name: str) -> str:
    with open(os.path.join(self.log_dir, f"{name}.log"), errors="replace") as f:
      return f.read()

  def wait(self, name: str, timeout: float) -> Optional[int]:
    """Exit status of task `name`, or None if it is still running."""
    try:
      return self.procs[name].wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      return None

  def wait_for_log(self, name: str, text: str, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
      if text in self.log(name):
        return True
      if self.procs[name].poll() is not None:
        return text in self.log(name)
      time.sleep(0.2)
    return False

  def kill(self, name: str, sig=signal.SIGKILL):
    proc = self.procs[name]
    if proc.poll() is None:
      os.kill(proc.pid, sig)
      proc.wait(timeout=30)

  def stop(self):
    """Kills every task still running (only the ones started here)."""
    for name, proc in self.procs.items():
      if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    for proc in self.procs.values():
      try:
        proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        pass

  def __enter__(self):
    return self.start()

  def __exit__(self, *exc):
    self.stop()
