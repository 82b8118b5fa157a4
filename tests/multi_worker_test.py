"""Real two-process MultiWorkerMirroredStrategy clusters on 127.0.0.1.

(A chief whose peer never starts: tests/cluster_start_test.py, one process.)
Every run has a hard timeout and stops only the processes it started (the
launcher forwards the stop to its own tasks). Sized for a 2-core machine:
tiny Fashion-MNIST subsets, a few steps.
"""

import contextlib
import glob
import io
import json
import os
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from tests import conformance_table
from tests import multi_worker_testlib as testlib
from tests import testutil
from tfdist import errors

TIMEOUT = 180


def _convert(limit, train_shards):
  """The glob of `limit` Fashion-MNIST training images in `train_shards`
  files, converted once per process (the tests only read them)."""
  return testutil.fashion_mnist_subset(limit=limit, train_shards=train_shards,
                                       test_shards=1)["train"]


class StrategyOptionsTest(parameterized.TestCase):
  """The factory's multi_worker_mirrored branch, in one process (no peers)."""

  def _config(self, **kwargs):
    from tfdist import config as config_lib  # pylint: disable=g-import-not-at-top
    return config_lib.TrainConfig(
        distribution_strategy="multi_worker_mirrored", model_dir="/tmp/x",
        train_steps=1, num_gpus=0, **kwargs)

  def _make(self, config):
    from tfdist.distribute import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
    from tfdist.distribute import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
    from tfdist.backends import registry as backend_registry  # pylint: disable=g-import-not-at-top
    return backend_registry.make_strategy(
        strategy_lib.StrategyOptions.of(config.strategy),
        cluster=cluster_lib.resolve_cluster())

  @parameterized.named_parameters(("ring", "ring", "RING"),
                                  ("auto", "auto", "AUTO"))
  def test_communication_options(self, alg, implementation):
    with mock.patch.dict(os.environ, {"TF_CONFIG": "", "CLUSTER_SPEC": ""}):
      choice = self._make(self._config(
          all_reduce_alg=alg, collective_timeout_seconds=12,
          bytes_per_pack=4096))
    self.assertEqual(choice.name, "multi_worker_mirrored")
    self.assertEqual(choice.strategy.num_replicas_in_sync, 1)
    options = choice.strategy.extended._communication_options  # pylint: disable=protected-access
    self.assertEqual(options.implementation.name, implementation)
    self.assertEqual(options.timeout_seconds, 12)
    self.assertEqual(options.bytes_per_pack, 4096)

  def test_bytes_per_pack_refused_where_it_does_nothing(self):
    from tfdist import config as config_lib  # pylint: disable=g-import-not-at-top
    from tfdist.backends import registry as backend_registry  # pylint: disable=g-import-not-at-top
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"--bytes_per_pack=1024 applies to multi_worker_mirrored, not "
        r"mirrored.*Drop --bytes_per_pack"):
      # `auto` decided to mirrored: the decided backend's rule.
      backend_registry.backend_for("mirrored").validate(
          config_lib.TrainConfig(model_dir="/tmp/x", train_steps=1,
                                 bytes_per_pack=1024), None, dataset=None)
    with self.assertRaisesRegex(errors.ConfigError,
                                "--bytes_per_pack=-1 must be >= 0"):
      self._config(bytes_per_pack=-1)
    # Named by the flag: the same rule, run as the run is prepared (so
    # --dry_run refuses what the run would).
    for strategy in ("mirrored", "parameter_server", "tpu"):
      with self.assertRaisesRegex(
          errors.ConfigError,
          rf"--bytes_per_pack=1024 applies to multi_worker_mirrored, not "
          rf"{strategy}"):
        backend_registry.check_strategy_rules(config_lib.TrainConfig(
            model_dir="/tmp/x", train_steps=1, tpu="local",
            distribution_strategy=strategy, bytes_per_pack=1024))
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"--bytes_per_pack=1024 does not apply with --zero_stage=1"):
      self._config(bytes_per_pack=1024, zero_stage=1)

  @parameterized.named_parameters(
      ("hierarchical_copy", "hierarchical_copy",
       "--all_reduce_alg=hierarchical_copy does not apply to "
       "multi_worker_mirrored"),
      ("nccl_on_cpu", "nccl", "--all_reduce_alg=nccl needs GPUs"))
  def test_all_reduce_errors(self, alg, message):
    from tfdist import config as config_lib  # pylint: disable=g-import-not-at-top
    with self.assertRaisesRegex(errors.ConfigError, message):
      self._make(self._config(all_reduce_alg=alg))

  def test_ps_task_cannot_run_mirrored(self):
    from tfdist import config as config_lib  # pylint: disable=g-import-not-at-top
    tf_config = json.dumps({"cluster": {"chief": ["127.0.0.1:1"],
                                        "ps": ["127.0.0.1:2"]},
                            "task": {"type": "ps", "index": 0}})
    with mock.patch.dict(os.environ, {"TF_CONFIG": tf_config}):
      with self.assertRaisesRegex(errors.ConfigError,
                                  "runs only on chief and worker tasks"):
        self._make(self._config())


_CLUSTER = {}


def _cluster_run() -> dict:
  """One two-worker cluster (`tfdist.launch`) for the shard test and both
  two-worker trainings of EquivalenceTest, run in turn under one strategy
  (`multi_worker_testlib`'s `programs` mode), once per process: one
  cluster start where there were three. Returns the exit status, the
  output and each program's folder."""
  if not _CLUSTER:
    by_file = _convert(256, 4)   # 4 files of 64: 128 records per worker.
    by_range = _convert(256, 1)  # 1 file < 2 workers: record ranges.
    pattern = _convert(256, 2)
    dirs = {name: testutil.scratch_dir()
            for name in ("shard", "packs", "bfloat16")}
    steps = str(EquivalenceTest.STEPS)
    status, output = testlib.run_launcher(
        ["--num_workers=2", "--module=tests.multi_worker_testlib"],
        ["programs", "shard", dirs["shard"], by_file, by_range,
         # The gradients all-reduced in packs of 1 KiB.
         "+", "train", dirs["packs"], pattern, steps, "1024",
         "+", "train", dirs["bfloat16"], pattern, steps, "0", "bfloat16"],
        timeout=TIMEOUT)
    _CLUSTER.update(status=status, output=output, dirs=dirs,
                    globs=(by_file, by_range), pattern=pattern)
  return _CLUSTER


def _trained_lines(test, run: dict, name: str) -> list:
  """The `train` program's summary lines (one a task) of `run`'s program
  `name`, after asserting the cluster run succeeded."""
  test.assertEqual(run["status"], 0, run["output"][-4000:])
  lines = [line for line in run["output"].splitlines()
           if f"{run['dirs'][name]}: trained " in line]
  test.assertLen(lines, 2, run["output"][-4000:])
  return lines


class ExactlyOnceShardingTest(absltest.TestCase):

  def test_each_example_once_per_epoch_across_two_workers(self):
    run = _cluster_run()
    self.assertEqual(run["status"], 0, run["output"][-4000:])
    by_file, by_range = run["globs"]
    out, output = run["dirs"]["shard"], run["output"]
    results = [json.load(open(p))
               for p in sorted(glob.glob(os.path.join(out, "ids-*.json")))]
    self.assertLen(results, 2, output[-2000:])
    for pattern, mode in ((by_file, "file"), (by_range, "range")):
      with self.subTest(mode=mode):
        per_worker = [r[pattern] for r in results]
        ids = [i for r in per_worker for i in r["ids"]]
        self.assertEqual(per_worker[0]["mode"], mode)
        self.assertLen(ids, 256)
        self.assertEqual(sorted(ids), list(range(256)))  # Each id once.
        self.assertEmpty(set(per_worker[0]["ids"]) & set(per_worker[1]["ids"]))
        for r in per_worker:
          # Per-worker batch = global batch / workers.
          self.assertEqual(r["batch_sizes"], [testlib.GLOBAL_BATCH // 2])


def deep_narrow_model():
  """A Fashion-MNIST classifier of 10 narrow layers: its checkpoints are
  small (about 33 KiB) and its SavedModel's graph large (about 115 KiB).
  (42 layers, with a 256 KiB limit, built and traced for 2.7 CPU-seconds
  more in each of the four processes.)"""
  import keras  # pylint: disable=g-import-not-at-top
  inputs = keras.Input((28, 28, 1), name="image")
  hidden = keras.layers.Dense(4)(keras.layers.Flatten()(inputs))
  for _ in range(8):
    hidden = keras.layers.Dense(4)(hidden)
  return keras.Model(inputs, keras.layers.Dense(10)(hidden))


def _limit_file_size():
  """In a child before it runs: its files may not pass 64 KiB
  (RLIMIT_FSIZE, as in tests/nothing_lost_test.py), so its checkpoints fit
  and its SavedModel's saved_model.pb (`deep_narrow_model`) does not, as
  on a disk that fills during the export."""
  import resource  # pylint: disable=g-import-not-at-top
  resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))


def _full_disk_runs(runs) -> list:
  """Runs `python -m tfdist.train` once per `(root, flags, environment,
  limited)` of `runs` at once (`limited`: under `_limit_file_size`), each
  training 2 steps of `deep_narrow_model` with `--model_dir=root/run` and
  `--export_dir=root/exports/serving`; returns `[(exit status, output)]`."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  procs = []
  for root, flags, environment, limited in runs:
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "tfdist.train",
         f"--train_files={_convert(256, 2)}", "--mode=train",
         f"--model={__name__}:deep_narrow_model", "--batch_size=64",
         "--train_steps=2", "--checkpoint_steps=2", "--log_steps=1",
         f"--model_dir={os.path.join(root, 'run')}",
         f"--export_dir={os.path.join(root, 'exports', 'serving')}",
         *flags],
        cwd=testutil.REPO_ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        preexec_fn=_limit_file_size if limited else None,
        env=testlib._env(environment)))  # pylint: disable=protected-access
  outputs = []
  try:
    for proc in procs:
      outputs.append((proc.communicate(timeout=TIMEOUT)[0], proc))
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  return [(proc.returncode, out) for out, proc in outputs]


class ExportFailureTest(absltest.TestCase):

  def _check_message(self, output: str, export_dir: str):
    self.assertRegex(output, "tfdist.train: error: --export_dir="
                     f"{export_dir}: a write failed: the disk or quota is "
                     "full .*File too large")

  def test_one_process_exits_2_and_leaves_nothing(self):
    # One device and Mirrored (2 logical CPUs), each in its own folders.
    roots = {s: testutil.scratch_dir() for s in ("one_device", "mirrored")}
    results = _full_disk_runs([
        (root, [f"--distribution_strategy={strategy}"] + (
            ["--num_cpu_devices=2"] if strategy == "mirrored" else []),
         {}, True) for strategy, root in roots.items()])
    for (strategy, root), (status, output) in zip(roots.items(), results):
      with self.subTest(strategy=strategy):
        self.assertEqual(status, 2, output[-3000:])
        self._check_message(output, os.path.join(root, "exports", "serving"))
        # Nothing of the failed export is left.
        self.assertEqual(os.listdir(os.path.join(root, "exports")), [])
        conformance_table.check_cell(
            self, "failed_export", strategy, "works (status 2 naming "
            "`--export_dir`; nothing of the export is left)")

  def test_every_task_exits_2_when_the_chiefs_export_disk_is_full(self):
    # Only the chief's files are limited. The worker exported to its own
    # scratch folder and exited 200 (a lost peer, retryable) while the
    # chief exited 2 for the full disk; now both exit 2.
    import portpicker  # pylint: disable=g-import-not-at-top
    from tfdist import launch  # pylint: disable=g-import-not-at-top
    root = testutil.scratch_dir()
    export_dir = os.path.join(root, "exports", "serving")
    tasks = launch.plan_tasks(num_workers=2)
    cluster = launch.make_cluster(
        tasks, [portpicker.pick_unused_port() for _ in tasks])
    (chief_status, chief_out), (worker_status, worker_out) = _full_disk_runs([
        (root, ["--distribution_strategy=multi_worker_mirrored",
                "--collective_timeout_seconds=60"],
         {"TF_CONFIG": launch.tf_config(cluster, task)},
         task.task_type == "chief") for task in tasks])
    self.assertEqual([chief_status, worker_status], [2, 2],
                     chief_out[-3000:] + "\n----\n" + worker_out[-3000:])
    self._check_message(chief_out, export_dir)
    self.assertRegex(worker_out, "tfdist.train: error: 1 replica.* of "
                     "another task of this run stopped at the end of "
                     "training with a status-2 error")
    # Nothing of the failed export is left.
    self.assertEqual(os.listdir(os.path.dirname(export_dir)), [])
    conformance_table.check_cell(
        self, "failed_export", "multi_worker_mirrored", "works (every task "
        "exits 2, the chief naming `--export_dir`; nothing of the export is "
        "left)")


class EquivalenceTest(absltest.TestCase):

  STEPS = 5
  _single = None

  def _one_process(self):
    """`(data pattern, folder)` of the one-process float32 reference run,
    trained once for every test of the class, in this process (one device,
    no cluster: nothing needs a fresh process)."""
    if EquivalenceTest._single is None:
      pattern, single_dir = _convert(256, 2), testutil.scratch_dir()
      out = io.StringIO()
      with mock.patch.dict(os.environ, {"TF_CONFIG": "", "CLUSTER_SPEC": ""}
                           ), contextlib.redirect_stdout(out):
        testlib.train_main(single_dir, pattern, self.STEPS)
      out = out.getvalue()
      self.assertIn("strategy one_device", out)
      self.assertIn("replicas 1", out)
      EquivalenceTest._single = (pattern, single_dir)
    return EquivalenceTest._single

  def test_two_workers_match_one_process(self):
    pattern, single_dir = self._one_process()
    run = _cluster_run()
    self.assertEqual(run["pattern"], pattern)
    multi_dir = run["dirs"]["packs"]
    # The gradients all-reduced in packs of 1 KiB (--bytes_per_pack), last
    # layers first: the step's sums (24 bytes), the 10-way layer's bias and
    # kernel (1.3 KiB) in one, the first layer's in another.
    for line in _trained_lines(self, run, "packs"):
      self.assertIn(f"trained {self.STEPS} steps, replicas 2", line)
      # The 2 packs, and nothing else: the sums ride in the first, and the
      # endless input needs no all-reduce of "has a batch" before the step.
      self.assertIn("all-reduces per step 2 (float32,float32)", line)
    # `auto` is decided in one place (tfdist.distribute.auto_select), in its words.
    self.assertIn("strategy multi_worker_mirrored (auto: TF_CONFIG lists 2 "
                  "workers)", run["output"])
    single = np.load(os.path.join(single_dir, "weights.npz"))
    multi = np.load(os.path.join(multi_dir, "weights.npz"))
    np.testing.assert_allclose(multi["losses"], single["losses"], rtol=1e-5)
    names = [k for k in single.files if k.startswith("arr_")]
    self.assertLen(names, 4)
    for name in names:
      a, b = single[name], multi[name]
      rel = np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-12)
      self.assertLessEqual(rel, 1e-5, name)
    # Training moved the weights (the comparison is not vacuous).
    rng = np.random.RandomState(0)
    first = rng.normal(0, 0.1, single["arr_0"].shape).astype(np.float32)
    self.assertGreater(np.max(np.abs(single["arr_0"] - first)), 1e-4)

  def test_bfloat16_reduction_stays_near_one_process(self):
    # --all_reduce_dtype=bfloat16: the gradients travel in bfloat16, the
    # step's float32 sums in a float32 collective of their own (2 per
    # step, the endless input adding none), and the weights stay within
    # 1% of how far one float32 process moved them.
    pattern, single_dir = self._one_process()
    run = _cluster_run()
    self.assertEqual(run["pattern"], pattern)
    multi_dir = run["dirs"]["bfloat16"]
    for line in _trained_lines(self, run, "bfloat16"):
      self.assertIn("all-reduces per step 2 (bfloat16,float32)", line)
    single = np.load(os.path.join(single_dir, "weights.npz"))
    multi = np.load(os.path.join(multi_dir, "weights.npz"))
    self.assertAlmostEqual(float(multi["losses"][0]),
                           float(single["losses"][0]), places=5)
    rng = np.random.RandomState(0)
    names = [k for k in single.files if k.startswith("arr_")]
    first = [rng.normal(0, 0.1, single[n].shape).astype(np.float32)
             for n in names]
    moved = max(np.max(np.abs(single[n] - f)) for n, f in zip(names, first))
    differ = max(np.max(np.abs(single[n] - multi[n])) for n in names)
    print(f"bfloat16 reduction: moved {moved:.3g}, differ {differ:.3g}")
    self.assertGreater(differ, 0.0)
    self.assertLessEqual(differ / moved, 0.01)


if __name__ == "__main__":
  absltest.main()
