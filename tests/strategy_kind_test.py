"""Unit tests of tfdist.distribute.strategy_kind: parsing and the facts of each kind."""

import json

import pytest

from tfdist.distribute.strategy_kind import StrategyKind


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


@pytest.mark.compat
def test_kind_prints_and_serializes_as_its_flag_value():
  kind = StrategyKind.PARAMETER_SERVER
  assert str(kind) == f"{kind}" == "parameter_server"
  assert json.dumps({"s": kind}) == '{"s": "parameter_server"}'


@pytest.mark.compat
def test_facts():
  ps, mwms = StrategyKind.PARAMETER_SERVER, StrategyKind.MULTI_WORKER_MIRRORED
  assert [k for k in StrategyKind if k.is_asynchronous] == [ps]
  assert {k for k in StrategyKind if k.is_multi_worker} == {ps, mwms}
  assert not ps.supports_gradient_accumulation
  assert mwms.writes_model_dir(is_chief=True)
  assert not mwms.writes_model_dir(is_chief=False)
  assert ps.writes_model_dir(is_chief=False)
  assert StrategyKind.MIRRORED.num_input_pipelines(4) == 1
  assert mwms.num_input_pipelines(3) == 3
