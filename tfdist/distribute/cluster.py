"""Cluster resolution: which task this process is, in which cluster.

One function, `resolve_cluster`, reads the cluster from exactly one source.
Precedence (the first source present wins; the others are ignored, and the
choice is logged):

1. Flags `--worker_hosts=h0:p0,h1:p1,...` with `--task_index=i` (Model
   Garden's names): every host is a `worker`; worker 0 acts as chief.
2. `TF_CONFIG` (TensorFlow's own variable; Vertex AI sets it in its
   TensorFlow containers): `{"cluster": {"chief": [...], "worker": [...],
   "ps": [...]}, "task": {"type": "worker", "index": 0}}`. `master` is
   accepted as the old name of `chief`; an `evaluator` task is not listed in
   `cluster`.
3. Vertex AI's `CLUSTER_SPEC`: `{"cluster": {"workerpool0": [...], ...},
   "task": {"type": "workerpool0", "index": 0}}`, with `workerpool0` ->
   `chief`, `workerpool1` -> `worker`, `workerpool2` -> `ps`,
   `workerpool3` -> `evaluator` (not a cluster member).
4. None of these: a single process (`ClusterInfo.single_process()`).

Vertex AI's Reduction Server: worker pool 2 may run Vertex's Reduction
Server image instead of parameter servers. Its replicas are neither `ps` nor
`worker` tasks of TensorFlow: they are dropped from the cluster (and from
TF_CONFIG's `ps` job, where Vertex lists pool 2 too), so `auto` picks
MultiWorkerMirroredStrategy over the chief and workers, whose NCCL
all-reduce the Reduction Server serves. Pool 2 is taken for the Reduction
Server when `--reduction_server` is given, or when `CLUSTER_SPEC`'s `job`
(the CustomJobSpec the job was created with, as Vertex documents it) shows
pool 2 running an image `.../vertex-ai-restricted/training/reductionserver`
(`reduction_server_in_job`).

Flags win because they are the most explicit; `TF_CONFIG` beats
`CLUSTER_SPEC` because Vertex AI sets both for the same job, and `TF_CONFIG`
is the form TensorFlow reads.

This module does not import TensorFlow at load time, so the launcher
(`tfdist.launch`) stays light.
"""

import dataclasses
import json
import os
import re
import signal
import socket
import threading
import time
import types
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from absl import logging

from tfdist import errors
from tfdist.distribute import rendezvous

CHIEF, WORKER, PS, EVALUATOR = "chief", "worker", "ps", "evaluator"
TASK_TYPES = (CHIEF, WORKER, PS, EVALUATOR)
# Jobs that may appear in a cluster definition (the evaluator never does).
CLUSTER_JOBS = (CHIEF, WORKER, PS)
# Aliases: Vertex AI's old TF_CONFIG name for the chief.
TASK_TYPE_ALIASES = {"master": CHIEF}
VERTEX_WORKER_POOLS = {
    "workerpool0": CHIEF,
    "workerpool1": WORKER,
    "workerpool2": PS,
    "workerpool3": EVALUATOR,
}
SOURCES = ("flags", "TF_CONFIG", "CLUSTER_SPEC", "single_process")
# Vertex AI's Reduction Server image (any region's registry, tag or digest),
# e.g. us-docker.pkg.dev/vertex-ai-restricted/training/reductionserver:latest.
REDUCTION_SERVER_IMAGE = (
    "us-docker.pkg.dev/vertex-ai-restricted/training/reductionserver:latest")
_REDUCTION_SERVER_IMAGE_RE = re.compile(
    r"^([a-z0-9-]+-)?docker\.pkg\.dev/vertex-ai-restricted/training/"
    r"reductionserver(:[\w.-]+)?(@sha256:[0-9a-f]{64})?$")
# A hyperparameter-tuning trial id (Vertex AI: "1", "2", ...); it names the
# trial's folder, `trial_<id>` (tfdist.distribute.environment.trial_folders).
_TRIAL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# The Vertex worker pool that may hold parameter servers or the Reduction
# Server (workerPoolSpecs[2]).
REDUCTION_SERVER_POOL = 2


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
  """The resolved cluster and this process's place in it (immutable).

  Attributes:
    task_type: `chief`, `worker`, `ps` or `evaluator`.
    task_index: index of this task within its job (>= 0).
    cluster: read-only mapping job name -> tuple of `host:port` addresses
      (jobs `chief`, `worker`, `ps`; empty for a single process).
    source: where it came from: one of `SOURCES`.
    rpc_layer: the RPC protocol (`grpc`).
    environment: TF_CONFIG's `environment` (`cloud` on Vertex AI), or ''.
    trial: the hyperparameter-tuning trial id (`task.trial` of TF_CONFIG
      or CLUSTER_SPEC), or ''; an explicit `--model_dir` gets the subfolder
      `trial_<id>` (`tfdist.distribute.environment.trial_folders`).
    reduction_server_replicas: Vertex AI Reduction Server replicas (worker
      pool 2) left out of `cluster`; 0 when there is none.
  """
  task_type: str
  task_index: int
  cluster: Mapping[str, Tuple[str, ...]]
  source: str
  rpc_layer: str = "grpc"
  environment: str = ""
  trial: str = ""
  reduction_server_replicas: int = 0

  def __post_init__(self):
    frozen = types.MappingProxyType(
        {job: tuple(addresses) for job, addresses in
         sorted(dict(self.cluster).items())})
    object.__setattr__(self, "cluster", frozen)

  @classmethod
  def single_process(cls) -> "ClusterInfo":
    """A one-process 'cluster': task `chief` 0 with no addresses."""
    return cls(task_type=CHIEF, task_index=0, cluster={},
               source="single_process")

  @property
  def num_workers(self) -> int:
    """Tasks that train in sync: chief plus workers (1 for one process)."""
    if not self.cluster:
      return 1
    return len(self.cluster.get(CHIEF, ())) + len(self.cluster.get(WORKER, ()))

  def training_tasks(self) -> Tuple[str, ...]:
    """The chief's and workers' task names in order (the chief first),
    such as `("/job:chief/replica:0/task:0",
    "/job:worker/replica:0/task:0")`; empty outside a cluster of two or
    more such tasks."""
    tasks = tuple(f"/job:{job}/replica:0/task:{index}"
                  for job in (CHIEF, WORKER)
                  for index in range(len(self.cluster.get(job, ()))))
    return tasks if len(tasks) > 1 else ()

  @property
  def num_ps(self) -> int:
    return len(self.cluster.get(PS, ()))

  @property
  def is_multi_worker(self) -> bool:
    """True when there is a real cluster of more than one task."""
    return sum(len(v) for v in self.cluster.values()) > 1

  @property
  def is_chief(self) -> bool:
    """The task that writes to `--model_dir`.

    The `chief` task if the cluster has one, else `worker` 0 (TensorFlow's
    rule in `multi_worker_util.is_chief`).
    """
    if self.task_type == CHIEF:
      return True
    return (self.task_type == WORKER and self.task_index == 0 and
            not self.cluster.get(CHIEF))

  @property
  def worker_id(self) -> int:
    """This task's index among chief + workers (chief first); -1 otherwise."""
    if self.task_type == CHIEF:
      return 0
    if self.task_type == WORKER:
      return len(self.cluster.get(CHIEF, ())) + self.task_index
    return -1

  @property
  def address(self) -> Optional[str]:
    """This task's `host:port`, or None (single process, evaluator)."""
    addresses = self.cluster.get(self.task_type, ())
    return addresses[self.task_index] if self.task_index < len(
        addresses) else None

  def cluster_dict(self, jobs: Sequence[str] = CLUSTER_JOBS
                  ) -> Dict[str, list]:
    """A plain `{job: [addresses]}` dict restricted to `jobs`."""
    return {job: list(addresses) for job, addresses in self.cluster.items()
            if job in jobs and addresses}

  def to_tf_config(self, jobs: Sequence[str] = CLUSTER_JOBS) -> dict:
    """This task as a `TF_CONFIG` dict (what TensorFlow reads)."""
    config = {"cluster": self.cluster_dict(jobs),
              "task": {"type": self.task_type, "index": self.task_index}}
    if self.trial:
      config["task"]["trial"] = self.trial
    if self.environment:
      config["environment"] = self.environment
    return config

  def cluster_resolver(self, jobs: Sequence[str] = CLUSTER_JOBS):
    """A `tf.distribute.cluster_resolver.SimpleClusterResolver` for `jobs`.

    Imports TensorFlow. Pass `jobs=("chief", "worker")` for
    MultiWorkerMirroredStrategy, which has no use for `ps` tasks (on Vertex AI
    worker pool 2 may hold the Reduction Server, which is not a TF task).
    """
    # Imported here: parsing a cluster stays TensorFlow-free (the launcher
    # and `tfdist.job_spec` read clusters without starting TensorFlow).
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(self.cluster_dict(jobs)),
        task_type=self.task_type, task_id=self.task_index,
        rpc_layer=self.rpc_layer)

  def describe(self) -> str:
    """One line: role, index, cluster size and source."""
    if not self.cluster:
      return ("tfdist cluster: single process (no --worker_hosts, TF_CONFIG "
              "or CLUSTER_SPEC)")
    sizes = ", ".join(f"{len(v)} {k}" for k, v in self.cluster.items())
    if self.reduction_server_replicas:
      sizes += (f"; {self.reduction_server_replicas} Reduction Server "
                "replica(s), not TensorFlow tasks")
    chief = " (chief)" if self.is_chief and self.task_type != CHIEF else ""
    return (f"tfdist cluster: role {self.task_type}{chief}, index "
            f"{self.task_index}, {self.num_workers} training worker(s) "
            f"[{sizes}], from {self.source}")


# --- parsing helpers -----------------------------------------------------
def _check_address(address, where: str) -> str:
  """Returns `address` if it is `host:port` with a valid port."""
  if not isinstance(address, str) or not address.strip():
    raise errors.ClusterConfigError(
        f"{where}: address {address!r} is not a 'host:port' string.")
  address = address.strip()
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port:
    raise errors.ClusterConfigError(
        f"{where}: address {address!r} has no port. Write it as host:port, "
        "e.g. 10.0.0.2:2222.")
  if not port.isdigit() or not 0 < int(port) < 65536:
    raise errors.ClusterConfigError(
        f"{where}: address {address!r} has an invalid port {port!r}; use a "
        "number in 1..65535.")
  return address


def _normalize_cluster(raw, source: str, *, pools: Optional[Mapping[str, str]]
                       = None) -> Dict[str, Tuple[str, ...]]:
  """Validates a `cluster` dict; maps job aliases; returns job -> addresses.

  Args:
    raw: the `cluster` value as parsed from JSON.
    source: the variable or flag, for error messages.
    pools: job-name mapping (Vertex worker pools); None for TF_CONFIG names.

  Returns:
    `{job: (address, ...)}` including `evaluator` when `pools` maps one.

  Raises:
    ClusterConfigError: not a dict, an unknown job, a job that is not a list
      of `host:port`, the chief listed twice, or a duplicate address.
  """
  if not isinstance(raw, dict):
    raise errors.ClusterConfigError(
        f"{source}: 'cluster' must be an object mapping job names to lists of "
        f"addresses; got {type(raw).__name__}.")
  known = pools if pools is not None else {
      **{job: job for job in CLUSTER_JOBS}, **TASK_TYPE_ALIASES}
  out: Dict[str, Tuple[str, ...]] = {}
  seen: Dict[str, str] = {}
  for job, addresses in raw.items():
    if job not in known:
      hint = (", ".join(sorted(known)))
      extra = (" (the evaluator is not listed in TF_CONFIG's cluster; only "
               "its task.type is 'evaluator')") if job == EVALUATOR else ""
      raise errors.ClusterConfigError(
          f"{source}: unknown job {job!r} in 'cluster'{extra}. Known jobs: "
          f"{hint}.")
    if isinstance(addresses, str):
      addresses = [a for a in addresses.split(",") if a.strip()]
    if not isinstance(addresses, (list, tuple)):
      raise errors.ClusterConfigError(
          f"{source}: cluster[{job!r}] must be a list of 'host:port' "
          f"strings; got {addresses!r}.")
    name = known[job]
    if name in out:
      raise errors.ClusterConfigError(
          f"{source}: the {name} is listed twice (as {job!r} and as an "
          f"alias). Keep only one of {sorted(k for k, v in known.items() if v == name)}.")
    checked = tuple(_check_address(a, f"{source} cluster[{job!r}]")
                    for a in addresses)
    for address in checked:
      if address in seen:
        raise errors.ClusterConfigError(
            f"{source}: address {address} is used twice (by {seen[address]} "
            f"and {name}); every task needs its own host:port.")
      seen[address] = name
    out[name] = checked
  if len(out.get(CHIEF, ())) > 1:
    raise errors.ClusterConfigError(
        f"{source}: the chief is listed {len(out[CHIEF])} times "
        f"({', '.join(out[CHIEF])}); a cluster has exactly one chief. Put the "
        "others under 'worker'.")
  return out


def _task(raw, source: str, pools: Optional[Mapping[str, str]] = None):
  """Parses the `task` object into (task_type, task_index, trial)."""
  if not isinstance(raw, dict):
    raise errors.ClusterConfigError(
        f"{source}: 'task' must be an object like "
        "{\"type\": \"worker\", \"index\": 0}; got "
        f"{json.dumps(raw)[:80]}.")
  raw_type = raw.get("type")
  if pools is not None:
    if raw_type not in pools:
      raise errors.ClusterConfigError(
          f"{source}: unknown task type {raw_type!r}. Known: "
          f"{', '.join(sorted(pools))}.")
    task_type = pools[raw_type]
  else:
    task_type = TASK_TYPE_ALIASES.get(raw_type, raw_type)
    if task_type not in TASK_TYPES:
      raise errors.ClusterConfigError(
          f"{source}: unknown task type {raw_type!r}. Known: "
          f"{', '.join(TASK_TYPES + tuple(TASK_TYPE_ALIASES))}.")
  index = raw.get("index", 0)
  if isinstance(index, str) and index.strip().isdigit():
    index = int(index)
  if isinstance(index, bool) or not isinstance(index, int) or index < 0:
    raise errors.ClusterConfigError(
        f"{source}: task index {index!r} must be an integer >= 0.")
  trial = str(raw.get("trial", "") or "").strip()
  if trial and not _TRIAL_RE.match(trial):
    raise errors.ClusterConfigError(
        f"{source}: task trial {trial!r} cannot name a folder (tfdist keeps "
        "each hyperparameter-tuning trial in <model_dir>/trial_<id>). Vertex "
        "AI's trial ids are numbers, e.g. \"trial\": \"7\"; use letters, "
        "digits, '_', '.' or '-'.")
  return task_type, index, trial


def _check_index(task_type, index, cluster, source, *, evaluator_listed):
  if task_type == EVALUATOR and not evaluator_listed:
    return
  size = len(cluster.get(task_type, ()))
  if not size:
    raise errors.ClusterConfigError(
        f"{source}: this task is {task_type} {index}, but the cluster lists "
        f"no {task_type} tasks (jobs: {', '.join(cluster) or 'none'}).")
  if index >= size:
    raise errors.ClusterConfigError(
        f"{source}: task index {index} is out of range for {task_type}, "
        f"which has {size} task(s) (valid: 0..{size - 1}).")


def _load_json(text: str, source: str) -> dict:
  try:
    value = json.loads(text)
  except ValueError as e:
    raise errors.ClusterConfigError(
        f"{source} is not valid JSON ({e}). Received: {text[:120]!r}") from None
  if not isinstance(value, dict):
    raise errors.ClusterConfigError(
        f"{source} must be a JSON object with 'cluster' and 'task'; got "
        f"{type(value).__name__}.")
  return value


def _get(mapping, *names):
  """The first of `names` (camelCase or snake_case spellings) present."""
  for name in names:
    if isinstance(mapping, dict) and mapping.get(name) is not None:
      return mapping[name]
  return None


def is_reduction_server_image(image_uri: str) -> bool:
  """True for Vertex AI's Reduction Server image (any region, tag, digest)."""
  return bool(_REDUCTION_SERVER_IMAGE_RE.match(str(image_uri or "").strip()))


def reduction_server_in_job(job) -> bool:
  """Whether `CLUSTER_SPEC`'s `job` shows worker pool 2 running the Reduction
  Server image.

  Vertex AI documents `job` as the CustomJobSpec the job was created with;
  it is accepted as an object or as a JSON string, with the REST API's
  camelCase (`workerPoolSpecs`, `containerSpec.imageUri`) or the Python
  client's snake_case names, and wrapped in `jobSpec` or not. A `job` that
  does not describe worker pools (custom-container jobs have been seen to
  carry only `{"python_module": "", "package_uris": [], "job_args": []}`)
  says nothing: False. Pass `--reduction_server` for such jobs
  (`python -m tfdist.job_spec` adds it).

  Args:
    job: the `job` value of `CLUSTER_SPEC` (dict, JSON string, or None).

  Returns:
    True when `workerPoolSpecs[2].containerSpec.imageUri` is the Reduction
    Server image.
  """
  if isinstance(job, str):
    try:
      job = json.loads(job)
    except ValueError:
      return False
  if not isinstance(job, dict):
    return False
  spec = _get(job, "jobSpec", "job_spec")
  specs = _get(spec if isinstance(spec, dict) else job,
               "workerPoolSpecs", "worker_pool_specs")
  if not isinstance(specs, list) or len(specs) <= REDUCTION_SERVER_POOL:
    return False
  container = _get(specs[REDUCTION_SERVER_POOL], "containerSpec",
                   "container_spec")
  return is_reduction_server_image(_get(container, "imageUri", "image_uri"))


def reduction_server_in_cluster_spec(text: Optional[str]) -> bool:
  """`reduction_server_in_job` for a raw `CLUSTER_SPEC` string (False when it
  is absent or not JSON: resolving the cluster reports that)."""
  if not text or not text.strip():
    return False
  try:
    value = json.loads(text)
  except ValueError:
    return False
  return isinstance(value, dict) and reduction_server_in_job(value.get("job"))


def _drop_reduction_server(info: "ClusterInfo", job: str, why: str
                           ) -> "ClusterInfo":
  """`info` without `job` (the Reduction Server's replicas).

  Raises:
    ClusterConfigError: this task itself is in that job.
  """
  if info.task_type == job and job in info.cluster:
    raise errors.ClusterConfigError(
        f"{info.source}: this task is {job} {info.task_index}, but worker pool "
        f"2 runs Vertex AI's Reduction Server ({why}); tfdist runs only on the "
        "chief (pool 0), workers (pool 1) and evaluator (pool 3). Run the "
        f"Reduction Server image ({REDUCTION_SERVER_IMAGE}) in pool 2, not "
        "tfdist.")
  replicas = len(info.cluster.get(job, ()))
  cluster = {k: v for k, v in info.cluster.items() if k != job}
  return dataclasses.replace(info, cluster=cluster,
                             reduction_server_replicas=replicas)


# --- the three sources ---------------------------------------------------
def from_flags(worker_hosts: str, task_index: int) -> ClusterInfo:
  """`--worker_hosts` + `--task_index` (all tasks are `worker`s).

  Raises:
    ClusterConfigError: empty list, bad address, duplicate, or index out of
      range; the message names the flag.
  """
  hosts = [h for h in str(worker_hosts).split(",") if h.strip()]
  if not hosts:
    raise errors.ClusterConfigError(
        "--worker_hosts is empty: give host:port,... .")
  if task_index is None or task_index < 0:
    if len(hosts) == 1:
      task_index = 0
    else:
      raise errors.ClusterConfigError(
          f"--worker_hosts lists {len(hosts)} hosts: set --task_index to this "
          f"host's position (0..{len(hosts) - 1}).")
  cluster = _normalize_cluster({WORKER: hosts}, "--worker_hosts")
  if task_index >= len(hosts):
    raise errors.ClusterConfigError(
        f"--task_index={task_index} is out of range for --worker_hosts with "
        f"{len(hosts)} host(s) (valid: 0..{len(hosts) - 1}).")
  return ClusterInfo(task_type=WORKER, task_index=task_index, cluster=cluster,
                     source="flags")


def from_tf_config(text: str, source: str = "TF_CONFIG", *,
                   reduction_server: bool = False) -> ClusterInfo:
  """Parses a `TF_CONFIG` JSON string.

  Args:
    text: the JSON.
    source: the variable's name, for messages.
    reduction_server: the job's `ps` entries are Vertex AI's Reduction
      Server (worker pool 2), not TensorFlow tasks: leave them out.

  Raises:
    ClusterConfigError: bad JSON, unknown job or task type, index out of
      range, missing port, duplicate address, the chief listed twice, or a
      training `task` with no cluster (Kubeflow's `sparseCluster` form, or
      none at all; an evaluator needs none).
  """
  value = _load_json(text, source)
  cluster = _normalize_cluster(value.get("cluster", {}), source)
  if "task" not in value:
    if sum(len(v) for v in cluster.values()) > 1:
      raise errors.ClusterConfigError(
          f"{source} has a cluster but no 'task': add "
          "\"task\": {\"type\": \"worker\", \"index\": N}.")
    task_type, index, trial = (WORKER if WORKER in cluster else CHIEF), 0, ""
  else:
    task_type, index, trial = _task(value["task"], source)
  if cluster:
    _check_index(task_type, index, cluster, source, evaluator_listed=False)
  elif task_type != EVALUATOR:
    raise errors.ClusterConfigError(_no_cluster_message(value, source))
  info = ClusterInfo(task_type=task_type, task_index=index, cluster=cluster,
                     source=source, rpc_layer=value.get("rpc_layer") or "grpc",
                     environment=str(value.get("environment", "") or ""),
                     trial=trial)
  if reduction_server:
    info = _drop_reduction_server(
        info, PS, "--reduction_server, or CLUSTER_SPEC's job description")
  return info


def _no_cluster_message(value: dict, source: str) -> str:
  """Why a `TF_CONFIG` with a `task` but no cluster is refused: the keys it
  has (Kubeflow's `sparseCluster`, say) and the form TensorFlow reads."""
  keys = ", ".join(repr(k) for k in value) or "none"
  sparse = ("; 'sparseCluster' (Kubeflow's dynamic-worker form) is not read "
            "by TensorFlow's strategies" if "sparseCluster" in value else "")
  return (f"{source} names a task ({json.dumps(value.get('task'))[:80]}) but "
          f"no usable 'cluster' (its keys: {keys}){sparse}: the task would "
          "run alone, as a single process. Give the whole cluster, e.g. "
          "{\"cluster\": {\"worker\": [\"host0:2222\", \"host1:2222\"]}, "
          "\"task\": {\"type\": \"worker\", \"index\": 0}} (on Kubeflow: "
          f"a TFJob without enableDynamicWorker), or unset {source} to train "
          "in one process.")


def from_cluster_spec(text: str, source: str = "CLUSTER_SPEC", *,
                      reduction_server: bool = False) -> ClusterInfo:
  """Parses Vertex AI's `CLUSTER_SPEC` (worker pools -> task types).

  Worker pool 2 is `ps`, unless it runs the Reduction Server
  (`reduction_server`, or `reduction_server_in_job` of the spec's `job`):
  then it is left out of the cluster.

  Args:
    text: the JSON.
    source: the variable's name, for messages.
    reduction_server: `--reduction_server` was given.

  Raises:
    ClusterConfigError: as `from_tf_config`, plus an unknown worker pool.
  """
  value = _load_json(text, source)
  raw_cluster = value.get("cluster", {})
  cluster = _normalize_cluster(raw_cluster, source, pools=VERTEX_WORKER_POOLS)
  if "task" not in value:
    raise errors.ClusterConfigError(
        f"{source} has no 'task': expected "
        "\"task\": {\"type\": \"workerpool0\", \"index\": 0}.")
  task_type, index, trial = _task(value["task"], source,
                                  pools=VERTEX_WORKER_POOLS)
  _check_index(task_type, index, cluster, source, evaluator_listed=True)
  members = {k: v for k, v in cluster.items() if k != EVALUATOR}
  info = ClusterInfo(task_type=task_type, task_index=index, cluster=members,
                     source=source,
                     environment=str(value.get("environment", "") or ""),
                     trial=trial)
  in_job = reduction_server_in_job(value.get("job"))
  if reduction_server or in_job:
    info = _drop_reduction_server(
        info, PS, "its job description names the Reduction Server image"
        if in_job else "--reduction_server")
  return info


def resolve_cluster(*, worker_hosts: str = "", task_index: int = -1,
                    environ: Optional[Mapping[str, str]] = None,
                    reduction_server: bool = False) -> ClusterInfo:
  """Resolves the cluster from flags, `TF_CONFIG` or `CLUSTER_SPEC`.

  Precedence: `--worker_hosts` > `TF_CONFIG` > `CLUSTER_SPEC` > single
  process (see the module docstring). The ignored sources are logged.

  Args:
    worker_hosts: `--worker_hosts`, comma-separated `host:port` ('' if unset).
    task_index: `--task_index` (-1 if unset).
    environ: the environment to read (default `os.environ`).
    reduction_server: `--reduction_server`: Vertex worker pool 2 (TF_CONFIG's
      `ps`) is the Reduction Server. Also inferred from `CLUSTER_SPEC`'s
      `job` (`reduction_server_in_cluster_spec`), even when TF_CONFIG wins.

  Returns:
    A `ClusterInfo`.

  Raises:
    ClusterConfigError: the winning source is malformed, or `--task_index`
      is set without `--worker_hosts`.
  """
  env = os.environ if environ is None else environ
  present = [name for name in ("TF_CONFIG", "CLUSTER_SPEC")
             if env.get(name, "").strip()]
  if worker_hosts:
    info = from_flags(worker_hosts, task_index)
  elif task_index is not None and task_index >= 0 and not present:
    raise errors.ClusterConfigError(
        f"--task_index={task_index} needs --worker_hosts (or a TF_CONFIG / "
        "CLUSTER_SPEC environment variable).")
  elif "TF_CONFIG" in present:
    info = from_tf_config(
        env["TF_CONFIG"], reduction_server=reduction_server or
        reduction_server_in_cluster_spec(env.get("CLUSTER_SPEC")))
  elif "CLUSTER_SPEC" in present:
    info = from_cluster_spec(env["CLUSTER_SPEC"],
                             reduction_server=reduction_server)
  else:
    return ClusterInfo.single_process()
  ignored = [name for name in present if name != info.source]
  if ignored:
    logging.info("Cluster from %s; ignoring %s (precedence: --worker_hosts > "
                 "TF_CONFIG > CLUSTER_SPEC).", info.source, ", ".join(ignored))
  return info


# --- reachability at start ------------------------------------------------
def _split_address(address: str) -> Tuple[str, int]:
  host, _, port = address.rpartition(":")
  return host.strip("[]"), int(port)


def _resolve_once(addresses: Sequence[str], timeout: float
                  ) -> Dict[str, str]:
  """`{address: error}` for the addresses that did not resolve (each looked
  up in a thread of its own; one still unresolved after `timeout` seconds
  counts as failed)."""
  failures: Dict[str, str] = {}
  done: Dict[str, bool] = {}

  def look_up(address):
    host, port = _split_address(address)
    try:
      socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError) as e:
      failures[address] = str(e)
    done[address] = True

  threads = [threading.Thread(target=look_up, args=(a,), daemon=True)
             for a in addresses]
  for thread in threads:
    thread.start()
  deadline = time.time() + timeout
  for thread in threads:
    thread.join(max(deadline - time.time(), 0))
  for address in addresses:
    if not done.get(address):
      failures.setdefault(address, f"no answer from the resolver within "
                        f"{timeout:g} s")
  return failures


def check_addresses_resolve(info: ClusterInfo, *, retry_seconds: float = 30.0,
                            sleep: Callable[[float], None] = time.sleep):
  """Checks that every task's host name resolves (`socket.getaddrinfo`).

  A name that does not resolve is looked up again, every 2 s, for up to
  `retry_seconds` (a cluster manager may register a peer's name only as the
  peer starts); then the run stops. Without this check a task waits for an
  unresolvable peer until `--cluster_start_timeout_seconds`.

  Args:
    info: the resolved cluster; a single process, or an evaluator (which
      connects to no peer), is not checked.
    retry_seconds: how long names that fail are retried, in seconds.
    sleep: the wait between attempts (tests pass a fake).

  Raises:
    ClusterConfigError: an address still does not resolve; the message names
      the task, the address, the error and the source of the cluster.
    StoppedAtStartError: SIGTERM or SIGINT arrived while names were being
      retried (seen after the current lookup, at most 10 s).
  """
  if not info.is_multi_worker or info.task_type == EVALUATOR:
    return
  tasks: Dict[str, List[str]] = {}
  for job, addresses in info.cluster.items():
    for i, address in enumerate(addresses):
      tasks.setdefault(address, []).append(f"{job} {i}")
  started = time.time()
  deadline = started + retry_seconds
  logged = False
  with rendezvous.recording_stop_signals() as received:
    while True:
      failures = _resolve_once(sorted(tasks), timeout=min(
          10.0, max(retry_seconds, 1.0)))
      if not failures:
        return
      if received:
        raise errors.StoppedAtStartError(
            f"received {signal.Signals(received[0]).name} after "
            f"{time.time() - started:.0f} s of waiting for the host names "
            f"of the cluster from {info.source} to resolve (not resolving "
            f"yet: {', '.join(sorted(failures))}); nothing was trained or "
            "saved yet.", received[0])
      if time.time() + 2 > deadline:
        break
      if not logged:
        logging.info("tfdist: not resolving yet: %s; retrying for up to "
                     "%.0f s.", ", ".join(sorted(failures)), retry_seconds)
        logged = True
      sleep(2)
  address, error = sorted(failures.items())[0]
  others = (f" (and {len(failures) - 1} other address(es): "
            f"{', '.join(sorted(failures)[1:])})" if len(failures) > 1 else "")
  raise errors.ClusterConfigError(
      f"{info.source}: {' / '.join(tasks[address])} at {address}: the host "
      f"name does not resolve ({error}){others}, tried for "
      f"{retry_seconds:g} s. Fix the address in {info.source}, or start the "
      "task so that its name is registered (a Kubernetes service, a Vertex "
      "AI replica).")
