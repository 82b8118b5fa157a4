"""Trains a Keras 3 model with a tf.distribute strategy.

Usage:
  python -m tfdist.train --model_dir=DIR [--flag=value ...]
  python -m tfdist.train --flagfile=run.flags

Key flags: --helpshort. All flags: --helpfull.
"""

import os
import sys

from absl import app
from absl import flags as absl_flags
from absl import logging

import flags as tfdist_flags
from tfdist import allocator
from tfdist import config as config_lib

KEY_FLAGS = tfdist_flags.define_all_flags()
for _name in KEY_FLAGS:
  absl_flags.declare_key_flag(_name)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  try:
    config = tfdist_flags.flags_to_config()
  except config_lib.ConfigError as e:
    raise app.UsageError(str(e)) from None
  allocator.configure_allocator(config.tune_allocator)
  from tfdist import experiment  # pylint: disable=g-import-not-at-top
  from tfdist import preemption  # pylint: disable=g-import-not-at-top
  try:
    experiment.run_experiment(config)
  except config_lib.ConfigError as e:
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


def run():
  app.run(main)


if __name__ == "__main__":
  run()
