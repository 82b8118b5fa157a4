"""`tfdist.training.assembly`: model, optimizer, trainer and checkpoint, built once.

* `AssemblyOptions` holds the config's sections as the config holds them
  (`tfdist.experiment.prepare.assembly_options`), with the decided values;
* `build` under the default strategy: a built optimizer at the plan's
  learning rate, the trainer at the plan's batch, a checkpoint of the whole
  training state (the optimizer saved once, not under the model);
* the refusals: ZeRO sharding without a mirrored strategy, class weights
  with sample weights, recomputation for a builder that cannot;
* `build_model` hands builders what they ask for and drops `compile`'s
  optimizer.
"""

import dataclasses
import types

from absl.testing import absltest
import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist import api
from tfdist import errors
from tfdist import config as config_lib
from tfdist.config import TrainConfig
from tfdist.experiment import prepare
from tfdist.training import assembly
from tfdist.training.plan import lr_schedule

pytestmark = pytest.mark.compat

_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _model():
  return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])


def _dataset(training):
  del training
  features = np.zeros((8, 4), np.float32)
  labels = np.zeros((8,), np.int64)
  return tf.data.Dataset.from_tensor_slices((features, labels))


def _weighted_dataset(training):
  del training
  return tf.data.Dataset.from_tensor_slices(
      (np.zeros((8, 4), np.float32), np.zeros((8,), np.int64),
       np.ones((8,), np.float32)))


def _options(**given) -> assembly.AssemblyOptions:
  """`AssemblyOptions` with each setting given (by its flag name) in its
  section, the sections' other settings their defaults; other keywords
  (`builder_config`, `dtype`, ...) as given."""
  settings = {name: value for name, value in given.items()
              if name in config_lib.flat_fields()}
  by_section = {}
  for name, value in settings.items():
    (section,) = config_lib.section_of(name)
    by_section.setdefault(section, {})[name] = value
  default = assembly.AssemblyOptions()
  sections = {name: dataclasses.replace(getattr(default, name), **values)
              for name, values in by_section.items()}
  others = {k: v for k, v in given.items() if k not in settings}
  return assembly.AssemblyOptions(**sections, **others)


def _task(model_fn=_model, dataset_fn=_dataset, config=None):
  return api.make_task(model_fn, dataset_fn,
                       config=config or TrainConfig(model_dir="/unused"),
                       loss=_LOSS)


def _plan(learning_rate=0.25, global_batch_size=8):
  """What `assembly.build` reads of a
  `tfdist.training.plan.run_plan.RunPlan`."""
  return types.SimpleNamespace(
      lr=types.SimpleNamespace(
          schedule=lr_schedule.ConstantLearningRate(learning_rate)),
      sync_batch_norm=False, global_batch_size=global_batch_size,
      batch=types.SimpleNamespace(num_replicas_in_sync=1,
                                  gradient_accumulation_steps=1))


class OptionsTest(absltest.TestCase):

  def test_the_options_read_the_configs_sections(self):
    config = TrainConfig(model_dir="/unused", optimizer="adam",
                         weight_decay=0.01, clipnorm=1.5, run_eagerly=True,
                         class_weight="0:1.0,1:2.0",
                         steps_per_execution=3)
    options = prepare.assembly_options(config, None)
    # Each section handed over as it is, not restated field by field.
    for name in ("optimization", "precision", "loop", "memory", "task",
                 "strategy"):
      self.assertIs(getattr(options, name), getattr(config, name), name)
    self.assertEqual(
        (options.optimization.optimizer, options.optimization.weight_decay,
         options.optimization.clipnorm, options.loop.run_eagerly,
         options.task.class_weight, options.steps_per_execution,
         options.memory.zero_stage_resolved),
        ("adam", 0.01, 1.5, True, ((0, 1.0), (1, 2.0)), 3,
         config.memory.zero_stage_resolved))
    # Builders asking for `config` get the model options.
    self.assertIs(options.builder_config.task, config.task)


class BuildTest(absltest.TestCase):

  def test_build_gives_the_whole_training_state(self):
    options = _options(optimizer="sgd", momentum=0.0)
    parts = assembly.build(options, task=_task(),
                           strategy=tf.distribute.get_strategy(),
                           plan=_plan(learning_rate=0.25))
    self.assertIs(parts.model.optimizer, parts.optimizer)
    self.assertTrue(parts.optimizer.built)
    self.assertAlmostEqual(assembly.current_learning_rate(parts.optimizer),
                           0.25)
    self.assertEqual(parts.trainer.global_batch_size, 8)
    self.assertEqual(parts.objectives.loss.name,
                     "sparse_categorical_crossentropy")
    # pylint: disable=protected-access
    names = set(parts.checkpoint._trackable_children())
    self.assertLessEqual({"model", "global_step", "optimizer",
                          "lr_multiplier"}, names)
    # The optimizer is saved once, as the checkpoint's own.
    self.assertNotIn("optimizer", parts.model._trackable_children())
    # pylint: enable=protected-access

  def test_sharding_needs_a_mirrored_strategy(self):
    with self.assertRaisesRegex(errors.ConfigError, "--zero_stage=1"):
      assembly.build(_options(zero_stage=1), task=_task(),
                     strategy=tf.distribute.get_strategy(), plan=_plan())

  def test_class_weights_refuse_sample_weights(self):
    options = _options(class_weight=((0, 1.0), (1, 3.0)))
    self.assertEqual(assembly.check_weights(options, task=_task()),
                     {0: 1.0, 1: 3.0})
    self.assertIsNone(assembly.check_weights(
        _options(), task=_task(dataset_fn=_weighted_dataset)))
    with self.assertRaisesRegex(
        errors.ConfigError, "--class_weight=0:1.0,1:3.0"):
      assembly.check_weights(options,
                             task=_task(dataset_fn=_weighted_dataset))

  def test_recomputation_needs_a_builder_that_takes_it(self):
    recompute = _options(activation_recomputation=True)
    with self.assertRaisesRegex(
        errors.ConfigError, "--activation_recomputation"):
      assembly.check_model_options(recompute, task=_task())

    def recomputing(activation_recomputation):
      del activation_recomputation
      return _model()

    assembly.check_model_options(recompute, task=_task(model_fn=recomputing))


class BuildModelTest(absltest.TestCase):

  def test_builders_get_what_they_ask_for(self):
    seen = {}

    def builder(config, activation_recomputation, sync_batch_norm):
      seen.update(config=config, recompute=activation_recomputation,
                  sync=sync_batch_norm)
      return _model()

    marker = object()
    assembly.build_model(
        _options(activation_recomputation=True, builder_config=marker),
        task=_task(model_fn=builder), sync_batch_norm=True)
    self.assertEqual(seen, {"config": marker, "recompute": True,
                            "sync": True})

  def test_compiles_optimizer_is_dropped(self):

    def compiled():
      model = _model()
      model.compile(optimizer="adam", loss=_LOSS)
      return model

    model = assembly.build_model(assembly.AssemblyOptions(),
                                 task=_task(model_fn=compiled))
    self.assertIsNone(model.optimizer)

  def test_a_builder_returning_no_model_is_refused(self):

    def no_model():
      return keras.layers.Dense(3)

    with self.assertRaisesRegex(errors.ConfigError, "not a keras.Model"):
      assembly.build_model(assembly.AssemblyOptions(),
                           task=_task(model_fn=no_model))


if __name__ == "__main__":
  absltest.main()
