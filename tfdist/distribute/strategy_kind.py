"""The kind of `tf.distribute` strategy a run uses, decided once.

`--distribution_strategy` (or `auto`'s decision,
`tfdist.distribute.auto_select`) is parsed into a `StrategyKind` in one place,
`StrategyKind.parse`; every later question about the strategy ("is it
asynchronous?", "which task writes `--model_dir`?", "how many input pipelines?")
is a property of the kind, never a comparison of strings. Keras 3's trainer and
Model Garden's `_AsyncTrainer` decide such facts once in the same way
(`_is_async`).

The members are `str`-valued, so a kind prints, formats and serializes to
JSON as the flag value it came from (`multi_worker_mirrored`).
"""

import enum
from typing import Union


class StrategyKind(str, enum.Enum):
  """A concrete strategy: what `--distribution_strategy` resolved to.

  `auto` is a request, not a kind: `tfdist.distribute.auto_select` turns it into
  one of these before any strategy is built.
  """

  OFF = "off"
  ONE_DEVICE = "one_device"
  MIRRORED = "mirrored"
  MULTI_WORKER_MIRRORED = "multi_worker_mirrored"
  PARAMETER_SERVER = "parameter_server"
  TPU = "tpu"

  def __str__(self) -> str:
    return self.value

  def __format__(self, spec: str) -> str:
    return format(self.value, spec)

  @classmethod
  def parse(cls, name: Union[str, "StrategyKind"]) -> "StrategyKind":
    """The kind named by a flag value (case-insensitive).

    Args:
      name: a `--distribution_strategy` value other than `auto`, or a kind.

    Returns:
      The `StrategyKind` member.

    Raises:
      ValueError: `name` is not a concrete strategy name (the message names
        the flag, the value and the choices). `auto` is refused: resolve it
        with `tfdist.distribute.auto_select` first.
    """
    if isinstance(name, cls):
      return name
    text = str(name).strip().lower()
    for kind in cls:
      if kind.value == text:
        return kind
    raise ValueError(
        f"--distribution_strategy={name!r} is not a concrete strategy; use one"
        f" of: {', '.join(k.value for k in cls)} (auto is resolved by "
        "tfdist.distribute.auto_select before a kind is parsed).")

  @property
  def is_asynchronous(self) -> bool:
    """Workers step independently, scheduled by a coordinator (PS only)."""
    return self is StrategyKind.PARAMETER_SERVER

  @property
  def is_multi_worker(self) -> bool:
    """The run spans several processes that form a `tf.distribute` cluster."""
    return self in (StrategyKind.MULTI_WORKER_MIRRORED,
                    StrategyKind.PARAMETER_SERVER)

  @property
  def is_mirrored(self) -> bool:
    """Synchronous all-reduce data parallelism (Mirrored or MWMS)."""
    return self in (StrategyKind.MIRRORED, StrategyKind.MULTI_WORKER_MIRRORED)

  @property
  def is_tpu(self) -> bool:
    return self is StrategyKind.TPU

  @property
  def is_single_process(self) -> bool:
    """One process trains: off, one device, Mirrored or TPU."""
    return not self.is_multi_worker

  @property
  def supports_gradient_accumulation(self) -> bool:
    """Accumulation needs a synchronous step (not parameter servers)."""
    return not self.is_asynchronous

  def writes_model_dir(self, is_chief: bool) -> bool:
    """Whether this process writes `--model_dir` (checkpoints, TensorBoard).

    Args:
      is_chief: the process is its cluster's chief (`Cluster.is_chief`);
        read only under MultiWorkerMirrored, where every worker runs the
        training loop and only the chief writes.

    Returns:
      True for the only process of a single-process run, the MWMS chief, and
      the parameter-server coordinator (workers and ps tasks of a
      parameter-server cluster never reach the training loop).
    """
    if self is StrategyKind.MULTI_WORKER_MIRRORED:
      return bool(is_chief)
    return True

  def num_input_pipelines(self, num_workers: int) -> int:
    """How many `tf.data` pipelines feed the run (`num_input_pipelines`).

    Args:
      num_workers: the cluster's training workers (`Cluster.num_workers`;
        1 outside a cluster).

    Returns:
      One per worker under MultiWorkerMirrored and parameter servers (each
      worker reads its own shard); 1 otherwise.
    """
    if self.is_multi_worker:
      return max(1, int(num_workers))
    return 1
