"""Cases of `tests/loss_semantics_test.py` and
`tests/loss_semantics_multi_worker_test.py`: what a Keras loss says,
through `Model.fit` (the reference, one device) and `tfdist.fit`.

Cases (tfdist/training/step/objectives.py `loss_values`,
tfdist/training/step/train_loop.py `Trainer`):

* a loss function returning one value for the whole batch (a `lambda`, and
  a named function): the value is the batch's loss, as `fit` takes it, not
  a per-example value divided by the batch;
* `model.losses` (a kernel regularizer, `add_loss`): in the training loss
  and in the evaluation loss, as `Model.evaluate` reports it;
* a `keras.losses.Loss` with `reduction="sum"` (with and without sample
  weights), and with `reduction=None`
  (`fit` differentiates the sum of the values and reports their mean).

The same updates on the same global batches (plain SGD, no shuffling,
zero-initialized weights): weights and losses agree to float32 round-off.
Run as a module (`tfdist.launch --module=tests.loss_semantics_testlib
OUT_JSON CASE`), it runs one case on the cluster of `TF_CONFIG`.
"""

import json
import os
import sys

from tests import conformance_table

EXAMPLES = 256
GLOBAL_BATCH = 64
EPOCHS = 2
# Relative to the values' size (the "sum" case's losses are about 64x).
RTOL = 1e-4
CASES = ("batch_valued_lambda", "batch_valued_function", "regularized",
         "sum", "sum_weighted", "none")
# Cases whose examples carry sample weights (`fit(sample_weight=...)`).
WEIGHTED = ("sum_weighted",)
# The two-worker runs' cases (one cluster run each): the lambda of
# batch_valued_lambda on regularized's model stands for both.
MULTI_WORKER_CASES = ("batch_valued_regularized", "sum", "none")
# The cases whose model tfdist gets compiled with jit_compile=True (the
# reference is compiled without: XLA changes only round-off).
JIT_COMPILED = ("regularized", "batch_valued_regularized")
# The conformance-table rows (tests/conformance_table.py) of the cases.
CELL_ROWS = {"batch_valued_lambda": ("batch_valued_loss",),
             "regularized": ("model_losses",), "sum": ("reduction_sum",),
             "none": ("reduction_none",),
             "batch_valued_regularized": ("batch_valued_loss",
                                          "model_losses")}
WORKS = "works (the weights, training and evaluation losses of `Model.fit`)"
# The cell of a case that stands for two rows.
WORKS_BOTH = WORKS[:-1] + "; measured with one model holding both rows)"
JIT_WARNED = ("warned at start (the step compiles with XLA only under "
              "`--enable_xla`; the same weights)")


def data(case: str = ""):
  """`(x, y)`: float32 [256, 3] and [256, 1], y = x . (1, 2, 3) + 1.5 +
  noise; `WEIGHTED` cases also `w`, float32 [256] in [0, 2)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = rng.normal(size=(EXAMPLES, 3)).astype("float32")
  y = x @ np.array([1.0, 2.0, 3.0]) + 1.5 + rng.normal(0, 0.1, EXAMPLES)
  w = rng.uniform(0, 2, EXAMPLES).astype("float32")
  return (x, y.astype("float32")[:, None]) + ((w,) if case in WEIGHTED
                                               else ())


def batch_mean_squared_error(y_true, y_pred):
  """One value for the whole batch: the mean squared error."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.reduce_mean(tf.square(y_true - y_pred))


def learning_rate(case: str) -> float:
  """`case`'s SGD learning rate (lower for the losses summed over the
  batch)."""
  return 0.001 if case in ("sum", "sum_weighted", "none") else 0.05


def build(case: str, jit_compile: bool = False):
  """`(model, learning rate)` of `case`, compiled as the user would
  (`jit_compile`: with `compile(jit_compile=True)`)."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  class SquaredError(keras.losses.Loss):

    def call(self, y_true, y_pred):
      return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)

  class AddsLoss(keras.layers.Layer):

    def call(self, inputs):
      self.add_loss(0.01 * keras.ops.mean(keras.ops.square(inputs)))
      return inputs

  rate = learning_rate(case)
  regularizer = None
  if case in ("batch_valued_lambda", "batch_valued_regularized"):
    loss = lambda y, p: tf.reduce_mean(tf.square(y - p))
  elif case == "batch_valued_function":
    loss = batch_mean_squared_error
  elif case == "regularized":
    loss = "mse"
  elif case in ("sum", "sum_weighted"):
    loss = keras.losses.MeanSquaredError(reduction="sum")
  else:
    loss = SquaredError(reduction=None, name="squared_error")
  layers = [keras.Input((3,))]
  if case in ("regularized", "batch_valued_regularized"):
    regularizer = keras.regularizers.L2(0.1)
    layers.append(AddsLoss())
  layers.append(keras.layers.Dense(1, kernel_initializer="zeros",
                                   kernel_regularizer=regularizer))
  model = keras.Sequential(layers)
  model.compile(optimizer=keras.optimizers.SGD(rate), loss=loss,
                **({"jit_compile": True} if jit_compile else {}))
  return model, rate


def keras_fit(case: str) -> dict:
  x, y, *w = data(case)
  w = w[0] if w else None
  model, _ = build(case)
  history = model.fit(x, y, sample_weight=w, batch_size=GLOBAL_BATCH,
                      epochs=EPOCHS, shuffle=False, verbose=0)
  return {"weights": [v.tolist() for v in model.get_weights()],
          "loss": [float(v) for v in history.history["loss"]],
          "eval_loss": float(model.evaluate(x, y, sample_weight=w,
                                            batch_size=GLOBAL_BATCH,
                                            verbose=0))}


def tfdist_fit(case: str, strategy: str, model_dir: str) -> dict:
  """`tfdist.fit` of `case` under `strategy`; `warnings` holds what it
  logged about jit_compile (the `JIT_COMPILED` case's model is compiled
  with `jit_compile=True`)."""
  import logging  # pylint: disable=g-import-not-at-top
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top
  x, y, *w = data(case)
  w = w[0] if w else None
  built = []

  def model_fn():
    model, _ = build(case, jit_compile=case in JIT_COMPILED)
    built.append(model)
    return model

  logged = []
  handler = logging.Handler(logging.WARNING)
  handler.emit = lambda record: logged.append(record.getMessage())
  absl_logging.get_absl_logger().addHandler(handler)
  # Not build's rate: a model built before tfdist.fit would start
  # TensorFlow before MultiWorkerMirroredStrategy configures it.
  rate = learning_rate(case)
  try:
    result = tfdist.fit(model_fn, x=x, y=y, sample_weight=w,
                        validation_data=(x, y) if w is None else (x, y, w),
                        verbose=0, config=tfdist.TrainConfig(
                            model_dir=model_dir, train_epochs=EPOCHS,
                            batch_size=GLOBAL_BATCH,
                            base_batch_size=GLOBAL_BATCH, optimizer="sgd",
                            momentum=0.0, base_learning_rate=rate,
                            warmup_steps=0, lr_schedule="constant",
                            shuffle_buffer_size=0, log_steps=1000,
                            distribution_strategy=strategy))
  finally:
    absl_logging.get_absl_logger().removeHandler(handler)
  return {"weights": [w.tolist() for w in built[-1].get_weights()],
          "loss": result["history"]["loss"],
          "eval_loss": result["history"]["val_loss"][-1],
          "replicas": result["num_replicas_in_sync"],
          "warnings": [m for m in logged if "jit_compile" in m]}


def flat(weights) -> list:
  import numpy as np  # pylint: disable=g-import-not-at-top
  return np.concatenate([np.ravel(np.asarray(w)) for w in weights])


class Checks:
  """What a run of a case must show (a mixin of the test classes)."""

  def check_run(self, case: str, strategy: str, run: dict,
                reference: dict):
    """Asserts `case`'s tfdist `run` under `strategy` matches `Model.fit`'s
    `reference` (`keras_fit`), and checks its conformance cell."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    self.assertNotIn("error", run, run.get("error"))
    scale = max(1.0, float(np.max(np.abs(flat(reference["weights"])))))
    np.testing.assert_allclose(flat(run["weights"]),
                               flat(reference["weights"]),
                               rtol=RTOL, atol=RTOL * scale,
                               err_msg=f"{case} weights, {strategy}")
    np.testing.assert_allclose(run["loss"], reference["loss"], rtol=RTOL,
                               err_msg=f"{case} training loss, {strategy}")
    np.testing.assert_allclose(run["eval_loss"], reference["eval_loss"],
                               rtol=RTOL,
                               err_msg=f"{case} evaluation loss, {strategy}")
    self.assertEqual(run["replicas"], 1 if strategy == "one_device" else 2)
    for row in CELL_ROWS.get(case, ()):
      conformance_table.check_cell(self, row, strategy, WORKS if len(
          CELL_ROWS[case]) == 1 else WORKS_BOTH)

  def check_jit_warning(self, run: dict, strategy: str):
    warnings = run["warnings"]
    self.assertLen(warnings, 1, warnings)
    self.assertIn("compiled with jit_compile=True, which tfdist does not "
                  "read", warnings[0])
    # The setting to change: a flag for tfdist.train, the field for
    # tfdist.fit (whose log lines say fields).
    self.assertRegex(warnings[0], r"Set (--)?enable_xla \(TrainConfig\("
                                  r"enable_xla=True\)\)")
    conformance_table.check_cell(self, "jit_compile", strategy, JIT_WARNED)


def cluster_main(out_path: str, case: str):
  """`case` through `tfdist.fit` on the cluster of `TF_CONFIG` (run by
  `tfdist.launch --module=tests.loss_semantics_testlib OUT_JSON CASE`); the
  chief then runs the reference, `keras_fit(case)` (one device: outside
  any strategy's scope), and writes both to OUT_JSON as
  `{"run": ..., "keras": ...}` (the test's process starts no TensorFlow)."""
  tf_config = json.loads(os.environ["TF_CONFIG"])
  result = tfdist_fit(case, "multi_worker_mirrored",
                       os.path.join(os.path.dirname(out_path), case))
  if tf_config["task"]["type"] == "chief":
    with open(out_path, "w") as f:
      json.dump({"run": result, "keras": keras_fit(case)}, f)


if __name__ == "__main__":
  cluster_main(*sys.argv[1:3])
