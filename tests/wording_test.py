"""Tests for tfdist.runtime.wording."""

from absl.testing import absltest
from absl.testing import parameterized

from tests import testutil
from tfdist.runtime import wording


class WordingTest(parameterized.TestCase):

  @parameterized.parameters(
      (1, "1st"), (2, "2nd"), (3, "3rd"), (4, "4th"), (11, "11th"),
      (12, "12th"), (13, "13th"), (21, "21st"), (22, "22nd"), (101, "101st"),
      (111, "111th"), (0, "0th"))
  def test_ordinal(self, n, expected):
    self.assertEqual(wording.ordinal(n), expected)

  def test_count(self):
    self.assertEqual(wording.count(1, "element"), "1 element")
    self.assertEqual(wording.count(0, "element"), "0 elements")
    self.assertEqual(wording.count(3, "replica"), "3 replicas")
    self.assertEqual(wording.count(2, "copy", "copies"), "2 copies")

  def test_either(self):
    # A choice in words, not a Python list ("Use --expert_parallel in
    # [2, 3, 6]" before).
    self.assertEqual(wording.either([2, 3, 6]), "2, 3 or 6")
    self.assertEqual(wording.either([2, 4]), "2 or 4")
    self.assertEqual(wording.either([1]), "1")

  def test_multiples_near(self):
    self.assertEqual(wording.multiples_near(63, 2), "62 or 64")
    self.assertEqual(wording.multiples_near(100, 8), "96 or 104")
    self.assertEqual(wording.multiples_near(5, 8), "8")

  def test_in_field_terms(self):
    fields = {"batch_size", "per_replica_batch_size", "model_dir"}
    self.assertEqual(
        wording.in_field_terms(
            "--batch_size=63 (global) is not divisible by 2 replicas. Use "
            "--batch_size=62, or set --per_replica_batch_size instead; "
            "--helpfull lists flags; see gs://b/--model_dir/x.", fields),
        "batch_size=63 (global) is not divisible by 2 replicas. Use "
        "batch_size=62, or set per_replica_batch_size instead; "
        "--helpfull lists flags; see gs://b/--model_dir/x.")


class MessagesTest(absltest.TestCase):
  """The messages that say numbers and names through `wording`."""

  def test_an_indivisible_batch_suggests_the_multiples_on_both_sides(self):
    from tfdist import errors  # pylint: disable=g-import-not-at-top
    from tfdist.training.plan import batch_plan  # pylint: disable=g-import-not-at-top
    with self.assertRaisesRegex(errors.ConfigError,
                                r"\(e\.g\. --batch_size=62 or 64\)"):
      batch_plan.make_batch_plan(num_replicas_in_sync=2, batch_size=63)

  def test_example_sharding_says_an_ordinal(self):
    from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
    plan = input_pipeline.function_sharding(lambda: None,
                                            num_input_pipelines=2)
    self.assertIn("keeps every 2nd example", plan.reason)

  def test_the_stage_3_refusal_names_shard_parameters(self):
    from tfdist import config as config_lib  # pylint: disable=g-import-not-at-top
    from tfdist import errors  # pylint: disable=g-import-not-at-top
    from tfdist.backends import registry  # pylint: disable=g-import-not-at-top
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"^--zero_stage=3 \(--shard_parameters\) runs under mirrored"):
      registry.check_strategy_rules(config_lib.TrainConfig(
          zero_stage=3, distribution_strategy="one_device"))

  def test_fit_errors_name_the_train_config_field(self):
    import numpy as np  # pylint: disable=g-import-not-at-top
    import tfdist  # pylint: disable=g-import-not-at-top
    from tfdist import errors  # pylint: disable=g-import-not-at-top
    x = np.zeros((64, 2), np.float32)
    # One device and 2 accumulation steps (not 2 Mirrored replicas: this
    # file shares its process with other unit tests, one of which may have
    # started TensorFlow's runtime without a CPU split already).
    config = tfdist.TrainConfig(
        model_dir=testutil.scratch_dir(), batch_size=63,
        train_steps=1, distribution_strategy="one_device",
        gradient_accumulation_steps=2)
    with self.assertRaises(errors.ConfigError) as raised:
      tfdist.fit(lambda: None, x=x, y=x[:, 0], config=config, verbose=0)
    message = str(raised.exception)
    self.assertIn("batch_size=63 (global) is not divisible", message)
    self.assertIn("(e.g. batch_size=62 or 64)", message)
    self.assertNotIn("--batch_size", message)
    self.assertNotIn("--per_replica_batch_size", message)


if __name__ == "__main__":
  absltest.main()
