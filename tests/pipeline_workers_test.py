"""Pipeline stages across the tasks of a cluster (`--pipeline_stages` under
`tfdist.launch`, from `TF_CONFIG`).

One local cluster of two processes per launching test, started by
`tfdist.launch --num_workers=2 --module=tests.pipeline_workers_test`: the
chief drives (its 2 logical CPU devices, all the input, the steps,
`--model_dir`), worker 0 serves its own 2: one copy of 4 stages (stages
1-2 on the chief, 3-4 on the worker), or D x P = 2 x 2 (stage 0 of both
copies on the chief, stage 1 on the worker). With `--deterministic
--seed`:

* K updates of `tfdist.fit` on NumPy arrays (Adam, 1F1B, a skip
  connection across the cuts) give the one-device run's weights within
  1e-5 (the reference is trained once, in this process), in one fresh
  process (4 stages, 4 micro-batches; it splits its CPU into 4 logical
  devices itself: it failed before) and across two processes as D x P =
  2 x 2 (`--num_cpu_devices=2` a task: stage 0 of both copies on the
  chief, stage 1 on the worker, 2 micro-batches a copy), the latter
  resumed from the former's step-1 checkpoint (mid-epoch): it continues
  the epoch and ends within 1e-6 of the uninterrupted run in weights and
  Adam's slots; the plan prints the mesh with each device's coordinates;
  stage 1's gradients meet by the sub-group collectives on the worker,
  stage 0's on the chief's copy-0 device; the manifest lists copy 0's
  stages' devices and the SavedModel serves the trained model's outputs;
  its step-2 checkpoint, restored by a one-device run, gives the third
  update within 1e-5; the chief creates the storage of its own stages'
  weights only (the worker's are created on the worker, from their
  initializers); both processes exit 0;
* where the stages go (P/T per task, GPUs first) and the refusals: ps
  tasks in the cluster, T not dividing P (no processes);
* a worker killed mid-run stops the chief with `PeerLostError`'s line and
  exit status (200), naming the lost task and (from the launcher) its exit
  status.

Run as a module (by the launcher), this file is the tasks' program:
`fit OUT_DIR STEPS VERBOSE [COPIES]` trains and (the chief) writes
`OUT_DIR/weights.npz`; a tfdist error ends it with its exit status, as
`tfdist.train` ends.
"""

import json
import os
import re
import sys
from unittest import mock

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
from absl.testing import absltest  # pylint: disable=g-import-not-at-top
import keras  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

from tests import input_position_testlib as ids_lib  # pylint: disable=g-import-not-at-top
from tests import multi_worker_testlib  # pylint: disable=g-import-not-at-top
from tests import resume_forms_testlib as forms_lib  # pylint: disable=g-import-not-at-top
from tests import testutil  # pylint: disable=g-import-not-at-top
from tfdist import api  # pylint: disable=g-import-not-at-top
from tfdist import errors  # pylint: disable=g-import-not-at-top
from tfdist import exit_codes  # pylint: disable=g-import-not-at-top
from tfdist.backends import pipeline as backend_lib  # pylint: disable=g-import-not-at-top
from tfdist.config import TrainConfig  # pylint: disable=g-import-not-at-top
from tfdist.distribute import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
from tfdist.parallel.pipeline import options as options_lib  # pylint: disable=g-import-not-at-top

BATCH = 16
STEPS = 3
TOLERANCE = 1e-5
# The chief's start, two processes' TensorFlow imports and the steps.
LAUNCH_TIMEOUT = 120


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 8)).astype("float32")
  y = rng.integers(0, 3, size=(64,)).astype("int32")
  return x, y


class _Built:
  model = None


def skip_model():
  """Four layer calls; block_1's output skips to the Add (across the cut)."""
  keras.utils.set_random_seed(1)
  x = keras.Input((8,), name="features")
  h1 = keras.layers.Dense(16, activation="tanh", name="block_1")(x)
  h2 = keras.layers.Dense(16, activation="tanh", name="block_2")(h1)
  h3 = keras.layers.Add(name="skip")([h2, h1])
  out = keras.layers.Dense(3, name="logits")(h3)
  model = keras.Model(x, out, name="skip_model")
  model.compile(
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  _Built.model = model
  return model


def _config(model_dir, steps, **changes):
  settings = dict(model_dir=model_dir, train_steps=steps, batch_size=BATCH,
                  deterministic=True, seed=3, optimizer="adam",
                  base_learning_rate=0.01, lr_scaling="none", mode="train",
                  log_steps=1, num_gpus=0, cluster_start_timeout_seconds=60,
                  checkpoint_steps=1, max_checkpoints=STEPS)
  settings.update(changes)
  return TrainConfig(**settings)


def _fit(model_dir, steps, verbose=0, **changes):
  x, y = _data()
  return api.fit(skip_model, x=x, y=y, verbose=verbose,
                 config=_config(model_dir, steps, **changes))


def fit_main(out_dir: str, steps: int, verbose: int, copies: int = 1):
  """A task's program: 4 stages, 2 a task across a 2-task cluster (in one
  process without one); with `copies=2`, 2 copies of 2 stages (each task
  its 2 logical CPU devices: one stage of both copies; the plan logged).
  The chief saves the trained weights."""
  layout = (dict(pipeline_stages=4, num_microbatches=4) if copies == 1 else
            dict(pipeline_stages=2, num_microbatches=2, num_cpu_devices=2))
  if copies > 1:
    absl_logging.set_verbosity(absl_logging.INFO)
  with testutil.VariableCreations() as log:
    result = _fit(os.path.join(out_dir, "run"), steps, verbose,
                  pipeline_schedule="1f1b", **layout)
  if "role" not in result:
    np.savez(os.path.join(out_dir, "weights.npz"),
             *_Built.model.get_weights())
    with open(os.path.join(out_dir, "created.json"), "w") as f:
      json.dump(log.created, f)


def _cluster(workers: int, ps: int = 0, task=("chief", 0)):
  jobs = {"chief": ["127.0.0.1:1000"],
          "worker": [f"127.0.0.1:{1001 + i}" for i in range(workers)]}
  if ps:
    jobs["ps"] = [f"127.0.0.1:{2000 + i}" for i in range(ps)]
  return cluster_lib.ClusterInfo(task_type=task[0], task_index=task[1],
                                 cluster=jobs, source="TF_CONFIG")


class ClusterLayoutTest(absltest.TestCase):
  """Where the stages go in a cluster, and the refusals (no processes)."""

  def test_stage_tasks_roles_and_stages_per_task(self):
    cluster = _cluster(workers=1)
    self.assertEqual(backend_lib.stage_tasks(cluster),
                     [("chief", 0), ("worker", 0)])
    self.assertEqual(backend_lib.stages_per_task(4, cluster), 2)
    self.assertEqual(backend_lib.stage_tasks(None), [])
    chief = backend_lib.PipelineBackend(cluster).role(cluster)
    self.assertTrue(chief.is_writer)
    self.assertFalse(chief.serves)
    self.assertEqual(chief.num_workers, 1)
    worker = _cluster(workers=1, task=("worker", 0))
    role = backend_lib.PipelineBackend(worker).role(worker)
    self.assertFalse(role.is_writer)
    self.assertTrue(role.serves)

  def test_refuses_ps_tasks_and_uneven_stages(self):
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"--pipeline_stages=2 .*1 ps task.*without ps tasks"):
      backend_lib.stages_per_task(2, _cluster(workers=1, ps=1))
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"--pipeline_stages=3 cannot be spread evenly over the 2 chief and "
        r"worker tasks .*Use --pipeline_stages=2 or 4"):
      backend_lib.stages_per_task(3, _cluster(workers=1))

  def test_data_parallel_copies_refused_where_they_cannot_run(self):
    # D x P runs in one process; these refusals need no GPU (the GPU count
    # is given).
    cpus = TrainConfig(model_dir="/tmp/unused", pipeline_stages=2,
                       num_cpu_devices=4)
    backend_lib.check_copies(cpus, gpus=0)
    # Across 2 tasks: 2 x 4 devices, 4 copies (each task's devices are
    # checked once the chief is connected).
    self.assertEqual(backend_lib.data_degree(cpus, 2), 4)
    backend_lib.check_copies(cpus, tasks=2, gpus=0)
    with self.assertRaisesRegex(
        errors.ConfigError, r"--num_cpu_devices=4 asks for 2 copies .* "
        r"Pass --num_gpus=4 .* or --num_gpus=0"):
      backend_lib.check_copies(cpus, gpus=8)
    gpus = TrainConfig(model_dir="/tmp/unused", pipeline_stages=2,
                       num_gpus=8)
    backend_lib.check_copies(gpus, gpus=8)
    with self.assertRaisesRegex(
        errors.ConfigError, r"--num_gpus=8 \(4 data-parallel copies\) "
        r"needs 8 GPUs; this host has 6. Lower --num_gpus to a multiple "
        r"of 2 up to 6"):
      backend_lib.check_copies(gpus, gpus=6)
    # One copy: nothing to refuse here.
    backend_lib.check_copies(TrainConfig(model_dir="/tmp/unused",
                                         pipeline_stages=2), gpus=8)

  def test_copies_across_tasks_plan_and_refusals(self):
    # --num_cpu_devices counts each task's devices: 2 tasks x 2 = D 2 x P 2,
    # the plan's mesh over the tasks' devices in task order.
    tasks = _cluster(workers=1).training_tasks()
    self.assertEqual(tasks, ("/job:chief/replica:0/task:0",
                             "/job:worker/replica:0/task:0"))
    parallelism = TrainConfig(model_dir="/tmp/unused", pipeline_stages=2,
                              num_microbatches=2).strategy.parallelism
    options = options_lib.PipelineOptions.of(parallelism, num_cpu_devices=2,
                                             tasks=tasks)
    self.assertEqual(options.data, 2)
    self.assertEqual(options.mesh().plan_lines()[1:], [
        f"  {tasks[t] + f'/device:CPU:{i}':<41}  data {i}  pipeline {t}  "
        "tensor 0" for t in (0, 1) for i in (0, 1)])
    self.assertEqual(options_lib.PipelineOptions.of(
        parallelism, num_cpu_devices=2).data, 1)  # One process: 2 devices.
    with self.assertRaisesRegex(
        errors.ConfigError, r"--num_cpu_devices=3 devices on each of the "
        r"cluster's 2 tasks \(6 in all\) cannot hold whole copies of a "
        r"--pipeline_stages=4 pipeline.*Use --num_cpu_devices=2 or 4, or "
        # Stages spread evenly over the 2 tasks: not 3 (a new user's find).
        r"--pipeline_stages=2 or 6\."):
      options_lib.data_degree(4, num_cpu_devices=3, tasks=2)
    def device(name):
      return tf.config.LogicalDevice(name=name, device_type="CPU")
    logical = [device(f"{task}/device:CPU:{i}") for task in tasks
               for i in (1, 0)]
    pairs = [("chief", 0), ("worker", 0)]
    self.assertEqual(
        backend_lib.cluster_stage_devices(pairs, 1, logical_devices=logical,
                                          copies=2),
        [f"{task}/device:CPU:{i}" for task in tasks for i in (0, 1)])
    with self.assertRaisesRegex(
        errors.ConfigError, r"--num_cpu_devices=3 a task puts 1 stage\(s\) "
        r"x 3 data-parallel copies on chief 0, which offers 0 GPU\(s\) and "
        r"2 CPU device\(s\). Lower --num_cpu_devices to 2 or fewer"):
      backend_lib.cluster_stage_devices(pairs, 1, logical_devices=logical,
                                        copies=3)
    interleaved = TrainConfig(
        model_dir="/tmp/unused", pipeline_stages=2, num_cpu_devices=2,
        pipeline_schedule="interleaved", pipeline_virtual_stages=2)
    backend_lib.check_copies(interleaved, gpus=0)  # One process: 1 copy.
    with self.assertRaisesRegex(
        errors.ConfigError, r"--pipeline_schedule=interleaved with "
        r"--num_cpu_devices=2 on each of the cluster's 2 tasks \(D=2 "
        r"copies .* Use --num_cpu_devices=1 \(one copy\), or "
        r"--pipeline_schedule=1f1b"):
      backend_lib.check_copies(interleaved, gpus=0, tasks=2)

  def test_dry_run_plans_the_mesh_across_tasks(self):
    # The chief's --dry_run (no process started, none connected): the
    # plan's mesh over the chief's and worker 0's devices.
    tf_config = {"cluster": {"chief": ["127.0.0.1:1000"],
                             "worker": ["127.0.0.1:1001"]},
                 "task": {"type": "chief", "index": 0}}
    with mock.patch.dict(os.environ, {"TF_CONFIG": json.dumps(tf_config)}):
      with self.assertLogs(level="INFO") as logs:
        result = _fit(testutil.scratch_dir(), STEPS, dry_run=True,
                      pipeline_stages=2, num_microbatches=2,
                      num_cpu_devices=2)
    self.assertTrue(result["dry_run"])
    plan = "\n".join(logs.output)
    self.assertIn("2 copies (data 2 x pipeline 2 over 2 tasks, each on 1/2 "
                  "of the batch) of 2 stages", plan)
    for task, stage in (("chief", 0), ("worker", 1)):
      for data in (0, 1):
        self.assertRegex(plan, re.escape(
            f"/job:{task}/replica:0/task:0/device:CPU:{data}") +
                         rf"\s+data {data}  pipeline {stage}  tensor 0")

  def test_devices_per_task_gpus_first(self):
    def device(name):
      kind = tf.DeviceSpec.from_string(name).device_type
      return tf.config.LogicalDevice(name=name, device_type=kind)
    chief = "/job:chief/replica:0/task:0"
    worker = "/job:worker/replica:0/task:0"
    logical = [device(f"{worker}/device:CPU:1"),
               device(f"{worker}/device:CPU:0"),
               device(f"{chief}/device:CPU:0"),
               device(f"{chief}/device:GPU:1"),
               device(f"{chief}/device:GPU:0")]
    tasks = [("chief", 0), ("worker", 0)]
    self.assertEqual(
        backend_lib.cluster_stage_devices(tasks, 2, logical_devices=logical),
        [f"{chief}/device:GPU:0", f"{chief}/device:GPU:1",
         f"{worker}/device:CPU:0", f"{worker}/device:CPU:1"])
    self.assertEqual(
        backend_lib.cluster_stage_devices(tasks, 1, num_gpus=0,
                                          logical_devices=logical),
        [f"{chief}/device:CPU:0", f"{worker}/device:CPU:0"])
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"3 stages on chief 0, which offers 2 GPU\(s\) and 1 CPU"):
      backend_lib.cluster_stage_devices(tasks, 3, logical_devices=logical)


def _saved_weights(out_dir):
  with np.load(os.path.join(out_dir, "weights.npz")) as saved:
    return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def _max_difference(a, b) -> float:
  assert len(a) == len(b), (len(a), len(b))
  return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


class AcrossWorkersTest(absltest.TestCase):
  _unsplit = None

  @classmethod
  def unsplit(cls):
    """The one-device run's weights after STEPS updates (trained here,
    once)."""
    if cls._unsplit is None:
      _fit(os.path.join(testutil.scratch_dir(), "one_device"), STEPS)
      cls._unsplit = [w.copy() for w in _Built.model.get_weights()]
    return cls._unsplit

  def _launch(self, out_dir, steps, verbose=0, timeout=LAUNCH_TIMEOUT,
              copies=1):
    return multi_worker_testlib.LauncherWatch(
        ["--num_workers=2", "--module=tests.pipeline_workers_test",
         "--stop_grace_seconds=20"],
        ["fit", out_dir, str(steps), str(verbose), str(copies)],
        timeout=timeout)

  def test_two_processes_resume_and_train_like_one_device(self):
    # A: one fresh process, uninterrupted (a checkpoint a step), one copy
    # of 4 stages; it splits its CPU into 4 logical devices itself (it
    # listed them first, which started the runtime, and the split was
    # refused). B: the 2-process cluster, D x P = 2 x 2 (each task's 2
    # logical CPU devices: the mesh over the tasks' devices in task order
    # puts stage 0 of both copies on the chief, stage 1 on the worker;
    # each copy on its half of every batch), resumed from A's step-1
    # checkpoint (mid-epoch: 4 steps an epoch of the NumPy arrays).
    fresh_dir, out_dir = testutil.scratch_dir(), testutil.scratch_dir()
    code, output, _ = multi_worker_testlib.run_module_with_timeout(
        "tests.pipeline_workers_test", ["fit", fresh_dir, str(STEPS), "0"],
        timeout=LAUNCH_TIMEOUT)
    self.assertEqual(code, 0, output)
    ids_lib.copy_checkpoint(os.path.join(fresh_dir, "run"),
                            os.path.join(out_dir, "run"), 1)
    watch = self._launch(out_dir, STEPS, copies=2)
    unsplit = self.unsplit()  # Trained here meanwhile.
    status = watch.wait()
    output = watch.output()
    self.assertEqual(status, 0, output)
    self.assertIn("serving at", output)
    self.assertLess(_max_difference(_saved_weights(fresh_dir), unsplit),
                    TOLERANCE)
    self.assertLess(_max_difference(_saved_weights(out_dir), unsplit),
                    TOLERANCE)
    # Resumed equals uninterrupted: weights and Adam's slots (the
    # comparison can fail: steps 2-3 moved them).
    runs = [os.path.join(d, "run") for d in (fresh_dir, out_dir)]
    self.assertLessEqual(forms_lib.max_difference(*runs), 1e-6)
    self.assertGreater(forms_lib.max_difference(runs[0], os.path.join(
        runs[0], "checkpoints", "ckpt-1")), 1e-3)
    with open(os.path.join(out_dir, "run", "run_manifest.json")) as f:
      manifest = json.load(f)
    self.assertEqual(os.path.basename(manifest["restored_from"]), "ckpt-1")
    self.assertIn("stages on the 2 chief and worker tasks of the cluster",
                  manifest["strategy_reason"])
    self.assertEqual(manifest["pipeline"]["data"], 2)
    chief, worker = ("/job:chief/replica:0/task:0",
                     "/job:worker/replica:0/task:0")
    # Copy 0's stages: index(0, p) = p * D.
    stages = manifest["one_device"]["pipeline_stages"]
    self.assertEqual([s["device"] for s in stages],
                     [f"{chief}/device:CPU:0", f"{worker}/device:CPU:0"])
    # The plan (what --dry_run prints): the mesh, each device's
    # coordinates.
    self.assertIn("2 copies (data 2 x pipeline 2 over 2 tasks, each on 1/2 "
                  "of the batch) of 2 stages", output)
    self.assertIn("mesh: data 2 x pipeline 2 x tensor 1 over 4 devices",
                  output)
    for device, data, stage in ((f"{chief}/device:CPU:1", 1, 0),
                                (f"{worker}/device:CPU:0", 0, 1)):
      self.assertRegex(output, re.escape(device) +
                       rf"\s+data {data}  pipeline {stage}  tensor 0")
    # Stage 1's data group (the worker's devices) ran the sub-group
    # collectives; stage 0's (the chief's own) was summed on copy 0's.
    self.assertIn("stage 1's gradients are all-reduced over its data group "
                  "(collectives); stage 0's are summed on copy 0's device",
                  output)
    # The chief made the storage of its own stages' weights only (those
    # of the worker's stages were created there, from their initializers):
    # the bytes of the weights (`kernel`, `bias`; slots have other names)
    # created on each task are its stages' weight bytes, once per copy.
    with open(os.path.join(out_dir, "created.json")) as f:
      created = json.load(f)
    made = {}
    for name, shape, device in created:
      if name.rsplit("/", 1)[-1] in ("kernel", "bias"):
        task = device.split("/device:")[0]
        made[task] = made.get(task, 0) + 4 * int(np.prod(shape))
    per_task = {}
    for stage in stages:
      task = stage["device"].split("/device:")[0]
      per_task[task] = per_task.get(task, 0) + 2 * stage["param_bytes"]
    self.assertEqual(made, per_task)
    # The SavedModel is the whole trained model.
    exported = tf.saved_model.load(os.path.join(out_dir, "run",
                                                "saved_model"))
    x, _ = _data()
    served = exported.signatures["serving_default"](
        features=tf.constant(x[:4]))
    reference = skip_model()
    reference.set_weights(unsplit)
    self.assertLess(
        float(np.max(np.abs(next(iter(served.values())).numpy() -
                            reference(x[:4]).numpy()))), TOLERANCE)
    # B's checkpoint restores on one device: from its step 2 the
    # one-device run's third update gives the unsplit run's weights.
    one_dir = testutil.scratch_dir()
    ids_lib.copy_checkpoint(os.path.join(out_dir, "run"),
                            os.path.join(one_dir, "run"), 2)
    _fit(os.path.join(one_dir, "run"), STEPS)
    self.assertLess(_max_difference(_Built.model.get_weights(), unsplit),
                    TOLERANCE)

  def test_lost_stage_task_stops_the_chief_with_peer_lost(self):
    out_dir = testutil.scratch_dir()
    watch = self._launch(out_dir, 100000, verbose=2)
    self.assertIsNotNone(watch.wait_for(r"\[chief:0\].*step 2\b", 90),
                         watch.output())
    os.kill(watch.task_pid("worker:0"), 9)
    status = watch.wait()
    output = watch.output()
    self.assertEqual(status, exit_codes.PEER_LOST, output)
    # With the launcher's word on the lost task's status (before: none).
    self.assertRegex(output, re.compile(
        r"\[chief:0\] PeerLostError: Pipeline training lost worker 0 at "
        r"127\.0\.0\.1:\d+ \(tfdist\.launch: worker:0 exited with status "
        r"137\) after step \d+"))


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "fit":
    try:
      fit_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
               *map(int, sys.argv[5:6]))
    except Exception as e:  # pylint: disable=broad-except
      # Ends as tfdist.train ends: the error's line and its exit status.
      print(f"{type(e).__name__}: {e}", flush=True)
      sys.exit(errors.exit_code_for(e) or 1)
  else:
    absltest.main()
