"""Unit tests of tfdist.core.strategy_kind: parsing and registering
kinds (the facts of each kind are its backend's: tests/backends_test.py)."""

import json

import pytest

from tfdist.core import strategy_kind
from tfdist.core.strategy_kind import StrategyKind


@pytest.mark.compat
def test_parse_accepts_flag_values_case_insensitively():
  assert StrategyKind.parse("MULTI_WORKER_MIRRORED") is (
      StrategyKind.MULTI_WORKER_MIRRORED)
  assert StrategyKind.parse(StrategyKind.TPU) is StrategyKind.TPU


@pytest.mark.compat
@pytest.mark.parametrize("bad", ["auto", "mirorred", ""])
def test_parse_refuses_what_is_not_a_concrete_kind(bad):
  with pytest.raises(ValueError, match="--distribution_strategy"):
    StrategyKind.parse(bad)


def test_a_kind_is_only_a_name():
  # Its traits are its backend's (tfdist.backends.base.Backend).
  for trait in ("is_tpu", "is_mirrored", "is_asynchronous",
                "num_input_pipelines"):
    assert not hasattr(StrategyKind.TPU, trait), trait


@pytest.mark.compat
def test_kind_prints_and_serializes_as_its_flag_value():
  kind = StrategyKind.PARAMETER_SERVER
  assert str(kind) == f"{kind}" == "parameter_server"
  assert json.dumps({"s": kind}) == '{"s": "parameter_server"}'


@pytest.mark.compat
def test_a_registered_kind_parses_prints_and_serializes_as_its_name():
  kind = strategy_kind.register_kind("toy_kind")
  try:
    assert StrategyKind.parse("TOY_KIND") is kind
    assert strategy_kind.register_kind("toy_kind") is kind
    assert str(kind) == f"{kind}" == kind.value == "toy_kind"
    assert json.dumps({"s": kind}) == '{"s": "toy_kind"}'
    assert kind not in list(StrategyKind)
    assert strategy_kind.names()[-1] == "toy_kind"
  finally:
    strategy_kind.unregister_kind("toy_kind")
  with pytest.raises(ValueError, match="toy_kind"):
    StrategyKind.parse("toy_kind")


@pytest.mark.compat
@pytest.mark.parametrize("bad", ["auto", "mirrored", "Toy", "1toy", "to-y"])
def test_register_kind_refuses_taken_and_malformed_names(bad):
  with pytest.raises(ValueError, match="register_kind"):
    strategy_kind.register_kind(bad)


def test_the_old_path_is_the_same_module():
  # A kind written outside tfdist is registered through
  # tfdist.distribute.strategy_kind.register_kind.
  from tfdist.distribute import strategy_kind as old  # pylint: disable=g-import-not-at-top
  assert old is strategy_kind
  assert old.StrategyKind is StrategyKind
