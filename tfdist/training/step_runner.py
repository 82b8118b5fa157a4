"""Step runners: "run N training steps", the one thing strategies differ in.

The `tfdist.training.controller.Controller` owns everything between steps
(boundaries, logging, checkpoints, evaluation, callbacks, preemption); a
step runner only runs steps and returns their sums:

* `LocalStepRunner` calls the `Trainer`'s compiled `train_function` (one
  device, Mirrored, MultiWorkerMirrored, TPU): one call runs up to
  `steps_per_execution` steps, so the controller hands it at most that many.
* `CoordinatorStepRunner` schedules the same function on a
  `tf.distribute.coordinator.ClusterCoordinator` (ParameterServer): chunks
  of up to `steps_per_execution` steps, run by the workers as they come,
  joined before returning, so after `run(n)` exactly `n` steps ran (a chunk
  lost with a worker is run again on another and counted once). A lost ps
  task becomes one `ParameterServerError`.

Both implement `StepRunner` and return a `StepOutput`: the chunk's sums
as float64 NumPy values (`loss`: sum of the per-step mean losses, `count`:
examples, `micro_steps`, each metric's summed state,
`tfdist.training.objectives.MetricSums`; `Trainer.summarize` makes values of
them) and, apart from them, its `StepSignals` (stop requests, skipped steps).
"""

import abc
import dataclasses
import re
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tfdist.distribute import parameter_server
from tfdist.errors import PeerLostError, first_line

# Errors that mean a ps task (or the whole cluster) is gone.
PS_LOST_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError,
                  tf.errors.CancelledError, tf.errors.NotFoundError,
                  tf.errors.InternalError, tf.errors.UnknownError)


# Errors that mean a MultiWorkerMirrored peer is gone or unreachable (its
# process died, its host was preempted, a collective timed out waiting).
PEER_LOST_ERRORS = (tf.errors.UnavailableError,
                    tf.errors.DeadlineExceededError, tf.errors.AbortedError,
                    tf.errors.CancelledError, tf.errors.InternalError,
                    tf.errors.UnknownError)


_TASK_NAME = re.compile(r"/job:(\w+)/(?:replica:\d+/)?task:(\d+)")


def lost_tasks(error: Exception, *, own: Optional[Tuple[str, int]] = None,
               service_host: Optional[Tuple[str, int]] = None
               ) -> List[Tuple[str, int]]:
  """The tasks a TensorFlow error names, other than `own`, in order.

  TensorFlow names them as `/job:worker/replica:0/task:0`: the coordination
  service lists tasks that "stopped sending heartbeats" (a stopped or lost
  process), and a failed RPC names its "remote target" (a process that is
  gone).

  Args:
    error: the error raised.
    own: this task's `(job, index)`, left out.
    service_host: the task hosting the coordination service (the chief):
      named when the error is a failed call to that service (it stopped
      answering: `DEADLINE_EXCEEDED ... CoordinationService/Heartbeat`)
      and names no task itself.

  Returns:
    `[(job, index), ...]`, without duplicates.
  """
  text = str(error)
  # The coordination service's list, when there is one, is the lost tasks
  # (the task before it only reported them).
  unhealthy = text.find("stopped sending heartbeats")
  if unhealthy >= 0:
    text = text[unhealthy:]
  found = []
  for job, index in _TASK_NAME.findall(text):
    task = (job, int(index))
    if task != own and task not in found:
      found.append(task)
  if (not found and service_host is not None and service_host != own and
      "CoordinationService" in text):
    found.append(service_host)
  return found


def peer_lost_error(error: Exception, *, after: str,
                    last_checkpoint: Optional[str],
                    own: Optional[Tuple[str, int]] = None,
                    addresses: Optional[Mapping[str, Sequence[str]]] = None
                    ) -> PeerLostError:
  """The one error for a lost MultiWorkerMirrored peer, whatever noticed it.

  Args:
    error: the TensorFlow error raised (an all-reduce that failed or timed
      out, or the coordination service's report of a task that stopped
      sending heartbeats).
    after: where training was, e.g. "step 40".
    last_checkpoint: the checkpoint a restart resumes from (None: step 0).
    own: this task's `(job, index)`.
    addresses: the cluster's job -> `host:port` list, to name the lost
      task's address.
  """
  first = first_line(error)
  names = []
  service_host = None
  if addresses:
    service_host = ("chief", 0) if addresses.get("chief") else ("worker", 0)
  for job, index in lost_tasks(error, own=own, service_host=service_host):
    listed = (addresses or {}).get(job, ())
    names.append(f"{job} {index}" + (f" at {listed[index]}"
                                     if index < len(listed) else ""))
  who = (f"lost {', '.join(names)}" if names else "lost a peer worker")
  return PeerLostError(
      f"MultiWorkerMirrored training {who} after {after}: "
      f"{type(error).__name__}: {first}. Every worker must take part in "
      "every step: restart the whole cluster (python -m tfdist.launch "
      "--max_restarts=N does; Vertex AI and Kubernetes restart on this exit "
      "status) and training resumes from the last checkpoint, "
      f"{last_checkpoint or 'none yet (from step 0)'}.")


def ps_lost_error(error: Exception, *, after: str,
                  last_checkpoint: Optional[str]):
  """The one error for a lost ps task (or cluster), whatever noticed it.

  Args:
    error: the TensorFlow error raised.
    after: where training was, e.g. "step 40".
    last_checkpoint: the checkpoint a restart resumes from (None: step 0).

  Returns:
    A `tfdist.distribute.parameter_server.ParameterServerError` to raise from
    `error`.
  """
  first = first_line(error)
  return parameter_server.ParameterServerError(
      f"Parameter-server training lost a ps task (or the whole cluster) "
      f"after {after}: {type(error).__name__}: {first}. Worker failures are "
      "tolerated, ps failures are not: restart the cluster (python -m "
      "tfdist.launch ... --max_restarts=N does) and training resumes from "
      f"the last checkpoint, {last_checkpoint or 'none yet (from step 0)'}.")


@dataclasses.dataclass(frozen=True)
class StepSignals:
  """What a chunk of steps tells the controller besides its metrics.

  Under MultiWorkerMirroredStrategy each value is the same on every worker
  (reduced inside the compiled step with the metrics).

  Attributes:
    stop_signal: some worker received a stop signal (SIGTERM, SIGINT).
    stop_training: some worker's callback set `model.stop_training`.
    skipped_steps: steps of the chunk whose update was skipped (fp16
      gradients not finite).
    skipped_steps_at_end: how many of the chunk's last steps in a row were
      skipped (== `skipped_steps` when every step was).
  """
  stop_signal: bool = False
  stop_training: bool = False
  skipped_steps: float = 0.0
  skipped_steps_at_end: float = 0.0

  @classmethod
  def split(cls, sums: Mapping[str, np.ndarray]
            ) -> Tuple["StepSignals", Dict[str, np.ndarray]]:
    """Separates the compiled step's outputs (`Trainer.train_function`: one
    dict, signals under their field names) into signals and metric sums.

    Returns:
      `(StepSignals, sums without the signal keys)`; a missing signal is
      False or 0.
    """
    names = [field.name for field in dataclasses.fields(cls)]
    metrics = {k: v for k, v in sums.items() if k not in names}
    values = {name: float(sums.get(name, 0.0)) for name in names}
    return cls(stop_signal=values["stop_signal"] > 0,
               stop_training=values["stop_training"] > 0,
               skipped_steps=values["skipped_steps"],
               skipped_steps_at_end=values["skipped_steps_at_end"]), metrics


@dataclasses.dataclass(frozen=True)
class StepOutput:
  """What `StepRunner.run` returns for one chunk of steps.

  Attributes:
    sums: metric name -> float64 NumPy scalar or array summed over the
      chunk's steps (`loss`, `count`, `micro_steps`, metric states).
    signals: the chunk's `StepSignals`.
  """
  sums: Dict[str, np.ndarray]
  signals: StepSignals = StepSignals()

  @classmethod
  def from_sums(cls, sums: Mapping[str, np.ndarray]) -> "StepOutput":
    """A `StepOutput` from the compiled step's one dict of outputs."""
    signals, metrics = StepSignals.split(sums)
    return cls(sums=metrics, signals=signals)


class StepRunner(abc.ABC):
  """Runs chunks of training steps: the one thing strategies differ in.

  Attributes:
    max_steps_per_call: the most steps one `run` may be asked for (None:
      any number).
  """

  max_steps_per_call: Optional[int] = None

  @abc.abstractmethod
  def run(self, num_steps: int, *, start_step: int, stop_signal: bool = False,
          stop_training: bool = False) -> StepOutput:
    """Runs `num_steps` steps after step `start_step`.

    Args:
      num_steps: steps to run (>= 1, <= `max_steps_per_call` when set).
      start_step: the last step trained before.
      stop_signal: this process received a stop signal.
      stop_training: a callback of this process set `model.stop_training`.

    Returns:
      The chunk's `StepOutput`; its signals are the stop requests of every
      worker together.
    """

  def agree(self, flag: bool) -> bool:
    """True when any worker passes True; every worker calls it at the same
    point. This base: the caller alone decides (`flag` itself)."""
    return bool(flag)


def _as_numpy(sums) -> Dict[str, np.ndarray]:
  return {k: np.asarray(v, np.float64) for k, v in sums.items()}


def _stop_flags(stop_signal: bool, stop_training: bool) -> tf.Tensor:
  return tf.constant([float(stop_signal), float(stop_training)], tf.float32)


class LocalStepRunner(StepRunner):
  """Runs steps by calling the compiled training function in this process.

  Args:
    trainer: the `tfdist.training.train_loop.Trainer`.
    iterator: an iterator over the distributed training dataset.
    num_workers: hosts training in sync (MultiWorkerMirroredStrategy); with
      more than one, `agree` is a one-number all-reduce.
    iterator_fn: instead of `iterator`: called once, at the first `run`,
      with that run's `start_step` (the step restored from a checkpoint),
      to make the iterator (so the input can resume where the checkpoint
      left it).
  """

  def __init__(self, *, trainer, iterator=None, num_workers: int = 1,
               iterator_fn: Optional[Callable] = None):
    if (iterator is None) == (iterator_fn is None):
      raise ValueError("LocalStepRunner takes one of iterator and "
                       "iterator_fn.")
    self.trainer = trainer
    self.iterator = iterator
    self.iterator_fn = iterator_fn
    self.num_workers = int(num_workers)
    # One call runs at most this many steps; the controller asks no more.
    self.max_steps_per_call = trainer.steps_per_execution
    self._agree_fn = None
    # The call's tensor arguments, made once per value (a chunk's length
    # and stop requests take few values) instead of once per call.
    self._arguments: Dict[Tuple[int, bool, bool], Tuple[tf.Tensor,
                                                        tf.Tensor]] = {}
    if self.num_workers > 1:
      strategy = trainer.strategy

      def agree(flag):
        per_replica = strategy.run(tf.identity, args=(flag,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica,
                               axis=None)
      self._agree_fn = tf.function(agree)

  def agree(self, flag: bool) -> bool:
    """True when any worker passes True; every worker must call it at the
    same point (one all-reduce of a float32 scalar with several workers).
    The controller calls it at epoch ends, after the callbacks, so that a
    callback's `model.stop_training` stops every worker at the same step."""
    if self._agree_fn is None:
      return bool(flag)
    return float(self._agree_fn(tf.constant(1.0 if flag else 0.0))) > 0

  def run(self, num_steps: int, *, start_step: int, stop_signal: bool = False,
          stop_training: bool = False) -> StepOutput:
    """Runs `num_steps` (<= `max_steps_per_call`) steps; returns their
    `StepOutput`.

    `start_step` is the step reached before (the trainer's own step
    counter, which the compiled function advances, already equals it).

    Under MultiWorkerMirroredStrategy every worker must call this with the
    same `num_steps` (the steps are collective); the stop requests of all
    workers are summed, so every worker sees the same `stop_*` values.
    """
    # The compiled function counts steps itself.
    if self.iterator is None:
      self.iterator = self.iterator_fn(start_step)
    key = (int(num_steps), bool(stop_signal), bool(stop_training))
    arguments = self._arguments.get(key)
    if arguments is None:
      arguments = self._arguments[key] = (
          tf.constant(num_steps, tf.int32),
          _stop_flags(stop_signal, stop_training))
    sums = self.trainer.train_function(self.iterator, *arguments)
    return StepOutput.from_sums(_as_numpy(sums))


class CoordinatorStepRunner(StepRunner):
  """Schedules steps on parameter-server workers through a coordinator.

  Args:
    trainer: the `tfdist.training.train_loop.Trainer` (built under the
      ParameterServerStrategy's scope).
    coordinator: the `tf.distribute.coordinator.ClusterCoordinator`.
    iterator: the per-worker iterator
      (`iter(coordinator.create_per_worker_dataset(...))`).
    last_checkpoint: returns the latest checkpoint path (or None), for the
      error message when a ps task is lost.
  """

  # The coordinator joins only at the controller's boundaries.
  max_steps_per_call: Optional[int] = None

  def __init__(self, *, trainer, coordinator, iterator,
               last_checkpoint: Callable[[], Optional[str]] = lambda: None):
    self.trainer = trainer
    self.coordinator = coordinator
    self.iterator = iterator
    self.last_checkpoint = last_checkpoint

  def run(self, num_steps: int, *, start_step: int, stop_signal: bool = False,
          stop_training: bool = False) -> StepOutput:
    """Schedules `num_steps` steps in chunks, joins, returns their
    `StepOutput`.

    Afterwards the trainer's step counter is set to exactly `start_step +
    num_steps` (a chunk re-run after a worker was lost advanced it twice).
    The stop requests are the coordinator's own (it is the only process
    that decides; `agree` is `flag` itself); they come back unchanged in
    the signals.

    Raises:
      tfdist.distribute.parameter_server.ParameterServerError: a ps task (or the
        whole cluster) became unreachable; the message names the last
        checkpoint training will resume from.
    """
    chunk = self.trainer.steps_per_execution
    flags = _stop_flags(False, False)
    pending, scheduled = [], 0
    try:
      while scheduled < num_steps:
        n = min(chunk, num_steps - scheduled)
        pending.append(self.coordinator.schedule(
            self.trainer.train_function,
            args=(self.iterator, tf.constant(n, tf.int32), flags)))
        scheduled += n
      self.coordinator.join()
      sums: Dict[str, np.ndarray] = {}
      for remote in pending:
        for k, v in remote.fetch().items():
          sums[k] = sums.get(k, 0.0) + np.asarray(v, np.float64)
    except PS_LOST_ERRORS as e:
      raise ps_lost_error(e, after=f"step {start_step}",
                          last_checkpoint=self.last_checkpoint()) from e
    self.trainer.global_step.assign(start_step + num_steps)
    output = StepOutput.from_sums(sums)
    return dataclasses.replace(output, signals=dataclasses.replace(
        output.signals, stop_signal=bool(stop_signal),
        stop_training=bool(stop_training)))
