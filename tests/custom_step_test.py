"""A model's own `train_step`, `test_step` and `compute_loss` run in tfdist.

Each case (`CASES`) is a Keras model subclass in the style of Keras's guide
"Customizing what happens in fit()"; it trains with `Model.fit` (then
`Model.evaluate`) and with `tfdist.fit`, on one device and under
MirroredStrategy on 2 logical CPUs, and the final weights, the last
epoch's logs and the evaluation logs are compared (`ATOL`). Every case
runs once per test process: in this process when no test trained here
before (the logical devices must exist before TensorFlow starts), else in
one child process (this file run as a script). The refusals (`REFUSALS`)
of settings that need tfdist's own step run there too. The
two-optimizer case also runs on two MultiWorkerMirrored workers (a local
cluster, `tfdist.launch --module=tests.custom_step_test`), against
`Model.fit` under Mirrored (Keras's own `fit` fails under
MultiWorkerMirrored).

Terms added by hand (an L2 penalty added in `train_step`, an output
penalty added to `super().compute_loss(...)`, both in one model) are
per-replica values the strategy sums: tfdist gives Keras's weights under the
same strategy (on one device, one device's; under Mirrored and on two
workers, Mirrored's, which are not one device's), and the run warns
(`tfdist.training.plan.differences`).

Data: y = 3x + 1 on 512 examples, batches of 64, plain SGD at 0.1 with no
shuffling, so both loops make the same updates on the same batches (float32
round-off apart). Weights start at zero (a fixed initializer).
"""

import json
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest

from tests import conformance_table
from tests import testutil

_CHILD_ENV = "TFDIST_CUSTOM_STEP_CHILD"
ATOL = 1e-4
BATCH = 64
EPOCHS = 2
RATE = 0.1
STRATEGIES = ("one_device", "mirrored")


def _data():
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = rng.uniform(-1, 1, (512, 1)).astype("float32")
  return x, (3 * x[:, 0] + 1).astype("float32")


def _models():
  """`{case: builder(optimizer)}`: each returns the case's compiled model
  (`optimizer`: compile's, which tfdist replaces with its own)."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def dense(name="dense"):
    return keras.layers.Dense(1, kernel_initializer="zeros", name=name)

  class Frozen(keras.Model):
    """Trains the kernel only: the bias stays 0."""

    def __init__(self):
      super().__init__()
      self.dense = dense()

    def call(self, x):
      return self.dense(x)

    def train_step(self, data):
      x, y = data
      with tf.GradientTape() as tape:
        y_pred = self(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
      kernel = self.dense.kernel
      self.optimizer.apply([tape.gradient(loss, kernel)], [kernel])
      return self.compute_metrics(x, y, y_pred)

  class TwoOptimizers(keras.Model):
    """A GAN's layout: two parts, each with its loss and optimizer (the
    second one's own, given to `compile`); logs two raw losses."""

    def __init__(self):
      super().__init__()
      self.a = dense("a")
      self.b = dense("b")

    def compile(self, b_optimizer, **kwargs):
      super().compile(**kwargs)
      self.b_optimizer = b_optimizer

    def call(self, x):
      return self.a(x)

    def train_step(self, data):
      x, y = data
      mse = keras.losses.MeanSquaredError()
      with tf.GradientTape() as tape:
        a_loss = mse(y[:, None], self.a(x))
      self.optimizer.apply(tape.gradient(a_loss, self.a.trainable_weights),
                           self.a.trainable_weights)
      with tf.GradientTape() as tape:
        # The second part learns from the first's output.
        b_loss = mse(2.0 * y[:, None], self.b(self.a(x)) + x)
      self.b_optimizer.apply(
          tape.gradient(b_loss, self.b.trainable_weights),
          self.b.trainable_weights)
      return {"a_loss": a_loss, "b_loss": b_loss}

  class AbsoluteLoss(keras.Model):
    """`compute_loss` overridden: mean absolute error, whatever compile
    says (mean squared error)."""

    def __init__(self):
      super().__init__()
      self.dense = dense()

    def call(self, x):
      return self.dense(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
      return keras.losses.MeanAbsoluteError()(y, y_pred)

  class LowLevel(keras.Model):
    """Keras's "going lower-level" step: compiled without a loss; its own
    loss function and metric trackers."""

    def __init__(self):
      super().__init__()
      self.dense = dense()
      self.loss_tracker = keras.metrics.Mean(name="loss")
      self.mae = keras.metrics.MeanAbsoluteError(name="mae")
      self.loss_fn = keras.losses.MeanSquaredError()

    def call(self, x):
      return self.dense(x)

    @property
    def metrics(self):
      return [self.loss_tracker, self.mae]

    def train_step(self, data):
      x, y = data
      with tf.GradientTape() as tape:
        y_pred = self(x, training=True)
        loss = self.loss_fn(y[:, None], y_pred)
      self.optimizer.apply(tape.gradient(loss, self.trainable_weights),
                           self.trainable_weights)
      self.loss_tracker.update_state(loss)
      self.mae.update_state(y[:, None], y_pred)
      return {"loss": self.loss_tracker.result(), "mae": self.mae.result()}

    def test_step(self, data):
      x, y = data
      y_pred = self(x, training=False)
      self.loss_tracker.update_state(self.loss_fn(y[:, None], y_pred))
      self.mae.update_state(y[:, None], y_pred)
      return {m.name: m.result() for m in self.metrics}

  class OwnEvaluation(keras.Model):
    """`test_step` overridden: reports its own error metric, under a name
    of its own."""

    def __init__(self):
      super().__init__()
      self.dense = dense()
      self.error = keras.metrics.MeanAbsoluteError(name="error")

    def call(self, x):
      return self.dense(x)

    def test_step(self, data):
      x, y = data
      self.error.update_state(y[:, None], self(x))
      return {"abs_error": self.error.result()}

  class Combined(keras.Model):
    """The four above in one step, for the two-worker run: a frozen bias
    (part `a`), a second part `b` with its own optimizer and loss
    function, `compute_loss` overridden (mean absolute error) and no
    compiled loss (its own metric trackers, and a `test_step`)."""

    def __init__(self):
      super().__init__()
      self.a = dense("a")
      self.b = dense("b")
      self.loss_tracker = keras.metrics.Mean(name="loss")
      self.mae = keras.metrics.MeanAbsoluteError(name="mae")
      self.loss_fn = keras.losses.MeanSquaredError()

    def compile(self, b_optimizer, **kwargs):
      super().compile(**kwargs)
      self.b_optimizer = b_optimizer

    def call(self, x):
      return self.a(x)

    @property
    def metrics(self):
      return [self.loss_tracker, self.mae]

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
      return keras.losses.MeanAbsoluteError()(y, y_pred)

    def train_step(self, data):
      x, y = data
      with tf.GradientTape() as tape:
        y_pred = self(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
      kernel = self.a.kernel
      self.optimizer.apply([tape.gradient(loss, kernel)], [kernel])
      with tf.GradientTape() as tape:
        b_loss = self.loss_fn(2.0 * y[:, None], self.b(y_pred) + x)
      self.b_optimizer.apply(
          tape.gradient(b_loss, self.b.trainable_weights),
          self.b.trainable_weights)
      self.loss_tracker.update_state(loss)
      self.mae.update_state(y[:, None], y_pred)
      return {"loss": self.loss_tracker.result(), "mae": self.mae.result(),
              "b_loss": b_loss}

    def test_step(self, data):
      x, y = data
      y_pred = self(x, training=False)
      self.loss_tracker.update_state(self.compute_loss(y=y, y_pred=y_pred))
      self.mae.update_state(y[:, None], y_pred)
      return {m.name: m.result() for m in self.metrics}

  class HandAddedRegularizer(keras.Model):
    """Its own `train_step` adds an L2 penalty by hand to the compiled
    loss: a per-replica value the strategy sums (N times one device's)."""

    def __init__(self):
      super().__init__()
      self.dense = dense()

    def call(self, x):
      return self.dense(x)

    def train_step(self, data):
      x, y = data
      with tf.GradientTape() as tape:
        y_pred = self(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred) + (
            0.5 * tf.reduce_sum(tf.square(self.dense.kernel)))
      self.optimizer.apply(tape.gradient(loss, self.trainable_weights),
                           self.trainable_weights)
      return self.compute_metrics(x, y, y_pred)

  class HandAddedTerms(HandAddedRegularizer):
    """Both terms in one model: its own `train_step` adds an L2 penalty by
    hand (`HandAddedRegularizer`), and `compute_loss` is overridden to add
    a penalty on the outputs after `super().compute_loss` (not scaled for
    the strategy)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
      return super().compute_loss(
          x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
          training=training) + 0.5 * tf.reduce_mean(tf.square(y_pred))

  def build(cls, **compile_args):
    def builder(optimizer):
      model = cls()
      model(tf.zeros((1, 1)))
      model.compile(optimizer=optimizer, **compile_args)
      return model
    return builder

  return {
      "frozen_bias": build(Frozen, loss="mse", metrics=["mae"]),
      "two_optimizers": lambda optimizer: _two_optimizers(TwoOptimizers,
                                                          optimizer),
      # The model's own optimizer keeps state (momentum) to checkpoint.
      "two_optimizers_momentum": lambda optimizer: _two_optimizers(
          TwoOptimizers, optimizer, momentum=0.9),
      "compute_loss": build(AbsoluteLoss, loss="mse", metrics=["mae"]),
      "low_level_no_loss": build(LowLevel),
      "test_step": build(OwnEvaluation, loss="mse"),
      "combined": lambda optimizer: _two_optimizers(Combined, optimizer),
      "hand_added_terms": build(HandAddedTerms, loss="mse", metrics=["mae"]),
  }


def _two_optimizers(cls, optimizer, momentum: float = 0.0):
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  model = cls()
  model(tf.zeros((1, 1)))
  model.b(tf.zeros((1, 1)))
  model.compile(b_optimizer=keras.optimizers.SGD(RATE, momentum=momentum),
                optimizer=optimizer)
  return model


# The conformance-table rows (tests/conformance_table.py) of the cases,
# and each column's cell.
CELL_ROWS = {"frozen_bias": "own_step_frozen",
             "two_optimizers": "own_step_two_optimizers",
             "compute_loss": "own_compute_loss",
             "low_level_no_loss": "own_step_no_loss"}
# Terms added by hand: Keras's fit under the strategy, not one device's.
# Both rows are measured with one model holding both terms
# (`_models()["hand_added_terms"]`) on every strategy.
HAND_ADDED_ROWS = ("own_step_hand_added_term", "own_compute_loss_extra_term")
HAND_ADDED_CELLS = {
    "one_device": "works (the weights and logs of `Model.fit`; measured "
                  "with one model holding both terms)",
    "mirrored": "as Keras under Mirrored (the weights and logs of "
                "`Model.fit` under Mirrored; the hand-added term counts 2 "
                "times, so not one device's weights; warned at start; "
                "measured with one model holding both terms)",
    "multi_worker_mirrored": "as Keras under Mirrored (the weights and logs "
                             "of `Model.fit` under Mirrored on 2 devices; "
                             "not one device's; measured with one model "
                             "holding both terms)",
}
CELLS = {
    "one_device": "works (the weights and logs of `Model.fit`)",
    "mirrored": "works (one device's weights; the logs of `Model.fit` under "
                "Mirrored)",
    "multi_worker_mirrored": "works (one device's weights; the logs of "
                             "`Model.fit` under Mirrored; measured with one "
                             "model combining the four rows)",
}


def _floats(logs: dict) -> dict:
  return {k: float(v) for k, v in logs.items() if k != "learning_rate"}


# Cases run only by the resumed test and the two-worker test.
RESUMED_ONLY = ("two_optimizers_momentum", "combined")
# Cases that Keras cannot evaluate (no loss for the default test_step).
NOT_EVALUATED = ("two_optimizers", "two_optimizers_momentum")


# Evaluation examples that leave the last batch's second replica empty
# (200 = 3 x 64 + 8: tfdist batches per replica, 8 + 0).
PARTIAL_EVAL = 200


def _keras_fit(builder, strategy, evaluate: bool = True,
               partial_eval: bool = False) -> dict:
  """`Model.fit` and `Model.evaluate` (on every example) in `strategy`'s
  scope (None: one device); with `partial_eval`, also `Model.evaluate` of
  the same weights on the first `PARTIAL_EVAL` examples
  (`"partial_eval"`)."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  x, y = _data()
  with strategy.scope() if strategy else contextlib.nullcontext():
    model = builder(keras.optimizers.SGD(RATE))
  history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                      verbose=0)

  def evaluation(examples):
    return _floats(model.evaluate(x[:examples], y[:examples],
                                  batch_size=BATCH, verbose=0,
                                  return_dict=True))
  return {"weights": [w.tolist() for w in model.get_weights()],
          "train": _floats({k: v[-1] for k, v in history.history.items()}),
          "eval": evaluation(len(x)) if evaluate else {},
          **({"partial_eval": evaluation(PARTIAL_EVAL)} if partial_eval
             else {})}


def _config(model_dir: str, strategy: str, **overrides):
  import tfdist  # pylint: disable=g-import-not-at-top
  return tfdist.TrainConfig(**{
      **dict(model_dir=model_dir, train_epochs=EPOCHS, batch_size=BATCH,
             base_batch_size=BATCH, optimizer="sgd", momentum=0.0,
             base_learning_rate=RATE, warmup_steps=0, lr_schedule="constant",
             shuffle_buffer_size=0, distribution_strategy=strategy,
             log_steps=1000),
      **overrides})


def _tfdist_fit(builder, strategy: str, model_dir: str,
                evaluate: bool = True, eval_examples: int = 512,
                **overrides) -> dict:
  """`tfdist.fit` of the case's model (`overrides`: of the config),
  evaluated on the first `eval_examples`; in `mode="eval"`, the
  manifest's `results`."""
  import keras  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top
  x, y = _data()
  weights = {}

  class Final(keras.callbacks.Callback):

    def on_train_end(self, logs=None):
      weights["final"] = [w.tolist() for w in self.model.get_weights()]

  manifest = tfdist.fit(lambda: builder(keras.optimizers.SGD(RATE)),
                        x=x, y=y,
                        validation_data=((x[:eval_examples],
                                          y[:eval_examples])
                                         if evaluate else None),
                        config=_config(model_dir, strategy, **overrides),
                        callbacks=[Final()], verbose=0)
  if overrides.get("mode") == "eval":
    return {"results": manifest["results"]}
  last_eval = (manifest.get("eval_history") or [{}])[-1]
  return {"weights": weights["final"],
          "train": _floats({k: v[-1] for k, v in
                            manifest["history"].items()
                            if not k.startswith("val_")}),
          "eval": {k: v for k, v in last_eval.items()
                   if isinstance(v, float) and k not in (
                       "eval_seconds", "time", "process_seconds",
                       "examples_per_second")},
          "replicas": manifest.get("num_replicas_in_sync")}


# Settings that need tfdist's own step: (name, TrainConfig overrides,
# fit keyword arguments, a text the error must hold: the TrainConfig field,
# as fit's errors say it).
REFUSALS = (
    ("gradient_accumulation", {"gradient_accumulation_steps": 2}, {},
     "gradient_accumulation_steps=2"),
    ("zero", {"zero_stage": 1, "distribution_strategy": "mirrored"}, {},
     "zero_stage=1 (shard_optimizer_state)"),
    ("clipnorm", {"clipnorm": 1.0}, {}, "clipnorm"),
    ("global_clipnorm", {"global_clipnorm": 1.0}, {}, "global_clipnorm"),
    ("class_weight", {"class_weight": ((0, 1.0),)}, {}, "class_weight"),
    ("enable_xla", {"enable_xla": True}, {}, "enable_xla"),
    ("fit_loss", {}, {"loss": "mae"}, "tfdist.fit(loss=..., metrics=...)"),
)


def _refusals(builder, root: str) -> dict:
  """Each of `REFUSALS` with the frozen-bias model, and an uncompiled one:
  the error's class and message."""
  import keras  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top
  x, y = _data()
  out = {}

  def uncompiled(optimizer):
    model = builder(optimizer)
    model.compiled = False
    return model

  for name, overrides, kwargs, _ in REFUSALS + (
      ("uncompiled", {}, {}, "not compiled"),):
    make = uncompiled if name == "uncompiled" else builder
    try:
      tfdist.fit(lambda make=make: make(keras.optimizers.SGD(RATE)), x=x, y=y,
                 config=_config(os.path.join(root, name),
                                overrides.pop("distribution_strategy",
                                              "one_device"), **overrides),
                 verbose=0, **kwargs)
      out[name] = {"error": None}
    except Exception as e:  # pylint: disable=broad-except
      out[name] = {"error": type(e).__name__, "message": str(e),
                   "config_error": isinstance(e, tfdist.ConfigError)}
  return out


def _no_call_run(model_dir: str) -> dict:
  """A GAN as Keras's tutorial writes it (no `call`, its own `compile` and
  two optimizers) through `tfdist.fit`: it trains; there is no SavedModel."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top

  class TutorialGAN(keras.Model):

    def __init__(self):
      super().__init__()
      self.d = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
      self.g = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])

    def compile(self, d_optimizer, g_optimizer):  # pylint: disable=arguments-differ
      super().compile()
      self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def train_step(self, data):
      x, _ = data
      with tf.GradientTape() as tape:
        d_loss = tf.reduce_mean(tf.square(self.d(x) - 1.0))
      grads = tape.gradient(d_loss, self.d.trainable_weights)
      self.d_optimizer.apply_gradients(zip(grads, self.d.trainable_weights))
      with tf.GradientTape() as tape:
        g_loss = tf.reduce_mean(tf.square(self.d(self.g(x))))
      grads = tape.gradient(g_loss, self.g.trainable_weights)
      self.g_optimizer.apply_gradients(zip(grads, self.g.trainable_weights))
      return {"d_loss": d_loss, "g_loss": g_loss}

  def build():
    model = TutorialGAN()
    model.compile(keras.optimizers.SGD(RATE), keras.optimizers.SGD(RATE))
    return model

  x, y = _data()
  manifest = tfdist.fit(build, x=x, y=y, verbose=0, config=_config(
      model_dir, "one_device", mode="train", train_epochs=1))
  return {"saved_model": manifest["artifacts"]["saved_model"],
          "final_step": manifest["final_step"],
          "written": os.path.exists(os.path.join(model_dir, "saved_model"))}


# The cases whose one-device Model.fit also evaluates the first
# PARTIAL_EVAL examples (the partial-evaluation references).
PARTIAL_EVAL_CASES = ("frozen_bias", "test_step")


def _child_main() -> dict:
  """Every case's runs, on 2 logical CPUs (`testutil.two_logical_cpus`
  first)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import traceback  # pylint: disable=g-import-not-at-top
  root = tempfile.mkdtemp(dir=testutil.scratch_dir())
  mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  out = {}
  models = _models()
  for case, builder in models.items():
    if case in RESUMED_ONLY:
      continue
    for strategy in STRATEGIES:
      name = f"{case}/{strategy}"
      try:
        out[name] = {
            "keras": _keras_fit(builder, mirrored if strategy == "mirrored"
                                else None,
                                evaluate=case not in NOT_EVALUATED,
                                partial_eval=(case in PARTIAL_EVAL_CASES and
                                              strategy == "one_device")),
            "tfdist": _tfdist_fit(builder, strategy,
                                  os.path.join(root, name.replace("/", "-")),
                                  evaluate=case not in NOT_EVALUATED)}
      except Exception:  # pylint: disable=broad-except
        out[name] = {"error": traceback.format_exc()}
  # Several steps per tf.function call (tfdist's --steps_per_execution).
  try:
    # Model.fit's run is the low_level_no_loss case's (the same updates).
    out["steps_per_execution"] = {
        "keras": (out.get("low_level_no_loss/mirrored", {}).get("keras") or
                  _keras_fit(models["low_level_no_loss"], mirrored)),
        "tfdist": _tfdist_fit(models["low_level_no_loss"], "mirrored",
                              os.path.join(root, "spe"),
                              steps_per_execution=4)}
  except Exception:  # pylint: disable=broad-except
    out["steps_per_execution"] = {"error": traceback.format_exc()}
  # Trained one epoch, then resumed from its checkpoint for the second.
  try:
    builder = models["two_optimizers_momentum"]
    resumed_dir = os.path.join(root, "resumed")
    first = _tfdist_fit(builder, "one_device", resumed_dir, evaluate=False,
                        train_epochs=1)
    out["resumed"] = {
        "keras": _keras_fit(builder, None, evaluate=False),
        "first": first,
        "tfdist": _tfdist_fit(builder, "one_device", resumed_dir,
                              evaluate=False),
        # Keras's own fit fails on this model under Mirrored (the model's
        # optimizer creates its momentum inside the replica step:
        # InvalidArgumentError at cond/Placeholder); tfdist trains it.
        "mirrored": _tfdist_fit(builder, "mirrored",
                                os.path.join(root, "momentum-mirrored"),
                                evaluate=False)}
  except Exception:  # pylint: disable=broad-except
    out["resumed"] = {"error": traceback.format_exc()}
  # The two-worker run's references: Model.fit under Mirrored (2
  # replicas, as the two workers) and on one device.
  try:
    out["combined"] = {
        "keras": _keras_fit(models["combined"], mirrored),
        "keras_one_device": _keras_fit(models["combined"], None)}
  except Exception:  # pylint: disable=broad-except
    out["combined"] = {"error": traceback.format_exc()}
  # The hand-added terms' references are that case's Model.fit runs.
  try:
    out["hand_added_terms"] = {
        "keras": out["hand_added_terms/mirrored"]["keras"],
        "keras_one_device": out["hand_added_terms/one_device"]["keras"]}
  except KeyError:
    out["hand_added_terms"] = {"error": out.get(
        "hand_added_terms/mirrored", {}).get("error") or out.get(
            "hand_added_terms/one_device", {}).get("error")}
  # Evaluation on examples that leave a replica's last batch empty:
  # Keras's test_step averaged that empty batch into a NaN loss (issue
  # 47); one device's Model.evaluate of the same weights is the reference
  # (that of the case's one-device Model.fit: the same updates).
  for case in PARTIAL_EVAL_CASES:
    try:
      out[f"partial_eval/{case}"] = {
          "keras": {"eval": out[f"{case}/one_device"]["keras"][
              "partial_eval"]},
          "tfdist": _tfdist_fit(models[case], "mirrored",
                                os.path.join(root, f"partial-{case}"),
                                eval_examples=PARTIAL_EVAL)}
    except Exception:  # pylint: disable=broad-except
      out[f"partial_eval/{case}"] = {"error": traceback.format_exc()}
  # --mode=eval on the test_step case's checkpoint: its own test_step.
  try:
    out["eval_mode"] = _tfdist_fit(
        models["test_step"], "one_device",
        os.path.join(root, "test_step-one_device"), mode="eval")
  except Exception:  # pylint: disable=broad-except
    out["eval_mode"] = {"error": traceback.format_exc()}
  out["refusals"] = _refusals(models["frozen_bias"], root)
  try:
    out["no_call"] = _no_call_run(os.path.join(root, "no-call"))
  except Exception:  # pylint: disable=broad-except
    out["no_call"] = {"error": traceback.format_exc()}
  return out


_RESULTS = {}


def _child_results() -> dict:
  """`_child_main`'s results, once per test process: in this process when
  its CPU can still be split (no test trained here before: TensorFlow's
  start-up is then paid once for the file), else in a child process (this
  file run as a script). JSON either way (lists, not tuples)."""
  if not _RESULTS and testutil.two_logical_cpus():
    _RESULTS.update(json.loads(json.dumps(_child_main())))
  if not _RESULTS:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               TF_ENABLE_ONEDNN_OPTS="0", **{_CHILD_ENV: "1"})
    env["PYTHONPATH"] = (testutil.REPO_ROOT + os.pathsep +
                         env.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)],
                          cwd=testutil.REPO_ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=900)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode or not lines:
      raise AssertionError(f"child failed ({proc.returncode}):\n"
                           f"{proc.stdout[-4000:]}")
    _RESULTS.update(json.loads(lines[-1]))
  return _RESULTS


class CustomStepTest(absltest.TestCase):
  """tfdist against `Model.fit` for models that customize their step."""

  def _case(self, name: str) -> dict:
    result = _child_results()[name]
    self.assertNotIn("error", result, result.get("error"))
    return result

  def _check(self, case: str) -> dict:
    """Asserts `case`'s tfdist runs match `Model.fit` under the same
    strategy (and one device's weights), and checks its conformance
    cells."""
    out = {}
    for strategy in STRATEGIES:
      with self.subTest(strategy=strategy):
        result = self._case(f"{case}/{strategy}")
        keras_run, ours = result["keras"], result["tfdist"]
        self.assertEqual(ours["replicas"], 2 if strategy == "mirrored" else 1)
        for mine, theirs in zip(ours["weights"], keras_run["weights"]):
          self.assertSequenceAlmostEqual(
              _flatten(mine), _flatten(theirs), delta=ATOL,
              msg=f"weights {ours['weights']} vs {keras_run['weights']}")
        self.assertEqual(set(ours["train"]), set(keras_run["train"]))
        for key, value in keras_run["train"].items():
          self.assertAlmostEqual(ours["train"][key], value, delta=ATOL,
                                 msg=f"train {key}: {ours['train']} vs "
                                 f"{keras_run['train']}")
        for key, value in keras_run["eval"].items():
          self.assertIn(key, ours["eval"])
          self.assertAlmostEqual(ours["eval"][key], value, delta=ATOL,
                                 msg=f"eval {key}: {ours['eval']} vs "
                                 f"{keras_run['eval']}")
        # Under Mirrored too, the weights are one device's.
        self.assertLess(_max_diff(ours["weights"], self._case(
            f"{case}/one_device")["keras"]["weights"]), ATOL)
        out[strategy] = result
    if case in CELL_ROWS:
      for strategy in STRATEGIES:
        conformance_table.check_cell(self, CELL_ROWS[case], strategy,
                                     CELLS[strategy])
    return out

  def test_a_replica_left_without_evaluation_examples(self):
    # 200 examples in batches of 64 over 2 replicas: the last batch's 8
    # examples all on the first replica. Keras's test_step averaged the
    # empty batch into a NaN loss (issue 47). The compiled loss and
    # metrics (read from their state over every replica) are one device's
    # Model.evaluate of the same weights; a test_step's own logs are the
    # mean of the replicas' values (as under Keras's fit with the
    # strategy), so near one device's, not equal.
    for case, tolerance in (("frozen_bias", ATOL), ("test_step", 0.05)):
      with self.subTest(case=case):
        result = self._case(f"partial_eval/{case}")
        theirs, ours = result["keras"]["eval"], result["tfdist"]["eval"]
        self.assertEqual(result["tfdist"]["replicas"], 2)
        self.assertTrue(theirs)
        for key, value in theirs.items():
          self.assertAlmostEqual(
              ours[key], value, delta=tolerance * max(1.0, abs(value)),
              msg=f"eval {key}: {ours} vs {theirs}")

  def test_terms_added_by_hand_count_per_replica(self):
    # The compiled loss is one device's; a term added by hand (in
    # train_step, or after super().compute_loss) is summed over the
    # replicas as under Keras's fit with the strategy: Keras's weights,
    # not one device's (the run warns, `tfdist.training.plan.differences`).
    # One model holds both terms (`_models()["hand_added_terms"]`).
    case = "hand_added_terms"
    for strategy in STRATEGIES:
      with self.subTest(case=case, strategy=strategy):
        result = self._case(f"{case}/{strategy}")
        keras_run, ours = result["keras"], result["tfdist"]
        self.assertLess(_max_diff(ours["weights"], keras_run["weights"]),
                        ATOL)
        for key, value in keras_run["train"].items():
          self.assertAlmostEqual(ours["train"][key], value, delta=ATOL,
                                 msg=f"train {key}")
        one_device = self._case(f"{case}/one_device")["keras"]["weights"]
        if strategy == "mirrored":
          self.assertGreater(_max_diff(ours["weights"], one_device), 1e-3)
        for row in HAND_ADDED_ROWS:
          conformance_table.check_cell(self, row, strategy,
                                       HAND_ADDED_CELLS[strategy])

  def test_frozen_variable_stays_frozen(self):
    for result in self._check("frozen_bias").values():
      self.assertEqual(result["tfdist"]["weights"][1], [0.0])
      # The kernel trained.
      self.assertGreater(result["tfdist"]["weights"][0][0][0], 1.0)

  def test_two_optimizers_gan_style(self):
    for result in self._check("two_optimizers").values():
      self.assertEqual(set(result["tfdist"]["train"]), {"a_loss", "b_loss"})

  def test_compute_loss_override_is_the_loss(self):
    for result in self._check("compute_loss").values():
      # The mean absolute error, not the compiled mean squared error.
      self.assertAlmostEqual(result["tfdist"]["eval"]["loss"],
                             result["keras"]["eval"]["mae"], delta=ATOL)

  def test_low_level_step_without_a_compiled_loss(self):
    for result in self._check("low_level_no_loss").values():
      self.assertEqual(set(result["tfdist"]["train"]), {"loss", "mae"})

  def test_test_step_override_reports_its_logs(self):
    for result in self._check("test_step").values():
      self.assertEqual(set(result["keras"]["eval"]), {"abs_error"})
      self.assertIn("abs_error", result["tfdist"]["eval"])

  def test_several_steps_per_call(self):
    result = self._case("steps_per_execution")
    keras_run, ours = result["keras"], result["tfdist"]
    self.assertSequenceAlmostEqual(_flatten(ours["weights"]),
                                   _flatten(keras_run["weights"]),
                                   delta=ATOL)
    for key, value in keras_run["train"].items():
      self.assertAlmostEqual(ours["train"][key], value, delta=ATOL)

  def test_resumed_run_restores_the_models_own_optimizer(self):
    result = self._case("resumed")
    keras_run, ours = result["keras"], result["tfdist"]
    # The first attempt stopped half-way (another model than the end's).
    self.assertGreater(_max_diff(result["first"]["weights"],
                                 keras_run["weights"]), 0.01)
    self.assertLess(_max_diff(ours["weights"], keras_run["weights"]), ATOL)
    for key, value in keras_run["train"].items():
      self.assertAlmostEqual(ours["train"][key], value, delta=ATOL)
    # Mirrored makes one device's updates (each replica's loss is scaled
    # by 1/2 and the gradients summed).
    self.assertEqual(result["mirrored"]["replicas"], 2)
    self.assertLess(_max_diff(result["mirrored"]["weights"],
                              keras_run["weights"]), ATOL)

  def test_eval_mode_runs_the_models_test_step(self):
    results = self._case("eval_mode")["results"]
    reference = self._case("test_step/one_device")["keras"]["eval"]
    self.assertLen(results, 1)
    self.assertAlmostEqual(results[0]["abs_error"], reference["abs_error"],
                           delta=ATOL)
    self.assertEqual(results[0]["num_examples"], 512)

  def test_a_gan_without_call_trains_and_writes_no_saved_model(self):
    # Before: refused at start ("cannot take --dataset=arrays's features
    # ... Could not automatically infer the output shape"), where
    # Model.fit trains it.
    result = _child_results()["no_call"]
    self.assertNotIn("error", result, result.get("error"))
    self.assertEqual(result["final_step"], 512 // BATCH)
    self.assertIsNone(result["saved_model"])
    self.assertFalse(result["written"])

  def test_settings_that_need_tfdists_own_step_are_refused(self):
    refusals = self._case("refusals")
    for name, _, _, text in REFUSALS + (("uncompiled", {}, {},
                                         "not compiled"),):
      with self.subTest(name):
        result = refusals[name]
        self.assertTrue(result.get("config_error"), result)
        self.assertIn("Frozen.train_step", result["message"])
        self.assertIn(text, result["message"])
        self.assertNotIn(f"--{text}", result["message"])
        self.assertIn("Fix:", result["message"])


class OverridesAndChecksTest(absltest.TestCase):
  """`custom_step.overrides` and `check` alone (this process)."""

  def test_overrides_are_found_by_class(self):
    import keras  # pylint: disable=g-import-not-at-top
    from tfdist.training.step import custom_step  # pylint: disable=g-import-not-at-top

    class Plain(keras.Model):

      def call(self, x):
        return x

    class Own(Plain):

      def train_step(self, data):
        return {}

      def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return {}

    self.assertEqual(custom_step.overrides(Plain()), ())
    self.assertEqual(custom_step.overrides(
        keras.Sequential([keras.layers.Dense(1)])), ())
    self.assertEqual(custom_step.overrides(Own()),
                     ("Own.train_step", "Own.compute_metrics"))

  def test_fp16_train_step_is_warned_to_scale_its_loss(self):
    from tfdist.training.step import custom_step  # pylint: disable=g-import-not-at-top
    with self.assertLogs(level="WARNING") as logs:
      custom_step.check(("Gan.train_step",), model_name="gan", compiled=True,
                        loss_scaled=True)
    self.assertIn("self.optimizer.scale_loss(loss)", logs.output[0])
    # Nothing to say without an override, or with one that leaves Keras's
    # train_step (which scales the loss).
    with self.assertNoLogs(level="WARNING"):
      custom_step.check((), model_name="m", compiled=False,
                        gradient_accumulation_steps=4, loss_scaled=True)
      custom_step.check(("M.compute_loss",), model_name="m", compiled=True,
                        loss_scaled=True)

  def test_a_zero_stage_refusal_names_its_stages_switch(self):
    from tfdist import errors  # pylint: disable=g-import-not-at-top
    from tfdist.training.step import custom_step  # pylint: disable=g-import-not-at-top
    for stage, switch in ((1, "shard_optimizer_state"),
                          (2, "shard_gradients"), (3, "shard_parameters")):
      with self.assertRaisesRegex(
          errors.ConfigError,
          rf"--zero_stage={stage} \(--{switch}\)"):
        custom_step.check(("Gan.train_step",), model_name="gan",
                          compiled=True, zero_stage=stage)


def _cluster_main(out_path: str, case: str):
  """One case through `tfdist.fit` on the cluster of `TF_CONFIG` (run by
  `tfdist.launch --module=tests.custom_step_test OUT_JSON CASE`); the
  chief writes the result to OUT_JSON."""
  tf_config = json.loads(os.environ["TF_CONFIG"])
  result = _tfdist_fit(_models()[case], "multi_worker_mirrored",
                       os.path.join(os.path.dirname(out_path), case),
                       evaluate=case not in NOT_EVALUATED)
  if tf_config["task"]["type"] == "chief":
    with open(out_path, "w") as f:
      json.dump(result, f)


class MultiWorkerTest(absltest.TestCase):
  """Two MultiWorkerMirrored workers (one replica each) against
  `Model.fit` under Mirrored on 2 devices: the same global batches, the
  same reduction of the step's logs over replicas (an all-reduce between
  the workers)."""

  def test_own_step_on_two_workers(self):
    # One model's step keeps a bias frozen, trains a second part with its
    # own optimizer and loss function, calls its compute_loss override and
    # has no compiled loss (`_models()["combined"]`).
    from tests import multi_worker_testlib  # pylint: disable=g-import-not-at-top
    out = os.path.join(tempfile.mkdtemp(dir=testutil.scratch_dir()),
                       "result.json")
    status, output = multi_worker_testlib.run_launcher(
        ["--num_workers=2", "--module=tests.custom_step_test"],
        [out, "combined"], timeout=300,
        env={"TF_ENABLE_ONEDNN_OPTS": "0", "CUDA_VISIBLE_DEVICES": ""})
    self.assertEqual(status, 0, output[-4000:])
    with open(out) as f:
      ours = json.load(f)
    result = _child_results()["combined"]
    self.assertNotIn("error", result, result.get("error"))
    reference = result["keras"]
    self.assertEqual(ours["replicas"], 2)
    for weights in (reference["weights"],
                    result["keras_one_device"]["weights"]):
      self.assertSequenceAlmostEqual(_flatten(ours["weights"]),
                                     _flatten(weights), delta=ATOL)
    # The bias of part a stayed frozen; its kernel and part b trained.
    self.assertEqual(ours["weights"][1], [0.0])
    self.assertGreater(abs(ours["weights"][0][0][0]), 0.5)
    self.assertGreater(abs(ours["weights"][2][0][0]), 0.5)
    for what in ("train", "eval"):
      self.assertEqual(set(ours[what]), set(reference[what]), what)
      for key, value in reference[what].items():
        # Each worker's last-batch loss alone would be off by about 2%.
        self.assertAlmostEqual(ours[what][key], value, delta=ATOL,
                               msg=f"{what} {key}")
    for case in CELL_ROWS:
      conformance_table.check_cell(self, CELL_ROWS[case],
                                   "multi_worker_mirrored",
                                   CELLS["multi_worker_mirrored"])

  def test_terms_added_by_hand_on_two_workers(self):
    # `_models()["hand_added_terms"]`: both hand-added terms; Model.fit
    # under Mirrored on 2 devices, not one device's weights.
    from tests import multi_worker_testlib  # pylint: disable=g-import-not-at-top
    out = os.path.join(tempfile.mkdtemp(dir=testutil.scratch_dir()),
                       "result.json")
    status, output = multi_worker_testlib.run_launcher(
        ["--num_workers=2", "--module=tests.custom_step_test"],
        [out, "hand_added_terms"], timeout=300,
        env={"TF_ENABLE_ONEDNN_OPTS": "0", "CUDA_VISIBLE_DEVICES": ""})
    self.assertEqual(status, 0, output[-4000:])
    self.assertIn("differs from one device (own_step_added_terms)", output)
    with open(out) as f:
      ours = json.load(f)
    result = _child_results()["hand_added_terms"]
    self.assertNotIn("error", result, result.get("error"))
    self.assertLess(_max_diff(ours["weights"], result["keras"]["weights"]),
                    ATOL)
    self.assertGreater(_max_diff(ours["weights"],
                                 result["keras_one_device"]["weights"]), 1e-3)
    for row in HAND_ADDED_ROWS:
      conformance_table.check_cell(self, row, "multi_worker_mirrored",
                                   HAND_ADDED_CELLS["multi_worker_mirrored"])


def _max_diff(a, b) -> float:
  return max(abs(x - y) for x, y in zip(_flatten(a), _flatten(b)))


def _flatten(value) -> list:
  if isinstance(value, list):
    return [v for item in value for v in _flatten(item)]
  return [value]


if __name__ == "__main__":
  if os.environ.get(_CHILD_ENV):
    assert testutil.two_logical_cpus()
    print(json.dumps(_child_main()), flush=True)
  elif os.environ.get("TF_CONFIG"):
    _cluster_main(*sys.argv[1:3])
  else:
    absltest.main()
