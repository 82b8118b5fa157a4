"""Input forms other than TFRecord files, for resumed-run tests.

A small regression (160 examples of 8 features, global batch 32: 5 steps
per epoch, as `tests.input_position_testlib`'s runs) fed as each input form
`tfdist.fit` takes, for the resumed runs of
`tests/input_position_one_process_test.py` (one device, Mirrored) and
`tests/input_position_test.py` (2 workers,
`--dataset=tests.resume_forms_testlib:make_dataset`). Importable by a
`tfdist.launch --module` that defines flags (it defines none).
"""

import os

# The `tfdist.fit` forms `form_input` makes.
FORMS = ("dataset_function", "py_dataset", "generator")
# More forms, on fewer strategies: a dataset function that takes
# `input_context` (it shards itself) and NumPy arrays.
MORE_FORMS = ("dataset_function_ctx", "numpy")


def _arrays():
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(0)
  x = rng.randn(160, 8).astype("float32")
  return x, (x @ rng.randn(8, 1)).astype("float32")


def make_dataset(training):
  """One epoch of `(features [8], label [1])` float32 examples, shuffled by
  the function itself (unseeded: `--deterministic`'s seed orders it)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  del training
  return tf.data.Dataset.from_tensor_slices(_arrays()).shuffle(64)


def make_dataset_ctx(input_context, training):
  """`make_dataset`'s examples, sharded by the function itself: worker i of
  n keeps examples i, i + n, ... (before its shuffle)."""
  return make_dataset(training).shard(
      input_context.num_input_pipelines, input_context.input_pipeline_id
  ) if input_context.num_input_pipelines > 1 else make_dataset(training)


def build_model():
  import keras  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([keras.Input((8,)),
                            keras.layers.Dense(16, activation="relu"),
                            keras.layers.Dense(16, activation="relu"),
                            keras.layers.Dense(1)])
  model.compile(loss="mse")
  return model


def form_input(form: str) -> dict:
  """`tfdist.fit`'s data arguments for `form` (one of `FORMS`)."""
  import keras  # pylint: disable=g-import-not-at-top
  x, y = _arrays()

  class Batches(keras.utils.PyDataset):

    def __len__(self):
      return 10

    def __getitem__(self, index):
      return x[index * 16:(index + 1) * 16], y[index * 16:(index + 1) * 16]

  if form == "dataset_function":
    return {"dataset_fn": make_dataset}
  if form == "dataset_function_ctx":
    return {"dataset_fn": make_dataset_ctx}
  if form == "numpy":
    return {"x": x, "y": y}
  if form == "py_dataset":
    return {"x": Batches()}
  return {"x": ((x[i * 16:(i + 1) * 16], y[i * 16:(i + 1) * 16])
                for i in range(10))}


def max_difference(path_a: str, path_b: str) -> float:
  """Largest absolute difference between two checkpoints' float variables
  (weights and optimizer slots); a folder stands for its latest."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  readers = [tf.train.load_checkpoint(
      tf.train.latest_checkpoint(os.path.join(p, "checkpoints"))
      if os.path.isdir(p) else p) for p in (path_a, path_b)]
  keys = [k for k, dtype in readers[0].get_variable_to_dtype_map().items()
          if dtype.is_floating]
  return max(float(np.abs(readers[0].get_tensor(k) -
                          readers[1].get_tensor(k)).max()) for k in keys)
