"""Validated job specs: a Vertex AI CustomJob or a Kubeflow TFJob for tfdist.

Usage:
  python -m tfdist.job_spec vertex --num_workers=N [--num_ps=M] [--evaluator]
      [--reduction_server_replicas=R] [--machine_type=TYPE]
      [--accelerator=TYPE[:COUNT]] --package_uris=gs://.../tfdist-X.tar.gz
      [--base_output_dir=gs://...] [--form=rest|sdk|gcloud]
      -- <tfdist.train flags>
  python -m tfdist.job_spec kubernetes --image=IMAGE --num_workers=N
      [--num_ps=M] [--evaluator] [--accelerator=TYPE[:COUNT]]
      [--cpu=4 --memory=16Gi] [--service_account=SA] [--env=NAME=VALUE]
      [--node_selector=KEY=VALUE] [--values=values.yaml]
      -- <tfdist.train flags>

The spec is printed (JSON for Vertex, YAML for Kubernetes); nothing is sent
anywhere. The job has one chief, `--num_workers` workers, either
`--num_ps` parameter servers or, on Vertex, `--reduction_server_replicas`
Reduction Server replicas, and with `--evaluator` tfdist's side-car
evaluator (under every strategy: it evaluates each checkpoint the chief
writes).

* Vertex AI: a `CustomJob`, in the form `--form` names for the client that
  sends it (`VERTEX_FORMS`): `rest` (default), the REST body of
  `projects.locations.customJobs` (camelCase JSON); `sdk`, the keyword
  arguments of the Python SDK's `aiplatform.CustomJob(...)`
  (`display_name`, `worker_pool_specs` in snake_case, `base_output_dir`;
  JSON); `gcloud`, the `CustomJobSpec` that `gcloud ai custom-jobs create
  --config=config.yaml` reads (camelCase YAML; the display name and region
  go on gcloud's command line). `--spec_only` prints the REST body's
  `jobSpec`. Worker pools in Vertex's order: 0 chief (1 replica), 1
  workers, 2 parameter servers or the Reduction Server, 3 evaluator; empty
  pools in between are `{}`. Each tfdist pool is a `pythonPackageSpec`
  running `tfdist.train` on the prebuilt TensorFlow image
  (`PREBUILT_TF_IMAGES`; tf-gpu when `--accelerator` is given), or with
  `--container_image_uri` a `containerSpec` running `python -m
  tfdist.train` in that image (e.g. one built from the repository's
  Dockerfile).
* Kubernetes: a Kubeflow `TFJob` (training operator, `kubeflow.org/v1`) with
  `Chief`, `Worker`, `PS` and `Evaluator` replica specs, each a container
  named `tensorflow` running `python -m tfdist.train` (with the
  resources, service account, environment, volumes, node selector and
  tolerations of `--values` and the flags, `PodOptions`), and
  `restartPolicy: ExitCode`: the operator restarts a replica that exits with
  a retryable code (128-255: killed by a signal, e.g. 137 for SIGKILL or an
  out-of-memory kill, 143 for SIGTERM, which tfdist returns after its
  preemption checkpoint) and fails the job on a permanent one (1-127: tfdist
  exits 2 on invalid flags or configuration, 1 on divergence or a bug). That split is the assumption
  tfdist's exit codes are held to.

Validation, before printing (each raises `JobSpecError` naming the field):
* the Vertex spec is parsed with google-cloud-aiplatform's own protobuf type
  (`google.cloud.aiplatform_v1.types.CustomJob`) with unknown fields
  rejected, then checked for what the API requires (display name, pool 0
  with exactly one replica, a machine type and one task per pool, valid
  accelerator types); the `sdk` form's pools are built as the SDK's
  `aiplatform_v1.types.WorkerPoolSpec`s (what `aiplatform.CustomJob` does
  with them) and must equal the REST body's;
* the TFJob is deserialized with the Kubeflow training SDK's models
  (`kubeflow-training`: `KubeflowOrgV1TFJob`, which requires `runPolicy` and
  `tfReplicaSpecs`) and serialized back: a field the models do not know is an
  error; then the CRD's and the operator's rules are checked (replica types
  Chief/Master/Worker/PS/Evaluator, at most one Chief and one Evaluator, a
  container named `tensorflow` with an image in every replica, a known
  restart policy), and each pod template is read with the `kubernetes`
  client's `V1PodTemplateSpec` and checked as the API server would
  (quantities, requests within limits, mounts of declared volumes,
  tolerations);
* the train flags of every tfdist pool are parsed with tfdist's own flag
  definitions (a fresh `absl.flags.FlagValues`, then
  `flags.flags_to_config`), under the environment the job gives them
  (Vertex's `AIP_*` folders from `--base_output_dir`), and checked against
  the job's shape. Flags tfdist adds later (e.g. `--dry_run`) pass through
  as any other flag.

Both validators need their packages (`pip install 'tfdist[jobspec]'`); they
are not needed to run training.
"""

import copy
import dataclasses
import json
import os
import re
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from absl import app
from absl import flags
from absl import logging

from tfdist import cluster as cluster_lib
from tfdist import environment as environment_lib
from tfdist import flags as tfdist_flags
from tfdist import quiet_tensorflow
from tfdist.config import ConfigError
from tfdist.strategy_kind import StrategyKind

# The validators' packages (google-cloud-aiplatform, kubeflow-training,
# kubernetes) and PyYAML are optional (the jobspec extra): each is imported
# in the function that needs it.

PLATFORMS = ("vertex", "kubernetes")
# The forms a Vertex CustomJob is printed in, by the client that takes it.
VERTEX_FORMS = ("rest", "sdk", "gcloud")
TRAIN_MODULE = "tfdist.train"
# Vertex AI's prebuilt TensorFlow training images by TensorFlow version:
# the Python version in the image's name. TF 2.17 on Python 3.10 is the
# newest prebuilt training container; tfdist supports TF 2.17 and 2.21.
PREBUILT_TF_IMAGES = {"2.17": "py310"}
PREBUILT_IMAGE_FORMAT = (
    "us-docker.pkg.dev/vertex-ai/training/tf-{kind}.{version}.{python}:latest")
# Kubeflow training operator: replica types, the container it configures,
# restart policies (kubeflow.org/v1 common types).
TFJOB_REPLICA_TYPES = ("Chief", "Master", "Worker", "PS", "Evaluator")
TFJOB_CONTAINER = "tensorflow"
TFJOB_RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
# Vertex sets these from baseOutputDirectory (Vertex AI documentation).
_AIP_FOLDERS = (("AIP_MODEL_DIR", "model/"),
                ("AIP_CHECKPOINT_DIR", "checkpoints/"),
                ("AIP_TENSORBOARD_LOG_DIR", "logs/"))


class JobSpecError(ConfigError):
  """The job description or its train flags are invalid; names the field."""


# --- the job's shape ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class JobPlan:
  """The cluster a job asks for, independent of the platform.

  Attributes:
    num_workers: worker replicas besides the chief (Vertex pool 1, TFJob
      `Worker`).
    num_ps: parameter-server replicas (pool 2, `PS`).
    evaluator: one evaluator replica (pool 3, `Evaluator`): tfdist's
      side-car evaluator (`--mode=continuous_eval` by itself), which
      evaluates each checkpoint the chief writes, under every strategy.
    reduction_server_replicas: Vertex AI Reduction Server replicas (pool 2).
    machine_type: Compute Engine machine type of the chief, workers and
      evaluator (Vertex).
    accelerator_type: e.g. `NVIDIA_TESLA_T4` ('' for none).
    accelerator_count: accelerators per chief/worker/evaluator replica.
    ps_machine_type: machine type of the parameter servers (Vertex).
    reduction_server_machine_type: machine type of the Reduction Server
      replicas (Vertex; CPU machines).
    train_args: the `tfdist.train` flags every tfdist replica runs with.
  """
  num_workers: int = 0
  num_ps: int = 0
  evaluator: bool = False
  reduction_server_replicas: int = 0
  machine_type: str = "n1-standard-8"
  accelerator_type: str = ""
  accelerator_count: int = 0
  ps_machine_type: str = "n1-standard-4"
  reduction_server_machine_type: str = "n1-highcpu-16"
  train_args: Tuple[str, ...] = ()

  def __post_init__(self):
    need = _need
    need(self.num_workers >= 0,
         f"--num_workers={self.num_workers} must be >= 0 (workers besides "
         "the chief).")
    need(self.num_ps >= 0, f"--num_ps={self.num_ps} must be >= 0.")
    need(self.reduction_server_replicas >= 0,
         f"--reduction_server_replicas={self.reduction_server_replicas} must "
         "be >= 0.")
    need(not (self.num_ps and self.reduction_server_replicas),
         f"--num_ps={self.num_ps} and --reduction_server_replicas="
         f"{self.reduction_server_replicas}: worker pool 2 holds either "
         "parameter servers or the Reduction Server. Give one.")
    need(not self.num_ps or self.num_workers >= 1,
         f"--num_ps={self.num_ps} needs --num_workers >= 1: under "
         "parameter_server the chief only coordinates; workers train.")
    need(not self.reduction_server_replicas or self.num_workers >= 1,
         "--reduction_server_replicas needs --num_workers >= 1: the "
         "Reduction Server all-reduces between workers.")
    need(not self.reduction_server_replicas or self.accelerator_count > 0,
         "--reduction_server_replicas needs GPU workers (it serves NCCL "
         "all-reduce): give --accelerator=TYPE:COUNT, e.g. "
         "--accelerator=NVIDIA_TESLA_T4:1.")
    need(bool(self.accelerator_type) == (self.accelerator_count > 0),
         f"--accelerator: type {self.accelerator_type!r} and count "
         f"{self.accelerator_count} must be given together "
         "(--accelerator=TYPE:COUNT).")
    for name in ("machine_type", "ps_machine_type",
                 "reduction_server_machine_type"):
      need(bool(getattr(self, name).strip()), f"--{name} must not be empty.")
    for arg in self.train_args:
      need(arg.startswith("-"),
           f"train flag {arg!r} is not a flag: everything after `--` goes to "
           "tfdist.train as --name=value.")

  @property
  def strategy(self) -> StrategyKind:
    """The strategy `auto` picks for this cluster."""
    if self.num_ps:
      return StrategyKind.PARAMETER_SERVER
    if self.num_workers:
      return StrategyKind.MULTI_WORKER_MIRRORED
    return StrategyKind.ONE_DEVICE


def _need(cond, message):
  if not cond:
    raise JobSpecError(message)


def parse_accelerator(value: str) -> Tuple[str, int]:
  """`TYPE[:COUNT]` -> `(TYPE, COUNT)`; '' -> `('', 0)`.

  Raises:
    JobSpecError: COUNT is not a positive integer.
  """
  if not value:
    return "", 0
  kind, _, count = value.partition(":")
  count = count or "1"
  if not count.isdigit() or int(count) < 1:
    raise JobSpecError(
        f"--accelerator={value!r}: the count after ':' must be a positive "
        "integer, e.g. NVIDIA_TESLA_T4:2.")
  return kind.strip().upper(), int(count)


# --- train flags, through tfdist's own parser --------------------------------
def _train_flag_template() -> List[flags.Flag]:
  """tfdist.train's flags, defined once in the global FLAGS (copied from)."""
  global_flags = flags.FLAGS
  if "model_dir" not in global_flags:
    tfdist_flags.define_all_flags()
  module = tfdist_flags.definitions.__name__
  return list(global_flags.flags_by_module_dict()[module])


def parse_train_flags(args: Sequence[str], *, where: str,
                      environ: Optional[Dict[str, str]] = None):
  """Parses `tfdist.train` flags as the binary would; returns the config.

  A fresh `absl.flags.FlagValues` holds copies of tfdist.train's flag
  definitions (validators included); `flags.flags_to_config` then builds
  and validates the `TrainConfig`.

  Args:
    args: the flags, e.g. `["--model_dir=gs://b/run", "--train_steps=100"]`.
    where: the replica they belong to, for messages.
    environ: variables the job sets (e.g. Vertex's `AIP_MODEL_DIR`): the
      replica's environment, applied as the binary's edge applies it
      (`tfdist.environment`); this machine's own variables play no part.

  Returns:
    The `tfdist.config.TrainConfig` the replica would run with.

  Raises:
    JobSpecError: an unknown flag, a bad value, a positional argument, or an
      invalid configuration; the message names `where`.
  """
  values = flags.FlagValues()
  for flag in _train_flag_template():
    values[flag.name] = copy.deepcopy(flag)
  try:
    rest = values([TRAIN_MODULE, *args])
  except flags.Error as e:
    raise JobSpecError(f"{where}: tfdist.train rejects its flags: {e}") from None
  if len(rest) > 1:
    raise JobSpecError(f"{where}: tfdist.train takes no positional arguments;"
                       f" received {' '.join(rest[1:])}.")
  try:
    config = tfdist_flags.flags_to_config(values)
    config, _ = environment_lib.apply_environment(
        config, environment_lib.read_environment(environ or {}))
    config.require_model_dir()
    config.require_data_files()
    # The part of tfdist.train --dry_run that needs no access to the job's
    # files, cluster or devices: names that exist and fit together.
    quiet_tensorflow.import_tensorflow()  # The spec alone on stdout.
    # Imported only now: it imports TensorFlow, quietly after the line above.
    from tfdist import preflight  # pylint: disable=g-import-not-at-top
    preflight.check_names(config)
  except ConfigError as e:
    raise JobSpecError(f"{where}: tfdist.train would stop at start: {e}"
                       ) from None
  if config.dry_run:
    raise JobSpecError(
        f"{where}: --dry_run makes every replica check its flags and exit "
        "without training. Run python -m tfdist.train --dry_run with these "
        "flags where the job's data and --model_dir are reachable, and "
        "leave --dry_run out of the job spec.")
  return config


def check_train_config(config, plan: Optional[JobPlan], *, where: str,
                       shared_prefixes: Sequence[str] = (),
                       prebuilt_container: bool = False):
  """Checks a replica's config against the job's cluster.

  Args:
    config: the replica's `TrainConfig`.
    plan: the job (None: only the checks that need no plan).
    where: the replica, for messages.
    shared_prefixes: local paths that are shared storage (Vertex: `/gcs/`).
    prebuilt_container: the replica runs in Vertex's prebuilt image, which
      has neither Debian's Fashion-MNIST nor recbole's MovieLens files.

  Raises:
    JobSpecError: a strategy the cluster cannot run, `--worker_hosts` (the
      platform sets the cluster), a `--model_dir` local to one machine in
      a multi-replica job, or (prebuilt container) no `--train_files` and
      `--eval_files`.
  """
  if prebuilt_container:
    _need(config.train_files and config.eval_files,
          f"{where}: the prebuilt container has no raw data for "
          f"--dataset={config.dataset}: give --train_files and --eval_files "
          "(TFRecord globs on gs://, e.g. the files a local run converted "
          "under --data_dir, copied to a bucket).")
  if plan is None:
    return
  name = config.distribution_strategy
  # None: `auto`, which picks the strategy of the job's shape (`plan.strategy`).
  kind = None if name == "auto" else StrategyKind.parse(name)
  _need(not config.worker_hosts,
        f"{where}: --worker_hosts is set; the platform gives every replica "
        "its cluster (CLUSTER_SPEC/TF_CONFIG). Drop --worker_hosts and "
        "--task_index.")
  if plan.num_ps:
    _need(kind is None or kind.is_asynchronous,
          f"{where}: --distribution_strategy={name} cannot run a cluster "
          f"with {plan.num_ps} parameter server(s); use parameter_server or "
          "auto.")
  else:
    _need(kind is None or not kind.is_asynchronous,
          f"{where}: --distribution_strategy=parameter_server needs "
          "--num_ps >= 1.")
    if plan.num_workers:
      _need(kind in (None, StrategyKind.MULTI_WORKER_MIRRORED),
            f"{where}: --distribution_strategy={name} runs on one machine; "
            f"this job has {plan.num_workers + 1} training replicas. Use "
            "multi_worker_mirrored or auto.")
  if plan.num_workers or plan.num_ps or plan.evaluator:
    model_dir = config.model_dir
    readers = ("workers resume from" if plan.num_workers or plan.num_ps
               else "the evaluator reads")
    _need("://" in model_dir or model_dir.startswith(tuple(shared_prefixes)),
          f"{where}: --model_dir={model_dir} is a folder on each replica's "
          f"own disk, but {readers} the chief's checkpoints: use "
          "shared storage such as gs://BUCKET/run.")


# --- Vertex AI ---------------------------------------------------------------
def prebuilt_image(tf_version: str, *, gpu: bool) -> str:
  """Vertex AI's prebuilt TensorFlow training image for `tf_version`.

  Raises:
    JobSpecError: no prebuilt image is known for that version.
  """
  if tf_version not in PREBUILT_TF_IMAGES:
    raise JobSpecError(
        f"--tf_version={tf_version}: Vertex AI has no prebuilt TensorFlow "
        f"training image for it that tfdist knows. Known: "
        f"{', '.join(PREBUILT_TF_IMAGES)}; or give --executor_image_uri.")
  return PREBUILT_IMAGE_FORMAT.format(
      kind="gpu" if gpu else "cpu", version=tf_version.replace(".", "-"),
      python=PREBUILT_TF_IMAGES[tf_version])


def vertex_custom_job(plan: JobPlan, *, display_name: str,
                      package_uris: Sequence[str] = (),
                      tf_version: str = "2.17",
                      executor_image_uri: str = "",
                      base_output_dir: str = "",
                      container_image_uri: str = "") -> dict:
  """A Vertex AI `CustomJob` (REST JSON, camelCase) for `plan`.

  With Reduction Server replicas, `--reduction_server` is added to the train
  flags unless present (CLUSTER_SPEC may not describe the pools).

  Args:
    plan: the job's shape and train flags.
    display_name: the job's `displayName`.
    package_uris: gs:// URIs of tfdist's sdist, installed by Vertex into
      the prebuilt image (`pythonPackageSpec`).
    tf_version: the prebuilt image's TensorFlow version.
    executor_image_uri: another prebuilt image.
    base_output_dir: gs:// folder of Vertex's `AIP_*` folders.
    container_image_uri: an image with tfdist installed (e.g. built from
      the repository's Dockerfile): tfdist pools are then `containerSpec`s
      running `python -m tfdist.train`, and `package_uris` is unused.

  Returns:
    A JSON-serializable dict; check it with `validate_vertex_custom_job`.
  """
  args = list(plan.train_args)
  if plan.reduction_server_replicas and not any(
      a in ("--reduction_server", "--reduction_server=true") for a in args):
    args.append("--reduction_server")

  def machine(machine_type, accelerated):
    spec = {"machineType": machine_type}
    if accelerated and plan.accelerator_count:
      spec.update(acceleratorType=plan.accelerator_type,
                  acceleratorCount=plan.accelerator_count)
    return spec

  def tfdist_pool(replicas, machine_type, accelerated):
    if container_image_uri:
      return {"machineSpec": machine(machine_type, accelerated),
              "replicaCount": replicas,
              "containerSpec": {"imageUri": container_image_uri,
                                "command": ["python", "-m", TRAIN_MODULE],
                                "args": list(args)}}
    image = executor_image_uri or prebuilt_image(
        tf_version, gpu=accelerated and plan.accelerator_count > 0)
    return {"machineSpec": machine(machine_type, accelerated),
            "replicaCount": replicas,
            "pythonPackageSpec": {"executorImageUri": image,
                                  "packageUris": list(package_uris),
                                  "pythonModule": TRAIN_MODULE,
                                  "args": list(args)}}

  pools = [tfdist_pool(1, plan.machine_type, True)]
  pools.append(tfdist_pool(plan.num_workers, plan.machine_type, True)
               if plan.num_workers else {})
  if plan.num_ps:
    pools.append(tfdist_pool(plan.num_ps, plan.ps_machine_type, False))
  elif plan.reduction_server_replicas:
    pools.append({"machineSpec": {
        "machineType": plan.reduction_server_machine_type},
                  "replicaCount": plan.reduction_server_replicas,
                  "containerSpec": {
                      "imageUri": cluster_lib.REDUCTION_SERVER_IMAGE}})
  else:
    pools.append({})
  pools.append(tfdist_pool(1, plan.machine_type, True) if plan.evaluator
               else {})
  while pools and not pools[-1]:
    pools.pop()
  spec = {"workerPoolSpecs": pools}
  if base_output_dir:
    spec["baseOutputDirectory"] = {"outputUriPrefix": base_output_dir}
  return {"displayName": display_name, "jobSpec": spec}


def _snake_case(value):
  """`value` with every dict key from camelCase to snake_case (protobuf's
  field names, which the Python SDK's types take)."""
  if isinstance(value, dict):
    return {re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", k).lower():
            _snake_case(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_snake_case(v) for v in value]
  return value


def vertex_form(job: dict, form: str) -> dict:
  """The REST `CustomJob` `job` in the form a Vertex client takes.

  Args:
    job: the REST JSON of `vertex_custom_job`.
    form: one of `VERTEX_FORMS`: `rest` (`job` itself), `sdk` (keyword
      arguments of `google.cloud.aiplatform.CustomJob`: `display_name`,
      `worker_pool_specs` in snake_case, and `base_output_dir` when the job
      has one; the caller adds `project`, `location` and
      `staging_bucket`), or `gcloud` (the `CustomJobSpec` of `gcloud ai
      custom-jobs create --config`: the REST body's camelCase `jobSpec`).

  Raises:
    JobSpecError: an unknown form.
  """
  _need(form in VERTEX_FORMS, f"--form={form}: use one of "
        f"{', '.join(VERTEX_FORMS)}.")
  if form == "rest":
    return job
  spec = job["jobSpec"]
  if form == "gcloud":
    return spec
  kwargs = {"display_name": job["displayName"],
            "worker_pool_specs": _snake_case(spec["workerPoolSpecs"])}
  base = (spec.get("baseOutputDirectory") or {}).get("outputUriPrefix")
  if base:
    kwargs["base_output_dir"] = base
  return kwargs


def validate_vertex_sdk_kwargs(kwargs: dict, job: dict):
  """Checks the `sdk` form against the REST `job` it was made from.

  Each of `kwargs["worker_pool_specs"]` is built as
  `google.cloud.aiplatform_v1.types.WorkerPoolSpec` (what
  `aiplatform.CustomJob(worker_pool_specs=...)` does with a dict) and must
  equal the REST body's pool.

  Raises:
    JobSpecError: a field the SDK's type does not know, or a pool that
      differs from the REST body's.
    ImportError: google-cloud-aiplatform is not installed.
  """
  from google.cloud.aiplatform_v1.types import custom_job as custom_job_types  # pylint: disable=g-import-not-at-top
  from google.protobuf import json_format  # pylint: disable=g-import-not-at-top
  rest = custom_job_types.CustomJob.pb()()
  json_format.Parse(json.dumps(job), rest)
  pools = kwargs.get("worker_pool_specs") or []
  _need(len(pools) == len(rest.job_spec.worker_pool_specs),
        f"Vertex SDK worker_pool_specs: {len(pools)} pools; the job has "
        f"{len(rest.job_spec.worker_pool_specs)}.")
  for index, (pool, expected) in enumerate(
      zip(pools, rest.job_spec.worker_pool_specs)):
    try:
      message = custom_job_types.WorkerPoolSpec(pool)
    except (ValueError, TypeError, KeyError) as e:
      raise JobSpecError(f"Vertex SDK worker_pool_specs[{index}]: {e}"
                         ) from None
    _need(custom_job_types.WorkerPoolSpec.pb(message) == expected,
          f"Vertex SDK worker_pool_specs[{index}] differs from the REST "
          f"body's workerPoolSpecs[{index}].")


def _vertex_environment(job_spec: dict) -> Dict[str, str]:
  base = (job_spec.get("baseOutputDirectory") or {}).get("outputUriPrefix")
  if not base:
    return {}
  base = base.rstrip("/") + "/"
  return {name: base + leaf for name, leaf in _AIP_FOLDERS}


def _check_vertex_pool_machine(pool, where: str):
  """A used pool's machine and replicas, as the Vertex API requires them."""
  _need(pool.machine_spec.machine_type,
        f"Vertex CustomJob: {where}.machineSpec.machineType is required.")
  _need(pool.replica_count >= 1,
        f"Vertex CustomJob: {where}.replicaCount must be >= 1.")
  accelerated = pool.machine_spec.accelerator_type != 0
  _need(accelerated == (pool.machine_spec.accelerator_count > 0),
        f"Vertex CustomJob: {where}.machineSpec: acceleratorType and "
        "acceleratorCount go together.")


def _vertex_container_args(index: int, pool, where: str) -> Optional[list]:
  """A `containerSpec` pool's checks; its args when it runs tfdist.train."""
  _need(pool.container_spec.image_uri,
        f"Vertex CustomJob: {where}.containerSpec.imageUri is required.")
  if cluster_lib.is_reduction_server_image(pool.container_spec.image_uri):
    _need(index == cluster_lib.REDUCTION_SERVER_POOL,
          f"Vertex CustomJob: the Reduction Server runs in "
          f"workerPoolSpecs[2], not {where}.")
  if list(pool.container_spec.command)[-2:] == ["-m", TRAIN_MODULE]:
    return list(pool.container_spec.args)
  return None


def _vertex_package_args(pool, where: str) -> Optional[list]:
  """A `pythonPackageSpec` pool's checks; its args when it runs
  tfdist.train."""
  package = pool.python_package_spec
  _need(package.executor_image_uri and package.python_module and
        package.package_uris,
        f"Vertex CustomJob: {where}.pythonPackageSpec needs "
        "executorImageUri, packageUris and pythonModule.")
  for uri in package.package_uris:
    _need(uri.startswith("gs://"),
          f"Vertex CustomJob: {where} package {uri!r}: Vertex installs "
          "packages from Cloud Storage (gs://BUCKET/tfdist-X.tar.gz).")
  if package.python_module != TRAIN_MODULE:
    return None
  return list(package.args)


def _vertex_pool_config(index: int, pool, *, plan: Optional[JobPlan],
                        environ: Dict[str, str]):
  """Checks used pool `index`; returns its `TrainConfig`, or None for a
  pool that does not run tfdist.train (the Reduction Server, another
  program)."""
  where = f"workerPoolSpecs[{index}]"
  _check_vertex_pool_machine(pool, where)
  task = pool.WhichOneof("task")
  _need(task in ("python_package_spec", "container_spec"),
        f"Vertex CustomJob: {where} needs pythonPackageSpec or "
        "containerSpec.")
  if task == "container_spec":
    args = _vertex_container_args(index, pool, where)
    prebuilt = False
  else:
    args = _vertex_package_args(pool, where)
    prebuilt = pool.python_package_spec.executor_image_uri.startswith(
        "us-docker.pkg.dev/vertex-ai/training/")
  if args is None:
    return None
  config = parse_train_flags(args, where=f"Vertex {where}", environ=environ)
  check_train_config(config, plan, where=f"Vertex {where}",
                     shared_prefixes=("/gcs/",), prebuilt_container=prebuilt)
  return config


def validate_vertex_custom_job(job: dict, plan: Optional[JobPlan] = None
                               ) -> List:
  """Checks a `CustomJob` dict strictly; returns each tfdist pool's config.

  Args:
    job: the REST JSON (camelCase) of a `CustomJob`.
    plan: when given, the train flags are also checked against it.

  Returns:
    `[(pool_index, TrainConfig), ...]` for the pools that run tfdist.

  Raises:
    JobSpecError: an unknown or misspelt field (google-cloud-aiplatform's
      parser), a missing required field, a bad pool layout, or train flags
      tfdist rejects.
    ImportError: google-cloud-aiplatform is not installed.
  """
  from google.cloud.aiplatform_v1.types import custom_job as custom_job_types  # pylint: disable=g-import-not-at-top
  from google.protobuf import json_format  # pylint: disable=g-import-not-at-top
  message = custom_job_types.CustomJob.pb()()
  try:
    json_format.Parse(json.dumps(job), message, ignore_unknown_fields=False)
  except json_format.ParseError as e:
    raise JobSpecError(f"Vertex CustomJob: {e}") from None
  _need(message.display_name.strip(),
        "Vertex CustomJob: displayName is required.")
  pools = message.job_spec.worker_pool_specs
  _need(len(pools) >= 1 and pools[0].replica_count == 1,
        "Vertex CustomJob: workerPoolSpecs[0] (the chief) must have "
        "replicaCount 1.")
  _need(len(pools) <= 4, f"Vertex CustomJob: {len(pools)} worker pools; "
        "Vertex has four (chief, workers, ps or Reduction Server, evaluator).")
  environ = _vertex_environment(job["jobSpec"])
  configs = []
  for index, pool in enumerate(pools):
    if not pool.ByteSize():
      _need(index not in (0, len(pools) - 1),
            f"Vertex CustomJob: workerPoolSpecs[{index}] is empty; only "
            "pools between used ones may be empty.")
      continue
    config = _vertex_pool_config(index, pool, plan=plan, environ=environ)
    if config is not None:
      configs.append((index, config))
  _need(configs, "Vertex CustomJob: no worker pool runs tfdist.train.")
  return configs


# --- Kubernetes (Kubeflow TFJob) ---------------------------------------------
# Pod settings a values file may give (`--values`), as Kubernetes spells
# them: container fields, then pod fields; `replicaTypes` overrides them per
# TFJob replica type (e.g. smaller `resources` for `PS`).
POD_VALUE_KEYS = ("env", "resources", "volumeMounts", "serviceAccountName",
                  "volumes", "nodeSelector", "tolerations")
_CONTAINER_KEYS = ("env", "resources", "volumeMounts")
TOLERATION_OPERATORS = ("Exists", "Equal")
TOLERATION_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


@dataclasses.dataclass(frozen=True)
class PodOptions:
  """What a cluster needs to run a TFJob's pods, beyond image and command.

  Values are Kubernetes' own (camelCase) fragments, as in a pod spec;
  `validate_tfjob` checks them with the `kubernetes` client's models.

  Attributes:
    values: `{key: value}` for keys of `POD_VALUE_KEYS`, given to every
      replica: `env` (list of `{name, value}` or `valueFrom`), `resources`
      (`{requests: {cpu, memory}, limits: {...}}`; the GPU limit of
      `--accelerator` is added), `volumeMounts`, `serviceAccountName`
      (e.g. a Workload Identity account that can write the gs:// model
      folder), `volumes`, `nodeSelector`, `tolerations`.
    replica_values: `{replica type: {key: value}}`: per-type values that
      replace the shared ones key by key (e.g. `{"PS": {"resources": ...}}`).
  """
  values: Dict[str, object] = dataclasses.field(default_factory=dict)
  replica_values: Dict[str, Dict[str, object]] = dataclasses.field(
      default_factory=dict)

  def __post_init__(self):
    for where, values in (("", self.values), *(
        (f"replicaTypes.{k}.", v) for k, v in self.replica_values.items())):
      _need(isinstance(values, dict), f"TFJob values {where or 'file'}: a "
            "mapping of pod settings is needed.")
      unknown = sorted(set(values) - set(POD_VALUE_KEYS))
      _need(not unknown,
            f"TFJob values: unknown key(s) {where}{', '.join(unknown)}; "
            f"use {', '.join(POD_VALUE_KEYS)} (and replicaTypes). The "
            "restart policy is tfdist's (ExitCode) and not set here.")
    for kind in self.replica_values:
      _need(kind in TFJOB_REPLICA_TYPES,
            f"TFJob values: replicaTypes.{kind}: unknown replica type; use "
            f"one of {', '.join(TFJOB_REPLICA_TYPES)}.")

  def for_replica(self, kind: str) -> Dict[str, object]:
    """The values of replica type `kind`."""
    return {**self.values, **self.replica_values.get(kind, {})}


def _key_value(item: str, flag: str) -> Tuple[str, str]:
  key, sep, value = item.partition("=")
  _need(sep and key.strip(),
        f"--{flag}={item!r}: give KEY=VALUE, e.g. --{flag}=NAME=value.")
  return key.strip(), value


def pod_options(*, values_file: str = "", service_account: str = "",
                env: Sequence[str] = (), cpu: str = "", memory: str = "",
                ps_cpu: str = "", ps_memory: str = "",
                node_selector: Sequence[str] = ()) -> PodOptions:
  """`PodOptions` from a values file and the flags that add to it.

  Args:
    values_file: a YAML file of `POD_VALUE_KEYS` (and `replicaTypes`);
      '' for none.
    service_account: the pods' `serviceAccountName`.
    env: `NAME=VALUE` variables added to every container.
    cpu, memory: requests and limits (equal) of the chief, workers and
      evaluator, in Kubernetes quantities (`4`, `500m`; `16Gi`).
    ps_cpu, ps_memory: the same for the parameter servers.
    node_selector: `KEY=VALUE` node labels every pod needs.

  Raises:
    JobSpecError: an unreadable values file, an unknown key, or a flag not
      of the form KEY=VALUE.
  """
  import yaml  # pylint: disable=g-import-not-at-top
  values, replica_values = {}, {}
  if values_file:
    try:
      with open(values_file) as f:
        loaded = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
      raise JobSpecError(f"--values={values_file}: {e}") from None
    _need(isinstance(loaded, dict), f"--values={values_file}: a YAML "
          "mapping of pod settings is needed (e.g. serviceAccountName: "
          "trainer).")
    loaded = copy.deepcopy(loaded)
    replica_values = loaded.pop("replicaTypes", None) or {}
    _need(isinstance(replica_values, dict),
          f"--values={values_file}: replicaTypes must map replica types "
          "(Chief, Worker, PS, Evaluator) to pod settings.")
    values = loaded
  if service_account:
    values["serviceAccountName"] = service_account
  if env:
    values["env"] = list(values.get("env") or []) + [
        {"name": k, "value": v}
        for k, v in (_key_value(item, "env") for item in env)]
  if node_selector:
    values["nodeSelector"] = {**(values.get("nodeSelector") or {}), **dict(
        _key_value(item, "node_selector") for item in node_selector)}

  def with_resources(target, cpu_value, memory_value):
    amounts = {k: v for k, v in (("cpu", cpu_value),
                                 ("memory", memory_value)) if v}
    if not amounts:
      return target
    resources = copy.deepcopy(target.get("resources") or {})
    for part in ("requests", "limits"):
      resources[part] = {**(resources.get(part) or {}), **amounts}
    return {**target, "resources": resources}

  values = with_resources(values, cpu, memory)
  if ps_cpu or ps_memory:
    ps = replica_values.get("PS") or {}
    replica_values["PS"] = with_resources(
        {"resources": copy.deepcopy(values.get("resources") or {}), **ps},
        ps_cpu, ps_memory)
  return PodOptions(values=values, replica_values=replica_values)


def kubernetes_tfjob(plan: JobPlan, *, name: str, image: str,
                     namespace: str = "", backoff_limit: int = 3,
                     pods: Optional[PodOptions] = None) -> dict:
  """A Kubeflow `TFJob` (`kubeflow.org/v1`) for `plan`.

  Every replica has `restartPolicy: ExitCode` (see the module docstring)
  and, from `pods`, its resources, service account, environment,
  volumes, node selector and tolerations.

  Returns:
    A JSON-serializable dict; check it with `validate_tfjob`.
  """
  pods = pods or PodOptions()

  def replica(kind, count, accelerated):
    values = copy.deepcopy(pods.for_replica(kind))
    container = {"name": TFJOB_CONTAINER, "image": image,
                 "command": ["python", "-m", TRAIN_MODULE],
                 "args": list(plan.train_args)}
    container.update({k: values.pop(k) for k in _CONTAINER_KEYS
                      if k in values})
    if accelerated and plan.accelerator_count:
      resources = container.setdefault("resources", {})
      resources["limits"] = {**(resources.get("limits") or {}),
                             "nvidia.com/gpu": str(plan.accelerator_count)}
    return {"replicas": count, "restartPolicy": "ExitCode",
            "template": {"spec": {**values, "containers": [container]}}}

  specs = {"Chief": replica("Chief", 1, True)}
  if plan.num_workers:
    specs["Worker"] = replica("Worker", plan.num_workers, True)
  if plan.num_ps:
    specs["PS"] = replica("PS", plan.num_ps, False)
  if plan.evaluator:
    specs["Evaluator"] = replica("Evaluator", 1, True)
  metadata = {"name": name}
  if namespace:
    metadata["namespace"] = namespace
  return {"apiVersion": "kubeflow.org/v1", "kind": "TFJob",
          "metadata": metadata,
          "spec": {"runPolicy": {"backoffLimit": backoff_limit,
                                 "cleanPodPolicy": "None"},
                   "tfReplicaSpecs": specs}}


def _check_pod_template(template: dict, where: str):
  """Checks a replica's pod template with the `kubernetes` client's models
  (`V1PodTemplateSpec`: field names and types) and the API server's rules
  for what tfdist sets: quantities, requests within limits, mounts of
  declared volumes, variable names, tolerations.

  Raises:
    JobSpecError: the first problem, naming the field.
  """
  try:
    from kubernetes import client as k8s  # pylint: disable=g-import-not-at-top
    from kubernetes import utils as k8s_utils  # pylint: disable=g-import-not-at-top
  except ImportError:
    return  # kubeflow-training's own models checked the fields.
  api = k8s.ApiClient()

  class _Response:  # what ApiClient.deserialize reads
    data = json.dumps(template)

  try:
    model = api.deserialize(_Response(), "V1PodTemplateSpec")
  except (ValueError, TypeError) as e:
    raise JobSpecError(f"{where}: the kubernetes client rejects the pod "
                       f"template: {e}") from None
  lost = _diff(template, api.sanitize_for_serialization(model))
  _need(not lost, f"{where}: unknown pod field(s) {', '.join(lost)} (not in "
        "the kubernetes client's V1PodTemplateSpec).")
  spec = model.spec
  volumes = {v.name for v in spec.volumes or []}
  for container in spec.containers or []:
    resources = container.resources
    amounts = {}
    for part in ("requests", "limits"):
      for resource, value in ((getattr(resources, part) if resources else None)
                              or {}).items():
        try:
          amounts[part, resource] = k8s_utils.parse_quantity(value)
        except ValueError:
          raise JobSpecError(
              f"{where}: resources.{part}.{resource}={value!r} is not a "
              "Kubernetes quantity (e.g. cpu: 4 or 500m; memory: 16Gi or "
              "512Mi).") from None
    for (part, resource), amount in amounts.items():
      limit = amounts.get(("limits", resource))
      _need(part != "requests" or limit is None or amount <= limit,
            f"{where}: resources.requests.{resource} exceeds "
            f"resources.limits.{resource}; a request must fit its limit.")
    for variable in container.env or []:
      _need(_ENV_NAME.match(variable.name or ""),
            f"{where}: env name {variable.name!r} is not a valid variable "
            "name (letters, digits, '_', '-', '.'; not starting with a "
            "digit).")
    for mount in container.volume_mounts or []:
      _need(mount.name in volumes,
            f"{where}: volumeMounts {mount.name!r} names no volume of the "
            f"pod (volumes: {', '.join(sorted(volumes)) or 'none'}).")
      _need(mount.mount_path and mount.mount_path.startswith("/"),
            f"{where}: volumeMounts {mount.name!r} needs an absolute "
            "mountPath.")
  for toleration in spec.tolerations or []:
    _need((toleration.operator or "Equal") in TOLERATION_OPERATORS,
          f"{where}: toleration operator {toleration.operator!r}: use "
          f"{' or '.join(TOLERATION_OPERATORS)}.")
    _need((toleration.effect or "") in TOLERATION_EFFECTS,
          f"{where}: toleration effect {toleration.effect!r}: use one of "
          f"{', '.join(e for e in TOLERATION_EFFECTS if e)}.")
  _need(spec.restart_policy is None,
        f"{where}: the pod template sets restartPolicy; the TFJob replica's "
        "restartPolicy (ExitCode) decides restarts.")


def _diff(original, round_trip, path="") -> List[str]:
  """Paths in `original` that `round_trip` lost (unknown to the models)."""
  lost = []
  if isinstance(original, dict):
    for key, value in original.items():
      if not isinstance(round_trip, dict) or key not in round_trip:
        lost.append(f"{path}.{key}".lstrip("."))
      else:
        lost += _diff(value, round_trip[key], f"{path}.{key}")
  elif isinstance(original, list) and isinstance(round_trip, list):
    for i, (a, b) in enumerate(zip(original, round_trip)):
      lost += _diff(a, b, f"{path}[{i}]")
  return lost


_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def validate_tfjob(job: dict, plan: Optional[JobPlan] = None) -> List:
  """Checks a `TFJob` dict; returns each replica type's config.

  Raises:
    JobSpecError: a field the Kubeflow SDK's models do not know or require,
      a rule of the CRD or the training operator broken, or train flags
      tfdist rejects.
    ImportError: kubeflow-training is not installed.
  """
  from kubeflow.training import ApiClient  # pylint: disable=g-import-not-at-top
  client = ApiClient()

  class _Response:  # what ApiClient.deserialize reads
    data = json.dumps(job)

  try:
    model = client.deserialize(_Response(), "KubeflowOrgV1TFJob")
  except (ValueError, TypeError) as e:
    raise JobSpecError(f"TFJob: the Kubeflow training SDK rejects it: {e}"
                       ) from None
  lost = _diff(job, client.sanitize_for_serialization(model))
  _need(not lost, f"TFJob: unknown field(s) {', '.join(lost)} (not in the "
        "Kubeflow training SDK's models).")
  _need(job.get("apiVersion") == "kubeflow.org/v1" and
        job.get("kind") == "TFJob",
        "TFJob: apiVersion must be kubeflow.org/v1 and kind TFJob.")
  name = (job.get("metadata") or {}).get("name", "")
  _need(_DNS1035.match(name or ""),
        f"TFJob: metadata.name={name!r} must be a DNS-1035 label (lower-case "
        "letters, digits, '-', starting with a letter, at most 63).")
  specs = model.spec.tf_replica_specs or {}
  _need(specs, "TFJob: spec.tfReplicaSpecs is required.")
  configs = []
  for kind, spec in specs.items():
    where = f"TFJob {kind}"
    _need(kind in TFJOB_REPLICA_TYPES,
          f"{where}: unknown replica type; use one of "
          f"{', '.join(TFJOB_REPLICA_TYPES)}.")
    replicas = 1 if spec.replicas is None else spec.replicas
    _need(replicas >= 1, f"{where}: replicas must be >= 1.")
    _need(kind not in ("Chief", "Master", "Evaluator") or replicas == 1,
          f"{where}: the operator allows exactly one {kind} replica.")
    _need(spec.restart_policy in TFJOB_RESTART_POLICIES,
          f"{where}: restartPolicy {spec.restart_policy!r} is not one of "
          f"{', '.join(TFJOB_RESTART_POLICIES)}.")
    containers = (spec.template.spec.containers if spec.template and
                  spec.template.spec else None) or []
    main = [c for c in containers if c.name == TFJOB_CONTAINER]
    _need(main, f"{where}: no container named {TFJOB_CONTAINER!r} (the "
          "training operator configures only that container).")
    for container in containers:
      _need(container.name and container.image,
            f"{where}: every container needs a name and an image.")
    _check_pod_template(job["spec"]["tfReplicaSpecs"][kind].get("template")
                        or {}, where)
    command = list(main[0].command or [])
    if command[-2:] == ["-m", TRAIN_MODULE]:
      config = parse_train_flags(list(main[0].args or []), where=where)
      if plan is not None:
        check_train_config(config, plan, where=where)
      configs.append((kind, config))
  _need(sum(k in ("Chief", "Master") for k in specs) <= 1,
        "TFJob: give Chief or Master, not both.")
  _need(configs, "TFJob: no replica runs python -m tfdist.train.")
  return configs


# --- the binary --------------------------------------------------------------
_FLAGS = flags.FlagValues()
flags.DEFINE_integer("num_workers", 0, "Worker replicas besides the chief "
                     "(Vertex pool 1, TFJob Worker).", flag_values=_FLAGS)
flags.DEFINE_integer("num_ps", 0, "Parameter-server replicas (Vertex pool 2, "
                     "TFJob PS).", flag_values=_FLAGS)
flags.DEFINE_bool("evaluator", False, "One evaluator replica (Vertex pool 3, "
                  "TFJob Evaluator): tfdist's side-car evaluator, under "
                  "every strategy.", flag_values=_FLAGS)
flags.DEFINE_integer("reduction_server_replicas", 0,
                     "Vertex only: Reduction Server replicas in pool 2 (GPU "
                     "workers; adds --reduction_server).", flag_values=_FLAGS)
flags.DEFINE_string("machine_type", JobPlan.machine_type,
                    "Vertex: machine type of the chief, workers, evaluator.",
                    flag_values=_FLAGS)
flags.DEFINE_string("ps_machine_type", JobPlan.ps_machine_type,
                    "Vertex: machine type of the parameter servers.",
                    flag_values=_FLAGS)
flags.DEFINE_string("reduction_server_machine_type",
                    JobPlan.reduction_server_machine_type,
                    "Vertex: machine type of the Reduction Server replicas.",
                    flag_values=_FLAGS)
flags.DEFINE_string("accelerator", "", "TYPE[:COUNT] per chief/worker/"
                    "evaluator replica, e.g. NVIDIA_TESLA_T4:1 (Kubernetes "
                    "uses the count as nvidia.com/gpu).", flag_values=_FLAGS)
flags.DEFINE_string("display_name", "tfdist", "Vertex: the job's display "
                    "name.", flag_values=_FLAGS)
flags.DEFINE_list("package_uris", [], "Vertex: gs:// URIs of the tfdist "
                  "sdist (python setup.py sdist, then gsutil cp).",
                  flag_values=_FLAGS)
flags.DEFINE_string("tf_version", "2.17", "Vertex: TensorFlow version of the "
                    "prebuilt training image.", flag_values=_FLAGS)
flags.DEFINE_string("executor_image_uri", "", "Vertex: a prebuilt training "
                    "image instead of the one for --tf_version.",
                    flag_values=_FLAGS)
flags.DEFINE_string("base_output_dir", "", "Vertex: gs:// folder; Vertex "
                    "sets AIP_MODEL_DIR, AIP_CHECKPOINT_DIR and "
                    "AIP_TENSORBOARD_LOG_DIR under it.", flag_values=_FLAGS)
flags.DEFINE_bool("spec_only", False, "Vertex: print only the REST body's "
                  "jobSpec (as --form=gcloud, in --format).",
                  flag_values=_FLAGS)
flags.DEFINE_enum("form", "rest", list(VERTEX_FORMS), "Vertex: rest (the "
                  "REST body, camelCase JSON), sdk (keyword arguments of "
                  "aiplatform.CustomJob: display_name, worker_pool_specs in "
                  "snake_case, base_output_dir; JSON), gcloud (the "
                  "CustomJobSpec of `gcloud ai custom-jobs create "
                  "--config=config.yaml`; YAML).", flag_values=_FLAGS)
flags.DEFINE_string("container_image_uri", "", "Vertex: an image with tfdist "
                    "installed (e.g. built from the repository's "
                    "Dockerfile) that every tfdist pool runs as a "
                    "containerSpec; replaces --package_uris and the "
                    "prebuilt image.", flag_values=_FLAGS)
flags.DEFINE_string("image", "", "Kubernetes: container image with tfdist "
                    "and TensorFlow installed.", flag_values=_FLAGS)
flags.DEFINE_string("name", "tfdist", "Kubernetes: the TFJob's name.",
                    flag_values=_FLAGS)
flags.DEFINE_string("namespace", "", "Kubernetes: the TFJob's namespace.",
                    flag_values=_FLAGS)
flags.DEFINE_integer("backoff_limit", 3, "Kubernetes: restarts before the "
                     "job fails (runPolicy.backoffLimit).", flag_values=_FLAGS)
flags.DEFINE_string("values", "", "Kubernetes: YAML file of pod settings as "
                    "Kubernetes spells them (" + ", ".join(POD_VALUE_KEYS) +
                    "; replicaTypes: {PS: {...}} per replica type); the "
                    "pod flags (--cpu, --memory, --ps_cpu, --ps_memory, "
                    "--env, --node_selector, --service_account) add to it.",
                    flag_values=_FLAGS)
flags.DEFINE_string("service_account", "", "Kubernetes: the pods' "
                    "serviceAccountName (e.g. a Workload Identity account "
                    "that can write the gs:// --model_dir).",
                    flag_values=_FLAGS)
flags.DEFINE_multi_string("env", [], "Kubernetes: NAME=VALUE, an environment "
                          "variable of every container (repeatable).",
                          flag_values=_FLAGS)
flags.DEFINE_string("cpu", "", "Kubernetes: CPU request and limit of the "
                    "chief, workers and evaluator (e.g. 4, 500m).",
                    flag_values=_FLAGS)
flags.DEFINE_string("memory", "", "Kubernetes: memory request and limit of "
                    "the chief, workers and evaluator (e.g. 16Gi).",
                    flag_values=_FLAGS)
flags.DEFINE_string("ps_cpu", "", "Kubernetes: CPU request and limit of the "
                    "parameter servers.", flag_values=_FLAGS)
flags.DEFINE_string("ps_memory", "", "Kubernetes: memory request and limit of "
                    "the parameter servers.", flag_values=_FLAGS)
flags.DEFINE_multi_string("node_selector", [], "Kubernetes: KEY=VALUE, a "
                          "node label every pod needs (repeatable; e.g. "
                          "cloud.google.com/gke-accelerator=nvidia-l4).",
                          flag_values=_FLAGS)
flags.DEFINE_enum("format", None, ["json", "yaml"], "Output format. Default: "
                  "json for vertex (yaml for --form=gcloud), yaml for "
                  "kubernetes.", flag_values=_FLAGS)


def build(platform: str, options, train_args: Sequence[str]) -> dict:
  """Builds and validates the spec for `platform` from parsed `options`.

  Raises:
    JobSpecError: invalid options, spec or train flags.
  """
  kind, count = parse_accelerator(options.accelerator)
  plan = JobPlan(num_workers=options.num_workers, num_ps=options.num_ps,
                 evaluator=options.evaluator,
                 reduction_server_replicas=options.reduction_server_replicas,
                 machine_type=options.machine_type,
                 accelerator_type=kind, accelerator_count=count,
                 ps_machine_type=options.ps_machine_type,
                 reduction_server_machine_type=(
                     options.reduction_server_machine_type),
                 train_args=tuple(train_args))
  if platform == "vertex":
    _need(options.package_uris or options.container_image_uri,
          "--package_uris is required for vertex: the gs:// URI of tfdist's "
          "sdist (python setup.py sdist; gsutil cp dist/tfdist-*.tar.gz "
          "gs://BUCKET/); or give --container_image_uri, an image with "
          "tfdist installed.")
    _need(not (options.package_uris and options.container_image_uri),
          "--package_uris and --container_image_uri: give one (a container "
          "image has tfdist installed already).")
    _need(not (options.spec_only and options.form != "rest"),
          f"--spec_only with --form={options.form}: --spec_only prints the "
          "REST body's jobSpec; drop one.")
    job = vertex_custom_job(plan, display_name=options.display_name,
                            package_uris=options.package_uris,
                            tf_version=options.tf_version,
                            executor_image_uri=options.executor_image_uri,
                            base_output_dir=options.base_output_dir,
                            container_image_uri=options.container_image_uri)
    validate_vertex_custom_job(job, plan)
    if options.spec_only:
      return job["jobSpec"]
    out = vertex_form(job, options.form)
    if options.form == "sdk":
      validate_vertex_sdk_kwargs(out, job)
    return out
  _need(not options.reduction_server_replicas,
        "--reduction_server_replicas is Vertex AI's; a TFJob has no "
        "Reduction Server.")
  _need(options.image, "--image is required for kubernetes: a container "
        "image with TensorFlow and tfdist installed.")
  pods = pod_options(values_file=options.values,
                     service_account=options.service_account,
                     env=options.env, cpu=options.cpu, memory=options.memory,
                     ps_cpu=options.ps_cpu, ps_memory=options.ps_memory,
                     node_selector=options.node_selector)
  job = kubernetes_tfjob(plan, name=options.name, image=options.image,
                         namespace=options.namespace,
                         backoff_limit=options.backoff_limit, pods=pods)
  validate_tfjob(job, plan)
  return job


def render(job: dict, fmt: str) -> str:
  if fmt == "yaml":
    import yaml  # pylint: disable=g-import-not-at-top
    return yaml.safe_dump(job, sort_keys=False, default_flow_style=False)
  return json.dumps(job, indent=2) + "\n"


def main(argv):
  head = argv[:argv.index("--")] if "--" in argv else argv
  if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in head):
    print(f"{__doc__}\nFlags:\n{_FLAGS.get_help()}")
    return
  try:
    rest = _FLAGS(argv)
  except flags.Error as e:
    sys.exit(f"tfdist.job_spec: error: {e}\n{__doc__}")
  if len(rest) < 2 or rest[1] not in PLATFORMS:
    sys.exit(f"tfdist.job_spec: error: name the platform first: one of "
             f"{', '.join(PLATFORMS)}.\n{__doc__}")
  platform = rest[1]
  # Building each replica's TrainConfig logs at INFO; only problems matter.
  logging.set_verbosity(logging.WARNING)
  try:
    job = build(platform, _FLAGS, rest[2:])
  except JobSpecError as e:
    sys.exit(f"tfdist.job_spec: error: {e}")
  except ImportError as e:
    sys.exit(f"tfdist.job_spec: error: validating a {platform} spec needs "
             f"{e.name}: pip install 'tfdist[jobspec]'.")
  fmt = _FLAGS.format or ("json" if platform == "vertex" and
                          _FLAGS.form != "gcloud" else "yaml")
  sys.stdout.write(render(job, fmt))


def parse_own_flags_later(argv):
  """An `app.run` flags parser for binaries whose options live in their
  own `FlagValues`, parsed in `main` (`tfdist.job_spec`, `tfdist.diagnose`):
  tfdist.train's flags can then be defined and copied without being
  mistaken for the binary's; absl's global FLAGS get only the program name.

  Returns:
    `argv` unchanged, for `main`.
  """
  flags.FLAGS(argv[:1])
  return argv


def run():
  app.run(main, argv=sys.argv, flags_parser=parse_own_flags_later)


if __name__ == "__main__":
  run()
