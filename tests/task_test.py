"""Your model, your data: registries, import paths, loss and metrics.

* `tfdist.training.registry` and `tfdist.training.task`: the public decorators, import paths
  and `--import_modules` (a real package written to a scratch folder), and
  the errors that list what is registered;
* no shadowing: a project's own `models/` and `flags.py` (both broken on
  purpose) next to `python -m tfdist.train`, in a subprocess;
* `tfdist.training.step.objectives`: where the loss and metrics come from,
  resolved as Keras's `compile` resolves them;
* the `Trainer` with Keras losses and metrics under one device and
  MirroredStrategy over 2 logical CPUs (a child process: the device split
  must come before TensorFlow starts): evaluation and training values equal
  Keras's own metrics on the whole data;
* `--init_checkpoint` (`assembly.load_init_checkpoint`).
"""

import json
import os
import subprocess
import sys
import textwrap
import uuid

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import testutil
from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.data import input_pipeline
from tfdist.core.dataset_spec import DatasetSpec
from tfdist.training import assembly
from tfdist.training.step import objectives
from tfdist.core import registry
from tfdist.training import task as task_lib


_CHILD_ENV = "TFDIST_TASK_TEST_CHILD"


def _write_package(files: dict) -> str:
  """Writes `{relative path: source}` into a scratch folder on sys.path;
  returns the package name (unique)."""
  root = testutil.scratch_dir()
  name = f"userpkg_{uuid.uuid4().hex[:8]}"
  os.makedirs(os.path.join(root, name))
  with open(os.path.join(root, name, "__init__.py"), "w") as f:
    f.write("")
  for path, source in files.items():
    with open(os.path.join(root, name, path), "w") as f:
      f.write(textwrap.dedent(source))
  sys.path.insert(0, root)
  return name


USER_MODULE = """
    import keras
    import tensorflow as tf
    import tfdist

    def build(spec):
      del spec
      model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      model.compile(loss="mse", metrics=["mae"])
      return model

    def examples(training):
      n = 40 if training else 10
      x = tf.random.stateless_normal([n, 3], seed=[1, 2])
      return tf.data.Dataset.from_tensor_slices((x, tf.reduce_sum(x, 1)))

    @tfdist.register_model("{name}_registered")
    def registered():
      return build(None)

    @tfdist.register_dataset("{name}_data", task=None)
    def registered_data(input_context, training):
      del input_context
      return examples(training)
"""


@pytest.mark.compat  # Also on the oldest TensorFlow.
class RegistryTest(parameterized.TestCase):

  def test_register_model_forms(self):
    name = f"m{uuid.uuid4().hex[:6]}"

    @registry.register_model
    def bare():  # registered under its function name
      return None

    @registry.register_model(name)
    def named(spec):
      return spec

    self.assertIn("bare", registry.model_names())
    self.assertEqual(registry.get_model_builder(name), (name, named))
    # The same function again (a module imported twice) is fine; another
    # function under a taken name is not.
    registry.register_model(name)(named)
    with self.assertRaisesRegex(ValueError, f"{name!r} is already registered"):
      registry.register_model(name)(lambda: None)
    with self.assertRaisesRegex(ValueError, "without ':'"):
      registry.register_model("a:b")(named)

  def test_register_dataset_function_and_spec(self):
    name = f"d{uuid.uuid4().hex[:6]}"

    @registry.register_dataset(name, task="binary")
    def examples(training):
      del training

    spec = registry.get_dataset(name)
    self.assertIs(spec.input_fn, examples)
    self.assertEqual(spec.task, "binary")
    self.assertFalse(spec.reads_files)
    files = DatasetSpec(name=name + "_files", parse_fn=lambda s: s)
    registry.register_dataset(files)
    self.assertIs(registry.get_dataset(name + "_files"), files)

  @parameterized.named_parameters(
      ("model", dict(model="vit"), "--model='vit' is unknown. Registered: "
       ".*cnn.*ranking.*resnet.*--model=my_project.models:build_model"),
      ("dataset", dict(dataset="cifar10"), "--dataset='cifar10' is unknown."
       " Registered: .*fashion_mnist, movielens.*register_dataset"),
  )
  def test_unknown_names_list_what_is_registered(self, changes, message):
    with self.assertRaisesRegex(errors.ConfigError, message):
      config = TrainConfig(model_dir="/tmp/x", train_steps=1, **changes)
      task_lib.from_names(config.task)

  def test_import_paths_and_import_modules(self):
    pkg = _write_package({"mod.py": USER_MODULE.replace("{name}",
                                                        "pathtest")})
    config = TrainConfig(model_dir="/tmp/x", train_steps=1,
                         model=f"{pkg}.mod:build",
                         dataset=f"{pkg}.mod:examples")
    task = task_lib.from_names(config.task)
    self.assertEqual(task.model_name, f"{pkg}.mod:build")
    self.assertEqual(task.dataset.name, f"{pkg}.mod:examples")
    model = task_lib.build_model(task, config)
    self.assertIsInstance(model, keras.Model)
    self.assertEqual(input_pipeline.count_examples(task.dataset), 40)
    features, labels = task_lib.example_spec(task.dataset)
    self.assertEqual((features.shape, labels.shape), ((3,), ()))
    # Registration modules: imported by --import_modules, then by name.
    pkg2 = _write_package({"reg.py": USER_MODULE.replace("{name}", "regtest")})
    config = TrainConfig(
        model_dir="/tmp/x", train_steps=1, model="regtest_registered",
        dataset="regtest_data", import_modules=f"{pkg2}.reg")
    task = task_lib.from_names(config.task)
    self.assertEqual(task.dataset.name, "regtest_data")
    self.assertIn("regtest_registered", registry.model_names())

  def test_names_give_the_task_the_config_names(self):
    config = TrainConfig(model_dir="/tmp/x", train_steps=1, model="cnn",
                         dataset="fashion_mnist")
    names = config.task  # The model and data section, as it is.
    task = task_lib.from_names(names)
    self.assertEqual((task.model_name, task.dataset.name),
                     ("cnn", "fashion_mnist"))
    self.assertEqual(task_lib.dataset_from_names(names).name,
                     "fashion_mnist")

  @parameterized.named_parameters(
      ("no_module", "nosuchpkg_x.mod:build",
       "--model=nosuchpkg_x.mod:build: cannot import nosuchpkg_x.mod \\(no "
       "module named 'nosuchpkg_x'\\)"),
      ("no_attribute", "{pkg}.mod:biuld",
       "module {pkg}.mod has no attribute 'biuld'. It has: build, examples"),
      ("not_a_path", ":build", "is not an import path"),
  )
  def test_bad_import_paths(self, value, message):
    pkg = _write_package({"mod.py": USER_MODULE.replace("{name}",
                                                        "badpath")})
    with self.assertRaisesRegex(
        errors.ConfigError, message.replace("{pkg}", pkg)):
      registry.get_model_builder(value.replace("{pkg}", pkg))
    with self.assertRaisesRegex(
        errors.ConfigError, "--import_modules=nosuchpkg_y"):
      registry.import_modules(["nosuchpkg_y"])

  def test_call_with_accepted(self):
    call = lambda fn: registry.call_with_accepted(
        fn, {"spec": 1, "config": 2}, what="--model=x")
    self.assertEqual(call(lambda: 0), 0)
    self.assertEqual(call(lambda spec: spec), 1)
    self.assertEqual(call(lambda config, spec=None: (config, spec)), (2, 1))
    self.assertEqual(call(lambda **kw: sorted(kw)), ["config", "spec"])
    self.assertEqual(call(lambda spec, width=3: width), 3)
    with self.assertRaisesRegex(errors.ConfigError, "--model=x: .* required "
                                "parameter\\(s\\) units .* only: spec, config"):
      call(lambda units: units)

  def test_builder_must_return_a_model(self):
    task = task_lib.Task(model_fn=lambda: "nope", model_name="x:y",
                         dataset=DatasetSpec(name="d", parse_fn=lambda s: s))
    with self.assertRaisesRegex(
        errors.ConfigError, "--model=x:y returned str, not "
                                "a keras.Model"):
      task_lib.build_model(task, None)

  def test_infinite_dataset_function_is_refused(self):
    spec = DatasetSpec(name="forever", input_fn=lambda: tf.data.Dataset.range(
        3).repeat())
    with self.assertRaisesRegex(
        errors.ConfigError, "infinite dataset: return one "
                                "epoch"):
      input_pipeline.count_examples(spec)
    spec = DatasetSpec(name="eval_forever", input_fn=lambda training: (
        tf.data.Dataset.range(3).repeat(1 if training else -1)))
    self.assertEqual(input_pipeline.count_examples(spec), 3)
    with self.assertRaisesRegex(errors.ConfigError, "infinite evaluation "
                                r"\(training=False\) dataset"):
      input_pipeline.count_examples(spec, training=False)
    spec = DatasetSpec(name="list", input_fn=lambda: [1, 2])
    with self.assertRaisesRegex(errors.ConfigError, "returned list, not a "
                                "tf.data.Dataset"):
      input_pipeline.count_examples(spec)


class NoShadowingTest(absltest.TestCase):
  """A project's own `models/` and `flags.py` beside tfdist's."""

  def _project(self) -> str:
    root = testutil.scratch_dir()
    os.makedirs(os.path.join(root, "models"))
    broken = "raise RuntimeError('the project\\'s own {} was imported')\n"
    with open(os.path.join(root, "models", "__init__.py"), "w") as f:
      f.write(broken.format("models"))
    with open(os.path.join(root, "flags.py"), "w") as f:
      f.write(broken.format("flags.py"))
    return root

  def _run(self, cwd, args, timeout=120):
    env = dict(os.environ, PYTHONPATH=testutil.REPO_ROOT,
               TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)

  def test_binary_and_builtin_models_ignore_the_projects_packages(self):
    project = self._project()
    # One process from the project's folder: first the binary, as
    # `python -m tfdist.train --helpshort` runs it (runpy is what `-m` uses),
    # then the registry, then the project's own package.
    proc = self._run(project, ["-c", textwrap.dedent("""
        import runpy, sys
        sys.argv = ["tfdist.train", "--helpshort"]
        try:
          runpy.run_module("tfdist.train", run_name="__main__", alter_sys=True)
        except SystemExit:
          pass
        print("BINARY DONE", flush=True)
        from tfdist.training import registry, task
        task.load_builtins()
        import tfdist.models, tfdist.flags
        print("MODELS", registry.model_names())
        print("FILES", tfdist.models.__file__, tfdist.flags.__file__)
        import models
        """)])
    binary, _, rest = proc.stdout.partition("BINARY DONE")
    # The binary imports its flags (tfdist.flags), not the project's, and
    # its --helpshort lists the key flags only.
    self.assertNotIn("was imported", binary)
    self.assertIn("Trains a Keras 3 model", binary)
    for name in ("--feature_spec", "--distribution_strategy", "--batch_size",
                 "--dtype", "--model_dir", "--base_learning_rate",
                 "--lr_scaling", "--warmup_steps", "--num_cpu_devices",
                 "--train_files"):
      self.assertIn(name, binary)
    self.assertNotIn("  --piecewise_multipliers:", binary)  # not key
    # tfdist's model registry loads its own models (tfdist.models).
    # ... and the project's own packages are still the project's.
    self.assertIn("MODELS ('cnn', 'ranking', 'resnet', 'transformer')", rest)
    self.assertIn(f"FILES {os.path.join(testutil.REPO_ROOT, 'models')}",
                  rest)
    self.assertIn("RuntimeError: the project's own models was imported",
                  rest)


@pytest.mark.compat  # Also on the oldest TensorFlow.
class ObjectivesTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("binary", [None], [None, 1], keras.metrics.BinaryAccuracy),
      ("sparse", [None], [None, 10], keras.metrics.SparseCategoricalAccuracy),
      ("categorical", [None, 10], [None, 10],
       keras.metrics.CategoricalAccuracy),
  )
  def test_accuracy_resolves_as_compile_does(self, y_true, y_pred, cls):
    metric = objectives.resolve_metric("accuracy",
                                       y_true=tf.TensorShape(y_true),
                                       y_pred=tf.TensorShape(y_pred))
    self.assertIsInstance(metric, cls)
    self.assertEqual(metric.name, "accuracy")

  def test_names_and_functions(self):
    shapes = dict(y_true=tf.TensorShape([None]),
                  y_pred=tf.TensorShape([None, 1]))
    mae = objectives.resolve_metric("mae", **shapes)
    self.assertEqual(mae.name, "mae")
    custom = objectives.resolve_metric(lambda t, p: tf.abs(t - p), **shapes)
    self.assertIsInstance(custom, keras.metrics.MeanMetricWrapper)
    loss = objectives.resolve_loss("crossentropy", **shapes)
    self.assertEqual(loss.name, "binary_crossentropy")
    self.assertIsNone(loss.reduction)
    with self.assertRaisesRegex(
        errors.ConfigError, "loss='nope' is not a Keras "
                                "loss name"):
      objectives.resolve_loss("nope", **shapes)
    with self.assertRaisesRegex(errors.ConfigError, "Losses per output"):
      objectives.resolve_loss({"a": "mse"}, **shapes)

  def test_where_they_come_from(self):
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    compiled = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    auc = keras.metrics.AUC(name="my_auc")
    compiled.compile(loss="mse", metrics=["mae", auc])
    binary = DatasetSpec(name="b", parse_fn=lambda s: s, task="binary")
    bare = DatasetSpec(name="bare", parse_fn=lambda s: s)
    resolve = lambda **kw: objectives.resolve(
        y_true=tf.TensorShape([None]), y_pred=tf.TensorShape([None, 1]), **kw)
    got = resolve(model=compiled, dataset=binary)
    self.assertEqual((got.source, got.loss.name, got.metric_names),
                     ("compile", "mse", ("mae", "my_auc")))
    self.assertIs(got.metrics[1], auc)
    got = resolve(model=compiled, dataset=binary, loss="mae", metrics=[])
    self.assertEqual((got.source, got.metric_names), ("arguments", ()))
    got = resolve(model=plain, dataset=binary)
    self.assertEqual((got.source, got.metric_names),
                     ("task binary", ("accuracy", "auc")))
    with self.assertRaisesRegex(
        errors.ConfigError, "--model=m has no loss: compile "
                                "it .*--dataset=bare has none"):
      resolve(model=plain, dataset=bare, what="--model=m")

  def test_metric_state_must_be_summed(self):

    class Last(keras.metrics.Metric):

      def __init__(self):
        super().__init__(name="last")
        self.value = self.add_variable((), "zeros", aggregation="mean")

      def update_state(self, y_true, y_pred, sample_weight=None):
        self.value.assign(tf.reduce_mean(y_pred))

      def result(self):
        return self.value

    with self.assertRaisesRegex(errors.ConfigError, "Metric 'last' keeps its "
                                "variable .* aggregation='mean'"):
      objectives.MetricSums([Last()])
    with self.assertRaisesRegex(
        errors.ConfigError, "Metric 'auc' sizes its state "
                                "from its first batch"):
      objectives.MetricSums([keras.metrics.AUC(multi_label=True)])


class StrategiesTest(absltest.TestCase):
  """Keras losses and metrics through the Trainer, one device and Mirrored
  (run in a child process that splits the CPU in two first)."""

  def test_values_equal_keras_on_all_the_data(self):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=testutil.REPO_ROOT, **{_CHILD_ENV: "strategies"})
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)],
                          env=env, cwd=testutil.REPO_ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    self.assertTrue(lines, proc.stdout[-4000:])
    result = json.loads(lines[-1][len("RESULT "):])
    reference = result["reference"]
    self.assertEqual(sorted(result["runs"]), ["mirrored", "one_device"])
    for name, run in result["runs"].items():
      self.assertEqual(run["replicas"], 2 if name == "mirrored" else 1)
      self.assertEqual(run["eval"]["num_examples"], 90)
      for key in ("loss", "auc", "mae", "f1"):
        self.assertAlmostEqual(run["eval"][key], reference["eval"][key],
                               places=5, msg=f"{name} eval {key}")
        self.assertAlmostEqual(run["train"][key], reference["train"][key],
                               places=5, msg=f"{name} train {key}")


def _child_strategies() -> dict:
  """Evaluates and trains (learning rate 0) a multi-label model with a
  custom per-element loss and Keras metrics; the references are Keras's own
  stateful metrics and loss on the same examples in one batch."""
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
  from tfdist.training.step.train_loop import Trainer  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(0)
  x = rng.normal(size=(90, 5)).astype(np.float32)
  y = (rng.rand(90, 3) > 0.5).astype(np.float32)
  init = [rng.normal(size=(5, 3)).astype(np.float32),
          rng.normal(size=(3,)).astype(np.float32)]

  def per_element_loss(y_true, y_pred):  # [batch, 3]: tfdist averages axis 1
    return tf.square(y_true - y_pred)

  def make_metrics():
    return [keras.metrics.AUC(multi_label=True, name="auc"),
            keras.metrics.MeanAbsoluteError(name="mae"),
            keras.metrics.F1Score(average="micro", threshold=0.5, name="f1")]

  def build():
    model = keras.Sequential([keras.Input((5,)),
                              keras.layers.Dense(3, activation="sigmoid")])
    model.set_weights(init)
    return model

  def values(metrics, y_true, y_pred):
    out = {}
    for m in metrics:
      m.update_state(y_true, y_pred)
      out[m.name] = float(np.mean(m.result()))
    return out

  reference = {}
  predictions = build()(x).numpy()
  reference["eval"] = {"loss": float(np.mean((y - predictions) ** 2)),
                       **values(make_metrics(), y, predictions)}
  # Training: 2 steps of 40 (SGD at rate 0 keeps the weights).
  reference["train"] = {"loss": float(np.mean((y[:80] - predictions[:80])
                                              ** 2)),
                        **values(make_metrics(), y[:80], predictions[:80])}
  runs = {}
  for name, strategy in (
      ("one_device", tf.distribute.OneDeviceStrategy("/cpu:0")),
      ("mirrored", tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))):
    with strategy.scope():
      model = build()
      optimizer = keras.optimizers.SGD(0.0)
      optimizer.build(model.trainable_variables)
    sums = objectives.MetricSums(
        make_metrics(), y_true=tf.TensorSpec([None, 3]),
        y_pred=tf.TensorSpec([None, 3]))
    trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                      global_batch_size=40, loss=per_element_loss,
                      metrics=sums, steps_per_execution=2)
    data = tf.data.Dataset.from_tensor_slices((x, y))
    eval_ds = input_pipeline.distribute(
        strategy, input_pipeline.options_for(
            DatasetSpec(name="arrays", input_fn=lambda: data),
            global_batch_size=40, is_training=False, cache=False))
    train_ds = strategy.experimental_distribute_dataset(data.batch(40))
    totals = trainer.train_function(iter(train_ds), tf.constant(2))
    runs[name] = {
        "replicas": strategy.num_replicas_in_sync,
        "eval": trainer.evaluate(eval_ds),
        "train": trainer.summarize(
            {k: np.asarray(v, np.float64) for k, v in totals.items()}, 2)}
  return {"reference": reference, "runs": runs}


@pytest.mark.compat  # Also on the oldest TensorFlow.
class InitCheckpointTest(absltest.TestCase):

  def _model(self, head: int = 2, seed: int = 0, extra: bool = False):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    x = keras.layers.Dense(8, name="body")(inputs)
    x = keras.layers.Dense(head, name="head")(x)
    if extra:
      x = keras.layers.Dense(3, name="extra")(x)
    return keras.Model(inputs, x)

  def test_loads_prefix_folder_and_weights_file(self):
    source = self._model(seed=1)
    folder = testutil.scratch_dir()
    prefix = tf.train.Checkpoint(model=source).save(
        os.path.join(folder, "checkpoints", "ckpt"))
    weights = os.path.join(folder, "model.weights.h5")
    source.save_weights(weights)
    for path in (prefix, folder, os.path.join(folder, "checkpoints"),
                 weights):
      target = self._model(seed=2)
      assembly.load_init_checkpoint(target, path)
      for a, b in zip(source.get_weights(), target.get_weights()):
        np.testing.assert_array_equal(a, b)

  def test_loads_a_tfdist_training_checkpoint(self):
    # What tfdist.training.assembly saves: model, optimizer (built over the model's
    # variables, so they are saved under its path) and the global step.
    source = self._model(seed=1)
    optimizer = keras.optimizers.Adam(0.1)
    optimizer.build(source.trainable_variables)
    prefix = tf.train.Checkpoint(
        model=source, optimizer=optimizer,
        global_step=tf.Variable(7, dtype=tf.int64)).save(
            os.path.join(testutil.scratch_dir(), "ckpt"))
    target = self._model(seed=2)
    target.compile(loss="mse")  # An optimizer of its own (RMSprop).
    assembly.load_init_checkpoint(target, prefix)
    for a, b in zip(source.get_weights(), target.get_weights()):
      np.testing.assert_array_equal(a, b)

  def test_partial_match_loads_the_rest_keeps_its_values(self):
    source = self._model(seed=1)
    prefix = tf.train.Checkpoint(model=source).save(
        os.path.join(testutil.scratch_dir(), "ckpt"))
    target = self._model(seed=2, extra=True)  # A layer added: fine-tuning.
    extra_before = target.get_layer("extra").get_weights()[0].copy()
    with self.assertLogs(level="WARNING") as logs:
      assembly.load_init_checkpoint(target, prefix)
    self.assertTrue(any("matches the model only in part" in line
                        for line in logs.output), logs.output)
    for name in ("body", "head"):
      np.testing.assert_array_equal(target.get_layer(name).get_weights()[0],
                                    source.get_layer(name).get_weights()[0])
    np.testing.assert_array_equal(target.get_layer("extra").get_weights()[0],
                                  extra_before)

  def test_errors(self):
    with self.assertRaisesRegex(errors.ConfigError, "no checkpoint there"):
      assembly.load_init_checkpoint(self._model(), "/no/such/ckpt-3")
    with self.assertRaisesRegex(
        errors.ConfigError, "folder without checkpoints"):
      assembly.load_init_checkpoint(self._model(), testutil.scratch_dir())
    other = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    prefix = tf.train.Checkpoint(step=tf.Variable(3)).save(
        os.path.join(testutil.scratch_dir(), "ckpt"))
    with self.assertRaisesRegex(errors.ConfigError, "holds no model"):
      assembly.load_init_checkpoint(other, prefix)
    prefix = tf.train.Checkpoint(model=self._model(seed=1)).save(
        os.path.join(testutil.scratch_dir(), "ckpt"))
    with self.assertRaisesRegex(errors.ConfigError, "does not fit the model: "
                                "Received incompatible tensor with shape "
                                "\\(8, 2\\)"):
      assembly.load_init_checkpoint(self._model(head=5), prefix)


if __name__ == "__main__":
  if os.environ.get(_CHILD_ENV) == "strategies":
    print("RESULT " + json.dumps(_child_strategies()), flush=True)
  else:
    absltest.main()
