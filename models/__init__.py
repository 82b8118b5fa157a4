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


def build_model(name: str, *, spec=None, input_shape=None,
                num_classes: Optional[int] = None, embedding_dim: int = 16,
                hash_buckets: int = 100_000) -> keras.Model:
  """Builds the model registered as `name` for the data set `spec`.

  Args:
    name: a name from `model_names()`.
    spec: the data set's `tfdist.dataset_spec.DatasetSpec` (image models
      read `input_shape` and `num_classes`; ranking models `id_features`,
      `num_dense` and `num_classes`).
    input_shape, num_classes: image models only, instead of `spec`.
    embedding_dim, hash_buckets: reach only ranking models
      (`is_ranking_model`); the others ignore them.

  Raises:
    ValueError: unknown name (the message lists the known ones).
  """
  if name not in _BUILDERS:
    raise ValueError(f"--model={name!r} is unknown. Known: "
                     f"{', '.join(model_names())}.")
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
  return _BUILDERS[name](input_shape=tuple(input_shape),
                        num_classes=num_classes)
