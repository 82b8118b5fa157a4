"""Data sets tfdist knows by name (`--dataset`).

The registry maps each name to its `DatasetSpec` (`tfdist.dataset_spec`);
each data set's conversion and parser live in a module of its own
(`tfdist.fashion_mnist`, `tfdist.movielens`), which depends only on
`tfdist.dataset_spec`. The Fashion-MNIST helpers are re-exported here under
their old names.
"""

from tfdist import fashion_mnist
from tfdist import movielens
from tfdist.config import ConfigError  # pylint: disable=unused-import
from tfdist.dataset_spec import DataNotFoundError  # pylint: disable=unused-import
from tfdist.dataset_spec import DatasetSpec
from tfdist.dataset_spec import INFO_FILE  # pylint: disable=unused-import
from tfdist.fashion_mnist import DEBIAN_FASHION_MNIST_DIR  # pylint: disable=unused-import
from tfdist.fashion_mnist import convert_fashion_mnist  # pylint: disable=unused-import
from tfdist.fashion_mnist import parse_image_example  # pylint: disable=unused-import
from tfdist.fashion_mnist import read_idx  # pylint: disable=unused-import
from tfdist.fashion_mnist import write_image_shards  # pylint: disable=unused-import

_REGISTRY = {spec.name: spec for spec in (fashion_mnist.SPEC, movielens.SPEC)}


def get_dataset_spec(name: str) -> DatasetSpec:
  """Returns the `DatasetSpec` registered as `name`.

  Raises:
    ConfigError: unknown name (the message lists the known ones).
  """
  if name not in _REGISTRY:
    raise ConfigError(f"--dataset={name!r} is unknown. Known: "
                      f"{', '.join(sorted(_REGISTRY))}.")
  return _REGISTRY[name]
