"""How the workers of a synchronous run finish: together, and said so.

Under MultiWorkerMirroredStrategy the chief's process hosts TensorFlow's
coordination service. Workers do not finish at the same moment (one still
exports or evaluates while another is done), and a worker that still talks
to the service or waits in a collective after the chief has exited fails
with `UNAVAILABLE` ("Failed to send RPC to coordination service") and may
hang until it is killed. tfdist therefore

1. ends every run with `leave_together`: a final barrier (a one-number
   all-reduce) after the last collective, so no worker leaves while another
   still needs it; then
2. the binary (`tfdist.train`) writes a done marker (`mark_done`), a file
   whose path the launcher passes in `$TFDIST_DONE_FILE`. A task that wrote
   it has finished its work: the launcher counts it as finished even if its
   process then hangs or fails while TensorFlow shuts down (it is stopped
   after a short grace period), and never restarts the group for it; then
3. the chief leaves last (`leave_in_order`): each other worker, as the
   last thing before its process ends, says so through the coordination
   service's key-value store, and the chief waits (bounded) for every one
   of them before it ends, so no worker's heartbeat meets a service that is
   gone (seen as a stray `UNAVAILABLE ... coordination service` line in an
   otherwise clean run when the chief left first).
"""

import os
import time
from typing import Optional

from absl import logging

# The environment variable through which `tfdist.launch` tells each task
# where to write its done marker (read only by binaries).
DONE_FILE_ENV = "TFDIST_DONE_FILE"


def leave_together(strategy, *, num_workers: int) -> float:
  """Waits until every worker has reached this point (a final barrier).

  Call it on every worker after the run's last collective operation (final
  evaluation, checkpoint, export), at the same point in the program. With
  one worker it returns at once. The barrier is a float32 scalar all-reduce,
  bounded like every collective by `--collective_timeout_seconds`.

  Args:
    strategy: the run's `tf.distribute.Strategy`.
    num_workers: workers training in sync.

  Returns:
    Seconds spent waiting for the other workers.

  Raises:
    tf.errors.DeadlineExceededError, tf.errors.UnavailableError: a peer
      never arrived (timed out or gone).
  """
  if num_workers <= 1:
    return 0.0
  # Imported here: the launcher imports this module and not TensorFlow.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  started = time.time()
  total = tf.function(lambda: strategy.reduce(
      tf.distribute.ReduceOp.SUM,
      strategy.run(lambda: tf.constant(1.0)), axis=None))()
  arrived = int(round(float(total)))
  waited = time.time() - started
  logging.info("All %d replicas reached the end (waited %.2f s); leaving "
               "together.", arrived, waited)
  return waited


_LEAVING_KEY = "tfdist_leaving/{task_type}/{task_index}"
# A worker announces just before `os._exit`; this covers the rest.
_LINGER_SECONDS = 0.5


def leave_in_order(cluster: dict, *, timeout_seconds: float = 10.0
                   ) -> Optional[float]:
  """The chief leaves last: call it on every training task of a
  MultiWorkerMirroredStrategy run, after `leave_together`, as the last step
  before the process ends.

  Args:
    cluster: the run manifest's `cluster` section (`task_type`,
      `task_index`, `is_chief`, `jobs`: job name -> addresses).
    timeout_seconds: the longest the chief waits for the other workers.

  Returns:
    On the chief, the seconds it waited; on another worker, None (it
    announced that it leaves).
  """
  # Imported here: the launcher imports this module and not TensorFlow.
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top,g-direct-tensorflow-import
  if not cluster.get("is_chief"):
    context.context().set_config_key_value(
        _LEAVING_KEY.format(task_type=cluster["task_type"],
                            task_index=cluster["task_index"]), "1")
    return None
  me = (cluster["task_type"], cluster["task_index"])
  peers = [(job, i) for job in ("chief", "worker")
           for i in range(len(cluster.get("jobs", {}).get(job, ())))
           if (job, i) != me]
  started = time.time()
  for job, i in peers:
    left = max(timeout_seconds - (time.time() - started), 0.001)
    try:
      context.context().get_config_key_value(
          _LEAVING_KEY.format(task_type=job, task_index=i),
          timeout_in_ms=int(left * 1000))
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("tfdist: %s %d did not say it left within %.0f s "
                      "(%s); the chief leaves anyway.", job, i,
                      timeout_seconds, type(e).__name__)
      return time.time() - started
  time.sleep(_LINGER_SECONDS)
  waited = time.time() - started
  logging.info("The other %d worker(s) left first (waited %.2f s); the "
               "chief leaves last.", len(peers), waited)
  return waited


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
