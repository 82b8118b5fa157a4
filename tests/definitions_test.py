"""Unit tests of flags/definitions.py: the groups, validators and reading.

Flags live on absl's global FLAGS (the binary's); importing `tfdist.train`
defines every group once. Each test restores the flags it sets (flagsaver).
"""

from absl import flags as absl_flags
from absl.testing import absltest
from absl.testing import flagsaver

from tfdist import config as config_lib
from tfdist import train  # pylint: disable=unused-import
from tfdist.flags import definitions

FLAGS = absl_flags.FLAGS
MODULE = "tfdist.flags.definitions"


def _names_of_this_module():
  return {flag.name for flag in FLAGS.flags_by_module_dict()[MODULE]}


class DefinitionsTest(absltest.TestCase):

  def test_the_module_defines_one_flag_per_field_and_one_alias(self):
    self.assertEqual(_names_of_this_module(),
                     set(definitions.config_flag_names()) |
                     {"gradient_checkpointing"})

  def test_key_flags_of_the_groups_are_defined_fields(self):
    key_flags = ["model", "dataset", "feature_spec", "train_files",
                 "eval_files", "model_dir", "mode", "dtype", "loss_scale"]
    for name in key_flags:
      self.assertIn(name, FLAGS)
      self.assertIn(name, definitions.config_flag_names())

  def test_enum_values_come_from_the_config(self):
    self.assertEqual(FLAGS["distribution_strategy"].parser.enum_values,
                     list(config_lib.STRATEGIES))
    self.assertEqual(FLAGS["mode"].parser.enum_values,
                     list(config_lib.MODES))
    self.assertIn("movielens sets --model=ranking", FLAGS["dataset"].help)

  def test_the_loss_scale_validator_rejects_what_the_config_would(self):
    with flagsaver.flagsaver():
      with self.assertRaisesRegex(absl_flags.IllegalFlagValueError,
                                  "'dynamic' or a positive number"):
        FLAGS["loss_scale"].parse("-3")
        FLAGS.validate_all_flags()
    with flagsaver.as_parsed(loss_scale="128", dtype="fp16"):
      self.assertEqual(definitions.flags_to_config().loss_scale, 128.0)

  def test_gradient_checkpointing_is_an_alias(self):
    with flagsaver.as_parsed(gradient_checkpointing="true"):
      self.assertTrue(FLAGS.activation_recomputation)
      self.assertTrue(definitions.flags_to_config().activation_recomputation)

  def test_flags_left_unset_take_the_data_sets_recommendation(self):
    with flagsaver.as_parsed(dataset="movielens", optimizer="sgd"):
      config = definitions.flags_to_config()
    self.assertEqual((config.model, config.optimizer, config.batch_size),
                     ("ranking", "sgd", 512))
    snapshot = dict(config.flags_snapshot)
    # The snapshot records the values that took effect.
    self.assertEqual((snapshot["model"], snapshot["batch_size"]),
                     ("ranking", "512"))


if __name__ == "__main__":
  absltest.main()
