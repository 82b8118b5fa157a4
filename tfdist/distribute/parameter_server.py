"""ParameterServerStrategy: roles, the embedding-only partitioner, servers.

One binary serves every role of a parameter-server cluster, read from
`TF_CONFIG` (`{"cluster": {"chief": [...], "worker": [...], "ps": [...]},
"task": {"type": ..., "index": ...}}`):

* `chief`: the coordinator; it builds the strategy and runs the training
  program (`tfdist.experiment` with
  `tfdist.training.step.step_runner.CoordinatorStepRunner`);
* `worker`, `ps`: start a `tf.distribute.Server` and serve until the chief
  marks the run finished (`DONE_MARKER` in `--model_dir`), then exit 0;
* `evaluator`: not a cluster member; it evaluates checkpoints as they appear
  (`tfdist.training.controller.Controller.evaluate_continuously`).

Every task sets `GRPC_FAIL_FAST=use_caller`, as TensorFlow requires for the
coordinator to notice lost workers and ps tasks instead of waiting on them.

Partitioning: only variables created inside
`tfdist.distribute.sharded_embedding.sharding_scope()` (embedding tables) may be
split; every other variable (dense kernels, biases, counters; optimizer slots
are colocated with their variable anyway) gets one shard, because Keras 3
variables cannot be `ShardedVariable`s.
"""

import json
import os
import signal
import threading
import time
from typing import Optional, Tuple

from absl import logging
import tensorflow as tf

from tfdist import config as config_lib
from tfdist import errors
from tfdist.distribute import sharded_embedding
from tfdist.distribute.done_marker import (  # noqa: F401
    DONE_MARKER, clear_done, done_marker, mark_done, marked_done_since)

_partitioners = tf.distribute.experimental.partitioners


def set_grpc_fail_fast():
  """Sets `GRPC_FAIL_FAST=use_caller` (before any gRPC channel exists)."""
  os.environ["GRPC_FAIL_FAST"] = "use_caller"


def cluster_resolver(cluster
                     ) -> tf.distribute.cluster_resolver.ClusterResolver:
  """A resolver over `cluster`'s chief, worker and ps tasks.

  Args:
    cluster: the `tfdist.distribute.cluster.ClusterInfo` of this process.

  Raises:
    ConfigError: no ps or no worker task in the cluster.
  """
  spec = cluster.cluster_dict(("chief", "worker", "ps"))
  if not spec.get("ps") or not spec.get("worker"):
    raise errors.ConfigError(
        "--distribution_strategy=parameter_server needs a cluster with ps and "
        "worker tasks in TF_CONFIG or CLUSTER_SPEC (found jobs: "
        f"{', '.join(sorted(spec)) or 'none'}). Start the cluster with "
        "python -m tfdist.launch --num_workers=N --num_ps=M -- <flags>.")
  return cluster.cluster_resolver(jobs=("chief", "worker", "ps"))


class EmbeddingOnlyPartitioner:
  """Applies `inner` to embedding tables only; one shard for the rest.

  Args:
    inner: a `tf.distribute.experimental.partitioners.Partitioner`.
  """

  def __init__(self, inner):
    self.inner = inner

  def __call__(self, shape, dtype, axis=0):
    if not sharded_embedding.sharding_allowed():
      return [1] * len(shape)
    return self.inner(shape, dtype, axis=axis)

  def __repr__(self):
    return f"EmbeddingOnlyPartitioner({self.inner.__class__.__name__})"


def make_partitioner(kind: str, *, num_ps: int, shard_bytes: int,
                     max_shards: int = 0) -> Optional[EmbeddingOnlyPartitioner]:
  """Builds the variable partitioner `--ps_partitioner` names.

  Args:
    kind: `min_size` (as many shards as allowed, each at least `shard_bytes`,
      at most `max_shards`), `max_size` (shards of at most `shard_bytes`, at
      most `max_shards` of them), `fixed` (exactly `max_shards` shards) or
      `none`.
    num_ps: ps tasks in the cluster (> 0).
    shard_bytes: the size bound in bytes (`--ps_min_shard_bytes`).
    max_shards: most shards per table; 0 means `num_ps`.

  Returns:
    An `EmbeddingOnlyPartitioner`, or None for `none`.

  Raises:
    ConfigError: unknown kind or non-positive sizes.
  """
  if num_ps <= 0:
    raise errors.ConfigError(
        f"A parameter-server cluster needs ps tasks; found "
        f"{num_ps}.")
  if shard_bytes <= 0:
    raise errors.ConfigError(f"--ps_min_shard_bytes={shard_bytes} must be > 0.")
  shards = max_shards or num_ps
  if kind == "none":
    return None
  if kind == "min_size":
    inner = _partitioners.MinSizePartitioner(min_shard_bytes=shard_bytes,
                                             max_shards=shards)
  elif kind == "max_size":
    inner = _partitioners.MaxSizePartitioner(max_shard_bytes=shard_bytes,
                                             max_shards=shards)
  elif kind == "fixed":
    inner = _partitioners.FixedShardsPartitioner(num_shards=shards)
  else:
    raise errors.ConfigError(
        f"--ps_partitioner={kind!r} is unknown. Use one of: "
        "min_size, fixed, max_size, none.")
  return EmbeddingOnlyPartitioner(inner)


# How parameter servers shard variables: the config's parameter-server
# section (`--ps_partitioner`, `--ps_min_shard_bytes`, `--ps_max_shards`),
# handed to this part as it is.
PartitionerOptions = config_lib.ParameterServerConfig


def make_ps_strategy(options: PartitionerOptions, cluster
                     ) -> Tuple[tf.distribute.ParameterServerStrategy, tuple]:
  """Builds `ParameterServerStrategy` over `cluster` (a `ClusterInfo`).

  Args:
    options: the variable partitioner's `PartitionerOptions`.
    cluster: the resolved `tfdist.distribute.cluster.ClusterInfo` with ps tasks.

  Returns:
    `(strategy, devices)`: devices are the ps tasks' CPU device names.

  Raises:
    ConfigError: not a ps cluster, or bad partitioner flags.
  """
  set_grpc_fail_fast()
  resolver = cluster_resolver(cluster)
  num_ps = len(resolver.cluster_spec().as_dict()["ps"])
  partitioner = make_partitioner(
      options.ps_partitioner, num_ps=num_ps,
      shard_bytes=options.ps_min_shard_bytes, max_shards=options.ps_max_shards)
  strategy = tf.distribute.ParameterServerStrategy(
      resolver, variable_partitioner=partitioner)
  logging.info("ParameterServerStrategy: %d ps, %d worker(s), partitioner %s",
               num_ps, len(resolver.cluster_spec().as_dict()["worker"]),
               partitioner)
  devices = tuple(f"/job:ps/replica:0/task:{i}/device:CPU:0"
                  for i in range(num_ps))
  return strategy, devices


def task_of(device: str) -> str:
  """`'ps:1'` for `/job:ps/replica:0/task:1/device:CPU:0`."""
  job = device.split("/job:")[1].split("/")[0] if "/job:" in device else "?"
  task = device.split("/task:")[1].split("/")[0] if "/task:" in device else "0"
  return f"{job}:{task}"


def _device_of(variable) -> str:
  value = getattr(variable, "value", None)
  device = getattr(variable, "device", None)
  if device is None and value is not None:
    device = getattr(value, "device", "")
  return device or ""


def describe_placement(model, optimizer, *, large_bytes: int) -> dict:
  """Where the model's tables, dense weights and optimizer slots live.

  Args:
    model: a Keras model (built).
    optimizer: its built Keras optimizer (or None).
    large_bytes: variables at least this big are listed one by one.

  Returns:
    `{"tables": describe_shards(model), "large_variables": [{"name",
    "shape", "bytes", "device"}], "num_variables": n}`; every shard entry and
    large variable has a `task` (e.g. `ps:1`).
  """
  tables = sharded_embedding.describe_shards(model)
  for table in tables:
    for shard in table["shards"]:
      shard["task"] = task_of(shard["device"])
  variables = list(model.variables)
  if optimizer is not None:
    variables += list(optimizer.variables)
  large = []
  for v in variables:
    size = int(v.shape.num_elements() if hasattr(v.shape, "num_elements")
               else 1) * tf.as_dtype(v.dtype).size
    if size >= large_bytes:
      name = getattr(v, "path", None) or v.name
      device = _device_of(v)
      large.append({"name": name, "shape": [int(d) for d in v.shape],
                    "bytes": size, "device": device, "task": task_of(device)})
  return {"tables": tables, "large_variables": large,
          "num_variables": len(variables)}


def format_placement(placement: dict) -> str:
  """Human-readable lines for `describe_placement`'s result."""
  lines = ["Parameter-server placement:"]
  for table in placement["tables"]:
    lines.append(
        f"  table {table['layer']} {table['shape'][0]} x {table['shape'][1]} "
        f"({table['bytes'] / 2**20:.2f} MiB) in {table['num_shards']} "
        "shard(s):")
    for shard in table["shards"]:
      lines.append(f"    {shard['name']} rows {shard['shape'][0]} on "
                   f"{shard['task']}")
  if placement["large_variables"]:
    lines.append("  large variables (tables, slots, dense):")
    for v in placement["large_variables"]:
      lines.append(f"    {v['name']} {v['shape']} ({v['bytes'] / 2**10:.0f} "
                   f"KiB) on {v['task']}")
  return "\n".join(lines)


# --- checkpoints ----------------------------------------------------------
SHARDS_FILE = "shards.json"


def shard_layout(model) -> dict:
  """`{table layer name: number of shards}` of `model`'s embedding tables."""
  return {t["layer"]: t["num_shards"]
          for t in sharded_embedding.describe_shards(model)}


def write_shard_layout(checkpoint_dir: str, model):
  """Records the shard counts beside the checkpoints (`shards.json`)."""
  tf.io.gfile.makedirs(checkpoint_dir)
  path = os.path.join(checkpoint_dir, SHARDS_FILE)
  tmp = f"{path}.tmp-{os.getpid()}"
  with tf.io.gfile.GFile(tmp, "w") as f:
    json.dump(shard_layout(model), f, indent=2, sort_keys=True)
  tf.io.gfile.rename(tmp, path, overwrite=True)


def check_shard_layout(checkpoint_dir: str, model):
  """Raises if the checkpoints' tables were split differently than now.

  Raises:
    ShardCountMismatchError: a table's shard count differs; the message
      names the table and both counts.
  """
  path = os.path.join(checkpoint_dir, SHARDS_FILE)
  if not tf.io.gfile.exists(path):
    return
  with tf.io.gfile.GFile(path) as f:
    saved = json.load(f)
  now = shard_layout(model)
  for layer, count in sorted(saved.items()):
    if layer in now and now[layer] != count:
      raise errors.ShardCountMismatchError(
          f"The checkpoints in {checkpoint_dir} hold table {layer!r} in "
          f"{count} shard(s), but this cluster splits it into {now[layer]} "
          "shard(s). Restore with the same number of ps tasks and the same "
          "--ps_partitioner, --ps_min_shard_bytes and --ps_max_shards, or "
          "start a fresh --model_dir.")


# --- worker and ps tasks --------------------------------------------------
def serve(model_dir: str, cluster, *, poll_seconds: float = 1.0,
          grace_seconds: float = 30.0, resolver=None,
          server_config=None) -> int:
  """Runs this worker or ps task's server until the chief marks the run done.

  On SIGTERM or SIGINT (a preemption reaches every task of a job at once)
  the server keeps serving, so that the chief can still read the variables
  for its final checkpoint, until the chief marks the run done or
  `grace_seconds` pass.

  Args:
    model_dir: the run's `--model_dir` (where the chief's done marker
      appears).
    cluster: this process's `tfdist.distribute.cluster.ClusterInfo` (a `worker`
      or `ps` task).
    poll_seconds: how often to look for the marker.
    grace_seconds: after a stop signal, serve at most this long
      (`--preemption_grace_seconds`).
    resolver: the cluster's resolver (default: its chief, worker and ps
      tasks, `cluster_resolver`; a pipeline's has no ps tasks).
    server_config: the server's `tf.compat.v1.ConfigProto` (a pipeline's
      worker sets its CPU device count there: a server's devices are its
      own, not the eager context's logical devices).

  Returns:
    The exit status: 0, or 128 + the signal when one arrived.
  """
  set_grpc_fail_fast()
  task_type, task_index = cluster.task_type, cluster.task_index
  resolver = resolver or cluster_resolver(cluster)
  server = tf.distribute.Server(
      resolver.cluster_spec(), job_name=task_type, task_index=task_index,
      protocol=resolver.rpc_layer or "grpc", config=server_config,
      start=True)
  started = time.time()
  stop = {}

  def on_signal(signum, frame):
    del frame  # Unused.
    if "signum" not in stop:
      stop.update(signum=signum, at=time.time() + grace_seconds)
      print(f"tfdist: {task_type}:{task_index} received "
            f"{signal.Signals(signum).name}: serving until the chief's "
            f"checkpoint is done, at most {grace_seconds:g} s.", flush=True)

  if threading.current_thread() is threading.main_thread():
    for signum in (signal.SIGTERM, signal.SIGINT):
      signal.signal(signum, on_signal)
  print(f"tfdist: {task_type}:{task_index} serving at {server.target}; "
        f"exits when {done_marker(model_dir)} appears", flush=True)
  while not marked_done_since(model_dir, started):
    if "signum" in stop and time.time() > stop["at"]:
      print(f"tfdist: {task_type}:{task_index}: grace period over; "
            "exiting.", flush=True)
      return 128 + stop["signum"]
    time.sleep(poll_seconds)
  print(f"tfdist: {task_type}:{task_index} done: the chief finished",
        flush=True)
  return 128 + stop["signum"] if "signum" in stop else 0
