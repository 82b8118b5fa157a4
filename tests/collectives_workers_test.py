"""A device group that spans two TensorFlow processes
(tfdist/parallel/collectives.py across the tasks of a cluster).

Two local tasks of one job `worker` (portpicker ports on 127.0.0.1), each
with 2 logical CPU devices, run the same program as MultiWorkerMirrored
Strategy's workers do (`enable_collective_ops` with the cluster and task 0
as the collective leader); each passes its own devices' tensors
(`group.local_devices`):

* groups {task 0 CPU:0, task 1 CPU:0} and {task 0 CPU:1, task 1 CPU:1}
  all-reduced side by side in one `tf.function`, then the 4 devices
  gathered (rank order: task 0's devices before task 1's, however the
  group was given), an all-to-all across the tasks and its gradient (the
  inverse all-to-all);
* every value against NumPy, for both tasks' results (each prints one JSON
  line); both exit 0 within the test's limit.

And one client driving a remote task's devices
(`tf.config.experimental_connect_to_cluster`; task 1 a plain
`tf.distribute.Server` with 2 CPU devices): a group of task 1's two
devices all-reduces and gathers. (Measured December 2026, not supported: a
group spanning the client's and the server's devices times out, and one of
the client's own devices fails with "unknown device": its collective
executor names them /job:localhost.)

Run as a module this file is a task's program: `task CLUSTER_JSON INDEX`,
`serve CLUSTER_JSON` or `client CLUSTER_JSON`.
"""

import threading

import json
import subprocess
import sys

from absl.testing import absltest
import numpy as np
import portpicker

from tests import multi_worker_testlib
from tests import testutil

# Each task's start (TensorFlow import, the cluster) and its collectives;
# each collective's own limit is COLLECTIVE_TIMEOUT.
TASK_TIMEOUT = 180
COLLECTIVE_TIMEOUT = 60
LEADER = "/job:worker/replica:0/task:0"


def _dev(task, index):
  return f"/job:worker/replica:0/task:{task}/device:CPU:{index}"


def _inputs():
  rng = np.random.default_rng(0)
  xs = [rng.normal(size=(4, 2)).astype(np.float32) for _ in range(4)]
  # all_to_all([4, 2] each, split 0, concat 1) gives [1, 8] each.
  weights = [rng.normal(size=(1, 8)).astype(np.float32) for _ in range(4)]
  return xs, weights


def task_main(cluster: dict, task: int):
  """One task: its 2 devices' side of every collective; prints JSON."""
  # pylint: disable=g-import-not-at-top
  import tensorflow as tf
  from tensorflow.core.protobuf import tensorflow_server_pb2
  from tensorflow.python.eager import context
  from tfdist.parallel import collectives as col
  # pylint: enable=g-import-not-at-top
  tf.config.set_logical_device_configuration(
      tf.config.list_physical_devices("CPU")[0],
      [tf.config.LogicalDeviceConfiguration()] * 2)
  context.context().configure_collective_ops(collective_leader=LEADER)
  context.context().enable_collective_ops(tensorflow_server_pb2.ServerDef(
      cluster=tf.train.ClusterSpec(cluster).as_cluster_def(),
      default_session_config=context.context().config, job_name="worker",
      task_index=task, protocol="grpc"))

  # Device order: task 0's two, then task 1's two.
  devices = [_dev(t, i) for t in (0, 1) for i in (0, 1)]
  cross = [col.DeviceGroup([_dev(1, i), _dev(0, i)], name=f"cross{i}",
                           timeout_seconds=COLLECTIVE_TIMEOUT)
           for i in (0, 1)]
  everyone = col.DeviceGroup(list(reversed(devices)), name="all",
                             timeout_seconds=COLLECTIVE_TIMEOUT)
  xs, weights = _inputs()
  mine = [2 * task, 2 * task + 1]
  placed = []

  @tf.function
  def step():
    inputs = []
    for j in mine:
      with tf.device(devices[j]):
        inputs.append(tf.constant(xs[j]))
    # This task's device i is in group cross{i}.
    summed = [col.all_reduce(cross[i], [inputs[i]])[0] for i in (0, 1)]
    gathered = col.all_gather(everyone, summed, axis=0)
    with tf.GradientTape() as tape:
      tape.watch(inputs)
      exchanged = col.all_to_all(everyone, inputs, split_axis=0,
                                 concat_axis=1)
      loss = tf.add_n([tf.reduce_sum(y * weights[j]) for y, j in
                       zip(exchanged, mine)])
    grads = tape.gradient(loss, inputs)
    placed.extend(y.device for y in exchanged)
    return summed, gathered, exchanged, grads

  with col.timeouts_as_errors(everyone):
    summed, gathered, exchanged, grads = step()
  print(json.dumps({
      "task": task,
      "local": [list(g.local_devices) for g in cross + [everyone]],
      "order": list(everyone.devices),
      "placed": placed,
      "summed": [y.numpy().tolist() for y in summed],
      "gathered": [y.numpy().tolist() for y in gathered],
      "exchanged": [y.numpy().tolist() for y in exchanged],
      "grads": [y.numpy().tolist() for y in grads]}), flush=True)


def serve_main(cluster: dict):
  """Task 1 for a client: a server with 2 CPU devices; prints `ready`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # A server makes its devices from its ConfigProto, not from logical
  # device settings.
  server = tf.distribute.Server(
      tf.train.ClusterSpec(cluster), job_name="worker", task_index=1,
      protocol="grpc",
      config=tf.compat.v1.ConfigProto(device_count={"CPU": 2}))
  print("ready", flush=True)
  server.join()


def client_main(cluster: dict):
  """Task 0 as the one client: a group of task 1's devices."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.parallel import collectives as col  # pylint: disable=g-import-not-at-top
  tf.config.set_logical_device_configuration(
      tf.config.list_physical_devices("CPU")[0],
      [tf.config.LogicalDeviceConfiguration()] * 2)
  tf.config.experimental_connect_to_cluster(
      tf.train.ClusterSpec(cluster), job_name="worker", task_index=0,
      protocol="grpc")
  remote = col.DeviceGroup([_dev(1, 1), _dev(1, 0)], name="remote",
                           timeout_seconds=COLLECTIVE_TIMEOUT)
  xs, _ = _inputs()
  placed = []

  @tf.function
  def step():
    inputs = []
    for j, device in enumerate(remote.devices):
      with tf.device(device):
        inputs.append(tf.constant(xs[j]))
    summed = col.all_reduce(remote, inputs)
    gathered = col.all_gather(remote, summed, axis=1)
    placed.extend(y.device for y in gathered)
    return summed + gathered

  with col.timeouts_as_errors():
    out = step()
  print(json.dumps({"local": list(remote.local_devices), "placed": placed,
                    "out": [y.numpy().tolist() for y in out]}), flush=True)


class GroupAcrossProcessesTest(absltest.TestCase):

  def test_groups_span_two_tasks(self):
    ports = [portpicker.pick_unused_port() for _ in range(2)]
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    env = multi_worker_testlib._env({"TF_ENABLE_ONEDNN_OPTS": "0"})  # pylint: disable=protected-access
    procs = []
    for task in (0, 1):
      procs.append(subprocess.Popen(
          [sys.executable, "-m", "tests.collectives_workers_test", "task",
           json.dumps(cluster), str(task)], cwd=testutil.REPO_ROOT, env=env,
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for proc in procs:
      self.addCleanup(lambda p=proc: (p.poll() is None and p.kill(),
                                      p.wait()))
    outputs = []
    for proc in procs:
      out, _ = proc.communicate(timeout=TASK_TIMEOUT)
      self.assertEqual(proc.returncode, 0, out[-4000:])
      lines = [l for l in out.splitlines() if l.startswith("{")]
      self.assertTrue(lines, out[-4000:])
      outputs.append(json.loads(lines[-1]))

    xs, weights = _inputs()
    pair = [xs[0] + xs[2], xs[1] + xs[3]]
    chunks = [np.split(x, 4, axis=0) for x in xs]
    for task, out in enumerate(outputs):
      mine = [2 * task, 2 * task + 1]
      self.assertEqual(out["task"], task)
      self.assertEqual(out["order"], [_dev(t, i) for t in (0, 1)
                                      for i in (0, 1)])
      self.assertEqual(out["local"], [[_dev(task, 0)], [_dev(task, 1)],
                                      [_dev(task, 0), _dev(task, 1)]])
      self.assertEqual([p.split("/")[3] for p in out["placed"]],
                       [f"task:{task}"] * 2)
      np.testing.assert_allclose(out["summed"], pair, rtol=1e-6)
      for g in out["gathered"]:
        np.testing.assert_allclose(g, np.concatenate(pair + pair),
                                   rtol=1e-6)
      for i, y in zip(mine, out["exchanged"]):
        np.testing.assert_allclose(
            y, np.concatenate([chunks[j][i] for j in range(4)], axis=1))
      # d loss / d x_j, chunk i = weight_i's columns from source j.
      for j, g in zip(mine, out["grads"]):
        want = np.concatenate([np.split(weights[i], 4, axis=1)[j]
                               for i in range(4)], axis=0)
        np.testing.assert_allclose(g, want, rtol=1e-6)

  def test_client_drives_a_remote_tasks_group(self):
    ports = [portpicker.pick_unused_port() for _ in range(2)]
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    env = multi_worker_testlib._env({"TF_ENABLE_ONEDNN_OPTS": "0"})  # pylint: disable=protected-access
    args = [sys.executable, "-m", "tests.collectives_workers_test"]
    server = subprocess.Popen(args + ["serve", json.dumps(cluster)],
                              cwd=testutil.REPO_ROOT, env=env,
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    self.addCleanup(lambda: (server.kill(), server.wait()))
    # A barrier, not a sleep: the server says when it is listening.
    for line in server.stdout:
      if line.strip() == "ready":
        break
    else:
      self.fail(f"the server ended ({server.wait()}) before it was ready")
    # Keep reading its output, so that a full pipe never blocks it.
    threading.Thread(target=server.stdout.read, daemon=True).start()
    client = subprocess.run(args + ["client", json.dumps(cluster)],
                            cwd=testutil.REPO_ROOT, env=env,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            timeout=TASK_TIMEOUT, check=False)
    lines = [l for l in client.stdout.splitlines() if l.startswith("{")]
    self.assertEqual(client.returncode, 0, client.stdout[-4000:])
    self.assertTrue(lines, client.stdout[-4000:])
    out = json.loads(lines[-1])
    xs, _ = _inputs()
    # The client issues every device's collective: all are local to it.
    self.assertEqual(out["local"], [_dev(1, 0), _dev(1, 1)])
    self.assertEqual([p.split("/")[3] for p in out["placed"]],
                     ["task:1", "task:1"])
    total = xs[0] + xs[1]
    want = [total] * 2 + [np.concatenate([total] * 2, axis=1)] * 2
    self.assertLen(out["out"], 4)
    for got, w in zip(out["out"], want):
      np.testing.assert_allclose(got, w, rtol=1e-6)


if __name__ == "__main__":
  if len(sys.argv) == 4 and sys.argv[1] == "task":
    task_main(json.loads(sys.argv[2]), int(sys.argv[3]))
  elif len(sys.argv) == 3 and sys.argv[1] in ("serve", "client"):
    {"serve": serve_main, "client": client_main}[sys.argv[1]](
        json.loads(sys.argv[2]))
  else:
    absltest.main()
