"""Exit codes of `tfdist.train`: a contract with cluster managers.

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
| 2 | invalid flags or configuration, missing or damaged data, unwritable outputs (also a full disk or a refused write during the run: a restart on the same volume fails the same way, `tfdist.failures`), overlapping output folders, a damaged checkpoint, a resume the checkpoint's run does not allow | permanent |
| 130, 143 | stopped by SIGINT / SIGTERM after saving a checkpoint, or while waiting for the cluster's peers at start (128 + signal) | retryable |
| 137 | killed (SIGKILL): the grace period after a signal ran out, the cluster did not form in time (also without a kill: peers that never answered), or out of memory | retryable |
| 200 | a peer worker or a ps task was lost (MultiWorkerMirrored, parameter servers) | retryable |
| 201 | `--model_dir` is held by another run's live lease | retryable |

`exit_code_for` maps an exception raised by `run_experiment` to its status.
"""

import signal
from typing import Optional

OK = 0
# A bug (Python's own status for an uncaught exception), and a run that
# diverged or stalled (`tfdist.training_checks`): a restart repeats it.
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


def exit_code_for(error: BaseException) -> Optional[int]:
  """The exit status for an exception `run_experiment` raised.

  Returns:
    A status from the table above, or None for an unexpected error (the
    caller lets Python report it: status 1, with the traceback).
  """
  # Imported here: this module is read by the binary and by job specs, and
  # the error classes live with the code that raises them.
  from tfdist import config as config_lib  # pylint: disable=g-import-not-at-top
  from tfdist import lease  # pylint: disable=g-import-not-at-top
  from tfdist import parameter_server  # pylint: disable=g-import-not-at-top
  from tfdist import preemption  # pylint: disable=g-import-not-at-top
  from tfdist import step_runner  # pylint: disable=g-import-not-at-top
  from tfdist import rendezvous  # pylint: disable=g-import-not-at-top
  if isinstance(error, (preemption.PreemptedError,
                        rendezvous.StoppedAtStartError)):
    return error.exit_code
  if isinstance(error, rendezvous.ClusterStartError):
    return KILLED
  if isinstance(error, (lease.LeaseHeldError, lease.LeaseLostError)):
    return LEASE_HELD
  if isinstance(error, (parameter_server.ParameterServerError,
                        step_runner.PeerLostError)):
    return PEER_LOST
  if isinstance(error, config_lib.ConfigError):
    return CONFIG
  if isinstance(error, FloatingPointError):
    return DIVERGED
  return None
