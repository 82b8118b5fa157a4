"""`gs://` for real: a run reads, checkpoints, resumes and exports on GCS.

One local GCS emulator for the whole file (tests/gcs_emulator.py: the real
fake-gcs-server on 127.0.0.1, reached by TensorFlow's own GCS client through
a TLS-terminating proxy). A short `python -m tfdist.train` run reads its
Fashion-MNIST shards from `gs://`, checkpoints there, is SIGKILLed after its
first checkpoint, is run again and resumes from `gs://`, then writes its
SavedModel, TensorBoard logs and run manifest there. A second client reads
what TensorFlow wrote: `google-cloud-storage` where it is installed (the
default environment), and TensorFlow's `tf.io.gfile` in every environment
(the TF 2.17 one has no `google-cloud-storage`: it needs protobuf >= 5).
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

# Read by TensorFlow's GCS client when TensorFlow is imported: a failing
# request then fails in seconds (the default retries for about 195 s).
os.environ.setdefault("GCS_RETRY_CONFIG_MAX_RETRIES", "2")

from absl.testing import absltest
import pytest  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

from tests import gcs_emulator  # pylint: disable=g-import-not-at-top
from tests import testutil  # pylint: disable=g-import-not-at-top

# Also run on the oldest supported TensorFlow (tests/conftest.py).
pytestmark = pytest.mark.compat

_TRAIN_STEPS = 30
_CHECKPOINT_STEPS = 10
_LOG_STEPS = 5
_BATCH = 32
_LIMIT = 256  # examples per split: 8 steps per epoch at batch 32
_RUN_TIMEOUT = 300  # seconds per training run

_EMULATOR = None
_SAVED_ENV = {}


def setUpModule():
  global _EMULATOR
  _EMULATOR = gcs_emulator.GcsEmulator(bucket="tfdist-gcs-test").start()
  # This process reads and checks gs:// too (tf.io.gfile).
  for key, value in _EMULATOR.env().items():
    _SAVED_ENV[key] = os.environ.get(key)
    os.environ[key] = value


def tearDownModule():
  for key, value in _SAVED_ENV.items():
    if value is None:
      os.environ.pop(key, None)
    else:
      os.environ[key] = value
  if _EMULATOR is not None:
    _EMULATOR.stop()


def _copy_to_gcs(local_dir: str, gcs_dir: str):
  for path in tf.io.gfile.glob(os.path.join(local_dir, "*.tfrecord.gz")):
    tf.io.gfile.copy(path, f"{gcs_dir}/{os.path.basename(path)}")


@pytest.mark.cluster
class GcsKillAndResumeTest(absltest.TestCase):
  """One killed run and its resumption, shared by the checks below."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    bucket = _EMULATOR.url
    local = testutil.fashion_mnist_subset(limit=_LIMIT, train_shards=4,
                                          test_shards=2)
    cls.data_dir = f"{bucket}/data"
    _copy_to_gcs(local["dir"], cls.data_dir)
    cls.model_dir = f"{bucket}/run"
    cls.checkpoint_dir = f"{cls.model_dir}/checkpoints"
    cls.args = [
        f"--model_dir={cls.model_dir}",
        f"--train_files={cls.data_dir}/train-*.tfrecord.gz",
        f"--eval_files={cls.data_dir}/test-*.tfrecord.gz",
        "--distribution_strategy=one_device",
        f"--train_steps={_TRAIN_STEPS}", f"--checkpoint_steps={_CHECKPOINT_STEPS}",
        f"--batch_size={_BATCH}", f"--log_steps={_LOG_STEPS}",
        "--epochs_between_evals=100",  # evaluate once, at the end
        "--seed=3"]
    env = _EMULATOR.env(dict(os.environ))
    cls.first = cls._run_until_first_checkpoint(env)
    cls.killed_at = tf.train.latest_checkpoint(cls.checkpoint_dir)
    cls.manifest_after_kill = tf.io.gfile.exists(
        f"{cls.model_dir}/run_manifest.json")
    cls.second = testutil.run_module("tfdist.train", cls.args,
                                     timeout=_RUN_TIMEOUT, env=env)
    if cls.second.returncode == 0:
      with tf.io.gfile.GFile(f"{cls.model_dir}/run_manifest.json") as f:
        cls.manifest = json.load(f)

  @classmethod
  def _run_until_first_checkpoint(cls, env):
    """Starts the run, SIGKILLs it once a checkpoint is on gs://.

    Returns:
      `(returncode, output)`.
    """
    env = dict(env, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=testutil.REPO_ROOT + os.pathsep +
               env.get("PYTHONPATH", ""))
    with tempfile.TemporaryFile("w+") as log:
      proc = subprocess.Popen(
          [sys.executable, "-m", "tfdist.train", *cls.args],
          cwd=testutil.REPO_ROOT, env=env, stdout=log,
          stderr=subprocess.STDOUT, text=True)
      try:
        deadline = time.monotonic() + _RUN_TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline:
          if tf.train.latest_checkpoint(cls.checkpoint_dir):
            proc.send_signal(signal.SIGKILL)
            break
          time.sleep(0.1)
      finally:
        if proc.poll() is None:
          proc.kill()
        proc.wait(timeout=30)
      log.seek(0)
      return proc.returncode, log.read()

  def test_first_run_killed_after_a_checkpoint_on_gcs(self):
    returncode, output = self.first
    self.assertEqual(returncode, -signal.SIGKILL,
                     f"the first run was to be killed mid-run:\n{output[-3000:]}")
    self.assertIsNotNone(self.killed_at)
    self.assertTrue(self.killed_at.startswith(f"{self.checkpoint_dir}/ckpt-"))
    step = int(self.killed_at.rsplit("-", 1)[1])
    self.assertGreater(step, 0)
    self.assertLess(step, _TRAIN_STEPS)
    self.assertFalse(self.manifest_after_kill,
                     "a killed run must not have written its manifest")

  def test_second_run_resumes_from_gcs_and_finishes(self):
    self.assertEqual(self.second.returncode, 0, self.second.stdout[-3000:])
    step = int(self.killed_at.rsplit("-", 1)[1])
    self.assertIn(f"restored {self.killed_at}: resuming at step {step}",
                  self.second.stdout)
    manifest = self.manifest
    self.assertEqual(manifest["final_step"], _TRAIN_STEPS)
    # The resumed run logged only the steps after the restored one; the
    # history (metrics.jsonl on gs://) also holds the killed run's records
    # up to that step.
    last = manifest["history"][-1]["process"]
    logged = [record["step"] for record in manifest["history"]
              if record["process"] == last]
    self.assertEqual(logged[0], step + _LOG_STEPS)
    self.assertEqual(logged[-1], _TRAIN_STEPS)
    self.assertTrue(all(record["step"] <= step
                        for record in manifest["history"]
                        if record["process"] != last))
    self.assertTrue(manifest["restored_from"].endswith(f"ckpt-{step}"))
    self.assertEqual(manifest["artifacts"]["checkpoint"],
                     f"{self.checkpoint_dir}/ckpt-{_TRAIN_STEPS}")
    self.assertEqual(manifest["artifacts"]["saved_model"],
                     f"{self.model_dir}/saved_model")
    train_files = manifest["data"]["train_files"]
    self.assertLen(train_files, 4)
    for entry in train_files:
      self.assertTrue(entry["path"].startswith(f"{self.data_dir}/train-"))
      self.assertLen(entry["sha256"], 64)
    self.assertEqual(manifest["final_metrics"]["eval_examples"], _LIMIT)

  def _check_saved_model(self, export_dir: str):
    images = self._first_test_images()
    reloaded = tf.saved_model.load(export_dir)
    logits = list(reloaded.signatures["serving_default"](
        tf.constant(images)).values())[0].numpy()
    self.assertEqual(logits.shape, (len(images), 10))
    self.assertTrue(np.all(np.isfinite(logits)))

  def _first_test_images(self, n: int = 8) -> np.ndarray:
    from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
    spec = datasets.get_dataset_spec("fashion_mnist")
    files = tf.io.gfile.glob(f"{self.data_dir}/test-*.tfrecord.gz")
    dataset = tf.data.TFRecordDataset(sorted(files), compression_type="GZIP")
    images = [spec.parse_fn(record)[0].numpy() for record in dataset.take(n)]
    return np.stack(images)

  def _check_events(self, paths, restored_step: int):
    """The `batch_loss` scalars of the resumed run are in the events files."""
    steps = set()
    for path in paths:
      for event in tf.compat.v1.train.summary_iterator(path):
        for value in event.summary.value:
          if value.tag == "batch_loss":
            steps.add(event.step)
    self.assertContainsSubset(
        range(restored_step + _LOG_STEPS, _TRAIN_STEPS + 1, _LOG_STEPS),
        steps)

  def test_tensorflow_reads_back_what_it_wrote_on_gcs(self):
    self.assertEqual(self.second.returncode, 0, self.second.stdout[-3000:])
    names = set(tf.io.gfile.listdir(self.model_dir))
    self.assertContainsSubset(
        {"run_manifest.json", "checkpoints/", "saved_model/", "train/"},
        names)
    self.assertFalse([n for n in names if n.startswith(".tmp-export")])
    self.assertTrue(tf.io.gfile.exists(
        f"{self.model_dir}/saved_model/saved_model.pb"))
    self._check_saved_model(f"{self.model_dir}/saved_model")
    events = tf.io.gfile.glob(f"{self.model_dir}/train/events.out.tfevents.*")
    self.assertTrue(events)
    self._check_events(events, int(self.killed_at.rsplit("-", 1)[1]))

  def test_google_cloud_storage_reads_what_tensorflow_wrote(self):
    try:
      client = _EMULATOR.storage_client()
    except ImportError as e:
      self.skipTest(
          f"google-cloud-storage is not installed here ({e}); it needs "
          "protobuf >= 5, which TensorFlow 2.17 forbids. "
          "test_tensorflow_reads_back_what_it_wrote_on_gcs read the "
          "artifacts with tf.io.gfile instead.")
    self.assertEqual(self.second.returncode, 0, self.second.stdout[-3000:])
    blobs = {blob.name: blob for blob in client.list_blobs(
        _EMULATOR.bucket, prefix="run/")}
    for name in ("run/run_manifest.json", "run/checkpoints/checkpoint",
                 f"run/checkpoints/ckpt-{_TRAIN_STEPS}.index",
                 "run/saved_model/saved_model.pb",
                 "run/saved_model/variables/variables.index"):
      self.assertIn(name, blobs)
    manifest = json.loads(blobs["run/run_manifest.json"].download_as_bytes())
    self.assertEqual(manifest, self.manifest)
    # Copy the SavedModel and the events files out with the other client,
    # then load them from local disk.
    local = testutil.scratch_dir()
    for name, blob in blobs.items():
      if name.endswith("/") or not name.startswith(
          ("run/saved_model/", "run/train/")):
        continue
      path = os.path.join(local, name)
      os.makedirs(os.path.dirname(path), exist_ok=True)
      blob.download_to_filename(path)
    self._check_saved_model(os.path.join(local, "run", "saved_model"))
    events = sorted(n for n in blobs if n.startswith(
        "run/train/events.out.tfevents."))
    self.assertTrue(events)
    self._check_events([os.path.join(local, name) for name in events],
                       int(self.killed_at.rsplit("-", 1)[1]))


if __name__ == "__main__":
  absltest.main()
