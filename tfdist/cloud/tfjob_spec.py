"""Kubeflow TFJobs for tfdist: built for a `JobPlan`, validated strictly.

`kubernetes_tfjob` builds a `TFJob` (training operator, `kubeflow.org/v1`)
with `Chief`, `Worker`, `PS` and `Evaluator` replica specs running `python
-m tfdist.train`, with the pod settings of `PodOptions` (`pod_options`: a
values file and flags) and `restartPolicy: ExitCode`. `validate_tfjob`
round-trips it through the Kubeflow training SDK's models, checks the
operator's rules and each pod template as the API server would, and checks
every replica's train flags (`tfdist.cloud.job_plan`). The binary is `python -m
tfdist.job_spec kubernetes`.
"""

import copy
import dataclasses
import json
import re
from typing import Dict, List, Optional, Sequence, Tuple

from tfdist.cloud.job_plan import check_train_config
from tfdist.cloud.job_plan import JobPlan
from tfdist import errors
from tfdist.cloud.job_plan import need
from tfdist.cloud.job_plan import parse_train_flags
from tfdist.cloud.job_plan import TRAIN_MODULE

# kubeflow-training, kubernetes and PyYAML (the jobspec extra) are
# optional: imported in the functions that use them.

# Kubeflow training operator: replica types, the container it configures,
# restart policies (kubeflow.org/v1 common types).
TFJOB_REPLICA_TYPES = ("Chief", "Master", "Worker", "PS", "Evaluator")
TFJOB_CONTAINER = "tensorflow"
TFJOB_RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
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
      need(isinstance(values, dict), f"TFJob values {where or 'file'}: a "
            "mapping of pod settings is needed.")
      unknown = sorted(set(values) - set(POD_VALUE_KEYS))
      need(not unknown,
            f"TFJob values: unknown key(s) {where}{', '.join(unknown)}; "
            f"use {', '.join(POD_VALUE_KEYS)} (and replicaTypes). The "
            "restart policy is tfdist's (ExitCode) and not set here.")
    for kind in self.replica_values:
      need(kind in TFJOB_REPLICA_TYPES,
            f"TFJob values: replicaTypes.{kind}: unknown replica type; use "
            f"one of {', '.join(TFJOB_REPLICA_TYPES)}.")

  def for_replica(self, kind: str) -> Dict[str, object]:
    """The values of replica type `kind`."""
    return {**self.values, **self.replica_values.get(kind, {})}


def _key_value(item: str, flag: str) -> Tuple[str, str]:
  key, sep, value = item.partition("=")
  need(sep and key.strip(),
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
  # The optional jobspec extra (kubernetes, PyYAML): imported only when used.
  import yaml  # pylint: disable=g-import-not-at-top
  values, replica_values = {}, {}
  if values_file:
    try:
      with open(values_file) as f:
        loaded = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
      raise errors.JobSpecError(f"--values={values_file}: {e}") from None
    need(isinstance(loaded, dict), f"--values={values_file}: a YAML "
          "mapping of pod settings is needed (e.g. serviceAccountName: "
          "trainer).")
    loaded = copy.deepcopy(loaded)
    replica_values = loaded.pop("replicaTypes", None) or {}
    need(isinstance(replica_values, dict),
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
    # The optional jobspec extra (kubernetes, PyYAML): imported only when used.
    from kubernetes import client as k8s  # pylint: disable=g-import-not-at-top
    from kubernetes import utils as k8s_utils  # pylint: disable=g-import-not-at-top
  except ImportError:
    return  # kubeflow-training's own models checked the fields.
  spec = _pod_model(k8s.ApiClient(), template, where).spec
  volumes = {v.name for v in spec.volumes or []}
  for container in spec.containers or []:
    _check_resources(container.resources, where, k8s_utils.parse_quantity)
    _check_env_and_mounts(container, volumes, where)
  _check_tolerations(spec.tolerations or [], where)
  need(spec.restart_policy is None,
        f"{where}: the pod template sets restartPolicy; the TFJob replica's "
        "restartPolicy (ExitCode) decides restarts.")


def _pod_model(api, template: dict, where: str):
  """`template` as the kubernetes client's `V1PodTemplateSpec`; refuses a
  field the model does not know (lost in the round trip)."""

  class _Response:  # what ApiClient.deserialize reads
    data = json.dumps(template)

  try:
    model = api.deserialize(_Response(), "V1PodTemplateSpec")
  except (ValueError, TypeError) as e:
    raise errors.JobSpecError(f"{where}: the kubernetes client rejects the pod "
                              f"template: {e}") from None
  lost = _diff(template, api.sanitize_for_serialization(model))
  need(not lost, f"{where}: unknown pod field(s) {', '.join(lost)} (not in "
        "the kubernetes client's V1PodTemplateSpec).")
  return model


def _check_resources(resources, where: str, parse_quantity):
  """A container's requests and limits are quantities, each request within
  its limit."""
  amounts = {}
  for part in ("requests", "limits"):
    for resource, value in ((getattr(resources, part) if resources else None)
                            or {}).items():
      try:
        amounts[part, resource] = parse_quantity(value)
      except ValueError:
        raise errors.JobSpecError(
            f"{where}: resources.{part}.{resource}={value!r} is not a "
            "Kubernetes quantity (e.g. cpu: 4 or 500m; memory: 16Gi or "
            "512Mi).") from None
  for (part, resource), amount in amounts.items():
    limit = amounts.get(("limits", resource))
    need(part != "requests" or limit is None or amount <= limit,
          f"{where}: resources.requests.{resource} exceeds "
          f"resources.limits.{resource}; a request must fit its limit.")


def _check_env_and_mounts(container, volumes: set, where: str):
  """A container's variable names, and its mounts of the pod's volumes at
  absolute paths."""
  for variable in container.env or []:
    need(_ENV_NAME.match(variable.name or ""),
          f"{where}: env name {variable.name!r} is not a valid variable "
          "name (letters, digits, '_', '-', '.'; not starting with a "
          "digit).")
  for mount in container.volume_mounts or []:
    need(mount.name in volumes,
          f"{where}: volumeMounts {mount.name!r} names no volume of the "
          f"pod (volumes: {', '.join(sorted(volumes)) or 'none'}).")
    need(mount.mount_path and mount.mount_path.startswith("/"),
          f"{where}: volumeMounts {mount.name!r} needs an absolute "
          "mountPath.")


def _check_tolerations(tolerations, where: str):
  """Each toleration's operator and effect are the API server's."""
  for toleration in tolerations:
    need((toleration.operator or "Equal") in TOLERATION_OPERATORS,
          f"{where}: toleration operator {toleration.operator!r}: use "
          f"{' or '.join(TOLERATION_OPERATORS)}.")
    need((toleration.effect or "") in TOLERATION_EFFECTS,
          f"{where}: toleration effect {toleration.effect!r}: use one of "
          f"{', '.join(e for e in TOLERATION_EFFECTS if e)}.")


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
    raise errors.JobSpecError(
        f"TFJob: the Kubeflow training SDK rejects it: {e}"
        ) from None
  lost = _diff(job, client.sanitize_for_serialization(model))
  need(not lost, f"TFJob: unknown field(s) {', '.join(lost)} (not in the "
        "Kubeflow training SDK's models).")
  need(job.get("apiVersion") == "kubeflow.org/v1" and
        job.get("kind") == "TFJob",
        "TFJob: apiVersion must be kubeflow.org/v1 and kind TFJob.")
  name = (job.get("metadata") or {}).get("name", "")
  need(_DNS1035.match(name or ""),
        f"TFJob: metadata.name={name!r} must be a DNS-1035 label (lower-case "
        "letters, digits, '-', starting with a letter, at most 63).")
  specs = model.spec.tf_replica_specs or {}
  need(specs, "TFJob: spec.tfReplicaSpecs is required.")
  configs = []
  for kind, spec in specs.items():
    where = f"TFJob {kind}"
    need(kind in TFJOB_REPLICA_TYPES,
          f"{where}: unknown replica type; use one of "
          f"{', '.join(TFJOB_REPLICA_TYPES)}.")
    replicas = 1 if spec.replicas is None else spec.replicas
    need(replicas >= 1, f"{where}: replicas must be >= 1.")
    need(kind not in ("Chief", "Master", "Evaluator") or replicas == 1,
          f"{where}: the operator allows exactly one {kind} replica.")
    need(spec.restart_policy in TFJOB_RESTART_POLICIES,
          f"{where}: restartPolicy {spec.restart_policy!r} is not one of "
          f"{', '.join(TFJOB_RESTART_POLICIES)}.")
    containers = (spec.template.spec.containers if spec.template and
                  spec.template.spec else None) or []
    main = [c for c in containers if c.name == TFJOB_CONTAINER]
    need(main, f"{where}: no container named {TFJOB_CONTAINER!r} (the "
          "training operator configures only that container).")
    for container in containers:
      need(container.name and container.image,
            f"{where}: every container needs a name and an image.")
    _check_pod_template(job["spec"]["tfReplicaSpecs"][kind].get("template")
                        or {}, where)
    command = list(main[0].command or [])
    if command[-2:] == ["-m", TRAIN_MODULE]:
      config = parse_train_flags(list(main[0].args or []), where=where)
      if plan is not None:
        check_train_config(config, plan, where=where)
      configs.append((kind, config))
  need(sum(k in ("Chief", "Master") for k in specs) <= 1,
        "TFJob: give Chief or Master, not both.")
  need(configs, "TFJob: no replica runs python -m tfdist.train.")
  return configs
