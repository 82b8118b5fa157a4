"""Unit tests of tfdist.core.dataset_spec: one source per data set."""

import dataclasses

import pytest

from tfdist import errors
from tfdist.core.dataset_spec import DatasetSpec


def _parse(serialized):
  return serialized


def _input_fn(training):
  del training


@pytest.mark.compat
def test_a_spec_reads_files_or_calls_a_function():
  assert DatasetSpec(name="files", parse_fn=_parse).reads_files
  assert not DatasetSpec(name="fn", input_fn=_input_fn).reads_files


@pytest.mark.compat
@pytest.mark.parametrize("sources", [{}, {"parse_fn": _parse,
                                          "input_fn": _input_fn}])
def test_exactly_one_source(sources):
  with pytest.raises(ValueError, match="exactly one source"):
    DatasetSpec(name="toy", **sources)


@pytest.mark.compat
def test_a_spec_is_frozen_with_documented_defaults():
  spec = DatasetSpec(name="toy", parse_fn=_parse)
  assert (spec.input_shape, spec.num_classes, spec.task, spec.id_features,
          spec.num_dense) == ((), 0, None, (), 0)
  with pytest.raises(dataclasses.FrozenInstanceError):
    spec.name = "other"


@pytest.mark.compat
def test_a_missing_data_set_is_a_config_error():
  assert issubclass(errors.DataNotFoundError, errors.ConfigError)
