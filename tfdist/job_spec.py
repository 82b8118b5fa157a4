"""Validated job specs: a Vertex AI CustomJob or a Kubeflow TFJob for tfdist.

Usage:
  python -m tfdist.job_spec vertex --worker_replicas=N [--num_ps=M] [--evaluator]
      [--reduction_server_replicas=R] [--machine_type=TYPE]
      [--accelerator=TYPE[:COUNT]] --package_uris=gs://.../tfdist-X.tar.gz
      [--base_output_dir=gs://...] [--form=rest|sdk|gcloud]
      -- <tfdist.train flags>
  python -m tfdist.job_spec kubernetes --image=IMAGE --worker_replicas=N
      [--num_ps=M] [--evaluator] [--accelerator=TYPE[:COUNT]]
      [--cpu=4 --memory=16Gi] [--service_account=SA] [--env=NAME=VALUE]
      [--node_selector=KEY=VALUE] [--values=values.yaml]
      -- <tfdist.train flags>

The spec is printed (JSON for Vertex, YAML for Kubernetes); nothing is sent
anywhere; a line on stderr states the machines it asks for. The job has
one chief, `--worker_replicas` workers (`--num_workers` is refused: in
`tfdist.launch` it counts the chief too), either
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
  exits 2 on invalid flags or configuration, 1 on divergence or a bug). That
  split is the assumption tfdist's exit codes are held to.

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

The job's shape and the train-flag checks are `tfdist.cloud.job_plan`'s, the
builders and validators `tfdist.cloud.vertex_spec`'s and
`tfdist.cloud.tfjob_spec`'s; their public names are importable from
`tfdist.job_spec` as well.
"""

import json
import sys
from typing import Optional, Sequence

from absl import app
from absl import flags
from absl import logging

# The parts, and the names `tfdist.job_spec` has always offered.
from tfdist.cloud.job_plan import check_train_config  # pylint: disable=unused-import
from tfdist.cloud.job_plan import JobPlan  # pylint: disable=unused-import
from tfdist import errors
from tfdist.cloud.job_plan import need
from tfdist.cloud.job_plan import parse_accelerator  # pylint: disable=unused-import
from tfdist.cloud.job_plan import parse_train_flags  # pylint: disable=unused-import
from tfdist.cloud.job_plan import TRAIN_MODULE  # pylint: disable=unused-import
from tfdist.cloud.tfjob_spec import kubernetes_tfjob
from tfdist.cloud.tfjob_spec import pod_options
from tfdist.cloud.tfjob_spec import POD_VALUE_KEYS  # pylint: disable=unused-import
from tfdist.cloud.tfjob_spec import PodOptions  # pylint: disable=unused-import
from tfdist.cloud.tfjob_spec import TFJOB_CONTAINER  # pylint: disable=unused-import
from tfdist.cloud.tfjob_spec import TFJOB_REPLICA_TYPES  # pylint: disable=unused-import
from tfdist.cloud.tfjob_spec import TFJOB_RESTART_POLICIES  # pylint: disable=unused-import
from tfdist.cloud.tfjob_spec import TOLERATION_EFFECTS  # pylint: disable=unused-import
from tfdist.cloud.tfjob_spec import TOLERATION_OPERATORS  # pylint: disable=unused-import
from tfdist.cloud.tfjob_spec import validate_tfjob
from tfdist.cloud.vertex_spec import prebuilt_image  # pylint: disable=unused-import
from tfdist.cloud.vertex_spec import PREBUILT_IMAGE_FORMAT  # pylint: disable=unused-import
from tfdist.cloud.vertex_spec import PREBUILT_TF_IMAGES  # pylint: disable=unused-import
from tfdist.cloud.vertex_spec import validate_vertex_custom_job
from tfdist.cloud.vertex_spec import validate_vertex_sdk_kwargs
from tfdist.cloud.vertex_spec import vertex_custom_job
from tfdist.cloud.vertex_spec import vertex_form
from tfdist.cloud.vertex_spec import VERTEX_FORMS
from tfdist.runtime import cli

# PyYAML (the jobspec extra) is optional: `render` imports it for YAML.

PLATFORMS = ("vertex", "kubernetes")


# --- the binary --------------------------------------------------------------
_FLAGS = flags.FlagValues()
flags.DEFINE_integer("worker_replicas", 0, "Worker replicas besides the "
                     "chief (Vertex pool 1, TFJob Worker): the job has "
                     "1 + N machines that train (N under parameter servers, "
                     "where the chief coordinates).", flag_values=_FLAGS)
flags.DEFINE_integer("num_workers", None, "Refused: use --worker_replicas "
                     "(tfdist.launch's --num_workers counts every training "
                     "process, the chief included).", flag_values=_FLAGS)
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


def refuse_num_workers(value: Optional[int]) -> None:
  """`--num_workers` is refused here: it named the workers besides the
  chief, while `tfdist.launch --num_workers` counts every process that
  trains (2 gave three machines here, two there).

  Raises:
    JobSpecError: `value` is not None; names `--worker_replicas` and what
      the job would hold.
  """
  if value is None:
    return
  workers = max(value - 1, 0)
  need(False,
       f"--num_workers={value} is not a tfdist.job_spec flag: give "
       f"--worker_replicas, the workers besides the chief (Vertex pool 1, "
       f"TFJob Worker). --worker_replicas={workers} makes {workers + 1} "
       f"machine{'s' if workers else ''} that train (the chief and "
       f"{workers} worker{'' if workers == 1 else 's'}), as tfdist.launch "
       f"--num_workers={workers + 1} does; --worker_replicas={value} makes "
       f"{value + 1}.")


def job_plan(options, train_args: Sequence[str] = ()) -> JobPlan:
  """The `JobPlan` of the parsed `options` (the binary's flags).

  Raises:
    JobSpecError: invalid options (`--num_workers` among them).
  """
  refuse_num_workers(getattr(options, "num_workers", None))
  kind, count = parse_accelerator(options.accelerator)
  return JobPlan(num_workers=options.worker_replicas, num_ps=options.num_ps,
                 evaluator=options.evaluator,
                 reduction_server_replicas=options.reduction_server_replicas,
                 machine_type=options.machine_type,
                 accelerator_type=kind, accelerator_count=count,
                 ps_machine_type=options.ps_machine_type,
                 reduction_server_machine_type=(
                     options.reduction_server_machine_type),
                 train_args=tuple(train_args))


def build(platform: str, options, train_args: Sequence[str]) -> dict:
  """Builds and validates the spec for `platform` from parsed `options`.

  Raises:
    JobSpecError: invalid options, spec or train flags.
  """
  plan = job_plan(options, train_args)
  if platform == "vertex":
    need(options.package_uris or options.container_image_uri,
          "--package_uris is required for vertex: the gs:// URI of tfdist's "
          "sdist (python setup.py sdist; gsutil cp dist/tfdist-*.tar.gz "
          "gs://BUCKET/); or give --container_image_uri, an image with "
          "tfdist installed.")
    need(not (options.package_uris and options.container_image_uri),
          "--package_uris and --container_image_uri: give one (a container "
          "image has tfdist installed already).")
    need(not (options.spec_only and options.form != "rest"),
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
  need(not options.reduction_server_replicas,
        "--reduction_server_replicas is Vertex AI's; a TFJob has no "
        "Reduction Server.")
  need(options.image, "--image is required for kubernetes: a container "
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
    # PyYAML comes with the optional jobspec extra: imported only when used.
    import yaml  # pylint: disable=g-import-not-at-top
    return yaml.safe_dump(job, sort_keys=False, default_flow_style=False)
  return json.dumps(job, indent=2) + "\n"


def main(argv):
  head = argv[:argv.index("--")] if "--" in argv else argv
  if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in head):
    print(f"{__doc__}\nFlags:\n{_FLAGS.get_help()}")
    return
  # Bad input (a flag, the platform, the job's fields or train flags):
  # one line naming it, status 2 (tfdist.errors.CONFIG), as tfdist.train.
  rest = cli.flags_parser("tfdist.job_spec", _FLAGS)(argv)
  if len(rest) < 2 or rest[1] not in PLATFORMS:
    cli.usage_error("tfdist.job_spec", f"name the platform first: one of "
                    f"{', '.join(PLATFORMS)}.")
  platform = rest[1]
  # Building each replica's TrainConfig logs at INFO; only problems matter.
  logging.set_verbosity(logging.WARNING)
  try:
    job = build(platform, _FLAGS, rest[2:])
  except errors.JobSpecError as e:
    cli.usage_error("tfdist.job_spec", e)
  except ImportError as e:
    sys.exit(f"tfdist.job_spec: error: validating a {platform} spec needs "
             f"{e.name}: pip install 'tfdist[jobspec]'.")
  print(f"tfdist.job_spec: {platform} job of {job_plan(_FLAGS).describe()}",
        file=sys.stderr, flush=True)
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
