"""`tfdist.training.state.export`: the SavedModel folder is tfdist's alone.

* `check_layout` refuses an export folder that is, holds, or lies in an
  entry of the run's other folders, and passes the default;
* `check_export_dir` and `export_saved_model` replace only a folder tfdist
  marked (or an empty one) and never delete anything else;
* an export carries its mark (`tfdist_export.json`) and serves the model.
"""

import json
import os

from absl import logging
from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import testutil
from tfdist import errors
from tfdist.training.state import export

pytestmark = pytest.mark.compat


def _layout(export_dir, model_dir="/r/run",
            checkpoint_dir="/r/run/checkpoints", tensorboard_dir="/r/run"):
  return dict(export_dir=(export_dir, "--export_dir"),
              model_dir=(model_dir, "--model_dir"),
              checkpoint_dir=(checkpoint_dir, "--checkpoint_dir"),
              tensorboard_dir=(tensorboard_dir, "--tensorboard_dir"))


def _model():
  return keras.Sequential([keras.Input((3,), name="x"),
                           keras.layers.Dense(2)])


class LayoutTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("default", "/r/run/saved_model"),
      ("elsewhere", "/exports/one"),
      ("gcs_elsewhere", "gs://b/exports/one"))
  def test_a_folder_of_its_own_passes(self, export_dir):
    export.check_layout(**_layout(export_dir))

  @parameterized.named_parameters(
      ("is_model_dir", "/r/run", "the same folder as"),
      ("holds_model_dir", "/r", "is inside"),
      ("trailing_slash_and_dots", "/r/x/../run/", "the same folder as"),
      ("is_checkpoints", "/r/run/checkpoints",
       "--checkpoint_dir=/r/run/checkpoints is the same folder as"),
      ("inside_checkpoints", "/r/run/checkpoints/export",
       "where the run writes"),
      ("is_eval", "/r/run/eval", "where the run writes eval"),
      ("is_tensorboard_train", "/r/run/train", "where the run writes train"))
  def test_an_overlap_is_refused(self, export_dir, expected):
    with self.assertRaises(errors.ExportRefusedError) as cm:
      export.check_layout(**_layout(export_dir))
    self.assertIn(expected, str(cm.exception))
    self.assertIsInstance(cm.exception, errors.ConfigError)  # Status 2.
    self.assertIn("--export_dir", str(cm.exception))

  def test_gcs_paths_compare_without_their_trailing_slash(self):
    with self.assertRaises(errors.ExportRefusedError):
      export.check_layout(**_layout(
          "gs://b/run/", model_dir="gs://b/run",
          checkpoint_dir="gs://b/run/checkpoints",
          tensorboard_dir="gs://b/run"))


class ExportFolderTest(absltest.TestCase):

  def test_absent_or_empty_folders_may_be_written(self):
    root = testutil.scratch_dir()
    export.check_export_dir(os.path.join(root, "absent"))
    os.makedirs(os.path.join(root, "empty"))
    export.check_export_dir(os.path.join(root, "empty"))

  def test_a_foreign_folder_is_refused_and_kept(self):
    root = testutil.scratch_dir()
    folder = os.path.join(root, "mine")
    os.makedirs(folder)
    with open(os.path.join(folder, "notes.txt"), "w") as f:
      f.write("keep me")
    with self.assertRaises(errors.ExportRefusedError) as cm:
      export.check_export_dir(folder, source="$AIP_MODEL_DIR")
    self.assertIn("$AIP_MODEL_DIR=", str(cm.exception))
    self.assertIn(export.MARKER_FILE, str(cm.exception))
    self.assertEqual(os.listdir(folder), ["notes.txt"])

  def test_a_file_is_refused(self):
    path = os.path.join(testutil.scratch_dir(), "file")
    with open(path, "w") as f:
      f.write("x")
    with self.assertRaises(errors.ExportRefusedError):
      export.check_export_dir(path)

  def test_export_marks_and_replaces_only_its_own(self):
    root = testutil.scratch_dir()
    target = os.path.join(root, "saved_model")
    model = _model()
    self.assertEqual(export.export_saved_model(
        model, target, details={"step": 3}), target)
    self.assertTrue(export.is_tfdist_export(target))
    with open(os.path.join(target, export.MARKER_FILE)) as f:
      mark = json.load(f)
    self.assertEqual((mark["written_by"], mark["details"]),
                     ("tfdist", {"step": 3}))
    # A second export replaces the first; nothing else is left beside it.
    export.check_export_dir(target)
    export.export_saved_model(model, target, details={"step": 4})
    with open(os.path.join(target, export.MARKER_FILE)) as f:
      self.assertEqual(json.load(f)["details"], {"step": 4})
    self.assertEqual(sorted(os.listdir(root)), ["saved_model"])
    # It serves the model's outputs.
    x = np.ones((2, 3), np.float32)
    served = tf.saved_model.load(target).signatures["serving_default"](
        x=tf.constant(x))
    np.testing.assert_allclose(served["output_0"].numpy(), model(x).numpy(),
                               rtol=1e-5)

  def test_the_signature_is_logged_at_export_for_any_model(self):
    # Two named inputs of other dtypes and shapes, two outputs.
    ids = keras.Input((5,), dtype="int64", name="ids")
    weight = keras.Input((2, 4), name="weight")
    pooled = keras.layers.GlobalAveragePooling1D()(
        keras.layers.Embedding(10, 4)(ids))
    score = keras.layers.Dense(1, name="score")(
        keras.layers.Concatenate()([pooled, keras.layers.Flatten()(weight)]))
    model = keras.Model({"ids": ids, "weight": weight},
                        [score, keras.layers.Dense(3)(pooled)])
    target = os.path.join(testutil.scratch_dir(), "saved_model")
    with self.assertLogs(logging.get_absl_logger(), "INFO") as logs:
      export.export_saved_model(model, target)
    line = ("serving_default(ids: int64 [batch, 5], weight: float32 [batch, "
            "2, 4]) -> output_0: float32 [batch, 1], output_1: float32 "
            "[batch, 3]")
    self.assertEqual(export.describe_signature(target), line)
    self.assertIn(f"SavedModel written to {target}; its signature: {line}",
                  "\n".join(logs.output))
    self.assertEqual(export.signature(target)["inputs"],
                     {"ids": "int64 [batch, 5]",
                      "weight": "float32 [batch, 2, 4]"})
    with self.assertRaisesRegex(KeyError, "no 'predict' serving signature"):
      export.signature(target, "predict")

  def test_export_refuses_a_foreign_folder_and_keeps_the_new_model(self):
    root = testutil.scratch_dir()
    target = os.path.join(root, "taken")
    os.makedirs(target)
    with open(os.path.join(target, "saved_model.pb"), "w") as f:
      f.write("not tfdist's")  # A SavedModel without tfdist's mark.
    self.assertFalse(export.is_tfdist_export(target))
    with self.assertRaises(errors.ExportRefusedError) as cm:
      export.export_saved_model(_model(), target)
    left = [n for n in os.listdir(root) if n.startswith(".tmp-export-")]
    self.assertLen(left, 1)
    self.assertIn(os.path.join(root, left[0]), str(cm.exception))
    self.assertEqual(os.listdir(target), ["saved_model.pb"])


if __name__ == "__main__":
  absltest.main()
