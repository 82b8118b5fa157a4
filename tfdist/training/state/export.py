"""SavedModel export with a serving signature, its contract, and its folder.

The `serving_default` signature is the Keras model itself: it does not
contain the input parser's preprocessing, so a client must give inputs
exactly as the data set's parser makes them (README "Serving", with a
serving example that `tests/cluster_faults_test.py` runs):

* image models (`cnn`, `resnet`; `fashion_mnist`): keyword `image`,
  float32 [batch, 28, 28, 1], pixels scaled to [0, 1] (uint8 / 255, as
  `tfdist.data.fashion_mnist.parse_image_example` does); output `output_0`,
  float32 logits [batch, 10];
* `ranking` (`movielens`): keywords `user_id`, `item_id`, `gender`,
  `occupation`, `zip3` (string [batch, 1]) and `dense` (float32
  [batch, 21]), as `tfdist.data.movielens.parse_example` makes them; output
  `output_0`, float32 probability [batch, 1];
* `transformer` (`clothing_reviews`): keyword `tokens`, int64 [batch, 128],
  word ids of the conversion's `vocabulary.txt` (0 pads), as
  `tfdist.data.clothing_reviews` tokenizes; output `output_0`, float32
  probability [batch, 1].

Any model's signature (its `keras.Input` names, dtypes and shapes, and its
outputs) is logged at export (`describe_signature`).

The export folder holds the SavedModel only (`saved_model.pb` at its top,
as Vertex AI and TF Serving load it) and `tfdist_export.json`, the mark that
tfdist wrote it. An export replaces an existing folder only when it bears
that mark; any other non-empty folder is refused (`check_export_dir`, at
start; again at export). `check_layout` keeps the export folder apart from
the run's other folders (docs/design/nothing-lost.md).
"""

import contextlib
import json
import os
import posixpath
import re
import time
import uuid
from typing import Mapping, Optional, Tuple

from absl import logging
import keras
import tensorflow as tf

from tfdist import errors
from tfdist.errors import first_line
from tfdist.runtime import failures

# Written into every SavedModel folder tfdist exports: the only folders an
# export may replace.
MARKER_FILE = "tfdist_export.json"
SAVED_MODEL_FILE = "saved_model.pb"

# What a run writes directly under `--model_dir` and under the TensorBoard
# folder: an export folder inside either must not be one of these
# (checkpoints: `tfdist.config`; metrics:
# `tfdist.observability.run_log.METRICS_FILE`; the manifest:
# `tfdist.observability.manifest.MANIFEST_FILE`; the lease:
# `tfdist.distribute.lease.LEASE_FILE`; the done marker:
# `tfdist.distribute.parameter_server.DONE_MARKER`; evaluations: `eval/`).
MODEL_DIR_ENTRIES = ("checkpoints", "eval", "metrics.jsonl",
                     "run_manifest.json", "lease.json", "training_done")
# Keras's TensorBoard callback writes `train/` and `validation/`, evaluators
# `eval/`.
TENSORBOARD_ENTRIES = ("train", "validation", "eval")
# What the checkpoint folder holds: `ckpt-N.*`, `ckpt-N_temp/`, the
# `checkpoint` index, `run_config.json` (`tfdist.training.state.checkpointing`)
# and `shards.json` (`tfdist.distribute.parameter_server`): names starting with
# these.
CHECKPOINT_PREFIXES = ("ckpt", "checkpoint", "run_config.json",
                       "shards.json")


def _normalized(path: str) -> str:
  """`path` without trailing slashes or `.`/`..` steps (local paths made
  absolute and symbolic links resolved), for comparing folders."""
  if "://" in path:
    scheme, rest = path.split("://", 1)
    return f"{scheme}://" + posixpath.normpath("/" + rest).lstrip("/")
  return os.path.realpath(os.path.abspath(path))


def _relative(path: str, folder: str) -> Optional[Tuple[str, ...]]:
  """The components of `path` below `folder` (`()` when equal), or None
  when `path` is not inside `folder` (both `_normalized`)."""
  if path == folder:
    return ()
  prefix = folder.rstrip("/") + "/"
  if not path.startswith(prefix):
    return None
  return tuple(p for p in path[len(prefix):].split("/") if p)


def check_layout(*, export_dir: Tuple[str, str],
                 model_dir: Tuple[str, str],
                 checkpoint_dir: Tuple[str, str],
                 tensorboard_dir: Tuple[str, str]):
  """Refuses an export folder that would replace the run's other outputs.

  Each argument is `(folder, source)`: the folder as the run will use it
  and what chose it, e.g. `("/runs/a", "--model_dir")`, `("gs://b/model",
  "$AIP_MODEL_DIR (--export_dir)")`. An export replaces its whole folder, so
  the export folder must not be, or contain, `--model_dir`, the checkpoint
  folder or the TensorBoard folder; inside one of them it must not be (or
  lie inside) an entry the run writes there (`MODEL_DIR_ENTRIES`,
  `CHECKPOINT_PREFIXES`, `TENSORBOARD_ENTRIES`). The default,
  `<model_dir>/saved_model`, passes.

  Raises:
    ExportRefusedError: the first overlap, naming both sources, both
      folders and the fix (status 2).
  """
  export_path, export_source = export_dir
  export = _normalized(export_path)
  problem = None
  taken = (
      (model_dir, lambda name: name in MODEL_DIR_ENTRIES),
      (checkpoint_dir, lambda name: name.startswith(CHECKPOINT_PREFIXES)),
      (tensorboard_dir, lambda name: name in TENSORBOARD_ENTRIES))
  for (path, source), _ in taken:
    folder = _normalized(path)
    if _relative(folder, export) is not None:
      problem = (f"{source}={path} is "
                 f"{'the same folder as' if folder == export else 'inside'} "
                 f"{export_source}={export_path}")
      break
  for (path, source), is_taken in taken if problem is None else ():
    below = _relative(export, _normalized(path))
    if below is not None and is_taken(below[0]):
      problem = (f"{export_source}={export_path} is inside {source}={path}, "
                 f"where the run writes {below[0]}")
      break
  if problem is None:
    return
  raise errors.ExportRefusedError(
      f"{problem}: the SavedModel export replaces its whole folder, which "
      "would delete the run's checkpoints or logs. Give the SavedModel a "
      "folder of its own (e.g. --export_dir=<model_dir>/saved_model, the "
      "default) or another --model_dir; on Vertex AI set AIP_CHECKPOINT_DIR "
      "beside AIP_MODEL_DIR (a base output directory sets both).")


def is_tfdist_export(path: str) -> bool:
  """True when `path` is a SavedModel folder tfdist wrote (its mark and
  `saved_model.pb` are there)."""
  return (tf.io.gfile.exists(os.path.join(path, MARKER_FILE)) and
          tf.io.gfile.exists(os.path.join(path, SAVED_MODEL_FILE)))


def _replaceable(path: str) -> bool:
  """True when an export may take `path`: absent, an empty folder, or a
  SavedModel tfdist wrote."""
  if not tf.io.gfile.exists(path):
    return True
  if not tf.io.gfile.isdir(path):
    return False
  return not tf.io.gfile.listdir(path) or is_tfdist_export(path)


def check_export_dir(export_dir: str, *, source: str = "--export_dir"):
  """Checks at start that the final export may write `export_dir`.

  Raises:
    ExportRefusedError: it exists and is neither an empty folder nor a
      SavedModel tfdist wrote (status 2).
  """
  if not _replaceable(export_dir):
    raise errors.ExportRefusedError(_refusal(export_dir, source))


def _refusal(export_dir: str, source: str, new: str = "") -> str:
  kept = (f" The new SavedModel was left at {new}." if new else "")
  return (f"{source}={export_dir} exists and is not a SavedModel tfdist "
          f"wrote (no {MARKER_FILE}): tfdist replaces only its own exports "
          "and never deletes other files." + kept + " Give an empty or new "
          "folder, or move that one away.")


# The folders an export makes beside `export_dir` (`_scratch_name`): the
# SavedModel being written, and the previous export moved aside.
_TEMPORARY = "tmp"
_PREVIOUS = "old"


def _scratch_name(export_dir: str, kind: str, tag: str) -> str:
  """`.<kind>-export-<export folder's name>-<8 hex digits>`, beside
  `export_dir`: the only names `remove_stale_exports` removes."""
  parent = os.path.dirname(export_dir.rstrip("/")) or "."
  base = os.path.basename(export_dir.rstrip("/"))
  return os.path.join(parent, f".{kind}-export-{base}-{tag}")


def _scratch_folders(export_dir: str, kind: str) -> list:
  """The `_scratch_name` folders of `kind` beside `export_dir`."""
  parent = os.path.dirname(export_dir.rstrip("/")) or "."
  base = os.path.basename(export_dir.rstrip("/"))
  pattern = re.compile(rf"\.{kind}-export-{re.escape(base)}-[0-9a-f]{{8}}/?$")
  return [os.path.join(parent, name.rstrip("/"))
          for name in tf.io.gfile.listdir(parent) if pattern.match(name)]


def _remove_quietly(path: str) -> bool:
  """Removes folder `path`; False (and a warning) when it cannot."""
  try:
    if tf.io.gfile.exists(path):
      tf.io.gfile.rmtree(path)
    return True
  except (tf.errors.OpError, OSError) as e:
    logging.warning("Could not remove the unfinished export %s: %s", path,
                    failures.what_happened(e))
    return False


def remove_stale_exports(export_dir: str) -> list:
  """Removes what an earlier export to `export_dir` left when it failed.

  Run at start by the process that writes the export, once it holds the
  `--model_dir` lease (no other run of it is exporting). Only tfdist's own
  names beside `export_dir` are touched: `.tmp-export-<name>-<hex>`
  folders without the mark (a SavedModel whose writing failed part way),
  and `.old-export-<name>-<hex>` folders (a previous export moved aside)
  once `export_dir` holds a whole tfdist export again. A temporary folder
  that has the mark is a whole SavedModel (an export refused at its end,
  or a failed move): it is kept, and named in a warning. Errors (a parent
  that cannot be listed) are left to the output probes to report.

  Args:
    export_dir: the run's export folder (local or `gs://`).

  Returns:
    The folders removed.
  """
  removed = []
  try:
    temporary = _scratch_folders(export_dir, _TEMPORARY)
    previous = _scratch_folders(export_dir, _PREVIOUS)
    replaced = is_tfdist_export(export_dir)
  except (tf.errors.OpError, OSError):
    return removed
  for path in temporary:
    if tf.io.gfile.exists(os.path.join(path, MARKER_FILE)):
      logging.warning("%s is a whole SavedModel an earlier export left "
                      "(kept); move or remove it yourself.", path)
    elif _remove_quietly(path):
      removed.append(path)
  for path in previous:
    if not replaced:
      logging.warning("%s is the previous export, moved aside by an export "
                      "that did not finish (kept: %s holds no SavedModel); "
                      "move it back to keep it.", path, export_dir)
    elif _remove_quietly(path):
      removed.append(path)
  if removed:
    logging.info("Removed %d unfinished export folder(s) of an earlier run: "
                 "%s", len(removed), ", ".join(removed))
  return removed


def _move_folder(src: str, dst: str):
  """Renames folder `src` to `dst` (which does not exist).

  A local rename is one atomic step. An object store (`gs://`, `s3://`)
  has no folders to rename: each object is copied, then `src` is deleted
  (tensorflow-io's S3 rename of a folder failed now and then with "Source
  is a directory or empty file" against an S3 server).
  """
  if "://" not in src:
    tf.io.gfile.rename(src, dst)
    return
  for folder, _, files in tf.io.gfile.walk(src):
    rel = os.path.relpath(folder, src)
    target = dst if rel == "." else os.path.join(dst, rel)
    tf.io.gfile.makedirs(target)
    for name in files:
      tf.io.gfile.copy(os.path.join(folder, name), os.path.join(target, name),
                       overwrite=True)
  tf.io.gfile.rmtree(src)


@contextlib.contextmanager
def _absl_level_kept():
  """Restores absl's logger level after the block. Saving a SavedModel
  sets absl's verbosity to FATAL and back to the value `get_verbosity`
  reported (TensorFlow's `AutoTrackable._trackable_children`), which
  leaves the level set explicitly (WARNING by default) where it was
  inherited: a script that logs at INFO through Python's root logger
  would lose absl's INFO lines after an export."""
  absl_logger = logging.get_absl_logger()
  level = absl_logger.level
  try:
    yield
  finally:
    absl_logger.setLevel(level)


def exportable(model: keras.Model, features) -> Optional[str]:
  """Makes `model` exportable if it can be; returns why not, else None.

  Keras exports a subclassed model only once it has been called (it reads
  the input signature from that call); a model whose own `train_step`
  trains it may never have been (built with `build`), or may have no
  `call` at all (a GAN of Keras's tutorial). A subclassed model without
  recorded input shapes is called here once, on a batch of one zero
  example of `features`.

  Args:
    model: the trained Keras model.
    features: `tf.TensorSpec`s of one unbatched example's features (a
      nest), as `tfdist.training.task.example_spec` gives them.

  Returns:
    None (exportable), or the reason there is no SavedModel to write (the
    model cannot be called on its features).
  """
  if (isinstance(model, keras.Sequential) or
      type(model).__name__ == "Functional"):
    return None  # Their inputs are their signature.
  shapes = getattr(model, "_build_shapes_dict", None) or {}
  if (getattr(model, "_called", False) and shapes and
      all(v is not None for v in shapes.values())):
    return None  # Called and built on its inputs: Keras reads those.
  zeros = tf.nest.map_structure(
      lambda s: tf.zeros([1, *[d or 1 for d in s.shape]], s.dtype), features)
  try:
    model(zeros, training=False)
  except Exception as e:  # pylint: disable=broad-except
    return (f"{type(model).__name__} cannot be called on its features "
            f"{features} ({type(e).__name__}: {first_line(e)}), and a "
            "SavedModel serves the model's call")
  return None


def export_saved_model(model: keras.Model, export_dir: str, *,
                       source: str = "--export_dir",
                       details: Optional[Mapping[str, object]] = None,
                       last_checkpoint: Optional[str] = None) -> str:
  """Exports `model` as a TensorFlow SavedModel with a `serving_default`.

  The signature takes the model's inputs under their input names (e.g.
  `image`: float32 [batch, 28, 28, 1] scaled to [0, 1]) and returns
  `{"output_0": float32 outputs}` (see the module docstring). The export goes
  to a temporary sibling folder, gets its mark (`MARKER_FILE`: JSON with
  `written_by`, `time` and `details`), and is renamed to `export_dir`. An
  existing `export_dir` is replaced only when it is a SavedModel tfdist
  wrote (moved aside, the new one renamed in, then the old one removed) or
  an empty folder: `export_dir` is always a whole SavedModel, and nothing
  else is ever deleted.

  Args:
    model: the Keras model to export.
    export_dir: the SavedModel folder (local or `gs://`).
    source: the flag or variable that chose `export_dir`, for messages.
    details: JSON-serializable facts recorded in the mark (e.g. the step).
    last_checkpoint: the run's newest checkpoint, named by a failure's
      message as the one to resume from.

  Returns:
    `export_dir`.

  Raises:
    ExportRefusedError: `export_dir` holds something else; the new
      SavedModel is left in its temporary folder, named in the message.
    tfdist.errors.OutputWriteError: the disk or quota of `export_dir`'s
      volume is full, or writing there is refused: the message names
      `source` (status 2); the temporary folder is removed.
  """
  parent = os.path.dirname(export_dir.rstrip("/")) or "."
  tag = uuid.uuid4().hex[:8]
  tmp = _scratch_name(export_dir, _TEMPORARY, tag)
  try:
    tf.io.gfile.makedirs(parent)
    with _absl_level_kept():
      model.export(tmp, format="tf_saved_model", verbose=False)
    with tf.io.gfile.GFile(os.path.join(tmp, MARKER_FILE), "w") as f:
      f.write(json.dumps({"written_by": "tfdist",
                          "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                time.gmtime()),
                          "details": dict(details or {})}, sort_keys=True,
                         default=str))
  except BaseException as e:
    _remove_quietly(tmp)  # An unfinished SavedModel: nothing to keep.
    if isinstance(e, (tf.errors.OpError, OSError)):
      named = failures.describe(e, folders={source: export_dir},
                                last_checkpoint=last_checkpoint)
      if named is not None:
        raise named from e
    raise
  if not _replaceable(export_dir):
    raise errors.ExportRefusedError(_refusal(export_dir, source, new=tmp))
  old = None
  if tf.io.gfile.exists(export_dir):
    if tf.io.gfile.listdir(export_dir):
      old = _scratch_name(export_dir, _PREVIOUS, tag)
      _move_folder(export_dir, old)
    else:
      tf.io.gfile.rmtree(export_dir)  # An empty folder: nothing is lost.
  _move_folder(tmp, export_dir)
  if old is not None:
    tf.io.gfile.rmtree(old)  # The previous tfdist export, checked above.
  logging.info("SavedModel written to %s; its signature: %s", export_dir,
               describe_signature(export_dir))
  return export_dir


SERVING_SIGNATURE = "serving_default"


def _tensor_text(info) -> str:
  """`float32 [batch, 28, 28, 1]` for a `TensorInfo` proto."""
  dtype = tf.dtypes.as_dtype(info.dtype).name
  if info.tensor_shape.unknown_rank:
    return f"{dtype} [unknown rank]"
  dims = ["batch" if i == 0 and d.size < 0 else ("?" if d.size < 0
                                                 else str(d.size))
          for i, d in enumerate(info.tensor_shape.dim)]
  return f"{dtype} [{', '.join(dims)}]"


def signature(export_dir: str, name: str = SERVING_SIGNATURE) -> dict:
  """The inputs and outputs of a SavedModel's signature, read from its
  `saved_model.pb` (no variables are loaded).

  Args:
    export_dir: the SavedModel folder (local or `gs://`).
    name: the signature.

  Returns:
    `{"inputs": {keyword: "dtype [shape]"}, "outputs": {key: "dtype
    [shape]"}}`, each sorted by name; a dimension of unknown size is `?`
    (`batch` when it is the first).

  Raises:
    KeyError: the SavedModel has no serving graph or no signature `name`.
  """
  from tensorflow.core.protobuf import saved_model_pb2  # pylint: disable=g-import-not-at-top
  saved = saved_model_pb2.SavedModel()
  with tf.io.gfile.GFile(os.path.join(export_dir, SAVED_MODEL_FILE),
                         "rb") as f:
    saved.ParseFromString(f.read())
  graphs = [g for g in saved.meta_graphs
            if tf.saved_model.SERVING in g.meta_info_def.tags]
  if not graphs or name not in graphs[0].signature_def:
    raise KeyError(f"{export_dir} has no {name!r} serving signature.")
  sig = graphs[0].signature_def[name]
  return {"inputs": {k: _tensor_text(v) for k, v in sorted(sig.inputs.items())},
          "outputs": {k: _tensor_text(v)
                      for k, v in sorted(sig.outputs.items())}}


def describe_signature(export_dir: str,
                       name: str = SERVING_SIGNATURE) -> str:
  """`serving_default(image: float32 [batch, 28, 28, 1]) -> output_0:
  float32 [batch, 10]`: `signature` in one line (see it)."""
  sig = signature(export_dir, name)
  join = lambda part: ", ".join(f"{k}: {v}" for k, v in sig[part].items())
  return f"{name}({join('inputs')}) -> {join('outputs')}"

