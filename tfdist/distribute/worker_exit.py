"""How the workers of a synchronous run finish: together, and chief last.

Under MultiWorkerMirroredStrategy the chief's process hosts TensorFlow's
coordination service. A worker still alive after the chief has exited fails
its next heartbeat or error poll with `UNAVAILABLE` ("Failed to send RPC to
coordination service": a gRPC `E0000` line, or an `UnavailableError`
traceback when Python was the caller), so the chief must leave last, and
only once every worker's process is really gone. Freeing the training
objects (datasets, iterators, functions) takes seconds after a run (4 s
measured for the ranking model on this machine, under load), so a process
that announces it leaves only after that teardown keeps the chief waiting
past any short bound. `tfdist.train` therefore ends a multi-worker run with
`leave_process`, inside the run, while the objects are still alive:

1. `leave_together`: a final barrier (a one-number all-reduce) after the
   last collective, so no worker leaves while another still needs it;
2. each worker writes its done marker (`mark_done`, the path the launcher
   passes in `$TFDIST_DONE_FILE`), says it leaves through the coordination
   service's key-value store, and ends its process at once (`os._exit`, no
   teardown);
3. the chief waits (bounded) for every worker's word and then until the
   worker's server no longer accepts TCP connections at its cluster
   address (the process is gone), then releases what it holds (`before_exit`:
   the `--model_dir` lease), writes its done marker and ends its process.

A task that wrote its done marker has finished its work; the launcher still
reports it as failed if it then exits with an error or does not exit.
"""

import contextlib
import dataclasses
import os
import socket
import sys
import time
from typing import Callable, Mapping, Optional, Sequence

from absl import logging

from tfdist import errors

# The environment variable through which `tfdist.launch` tells each task
# where to write its done marker (read only by binaries).
DONE_FILE_ENV = "TFDIST_DONE_FILE"


def leave_together(strategy, *, num_workers: int,
                   failed: bool = False) -> float:
  """Waits until every worker has reached this point (a final barrier).

  Call it on every worker after the run's last collective operation (final
  evaluation, checkpoint, export), at the same point in the program. With
  one worker it returns at once. The barrier is a float32 all-reduce
  (bounded by `--collective_timeout_seconds` when that is set; a lost peer
  fails it through the coordination service's heartbeats) of two numbers:
  the replicas that arrived and those of tasks that arrived `failed`, so
  that every task stops with the status of a task whose writes failed
  (`failures_shared`), not with a lost peer's.

  Args:
    strategy: the run's `tf.distribute.Strategy`.
    num_workers: workers training in sync.
    failed: this task arrives after a status-2 error (it raises it next).

  Returns:
    Seconds spent waiting for the other workers.

  Raises:
    tf.errors.DeadlineExceededError, tf.errors.UnavailableError: a peer
      never arrived (timed out or gone).
    tfdist.errors.PeerStoppedError: another task arrived `failed` (and
      this one did not).
  """
  if num_workers <= 1:
    return 0.0
  # Imported here: the launcher imports this module and not TensorFlow.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  started = time.time()
  mark = [1.0, 1.0 if failed else 0.0]
  total = tf.function(lambda: strategy.reduce(
      tf.distribute.ReduceOp.SUM,
      strategy.run(lambda: tf.constant(mark)), axis=None))()
  arrived, failing = (int(round(float(v))) for v in total.numpy())
  waited = time.time() - started
  if failing and not failed:
    raise errors.PeerStoppedError(
        f"{failing} replica(s) of another task of this run stopped at the "
        "end of training with a status-2 error (its writes failed: a full "
        "disk or quota, a refused write, e.g. of the chief's export; that "
        "task's log names the flag and the fix), so this task stops with "
        "the same status. Fix that and rerun the same command: it resumes "
        "from the last checkpoint.")
  logging.info("All %d replicas reached the end (waited %.2f s); leaving "
               "together.", arrived, waited)
  return waited


@contextlib.contextmanager
def failures_shared(leave: Callable[..., object]):
  """Runs the block; on a status-2 error (`tfdist.errors.ConfigError`)
  inside it calls `leave(failed=True)` (the run's `leave_together`), so
  the other tasks, waiting at the final barrier, stop with status 2 too,
  then re-raises the error. An error of the barrier itself is logged, not
  raised: the block's error is what this task reports."""
  try:
    yield
  except errors.ConfigError:
    try:
      leave(failed=True)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("tfdist: could not tell the other tasks that this one "
                      "stops (%s: %s).", type(e).__name__, e)
    raise


_LEAVING_KEY = "tfdist_leaving/{task_type}/{task_index}"
_PROBE_SECONDS = 0.05


@dataclasses.dataclass(frozen=True)
class ExitPlan:
  """How a binary's process ends after a multi-worker run (`leave_process`).

  Attributes:
    done_file: where this task writes its done marker (the launcher's
      `$TFDIST_DONE_FILE`); None or '' for none.
    timeout_seconds: the longest the chief waits for each phase (a worker's
      word, then its process's end) before it leaves anyway, in seconds.
  """
  done_file: Optional[str] = None
  timeout_seconds: float = 10.0


def _accepts_connections(address: str, timeout: float = 0.5) -> bool:
  """Whether `host:port` accepts a TCP connection now."""
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)),
                                  timeout=timeout):
      return True
  except (OSError, ValueError):
    return False


def wait_until_gone(address: str, timeout_seconds: float) -> bool:
  """Waits until nothing listens at `address` (`host:port`) any more.

  Returns:
    True once a connection is refused (or fails), False if the address still
    accepted connections after `timeout_seconds`.
  """
  deadline = time.time() + timeout_seconds
  while _accepts_connections(address):
    if time.time() > deadline:
      return False
    time.sleep(_PROBE_SECONDS)
  return True


def _end_process():
  """Ends this process with status 0, without Python's or TensorFlow's
  teardown (a peer may already be gone; see the module docstring)."""
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)  # pylint: disable=protected-access


def leave_process(plan: ExitPlan, *, task_type: str, task_index: int,
                  jobs: Mapping[str, Sequence[str]], is_chief: bool,
                  before_exit: Optional[Callable[[], None]] = None):
  """Ends this task's process after `leave_together`: workers first, the
  chief once every worker's process is gone (see the module docstring).

  Never returns. Call it on every chief and worker task, right after
  `leave_together`.

  Args:
    plan: the done marker and the chief's bound.
    task_type: `chief` or `worker`.
    task_index: this task's index.
    jobs: job name -> `host:port` addresses (the cluster's `chief` and
      `worker` jobs).
    is_chief: whether this task hosts the coordination service.
    before_exit: called on the chief after every worker has gone, just
      before its process ends (release what the run holds).
  """
  # Imported here: the launcher imports this module and not TensorFlow.
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top,g-direct-tensorflow-import
  if not is_chief:
    mark_done(plan.done_file)
    context.context().set_config_key_value(
        _LEAVING_KEY.format(task_type=task_type, task_index=task_index), "1")
    _end_process()
  peers = [(job, i, address) for job in ("chief", "worker")
           for i, address in enumerate(jobs.get(job, ()))
           if (job, i) != (task_type, task_index)]
  started = time.time()
  late = []
  for job, i, address in peers:
    try:
      context.context().get_config_key_value(
          _LEAVING_KEY.format(task_type=job, task_index=i),
          timeout_in_ms=int(plan.timeout_seconds * 1000))
    except Exception as e:  # pylint: disable=broad-except
      late.append(f"{job} {i} did not say it left within "
                  f"{plan.timeout_seconds:g} s ({type(e).__name__})")
      continue
    if not wait_until_gone(address, plan.timeout_seconds):
      late.append(f"{job} {i} said it left, but its server at {address} "
                  f"still answered {plan.timeout_seconds:g} s later")
  waited = time.time() - started
  if late:
    logging.warning("tfdist: %s; the chief leaves anyway.", "; ".join(late))
  else:
    logging.info("The other %d worker(s) have left (waited %.2f s); the "
                 "chief leaves last.", len(peers), waited)
  if before_exit is not None:
    before_exit()
  mark_done(plan.done_file)
  _end_process()


def mark_done(path: Optional[str]):
  """Writes the done marker at `path` (no-op for None or ''), atomically."""
  if not path:
    return
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(f"{os.getpid()} {time.time():.3f}\n")
  os.replace(tmp, path)


def is_done(path: Optional[str]) -> bool:
  """Whether a task wrote its done marker at `path`."""
  return bool(path) and os.path.exists(path)


# The environment variable through which `tfdist.launch` tells each task
# the file where it writes which tasks failed, when one does ("worker:0
# exited with status 137"), before it stops the others: a task that then
# reports a lost peer names that task and its status in its own log
# (`lost_peers_note`).
LOST_FILE_ENV = "TFDIST_LOST_TASKS_FILE"


def write_lost_peers(path: Optional[str], text: str) -> None:
  """The launcher's side: writes `text` (the failed tasks and their exit
  statuses) to `path` at once (a rename: a reader sees all of it or
  nothing); no-op without a path, silent if the folder is gone."""
  if not path:
    return
  try:
    with open(path + ".tmp", "w") as f:
      f.write(text)
    os.replace(path + ".tmp", path)
  except OSError:
    pass


def lost_peers_note(wait_seconds: float = 3.0,
                    path: Optional[str] = None) -> Optional[str]:
  """What the launcher said of the tasks that failed ("worker:0 exited with
  status 137"), for a task reporting a lost peer.

  Args:
    wait_seconds: how long to wait for the launcher's word (it notices a
      dead process within a tenth of a second, a peer within the
      collective's failure or the coordination service's heartbeat; the
      margin is for a loaded machine). A lost peer that did not exit (a
      hung one) costs this wait once.
    path: the file (default: `$TFDIST_LOST_TASKS_FILE`).

  Returns:
    The text, or None: not under `tfdist.launch`, or no word in time.
  """
  path = path or os.environ.get(LOST_FILE_ENV)
  if not path:
    return None
  deadline = time.time() + wait_seconds
  while True:
    try:
      with open(path) as f:
        return f.read().strip() or None
    except OSError:
      if time.time() >= deadline:
        return None
      time.sleep(0.05)
