"""Vertex AI CustomJobs for tfdist: built for a `JobPlan`, validated strictly.

`vertex_custom_job` builds the REST body (camelCase JSON) of a `CustomJob`
whose pools run `tfdist.train` (worker pools in Vertex's order: 0 chief,
1 workers, 2 parameter servers or the Reduction Server, 3 evaluator);
`vertex_form` gives it in the form another client takes (`VERTEX_FORMS`);
`validate_vertex_custom_job` parses it with google-cloud-aiplatform's own
protobuf type and checks every tfdist pool's train flags
(`tfdist.cloud.job_plan`). The binary is `python -m tfdist.job_spec vertex`.
"""

import json
import re
from typing import Dict, List, Optional, Sequence

from tfdist.cloud.job_plan import check_train_config
from tfdist.cloud.job_plan import JobPlan
from tfdist import errors
from tfdist.cloud.job_plan import need
from tfdist.cloud.job_plan import parse_train_flags
from tfdist.cloud.job_plan import TRAIN_MODULE
from tfdist.distribute import cluster as cluster_lib

# google-cloud-aiplatform (the jobspec extra) is optional: the validators
# import it in the functions that use it.

# The forms a Vertex CustomJob is printed in, by the client that takes it.
VERTEX_FORMS = ("rest", "sdk", "gcloud")
# Vertex AI's prebuilt TensorFlow training images by TensorFlow version:
# the Python version in the image's name. TF 2.17 on Python 3.10 is the
# newest prebuilt training container; tfdist supports TF 2.17 and 2.21.
PREBUILT_TF_IMAGES = {"2.17": "py310"}
PREBUILT_IMAGE_FORMAT = (
    "us-docker.pkg.dev/vertex-ai/training/tf-{kind}.{version}.{python}:latest")
# Vertex sets these from baseOutputDirectory (Vertex AI documentation).
_AIP_FOLDERS = (("AIP_MODEL_DIR", "model/"),
                ("AIP_CHECKPOINT_DIR", "checkpoints/"),
                ("AIP_TENSORBOARD_LOG_DIR", "logs/"))


def prebuilt_image(tf_version: str, *, gpu: bool) -> str:
  """Vertex AI's prebuilt TensorFlow training image for `tf_version`.

  Raises:
    JobSpecError: no prebuilt image is known for that version.
  """
  if tf_version not in PREBUILT_TF_IMAGES:
    raise errors.JobSpecError(
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
  need(form in VERTEX_FORMS, f"--form={form}: use one of "
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
  # The optional jobspec extra (google-cloud-aiplatform): imported only when
  # used.
  from google.cloud.aiplatform_v1.types import custom_job as custom_job_types  # pylint: disable=g-import-not-at-top
  from google.protobuf import json_format  # pylint: disable=g-import-not-at-top
  rest = custom_job_types.CustomJob.pb()()
  json_format.Parse(json.dumps(job), rest)
  pools = kwargs.get("worker_pool_specs") or []
  need(len(pools) == len(rest.job_spec.worker_pool_specs),
        f"Vertex SDK worker_pool_specs: {len(pools)} pools; the job has "
        f"{len(rest.job_spec.worker_pool_specs)}.")
  for index, (pool, expected) in enumerate(
      zip(pools, rest.job_spec.worker_pool_specs)):
    try:
      message = custom_job_types.WorkerPoolSpec(pool)
    except (ValueError, TypeError, KeyError) as e:
      raise errors.JobSpecError(f"Vertex SDK worker_pool_specs[{index}]: {e}"
                                ) from None
    need(custom_job_types.WorkerPoolSpec.pb(message) == expected,
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
  need(pool.machine_spec.machine_type,
        f"Vertex CustomJob: {where}.machineSpec.machineType is required.")
  need(pool.replica_count >= 1,
        f"Vertex CustomJob: {where}.replicaCount must be >= 1.")
  accelerated = pool.machine_spec.accelerator_type != 0
  need(accelerated == (pool.machine_spec.accelerator_count > 0),
        f"Vertex CustomJob: {where}.machineSpec: acceleratorType and "
        "acceleratorCount go together.")


def _vertex_container_args(index: int, pool, where: str) -> Optional[list]:
  """A `containerSpec` pool's checks; its args when it runs tfdist.train."""
  need(pool.container_spec.image_uri,
        f"Vertex CustomJob: {where}.containerSpec.imageUri is required.")
  if cluster_lib.is_reduction_server_image(pool.container_spec.image_uri):
    need(index == cluster_lib.REDUCTION_SERVER_POOL,
          f"Vertex CustomJob: the Reduction Server runs in "
          f"workerPoolSpecs[2], not {where}.")
  if list(pool.container_spec.command)[-2:] == ["-m", TRAIN_MODULE]:
    return list(pool.container_spec.args)
  return None


def _vertex_package_args(pool, where: str) -> Optional[list]:
  """A `pythonPackageSpec` pool's checks; its args when it runs
  tfdist.train."""
  package = pool.python_package_spec
  need(package.executor_image_uri and package.python_module and
        package.package_uris,
        f"Vertex CustomJob: {where}.pythonPackageSpec needs "
        "executorImageUri, packageUris and pythonModule.")
  for uri in package.package_uris:
    need(uri.startswith("gs://"),
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
  need(task in ("python_package_spec", "container_spec"),
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
    raise errors.JobSpecError(f"Vertex CustomJob: {e}") from None
  need(message.display_name.strip(),
        "Vertex CustomJob: displayName is required.")
  pools = message.job_spec.worker_pool_specs
  need(len(pools) >= 1 and pools[0].replica_count == 1,
        "Vertex CustomJob: workerPoolSpecs[0] (the chief) must have "
        "replicaCount 1.")
  need(len(pools) <= 4, f"Vertex CustomJob: {len(pools)} worker pools; "
        "Vertex has four (chief, workers, ps or Reduction Server, evaluator).")
  environ = _vertex_environment(job["jobSpec"])
  configs = []
  for index, pool in enumerate(pools):
    if not pool.ByteSize():
      need(index not in (0, len(pools) - 1),
            f"Vertex CustomJob: workerPoolSpecs[{index}] is empty; only "
            "pools between used ones may be empty.")
      continue
    config = _vertex_pool_config(index, pool, plan=plan, environ=environ)
    if config is not None:
      configs.append((index, config))
  need(configs, "Vertex CustomJob: no worker pool runs tfdist.train.")
  return configs
