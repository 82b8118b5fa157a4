"""Model builders, chosen by name (`--model`).

`build_model(name, spec=...)` builds from the data set's `DatasetSpec`
(`tfdist.dataset_spec`): its input shape, classes and feature names. Every
model returns a `keras.Model`
whose output stays float32 under a mixed precision policy (the last layer is
a float32 activation): image models (`cnn`, `resnet`) return logits
[batch, num_classes]; ranking models (`ranking`) return sigmoid
probabilities [batch, 1].
"""

from typing import Callable, Dict, Optional, Tuple

import keras

from models import cnn
from models import ranking
from models import resnet
from tfdist.config import ConfigError

_BUILDERS: Dict[str, Callable[..., keras.Model]] = {
    "cnn": cnn.build_cnn,
    "ranking": ranking.build_ranking,
    "resnet": resnet.build_resnet,
}
# Builders that also take `embedding_dim` and `hash_buckets` (recommendation
# models; they return sigmoid probabilities [batch, 1], not logits).
_RANKING = frozenset({"ranking"})


def model_names() -> Tuple[str, ...]:
  """Names accepted by `--model`."""
  return tuple(sorted(_BUILDERS))


def is_ranking_model(name: str) -> bool:
  """True for models with embedding tables (`--embedding_dim`,
  `--hash_buckets`) and a sigmoid output."""
  return name in _RANKING


# Builders whose models have batch normalization (they take
# `sync_batch_norm`).
_BATCH_NORM = frozenset({"cnn", "resnet"})
# Strategies whose replicas apply one update together per step, so that
# batch statistics can be summed over the global batch.
SYNCHRONOUS_STRATEGIES = ("mirrored", "multi_worker_mirrored", "tpu")


# Builders that can recompute activations in the backward pass
# (`activation_recomputation`, models/recompute.py).
_RECOMPUTATION = frozenset({"cnn", "resnet"})
# Why the others cannot.
_NO_RECOMPUTATION_REASONS = {
    "ranking": "its activations are a few embedding rows and a small MLP "
               "per example (nothing worth recomputing), and its embedding "
               "lookups produce sparse gradients over tables that parameter "
               "servers shard, which tf.recompute_grad does not handle",
}


def supports_recomputation(name: str) -> bool:
  """True for built-in models that can recompute activations
  (`--activation_recomputation`)."""
  return name in _RECOMPUTATION


def check_recomputation(name: str, activation_recomputation: bool):
  """Raises `ConfigError` when `--activation_recomputation` is asked of a
  model that cannot recompute its activations (the message says why)."""
  if activation_recomputation and name in _BUILDERS and (
      name not in _RECOMPUTATION):
    reason = _NO_RECOMPUTATION_REASONS.get(name, "its builder has no blocks "
                                                 "to recompute")
    raise ConfigError(
        f"--activation_recomputation (--gradient_checkpointing) is not "
        f"available for --model={name}: {reason}. Models that recompute: "
        f"{', '.join(sorted(_RECOMPUTATION))}; or drop the flag.")


def has_batch_norm(name: str) -> bool:
  """True for built-in models with batch normalization (`--sync_batch_norm`
  applies to them)."""
  return name in _BATCH_NORM


def resolve_sync_batch_norm(value: Optional[bool], *, strategy_name: str,
                            num_replicas_in_sync: int,
                            xla_per_replica: bool = False
                            ) -> Tuple[bool, str]:
  """Whether built-in models normalize over the global batch, and why.

  Args:
    value: `--sync_batch_norm` (None: the default).
    strategy_name: the concrete strategy (`mirrored`, ...; never `auto`).
    num_replicas_in_sync: replicas over all workers.
    xla_per_replica: each replica's forward pass is XLA-compiled on its own
      (`--enable_xla` off TPUs), where an all-reduce cannot run.

  Returns:
    `(synchronized, reason)`. The default is synchronized under a
    synchronous strategy (`SYNCHRONOUS_STRATEGIES`) with more than one
    replica: N replicas then normalize as one device on the global batch
    (three small all-reduces per batch-norm layer in the forward pass, and
    their gradients). With one replica, under parameter_server (each worker
    updates alone), or with `xla_per_replica`, statistics are per replica.

  Raises:
    tfdist.config.ConfigError: `--sync_batch_norm` with `--enable_xla` off
      TPUs (compiling the all-reduce into one replica's XLA cluster fails
      under MirroredStrategy).
  """
  if value and xla_per_replica and num_replicas_in_sync > 1:
    raise ConfigError(
        "--sync_batch_norm needs an all-reduce inside the forward pass, "
        "which --enable_xla compiles per replica (off TPUs) where it cannot "
        "run. Drop one of --sync_batch_norm and --enable_xla.")
  if value is not None:
    return bool(value), f"--sync_batch_norm={str(bool(value)).lower()}"
  if strategy_name in SYNCHRONOUS_STRATEGIES and num_replicas_in_sync > 1:
    if xla_per_replica:
      return False, ("default with --enable_xla: each replica's forward "
                     "pass is compiled alone")
    return True, (f"default under {strategy_name} with "
                  f"{num_replicas_in_sync} replicas")
  why = ("one replica" if num_replicas_in_sync <= 1 else
         f"{strategy_name} is not synchronous")
  return False, f"default: {why}"


def build_model(name: str, *, spec=None, input_shape=None,
                num_classes: Optional[int] = None, embedding_dim: int = 16,
                hash_buckets: int = 100_000,
                sync_batch_norm: bool = False,
                activation_recomputation: bool = False) -> keras.Model:
  """Builds the model registered as `name` for the data set `spec`.

  Args:
    name: a name from `model_names()`.
    spec: the data set's `tfdist.dataset_spec.DatasetSpec` (image models
      read `input_shape` and `num_classes`; ranking models `id_features`,
      `num_dense` and `num_classes`).
    input_shape, num_classes: image models only, instead of `spec`.
    embedding_dim, hash_buckets: reach only ranking models
      (`is_ranking_model`); the others ignore them.
    sync_batch_norm: batch statistics over the global batch (see
      `resolve_sync_batch_norm`); reaches only models with batch
      normalization (`has_batch_norm`).
    activation_recomputation: blocks recompute their activations in the
      backward pass (`supports_recomputation`; models/recompute.py).

  Raises:
    ValueError: unknown name (the message lists the known ones).
    ConfigError: `activation_recomputation` for a model that cannot.
  """
  if name not in _BUILDERS:
    raise ValueError(f"--model={name!r} is unknown. Known: "
                     f"{', '.join(model_names())}.")
  check_recomputation(name, activation_recomputation)
  if name in _RANKING:
    if spec is None:
      raise ValueError(f"--model={name} needs spec=DatasetSpec (its id "
                       "features and dense width).")
    return _BUILDERS[name](id_features=spec.id_features,
                          num_dense=spec.num_dense,
                          num_classes=spec.num_classes,
                          embedding_dim=embedding_dim,
                          hash_buckets=hash_buckets)
  if spec is not None:
    input_shape, num_classes = spec.input_shape, spec.num_classes
  if input_shape is None or num_classes is None:
    raise ValueError(f"--model={name}: pass spec=DatasetSpec, or both "
                     "input_shape and num_classes.")
  kwargs = {}
  if name in _BATCH_NORM:
    kwargs["sync_batch_norm"] = bool(sync_batch_norm)
  if activation_recomputation:
    kwargs["activation_recomputation"] = True
  return _BUILDERS[name](input_shape=tuple(input_shape),
                        num_classes=num_classes, **kwargs)
