"""Flags and config fields: one table, no drift.

Every `TrainConfig` field has a flag of the same name whose default is the
field's default, or is library-only (`flags.LIBRARY_ONLY_FIELDS`); every
such flag reaches its field through `flags_to_config`.
"""

import json
import os
import subprocess
import sys
import textwrap

from absl import flags as absl_flags
from absl.testing import absltest
from absl.testing import flagsaver

from tfdist import config as config_lib
from tfdist import flags as tfdist_flags
from tfdist import train  # pylint: disable=unused-import
from tfdist.flags import definitions
from tests import testutil

# Importing the binary defined every tfdist flag on absl's FLAGS.

FLAGS = absl_flags.FLAGS
FIELDS = config_lib.flat_fields()


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
    self.assertEqual(config.pipeline_stages, 1)
    self.assertIn("model", config.unset_fields)


  def test_pipeline_flags_reach_their_fields(self):
    given = {"model_dir": "/m", "train_steps": "1", "pipeline_stages": "3",
             "num_microbatches": "6", "pipeline_schedule": "1f1b",
             "pipeline_cuts": "block_3,block_6", "transformer_layers": "8"}
    with flagsaver.as_parsed(**given):
      config = tfdist_flags.flags_to_config()
    self.assertEqual((config.pipeline_stages, config.num_microbatches,
                      config.pipeline_schedule, config.pipeline_cuts,
                      config.transformer_layers),
                     (3, 6, "1f1b", ("block_3", "block_6"), 8))


class FlagsReferenceTest(absltest.TestCase):
  """docs/reference/flags.md's generated part (`tfdist.flags.reference`)."""

  PAGE = os.path.join(testutil.REPO_ROOT, "docs", "reference", "flags.md")

  def _check(self, pages: dict) -> dict:
    """`reference.check` of each page text, in a child process (the
    generator defines the flags; this process has them already)."""
    script = textwrap.dedent("""
        import json, sys
        from tfdist.flags import reference
        groups = reference.define_groups()
        pages = json.load(sys.stdin)
        print(json.dumps({
            "names": [f.name for _, group in groups for f in group],
            "checks": {k: reference.check(v, groups)
                       for k, v in pages.items()}}))
        """)
    proc = subprocess.run(
        [sys.executable, "-c", script], input=json.dumps(pages), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120,
        cwd=testutil.REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=testutil.REPO_ROOT))
    self.assertEqual(proc.returncode, 0, proc.stderr)
    return json.loads(proc.stdout)

  def test_every_flag_has_an_entry_and_the_page_is_up_to_date(self):
    with open(self.PAGE, encoding="utf-8") as f:
      page = f.read()
    without_row = "\n".join(line for line in page.splitlines()
                             if not line.startswith("| `--export_dir` |"))
    edited = page.replace("Where the SavedModel goes.", "Where it goes.")
    result = self._check({"page": page, "without_row": without_row + "\n",
                          "edited": edited})
    # The groups hold every flag the binary defines (TensorFlow's and
    # absl's own apart), each once.
    ours = [name for name, flag in FLAGS.flags_by_module_dict().items()
            if name.endswith("definitions")]
    self.assertLen(ours, 1)
    defined = {f.name for f in FLAGS.flags_by_module_dict()[ours[0]]}
    self.assertCountEqual(result["names"], defined)
    self.assertEqual(result["checks"]["page"],
                     {"missing": [], "stale": False},
                     "docs/reference/flags.md is out of date: run python -m "
                     "tfdist.flags.reference --write docs/reference/flags.md")
    self.assertEqual(result["checks"]["without_row"],
                     {"missing": ["export_dir"], "stale": True})
    self.assertEqual(result["checks"]["edited"],
                     {"missing": [], "stale": True})


if __name__ == "__main__":
  absltest.main()
