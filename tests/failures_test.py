"""Unit tests of tfdist.runtime.failures: foreseeable failures as one named line.

A full disk cannot be made here (no tmpfs of our own), so the OSErrors a
full disk raises are constructed with their real errno; a refused write is
real where the tests do not run as root (root writes anywhere).
"""

import errno
import os

import pytest
import tensorflow as tf

from tests import testutil
from tfdist import errors
from tfdist.runtime import failures

FOLDERS = {"--model_dir": "/runs/m", "--export_dir": "/runs/m/export"}


def _full_disk():
  return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC),
                 "/runs/m/export/variables/variables.data-00000-of-00001")


@pytest.mark.compat
def test_a_full_disk_names_the_deepest_folder_and_the_checkpoint():
  named = failures.describe(_full_disk(), folders=FOLDERS,
                            last_checkpoint="/runs/m/checkpoints/ckpt-40",
                            step=41)
  assert isinstance(named, errors.OutputWriteError)
  assert errors.exit_code_for(named) == errors.CONFIG
  message = str(named)
  assert message.startswith("--export_dir=/runs/m/export: a write failed at "
                            "step 41: the disk or quota is full (OSError: ")
  assert "free space there or give a larger volume" in message
  assert message.endswith("resume from /runs/m/checkpoints/ckpt-40.")


@pytest.mark.compat
@pytest.mark.parametrize("number", [errno.EDQUOT, errno.EFBIG])
def test_a_quota_or_file_size_limit_is_a_full_disk(number):
  error = OSError(number, os.strerror(number), "/elsewhere/file")
  named = failures.describe(error, folders=FOLDERS)
  assert "the disk or quota is full" in str(named)
  # A path under no output folder: `--model_dir` is named.
  assert str(named).startswith("--model_dir=/runs/m: ")
  assert str(named).endswith("; nothing was checkpointed yet.")


@pytest.mark.compat
def test_tensorflow_words_of_a_full_disk():
  error = tf.errors.ResourceExhaustedError(
      None, None, "/runs/m/checkpoints/ckpt-3_temp; No space left on device")
  assert "the disk or quota is full" in str(
      failures.describe(error, folders=FOLDERS))
  other = tf.errors.ResourceExhaustedError(None, None, "OOM allocating")
  assert failures.describe(other, folders=FOLDERS) is None


@pytest.mark.compat
@pytest.mark.parametrize("number", [errno.EACCES, errno.EPERM, errno.EROFS])
def test_a_refused_write(number):
  error = PermissionError(number, os.strerror(number), "/runs/m/ckpt")
  named = failures.describe(error, folders=FOLDERS, step=2)
  assert isinstance(named, errors.OutputWriteError)
  assert "this process may no longer write there" in str(named)
  assert "restore write access" in str(named)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_real_refused_write():
  folder = testutil.scratch_dir()
  os.chmod(folder, 0o500)
  try:
    with pytest.raises(errors.OutputWriteError, match=f"--model_dir={folder}"):
      with failures.named_failures({"--model_dir": folder}):
        with open(os.path.join(folder, "x"), "w"):
          pass
  finally:
    os.chmod(folder, 0o700)


@pytest.mark.compat
def test_a_vanished_data_file_is_named_only_under_the_data_folders():
  error = FileNotFoundError(errno.ENOENT, "No such file",
                            "/data/train-00003.tfrecord")
  named = failures.describe(error, folders=FOLDERS,
                            data_folders=("/data",))
  assert isinstance(named, errors.DataNotFoundError)
  assert "A file the run reads vanished during training" in str(named)
  assert failures.describe(error, folders=FOLDERS,
                           data_folders=("/other",)) is None


@pytest.mark.compat
def test_other_errors_pass_through():
  assert failures.describe(ValueError("a bug"), folders=FOLDERS) is None
  with pytest.raises(OSError) as caught:
    with failures.named_failures(FOLDERS):
      raise OSError(errno.ECONNRESET, "reset")
  assert caught.value.errno == errno.ECONNRESET


def test_named_failures_chains_the_cause_and_finds_the_checkpoint():
  directory = testutil.scratch_dir()
  step = tf.Variable(7, dtype=tf.int64)
  tf.train.CheckpointManager(tf.train.Checkpoint(step=step), directory,
                             max_to_keep=1).save(checkpoint_number=7)
  cause = _full_disk()
  with pytest.raises(errors.OutputWriteError) as caught:
    with failures.named_failures(FOLDERS, checkpoint_dir=directory):
      raise cause
  assert caught.value.__cause__ is cause
  assert str(caught.value).endswith(
      f"resume from {os.path.join(directory, 'ckpt-7')}.")


@pytest.mark.compat
def test_what_happened():
  graph = tf.errors.UnknownError(None, None, (
      "Graph execution error:\n\nDetected at node Save\n"
      "  File \"train.py\", line 3\n"
      "{{function_node __inference_save_9}} write failed: disk full\n"
      "\t [[{{node SaveV2}}]]"))
  assert failures.what_happened(graph) == "write failed: disk full"
  plain = tf.errors.NotFoundError(
      None, None, "{{function_node __inference_f_1}} x.index gone\nmore")
  assert failures.what_happened(plain) == "x.index gone"
  assert failures.what_happened(OSError()) == "OSError"


@pytest.mark.compat
def test_data_folders():
  assert failures.data_folders("/d/a-*.gz,/d/b.gz", "", None,
                               "gs://b/eval/*") == ("/d", "gs://b/eval")
