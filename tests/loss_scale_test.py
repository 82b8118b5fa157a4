"""Dynamic loss scaling for fp16, observed through tfdist's own training step.

* A loss whose gradients underflow in float16 leaves the weights unchanged
  without loss scaling and trains with it.
* An overflowing step is skipped (weights unchanged) and the scale halves.
* The loss scale reaches TensorBoard (read back from the event file).
* Every precision policy trains end to end on a real Fashion-MNIST subset.

fp16 on a CPU is only usable with TensorFlow's oneDNN ops off
(`TF_ENABLE_ONEDNN_OPTS=0`, read when TensorFlow is imported). This file
sets it before importing TensorFlow; when TensorFlow was imported earlier in
the same process (several test files in one pytest run), those tests run in
one fresh child process with the variable set.
"""

import glob
import os
import re
import sys

_ONEDNN_OFF = ("tensorflow" not in sys.modules or
               os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0")
os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"

# pylint: disable=g-import-not-at-top,wrong-import-position
import functools

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import testutil
from tfdist import experiment
from tfdist.config import TrainConfig
from tfdist.training.step import precision
from tfdist.training.step.train_loop import Trainer
# pylint: enable=g-import-not-at-top,wrong-import-position

_CHILD_TIMEOUT_S = 240


# "Class.test" of every @onednn_off test: one child process runs them all.
_ONEDNN_OFF_TESTS = []
_CHILD_OUTPUT = []


def _child_output() -> str:
  """The output of the child process (oneDNN off) that runs every
  @onednn_off test, started once per test process."""
  if not _CHILD_OUTPUT:
    result = testutil.run_module(
        "tests.loss_scale_test", _ONEDNN_OFF_TESTS, timeout=_CHILD_TIMEOUT_S,
        env={"TF_ENABLE_ONEDNN_OPTS": "0"})
    _CHILD_OUTPUT.append(result.stdout)
  return _CHILD_OUTPUT[0]


def onednn_off(test_method):
  """Runs the test here if oneDNN is off, else in the child process that
  runs every such test (`_child_output`: one TensorFlow start-up for
  them all)."""
  test_id = test_method.__qualname__
  _ONEDNN_OFF_TESTS.append(test_id)

  @functools.wraps(test_method)
  def wrapper(self, *args, **kwargs):
    if _ONEDNN_OFF:
      return test_method(self, *args, **kwargs)
    output = _child_output()
    if not re.search(rf"Ran {len(_ONEDNN_OFF_TESTS)} tests", output):
      self.fail(f"the child process did not run its tests:\n"
                f"{output[-4000:]}")
    name = test_id.rsplit(".", 1)[1]
    if re.search(rf"(?m)^(FAIL|ERROR): {name} ", output):
      self.fail(f"{test_id} failed in its child process:\n"
                f"{output[-4000:]}")
  return wrapper


def _tiny_trainer(optimizer, *, global_batch_size):
  """A float16 dense model [batch, 4] -> [batch, 3] under tfdist's Trainer."""
  strategy = tf.distribute.get_strategy()
  model = keras.Sequential([keras.Input((4,)),
                            keras.layers.Dense(3, kernel_initializer="ones")])
  optimizer.build(model.trainable_variables)
  return Trainer(strategy=strategy, model=model, optimizer=optimizer,
                 global_batch_size=global_batch_size), model


def _one_step(trainer, inputs, labels):
  ds = tf.data.Dataset.from_tensors((inputs, labels)).repeat()
  return trainer.train_function(iter(ds), tf.constant(1, tf.int32))


@pytest.mark.compat
class LossScaleTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    keras.mixed_precision.set_global_policy("mixed_float16")

  def tearDown(self):
    keras.mixed_precision.set_global_policy("float32")
    super().tearDown()

  @onednn_off
  def test_underflowing_loss_trains_only_when_scaled(self):
    # The mean loss over a "global batch" of 2**30 examples makes the
    # gradient reaching the float16 logits about 1e-9, below float16's
    # smallest subnormal (6e-8): it flushes to zero. Scaled by 2**15 it is
    # about 3e-5, representable; unscaled again in float32 it updates.
    inputs = np.ones((8, 4), np.float32)
    labels = np.zeros((8,), np.int64)
    lr = 1e4
    moved = {}
    for name, optimizer in (
        ("plain", keras.optimizers.SGD(lr)),
        ("scaled", precision.wrap_optimizer_for_precision(
            keras.optimizers.SGD(lr), dtype="fp16", loss_scale="dynamic"))):
      trainer, model = _tiny_trainer(optimizer, global_batch_size=2**30)
      before = model.layers[-1].kernel.numpy().copy()
      _one_step(trainer, inputs, labels)
      moved[name] = np.abs(model.layers[-1].kernel.numpy() - before).max()
    self.assertEqual(moved["plain"], 0.0)
    # Expected update: lr * 8 examples * |p - y| (about 2/3) / 2**30 ~ 5e-5.
    self.assertGreater(moved["scaled"], 1e-5)
    self.assertLess(moved["scaled"], 1e-3)

  @onednn_off
  def test_overflowing_step_is_skipped_and_scale_lowered(self):
    # Inputs of 1e4 give gradients of about 1e4 * 2**15 / 8 in float16
    # (max 65504): inf. The step is skipped and the scale halves, again and
    # again until the scaled gradients fit, after which training updates.
    optimizer = precision.wrap_optimizer_for_precision(
        keras.optimizers.SGD(1e-9), dtype="fp16", loss_scale="dynamic")
    trainer, model = _tiny_trainer(optimizer, global_batch_size=8)
    inputs = np.full((8, 4), 1e4, np.float32)
    labels = np.zeros((8,), np.int64)
    before = model.layers[-1].kernel.numpy().copy()
    self.assertEqual(precision.current_loss_scale(optimizer), 2.0**15)
    _one_step(trainer, inputs, labels)
    self.assertEqual(precision.current_loss_scale(optimizer), 2.0**14)
    np.testing.assert_array_equal(model.layers[-1].kernel.numpy(), before)
    self.assertEqual(int(trainer.global_step.numpy()), 1)  # Counted, skipped.
    scales = [precision.current_loss_scale(optimizer)]
    for _ in range(20):
      _one_step(trainer, inputs, labels)
      scales.append(precision.current_loss_scale(optimizer))
      if scales[-1] == scales[-2]:
        break
    self.assertEqual(scales[-1], scales[-2])  # Stopped halving: it fits.
    self.assertLess(scales[-1], 2.0**14)
    self.assertTrue(np.any(model.layers[-1].kernel.numpy() != before))


class PrecisionEndToEndTest(parameterized.TestCase):

  def tearDown(self):
    keras.mixed_precision.set_global_policy("float32")
    super().tearDown()

  def _run(self, dtype):
    data = testutil.fashion_mnist_subset(limit=512, train_shards=4,
                                         test_shards=2)
    model_dir = testutil.scratch_dir()
    record = experiment.run_experiment(TrainConfig(
        model_dir=model_dir, train_files=data["train"],
        eval_files=data["eval"], distribution_strategy="one_device",
        dtype=dtype, batch_size=64, train_steps=6, log_steps=2,
        warmup_steps=0, seed=3))
    self.assertEqual(record["dtype"], dtype)
    self.assertEqual(record["final_metrics"]["eval_examples"], 512)
    losses = [h["loss"] for h in record["history"]]
    self.assertTrue(all(np.isfinite(losses)), losses)
    return record, _scalars(os.path.join(model_dir, "train"), "loss_scale")

  @parameterized.named_parameters(("fp32", "fp32", "float32"),
                                  ("bf16", "bf16", "mixed_bfloat16"))
  def test_policy_trains_without_loss_scale(self, dtype, policy):
    record, scales = self._run(dtype)
    self.assertEqual(record["dtype_policy"], policy)
    self.assertEqual(scales, {})  # No loss scaling, nothing logged.
    self.assertIsNone(record["loss_scale"])

  @onednn_off
  def test_fp16_trains_and_logs_loss_scale_to_tensorboard(self):
    record, scales = self._run("fp16")
    self.assertEqual(record["dtype_policy"], "mixed_float16")
    self.assertEqual(sorted(scales), [2, 4, 6])  # Every --log_steps.
    self.assertLessEqual(max(scales.values()), 2.0**15)
    self.assertEqual(scales[6], record["loss_scale"])
    self.assertEqual([h["loss_scale"] for h in record["history"]],
                     [scales[s] for s in (2, 4, 6)])


def _scalars(log_dir, tag):
  """{step: value} of scalar `tag` in the TensorBoard event files."""
  out = {}
  for path in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tag == tag:
          out[event.step] = float(tf.make_ndarray(value.tensor))
  return out


if __name__ == "__main__":
  absltest.main()
