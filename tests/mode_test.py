"""`tfdist.parallel.mode`: the step-mode protocol and its registry.

The registry finds the built-in modes by name and refuses unknown or taken
names. A mode written here, outside tfdist, is registered and trained with
through the real `Trainer` under MirroredStrategy on 2 logical CPU
devices: it splits each replica's batch in two halves and runs the whole
model's pass on each, so its update equals the data-parallel one, and it
counts its calls (the trainer used it, for training and evaluation).
"""

import os
import types

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from absl.testing import absltest  # pylint: disable=g-import-not-at-top
import keras  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

from tfdist import errors  # pylint: disable=g-import-not-at-top
from tfdist.backends import mode_backends  # pylint: disable=g-import-not-at-top
from tfdist.backends import pipeline as pipeline_backend  # pylint: disable=g-import-not-at-top
from tfdist.backends import registry  # pylint: disable=g-import-not-at-top
from tfdist.backends import single_process  # pylint: disable=g-import-not-at-top
from tfdist.backends import tensor_parallel as tensor_backend  # pylint: disable=g-import-not-at-top
from tfdist.core.strategy_kind import StrategyKind  # pylint: disable=g-import-not-at-top
from tfdist.distribute import devices  # pylint: disable=g-import-not-at-top
from tfdist.parallel import mode as mode_lib  # pylint: disable=g-import-not-at-top
from tfdist.parallel import modes  # pylint: disable=g-import-not-at-top
from tfdist.training.step.train_loop import Trainer  # pylint: disable=g-import-not-at-top

DEVICES = devices.configure_cpu_devices(2)
GLOBAL_BATCH = 16
STEPS = 3


class HalvesMode(mode_lib.StepMode):
  """Runs the whole model on each half of the replica's batch and adds the
  halves' losses and gradients (each loss is already divided by the global
  batch size): the data-parallel pass in two pieces."""

  name = "halves"  # Also set by `register_mode("halves")`.

  def __init__(self):
    self.forward_calls = 0
    self.eval_calls = 0

  def forward_backward(self, context, inputs, labels, weights=None):
    self.forward_calls += 1  # Counted when the step is traced.
    half = tf.shape(labels)[0] // 2
    pieces = [context.model_forward_backward(inputs[s], labels[s], None
                                             if weights is None
                                             else weights[s])
              for s in (slice(None, half), slice(half, None))]
    (loss_a, grads_a, out_a), (loss_b, grads_b, out_b) = pieces
    grads = [a + b for a, b in zip(grads_a, grads_b)]
    return loss_a + loss_b, grads, tf.concat([out_a, out_b], 0)

  def eval_sums(self, context, inputs, labels, weights=None, mask=None):
    self.eval_calls += 1
    return super().eval_sums(context, inputs, labels, weights, mask)


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(GLOBAL_BATCH * STEPS, 6)).astype(np.float32)
  y = rng.integers(0, 3, size=(GLOBAL_BATCH * STEPS,)).astype(np.int32)
  return x, y


def _train(strategy, mode):
  """STEPS SGD steps and one evaluation; returns (weights, train sums,
  evaluation results, trainer)."""
  keras.utils.set_random_seed(3)
  with strategy.scope():
    model = keras.Sequential([keras.Input((6,)),
                              keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3)])
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
  trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                    global_batch_size=GLOBAL_BATCH,
                    steps_per_execution=STEPS, mode=mode)
  x, y = _data()
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
  sums = trainer.train_function(
      iter(strategy.experimental_distribute_dataset(dataset)),
      tf.constant(STEPS, tf.int32))
  results = trainer.evaluate(strategy.experimental_distribute_dataset(
      dataset))
  return model.get_weights(), sums, results, trainer


class RegistryTest(absltest.TestCase):

  def test_built_in_modes_by_name(self):
    self.assertEqual(modes.BUILTIN_MODES,
                     ("data", "zero3", "pipeline", "tensor", "experts"))
    self.assertEqual(modes.mode_names()[:5], modes.BUILTIN_MODES)
    self.assertEqual(set(mode_lib.mode_names()), set(modes.BUILTIN_MODES))
    for name in modes.BUILTIN_MODES:
      cls = mode_lib.get_mode(name)
      self.assertTrue(issubclass(cls, mode_lib.StepMode), name)
      self.assertEqual(cls.name, name)

  def test_settings_choose_the_mode(self):
    self.assertEqual(mode_lib.mode_name_for(), "data")
    self.assertEqual(mode_lib.mode_name_for(zero_stage=2), "data")
    self.assertEqual(mode_lib.mode_name_for(zero_stage=3), "zero3")
    self.assertEqual(mode_lib.mode_name_for(pipeline_stages=2), "pipeline")
    self.assertEqual(mode_lib.mode_name_for(tensor_parallel=2), "tensor")
    self.assertEqual(mode_lib.mode_name_for(expert_parallel=2), "experts")
    self.assertIs(mode_lib.mode_for({"expert_parallel": 2,
                                     "model": "transformer",
                                     "transformer_experts": 4}),
                  mode_lib.get_mode("experts"))
    self.assertIs(mode_lib.mode_for({"zero_stage": 3}),
                  mode_lib.get_mode("zero3"))

  def test_modes_validate_their_settings_and_count_their_devices(self):
    pipeline = dict(pipeline_stages=2, num_microbatches=4,
                    pipeline_schedule="gpipe", pipeline_cuts=(),
                    distribution_strategy="one_device", zero_stage=0,
                    enable_xla=False)
    self.assertIs(mode_lib.mode_for(pipeline), mode_lib.get_mode("pipeline"))
    self.assertEqual(mode_lib.get_mode("pipeline").devices(pipeline), 2)
    with self.assertRaisesRegex(errors.ConfigError, "--zero_stage"):
      mode_lib.mode_for({**pipeline, "zero_stage": 1})
    # D x P: 2 copies of the 2 stages on 4 logical CPU devices.
    self.assertEqual(mode_lib.get_mode("pipeline").devices(
        {**pipeline, "num_gpus": -1, "num_cpu_devices": 4}), 4)
    with self.assertRaisesRegex(errors.ConfigError, "--num_cpu_devices=3"):
      mode_lib.mode_for({**pipeline, "num_cpu_devices": 3})
    tensor = dict(tensor_parallel=2, model="transformer",
                  distribution_strategy="mirrored", zero_stage=0,
                  pipeline_stages=1, enable_xla=False, dtype="fp32",
                  clipnorm=None, global_clipnorm=None, init_checkpoint=None,
                  num_gpus=0, num_cpu_devices=2)
    self.assertEqual(mode_lib.mode_for(tensor).devices(tensor), 2)
    with self.assertRaisesRegex(errors.ConfigError, "--model=cnn"):
      mode_lib.mode_for({**tensor, "model": "cnn"})
    self.assertEqual(mode_lib.mode_for({}).devices({}), 1)

  def test_unknown_name_lists_the_known_ones(self):
    with self.assertRaisesRegex(errors.ConfigError,
                                r"'sequence'.*data, experts, pipeline, tensor, zero3"
                                r".*register_mode"):
      mode_lib.get_mode("sequence")

  def test_refuses_a_taken_name_and_a_non_mode(self):
    with self.assertRaisesRegex(ValueError, "taken by"):
      mode_lib.register_mode("data")(HalvesMode)
    with self.assertRaisesRegex(ValueError, "subclass of"):
      mode_lib.register_mode("not_a_mode")(object)
    with self.assertRaisesRegex(ValueError, "non-empty"):
      mode_lib.register_mode("")


def _settings(zero_stage=0, pipeline_stages=1, tensor_parallel=1,
              expert_parallel=1):
  """A config's parallelism settings, in their sections (what
  `backend_for_run` reads)."""
  return types.SimpleNamespace(
      memory=types.SimpleNamespace(zero_stage_resolved=zero_stage),
      strategy=types.SimpleNamespace(parallelism=types.SimpleNamespace(
          pipeline_stages=pipeline_stages, tensor_parallel=tensor_parallel,
          expert_parallel=expert_parallel)))


class BackendCompositionTest(absltest.TestCase):

  def test_data_mode_gets_the_kinds_backend(self):
    backend = registry.backend_for_run(StrategyKind.MIRRORED, _settings(2))
    self.assertIs(type(backend), single_process.MirroredBackend)

  def test_zero3_composes_the_gather_with_the_mirrored_kinds(self):
    for kind in (StrategyKind.MIRRORED, StrategyKind.MULTI_WORKER_MIRRORED):
      backend = registry.backend_for_run(kind, _settings(3))
      self.assertIsInstance(backend, type(registry.backend_for(kind)))
      self.assertEqual(type(backend).__mro__[1].__name__, "_GathersForExport")
      self.assertEqual(backend.kind, kind)
    one = registry.backend_for_run(StrategyKind.ONE_DEVICE, _settings(3))
    self.assertIs(type(one), type(registry.backend_for(
        StrategyKind.ONE_DEVICE)))

  def test_pipeline_and_tensor_replace_the_kinds_backend(self):
    self.assertIsInstance(
        registry.backend_for_run(StrategyKind.ONE_DEVICE,
                                 _settings(pipeline_stages=2)),
        pipeline_backend.PipelineBackend)
    self.assertIsInstance(
        registry.backend_for_run(StrategyKind.MIRRORED,
                                 _settings(tensor_parallel=2)),
        tensor_backend.TensorParallelBackend)

  def test_a_mode_registers_what_it_needs_of_the_backend(self):
    class Marked:
      marked = True

    mode_backends.register_mode_backend("halves", mixin=Marked)
    self.addCleanup(mode_backends.register_mode_backend, "halves",
                    factory=lambda kind, cls, cluster: None)
    backend = mode_backends.compose(
        HalvesMode, StrategyKind.MIRRORED, single_process.MirroredBackend)
    self.assertTrue(backend.marked)
    self.assertIsInstance(backend, single_process.MirroredBackend)
    with self.assertRaisesRegex(ValueError, "one of mixin= or factory="):
      mode_backends.register_mode_backend("halves")

    class Driving(HalvesMode):
      name = "driving"
      replaces_step_runner = True

    with self.assertRaisesRegex(ValueError, "'driving' replaces the step"):
      mode_backends.compose(Driving, StrategyKind.MIRRORED,
                            single_process.MirroredBackend)


class OutsideModeTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    mode_lib.register_mode("halves")(HalvesMode)
    self.addCleanup(mode_lib.unregister_mode, "halves")

  def test_registered_mode_trains_like_data_parallelism(self):
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    self.assertEqual(strategy.num_replicas_in_sync, 2)
    mode = mode_lib.get_mode("halves")()
    weights, sums, results, trainer = _train(strategy, mode)
    self.assertIs(trainer.mode, mode)
    self.assertEqual(mode.name, "halves")
    self.assertGreaterEqual(mode.forward_calls, 1)
    self.assertGreaterEqual(mode.eval_calls, 1)
    self.assertEqual(int(trainer.global_step.numpy()), STEPS)
    reference, ref_sums, ref_results, ref_trainer = _train(strategy, None)
    self.assertEqual(ref_trainer.mode.name, "data")
    self.assertAlmostEqual(float(sums["loss"]), float(ref_sums["loss"]),
                           places=5)
    self.assertEqual(float(sums["count"]), GLOBAL_BATCH * STEPS)
    for ours, theirs in zip(weights, reference):
      np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    self.assertAlmostEqual(results["loss"], ref_results["loss"], places=5)
    self.assertEqual(results["num_examples"], GLOBAL_BATCH * STEPS)
    # The weights moved: the comparison is not of two untrained models.
    keras.utils.set_random_seed(3)
    initial = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                                keras.layers.Dense(3)]).get_weights()
    self.assertGreater(np.abs(weights[0] - initial[0]).max(), 1e-4)


if __name__ == "__main__":
  absltest.main()
