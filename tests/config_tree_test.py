"""Tests for the config tree: `TrainConfig`'s sections, its flat constructor
and reads, and the settings' flag metadata (tfdist.config_tree)."""

import ast
import dataclasses
import importlib
import inspect
import pickle
import pkgutil

from absl import flags
from absl.testing import absltest

from tfdist import config
from tfdist import config_tree
from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.flags import definitions

_BASE = dict(model_dir="/tmp/x", train_steps=3)


class SectionsTest(absltest.TestCase):

  def test_flat_keywords_land_in_their_sections(self):
    cfg = TrainConfig(batch_size=32, tpu_zone="z", pipeline_stages=2,
                      optimizer="adam", dtype="bfloat16", zero_stage=0,
                      hptune_metric="eval_loss", **_BASE)
    self.assertEqual(cfg.loop.train_steps, 3)
    self.assertEqual(cfg.loop.batch_size, 32)
    self.assertEqual(cfg.outputs.model_dir, "/tmp/x")
    self.assertEqual(cfg.strategy.tpu.tpu_zone, "z")
    self.assertEqual(cfg.strategy.parallelism.pipeline_stages, 2)
    self.assertEqual(cfg.optimization.optimizer, "adam")
    self.assertEqual(cfg.precision.dtype, "bf16")  # Normalized there.
    self.assertEqual(cfg.memory.zero_stage, 0)
    self.assertEqual(cfg.cloud.hptune_metric, "eval_loss")
    # Flat reads are the sections' values, read-only.
    self.assertEqual((cfg.train_steps, cfg.tpu_zone, cfg.dtype),
                     (3, "z", "bf16"))
    with self.assertRaises(AttributeError):
      cfg.train_steps = 4

  def test_an_unknown_keyword_is_a_type_error_naming_it(self):
    with self.assertRaisesRegex(TypeError,
                                "unexpected keyword argument 'train_stepz'"):
      TrainConfig(train_stepz=3)

  def test_a_section_object_is_accepted_and_flat_keywords_win(self):
    cfg = TrainConfig(loop=config.LoopConfig(train_steps=7, log_steps=2),
                      model_dir="/tmp/x", log_steps=5)
    self.assertEqual((cfg.train_steps, cfg.log_steps), (7, 5))
    # Its unset (None) settings are still resolved by the root; a None that
    # is a value (no seed) stays.
    self.assertEqual(cfg.steps_per_execution, 1)
    self.assertIn("steps_per_execution", cfg.defaulted)
    self.assertIsNone(TrainConfig(loop=config.LoopConfig(seed=None),
                                  **_BASE).seed)

  def test_sections_validate_their_own_settings(self):
    with self.assertRaisesRegex(errors.ConfigError,
                                r"^--log_steps=0 must be > 0\."):
      config.LoopConfig(log_steps=0)
    with self.assertRaisesRegex(errors.ConfigError, r"--ps_partitioner='x'"):
      config.ParameterServerConfig(ps_partitioner="x")
    # Unresolved settings (None) pass: the root resolves them.
    self.assertIsNone(config.OptimizationConfig().optimizer)

  def test_cross_section_rules_run_on_the_root(self):
    # Each section alone is fine; together they are not.
    config.CloudConfig(reduction_server=True)
    config.StrategyConfig(all_reduce_alg="ring")
    with self.assertRaisesRegex(errors.ConfigError,
                                r"^--reduction_server implies "
                                r"--all_reduce_alg=nccl; received "
                                r"--all_reduce_alg=ring"):
      TrainConfig(reduction_server=True, all_reduce_alg="ring", **_BASE)

  def test_replace_keeps_unset_settings_unset(self):
    cfg = TrainConfig(**_BASE)
    self.assertEqual(cfg.model, "cnn")
    moved = cfg.replace(dataset="movielens")
    self.assertEqual((moved.model, moved.batch_size, moved.loop.batch_size),
                     ("ranking", 512, 512))
    with self.assertRaisesRegex(TypeError, "'nope'"):
      cfg.replace(nope=1)
    # dataclasses.replace takes flat keywords too (fixing what was unset).
    self.assertEqual(dataclasses.replace(cfg, train_steps=9).loop.train_steps,
                     9)

  def test_to_dict_is_flat_by_flag_name(self):
    cfg = TrainConfig(class_weight="0:1,1:2", **_BASE)
    out = cfg.to_dict()
    self.assertEqual(set(out), set(config.flat_fields()))
    self.assertEqual(out["train_steps"], 3)
    self.assertEqual(out["class_weight"], [[0, 1.0], [1, 2.0]])
    self.assertEqual(out["flags_snapshot"], {})

  def test_equal_hashable_and_picklable(self):
    cfg = TrainConfig(**_BASE)
    self.assertEqual(cfg, TrainConfig(**_BASE))
    self.assertNotEqual(cfg, cfg.replace(train_steps=4))
    self.assertEqual(hash(cfg), hash(TrainConfig(**_BASE)))
    self.assertEqual(pickle.loads(pickle.dumps(cfg)), cfg)


class ModelBuilderConfigTest(absltest.TestCase):

  def test_a_builder_reads_its_model_options_and_is_warned_of_the_rest(self):
    run = TrainConfig(model_dir="/m", train_steps=1, model="transformer",
                      embedding_dim=8, transformer_layers=1, batch_size=16,
                      train_files="/d/train-*", activation_recomputation=True)
    seen = {}

    def builder(config):
      import warnings  # pylint: disable=g-import-not-at-top
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen["options"] = (config.embedding_dim, config.transformer_layers,
                           config.train_files, config.model,
                           config.activation_recomputation,
                           config.task is run.task)
        seen["quiet"] = list(caught)
        seen["batch_size"] = config.batch_size
        seen["warned"] = [str(w.message) for w in caught
                          if issubclass(w.category, FutureWarning)]
      with self.assertRaises(dataclasses.FrozenInstanceError):
        config.embedding_dim = 4
      with self.assertRaisesRegex(AttributeError, "no 'embeding_dim'"):
        _ = config.embeding_dim
      return "model"

    builder(config.ModelBuilderConfig(run))
    self.assertEqual(seen["options"],
                     (8, 1, "/d/train-*", "transformer", True, True))
    self.assertEqual(seen["quiet"], [])
    self.assertEqual(seen["batch_size"], 16)  # the run's, as before
    self.assertLen(seen["warned"], 1)
    self.assertIn("read config.batch_size, which is not a model option",
                  seen["warned"][0])


class MetadataTest(absltest.TestCase):

  def test_every_setting_has_a_flag_type_group_and_help(self):
    groups = set()
    for name, field in config.flat_fields().items():
      if name in config.BOOKKEEPING_FIELDS:
        self.assertFalse(config_tree.is_setting(field), name)
        continue
      meta = field.metadata
      self.assertIn(meta["flag"], config_tree.FLAG_TYPES, name)
      self.assertTrue(config_tree.resolve(meta["help"]).strip(), name)
      if meta["flag"] == "enum":
        self.assertIn(field.default, (None, *config_tree.resolve(
            meta["choices"])), name)
      groups.add(meta["group"])
      self.assertEqual(config.section_of(name),
                       next(path for path, f in config_tree.settings(
                           TrainConfig) if f.name == name))
    self.assertEqual(len(groups), 11)

  def test_setting_refuses_an_unknown_flag_type(self):
    with self.assertRaisesRegex(ValueError, "flag must be one of"):
      config_tree.setting(1, "int", "train", help="x")
    with self.assertRaisesRegex(ValueError, "choices exactly"):
      config_tree.setting("a", "enum", "train", help="x")


@dataclasses.dataclass(frozen=True)
class _OwnSection:
  """A section written outside tfdist: one field a setting, one flag."""
  eval_batches: int = config_tree.setting(
      0, "integer", "train", help="Batches per evaluation (0: all).")
  head: str = config_tree.setting(
      "mlp", "enum", "base", choices=lambda: ("mlp", "linear"),
      case_sensitive=False, help=lambda: "The model's head.")
  tags: tuple = config_tree.setting(("a", "b"), "list", "base",
                                    help="Tags.", alias="labels")


class GeneratedFlagsTest(absltest.TestCase):

  def test_a_new_setting_is_one_field(self):
    flag_values = flags.FlagValues()
    for name, field in (
        (field.name, field) for _, field in config_tree.settings(
            _OwnSection)):
      definitions._define_setting(name, field, flag_values=flag_values)
    flag_values(["prog", "--eval_batches=3", "--head=LINEAR",
                 "--labels=x,y"])
    self.assertEqual(flag_values.eval_batches, 3)
    self.assertEqual(flag_values.head, "linear")
    self.assertEqual(flag_values.tags, ["x", "y"])
    self.assertEqual(flag_values["eval_batches"].help,
                     "Batches per evaluation (0: all).")
    self.assertEqual(flag_values["tags"].default, ["a", "b"])
    self.assertEqual(flag_values["head"].help, "<mlp|linear>: The model's "
                     "head.")

  def test_parse_checks_stay_on_their_flags(self):
    flag_values = flags.FlagValues()
    fields = config.flat_fields()
    definitions._define_setting("loss_scale", fields["loss_scale"],
                                flag_values=flag_values)
    with self.assertRaisesRegex(flags.IllegalFlagValueError,
                                "must be 'dynamic' or a positive number"):
      flag_values(["prog", "--loss_scale=-1"])


class PackageTest(absltest.TestCase):
  """`tfdist/config/`: one module per section family, read through the
  package."""

  def _modules(self):
    return [importlib.import_module(f"{config.__name__}.{info.name}")
            for info in pkgutil.iter_modules(config.__path__)]

  def test_the_package_exports_each_module_s_classes_and_constants(self):
    # A new section's class (or constant) read as `tfdist.config.X`, as
    # every name of the single module it replaced is.
    missing = []
    for module in self._modules():
      tree = ast.parse(inspect.getsource(module))
      for node in tree.body:
        names = ([node.name] if isinstance(node, ast.ClassDef) else
                 [t.id for t in getattr(node, "targets", ())
                  if isinstance(t, ast.Name)])
        for name in names:
          if name.startswith("_") or not (isinstance(node, ast.ClassDef)
                                          or name.isupper()):
            continue
          if getattr(config, name, None) is not getattr(module, name):
            missing.append(f"{module.__name__}.{name}")
    self.assertEqual(missing, [], "re-export these in "
                     "tfdist/config/__init__.py")

  def test_each_section_module_names_its_consumer(self):
    sections, classes = set(), [TrainConfig]
    while classes:  # The tree's section classes, walked from the root.
      for field in dataclasses.fields(classes.pop()):
        if config_tree.is_section(field):
          classes.append(field.metadata["section"])
          sections.add(field.metadata["section"].__module__)
    self.assertIn(f"{config.__name__}.task", sections)
    for module in self._modules():
      if module.__name__ in sections:
        self.assertIn("Consumer", module.__doc__, module.__name__)


if __name__ == "__main__":
  absltest.main()
