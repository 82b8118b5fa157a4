"""`--enable_xla`: tfdist jit-compiles its own per-replica step.

Keras 3 turns XLA off under a tf.distribute strategy, so the Trainer wraps
its per-replica forward and backward pass in `tf.function(jit_compile=True)`
and applies the gradients outside it. These tests check that the compiled
function really is XLA (it has an HLO module), that it trains to the same
weights as the uncompiled step, and that it runs under a strategy.
(`tests/auto_select_test.py` runs the binary with `--enable_xla` under
MirroredStrategy on 2 logical CPU devices.)
"""

from absl.testing import absltest
import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.training.step.train_loop import Trainer

# Also run on the oldest supported TensorFlow (see tests/conftest.py).
pytestmark = pytest.mark.compat


def _train(enable_xla, steps=3):
  keras.utils.set_random_seed(5)
  strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
  with strategy.scope():
    model = keras.Sequential([keras.Input((6,)),
                              keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3)])
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    optimizer.build(model.trainable_variables)
  trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                    global_batch_size=16, steps_per_execution=steps,
                    enable_xla=enable_xla)
  rng = np.random.default_rng(0)
  inputs = rng.normal(size=(16, 6)).astype(np.float32)
  labels = rng.integers(0, 3, size=(16,))
  ds = strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensors((inputs, labels)).repeat())
  out = trainer.train_function(iter(ds), tf.constant(steps, tf.int32))
  return trainer, model, out, (inputs, labels)


class XlaTest(absltest.TestCase):

  def test_step_is_xla_compiled_and_matches(self):
    trainer, model, out, (inputs, labels) = _train(enable_xla=True)
    self.assertTrue(trainer.xla_applied)
    # No sample weights (the third argument) in this data.
    hlo = trainer.mode.compiled_pass.experimental_get_compiler_ir(
        tf.constant(inputs), tf.constant(labels), None)(stage="hlo")
    self.assertIn("HloModule", hlo)
    self.assertEqual(int(trainer.global_step.numpy()), 3)
    plain_trainer, plain_model, plain_out, _ = _train(enable_xla=False)
    self.assertFalse(plain_trainer.xla_applied)
    self.assertAlmostEqual(float(out["loss"]), float(plain_out["loss"]),
                           places=4)
    for a, b in zip(model.get_weights(), plain_model.get_weights()):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

  def test_runs_under_mirrored_strategy(self):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
      model = keras.Sequential([keras.Input((4,)),
                                keras.layers.BatchNormalization(),
                                keras.layers.Dense(2)])
      optimizer = keras.optimizers.SGD(0.1)
      optimizer.build(model.trainable_variables)
    trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                      global_batch_size=8, enable_xla=True)
    ds = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors(
            (np.ones((8, 4), np.float32), np.zeros((8,), np.int64))).repeat())
    before = model.get_weights()
    out = trainer.train_function(iter(ds), tf.constant(2, tf.int32))
    self.assertTrue(np.isfinite(float(out["loss"])))
    self.assertTrue(any(np.any(a != b) for a, b in
                        zip(model.get_weights(), before)))


if __name__ == "__main__":
  absltest.main()
