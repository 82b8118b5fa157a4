"""Fault injection for multi-worker tests: a worker that kills itself once;
and a Ray Train callback that records what the workers report.

`KillOnceCallback` is a Keras callback for tfdist's controller, passed to
the workers (e.g. through `tfdist.ray.run_on_ray(callbacks=...)`; it must
be importable there, hence this module). On the chosen task it SIGKILLs its
own process once, at the first step boundary at or after `after_step` where
a checkpoint exists in `checkpoint_dir`, so a restarted job has something
to resume from. A marker file makes it fire once across restarts: the
first process to create the marker (O_EXCL) is the one that dies, and it
writes its step and pid there first.
"""

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
