"""Vertex AI's Reduction Server: worker pool 2 is neither ps nor worker.

The CLUSTER_SPEC values below have the shape Vertex AI writes: host names
`cmle-training-workerpoolN-<id>-<i>:2222`, `environment: cloud`, and a `job`
that is either what custom jobs have been seen to carry (a JSON *string*
`{"python_module": ..., "package_uris": [...], "job_args": [...]}`, which
names no worker pools) or the CustomJobSpec the job was created with (as
Vertex documents `job`), whose pool 2 runs the Reduction Server image.
"""

import json

from absl.testing import absltest
import pytest
from absl.testing import parameterized

from tests import testutil
from tfdist import experiment
from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.distribute import auto_select
from tfdist.distribute import cluster as cluster_lib
from tfdist.distribute import environment as environment_lib
from tfdist.distribute import strategy as strategy_lib
from tfdist.backends import registry as backend_registry

# Also run on the oldest supported TensorFlow (tests/conftest.py).
pytestmark = pytest.mark.compat

_ID = "4c1d6d97d0"
_CLUSTER = {
    "workerpool0": [f"cmle-training-workerpool0-{_ID}-0:2222"],
    "workerpool1": [f"cmle-training-workerpool1-{_ID}-0:2222",
                    f"cmle-training-workerpool1-{_ID}-1:2222"],
    "workerpool2": [f"cmle-training-workerpool2-{_ID}-0:2222",
                    f"cmle-training-workerpool2-{_ID}-1:2222"],
}
_TRAINER_POOL = {
    "machineSpec": {"machineType": "n1-standard-8",
                    "acceleratorType": "NVIDIA_TESLA_T4",
                    "acceleratorCount": 1},
    "diskSpec": {"bootDiskType": "pd-ssd", "bootDiskSizeGb": 100},
    "pythonPackageSpec": {
        "executorImageUri":
            "us-docker.pkg.dev/vertex-ai/training/tf-gpu.2-17.py310:latest",
        "packageUris": ["gs://my-bucket/tfdist-0.1.0.tar.gz"],
        "pythonModule": "tfdist.train",
        "args": ["--model_dir=gs://my-bucket/run"]},
}
_REDUCTION_SERVER_POOL = {
    "machineSpec": {"machineType": "n1-highcpu-16"},
    "replicaCount": "2",
    "containerSpec": {"imageUri": cluster_lib.REDUCTION_SERVER_IMAGE},
}
_PS_POOL = {
    "machineSpec": {"machineType": "n1-standard-4"},
    "replicaCount": "2",
    "pythonPackageSpec": dict(_TRAINER_POOL["pythonPackageSpec"]),
}
# What custom jobs have been seen to carry in `job`: no worker pools.
_PACKAGE_JOB = json.dumps({
    "python_module": "tfdist.train",
    "package_uris": ["gs://my-bucket/tfdist-0.1.0.tar.gz"],
    "job_args": ["--model_dir=gs://my-bucket/run"]})


def _job_spec(pool2, *, snake_case=False):
  pools = [dict(_TRAINER_POOL, replicaCount="1"),
           dict(_TRAINER_POOL, replicaCount="2"), pool2]
  spec = {"workerPoolSpecs": pools,
          "baseOutputDirectory": {"outputUriPrefix": "gs://my-bucket/run"}}
  if snake_case:
    # The Python client's field names.
    spec = json.loads(json.dumps(spec).replace(
        "workerPoolSpecs", "worker_pool_specs").replace(
            "containerSpec", "container_spec").replace(
                "imageUri", "image_uri"))
  return spec


def _cluster_spec(job, task_type="workerpool0", index=0):
  return json.dumps({"cluster": _CLUSTER, "environment": "cloud",
                     "task": {"type": task_type, "index": index, "trial": ""},
                     "job": job})


PS_JOB = _cluster_spec(_job_spec(_PS_POOL))
PS_JOB_PACKAGE = _cluster_spec(_PACKAGE_JOB)
REDUCTION_SERVER_JOB = _cluster_spec(_job_spec(_REDUCTION_SERVER_POOL))


class ImageTest(parameterized.TestCase):

  @parameterized.parameters(
      cluster_lib.REDUCTION_SERVER_IMAGE,
      "us-docker.pkg.dev/vertex-ai-restricted/training/reductionserver",
      "europe-docker.pkg.dev/vertex-ai-restricted/training/reductionserver:v2",
      "us-docker.pkg.dev/vertex-ai-restricted/training/reductionserver@sha256:"
      + "0" * 64,
  )
  def test_reduction_server_images(self, image):
    self.assertTrue(cluster_lib.is_reduction_server_image(image))

  @parameterized.parameters(
      "us-docker.pkg.dev/vertex-ai/training/tf-gpu.2-17.py310:latest",
      "example.com/vertex-ai-restricted/training/reductionserver:latest",
      "us-docker.pkg.dev/vertex-ai-restricted/training/reductionserver-x",
      "", None,
  )
  def test_other_images(self, image):
    self.assertFalse(cluster_lib.is_reduction_server_image(image))


def _counts(env, reduction_server=False):
  """(source, workers, ps) of the cluster `auto` counts, for `env`."""
  cluster = cluster_lib.resolve_cluster(environ=env,
                                        reduction_server=reduction_server)
  config = TrainConfig(model_dir="/m", train_steps=1,
                       distribution_strategy="one_device")
  inventory = auto_select.take_inventory(
      auto_select.SelectOptions(
          strategy=config.strategy, precision=config.precision),
      cluster=cluster)
  return (inventory.cluster_source, inventory.cluster_workers,
          inventory.cluster_ps)


def _make_strategy(config, env):
  """As the binary does: environment, cluster, decision, then the factory."""
  prepared = experiment.prepare_run(
      config, environment=environment_lib.read_environment(env))
  return backend_registry.make_strategy(
      strategy_lib.StrategyOptions.of(
          prepared.config.strategy, prepared.decisions,
          reduction_server=prepared.config.cloud.reduction_server),
      cluster=prepared.cluster)


class ClusterSpecTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("ps_job", PS_JOB),
      ("ps_job_package_description", PS_JOB_PACKAGE),
  )
  def test_pool2_is_ps(self, spec):
    info = cluster_lib.resolve_cluster(environ={"CLUSTER_SPEC": spec})
    self.assertEqual(info.num_ps, 2)
    self.assertEqual(info.num_workers, 3)
    self.assertEqual(info.reduction_server_replicas, 0)
    self.assertEqual(_counts({"CLUSTER_SPEC": spec}),
                     ("CLUSTER_SPEC", 3, 2))

  @parameterized.named_parameters(
      ("camel_case_object", _job_spec(_REDUCTION_SERVER_POOL)),
      ("snake_case_object", _job_spec(_REDUCTION_SERVER_POOL,
                                      snake_case=True)),
      ("json_string", json.dumps(_job_spec(_REDUCTION_SERVER_POOL))),
      ("custom_job_resource",
       {"displayName": "tfdist", "jobSpec": _job_spec(_REDUCTION_SERVER_POOL)}),
  )
  def test_pool2_runs_reduction_server(self, job):
    spec = _cluster_spec(job, "workerpool1", 1)
    info = cluster_lib.resolve_cluster(environ={"CLUSTER_SPEC": spec})
    self.assertEqual((info.task_type, info.task_index), ("worker", 1))
    self.assertEqual(dict(info.cluster),
                     {"chief": tuple(_CLUSTER["workerpool0"]),
                      "worker": tuple(_CLUSTER["workerpool1"])})
    self.assertEqual(info.num_ps, 0)
    self.assertEqual(info.reduction_server_replicas, 2)
    self.assertIn("2 Reduction Server replica(s)", info.describe())
    self.assertEqual(_counts({"CLUSTER_SPEC": spec}),
                     ("CLUSTER_SPEC", 3, 0))

  def test_flag_marks_pool2_when_the_job_names_no_pools(self):
    env = {"CLUSTER_SPEC": PS_JOB_PACKAGE}
    info = cluster_lib.resolve_cluster(environ=env, reduction_server=True)
    self.assertEqual((info.num_ps, info.reduction_server_replicas), (0, 2))
    self.assertEqual(_counts(env, reduction_server=True),
                     ("CLUSTER_SPEC", 3, 0))

  def test_tf_config_ps_is_the_reduction_server(self):
    # Vertex sets TF_CONFIG too, with pool 2 as `ps`; TF_CONFIG wins, and the
    # job description in CLUSTER_SPEC still marks pool 2.
    tf_config = json.dumps({
        "cluster": {"chief": _CLUSTER["workerpool0"],
                    "worker": _CLUSTER["workerpool1"],
                    "ps": _CLUSTER["workerpool2"]},
        "task": {"type": "chief", "index": 0}, "environment": "cloud"})
    env = {"TF_CONFIG": tf_config, "CLUSTER_SPEC": REDUCTION_SERVER_JOB}
    info = cluster_lib.resolve_cluster(environ=env)
    self.assertEqual(info.source, "TF_CONFIG")
    self.assertEqual((info.num_workers, info.num_ps), (3, 0))
    self.assertEqual(_counts(env), ("TF_CONFIG", 3, 0))
    # Without the marker it is a parameter-server cluster.
    plain = cluster_lib.resolve_cluster(environ={"TF_CONFIG": tf_config})
    self.assertEqual(plain.num_ps, 2)

  def test_task_in_reduction_server_pool_is_an_error(self):
    spec = _cluster_spec(_job_spec(_REDUCTION_SERVER_POOL), "workerpool2", 0)
    with self.assertRaisesRegex(
        errors.ClusterConfigError,
        "this task is ps 0, but worker pool 2 runs Vertex AI's Reduction "
        "Server"):
      cluster_lib.resolve_cluster(environ={"CLUSTER_SPEC": spec})


class AutoTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("ps_job", PS_JOB, "parameter_server"),
      ("reduction_server_job", REDUCTION_SERVER_JOB, "multi_worker_mirrored"),
  )
  def test_auto_strategy(self, spec, expected):
    config = TrainConfig(model_dir="/m", train_steps=1)
    cluster = cluster_lib.resolve_cluster(environ={"CLUSTER_SPEC": spec})
    options = auto_select.SelectOptions(
        strategy=config.strategy, precision=config.precision,
        dtype_defaulted="dtype" in config.defaulted)
    inventory = auto_select.take_inventory(options, cluster=cluster)
    self.assertEqual(auto_select.decide_strategy(inventory)[0], expected)
    self.assertEqual(auto_select.resolve(options, cluster=cluster).strategy,
                     expected)


class StrategyTest(absltest.TestCase):

  def _config(self, **kwargs):
    return TrainConfig(model_dir="/m", train_steps=1, **kwargs)

  def test_config_rules(self):
    from tfdist.backends import registry as backend_registry  # pylint: disable=g-import-not-at-top
    with self.assertRaisesRegex(errors.ConfigError, "--reduction_server needs "
                                "--distribution_strategy=multi_worker_mirrored"):
      # The strategy's rule: its backend's, run as the run is prepared.
      backend_registry.check_strategy_rules(self._config(
          reduction_server=True, distribution_strategy="parameter_server"))
    with self.assertRaisesRegex(
        errors.ConfigError, "implies --all_reduce_alg=nccl"):
      self._config(reduction_server=True, all_reduce_alg="ring")

  def test_refused_without_gpus(self):
    # auto picks multi_worker_mirrored for the reduction-server job, then
    # refuses: NCCL needs GPUs (this machine has none). Nothing connects.
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"Reduction Server \(CLUSTER_SPEC's job description "
        r"runs it in worker pool 2\) needs GPU workers"):
      _make_strategy(self._config(), {"CLUSTER_SPEC": REDUCTION_SERVER_JOB})

  def test_flag_needs_a_cluster(self):
    with self.assertRaisesRegex(
        errors.ConfigError, "--reduction_server needs a multi-worker cluster"):
      # auto on one process resolves to one_device.
      _make_strategy(self._config(reduction_server=True), {})

  def test_binary_refuses_flag_without_gpus(self):
    proc = testutil.run_module(
        "tfdist.train",
        [f"--model_dir={testutil.scratch_dir()}", "--train_steps=1",
         "--reduction_server"],
        env={"CLUSTER_SPEC": PS_JOB_PACKAGE, "TF_CONFIG": ""}, timeout=120)
    self.assertNotEqual(proc.returncode, 0)
    self.assertIn("Vertex AI's Reduction Server (--reduction_server) needs "
                  "GPU workers", proc.stdout)


if __name__ == "__main__":
  absltest.main()
