"""Ray Train's backend for tfdist's jobs: each worker's `TF_CONFIG`.

`TfdistTensorflowConfig` replaces Ray Train's `TensorflowConfig` in
`tfdist.ray`'s `TensorflowTrainer`. It writes the same `TF_CONFIG`
(`worker` 0..N-1, each at its node's address), with two differences:

* Each worker's port is held from its choice until TensorFlow's server
  takes it. Ray's backend picks it with `find_free_port`
  (ray/_common/network_utils.py: bind to port 0, then close) in
  `get_address_and_port` (ray/train/_internal/utils.py), and TensorFlow
  binds it seconds later, when the training function builds its
  MultiWorkerMirroredStrategy (2-3 s on a loaded 2-core machine; more
  while a worker imports TensorFlow or restores a checkpoint). A port taken
  by another process meanwhile fails that worker's start ("Could not start
  gRPC server"; TensorFlow's server refuses SO_REUSEPORT), and with it the
  job, unless `max_failures` restarts it. Here each worker listens on its
  port from the start (`rendezvous.reserve_port`) and tfdist's wait for
  the peers takes that socket over (`rendezvous.wait_for_peers`) and
  closes it just before TensorFlow's server binds the port.
* `TF_USE_LEGACY_KERAS` is left alone (Ray's backend sets it to 1 for
  tf_keras users; tfdist runs Keras 3).

It leans on two of Ray's internal names, the ones Ray's own
`TensorflowConfig` imports (ray/train/tensorflow/config.py in Ray 2.60):
`ray.train.v2._internal.util.TrainingFramework` and the worker group's
`execute`/`execute_single_async`. `setup.py` allows Ray 2.60 to 3; a Ray
that moves them fails every Ray job at its start (tests/ray_test.py), not
silently.

This module imports no TensorFlow: Ray's Train controller unpickles the
config, and `ray.train.tensorflow` (Ray's own config's package) imports
TensorFlow there, for nothing (`tfdist.ray` takes `TensorflowTrainer` from
its own module for the same reason).
"""

import dataclasses
import json
import os
from typing import Sequence

import portpicker
import ray
from ray.train.backend import Backend, BackendConfig
from ray.train.v2._internal.util import TrainingFramework

from tfdist.distribute import rendezvous


def _address(host: str, port: int) -> str:
  return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def reserve_worker_address() -> str:
  """Runs in each worker of a multi-worker group: `host:port`, this node's
  address and a port this process holds for TensorFlow's server."""
  return _address(ray.util.get_node_ip_address(), rendezvous.reserve_port())


def free_worker_address() -> str:
  """Runs in the worker of a one-worker group: `host:port`, this node's
  address and a free port (no peer waits for it, so tfdist holds none)."""
  # Found free and released (portpicker, as tfdist.launch picks ports).
  return _address(ray.util.get_node_ip_address(),
                  portpicker.pick_unused_port())


def set_tf_config(worker_addresses: Sequence[str], index: int):
  """Runs in each worker: its `TF_CONFIG`, task `worker` `index`."""
  os.environ["TF_CONFIG"] = json.dumps({
      "cluster": {"worker": list(worker_addresses)},
      "task": {"type": "worker", "index": index}})


class _TfdistTensorflowBackend(Backend):

  def on_start(self, worker_group, backend_config):
    del backend_config
    choose = (reserve_worker_address if len(worker_group) > 1 else
              free_worker_address)
    addresses = worker_group.execute(choose)
    ray.get([worker_group.execute_single_async(
        i, set_tf_config, worker_addresses=addresses, index=i)
             for i in range(len(worker_group))])


@dataclasses.dataclass
class TfdistTensorflowConfig(BackendConfig):
  """Ray Train's backend config for tfdist's workers (see the module)."""

  @property
  def backend_cls(self):
    return _TfdistTensorflowBackend

  @property
  def framework(self):
    return TrainingFramework.TENSORFLOW

  def to_dict(self):
    return {}
