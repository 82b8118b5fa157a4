"""Trains a Keras 3 model with a tf.distribute strategy.

Usage:
  python -m tfdist.train --model_dir=DIR [--flag=value ...]
  python -m tfdist.train --flagfile=run.flags

Key flags: --helpshort. All flags: --helpfull.
"""

import os
import sys
import traceback
from typing import Sequence

from absl import app
from absl import flags as absl_flags
from absl import logging

from tfdist import allocator
from tfdist import flags as tfdist_flags
from tfdist import config as config_lib
from tfdist import environment as environment_lib
from tfdist import filesystems

KEY_FLAGS = tfdist_flags.define_all_flags()
for _name in KEY_FLAGS:
  absl_flags.declare_key_flag(_name)


def _usage_error(error: Exception):
  """Bad input: one line naming flag, value and fix; no usage dump."""
  print(f"tfdist.train: error: {error}\nSee python -m tfdist.train "
        "--helpshort for the key flags.", file=sys.stderr, flush=True)
  sys.exit(2)


def main(argv, *, callbacks: Sequence["keras.callbacks.Callback"] = ()):
  """The binary: flags and environment in, one run, an exit status out.

  A wrapper binary can add Keras callbacks:
  `app.run(functools.partial(tfdist.train.main, callbacks=[...]))`.
  """
  if len(argv) > 1:
    _usage_error(app.UsageError(f"Unexpected arguments: "
                                f"{' '.join(argv[1:])}"))
  # The binary's edge: flags and the environment are read here, once.
  try:
    config = tfdist_flags.flags_to_config()
  except config_lib.ConfigError as e:
    _usage_error(e)
  from tfdist import versions  # pylint: disable=g-import-not-at-top
  try:
    # Before anything else imports Keras: an unsupported pair is named here
    # rather than failing inside an import.
    versions.check_installed_versions()
    filesystems.require_file_systems(filesystems.config_paths(config))
  except config_lib.ConfigError as e:
    _usage_error(e)
  environment = environment_lib.read_environment()
  allocator.configure_allocator(config.tune_allocator)
  from tfdist import experiment  # pylint: disable=g-import-not-at-top
  from tfdist import preemption  # pylint: disable=g-import-not-at-top
  from tfdist import worker_exit  # pylint: disable=g-import-not-at-top
  try:
    result = experiment.run_experiment(config, callbacks=callbacks,
                                       environment=environment)
  except config_lib.ConfigError as e:
    _usage_error(e)
  except FloatingPointError as e:
    # Diverged or stalled (tfdist.training_checks): a clear message, exit 1.
    logging.error("%s", e)
    sys.exit(f"tfdist.train: error: {e}")
  except preemption.PreemptedError as e:
    # Checkpoint saved; 128 + signal (143 for SIGTERM), as a shell reports.
    print(f"tfdist.train: {e}", file=sys.stderr, flush=True)
    logging.flush()
    sys.stdout.flush()
    # Exit at once, without Python's shutdown: tearing down a half-read
    # distributed iterator (MultiDeviceIterator) was seen to hang there for
    # minutes, after the grace-period watcher had already been released.
    os._exit(e.exit_code)  # pylint: disable=protected-access
  # This task's work is done (after the final barrier): tell the launcher,
  # which then counts the task as finished even if TensorFlow's shutdown
  # hangs or fails (tfdist.worker_exit).
  worker_exit.mark_done(os.environ.get(worker_exit.DONE_FILE_ENV))
  if result.get("exit_status"):  # A ps/worker server stopped by a signal.
    sys.exit(result["exit_status"])


def _exit_now(code) -> None:
  """Ends the process with `code` as `sys.exit(code)` would, skipping C++
  static destructors: tensorflow-io's S3 file system aborts there (exit
  status 134, "pure virtual method called": tensorflow/io#2039)."""
  if isinstance(code, str):
    print(code, file=sys.stderr)
    code = 1
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0 if code is None else code)  # pylint: disable=protected-access


def run():
  """The entry point of `python -m tfdist.train` and of the `tfdist-train`
  console script."""
  # --helpshort lists the key flags of the main module, which absl names by
  # sys.argv[0]: this file under `python -m`, but the wrapper script when pip's
  # console script `tfdist-train` runs.
  for name in KEY_FLAGS:
    absl_flags.FLAGS.register_key_flag_for_module(sys.argv[0],
                                                  absl_flags.FLAGS[name])
  try:
    app.run(main)
  except SystemExit as e:
    if filesystems.used_tensorflow_io():
      _exit_now(e.code)
    raise
  except BaseException as e:  # pylint: disable=broad-except
    if filesystems.used_tensorflow_io():
      traceback.print_exc()
      _exit_now(130 if isinstance(e, KeyboardInterrupt) else 1)
    raise


if __name__ == "__main__":
  run()
