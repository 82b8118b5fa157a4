"""Unit tests of tfdist.errors: every class, its exit status, first_line.

The statuses are compared with the table of docs/reference/exit-codes.md,
the contract cluster managers read.
"""

import os
import re
import signal

import pytest
import tensorflow as tf

from tests import testutil
from tfdist import errors

CONFIG_ERRORS = [
    errors.ConfigError, errors.ClusterConfigError, errors.JobSpecError,
    errors.UnsupportedVersionError, errors.FileSystemUnavailableError,
    errors.TPUNotAvailableError, errors.DataNotFoundError, errors.DataError,
    errors.OutputNotWritableError, errors.OutputWriteError,
    errors.PeerStoppedError,
    errors.ExportRefusedError, errors.DamagedCheckpointError,
    errors.IncompatibleResumeError, errors.ShardCountMismatchError,
    errors.PipelineConfigError, errors.WeightsShardedError]

# (an instance, its status) for every class a run raises.
CASES = [(cls("bad"), 2) for cls in CONFIG_ERRORS] + [
    (errors.TrainingStalledError("stalled"), 1),
    (errors.TrainingDivergedError("nan"), 1),
    (errors.NonFiniteStateError("nan"), 1),
    (errors.PreemptedError(signum=signal.SIGTERM, step=3, checkpoint="c"),
     143),
    (errors.PreemptedError(signum=signal.SIGINT, step=3, checkpoint=None),
     130),
    (errors.StoppedAtStartError("waiting", signal.SIGTERM), 143),
    (errors.StoppedAtStartError("waiting", signal.SIGINT), 130),
    (errors.ClusterStartError("peers never answered"), 137),
    (errors.PeerLostError("worker 1 lost"), 200),
    (errors.CollectiveTimeoutError("group 'tensor' timed out"), 200),
    (errors.ParameterServerError("ps 0 lost"), 200),
    (errors.LeaseHeldError("held"), 201),
    (errors.LeaseLostError("taken over"), 201),
]


def _documented_statuses():
  """`{status: "permanent" | "retryable" | "-"}` of the reference's table."""
  path = os.path.join(testutil.REPO_ROOT, "docs", "reference",
                      "exit-codes.md")
  with open(path) as f:
    text = f.read()
  table = {}
  for statuses, retry in re.findall(r"^\| ([\d, ]+) \|.*\| (\S+) \|$", text,
                                    re.M):
    for status in statuses.split(","):
      table[int(status)] = retry
  return table


@pytest.mark.compat
def test_every_error_class_is_covered_here():
  classes = {value for value in vars(errors).values()
             if isinstance(value, type) and issubclass(value, BaseException)}
  covered = {type(error) for error, _ in CASES} | {errors.DiagnoseError}
  assert classes == covered


@pytest.mark.compat
@pytest.mark.parametrize("error,status", CASES,
                         ids=[f"{type(e).__name__}-{s}" for e, s in CASES])
def test_status_is_the_documented_one(error, status):
  assert errors.exit_code_for(error) == status
  documented = _documented_statuses()
  assert status in documented, f"exit-codes.md has no row for {status}"
  assert documented[status] == (
      "retryable" if errors.is_retryable(status) else "permanent")


@pytest.mark.compat
def test_the_table_has_exactly_these_statuses():
  assert set(_documented_statuses()) == {0, 1, 2, 130, 143, 137, 200, 201}
  assert {status for _, status in CASES} | {errors.OK} == set(
      _documented_statuses())


@pytest.mark.compat
def test_other_errors_are_unexpected():
  assert errors.exit_code_for(RuntimeError("a bug")) is None
  assert errors.exit_code_for(ValueError("not a ConfigError")) is None
  assert errors.exit_code_for(errors.DiagnoseError("no manifest")) is None
  # A divergence Keras or NumPy raises is status 1 too.
  assert errors.exit_code_for(FloatingPointError("overflow")) == 1


@pytest.mark.compat
def test_classes_keep_their_builtin_bases():
  assert issubclass(errors.ConfigError, ValueError)
  assert issubclass(errors.TrainingDivergedError, FloatingPointError)
  assert issubclass(errors.NonFiniteStateError, errors.TrainingDivergedError)
  assert issubclass(errors.PeerLostError, RuntimeError)
  assert all(issubclass(cls, errors.ConfigError) for cls in CONFIG_ERRORS)


@pytest.mark.compat
def test_signal_stops_carry_their_status():
  error = errors.PreemptedError(signum=signal.SIGTERM, step=7,
                                checkpoint="/m/ckpt-7")
  assert (error.signum, error.step, error.checkpoint, error.exit_code) == (
      signal.SIGTERM, 7, "/m/ckpt-7", 143)
  assert str(error) == ("Stopped by SIGTERM at step 7; checkpoint /m/ckpt-7. "
                        "Run again with the same --model_dir to resume.")
  stopped = errors.StoppedAtStartError("waiting for worker 1", signal.SIGINT)
  assert (str(stopped), stopped.signum, stopped.exit_code) == (
      "waiting for worker 1", signal.SIGINT, 130)


@pytest.mark.compat
def test_retryable_split():
  assert [s for s in (0, 1, 2, 127, 128, 137, 200, 255, 256)
          if errors.is_retryable(s)] == [128, 137, 200, 255]


@pytest.mark.compat
@pytest.mark.parametrize("message,default,line", [
    ("disk full\nat step 3", "", "disk full"),
    ("\n  disk full  \nmore", "", "disk full"),
    ("", "", ""),
    ("   \n ", "OSError", "OSError"),
    ("one line", "OSError", "one line"),
])
def test_first_line(message, default, line):
  assert errors.first_line(RuntimeError(message), default=default) == line
  assert errors.first_line(message, default=default) == line


def test_first_line_of_a_tensorflow_error():
  error = tf.errors.NotFoundError(None, None, "ckpt-4.index gone\ndetail")
  assert errors.first_line(error) == "ckpt-4.index gone"
