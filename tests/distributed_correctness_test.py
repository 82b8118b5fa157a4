"""N replicas train like one device on the global batch.

* Every example once per epoch, with uneven files (`make_dataset` per
  worker, in this process: no cluster needed to read one worker's share).
* Under MirroredStrategy on 2 logical CPU devices, against one device on the
  same global batch: one replica's fp16 overflow skips the step on every
  replica (scale halved, weights untouched); each replica draws its own
  dropout mask, the same again with the same seed; batch norm of the
  built-in models uses the global batch's statistics; gradient clipping acts
  on the summed gradient. These run in one child process (this file run as
  a script): 2 logical CPU devices and `TF_ENABLE_ONEDNN_OPTS=0` (fp16 on a
  CPU) must be set before TensorFlow starts. The child prints one JSON line.
* Skipped steps are loud: the trainer with a fixed fp16 loss scale that
  overflows fails with a clear message; a non-finite evaluation loss is
  divergence; the manifest is strict JSON.

The MultiWorkerMirrored cases are in tests/multi_worker_agreement_test.py.
"""

import collections
import json
import math
import os

from absl.testing import absltest
from absl.testing import parameterized

from tests import testutil
from tfdist import errors

_CHILD_ENV = "TFDIST_CORRECTNESS_CHILD"


def _case(test, name):
  """Case `name` of this file's child process (run once per process)."""
  return testutil.child_case(test, os.path.abspath(__file__), _CHILD_ENV,
                             name)


# --- 1. every example once per epoch ---------------------------------------
def _ids_per_worker_per_epoch(files, *, workers, global_batch, epochs, seed,
                              counts=None):
  """Example ids each worker's `make_dataset` yields, per epoch of
  `N // global_batch` steps."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
  from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
  total = input_pipeline.count_records(files)
  steps = total // global_batch
  out = [[[] for _ in range(workers)] for _ in range(epochs)]
  for worker in range(workers):
    context = tf.distribute.InputContext(num_input_pipelines=workers,
                                         input_pipeline_id=worker,
                                         num_replicas_in_sync=workers)
    kwargs = {} if counts is None else {"file_record_counts": counts}
    ds = input_pipeline.make_dataset(input_pipeline.PipelineOptions(
        files=files, global_batch_size=global_batch, is_training=True,
        parse_fn=lambda s: datasets.parse_image_example(s, with_id=True),
        seed=seed, **kwargs), context)
    batches = iter(ds)
    for epoch in range(epochs):
      for _ in range(steps):
        out[epoch][worker].extend(next(batches)[2].numpy().tolist())
  return total, steps, out


class ExactlyOncePerEpochTest(parameterized.TestCase):

  @parameterized.named_parameters(
      # Uneven files: 3 files of 80, 2 workers: by file 160 vs 80.
      ("three_files_two_workers", 240, 3, 2, 32, None),
      # 4 files (63, 63, 62, 62 records), 3 workers; counts given.
      ("four_files_three_workers", 250, 4, 3, 48, "given"))
  def test_no_example_twice_and_only_the_remainder_missed(
      self, limit, num_files, workers, global_batch, counts):
    from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
    data = testutil.fashion_mnist_subset(limit=limit, train_shards=num_files,
                                         test_shards=1)
    files = input_pipeline.list_files(data["train"])
    if counts:
      counts = input_pipeline.count_records_per_file(files)
    total, steps, seen = _ids_per_worker_per_epoch(
        files, workers=workers, global_batch=global_batch, epochs=2, seed=5,
        counts=counts)
    left_out = []
    for epoch, per_worker in enumerate(seen):
      ids = [i for worker_ids in per_worker for i in worker_ids]
      repeated = [i for i, n in collections.Counter(ids).items() if n > 1]
      self.assertEqual(repeated, [], f"epoch {epoch}: seen twice")
      self.assertLen(ids, steps * global_batch)
      missed = set(range(limit)) - set(ids)
      self.assertLen(missed, total % global_batch, f"epoch {epoch}")
      left_out.append(missed)
      for worker_ids in per_worker:  # Each worker's batch is its share.
        self.assertLen(worker_ids, steps * global_batch // workers)
    # A reshuffled epoch leaves out other examples: none is carried over.
    self.assertNotEqual(left_out[0], left_out[1])

  def test_plan_prefers_files_only_when_shares_are_equal(self):
    from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
    plan = input_pipeline.plan_sharding(
        [80, 80, 80], num_files=3, num_input_pipelines=2,
        global_batch_size=32, is_training=True)
    self.assertEqual(plan.mode, "range")
    self.assertEqual(plan.records_per_pipeline, (120, 120))
    self.assertEqual(plan.examples_per_epoch, 112)  # 7 steps x 16.
    self.assertIn("by file, the 3 files would give the 2 workers 160, 80 "
                  "records", plan.describe())
    plan = input_pipeline.plan_sharding(
        [60, 70, 60, 50], num_files=4, num_input_pipelines=2,
        global_batch_size=32, is_training=True)
    self.assertEqual((plan.mode, plan.records_per_pipeline), ("file",
                                                              (120, 120)))
    plan = input_pipeline.plan_sharding(
        [100], num_files=1, num_input_pipelines=3, global_batch_size=30,
        is_training=True)
    self.assertEqual((plan.mode, plan.records_per_pipeline),
                     ("range", (33, 33, 34)))
    self.assertEqual(plan.examples_per_epoch, 30)


# --- 2, 4, 5, 7. MirroredStrategy against one device ------------------------
class MirroredAgreesWithOneDeviceTest(absltest.TestCase):

  def test_fp16_overflow_on_one_replica_skips_on_all(self):
    result = _case(self, "fp16")
    one, mirrored = result["one_device"], result["mirrored"]
    for name, run in (("one_device", one), ("mirrored", mirrored)):
      with self.subTest(name):
        first, second = run
        self.assertEqual(first["skipped"], 1.0)
        self.assertEqual(first["loss_scale"], 2.0**14)  # Halved.
        self.assertEqual(first["iterations"], 0)
        self.assertTrue(first["kernel_unchanged"])
        self.assertTrue(all(first["kernel_finite"]))
        self.assertEqual(second["skipped"], 0.0)  # Then it trains.
        self.assertEqual(second["iterations"], 1)
        self.assertTrue(all(second["kernel_finite"]))
    # Both replicas hold the same weights, equal to one device's.
    self.assertEqual(mirrored[1]["kernels"][0], mirrored[1]["kernels"][1])
    self.assertLess(max(abs(a - b) for a, b in zip(
        one[1]["kernels"][0], mirrored[1]["kernels"][0])), 1e-6)

  def test_each_replica_draws_its_own_dropout_mask_reproducibly(self):
    result = _case(self, "dropout")
    first, rerun = result["first"], result["rerun"]
    for step in first:
      self.assertNotEqual(step[0], step[1])  # Replica 0 vs replica 1.
    self.assertNotEqual(first[0][0], first[1][0])  # A new mask each step.
    self.assertEqual(first, rerun)  # Same seed, same masks.

  def test_batch_norm_uses_global_batch_statistics(self):
    result = _case(self, "batch_norm")
    self.assertTrue(result["default_synchronized"])
    # Relative differences of the first layer's batch variance.
    self.assertLess(result["default_vs_one_device"], 1e-3)
    # Per-replica statistics differ: the comparison above can fail.
    self.assertGreater(result["per_replica_vs_one_device"], 1e-2)

  def test_clipping_acts_once_on_the_summed_gradient(self):
    result = _case(self, "clipping")
    for option in ("global_clipnorm", "clipnorm"):
      with self.subTest(option):
        self.assertLess(result[option]["mirrored_vs_one_device"], 1e-6)
        # The clip binds (the gradient's norm is above it).
        self.assertGreater(result[option]["clipped_vs_unclipped"], 1e-3)


def _child_main(train_glob: str) -> dict:
  """Runs the MirroredStrategy cases; returns JSON-able results."""
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
  from tfdist import models  # pylint: disable=g-import-not-at-top
  from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
  from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
  from tfdist.training.step import precision  # pylint: disable=g-import-not-at-top
  from tfdist.training.step.train_loop import Trainer  # pylint: disable=g-import-not-at-top
  one = tf.distribute.OneDeviceStrategy("/cpu:0")
  mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  # 16 real images; replica 0 gets the first 8, replica 1 the last 8.
  images, labels = next(iter(tf.data.TFRecordDataset(
      input_pipeline.list_files(train_glob), compression_type="GZIP").map(
          datasets.parse_image_example).batch(16)))
  images, labels = images.numpy(), labels.numpy()

  def run_steps(strategy, trainer, batches):
    """Yields each step's sums, one step per element of `batches`."""
    ds = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(batches))
    iterator = iter(ds)
    for _ in range(len(batches[0])):
      yield trainer.train_function(iterator, tf.constant(1, tf.int32))

  def fp16(strategy):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
      model, optimizer = testutil.fp16_dense_model(strategy)
      trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                        global_batch_size=8)
      # Step 1: the second half of the batch (replica 1 under Mirrored)
      # has inputs of 1e4: its float16 gradients overflow. Step 2: finite.
      inputs = np.ones((2, 8, 4), np.float32)
      inputs[0, 4:] = 1e4
      out = []
      for sums in run_steps(strategy, trainer,
                            (inputs, np.zeros((2, 8), np.int64))):
        kernels = [np.asarray(k, np.float64) for k in
                   strategy.experimental_local_results(
                       model.layers[-1].kernel.value)]
        out.append({
            "skipped": float(sums["skipped_steps"]),
            "loss_scale": precision.current_loss_scale(optimizer),
            "iterations": int(optimizer.iterations.numpy()),
            "kernel_finite": [bool(np.isfinite(k).all()) for k in kernels],
            "kernel_unchanged": all(bool((k == 1).all()) for k in kernels),
            "kernels": [k.ravel().tolist() for k in kernels]})
      return out
    finally:
      keras.mixed_precision.set_global_policy("float32")

  def dropout_masks(seed):
    keras.utils.set_random_seed(seed)
    with mirrored.scope():
      model = keras.Sequential([keras.Input((64,)),
                                keras.layers.Dropout(0.5)])
    Trainer(strategy=mirrored, model=model,
            optimizer=keras.optimizers.SGD(0.1), global_batch_size=4)
    call = tf.function(lambda: model(tf.ones((2, 64)), training=True) != 0)
    steps = []
    for _ in range(2):
      masks = mirrored.experimental_local_results(mirrored.run(call))
      steps.append([np.asarray(m).astype(int).ravel().tolist()
                    for m in masks])
    return steps

  def batch_norm_variance(strategy, synchronized):
    """The first batch-norm layer's batch variance after one step (from its
    moving variance)."""
    keras.utils.set_random_seed(1)
    with strategy.scope():
      model = models.build_model("cnn", input_shape=(28, 28, 1),
                                 num_classes=10,
                                 sync_batch_norm=synchronized)
      optimizer = keras.optimizers.SGD(0.0)
      optimizer.build(model.trainable_variables)
    trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                      global_batch_size=16)
    list(run_steps(strategy, trainer, (images[None], labels[None])))
    bn = [l for l in model.layers
          if isinstance(l, keras.layers.BatchNormalization)][0]
    # moving = momentum * 1 (initial) + (1 - momentum) * batch variance.
    moving = np.asarray(bn.moving_variance.numpy(), np.float64)
    return (moving - bn.momentum) / (1.0 - bn.momentum)

  def clipped_weights(strategy, clip):
    with strategy.scope():
      model = keras.Sequential([
          keras.Input((28, 28, 1)), keras.layers.Flatten(),
          keras.layers.Dense(10, kernel_initializer="zeros")])
      optimizer = keras.optimizers.SGD(1.0, **clip)
      optimizer.build(model.trainable_variables)
    trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                      global_batch_size=16)
    list(run_steps(strategy, trainer, (images[None], labels[None])))
    return [np.asarray(w, np.float64) for w in model.get_weights()]

  def max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))

  def guarded(fn):
    try:
      return fn()
    except Exception as e:  # pylint: disable=broad-except
      return {"error": f"{type(e).__name__}: {e}"[:2000]}

  def batch_norm_case():
    default, _ = models.resolve_sync_batch_norm(
        None, strategy_name="mirrored", num_replicas_in_sync=2,
        synchronous=True)
    reference = batch_norm_variance(one, False)
    relative = lambda v: float(np.abs(v - reference).max() /
                               np.abs(reference).max())
    return {"default_synchronized": default,
            "default_vs_one_device": relative(
                batch_norm_variance(mirrored, default)),
            "per_replica_vs_one_device": relative(
                batch_norm_variance(mirrored, False))}

  def clipping_case():
    out = {}
    unclipped = clipped_weights(one, {})
    for option, value in (("global_clipnorm", 0.05), ("clipnorm", 0.02)):
      reference = clipped_weights(one, {option: value})
      out[option] = {
          "mirrored_vs_one_device": max_diff(
              clipped_weights(mirrored, {option: value}), reference),
          "clipped_vs_unclipped": max_diff(reference, unclipped)}
    return out

  return {
      "fp16": guarded(lambda: {"one_device": fp16(one),
                               "mirrored": fp16(mirrored)}),
      "dropout": guarded(lambda: {"first": dropout_masks(3),
                                  "rerun": dropout_masks(3)}),
      "batch_norm": guarded(batch_norm_case),
      "clipping": guarded(clipping_case),
  }


# --- 3. skipped steps are loud ------------------------------------------------
class SkippedStepsAreLoudTest(absltest.TestCase):

  def test_monitor_counts_and_stops_on_a_window(self):
    from tfdist.training.step import training_checks  # pylint: disable=g-import-not-at-top
    monitor = training_checks.SkippedStepMonitor(5, start_step=10)
    monitor.record_chunk(steps=4, skipped=3, skipped_at_end=2)  # 11-14
    monitor.record_chunk(steps=2, skipped=2, skipped_at_end=2)  # 15-16
    self.assertEqual((monitor.total_skipped, monitor.consecutive), (5, 4))
    self.assertEqual(monitor.take_interval(), 5)
    self.assertEqual(monitor.take_interval(), 0)
    with self.assertRaisesRegex(
        errors.TrainingStalledError,
        r"no update for the last 5 steps in a row \(steps 13-17\).*"
        r"at loss scale 8.*--max_consecutive_skipped_steps=5"):
      monitor.record_chunk(steps=1, skipped=1, skipped_at_end=1,
                           loss_scale=lambda: 8.0)
    # An update resets the count; a run that never updated fails at its end.
    monitor = training_checks.SkippedStepMonitor(0)
    monitor.record_chunk(steps=3, skipped=2, skipped_at_end=0)
    self.assertEqual(monitor.consecutive, 0)
    monitor.finish()
    monitor = training_checks.SkippedStepMonitor(100)
    monitor.record_chunk(steps=16, skipped=16, skipped_at_end=16)
    with self.assertRaisesRegex(errors.TrainingStalledError,
                                "at any of this run's 16 steps"):
      monitor.finish()

  def test_fixed_scale_that_always_overflows_fails_the_run(self):
    data = testutil.fashion_mnist_subset(limit=512, train_shards=4,
                                         test_shards=2)
    model_dir = testutil.scratch_dir()
    result = testutil.run_module("tfdist.train", [
        "--dtype=fp16", "--loss_scale=262144", "--train_steps=16",
        "--batch_size=32", "--log_steps=2", "--distribution_strategy="
        "one_device", f"--train_files={data['train']}",
        f"--eval_files={data['eval']}", f"--model_dir={model_dir}",
        "--max_consecutive_skipped_steps=4"], timeout=240,
                                 env={"TF_ENABLE_ONEDNN_OPTS": "0"})
    out = result.stdout
    self.assertEqual(result.returncode, 1, out[-4000:])
    self.assertIn("step 2/16: loss", out)
    self.assertIn("2 of 2 steps skipped (fp16 gradients not finite; 2 in "
                  "this run)", out)
    self.assertIn("tfdist.train: error: Training stalled: the optimizer made "
                  "no update for the last 4 steps in a row (steps 1-4)", out)
    self.assertIn("at loss scale 262144", out)
    self.assertNotIn("step 6/16", out)  # Stopped at the window.
    self.assertFalse(os.path.exists(os.path.join(model_dir,
                                                 "run_manifest.json")))

  def test_non_finite_eval_loss_is_divergence(self):
    import keras  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdist.training import controller as controller_lib  # pylint: disable=g-import-not-at-top
    from tfdist.training.step import training_checks  # pylint: disable=g-import-not-at-top
    from tfdist.training.step.train_loop import Trainer  # pylint: disable=g-import-not-at-top
    strategy = tf.distribute.get_strategy()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        3, kernel_initializer=keras.initializers.Constant(np.inf))])
    trainer = Trainer(strategy=strategy, model=model,
                      optimizer=keras.optimizers.SGD(0.1),
                      global_batch_size=4)
    from tfdist.observability import run_log as run_log_lib  # pylint: disable=g-import-not-at-top
    eval_data = tf.data.Dataset.from_tensors(
        (np.ones((4, 4), np.float32), np.zeros((4,), np.int64)))
    controller = controller_lib.Controller(
        options=controller_lib.ControllerOptions(
            total_steps=1, steps_per_epoch=1),
        run_log=run_log_lib.RunLog(tensorboard_dir=None, metrics_dir=None,
                                   global_batch_size=4, total_steps=1),
        evaluate=lambda: trainer.evaluate(eval_data), model=model)
    with self.assertRaisesRegex(errors.TrainingDivergedError,
                                "evaluation loss at step 3 is (nan|inf)"):
      controller.evaluate(3)

  def test_manifest_is_strict_json(self):
    import numpy as np  # pylint: disable=g-import-not-at-top
    from tfdist.observability import manifest  # pylint: disable=g-import-not-at-top
    directory = testutil.scratch_dir()
    manifest.write_manifest(directory, {
        "final_metrics": {"eval_loss": float("inf"), "eval_auc": math.nan,
                          "eval_accuracy": np.float32(0.5)},
        "history": [{"loss": np.float64("-inf")}]})

    def reject(constant):
      raise ValueError(f"not strict JSON: {constant}")

    with open(os.path.join(directory, manifest.MANIFEST_FILE)) as f:
      record = json.loads(f.read(), parse_constant=reject)
    self.assertEqual(record["final_metrics"],
                     {"eval_loss": None, "eval_auc": None,
                      "eval_accuracy": 0.5})
    self.assertEqual(record["history"], [{"loss": None}])


# --- 5, 7. flags and defaults ---------------------------------------------------
class FlagsTest(absltest.TestCase):

  def test_sync_batch_norm_default_and_flag(self):
    from tfdist import models  # pylint: disable=g-import-not-at-top
    from tfdist.backends import registry  # pylint: disable=g-import-not-at-top

    def resolve(value, *, strategy_name, **kwargs):
      # The trait a run passes: its backend's (not a list of kinds).
      synchronous = not registry.backend_for(strategy_name).asynchronous
      return models.resolve_sync_batch_norm(
          value, strategy_name=strategy_name, synchronous=synchronous,
          **kwargs)

    for strategy, replicas, expected in (
        ("mirrored", 2, True), ("multi_worker_mirrored", 4, True),
        ("tpu", 8, True), ("mirrored", 1, False), ("one_device", 1, False),
        ("parameter_server", 2, False)):
      with self.subTest(strategy=strategy, replicas=replicas):
        self.assertEqual(resolve(None, strategy_name=strategy,
                                 num_replicas_in_sync=replicas)[0], expected)
    self.assertEqual(resolve(False, strategy_name="mirrored",
                             num_replicas_in_sync=2),
                     (False, "--sync_batch_norm=false"))
    self.assertFalse(resolve(None, strategy_name="mirrored",
                             num_replicas_in_sync=2, xla_per_replica=True)[0])
    with self.assertRaisesRegex(
        errors.ConfigError, "Drop one of --sync_batch_norm "
                                "and --enable_xla"):
      resolve(True, strategy_name="mirrored", num_replicas_in_sync=2,
              xla_per_replica=True)

  def test_clip_flags_reach_the_keras_optimizer(self):
    from tfdist.config import TrainConfig
    from tfdist.core import optimizers  # pylint: disable=g-import-not-at-top
    optimizer = optimizers.build_optimizer("adam", 0.1, global_clipnorm=1.5)
    self.assertEqual(optimizer.global_clipnorm, 1.5)
    self.assertEqual(optimizers.build_optimizer(
        "sgd", 0.1, clipnorm=0.5).clipnorm, 0.5)
    base = dict(model_dir="/tmp/x", train_steps=1)
    self.assertEqual(TrainConfig(clipnorm=2.0, **base).clipnorm, 2.0)
    with self.assertRaisesRegex(errors.ConfigError, "were both given"):
      TrainConfig(clipnorm=1.0, global_clipnorm=1.0, **base)
    with self.assertRaisesRegex(
        errors.ConfigError, "--global_clipnorm=-1.0 must be "
                                "a positive number"):
      TrainConfig(global_clipnorm=-1.0, **base)
    with self.assertRaisesRegex(errors.ConfigError,
                                "--max_consecutive_skipped_steps=-1"):
      TrainConfig(max_consecutive_skipped_steps=-1, **base)


if __name__ == "__main__":
  if os.environ.get(_CHILD_ENV):
    print(json.dumps(_child_main(os.environ[_CHILD_ENV])), flush=True)
  else:
    absltest.main()
