"""Runs tfdist training as a Ray Train job (`TensorflowTrainer`).

Usage:
  python -m tfdist.ray --num_workers=2 -- --dataset=fashion_mnist
      --train_steps=200 --model_dir=/tmp/ray_run
  python -m tfdist.ray --address=auto --num_workers=8 --use_gpu
      --max_failures=3 -- --model_dir=gs://BUCKET/run ...

Everything after `--` is a `tfdist.train` flag; it is checked here, before
Ray starts, into one `TrainConfig` that every worker runs unchanged with
`tfdist.experiment.run_experiment`. Needs Ray Train:
`pip install 'tfdist[ray]'`.

What Ray does and what tfdist does:

* Ray Train's `TensorflowTrainer` starts `--num_workers` worker processes
  (each with `--cpus_per_worker` CPUs and, with `--use_gpu`, one GPU), and
  tfdist's backend for it (`tfdist.cloud.ray_backend`) writes each its
  `TF_CONFIG` (`worker` 0..N-1; worker 0 is tfdist's chief), each port
  held by its worker until TensorFlow's server binds it.
  tfdist trains synchronously across them with MultiWorkerMirroredStrategy,
  one device per worker, with its own batch plan, learning-rate scaling,
  checkpoints and manifest.
* Ray runs the training function in a thread of each worker process, where
  Python cannot handle signals: tfdist's signal-based preemption is off
  there (it says so); Ray handles worker failures. With
  `--max_failures=K` Ray restarts the whole worker group up to K times
  (`ray.train.FailureConfig`), and the restarted workers resume from the
  latest checkpoint in `--model_dir`.
* `--model_dir` and every other local path is made absolute here, since
  Ray's workers run in folders of their own. On a cluster of several
  machines it must be shared storage (e.g. `gs://`): the chief writes
  there and the others restore from it.
* Metrics and checkpoints go to Ray (`RayReportCallback`): every
  `--log_steps` steps and after each evaluation every worker calls
  `ray.train.report` (a barrier across the workers; tfdist's controller
  reaches those points at the same step on every worker), and the chief
  attaches each new tfdist checkpoint as a Ray checkpoint, so
  `CheckpointConfig`, `storage_path`, `Result.checkpoint` and
  `ray.train.get_checkpoint()` hold the model. At the end the final
  metrics are reported with the final checkpoint and `run_manifest.json`,
  so they are the Ray `Result`'s `metrics`; the chief's manifest is its
  `return_value`. A Ray checkpoint newer than `--model_dir`'s own (Ray's
  restart, or `resume_from_checkpoint`) is copied in before training, and
  tfdist resumes from it. The SavedModel stays in `--model_dir`; Ray's own
  run records go to `--storage_path` (default `<model_dir>/ray_results`).
* On one machine the workers' temporary files (non-chief scratch folders)
  go to a folder of the run's, deleted at the end, killed workers' too.
* Ray Tune: `tune_trainable(config, num_workers=...)` is a trainable
  whose trials are tfdist Ray Train jobs, with `tfdist.train` flags
  (`TrainConfig` fields) as the search space and a `--model_dir` per
  trial.
* Each line of a Ray process once: TensorFlow's Python log lines go
  through the root logger's handlers only, Ray Train's print patch is off
  in the workers, and in the local cluster's processes TensorFlow's
  import-time notices are left out (see `setup_local_worker_process`).
* `--address=local` (the default) starts a private one-machine Ray cluster
  for this job with every Ray process on 127.0.0.1 (see
  `init_local_cluster`) and stops it at the end; `--address=auto` joins
  the running cluster (`ray start`); any other value is passed to
  `ray.init(address=...)`.

Parameter-server jobs are refused (see `PS_REFUSAL`): run them with
`python -m tfdist.launch --num_ps=M` or on Vertex AI / Kubernetes.

Library use: `run_on_ray(config, num_workers=2, ...)` after `ray.init` (or
`init_local_cluster`); callers add Keras callbacks with `callbacks=`.
"""

import copy
import glob
import importlib
import json
import logging as std_logging
import os
import shutil
import sys
import tempfile
import time
from typing import Optional, Sequence

if __name__ == "__main__":
  # Run as a file (Bazel's py_binary runs `python tfdist/ray.py`), Python
  # puts tfdist/ first on sys.path, where this file would shadow the `ray`
  # package and `tfdist` would not be found from here: put the folder
  # holding tfdist/ there instead, before anything is imported from it.
  _HERE = os.path.dirname(os.path.abspath(__file__))
  sys.path[:] = [os.path.dirname(_HERE)
                 if os.path.abspath(p or os.curdir) == _HERE else p
                 for p in sys.path]

from absl import app  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import logging  # pylint: disable=g-import-not-at-top,wrong-import-position

from tfdist import flags as tfdist_flags  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdist import errors
from tfdist import config as config_lib
from tfdist.config import TrainConfig
from tfdist.distribute import environment  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdist.core.strategy_kind import StrategyKind  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdist.runtime import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from tfdist.runtime import quiet_tensorflow  # pylint: disable=g-import-not-at-top,wrong-import-position

# Every Ray Train worker is one task of this strategy's cluster.
RAY_STRATEGY = StrategyKind.MULTI_WORKER_MIRRORED
INSTALL_HINT = ("Ray Train is not installed. Install it with: pip install "
                "'tfdist[ray]' (or: pip install 'ray[train]>=2.60,<3').")
LOCALHOST = "127.0.0.1"
# Ray reads this when `ray` is imported: "0" keeps a Ray node on one
# machine, with every process bound to and advertising 127.0.0.1 (Ray's
# behaviour on macOS and Windows). Without it Ray replaces a node IP of
# 127.0.0.1 by the machine's network address.
SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Ray Train's patch of print() in its workers (see `_fit`).
PRINT_PATCH_ENV = "RAY_TRAIN_ENABLE_PRINT_PATCH"
# Unix socket paths are limited to 107 bytes; Ray puts its sockets at
# TEMP_DIR/session_<date>_<time>_<micros>_<pid>/sockets/plasma_store
# (about 70 bytes after TEMP_DIR).
MAX_TEMP_DIR_CHARS = 37
# tfdist passes only the config and small metric dicts through Ray's object
# store (each worker reads its own data), so the local cluster reserves
# little shared memory (Ray's minimum is 75 MiB; its default is 30% of RAM).
LOCAL_OBJECT_STORE_BYTES = 128 << 20
PS_REFUSAL = (
    "parameter-server training does not run under tfdist.ray: Ray Train's "
    "TensorflowTrainer starts identical workers, writes a TF_CONFIG listing "
    "only 'worker' tasks, and ends the job when the workers' training "
    "function returns, while a parameter-server job needs a chief "
    "(coordinator), workers and ps tasks that serve until the chief "
    "finishes, and a restart of all of them when a ps task is lost. Run it "
    "with `python -m tfdist.launch --num_ps=M` on one machine, or on Vertex "
    "AI or Kubernetes (see the README).")
# TrainConfig fields that name local paths (comma-separated for the files).
_PATH_FIELDS = config_lib.settings_with("folder")
_FILE_FIELDS = tuple((n, f"--{n}")
                     for n in config_lib.settings_with("files"))


def _is_local(path: str) -> bool:
  return bool(path) and "://" not in path


def _absolute(path: str) -> str:
  return os.path.abspath(os.path.expanduser(path)) if _is_local(path) else path


def _backend_for(strategy: str):
  """The backend of the strategy `strategy` (`tfdist.backends.registry`),
  imported on first use: it imports TensorFlow, which a driver needs for
  nothing else."""
  from tfdist.backends import registry  # pylint: disable=g-import-not-at-top
  return registry.backend_for(strategy)


def prepare_config(config: TrainConfig) -> TrainConfig:
  """Checks and adapts `config` for Ray Train workers; runs before Ray.

  * `--distribution_strategy=auto` becomes `multi_worker_mirrored` (the
    only strategy here); `parameter_server` is refused with `PS_REFUSAL`,
    and every single-process strategy with the fix.
  * Local paths (`--model_dir`, the other output folders, `--data_dir`,
    `--raw_data_dir`, each glob of `--train_files`/`--eval_files`) become
    absolute: Ray's workers run in folders of their own. An unset
    `--data_dir` becomes this machine's default, made absolute.
  * Local `--train_files`/`--eval_files` globs must match a file (a missing
    file would otherwise fail every worker, then every Ray restart).

  Args:
    config: the run's validated `TrainConfig`.

  Returns:
    The adapted config (validated again).

  Raises:
    ConfigError: an unsupported strategy, `--worker_hosts`/`--task_index`
      (Ray gives the cluster), or a local file glob that matches nothing.
  """
  strategy = config.strategy.distribution_strategy
  # None: `auto`, which becomes RAY_STRATEGY.
  backend = None if strategy == "auto" else _backend_for(strategy)
  if backend is not None and backend.asynchronous:
    raise errors.ConfigError(
        f"--distribution_strategy={strategy}: {PS_REFUSAL}")
  if backend is not None and not backend.multi_process:
    raise errors.ConfigError(
        f"--distribution_strategy={strategy} does not apply under tfdist.ray: "
        "each Ray Train worker is one task of a MultiWorkerMirroredStrategy "
        "cluster with one device. Use --distribution_strategy="
        "multi_worker_mirrored (or auto), or run `python -m tfdist.train` "
        "for one process.")
  cluster = config.strategy.cluster
  if cluster.worker_hosts or cluster.task_index >= 0:
    raise errors.ConfigError(
        f"--worker_hosts={cluster.worker_hosts!r} / --task_index="
        f"{cluster.task_index}: Ray Train gives every worker its place in the "
        "cluster (TF_CONFIG). Drop both flags.")
  changes = {"distribution_strategy": RAY_STRATEGY.value}
  for name in _PATH_FIELDS:
    value = getattr(config, name)
    data = config.task.data
    if name == "data_dir" and not value and not (data.train_files and
                                                  data.eval_files):
      # This binary's edge: the driver's environment names the data folder.
      value = environment.read_environment().default_data_dir
    changes[name] = _absolute(value) if value else value
  for name, flag in _FILE_FIELDS:
    patterns = [p.strip() for p in getattr(config, name).split(",")
                if p.strip()]
    for pattern in patterns:
      if _is_local(pattern) and not glob.glob(_absolute(pattern)):
        raise errors.ConfigError(
            f"{flag}={pattern!r} matches no file (looked for "
            f"{_absolute(pattern)}). Check the path, or leave {flag} empty "
            "to use the --dataset's own files.")
    changes[name] = ",".join(_absolute(p) for p in patterns)
  return config.replace(**changes)


# Ray is an optional dependency (`pip install 'tfdist[ray]'`): `ray` and its
# parts are imported inside the functions that use them, after
# `_require_ray` named the fix if it is missing.
def _require_ray():
  try:
    import ray  # pylint: disable=g-import-not-at-top
    import ray.train  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    raise ImportError(f"{INSTALL_HINT} ({e})") from None
  return ray


def init_local_cluster(*, num_cpus: float, num_gpus: Optional[int] = None,
                       temp_dir: Optional[str] = None,
                       object_store_memory: int = LOCAL_OBJECT_STORE_BYTES
                       ) -> str:
  """Starts a one-machine Ray cluster in this process, all on 127.0.0.1.

  `ray.init` with no dashboard, `object_store_memory` bytes of object
  store, Ray's temporary files under `temp_dir`, and
  `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (set here if `ray` is not imported
  yet), which makes Ray bind every server to, and advertise, 127.0.0.1:
  the GCS, the raylet, the runtime-env agent, every worker process and so
  the `TF_CONFIG` that Ray Train writes. Stop it with `ray.shutdown()`.

  Args:
    num_cpus: logical CPUs Ray may hand out (>= the workers' total).
    num_gpus: GPUs (None: Ray detects them).
    temp_dir: Ray's temporary folder, at most `MAX_TEMP_DIR_CHARS`
      characters (Unix socket paths inside it are limited to 107 bytes).
      None: a new folder under the system's temporary folder (`/tmp` when
      that is too long); the caller deletes it after `ray.shutdown()`.
    object_store_memory: bytes of shared memory for Ray's object store.

  Returns:
    The temporary folder used.

  Raises:
    ImportError: Ray is not installed (the message says how to install it).
    ValueError: `temp_dir` is too long.
    RuntimeError: Ray was imported before `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`
      was set, and advertises another address than 127.0.0.1 (the cluster
      is stopped again).
  """
  if temp_dir is None:
    base = tempfile.gettempdir()
    if len(base) + len("/tfdist-ray-xxxxxxxx") > MAX_TEMP_DIR_CHARS:
      base = "/tmp"
    temp_dir = tempfile.mkdtemp(prefix="tfdist-ray-", dir=base)
  elif len(temp_dir) > MAX_TEMP_DIR_CHARS:
    raise ValueError(
        f"Ray temp_dir {temp_dir!r} has {len(temp_dir)} characters; Ray's "
        "Unix sockets inside it would pass the 107-byte limit. Use a folder "
        f"of at most {MAX_TEMP_DIR_CHARS} characters, e.g. under /tmp.")
  if "ray" not in sys.modules:
    os.environ.setdefault(SINGLE_NODE_ENV, "0")
  ray = _require_ray()
  ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
           object_store_memory=object_store_memory, _temp_dir=temp_dir,
           _node_ip_address=LOCALHOST,
           runtime_env={"worker_process_setup_hook":
                        f"{__name__}.setup_local_worker_process"})
  address = ray.util.get_node_ip_address()
  if address != LOCALHOST:
    ray.shutdown()
    raise RuntimeError(
        f"The local Ray cluster advertises {address}, not {LOCALHOST}: Ray "
        f"was imported before {SINGLE_NODE_ENV}=0 was set. Set it in the "
        "environment before importing ray.")
  logging.info("Local Ray cluster: %s CPUs, everything on %s, temp dir %s.",
               num_cpus, LOCALHOST, temp_dir)
  return temp_dir


# Ray Train's placement-group cleaner asks Ray's State API, served by the
# dashboard, whether the controller still runs, every second; without the
# dashboard (the local cluster's) each try logs this warning, while
# ray.shutdown() removes the placement group in any case.
_STATE_API_LOGGER = (
    "ray.train.v2._internal.execution.controller.placement_group_cleaner")


def setup_local_worker_process():
  """Runs at the start of every process of `init_local_cluster`'s cluster
  (Ray's `worker_process_setup_hook`).

  * Silences the placement-group cleaner's warning that the State API
    (the dashboard, off here) is unavailable, which it repeats every
    second of a run.
  * TensorFlow's native code prints its import-time notices (absl's
    "logging is not initialized" line, the oneDNN and CPU-feature lines)
    twice per process, from two of its libraries, whatever
    `TF_CPP_MIN_LOG_LEVEL` says; the Train workers import TensorFlow (and
    so does any process that imports `ray.train.tensorflow`). Here the
    first import of each process leaves
    them out (`quiet_tensorflow.quiet_on_import`), and TensorFlow's C++
    INFO and WARNING lines are off as in `tfdist.train`
    (`TF_CPP_MIN_LOG_LEVEL=2` unless set; `TF_CPP_MIN_LOG_LEVEL=0` shows
    everything).
  """
  std_logging.getLogger(_STATE_API_LOGGER).setLevel(std_logging.ERROR)
  quiet_tensorflow.default_log_level()
  quiet_tensorflow.quiet_on_import()


# --- inside the Ray Train workers (tfdist.cloud.ray_worker) ---------------------
# Names of `tfdist.cloud.ray_worker` also importable from here.
_WORKER_NAMES = ("RayReportCallback", "checkpoint_step", "export_checkpoint",
                 "import_checkpoint", "final_metrics",
                 "IMPORT_TIMEOUT_SECONDS")


def _ray_worker():
  """`tfdist.cloud.ray_worker`, imported on first use: it imports TensorFlow,
  Keras and Ray Train, which this module's binary imports only after its
  `quiet_tensorflow` set-up, and which a driver never needs."""
  from tfdist.cloud import ray_worker  # pylint: disable=g-import-not-at-top
  return ray_worker


def __getattr__(name):  # PEP 562: `tfdist.ray.RayReportCallback`, ...
  if name in _WORKER_NAMES:
    return getattr(_ray_worker(), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def train_loop_per_worker(loop_config: dict) -> dict:
  """Ray Train's per-worker function: one tfdist run of `loop_config`
  (`tfdist.cloud.ray_worker.run_worker`).

  Args:
    loop_config: `{"config": TrainConfig, "callbacks": [Keras callbacks],
      "resume_from": a ray.train.Checkpoint or None}`.

  Returns:
    This worker's run manifest (Ray keeps rank 0's: the chief's).
  """
  return _ray_worker().run_worker(loop_config)


# --- the driver -------------------------------------------------------------
def run_on_ray(config: TrainConfig, *, num_workers: int, use_gpu: bool = False,
               cpus_per_worker: float = 1.0, max_failures: int = 0,
               storage_path: Optional[str] = None, name: Optional[str] = None,
               callbacks: Sequence = (), run_config=None,
               resume_from_checkpoint=None):
  """Runs `config` as a Ray Train job on the Ray cluster this process joined.

  Call `ray.init` (or `init_local_cluster`) first; without it Ray starts a
  default local cluster (which advertises the machine's network address).

  Args:
    config: a `TrainConfig`; `prepare_config` is applied to it here.
    num_workers: Ray Train workers (>= 1), one MultiWorkerMirroredStrategy
      task and one device each.
    use_gpu: give each worker one GPU.
    cpus_per_worker: CPUs Ray reserves per worker (> 0).
    max_failures: how often Ray restarts the worker group after a failure
      (`ray.train.FailureConfig`; -1: without limit). Each restart resumes
      from the latest checkpoint in `--model_dir`.
    storage_path: where Ray keeps its run records and the final Ray
      checkpoint (default `<model_dir>/ray_results`).
    name: the Ray run's name (default: Ray's).
    callbacks: extra Keras callbacks for every worker (picklable; called
      at the same points on every worker).
    run_config: the user's own `ray.train.RunConfig` (its `name`,
      `storage_path`, `failure_config`, `checkpoint_config`, Ray
      `callbacks`, ...), used as given instead of the one `name`,
      `storage_path` and `max_failures` make; give those inside it.
    resume_from_checkpoint: a `ray.train.Checkpoint` of an earlier tfdist
      Ray run (e.g. its `Result.checkpoint`): the run starts from its
      tfdist checkpoint when `--model_dir` holds none as new.

  Returns:
    The `ray.train.Result`: `metrics` = `final_metrics` of the chief's
    manifest, `checkpoint` = the last Ray checkpoint (the final tfdist
    checkpoint, with `run_manifest.json`), `best_checkpoints` and
    `metrics_dataframe` (a row per report: every `--log_steps` and every
    evaluation), `return_value` = the chief's manifest dict, `error` on
    failure.

  Raises:
    ImportError: Ray Train is not installed.
    ConfigError: from `prepare_config`, bad counts, or `run_config` with
      `name`, `storage_path` or `max_failures`.
  """
  check_worker_counts(num_workers=num_workers,
                      cpus_per_worker=cpus_per_worker,
                      max_failures=max_failures)
  config = prepare_config(config)
  ray = _require_ray()
  _warn_if_local_model_dir_on_a_cluster(ray, config.outputs.model_dir)
  if run_config is not None:
    _refuse_run_config_duplicates(name=name, storage_path=storage_path,
                                  max_failures=max_failures)
    max_failures = (run_config.failure_config.max_failures
                    if run_config.failure_config else 0)
  else:
    run_config = _default_run_config(
        name=name, max_failures=max_failures,
        storage_path=storage_path or os.path.join(config.outputs.model_dir,
                                                  "ray_results"))
  logging.info("Ray Train: %d worker(s) x %s CPUs%s, max_failures=%d, "
               "model_dir %s", num_workers, cpus_per_worker,
               " + 1 GPU" if use_gpu else "", max_failures,
               config.outputs.model_dir)
  return _fit(config, num_workers=num_workers, use_gpu=use_gpu,
              cpus_per_worker=cpus_per_worker, callbacks=callbacks,
              run_config=run_config, resume_from=resume_from_checkpoint)


def check_worker_counts(*, num_workers: int, cpus_per_worker: float,
                        max_failures: int = 0):
  """Checks a Ray Train job's sizes (the launcher's flags).

  Args:
    num_workers: Ray Train workers (>= 1).
    cpus_per_worker: CPUs Ray reserves per worker (> 0).
    max_failures: restarts of the worker group (>= 0, or -1: no limit).

  Raises:
    ConfigError: a count out of range (the message names the flag).
  """
  if num_workers < 1:
    raise errors.ConfigError(f"--num_workers={num_workers} must be >= 1.")
  if cpus_per_worker <= 0:
    raise errors.ConfigError(
        f"--cpus_per_worker={cpus_per_worker} must be > 0.")
  if max_failures < -1:
    raise errors.ConfigError(
        f"--max_failures={max_failures} must be >= 0 (or -1: no limit).")


def _warn_if_local_model_dir_on_a_cluster(ray, model_dir: str):
  """Warns when a local `--model_dir` is used on several Ray nodes."""
  if not (ray.is_initialized() and _is_local(model_dir)):
    return
  nodes = [n for n in ray.nodes() if n.get("Alive")]
  if len(nodes) > 1:
    logging.warning(
        "--model_dir=%s is a local path on a %d-node Ray cluster: the "
        "chief writes checkpoints there and the other workers restore from "
        "it, so it must be shared storage (gs://, or a shared mount).",
        model_dir, len(nodes))


def _refuse_run_config_duplicates(*, name, storage_path, max_failures):
  """`run_on_ray`'s `name`, `storage_path` and `max_failures` belong in the
  caller's own `run_config` when one is given (ConfigError otherwise)."""
  given = [f for f, v in (("name", name), ("storage_path", storage_path),
                          ("max_failures", max_failures)) if v]
  if given:
    where = ("failure_config=FailureConfig(max_failures=...)"
             if given[0] == "max_failures" else f"{given[0]}=...")
    raise errors.ConfigError(
        f"run_on_ray: {given[0]} and run_config given: set "
        f"it in the RunConfig (RunConfig({where})).")


def _default_run_config(*, name, storage_path: str, max_failures: int):
  """The `ray.train.RunConfig` of a job without the caller's own."""
  # Ray is optional (pip install 'tfdist[ray]'): imported only when used.
  from ray.train import FailureConfig, RunConfig  # pylint: disable=g-import-not-at-top
  return RunConfig(name=name, storage_path=storage_path,
                   failure_config=FailureConfig(max_failures=max_failures))


def _fit(config: TrainConfig, *, num_workers: int, use_gpu: bool,
         cpus_per_worker: float, callbacks: Sequence, run_config,
         resume_from=None):
  """Builds tfdist's `TensorflowTrainer` for the prepared `config` and runs
  it (`trainer.fit()`); returns the `ray.train.Result`."""
  import ray  # pylint: disable=g-import-not-at-top,redefined-outer-name
  from ray.train import ScalingConfig  # pylint: disable=g-import-not-at-top
  # Ray Train 2's TensorflowTrainer (the one `ray.train.tensorflow` exports),
  # from its own module: `ray.train.tensorflow` imports TensorFlow, which
  # this process (a driver, a Tune trial's) needs for nothing.
  from ray.train.v2.tensorflow.tensorflow_trainer import TensorflowTrainer  # pylint: disable=g-import-not-at-top
  from tfdist.cloud import ray_backend  # pylint: disable=g-import-not-at-top
  resources = {"CPU": cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
  scratch = None
  worker_env = dict(run_config.worker_runtime_env or {})
  env_vars = dict(worker_env.get("env_vars") or {})
  # Ray replaces a worker's sys.stdout by an unbuffered file on the same
  # descriptor, which Ray Train's print patch takes for a user's redirect:
  # it then writes each print() twice, to stdout and through the root
  # logger to the console. Without the patch each print() line comes once.
  env_vars.setdefault(PRINT_PATCH_ENV, "0")
  if (ray.is_initialized() and run_config.worker_runtime_env is None and
      len([n for n in ray.nodes() if n.get("Alive")]) == 1):
    # One machine: the workers' temporary files (the non-chief workers'
    # scratch folders, the checkpoint copies reported to Ray) go to a
    # folder of this run's, deleted at the end, so that a worker Ray
    # killed leaves nothing behind.
    scratch = tempfile.mkdtemp(prefix="tfdist-ray-scratch-")
    env_vars["TMPDIR"] = scratch
  run_config = copy.copy(run_config)  # The caller's stays as it was.
  run_config.worker_runtime_env = {**worker_env, "env_vars": env_vars}
  trainer = TensorflowTrainer(
      train_loop_per_worker,
      # Ray Train 2's way of starting from an earlier run's checkpoint:
      # the training function gets it (`resume_from_checkpoint=` of the
      # trainer is deprecated there).
      train_loop_config={"config": config, "callbacks": list(callbacks),
                         "resume_from": resume_from},
      # TF_CONFIG with each worker's port held until TensorFlow binds it.
      tensorflow_config=ray_backend.TfdistTensorflowConfig(),
      scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                   resources_per_worker=resources),
      run_config=run_config)
  try:
    return trainer.fit()
  finally:
    if scratch:
      shutil.rmtree(scratch, ignore_errors=True)


# --- Ray Tune -----------------------------------------------------------------
# TrainConfig fields a trial may not set: each trial's own folders follow
# from its --model_dir, and Ray Train gives the cluster.
_TRIAL_FIXED_FIELDS = (config_lib.settings_with("output_folder") +
                       config_lib.settings_with("cluster_given"))


# The CPUs a Tune trial's own process reserves: it only waits on its Ray
# Train job (Tune refuses a trial that reserves nothing).
TRIAL_DRIVER_CPUS = 0.01


def _refuse_shared_trial_folders(config: TrainConfig):
  """ConfigError if `config` sets a folder every trial would share."""
  shared = [f for f in config_lib.settings_with("output_folder")
            if f != "model_dir" and getattr(config, f)]
  if shared:
    raise errors.ConfigError(
        f"--{shared[0]}={getattr(config, shared[0])!r} would be shared by "
        "every Tune trial: leave it unset, and each trial's goes under its "
        "own --model_dir (<model_dir>/<trial name>).")


def _require_tune():
  """`ray.tune`, or an ImportError that says how to install it."""
  _require_ray()
  try:
    # Ray is optional (pip install 'tfdist[ray]'): imported only when used.
    from ray import tune  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(f"{INSTALL_HINT} Ray Tune: pip install 'ray[tune]' "
                      f"({e})") from None
  return tune


def trial_train_config(base: TrainConfig, params: dict,
                       trial: str) -> TrainConfig:
  """The `TrainConfig` of one Tune trial: `base` with the trial's `params`
  and `--model_dir=<base.model_dir>/<trial>`.

  Args:
    base: the prepared base config (`prepare_config`).
    params: the trial's parameters, `TrainConfig` field names to values.
    trial: the trial's name (a folder name).

  Returns:
    The trial's config (validated by `TrainConfig.replace`).

  Raises:
    ConfigError: a parameter that is no `TrainConfig` field or one of
      `_TRIAL_FIXED_FIELDS` (the message names it), or a bad value.
  """
  fields = set(config_lib.flat_fields())
  bad = sorted(k for k in params
               if k not in fields or k in _TRIAL_FIXED_FIELDS)
  if bad:
    raise errors.ConfigError(
        f"Tune parameter {bad[0]!r}: not a tfdist.train flag a trial may "
        f"set ({'each trial has its own' if bad[0] in fields else 'no such field'}"
        "). Use TrainConfig field names (the flag names), other than "
        f"{', '.join(_TRIAL_FIXED_FIELDS)}.")
  return base.replace(model_dir=os.path.join(base.outputs.model_dir, trial),
                      **params)


def _run_trial(tune, base: TrainConfig, params: dict, **fit_args):
  """One Tune trial: `base` with `params` as a Ray Train job (`_fit`
  arguments `fit_args`) whose reports reach Tune; the trial ends with the
  job's final metrics and checkpoint, or raises the job's error."""
  # Ray is optional (pip install 'tfdist[ray]'): imported only when used.
  from ray.train import RunConfig  # pylint: disable=g-import-not-at-top
  from ray.tune.integration.ray_train import TuneReportCallback  # pylint: disable=g-import-not-at-top
  trial = tune.get_context().get_trial_name()
  trial_config = trial_train_config(base, params, trial)
  result = _fit(
      trial_config, **fit_args,
      run_config=RunConfig(
          name=trial,
          storage_path=os.path.join(trial_config.outputs.model_dir,
                                    "ray_results"),
          callbacks=[TuneReportCallback()]))
  if result.error is not None:
    raise result.error
  checkpoint = result.checkpoint and tune.Checkpoint(
      result.checkpoint.path, filesystem=result.checkpoint.filesystem)
  tune.report(result.metrics, checkpoint=checkpoint)


def tune_trainable(config: TrainConfig, *, num_workers: int = 1,
                   use_gpu: bool = False, cpus_per_worker: float = 1.0,
                   callbacks: Sequence = ()):
  """A Ray Tune trainable running one tfdist Ray Train job per trial.

  Use it with Ray Tune, tfdist.train's flag names as the search space:

      tuner = ray.tune.Tuner(
          tfdist.ray.tune_trainable(config, num_workers=1),
          param_space={"base_learning_rate":
                       ray.tune.grid_search([0.02, 0.002])})
      best = tuner.fit().get_best_result(metric="eval_loss", mode="min")

  Each trial runs `config` with the trial's parameters as `TrainConfig`
  field overrides (a `replace`, validated as flags are), in a
  `--model_dir` of its own: `<config.model_dir>/<trial name>` (its
  checkpoints, TensorBoard files, manifest and Ray Train run records under
  `ray_results/` there). Ray Train's reports (every `--log_steps` and every
  evaluation, see `RayReportCallback`) reach Tune as the trial's
  intermediate results, so Tune's schedulers (ASHA, PBT, ...) can act on
  them by `step` (the log points' reports hold `loss`, the evaluations'
  `val_loss`, `val_accuracy`, ..., the last one `eval_*`: a
  `TuneConfig(metric=)` Tune checks in every result needs
  `TUNE_DISABLE_STRICT_METRIC_CHECKING=1`); the trial ends with
  tfdist's final metrics (`final_metrics`) and its final checkpoint (the
  tfdist checkpoint and `run_manifest.json`), so the trial's
  `ray.tune.Result` has `metrics`, `checkpoint` and `path` of its own. A
  trial whose job fails raises its error in Tune (the trial's `error`).

  The trial's own process reserves `TRIAL_DRIVER_CPUS` (0.01) CPUs; its
  Ray Train workers (`num_workers` x `cpus_per_worker` CPUs, + 1 GPU each
  with `use_gpu`) are what a trial holds, so on N CPUs about N /
  (num_workers * cpus_per_worker + 0.01) trials run at once
  (`TuneConfig(max_concurrent_trials=)` lowers that).

  Args:
    config: the base `TrainConfig` (`prepare_config` is applied to it
      here); `model_dir` is the folder of the trials' folders.
    num_workers: Ray Train workers per trial (>= 1).
    use_gpu: give each worker one GPU.
    cpus_per_worker: CPUs Ray reserves per worker (> 0).
    callbacks: extra Keras callbacks for every worker of every trial
      (picklable).

  Returns:
    A function trainable (`ray.tune.with_resources` of it) for
    `ray.tune.Tuner`.

  Raises:
    ImportError: Ray Tune is not installed.
    ConfigError: from `prepare_config`, bad counts, or `config` with its own
      `checkpoint_dir`, `tensorboard_dir` or `export_dir` (trials would
      share them). A trial's parameter that is no `TrainConfig` field, or
      one of `model_dir`, `checkpoint_dir`, `tensorboard_dir`,
      `export_dir`, `worker_hosts`, `task_index`, `distribution_strategy`,
      fails that trial with a ConfigError naming it.
  """
  if num_workers < 1:
    raise errors.ConfigError(f"num_workers={num_workers} must be >= 1.")
  if cpus_per_worker <= 0:
    raise errors.ConfigError(f"cpus_per_worker={cpus_per_worker} must be > 0.")
  _refuse_shared_trial_folders(config)
  base = prepare_config(config)
  tune = _require_tune()

  def tfdist_trial(params: dict):
    _run_trial(tune, base, params, num_workers=num_workers, use_gpu=use_gpu,
               cpus_per_worker=cpus_per_worker, callbacks=callbacks)

  return tune.with_resources(tfdist_trial, {"CPU": TRIAL_DRIVER_CPUS})


# --- binary ------------------------------------------------------------------
FLAGS = flags.FLAGS
RAY_FLAGS = ("num_workers", "use_gpu", "cpus_per_worker", "max_failures",
             "address", "storage_path")


def define_ray_flags():
  """Defines the launcher's flags (before `--`) and tfdist.train's flags."""
  flags.DEFINE_integer(
      "num_workers", 2,
      "Ray Train workers: tasks of one MultiWorkerMirroredStrategy cluster, "
      "one device each.")
  flags.DEFINE_bool("use_gpu", False, "Give each worker one GPU.")
  flags.DEFINE_float("cpus_per_worker", 1.0, "CPUs Ray reserves per worker.")
  flags.DEFINE_integer(
      "max_failures", 0,
      "Restart the worker group after a failure at most this many times "
      "(-1: no limit); it resumes from the last checkpoint in --model_dir.")
  flags.DEFINE_string(
      "address", "local",
      "local: start a one-machine Ray cluster on 127.0.0.1 for this job; "
      "auto: join the running cluster (ray start); or a Ray address.")
  flags.DEFINE_string(
      "storage_path", None,
      "Ray's storage for its run records and the final Ray checkpoint "
      "(default: <model_dir>/ray_results).")
  for name in tfdist_flags.define_all_flags():
    flags.declare_key_flag(name)


def _flag_name(arg: str) -> str:
  name = arg.lstrip("-").split("=", 1)[0]
  return name[2:] if name.startswith("no") and name[2:] in RAY_FLAGS else name


def _train_config(argv) -> TrainConfig:
  """The job's prepared `TrainConfig`, from the arguments after `--`.

  Raises:
    app.UsageError: a flag on the wrong side of `--`, a bad tfdist.train
      flag, a leftover argument, or a config `prepare_config` (or
      `check_worker_counts`, for this binary's own flags) refuses.
  """
  train_args = argv[1:]
  misplaced = [a for a in train_args
               if a.startswith("-") and _flag_name(a) in RAY_FLAGS]
  if misplaced:
    raise app.UsageError(
        f"{misplaced[0]} is a flag of tfdist.ray: put it before `--` (after "
        "`--` go tfdist.train's flags).")
  train_flag_names = {f.name for module, fl in
                      FLAGS.flags_by_module_dict().items()
                      if module == tfdist_flags.definitions.__name__
                      for f in fl}
  given_early = sorted(n for n in train_flag_names if FLAGS[n].present)
  if given_early:
    raise app.UsageError(
        f"--{given_early[0]} is a tfdist.train flag: put it after `--`, e.g. "
        f"python -m tfdist.ray --num_workers=2 -- --{given_early[0]}=...")
  try:
    leftover = FLAGS(["tfdist.ray", *train_args])
  except flags.Error as e:
    raise app.UsageError(str(e)) from None
  if len(leftover) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(leftover[1:])}")
  try:
    config = prepare_config(tfdist_flags.flags_to_config())
    check_worker_counts(num_workers=FLAGS.num_workers,
                        cpus_per_worker=FLAGS.cpus_per_worker,
                        max_failures=FLAGS.max_failures)
  except errors.ConfigError as e:
    raise app.UsageError(str(e)) from None
  return config


def _join_cluster(ray) -> Optional[str]:
  """Starts the local cluster (`--address=local`) or joins `--address`;
  exits with a one-line error where that fails.

  Returns:
    The local cluster's temporary folder (to delete at the end), or None.
  """
  if FLAGS.address != "local":
    try:
      ray.init(address=FLAGS.address)
    except ConnectionError as e:
      sys.exit(f"tfdist.ray: error: --address={FLAGS.address}: {e} Start "
               "a cluster with `ray start --head`, or use --address=local "
               "for a one-machine cluster of this job's own.")
    return None
  need = FLAGS.num_workers * FLAGS.cpus_per_worker
  temp_dir = init_local_cluster(
      num_cpus=max(float(os.cpu_count() or 1), need), num_gpus=None)
  gpus = ray.cluster_resources().get("GPU", 0)
  if FLAGS.use_gpu and gpus < FLAGS.num_workers:
    sys.exit(f"tfdist.ray: error: --use_gpu with --num_workers="
             f"{FLAGS.num_workers} needs {FLAGS.num_workers} GPUs; this "
             f"machine has {gpus:g}.")
  return temp_dir


def main(argv):
  """The binary: launcher flags before `--`, tfdist.train's after; one Ray
  Train job; its final metrics printed as JSON (`tfdist.ray: done: {...}`).
  """
  config = _train_config(argv)
  if FLAGS.address == "local":
    os.environ.setdefault(SINGLE_NODE_ENV, "0")
  # In case this process imports TensorFlow (a strategy's backend does).
  quiet_tensorflow.default_log_level()
  quiet_tensorflow.quiet_on_import()
  try:
    ray = _require_ray()
  except ImportError as e:
    sys.exit(f"tfdist.ray: error: {e}")
  temp_dir = None
  started = time.time()
  try:
    temp_dir = _join_cluster(ray)
    result = run_on_ray(config, num_workers=FLAGS.num_workers,
                        use_gpu=FLAGS.use_gpu,
                        cpus_per_worker=FLAGS.cpus_per_worker,
                        max_failures=FLAGS.max_failures,
                        storage_path=FLAGS.storage_path)
  finally:
    if ray.is_initialized():
      ray.shutdown()
    if temp_dir:
      shutil.rmtree(temp_dir, ignore_errors=True)
  if result.error is not None:
    sys.exit(f"tfdist.ray: error: the Ray Train job failed after "
             f"{time.time() - started:.0f} s: {result.error}")
  print("tfdist.ray: done: " + json.dumps(result.metrics, sort_keys=True),
        flush=True)


def run():
  """The entry point of `python -m tfdist.ray` and of its console
  script."""
  define_ray_flags()
  cli.adopt_usage(__doc__, flags.FLAGS.get_key_flags_for_module(__name__))
  app.run(main, flags_parser=cli.flags_parser("tfdist.ray"))


if __name__ == "__main__":
  # Run the copy imported as `tfdist.ray`, so that what goes to Ray's
  # workers names importable functions (cloudpickle copies functions of
  # `__main__` by value).
  importlib.import_module("tfdist.ray").run()
