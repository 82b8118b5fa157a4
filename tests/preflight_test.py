"""Start-up checks (tfdist/training/plan/preflight.py): registry names and
output folders."""

import os
import shutil
import stat
import tempfile

from absl.testing import absltest

from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.training.plan import preflight


def _sections(**names):
  """The task and cloud sections of a config giving `names`."""
  config = TrainConfig(model_dir="/tmp/x", train_steps=1, **names)
  return config.task, config.cloud


class CheckNamesTest(absltest.TestCase):

  def test_known_names_pass(self):
    preflight.check_names(*_sections(model="cnn", dataset="fashion_mnist"))

  def test_an_unknown_model_lists_the_known_ones(self):
    with self.assertRaisesRegex(errors.ConfigError, "no_such_model.*cnn"):
      preflight.check_names(*_sections(model="no_such_model",
                                       dataset="fashion_mnist"))

  def test_an_unknown_dataset_is_named(self):
    with self.assertRaisesRegex(errors.ConfigError, "no_such_data"):
      preflight.check_names(*_sections(model="cnn", dataset="no_such_data"))

  def test_a_metric_the_task_does_not_produce(self):
    with self.assertRaisesRegex(errors.ConfigError, "auc_of_nothing"):
      preflight.check_names(*_sections(
          model="cnn", dataset="fashion_mnist",
          hptune_metric="eval_auc_of_nothing"))
    preflight.check_names(*_sections(
        model="cnn", dataset="fashion_mnist", hptune_metric="eval_accuracy"))

  def test_user_modules_and_import_paths_are_the_jobs_to_check(self):
    preflight.check_names(*_sections(
        model="no_such_model", dataset="x", import_modules=("my_models",)))
    preflight.check_names(*_sections(model="cnn",
                                     dataset="my.module:dataset"))


class KerasDistributionTest(absltest.TestCase):
  """A `keras.distribution` set in the process: Keras ignores it under
  TensorFlow (the run went on without a word); refused at start."""

  def tearDown(self):
    import keras  # pylint: disable=g-import-not-at-top
    keras.distribution.set_distribution(None)
    super().tearDown()

  def test_data_parallel_is_refused_at_start_naming_the_flags(self):
    import keras  # pylint: disable=g-import-not-at-top
    from tfdist import errors  # pylint: disable=g-import-not-at-top
    from tfdist import experiment  # pylint: disable=g-import-not-at-top
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    with self.assertRaisesRegex(
        errors.ConfigError, r"keras.distribution.set_distribution\(DataParallel"
        r"\(...\)\) is set in this process, which Keras ignores under the "
        r"TensorFlow backend.*--distribution_strategy=mirrored .*"
        "multi_worker_mirrored") as cm:
      experiment.prepare_run(TrainConfig(model_dir="/unused/run",
                                         train_steps=1))
    self.assertEqual(errors.exit_code_for(cm.exception), errors.CONFIG)

  def test_model_parallel_names_zero_and_parameter_servers(self):
    import keras  # pylint: disable=g-import-not-at-top
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((len(devices),), ["model"], devices)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(mesh)))
    with self.assertRaisesRegex(
        errors.ConfigError, r"ModelParallel.*--zero_stage=1 or 2.*"
        "--distribution_strategy=parameter_server.*tensor parallel layout "
        r"pass its LayoutMap to tfdist\.fit\(model_fn, \.\.\., "
        r"layout_map=\.\.\.\)"):
      preflight.check_no_keras_distribution()

  def test_none_set_passes(self):
    preflight.check_no_keras_distribution()


class OutputFoldersTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.root = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)

  def test_derived_folders_name_model_dir(self):
    model_dir = os.path.join(self.root, "run")
    outputs = TrainConfig(model_dir=model_dir, train_steps=1).outputs
    folders = preflight.output_folders(outputs)
    self.assertEqual(folders[0], ("--model_dir", model_dir, model_dir))
    self.assertTrue(all(flag == "--model_dir" for flag, _, _ in folders))
    self.assertLen({folder for _, _, folder in folders}, len(folders))

  def test_a_given_folder_names_its_flag(self):
    model_dir = os.path.join(self.root, "run")
    export = os.path.join(self.root, "exports", "model")
    outputs = TrainConfig(
        model_dir=model_dir, train_steps=1, export_dir=export,
        checkpoint_dir=model_dir).outputs
    folders = preflight.output_folders(outputs)
    # The export's parent is probed (the SavedModel is renamed into it);
    # --checkpoint_dir names --model_dir's folder, listed once.
    self.assertIn(("--export_dir", export, os.path.dirname(export)), folders)
    self.assertEqual([f for f in folders if f[2] == model_dir],
                     [("--model_dir", model_dir, model_dir)])

  def test_probe_outputs_leaves_nothing_behind(self):
    model_dir = os.path.join(self.root, "a", "run")
    preflight.probe_outputs(
        TrainConfig(model_dir=model_dir, train_steps=1).outputs)
    self.assertEqual(os.listdir(self.root), [])

  def test_probe_keeps_an_existing_folder_and_removes_the_probe(self):
    preflight.probe_writable(self.root, flag="--model_dir", value=self.root)
    self.assertTrue(os.path.isdir(self.root))
    self.assertEqual(os.listdir(self.root), [])

  def test_a_file_in_the_way_is_named(self):
    blocker = os.path.join(self.root, "file")
    with open(blocker, "w") as f:
      f.write("x")
    folder = os.path.join(blocker, "run")
    with self.assertRaisesRegex(
        errors.OutputNotWritableError,
        rf"--model_dir={folder} is not writable: {blocker} is a file, not a "
        "folder"):
      preflight.probe_writable(folder, flag="--model_dir", value=folder)

  def test_a_read_only_folder_is_not_writable(self):
    if os.geteuid() == 0:
      self.skipTest("root writes into read-only folders")
    os.chmod(self.root, stat.S_IRUSR | stat.S_IXUSR)
    self.addCleanup(os.chmod, self.root, stat.S_IRWXU)
    with self.assertRaisesRegex(errors.OutputNotWritableError,
                                r"--export_dir=E is not writable \("):
      preflight.probe_writable(os.path.join(self.root, "x"),
                               flag="--export_dir", value="E")


if __name__ == "__main__":
  absltest.main()
