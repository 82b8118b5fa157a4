"""Tests for tfdist.distribute.tpu: the TPU path with no TPU present, and its rules.

No TPU exists here, so the failures run for real: `--tpu=local` against
TensorFlow's own TPU initialization, a name against the Cloud TPU lookup,
and `grpc://` addresses against a closed port and against a socket that
accepts and then says nothing (where TensorFlow alone waits forever). Each
must fail within its time bound with a message saying what was tried and
what to check. A fake resolver stands in only for a TPU that answers.
"""

import socket
import threading
import time

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import portpicker
import pytest
import tensorflow as tf

from tests import testutil
from tfdist import experiment
from tfdist import errors
from tfdist.backends import registry as backend_registry
from tfdist.config import TrainConfig
from tfdist.data import input_pipeline
from tfdist.distribute import decisions as decisions_lib
from tfdist.distribute import auto_select
from tfdist.distribute import environment as environment_lib
from tfdist.distribute import tpu
from tfdist.training.plan import run_plan

# Also run on the oldest supported TensorFlow (see tests/conftest.py).
pytestmark = pytest.mark.compat

# TPU failures must come within this many seconds (TensorFlow imported).
_BOUND_S = 10.0


class _Server:
  """A TCP server on 127.0.0.1 that accepts and then answers `reply` (or
  nothing when `reply` is None), until closed."""

  def __init__(self, reply=None):
    self.sock = socket.socket()
    self.sock.bind(("127.0.0.1", 0))
    self.sock.listen(8)
    self.port = self.sock.getsockname()[1]
    self.reply = reply
    self.conns = []
    self.thread = threading.Thread(target=self._serve, daemon=True)
    self.thread.start()

  def _serve(self):
    while True:
      try:
        conn, _ = self.sock.accept()
      except OSError:
        return
      self.conns.append(conn)
      if self.reply is not None:
        conn.recv(64)
        conn.sendall(self.reply)

  def close(self):
    self.sock.close()
    for conn in self.conns:
      conn.close()


class _FakeResolver:
  """Stands in for TPUClusterResolver where a TPU answers (none exists)."""

  def __init__(self, cores):
    self.cores = cores

  def num_accelerators(self):
    return {"TPU": self.cores}

  def master(self):
    return "grpc://fake:8470"


class AddressTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("local", "local", "local"), ("grpc", "grpc://10.0.0.2:8470", "grpc"),
      ("name", "my-tpu", "name"))
  def test_kinds(self, address, kind):
    self.assertEqual(tpu.tpu_address_kind(address), kind)

  @parameterized.named_parameters(
      ("empty", "", "needs --tpu"), ("http", "http://x:1", "only grpc://"))
  def test_bad_addresses(self, address, message):
    with self.assertRaisesRegex(errors.ConfigError, message):
      tpu.tpu_address_kind(address)

  def test_grpc_port(self):
    self.assertEqual(tpu.parse_grpc_address("grpc://10.0.0.2"),
                     ("10.0.0.2", 8470))
    self.assertEqual(tpu.parse_grpc_address("grpc://h:9"), ("h", 9))
    with self.assertRaisesRegex(errors.ConfigError, "grpc://HOST:PORT"):
      tpu.parse_grpc_address("grpc://h:port")


class ProbeTest(absltest.TestCase):

  def test_closed_port_is_refused_at_once(self):
    port = portpicker.pick_unused_port()
    started = time.monotonic()
    with self.assertRaisesRegex(errors.TPUNotAvailableError,
                                f"127.0.0.1:{port} failed"):
      tpu.probe_grpc("127.0.0.1", port, timeout=2)
    self.assertLess(time.monotonic() - started, 1.0)

  def test_silent_listener_times_out(self):
    server = _Server(reply=None)
    self.addCleanup(server.close)
    started = time.monotonic()
    with self.assertRaisesRegex(errors.TPUNotAvailableError,
                                "no gRPC \\(HTTP/2\\) answer within 1 s"):
      tpu.probe_grpc("127.0.0.1", server.port, timeout=1)
    self.assertLess(time.monotonic() - started, 2.5)

  def test_http1_server_is_not_grpc(self):
    server = _Server(reply=b"HTTP/1.1 400 Bad Request\r\n\r\n")
    self.addCleanup(server.close)
    with self.assertRaisesRegex(errors.TPUNotAvailableError,
                                "not as a gRPC \\(HTTP/2\\) server"):
      tpu.probe_grpc("127.0.0.1", server.port, timeout=2)

  def test_http2_settings_answer_passes(self):
    server = _Server(reply=b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
    self.addCleanup(server.close)
    self.assertLess(tpu.probe_grpc("127.0.0.1", server.port, timeout=2), 2)

  def test_deadline_abandons_work(self):
    release = threading.Event()
    self.addCleanup(release.set)
    started = time.monotonic()
    with self.assertRaisesRegex(TimeoutError, "stuck did not finish"):
      tpu.run_with_deadline(release.wait, timeout=0.3, what="stuck")
    self.assertLess(time.monotonic() - started, 1.0)
    with self.assertRaisesRegex(KeyError, "inner"):
      tpu.run_with_deadline(lambda: {}["inner"], timeout=1, what="x")
    self.assertEqual(tpu.run_with_deadline(lambda: 7, timeout=1, what="x"), 7)


class NoTpuTest(absltest.TestCase):
  """The real failures: TensorFlow's resolver and initialization, no TPU."""

  def _fails_fast(self, address, *patterns, **kwargs):
    started = time.monotonic()
    with self.assertRaises(errors.TPUNotAvailableError) as ctx:
      tpu.connect_tpu(address, **kwargs)
    elapsed = time.monotonic() - started
    self.assertLess(elapsed, _BOUND_S)
    message = str(ctx.exception)
    self.assertIn(f"Tried: --tpu={address}", message)
    self.assertIn("Check: ", message)
    for pattern in patterns:
      self.assertRegex(message, pattern)
    return message

  def test_local(self):
    self._fails_fast("local", "TPUs not found", "Cloud TPU VM")

  def test_name(self):
    # Without cloud-tpu-client: RuntimeError; with it but no metadata
    # server: URLError. Either way within the bound.
    self._fails_fast("no-such-tpu", "RuntimeError|URLError|Error",
                     "--tpu_zone=us-central1-b", "--tpu_gcp_project",
                     zone="us-central1-b")

  def test_unreachable_address(self):
    port = portpicker.pick_unused_port()
    self._fails_fast(f"grpc://127.0.0.1:{port}", "TCP connect",
                     "firewall")

  def test_silent_address_does_not_hang(self):
    # TensorFlow's connect_to_cluster waited > 60 s here (measured).
    server = _Server(reply=None)
    self.addCleanup(server.close)
    self._fails_fast(f"grpc://127.0.0.1:{server.port}", "no gRPC",
                     probe_timeout=1.0)

  def test_initialization_past_deadline(self):
    release = threading.Event()
    self.addCleanup(release.set)
    self._fails_fast(
        "stuck-tpu", "did not finish within 0.5 s", "--tpu_init_timeout",
        init_timeout=0.5, resolver_factory=lambda *a: _FakeResolver(8),
        initialize_fn=lambda resolver, kind: release.wait())

  def test_fake_tpu_connects_and_is_reused(self):
    calls = []

    def initialize(resolver, kind):
      calls.append(kind)
      return None

    system = tpu.connect_tpu("fake-tpu-for-test", zone="z",
                             resolver_factory=lambda *a: _FakeResolver(8),
                             initialize_fn=initialize)
    self.assertEqual((system.kind, system.num_cores), ("name", 8))
    again = tpu.connect_tpu("fake-tpu-for-test", zone="z")
    self.assertIs(again, system)
    self.assertEqual(calls, ["name"])

  def test_binary_fails_within_seconds(self):
    model_dir = testutil.scratch_dir()
    started = time.monotonic()
    result = testutil.run_module(
        "tfdist.train", ["--distribution_strategy=tpu", "--tpu=local",
                         f"--model_dir={model_dir}", "--train_steps=2"],
        timeout=240)
    elapsed = time.monotonic() - started
    self.assertNotEqual(result.returncode, 0)
    self.assertRegex(result.stdout,
                     r"tfdist.train: error: No TPU available: .*TPUs not "
                     r"found.* Tried: --tpu=local \(after \d+\.\d s\)\. "
                     r"Check: ")
    tpu_seconds = float(
        result.stdout.split("Tried: --tpu=local (after ")[1].split(" s)")[0])
    self.assertLess(tpu_seconds, 5.0)
    # Python and TensorFlow start-up included (about 6 s when idle; much
    # more on a loaded 2-core CI machine).
    self.assertLess(elapsed, 180.0)


class TpuRulesTest(parameterized.TestCase):

  def _config(self, **kwargs):
    base = dict(model_dir="/tmp/m", train_steps=10,
                distribution_strategy="tpu", tpu="local")
    base.update(kwargs)
    return TrainConfig(**base)

  def _with_environment(self, cfg):
    # As the binary's edge does (fills --data_dir's default).
    return environment_lib.apply_environment(
        cfg, environment_lib.read_environment({"HOME": "/home/u"}))[0]

  def test_defaults_on_tpu(self):
    # The config holds the defaults; the decisions give a TPU its own.
    cfg = self._config()
    self.assertEqual((cfg.dtype, cfg.steps_per_execution), ("fp32", 1))
    self.assertContainsSubset(("dtype", "steps_per_execution"),
                              cfg.defaulted)
    decided = decisions_lib.Decisions.of(cfg)
    self.assertEqual((decided.dtype, decided.steps_per_execution),
                     ("bf16", tpu.TPU_DEFAULT_STEPS_PER_EXECUTION))
    cpu = TrainConfig(model_dir="/tmp/m", train_steps=10,
                      distribution_strategy="one_device")
    decided = decisions_lib.Decisions.of(cpu)
    self.assertEqual((decided.dtype, decided.steps_per_execution),
                     ("fp32", 1))

  def test_flags_override_defaults(self):
    cfg = self._config(dtype="fp32", steps_per_execution=1)
    decided = decisions_lib.Decisions.of(cfg)
    self.assertEqual((decided.dtype, decided.steps_per_execution),
                     ("fp32", 1))
    self.assertNoCommonElements(("dtype", "steps_per_execution"),
                                cfg.defaulted)

  def test_fp16_refused(self):
    with self.assertRaisesRegex(
        errors.ConfigError, "--dtype=fp16 is not supported"
                                " with --distribution_strategy=tpu:"):
      backend_registry.check_strategy_rules(self._config(dtype="fp16"))

  def test_tpu_address_required(self):
    # Checked once the environment is applied ($TPU_NAME may supply it).
    with self.assertRaisesRegex(errors.ConfigError, "needs --tpu"):
      tpu.validate_tpu_config(self._config(tpu="").tpu, data_patterns=[])

  @parameterized.named_parameters(
      ("remote_local_files", "grpc://10.0.0.2:8470",
       dict(train_files="/data/train-*", eval_files="gs://b/test-*"),
       "input must be on gs://.*--train_files=/data/train-\\*"),
      ("name_default_data_dir", "my-tpu", {}, "--data_dir="),
      ("name_local_data_dir", "my-tpu", dict(data_dir="/data"),
       "--data_dir=/data"))
  def test_gcs_required_for_remote_tpus(self, address, files, message):
    cfg = self._with_environment(self._config(tpu=address, **files))
    with self.assertRaisesRegex(errors.ConfigError, message):
      tpu.validate_tpu_config(cfg.tpu, data_patterns=run_plan.data_patterns(
          cfg.task.data))

  @parameterized.named_parameters(
      ("gcs", "my-tpu", dict(train_files="gs://b/train-*",
                             eval_files="gs://b/test-*")),
      ("gcs_data_dir", "grpc://h:8470", dict(data_dir="gs://b/data")),
      ("local_tpu_local_files", "local", dict(train_files="/d/train-*",
                                              eval_files="/d/test-*")))
  def test_allowed_inputs(self, address, files):
    cfg = self._with_environment(self._config(tpu=address, **files))
    tpu.validate_tpu_config(cfg.tpu, data_patterns=run_plan.data_patterns(
        cfg.task.data))

  def test_dataset_functions_and_feature_specs_on_remote_tpus(self):
    # A dataset function reads no files of tfdist's: nothing to put on
    # gs://. A feature spec reads --train_files/--eval_files: the rule holds.
    from tfdist.data import feature_spec  # pylint: disable=g-import-not-at-top
    from tfdist.core.dataset_spec import DatasetSpec  # pylint: disable=g-import-not-at-top
    cfg = self._with_environment(self._config(tpu="grpc://10.0.0.2:8470"))
    function = DatasetSpec(name="mine", input_fn=lambda training: None)
    self.assertEqual(
        run_plan.data_patterns(cfg.task.data, function), [])
    tpu.validate_tpu_config(cfg.tpu, data_patterns=run_plan.data_patterns(
        cfg.task.data, function))
    cfg = self._config(tpu="grpc://10.0.0.2:8470", feature_spec="spec.json",
                       train_files="/d/train-*", eval_files="/d/test-*")
    records = feature_spec.from_dict({
        "features": {"x": {"dtype": "float32", "shape": [2]},
                     "y": {"dtype": "int64"}}, "labels": ["y"]}
    ).dataset_spec()
    with self.assertRaisesRegex(errors.ConfigError, "input must be on gs://"):
      tpu.validate_tpu_config(cfg.tpu, data_patterns=run_plan.data_patterns(
          cfg.task.data, records))

  def test_rules_checked_before_connecting(self):
    # A remote TPU with local files fails on the rule, without any network.
    cfg = self._config(tpu=f"grpc://127.0.0.1:{portpicker.pick_unused_port()}",
                       train_files="/d/train-*", eval_files="/d/test-*")
    with self.assertRaisesRegex(errors.ConfigError, "input must be on gs://"):
      experiment.prepare_run(
          cfg, environment=environment_lib.read_environment({}))

  def test_auto_chosen_tpu_gets_tpu_defaults(self):
    cfg = TrainConfig(model_dir="/tmp/m", train_steps=10)
    decision = auto_select.decide(auto_select.DeviceInventory(
        tpu_cores=8, tpu_address="local"),
                                  dtype=cfg.dtype,
                                  dtype_defaulted="dtype" in cfg.defaulted)
    decided = decisions_lib.Decisions.of(cfg, choice=decision)
    self.assertEqual((decided.strategy, decided.tpu,
                      decided.dtype, decided.steps_per_execution),
                     ("tpu", "local", "bf16",
                      tpu.TPU_DEFAULT_STEPS_PER_EXECUTION))


class TpuFlagsTest(absltest.TestCase):
  """Model Garden's flag names reach the TrainConfig."""

  def test_flags_to_config(self):
    from absl import flags  # pylint: disable=g-import-not-at-top
    from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
    from tfdist import flags as tfdist_flags  # pylint: disable=g-import-not-at-top
    from tfdist import train  # pylint: disable=g-import-not-at-top,unused-import
    with flagsaver.as_parsed(
        distribution_strategy="tpu", tpu="my-tpu", tpu_zone="us-central2-b",
        tpu_gcp_project="proj", tpu_init_timeout="30", model_dir="/m",
        train_steps="5"):
      cfg = tfdist_flags.flags_to_config(flags.FLAGS)
    self.assertEqual((cfg.tpu, cfg.tpu_zone, cfg.tpu_gcp_project,
                      cfg.tpu_init_timeout), ("my-tpu", "us-central2-b",
                                              "proj", 30.0))
    # Neither --dtype nor --steps_per_execution given: the TPU defaults.
    decided = decisions_lib.Decisions.of(cfg)
    self.assertEqual((decided.dtype, decided.steps_per_execution),
                     ("bf16", tpu.TPU_DEFAULT_STEPS_PER_EXECUTION))
    with flagsaver.as_parsed(dtype="AUTO", model_dir="/m", train_steps="5"):
      self.assertEqual(tfdist_flags.flags_to_config(flags.FLAGS).dtype,
                       "auto")


class StaticEvalBatchesTest(parameterized.TestCase):
  """TPU evaluation: static shapes, every example counted once."""

  @parameterized.named_parameters(
      ("one_replica", 10, 4, 1, 3), ("two_replicas", 10, 4, 2, 4),
      ("exact", 8, 4, 2, 2), ("fewer_than_a_batch", 3, 4, 2, 2))
  def test_padding_and_weights(self, n, batch, replicas, num_batches):
    ds = tf.data.Dataset.range(n).map(
        lambda i: (tf.fill([2], tf.cast(i, tf.float32)), i))
    out = list(input_pipeline.pad_to_static_batches(ds, batch, replicas))
    self.assertLen(out, num_batches)
    spec = input_pipeline.pad_to_static_batches(ds, batch, replicas
                                                ).element_spec
    self.assertEqual([s.shape.as_list() for s in spec],
                     [[batch, 2], [batch], [batch]])
    weights = np.concatenate([w.numpy() for _, _, w in out])
    labels = np.concatenate([y.numpy() for _, y, _ in out])
    self.assertEqual(weights.sum(), n)
    self.assertCountEqual(labels[weights == 1], range(n))

  def test_masked_evaluation_counts_every_example_once(self):
    import keras  # pylint: disable=g-import-not-at-top
    from tfdist.training.step.train_loop import Trainer  # pylint: disable=g-import-not-at-top
    data = testutil.fashion_mnist_subset(limit=512, train_shards=4,
                                         test_shards=2)
    files = input_pipeline.list_files(data["eval"])
    from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
    spec = datasets.get_dataset_spec("fashion_mnist")
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
      model = keras.Sequential([keras.Input((28, 28, 1)),
                                keras.layers.Flatten(),
                                keras.layers.Dense(10)])
      optimizer = keras.optimizers.SGD(0.1)
      optimizer.build(model.trainable_variables)
    results = {}
    for padded in (False, True):
      trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                        global_batch_size=96, eval_example_weights=padded)
      ds = input_pipeline.distribute(strategy, input_pipeline.PipelineOptions(
          files=files, parse_fn=spec.parse_fn, global_batch_size=96,
          is_training=False, pad_to_static_batches=padded))
      results[padded] = trainer.evaluate(ds)
    self.assertEqual(results[True]["num_examples"], 512)  # 512 = 5*96 + 32.
    self.assertEqual(results[False]["num_examples"], 512)
    self.assertAlmostEqual(results[True]["loss"], results[False]["loss"],
                           places=5)
    self.assertAlmostEqual(results[True]["accuracy"],
                           results[False]["accuracy"], places=6)

  def test_masked_evaluation_of_user_features_loss_and_metrics(self):
    # Dict features from a dataset function, a multi-label loss and Keras
    # metrics: padded static batches give the unpadded values.
    import keras  # pylint: disable=g-import-not-at-top
    from tfdist.core.dataset_spec import DatasetSpec  # pylint: disable=g-import-not-at-top
    from tfdist.training.step import objectives  # pylint: disable=g-import-not-at-top
    from tfdist.training.step.train_loop import Trainer  # pylint: disable=g-import-not-at-top
    rng = np.random.RandomState(1)
    x = rng.normal(size=(70, 4)).astype(np.float32)
    ids = np.arange(70, dtype=np.int64)
    y = (rng.rand(70, 3) > 0.5).astype(np.float32)
    spec = DatasetSpec(name="mine", input_fn=lambda: tf.data.Dataset
                       .from_tensor_slices(({"x": x, "id": ids}, y)))
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
      inputs = {"x": keras.Input((4,), name="x"),
                "id": keras.Input((), name="id", dtype="int64")}
      features = keras.layers.Concatenate()([
          inputs["x"], keras.layers.Embedding(70, 2)(inputs["id"])])
      model = keras.Model(inputs, keras.layers.Dense(
          3, activation="sigmoid")(features))
      optimizer = keras.optimizers.SGD(0.1)
      optimizer.build(model.trainable_variables)
    results = {}
    for padded in (False, True):
      metrics = objectives.MetricSums(
          [keras.metrics.AUC(multi_label=True, name="auc"),
           keras.metrics.MeanAbsoluteError(name="mae")],
          y_true=tf.TensorSpec([None, 3]), y_pred=tf.TensorSpec([None, 3]))
      trainer = Trainer(
          strategy=strategy, model=model, optimizer=optimizer,
          global_batch_size=32, eval_example_weights=padded,
          loss="binary_crossentropy", metrics=metrics)
      ds = input_pipeline.distribute(strategy, input_pipeline.options_for(
          spec, global_batch_size=32, is_training=False, cache=False,
          pad_to_static_batches=padded))
      results[padded] = trainer.evaluate(ds)
    self.assertEqual(results[True]["num_examples"], 70)  # 70 = 2*32 + 6.
    for key in ("loss", "auc", "mae"):
      self.assertAlmostEqual(results[True][key], results[False][key],
                             places=5, msg=key)


if __name__ == "__main__":
  absltest.main()
