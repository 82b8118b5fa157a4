"""Start-up checks that need neither data nor a model: names and outputs.

Run first, right after the flags are read and the cluster is known
(`tfdist.experiment.run_experiment`), so that a run that cannot finish
stops in seconds with one line naming the flag:

* `check_names`: the registered `--dataset`, `--model` and
  `--hptune_metric` exist and fit together (run by `tfdist.job_spec` on
  every replica's flags: the part of `--dry_run` that needs no access to
  the job's code and files; a run resolves them itself,
  `tfdist.training.task.from_names`);
* `check_no_keras_distribution`: a `keras.distribution` distribution set
  in the process (ignored by Keras under TensorFlow) is refused;
* `probe_outputs`: the process that writes `--model_dir` creates every
  output folder (model, checkpoints, TensorBoard, export) and writes and
  deletes a probe file in each (folders it had to create are removed
  again); other workers probe their scratch folders.
  A folder that cannot be written fails with `--model_dir=DIR is not
  writable: <reason>`.
"""

import dataclasses
import os
import uuid
from typing import List, Optional, Tuple

import tensorflow as tf

from tfdist import config as config_lib
from tfdist.cloud import hptune
from tfdist import errors
from tfdist.errors import first_line
from tfdist.training.step import objectives
from tfdist.core import registry
from tfdist.training import task as task_lib


# The output folders a run writes: the config's outputs section
# (`--model_dir`, `--checkpoint_dir`, `--tensorboard_dir`, `--export_dir`,
# and the folders derived from `--model_dir`: `resolved_checkpoint_dir`,
# ...), handed to this part as it is.
OutputOptions = config_lib.OutputsConfig


def decided_outputs(outputs: OutputOptions, decisions=None) -> OutputOptions:
  """The outputs section `outputs` with the folders the run's `decisions`
  (`tfdist.distribute.decisions.Decisions`: the environment's, a tuning
  trial's) chose; None: `outputs` as given."""
  if decisions is None:
    return outputs
  values = decisions.field_values()
  return dataclasses.replace(
      outputs, model_dir=decisions.model_dir,
      checkpoint_dir=values["checkpoint_dir"],
      tensorboard_dir=values["tensorboard_dir"],
      export_dir=values["export_dir"])


def check_names(task, cloud):
  """Checks that the names a run gives tfdist's registries exist and fit.

  The part of `--dry_run` a job-spec writer can run where the job's code
  and files are not: a `--model` or `--dataset` given as an import path,
  `--import_modules` and `--feature_spec` are the user's, checked by the
  job itself at start.

  Args:
    task: the config's model and data section (`tfdist.config.TaskConfig`:
      `model`, `data.dataset`, `feature_spec`, `import_modules`).
    cloud: the config's cloud section (`tfdist.config.CloudConfig`:
      `hptune_metric`).

  Raises:
    ConfigError: an unknown registered `--dataset` or `--model` (the
      message lists the known ones), or an `--hptune_metric` the data set's
      task does not produce.
  """
  if task.import_modules:
    return
  task_lib.load_builtins()
  if not registry.is_import_path(task.model):
    registry.get_model_builder(task.model)
  if task.feature_spec or registry.is_import_path(task.data.dataset):
    return
  spec = registry.get_dataset(task.data.dataset)
  if (cloud.hptune_metric and spec.task and
      not registry.is_import_path(task.model)):
    # tfdist's own models evaluate the data set's default loss and metrics.
    _, metrics = objectives.task_defaults(spec.task)
    hptune.check_metric(cloud.hptune_metric,
                        available=["loss", *(m.name for m in metrics)])


def check_no_keras_distribution(distribution=None):
  """Refuses a `keras.distribution` distribution set in this process.

  Keras 3 reads `keras.distribution.set_distribution(...)` only on the JAX
  backend (its TensorFlow path is a DTensor prototype): under TensorFlow it
  is dropped without a word, and tfdist distributes with `tf.distribute`.
  The message names tfdist's flags for the same layouts.

  Args:
    distribution: the distribution to check; None: the process's
      (`keras.distribution.distribution()`).

  Raises:
    ConfigError: a distribution is set (status 2).
  """
  if distribution is None:
    import keras  # pylint: disable=g-import-not-at-top
    distribution = keras.distribution.distribution()
  if distribution is None:
    return
  kind = type(distribution).__name__
  if kind == "DataParallel":
    same = ("for data parallel training use --distribution_strategy="
            "mirrored (one host; --num_cpu_devices on a CPU) or "
            "multi_worker_mirrored (TF_CONFIG or --worker_hosts), or auto")
  else:
    same = ("for model parallel layouts use --zero_stage=1 or 2 (optimizer "
            "state and gradients sharded over the replicas) or "
            "--distribution_strategy=parameter_server (variables and "
            "embedding tables sharded over ps tasks), and for its tensor "
            "parallel layout pass its LayoutMap to tfdist.fit(model_fn, "
            "..., layout_map=...) (Dense split by columns or rows, "
            "MultiHeadAttention by heads)")
  raise errors.ConfigError(
      f"keras.distribution.set_distribution({kind}(...)) is set in this "
      "process, which Keras ignores under the TensorFlow backend; tfdist "
      f"distributes with tf.distribute instead: {same}. Remove the "
      "set_distribution call (or call "
      "keras.distribution.set_distribution(None)) before tfdist runs.")


def output_folders(outputs: OutputOptions) -> List[Tuple[str, str, str]]:
  """`(flag, value, folder)` of every folder the writing process fills.

  The SavedModel is written next to `--export_dir` and renamed into it, so
  its parent folder is probed. A folder named twice is listed once (the
  first flag that names it).
  """
  model_dir = outputs.model_dir
  out = [("--model_dir", model_dir, model_dir)]
  for flag, value, folder in (
      ("--checkpoint_dir", outputs.checkpoint_dir,
       outputs.resolved_checkpoint_dir),
      ("--tensorboard_dir", outputs.tensorboard_dir,
       outputs.resolved_tensorboard_dir),
      ("--export_dir", outputs.export_dir,
       os.path.dirname(outputs.resolved_export_dir.rstrip("/")) or ".")):
    if value:
      out.append((flag, value, folder))
    else:  # Derived from --model_dir.
      out.append(("--model_dir", model_dir, folder))
  seen, unique = set(), []
  for item in out:
    if item[2] not in seen:
      seen.add(item[2])
      unique.append(item)
  return unique


def _reason(folder: str, error: Exception) -> str:
  """Why `folder` cannot be written, in words (not a bare errno)."""
  if "://" not in folder:
    parent = folder
    while parent and parent != os.path.dirname(parent):
      if os.path.exists(parent):
        if not os.path.isdir(parent):
          return f"{parent} is a file, not a folder"
        break
      parent = os.path.dirname(parent)
  return (f"{type(error).__name__}: "
          f"{first_line(error, default=type(error).__name__)}")


def _missing_folders(folder: str) -> List[str]:
  """`folder` and those of its parents that do not exist, deepest first
  (never above a bucket: `gs://bucket`, `s3://bucket`)."""
  missing = []
  path = folder.rstrip("/")
  while path:
    if "://" in path and "/" not in path.split("://", 1)[1]:
      break  # A bucket: not created by the run, never removed.
    try:
      if tf.io.gfile.exists(path):
        break
    except (tf.errors.OpError, OSError):
      break  # Let makedirs say what is wrong.
    missing.append(path)
    parent = os.path.dirname(path)
    if parent == path:
      break
    path = parent
  return missing


# Tries of a probe whose folder another task removed meanwhile.
_PROBE_ATTEMPTS = 3


def probe_writable(folder: str, *, flag: str, value: str):
  """Creates `folder`, writes and deletes a probe file in it.

  Folders the probe had to create are removed again (the run creates them
  when it writes there), and the probe file also when its write failed (a
  full disk), so a run stopped at start leaves nothing behind.

  Args:
    folder: the folder to probe (local or `gs://`).
    flag, value: the flag (and its value) that chose the folder, for the
      message.

  Raises:
    OutputNotWritableError: `{flag}={value} is not writable: <reason>`.
  """
  probe = os.path.join(folder, f".tfdist-probe-{uuid.uuid4().hex[:8]}")
  created = _missing_folders(folder)
  for attempt in range(_PROBE_ATTEMPTS):
    try:
      tf.io.gfile.makedirs(folder)
      with tf.io.gfile.GFile(probe, "w") as f:
        f.write("tfdist write probe\n")
      tf.io.gfile.remove(probe)
      break
    except tf.errors.NotFoundError as e:
      # Another task of the run probing the same new folder removed it
      # between our makedirs and our write: make it again.
      if attempt + 1 < _PROBE_ATTEMPTS:
        continue
      error = e
    except (tf.errors.OpError, OSError) as e:
      error = e
    # A write that failed (a full disk) may have left the file, empty.
    try:
      if tf.io.gfile.exists(probe):
        tf.io.gfile.remove(probe)
    except (tf.errors.OpError, OSError):
      pass
    where = "" if folder == value else f" ({folder})"
    raise errors.OutputNotWritableError(
        f"{flag}={value} is not writable{where}: {_reason(folder, error)}. "
        "Give a folder this process can create and write (local, a "
        "mounted bucket, or gs://BUCKET/PATH).") from None
  for path in created:  # Best effort: object stores have no real folders.
    try:
      if "://" not in path:
        # Only if still empty: another task may be probing it too.
        os.rmdir(path)
      elif tf.io.gfile.isdir(path) and not tf.io.gfile.listdir(path):
        tf.io.gfile.rmtree(path)
    except (tf.errors.OpError, OSError):
      break


def probe_outputs(outputs: OutputOptions):
  """Probes every output folder of the process that writes `--model_dir`.

  Args:
    outputs: the run's folders (`decided_outputs`).

  Raises:
    OutputNotWritableError: the first folder that cannot be written.
  """
  for flag, value, folder in output_folders(outputs):
    probe_writable(folder, flag=flag, value=value)
