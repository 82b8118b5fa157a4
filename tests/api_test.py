"""`tfdist.fit`'s argument checks and in-memory data (tfdist/api.py).

Cheap: the checks stop before a model is built; one tiny one-device fit
of a few steps checks what `fit` returns.
"""

import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

from absl.testing import absltest
import keras
import numpy as np
import tensorflow as tf

from tests import conformance_table
from tests import testutil
from tfdist import api
from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.data import input_pipeline
from tfdist.training.state import checkpointing


def _context(pipelines: int = 1, pipeline: int = 0):
  return tf.distribute.InputContext(num_input_pipelines=pipelines,
                                    input_pipeline_id=pipeline)


def _rows(dataset) -> list:
  return [tuple(np.asarray(t).tolist() for t in tf.nest.flatten(example))
          for example in dataset.as_numpy_iterator()]


def _model():
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  model.compile(loss="mse")
  return model


class InMemoryDatasetTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.x = np.arange(20, dtype=np.float32).reshape(10, 2)
    self.y = np.arange(10, dtype=np.float32)

  def test_validation_split_keeps_the_last_rows(self):
    input_fn, has_validation = api.in_memory_dataset(
        x=self.x, y=self.y, validation_split=0.2)
    self.assertTrue(has_validation)
    train = _rows(input_fn(True, _context()))
    validation = _rows(input_fn(False, _context()))
    self.assertLen(train, 8)
    self.assertEqual([y for _, y in validation], [8.0, 9.0])

  def test_pipelines_read_disjoint_shares(self):
    input_fn, _ = api.in_memory_dataset(x=self.x, y=self.y)
    shares = [[y for _, y in _rows(input_fn(True, _context(3, i)))]
              for i in range(3)]
    self.assertEqual(shares[1], [1.0, 4.0, 7.0])
    self.assertEqual(sorted(sum(shares, [])), self.y.tolist())

  def test_without_validation_the_eval_split_is_the_arrays(self):
    input_fn, has_validation = api.in_memory_dataset(x=self.x, y=self.y)
    self.assertFalse(has_validation)
    self.assertLen(_rows(input_fn(False, _context())), 10)

  def test_validation_arrays_and_a_dataset_function(self):
    input_fn, has_validation = api.in_memory_dataset(
        dataset_fn=lambda training: tf.data.Dataset.range(6),
        validation_data=(self.x[:3], self.y[:3]))
    self.assertTrue(has_validation)
    self.assertEqual(
        list(input_fn(True, _context(2, 0)).as_numpy_iterator()), [0, 2, 4])
    self.assertLen(_rows(input_fn(False, _context())), 3)
    # Sharded as tfdist shards it: its epochs align to steps (a resumed run
    # continues its epoch). One that shards itself is left alone.
    self.assertTrue(getattr(input_fn, input_pipeline.SHARDS_BY_EXAMPLE,
                            False))
    input_fn, _ = api.in_memory_dataset(
        dataset_fn=lambda training, input_context: tf.data.Dataset.range(6),
        validation_data=(self.x[:3], self.y[:3]))
    self.assertFalse(getattr(input_fn, input_pipeline.SHARDS_BY_EXAMPLE,
                             False))

  def test_the_checks(self):
    for kwargs, message in (
        (dict(x=self.x, y=self.y, validation_split=1.0),
         r"validation_split=1\.0 must be in \(0, 1\)"),
        (dict(y=self.y), "y or sample_weight given without x"),
        (dict(dataset_fn=lambda: None, validation_split=0.5),
         "validation_split=0.5 is only for arrays"),
        (dict(x=self.x, y=self.y[:4]),
         "x has 10 rows, y has 4 rows"),
        (dict(x=self.x, y=self.y, validation_data=(self.x,)),
         "validation_data must be a tuple .* received tuple of 1 entries"),
        (dict(x=self.x, y=self.y, validation_data="data"),
         "validation_data must be a tuple .* received str\\."),
        (dict(x=self.x[:1], y=self.y[:1], validation_split=0.5),
         "leaves 0 for training and 1 for evaluation"),
        (dict(x=np.float32(1.0)), "holds a scalar")):
      with self.subTest(message=message):
        with self.assertRaisesRegex(errors.ConfigError, message):
          api.in_memory_dataset(**kwargs)


# A script's fits (`build`, `fit(verbose, folder)`: 4 steps, a line every
# 2; `fit_4_epochs(folder)`: verbose="auto", 6 steps an epoch, a line every
# 12 steps, a checkpoint and an evaluation every epoch).
_FIT_SCRIPT = textwrap.dedent("""
    import logging
    import sys
    from absl import logging as absl_logging
    import keras
    import numpy as np
    import tfdist

    def build():
      model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
      model.compile(loss="mse", metrics=["mae"])
      return model

    def fit(verbose, folder):
      x, y = np.ones((32, 2), np.float32), np.ones((32,), np.float32)
      tfdist.fit(build, x=x, y=y, verbose=verbose, validation_split=0.25,
                 config=tfdist.TrainConfig(
                     model_dir=folder, train_steps=4, batch_size=4,
                     log_steps=2, distribution_strategy="one_device"))

    def fit_4_epochs(folder):
      x = np.ones((32, 2), np.float32)
      tfdist.fit(build, x=x, y=x.sum(axis=1), validation_split=0.25,
                 config=tfdist.TrainConfig(
                     model_dir=folder, train_epochs=4, batch_size=4,
                     log_steps=12, distribution_strategy="one_device"))
    """)
# The plain script (no absl.app.run, stdout and stderr pipes): each part
# of its stderr begins with a "=== NAME" line. Its last part is
# PythonInputsTest's Mirrored runs (2 logical CPUs, set after `import
# tfdist` and before TensorFlow's runtime starts; the other runs name
# one_device), printed as a "RESULT " line.
_PLAIN_SCRIPT = textwrap.dedent("""
    import json
    import tfdist
    from tfdist.distribute import devices
    devices.configure_cpu_devices(2)
    """) + _FIT_SCRIPT + textwrap.dedent("""
    for verbose, folder in ((0, sys.argv[1]), ("auto", sys.argv[2])):
      print(f"=== {'quiet' if verbose == 0 else 'auto'}", file=sys.stderr,
            flush=True)
      fit(verbose, folder)
    print("=== pipe", file=sys.stderr, flush=True)
    fit_4_epochs(sys.argv[4])
    print("=== after", file=sys.stderr, flush=True)
    absl_logging.info("hidden after the call")
    # A script that logs at INFO itself: its lines, and tfdist's once.
    logging.basicConfig(level=logging.INFO, force=True)
    print("=== basic", file=sys.stderr, flush=True)
    fit("auto", sys.argv[3])
    absl_logging.info("still shown after the export")
    print("=== done", file=sys.stderr, flush=True)
    from tests import api_test
    x, y = np.ones((16, 2), np.float32), np.ones((16,), np.float32)
    result = tfdist.fit(
        api_test._model, x=api_test._Batches(x, y),
        validation_data=api_test._batches(x[:8], y[:8]), verbose=0,
        config=tfdist.TrainConfig(
            model_dir=sys.argv[5], train_steps=8, batch_size=4,
            log_steps=4, distribution_strategy="mirrored",
            num_cpu_devices=2))
    x, y = api_test._python_inputs_data()
    print("RESULT " + json.dumps(
        [result["strategy"], result["final_step"],
         sorted(result["history"]),
         api_test._fit_python_inputs(x, y, sys.argv[5] + "-fit",
                                     "mirrored")]))
    """)
_PLAIN_RUN = {}


def _script_env() -> dict:
  return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
          "PYTHONPATH": os.pathsep.join(
              [testutil.REPO_ROOT, os.environ.get("PYTHONPATH", "")])}


def _plain_script_run(folder: str) -> dict:
  """`_PLAIN_SCRIPT`'s run in `folder`, once per test process (its
  verbose=0, "auto", 4-epoch "auto" and after-basicConfig fits, then
  PythonInputsTest's Mirrored runs, in one process): {"stdout": text,
  "stderr": {part name: text}, "mirrored": the RESULT line's value}."""
  if not _PLAIN_RUN:
    folder = tempfile.mkdtemp(dir=folder)
    run = subprocess.run(
        [sys.executable, "-c", _PLAIN_SCRIPT,
         *(os.path.join(folder, name)
           for name in ("quiet", "auto", "basic", "pipe", "mirrored"))],
        cwd=folder, capture_output=True, text=True, timeout=300,
        check=False, env=_script_env())
    if run.returncode:
      raise AssertionError(f"the script failed ({run.returncode}):\n"
                           f"{run.stderr[-3000:]}")
    parts = {"start": run.stderr.split("=== ", 1)[0]}
    for text in run.stderr.split("=== ")[1:]:
      name, _, rest = text.partition("\n")
      parts[name] = rest
    _PLAIN_RUN.update(stdout=run.stdout, stderr=parts, mirrored=json.loads(
        run.stdout.split("RESULT ", 1)[1]))
  return _PLAIN_RUN


class FitTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
    self.config = TrainConfig(model_dir=self.dir, train_steps=4,
                              batch_size=4, log_steps=2,
                              distribution_strategy="one_device",
                              optimizer="sgd", base_learning_rate=0.01,
                              base_batch_size=4, warmup_steps=0)
    self.x = np.ones((16, 2), np.float32)
    self.y = np.ones((16,), np.float32)

  def test_argument_checks_stop_before_training(self):
    for kwargs, message in (
        (dict(x=self.x, y=self.y,
              dataset_fn=lambda training: tf.data.Dataset.range(1)),
         "Pass the examples once"),
        (dict(x=self.x, y=self.y, parse_fn=lambda r: r),
         "parse_fn and config.feature_spec read"),
        (dict(dataset_fn="fashion_mnist", validation_split=0.1),
         "need dataset_fn to be a function"),
        (dict(dataset_fn=lambda training: None, parse_fn=lambda r: r),
         "Pass one source of data")):
      with self.subTest(message=message):
        with self.assertRaisesRegex(errors.ConfigError, message):
          api.fit(_model, config=self.config, **kwargs)
    with self.assertRaisesRegex(
        errors.ConfigError, "model_fn must be a function"):
      api.fit(3, x=self.x, y=self.y, config=self.config)
    with self.assertRaisesRegex(errors.ConfigError, r"verbose='yes'\): use"):
      api.fit(_model, x=self.x, y=self.y, config=self.config, verbose="yes")

  def test_keras_epochs_and_batch_size_set_the_configs_fields(self):
    config = self.config.replace(train_steps=0, batch_size=None)
    result = api.fit(_model, x=self.x, y=self.y, epochs=2, batch_size=8,
                     config=config)
    self.assertEqual(result["final_step"], 4)  # 16 examples, 2 epochs of 8.
    self.assertLen(result["history"]["loss"], 2)

  def test_keras_epochs_and_batch_size_conflicts_are_refused(self):
    for kwargs, config, message in (
        (dict(epochs=2), self.config,
         r"fit\(epochs=2\) and TrainConfig\(train_steps=4\) both set how "
         r"long to train: drop one \(train_steps=0 lets epochs decide\)"),
        (dict(epochs=2), self.config.replace(train_steps=0, train_epochs=3),
         r"fit\(epochs=2\) and TrainConfig\(train_epochs=3\) disagree"),
        (dict(batch_size=8), self.config,
         r"fit\(batch_size=8\) and TrainConfig\(batch_size=4\) disagree"),
        (dict(batch_size=8), self.config.replace(
            batch_size=None, per_replica_batch_size=2),
         r"fit\(batch_size=8\) is the global batch, and TrainConfig\("
         r"per_replica_batch_size=2\) sets it per replica"),
        (dict(epochs=0), self.config, r"fit\(epochs=0\): epochs must be an "
         "integer >= 1"),
        (dict(batch_size=2.5), self.config,
         r"fit\(batch_size=2.5\): batch_size must be an integer >= 1")):
      with self.subTest(message=message):
        with self.assertRaisesRegex(errors.ConfigError, message):
          api.fit(_model, x=self.x, y=self.y, config=config, **kwargs)
    # The same values as the config's are no conflict.
    self.assertEqual(api.with_keras_length(self.config, batch_size=4),
                     self.config)
  def _fit_script(self, folder: str) -> tuple:
    """Runs `_FIT_SCRIPT` (a 4-epoch `tfdist.fit(verbose="auto")`) with
    stdout a pseudo-terminal; returns (stdout, stderr)."""
    command = [sys.executable, "-c",
               _FIT_SCRIPT + "fit_4_epochs(sys.argv[1])",
               os.path.join(self.dir, folder)]
    main, child = pty.openpty()
    with tempfile.TemporaryFile() as stderr:
      proc = subprocess.Popen(command, cwd=self.dir, stdout=child,
                              stderr=stderr, env=_script_env())
      os.close(child)
      stdout, deadline = b"", time.time() + 300
      while time.time() < deadline:
        if select.select([main], [], [], 1.0)[0]:
          try:
            chunk = os.read(main, 65536)
          except OSError:  # EIO: the child closed the terminal.
            break
          if not chunk:
            break
          stdout += chunk
        elif proc.poll() is not None:
          break
      os.close(main)
      if proc.poll() is None:
        proc.kill()
      returncode = proc.wait(timeout=60)
      stderr.seek(0)
      err = stderr.read().decode(errors="replace")
    self.assertEqual(returncode, 0, err[-3000:])
    return stdout.decode(errors="replace"), err

  def test_a_terminal_gets_kerass_progress_bar_and_a_pipe_log_lines(self):
    stdout, stderr = self._fit_script("terminal")
    # keras.utils.Progbar's bar, one per epoch, as fit(verbose=1) shows it,
    # with the epoch's validation values; tfdist's step and evaluation lines
    # (which the bar repeats) are left out, its other lines stay.
    for epoch in range(1, 5):
      self.assertIn(f"Epoch {epoch}/4", stdout)
    self.assertIn("\u2501", stdout)  # The bar.
    self.assertRegex(stdout, r"6/6\S* \S*\u2501+.* - loss: \d.* - val_loss: ")
    self.assertNotRegex(stderr, r"tfdist: epoch \d|held-out evaluation")
    self.assertIn("tfdist plan:", stderr)

    # The same fit with stdout a pipe: the plain script's (one process).
    run = _plain_script_run(self.dir)
    stdout, stderr = run["stdout"], run["stderr"]["pipe"]
    self.assertNotIn("\u2501", stdout)
    self.assertIn("Final eval: ", stdout)
    # One line for each epoch, counted from 1, each with its evaluation; a
    # step line's ETA.
    progress_lines = re.findall(r"tfdist: epoch \d/4, .*", stderr)
    self.assertEqual([re.match(r"tfdist: epoch (\d)", l)[1]
                      for l in progress_lines], ["1", "2", "3", "4"],
                     stderr[-3000:])
    for line in progress_lines:
      self.assertRegex(line, r"held-out evaluation at step \d+: loss ")
    self.assertRegex(progress_lines[1], r"^tfdist: epoch 2/4, step 12/24: "
                     r"loss .*, ETA \d+s; held-out evaluation at step 12: ")
    # A short run's checkpoints do not bury its progress.
    self.assertLess(stderr.count("Saved checkpoint"), len(progress_lines),
                    stderr[-3000:])

  def test_a_plain_script_prints_tfdist_lines_unless_verbose_is_0(self):
    # A script without absl.app.run: absl's logging is not set up there.
    run = _plain_script_run(self.dir)
    parts = run["stderr"]
    self.assertNotRegex(parts["quiet"], r"tfdist: (epoch \d+/\d+, )?step")
    self.assertRegex(parts["auto"], r"tfdist: epoch 1/1, step 2/4: loss \d")
    self.assertEqual(parts["auto"].count("tfdist: epoch 1/1, step 2/4"), 1)
    # In the caller's terms, as the errors: the fields it set, not flags.
    self.assertIn("model=__main__:", parts["auto"])
    self.assertNotRegex(parts["auto"], r"--(model|dataset|batch_size)\b")
    # TensorFlow's own INFO lines stay hidden.
    self.assertNotIn("Sharding callback", parts["auto"])
    # Logging is as it was after the call.
    self.assertNotIn("hidden after the call", parts["after"])
    self.assertEqual(parts["basic"].count("tfdist: epoch 1/1, step 2/4"), 1)
    self.assertIn("still shown after the export", parts["basic"])
    # The final evaluation on stdout, except with verbose=0 (and the
    # 4-epoch pipe run's).
    self.assertEqual(run["stdout"].count("Final eval: "), 3, run["stdout"])

  def test_the_callers_dtype_policy_is_back_after_a_mixed_precision_fit(self):
    before = keras.mixed_precision.global_policy().name
    result = api.fit(_model, x=self.x, y=self.y,
                     config=self.config.replace(dtype="bf16"))
    self.assertEqual(result["dtype_policy"], "mixed_bfloat16")
    # As after `Model.fit`: a layer the script builds next has its usual
    # dtype.
    self.assertEqual(keras.mixed_precision.global_policy().name, before)
    self.assertEqual(keras.layers.Dense(2).dtype_policy.name, before)

  def test_resuming_with_another_optimizer_is_refused_and_keeps_the_record(
      self):
    api.fit(_model, x=self.x, y=self.y,
            config=self.config.replace(optimizer="sgd"), verbose=0)
    checkpoints = os.path.join(self.dir, "checkpoints")
    with self.assertRaisesRegex(
        errors.IncompatibleResumeError,
        r"\(optimizer sgd -> adam\).*with init_checkpoint="):
      api.fit(_model, x=self.x, y=self.y,
              config=self.config.replace(optimizer="adam", train_steps=6),
              verbose=0)
    # The record still describes the run that wrote the checkpoints.
    self.assertEqual(checkpointing.read_run_record(checkpoints)["config"]
                     ["optimizer"], "sgd")

  def test_a_tiny_fit_returns_the_manifest_and_history(self):
    result = api.fit(_model, x=self.x, y=self.y, config=self.config)
    self.assertEqual(result["final_step"], 4)
    self.assertEqual(result["strategy"], "one_device")
    self.assertEqual(result["data"]["dataset"], "arrays")
    self.assertIn("loss", result["history"])
    self.assertTrue(all(isinstance(v, float)
                        for v in result["history"]["loss"]))
    # Nothing that does not apply: no batch norm, no AUC, no evaluation.
    self.assertNotIn("sync_batch_norm", result)
    self.assertEqual(set(result["final_metrics"]), {"train_loss"})



class _Batches(keras.utils.PyDataset):
  """`x`, `y` in batches of 3 (the last one shorter), counting the passes."""

  def __init__(self, x, y, size=3):
    super().__init__()
    self.x, self.y, self.size = x, y, size
    self.passes = 0

  def __len__(self):
    return -(-len(self.x) // self.size)

  def __getitem__(self, index):
    rows = slice(index * self.size, (index + 1) * self.size)
    return self.x[rows], self.y[rows]

  def on_epoch_end(self):
    self.passes += 1


def _batches(x, y, size=3):
  for start in range(0, len(x), size):
    yield x[start:start + size], y[start:start + size]


_RATE = 0.05
_FIT_CELL = ("works (the weights and losses of `Model.fit` on the same "
             "batches)")
_WORKERS_CELL = ("refused at start (only the script's process can read it; "
                 "the error shows the dataset-function form)")


def _zero_model(optimizer=None):
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(
      1, kernel_initializer="zeros")])
  model.compile(loss="mse", optimizer=optimizer)
  return model


def _two_workers():
  """The environment of worker 0 of two (nothing listens at the ports)."""
  from tfdist.distribute import environment as environment_lib  # pylint: disable=g-import-not-at-top
  return environment_lib.read_environment({"TF_CONFIG": json.dumps(
      {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
       "task": {"type": "worker", "index": 0}})})


def _python_inputs_data():
  """PythonInputsTest's `(x, y)`: float32 [16, 2] and [16], seeded."""
  rng = np.random.default_rng(5)
  return (rng.normal(size=(16, 2)).astype(np.float32),
          rng.normal(size=(16,)).astype(np.float32))


def _fit_python_inputs(x, y, model_dir: str, strategy: str) -> dict:
  """`tfdist.fit` of `_zero_model` on `_Batches(x, y)` and on `_batches(x,
  y)` (batches of 3, rebatched to 4), 2 epochs in order (no shuffling),
  plain SGD: `{"py_dataset" | "generator": {"weights", "loss"}}`."""
  import tfdist  # pylint: disable=g-import-not-at-top
  out = {}
  for name, data in (("py_dataset", _Batches(x, y)),
                     ("generator", _batches(x, y))):
    built = []

    def model_fn():
      built.append(_zero_model())
      return built[-1]
    result = tfdist.fit(model_fn, x=data, verbose=0, config=TrainConfig(
        model_dir=f"{model_dir}-{name}", train_epochs=2, batch_size=4,
        base_batch_size=4, optimizer="sgd", momentum=0.0,
        base_learning_rate=_RATE, warmup_steps=0, lr_schedule="constant",
        shuffle_buffer_size=0, log_steps=1000, mode="train",
        distribution_strategy=strategy))
    out[name] = {"weights": [w.tolist() for w in built[-1].get_weights()],
                 "loss": result["history"]["loss"]}
  return out


class PythonInputsTest(absltest.TestCase):
  """`tfdist.fit(x=PyDataset | generator | iterator)` (tfdist.data.python_inputs)."""

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
    self.x, self.y = _python_inputs_data()

  def _config(self, name, **overrides):
    fields = dict(model_dir=os.path.join(self.dir, name), train_steps=8,
                  batch_size=4, log_steps=4, distribution_strategy="one_device",
                  optimizer="sgd", base_learning_rate=0.05, base_batch_size=4,
                  warmup_steps=0, seed=3)
    fields.update(overrides)
    return TrainConfig(**fields)

  def test_py_dataset_examples_are_its_batches_split(self):
    from tfdist.data import python_inputs  # pylint: disable=g-import-not-at-top
    data = _Batches(self.x, self.y)
    fn = python_inputs.py_dataset_function(data, name="x")
    rows = _rows(fn())
    self.assertEqual(rows, _rows(tf.data.Dataset.from_tensor_slices(
        (self.x, self.y))))
    self.assertEqual(data.passes, 1)
    self.assertEqual(fn.__qualname__, "_Batches")
    x, y = python_inputs.generator_arrays(_batches(self.x, self.y), name="x")
    np.testing.assert_array_equal(x, self.x)
    np.testing.assert_array_equal(y, self.y)

  def test_bad_batches_are_named(self):
    from tfdist.data import python_inputs  # pylint: disable=g-import-not-at-top
    for value, message in (
        (iter([self.x]), r"batch 0 of tfdist.fit\(x=...\)'s an iterator "
         r"\(list_iterator\) is ndarray; training needs batches \(x, y\)"),
        (iter([]), "yielded no batch"),
        ((b for b in [(self.x, self.y[:3])]), "different numbers of rows"),
        (iter([(self.x, 1.0)]), "holds a scalar")):
      with self.subTest(message=message):
        with self.assertRaisesRegex(errors.ConfigError, message):
          python_inputs.generator_arrays(value, name="x")
    with self.assertRaisesRegex(errors.ConfigError, "more than 100 bytes in 1 "
                                "batches: a generator cannot be rewound"):
      python_inputs.generator_arrays(_batches(self.x, self.y, 16), name="x",
                                     max_bytes=100)

  def test_py_dataset_and_generator_train_as_the_arrays_do(self):
    # Before: a NumPy traceback from api._leaves (PyDataset) and "x holds a
    # scalar" (a generator).
    arrays = api.fit(_model, x=self.x, y=self.y, config=self._config("a"),
                     verbose=0)
    data = _Batches(self.x, self.y)
    py_dataset = api.fit(_model, x=data, validation_data=_batches(
        self.x[:8], self.y[:8]), config=self._config("p"), verbose=0)
    generator = api.fit(_model, x=_batches(self.x, self.y),
                        config=self._config("g"), verbose=0)
    # The same examples in the same seeded order: the same losses.
    for result in (py_dataset, generator):
      np.testing.assert_allclose(result["history"]["loss"],
                                 arrays["history"]["loss"], rtol=1e-5)
    self.assertEqual(py_dataset["data"]["dataset"], "__main__:_Batches"
                     if _Batches.__module__ == "__main__" else
                     f"{_Batches.__module__}:_Batches")
    self.assertIn("val_loss", py_dataset["history"])
    self.assertNotIn("val_loss", generator["history"])
    # One pass to count, one to fill the cache.
    self.assertEqual(data.passes, 2)

  def test_a_py_dataset_without_validation_data_trains_and_evaluates(self):
    # Before: "object of type 'NoneType' has no len()" (the evaluation
    # split of a PyDataset without validation data was taken for arrays).
    for mode in ("train", "train_and_eval"):
      with self.subTest(mode=mode):
        result = api.fit(_model, x=_Batches(self.x, self.y),
                         config=self._config(f"nv_{mode}", mode=mode),
                         verbose=0)
        self.assertEqual(result["final_step"], 8)

  def _keras_fit(self) -> dict:
    """`Model.fit` of `_zero_model` on `_Batches(self.x, self.y, 4)` (the
    batches tfdist makes at --batch_size=4), 2 epochs, not shuffled."""
    model = _zero_model(keras.optimizers.SGD(_RATE))
    history = model.fit(_Batches(self.x, self.y, 4), epochs=2, shuffle=False,
                        verbose=0)
    return {"weights": [w.tolist() for w in model.get_weights()],
            "loss": [float(v) for v in history.history["loss"]]}

  def _check_against_fit(self, runs: dict, strategy: str):
    """Asserts each of `runs` (`py_dataset`, `generator`: `weights`,
    `loss`) trained as `Model.fit` did; checks the rows' cells."""
    reference = self._keras_fit()
    for name, row in (("py_dataset", "py_dataset"),
                      ("generator", "generator")):
      run = runs[name]
      np.testing.assert_allclose(np.concatenate(
          [np.ravel(w) for w in run["weights"]]), np.concatenate(
              [np.ravel(w) for w in reference["weights"]]), atol=1e-5,
                                 err_msg=f"{name} weights, {strategy}")
      np.testing.assert_allclose(run["loss"], reference["loss"], rtol=1e-5,
                                 err_msg=f"{name} loss, {strategy}")
      conformance_table.check_cell(self, row, strategy, _FIT_CELL)

  def test_py_dataset_and_generator_train_as_model_fit(self):
    self._check_against_fit(_fit_python_inputs(
        self.x, self.y, os.path.join(self.dir, "fit"), "one_device"),
                            "one_device")

  def test_py_dataset_and_generator_under_mirrored(self):
    # In the plain script's process (FitTest's): its two logical CPUs are
    # set before TensorFlow starts.
    *summary, runs = _plain_script_run(self.dir)["mirrored"]
    self.assertEqual(summary, ["mirrored", 8, ["loss", "val_loss"]])
    self._check_against_fit(runs, "mirrored")

  def test_several_workers_are_refused_at_start_with_the_form(self):
    for config, environment, where in (
        (self._config("w"), _two_workers(),
         "a cluster of 2 worker\\(s\\) and 0 ps task"),
        (self._config("s", distribution_strategy="parameter_server"), None,
         "distribution_strategy=parameter_server")):
      generator = _batches(self.x, self.y)
      with self.subTest(where=where):
        with self.assertRaisesRegex(
            errors.ConfigError,
            r"tfdist.fit\(x=...\) got a generator, which only "
            f"this Python process can read; the run uses {where}.*Pass a "
            r"dataset function instead.*def make_dataset\(training\)"):
          api.fit(_model, x=generator, config=config, environment=environment)
        self.assertLen(list(generator), 6)  # Not read.
    # A PyDataset too, on one of two MultiWorkerMirrored workers.
    data = _Batches(self.x, self.y)
    with self.assertRaisesRegex(
        errors.ConfigError, r"tfdist.fit\(x=...\) got keras.utils.PyDataset "
        r"\(_Batches\), which only this Python process can read.*def "
        r"make_dataset"):
      api.fit(_model, x=data, environment=_two_workers(),
              config=self._config("pw", distribution_strategy=(
                  "multi_worker_mirrored")))
    self.assertEqual(data.passes, 0)
    for row in ("py_dataset", "generator"):
      conformance_table.check_cell(self, row, "multi_worker_mirrored",
                                   _WORKERS_CELL)

  def test_argument_checks(self):
    for kwargs, message in (
        (dict(x=_Batches(self.x, self.y), y=self.y), "its batches hold them"),
        (dict(x=_Batches(self.x, self.y), validation_split=0.5),
         "with a keras.utils.PyDataset pass validation_data"),
        (dict(x=_Batches(self.x[:0], self.y[:0])), "has no batches")):
      with self.subTest(message=message):
        with self.assertRaisesRegex(errors.ConfigError, message):
          api.fit(_model, config=self._config("c"), **kwargs)


class RefusedSettingsTest(absltest.TestCase):
  """What `fit` would drop without a word, refused at start by `tfdist.fit`
  under each strategy (the model function fails the test if called): a
  `TF_CONFIG` with a task but no usable cluster, a `keras.distribution`."""

  def _refused(self, strategy: str, pattern: str, environment=None):
    from tfdist import errors  # pylint: disable=g-import-not-at-top

    def model_fn():
      raise AssertionError("the model was built before the check")
    config = TrainConfig(model_dir=os.path.join(tempfile.mkdtemp(), "m"),
                         train_steps=1, batch_size=4,
                         distribution_strategy=strategy)
    with self.assertRaisesRegex(errors.ConfigError, pattern) as cm:
      api.fit(model_fn, x=np.zeros((8, 1), np.float32),
              y=np.zeros(8, np.float32), config=config,
              environment=environment)
    self.assertEqual(errors.exit_code_for(cm.exception), errors.CONFIG)
    return cm.exception

  def test_the_strategys_rules_before_the_model(self):
    # The decided backend's rules (`Backend.validate`), not the config's:
    # the config is built, `fit` refuses it before calling `model_fn`.
    from tfdist import errors  # pylint: disable=g-import-not-at-top

    def model_fn():
      raise AssertionError("the model was built before the check")
    # (`fit` names TrainConfig's fields where the flags say `--name`.)
    for settings, pattern in (
        (dict(reduction_server=True),
         r"^reduction_server needs distribution_strategy="
         r"multi_worker_mirrored or auto .*received "
         r"distribution_strategy=mirrored\.$"),
        (dict(bytes_per_pack=1024),
         r"^bytes_per_pack=1024 applies to multi_worker_mirrored, not "
         r"mirrored .*Drop bytes_per_pack\.$")):
      with self.subTest(**settings):
        config = TrainConfig(
            model_dir=os.path.join(tempfile.mkdtemp(), "m"), train_steps=1,
            batch_size=4, distribution_strategy="mirrored",
            num_cpu_devices=2, **settings)
        with self.assertRaisesRegex(errors.ConfigError, pattern) as cm:
          api.fit(model_fn, x=np.zeros((8, 1), np.float32),
                  y=np.zeros(8, np.float32), config=config, verbose=0)
        self.assertEqual(errors.exit_code_for(cm.exception), errors.CONFIG)

  def test_tf_config_without_a_cluster(self):
    from tfdist.distribute import environment as environment_lib  # pylint: disable=g-import-not-at-top
    # Kubeflow's form for dynamic workers: it ran as one process before.
    sparse = environment_lib.read_environment({"TF_CONFIG": json.dumps(
        {"sparseCluster": {"worker": {"1": "w1:2222"}},
         "task": {"type": "worker", "index": 1}})})
    for strategy in conformance_table.COLUMNS:
      with self.subTest(strategy=strategy):
        self._refused(strategy, r"TF_CONFIG names a task .* but no usable "
                      r"'cluster' \(its keys: 'sparseCluster', 'task'\).*"
                      r"Give the whole cluster", environment=sparse)
        conformance_table.check_cell(
            self, "tf_config_without_cluster", strategy, "refused at start "
            "(status 2, naming the form it got and the form it needs)")

  def test_a_keras_distribution(self):
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    self.addCleanup(keras.distribution.set_distribution, None)
    for strategy in conformance_table.COLUMNS:
      with self.subTest(strategy=strategy):
        self._refused(strategy, r"keras.distribution.set_distribution\("
                      r"DataParallel\(...\)\) is set in this process, which "
                      r"Keras ignores.*[^-]distribution_strategy=mirrored",
                      environment=(_two_workers() if strategy ==
                                   "multi_worker_mirrored" else None))
        conformance_table.check_cell(
            self, "keras_distribution", strategy, "refused at start "
            "(status 2, naming tfdist's flags for the same layout)")


if __name__ == "__main__":
  absltest.main()
