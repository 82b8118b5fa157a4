"""Unit tests of tfdist.exit_codes: the documented names, from tfdist.errors."""

import signal

import pytest

from tfdist import errors
from tfdist import exit_codes


@pytest.mark.compat
def test_statuses():
  assert (exit_codes.OK, exit_codes.UNEXPECTED, exit_codes.DIVERGED,
          exit_codes.CONFIG) == (0, 1, 1, 2)
  assert exit_codes.KILLED == 128 + signal.SIGKILL == 137
  assert (exit_codes.PEER_LOST, exit_codes.LEASE_HELD) == (200, 201)
  assert exit_codes.RETRYABLE_FROM == 128


@pytest.mark.compat
def test_every_name_is_the_one_in_errors():
  for name in exit_codes.__all__:
    assert getattr(exit_codes, name) is getattr(errors, name), name


@pytest.mark.compat
def test_exit_code_for_and_is_retryable():
  assert exit_codes.exit_code_for(errors.LeaseHeldError("held")) == 201
  assert exit_codes.is_retryable(exit_codes.LEASE_HELD)
  assert exit_codes.exit_code_for(errors.DataError("cut")) == 2
  assert not exit_codes.is_retryable(exit_codes.CONFIG)
  assert exit_codes.exit_code_for(KeyError("a bug")) is None
