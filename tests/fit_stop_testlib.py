"""`python -m tests.fit_stop_testlib MODEL_DIR STEPS`: a user's script.

Calls `tfdist.fit` as a Keras user's script does, nothing around it: a
small dense model on in-memory arrays, STEPS steps at global batch 32, a
line every 5 steps. The strategy comes from the environment:
MultiWorkerMirrored under `tfdist.launch --num_workers=2 --module=...`, one
device alone. Nothing catches a stop, so a signal ends it as
`tfdist.runtime.script_exit` says.
"""

import sys

import keras
import numpy as np

import tfdist


def build_model():
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
  model.compile(loss="mse")
  return model


def main(model_dir: str, steps: int):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(512, 4)).astype("float32")
  y = x.sum(axis=1)
  tfdist.fit(build_model, x=x, y=y, config=tfdist.TrainConfig(
      model_dir=model_dir, train_steps=steps, batch_size=32, log_steps=5,
      num_gpus=0))


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
