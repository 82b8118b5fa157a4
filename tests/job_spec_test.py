"""`python -m tfdist.job_spec`: Vertex CustomJobs and Kubeflow TFJobs.

Every spec is checked by the real validators (google-cloud-aiplatform's
protobuf types, the Kubeflow training SDK's models, tfdist's own flag
parser), and each validator is shown to reject what a hand-written toy
would let through.
"""

import contextlib
import copy
import io
import json
import os
import subprocess
import sys
import types

from absl import flags
from absl import logging
from absl.testing import absltest
from absl.testing import parameterized

from tests import testutil
from tfdist import errors
from tfdist import job_spec
from tfdist.distribute import cluster as cluster_lib

_PACKAGE = "gs://my-bucket/tfdist-0.1.0.tar.gz"
_TRAIN = ("--model_dir=gs://my-bucket/run", "--train_steps=1000",
          "--train_files=gs://my-bucket/data/train-*.tfrecord.gz",
          "--eval_files=gs://my-bucket/data/test-*.tfrecord.gz")


def _options(**overrides):
  values = {name: flag.default
            for name, flag in job_spec._FLAGS._flags().items()}  # pylint: disable=protected-access
  values.update(package_uris=[_PACKAGE], image="example.com/tfdist:0.1")
  values.update(overrides)
  return types.SimpleNamespace(**values)


def _run_binary(args) -> subprocess.CompletedProcess:
  """`python -m tfdist.job_spec args`, stdout and stderr apart."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  env["PYTHONPATH"] = testutil.REPO_ROOT + os.pathsep + env.get(
      "PYTHONPATH", "")
  return subprocess.run([sys.executable, "-m", "tfdist.job_spec", *args],
                        cwd=testutil.REPO_ROOT, env=env, text=True,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        timeout=120)


def _run_main(args):
  """`tfdist.job_spec.main` in this process, with the arguments `python -m
  tfdist.job_spec args` gives it (no second Python and TensorFlow
  start-up); its flags and the log verbosity it sets are restored.

  Returns:
    What it wrote to stdout and to stderr.
  """
  out, err = io.StringIO(), io.StringIO()
  verbosity = logging.get_verbosity()
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      job_spec.main(["tfdist.job_spec", *args])
  finally:
    logging.set_verbosity(verbosity)
    job_spec._FLAGS.unparse_flags()  # pylint: disable=protected-access
  return out.getvalue(), err.getvalue()


def _vertex(train=_TRAIN, **overrides):
  return job_spec.build("vertex", _options(**overrides), list(train))


def _tfjob(train=_TRAIN, **overrides):
  return job_spec.build("kubernetes", _options(**overrides), list(train))


class VertexTest(absltest.TestCase):

  def test_multi_worker_mirrored(self):
    job = _vertex(worker_replicas=3, accelerator="NVIDIA_TESLA_T4:2")
    pools = job["jobSpec"]["workerPoolSpecs"]
    self.assertLen(pools, 2)
    self.assertEqual([p["replicaCount"] for p in pools], [1, 3])
    for pool in pools:
      package = pool["pythonPackageSpec"]
      self.assertEqual(package["pythonModule"], "tfdist.train")
      self.assertEqual(package["packageUris"], [_PACKAGE])
      self.assertEqual(package["executorImageUri"],
                       "us-docker.pkg.dev/vertex-ai/training/"
                       "tf-gpu.2-17.py310:latest")
      self.assertEqual(package["args"], list(_TRAIN))
      self.assertEqual(pool["machineSpec"]["acceleratorCount"], 2)

  def test_parameter_server_with_evaluator(self):
    job = _vertex(worker_replicas=2, num_ps=2, evaluator=True,
                  base_output_dir="gs://my-bucket/ps", train=(
                      "--dataset=movielens", "--train_steps=500",
                      "--train_files=gs://my-bucket/movielens/train-*",
                      "--eval_files=gs://my-bucket/movielens/test-*"))
    pools = job["jobSpec"]["workerPoolSpecs"]
    self.assertEqual([p["replicaCount"] for p in pools], [1, 2, 2, 1])
    self.assertEqual(pools[2]["machineSpec"], {"machineType": "n1-standard-4"})
    self.assertIn("tf-cpu.2-17", pools[2]["pythonPackageSpec"][
        "executorImageUri"])
    # No --model_dir: Vertex's AIP_* folders under the base output directory.
    configs = job_spec.validate_vertex_custom_job(job)
    self.assertEqual([i for i, _ in configs], [0, 1, 2, 3])
    self.assertEqual(configs[0][1].model_dir, "gs://my-bucket/ps/checkpoints/")
    self.assertEqual(configs[0][1].model, "ranking")

  def test_reduction_server(self):
    job = _vertex(worker_replicas=2, reduction_server_replicas=4,
                  accelerator="NVIDIA_L4:1")
    pools = job["jobSpec"]["workerPoolSpecs"]
    self.assertLen(pools, 3)
    self.assertEqual(pools[2], {
        "machineSpec": {"machineType": "n1-highcpu-16"}, "replicaCount": 4,
        "containerSpec": {"imageUri": cluster_lib.REDUCTION_SERVER_IMAGE}})
    self.assertIn("--reduction_server", pools[0]["pythonPackageSpec"]["args"])
    # The job description Vertex hands the replicas marks pool 2, so auto
    # picks multi_worker_mirrored there (tfdist.distribute.cluster).
    self.assertTrue(cluster_lib.reduction_server_in_job(job["jobSpec"]))

  def test_evaluator_beside_multi_worker_mirrored(self):
    job = _vertex(worker_replicas=2, evaluator=True)
    pools = job["jobSpec"]["workerPoolSpecs"]
    self.assertEqual([p.get("replicaCount") for p in pools], [1, 2, None, 1])
    self.assertEqual(pools[2], {})
    configs = job_spec.validate_vertex_custom_job(job)
    self.assertEqual([i for i, _ in configs], [0, 1, 3])

  def test_chief_workers_reduction_server_and_evaluator(self):
    job = _vertex(worker_replicas=2, reduction_server_replicas=2, evaluator=True,
                  accelerator="NVIDIA_L4:1")
    pools = job["jobSpec"]["workerPoolSpecs"]
    self.assertEqual([p["replicaCount"] for p in pools], [1, 2, 2, 1])
    self.assertEqual(pools[2]["containerSpec"]["imageUri"],
                     cluster_lib.REDUCTION_SERVER_IMAGE)
    self.assertEqual(pools[3]["machineSpec"]["acceleratorType"], "NVIDIA_L4")
    configs = job_spec.validate_vertex_custom_job(job)
    self.assertEqual([i for i, _ in configs], [0, 1, 3])
    self.assertTrue(all(c.reduction_server for _, c in configs))

  def test_spec_only_is_the_job_spec(self):
    job = _vertex(worker_replicas=1)
    self.assertEqual(_vertex(worker_replicas=1, spec_only=True), job["jobSpec"])

  def test_binary_prints_the_spec_and_the_machines(self):
    # The binary's main (its exit status and wiring: the refusal below).
    out, err = _run_main(["vertex", "--worker_replicas=1",
                          f"--package_uris={_PACKAGE}", "--", *_TRAIN])
    job = json.loads(out)
    self.assertEqual(job, _vertex(worker_replicas=1))
    self.assertEqual(err, "tfdist.job_spec: vertex job of 2 machines: "
                     "1 chief, 1 worker; 2 of them train "
                     "(multi_worker_mirrored)\n")

  def test_num_workers_is_refused_naming_worker_replicas(self):
    # tfdist.launch --num_workers=2 is two processes; here 2 meant three.
    with self.assertRaisesRegex(
        errors.JobSpecError,
        r"--num_workers=2 is not a tfdist.job_spec flag: give "
        r"--worker_replicas, the workers besides the chief .* "
        r"--worker_replicas=1 makes 2 machines that train \(the chief and 1 "
        r"worker\), as tfdist.launch --num_workers=2 does; "
        r"--worker_replicas=2 makes 3\."):
      _vertex(num_workers=2)
    proc = _run_binary(["kubernetes", "--image=example.com/tfdist:0.1",
                        "--num_workers=2", "--", *_TRAIN])
    # Bad input: status 2 (tfdist.errors.CONFIG), as tfdist.train's; it
    # was 1, the status of divergence and bugs.
    self.assertEqual(proc.returncode, 2)
    self.assertEqual(proc.stdout, "")
    self.assertIn("tfdist.job_spec: error: --num_workers=2 is not a "
                  "tfdist.job_spec flag: give --worker_replicas", proc.stderr)

  def test_the_plan_states_the_machine_count(self):
    for plan, line in (
        (job_spec.JobPlan(), "1 machine: 1 chief; 1 of them train "
         "(one_device)"),
        (job_spec.JobPlan(num_workers=2, num_ps=1, evaluator=True),
         "5 machines: 1 chief, 2 workers, 1 parameter server, 1 evaluator; "
         "2 of them train (parameter_server)")):
      with self.subTest(line=line):
        self.assertEqual(plan.describe(), line)


class VertexFormsTest(absltest.TestCase):
  """The same job for each client: REST, the Python SDK, gcloud's config."""

  def _job(self, **overrides):
    return _vertex(worker_replicas=2, reduction_server_replicas=2,
                   evaluator=True, accelerator="NVIDIA_L4:1",
                   base_output_dir="gs://my-bucket/out", **overrides)

  def test_sdk_form_builds_an_aiplatform_custom_job_offline(self):
    from google.auth import credentials  # pylint: disable=g-import-not-at-top
    from google.cloud import aiplatform  # pylint: disable=g-import-not-at-top
    from google.protobuf import json_format  # pylint: disable=g-import-not-at-top
    rest = self._job()
    kwargs = self._job(form="sdk")
    self.assertEqual(kwargs["worker_pool_specs"][0]["machine_spec"],
                     {"machine_type": "n1-standard-8",
                      "accelerator_type": "NVIDIA_L4", "accelerator_count": 1})
    # Constructing sends nothing; project, location and bucket are the
    # caller's, anonymous credentials keep google.auth from looking for any.
    job = aiplatform.CustomJob(
        **kwargs, project="my-project", location="us-central1",
        staging_bucket="gs://my-bucket/staging",
        credentials=credentials.AnonymousCredentials())
    built = json_format.MessageToDict(job.job_spec._pb)  # pylint: disable=protected-access
    parsed = json_format.MessageToDict(json_format.Parse(
        json.dumps(rest["jobSpec"]), type(job.job_spec._pb)()))  # pylint: disable=protected-access
    self.assertEqual(built, parsed)
    self.assertEqual(job._gca_resource.display_name, "tfdist")  # pylint: disable=protected-access
    # The REST body itself is what the SDK refuses.
    with self.assertRaisesRegex(errors.JobSpecError,
                                "Unknown field for WorkerPoolSpec: "
                                "machineSpec"):
      job_spec.validate_vertex_sdk_kwargs(
          {"worker_pool_specs": rest["jobSpec"]["workerPoolSpecs"]}, rest)

  def test_gcloud_form_is_the_custom_job_spec_in_yaml(self):
    import yaml  # pylint: disable=g-import-not-at-top
    from google.cloud.aiplatform_v1.types import custom_job as types_lib  # pylint: disable=g-import-not-at-top
    from google.protobuf import json_format  # pylint: disable=g-import-not-at-top
    config = yaml.safe_load(job_spec.render(self._job(form="gcloud"), "yaml"))
    self.assertEqual(config, self._job()["jobSpec"])
    # camelCase CustomJobSpec fields, unknown ones refused.
    json_format.Parse(json.dumps(config), types_lib.CustomJobSpec.pb()(),
                      ignore_unknown_fields=False)

  def test_container_image_pools(self):
    job = self._job(package_uris=[],
                    container_image_uri="us-docker.pkg.dev/p/r/tfdist:0.1")
    pools = job["jobSpec"]["workerPoolSpecs"]
    for index in (0, 1, 3):
      self.assertEqual(pools[index]["containerSpec"]["command"],
                       ["python", "-m", "tfdist.train"])
      self.assertNotIn("pythonPackageSpec", pools[index])
    bad = copy.deepcopy(job)
    bad["jobSpec"]["workerPoolSpecs"][3]["containerSpec"]["args"].append(
        "--batch_size=0")
    with self.assertRaisesRegex(errors.JobSpecError,
                                r"workerPoolSpecs\[3\]: tfdist.train would "
                                "stop at start: --batch_size=0"):
      job_spec.validate_vertex_custom_job(bad)


class VertexRejectsTest(parameterized.TestCase):
  """What a toy validator would accept and google-cloud-aiplatform does not."""

  def _job(self):
    return _vertex(worker_replicas=1, accelerator="NVIDIA_TESLA_T4:1")

  def _pool0(self, job):
    return job["jobSpec"]["workerPoolSpecs"][0]

  @parameterized.named_parameters(
      ("misspelt_field", lambda j, p: p.update(replicaCnt=1),
       'no field named "replicaCnt"'),
      ("unknown_accelerator",
       lambda j, p: p["machineSpec"].update(acceleratorType="NVIDIA_GTX_1080"),
       "NVIDIA_GTX_1080"),
      ("two_chiefs", lambda j, p: p.update(replicaCount=2),
       r"workerPoolSpecs\[0\] \(the chief\) must have replicaCount 1"),
      ("no_module", lambda j, p: p["pythonPackageSpec"].pop("pythonModule"),
       "needs executorImageUri, packageUris and pythonModule"),
      ("local_package",
       lambda j, p: p["pythonPackageSpec"].update(packageUris=["dist/t.gz"]),
       "Vertex installs packages from Cloud Storage"),
      ("bad_train_flag",
       lambda j, p: p["pythonPackageSpec"]["args"].append("--batch_size=-4"),
       r"workerPoolSpecs\[0\]: tfdist.train would stop at start: "
       "--batch_size=-4"),
      ("no_data_in_prebuilt_container",
       lambda j, p: p["pythonPackageSpec"].update(args=[
           "--model_dir=gs://b/r", "--train_steps=5"]),
       "the prebuilt container has no raw data for --dataset=fashion_mnist"),
      ("reduction_server_in_pool_1",
       lambda j, p: j["jobSpec"]["workerPoolSpecs"].__setitem__(1, {
           "machineSpec": {"machineType": "n1-highcpu-16"},
           "replicaCount": 2, "containerSpec": {
               "imageUri": cluster_lib.REDUCTION_SERVER_IMAGE}}),
       r"runs in workerPoolSpecs\[2\], not workerPoolSpecs\[1\]"),
  )
  def test_rejects(self, change, pattern):
    job = copy.deepcopy(self._job())
    change(job, self._pool0(job))
    with self.assertRaisesRegex(errors.JobSpecError, pattern):
      job_spec.validate_vertex_custom_job(job)


class KubernetesTest(absltest.TestCase):

  def test_multi_worker_mirrored(self):
    job = _tfjob(worker_replicas=3, accelerator="NVIDIA_TESLA_T4:2")
    specs = job["spec"]["tfReplicaSpecs"]
    self.assertEqual(list(specs), ["Chief", "Worker"])
    self.assertEqual([s["replicas"] for s in specs.values()], [1, 3])
    for spec in specs.values():
      self.assertEqual(spec["restartPolicy"], "ExitCode")
      (container,) = spec["template"]["spec"]["containers"]
      self.assertEqual(container["name"], "tensorflow")
      self.assertEqual(container["command"], ["python", "-m", "tfdist.train"])
      self.assertEqual(container["args"], list(_TRAIN))
      self.assertEqual(container["resources"]["limits"]["nvidia.com/gpu"], "2")

  def test_parameter_server_with_evaluator(self):
    job = _tfjob(worker_replicas=2, num_ps=2, evaluator=True, name="ranking",
                 namespace="ml")
    specs = job["spec"]["tfReplicaSpecs"]
    self.assertEqual(list(specs), ["Chief", "Worker", "PS", "Evaluator"])
    self.assertEqual([s["replicas"] for s in specs.values()], [1, 2, 2, 1])
    self.assertEqual(job["metadata"], {"name": "ranking", "namespace": "ml"})
    configs = job_spec.validate_tfjob(job)
    self.assertLen(configs, 4)

  def test_binary_prints_yaml(self):
    out, _ = _run_main(["kubernetes", "--image=example.com/tfdist:0.1",
                        "--worker_replicas=1", "--", *_TRAIN])
    import yaml  # pylint: disable=g-import-not-at-top
    self.assertEqual(yaml.safe_load(out), _tfjob(worker_replicas=1))


_VALUES = """\
volumes:
- name: data
  persistentVolumeClaim: {claimName: fashion-mnist}
- name: dshm
  emptyDir: {medium: Memory}
volumeMounts:
- {name: data, mountPath: /data, readOnly: true}
- {name: dshm, mountPath: /dev/shm}
tolerations:
- {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
env:
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
replicaTypes:
  PS:
    tolerations: []
"""


class TfJobPodsTest(absltest.TestCase):
  """A TFJob a cluster can run: resources, credentials, variables, volumes,
  node selectors and tolerations, read back by the kubernetes client."""

  def test_values_file_and_flags(self):
    from kubernetes import client as k8s  # pylint: disable=g-import-not-at-top
    values = testutil.scratch_dir() + "/values.yaml"
    with open(values, "w") as f:
      f.write(_VALUES)
    job = _tfjob(worker_replicas=2, num_ps=1, evaluator=True,
                 accelerator="NVIDIA_L4:1", values=values,
                 service_account="tfdist-trainer", cpu="4", memory="16Gi",
                 ps_cpu="2", ps_memory="8Gi",
                 env=["GOOGLE_CLOUD_PROJECT=my-project"],
                 node_selector=["cloud.google.com/gke-nodepool=train"])
    self.assertLen(job_spec.validate_tfjob(job), 4)
    api = k8s.ApiClient()
    specs = job["spec"]["tfReplicaSpecs"]

    def pod(kind):
      class _Response:  # pylint: disable=too-few-public-methods
        data = json.dumps(specs[kind]["template"])
      return api.deserialize(_Response(), "V1PodTemplateSpec").spec

    for kind in ("Chief", "Worker", "PS", "Evaluator"):
      self.assertEqual(specs[kind]["restartPolicy"], "ExitCode")
      spec = pod(kind)
      (container,) = spec.containers
      self.assertEqual(spec.service_account_name, "tfdist-trainer")
      self.assertEqual(spec.node_selector,
                       {"cloud.google.com/gke-nodepool": "train"})
      self.assertEqual([v.name for v in spec.volumes], ["data", "dshm"])
      self.assertEqual([(m.name, m.mount_path) for m in
                        container.volume_mounts],
                       [("data", "/data"), ("dshm", "/dev/shm")])
      self.assertEqual([e.name for e in container.env],
                       ["POD_NAME", "GOOGLE_CLOUD_PROJECT"])
      self.assertEqual(container.env[1].value, "my-project")
      gpu = {} if kind == "PS" else {"nvidia.com/gpu": "1"}
      amounts = ({"cpu": "2", "memory": "8Gi"} if kind == "PS" else
                 {"cpu": "4", "memory": "16Gi"})
      self.assertEqual(container.resources.requests, amounts)
      self.assertEqual(container.resources.limits, {**amounts, **gpu})
      self.assertEqual([t.key for t in spec.tolerations or []],
                       [] if kind == "PS" else ["nvidia.com/gpu"])

  def test_rejects(self):
    cases = (
        (dict(memory="16GB"), r"resources.requests.memory='16GB' is not a "
         "Kubernetes quantity"),
        (dict(env=["PROJECT"]), "--env='PROJECT': give KEY=VALUE"),
        (dict(env=["1PROJECT=x"]), "env name '1PROJECT' is not a valid"),
    )
    for overrides, pattern in cases:
      with self.assertRaisesRegex(errors.JobSpecError, pattern):
        _tfjob(worker_replicas=1, **overrides)
    for text, pattern in (
        ("restartPolicy: Always\n", "unknown key.*restartPolicy.*The "
         "restart policy is tfdist's"),
        ("volumeMounts: [{name: data, mountPath: /data}]\n",
         "volumeMounts 'data' names no volume of the pod"),
        ("resources: {requests: {cpu: '8'}, limits: {cpu: '4'}}\n",
         "resources.requests.cpu exceeds resources.limits.cpu"),
        ("tolerations: [{key: a, operator: Has}]\n",
         "toleration operator 'Has'"),
        ("nodeSelectr: {a: b}\n", "unknown key.*nodeSelectr"),
        ("replicaTypes: {Coordinator: {}}\n",
         "replicaTypes.Coordinator: unknown replica type"),
        ("volumes: [{name: data, persistentVolumeClam: {}}]\n",
         r"unknown field\(s\) spec.tfReplicaSpecs.Chief.template.spec."
         r"volumes\[0\].persistentVolumeClam"),
    ):
      values = testutil.scratch_dir() + "/values.yaml"
      with open(values, "w") as f:
        f.write(text)
      with self.assertRaisesRegex(errors.JobSpecError, pattern):
        _tfjob(worker_replicas=1, values=values)


class TfJobRejectsTest(parameterized.TestCase):
  """What a toy validator would accept and the Kubeflow SDK/CRD do not."""

  def _container(self, job, kind="Chief"):
    return job["spec"]["tfReplicaSpecs"][kind]["template"]["spec"][
        "containers"][0]

  @parameterized.named_parameters(
      ("misspelt_container_field",
       lambda j, c: c.update(imagePullPolicyy="Always"),
       "unknown field.*imagePullPolicyy"),
      ("no_run_policy", lambda j, c: j["spec"].pop("runPolicy"),
       "`run_policy`, must not be `None`"),
      ("renamed_container", lambda j, c: c.update(name="trainer"),
       "no container named 'tensorflow'"),
      ("two_chiefs",
       lambda j, c: j["spec"]["tfReplicaSpecs"]["Chief"].update(replicas=2),
       "exactly one Chief"),
      ("bad_restart_policy",
       lambda j, c: j["spec"]["tfReplicaSpecs"]["Chief"].update(
           restartPolicy="Sometimes"), "restartPolicy 'Sometimes'"),
      ("bad_name", lambda j, c: j["metadata"].update(name="My_Job"),
       "DNS-1035"),
      ("unknown_replica_type",
       lambda j, c: j["spec"]["tfReplicaSpecs"].update(
           Coordinator=j["spec"]["tfReplicaSpecs"]["Chief"]),
       "Coordinator: unknown replica type"),
      ("bad_train_flag", lambda j, c: c["args"].append("--dtype=fp8"),
       "TFJob Chief: tfdist.train rejects its flags: .*--dtype=fp8"),
  )
  def test_rejects(self, change, pattern):
    job = copy.deepcopy(_tfjob(worker_replicas=1))
    change(job, self._container(job))
    with self.assertRaisesRegex(errors.JobSpecError, pattern):
      job_spec.validate_tfjob(job)


class PlanAndFlagsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("ps_and_reduction_server",
       dict(worker_replicas=1, num_ps=1, reduction_server_replicas=1),
       "either parameter servers or the Reduction Server"),
      ("reduction_server_on_cpus",
       dict(worker_replicas=1, reduction_server_replicas=2),
       "--reduction_server_replicas needs GPU workers"),
      ("ps_without_workers", dict(num_ps=1), "needs --worker_replicas >= 1"),
  )
  def test_bad_plans(self, overrides, pattern):
    with self.assertRaisesRegex(errors.JobSpecError, pattern):
      _vertex(**overrides)

  def test_evaluator_reads_the_chiefs_checkpoints_from_shared_storage(self):
    with self.assertRaisesRegex(
        errors.JobSpecError, "--model_dir=/tmp/run is a folder on each "
        "replica's own disk, but the evaluator reads the chief's"):
      _tfjob(evaluator=True, train=_TRAIN[1:] + ("--model_dir=/tmp/run",))
    specs = _tfjob(evaluator=True)["spec"]["tfReplicaSpecs"]
    self.assertEqual(list(specs), ["Chief", "Evaluator"])

  @parameterized.named_parameters(
      ("one_machine_strategy", ("--model_dir=gs://b/r",
                                "--distribution_strategy=mirrored"),
       "runs on one machine; this job has 3 training replicas"),
      ("worker_hosts", ("--model_dir=gs://b/r", "--worker_hosts=a:1,b:1",
                        "--task_index=0"), "--worker_hosts is set"),
      ("local_model_dir", ("--model_dir=/tmp/run",),
       "--model_dir=/tmp/run is a folder on each replica's own disk"),
      ("no_model_dir", (), "--model_dir is required"),
      ("positional", ("--model_dir=gs://b/r", "extra"), "is not a flag"),
  )
  def test_train_flags_checked_against_the_job(self, extra, pattern):
    train = tuple(a for a in _TRAIN if not a.startswith("--model_dir"))
    self.assertLen(train, 3)
    with self.assertRaisesRegex(errors.JobSpecError, pattern):
      _tfjob(worker_replicas=2, train=train + extra)

  def test_every_train_flag_passes_through(self):
    # Any flag tfdist.train defines is accepted, with its own validators,
    # and the global FLAGS are left alone.
    config = job_spec.parse_train_flags(
        ["--model_dir=gs://b/r", "--train_steps=7", "--hptune_metric=eval_loss",
         "--loss_scale=dynamic", "--dtype=fp16"], where="test")
    self.assertEqual((config.train_steps, config.hptune_metric),
                     (7, "eval_loss"))
    self.assertNotEqual(flags.FLAGS["train_steps"].value, 7)
    # A metric tfdist's model for the data set does not evaluate.
    with self.assertRaisesRegex(
        errors.JobSpecError, "--hptune_metric=eval_auc: this model's "
        "evaluation reports eval_loss, eval_accuracy"):
      job_spec.parse_train_flags(["--model_dir=gs://b/r", "--train_steps=1",
                                  "--hptune_metric=eval_auc"], where="test")
    with self.assertRaisesRegex(errors.JobSpecError,
                                "--loss_scale must be 'dynamic'"):
      job_spec.parse_train_flags(["--model_dir=/m", "--train_steps=1",
                                  "--loss_scale=zero"], where="test")


if __name__ == "__main__":
  absltest.main()
