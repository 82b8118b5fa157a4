"""Tests for tfdist.distribute.auto_select: every `auto` decision, per device situation.

The decision is a pure function of a `DeviceInventory`, so every situation
(TPU, GPUs of each compute capability, clusters, CPUs) is tested directly.
The inventory itself is tested on what runs here for real (this machine's
CPU, TF_CONFIG and CLUSTER_SPEC, a real failing TPU probe, logical CPU
devices in a real run of the binary), with fakes only for hardware that
cannot exist here (a TPU that answers, GPUs).
"""

import json
import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tests import testutil
from tfdist import experiment
from tfdist import config as config_lib
from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.distribute import decisions as decisions_lib
from tfdist.distribute import auto_select
from tfdist.distribute import cluster as cluster_lib
from tfdist.distribute import environment as environment_lib
from tfdist.distribute import tpu
from tfdist.distribute.auto_select import DeviceInventory, GpuInfo

A100 = GpuInfo("NVIDIA A100-SXM4-40GB", (8, 0))
H100 = GpuInfo("NVIDIA H100 80GB HBM3", (9, 0))
V100 = GpuInfo("Tesla V100-SXM2-16GB", (7, 0))
T4 = GpuInfo("Tesla T4", (7, 5))
P100 = GpuInfo("Tesla P100-PCIE-16GB", (6, 0))
UNKNOWN = GpuInfo("GPU", None)


@pytest.mark.compat
class DecideTest(parameterized.TestCase):

  @parameterized.named_parameters(
      # name, inventory, strategy, dtype, reason patterns
      ("tpu", DeviceInventory(tpu_cores=8, tpu_address="local"),
       "tpu", "bf16", "TPU with 8 cores", "bfloat16"),
      ("tpu_beats_gpus_and_cluster",
       DeviceInventory(tpu_cores=4, gpus=(A100,), cluster_source="TF_CONFIG",
                       cluster_workers=2),
       "tpu", "bf16", "TPU", "TPU"),
      ("ps_cluster", DeviceInventory(cluster_source="TF_CONFIG",
                                     cluster_workers=2, cluster_ps=1),
       "parameter_server", "fp32", "TF_CONFIG lists 1 parameter server",
       "no GPU"),
      ("multi_worker_tf_config",
       DeviceInventory(cluster_source="TF_CONFIG", cluster_workers=3,
                       gpus=(V100,) * 4),
       "multi_worker_mirrored", "fp16", "TF_CONFIG lists 3 workers",
       "7.x.*loss scaling"),
      ("multi_worker_vertex",
       DeviceInventory(cluster_source="CLUSTER_SPEC", cluster_workers=2,
                       gpus=(A100,)),
       "multi_worker_mirrored", "bf16", "CLUSTER_SPEC lists 2 workers",
       ">= 8.0"),
      ("one_worker_cluster_is_local",
       DeviceInventory(cluster_source="TF_CONFIG", cluster_workers=1),
       "one_device", "fp32", "one CPU device", "float32 is fastest"),
      ("eight_a100", DeviceInventory(gpus=(A100,) * 8),
       "mirrored", "bf16", "8 GPUs", "A100.*compute capability 8.0"),
      ("one_h100", DeviceInventory(gpus=(H100,)),
       "one_device", "bf16", "one GPU", "9.0"),
      ("one_v100", DeviceInventory(gpus=(V100,)),
       "one_device", "fp16", "one GPU", "V100.*7.0.*dynamic loss scaling"),
      ("two_t4", DeviceInventory(gpus=(T4, T4)),
       "mirrored", "fp16", "2 GPUs", "T4.*7.5"),
      ("mixed_gpus_use_the_least_capable", DeviceInventory(gpus=(H100, V100)),
       "mirrored", "fp16", "2 GPUs", "7.x"),
      ("p100", DeviceInventory(gpus=(P100,)),
       "one_device", "fp32", "one GPU", "< 7.0.*no Tensor Cores"),
      ("unknown_capability", DeviceInventory(gpus=(UNKNOWN,)),
       "one_device", "fp32", "one GPU", "unknown"),
      ("logical_cpus", DeviceInventory(num_cpu_devices=2),
       "mirrored", "fp32", "--num_cpu_devices=2 logical CPU", "no GPU"),
      ("cpu", DeviceInventory(), "one_device", "fp32", "one CPU device",
       "1.6x slower"),
      ("tpu_hint_without_tpu",
       DeviceInventory(tpu_note="$TPU_NAME=x suggested a TPU but none "
                       "answered"),
       "one_device", "fp32", "TPU_NAME=x suggested a TPU but none answered",
       "no GPU"),
  )
  def test_auto_auto(self, inventory, strategy, dtype, strategy_why,
                     dtype_why):
    decision = auto_select.decide(inventory)
    self.assertEqual((decision.strategy, decision.dtype), (strategy, dtype))
    self.assertRegex(decision.strategy_reason, "^auto: .*" + strategy_why)
    self.assertRegex(decision.dtype_reason, "^auto: .*" + dtype_why)
    self.assertIn(f"strategy {strategy}", decision.describe())
    self.assertIn(f"dtype {dtype}", decision.describe())

  @parameterized.named_parameters(
      ("explicit_strategy_auto_dtype",
       DeviceInventory(gpus=(A100,) * 2), "one_device", "auto",
       "one_device", "bf16"),
      ("explicit_tpu_auto_dtype", DeviceInventory(), "tpu", "auto",
       "tpu", "bf16"),
      ("auto_strategy_explicit_dtype", DeviceInventory(gpus=(A100,) * 2),
       "auto", "fp32", "mirrored", "fp32"),
      ("fp16_on_ampere_when_asked", DeviceInventory(gpus=(A100,)),
       "auto", "fp16", "one_device", "fp16"),
      ("bf16_on_cpu_when_asked", DeviceInventory(), "auto", "bf16",
       "one_device", "bf16"),
      ("off_with_gpu", DeviceInventory(gpus=(T4,)), "off", "auto", "off",
       "fp16"),
  )
  def test_flags_override(self, inventory, strategy, dtype, want_strategy,
                          want_dtype):
    decision = auto_select.decide(inventory, strategy=strategy, dtype=dtype)
    self.assertEqual((decision.strategy, decision.dtype),
                     (want_strategy, want_dtype))
    if strategy != "auto":
      self.assertEqual(decision.strategy_reason,
                       f"--distribution_strategy={strategy}")
    if dtype != "auto":
      self.assertEqual(decision.dtype_reason, f"--dtype={dtype}")

  def test_dtype_default_is_bf16_on_tpu_else_fp32(self):
    tpu_inventory = DeviceInventory(tpu_cores=8, tpu_address="local")
    decision = auto_select.decide(tpu_inventory, dtype="fp32",
                                  dtype_defaulted=True)
    self.assertEqual((decision.dtype, decision.tpu), ("bf16", "local"))
    self.assertIn("TPU default", decision.dtype_reason)
    decision = auto_select.decide(DeviceInventory(gpus=(A100,)),
                                  dtype="fp32", dtype_defaulted=True)
    self.assertEqual(decision.dtype, "fp32")
    self.assertIn("default", decision.dtype_reason)

  def test_fp16_on_tpu_refused(self):
    # `auto` decides the TPU; its backend refuses fp16, saying how.
    from tfdist.backends import registry  # pylint: disable=g-import-not-at-top
    cfg = TrainConfig(model_dir="/m", train_steps=1, dtype="fp16")
    choice = auto_select.decide(DeviceInventory(tpu_cores=8,
                                                tpu_address="local"),
                                dtype="fp16")
    with self.assertRaisesRegex(
        errors.ConfigError, r"^--dtype=fp16 is not supported with "
        r"--distribution_strategy=tpu \(auto: .*fp16 is not supported on "
        "TPUs"):
      registry.check_strategy_rules(
          cfg, decisions_lib.Decisions.of(cfg, choice=choice))

  def test_loss_scale_dropped_unless_fp16(self):
    cfg = TrainConfig(model_dir="/m", train_steps=1, dtype="auto",
                      loss_scale="128")
    for gpus, want in (((A100,), None), ((V100,), 128.0)):
      decision = auto_select.decide(DeviceInventory(gpus=gpus), dtype="auto")
      decided = decisions_lib.Decisions.of(cfg, choice=decision)
      self.assertEqual(decided.loss_scale, want)
      self.assertEqual(cfg.loss_scale, 128.0)  # the config keeps its own


@pytest.mark.compat
class ClusterTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("none", {}, ("", 0, 0)),
      ("tf_config_workers", {"TF_CONFIG": json.dumps({
          "cluster": {"chief": ["a:1"], "worker": ["b:1", "c:1"]},
          "task": {"type": "worker", "index": 0}})}, ("TF_CONFIG", 3, 0)),
      ("tf_config_ps", {"TF_CONFIG": json.dumps({
          "cluster": {"chief": ["a:1"], "worker": ["b:1"], "ps": ["c:1"]},
          "task": {"type": "chief", "index": 0}})}, ("TF_CONFIG", 2, 1)),
      ("tf_config_master", {"TF_CONFIG": json.dumps({
          "cluster": {"master": ["a:1"], "worker": ["b:1"]},
          "task": {"type": "master", "index": 0}})},
       ("TF_CONFIG", 2, 0)),
      ("cluster_spec", {"CLUSTER_SPEC": json.dumps({
          "cluster": {"workerpool0": ["a:1"], "workerpool1": ["b:1", "c:1"],
                      "workerpool2": ["d:1"]},
          "environment": "cloud",
          "task": {"type": "workerpool0", "index": 0}})},
       ("CLUSTER_SPEC", 3, 1)),
      ("tf_config_first", {
          "TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:1"]},
                                   "task": {"type": "worker", "index": 1}}),
          "CLUSTER_SPEC": json.dumps({"cluster": {"workerpool0": ["x:1"]},
                                      "task": {"type": "workerpool0"}})},
       ("TF_CONFIG", 2, 0)),
  )
  def test_cluster_from_env(self, env, expected):
    # The inventory counts the cluster that tfdist.distribute.cluster (the one
    # TF_CONFIG/CLUSTER_SPEC parser) resolved.
    cluster = cluster_lib.resolve_cluster(environ=env)
    config = TrainConfig(model_dir="/m", train_steps=1,
                         distribution_strategy="one_device")
    inventory = auto_select.take_inventory(
        auto_select.SelectOptions(
            strategy=config.strategy, precision=config.precision),
        cluster=cluster)
    self.assertEqual((inventory.cluster_source, inventory.cluster_workers,
                      inventory.cluster_ps), expected)

  def test_tf_config_without_cluster_is_refused(self):
    # It ran as a single process (the inventory counted no cluster); the
    # messages: tests/cluster_test.py.
    with self.assertRaisesRegex(errors.ConfigError, "no usable 'cluster'"):
      cluster_lib.resolve_cluster(environ={"TF_CONFIG": json.dumps({
          "task": {"type": "worker", "index": 0}})})

  def test_bad_json(self):
    with self.assertRaisesRegex(
        errors.ConfigError, "TF_CONFIG is not valid JSON"):
      cluster_lib.resolve_cluster(environ={"TF_CONFIG": "{not json"})


@pytest.mark.compat
class InventoryTest(absltest.TestCase):
  """`take_inventory` on this machine, with env vars set for real."""

  def _config(self, **kwargs):
    return TrainConfig(model_dir="/m", train_steps=1, **kwargs)

  def _inventory(self, config, env, **kwargs):
    # As the binary does: the environment is read once, then applied.
    environment = environment_lib.read_environment(env)
    config, _ = environment_lib.apply_environment(config, environment)
    return auto_select.take_inventory(
        auto_select.SelectOptions(
            strategy=config.strategy, precision=config.precision,
            dtype_defaulted="dtype" in config.defaulted),
        cluster=cluster_lib.resolve_cluster(environ=environment.variables),
        environment=environment, **kwargs)

  def test_this_machine(self):
    inventory = self._inventory(self._config(), {})
    self.assertEqual(inventory.gpus, ())  # tensorflow-cpu: no GPU here.
    self.assertEqual(inventory.cluster_source, "")
    decision = auto_select.decide(inventory)
    self.assertEqual((decision.strategy, decision.dtype),
                     ("one_device", "fp32"))

  def test_tf_config_for_real(self):
    tf_config = {"cluster": {"chief": ["127.0.0.1:1"],
                             "worker": ["127.0.0.1:2"]},
                 "task": {"type": "chief", "index": 0}}
    inventory = self._inventory(self._config(),
                                {"TF_CONFIG": json.dumps(tf_config)})
    self.assertEqual(auto_select.decide(inventory).strategy,
                     "multi_worker_mirrored")

  def test_num_cpu_devices(self):
    inventory = self._inventory(self._config(num_cpu_devices=2), {})
    self.assertEqual(auto_select.decide(inventory).strategy, "mirrored")

  def test_pipeline_stages_run_in_one_process(self):
    # Where auto would mirror (two GPUs, logical CPU devices), a run with
    # pipeline stages gets one process and says why.
    for inventory in (DeviceInventory(gpus=(A100, A100)),
                      DeviceInventory(num_cpu_devices=4)):
      decision = auto_select.resolve(
          auto_select.SelectOptions(strategy=config_lib.StrategyConfig(
              parallelism=config_lib.ParallelismConfig(pipeline_stages=2))),
          cluster=cluster_lib.resolve_cluster(environ={}),
          inventory=inventory)
      self.assertEqual(decision.strategy, "one_device")
      self.assertEqual(decision.strategy_reason,
                       "auto: --pipeline_stages=2 runs its stages in one "
                       "process, stage i on GPU i or logical CPU device i")

  def test_pipeline_stages_with_tensor_parallel_run_in_one_process(self):
    # T splits each stage's layers over devices of the one process (a
    # layout map's), not over Mirrored replicas.
    decision = auto_select.resolve(
        auto_select.SelectOptions(strategy=config_lib.StrategyConfig(
            parallelism=config_lib.ParallelismConfig(pipeline_stages=2,
                                                     tensor_parallel=2))),
        cluster=cluster_lib.resolve_cluster(environ={}),
        inventory=DeviceInventory(num_cpu_devices=4))
    self.assertEqual(decision.strategy, "one_device")
    self.assertEqual(decision.strategy_reason,
                     "auto: --pipeline_stages=2 runs its stages in one "
                     "process, each stage's split layers over 2 devices (a "
                     "data x pipeline x tensor mesh)")

  def test_tensor_parallel_mirrors_without_probing(self):
    # On one CPU device (where auto is one_device), --tensor_parallel=2
    # gets MirroredStrategy: its backend makes the 2 logical CPU devices.
    # (auto then takes no inventory, which would start TensorFlow's runtime
    # first; tfdist.train --tensor_parallel=2 alone runs.)
    decision = auto_select.resolve(
        auto_select.SelectOptions(
            strategy=config_lib.StrategyConfig(
                parallelism=config_lib.ParallelismConfig(tensor_parallel=2)),
            precision=config_lib.PrecisionConfig(dtype="fp32")),
        cluster=cluster_lib.resolve_cluster(environ={}),
        inventory=DeviceInventory())
    self.assertEqual(decision.strategy, "mirrored")
    self.assertEqual(decision.strategy_reason,
                     "auto: --tensor_parallel=2 splits the layers over 2 "
                     "replicas of one host")

  def test_tpu_hint_with_real_failing_probe(self):
    # A TPU hint on a machine without TPU: the real probe (TensorFlow's
    # local TPU initialization) fails fast and auto falls back, saying why.
    inventory = self._inventory(self._config(),
                                {"TPU_ACCELERATOR_TYPE": "v4-8"})
    self.assertEqual(inventory.tpu_cores, 0)
    self.assertIn("TPU_ACCELERATOR_TYPE=v4-8 suggested a TPU",
                  inventory.tpu_note)
    decision = auto_select.decide(inventory)
    self.assertEqual(decision.strategy, "one_device")
    self.assertIn("suggested a TPU but none answered",
                  decision.strategy_reason)

  def test_tpu_name_with_fake_resolver(self):
    # Only a TPU that answers is faked: connect_tpu runs for real around a
    # fake resolver.
    class FakeResolver:

      def num_accelerators(self):
        return {"TPU": 32}

    def connect(address, **kwargs):
      return tpu.connect_tpu(
          address, resolver_factory=lambda *a: FakeResolver(),
          initialize_fn=lambda resolver, kind: None, **kwargs)

    inventory = self._inventory(self._config(),
                                {"TPU_NAME": "auto-test-v4-32"},
                                connect_fn=connect)
    self.assertEqual((inventory.tpu_cores, inventory.tpu_address),
                     (32, "auto-test-v4-32"))
    decision = auto_select.decide(inventory, dtype="auto")
    self.assertEqual((decision.strategy, decision.dtype, decision.tpu),
                     ("tpu", "bf16", "auto-test-v4-32"))

  def test_explicit_strategy_never_probes_tpu(self):
    def connect(*args, **kwargs):
      raise AssertionError("probed")

    self._inventory(self._config(distribution_strategy="one_device"),
                    {"TPU_NAME": "x"}, connect_fn=connect)

  def test_tpu_hints(self):
    self.assertEqual(tpu.tpu_hints({}, device_globs=()), ())
    self.assertEqual(tpu.tpu_hints({"TPU_NAME": "t"}, device_globs=()),
                     ("$TPU_NAME=t",))
    with tempfile.TemporaryDirectory() as tmp:
      open(os.path.join(tmp, "accel0"), "w").close()
      hints = tpu.tpu_hints({}, device_globs=(os.path.join(tmp, "accel*"),))
    self.assertLen(hints, 1)
    self.assertIn("accel0", hints[0])

  def test_gpu_inventory_reads_compute_capability(self):
    devices = ["gpu0", "gpu1", "gpu2"]
    details = {"gpu0": {"device_name": "NVIDIA A100", "compute_capability":
                        (8, 0)},
               "gpu1": {"device_name": "Tesla T4", "compute_capability":
                        (7, 5)},
               "gpu2": {}}
    gpus = auto_select.gpu_inventory(-1, list_fn=lambda: devices,
                                     details_fn=details.get)
    self.assertEqual(gpus, (GpuInfo("NVIDIA A100", (8, 0)),
                            GpuInfo("Tesla T4", (7, 5)),
                            GpuInfo("GPU", None)))
    self.assertLen(auto_select.gpu_inventory(
        1, list_fn=lambda: devices, details_fn=details.get), 1)
    self.assertEqual(auto_select.gpu_inventory(
        0, list_fn=lambda: devices, details_fn=details.get), ())


class AutoRunTest(absltest.TestCase):
  """`--distribution_strategy=auto --dtype=auto` prints its decision and
  trains: in-process on one device, and the binary on 2 logical CPUs."""

  def test_in_process(self):
    data = testutil.fashion_mnist_subset(limit=512, train_shards=4,
                                         test_shards=2)
    record = experiment.run_experiment(TrainConfig(
        model_dir=testutil.scratch_dir(), train_files=data["train"],
        eval_files=data["eval"], distribution_strategy="auto", dtype="auto",
        batch_size=64, train_steps=4, log_steps=2, seed=1))
    self.assertEqual((record["strategy"], record["dtype"],
                      record["dtype_policy"]),
                     ("one_device", "fp32", "float32"))
    self.assertRegex(record["strategy_reason"], "^auto: ")
    self.assertRegex(record["dtype_reason"], "^auto: ")
    self.assertEqual(record["final_metrics"]["eval_examples"], 512)

  def test_binary_on_logical_cpus_with_xla(self):
    data = testutil.fashion_mnist_subset(limit=512, train_shards=4,
                                         test_shards=2)
    result = testutil.run_module("tfdist.train", [
        "--distribution_strategy=auto", "--dtype=auto", "--num_cpu_devices=2",
        "--enable_xla", f"--model_dir={testutil.scratch_dir()}",
        f"--train_files={data['train']}", f"--eval_files={data['eval']}",
        "--batch_size=64", "--train_steps=4", "--log_steps=2"], timeout=300)
    self.assertEqual(result.returncode, 0, result.stdout[-3000:])
    self.assertRegex(
        result.stdout,
        r"tfdist decision: strategy mirrored \(auto: no GPU or TPU; "
        r"--num_cpu_devices=2 logical CPU devices\); dtype fp32 \(auto: ")
    self.assertIn("--enable_xla: Keras 3 turns XLA off under a "
                  "tf.distribute strategy, so tfdist jit-compiles",
                  result.stdout)
    self.assertIn("Final eval:", result.stdout)
    self.assertIn("(512 examples)", result.stdout)


if __name__ == "__main__":
  absltest.main()
