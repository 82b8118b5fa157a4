"""Sharded optimizer state and gradients (ZeRO stages 1 and 2) train like
unsharded training, and their checkpoints do not care.

* Under MirroredStrategy on 2 logical CPU devices (set when this file is
  imported, before TensorFlow's runtime starts, with op determinism,
  `TF_ENABLE_ONEDNN_OPTS=0` and TensorFlow's BFC CPU allocator: run it as
  its own process) and under 2 real
  MultiWorkerMirroredStrategy workers (tests/sharded_optimizer_workers_test.py;
  the cases of both: tests/sharded_optimizer_testlib.py):
  3 updates of Adam and SGD with momentum (and under Mirrored AdamW and
  RMSprop) at stage 1 and 2, with and without gradient
  accumulation, global-norm and per-variable clipping, give
  the unsharded run's weights within 1e-5, on real Fashion-MNIST images,
  with a model whose parameter count is odd (the last shard is padded).
* An fp16 overflow on one replica (one worker) skips the update on all:
  the loss scale halves everywhere, no weight changes (under Mirrored also
  at ZeRO stage 3).
* A checkpoint goes unsharded (2 replicas) -> stage 1 (2 replicas) ->
  stage 2 (1 replica) -> unsharded under Mirrored, unsharded -> stage 2 ->
  unsharded under MultiWorkerMirrored (where the save gathers the shards
  across workers), and the weights at the end equal an uninterrupted
  run's; the sharded checkpoints have the unsharded one's keys and shapes.
* The compiled stage-1 and stage-3 steps keep no shard-sized buffer
  between steps
  (TensorFlow's allocator at rest, with the step function and without);
  per-variable statistics over a shard are the same by static slices and
  by segment ids.
* `python -m tfdist.train --zero_stage=2` trains, exports, and an unsharded
  run resumes from its checkpoint; bad flag combinations fail at start.

No test here runs two TensorFlow processes at once (the binary's runs one
at a time, while this process waits), so Bazel runs this file beside a
cluster target.
"""

import os

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
# TensorFlow's default CPU allocator keeps no statistics ("Allocator stats
# not available for device 'CPU:0'"); its BFC allocator does
# (`cases_lib.resting_memory`). Read when the CPU devices are made (below);
# the binaries CommandLineTest starts get the environment as it was.
_ALLOCATOR_ENV = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC")
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"

from absl.testing import absltest  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

from tests import sharded_optimizer_testlib as cases_lib  # pylint: disable=g-import-not-at-top
from tests import testutil  # pylint: disable=g-import-not-at-top
from tfdist import errors  # pylint: disable=g-import-not-at-top
from tfdist.distribute import devices  # pylint: disable=g-import-not-at-top

DEVICES = devices.configure_cpu_devices(2)
if _ALLOCATOR_ENV is None:
  del os.environ["TF_CPU_ALLOCATOR_USE_BFC"]
else:
  os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = _ALLOCATOR_ENV
tf.config.experimental.enable_op_determinism()

_RESULTS = {}


def _results() -> dict:
  """`cases_lib.mirrored_cases` on a small real Fashion-MNIST subset (256
  examples, 2 shards), run once for this process."""
  if not _RESULTS:
    data = testutil.fashion_mnist_subset(limit=256, train_shards=2,
                                         test_shards=1)
    _RESULTS.update(cases_lib.mirrored_cases(data["train"], DEVICES))
  return _RESULTS


class MirroredShardedTest(cases_lib.CaseChecks, absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.result = _results()["mirrored"]
    self.assertNotIn("error", self.result, self.result.get("error"))

  def test_equal_to_unsharded(self):
    self.check_equal(self.result, cases_lib.MIRRORED_CASES)

  def test_fp16_overflow_on_one_replica_skips_everywhere(self):
    # Stage 3 too: its kernel read between steps is gathered from the
    # shards (tfdist.parallel.zero3).
    self.check_fp16(self.result, stages=(1, 2, 3))

  def test_checkpoints_move_between_sharded_and_unsharded(self):
    self.check_checkpoint(self.result, [2, 2, 1, 2])

  def test_step_keeps_no_shard_sized_buffer_between_steps(self):
    # Stages 1-3: per-variable statistics once used int32 segment ids [S]
    # built from the replica's constant index, which Grappler folded into
    # a constant the compiled step kept (4-8 bytes per shard element per
    # replica). Stage 3: all_gather's built-in gradient (tf.gather at
    # tf.range(begin, end)) kept about 6 more.
    for key in ("resting", "resting_stage3"):
      resting = _results()[key]
      with self.subTest(key):
        self.assertNotIn("error", resting, resting.get("error"))
        self.assertLess(resting["function_bytes"],
                        4 * resting["shard_size"] / 2, resting)


class PerVariableTest(absltest.TestCase):

  def test_static_pieces_equal_segment_ids(self):
    # A constant replica index takes static slices, one unknown at trace
    # time segment ids: the same sums and scaling, padding included.
    import numpy as np  # pylint: disable=g-import-not-at-top
    from tfdist.parallel.data import sharded_optimizer  # pylint: disable=g-import-not-at-top
    layout = sharded_optimizer.FlatLayout([[2, 3], [2], [4]], num_shards=3)
    self.assertEqual((layout.shard_size, layout.padding), (4, 0))
    layout = sharded_optimizer.FlatLayout([[2, 3], [2], [3]], num_shards=3)
    self.assertEqual((layout.shard_size, layout.padding), (4, 1))
    shard = tf.constant([1.0, -2.0, 3.0, 0.5])
    factors = tf.constant([0.5, 2.0, 3.0])

    @tf.function(input_signature=[tf.TensorSpec([], tf.int32)])
    def traced(replica):
      per_variable = sharded_optimizer._PerVariable(layout, replica)  # pylint: disable=protected-access
      self.assertIsNone(per_variable.pieces)
      return (per_variable.sums_of_squares(shard),
              per_variable.scale(shard, factors))

    for replica in range(3):
      per_variable = sharded_optimizer._PerVariable(  # pylint: disable=protected-access
          layout, tf.constant(replica))
      self.assertIsNotNone(per_variable.pieces)
      want_sums, want_scaled = traced(tf.constant(replica))
      np.testing.assert_allclose(per_variable.sums_of_squares(shard),
                                 want_sums, rtol=1e-6)
      np.testing.assert_allclose(per_variable.scale(shard, factors),
                                 want_scaled, rtol=1e-6)
    # The last shard: variable 2's 3 elements, then padding.
    np.testing.assert_allclose(want_sums, [0.0, 0.0, 1.0 + 4.0 + 9.0])
    np.testing.assert_allclose(want_scaled, [3.0, -6.0, 9.0, 0.5])


class CommandLineTest(absltest.TestCase):

  def test_train_sharded_then_resume_unsharded(self):
    data = testutil.fashion_mnist_subset(limit=256)
    model_dir = testutil.scratch_dir()
    common = ["--distribution_strategy=mirrored", "--num_cpu_devices=2",
              f"--train_files={data['train']}",
              f"--eval_files={data['eval']}", "--batch_size=16",
              "--optimizer=adam", f"--model_dir={model_dir}",
              "--log_steps=2", "--deterministic", "--mode=train"]
    first = testutil.run_module(
        "tfdist.train", common + ["--zero_stage=2",
                                  "--gradient_accumulation_steps=2",
                                  "--train_steps=2"], timeout=240)
    self.assertEqual(first.returncode, 0, first.stdout[-4000:])
    self.assertIn("ZeRO stage 2", first.stdout)
    self.assertTrue(os.path.exists(os.path.join(model_dir, "saved_model",
                                                "saved_model.pb")))
    second = testutil.run_module("tfdist.train",
                                 common + ["--train_steps=4"], timeout=240)
    self.assertEqual(second.returncode, 0, second.stdout[-4000:])
    self.assertIn("resuming at step 2", second.stdout)
    self.assertIn("step 4/4", second.stdout)

  def test_bad_flags_fail_at_start(self):
    from tfdist.config import TrainConfig  # pylint: disable=g-import-not-at-top
    base = dict(model_dir="/tmp/x", train_steps=1)
    self.assertEqual(TrainConfig(**base).zero_stage_resolved, 0)
    self.assertEqual(TrainConfig(shard_optimizer_state=True, **base)
                     .zero_stage_resolved, 1)
    self.assertEqual(TrainConfig(shard_gradients=True, **base)
                     .zero_stage_resolved, 2)
    self.assertEqual(TrainConfig(zero_stage=2, shard_gradients=True, **base)
                     .zero_stage_resolved, 2)
    with self.assertRaisesRegex(
        errors.ConfigError, "--zero_stage=5 is not offered"):
      TrainConfig(zero_stage=5, **base)
    with self.assertRaisesRegex(
        errors.ConfigError, "--zero_stage=1 contradicts"):
      TrainConfig(zero_stage=1, shard_gradients=True, **base)
    # The strategy's own rule lives in its backend (refused when a run is
    # prepared, before anything is built), not in TrainConfig.
    from tfdist.backends import registry  # pylint: disable=g-import-not-at-top
    with self.assertRaisesRegex(errors.ConfigError,
                                "--distribution_strategy=parameter_server"):
      registry.check_strategy_rules(TrainConfig(
          zero_stage=1, distribution_strategy="parameter_server", **base))
    with self.assertRaisesRegex(errors.ConfigError, "--optimizer=lamb cannot"):
      TrainConfig(shard_optimizer_state=True, optimizer="lamb", **base)


if __name__ == "__main__":
  absltest.main()
