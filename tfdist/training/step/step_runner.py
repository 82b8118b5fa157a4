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
`tfdist.training.step.objectives.MetricSums`; `Trainer.summarize` makes values
of them) and, apart from them, its `StepSignals` (stop requests, skipped steps).
"""

import abc
import dataclasses
import re
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from absl import logging
import numpy as np
import tensorflow as tf

from tfdist.distribute import parameter_server
from tfdist.distribute import worker_exit
from tfdist import errors
from tfdist.errors import first_line

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
                    addresses: Optional[Mapping[str, Sequence[str]]] = None,
                    what: str = "MultiWorkerMirrored training"
                    ) -> errors.PeerLostError:
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
    what: the run, as the message begins (a pipeline's stage tasks are
      peers too).
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
  # Under tfdist.launch: the task that failed and its exit status.
  note = worker_exit.lost_peers_note()
  if note:
    who += f" (tfdist.launch: {note})"
  return errors.PeerLostError(
      f"{what} {who} after {after}: "
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
    A `tfdist.errors.ParameterServerError` to raise from
    `error`.
  """
  first = first_line(error)
  return errors.ParameterServerError(
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

  def nonfinite_input(self, after_step: Optional[int],
                      step: int) -> Optional[str]:
    """What in the training batches of steps `after_step + 1 .. step` is
    NaN or infinite, read again after a divergence; None when they are
    finite or cannot be read again. This base: None (not known)."""
    del after_step, step  # Unused.
    return None


def _as_numpy(sums) -> Dict[str, np.ndarray]:
  return {k: np.asarray(v, np.float64) for k, v in sums.items()}


def _stop_flags(stop_signal: bool, stop_training: bool) -> tf.Tensor:
  return tf.constant([float(stop_signal), float(stop_training)], tf.float32)


class LocalStepRunner(StepRunner):
  """Runs steps by calling the compiled training function in this process.

  Args:
    trainer: the `tfdist.training.step.train_loop.Trainer`.
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
    # The step whose position `iterator_fn` made the iterator at (None: an
    # iterator given, or none made yet).
    self._input_start: Optional[int] = None
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
      self._input_start = start_step
    key = (int(num_steps), bool(stop_signal), bool(stop_training))
    arguments = self._arguments.get(key)
    if arguments is None:
      arguments = self._arguments[key] = (
          tf.constant(num_steps, tf.int32),
          _stop_flags(stop_signal, stop_training))
    sums = self.trainer.train_function(self.iterator, *arguments)
    return StepOutput.from_sums(_as_numpy(sums))

  def nonfinite_input(self, after_step: Optional[int],
                      step: int) -> Optional[str]:
    """After a divergence: what in this worker's training batches of steps
    `after_step + 1 .. step` (None: from where the input started) is NaN
    or infinite, e.g. "the batch of step 6 on this worker holds 1 NaN in
    its features (rows [3] of replica 0's batch)"; None when they are all
    finite or cannot be read again.

    Nothing is checked while training runs: a fresh iterator from
    `iterator_fn` reads the batches again, skipping those before (in the
    run's order when that order is reproducible: a seeded or unshuffled
    input). At most `MAX_REREAD_STEPS` steps of batches are read, and only
    with `iterator_fn`. With several workers, each reads its own batches
    and one all-reduce of one number tells the others (every worker calls
    this at the same point): theirs then say another worker's input holds
    them.
    """
    found = None
    start = self._input_start
    after = start if after_step is None else after_step
    if (start is not None and start <= after < step and
        step - start <= MAX_REREAD_STEPS):
      try:
        found = self._find_nonfinite(start, after, step)
      except Exception as e:  # pylint: disable=broad-except
        # A diagnosis only: the divergence error is raised either way.
        logging.warning("Could not read the training input again to check "
                        "it for NaN or infinite values: %s", first_line(e))
    if self.num_workers > 1 and self.agree(found is not None) and not found:
      return (f"another worker's training batch of steps {after + 1}-"
              f"{step} holds NaN or infinite values (its own error names "
              "them)")
    return found

  def _find_nonfinite(self, start: int, after: int,
                      step: int) -> Optional[str]:
    """`nonfinite_input` on a fresh iterator made at step `start`."""
    iterator = self.iterator_fn(start)
    per_step = self.trainer.gradient_accumulation_steps
    for _ in range((after - start) * per_step):
      next(iterator)
    strategy = self.trainer.strategy
    for current in range(after + 1, step + 1):
      for _ in range(per_step):
        found = nonfinite_values(next(iterator), strategy)
        if found:
          return f"the batch of step {current} on this worker holds {found}"
    return None


# The most steps of training batches `LocalStepRunner.nonfinite_input`
# reads again after a divergence (a few seconds to a minute of input).
MAX_REREAD_STEPS = 5_000
_ROLES = ("features", "labels", "sample weights")


def nonfinite_values(batch, strategy: Optional[tf.distribute.Strategy] = None
                     ) -> Optional[str]:
  """What of a training batch `(features, labels[, sample_weights])` is
  NaN or infinite, e.g. "1 NaN in its features (`x`; rows [3] of replica
  0's batch)", or None when every floating-point value is finite.

  Args:
    batch: a batch as the input pipeline gives it: tensors, or per-replica
      values of `strategy` (a dict or list of features is named by key or
      index).
    strategy: the strategy whose per-replica values `batch` holds (None:
      plain tensors).
  """
  parts = []
  for role, part in zip(_ROLES, tuple(batch)):
    for name, value in _leaves(part):
      local = (strategy.experimental_local_results(value)
               if strategy is not None else (value,))
      for replica, tensor in enumerate(local):
        if isinstance(tensor, tf.SparseTensor):
          tensor = tensor.values
        elif isinstance(tensor, tf.RaggedTensor):
          tensor = tensor.flat_values
        if not tensor.dtype.is_floating:
          continue
        array = np.asarray(tensor)
        bad = ~np.isfinite(array)
        if not bad.any():
          continue
        nans = int(np.isnan(array).sum())
        kinds = ", ".join(f"{n} {what}" for n, what in (
            (nans, "NaN"), (int(bad.sum()) - nans, "infinite")) if n)
        rows = (np.nonzero(bad.reshape(bad.shape[0], -1).any(axis=1))[0]
                if bad.ndim else np.array([0]))
        shown = ", ".join(str(r) for r in rows[:5]) + (
            ", ..." if len(rows) > 5 else "")
        parts.append(f"{kinds} in its {role}" + (f" (`{name}`" if name
                                                   else " (") +
                     f"{'; ' if name else ''}rows [{shown}] of replica "
                     f"{replica}'s batch)")
  return "; ".join(parts) or None


def _leaves(part, name: str = ""):
  """`(name, tensor)` of each leaf of a batch's part: dict keys and list
  indices joined by `/` ("" for a single tensor)."""
  if isinstance(part, dict):
    for key in sorted(part):
      yield from _leaves(part[key], f"{name}/{key}" if name else str(key))
  elif isinstance(part, (list, tuple)):
    for i, value in enumerate(part):
      yield from _leaves(value, f"{name}/{i}" if name else str(i))
  else:
    yield name, part


class CoordinatorStepRunner(StepRunner):
  """Schedules steps on parameter-server workers through a coordinator.

  Args:
    trainer: the `tfdist.training.step.train_loop.Trainer` (built under the
      ParameterServerStrategy's scope).
    coordinator: the `tf.distribute.coordinator.ClusterCoordinator`.
    iterator: the per-worker iterator
      (`iter(coordinator.create_per_worker_dataset(...))`).
    last_checkpoint: returns the latest checkpoint path (or None), for the
      error message when a ps task is lost.
    reread_fn: returns a fresh, unshuffled copy of the training input
      (every worker reads all of it) for this process to read again after
      a divergence (`nonfinite_input`); None: not read.
    reread_batches: the most batches of it read again.
  """

  # The coordinator joins only at the controller's boundaries.
  max_steps_per_call: Optional[int] = None

  def __init__(self, *, trainer, coordinator, iterator,
               last_checkpoint: Callable[[], Optional[str]] = lambda: None,
               reread_fn: Optional[Callable[[], tf.data.Dataset]] = None,
               reread_batches: int = MAX_REREAD_STEPS):
    self.trainer = trainer
    self.coordinator = coordinator
    self.iterator = iterator
    self.last_checkpoint = last_checkpoint
    self.reread_fn = reread_fn
    self.reread_batches = max(1, min(int(reread_batches), MAX_REREAD_STEPS))

  def nonfinite_input(self, after_step: Optional[int],
                      step: int) -> Optional[str]:
    """After a divergence: what in the training input is NaN or infinite,
    e.g. "the training input holds 1 NaN in its features (rows [3] of
    replica 0's batch) in batch 5 of an unshuffled read"; None when every
    value read is finite or the input cannot be read.

    The coordinator hands each step to whichever worker is free, and each
    worker shuffles its copy of the input without a fixed seed, so the
    steps' batches cannot be read again in order as `LocalStepRunner`
    reads them. Instead this process reads the input again, unshuffled,
    at most `reread_batches` batches (an epoch, as `tfdist.experiment`
    sets it): values found there are the likely cause, though not proven
    to be in steps `after_step + 1 .. step`.
    """
    del after_step, step  # See above: not matched to steps.
    if self.reread_fn is None:
      return None
    try:
      for index, batch in enumerate(
          self.reread_fn().take(self.reread_batches)):
        found = nonfinite_values(batch)
        if found:
          return (f"the training input holds {found} in batch {index} of an "
                  "unshuffled read (parameter-server workers' batches are "
                  "not matched to steps)")
    except Exception as e:  # pylint: disable=broad-except
      # A diagnosis only: the divergence error is raised either way.
      logging.warning("Could not read the training input again to check it "
                      "for NaN or infinite values: %s", first_line(e))
    return None

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
      tfdist.errors.ParameterServerError: a ps task (or the
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
