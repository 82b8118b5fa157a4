"""Unit tests of tfdist.runtime.strict_json: values `json.dumps` accepts strictly."""

import json
import math

import numpy as np
import pytest

from tfdist.runtime import strict_json
from tfdist.training.step import training_checks


@pytest.mark.compat
def test_non_finite_floats_become_null():
  value = {"auc": math.nan, "loss": [1.5, math.inf, -math.inf],
           "nested": {"x": (2, float("nan"))}, "name": "run", "n": None}
  safe = strict_json.json_safe(value)
  assert safe == {"auc": None, "loss": [1.5, None, None],
                  "nested": {"x": [2, None]}, "name": "run", "n": None}
  assert json.loads(json.dumps(safe, allow_nan=False)) == safe


@pytest.mark.compat
def test_numpy_scalars_become_python_numbers():
  safe = strict_json.json_safe({"step": np.int64(3), "loss": np.float32(0.5),
                                "bad": np.float64("nan")})
  assert safe == {"step": 3, "loss": 0.5, "bad": None}
  assert type(safe["step"]) is int and type(safe["loss"]) is float
  json.dumps(safe, allow_nan=False)


@pytest.mark.compat
def test_the_input_is_not_changed():
  value = {"x": [math.nan]}
  strict_json.json_safe(value)
  assert math.isnan(value["x"][0])


@pytest.mark.compat
def test_training_checks_exports_it():
  assert training_checks.json_safe is strict_json.json_safe
