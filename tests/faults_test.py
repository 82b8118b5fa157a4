"""Faults a new user meets, each one small input on a real run.

Real short runs on a real Fashion-MNIST subset, in this process
(`run_experiment`) or as the binary in a subprocess where the exit status or
a signal is what is tested:

* divergence: a learning rate that overflows saves no NaN checkpoint, keeps
  the last good one through the rotation, names it in one error (status 1,
  no traceback), and a rerun with a sane rate finishes from it; a finite
  loss far above its early value is named in a warning;
* resumption: a changed model or global batch is refused, other changes
  are listed;
* data: a cut training or evaluation shard is named at start, records of
  another schema print expected against found features, `id` is optional;
* outputs: an unwritable output folder is named before anything else;
* the `--model_dir` lease: a second run refuses while the first is alive,
  also during a step that blocks in C++; the grace period after SIGTERM is
  a bound even then (status 137); a restarted run takes the lease over and
  resumes;
* exit statuses and the job-spec writer's flag checks.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import pytest
import tensorflow as tf

from tests import testutil
from tfdist import experiment
from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.data import datasets
from tfdist.observability import manifest as manifest_lib
from tfdist.observability import run_log as run_log_lib


def _data():
  return testutil.fashion_mnist_subset(limit=512, train_shards=4,
                                       test_shards=2)


def _config(model_dir, **overrides):
  data = _data()
  kwargs = dict(model_dir=model_dir, train_files=data["train"],
                eval_files=data["eval"], distribution_strategy="one_device",
                batch_size=64, train_steps=8, log_steps=4, warmup_steps=2,
                checkpoint_steps=4, seed=7)
  kwargs.update(overrides)
  return TrainConfig(**kwargs)


def _flags(config_kwargs) -> list:
  return [f"--{k}={v}" for k, v in config_kwargs.items()]


def _checkpoints(model_dir):
  state = tf.train.get_checkpoint_state(os.path.join(model_dir,
                                                     "checkpoints"))
  return list(state.all_model_checkpoint_paths) if state else []


def _finite(checkpoint: str) -> bool:
  reader = tf.train.load_checkpoint(checkpoint)
  for name in reader.get_variable_to_shape_map():
    value = reader.get_tensor(name)
    if np.issubdtype(np.asarray(value).dtype, np.floating) and not (
        np.all(np.isfinite(value))):
      return False
  return True


def _write_records(path, examples):
  options = tf.io.TFRecordOptions(compression_type="GZIP")
  with tf.io.TFRecordWriter(path, options) as writer:
    for features in examples:
      writer.write(tf.train.Example(features=tf.train.Features(
          feature=features)).SerializeToString())


def _int64(value):
  return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))


def _bytes(value):
  return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))


class _Lines:
  """Collects a subprocess's output lines in a thread; waits for one."""

  def __init__(self, proc):
    self.proc = proc
    self.lines = []
    self._cond = threading.Condition()
    self._thread = threading.Thread(target=self._read, daemon=True)
    self._thread.start()

  def _read(self):
    for line in self.proc.stdout:
      with self._cond:
        self.lines.append(line)
        self._cond.notify_all()
    with self._cond:
      self._cond.notify_all()

  def wait_for(self, text, timeout):
    end = time.time() + timeout
    with self._cond:
      while not any(text in line for line in self.lines):
        if time.time() > end or (self.proc.poll() is not None and
                                 not self._thread.is_alive()):
          return False
        self._cond.wait(0.5)
    return True

  def text(self):
    self._thread.join(timeout=10)
    return "".join(self.lines)


class FaultsTest(parameterized.TestCase):

  # One healthy run (checkpoints at steps 4 and 8), copied by the tests that
  # need it; made by the first of them, so that a pass without those tests
  # (the `compat` pass on TensorFlow 2.17) does not train it.
  _healthy = None

  def _copy_healthy(self):
    if FaultsTest._healthy is None:
      healthy = os.path.join(testutil.scratch_dir(), "healthy")
      experiment.run_experiment(_config(healthy))
      FaultsTest._healthy = healthy
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    shutil.copytree(FaultsTest._healthy, model_dir)
    return model_dir

  # --- 1. divergence --------------------------------------------------------
  def test_divergence_keeps_the_last_good_checkpoint_and_a_sane_rerun_finishes(
      self):
    model_dir = self._copy_healthy()
    # An interrupted save's parts: removed at start.
    debris = os.path.join(model_dir, "checkpoints", "ckpt-9_temp")
    os.makedirs(debris)
    with open(os.path.join(debris, "part-00000-of-00001.index"), "w") as f:
      f.write("half a save")
    data = _data()
    proc = testutil.run_module("tfdist.train", _flags(dict(
        model_dir=model_dir, train_files=data["train"],
        eval_files=data["eval"], distribution_strategy="one_device",
        batch_size=64, train_steps=40, log_steps=20, checkpoint_steps=2,
        max_checkpoints=2, base_learning_rate=1e30, warmup_steps=0,
        seed=7)), timeout=300)
    out = proc.stdout
    self.assertEqual(proc.returncode, 1, out[-4000:])  # Permanent.
    self.assertNotIn("Traceback", out)  # One message, not a traceback.
    error = [l for l in out.splitlines() if "Training diverged at step" in l]
    self.assertLen(error, 1, out[-4000:])
    self.assertIn("the last good checkpoint, "
                  f"{os.path.join(model_dir, 'checkpoints', 'ckpt-8')}, is "
                  "kept", error[0])
    self.assertIn("--base_learning_rate", error[0])
    # The value to lower, as the schedule gave it (linear rule: 1e30 x 64 /
    # the default --base_batch_size of 256).
    self.assertIn("the learning rate was 2.5e+29 there", error[0])
    self.assertNotIn("fp32", error[0])  # An fp32 run: no precision advice.
    self.assertNotIn("loss_scale", error[0])
    self.assertFalse(os.path.exists(debris))
    # Nothing non-finite was saved; the rotation kept the last good one.
    saved = _checkpoints(model_dir)
    self.assertTrue(saved[-1].endswith("ckpt-8"), saved)
    self.assertTrue(all(_finite(c) for c in saved), saved)
    # A rerun with a sane rate continues from it and finishes; it says what
    # changed since the run that wrote the checkpoint (the healthy one: the
    # diverged run saved nothing, so its settings were never recorded).
    with self.assertLogs(level="WARNING") as logs:
      record = experiment.run_experiment(_config(model_dir, train_steps=12))
    self.assertTrue(record["restored_from"].endswith("ckpt-8"))
    self.assertEqual(record["final_step"], 12)
    self.assertTrue(np.isfinite(record["final_metrics"]["eval_loss"]))
    said = "\n".join(logs.output)
    self.assertNotIn("--base_learning_rate", said)
    self.assertIn("schedules (--lr_schedule=constant) are recomputed", said)

  @pytest.mark.compat  # Also on the oldest TensorFlow.
  def test_a_finite_loss_far_above_its_early_value_is_named(self):
    self.assertEqual(TrainConfig().loss_explosion_factor, 10.0)
    log = run_log_lib.RunLog(tensorboard_dir=None, metrics_dir=None,
                             global_batch_size=64, total_steps=30,
                             loss_explosion_factor=10.0)
    sums = lambda loss: {"loss": loss * 10, "correct": 6.0, "count": 640.0}
    with self.assertLogs(level="INFO") as logs:
      log.log_train(10, sums(2.3), 10, learning_rate=0.1)
      log.log_train(20, sums(9.0), 10, learning_rate=0.1)  # Under 10x.
      log.log_train(30, sums(1e21), 10, learning_rate=0.1)
      log.log_train(40, sums(2e21), 10, learning_rate=0.1)  # Said once.
    warnings = [l for l in logs.output if l.startswith("WARNING")]
    self.assertLen(warnings, 1, logs.output)
    self.assertIn("loss 1e+21 at step 30 is more than 10 times its early "
                  "value 2.3 (step 10)", warnings[0])
    self.assertIn("--loss_explosion_factor", warnings[0])

  # --- 2. resuming with other flags ----------------------------------------
  def test_resume_refuses_a_changed_model_or_global_batch(self):
    model_dir = self._copy_healthy()
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"Cannot resume from .*ckpt-8: the global batch changed "
        r"from 64 to 32 .*--allow_incompatible_resume"):
      experiment.run_experiment(_config(model_dir, batch_size=32))
    with self.assertRaisesRegex(errors.ConfigError,
                                r"the model changed \(--model cnn -> resnet\)"):
      experiment.run_experiment(_config(model_dir, model="resnet"))
    self.assertTrue(_checkpoints(model_dir)[-1].endswith("ckpt-8"))
    # Allowed changes go through and are listed (dry runs build nothing).
    result = experiment.run_experiment(
        _config(model_dir, train_steps=16, lr_schedule="cosine",
                dry_run=True))
    notes = "; ".join(result["resume_notes"])
    self.assertIn("the run is longer: 8 -> 16 steps; the warmup and decay "
                  "schedules (--lr_schedule=cosine) are recomputed", notes)
    self.assertIn("--lr_schedule constant -> cosine", notes)
    result = experiment.run_experiment(
        _config(model_dir, batch_size=32, allow_incompatible_resume=True,
                dry_run=True))
    self.assertIn("global batch changed from 64 to 32",
                  "; ".join(result["resume_notes"]))

  @pytest.mark.compat  # Also on the oldest TensorFlow.
  def test_another_replica_count_at_the_same_global_batch_is_allowed(self):
    from tfdist.training.state import checkpointing  # pylint: disable=g-import-not-at-top
    before = {"global_batch_size": 64, "num_replicas_in_sync": 2,
              "per_replica_batch_size": 32, "total_steps": 100,
              "config": {"model": "cnn", "dataset": "fashion_mnist"}}
    after = dict(before, num_replicas_in_sync=1, per_replica_batch_size=64)
    notes = checkpointing.check_resume(before, after, checkpoint="ckpt-50",
                                       restored_step=50)
    self.assertEqual(notes, ["2 -> 1 replicas at the same global batch 64: "
                             "per-replica batch 32 -> 64"])

  # --- 3. data ---------------------------------------------------------------
  def _data_copy(self):
    out = os.path.join(testutil.scratch_dir(), "data")
    shutil.copytree(_data()["dir"], out)
    return {"train": os.path.join(out, "train-*.tfrecord.gz"),
            "eval": os.path.join(out, "test-*.tfrecord.gz"), "dir": out}

  @parameterized.named_parameters(
      ("training_shard", "train-00001-of-00004.tfrecord.gz",
       "training file"),
      ("evaluation_shard", "test-00001-of-00002.tfrecord.gz",
       "evaluation file"))
  @pytest.mark.compat  # Also on the oldest TensorFlow.
  def test_a_cut_shard_is_named_at_start(self, name, what):
    data = self._data_copy()
    path = os.path.join(data["dir"], name)
    with open(path, "rb") as f:
      content = f.read()
    with open(path, "wb") as f:
      f.write(content[:len(content) // 2])  # Cut mid-record.
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    with self.assertRaisesRegex(
        errors.ConfigError,
        rf"{what} {re.escape(path)} is damaged: the GZIP data "
        r"ends inside record (\d+) \(at byte \d+ of the decompressed "
        r"records\) \(after (\d+) good record\(s\)\)\. The file") as caught:
      experiment.run_experiment(_config(model_dir, train_files=data["train"],
                                        eval_files=data["eval"]))
    record, good = re.search(r"inside record (\d+) .*after (\d+) good",
                             str(caught.exception)).groups()
    self.assertEqual(int(record), int(good) + 1)
    # Before any training: no checkpoint.
    self.assertFalse(os.path.exists(os.path.join(model_dir, "checkpoints")))

  @pytest.mark.compat  # Also on the oldest TensorFlow.
  def test_records_of_another_schema_print_expected_and_found(self):
    folder = testutil.scratch_dir()
    for split in ("train", "test"):
      _write_records(os.path.join(folder, f"{split}.tfrecord.gz"),
                     [{"img": _bytes(bytes(784)), "y": _int64(3)}] * 8)
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    with self.assertRaises(errors.ConfigError) as caught:
      experiment.run_experiment(_config(
          model_dir, train_files=os.path.join(folder, "train.tfrecord.gz"),
          eval_files=os.path.join(folder, "test.tfrecord.gz"),
          batch_size=4))
    message = str(caught.exception)
    self.assertIn("image is missing; label is missing", message)
    self.assertIn("  expected: id int64[1] (optional), image bytes[1], "
                  "label int64[1]\n  found:    img bytes[1], y int64[1]",
                  message)
    self.assertFalse(os.path.exists(os.path.join(model_dir, "checkpoints")))

  @pytest.mark.compat  # Also on the oldest TensorFlow.
  def test_the_id_feature_is_optional(self):
    folder = testutil.scratch_dir()
    pixels = np.arange(784, dtype=np.uint8).tobytes()
    for split in ("train", "test"):
      _write_records(os.path.join(folder, f"{split}.tfrecord.gz"),
                     [{"image": _bytes(pixels), "label": _int64(k % 10)}
                      for k in range(64)])
    record = tf.train.Example(features=tf.train.Features(feature={
        "image": _bytes(pixels), "label": _int64(7)})).SerializeToString()
    image, label, example_id = datasets.parse_image_example(
        tf.constant(record), with_id=True)
    self.assertEqual((int(label), int(example_id)), (7, -1))
    np.testing.assert_allclose(image.numpy().reshape(-1),
                               (np.arange(784) % 256) / 255.0, rtol=1e-6)
    # The start-up check accepts the files (a dry run reads them all).
    result = experiment.run_experiment(_config(
        os.path.join(testutil.scratch_dir(), "run"),
        train_files=os.path.join(folder, "train.tfrecord.gz"),
        eval_files=os.path.join(folder, "test.tfrecord.gz"),
        batch_size=16, dry_run=True))
    self.assertEqual((result["num_train_examples"],
                      result["num_eval_examples"]), (64, 64))

  # --- 4. outputs ------------------------------------------------------------
  @parameterized.named_parameters(
      ("model_dir", "model_dir"), ("checkpoint_dir", "checkpoint_dir"),
      ("tensorboard_dir", "tensorboard_dir"), ("export_dir", "export_dir"))
  @pytest.mark.compat  # Also on the oldest TensorFlow.
  def test_an_unwritable_output_is_named_before_anything_else(self, flag):
    base = testutil.scratch_dir()
    blocker = os.path.join(base, "a_file")
    with open(blocker, "w") as f:
      f.write("a regular file, not a folder")
    bad = os.path.join(blocker, "out")
    overrides = {flag: bad}
    model_dir = bad if flag == "model_dir" else os.path.join(base, "run")
    overrides.pop("model_dir", None)
    # The data does not exist either: the output check comes first.
    with self.assertRaisesRegex(
        errors.ConfigError, rf"--{flag}={re.escape(bad)} is not writable.*: "
        rf"{re.escape(blocker)} is a file, not a folder"):
      experiment.run_experiment(_config(model_dir, train_files="/no/such/*",
                                        **overrides))

  # --- 5. one run per --model_dir; signals within the grace period ---------
  def test_lease_refuses_a_second_run_grace_is_a_bound_restart_takes_over(
      self):
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    data = _data()
    env = dict(os.environ, PYTHONPATH=testutil.REPO_ROOT + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    first = subprocess.Popen(
        [sys.executable, "-m", "tests.faults_testlib"] + _flags(dict(
            model_dir=model_dir, train_files=data["train"],
            eval_files=data["eval"], distribution_strategy="one_device",
            batch_size=64, train_steps=20, log_steps=2, checkpoint_steps=2,
            warmup_steps=0, seed=7, preemption_grace_seconds=2,
            block_at_step=4)),
        cwd=testutil.REPO_ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, errors="replace")
    self.addCleanup(lambda: first.poll() is None and first.kill())
    lines = _Lines(first)
    self.assertTrue(lines.wait_for("faults_testlib: blocking at step 4",
                                   timeout=240), lines.text()[-4000:])
    # The same command again, while the first run is alive (blocked inside
    # TensorFlow): refused, naming the holder; nothing written.
    with self.assertRaises(Exception) as caught:
      experiment.run_experiment(_config(model_dir, train_steps=20))
    message = str(caught.exception)
    self.assertIn(f"--model_dir={model_dir} is in use by another run", message)
    self.assertIn(f"pid {first.pid} on host {socket.gethostname()}", message)
    from tfdist import exit_codes  # pylint: disable=g-import-not-at-top
    self.assertEqual(exit_codes.exit_code_for(caught.exception),
                     exit_codes.LEASE_HELD)
    self.assertTrue(exit_codes.is_retryable(exit_codes.LEASE_HELD))
    self.assertTrue(_checkpoints(model_dir)[-1].endswith("ckpt-4"))
    # A dry run checks the lease too.
    with self.assertRaisesRegex(Exception, "is in use by another run"):
      experiment.run_experiment(_config(model_dir, dry_run=True))
    # SIGTERM while the step blocks in C++: the process is ended when the
    # grace period (2 s) after the signal's arrival runs out.
    signalled = time.time()
    first.send_signal(signal.SIGTERM)
    status = first.wait(timeout=120)
    took = time.time() - signalled
    out = lines.text()
    self.assertEqual(status, -signal.SIGKILL, out[-3000:])  # 137: retryable.
    self.assertBetween(took, 1.8, 15.0)
    delay = re.search(r"tfdist: error: still running (\d+\.\d) s after "
                      r"SIGTERM \(--preemption_grace_seconds=2\)", out)
    self.assertIsNotNone(delay, out[-3000:])
    self.assertBetween(float(delay.group(1)), 1.9, 6.0)
    # The restarted run: the holder's process is gone, so it takes the lease
    # over at once and resumes from the last checkpoint.
    with self.assertLogs(level="WARNING") as logs:
      record = experiment.run_experiment(_config(model_dir, train_steps=6,
                                                 checkpoint_steps=2,
                                                 warmup_steps=0))
    self.assertIn(f"its process (pid {first.pid} on this host) is gone",
                  "\n".join(logs.output))
    self.assertTrue(record["restored_from"].endswith("ckpt-4"))
    self.assertEqual(manifest_lib.read_manifest(model_dir)["final_step"], 6)
    self.assertFalse(os.path.exists(os.path.join(model_dir, "lease.json")))

  @pytest.mark.compat  # Also on the oldest TensorFlow.
  def test_an_expired_lease_is_taken_over_a_live_one_is_not(self):
    from tfdist.distribute import lease as lease_lib  # pylint: disable=g-import-not-at-top
    model_dir = testutil.scratch_dir()
    now = time.time()

    def write(**fields):
      info = dict(holder="other-host:7:abc", host="other-host", pid=7,
                  pid_start=None, command="tfdist.train", started=now - 600,
                  heartbeat=now - 5, expires=now + 55, timeout_seconds=60.0)
      info.update(fields)
      with open(os.path.join(model_dir, "lease.json"), "w") as f:
        json.dump(info, f)

    write()  # Another host, renewed 5 s ago.
    with self.assertRaisesRegex(errors.LeaseHeldError,
                                r"pid 7 on host other-host.*expires in"):
      lease_lib.Lease(model_dir).acquire()
    write(heartbeat=now - 90, expires=now - 30)  # Its host was preempted.
    with self.assertLogs(level="WARNING") as logs:
      lease = lease_lib.Lease(model_dir).acquire()
    self.assertIn("its lease expired 30 s ago", "\n".join(logs.output))
    self.assertEqual(lease_lib.read_lease(model_dir).holder, lease.holder)
    lease.release()
    # A holder that missed two renewals in a row (a restarted job's
    # predecessor) is waited for until its lease expires, then taken over.
    write(heartbeat=now - 40, expires=time.time() + 2)
    with self.assertLogs(level="WARNING") as logs:
      lease = lease_lib.Lease(model_dir).acquire()
    said = "\n".join(logs.output)
    self.assertIn("has not renewed it for 40 s: waiting 2 s", said)
    self.assertRegex(said, r"taking over the lease .* its lease expired "
                     r"\d+ s ago")
    # The holder notices when another run takes its lease over.
    write(heartbeat=now, expires=now + 60)
    self.assertFalse(lease.renew())
    with self.assertRaises(errors.LeaseLostError):
      lease.check()
    lease.release()
    self.assertEqual(lease_lib.read_lease(model_dir).holder,
                     "other-host:7:abc")  # Not ours: left alone.

  # --- 6. exit statuses and the job-spec writer -----------------------------
  @pytest.mark.compat  # Also on the oldest TensorFlow.
  def test_exit_statuses_follow_the_retryable_split(self):
    from tfdist import exit_codes  # pylint: disable=g-import-not-at-top
    from tfdist.data import data_checks  # pylint: disable=g-import-not-at-top
    from tfdist.distribute import lease as lease_lib  # pylint: disable=g-import-not-at-top
    from tfdist.distribute import parameter_server  # pylint: disable=g-import-not-at-top
    from tfdist.runtime import preemption  # pylint: disable=g-import-not-at-top
    from tfdist.training.plan import preflight  # pylint: disable=g-import-not-at-top
    from tfdist.training.state import checkpointing  # pylint: disable=g-import-not-at-top
    from tfdist.training.step import step_runner  # pylint: disable=g-import-not-at-top
    cases = [
        (errors.ConfigError("--batch_size=0"), 2),
        (errors.DataError("cut"), 2),
        (errors.OutputNotWritableError("ro"), 2),
        (errors.IncompatibleResumeError("batch"), 2),
        (errors.TrainingDivergedError("nan"), 1),
        (errors.NonFiniteStateError("nan"), 1),
        (errors.PreemptedError(signum=signal.SIGTERM, step=3,
                                   checkpoint=None), 143),
        (errors.PreemptedError(signum=signal.SIGINT, step=3,
                                   checkpoint=None), 130),
        (step_runner.ps_lost_error(tf.errors.UnavailableError(
            None, None, "ps gone"), after="step 4", last_checkpoint=None),
         200),
        (step_runner.peer_lost_error(tf.errors.UnavailableError(
            None, None, "peer gone"), after="step 4", last_checkpoint=None),
         200),
        (errors.LeaseHeldError("held"), 201),
    ]
    for error, status in cases:
      self.assertEqual(exit_codes.exit_code_for(error), status, repr(error))
      self.assertEqual(exit_codes.is_retryable(status), status >= 128)
    self.assertIsInstance(cases[8][0], errors.ParameterServerError)
    self.assertIsNone(exit_codes.exit_code_for(RuntimeError("a bug")))
    # The exit-code reference's table says the same.
    with open(os.path.join(testutil.REPO_ROOT, "docs", "reference",
                           "exit-codes.md")) as f:
      table = f.read()
    for status, retry in ((1, "permanent"), (2, "permanent"),
                          (137, "retryable"), (200, "retryable"),
                          (201, "retryable")):
      self.assertTrue(re.search(rf"\n\| {status} \|[^\n]*\| {retry} \|",
                                table),
                      f"docs/reference/exit-codes.md: no row for {status}")

  def test_job_specs_get_the_dry_run_name_checks(self):
    from tfdist import job_spec  # pylint: disable=g-import-not-at-top
    with self.assertRaisesRegex(errors.JobSpecError,
                                r"pool 0: tfdist.train would stop at start: "
                                r"--model='vit' is unknown"):
      job_spec.parse_train_flags(["--model_dir=gs://b/run", "--model=vit"],
                                 where="pool 0")
    with self.assertRaisesRegex(errors.JobSpecError,
                                "pool 0: --dry_run makes every replica"):
      job_spec.parse_train_flags(["--model_dir=gs://b/run", "--dry_run"],
                                 where="pool 0")


if __name__ == "__main__":
  absltest.main()
