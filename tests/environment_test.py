"""Vertex AI's environment: managed-dataset URIs and tuning trials' folders.

* `AIP_TRAINING_DATA_URI` / `AIP_VALIDATION_DATA_URI` fill `--train_files` /
  `--eval_files` when `AIP_DATA_FORMAT` is `tf-record` (the flag wins);
  another format is an error at start that names the variable, its value
  and the fix.
* A hyperparameter-tuning trial id in `CLUSTER_SPEC` / `TF_CONFIG` nests an
  explicit `--model_dir` as `<model_dir>/trial_<id>`; the `AIP_*` folders,
  already per trial, are kept.
* One real run of the binary's `tfdist.train.main` (in this process: it
  reads the environment when called) reads its TFRecords through
  `AIP_TRAINING_DATA_URI` (a wildcard, as Vertex gives it) in trial 3: the
  checkpoint lands in the trial's folder and the manifest records the trial.
"""

import glob
import json
import logging as std_logging
import os
from unittest import mock

from absl import logging
from absl.testing import absltest
from absl.testing import flagsaver
from absl.testing import parameterized
import pytest

from tests import testutil
from tfdist import experiment
from tfdist import errors
from tfdist import train
from tfdist.config import TrainConfig
from tfdist.distribute import environment as environment_lib
from tfdist.observability import manifest as manifest_lib
from tfdist.training.state import export

TRAIN_URI = "gs://bucket/dataset-123-tables-2024/training-*"
EVAL_URI = "gs://bucket/dataset-123-tables-2024/validation-*"


def _env(**variables):
  return environment_lib.read_environment(variables)


def _cluster_spec(trial: str) -> str:
  """Vertex AI's CLUSTER_SPEC of a one-replica tuning trial."""
  return json.dumps({
      "cluster": {"workerpool0": ["127.0.0.1:2222"]},
      "environment": "cloud",
      "task": {"type": "workerpool0", "index": 0, "trial": trial},
      "job": {"python_module": "tfdist.train", "package_uris": [],
              "job_args": []}})


def _tf_config(trial: str) -> str:
  return json.dumps({"cluster": {"chief": ["127.0.0.1:2222"]},
                     "environment": "cloud",
                     "task": {"type": "chief", "index": 0, "trial": trial}})


# The unit tests also run on the oldest supported TensorFlow
# (tests/conftest.py).
@pytest.mark.compat
class DataUriTest(parameterized.TestCase):

  def test_tf_record_uris_fill_train_and_eval_files(self):
    config, applied = environment_lib.apply_environment(
        TrainConfig(model_dir="/m", train_steps=1),
        _env(AIP_DATA_FORMAT="tf-record", AIP_TRAINING_DATA_URI=TRAIN_URI,
             AIP_VALIDATION_DATA_URI=EVAL_URI))
    self.assertEqual((config.train_files, config.eval_files),
                     (TRAIN_URI, EVAL_URI))
    self.assertIn(("train_files", "AIP_TRAINING_DATA_URI"), applied)
    self.assertIn(("eval_files", "AIP_VALIDATION_DATA_URI"), applied)

  def test_flag_wins_over_uri(self):
    config, applied = environment_lib.apply_environment(
        TrainConfig(model_dir="/m", train_steps=1, train_files="/mine/t-*"),
        _env(AIP_DATA_FORMAT="tf-record", AIP_TRAINING_DATA_URI=TRAIN_URI,
             AIP_VALIDATION_DATA_URI=EVAL_URI))
    self.assertEqual((config.train_files, config.eval_files),
                     ("/mine/t-*", EVAL_URI))
    self.assertNotIn(("train_files", "AIP_TRAINING_DATA_URI"), applied)
    # Both flags given: the URIs are not used, so their format is no error.
    config, _ = environment_lib.apply_environment(
        TrainConfig(model_dir="/m", train_steps=1, train_files="/t-*",
                    eval_files="/e-*"),
        _env(AIP_DATA_FORMAT="csv", AIP_TRAINING_DATA_URI=TRAIN_URI,
             AIP_VALIDATION_DATA_URI=EVAL_URI))
    self.assertEqual((config.train_files, config.eval_files),
                     ("/t-*", "/e-*"))

  @parameterized.named_parameters(
      ("csv", "csv", TRAIN_URI),
      ("jsonl", "jsonl", TRAIN_URI),
      ("bigquery", "bigquery", "bq://project.dataset_123.training"),
  )
  def test_other_format_is_a_clear_error(self, data_format, uri):
    with self.assertRaises(errors.ConfigError) as raised:
      environment_lib.apply_environment(
          TrainConfig(model_dir="/m", train_steps=1),
          _env(AIP_DATA_FORMAT=data_format, AIP_TRAINING_DATA_URI=uri))
    message = str(raised.exception)
    for part in (f"$AIP_TRAINING_DATA_URI={uri!r}",
                 f"AIP_DATA_FORMAT={data_format!r}", "'tf-record'",
                 "--train_files"):
      self.assertIn(part, message)

  def test_unset_format_is_an_error(self):
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"\$AIP_VALIDATION_DATA_URI='gs://.*validation-\*'.*"
        r"AIP_DATA_FORMAT is unset.*--eval_files"):
      environment_lib.apply_environment(
          TrainConfig(model_dir="/m", train_steps=1, train_files="/t-*"),
          _env(AIP_VALIDATION_DATA_URI=EVAL_URI))

  def test_error_comes_before_any_work(self):
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    with self.assertRaisesRegex(errors.ConfigError, "AIP_DATA_FORMAT='jsonl'"):
      experiment.run_experiment(
          TrainConfig(model_dir=model_dir, train_steps=1),
          environment=_env(AIP_DATA_FORMAT="jsonl",
                           AIP_TRAINING_DATA_URI=TRAIN_URI))
    self.assertFalse(os.path.exists(model_dir))

  def test_missing_data_names_the_variable_that_filled_the_flag(self):
    # The user gave no --train_files: the error must say where it came from.
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    with self.assertRaisesRegex(
        errors.DataNotFoundError,
        r"--train_files='/no/such/training-\*' matches no file.* "
        r"--train_files came from \$AIP_TRAINING_DATA_URI: fix that "
        r"variable, or pass --train_files"):
      experiment.run_experiment(
          TrainConfig(model_dir=model_dir, train_steps=1, dry_run=True),
          environment=_env(AIP_DATA_FORMAT="tf-record",
                           AIP_TRAINING_DATA_URI="/no/such/training-*",
                           AIP_VALIDATION_DATA_URI="/no/such/validation-*"))

  def test_feature_spec_takes_its_files_from_the_environment(self):
    # --feature_spec needs files; Vertex's URIs count (checked after the
    # environment is applied, not when the flags are parsed).
    config = TrainConfig(model_dir="/m", train_steps=1,
                         feature_spec="/spec.json")
    with self.assertRaisesRegex(
        errors.ConfigError, "give them as --train_files"):
      config.require_data_files()
    config, _ = environment_lib.apply_environment(
        config, _env(AIP_DATA_FORMAT="tf-record",
                     AIP_TRAINING_DATA_URI=TRAIN_URI,
                     AIP_VALIDATION_DATA_URI=EVAL_URI))
    config.require_data_files()
    self.assertEqual(config.train_files, TRAIN_URI)


@pytest.mark.compat
class TrialFolderTest(parameterized.TestCase):

  @parameterized.named_parameters(("cluster_spec", "CLUSTER_SPEC",
                                   _cluster_spec),
                                  ("tf_config", "TF_CONFIG", _tf_config))
  def test_trial_nests_explicit_model_dir_only(self, variable, make):
    prepared = experiment.prepare_run(
        TrainConfig(model_dir="/runs/study", train_steps=1),
        environment=_env(**{variable: make("7")}))
    decided, cluster = prepared.decisions, prepared.cluster
    self.assertEqual(cluster.trial, "7")
    self.assertEqual(decided.model_dir, "/runs/study/trial_7")
    self.assertEqual(decided.checkpoint_dir,
                     "/runs/study/trial_7/checkpoints")
    self.assertEqual(prepared.config.model_dir, "/runs/study")
    self.assertEqual(prepared.trial_fields, ("model_dir",))
    # Vertex already nests AIP_* per trial (<base>/<trial>/checkpoints/):
    # kept as they are.
    prepared = experiment.prepare_run(
        TrainConfig(train_steps=1),
        environment=_env(**{variable: make("7")},
                         AIP_MODEL_DIR="gs://b/out/7/model/",
                         AIP_CHECKPOINT_DIR="gs://b/out/7/checkpoints/"))
    decided = prepared.decisions
    self.assertEqual((decided.model_dir, decided.checkpoint_dir,
                      decided.export_dir),
                     ("gs://b/out/7/checkpoints/", "gs://b/out/7/checkpoints/",
                      "gs://b/out/7/model/"))
    self.assertEqual(prepared.trial_fields, ())
    # Outside a tuning job Vertex sends "trial": "": no subfolder.
    prepared = experiment.prepare_run(
        TrainConfig(model_dir="/runs/one", train_steps=1),
        environment=_env(**{variable: make("")}))
    self.assertEqual((prepared.decisions.model_dir, prepared.trial_fields),
                     ("/runs/one", ()))

  def test_explicit_checkpoint_dir_is_nested_too(self):
    prepared = experiment.prepare_run(
        TrainConfig(model_dir="gs://b/run/", checkpoint_dir="gs://b/ckpt",
                    train_steps=1),
        environment=_env(CLUSTER_SPEC=_cluster_spec("12")))
    decided = prepared.decisions
    self.assertEqual((decided.model_dir, decided.checkpoint_dir),
                     ("gs://b/run/trial_12", "gs://b/ckpt/trial_12"))
    self.assertEqual(prepared.trial_fields, ("model_dir", "checkpoint_dir"))

  def test_applying_twice_nests_once(self):
    config, _ = environment_lib.trial_folders(
        TrainConfig(model_dir="/runs/study", train_steps=1), trial="7")
    again, fields = environment_lib.trial_folders(config, trial="7")
    self.assertEqual((again.model_dir, fields), ("/runs/study/trial_7", ()))

  def test_trial_that_cannot_name_a_folder(self):
    with self.assertRaisesRegex(errors.ClusterConfigError,
                                "CLUSTER_SPEC: task trial '../x'"):
      experiment.prepare_run(
          TrainConfig(model_dir="/m", train_steps=1),
          environment=_env(CLUSTER_SPEC=_cluster_spec("../x")))


class PlainValuesTest(absltest.TestCase):
  """The rules on plain values, without a `TrainConfig`."""

  def test_environment_changes(self):
    environment = environment_lib.read_environment({
        "AIP_MODEL_DIR": "gs://b/model", "AIP_CHECKPOINT_DIR": "gs://b/ckpt",
        "TPU_NAME": "my-tpu", "TFDIST_DATA_DIR": "/cache"})
    changes, filled = environment_lib.environment_changes(
        {"tpu": "local"}, environment)
    self.assertEqual(changes, {"model_dir": "gs://b/ckpt",
                               "checkpoint_dir": "gs://b/ckpt",
                               "export_dir": "gs://b/model",
                               "data_dir": "/cache"})
    self.assertEqual(filled, (("model_dir", "AIP_CHECKPOINT_DIR"),
                              ("checkpoint_dir", "AIP_CHECKPOINT_DIR"),
                              ("export_dir", "AIP_MODEL_DIR")))
    # Every field given: nothing changes.
    given = {field: "/x" for field in environment_lib.ENVIRONMENT_FIELDS}
    self.assertEqual(environment_lib.environment_changes(given, environment),
                     ({}, ()))

  def test_trial_changes(self):
    folders = {"model_dir": "gs://b/run", "export_dir": "gs://b/out/7/model",
               "checkpoint_dir": "", "tensorboard_dir": "/tb/trial_7"}
    self.assertEqual(
        environment_lib.trial_changes(
            folders, trial="7", filled=(("export_dir", "AIP_MODEL_DIR"),)),
        {"model_dir": "gs://b/run/trial_7"})
    self.assertEqual(environment_lib.trial_changes(folders, trial=""), {})

  def test_folder_sources(self):
    sources = environment_lib.folder_sources(
        {"model_dir": "/m", "export_dir": "gs://b/model"},
        {"model_dir": "/m", "export_dir": "gs://b/model",
         "checkpoint_dir": "/m/checkpoints", "tensorboard_dir": "/m/logs"},
        (("export_dir", "AIP_MODEL_DIR"),))
    self.assertEqual(sources, {
        "export_dir": ("gs://b/model", "$AIP_MODEL_DIR (--export_dir)"),
        "model_dir": ("/m", "--model_dir"),
        "checkpoint_dir": ("/m/checkpoints",
                           "--checkpoint_dir (default, under --model_dir)"),
        "tensorboard_dir": ("/m/logs",
                            "--tensorboard_dir (default, under --model_dir)"),
    })


class TrainBinaryTest(absltest.TestCase):

  def test_vertex_data_uri_and_trial(self):
    data = testutil.fashion_mnist_subset(limit=256, train_shards=2,
                                         test_shards=1)
    model_dir = testutil.scratch_dir()
    # Vertex's wildcard form: <folder>/training-* (here train-*).
    train_uri = os.path.join(data["dir"], "train-*")
    eval_uri = os.path.join(data["dir"], "test-*")
    # The binary's main in this process (a child process would add a
    # Python and TensorFlow start-up): flags parsed as `python -m
    # tfdist.train` parses them, the variables set only for the call.
    self._restore_what_main_changes()
    variables = {"AIP_DATA_FORMAT": "tf-record",
                 "AIP_TRAINING_DATA_URI": train_uri,
                 "AIP_VALIDATION_DATA_URI": eval_uri,
                 "CLUSTER_SPEC": _cluster_spec("3")}
    with flagsaver.flagsaver(), mock.patch.dict(os.environ, variables):
      for name in ("TF_CONFIG", "AIP_MODEL_DIR"):
        os.environ.pop(name, None)
      train._parse_flags([  # pylint: disable=protected-access
          "tfdist.train", f"--model_dir={model_dir}",
          "--distribution_strategy=one_device", "--batch_size=64",
          "--train_steps=4", "--log_steps=2"])
      train.main(["tfdist.train"])
    trial_dir = os.path.join(model_dir, "trial_3")
    self.assertEqual(os.listdir(model_dir), ["trial_3"])
    self.assertTrue(glob.glob(os.path.join(trial_dir, "checkpoints",
                                           "ckpt-4.index")),
                    os.listdir(trial_dir))
    manifest = manifest_lib.read_manifest(trial_dir)
    self.assertEqual(manifest["trial"], {"id": "3", "subfolder": "trial_3",
                                         "fields": ["model_dir"]})
    self.assertEqual(manifest["cluster"]["trial"], "3")
    self.assertEqual(manifest["final_step"], 4)
    self.assertEqual(
        [f["path"] for f in manifest["data"]["train_files"]],
        sorted(glob.glob(data["train"])))
    self.assertEqual(
        [f["path"] for f in manifest["data"]["eval_files"]],
        sorted(glob.glob(data["eval"])))
    self.assertIn({"field": "train_files",
                   "variable": "AIP_TRAINING_DATA_URI"},
                  manifest["environment"])
    # Everything the manifest names is there, the export bears its mark.
    artifacts = manifest["artifacts"]
    for key in ("checkpoint_dir", "saved_model", "tensorboard", "metrics"):
      self.assertTrue(os.path.exists(artifacts[key]), (key, artifacts))
    self.assertTrue(os.path.exists(artifacts["checkpoint"] + ".index"))
    self.assertTrue(export.is_tfdist_export(artifacts["saved_model"]))

  def _restore_what_main_changes(self):
    """Undoes, after the test, what `train.main` leaves in the process: the
    log filters of `_quiet_library_info` and the binary's exit mark."""
    loggers = (logging.get_absl_logger(), std_logging.getLogger("tensorflow"))
    filters = [list(logger.filters) for logger in loggers]

    def restore():
      for logger, kept in zip(loggers, filters):
        logger.filters[:] = kept
      train._LEAVE_WITHOUT_TEARDOWN = False  # pylint: disable=protected-access
    self.addCleanup(restore)


if __name__ == "__main__":
  absltest.main()
