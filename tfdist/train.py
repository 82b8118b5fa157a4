"""Trains a Keras 3 model with a tf.distribute strategy.

Usage:
  python -m tfdist.train --model_dir=DIR [--flag=value ...]
  python -m tfdist.train --flagfile=run.flags
  python -m tfdist.train --dry_run ...   # every start-up check, the plan, exit

Key flags: --helpshort. All flags: --helpfull. Exit statuses (retryable
128-255, permanent 1-127): see tfdist/exit_codes.py and the README.
"""

import logging as std_logging
import os
import sys
import traceback
from typing import Sequence

from tfdist import errors
from tfdist.runtime import quiet_tensorflow  # Standard library only.

# TensorFlow is imported only once the flags are read and checked (a bad
# flag exits in about a second, without TensorFlow's start-up), quietly
# (`quiet_on_import`: the import-time notices left out wherever it comes
# from).
quiet_tensorflow.default_log_level()
quiet_tensorflow.quiet_on_import()

from absl import app  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags as absl_flags  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import logging  # pylint: disable=g-import-not-at-top,wrong-import-position

from tfdist import config as config_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdist import exit_codes  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdist import flags as tfdist_flags  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdist.data import filesystems  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdist.distribute import environment as environment_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdist.distribute import worker_exit  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdist.core.strategy_kind import StrategyKind  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdist.observability import versions  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdist.runtime import allocator  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdist.runtime import cli  # pylint: disable=g-import-not-at-top,wrong-import-position

KEY_FLAGS = tfdist_flags.define_all_flags()
for _name in KEY_FLAGS:
  absl_flags.declare_key_flag(_name)


# Set by `main` once the run has finished (its artifacts written, its done
# marker too): the binary's `run` then ends the process without Python's
# teardown (`_exit_now`). Teardown serves nothing after a finished run and
# costs seconds (TensorFlow's objects freed one by one: 3.5 s after a
# 2-step Mirrored run at load average 7); under `tfdist.launch` a task that
# has written its done marker and has not exited 10 s later is stopped and
# the run counted failed. In a cluster, teardown also tells peers already
# gone about every deleted function (gRPC errors) or hangs on a half-read
# distributed iterator. `main` itself returns (wrapper binaries go on),
# except on the tasks of a multi-worker MultiWorkerMirrored run, which end
# their process inside the run, the chief last (tfdist.distribute.worker_exit).
_LEAVE_WITHOUT_TEARDOWN = False


class _LibraryInfoFilter(std_logging.Filter):
  """Drops INFO records logged by TensorFlow's and Keras's own modules."""

  _LIBRARIES = tuple(f"{os.sep}{name}{os.sep}"
                     for name in ("tensorflow", "keras", "tf_keras"))

  def filter(self, record):
    return (record.levelno >= std_logging.WARNING or
            not any(lib in record.pathname for lib in self._LIBRARIES))


def _quiet_library_info():
  """TensorFlow's Python INFO lines (saver timings, signature renames,
  collective set-up) share absl's log with tfdist's own lines: keep
  tfdist's and the libraries' warnings, drop the libraries' INFO."""
  if not quiet_tensorflow.quiet_requested():
    return
  library_filter = _LibraryInfoFilter()
  for logger in (logging.get_absl_logger(),
                 std_logging.getLogger("tensorflow")):
    logger.addFilter(library_filter)


def _usage_error(error: Exception):
  """Bad input: one line naming flag, value and fix; no usage dump."""
  cli.usage_error("tfdist.train", error)


def failure_message(error: Exception, status: int) -> str:
  """The one line the binary prints for a run that failed with `status`.

  Args:
    error: what `run_experiment` raised.
    status: `tfdist.exit_codes.exit_code_for(error)` (not None).

  Returns:
    `tfdist.train: <error>` where the error carries that status itself (its
    `exit_code`: a preemption, a stop at start), else `tfdist.train:
    error: <error>`.
  """
  prefix = "" if status == getattr(error, "exit_code", None) else "error: "
  return f"tfdist.train: {prefix}{error}"


def _read_config() -> config_lib.TrainConfig:
  """The binary's edge: flags and the environment are read here, once.

  Exits with status 2 (`_usage_error`) on a bad config, a TensorFlow/Keras
  pair tfdist does not support, or a path no installed file system serves.
  """
  try:
    config = tfdist_flags.flags_to_config()
    # Before anything else imports Keras: an unsupported pair is named here
    # rather than failing inside an import.
    versions.check_installed_versions()
    filesystems.require_file_systems(filesystems.config_paths(config))
  except errors.ConfigError as e:
    _usage_error(e)
  return config


def main(argv, *, callbacks: Sequence["keras.callbacks.Callback"] = ()):
  """The binary: flags and environment in, one run, an exit status out.

  A wrapper binary can add Keras callbacks:
  `app.run(functools.partial(tfdist.train.main, callbacks=[...]))`.
  """
  if len(argv) > 1:
    _usage_error(app.UsageError(f"Unexpected arguments: "
                                f"{' '.join(argv[1:])}"))
  config = _read_config()
  environment = environment_lib.read_environment()
  _quiet_library_info()
  allocator.configure_allocator(config.tune_allocator)
  # Imported only now: it imports Keras, after the version check above.
  from tfdist import experiment  # pylint: disable=g-import-not-at-top
  try:
    # A multi-worker MultiWorkerMirrored task ends its process inside the
    # run, right after the final barrier, the chief last; it writes its
    # done marker there (tfdist.distribute.worker_exit).
    result = experiment.run_experiment(
        config, callbacks=callbacks, environment=environment,
        exit_plan=worker_exit.ExitPlan(
            done_file=os.environ.get(worker_exit.DONE_FILE_ENV)))
  except Exception as e:  # pylint: disable=broad-except
    status = exit_codes.exit_code_for(e)
    if status is None:
      raise  # A bug: Python's traceback and status 1.
    if status == exit_codes.CONFIG:
      _usage_error(e)
    # Divergence or a stall, preemption (checkpoint saved), a lost peer, a
    # held lease: one clear message (no traceback) and the status of the table
    # (tfdist.exit_codes). Exit at once, without Python's shutdown: tearing
    # down a half-read distributed iterator (MultiDeviceIterator) was seen
    # to hang there for minutes, after the grace-period watcher had already
    # been released.
    print(failure_message(e, status), file=sys.stderr, flush=True)
    _exit_now(status)
  # This task's work is done: tell the launcher (tfdist.distribute.worker_exit).
  worker_exit.mark_done(os.environ.get(worker_exit.DONE_FILE_ENV))
  global _LEAVE_WITHOUT_TEARDOWN
  _LEAVE_WITHOUT_TEARDOWN = True  # The binary's `run` exits at once.
  if result.get("exit_status"):  # A ps/worker server stopped by a signal.
    sys.exit(result["exit_status"])


def _exit_now(code) -> None:
  """Ends the process with `code` as `sys.exit(code)` would, skipping
  Python's teardown and C++ static destructors: tensorflow-io's S3 file
  system aborts there (exit status 134, "pure virtual method called":
  tensorflow/io#2039), and a cluster process's teardown tells peers already
  gone about every deleted function (gRPC errors) or hangs on a half-read
  distributed iterator."""
  if isinstance(code, str):
    print(code, file=sys.stderr)
    code = 1
  logging.flush()
  std_logging.shutdown()  # Flushes and closes every Python logging handler.
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0 if code is None else code)  # pylint: disable=protected-access


# absl's parser; an unknown flag or a bad value (`--distribution_strategy=
# mirrorred`, `--train_step=40`) is a usage error: one line, status 2.
_parse_flags = cli.flags_parser("tfdist.train")


def run():
  """The entry point of `python -m tfdist.train` and of the `tfdist-train`
  console script."""
  cli.adopt_usage(__doc__, [absl_flags.FLAGS[name] for name in KEY_FLAGS])
  try:
    app.run(main, flags_parser=_parse_flags)
  except SystemExit as e:
    if filesystems.used_tensorflow_io() or _LEAVE_WITHOUT_TEARDOWN:
      _exit_now(e.code)
    raise
  except BaseException as e:  # pylint: disable=broad-except
    if filesystems.used_tensorflow_io():
      traceback.print_exc()
      _exit_now(130 if isinstance(e, KeyboardInterrupt) else 1)
    raise


if __name__ == "__main__":
  run()
