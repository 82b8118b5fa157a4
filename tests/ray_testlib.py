"""Fault injection for multi-worker tests: a worker that kills itself once;
a Ray Train callback that records what the workers report; and the text
of a failed Ray Train job (`job_failure_text`).

`KillOnceCallback` is a Keras callback for tfdist's controller, passed to
the workers (e.g. through `tfdist.ray.run_on_ray(callbacks=...)`; it must
be importable there, hence this module). On the chosen task it SIGKILLs its
own process once, at the first step boundary at or after `after_step` where
a checkpoint exists in `checkpoint_dir`, so a restarted job has something
to resume from. A marker file makes it fire once across restarts: the
first process to create the marker (O_EXCL) is the one that dies, and it
writes its step and pid there first.
"""

import glob
import json
import os
import signal

import keras


class KillOnceCallback(keras.callbacks.Callback):
  """SIGKILLs `task` once, after `after_step` and a checkpoint.

  Args:
    checkpoint_dir: the chief's checkpoint folder (`<model_dir>/checkpoints`).
    marker: a file path that does not exist yet; written before the kill as
      JSON `{"step": int, "pid": int, "task": "worker:1"}`.
    after_step: the earliest optimizer step (updates) to kill at.
    task: `(task_type, task_index)` as `TF_CONFIG` names this process.
  """

  def __init__(self, *, checkpoint_dir: str, marker: str, after_step: int,
               task=("worker", 1)):
    super().__init__()
    self.checkpoint_dir = checkpoint_dir
    self.marker = marker
    self.after_step = int(after_step)
    self.task = tuple(task)
    self._armed = False

  def on_train_begin(self, logs=None):
    from tfdist.distribute import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
    info = cluster_lib.resolve_cluster()
    self._armed = ((info.task_type, info.task_index) == self.task and
                   not os.path.exists(self.marker))

  def on_train_batch_end(self, batch, logs=None):
    if not self._armed:
      return
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
    if step < self.after_step or not tf.train.latest_checkpoint(
        self.checkpoint_dir):
      return
    self._armed = False
    try:
      fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
      return
    with os.fdopen(fd, "w") as f:
      json.dump({"step": step, "pid": os.getpid(),
                 "task": f"{self.task[0]}:{self.task[1]}"}, f)
    os.kill(os.getpid(), signal.SIGKILL)


def report_recorder(path: str):
  """A `ray.train.UserCallback` appending one JSON line per
  `ray.train.report` round to `path`: `{"metrics": [each worker's dict],
  "checkpoint": bool}` (it runs in Ray's controller process, hence the
  file). Ray is imported here, on use."""
  import ray.train  # pylint: disable=g-import-not-at-top

  class ReportRecorder(ray.train.UserCallback):

    def after_report(self, run_context, metrics, checkpoint):
      del run_context
      with open(path, "a") as f:
        f.write(json.dumps({"metrics": metrics,
                            "checkpoint": checkpoint is not None},
                           default=str) + "\n")

  return ReportRecorder()


# How much of each Ray Train worker's logs `job_failure_text` shows.
LOG_TAIL_LINES = 30
LOG_LINE_CHARS = 600


def _tail(path: str, lines: int):
  try:
    with open(path, errors="replace") as f:
      return [line.rstrip("\n") for line in f.readlines()[-lines:]]
  except OSError:
    return []


def _log_record(line: str) -> str:
  """One line of a Ray Train log (JSON) as `LEVEL message`."""
  try:
    record = json.loads(line)
  except ValueError:
    return line[:LOG_LINE_CHARS]
  return f"{record.get('levelname', '')} {record.get('message', '')}"[
      :LOG_LINE_CHARS]


def worker_log_tails(ray_temp_dir: str, since: float) -> str:
  """The tails of the logs of each Ray Train worker that wrote after
  `since` (a `time.time()`): its Ray Train log (Python's records, with its
  world rank) and its process's stderr (TensorFlow's C++ lines), as
  text."""
  logs = os.path.join(ray_temp_dir, "session_latest", "logs")
  out = []
  for path in sorted(glob.glob(os.path.join(
      logs, "train", "ray-train-app-worker-*.log")), key=os.path.getmtime):
    if os.path.getmtime(path) < since:
      continue
    records = _tail(path, LOG_TAIL_LINES)
    rank = "?"
    for line in records:
      try:
        rank = json.loads(line).get("world_rank", rank)
      except ValueError:
        pass
    worker_id = os.path.basename(path)[len("ray-train-app-worker-"):-4]
    out.append(f"--- Ray Train worker {worker_id[:8]} (world rank {rank}): "
               f"last {len(records)} lines of {path}")
    out.extend(_log_record(line) for line in records)
    for err in glob.glob(os.path.join(logs, f"worker-{worker_id}-*.err")):
      lines = [l[:LOG_LINE_CHARS] for l in _tail(err, LOG_TAIL_LINES)
               if l.strip()]
      if lines:
        out.append(f"--- its stderr: last {len(lines)} lines of {err}")
        out.extend(lines)
  return "\n".join(out)


def job_failure_text(error: BaseException, *, ray_temp_dir: str,
                     since: float) -> str:
  """What a failed Ray Train job left to read: `error` in full, each
  worker's and the controller's error in full (`str(WorkerGroupError)`
  cuts each worker's text to 1,000 characters), and the tails of the logs
  of the Ray Train workers that ran after `since` (a `time.time()`) in
  the local cluster whose temporary folder is `ray_temp_dir`."""
  parts = [f"{type(error).__name__}: {error}"]
  for rank, failure in sorted(
      (getattr(error, "worker_failures", None) or {}).items()):
    parts.append(f"--- worker rank {rank}: {type(failure).__name__}: "
                 f"{failure}")
  controller = getattr(error, "controller_failure", None)
  if controller is not None:
    parts.append(f"--- controller: {type(controller).__name__}: "
                 f"{controller}")
  parts.append(worker_log_tails(ray_temp_dir, since))
  return "\n".join(parts)
