"""Batch plan: how the global batch splits across replicas and steps.

    global_batch_size = per_replica_batch_size
                        * num_replicas_in_sync
                        * gradient_accumulation_steps

Exactly one of `batch_size` (global, Model Garden's meaning of `--batch_size`)
or `per_replica_batch_size` is needed; given both they must agree.
"""

import dataclasses
import math
from typing import Optional

from tfdist import errors
from tfdist.runtime import wording

DEFAULT_GLOBAL_BATCH_SIZE = 128


@dataclasses.dataclass(frozen=True)
class BatchPlan:
  """The resolved batch arithmetic of a run (all sizes in examples).

  Attributes:
    num_replicas_in_sync: replicas that each compute one per-replica batch in
      every step (`strategy.num_replicas_in_sync`).
    per_replica_batch_size: examples each replica processes per micro-step.
    gradient_accumulation_steps: micro-steps summed into one update.
    global_batch_size: examples that make one optimizer update.
    num_train_examples: training examples in one epoch (None if unknown).
    steps_per_epoch: optimizer updates per epoch; the remainder
      (`num_train_examples % global_batch_size`) is dropped.
    num_input_pipelines: hosts that each read part of the data.
  """
  num_replicas_in_sync: int
  per_replica_batch_size: int
  gradient_accumulation_steps: int
  global_batch_size: int
  num_train_examples: Optional[int]
  steps_per_epoch: Optional[int]
  num_input_pipelines: int = 1

  @property
  def dropped_per_epoch(self) -> Optional[int]:
    """Training examples of an epoch that no step trains on: the last,
    partial global batch (`num_train_examples % global_batch_size`; None if
    the count is unknown). `keras.Model.fit` trains a partial last batch;
    tfdist keeps every step's global batch whole, so that every replica
    computes a full per-replica batch and the learning rate scaled to the
    batch (Goyal et al. 2017) holds for every step."""
    if self.num_train_examples is None or self.steps_per_epoch is None:
      return None
    return self.num_train_examples - self.steps_per_epoch * (
        self.global_batch_size)

  def remainder_warning(self) -> Optional[str]:
    """The start-up warning when an epoch leaves examples untrained (None
    when the global batch divides the epoch or the count is unknown)."""
    dropped = self.dropped_per_epoch
    if not dropped:
      return None
    return (
        f"{dropped} of the {self.num_train_examples} training examples of "
        f"each epoch are not trained on: {self.steps_per_epoch} steps of "
        f"{self.global_batch_size} examples, and the last, partial batch "
        "is dropped (keras.Model.fit would train it as a smaller batch). "
        "With shuffling they are other examples every epoch; to train "
        f"them all, use a global batch that divides {self.num_train_examples} "
        "(--batch_size, TrainConfig.batch_size).")

  @property
  def per_pipeline_batch_size(self) -> int:
    """Examples one input pipeline (one host) delivers per micro-step."""
    return self.global_batch_size // (self.num_input_pipelines *
                                      self.gradient_accumulation_steps)


def _global_batch_size(*, batch_size: Optional[int],
                       per_replica_batch_size: Optional[int],
                       num_replicas_in_sync: int,
                       gradient_accumulation_steps: int) -> int:
  """The global batch (examples per update) the two batch flags give.

  Raises:
    ConfigError: a size is not positive, the two flags disagree, or the
      global batch does not divide by replicas x accumulation steps.
  """
  per_update = num_replicas_in_sync * gradient_accumulation_steps
  if batch_size is not None and batch_size <= 0:
    raise errors.ConfigError(f"--batch_size={batch_size} must be > 0.")
  if per_replica_batch_size is not None and per_replica_batch_size <= 0:
    raise errors.ConfigError(
        f"--per_replica_batch_size={per_replica_batch_size} must be > 0.")
  if per_replica_batch_size is not None:
    implied = per_replica_batch_size * per_update
    if batch_size is not None and batch_size != implied:
      raise errors.ConfigError(
          f"--batch_size={batch_size} (global) disagrees with "
          f"--per_replica_batch_size={per_replica_batch_size} x "
          f"{num_replicas_in_sync} replicas x {gradient_accumulation_steps} "
          f"accumulation steps = {implied}. Pass only one of the two.")
    return implied
  global_batch_size = (batch_size if batch_size is not None else
                       DEFAULT_GLOBAL_BATCH_SIZE)
  if global_batch_size % per_update:
    raise errors.ConfigError(
        f"--batch_size={global_batch_size} (global) is not divisible by "
        f"{num_replicas_in_sync} replicas x {gradient_accumulation_steps} "
        "accumulation steps. Use a multiple of "
        f"{per_update} (e.g. --batch_size="
        f"{wording.multiples_near(global_batch_size, per_update)}) "
        "or set --per_replica_batch_size instead.")
  return global_batch_size


def make_batch_plan(*,
                    num_replicas_in_sync: int,
                    batch_size: Optional[int] = None,
                    per_replica_batch_size: Optional[int] = None,
                    gradient_accumulation_steps: int = 1,
                    num_train_examples: Optional[int] = None,
                    num_input_pipelines: int = 1) -> BatchPlan:
  """Resolves the global and per-replica batch sizes.

  Args:
    num_replicas_in_sync: `strategy.num_replicas_in_sync` (>= 1).
    batch_size: the global batch (`--batch_size`), or None.
    per_replica_batch_size: the per-replica batch, or None. With neither
      given, the global batch defaults to 128.
    gradient_accumulation_steps: micro-steps per update (>= 1).
    num_train_examples: examples in one training epoch, to derive
      `steps_per_epoch`; None if unknown.
    num_input_pipelines: hosts reading data (workers); the global batch must
      split evenly across them too.

  Returns:
    A `BatchPlan`.

  Raises:
    ConfigError: sizes are not positive, the two batch flags disagree, the
      global batch does not divide evenly by the replicas, or one epoch holds
      fewer examples than one global batch.
  """
  if num_replicas_in_sync < 1:
    raise errors.ConfigError(
        f"num_replicas_in_sync={num_replicas_in_sync} must be >= 1.")
  if gradient_accumulation_steps < 1:
    raise errors.ConfigError(
        f"--gradient_accumulation_steps={gradient_accumulation_steps} must "
        "be >= 1.")
  per_update = num_replicas_in_sync * gradient_accumulation_steps
  global_batch_size = _global_batch_size(
      batch_size=batch_size, per_replica_batch_size=per_replica_batch_size,
      num_replicas_in_sync=num_replicas_in_sync,
      gradient_accumulation_steps=gradient_accumulation_steps)
  if global_batch_size % (num_input_pipelines * gradient_accumulation_steps):
    raise errors.ConfigError(
        f"Global batch {global_batch_size} does not split evenly across "
        f"{num_input_pipelines} workers. Use a multiple of "
        f"{num_input_pipelines * gradient_accumulation_steps}.")
  steps_per_epoch = None
  if num_train_examples is not None:
    steps_per_epoch = num_train_examples // global_batch_size
    if steps_per_epoch < 1:
      raise errors.ConfigError(
          f"The global batch {global_batch_size} is larger than the "
          f"{num_train_examples} training examples: lower --batch_size.")
  return BatchPlan(
      num_replicas_in_sync=num_replicas_in_sync,
      per_replica_batch_size=global_batch_size // per_update,
      gradient_accumulation_steps=gradient_accumulation_steps,
      global_batch_size=global_batch_size,
      num_train_examples=num_train_examples,
      steps_per_epoch=steps_per_epoch,
      num_input_pipelines=num_input_pipelines)


def resolve_train_steps(*, train_steps: int, train_epochs: int,
                        steps_per_epoch: int) -> int:
  """Total optimizer updates: `train_steps` if > 0, else epochs x steps/epoch."""
  if train_steps > 0:
    return train_steps
  return int(math.ceil(train_epochs * steps_per_epoch))


def resolve_warmup_steps(*, warmup_steps: Optional[int],
                         warmup_epochs: Optional[float], steps_per_epoch: int,
                         total_steps: int) -> int:
  """Warmup length in steps, from `--warmup_steps` or `--warmup_epochs`.

  With neither given, the warmup is the smaller of one epoch and a tenth of
  the run (Goyal et al. 2017 warm up for 5 of 90 epochs; short runs need a
  proportionally shorter ramp). `warmup_steps=0` turns warmup off.

  Raises:
    ConfigError: the warmup is longer than the whole run.
  """
  if warmup_steps is not None:
    steps, source = int(warmup_steps), f"--warmup_steps={warmup_steps}"
  elif warmup_epochs is not None:
    steps = int(round(warmup_epochs * steps_per_epoch))
    source = (f"--warmup_epochs={warmup_epochs} ({steps} steps at "
              f"{steps_per_epoch} steps per epoch)")
  else:
    return min(steps_per_epoch, total_steps // 10)
  if steps > total_steps:
    raise errors.ConfigError(
        f"{source} is longer than the run ({total_steps} steps). Lower the "
        "warmup or train longer.")
  return steps
