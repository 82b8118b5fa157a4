"""Starts a whole TensorFlow cluster on this machine, one process per task.

Usage:
  python -m tfdist.launch --num_workers=2 -- --distribution_strategy=\
multi_worker_mirrored --dataset=fashion_mnist --train_steps=200 --model_dir=DIR
  python -m tfdist.launch --num_workers=2 --num_ps=1 [--evaluator] -- ...
  python -m tfdist.launch --num_workers=2 --max_restarts=3 -- ...

Everything after `--` goes to every process (`python -m tfdist.train` unless
`--module` says otherwise). The launcher:

* gives every task a free port on 127.0.0.1 (portpicker) and its own
  `TF_CONFIG` (the evaluator is not listed in `cluster`, only as its task);
* names the roles as TensorFlow's guides do. Without ps tasks the
  `--num_workers` processes that train are `chief` 0 and `worker` 0..N-2
  (MultiWorkerMirroredStrategy). With `--num_ps=M` there is a `chief`
  (the coordinator) plus `worker` 0..N-1 plus `ps` 0..M-1, and every task
  gets `GRPC_FAIL_FAST=use_caller` (ParameterServerStrategy). `--evaluator`
  adds `evaluator` 0. With `--pipeline_stages` among the task flags, the
  same chief and workers hold the stages: the chief drives, the workers
  serve until it marks the run done (`tfdist.backends.pipeline`);
* shows the chief's output as the chief writes it (once, not once per
  worker), the evaluator's prefixed with its task, and of the other tasks
  only their warnings and errors, prefixed with the task
  (`[worker:0] ...`); TensorFlow's own C++ log and import notices stay
  hidden unless `--verbose`; a task that fails gets its last lines shown
  (`tfdist.runtime.task_output`). `--output=all` shows every line of every
  task, prefixed; `--task_log_dir=DIR` keeps each task's whole output in
  `DIR/<type>-<index>.log`;
* forwards SIGINT (Ctrl-C) and SIGTERM to every task; the tasks save a
  checkpoint and exit (see `tfdist.runtime.preemption`), and any still running
  after `--stop_grace_seconds` are killed. A second Ctrl-C kills at once;
* exits with the chief's exit status (128 + N if a signal N ended it; 1 if
  the chief succeeded but another task failed);
* with `--pin_workers`: pins each training process (the chief and the
  workers; with ps tasks, the workers) to a CPU core of its own
  (`os.sched_setaffinity`, as `taskset -c` does), cycling through the cores
  this process may use. With ps tasks the chief (the coordinator) and the ps
  tasks share the cores left over (unpinned when none is left), and a worker
  pinned to one core gets `TF_NUM_INTEROP_THREADS=2`
  (`PS_WORKER_INTER_OP_THREADS`); an evaluator stays unpinned. For
  measurements: one core per worker;
* with `--max_restarts=K`: when any task exits with an error (or is
  killed), it stops the others and starts the whole group again, with new
  ports, up to K times. The training binary resumes from the last
  checkpoint in `--model_dir`. The launcher's lines (and, with
  `--task_log_dir`, the log of each task it stops for the failure) name
  the task that failed first and its exit status; so does a task's own
  error for the lost peer (`PeerLostError`: the launcher writes the
  failed tasks to `$TFDIST_LOST_TASKS_FILE` before it stops the others).

When the chief has finished, `ps` tasks (and, with ps tasks, the workers,
which are servers there) are stopped; other tasks get
`--stop_grace_seconds` to finish on their own.

Each task gets a done-marker path in `$TFDIST_DONE_FILE`; `tfdist.train`
writes it after its run's final barrier, just before its process ends
(`tfdist.distribute.worker_exit`). A task that wrote it and then exits with an
error, or has not exited `min(DONE_EXIT_GRACE_SECONDS, --stop_grace_seconds)`
later (it is then stopped), has failed: the run's status is then the
chief's, or 1. Its work is done, so the group is not restarted for it.

Non-chief tasks get a scratch `TMPDIR` under one launcher folder, which is
deleted at the end even if a task was killed before cleaning up.
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence

from absl import app
from absl import flags
import portpicker

from tfdist import errors
from tfdist.distribute import cluster as cluster_lib
from tfdist.distribute import worker_exit
from tfdist.runtime import cli
from tfdist.runtime import task_output

HOST = "127.0.0.1"
# Survivors of a failed task that end on their own (the chief; without ps
# tasks, the workers: they usually fail at once with UnavailableError) get
# this long to exit before every task still running is killed. Servers and
# an evaluator are not waited for (`_ends_on_its_own`).
FAILURE_STOP_SECONDS = 5.0
# A task that wrote its done marker gets this long (at most
# --stop_grace_seconds) to exit before it is stopped.
DONE_EXIT_GRACE_SECONDS = 10.0
POLL_SECONDS = 0.1
# The fewest inter-op threads a pinned parameter-server worker runs with.
# TensorFlow sizes the inter-op pool from the cores the process may use:
# pinned to one core, one thread, and the worker's first closure never
# finishes (its stacks show the remote function call waiting on a compute
# thread for ops that the one thread does not run); with two it trains.
PS_WORKER_INTER_OP_THREADS = 2


@dataclasses.dataclass(frozen=True)
class Task:
  """One process of the local cluster."""
  task_type: str
  task_index: int

  @property
  def name(self) -> str:
    return f"{self.task_type}:{self.task_index}"


def plan_tasks(*, num_workers: int, num_ps: int = 0,
               evaluator: bool = False) -> List[Task]:
  """The tasks for `num_workers` training processes (see module docstring).

  Raises:
    ValueError: `num_workers` < 1 or `num_ps` < 0.
  """
  if num_workers < 1:
    raise ValueError(f"--num_workers={num_workers} must be >= 1.")
  if num_ps < 0:
    raise ValueError(f"--num_ps={num_ps} must be >= 0.")
  tasks = [Task(cluster_lib.CHIEF, 0)]
  extra_workers = num_workers if num_ps else num_workers - 1
  tasks += [Task(cluster_lib.WORKER, i) for i in range(extra_workers)]
  tasks += [Task(cluster_lib.PS, i) for i in range(num_ps)]
  if evaluator:
    tasks.append(Task(cluster_lib.EVALUATOR, 0))
  return tasks


def make_cluster(tasks: Sequence[Task], ports: Sequence[int],
                 host: str = HOST) -> Dict[str, List[str]]:
  """`{job: [host:port, ...]}` for every task but the evaluator."""
  cluster: Dict[str, List[str]] = {}
  for task, port in zip(tasks, ports):
    if task.task_type != cluster_lib.EVALUATOR:
      cluster.setdefault(task.task_type, []).append(f"{host}:{port}")
  return cluster


def tf_config(cluster: Dict[str, List[str]], task: Task) -> str:
  """The `TF_CONFIG` JSON of `task` (checked with `tfdist.distribute.cluster`)."""
  text = json.dumps({"cluster": cluster,
                     "task": {"type": task.task_type,
                              "index": task.task_index}})
  cluster_lib.from_tf_config(text)  # Raises if we built something invalid.
  return text


def task_env(base: Dict[str, str], cluster: Dict[str, List[str]], task: Task,
             *, scratch_dir: Optional[str] = None,
             done_file: Optional[str] = None,
             pinned_cpus: Sequence[int] = (),
             lost_file: Optional[str] = None) -> Dict[str, str]:
  """The environment of one task: `base` plus TF_CONFIG and friends (and
  `$TFDIST_DONE_FILE`, where the task marks its work done;
  `$TFDIST_LOST_TASKS_FILE`, where the launcher says which task failed,
  `tfdist.distribute.worker_exit.lost_peers_note`).

  `pinned_cpus`: the cores the task is pinned to (`--pin_workers`; empty:
  not pinned). A parameter-server worker pinned to fewer than
  `PS_WORKER_INTER_OP_THREADS` cores gets that many inter-op threads
  (`TF_NUM_INTEROP_THREADS`, unless `base` sets it).
  """
  env = dict(base)
  if (pinned_cpus and cluster.get(cluster_lib.PS) and
      task.task_type == cluster_lib.WORKER and
      len(pinned_cpus) < PS_WORKER_INTER_OP_THREADS):
    env.setdefault("TF_NUM_INTEROP_THREADS", str(PS_WORKER_INTER_OP_THREADS))
  env["TF_CONFIG"] = tf_config(cluster, task)
  env.pop("CLUSTER_SPEC", None)  # TF_CONFIG would win anyway; avoid doubt.
  env["PYTHONUNBUFFERED"] = "1"
  if cluster.get(cluster_lib.PS):
    # TensorFlow's parameter-server guide: fail RPCs fast, let the caller
    # (the coordinator) retry.
    env["GRPC_FAIL_FAST"] = "use_caller"
  if scratch_dir:
    env["TMPDIR"] = scratch_dir
  env.pop(worker_exit.DONE_FILE_ENV, None)
  if done_file:
    env[worker_exit.DONE_FILE_ENV] = done_file
  env.pop(worker_exit.LOST_FILE_ENV, None)
  if lost_file:
    env[worker_exit.LOST_FILE_ENV] = lost_file
  return env


def worker_cpus(tasks: Sequence[Task], cpus: Sequence[int]
                ) -> Dict[Task, int]:
  """The CPU core of each training worker under `--pin_workers`.

  The training workers get `cpus` in order, cycling: the chief and the
  workers of a cluster without ps tasks, the workers of one with ps tasks
  (whose chief coordinates and trains nothing).

  Args:
    tasks: from `plan_tasks`.
    cpus: the cores to use (e.g. `sorted(os.sched_getaffinity(0))`).

  Returns:
    `{task: cpu}` for the training workers.

  Raises:
    ValueError: `cpus` is empty.
  """
  if not cpus:
    raise ValueError("--pin_workers needs at least one CPU core; none is "
                     "available to this process (os.sched_getaffinity).")
  return {t: cpus[i % len(cpus)] for i, t in enumerate(_training(tasks))}


def service_cpus(tasks: Sequence[Task], cpus: Sequence[int]
                 ) -> Dict[Task, List[int]]:
  """The cores of the coordinator and the ps tasks under `--pin_workers`.

  With ps tasks, the cores left after one per worker (`worker_cpus`) go to
  the chief (the coordinator) and the ps tasks, shared among them, so that
  no worker shares its core. With no core left, or without ps tasks, they
  stay unpinned (an evaluator always does).

  Args:
    tasks: from `plan_tasks`.
    cpus: the cores to use.

  Returns:
    `{task: [cpu, ...]}` for the chief and ps tasks of a parameter-server
    cluster with cores to spare; else `{}`.
  """
  if not any(t.task_type == cluster_lib.PS for t in tasks):
    return {}
  spare = list(cpus)[len(_training(tasks)):]
  if not spare:
    return {}
  return {t: spare for t in tasks
          if t.task_type in (cluster_lib.CHIEF, cluster_lib.PS)}


def _training(tasks: Sequence[Task]) -> List[Task]:
  """The tasks that run training steps (see `worker_cpus`)."""
  has_ps = any(t.task_type == cluster_lib.PS for t in tasks)
  kinds = ((cluster_lib.WORKER,) if has_ps else
           (cluster_lib.WORKER, cluster_lib.CHIEF))
  return [t for t in tasks if t.task_type in kinds]


def _log_name(task: Task) -> str:
  """The file name of `task`'s whole output under `--task_log_dir`."""
  return f"{task.task_type}-{task.task_index}.log"


def _exit_status(code: Optional[int]) -> int:
  """A subprocess return code as a shell exit status (signal N -> 128+N)."""
  if code is None:
    return 1
  return 128 - code if code < 0 else code


class Launcher:
  """Runs the local cluster; see the module docstring.

  Args:
    tasks: from `plan_tasks`.
    command: the program every task runs, e.g. `[python, -m, tfdist.train,
      --model_dir=...]`.
    max_restarts: group restarts allowed after a task fails.
    stop_grace_seconds: after forwarding a signal (or after the chief
      finished), how long tasks get before they are killed.
    out: where prefixed output goes.
    pin_workers: pin each training worker to a core of its own
      (`worker_cpus`), and the coordinator and ps tasks to the cores left
      over (`service_cpus`).
    output: `task_output.OUTPUT_CHIEF` (the chief's lines, the other
      tasks' warnings and errors) or `OUTPUT_ALL` (every line, prefixed).
    verbose: with `OUTPUT_CHIEF`, show the chief's TensorFlow chatter too.
    task_log_dir: a folder for each task's whole output (`<type>-<index>.log`,
      appended to by every attempt); None: no files.

  Raises:
    ValueError: `output` is not one of `task_output.OUTPUT_MODES`.
  """

  def __init__(self, *, tasks: Sequence[Task], command: Sequence[str],
               max_restarts: int = 0, stop_grace_seconds: float = 40.0,
               out=None, pin_workers: bool = False,
               output: str = task_output.OUTPUT_CHIEF, verbose: bool = False,
               task_log_dir: Optional[str] = None):
    if output not in task_output.OUTPUT_MODES:
      raise ValueError(
          f"--output={output!r} is not one of "
          f"{', '.join(task_output.OUTPUT_MODES)}: `chief` shows the chief's "
          "lines and the other tasks' warnings and errors, `all` every line "
          "of every task.")
    self.output = output
    self.verbose = bool(verbose)
    self.task_log_dir = task_log_dir
    self._tails: Dict[Task, task_output.TaskTail] = {}
    self._pumps: Dict[Task, threading.Thread] = {}
    self._shown_messages = set()
    self.tasks = list(tasks)
    self.command = list(command)
    self.max_restarts = int(max_restarts)
    self.stop_grace_seconds = float(stop_grace_seconds)
    self.out = out or sys.stdout
    self.cpus: Dict[Task, List[int]] = {}
    if pin_workers:
      cpus = sorted(os.sched_getaffinity(0))
      self.cpus = {t: [c] for t, c in worker_cpus(self.tasks, cpus).items()}
      self.cpus.update(service_cpus(self.tasks, cpus))
    self._lock = threading.Lock()
    self._procs: Dict[Task, subprocess.Popen] = {}
    self._signal: Optional[int] = None
    self._signal_deadline: Optional[float] = None
    self._done_files: Dict[Task, str] = {}
    self._done_at: Dict[Task, float] = {}
    self._failed_after_work: Dict[Task, str] = {}
    # The tasks whose failure ended the last attempt: their exit statuses.
    self._lost: Dict[Task, int] = {}
    # This attempt's file for `worker_exit.write_lost_peers`.
    self._lost_file: Optional[str] = None
    self.attempts = 0

  # --- output --------------------------------------------------------------
  def _say(self, text: str):
    with self._lock:
      self.out.write(f"[launch] {text}\n")
      self.out.flush()

  def _write(self, data: bytes):
    """Writes `data` (whole lines) to the output; the caller holds the lock."""
    out = getattr(self.out, "buffer", None)
    if out is not None:
      out.write(data)
    else:
      self.out.write(data.decode(errors="replace"))
    self.out.flush()

  def _pump(self, task: Task, stream, log=None):
    prefix = f"[{task.name}] ".encode()
    tail = self._tails[task]
    for line in iter(stream.readline, b""):
      if not line.endswith(b"\n"):
        line += b"\n"
      if log is not None:
        log.write(line)
        log.flush()
      with self._lock:
        if self.output == task_output.OUTPUT_ALL:
          shown, text = True, prefix + line
        elif task == self.tasks[0]:
          shown, text = self._chief_line(line), line
        elif task.task_type == cluster_lib.EVALUATOR:
          # Its evaluations are its own, not a copy of the chief's lines.
          shown, text = self._chief_line(line), prefix + line
        else:
          shown, text = self._task_line(line), prefix + line
        tail.add(line, shown)
        if shown:
          self._write(text)
    stream.close()
    if log is not None:
      log.close()

  def _chief_line(self, line: bytes) -> bool:
    """Whether the chief's (or the evaluator's) `line` is shown
    (`--output=chief`)."""
    text = line.decode(errors="replace").rstrip("\n")
    if not self.verbose and task_output.is_chatter(text):
      return False
    self._shown_messages.add(task_output.message_key(text))
    return True

  def _task_line(self, line: bytes) -> bool:
    """Whether another task's `line` is shown (`--output=chief`): what
    concerns it, less what the chief or another task has said already
    (`task_output.message_key`), and a signal it received unless the
    launcher forwarded one to every task."""
    text = line.decode(errors="replace").rstrip("\n")
    if text.startswith("tfdist: received SIG"):
      return self._signal is None
    key = task_output.message_key(text)
    if not task_output.concerns_task(text) or key in self._shown_messages:
      return False
    self._shown_messages.add(key)
    return True

  def _show_tail(self, task: Task):
    """After `task` failed: its last lines, when the user has not seen
    them all (`--output=chief`)."""
    if self.output == task_output.OUTPUT_ALL:
      return
    thread = self._pumps.get(task)
    if thread is not None:
      thread.join(timeout=5)  # The task has exited: its last lines come.
    tail = self._tails[task]
    if not tail.any_hidden():
      return
    where = (os.path.join(self.task_log_dir, _log_name(task))
             if self.task_log_dir else
             "run with --output=all or --task_log_dir=DIR")
    lines = tail.lines()
    what = f"{len(lines)} lines" if len(lines) > 1 else "line"
    self._say(f"the last {what} of {task.name} (all of its output: "
              f"{where}):")
    prefix = f"[{task.name}] ".encode()
    with self._lock:
      self._write(b"".join(prefix + line for line in lines))

  # --- signals -------------------------------------------------------------
  def _on_signal(self, signum, frame):
    del frame  # Unused.
    if self._signal is not None:
      self._say(f"second {signal.Signals(signum).name}: killing every task.")
      self._kill_all(signal.SIGKILL)
      return
    self._signal = signum
    self._signal_deadline = time.time() + self.stop_grace_seconds
    self._say(f"{signal.Signals(signum).name}: forwarding to every task; "
              f"killing any still running after {self.stop_grace_seconds:g} s.")
    self._kill_all(signum)

  def _kill_all(self, signum, only: Optional[Sequence[Task]] = None):
    for task, proc in list(self._procs.items()):
      if only is not None and task not in only:
        continue
      if proc.poll() is None:
        try:
          os.kill(proc.pid, signum)
        except ProcessLookupError:
          pass

  # --- one attempt -----------------------------------------------------------
  def _start(self, scratch_root: str):
    ports: List[int] = []
    while len(ports) < len(self.tasks):
      port = portpicker.pick_unused_port()
      if port not in ports:
        ports.append(port)
    cluster = make_cluster(self.tasks, ports)
    pumps = []
    self._shown_messages = set()
    self._lost_file = os.path.join(scratch_root, f"attempt{self.attempts}",
                                   "lost-tasks")
    for task, port in zip(self.tasks, ports):
      scratch = os.path.join(scratch_root, f"attempt{self.attempts}",
                             task.name.replace(":", ""))
      os.makedirs(scratch, exist_ok=True)
      self._done_files[task] = os.path.join(scratch, "tfdist-done")
      env = task_env(dict(os.environ), cluster, task, scratch_dir=scratch,
                     done_file=self._done_files[task],
                     pinned_cpus=self.cpus.get(task, ()),
                     lost_file=self._lost_file)
      proc = subprocess.Popen(self.command, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              start_new_session=True)
      self._procs[task] = proc
      if task in self.cpus:
        # Before the child imports TensorFlow (it sizes its thread pools
        # from the cores it may use); its threads inherit the mask.
        os.sched_setaffinity(proc.pid, set(self.cpus[task]))
      where = ("" if task.task_type == cluster_lib.EVALUATOR else
               f" at {HOST}:{port}")
      if task in self.cpus:
        cpus = self.cpus[task]
        where += (f", pinned to CPU{'s' if len(cpus) > 1 else ''} "
                  f"{','.join(map(str, cpus))}")
      self._say(f"attempt {self.attempts}: started {task.name} pid "
                f"{proc.pid}{where}")
      log = None
      if self.task_log_dir:
        log = open(os.path.join(self.task_log_dir, _log_name(task)), "ab")
        log.write(f"[launch] attempt {self.attempts}\n".encode())
      self._tails[task] = task_output.TaskTail()
      thread = threading.Thread(target=self._pump,
                                args=(task, proc.stdout, log), daemon=True)
      thread.start()
      pumps.append(thread)
      self._pumps[task] = thread
    return pumps

  def _wait_attempt(self) -> str:
    """Waits for the attempt to end: 'ok', 'failed' or 'signaled'."""
    chief = self.tasks[0]
    has_ps = any(t.task_type == cluster_lib.PS for t in self.tasks)
    servers = [t for t in self.tasks if t.task_type == cluster_lib.PS or
               (has_ps and t.task_type == cluster_lib.WORKER)]
    chief_done_at = None
    self._done_at = {}
    self._failed_after_work = {}
    done_grace = min(DONE_EXIT_GRACE_SECONDS, self.stop_grace_seconds)
    noted = set()
    while True:
      codes = {t: p.poll() for t, p in self._procs.items()}
      now = time.time()
      self._note_done_files(now)
      if self._signal is not None:
        if self._all_exited_after_signal(codes):
          return "signaled"
        continue
      failed = [t for t, c in codes.items() if c not in (None, 0)
                and t not in self._done_at
                and not (chief_done_at and t in servers)]
      if failed:
        self._stop_for_failed(failed, codes)
        return "failed"
      self._check_done_tasks(
          codes, now=now, noted=noted, done_grace=done_grace,
          skip=servers if chief_done_at else ())
      if (codes[chief] == 0 or chief in self._done_at) and (
          chief_done_at is None):
        chief_done_at = now
        if servers:
          self._say("chief finished: stopping the servers "
                    f"({', '.join(t.name for t in servers)}).")
          self._kill_all(signal.SIGKILL, only=servers)
      running = [t for t, c in codes.items()
                 if c is None and t not in servers]
      if chief_done_at is not None and not running:
        for task in servers:
          self._procs[task].wait()
        return "ok"
      pending = [t for t in running if t not in self._done_at]
      if (chief_done_at is not None and pending and
          now - chief_done_at > self.stop_grace_seconds):
        self._say(f"{', '.join(t.name for t in pending)} still running "
                  f"{self.stop_grace_seconds:g} s after the chief finished: "
                  "killing.")
        self._kill_all(signal.SIGKILL)
        return "failed"
      time.sleep(POLL_SECONDS)

  def _note_done_files(self, now: float) -> None:
    """Records in `_done_at` the time (`now`) a task's done file is first
    seen (`worker_exit.is_done`)."""
    for task in self.tasks:
      if task not in self._done_at and worker_exit.is_done(
          self._done_files.get(task)):
        self._done_at[task] = now

  def _all_exited_after_signal(self, codes: Dict[Task, Optional[int]]
                               ) -> bool:
    """After a forwarded signal: True when every task has exited (`codes`:
    their `poll()`s); else kills the rest once the grace period is over,
    waits `POLL_SECONDS` and returns False."""
    if all(c is not None for c in codes.values()):
      return True
    if time.time() > self._signal_deadline:
      self._say("grace period over: killing the remaining tasks.")
      self._kill_all(signal.SIGKILL)
      self._signal_deadline = float("inf")
    time.sleep(POLL_SECONDS)
    return False

  def _stop_for_failed(self, failed: Sequence[Task],
                       codes: Dict[Task, Optional[int]]) -> None:
    """Records the `failed` tasks in `_lost`, says so (with their last
    lines), notes it in the other tasks' logs and stops them."""
    self._lost = {task: _exit_status(codes[task]) for task in failed}
    # First, for the survivors: one reporting the lost peer names it and
    # its status in its own output (worker_exit.lost_peers_note).
    worker_exit.write_lost_peers(self._lost_file, self._lost_text())
    for task in failed:
      self._say(f"{task.name} exited with status "
                f"{self._lost[task]}.")
      self._show_tail(task)
    self._note_in_task_logs(
        f"{self._lost_text()}: the launcher stops the other tasks.",
        skip=failed)
    self._stop_survivors()

  def _check_done_tasks(self, codes: Dict[Task, Optional[int]], *,
                        now: float, noted: set, done_grace: float,
                        skip: Sequence[Task]) -> None:
    """Records in `_failed_after_work` (once: `noted`) a task that finished
    its work but then exited with a non-zero status, or had not exited
    `done_grace` seconds later (killed), but those in `skip` (the servers,
    once the chief finished)."""
    for task, at in self._done_at.items():
      if task in noted or task in skip:
        continue
      if codes[task] not in (None, 0):
        noted.add(task)
        self._failed_after_work[task] = (
            f"exited with status {_exit_status(codes[task])} after "
            "finishing its work")
        self._say(f"{task.name} {self._failed_after_work[task]}: the run "
                  "failed (not restarted: the work is done).")
        self._show_tail(task)
      elif codes[task] is None and now - at > done_grace:
        noted.add(task)
        self._failed_after_work[task] = (
            f"finished its work but had not exited {done_grace:g} s later")
        self._say(f"{task.name} {self._failed_after_work[task]}: stopping "
                  "it; the run failed (not restarted: the work is done).")
        self._kill_all(signal.SIGKILL, only=[task])

  def _lost_text(self) -> str:
    """The failed tasks of the last attempt: "worker:0 exited with status
    137"."""
    return ", ".join(f"{task.name} exited with status {status}"
                     for task, status in self._lost.items())

  def _note_in_task_logs(self, text: str, skip: Sequence[Task] = ()):
    """Appends `[launch] text` to each task's own log
    (`--task_log_dir`), but `skip`'s: a task stopped for another's failure
    has the reason in its own log."""
    if not self.task_log_dir:
      return
    for task in self.tasks:
      if task in skip:
        continue
      try:
        with open(os.path.join(self.task_log_dir, _log_name(task)),
                  "ab") as log:
          log.write(f"[launch] {text}\n".encode())
      except OSError:
        pass

  def _ends_on_its_own(self) -> List[Task]:
    """The tasks that end on their own when a peer fails: the chief and,
    without ps tasks, the workers (MultiWorkerMirrored peers, which report
    the lost peer and exit). Servers (ps tasks; with ps tasks, the
    workers) serve, and an evaluator watches, until the chief marks the
    run done: waiting for them only delayed every restart of a
    parameter-server group by the whole `FAILURE_STOP_SECONDS`."""
    has_ps = any(t.task_type == cluster_lib.PS for t in self.tasks)
    return [t for t in self.tasks if t.task_type == cluster_lib.CHIEF or
            (t.task_type == cluster_lib.WORKER and not has_ps)]

  def _stop_survivors(self):
    """Gives the survivors that end on their own (`_ends_on_its_own`) up to
    `FAILURE_STOP_SECONDS` to exit, then kills every task still running."""
    waited = [self._procs[t] for t in self._ends_on_its_own()
              if t in self._procs]
    deadline = time.time() + FAILURE_STOP_SECONDS
    while time.time() < deadline and any(p.poll() is None for p in waited):
      time.sleep(POLL_SECONDS)
    running = [t for t, p in self._procs.items() if p.poll() is None]
    if running:
      self._say(f"stopping {', '.join(t.name for t in running)}.")
      self._kill_all(signal.SIGKILL)
    for proc in self._procs.values():
      proc.wait()

  # --- the whole run ----------------------------------------------------------
  def run(self) -> int:
    """Runs (and restarts) the group; returns the exit status to use."""
    previous = {s: signal.signal(s, self._on_signal)
                for s in (signal.SIGINT, signal.SIGTERM)}
    scratch_root = tempfile.mkdtemp(prefix="tfdist-launch-")
    try:
      while True:
        self._procs = {}
        self._lost = {}
        pumps = self._start(scratch_root)
        outcome = self._wait_attempt()
        for proc in self._procs.values():
          proc.wait()
        for thread in pumps:
          thread.join(timeout=5)
        codes = {t.name: _exit_status(p.returncode)
                 for t, p in self._procs.items()}
        chief_status = codes[self.tasks[0].name]
        self._say("exit statuses: " + ", ".join(
            f"{name} {code}" for name, code in codes.items()))
        if outcome == "ok" and self._failed_after_work:
          status = chief_status or 1
          self._say(
              "failed: " + "; ".join(f"{t.name} {why}" for t, why in
                                     self._failed_after_work.items()) +
              f": exit status {status} (tasks: {codes}).")
          return status
        if outcome == "ok":
          self._say(f"done: every task finished (chief status "
                    f"{chief_status}).")
          return chief_status
        if outcome == "signaled" or self.attempts >= self.max_restarts:
          status = chief_status or 1
          why = ("stopped by signal" if outcome == "signaled" else
                 f"failed after {self.attempts} "
                 f"restart{'' if self.attempts == 1 else 's'}")
          if outcome == "failed" and self._lost:
            why += f" ({self._lost_text()} first)"
          self._say(f"{why}: exit status {status} (tasks: {codes}).")
          return status
        self.attempts += 1
        self._say(f"restarting the group ({self.attempts} of "
                  f"{self.max_restarts}) after "
                  f"{self._lost_text() or 'a failure'}; it resumes from the "
                  "last checkpoint.")
    finally:
      self._kill_all(signal.SIGKILL)
      for s, handler in previous.items():
        signal.signal(s, handler)
      shutil.rmtree(scratch_root, ignore_errors=True)


# --- binary --------------------------------------------------------------
FLAGS = flags.FLAGS


def define_launch_flags():
  flags.DEFINE_integer(
      "num_workers", 2,
      "Training processes. Without ps: chief 0 plus workers 0..N-2. With "
      "--num_ps: a chief (coordinator) plus workers 0..N-1.")
  flags.DEFINE_integer("num_ps", 0, "Parameter-server tasks (ps 0..M-1).")
  flags.DEFINE_bool("evaluator", False, "Add an evaluator task (evaluator 0).")
  flags.DEFINE_integer(
      "max_restarts", 0,
      "When a task fails, stop the others and restart the whole group, at "
      "most this many times (it resumes from the last checkpoint).")
  flags.DEFINE_float(
      "stop_grace_seconds", 40.0,
      "After forwarding Ctrl-C/SIGTERM, or after the chief finished, kill "
      "tasks still running after this many seconds. Keep it above the "
      "training flag --preemption_grace_seconds (default 30).")
  flags.DEFINE_bool(
      "pin_workers", False,
      "Pin each training process (the chief and the workers; with "
      "--num_ps, the workers, while the coordinator and the ps tasks share "
      "the cores left over) to a CPU core of its own, as `taskset -c` does; "
      "for measurements (python -m tfdist.diagnose, benchmarks/).")
  flags.DEFINE_string("module", "tfdist.train",
                      "Python module every task runs with `python -m`.")
  flags.DEFINE_enum(
      "output", task_output.OUTPUT_CHIEF, task_output.OUTPUT_MODES,
      "What of the tasks' output to show. chief: the chief's lines as they "
      "are, the evaluator's, the other tasks' warnings and errors (each "
      "prefixed with its task: [worker:0] ...), and the last lines of a "
      "task that fails. all: every line of every task, prefixed with the "
      "task.")
  flags.DEFINE_bool(
      "verbose", False,
      "With --output=chief, also show TensorFlow's own C++ log lines and "
      "import notices (the cluster's start-up chatter), hidden otherwise.")
  flags.DEFINE_string(
      "task_log_dir", "",
      "Write each task's whole output to DIR/<type>-<index>.log (for "
      "example chief-0.log, worker-0.log), every attempt appended; created "
      "if missing.")


def _check_task_log_dir(path: str):
  """Creates `--task_log_dir` if missing; exits with `errors.CONFIG` and one
  line naming the flag, the folder and the fix when it cannot be written
  (before any task starts)."""
  try:
    os.makedirs(path, exist_ok=True)
    why = None if os.access(path, os.W_OK) else "not writable"
  except OSError as e:
    why = e.strerror or str(e)
  if why:
    print(f"tfdist.launch: error: --task_log_dir={path!r}: {why}; give a "
          "folder this user can write (or leave the flag out).",
          file=sys.stderr)
    sys.exit(errors.CONFIG)


def main(argv):
  train_args = argv[1:]
  try:
    tasks = plan_tasks(num_workers=FLAGS.num_workers, num_ps=FLAGS.num_ps,
                       evaluator=FLAGS.evaluator)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if FLAGS.max_restarts < 0:
    raise app.UsageError(f"--max_restarts={FLAGS.max_restarts} must be >= 0.")
  if FLAGS.task_log_dir:
    _check_task_log_dir(FLAGS.task_log_dir)
  launcher = Launcher(
      tasks=tasks, command=[sys.executable, "-m", FLAGS.module, *train_args],
      max_restarts=FLAGS.max_restarts,
      stop_grace_seconds=FLAGS.stop_grace_seconds,
      pin_workers=FLAGS.pin_workers, output=FLAGS.output,
      verbose=FLAGS.verbose, task_log_dir=FLAGS.task_log_dir or None)
  sys.exit(launcher.run())


def run():
  """The entry point of `python -m tfdist.launch` and of its console
  script."""
  define_launch_flags()
  cli.adopt_usage(__doc__, flags.FLAGS.get_key_flags_for_module(__name__))
  app.run(main, flags_parser=cli.flags_parser("tfdist.launch"))


if __name__ == "__main__":
  run()
