"""tfdist's built-in data sets, registered by name (`--dataset`).

Importing this module registers each built-in `DatasetSpec`
(`tfdist.core.dataset_spec`) with `tfdist.core.registry.register_dataset`;
each data set's conversion and parser live in a module of its own
(`tfdist.data.fashion_mnist`, `tfdist.data.movielens`,
`tfdist.data.clothing_reviews`), which depends only on
`tfdist.core.dataset_spec`. Your own data sets register the same way, or are
named by import path (`--dataset=package.module:dataset_fn`). The Fashion-MNIST
helpers are re-exported here under their old names.
"""

from tfdist import errors
from tfdist.data import clothing_reviews
from tfdist.data import fashion_mnist
from tfdist.data import movielens
from tfdist.core.dataset_spec import DatasetSpec
from tfdist.core.dataset_spec import INFO_FILE  # pylint: disable=unused-import
from tfdist.data.fashion_mnist import convert_fashion_mnist  # pylint: disable=unused-import
from tfdist.data.fashion_mnist import DEBIAN_FASHION_MNIST_DIR  # pylint: disable=unused-import
from tfdist.data.fashion_mnist import parse_image_example  # pylint: disable=unused-import
from tfdist.data.fashion_mnist import read_idx  # pylint: disable=unused-import
from tfdist.data.fashion_mnist import write_image_shards  # pylint: disable=unused-import
from tfdist.core import registry

for _spec in (fashion_mnist.SPEC, movielens.SPEC, clothing_reviews.SPEC):
  registry.register_dataset(_spec)


def get_dataset_spec(name: str) -> DatasetSpec:
  """Returns the `DatasetSpec` registered as `name` (or an import path's).

  Raises:
    ConfigError: unknown name (the message lists the registered ones).
  """
  return registry.get_dataset(name)
