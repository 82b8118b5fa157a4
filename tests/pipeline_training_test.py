"""Pipeline stages in tfdist's trainer (`--pipeline_stages`, `tfdist.fit`).

On 4 logical CPU devices (configured when this file is imported, before
TensorFlow's runtime starts: run it as its own process), with
`--deterministic --seed`:

* `tfdist.fit` with `pipeline_stages=2` and 4, GPipe and 1F1B (and the
  interleaved schedule, P = 2 with V = 2 chunks per stage, M = 4), gives
  the one-device run's weights within 1e-5 after K updates, on a functional
  model whose skip connection crosses the cuts; also with
  `gradient_accumulation_steps=2` and `steps_per_execution=2`, with named
  cuts, with weight
  regularizers, and on a model with a dict of inputs and class weights; under bf16 and fp16 it equals the one-device run that
  accumulates over the same micro-batches;
* its evaluation is the one-device run's;
* each stage's weights are created once, on the stage's device (a
  `tf.variable_creator_scope` sees no copy made on device 0 first), with
  the values of an unsplit build; weights a builder assigns are kept; a
  builder that runs the model on data is built whole once more (the same
  seeds and names), with a warning;
* a pipelined run's checkpoint resumes unsplit, and that one's under
  another P, to the weights of one unsplit run; the SavedModel is the whole
  model and serves its outputs;
* the manifest and the plan say the stages, the micro-batches, the schedule
  and that batch normalization sees micro-batches;
* the refusals at start that need the model or the devices, as
  `ConfigError` (exit status 2) naming the flag, before any step: more
  stages than layers or devices, micro-batches not dividing the step's
  batch, a subclassed model, unknown cuts, an activity regularizer, more
  interleaved chunks (P x V) than layers (the flags' own refusals are
  `tests/config_test.py`'s);
* `--model=transformer --transformer_layers=8` is cut into 4 stages, and
  its `--dry_run` on the clothing reviews plans them;
* D x P = 2 x 2 (`pipeline_stages=2, num_cpu_devices=4`: two copies of the
  pipeline on a data x pipeline mesh) gives the one-device run's weights
  within 1e-5 under Adam, and under SGD with momentum with gradient
  accumulation, `steps_per_execution=2` and 1F1B; under bf16 it equals the
  one-device run accumulating over the same micro-batches; the plan and
  the log name the mesh; its checkpoints resume on one device and in one
  copy; each copy's weights live on its own devices; D or M not dividing
  the batch and P not dividing the devices are refused naming the flag;
* P x T = 2 x 2 (`pipeline_stages=2, num_cpu_devices=4` and a Keras
  LayoutMap splitting two Dense layers over each stage's 2 devices): 2
  steps of Adam, 2 more on one device from its checkpoint, 2 more in P x
  T from that one's, equal one unsplit run of 6 within 1e-5; its
  checkpoint has the one-device run's keys and shapes; the plan prints the
  mesh with each device's coordinates; the SavedModel is the whole model.
"""

import json
import logging
import os

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from absl.testing import absltest  # pylint: disable=g-import-not-at-top
from absl.testing import parameterized  # pylint: disable=g-import-not-at-top
import keras  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

from tfdist import api  # pylint: disable=g-import-not-at-top
from tfdist import errors  # pylint: disable=g-import-not-at-top
from tfdist import experiment  # pylint: disable=g-import-not-at-top
from tfdist.config import TrainConfig  # pylint: disable=g-import-not-at-top
from tfdist.distribute import devices  # pylint: disable=g-import-not-at-top
from tfdist.distribute import environment as environment_lib  # pylint: disable=g-import-not-at-top
from tfdist.parallel.pipeline import stages as pipeline  # pylint: disable=g-import-not-at-top
from tfdist.parallel.pipeline import options as pipeline_options  # pylint: disable=g-import-not-at-top
from tfdist.parallel.pipeline import mode as pipeline_step  # pylint: disable=g-import-not-at-top
from tests import testutil  # pylint: disable=g-import-not-at-top

DEVICES = devices.configure_cpu_devices(4)

BATCH = 16
STEPS = 3
TOLERANCE = 1e-5
_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(64, 8)).astype("float32")
Y = _RNG.integers(0, 3, size=(64,)).astype("int32")


class _Built:
  """The last model a builder made (the one `fit` trained)."""
  model = None


def skip_model(regularize: bool = False, activity: bool = False):
  """Five layer calls; block_1's output skips to the Add."""
  keras.utils.set_random_seed(1)
  reg = keras.regularizers.L2(1e-3) if regularize else None
  x = keras.Input((8,), name="features")
  h1 = keras.layers.Dense(16, activation="tanh", name="block_1",
                          kernel_regularizer=reg)(x)
  h2 = keras.layers.Dense(
      16, activation="tanh", name="block_2",
      activity_regularizer=keras.regularizers.L2(1e-3) if activity
      else None)(h1)
  h3 = keras.layers.Dense(16, activation="tanh", name="block_3")(h2)
  h4 = keras.layers.Add(name="skip")([h3, h1])
  out = keras.layers.Dense(3, name="logits", kernel_regularizer=reg)(h4)
  model = keras.Model(x, out, name="skip_model")
  model.compile(
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy"])
  _Built.model = model
  return model


def _config(model_dir, **changes):
  settings = dict(model_dir=model_dir, train_steps=STEPS, batch_size=BATCH,
                  deterministic=True, seed=3, optimizer="adam",
                  base_learning_rate=0.01, lr_scaling="none", mode="train",
                  log_steps=STEPS)
  settings.update(changes)
  return TrainConfig(**settings)


def _fit(builder=skip_model, model_dir=None, layout_map=None, **changes):
  """`(weights, manifest, model_dir)` of a `tfdist.fit` run."""
  model_dir = model_dir or os.path.join(testutil.scratch_dir(), "run")
  result = api.fit(builder, x=X, y=Y, config=_config(model_dir, **changes),
                   verbose=0, layout_map=layout_map)
  return [w.copy() for w in _Built.model.get_weights()], result, model_dir


_UNSPLIT = {}


def _unsplit(**changes):
  """`(weights, manifest)` of the one-device run with `changes`, run once
  per process (several tests compare with the same one)."""
  key = tuple(sorted(changes.items()))
  if key not in _UNSPLIT:
    _UNSPLIT[key] = _fit(**changes)[:2]
  return _UNSPLIT[key]


class _InfoLog(logging.Handler):
  """Inside, records the root logger's INFO and above in `output` as
  `assertLogs` does ("LEVEL:logger:message")."""

  def __enter__(self):
    self.output = []
    root = logging.getLogger()
    self._level = root.level
    root.addHandler(self)
    root.setLevel(logging.INFO)
    return self

  def emit(self, record):
    self.output.append(f"{record.levelname}:{record.name}:"
                       f"{record.getMessage()}")

  def __exit__(self, *exc):
    root = logging.getLogger()
    root.removeHandler(self)
    root.setLevel(self._level)


_PIPELINED = {}


def _pipelined(**changes):
  """`(weights, manifest, model_dir, model, created, log)` of the
  pipelined `tfdist.fit` run with `changes`, run once per process: the
  tests that read one configuration share its run (EqualToUnsplitTest
  its weights, WhereWeightsAreCreatedTest where its variables were made,
  ArtifactsTest its SavedModel, manifest and plan). `model`: the model
  the builder made, trained; `created`: `testutil.VariableCreations`'
  record of the run; `log`: its INFO lines (`_InfoLog`)."""
  key = tuple(sorted(changes.items()))
  if key not in _PIPELINED:
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    with testutil.VariableCreations() as creations, _InfoLog() as log:
      weights, manifest, _ = _fit(model_dir=model_dir, **changes)
    _PIPELINED[key] = (weights, manifest, model_dir, _Built.model,
                       creations.created, log.output)
  return _PIPELINED[key]


def _max_difference(a, b) -> float:
  return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def dict_model():
  """Two named inputs (a dict, given in another order than their names
  sort), concatenated."""
  keras.utils.set_random_seed(1)
  b = keras.Input((8,), name="b_dense")
  a = keras.Input((8,), name="a_dense")
  h = keras.layers.Concatenate(name="cat")([b, a])
  h = keras.layers.Dense(16, activation="tanh", name="block_1")(h)
  h = keras.layers.Dense(16, activation="tanh", name="block_2")(h)
  out = keras.layers.Dense(3, name="logits")(h)
  model = keras.Model({"b_dense": b, "a_dense": a}, out, name="dict_model")
  model.compile(
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  _Built.model = model
  return model


class EqualToUnsplitTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.unsplit, cls.unsplit_manifest = _unsplit()

  # The 1F1B runs are also WhereWeightsAreCreatedTest's (P = 4) and
  # ArtifactsTest's (P = 2 and 4): `_pipelined` runs each once.
  @parameterized.named_parameters(
      ("p2_gpipe", 2, 2, "gpipe"),
      ("p2_1f1b", 2, 4, "1f1b"),
      ("p4_1f1b", 4, 4, "1f1b"),
      ("p4_gpipe", 4, 8, "gpipe"),
      ("p2_v2_interleaved", 2, 4, "interleaved", 2))
  def test_fit_trains_like_one_device(self, stages, micro, schedule,
                                      virtual=1):
    weights, manifest, _, _, _, log = _pipelined(
        pipeline_stages=stages, num_microbatches=micro,
        pipeline_schedule=schedule,
        **(dict(pipeline_virtual_stages=virtual) if virtual > 1 else {}))
    self.assertLess(_max_difference(weights, self.unsplit), TOLERANCE)
    if virtual > 1:
      # A device's activations are all its chunks' at its peak: said once
      # per device, not repeated on each of its chunks' lines.
      plan = "\n".join(log)
      self.assertRegex(plan, r"chunk 2 on \S+: \d+ layer\(s\) .*weight "
                       r"bytes\n")
      self.assertNotRegex(plan, r"chunk \d+ on .*activations")
      self.assertRegex(plan, r"stage 0 on \S+ \(chunks 0, 2\): activations "
                       r"at least \d+ bytes \(\d+ chunk micro-batch\(es\) "
                       r"of \d+ in flight\)")
    self.assertEqual(manifest["pipeline"].get("virtual_stages", 1), virtual)
    self.assertEqual(manifest["final_step"], STEPS)
    self.assertAlmostEqual(manifest["final_metrics"]["train_loss"],
                           self.unsplit_manifest["final_metrics"]["train_loss"],
                           places=5)

  def test_with_accumulation_named_cuts_and_steps_per_execution(self):
    unsplit, _, _ = _fit(gradient_accumulation_steps=2)
    weights, manifest, _ = _fit(
        gradient_accumulation_steps=2, pipeline_stages=3,
        num_microbatches=2, pipeline_cuts="block_2,logits",
        steps_per_execution=2)
    self.assertLess(_max_difference(weights, unsplit), TOLERANCE)
    self.assertEqual(manifest["pipeline"]["cuts"], ["block_2", "logits"])

  @parameterized.parameters("bf16", "fp16")
  def test_mixed_precision_equals_accumulation_over_the_micro_batches(
      self, dtype):
    # Micro-batches of the same size compute the same bf16/fp16
    # activations (fp16: under the same loss scale); against one step on
    # the whole batch they differ by the precision's rounding.
    unsplit, _ = _unsplit(dtype=dtype, gradient_accumulation_steps=4)
    weights, manifest, _ = _fit(dtype=dtype, pipeline_stages=2,
                                num_microbatches=4)
    self.assertLess(_max_difference(weights, unsplit), TOLERANCE)
    if dtype == "fp16":
      self.assertGreater(manifest["loss_scale"], 1.0)

  def test_dict_inputs_and_class_weights(self):
    x = {"b_dense": X, "a_dense": X[::-1].copy()}
    runs = []
    for stages in (1, 2):
      model_dir = os.path.join(testutil.scratch_dir(), "run")
      api.fit(dict_model, x=x, y=Y, verbose=0, config=_config(
          model_dir, class_weight="0:1.0,1:2.0,2:0.5",
          pipeline_stages=stages))
      runs.append(_Built.model.get_weights())
    self.assertLess(_max_difference(*runs), TOLERANCE)

  def test_evaluation_equals_one_device(self):
    metrics = []
    for stages in (1, 2):
      model_dir = os.path.join(testutil.scratch_dir(), "run")
      result = api.fit(skip_model, x=X, y=Y, validation_split=0.25,
                       verbose=0, config=_config(
                           model_dir, mode="train_and_eval",
                           pipeline_stages=stages))
      metrics.append(result["final_metrics"])
    self.assertEqual(metrics[1]["eval_examples"], 16)
    for key in ("eval_loss", "eval_accuracy", "train_loss"):
      self.assertAlmostEqual(metrics[1][key], metrics[0][key], places=5)

  def test_weight_regularizers_are_added_once_per_update(self):
    unsplit, _, _ = _fit(lambda: skip_model(regularize=True))
    weights, _, _ = _fit(lambda: skip_model(regularize=True),
                         pipeline_stages=2)
    self.assertLess(_max_difference(weights, unsplit), TOLERANCE)


def _index(device: str) -> int:
  """The device's index (this process's logical CPU devices)."""
  return tf.DeviceSpec.from_string(device).device_index


def _stage_devices(model):
  """`[(name, shape, device)]` of the model's weights, where they are."""
  return sorted((v.name, tuple(v.shape), v.value.device)
                for v in model.weights)


class WhereWeightsAreCreatedTest(absltest.TestCase):
  """Each stage's weights are created on its device, from their
  initializers, never first on device 0 and copied (the whole model must
  not have to fit one device)."""

  def test_each_weight_is_created_once_on_its_stages_device(self):
    # EqualToUnsplitTest's p4_1f1b run.
    _, _, _, model, created, _ = _pipelined(
        pipeline_stages=4, num_microbatches=4, pipeline_schedule="1f1b")
    placed = _stage_devices(model)
    self.assertEqual(sorted({_index(d) for _, _, d in placed}), [0, 1, 2, 3])
    names = {name for name, _, _ in placed}
    # Every tf.Variable named as a weight (`block_1/kernel` or `kernel`;
    # the optimizer's slots are named after their layer), once each,
    # already on its stage's device: none made on device 0 and copied.
    # (Equal training: EqualToUnsplitTest.)
    self.assertEqual(
        sorted((name.rsplit("/", 1)[-1], shape, device)
               for name, shape, device in created
               if name.rsplit("/", 1)[-1] in names), placed)

  def test_initial_weights_equal_an_unsplit_builds(self):
    options = pipeline_options.PipelineOptions(
        num_stages=4, num_microbatches=4, devices=tuple(DEVICES))
    for builder in (skip_model, dict_model):
      unsplit = builder().get_weights()
      model, deferred = pipeline_step.build_model(builder, options)
      self.assertGreaterEqual(len(deferred), len(model.weights))
      step = pipeline_step.build(model, options, micro_step_batch=BATCH,
                                 deferred=deferred)
      self.assertLen(deferred, 0)
      for stage in step.pipeline.stages:
        for v in stage.weights:
          self.assertEqual(_index(v.value.device), _index(stage.device),
                           v.path)
      for a, b in zip(model.get_weights(), unsplit):
        np.testing.assert_array_equal(a, b)
      # compile's own variables (its loss tracker) have storage too.
      for metric in model.metrics:
        for v in metric.variables:
          self.assertIsNotNone(v.numpy())

  def test_weights_a_builder_assigns_keep_their_values(self):

    def loads_weights():
      model = skip_model()
      model.get_layer("logits").kernel.assign(np.ones((16, 3), "float32"))
      return model

    options = pipeline_options.PipelineOptions(
        num_stages=2, num_microbatches=2, devices=tuple(DEVICES[:2]))
    model, deferred = pipeline_step.build_model(loads_weights, options)
    step = pipeline_step.build(model, options, micro_step_batch=BATCH,
                               deferred=deferred)
    kernel = model.get_layer("logits").kernel
    np.testing.assert_array_equal(kernel.numpy(), np.ones((16, 3)))
    self.assertEqual(_index(kernel.value.device),
                     _index(step.pipeline.stages[-1].device))

  def test_a_builder_that_runs_the_model_is_built_whole_once_more(self):

    def runs_it():
      # Unseeded, auto-named: its seeds and names come from global state.
      x = keras.Input((8,))
      h = keras.layers.Dense(16, activation="tanh")(x)
      model = keras.Model(x, keras.layers.Dense(3)(h))
      model(X[:1])  # Runs it: its weights have no storage yet.
      return model

    options = pipeline_options.PipelineOptions(
        num_stages=2, num_microbatches=2, devices=tuple(DEVICES[:2]))
    keras.utils.set_random_seed(7)
    expected = runs_it()
    keras.utils.set_random_seed(7)
    with self.assertLogs(level="WARNING") as logs:
      model, deferred = pipeline_step.build_model(runs_it, options)
    self.assertIsNone(deferred)
    self.assertRegex("\n".join(logs.output),
                     r"--pipeline_stages=2: the model's builder runs "
                     r"TensorFlow ops on its weights before the model is cut "
                     r"\(InvalidArgumentError: .*it is built again, whole")
    # Auto-named as by one more call (the failed call's names given back):
    # dense_2, dense_3 after dense, dense_1.
    def numbers(m):
      return [int(l.name.rsplit("_", 1)[1]) if "_" in l.name else 0
              for l in m.layers[1:]]
    self.assertEqual(numbers(model), [n + 2 for n in numbers(expected)])
    for a, b in zip(model.get_weights(), expected.get_weights()):
      np.testing.assert_array_equal(a, b)
    step = pipeline_step.build(model, options, micro_step_batch=BATCH)
    self.assertEqual(_index(model.layers[-1].kernel.value.device),
                     _index(step.pipeline.stages[-1].device))


def _resume_in_turn(test, key, runs):
  """Runs `runs`, `[(steps, _fit's changes, manifest["pipeline"][key])]`
  (1 when absent), in one model_dir, each resuming the last's checkpoint
  and training to `steps`: checks they end at the one-device run of the
  last `steps` within `TOLERANCE`, the last resuming from `ckpt-4`.
  Returns the last `(manifest, model_dir)`."""
  straight, _ = _unsplit(train_steps=runs[-1][0])
  model_dir = os.path.join(testutil.scratch_dir(), "run")
  for steps, changes, degree in runs:
    weights, manifest, _ = _fit(model_dir=model_dir, train_steps=steps,
                                **changes)
    test.assertEqual(manifest["final_step"], steps)
    test.assertEqual(manifest.get("pipeline", {}).get(key, 1), degree)
  test.assertIn("ckpt-4", manifest["restored_from"])
  test.assertLess(_max_difference(weights, straight), TOLERANCE)
  return manifest, model_dir


class ArtifactsTest(absltest.TestCase):

  def test_checkpoints_move_between_pipelined_and_unsplit_runs(self):
    # 2 steps in 2 stages, to 4 unsplit, to 6 in 4 stages: one unsplit
    # run of 6 steps.
    _resume_in_turn(self, "stages", [
        (steps, dict(pipeline_stages=stages), stages)
        for steps, stages in ((2, 2), (4, 1), (6, 4))])

  def test_saved_model_is_the_whole_model(self):
    # EqualToUnsplitTest's p4_1f1b run.
    _, _, model_dir, model, _, _ = _pipelined(
        pipeline_stages=4, num_microbatches=4, pipeline_schedule="1f1b")
    loaded = tf.saved_model.load(os.path.join(model_dir, "saved_model"))
    serve = loaded.signatures["serving_default"]
    outputs = list(serve(tf.constant(X[:5])).values())
    self.assertLen(outputs, 1)
    np.testing.assert_allclose(outputs[0].numpy(),
                               model(X[:5]).numpy(), atol=1e-6)

  def test_manifest_and_plan_say_the_pipeline(self):
    # EqualToUnsplitTest's p2_1f1b run.
    _, manifest, model_dir, _, _, log = _pipelined(
        pipeline_stages=2, num_microbatches=4, pipeline_schedule="1f1b")
    self.assertEqual(manifest["pipeline"], {
        "stages": 2, "num_microbatches": 4, "schedule": "1f1b", "cuts": [],
        "batch_norm": "micro-batches"})
    with open(os.path.join(model_dir, "run_manifest.json")) as f:
      written = json.load(f)
    self.assertEqual(written["pipeline"]["stages"], 2)
    stages = manifest["one_device"]["pipeline_stages"]
    # The model state per device is the heaviest stage's, not the model's.
    self.assertEqual(written["memory"]["model"]["parameters_bytes"],
                     max(s["param_bytes"] for s in stages))
    self.assertEqual([s["device"] for s in stages], DEVICES[:2])
    self.assertEqual(sum(len(s["layers"]) for s in stages), 5)
    # Activations at each stage's peak: its layers' float32 outputs per
    # example x 4 examples a micro-batch x the micro-batches 1F1B keeps in
    # flight there (P - s).
    per_example = {"block_1": 64, "block_2": 64, "block_3": 64, "skip": 64,
                   "logits": 12}
    self.assertEqual([s["microbatches_in_flight"] for s in stages], [2, 1])
    self.assertEqual(
        [s["activation_bytes"] for s in stages],
        [sum(per_example[name] for name in s["layers"]) * 4 *
         s["microbatches_in_flight"] for s in stages])
    plan = "\n".join(log)
    self.assertIn("pipeline               2 stages (balanced by weight and "
                  "activation bytes), 4 micro-batches per step, 1f1b "
                  "schedule; batch normalization sees micro-batches of 4 "
                  "examples", plan)
    self.assertIn(f"stage 1 on {DEVICES[1]}", plan)
    self.assertRegex(plan, r"stage 0 on .*activations at least \d+ bytes "
                     r"\(2 micro-batch\(es\) of 4 in flight\)")
    # An unsplit run's manifest has no pipeline entry.
    _, unsplit = _unsplit()
    self.assertNotIn("pipeline", unsplit)


class DataTimesPipelineTest(parameterized.TestCase):
  """D x P = 2 x 2 on the 4 logical CPU devices (`--pipeline_stages=2
  --num_cpu_devices=4`): two copies of a two-stage pipeline, each on half
  of the step's batch, each stage's gradients all-reduced over its data
  group."""

  @parameterized.named_parameters(
      ("adam", {}, {}),  # The default of `_config`.
      # With accumulation over 2 micro-steps (of 8 examples: 2 copies x 2
      # micro-batches of 2), 2 steps a call, 1F1B.
      ("sgd_momentum_accumulating", dict(
          optimizer="momentum", momentum=0.9,
          gradient_accumulation_steps=2),
       dict(steps_per_execution=2, pipeline_schedule="1f1b")))
  def test_equals_one_device(self, optimizer, pipelined):
    unsplit, unsplit_manifest = _unsplit(**optimizer)
    with self.assertLogs(level="INFO") as logs:
      weights, manifest, _ = _fit(pipeline_stages=2, num_cpu_devices=4,
                                  num_microbatches=2, **optimizer,
                                  **pipelined)
    self.assertLess(_max_difference(weights, unsplit), TOLERANCE)
    self.assertAlmostEqual(
        manifest["final_metrics"]["train_loss"],
        unsplit_manifest["final_metrics"]["train_loss"], places=5)
    self.assertEqual(manifest["pipeline"]["data"], 2)
    # Copy 0's stage p on device index(0, p) = p * D.
    self.assertEqual(
        [s["device"] for s in manifest["one_device"]["pipeline_stages"]],
        [DEVICES[0], DEVICES[2]])
    plan = "\n".join(logs.output)
    self.assertIn("pipeline               2 copies (data 2 x pipeline 2, "
                  "each on 1/2 of the batch) of 2 stages", plan)
    self.assertIn("micro-batches of "
                  f"{4 // optimizer.get('gradient_accumulation_steps', 1)} "
                  "examples", plan)
    self.assertIn("mesh: data 2 x pipeline 2 x tensor 1 over 4 devices",
                  plan)
    self.assertRegex(plan, r"/device:CPU:3\s+data 1  pipeline 1  tensor 0")
    self.assertIn("copies 1..1 hold their stage's weights", plan)

  def test_mixed_precision_equals_accumulation_over_the_micro_batches(self):
    # 2 copies x 2 micro-batches of 4 examples: the bf16 activations of
    # one device accumulating over 4 micro-steps of 4.
    unsplit, _ = _unsplit(dtype="bf16", gradient_accumulation_steps=4)
    weights, _, _ = _fit(dtype="bf16", pipeline_stages=2,
                         num_cpu_devices=4, num_microbatches=2)
    self.assertLess(_max_difference(weights, unsplit), TOLERANCE)

  def test_checkpoints_move_to_one_device_and_one_copy(self):
    # 2 steps in 2 x 2, 3 unsplit, 4 in 2 x 2, 6 in one copy of 2 stages:
    # one unsplit run of 6 steps.
    layout = dict(pipeline_stages=2, num_cpu_devices=4)
    _resume_in_turn(self, "data", [(2, layout, 2), (3, {}, 1),
                                   (4, layout, 2),
                                   (6, dict(layout, num_cpu_devices=0), 1)])

  def test_each_copys_weights_live_on_its_devices(self):
    options = pipeline_options.PipelineOptions(
        num_stages=2, num_microbatches=2, devices=tuple(DEVICES), data=2)
    model, deferred = pipeline_step.build_model(skip_model, options)
    step = pipeline_step.build(model, options, micro_step_batch=BATCH,
                               deferred=deferred)
    self.assertEqual([_index(s.device) for s in step.pipeline.stages],
                     [0, 2])
    for stage in step.pipeline.stages:
      for v in stage.weights:
        self.assertEqual(_index(v.value.device), 2 * stage.index)
      mine = step.copies.variables[(1, stage.index)]
      self.assertLen(mine, len(stage.weights))
      for v in mine:
        self.assertEqual(_index(v.device), 2 * stage.index + 1)
    # Stage p's data group: its D copies' devices, p * D + d.
    self.assertEqual(list(step.copies.groups), [(0, 0), (1, 0)])
    self.assertEqual([[_index(d) for d in g.devices]
                      for g in step.copies.groups.values()],
                     [[0, 1], [2, 3]])

  def test_refusals_name_the_flag(self):
    with self.assertRaisesRegex(
        errors.ConfigError, r"--num_cpu_devices=6 devices cannot hold whole "
        r"copies of a --pipeline_stages=4 pipeline.*Use "
        r"--num_cpu_devices=4 or 8"):
      _config("/tmp/unused", pipeline_stages=4, num_cpu_devices=6)
    for changes, message in (
        (dict(num_microbatches=3),
         r"num_microbatches=3 does not divide the step's batch of 8 "
         r"examples of each of the 2 data-parallel copies' share"),
        (dict(num_microbatches=1, batch_size=15),
         r"The data x pipeline mesh's 2 copies .* do not divide the "
         r"step's batch of 15 examples")):
      model_dir = os.path.join(testutil.scratch_dir(), "run")
      with self.assertRaisesRegex(errors.ConfigError, message) as caught:
        _fit(model_dir=model_dir, pipeline_stages=2, num_cpu_devices=4,
             **changes)
      self.assertEqual(errors.exit_code_for(caught.exception), 2)


def _split_map():
  """`skip_model`'s Keras LayoutMap on a batch 1 x model 2 mesh: block_2
  split by columns, block_3 by rows (block_1's output also skips to the
  Add: split by columns, it would need a gather)."""
  mesh = keras.distribution.DeviceMesh(
      (1, 2), ["batch", "model"], devices=["cpu:0", "cpu:1"])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map["block_2/kernel"] = (None, "model")
  layout_map["block_3/kernel"] = ("model", None)
  return layout_map


class PipelineTimesTensorTest(absltest.TestCase):
  """P x T = 2 x 2 on the 4 logical CPU devices (`pipeline_stages=2,
  num_cpu_devices=4` and a layout map splitting block_2 by columns and
  block_3 by rows): each stage's split Dense layers over its 2 devices."""

  def test_checkpoints_move_to_one_device_and_back(self):
    # 2 steps in P x T, 4 on one device, 6 in P x T: one unsplit run of 6
    # steps (Adam: its slots restore across the splits too).
    layout = dict(layout_map=_split_map(), pipeline_stages=2,
                  num_cpu_devices=4)
    with self.assertLogs(level="INFO") as logs:
      manifest, model_dir = _resume_in_turn(
          self, "tensor", [(2, layout, 2), (4, {}, 1), (6, layout, 2)])
    # The plan's mesh, each device with its coordinates; stage p's
    # device index(0, p, 0) = 2 p.
    plan = "\n".join(logs.output)
    self.assertIn("mesh: data 1 x pipeline 2 x tensor 2 over 4 devices",
                  plan)
    self.assertRegex(plan, r"/device:CPU:3\s+data 0  pipeline 1  tensor 1")
    self.assertEqual(
        [s["device"] for s in manifest["one_device"]["pipeline_stages"]],
        [DEVICES[0], DEVICES[2]])
    # Saved under the one-device run's names and shapes.
    def shapes(prefix):
      return tf.train.load_checkpoint(prefix).get_variable_to_shape_map()

    self.assertEqual(
        shapes(tf.train.latest_checkpoint(os.path.join(model_dir,
                                                       "checkpoints"))),
        shapes(manifest["restored_from"]))  # The one-device run's.
    # The SavedModel is the whole model (plain Dense layers) and serves
    # the trained outputs; the model as built holds the trained weights.
    self.assertEqual({type(l).__name__ for l in _Built.model.layers},
                     {"InputLayer", "Dense", "Add"})
    serve = tf.saved_model.load(os.path.join(
        model_dir, "saved_model")).signatures["serving_default"]
    np.testing.assert_allclose(list(serve(tf.constant(X[:5])).values())[0],
                               _Built.model(X[:5]).numpy(), atol=1e-6)


class _Subclassed(keras.Model):

  def __init__(self):
    super().__init__()
    self.a = keras.layers.Dense(4)
    self.b = keras.layers.Dense(3)

  def call(self, x):
    return self.b(self.a(x))


def _subclassed():
  model = _Subclassed()
  model(X[:1])
  model.compile(
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  _Built.model = model
  return model


class _OwnStep(keras.Model):

  def train_step(self, data):
    return super().train_step(data)


def _own_step():
  x = keras.Input((8,))
  model = _OwnStep(x, keras.layers.Dense(3)(keras.layers.Dense(4)(x)))
  model.compile(
      optimizer="sgd",
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  _Built.model = model
  return model


def _two_layers():
  model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4),
                            keras.layers.Dense(3)])
  model.compile(
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  _Built.model = model
  return model


class RefusalTest(absltest.TestCase):

  def _refused(self, message, builder=skip_model, **changes):
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    with self.assertRaisesRegex(errors.ConfigError, message) as caught:
      _fit(builder, model_dir=model_dir, **changes)
    self.assertEqual(errors.exit_code_for(caught.exception), 2)
    # Refused before any step: no checkpoint.
    self.assertIsNone(tf.train.latest_checkpoint(
        os.path.join(model_dir, "checkpoints")))
    return caught.exception

  def test_more_stages_than_layers(self):
    self._refused(r"pipeline_stages=3: num_stages=3 is more than the 2 "
                  r"layer call\(s\)", _two_layers, pipeline_stages=3,
                  num_microbatches=2)
    self._refused(r"num_microbatches=3 \(not given: it defaults to "
                  r"pipeline_stages\) does not divide", _two_layers,
                  pipeline_stages=3)

  def test_more_chunks_than_layers(self):
    self._refused(r"pipeline_stages=2 pipeline_virtual_stages=2: "
                  r"num_stages=2 x virtual_stages=2 = 4 chunks is more than "
                  r"the 2 layer call\(s\)", _two_layers, pipeline_stages=2,
                  pipeline_schedule="interleaved", pipeline_virtual_stages=2,
                  num_microbatches=2)

  def test_more_stages_than_devices(self):
    self._refused(r"pipeline_stages=5 needs 5 logical CPU devices, and "
                  r"TensorFlow already started with 4", pipeline_stages=5)

  def test_microbatches_not_dividing_the_batch(self):
    self._refused(r"num_microbatches=3 does not divide the step's batch "
                  r"of 16 examples .* among \[1, 2, 4, 8, 16\]",
                  pipeline_stages=2, num_microbatches=3)
    self._refused(r"num_microbatches=16 does not divide each of the "
                  r"gradient_accumulation_steps=2 micro-steps' batch of 8",
                  pipeline_stages=2, num_microbatches=16,
                  gradient_accumulation_steps=2)

  def test_model_that_cannot_be_cut(self):
    self._refused(r"pipeline_stages=2: model .* is a subclassed model "
                  r"without a functional graph", _subclassed,
                  pipeline_stages=2)
    self._refused(r"pipeline_cuts=nope: pipeline cut 'nope' is not a "
                  r"layer", pipeline_stages=2, pipeline_cuts="nope")
    self._refused(r"pipeline_stages=2: model .* defines its own step "
                  r"\(_OwnStep.train_step\)", _own_step, pipeline_stages=2)
    self._refused(r"layer 'block_2' has an activity regularizer",
                  lambda: skip_model(activity=True), pipeline_stages=2)


class TransformerTest(absltest.TestCase):

  def test_eight_layers_cut_into_four_stages(self):
    from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
    from tfdist.core import registry  # pylint: disable=g-import-not-at-top
    spec = datasets.get_dataset_spec("clothing_reviews")
    _, build = registry.get_model_builder("transformer")
    model = build(spec, transformer_layers=8)
    names = [layer.name for layer in model.layers]
    self.assertIn("block7_ff_out", names)
    self.assertNotIn("block8_ff_out", names)
    pipe = pipeline.split_model(model, 4, devices=DEVICES)
    self.assertLen(pipe.stages, 4)
    tokens = np.zeros((4, spec.input_shape[0]), np.int64)
    tokens[:, :3] = [2, 3, 4]
    np.testing.assert_allclose(pipe(tokens, training=False).numpy(),
                               model(tokens, training=False).numpy(),
                               atol=1e-5)

  def test_dry_run_plans_four_stages(self):
    # The command of docs/guides/pipeline-parallelism.md and of
    # docs/guides/does-not-fit.md, on a converted subset of the reviews.
    from tfdist.data import clothing_reviews  # pylint: disable=g-import-not-at-top
    out = os.path.join(testutil.scratch_dir(), "clothing_reviews")
    clothing_reviews.convert_clothing_reviews(out, limit=200, train_shards=1,
                                              test_shards=1)
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    config = TrainConfig(
        model_dir=model_dir, model="transformer", dataset="clothing_reviews",
        transformer_layers=8, pipeline_stages=4, num_microbatches=4,
        train_files=os.path.join(out, "train-*.tfrecord.gz"),
        eval_files=os.path.join(out, "test-*.tfrecord.gz"), dry_run=True,
        train_steps=10)
    with self.assertLogs(level="INFO") as logs:
      result = experiment.run_experiment(
          config, environment=environment_lib.read_environment({}))
    self.assertTrue(result["dry_run"])
    self.assertEqual(result["num_replicas_in_sync"], 1)
    self.assertIn("pipeline               4 stages (balanced by weight and "
                  "activation bytes), 4 micro-batches per step, gpipe "
                  "schedule; batch normalization sees micro-batches of 16 "
                  "examples", "\n".join(logs.output))
    self.assertIn("strategy               one_device: auto: "
                  "--pipeline_stages=4 runs its stages in one process",
                  "\n".join(logs.output))
    self.assertFalse(os.path.exists(os.path.join(model_dir, "checkpoints")))


if __name__ == "__main__":
  absltest.main()
