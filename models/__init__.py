"""Model builders, chosen by name (`--model`).

Every builder takes `(input_shape, num_classes)` and returns an unbuilt-free
`keras.Model` whose output is float32 logits of shape [batch, num_classes],
even under a mixed precision policy (the last layer is a float32 activation).
"""

from typing import Callable, Dict, Tuple

import keras

from models import cnn
from models import resnet

_BUILDERS: Dict[str, Callable[..., keras.Model]] = {
    "cnn": cnn.build_cnn,
    "resnet": resnet.build_resnet,
}


def model_names() -> Tuple[str, ...]:
  """Names accepted by `--model`."""
  return tuple(sorted(_BUILDERS))


def build_model(name: str, *, input_shape, num_classes: int) -> keras.Model:
  """Builds the model registered as `name`.

  Raises:
    ValueError: unknown name (the message lists the known ones).
  """
  if name not in _BUILDERS:
    raise ValueError(f"--model={name!r} is unknown. Known: "
                     f"{', '.join(model_names())}.")
  return _BUILDERS[name](input_shape=tuple(input_shape),
                        num_classes=num_classes)
