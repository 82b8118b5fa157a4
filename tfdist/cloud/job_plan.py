"""A job's shape and its train flags, checked as the platforms run them.

`JobPlan` is the cluster a Vertex AI CustomJob or a Kubeflow TFJob asks for
(chief, workers, parameter servers, evaluator, Reduction Server, machines),
independent of the platform. `parse_train_flags` parses a replica's
`tfdist.train` flags with tfdist's own flag definitions, under the
environment the job gives the replica, and `check_train_config` checks the
resulting `TrainConfig` against the plan. `tfdist.cloud.vertex_spec` and
`tfdist.cloud.tfjob_spec` build and validate the specs; `python -m
tfdist.job_spec` is the binary.
"""

import copy
import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from absl import flags

from tfdist import flags as tfdist_flags
from tfdist import errors
from tfdist.distribute import auto_select
from tfdist.distribute import environment as environment_lib
from tfdist.core.strategy_kind import StrategyKind
from tfdist.runtime import quiet_tensorflow

TRAIN_MODULE = "tfdist.train"


# --- the job's shape ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class JobPlan:
  """The cluster a job asks for, independent of the platform.

  Attributes:
    num_workers: worker replicas besides the chief (Vertex pool 1, TFJob
      `Worker`; `tfdist.job_spec --worker_replicas`).
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
    need(self.num_workers >= 0,
         f"--worker_replicas={self.num_workers} must be >= 0 (workers "
         "besides the chief).")
    need(self.num_ps >= 0, f"--num_ps={self.num_ps} must be >= 0.")
    need(self.reduction_server_replicas >= 0,
         f"--reduction_server_replicas={self.reduction_server_replicas} must "
         "be >= 0.")
    need(not (self.num_ps and self.reduction_server_replicas),
         f"--num_ps={self.num_ps} and --reduction_server_replicas="
         f"{self.reduction_server_replicas}: worker pool 2 holds either "
         "parameter servers or the Reduction Server. Give one.")
    need(not self.num_ps or self.num_workers >= 1,
         f"--num_ps={self.num_ps} needs --worker_replicas >= 1: under "
         "parameter_server the chief only coordinates; workers train.")
    need(not self.reduction_server_replicas or self.num_workers >= 1,
         "--reduction_server_replicas needs --worker_replicas >= 1: the "
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

  def describe(self) -> str:
    """The machines the job asks for, in one line: `5 machines: 1 chief,
    2 workers, 1 parameter server, 1 evaluator; 2 of them train
    (parameter_server)`."""
    parts = [("chief", 1), ("worker", self.num_workers),
             ("parameter server", self.num_ps),
             ("Reduction Server replica", self.reduction_server_replicas),
             ("evaluator", int(self.evaluator))]
    total = sum(n for _, n in parts)
    training = self.num_workers + (0 if self.num_ps else 1)
    return (f"{total} machine{'s' if total != 1 else ''}: " + ", ".join(
        f"{n} {name}{'s' if n != 1 else ''}" for name, n in parts if n)
            + f"; {training} of them train ({self.strategy.value})")

  @property
  def strategy(self) -> StrategyKind:
    """The strategy `auto` picks for this cluster (its selection rules,
    `tfdist.distribute.auto_select.decide_strategy`, given the job's
    shape and no accelerator)."""
    kind, _ = auto_select.decide_strategy(auto_select.DeviceInventory(
        cluster_source="the job", cluster_workers=1 + self.num_workers,
        cluster_ps=self.num_ps))
    return kind


def need(cond, message: str):
  """Raises `JobSpecError(message)` unless `cond` holds."""
  if not cond:
    raise errors.JobSpecError(message)


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
    raise errors.JobSpecError(
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
      (`tfdist.distribute.environment`); this machine's own variables play no
      part.

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
    raise errors.JobSpecError(
        f"{where}: tfdist.train rejects its flags: {e}") from None
  if len(rest) > 1:
    raise errors.JobSpecError(
        f"{where}: tfdist.train takes no positional arguments;"
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
    from tfdist.training.plan import preflight  # pylint: disable=g-import-not-at-top
    preflight.check_names(config.task, config.cloud)
    if "auto" not in (config.strategy.distribution_strategy,
                      config.precision.dtype):
      # The strategy's own rules (ZeRO under Mirrored, fp16 on a TPU, ...)
      # live in its backend, not in TrainConfig: run them as the replica's
      # start would (with `auto`, the replica decides and checks them).
      from tfdist.backends import registry  # pylint: disable=g-import-not-at-top
      registry.check_strategy_rules(config)
  except errors.ConfigError as e:
    raise errors.JobSpecError(f"{where}: tfdist.train would stop at start: {e}"
                              ) from None
  if config.reliability.dry_run:
    raise errors.JobSpecError(
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
  data = config.task.data
  if prebuilt_container:
    need(data.train_files and data.eval_files,
          f"{where}: the prebuilt container has no raw data for "
          f"--dataset={data.dataset}: give --train_files and --eval_files "
          "(TFRecord globs on gs://, e.g. the files a local run converted "
          "under --data_dir, copied to a bucket).")
  if plan is None:
    return
  name = config.strategy.distribution_strategy
  # None: `auto`, which picks the strategy of the job's shape (`plan.strategy`).
  backend = None if name == "auto" else _backend_for(name)
  need(not config.strategy.cluster.worker_hosts,
        f"{where}: --worker_hosts is set; the platform gives every replica "
        "its cluster (CLUSTER_SPEC/TF_CONFIG). Drop --worker_hosts and "
        "--task_index.")
  if plan.num_ps:
    need(backend is None or backend.asynchronous,
          f"{where}: --distribution_strategy={name} cannot run a cluster "
          f"with {plan.num_ps} parameter server(s); use parameter_server or "
          "auto.")
  else:
    need(backend is None or not backend.asynchronous,
          f"{where}: --distribution_strategy=parameter_server needs "
          "--num_ps >= 1.")
    if plan.num_workers:
      need(backend is None or backend.multi_process,
            f"{where}: --distribution_strategy={name} runs on one machine; "
            f"this job has {plan.num_workers + 1} training replicas. Use "
            "multi_worker_mirrored or auto.")
  if plan.num_workers or plan.num_ps or plan.evaluator:
    model_dir = config.outputs.model_dir
    readers = ("workers resume from" if plan.num_workers or plan.num_ps
               else "the evaluator reads")
    need("://" in model_dir or model_dir.startswith(tuple(shared_prefixes)),
          f"{where}: --model_dir={model_dir} is a folder on each replica's "
          f"own disk, but {readers} the chief's checkpoints: use "
          "shared storage such as gs://BUCKET/run.")


def _backend_for(name: str):
  """The backend of the strategy `name` (`tfdist.backends.registry`),
  imported here: it imports TensorFlow, which the job's flags have
  imported already (`parse_train_flags`)."""
  from tfdist.backends import registry  # pylint: disable=g-import-not-at-top
  return registry.backend_for(name)
