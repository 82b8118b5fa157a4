"""File systems from tensorflow-io (tfdist/data/filesystems.py), and `s3://`.

Where tensorflow-io loads (TensorFlow 2.17: tools/test.sh runs this file in
.venv-tf217 too), a short training run reads its shards from `s3://`,
checkpoints, logs, exports and writes its manifest there, then a second run
resumes from the `s3://` checkpoint. The S3 server is moto's server mode
(PyPI `moto[s3]`), started once for this file on 127.0.0.1 (port from
portpicker); tensorflow-io's S3 client reaches it through `S3_ENDPOINT`,
boto3 creates the bucket, uploads the shards and reads back what tfdist
wrote. Where tensorflow-io does not load (TensorFlow 2.21, the default
environment), an `s3://` path must stop the binary at start with an error
naming the package, the TensorFlow versions it loads with and the fix.
"""

import contextlib
import hashlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

from absl.testing import absltest
from absl.testing import flagsaver
from absl.testing import parameterized
import portpicker
import pytest

from tests import testutil
from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.data import filesystems

# Also run on the oldest supported TensorFlow (see tests/conftest.py).
pytestmark = pytest.mark.compat

BUCKET = "tfdist-test"
# Test settings for tensorflow-io's S3 client and boto3 (never defaults of
# tfdist): the emulator's address, plain HTTP, any credentials.
S3_CLIENT_ENV = {"AWS_ACCESS_KEY_ID": "testing",
                 "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_REGION": "us-east-1", "S3_USE_HTTPS": "0",
                 "S3_VERIFY_SSL": "0"}


def _tensorflow_io_loads() -> bool:
  """Whether tensorflow-io registers `s3://` with this TensorFlow."""
  try:
    filesystems.require_file_systems([("--train_files", "s3://b/x")])
    return True
  except errors.FileSystemUnavailableError:
    return False


class SchemeTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("local", "/data/train-*.gz", ""), ("s3", "s3://bucket/x", "s3"),
      ("gcs", "gs://bucket/x", "gs"), ("upper_case", "S3://b/x", "s3"),
      ("file_url", "file:///tmp/x", "file"), ("hdfs", "hdfs://nn:8020/x",
                                              "hdfs"))
  def test_scheme_of(self, path, scheme):
    self.assertEqual(filesystems.scheme_of(path), scheme)

  def test_config_paths_lists_every_path_flag(self):
    config = TrainConfig(model_dir="s3://b/run", train_steps=1,
                         train_files="s3://b/a-*.gz, /local/b-*.gz",
                         eval_files="gs://b/e-*.gz", export_dir="/exp")
    self.assertEqual(filesystems.config_paths(config), [
        ("--train_files", "s3://b/a-*.gz"), ("--train_files", "/local/b-*.gz"),
        ("--eval_files", "gs://b/e-*.gz"), ("--model_dir", "s3://b/run"),
        ("--export_dir", "/exp")])

  def test_local_and_builtin_schemes_need_nothing(self):
    self.assertEqual(filesystems.require_file_systems([
        ("--model_dir", "/tmp/x"), ("--train_files", "gs://b/x-*"),
        ("--eval_files", "ram://x"), ("--data_dir", "file:///tmp")]), ())

  def test_unknown_scheme_names_flag_and_registered_schemes(self):
    with self.assertRaisesRegex(
        errors.FileSystemUnavailableError,
        r"--eval_files='nosuch://b/x': TensorFlow \S+ has no 'nosuch://' "
        r"file system \(registered: .*gs://"):
      filesystems.require_file_systems([("--eval_files", "nosuch://b/x")])


class WithoutTensorflowIoTest(absltest.TestCase):
  """Where tensorflow-io does not load: TensorFlow 2.21 (or not installed)."""

  def setUp(self):
    super().setUp()
    if _tensorflow_io_loads():
      self.skipTest("tensorflow-io loads here (TensorFlow 2.17): "
                    "S3EmulatorTest covers s3://")

  def test_s3_path_stops_the_binary_at_start(self):
    # The binary's main in this process (no second Python and TensorFlow
    # start-up): the flags parsed by its parser, its exit and its stderr.
    from tfdist import train  # pylint: disable=g-import-not-at-top
    model_dir = testutil.scratch_dir()
    started = time.time()
    with flagsaver.flagsaver():
      train._parse_flags([  # pylint: disable=protected-access
          "tfdist.train", f"--model_dir={model_dir}", "--train_steps=5",
          "--train_files=s3://bucket/train-*.tfrecord.gz"])
      with contextlib.redirect_stderr(io.StringIO()) as err:
        with self.assertRaises(SystemExit) as stopped:
          train.main(["tfdist.train"])
    self.assertNotIn(stopped.exception.code, (0, None), err.getvalue())
    for text in ("--train_files='s3://bucket/train-*.tfrecord.gz'",
                 "has no 's3://' file system",
                 "The package tensorflow-io provides it",
                 "loads with TensorFlow 2.16 and 2.17 only",
                 "pip install 'tfdist[io]'"):
      self.assertIn(text, err.getvalue())
    self.assertLess(time.time() - started, 60)
    self.assertFalse(os.listdir(model_dir))  # nothing written

  def test_installed_tensorflow_io_that_does_not_load_is_named(self):
    # The real tensorflow-io 0.37.1 wheel (from the wheelhouse that
    # tools/setup.sh fills; no download), first on the path.
    target = os.path.join(testutil.scratch_dir(), "tensorflow_io")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index",
         "--no-deps", "--disable-pip-version-check", "--find-links",
         testutil.setup_output(".wheelhouse"), "--target", target,
         f"tensorflow-io=={filesystems.TENSORFLOW_IO_VERSION}",
         f"tensorflow-io-gcs-filesystem=={filesystems.TENSORFLOW_IO_VERSION}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=300)
    self.assertEqual(proc.returncode, 0, proc.stdout)
    model_dir = testutil.scratch_dir()
    proc = testutil.run_module("tfdist.train", [
        f"--model_dir=s3://bucket/run", "--train_steps=5",
        f"--data_dir={model_dir}"], timeout=120,
                               env={"PYTHONPATH": target + os.pathsep +
                                    testutil.REPO_ROOT})
    self.assertNotEqual(proc.returncode, 0, proc.stdout[-3000:])
    self.assertIn("--model_dir='s3://bucket/run'", proc.stdout)
    self.assertIn("here tensorflow-io 0.37.1 is installed but its libraries "
                  "do not load with this TensorFlow (undefined symbol: ",
                  proc.stdout)
    self.assertIn("loads with TensorFlow 2.16 and 2.17 only", proc.stdout)
    self.assertFalse(os.listdir(model_dir))


@pytest.mark.cluster
class S3EmulatorTest(absltest.TestCase):
  """`s3://` for real against moto's S3 server (TensorFlow 2.17)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.server = None
    if not _tensorflow_io_loads():
      return
    import boto3  # pylint: disable=g-import-not-at-top
    port = portpicker.pick_unused_port()
    cls.endpoint = f"http://127.0.0.1:{port}"
    cls.server_log = open(os.path.join(testutil.scratch_dir(), "moto.log"),
                          "w")
    cls.server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
         str(port)], stdout=cls.server_log, stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while True:
      try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        break
      except OSError:
        if time.time() > deadline or cls.server.poll() is not None:
          cls.tearDownClass()
          raise AssertionError(f"moto's S3 server did not start on {port}")
        time.sleep(0.1)
    cls.s3 = boto3.client(
        "s3", endpoint_url=cls.endpoint,
        region_name=S3_CLIENT_ENV["AWS_REGION"],
        aws_access_key_id=S3_CLIENT_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=S3_CLIENT_ENV["AWS_SECRET_ACCESS_KEY"])
    cls.s3.create_bucket(Bucket=BUCKET)
    cls.data = testutil.fashion_mnist_subset(limit=512, train_shards=4,
                                             test_shards=2)
    cls.local_sha256 = {}
    for name in sorted(os.listdir(cls.data["dir"])):
      if name.endswith(".tfrecord.gz"):
        path = os.path.join(cls.data["dir"], name)
        cls.s3.upload_file(path, BUCKET, f"data/{name}")
        with open(path, "rb") as f:
          cls.local_sha256[name] = hashlib.sha256(f.read()).hexdigest()

  @classmethod
  def tearDownClass(cls):
    if cls.server is not None and cls.server.poll() is None:
      os.kill(cls.server.pid, signal.SIGTERM)
      try:
        cls.server.wait(timeout=10)
      except subprocess.TimeoutExpired:
        os.kill(cls.server.pid, signal.SIGKILL)
        cls.server.wait(timeout=10)
    if cls.server is not None:
      cls.server_log.close()
    super().tearDownClass()

  def setUp(self):
    super().setUp()
    if self.server is None:
      self.skipTest("tensorflow-io does not load with this TensorFlow: "
                    "WithoutTensorflowIoTest covers s3:// here")

  def _train(self, model_dir, steps):
    return testutil.run_module("tfdist.train", [
        f"--train_files=s3://{BUCKET}/data/train-*.tfrecord.gz",
        f"--eval_files=s3://{BUCKET}/data/test-*.tfrecord.gz",
        f"--model_dir={model_dir}", f"--train_steps={steps}",
        "--batch_size=64", "--log_steps=4", "--checkpoint_steps=4",
        "--distribution_strategy=one_device"], timeout=300,
                               env=dict(S3_CLIENT_ENV,
                                        S3_ENDPOINT=self.endpoint))

  def _keys(self, prefix):
    listing = self.s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"][len(prefix):] for o in listing.get("Contents", [])}

  def _manifest(self, prefix):
    body = self.s3.get_object(Bucket=BUCKET,
                              Key=prefix + "run_manifest.json")["Body"]
    return json.loads(body.read())

  def test_run_reads_shards_writes_artifacts_and_resumes_on_s3(self):
    model_dir = f"s3://{BUCKET}/runs/one"
    prefix = "runs/one/"
    proc = self._train(model_dir, steps=4)
    # 0, not 134: tfdist.train ends with os._exit after tensorflow-io's S3
    # client was used (tensorflow/io#2039 aborts at exit otherwise).
    self.assertEqual(proc.returncode, 0, proc.stdout[-4000:])
    keys = self._keys(prefix)
    for key in ("checkpoints/checkpoint", "checkpoints/ckpt-4.index",
                "saved_model/saved_model.pb", "run_manifest.json"):
      self.assertIn(key, keys)
    self.assertTrue(any(k.startswith("train/events.out.tfevents.")
                        for k in keys), keys)
    manifest = self._manifest(prefix)
    self.assertEqual(manifest["final_step"], 4)
    self.assertEqual(manifest["final_metrics"]["eval_examples"], 512)
    # The shards were read from s3:// (fingerprinted through tf.io.gfile).
    read = {os.path.basename(f["path"]): f["sha256"]
            for f in manifest["data"]["train_files"] +
            manifest["data"]["eval_files"]}
    self.assertTrue(all(f["path"].startswith(f"s3://{BUCKET}/data/")
                        for f in manifest["data"]["train_files"]))
    self.assertEqual(read, self.local_sha256)

    # The same command with more steps resumes from the s3:// checkpoint.
    proc = self._train(model_dir, steps=8)
    self.assertEqual(proc.returncode, 0, proc.stdout[-4000:])
    manifest = self._manifest(prefix)
    self.assertEqual(manifest["final_step"], 8)
    # The history covers both processes (metrics.jsonl on s3://): the first
    # run's log at 4, then the resumed run's at 8.
    self.assertEqual([h["step"] for h in manifest["history"]], [4, 8])
    self.assertLen({h["process"] for h in manifest["history"]}, 2)
    self.assertTrue(manifest["restored_from"].endswith("ckpt-4"))
    self.assertIn("checkpoints/ckpt-8.index", self._keys(prefix))


if __name__ == "__main__":
  absltest.main()
