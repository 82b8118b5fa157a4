"""Tests for tfdist.training.plan.batch_plan: arithmetic, steps and every
error."""

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tfdist import errors
from tfdist.training.plan import batch_plan

# Also run on the oldest supported TensorFlow (see tests/conftest.py).
pytestmark = pytest.mark.compat


class MakeBatchPlanTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("global_given", dict(batch_size=256), 4, 64, 256),
      ("per_replica_given", dict(per_replica_batch_size=32), 4, 32, 128),
      ("both_consistent", dict(batch_size=96, per_replica_batch_size=48), 2,
       48, 96),
      ("default", {}, 1, 128, 128),
      ("one_replica", dict(batch_size=100), 1, 100, 100),
  )
  def test_sizes(self, kwargs, replicas, per_replica, global_batch):
    plan = batch_plan.make_batch_plan(num_replicas_in_sync=replicas, **kwargs)
    self.assertEqual(plan.per_replica_batch_size, per_replica)
    self.assertEqual(plan.global_batch_size, global_batch)
    self.assertEqual(plan.num_replicas_in_sync, replicas)
    self.assertEqual(plan.per_replica_batch_size * replicas *
                     plan.gradient_accumulation_steps, plan.global_batch_size)

  def test_accumulation_multiplies_global_batch(self):
    plan = batch_plan.make_batch_plan(num_replicas_in_sync=2,
                                      per_replica_batch_size=16,
                                      gradient_accumulation_steps=4)
    self.assertEqual(plan.global_batch_size, 128)

  def test_steps_per_epoch_drops_remainder(self):
    plan = batch_plan.make_batch_plan(num_replicas_in_sync=2, batch_size=128,
                                      num_train_examples=60_000)
    self.assertEqual(plan.steps_per_epoch, 468)  # 60000 // 128
    self.assertEqual(plan.dropped_per_epoch, 96)  # 60000 - 468 * 128
    warning = plan.remainder_warning()
    self.assertIn("96 of the 60000 training examples of each epoch are not "
                  "trained on: 468 steps of 128 examples", warning)
    self.assertIn("--batch_size", warning)

  def test_a_batch_that_divides_the_epoch_drops_nothing(self):
    plan = batch_plan.make_batch_plan(num_replicas_in_sync=2, batch_size=100,
                                      num_train_examples=60_000)
    self.assertEqual(plan.dropped_per_epoch, 0)
    self.assertIsNone(plan.remainder_warning())
    unknown = batch_plan.make_batch_plan(num_replicas_in_sync=2,
                                         batch_size=100)
    self.assertIsNone(unknown.dropped_per_epoch)
    self.assertIsNone(unknown.remainder_warning())

  def test_per_pipeline_batch(self):
    plan = batch_plan.make_batch_plan(num_replicas_in_sync=4, batch_size=64,
                                      num_input_pipelines=2)
    self.assertEqual(plan.per_pipeline_batch_size, 32)

  def test_inconsistent_flags_name_both(self):
    with self.assertRaisesRegex(errors.ConfigError,
                                r"--batch_size=100.*--per_replica_batch_size=32"):
      batch_plan.make_batch_plan(num_replicas_in_sync=2, batch_size=100,
                                 per_replica_batch_size=32)

  def test_indivisible_global_batch(self):
    with self.assertRaisesRegex(errors.ConfigError,
                                r"--batch_size=129.*not divisible by 2"):
      batch_plan.make_batch_plan(num_replicas_in_sync=2, batch_size=129)

  def test_batch_larger_than_data(self):
    with self.assertRaisesRegex(
        errors.ConfigError, "larger than the 100 training"):
      batch_plan.make_batch_plan(num_replicas_in_sync=1, batch_size=128,
                                 num_train_examples=100)

  @parameterized.named_parameters(
      ("zero_batch", dict(batch_size=0), "--batch_size=0"),
      ("negative_per_replica", dict(per_replica_batch_size=-2),
       "--per_replica_batch_size=-2"),
      ("zero_replicas", dict(num_replicas_in_sync=0),
       "num_replicas_in_sync=0"),
  )
  def test_non_positive(self, kwargs, message):
    args = dict(num_replicas_in_sync=1)
    args.update(kwargs)
    with self.assertRaisesRegex(errors.ConfigError, message):
      batch_plan.make_batch_plan(**args)

  def test_uneven_split_across_workers(self):
    with self.assertRaisesRegex(errors.ConfigError, "3 workers"):
      batch_plan.make_batch_plan(num_replicas_in_sync=1, batch_size=64,
                                 num_input_pipelines=3)


class StepsTest(parameterized.TestCase):

  def test_train_steps_win(self):
    self.assertEqual(batch_plan.resolve_train_steps(
        train_steps=50, train_epochs=3, steps_per_epoch=100), 50)

  def test_epochs(self):
    self.assertEqual(batch_plan.resolve_train_steps(
        train_steps=0, train_epochs=3, steps_per_epoch=100), 300)

  @parameterized.named_parameters(
      ("steps", dict(warmup_steps=30, warmup_epochs=None), 30),
      ("epochs", dict(warmup_steps=None, warmup_epochs=0.5), 50),
      ("explicit_zero", dict(warmup_steps=0, warmup_epochs=None), 0),
      ("default_tenth", dict(warmup_steps=None, warmup_epochs=None), 40),
  )
  def test_warmup(self, kwargs, expected):
    self.assertEqual(batch_plan.resolve_warmup_steps(
        steps_per_epoch=100, total_steps=400, **kwargs), expected)

  def test_default_warmup_capped_at_one_epoch(self):
    self.assertEqual(batch_plan.resolve_warmup_steps(
        warmup_steps=None, warmup_epochs=None, steps_per_epoch=100,
        total_steps=5000), 100)

  def test_warmup_longer_than_run(self):
    with self.assertRaisesRegex(errors.ConfigError,
                                r"--warmup_epochs=3.*longer than the run"):
      batch_plan.resolve_warmup_steps(warmup_steps=None, warmup_epochs=3,
                                      steps_per_epoch=100, total_steps=200)


if __name__ == "__main__":
  absltest.main()
