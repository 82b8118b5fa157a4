"""Every tfdist error, and the exit status `tfdist.train` gives each one.

Cluster managers restart a task by its exit status. A Kubeflow `TFJob` with
`restartPolicy: ExitCode` (what `python -m tfdist.job_spec kubernetes`
writes) restarts a replica that exits with 128-255 (retryable: a signal,
a kill, a lost peer) and fails the job on 1-127 (permanent: a rerun with
the same flags fails the same way). Vertex AI restarts by its own policy;
`tfdist.launch --max_restarts` restarts on any failure. tfdist's statuses
follow the TFJob split:

| status | meaning | retry |
|---|---|---|
| 0 | finished (or `--dry_run` passed) | - |
| 1 | training diverged (NaN or infinite loss or state) or stalled (fp16 updates skipped), with one message; or an unexpected error (a bug: Python's traceback) | permanent |
| 2 | invalid flags or configuration, missing or damaged data, unwritable outputs (also a full disk or a refused write during the run: a restart on the same volume fails the same way, `tfdist.runtime.failures`; every MultiWorkerMirrored task when one fails so at the end, `PeerStoppedError`), overlapping output folders, a damaged checkpoint, a resume the checkpoint's run does not allow | permanent |
| 130, 143 | stopped by SIGINT / SIGTERM after saving a checkpoint, or while waiting for the cluster's peers at start (128 + signal) | retryable |
| 137 | killed (SIGKILL): the grace period after a signal ran out, the cluster did not form in time (also without a kill: peers that never answered), or out of memory | retryable |
| 200 | a peer worker or a ps task was lost (MultiWorkerMirrored, parameter servers), or a sub-group collective timed out (`CollectiveTimeoutError`) | retryable |
| 201 | `--model_dir` is held by another run's live lease | retryable |

A `tfdist.fit` script that does not catch a stop (`PreemptedError`,
`StoppedAtStartError`) exits 130 or 143 in the same way, with one line
(`tfdist.runtime.script_exit`).

`exit_code_for` maps an exception raised by `run_experiment` to its status.
The classes are defined here and only here: every module raises and
catches them as `errors.ConfigError`, ... (`from tfdist import errors`);
no other module defines or re-exports one (`tests/imports_test.py`). The
package root's `tfdist.ConfigError` is the one shortcut, for `tfdist.fit`
scripts. This module imports nothing of tfdist, so every module can import
it.
"""

import signal
from typing import Optional

OK = 0
# A bug (Python's own status for an uncaught exception), and a run that
# diverged or stalled (`tfdist.training.step.training_checks`): a restart
# repeats it.
UNEXPECTED = 1
DIVERGED = 1
CONFIG = 2
KILLED = 128 + signal.SIGKILL
PEER_LOST = 200
LEASE_HELD = 201
# The first retryable status (TFJob `restartPolicy: ExitCode`).
RETRYABLE_FROM = 128


def is_retryable(status: int) -> bool:
  """True for statuses a cluster manager should restart (128-255)."""
  return RETRYABLE_FROM <= int(status) <= 255


def first_line(error: object, default: str = "") -> str:
  """The first line of an error's message.

  Args:
    error: any exception (a TensorFlow `OpError` included: its message
      comes first in `str(error)`).
    default: returned when the message is empty or blank.

  Returns:
    The message's first non-blank line without surrounding blanks, else
    `default`.
  """
  text = str(error).strip()
  return text.splitlines()[0].strip() if text else default


# --- status 2: configuration, data, outputs ----------------------------------
class ConfigError(ValueError):
  """A configuration value is invalid. The message names flag, value and fix."""


class ClusterConfigError(ConfigError):
  """The cluster definition is malformed; the message names its source."""


class JobSpecError(ConfigError):
  """The job description or its train flags are invalid; names the field."""


class UnsupportedVersionError(ConfigError):
  """TensorFlow or Keras is outside the supported range (or fails to import).

  The message names the versions found, the supported range and the fix.
  """


class FileSystemUnavailableError(ConfigError):
  """A path's file system scheme is not registered with TensorFlow.

  The message names the flag, the path, the package that provides the
  scheme (if any), the TensorFlow versions it loads with, and the fix.
  """


class TPUNotAvailableError(ConfigError):
  """No usable TPU: the message says what was tried and what to check."""


class DataNotFoundError(ConfigError):
  """A data set or a file pattern could not be found."""


class DataError(ConfigError):
  """An input file is damaged or holds records of another schema."""


class OutputNotWritableError(ConfigError):
  """An output folder cannot be created or written."""


class OutputWriteError(ConfigError):
  """An output folder could not be written during the run (full, denied)."""


class PeerStoppedError(ConfigError):
  """Another task of a MultiWorkerMirrored run stopped at the end of
  training with a status-2 error (its export or manifest could not be
  written, say): this task stops with the same status."""


class ExportRefusedError(ConfigError):
  """The export folder holds something that is not a tfdist SavedModel, or
  overlaps the run's checkpoints, logs or `--model_dir`."""


class DamagedCheckpointError(ConfigError):
  """A checkpoint's index or data cannot be read (status 2)."""


class IncompatibleResumeError(ConfigError):
  """The checkpoint was written by a run with another model or global
  batch (`--allow_incompatible_resume` overrides)."""


class ShardCountMismatchError(ConfigError):
  """A checkpoint's tables are split into a different number of shards."""


class PipelineConfigError(ConfigError):
  """A model cannot be cut into the requested pipeline stages, or the
  stages, micro-batches and devices do not fit together
  (`tfdist.parallel.pipeline`)."""


# --- status 1: divergence and stalls -----------------------------------------
class WeightsShardedError(ConfigError):
  """A ZeRO stage-3 weight (`--zero_stage=3`) was read or assigned where
  it has no whole value: in traced code outside tfdist's step, or between
  steps with replicas on other workers (status 2: the same code fails the
  same way)."""


class TrainingStalledError(FloatingPointError):
  """The optimizer made no update for too many steps in a row."""


class TrainingDivergedError(FloatingPointError):
  """A loss became infinite or NaN."""


class NonFiniteStateError(TrainingDivergedError):
  """The state to be saved holds NaN or infinite values (not saved)."""


# --- 128 + signal, 137: stops and a cluster that did not form ----------------
class PreemptedError(Exception):
  """Training stopped on a signal after saving a checkpoint.

  Attributes:
    signum: the signal received (by this worker or, if none, a peer:
      SIGTERM).
    step: the step at which every worker stopped and saved.
    checkpoint: the checkpoint path this process wrote (None if unknown).
    exit_code: 128 + signum, the shell's convention for "ended by signal".
    resume: how to resume, in the caller's terms (the message's last
      sentence): the binary's flag by default; `tfdist.fit` names the
      `TrainConfig`'s `model_dir`.
  """

  RESUME_WITH_FLAGS = "Run again with the same --model_dir to resume."

  def __init__(self, *, signum: int, step: int, checkpoint: Optional[str],
               resume: str = RESUME_WITH_FLAGS):
    self.signum = signum
    self.step = step
    self.checkpoint = checkpoint
    self.exit_code = 128 + signum
    self.resume = resume
    super().__init__(
        f"Stopped by {signal.Signals(signum).name} at step {step}; checkpoint "
        f"{checkpoint}. {resume}")


class StoppedAtStartError(RuntimeError):
  """SIGTERM or SIGINT arrived while the task waited for its peers.

  Attributes:
    signum: the signal.
    exit_code: 128 + signum (143 for SIGTERM, 130 for SIGINT).
  """

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.signum = signum
    self.exit_code = 128 + signum


class ClusterStartError(RuntimeError):
  """The peers did not all answer within the start-up limit (`tfdist.train`
  exits 137, retryable: the cluster did not form in time)."""


# --- 200: a lost peer; 201: a held lease -------------------------------------
class PeerLostError(RuntimeError):
  """A MultiWorkerMirrored peer worker was lost: restart the cluster.

  `tfdist.train` exits with the retryable status 200 for it.
  """


class CollectiveTimeoutError(PeerLostError):
  """A sub-group collective (`tfdist.parallel.collectives`) timed out: a
  device of the group never joined (a lost or stalled worker, or one that
  ran other collectives). Status 200 like a lost peer; the message names
  the group and the timeout."""


class ParameterServerError(RuntimeError):
  """The parameter-server cluster failed in a way training cannot survive."""


class LeaseHeldError(RuntimeError):
  """Another live run holds the lease on `--model_dir`."""


class LeaseLostError(RuntimeError):
  """This run's lease was taken over by another run (it stalled past the
  timeout); it must stop writing `--model_dir`."""


# --- not raised by a run -----------------------------------------------------
class DiagnoseError(RuntimeError):
  """A child run failed or wrote no manifest; the message says where."""


def exit_code_for(error: BaseException) -> Optional[int]:
  """The exit status for an exception `run_experiment` raised.

  Args:
    error: the exception.

  Returns:
    A status from the table above, or None for an unexpected error (the
    caller lets Python report it: status 1, with the traceback).
  """
  if isinstance(error, (PreemptedError, StoppedAtStartError)):
    return error.exit_code
  if isinstance(error, ClusterStartError):
    return KILLED
  if isinstance(error, (LeaseHeldError, LeaseLostError)):
    return LEASE_HELD
  if isinstance(error, (ParameterServerError, PeerLostError)):
    return PEER_LOST
  if isinstance(error, ConfigError):
    return CONFIG
  if isinstance(error, FloatingPointError):
    return DIVERGED
  return None
