"""End-to-end tests: real short training runs on a real Fashion-MNIST subset.

In-process runs (`run_experiment`) cover one device (from a thread, as
library callers run it), resumption and the SavedModel; the binary runs in
subprocesses for `--flagfile`, a flag-parsing error's exit status, gs://
inputs and `--mode=export`; other flag errors run the binary's parser and
`main` in this process. The binary's Mirrored run over 2 logical CPUs (no
teardown after it) is tests/strategy_runs_test.py's; its `--helpshort`,
tests/task_test.py's (NoShadowingTest).
"""

import contextlib
import glob
import io
import os
import re
import signal
import threading
import time

from absl.testing import absltest
from absl.testing import flagsaver
from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf

from tfdist import models
from tests import testutil
from tfdist import experiment
from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.data import datasets
from tfdist.observability import manifest as manifest_lib


def _config(model_dir, **overrides):
  data = testutil.fashion_mnist_subset(limit=512, train_shards=4,
                                       test_shards=2)
  kwargs = dict(model_dir=model_dir, train_files=data["train"],
                eval_files=data["eval"], distribution_strategy="one_device",
                batch_size=64, train_steps=12, log_steps=4, warmup_steps=2,
                checkpoint_steps=6, seed=7)
  kwargs.update(overrides)
  return TrainConfig(**kwargs)


def _tags(folder):
  """{tag: [step, ...]} of the scalars in `folder`'s event files."""
  tags = {}
  for path in sorted(glob.glob(os.path.join(folder, "events.out.tfevents.*"))):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        tags.setdefault(value.tag, []).append(event.step)
  return tags


def _documented_tags():
  """The tags docs/reference/tensorboard-tags.md lists (`name` cells of
  its tables; `<metric>` stands for each metric)."""
  with open(os.path.join(testutil.SOURCE_ROOT, "docs", "reference",
                         "tensorboard-tags.md")) as f:
    return {m for line in f if line.startswith("| `")
            for m in [line.split("`")[1]]}


def _artifacts_ok(test, model_dir):
  test.assertTrue(glob.glob(os.path.join(model_dir, "checkpoints",
                                         "ckpt-*.index")))
  test.assertTrue(os.path.exists(os.path.join(model_dir, "checkpoints",
                                              "checkpoint")))
  test.assertTrue(os.path.exists(os.path.join(model_dir, "saved_model",
                                              "saved_model.pb")))
  test.assertTrue(glob.glob(os.path.join(model_dir, "train",
                                         "events.out.tfevents.*")))
  return manifest_lib.read_manifest(model_dir)


class RunExperimentTest(parameterized.TestCase):

  def tearDown(self):
    keras.mixed_precision.set_global_policy("float32")
    super().tearDown()

  def _run_off_the_main_thread(self, config):
    """`run_experiment(config)` from a thread, as Ray Train, notebook
    executors and some test runners call the library (where Python cannot
    install signal handlers: `ValueError: signal only works in main
    thread`); checks the warning and that the host's handlers are kept."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM,
                                                 signal.SIGINT)}
    outcome = {}

    def target():
      try:
        outcome["record"] = experiment.run_experiment(config)
      except Exception as e:  # pylint: disable=broad-except
        outcome["error"] = e

    thread = threading.Thread(target=target, name="library-caller")
    with self.assertLogs(level="WARNING") as logs:
      thread.start()
      thread.join(timeout=300)
      self.assertFalse(thread.is_alive())
      self.assertNotIn("error", outcome, repr(outcome.get("error")))
    self.assertTrue(any("not on the main thread (library-caller)" in line
                        for line in logs.output), logs.output)
    # The host's handlers are untouched.
    self.assertEqual({s: signal.getsignal(s) for s in handlers}, handlers)
    return outcome["record"]

  def test_one_device_run_off_the_main_thread_leaves_artifacts_and_manifest(
      self):
    model_dir = testutil.scratch_dir()
    record = self._run_off_the_main_thread(_config(model_dir))
    self.assertEqual(record["final_step"], 12)
    manifest = _artifacts_ok(self, model_dir)
    self.assertEqual(manifest["num_replicas_in_sync"], 1)
    self.assertEqual(manifest["strategy"], "one_device")
    self.assertEqual(manifest["global_batch_size"], 64)
    self.assertEqual(manifest["per_replica_batch_size"], 64)
    self.assertEqual(manifest["final_step"], 12)
    self.assertEqual(manifest["steps_per_epoch"], 8)  # 512 // 64
    self.assertAlmostEqual(manifest["peak_learning_rate"], 0.1 * 64 / 256)
    self.assertEqual(manifest["warmup_steps"], 2)
    self.assertEqual(manifest["versions"]["tensorflow"], tf.__version__)
    self.assertEqual(manifest["versions"]["keras"], keras.__version__)
    files = manifest["data"]["train_files"]
    self.assertLen(files, 4)
    for entry in files:
      self.assertLen(entry["sha256"], 64)
      self.assertEqual(entry["bytes"], os.path.getsize(entry["path"]))
    final = manifest["final_metrics"]
    self.assertEqual(final["eval_examples"], 512)  # every example once
    self.assertTrue(np.isfinite(final["eval_loss"]))
    # TensorBoard: each value once, under Keras's tags; log points at steps
    # 4, 8, 12, epochs end (and evaluate) at steps 8 and 12.
    train, validation = (_tags(os.path.join(model_dir, sub))
                         for sub in ("train", "validation"))
    self.assertEqual(validation, {"evaluation_loss_vs_iterations": [8, 12],
                                  "evaluation_accuracy_vs_iterations": [8, 12]})
    for tag in ("batch_loss", "batch_accuracy", "learning_rate",
                "examples_per_second"):
      self.assertEqual(train[tag], [4, 8, 12], tag)
    for tag in ("epoch_loss", "epoch_accuracy", "epoch_learning_rate"):
      self.assertEqual(train[tag], [0, 1], tag)
    self.assertNotIn("loss", train)
    documented = _documented_tags()
    for tag in [*train, *validation]:
      self.assertIn(tag.replace("accuracy", "<metric>"), documented, tag)
    self.assertBetween(final["eval_accuracy"], 0.0, 1.0)
    # Throughput: logged every 4 steps, first interval excluded.
    self.assertEqual(manifest["throughput"]["measured_steps"], 8)
    self.assertGreater(manifest["throughput"]["examples_per_second"], 0)
    self.assertEqual([h["step"] for h in manifest["history"]], [4, 8, 12])
    self.assertTrue(manifest["history"][0]["excluded_from_throughput"])
    self.assertNotIn("excluded_from_throughput", manifest["history"][1])
    self.assertGreater(manifest["history"][1]["examples_per_second"], 0)
    self.assertEqual(record["final_metrics"], final)
    self.assertEqual(manifest["config"]["model_dir"], model_dir)

  def test_stop_and_rerun_resumes_at_checkpoint(self):
    model_dir = testutil.scratch_dir()
    experiment.run_experiment(_config(model_dir, train_steps=6))
    first = manifest_lib.read_manifest(model_dir)
    self.assertEqual(first["final_step"], 6)
    reader = tf.train.load_checkpoint(os.path.join(model_dir, "checkpoints"))
    saved = {k for k in reader.get_variable_to_shape_map()}
    self.assertTrue(any(k.startswith("optimizer/") for k in saved))
    # Same command, longer run: continues from step 6, not from 0.
    experiment.run_experiment(_config(model_dir, train_steps=12))
    second = manifest_lib.read_manifest(model_dir)
    self.assertEqual(second["final_step"], 12)
    # The history covers both processes: the first's logs (4, and 6 at its
    # end), then the second's, which started at step 6.
    self.assertEqual([h["step"] for h in second["history"]], [4, 6, 8, 12])
    processes = [h["process"] for h in second["history"]]
    self.assertLen(set(processes), 2)
    self.assertEqual([h["step"] for h in second["history"]
                      if h["process"] == processes[-1]], [8, 12])
    self.assertTrue(second["restored_from"].endswith("ckpt-6"))
    reader = tf.train.load_checkpoint(os.path.join(model_dir, "checkpoints"))
    self.assertEqual(reader.get_tensor(
        "global_step/.ATTRIBUTES/VARIABLE_VALUE"), 12)
    iterations = [k for k in reader.get_variable_to_shape_map()
                  if k.startswith("optimizer/") and "iteration" in k]
    self.assertTrue(iterations)
    self.assertEqual(reader.get_tensor(iterations[0]), 12)
    # A finished run re-run does no more steps: its history is the first
    # run's (the history of every process), with nothing added.
    before = manifest_lib.read_manifest(model_dir)["history"]
    experiment.run_experiment(_config(model_dir, train_steps=12))
    after = manifest_lib.read_manifest(model_dir)
    self.assertEqual(after["history"], before)
    self.assertEqual(after["throughput"]["this_process"]["measured_steps"], 0)

  def test_saved_model_predicts_like_trained_model(self):
    model_dir = testutil.scratch_dir()
    experiment.run_experiment(_config(model_dir, model="resnet",
                                      train_steps=4, log_steps=2))
    model = models.build_model(
        "resnet", spec=datasets.get_dataset_spec("fashion_mnist"))
    tf.train.Checkpoint(model=model).restore(tf.train.latest_checkpoint(
        os.path.join(model_dir, "checkpoints"))).expect_partial()
    images = np.random.RandomState(0).rand(5, 28, 28, 1).astype(np.float32)
    reloaded = tf.saved_model.load(os.path.join(model_dir, "saved_model"))
    served = reloaded.signatures["serving_default"](tf.constant(images))
    served = list(served.values())[0].numpy()
    self.assertEqual(served.shape, (5, 10))
    np.testing.assert_allclose(served, model(images, training=False).numpy(),
                               rtol=1e-5, atol=1e-5)

  def test_bf16_run(self):
    model_dir = testutil.scratch_dir()
    experiment.run_experiment(_config(model_dir, dtype="bfloat16",
                                      train_steps=4, log_steps=2))
    manifest = manifest_lib.read_manifest(model_dir)
    self.assertEqual(manifest["dtype_policy"], "mixed_bfloat16")
    self.assertTrue(np.isfinite(manifest["final_metrics"]["eval_loss"]))

  @parameterized.named_parameters(
      ("glob_matches_nothing", dict(train_files="/no/such/*.gz"),
       errors.DataNotFoundError,
       r"--train_files='/no/such/\*.gz' matches no file"),
      ("inconsistent_batch", dict(batch_size=64, per_replica_batch_size=32),
       errors.ConfigError, "--batch_size=64.*--per_replica_batch_size=32"),
      ("warmup_too_long", dict(warmup_steps=50), errors.ConfigError,
       "--warmup_steps=50 is longer than the run"),
      ("unknown_model", dict(model="vit"), errors.ConfigError, "--model='vit'"),
      ("not_available_yet_or_unknown_dataset", dict(dataset="cifar10",
                                                    train_files=""),
       errors.ConfigError, "--dataset='cifar10'"),
  )
  def test_errors_before_training(self, changes, error, message):
    model_dir = testutil.scratch_dir()
    with self.assertRaisesRegex(error, message):
      experiment.run_experiment(_config(model_dir, **changes))
    self.assertFalse(os.path.exists(os.path.join(model_dir, "checkpoints")))


class TrainBinaryTest(absltest.TestCase):
  """The binary's flag errors: in real processes where the process's exit
  status is the point, else in this process through the binary's own
  parser and `main` (no training starts on these paths)."""

  def _in_process_status(self, argv):
    """(exit status, stderr) of `tfdist.train` given `argv`, run here."""
    from tfdist import train  # pylint: disable=g-import-not-at-top
    with flagsaver.flagsaver(), contextlib.redirect_stderr(
        io.StringIO()) as err:
      with self.assertRaises(SystemExit) as caught:
        train.main(train._parse_flags(argv))  # pylint: disable=protected-access
    return caught.exception.code, err.getvalue()

  def test_flag_parsing_errors_exit_2_with_one_line(self):
    # absl's own parser said `FATAL Flags parsing error` and exited 1, the
    # status of divergence and bugs; the exit-code table
    # (docs/reference/exit-codes.md) says 2. One real process shows the
    # binary's status and output; a bad value is the same parser's path.
    proc = testutil.run_module("tfdist.train", [
        "--train_step=40", f"--model_dir={testutil.scratch_dir()}"],
                               timeout=120)
    self.assertEqual(proc.returncode, 2, proc.stdout[-3000:])
    self.assertIn("tfdist.train: error: Unknown command line flag "
                  "'train_step'. Did you mean: train_steps", proc.stdout)
    self.assertNotIn("FATAL", proc.stdout)
    status, err = self._in_process_status([
        "tfdist.train", "--distribution_strategy=mirrorred",
        f"--model_dir={testutil.scratch_dir()}"])
    self.assertEqual(status, 2, err)
    self.assertIn("tfdist.train: error: flag --distribution_strategy="
                  "mirrorred: value should be one of", err)
    self.assertNotIn("FATAL", err)

  def test_unreachable_gs_inputs_are_usage_errors(self):
    # A gs:// bucket that cannot be reached (here a proxy port where nothing
    # listens; on a machine without network or credentials the same
    # OpError) stops the run at start naming the flag and the pattern, not
    # with TensorFlow's traceback. No network is used.
    env = {"HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": "",
           "NO_GCE_CHECK": "true",
           "GOOGLE_AUTH_TOKEN_FOR_TESTING": "tfdist-test",
           "GCS_RETRY_CONFIG_MAX_RETRIES": "0"}
    proc = testutil.run_module("tfdist.train", [
        "--dry_run", "--train_files=gs://tfdist-test/data/train-*",
        "--eval_files=gs://tfdist-test/data/eval-*",
        f"--model_dir={testutil.scratch_dir()}"], timeout=120, env=env)
    self.assertEqual(proc.returncode, 2, proc.stdout[-3000:])
    self.assertRegex(proc.stdout, r"tfdist.train: error: --train_files="
                     r"'gs://tfdist-test/data/train-\*' cannot be listed: ")
    self.assertNotIn("Traceback", proc.stdout)
    # The same for a --feature_spec there (read before the files).
    proc = testutil.run_module("tfdist.train", [
        "--dry_run", "--feature_spec=gs://tfdist-test/spec.json",
        "--train_files=gs://tfdist-test/data/train-*",
        "--eval_files=gs://tfdist-test/data/eval-*",
        f"--model_dir={testutil.scratch_dir()}"], timeout=120, env=env)
    self.assertEqual(proc.returncode, 2, proc.stdout[-3000:])
    self.assertIn("tfdist.train: error: --feature_spec=gs://tfdist-test/"
                  "spec.json cannot be read: ", proc.stdout)
    self.assertNotIn("Traceback", proc.stdout)

  def test_flagfile_and_errors_name_the_flag(self):
    data = testutil.fashion_mnist_subset(limit=512, train_shards=4,
                                         test_shards=2)
    model_dir = testutil.scratch_dir()
    flagfile = os.path.join(model_dir, "run.flags")
    with open(flagfile, "w") as f:
      f.write(f"--train_files={data['train']}\n--eval_files={data['eval']}\n"
              "--train_steps=10\n--batch_size=60\n"
              "--distribution_strategy=mirrored\n--num_cpu_devices=2\n"
              "--per_replica_batch_size=32\n")
    started = time.time()
    proc = testutil.run_module("tfdist.train", [
        f"--flagfile={flagfile}", f"--model_dir={model_dir}"], timeout=120)
    self.assertNotEqual(proc.returncode, 0)
    self.assertIn("--batch_size=60 (global) disagrees with "
                  "--per_replica_batch_size=32", proc.stdout)
    self.assertLess(time.time() - started, 60)
    self.assertFalse(os.path.exists(os.path.join(model_dir, "checkpoints")))

    # A bad value of a tfdist setting: a usage error naming it and the fix.
    # (--model_dir missing: tests/cli_test.py, TrainEdgeTest.)
    status, err = self._in_process_status([
        "tfdist.train", "--train_steps=5", "--loss_scale=huge",
        f"--model_dir={model_dir}"])
    self.assertEqual(status, 2, err)
    self.assertIn("--loss_scale", err)
    self.assertIn("dynamic", err)


class ExportModeTest(absltest.TestCase):
  """`--mode=export` (and `tfdist.fit` with `TrainConfig(mode="export")`):
  the newest checkpoint's model exported, no step trained."""

  def _served(self, folder, images):
    reloaded = tf.saved_model.load(folder)
    served = reloaded.signatures["serving_default"](tf.constant(images))
    return list(served.values())[0].numpy()

  def test_export_mode_of_the_binary_exports_the_checkpoint(self):
    model_dir = testutil.scratch_dir()
    config = _config(model_dir, train_steps=4, log_steps=2,
                     checkpoint_steps=4)
    experiment.run_experiment(config)
    checkpoints = sorted(os.listdir(os.path.join(model_dir, "checkpoints")))
    export_dir = os.path.join(testutil.scratch_dir(), "exported")
    proc = testutil.run_module("tfdist.train", [
        "--mode=export", f"--model_dir={model_dir}",
        f"--export_dir={export_dir}", f"--train_files={config.train_files}",
        f"--eval_files={config.eval_files}",
        "--distribution_strategy=one_device", "--batch_size=64"],
        timeout=300)
    self.assertEqual(proc.returncode, 0, proc.stdout[-3000:])
    self.assertRegex(proc.stdout, r"Exported \S+ckpt-4 \(step 4\) to "
                     + re.escape(export_dir))
    # Said once (it was logged and printed: issue 47).
    self.assertEqual(proc.stdout.count("Exported "), 1, proc.stdout[-3000:])
    self.assertNotRegex(proc.stdout, r"step \d+/\d+: loss")  # No training.
    # No step trained, nothing written beside the checkpoints.
    self.assertEqual(
        sorted(os.listdir(os.path.join(model_dir, "checkpoints"))),
        checkpoints)
    model = models.build_model(
        "cnn", spec=datasets.get_dataset_spec("fashion_mnist"))
    tf.train.Checkpoint(model=model).restore(tf.train.latest_checkpoint(
        os.path.join(model_dir, "checkpoints"))).expect_partial()
    images = np.random.RandomState(0).rand(3, 28, 28, 1).astype(np.float32)
    np.testing.assert_allclose(self._served(export_dir, images),
                               model(images, training=False).numpy(),
                               rtol=1e-5, atol=1e-5)

  def test_export_mode_without_a_checkpoint_is_refused(self):
    for dry_run in (False, True):
      with self.assertRaisesRegex(errors.ConfigError,
                                  r"^--mode=export: no checkpoint in "):
        experiment.run_experiment(_config(testutil.scratch_dir(),
                                          mode="export", dry_run=dry_run))

  def test_export_mode_through_fit(self):
    import tfdist  # pylint: disable=g-import-not-at-top

    def build():
      model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
      model.compile(loss="mse")
      return model

    x = np.random.RandomState(0).normal(size=(64, 4)).astype(np.float32)
    y = x.sum(axis=1)
    model_dir = testutil.scratch_dir()
    config = tfdist.TrainConfig(model_dir=model_dir, train_steps=3,
                                batch_size=16, checkpoint_steps=3,
                                distribution_strategy="one_device")
    tfdist.fit(build, x=x, y=y, config=config, verbose=0)
    export_dir = os.path.join(testutil.scratch_dir(), "exported")
    result = tfdist.fit(build, x=x, y=y, verbose=0, config=config.replace(
        mode="export", export_dir=export_dir))
    self.assertEqual(result["role"], "export")
    self.assertEqual(result["step"], 3)
    not_written = os.path.join(testutil.scratch_dir(), "not_written")
    dry = tfdist.fit(build, x=x, y=y, verbose=0, config=config.replace(
        mode="export", dry_run=True, export_dir=not_written))
    self.assertEqual((dry["step"], dry["saved_model"]), (3, None))
    self.assertFalse(os.path.exists(not_written))
    self.assertEqual(result["saved_model"], export_dir)
    model = build()
    tf.train.Checkpoint(model=model).restore(
        result["checkpoint"]).expect_partial()
    np.testing.assert_allclose(self._served(export_dir, x[:5]),
                               model(x[:5]).numpy(), rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
  absltest.main()
