"""Nothing a run writes is lost, and foreseeable failures are one line.

* outputs: an export folder overlapping `--model_dir`, the checkpoints or
  the TensorBoard logs (by flag or by Vertex AI's `AIP_*` variables) is
  refused at start; an export replaces only a SavedModel tfdist wrote;
* tuning trials: each trial's checkpoints are its own, whichever flag or
  variable gave the folder;
* data: an uncompressed TFRecord file cut mid-record or with a bad CRC is
  named with its byte offset at start;
* failures: mixed `.gz` and plain shards, a `--model` that is not a model
  builder, a full disk during a save, a damaged checkpoint index, a data
  file that vanished mid-epoch: one line each, with the status of
  `tfdist/exit_codes.py`.

Real short runs on a real Fashion-MNIST subset; everything else calls the
checks directly (docs/design/nothing-lost.md).
"""

import gzip
import glob
import json
import os
import resource
import struct
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import keras
import pytest
import tensorflow as tf

from tests import testutil
from tfdist import exit_codes
from tfdist import experiment
from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.data import data_checks
from tfdist.distribute import environment as environment_lib
from tfdist.observability import manifest as manifest_lib
from tfdist.runtime import failures
from tfdist.training.state import checkpointing
from tfdist.training.state import export
from tfdist.training.plan import run_plan
from tfdist.training import task as task_lib


def _data():
  return testutil.fashion_mnist_subset(limit=256, train_shards=2,
                                       test_shards=1)


def _config(model_dir, **overrides):
  data = _data()
  kwargs = dict(model_dir=model_dir, train_files=data["train"],
                eval_files=data["eval"], distribution_strategy="one_device",
                batch_size=64, train_steps=2, log_steps=1, warmup_steps=1,
                checkpoint_steps=2, seed=7)
  kwargs.update(overrides)
  return TrainConfig(**kwargs)


def _env(**variables):
  return environment_lib.read_environment(variables)


def _cluster_spec(trial: str) -> str:
  return json.dumps({"cluster": {"workerpool0": ["localhost:2222"]},
                     "task": {"type": "workerpool0", "index": 0,
                              "trial": trial}})


def _tree(folder):
  return sorted(os.path.relpath(os.path.join(root, name), folder)
                for root, dirs, files in os.walk(folder)
                for name in dirs + files)


class OutputLayoutTest(parameterized.TestCase):
  """`check_layout` through `prepare_run`: no files touched."""

  @parameterized.named_parameters(
      ("export_is_model_dir", dict(model_dir="/r/x", export_dir="/r/x"), {},
       "--model_dir=/r/x is the same folder as --export_dir=/r/x"),
      ("export_contains_model_dir",
       dict(model_dir="/r/x/run", export_dir="/r/x"), {},
       "--model_dir=/r/x/run is inside --export_dir=/r/x"),
      ("export_is_checkpoints",
       dict(model_dir="/r/x", export_dir="/r/x/checkpoints/"), {},
       r"--checkpoint_dir \(default, under --model_dir\)=/r/x/checkpoints is "
       "the same folder as --export_dir=/r/x/checkpoints/"),
      ("export_in_tensorboard_train",
       dict(model_dir="/r/x", tensorboard_dir="/r/tb",
            export_dir="/r/tb/train"), {},
       "--export_dir=/r/tb/train is inside --tensorboard_dir=/r/tb, where "
       "the run writes train"),
      ("export_is_metrics", dict(model_dir="/r/x",
                                 export_dir="/r/x/./metrics.jsonl"), {},
       "where the run writes metrics.jsonl"),
      ("aip_model_dir_alone", {}, dict(AIP_MODEL_DIR="gs://b/out/model/"),
       r"\$AIP_MODEL_DIR \(--model_dir\)=gs://b/out/model/ is the same "
       r"folder as \$AIP_MODEL_DIR \(--export_dir\)"),
      ("aip_model_is_checkpoint_dir", {},
       dict(AIP_MODEL_DIR="gs://b/out", AIP_CHECKPOINT_DIR="gs://b/out/"),
       r"\$AIP_CHECKPOINT_DIR \(--model_dir\)=gs://b/out/ is the same folder"
       r" as \$AIP_MODEL_DIR \(--export_dir\)=gs://b/out"),
      ("aip_logs_in_model", {},
       dict(AIP_MODEL_DIR="gs://b/out/model",
            AIP_CHECKPOINT_DIR="gs://b/out/ckpt",
            AIP_TENSORBOARD_LOG_DIR="gs://b/out/model/logs"),
       r"\$AIP_TENSORBOARD_LOG_DIR \(--tensorboard_dir\)=gs://b/out/model/"
       r"logs is inside \$AIP_MODEL_DIR"),
      ("flag_and_variable", dict(model_dir="gs://b/out/model"),
       dict(AIP_MODEL_DIR="gs://b/out/model/"),
       r"--model_dir=gs://b/out/model is the same folder as \$AIP_MODEL_DIR"),
  )
  def test_overlap_is_refused_naming_both(self, fields, variables, message):
    with self.assertRaisesRegex(errors.ExportRefusedError, message) as cm:
      experiment.prepare_run(TrainConfig(train_steps=1, **fields),
                             environment=_env(**variables))
    self.assertEqual(exit_codes.exit_code_for(cm.exception), exit_codes.CONFIG)
    self.assertNotIn("\n", str(cm.exception))

  @parameterized.named_parameters(
      ("default", dict(model_dir="/r/x"), {}),
      ("own_folder", dict(model_dir="/r/x", export_dir="/r/x/serving"), {}),
      ("checkpoints_in_model_dir",
       dict(model_dir="/r/x", checkpoint_dir="/r/x"), {}),
      ("vertex_base_output_dir", {},
       dict(AIP_MODEL_DIR="gs://b/out/model/",
            AIP_CHECKPOINT_DIR="gs://b/out/checkpoints/",
            AIP_TENSORBOARD_LOG_DIR="gs://b/out/logs/")),
      ("vertex_without_logs", {},
       dict(AIP_MODEL_DIR="gs://b/out/model/",
            AIP_CHECKPOINT_DIR="gs://b/out/checkpoints/")),
  )
  def test_separate_folders_pass(self, fields, variables):
    decided = experiment.prepare_run(TrainConfig(train_steps=1, **fields),
                                     environment=_env(**variables)).decisions
    if "AIP_MODEL_DIR" in variables:
      # Vertex AI loads saved_model.pb from AIP_MODEL_DIR itself.
      self.assertEqual(decided.export_dir, variables["AIP_MODEL_DIR"])

  def test_entries_are_the_writers_names(self):
    from tfdist.distribute import (lease, parameter_server)  # pylint: disable=g-import-not-at-top
    from tfdist.observability import run_log  # pylint: disable=g-import-not-at-top
    self.assertContainsSubset(
        {run_log.METRICS_FILE, manifest_lib.MANIFEST_FILE, lease.LEASE_FILE,
         parameter_server.DONE_MARKER,
         os.path.basename(TrainConfig(model_dir="/m").resolved_checkpoint_dir)
         }, export.MODEL_DIR_ENTRIES)


class TrialFoldersTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("checkpoint_dir_variable",
       dict(AIP_CHECKPOINT_DIR="/s/ckpt", AIP_MODEL_DIR="/s/model"),
       "/s/ckpt/trial_{}"),
      ("model_dir_flag", {}, "/s/flag/trial_{}"),
  )
  def test_two_trials_never_share_a_checkpoint_folder(self, variables,
                                                      expected):
    folders = []
    for trial in ("3", "4"):
      decided = experiment.prepare_run(
          TrainConfig(train_steps=1,
                      model_dir="" if variables else "/s/flag"),
          environment=_env(CLUSTER_SPEC=_cluster_spec(trial),
                           **variables)).decisions
      folders.append(decided.checkpoint_dir)
    self.assertEqual(folders[0], expected.format(3) +
                     ("" if variables else "/checkpoints"))
    self.assertNotEqual(*folders)

  def test_vertex_nested_folders_are_kept(self):
    variables = dict(AIP_MODEL_DIR="gs://b/out/4/model/",
                     AIP_CHECKPOINT_DIR="gs://b/out/4/checkpoints/")
    decided = experiment.prepare_run(
        TrainConfig(train_steps=1),
        environment=_env(CLUSTER_SPEC=_cluster_spec("4"), **variables)
    ).decisions
    self.assertEqual((decided.checkpoint_dir, decided.export_dir),
                     (variables["AIP_CHECKPOINT_DIR"],
                      variables["AIP_MODEL_DIR"]))

  def test_aip_model_dir_alone_in_a_trial_is_refused(self):
    # Both folders would be <AIP_MODEL_DIR>/trial_4: refused, never shared.
    with self.assertRaisesRegex(errors.ExportRefusedError,
                                "trial_4 is the same folder as"):
      experiment.prepare_run(
          TrainConfig(train_steps=1),
          environment=_env(CLUSTER_SPEC=_cluster_spec("4"),
                           AIP_MODEL_DIR="/s/model"))


def _plain_shard() -> bytes:
  """The bytes of one real Fashion-MNIST shard, uncompressed."""
  with gzip.open(sorted(glob.glob(_data()["train"]))[0]) as f:
    return f.read()


@pytest.mark.compat
class FramingTest(parameterized.TestCase):
  """An uncompressed file cut or corrupted anywhere is named with its byte
  offset (TF 2.17's venv has no compiled CRC32C: the fallback runs there)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.data = _plain_shard()
    (length,) = struct.unpack_from("<Q", cls.data, 0)
    cls.first = 12 + length + 4  # header, data, data CRC
    cls.records = sum(1 for _ in tf.compat.v1.io.tf_record_iterator(
        cls._write("whole", cls.data)))

  @staticmethod
  def _write(name, data) -> str:
    path = os.path.join(testutil.scratch_dir(), name + ".tfrecord")
    with open(path, "wb") as f:
      f.write(data)
    return path

  def test_whole_file_counts_as_tensorflow_does(self):
    path = self._write("whole", self.data)
    self.assertEqual(data_checks.count_file(path), self.records)
    self.assertEqual(data_checks.check_framing(path, check_data=True),
                     self.records)

  @parameterized.named_parameters(
      # TensorFlow's reader takes this one for a whole file.
      ("inside_a_header", lambda d, r: d[:r + 5],
       "the file ends 5 byte.s. into a record's 12-byte header at byte {r} "
       r"\(record 2; after 1 good"),
      ("inside_the_data", lambda d, r: d[:r + 100],
       "the file ends 100 byte.s. into a record of .* at byte {r}"),
      ("bad_header_crc", lambda d, r: d[:r + 9] + bytes([d[r + 9] ^ 1]) +
       d[r + 10:], "a record header fails its CRC32C at byte {r}"),
  )
  def test_damage_is_named_with_its_offset(self, damage, message):
    path = self._write("damaged", damage(self.data, self.first))
    with self.assertRaisesRegex(errors.DataError,
                                f"training file {path} is damaged: " +
                                message.format(r=self.first)):
      data_checks.check_data([path], [])

  def test_bad_data_crc_is_caught(self):
    at = self.first + 12 + 20
    path = self._write("flipped", self.data[:at] + bytes(
        [self.data[at] ^ 1]) + self.data[at + 1:])
    with self.assertRaisesRegex(errors.DataError,
                                f"evaluation file {path} is damaged"):
      data_checks.check_data([], [path])
    with self.assertRaisesRegex(
        errors.DataError,
        f"a record's data fails its CRC32C at byte {self.first}"):
      data_checks.check_framing(path, check_data=True)

  def test_python_crc32c(self):
    # The check value of CRC-32C (RFC 3720, B.4).
    self.assertEqual(data_checks._python_crc32c(b"123456789"), 0xE3069283)
    if data_checks.LIBRARY_CRC32C is not None:
      self.assertEqual(data_checks.LIBRARY_CRC32C(self.data[:4096]),
                       data_checks._python_crc32c(self.data[:4096]))


@pytest.mark.compat
class GzipEndTest(parameterized.TestCase):
  """A GZIP file cut anywhere is named, also where TensorFlow's reader
  reads it as a whole shorter file (a cut on a record boundary, or before
  the first record)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    folder = testutil.scratch_dir()
    cls.path = os.path.join(folder, "whole.tfrecord.gz")
    with tf.io.TFRecordWriter(cls.path, options="GZIP") as writer:
      for i in range(300):
        writer.write(bytes([i % 251]) * 60 + os.urandom(16))
    with open(cls.path, "rb") as f:
      cls.data = f.read()

  def _write(self, name, data) -> str:
    path = os.path.join(testutil.scratch_dir(), name + ".tfrecord.gz")
    with open(path, "wb") as f:
      f.write(data)
    return path

  def test_whole_files_pass(self):
    self.assertEqual(data_checks.count_file(self.path), 300)
    # Two GZIP members in one file (gzip reads them as one stream).
    two = self._write("two_members", self.data + self.data)
    self.assertEqual(data_checks.count_file(two), 600)

  @parameterized.named_parameters(
      ("in_the_header", 12), ("before_the_first_record", 30),
      ("a_few_records_in", 200), ("without_its_size", -4))
  def test_a_cut_file_is_named(self, keep):
    path = self._write(f"cut{keep}", self.data[:keep])
    # What TensorFlow's reader alone reads of it (with or without an
    # error: a cut inside a record raises, a cut elsewhere does not).
    read = 0
    try:
      for _ in tf.compat.v1.io.tf_record_iterator(
          path, tf.io.TFRecordOptions(compression_type="GZIP")):
        read += 1
    except tf.errors.DataLossError:
      pass
    self.assertLessEqual(read, 300)
    with self.assertRaisesRegex(
        errors.DataError,
        rf"training file {path} is damaged: the GZIP data .*\(after "
        rf"{read} good record\(s\)\)\. The file is cut short"):
      data_checks.check_data([path], [])

  def test_an_uncompressed_file_named_gz_is_named(self):
    with open(self.path, "rb") as f:
      plain = gzip.decompress(f.read())
    path = self._write("plain_named_gz", plain)
    with self.assertRaisesRegex(
        errors.DataError,
        rf"training file {path} is damaged: .*the name ends in \.gz but the "
        r"file is not GZIP data"):
      data_checks.check_data([path], [])


def _tiny_model():
  inputs = keras.Input((3,), name="x")
  return keras.Model(inputs, keras.layers.Dense(1)(inputs))


class ExportFolderTest(absltest.TestCase):
  """`export_saved_model` replaces only what tfdist wrote."""

  def test_foreign_folder_is_never_deleted(self):
    root = testutil.scratch_dir()
    target = os.path.join(root, "serving")
    os.makedirs(os.path.join(target, "notes"))
    with open(os.path.join(target, "notes", "keep.txt"), "w") as f:
      f.write("mine")
    with self.assertRaisesRegex(errors.ExportRefusedError,
                                "is not a SavedModel tfdist wrote"):
      export.check_export_dir(target)
    with self.assertRaisesRegex(errors.ExportRefusedError,
                                "The new SavedModel was left at"):
      export.export_saved_model(_tiny_model(), target)
    self.assertEqual(_tree(target), ["notes", "notes/keep.txt"])
    # Its own export is replaced whole; an empty folder is taken.
    empty = os.path.join(root, "empty")
    os.makedirs(empty)
    export.export_saved_model(_tiny_model(), empty)
    export.check_export_dir(empty)
    export.export_saved_model(_tiny_model(), empty, details={"step": 2})
    self.assertTrue(export.is_tfdist_export(empty))
    with open(os.path.join(empty, export.MARKER_FILE)) as f:
      self.assertEqual(json.load(f)["details"], {"step": 2})
    self.assertEqual(sorted(n for n in os.listdir(root)
                            if n.startswith(".")), [
                                n for n in os.listdir(root)
                                if n.startswith(".tmp-export")])


# Run in a child whose writes past RLIMIT_FSIZE fail with EFBIG ("File too
# large"), as on a full disk (see test_full_disk_during_a_save_is_one_line):
# an export of a model bigger than the limit, then a probe under a limit of
# 0 bytes. Prints what each raised.
_FULL_DISK_CHILD = """
import json, resource, sys
import keras
from tfdist.training.plan import preflight
from tfdist.training.state import export
export_dir, probed = sys.argv[1:]
inputs = keras.Input((256,), name="x")
model = keras.Model(inputs, keras.layers.Dense(256)(inputs))  # 257 KiB.
out = {}
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
try:
  export.export_saved_model(model, export_dir, source="--export_dir",
                            last_checkpoint="/m/checkpoints/ckpt-2")
except Exception as e:  # pylint: disable=broad-except
  out["export"] = [type(e).__name__, str(e)]
resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
try:
  preflight.probe_writable(probed, flag="--model_dir", value=probed)
except Exception as e:  # pylint: disable=broad-except
  out["probe"] = [type(e).__name__, str(e)]
print("RESULT " + json.dumps(out))
"""


class FullDiskLeavesNothingTest(absltest.TestCase):
  """A failed export or probe removes what it wrote; the next start
  removes what an earlier failed export left (tfdist's names only)."""

  def test_failed_export_and_probe_leave_nothing_and_name_the_flag(self):
    root = testutil.scratch_dir()
    export_dir = os.path.join(root, "exports", "serving")
    probed = os.path.join(root, "run")
    os.makedirs(probed)
    env = dict(os.environ, PYTHONPATH=testutil.REPO_ROOT,
               TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-c", _FULL_DISK_CHILD, export_dir, probed],
        cwd=testutil.REPO_ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=240)
    self.assertEqual(proc.returncode, 0, proc.stdout[-3000:])
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    # Before: a raw OpError, and .tmp-export-* (and the probe file) stayed.
    kind, message = result["export"]
    self.assertEqual(kind, "OutputWriteError", message)
    self.assertRegex(
        message, f"^--export_dir={export_dir}: a write failed: the disk or "
        "quota is full .*File too large.*rerun the same command to resume "
        "from /m/checkpoints/ckpt-2")
    self.assertEqual(_tree(os.path.join(root, "exports")), [])
    self.assertEqual(result["probe"][0], "OutputNotWritableError")
    self.assertEqual(os.listdir(probed), [])

  def test_stale_unfinished_exports_are_removed_and_nothing_else(self):
    parent = testutil.scratch_dir()
    export_dir = os.path.join(parent, "serving")

    def folder(name, marked=False):
      os.makedirs(os.path.join(parent, name, "variables"))
      if marked:
        with open(os.path.join(parent, name, export.MARKER_FILE), "w") as f:
          f.write("{}")
    folder(".tmp-export-serving-0123abcd")  # Failed part way: removed.
    folder(".tmp-export-serving-89abcdef", marked=True)  # Whole: kept.
    folder(".old-export-serving-00ff00ff")  # Previous export: no new one.
    folder(".tmp-export-other-0123abcd")  # Another export folder's.
    folder(".tmp-export-serving-notahex1")
    folder("serving-notes")
    self.assertEqual(export.remove_stale_exports(export_dir),
                     [os.path.join(parent, ".tmp-export-serving-0123abcd")])
    # Once the export folder holds a tfdist export, the moved-aside
    # previous one goes too.
    export.export_saved_model(_tiny_model(), export_dir)
    self.assertEqual(export.remove_stale_exports(export_dir),
                     [os.path.join(parent, ".old-export-serving-00ff00ff")])
    self.assertEqual(sorted(os.listdir(parent)), [
        ".tmp-export-other-0123abcd", ".tmp-export-serving-89abcdef",
        ".tmp-export-serving-notahex1", "serving", "serving-notes"])

  def test_a_run_removes_an_earlier_runs_unfinished_export(self):
    model_dir = testutil.scratch_dir()
    stale = os.path.join(model_dir, ".tmp-export-saved_model-0badf00d")
    os.makedirs(os.path.join(stale, "variables"))
    experiment.run_experiment(_config(model_dir, mode="train"))
    self.assertFalse(os.path.exists(stale))
    self.assertTrue(export.is_tfdist_export(
        os.path.join(model_dir, "saved_model")))
    self.assertEqual([n for n in os.listdir(model_dir)
                      if n.startswith(".")], [])


class OutputRunTest(absltest.TestCase):
  """A real run: the overlap is refused before any work (a run's artifacts
  and its manifest's paths: tests/environment_test.py)."""

  def test_export_dir_equal_to_model_dir_loses_nothing(self):
    model_dir = testutil.scratch_dir()
    # Before any work: the final export used to replace model_dir whole
    # (checkpoints/, train/, metrics.jsonl gone, exit 0).
    with self.assertRaisesRegex(
        errors.ConfigError,
        f"--model_dir={model_dir} is the same folder as --export_dir"):
      experiment.run_experiment(_config(model_dir, export_dir=model_dir))
    self.assertEqual(os.listdir(model_dir), [])


class FailureTest(absltest.TestCase):
  """Each foreseeable failure: one line naming the flag, status 2."""

  def test_mixed_gz_and_plain_shards_stop_before_the_model(self):
    shards = sorted(glob.glob(_data()["train"]))
    folder = testutil.scratch_dir()
    plain = os.path.join(folder, "train-1.tfrecord")
    with open(plain, "wb") as f:
      f.write(_plain_shard())
    os.symlink(shards[1], os.path.join(folder, "train-0.tfrecord.gz"))
    config = _config("/unused", train_files=os.path.join(folder, "train-*"))
    with self.assertRaisesRegex(
        errors.DataError,
        "--train_files mixes GZIP .* and uncompressed TFRecord files") as cm:
      run_plan.resolve_data_files(
          config.task.data,
          task_lib.from_names(config.task).dataset)
    self.assertEqual(exit_codes.exit_code_for(cm.exception), exit_codes.CONFIG)

  def test_a_callable_that_is_no_model_builder_stops_at_start(self):
    with self.assertRaisesRegex(
        errors.ConfigError, r"--model=json:loads: loads\(s, .* has required "
        r"parameter\(s\) s that tfdist cannot fill"):
      config = TrainConfig(model="json:loads", model_dir="/m", train_steps=1)
      task_lib.from_names(config.task)

  def test_full_disk_during_a_save_is_one_line(self):
    # RLIMIT_FSIZE in the child: writes past 256 KiB fail with EFBIG
    # ("File too large"), as a full disk fails them with ENOSPC, without
    # root or a mount; the first checkpoint is bigger.
    def limit_file_size():
      resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    data = _data()
    env = dict(os.environ, PYTHONPATH=testutil.REPO_ROOT,
               TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-m", "tfdist.train", f"--model_dir={model_dir}",
         f"--train_files={data['train']}", "--mode=train",
         "--distribution_strategy=one_device", "--batch_size=64",
         "--train_steps=1", "--checkpoint_steps=1", "--log_steps=1"],
        cwd=testutil.REPO_ROOT, env=env, preexec_fn=limit_file_size,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=240)
    self.assertEqual(proc.returncode, exit_codes.CONFIG, proc.stdout[-3000:])
    self.assertNotIn("Traceback", proc.stdout)
    self.assertRegex(
        proc.stdout, "tfdist.train: error: --checkpoint_dir=.*/checkpoints: "
        "a write failed: the disk or quota is full .*File too large")
    self.assertEqual(tf.train.latest_checkpoint(
        os.path.join(model_dir, "checkpoints")), None)

  def test_a_data_file_that_vanished_is_named(self):
    folder = testutil.scratch_dir()
    path = os.path.join(folder, "train-0.tfrecord")
    with open(path, "wb") as f:
      f.write(_plain_shard()[:1000])
    os.remove(path)
    with self.assertRaises(tf.errors.NotFoundError) as cm:
      next(iter(tf.data.TFRecordDataset(path)))
    named = failures.describe(
        cm.exception, folders={"--model_dir": "/runs/a"},
        data_folders=failures.data_folders(os.path.join(folder, "train-*")),
        last_checkpoint="/runs/a/checkpoints/ckpt-4")
    self.assertIsInstance(named, errors.ConfigError)
    self.assertRegex(str(named), "A file the run reads vanished during "
                     f"training .*{path}.*resume from /runs/a/checkpoints/"
                     "ckpt-4")
    # Not a data file: left as it is.
    self.assertIsNone(failures.describe(cm.exception,
                                        folders={"--model_dir": "/runs/a"}))

  def test_a_refused_write_names_the_folder(self):
    error = tf.errors.PermissionDeniedError(
        None, None, "/runs/a/train/events.out; Permission denied")
    named = failures.describe(error, folders={"--model_dir": "/runs/a",
                                              "--tensorboard_dir": "/runs/a"})
    self.assertRegex(str(named), "^--model_dir=/runs/a: a write failed: this "
                     "process may no longer write there")

  def test_a_damaged_checkpoint_index_is_named(self):
    folder = testutil.scratch_dir()
    step = tf.Variable(0, dtype=tf.int64)
    checkpoint = tf.train.Checkpoint(step=step, w=tf.Variable([1.0, 2.0]))
    keeper = checkpointing.CheckpointKeeper(
        checkpoint=checkpoint, directory=folder, step_counter=step)
    path = keeper.save(3)
    with open(path + ".index", "wb") as f:
      f.write(b"not an index")
    keeper = checkpointing.CheckpointKeeper(
        checkpoint=checkpoint, directory=folder, step_counter=step)
    with self.assertRaisesRegex(
        errors.DamagedCheckpointError,
        f"The checkpoint {path} cannot be read, its files are damaged .*"
        r"move its files \(ckpt-3\.\*\) out of") as cm:
      keeper.restore()
    self.assertEqual(exit_codes.exit_code_for(cm.exception), exit_codes.CONFIG)
    self.assertTrue(os.path.exists(path + ".index"))  # Nothing deleted.


if __name__ == "__main__":
  absltest.main()
