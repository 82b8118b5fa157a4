"""Flags and config fields: one table, no drift.

Every `TrainConfig` field has a flag of the same name whose default is the
field's default, or is library-only (`flags.LIBRARY_ONLY_FIELDS`); every
such flag reaches its field through `flags_to_config`.
"""

import dataclasses

from absl import flags as absl_flags
from absl.testing import absltest
from absl.testing import flagsaver

from tfdist import config as config_lib
from tfdist import flags as tfdist_flags
from tfdist import train  # pylint: disable=unused-import
from tfdist.flags import definitions

# Importing the binary defined every tfdist flag on absl's FLAGS.

FLAGS = absl_flags.FLAGS
FIELDS = {f.name: f for f in dataclasses.fields(config_lib.TrainConfig)}


class FlagsMatchConfigTest(absltest.TestCase):

  def test_every_field_has_a_flag_or_is_library_only(self):
    missing = [name for name in FIELDS
               if name not in FLAGS and
               name not in definitions.LIBRARY_ONLY_FIELDS]
    self.assertEqual(missing, [], "fields without a flag")
    self.assertEqual(sorted(tfdist_flags.config_flag_names()),
                     sorted(set(FIELDS) - set(
                         definitions.LIBRARY_ONLY_FIELDS)))

  def test_library_only_fields_have_no_flag(self):
    for name in definitions.LIBRARY_ONLY_FIELDS:
      self.assertIn(name, FIELDS)
      self.assertNotIn(name, FLAGS)

  def test_flag_defaults_are_the_config_defaults(self):
    for name in tfdist_flags.config_flag_names():
      default = FIELDS[name].default
      flag_default = FLAGS[name].default
      if isinstance(default, tuple):  # List flags hold strings.
        default = [str(v) for v in default]
      if flag_default is None or default is None:
        self.assertIsNone(flag_default if default is None else default,
                          f"--{name}: flag default {flag_default!r}, field "
                          f"default {default!r}")
        continue
      self.assertEqual(flag_default, default, f"--{name}")

  def test_each_flag_reaches_its_field(self):
    given = {"model_dir": "/m", "train_steps": "7", "batch_size": "64",
             "optimizer": "adam", "seed": "3", "dtype": "bf16",
             "lr_schedule": "cosine", "piecewise_boundaries": "0.3,0.6",
             "num_cpu_devices": "2", "tpu_zone": "z"}
    with flagsaver.as_parsed(**given):
      config = tfdist_flags.flags_to_config()
    self.assertEqual((config.model_dir, config.train_steps, config.batch_size,
                      config.optimizer, config.seed, config.dtype,
                      config.lr_schedule, config.piecewise_boundaries,
                      config.num_cpu_devices, config.tpu_zone),
                     ("/m", 7, 64, "adam", 3, "bf16", "cosine", (0.3, 0.6),
                      2, "z"))
    # Flags left unset: the config's own defaults.
    self.assertEqual(config.model, "cnn")
    self.assertIn("model", config.unset_fields)


if __name__ == "__main__":
  absltest.main()
