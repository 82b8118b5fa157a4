"""Tests for tfdist.core.reduce_dtype (`--all_reduce_dtype`).

* Under MirroredStrategy on 2 logical CPU devices (this file run as a child
  process: logical devices and `TF_ENABLE_ONEDNN_OPTS=0` must be set before
  TensorFlow starts):
  - the all-reduce really runs in the chosen dtype: a value exact in
    float32 but not in bfloat16 (or float16) comes back rounded, and the
    traced step's gradient collective has the wire dtype (float32: one
    collective carries the gradients and the step's sums);
  - `STEPS` SGD updates on real Fashion-MNIST images with bfloat16 (float32
    policy) and float16 (mixed_float16, loss-scaled) reduction give weights
    within `TOLERANCE` of float32 reduction, relative to how far training
    moved them; the first step's loss is the same (the sums stay float32);
  - ZeRO stage 1, and stage 2 under gradient accumulation, reduce their
    flat gradient buffer in bfloat16 as well, within the same tolerance of
    their float32 runs.
* The refusals: unknown values, parameter servers, float16 without a loss
  scale; the flag reaches the config, the run plan, the manifest and the
  Trainer (`python -m tfdist.train --all_reduce_dtype=bfloat16` under
  mirrored on 2 logical CPUs).
"""

import json
import os

from absl.testing import absltest
from absl.testing import parameterized

from tests import testutil
from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.core import reduce_dtype

_CHILD_ENV = "TFDIST_REDUCE_DTYPE_CHILD"
STEPS = 5
GLOBAL_BATCH = 16
# The largest weight difference from float32 reduction, as a share of the
# largest change training made to any weight over `STEPS` updates.
# Measured: bfloat16 0.25%, float16 under loss scaling 0.04%.
TOLERANCE = 0.01


def _child(train_glob: str) -> dict:
  """The cases under MirroredStrategy on 2 logical CPUs, as JSON values."""
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
  from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
  from tfdist.training.step import precision  # pylint: disable=g-import-not-at-top
  from tfdist.parallel.data import sharded_optimizer  # pylint: disable=g-import-not-at-top
  from tfdist.training.step import train_loop  # pylint: disable=g-import-not-at-top

  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  images, labels = next(iter(tf.data.TFRecordDataset(
      input_pipeline.list_files(train_glob), compression_type="GZIP").map(
          datasets.parse_image_example).batch(GLOBAL_BATCH * STEPS)))
  out = {}

  # 1. The sum of 1 + 2**-10 (bfloat16: 1 + 2**-12, float16) from each
  # replica: exact in float32 (2 + 2**-9), rounded to 2 in the wire dtype.
  @tf.function
  def sums(dtype, value):
    def replica():
      grads, _ = train_loop._all_reduce_sum(  # pylint: disable=protected-access
          [tf.constant([value, 3.0])], all_reduce_dtype=dtype)
      return grads[0]
    return strategy.experimental_local_results(strategy.run(replica))[0]

  for dtype, value in (("float32", 1 + 2**-10), ("bfloat16", 1 + 2**-10),
                       ("float32", 1 + 2**-12), ("float16", 1 + 2**-12)):
    got = sums(dtype, value)
    out[f"sum/{dtype}/{value!r}"] = {"dtype": got.dtype.name,
                                     "values": got.numpy().tolist()}

  def batches(accumulate=1):
    # Endless: a finite input adds an all-reduce of "has a batch".
    ds = tf.data.Dataset.from_tensor_slices((images, labels)).batch(
        GLOBAL_BATCH // accumulate).repeat()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA)
    return iter(strategy.experimental_distribute_dataset(
        ds.with_options(options)))

  def collectives(trainer, iterator):
    """Collective all-reduces per replica in one step, by dtype. (Under
    MirroredStrategy each collective is one op per device; the step's
    cross-replica `strategy.reduce` of the sums is a local sum on one
    host, no collective.)"""
    graph = trainer.train_function.get_concrete_function(
        iterator, tf.TensorSpec([], tf.int32)).graph.as_graph_def()
    found = {}
    for node in [*graph.node, *(n for f in graph.library.function
                                for n in f.node_def)]:
      if node.op.startswith("CollectiveReduce"):
        name = tf.as_dtype(node.attr["T"].type).name
        found[name] = found.get(name, 0) + 1
    return {k: v / strategy.num_replicas_in_sync for k, v in found.items()}

  def train(all_reduce_dtype, policy="fp32", stage=0, accumulate=1):
    keras.utils.set_random_seed(3)
    precision.configure_precision(policy)
    try:
      with strategy.scope():
        model = keras.Sequential([
            keras.Input((28, 28, 1)), keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10)])
        optimizer = precision.wrap_optimizer_for_precision(
            keras.optimizers.SGD(0.1), dtype=policy)
        optimizer.build([] if stage else model.trainable_variables)
      before = [v.numpy() for v in model.trainable_variables]
      trainer = train_loop.Trainer(
          strategy=strategy, model=model, optimizer=optimizer,
          global_batch_size=GLOBAL_BATCH, time_steps=False,
          all_reduce_dtype=all_reduce_dtype,
          gradient_accumulation_steps=accumulate,
          sharding=sharded_optimizer.ShardingOptions(stage=stage))
      iterator = batches(accumulate)
      losses = [float(trainer.train_function(
          iterator, tf.constant(1, tf.int32))["loss"]) for _ in range(STEPS)]
      return {"before": [w.tolist() for w in before],
              "after": [v.numpy().tolist()
                        for v in model.trainable_variables],
              "losses": losses,
              "collectives": collectives(trainer, iterator)}
    finally:
      precision.configure_precision("fp32")

  for name, dtype, policy, stage, accumulate in (
      ("fp32/float32", "float32", "fp32", 0, 1),
      ("fp32/bfloat16", "bfloat16", "fp32", 0, 1),
      ("fp16/float32", "float32", "fp16", 0, 1),
      ("fp16/float16", "float16", "fp16", 0, 1),
      ("zero1/float32", "float32", "fp32", 1, 1),
      ("zero1/bfloat16", "bfloat16", "fp32", 1, 1),
      # Stage 2 under accumulation reduces every micro-batch's gradients
      # into its shard accumulator.
      ("zero2acc/float32", "float32", "fp32", 2, 2),
      ("zero2acc/bfloat16", "bfloat16", "fp32", 2, 2)):
    try:
      out[name] = train(dtype, policy, stage, accumulate)
    except Exception as e:  # pylint: disable=broad-except
      import traceback  # pylint: disable=g-import-not-at-top
      out[name] = {"error": f"{e}\n{traceback.format_exc()}"}
  del np
  return out


class MirroredTest(parameterized.TestCase):
  """What the child process measured (run once per test process)."""

  def _case(self, name):
    return testutil.child_case(self, os.path.abspath(__file__), _CHILD_ENV,
                               name)

  def test_values_are_rounded_in_the_wire_dtype(self):
    # float32 carries 2**-9 in 2 + 2**-9; bfloat16 (8 bits of mantissa)
    # does not, and gives 2. float16 (11 bits) carries 2**-9 but not the
    # sum of 2 x (1 + 2**-12), whose halves it rounds to 0.5.
    want = {f"sum/float32/{1 + 2**-10!r}": 2 + 2**-9,
            f"sum/bfloat16/{1 + 2**-10!r}": 2.0,
            f"sum/float32/{1 + 2**-12!r}": 2 + 2**-11,
            f"sum/float16/{1 + 2**-12!r}": 2.0}
    for name, first in want.items():
      got = self._case(name)
      self.assertEqual(got["dtype"], "float32", name)  # Cast back.
      self.assertEqual(got["values"], [first, 6.0], name)

  @parameterized.named_parameters(
      ("bfloat16", "fp32/float32", "fp32/bfloat16"),
      ("float16_loss_scaled", "fp16/float32", "fp16/float16"),
      ("zero_stage_1_bfloat16", "zero1/float32", "zero1/bfloat16"),
      ("zero_stage_2_accumulating_bfloat16", "zero2acc/float32",
       "zero2acc/bfloat16"))
  def test_weights_within_tolerance_of_float32(self, reference, compressed):
    import numpy as np  # pylint: disable=g-import-not-at-top
    want, got = self._case(reference), self._case(compressed)
    moved = max(float(np.max(np.abs(np.subtract(a, b))))
                for a, b in zip(want["after"], want["before"]))
    differ = max(float(np.max(np.abs(np.subtract(a, b))))
                 for a, b in zip(got["after"], want["after"]))
    self.assertGreater(moved, 1e-3)  # Training moved the weights.
    self.assertGreater(differ, 0.0)  # The rounding is real.
    self.assertLessEqual(differ / moved, TOLERANCE)
    # Step 1 starts from the same weights: its loss, summed in float32
    # in both runs, is the same.
    self.assertAlmostEqual(got["losses"][0], want["losses"][0], places=6)
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-2)

  def test_collectives_per_step(self):
    # float32: the sums ride with the gradients, one collective.
    self.assertEqual(self._case("fp32/float32")["collectives"],
                     {"float32": 1})
    # 2 bytes: the gradients in their dtype and nothing else; the float32
    # sums go through `strategy.reduce` (on one host a local sum; under
    # MultiWorkerMirrored a float32 collective of its own).
    self.assertEqual(self._case("fp32/bfloat16")["collectives"],
                     {"bfloat16": 1})
    self.assertEqual(self._case("fp16/float16")["collectives"],
                     {"float16": 1})
    # ZeRO: the flat gradient buffer in bfloat16; its statistics (norms,
    # finite check) stay float32, as without compression.
    self.assertEqual(self._case("zero1/float32")["collectives"],
                     {"float32": 2})
    self.assertEqual(self._case("zero1/bfloat16")["collectives"],
                     {"bfloat16": 1, "float32": 1})


class RefusalTest(parameterized.TestCase):

  _BASE = dict(model_dir="/tmp/x", train_steps=1)

  def test_default_and_accepted(self):
    self.assertEqual(TrainConfig(**self._BASE).all_reduce_dtype, "float32")
    for strategy in ("mirrored", "multi_worker_mirrored", "auto",
                     "one_device"):
      config = TrainConfig(all_reduce_dtype="bfloat16",
                           distribution_strategy=strategy, **self._BASE)
      self.assertEqual(config.all_reduce_dtype, "bfloat16")
    TrainConfig(all_reduce_dtype="float16", dtype="fp16",
                distribution_strategy="mirrored", **self._BASE)

  @parameterized.named_parameters(
      ("unknown", dict(all_reduce_dtype="int8"),
       r"--all_reduce_dtype='int8' is unknown\. Use one of: float32, "
       "bfloat16, float16"),
      ("parameter_server", dict(all_reduce_dtype="bfloat16",
                                distribution_strategy="parameter_server"),
       "--all_reduce_dtype=bfloat16 does not apply to "
       "--distribution_strategy=parameter_server.*Drop --all_reduce_dtype"),
      ("float16_without_loss_scale", dict(all_reduce_dtype="float16",
                                          dtype="bf16"),
       "--all_reduce_dtype=float16 needs dynamic loss scaling "
       r"\(--dtype=fp16\), received --dtype=bf16.*bfloat16"))
  def test_refused_at_start(self, fields, message):
    with self.assertRaisesRegex(errors.ConfigError, message):
      TrainConfig(**fields, **self._BASE)

  def test_trainer_refuses_float16_without_loss_scale(self):
    import keras  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tfdist.training.step.train_loop import Trainer  # pylint: disable=g-import-not-at-top
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with self.assertRaisesRegex(errors.ConfigError, "LossScaleOptimizer"):
      Trainer(strategy=tf.distribute.get_strategy(), model=model,
              optimizer=keras.optimizers.SGD(0.1), global_batch_size=2,
              all_reduce_dtype="float16")
    # One replica: nothing travels, the gradients stay float32.
    trainer = Trainer(strategy=tf.distribute.get_strategy(), model=model,
                      optimizer=keras.optimizers.SGD(0.1),
                      global_batch_size=2, all_reduce_dtype="bfloat16")
    self.assertEqual(trainer.all_reduce_dtype, "float32")

  def test_reaches_the_parts(self):
    from tfdist.observability import manifest  # pylint: disable=g-import-not-at-top
    from tfdist.experiment import prepare  # pylint: disable=g-import-not-at-top
    config = TrainConfig(all_reduce_dtype="bfloat16",
                         distribution_strategy="mirrored", **self._BASE)
    self.assertEqual(prepare.assembly_options(config, None).strategy
                     .all_reduce_dtype, "bfloat16")
    self.assertEqual(prepare.plan_options(config, None).strategy
                     .all_reduce_dtype, "bfloat16")
    self.assertEqual(
        manifest.ManifestOptions.of(config).all_reduce_dtype, "bfloat16")

  def test_describe(self):
    self.assertIn("bfloat16", reduce_dtype.describe("bfloat16"))
    self.assertIn("float32 all-reduce of their own",
                  reduce_dtype.describe("float16"))


class CommandLineTest(absltest.TestCase):

  def test_train_with_bfloat16_reduction(self):
    from tfdist.observability import manifest as manifest_lib  # pylint: disable=g-import-not-at-top
    data = testutil.fashion_mnist_subset(limit=256)
    model_dir = testutil.scratch_dir()
    proc = testutil.run_module("tfdist.train", [
        "--distribution_strategy=mirrored", "--num_cpu_devices=2",
        f"--train_files={data['train']}", f"--eval_files={data['eval']}",
        "--batch_size=32", "--train_steps=3", "--log_steps=3",
        "--all_reduce_dtype=bfloat16", "--mode=train",
        f"--model_dir={model_dir}"], timeout=400,
                               env={"TF_ENABLE_ONEDNN_OPTS": "0"})
    self.assertEqual(proc.returncode, 0, proc.stdout[-4000:])
    self.assertIn("all_reduce_dtype       bfloat16: gradients all-reduced "
                  "in bfloat16", proc.stdout)
    manifest = manifest_lib.read_manifest(model_dir)
    self.assertEqual(manifest["all_reduce_dtype"], "bfloat16")
    self.assertEqual(manifest["config"]["all_reduce_dtype"], "bfloat16")


if __name__ == "__main__":
  if os.environ.get(_CHILD_ENV):
    print(json.dumps(_child(os.environ[_CHILD_ENV])), flush=True)
  else:
    absltest.main()
