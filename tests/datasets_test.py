"""Unit tests of tfdist.data.datasets: the built-in data sets by name."""

import pytest

from tfdist import errors
from tfdist.data import datasets
from tfdist.data import fashion_mnist
from tfdist.data import movielens
from tfdist.core import registry


def test_the_built_in_data_sets_are_registered():
  assert datasets.get_dataset_spec("fashion_mnist") is fashion_mnist.SPEC
  assert datasets.get_dataset_spec("movielens") is movielens.SPEC
  assert {"fashion_mnist", "movielens"} <= set(registry.dataset_names())


def test_their_shapes_and_tasks():
  images = datasets.get_dataset_spec("fashion_mnist")
  assert (images.input_shape, images.num_classes, images.task) == (
      (28, 28, 1), 10, "multiclass")
  ratings = datasets.get_dataset_spec("movielens")
  assert (ratings.num_classes, ratings.task) == (1, "binary")
  assert ratings.id_features == movielens.ID_FEATURES


def test_an_unknown_name_lists_the_registered_ones():
  with pytest.raises(errors.ConfigError, match="Registered: .*fashion_mnist"):
    datasets.get_dataset_spec("imagenet")


def test_the_old_names_still_import():
  assert datasets.convert_fashion_mnist is fashion_mnist.convert_fashion_mnist
  assert datasets.parse_image_example is fashion_mnist.parse_image_example
  assert datasets.INFO_FILE == "dataset_info.json"
