"""The small mixture-of-experts model and its training, shared by the
expert-parallel tests (tests/experts_parallel_test.py on one host's
replicas, tests/experts_workers_test.py across two workers).

The model: Dense, then a top-2 MixtureOfExperts whose capacity drops
nothing (4x), then a top-1 one whose capacity drops tokens (0.5x), then a
Dense head; the same initial weights at every build. A one-device
reference routes each replica's batch as one group: `group_size` =
`replica_tokens(replicas)` (capacity is per routing group, and under
expert parallelism a group never spans replicas).

Imports TensorFlow and Keras: import it after configuring devices.
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf

from tfdist.parallel.data import sharded_optimizer
from tfdist.parallel.experts.layer import MixtureOfExperts
from tfdist.training.step.train_loop import Trainer

SEQ, DIM, EXPERTS = 4, 6, 4
BATCH, STEPS, TOLERANCE = 16, 3, 1e-5


def replica_tokens(replicas: int) -> int:
  """The tokens of one replica's batch (of `replicas`): one device's
  routing group for the same routing as an expert-parallel run."""
  return BATCH // replicas * SEQ


def model(group_size=None) -> keras.Model:
  """The model (module docstring), routing groups of `group_size` tokens
  (None: a call's tokens); the same initial weights each time."""
  keras.utils.set_random_seed(7)
  inputs = keras.Input((SEQ, DIM))
  h = keras.layers.Dense(DIM, name="pre")(inputs)
  h = h + MixtureOfExperts(EXPERTS, 8, top_k=2, capacity_factor=4.0,
                           group_size=group_size, name="wide")(h)
  h = h + MixtureOfExperts(EXPERTS, 8, top_k=1, capacity_factor=0.5,
                           group_size=group_size, name="narrow")(h)
  outputs = keras.layers.Dense(1, name="head")(keras.layers.Flatten()(h))
  return keras.Model(inputs, outputs)


def optimizer(name: str):
  """`adam` (Adam 0.01), else SGD 0.05 with momentum 0.9."""
  if name == "adam":
    return keras.optimizers.Adam(0.01)
  return keras.optimizers.SGD(0.05, momentum=0.9)


def data():
  """`(x, y)`: STEPS batches of BATCH examples, y a sum of x's features."""
  x = np.random.default_rng(0).normal(
      size=(BATCH * STEPS, SEQ, DIM)).astype("float32")
  return x, x.sum(axis=(1, 2))[:, None] / 4.0


def train(strategy, net, name: str, mode=None, zero_stage: int = 0,
          micro_steps: int = 1):
  """STEPS updates of tfdist's Trainer on `net` with the optimizer `name`
  (made in the strategy's scope; with `zero_stage` > 0 built on no
  variables and the trainer made outside the scope, as a run makes them),
  each of `micro_steps` accumulated micro-batches; `(trainer, losses)`."""
  with strategy.scope():
    opt = optimizer(name)
    opt.build([] if zero_stage else net.trainable_variables)
  with strategy.scope() if not zero_stage else contextlib.nullcontext():
    trainer = Trainer(
        strategy=strategy, model=net, optimizer=opt, global_batch_size=BATCH,
        loss="mse", metrics=[], mode=mode, time_steps=False,
        gradient_accumulation_steps=micro_steps,
        sharding=(sharded_optimizer.ShardingOptions(stage=zero_stage)
                  if zero_stage else None))
  dataset = tf.data.Dataset.from_tensor_slices(data()).batch(
      BATCH // micro_steps)
  iterator = iter(strategy.experimental_distribute_dataset(dataset))
  losses = [float(trainer.train_function(iterator, tf.constant(1))["loss"])
            for _ in range(STEPS)]
  return trainer, losses
