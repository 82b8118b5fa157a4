"""Tests for tfdist.ray: tfdist as a Ray Train job on a real local Ray cluster.

The cluster is started once for the file (`tfdist.ray.init_local_cluster`:
2 CPUs, no dashboard, a small object store, a short temporary folder, every
address 127.0.0.1). One 2-worker MultiWorkerMirroredStrategy job on real
Fashion-MNIST has one worker SIGKILLed mid-run (after a checkpoint exists,
on the first attempt only); Ray restarts the worker group and the job
resumes from tfdist's checkpoint. At the end every Ray process this test
started must be gone.

The other tests check what happens before Ray starts (config checks, the
binary's flag handling, the message without Ray installed).
"""

import collections
import contextlib
import glob
import ipaddress
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

from absl.testing import absltest
import psutil
import tensorflow as tf

from tests import ray_testlib
from tests import testutil
from tfdist import ray as tfdist_ray
from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.runtime import quiet_tensorflow

# Ray reads it when imported: every test here that imports Ray comes before
# the local cluster's (`init_local_cluster`), which needs it.
os.environ.setdefault(tfdist_ray.SINGLE_NODE_ENV, "0")

STEPS = 32            # 2 epochs of 16 steps (1024 examples, batch 64).
CHECKPOINT_STEPS = 8
KILL_AFTER_STEP = 20  # The kill comes after the step-16 checkpoint.
# Measured on the busy 2-core machine: 0.62 after 48 steps, 0.54 (the
# evaluation's) after 16 (chance: 0.1).
ACCURACY_FLOOR = 0.5
# Ray Train's controller polls the workers this often (Ray's default: 2 s),
# so a job's end or a killed worker is seen sooner.
HEALTH_CHECK_INTERVAL_S = "0.5"
HEALTH_CHECK_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
TUNE_STEPS = 8       # Two Tune trials of 8 steps, one worker each.
TUNE_TIMEOUT = 300    # seconds: a hang guard.
JOB_TIMEOUT = 420     # seconds: a hang guard; the job took 100-180 s (kill included).


def _descendants():
  me = psutil.Process()
  return {p.pid: p for p in me.children(recursive=True)}


def _listening(processes):
  """`{(pid, name, ip, port)}` of the TCP sockets `processes` listen on."""
  out = set()
  for proc in processes:
    try:
      name = proc.name()
      for conn in proc.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN:
          out.add((proc.pid, name, conn.laddr.ip, conn.laddr.port))
    except (psutil.NoSuchProcess, psutil.AccessDenied):
      pass
  return out


def _is_train_worker(name: str) -> bool:
  """Whether a process name is a Ray Train worker's. psutil names a process
  by the kernel's 15-character name when its command line does not start
  with that (as for a moment while Ray retitles the worker), so
  "ray::RayTrainWo" is one too."""
  full = "ray::RayTrainWorker"
  return name.startswith(full) or (len(name) == 15 and full.startswith(name))


def _is_loopback(ip: str) -> bool:
  address = ipaddress.ip_address(ip.split("%")[0])
  mapped = getattr(address, "ipv4_mapped", None)
  return (mapped or address).is_loopback


class _ListenWatch:
  """Records every listening socket of this process's descendants."""

  def __init__(self):
    self.seen = set()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._poll, daemon=True)

  def _poll(self):
    while not self._stop.is_set():
      self.seen |= _listening([psutil.Process(), *_descendants().values()])
      self._stop.wait(1.0)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc_info):
    self._stop.set()
    self._thread.join(timeout=30)
    return False


@contextlib.contextmanager
def _captured_output(into: list):
  """Captures this process's output (`sys.stdout`/`sys.stderr`, where Ray
  prints its processes' forwarded lines, and file descriptors 1 and 2)
  into `into[0]`, and writes it through."""
  sys.stdout.flush()
  sys.stderr.flush()
  saved = [os.dup(1), os.dup(2)]
  streams = sys.stdout, sys.stderr
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 1)
    os.dup2(captured.fileno(), 2)
    text = os.fdopen(os.dup(captured.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr = text
    try:
      yield
    finally:
      text.flush()
      sys.stdout, sys.stderr = streams
      text.close()
      os.dup2(saved[0], 1)
      os.dup2(saved[1], 2)
      for fd in saved:
        os.close(fd)
      captured.seek(0)
      into.append(captured.read().decode(errors="replace"))
      sys.stderr.write(into[0])


_PROCESS_LINE = re.compile(r"^\((\S+ pid=\d+)\) (.*)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# TensorFlow logs this once per dataset it shards (training's and
# evaluation's), with a timing that can come out the same both times: two
# calls, not one line written by two handlers.
_PER_CALL_LINE = re.compile(r"^Sharding callback duration: \d+ microseconds$")


def _repeated_lines(output: str):
  """`{(process, line): count}` of the lines a Ray process wrote more than
  once (Python's "INFO:tensorflow:" logger prefix left out, so a line
  written by two handlers counts twice)."""
  counts = collections.Counter()
  for raw in output.splitlines():
    match = _PROCESS_LINE.match(_ANSI.sub("", raw).strip())
    if not match or not match.group(2).strip():
      continue
    line = re.sub(r"^(DEBUG|INFO|WARNING|ERROR):tensorflow:", "",
                  match.group(2).strip())
    if _PER_CALL_LINE.match(line):
      continue
    counts[(match.group(1), line)] += 1
  return {k: n for k, n in counts.items() if n > 1}


def _config(model_dir, data, **overrides):
  kwargs = dict(
      model_dir=model_dir, train_files=data["train"], eval_files=data["eval"],
      batch_size=64, train_steps=STEPS, log_steps=4,
      checkpoint_steps=CHECKPOINT_STEPS, epochs_between_evals=1,
      collective_timeout_seconds=60, cluster_start_timeout_seconds=90,
      seed=3)
  kwargs.update(overrides)
  return TrainConfig(**kwargs)


class RepeatedLinesTest(absltest.TestCase):
  """What the Tune test's clean-log check counts as a repeated line."""

  def test_a_line_written_by_two_handlers_counts_twice(self):
    output = ("(RayTrainWorker pid=7) INFO:tensorflow:tfdist: step 4/8\n"
              "(RayTrainWorker pid=7) tfdist: step 4/8\n"
              "(RayTrainWorker pid=8) tfdist: step 4/8\n")
    self.assertEqual(_repeated_lines(output),
                     {("RayTrainWorker pid=7", "tfdist: step 4/8"): 2})

  def test_equal_timings_of_two_shardings_are_not_repeats(self):
    line = "(RayTrainWorker pid=7) Sharding callback duration: 19 microseconds"
    self.assertEqual(_repeated_lines(f"{line}\n{line}\n"), {})


class JobFailureTextTest(absltest.TestCase):
  """What a failed job's test prints: the workers' errors in full (Ray's
  own text keeps 1,000 characters of each) and their logs' tails."""

  def test_full_worker_errors_and_the_tails_of_the_jobs_logs(self):
    from ray.train import WorkerGroupError  # pylint: disable=g-import-not-at-top
    temp_dir = testutil.scratch_dir()
    logs = os.path.join(temp_dir, "session_latest", "logs")
    os.makedirs(os.path.join(logs, "train"))

    def worker_logs(worker_id, message):
      with open(os.path.join(logs, "train",
                             f"ray-train-app-worker-{worker_id}.log"),
                "w") as f:
        for i in range(40):
          f.write(json.dumps({"levelname": "INFO", "world_rank": 1,
                              "message": f"{message} {i}"}) + "\n")
      with open(os.path.join(logs, f"worker-{worker_id}-01000000-7.err"),
                "w") as f:
        f.write(f"E0000 {message}: Could not start gRPC server\n")

    worker_logs("0ld", "an earlier job's line")
    os.utime(os.path.join(logs, "train", "ray-train-app-worker-0ld.log"),
             (1, 1))
    worker_logs("ab12", "this job's line")
    cause = "middle of a long error " + "x" * 2000 + " its end"
    error = WorkerGroupError("[Rank 1 Error Snippet]: cut",
                             {1: RuntimeError(cause)})
    text = ray_testlib.job_failure_text(error, ray_temp_dir=temp_dir,
                                        since=time.time() - 60)
    self.assertIn(f"worker rank 1: RuntimeError: {cause}", text)
    self.assertIn("world rank 1", text)
    self.assertIn("INFO this job's line 39", text)
    self.assertNotIn("this job's line 9\n", text)  # Only the tail.
    self.assertIn("this job's line: Could not start gRPC server", text)
    self.assertNotIn("an earlier job's line", text)


class TfConfigPortTest(absltest.TestCase):
  """The TF_CONFIG port of each worker of a multi-worker job."""

  def test_held_until_tensorflow_takes_it_where_rays_is_free_at_once(self):
    from ray.train._internal.utils import get_address_and_port  # pylint: disable=g-import-not-at-top
    from tfdist.cloud import ray_backend  # pylint: disable=g-import-not-at-top
    from tfdist.distribute import rendezvous  # pylint: disable=g-import-not-at-top
    # Ray's TensorFlow backend: the port is free again once chosen, so any
    # process may take it before TensorFlow's server binds it.
    _, port = get_address_and_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
      other.bind(("", port))
    # tfdist's backend: the worker holds it (its wait for the peers hands
    # it on to TensorFlow's server; see rendezvous_test).
    address = ray_backend.reserve_worker_address()
    host, port = address.rsplit(":", 1)
    held = rendezvous._RESERVED.pop(int(port))  # pylint: disable=protected-access
    self.addCleanup(held.close)
    self.assertEqual(host, "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
      with self.assertRaises(OSError):
        other.bind(("", int(port)))

  def test_the_trainer_and_backend_import_no_tensorflow(self):
    # Ray's Train controller unpickles the backend config; a Tune trial's
    # process builds the trainer.
    out = subprocess.run(
        [sys.executable, "-c", "import sys, tfdist.cloud.ray_backend; "
         "from ray.train.v2.tensorflow.tensorflow_trainer import "
         "TensorflowTrainer; print(sorted(m for m in ('tensorflow', "
         "'keras') if m in sys.modules))"],
        capture_output=True, text=True, timeout=120, check=True,
        cwd=testutil.REPO_ROOT)
    self.assertEqual(out.stdout.strip(), "[]", out.stderr)


class TrainWorkerNameTest(absltest.TestCase):
  """Which listening processes the loopback check counts as Ray Train
  workers (the kernel's 15-character name failed it on 1 December 2026)."""

  def test_full_retitled_and_kernel_names(self):
    for name in ("ray::RayTrainWorker", "ray::RayTrainWorker.poll_status",
                 "ray::RayTrainWo"):
      self.assertTrue(_is_train_worker(name), name)
    for name in ("ray::IDLE", "raylet", "ray::RayTrain"):
      self.assertFalse(_is_train_worker(name), name)


class PrepareConfigTest(absltest.TestCase):
  """What `tfdist.ray` checks and changes before Ray starts."""

  def setUp(self):
    super().setUp()
    self.data = testutil.fashion_mnist_subset(limit=1024)

  def test_parameter_server_refused_with_reason(self):
    config = _config("/tmp/x", self.data,
                     distribution_strategy="parameter_server")
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"parameter_server: parameter-server training does not "
        r"run under tfdist.ray: .*only 'worker' tasks.*tfdist.launch "
        r"--num_ps=M"):
      tfdist_ray.prepare_config(config)

  def test_single_process_strategy_refused(self):
    config = _config("/tmp/x", self.data, distribution_strategy="mirrored")
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"--distribution_strategy=mirrored does not apply under "
        r"tfdist.ray.*multi_worker_mirrored"):
      tfdist_ray.prepare_config(config)

  def test_worker_hosts_refused(self):
    config = _config("/tmp/x", self.data, worker_hosts="127.0.0.1:1234")
    with self.assertRaisesRegex(
        errors.ConfigError, r"--worker_hosts=.*Drop both"):
      tfdist_ray.prepare_config(config)

  def test_local_paths_become_absolute(self):
    scratch = testutil.scratch_dir()
    cwd = os.getcwd()
    os.chdir(scratch)
    try:
      relative_train = os.path.relpath(self.data["train"], scratch)
      config = tfdist_ray.prepare_config(_config(
          "run", self.data, train_files=relative_train + ",gs://b/x-*",
          export_dir="~/exported"))
    finally:
      os.chdir(cwd)
    self.assertEqual(config.distribution_strategy, "multi_worker_mirrored")
    self.assertTrue(os.path.isabs(config.model_dir))
    self.assertTrue(os.path.samefile(os.path.dirname(config.model_dir),
                                     scratch))
    self.assertEqual(os.path.basename(config.model_dir), "run")
    train, remote = config.train_files.split(",")
    self.assertTrue(os.path.isabs(train))
    self.assertEqual(sorted(map(os.path.realpath, glob.glob(train))),
                     sorted(map(os.path.realpath,
                                glob.glob(self.data["train"]))))
    self.assertEqual(remote, "gs://b/x-*")  # Not a local path: unchanged.
    self.assertEqual(config.export_dir,
                     os.path.join(os.path.expanduser("~"), "exported"))
    self.assertTrue(os.path.isabs(config.eval_files))

  def test_tune_trials_cannot_share_a_checkpoint_dir(self):
    config = _config("/tmp/x", self.data, checkpoint_dir="/tmp/shared")
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"--checkpoint_dir='/tmp/shared' would be shared by "
        r"every Tune trial: leave it unset"):
      tfdist_ray.tune_trainable(config)

  def test_local_glob_without_files_named(self):
    config = _config("/tmp/x", self.data, train_files="/nonexistent/t-*")
    with self.assertRaisesRegex(errors.ConfigError,
                                r"--train_files='/nonexistent/t-\*' matches "
                                r"no file"):
      tfdist_ray.prepare_config(config)


class BinaryTest(absltest.TestCase):
  """`python -m tfdist.ray`: errors that stop it before Ray starts."""

  def _run(self, args, env=None):
    out = testutil.run_module("tfdist.ray", args, timeout=120, env=env)
    return out.returncode, out.stdout

  def test_flags_on_the_wrong_side_of_the_separator(self):
    code, out = self._run(["--", "--num_workers=3", "--model_dir=/tmp/x",
                           "--train_steps=5"])
    self.assertNotEqual(code, 0)
    self.assertIn("--num_workers=3 is a flag of tfdist.ray: put it before "
                  "`--`", out)
    code, out = self._run(["--model_dir=/tmp/x", "--", "--train_steps=5"])
    self.assertNotEqual(code, 0)
    self.assertIn("--model_dir is a tfdist.train flag: put it after `--`", out)

  def test_parameter_server_refused_before_ray_starts(self):
    code, out = self._run(["--num_workers=2", "--",
                           "--distribution_strategy=parameter_server",
                           "--model_dir=/tmp/x", "--train_steps=5"])
    self.assertNotEqual(code, 0)
    self.assertIn("parameter-server training does not run under tfdist.ray",
                  out)
    self.assertNotIn("Started a local Ray instance", out)

  def test_without_ray_says_how_to_install(self):
    # A folder whose `ray` package fails to import as an absent one does.
    shadow = testutil.scratch_dir()
    os.makedirs(os.path.join(shadow, "ray"))
    with open(os.path.join(shadow, "ray", "__init__.py"), "w") as f:
      f.write("raise ModuleNotFoundError(\"No module named 'ray'\", "
              "name='ray')\n")
    code, out = self._run(
        ["--num_workers=2", "--", f"--model_dir={shadow}/run",
         "--train_steps=5", f"--train_files={self.data_glob()}",
         f"--eval_files={self.data_glob()}"],
        env={"PYTHONPATH": shadow + os.pathsep + testutil.REPO_ROOT})
    self.assertNotEqual(code, 0)
    self.assertIn("tfdist.ray: error: Ray Train is not installed. Install it "
                  "with: pip install 'tfdist[ray]'", out)

  def data_glob(self):
    return testutil.fashion_mnist_subset(limit=1024)["train"]


class LocalRayClusterTest(absltest.TestCase):
  """A real local Ray cluster: train, kill a worker, Ray restarts, resume."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.data = testutil.fashion_mnist_subset(limit=1024)
    cls.saved_interval = os.environ.get(HEALTH_CHECK_ENV)
    # Read by each job's driver (this process) and passed on to its
    # controller.
    os.environ[HEALTH_CHECK_ENV] = HEALTH_CHECK_INTERVAL_S
    before = set(_descendants())
    cls.temp_dir = tfdist_ray.init_local_cluster(num_cpus=2)
    import ray  # pylint: disable=g-import-not-at-top
    cls.ray = ray
    cls.started = {pid: p for pid, p in _descendants().items()
                   if pid not in before}

  @classmethod
  def tearDownClass(cls):
    started = {**cls.started, **_descendants()}
    cls.ray.shutdown()
    if cls.saved_interval is None:
      os.environ.pop(HEALTH_CHECK_ENV, None)
    else:
      os.environ[HEALTH_CHECK_ENV] = cls.saved_interval
    _, alive = psutil.wait_procs(list(started.values()), timeout=30)
    for proc in alive:  # Only processes this test started.
      try:
        proc.kill()
      except psutil.NoSuchProcess:
        pass
    import shutil  # pylint: disable=g-import-not-at-top
    shutil.rmtree(cls.temp_dir, ignore_errors=True)
    super().tearDownClass()
    if alive:
      raise AssertionError(
          "Ray processes still running 30 s after ray.shutdown(): "
          f"{[p.pid for p in alive]}")

  def _run_job(self, config, **kwargs):
    """`tfdist.ray.run_on_ray(config, **kwargs)`, bounded by JOB_TIMEOUT.

    A failed or hung job fails the test with what there is to read: the
    workers' errors in full and the tails of their logs
    (`ray_testlib.job_failure_text`).
    """
    outcome = {}

    def fit():
      try:
        outcome["result"] = tfdist_ray.run_on_ray(config, **kwargs)
      except BaseException as e:  # pylint: disable=broad-except
        outcome["error"] = e

    started = time.time()
    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    thread.join(timeout=JOB_TIMEOUT)
    if thread.is_alive():
      self.fail(f"the Ray job ran past {JOB_TIMEOUT} s.\n" +
                ray_testlib.worker_log_tails(self.temp_dir, started))
    error = outcome.get("error") or outcome["result"].error
    if error is not None:
      self.fail(f"the Ray job failed after {time.time() - started:.0f} s: " +
                ray_testlib.job_failure_text(error, ray_temp_dir=self.temp_dir,
                                             since=started))
    return outcome["result"]

  def test_cluster_is_local_and_small(self):
    self.assertEqual(self.ray.util.get_node_ip_address(), "127.0.0.1")
    resources = self.ray.cluster_resources()
    self.assertEqual(resources["CPU"], 2)
    self.assertEqual(resources["object_store_memory"],
                     tfdist_ray.LOCAL_OBJECT_STORE_BYTES)
    self.assertLessEqual(len(self.temp_dir), tfdist_ray.MAX_TEMP_DIR_CHARS)
    self.assertTrue(self.started)
    listening = _listening([psutil.Process(), *self.started.values()])
    self.assertTrue(listening)
    self.assertEqual([s for s in listening if not _is_loopback(s[2])], [])

  def test_killed_worker_is_restarted_and_resumes(self):
    model_dir = testutil.scratch_dir()
    marker = os.path.join(testutil.scratch_dir(), "killed.json")
    kill = ray_testlib.KillOnceCallback(
        checkpoint_dir=os.path.join(model_dir, "checkpoints"), marker=marker,
        after_step=KILL_AFTER_STEP)
    started = time.time()
    with _ListenWatch() as watch:
      result = self._run_job(
          _config(model_dir, self.data), num_workers=2, max_failures=1,
          storage_path=os.path.join(testutil.scratch_dir(), "ray_results"),
          callbacks=[kill])
    print(f"ray job: {time.time() - started:.1f} s; metrics {result.metrics}")

    # Worker 1 was killed once, after a checkpoint, on the first attempt.
    with open(marker) as f:
      killed = json.load(f)
    self.assertGreaterEqual(killed["step"], KILL_AFTER_STEP)
    # The restarted attempt resumed from tfdist's checkpoint.
    metrics = result.metrics
    self.assertEqual(metrics["final_step"], STEPS)
    self.assertEqual(metrics["num_replicas_in_sync"], 2)
    self.assertEqual(metrics["start_step"] % CHECKPOINT_STEPS, 0)
    self.assertGreater(metrics["start_step"], 0)
    self.assertGreaterEqual(metrics["start_step"],
                            killed["step"] - CHECKPOINT_STEPS)
    self.assertLessEqual(metrics["start_step"], killed["step"])
    self.assertGreater(metrics["eval_accuracy"], ACCURACY_FLOOR)
    manifest = json.load(open(os.path.join(model_dir, "run_manifest.json")))
    self.assertEqual(manifest["final_step"], STEPS)
    self.assertEqual(manifest["num_replicas_in_sync"], 2)
    self.assertEqual(manifest["strategy"], "multi_worker_mirrored")
    self.assertEqual(manifest["cluster"]["source"], "TF_CONFIG")
    self.assertEqual(manifest["final_metrics"]["eval_accuracy"],
                     metrics["eval_accuracy"])
    self.assertTrue(manifest["restored_from"].endswith(
        f"ckpt-{metrics['start_step']}"), manifest["restored_from"])
    # The history covers both attempts: the first's records up to the
    # checkpoint the second resumed from, then the second's.
    attempts = [h["process"] for h in manifest["history"]]
    resumed = [h["step"] for h in manifest["history"]
               if h["process"] == attempts[-1]]
    self.assertGreater(resumed[0], metrics["start_step"])
    self.assertTrue(all(h["step"] <= metrics["start_step"]
                        for h in manifest["history"]
                        if h["process"] != attempts[-1]))
    self.assertEqual(manifest["history"][-1]["step"], STEPS)
    # Ray's result: the chief's manifest, and the last Ray checkpoint: the
    # final tfdist checkpoint, with the manifest beside it.
    self.assertEqual(result.return_value["final_step"], STEPS)
    with result.checkpoint.as_directory() as folder:
      saved = json.load(open(os.path.join(folder, "run_manifest.json")))
      self.assertTrue(tf.train.latest_checkpoint(folder).endswith(
          f"ckpt-{STEPS}"))
    self.assertEqual(saved["final_step"], STEPS)
    # Every tfdist checkpoint of the resumed attempt reached Ray, each
    # once, from the chief, at the log point of its step.
    reported = [m.get("checkpoint_step")
                for _, m in result.best_checkpoints]
    self.assertContainsSubset(
        range(metrics["start_step"] + CHECKPOINT_STEPS, STEPS + 1,
              CHECKPOINT_STEPS), reported)
    self.assertEqual(len(reported), len(set(reported)), reported)
    # Ray's frame of the checkpoints' metrics: the interval's loss at each
    # log point's (the last row holds the final metrics).
    frame = result.metrics_dataframe
    self.assertTrue(frame.loc[frame["step"] < STEPS, "loss"].notna().all(),
                    frame)
    self.assertEqual(frame["step"].iloc[-1], STEPS)
    # The killed worker's scratch folder went with the run's.
    self.assertEqual(glob.glob(os.path.join(
        tempfile.gettempdir(), "tfdist-ray-scratch-*")), [])

    # Restored through Ray into a new --model_dir: the run resumes from the
    # Ray checkpoint's step, under the user's own RunConfig.
    from ray.train import CheckpointConfig, RunConfig  # pylint: disable=g-import-not-at-top
    resumed_dir = testutil.scratch_dir()
    reports = os.path.join(testutil.scratch_dir(), "reports.jsonl")
    again = self._run_job(
        _config(resumed_dir, self.data, train_steps=STEPS + 8,
                checkpoint_steps=0),
        num_workers=2, resume_from_checkpoint=result.checkpoint,
        run_config=RunConfig(
            storage_path=os.path.join(testutil.scratch_dir(), "ray_again"),
            checkpoint_config=CheckpointConfig(num_to_keep=1),
            callbacks=[ray_testlib.report_recorder(reports)]))
    self.assertEqual(again.metrics["start_step"], STEPS)
    self.assertEqual(again.metrics["final_step"], STEPS + 8)
    self.assertLen(again.best_checkpoints, 1)  # num_to_keep=1
    # The user's Ray callback saw every report of both workers: the log
    # point at step STEPS + 4 (--log_steps=4; no checkpoint, no
    # evaluation), then the evaluation and the final report at STEPS + 8,
    # the last with the final checkpoint.
    with open(reports) as f:
      rounds = [json.loads(line) for line in f]
    self.assertEqual([[m["step"] for m in r["metrics"]] for r in rounds],
                     [[STEPS + 4] * 2, [STEPS + 8] * 2, [STEPS + 8] * 2])
    self.assertIn("loss", rounds[0]["metrics"][0])
    self.assertNotIn("val_loss", rounds[0]["metrics"][0])
    self.assertIn("val_loss", rounds[1]["metrics"][0])
    self.assertEqual([r["checkpoint"] for r in rounds], [False, False, True])
    # Ray Train wrote TF_CONFIG with 127.0.0.1 addresses.
    self.assertEqual(
        [a.split(":")[0] for a in manifest["cluster"]["jobs"]["worker"]],
        ["127.0.0.1", "127.0.0.1"])
    # Every socket Ray listened on during the job was on loopback. The one
    # exception is TensorFlow's own: the gRPC server of each worker (its
    # TF_CONFIG port) binds 0.0.0.0 whatever address TF_CONFIG gives
    # (hard-coded in TensorFlow's grpc_server_lib.cc), one per worker
    # process and attempt.
    self.assertTrue(watch.seen)
    wide = [s for s in watch.seen if not _is_loopback(s[2])]
    # Ray retitles a worker while it runs a task
    # ("ray::RayTrainWorker.poll_status"): the same process and port.
    self.assertTrue(all(_is_train_worker(name) for _, name, _, _ in wide),
                    wide)
    wide = sorted({(pid, port) for pid, _, _, port in wide})
    pids = [pid for pid, _ in wide]
    self.assertEqual(len(pids), len(set(pids)), wide)
    tf_ports = {int(a.split(":")[1])
                for a in manifest["cluster"]["jobs"]["worker"]}
    self.assertLessEqual(tf_ports, {port for _, port in wide}, wide)
    self.assertLessEqual(len(wide), 4, wide)  # 2 workers x 2 attempts.

  def test_tune_runs_two_trials_of_their_own(self):
    from ray import tune  # pylint: disable=g-import-not-at-top
    root = testutil.scratch_dir()
    trainable = tfdist_ray.tune_trainable(
        _config(os.path.join(root, "trials"), self.data,
                train_steps=TUNE_STEPS, checkpoint_steps=TUNE_STEPS // 2),
        # Both trials at once on the 2 CPUs: 0.9 + 0.01 each.
        num_workers=1, cpus_per_worker=0.9)
    rates = [0.02, 0.0005]
    tuner = tune.Tuner(
        trainable,
        param_space={"base_learning_rate": tune.grid_search(rates)},
        run_config=tune.RunConfig(storage_path=os.path.join(root, "tune"),
                                  name="rates"))
    outcome = {}

    def fit():
      try:
        outcome["results"] = tuner.fit()
      except BaseException as e:  # pylint: disable=broad-except
        outcome["error"] = e

    started = time.time()
    output = []
    with _captured_output(output):
      thread = threading.Thread(target=fit, daemon=True)
      thread.start()
      thread.join(timeout=TUNE_TIMEOUT)
      time.sleep(3)  # Ray's log monitor forwards the last lines.
    self.assertFalse(thread.is_alive(),
                     f"the Tune run ran past {TUNE_TIMEOUT} s")
    # Clean logs: each line of a Ray process once (TensorFlow's too), no
    # import-time notices, no controller-state warnings.
    output = output[0]
    self.assertEqual(_repeated_lines(output), {})
    self.assertNotIn("Failed to query Ray Train Controller actor state",
                     output)
    self.assertEqual([line for line in output.splitlines()
                      if quiet_tensorflow.IMPORT_NOTICES.search(
                          _ANSI.sub("", line))], [])
    # The output read is the workers': a TensorFlow line of each trial's
    # worker, once. A trial's worker is alone in its cluster; lines of an
    # earlier test's two-worker cluster that Ray's log monitor forwards
    # late (a loaded machine) are not this test's.
    def pid(line):
      found = re.search(r"RayTrainWorker pid=(\d+)", line)
      return found.group(1) if found else None

    lines = output.splitlines()
    trial_pids = {pid(line) for line in lines if pid(line) and
                  "MultiWorkerMirroredStrategy with cluster_spec" in line and
                  "num_workers = 1," in line}
    self.assertLen(trial_pids, 2, output)
    strategy_lines = [line for line in lines if pid(line) in trial_pids and
                      "Using MirroredStrategy with devices" in line]
    self.assertLen(strategy_lines, 2, output)
    self.assertNotIn("error", outcome, repr(outcome.get("error")))
    results = outcome["results"]
    print(f"tune: 2 trials in {time.time() - started:.1f} s")
    self.assertLen(results, 2)
    self.assertEqual(results.errors, [])
    by_rate = {r.config["base_learning_rate"]: r for r in results}
    self.assertCountEqual(by_rate, rates)
    model_dirs, checkpoints = set(), set()
    for rate, result in by_rate.items():
      metrics = result.metrics
      self.assertEqual(metrics["final_step"], TUNE_STEPS)
      self.assertEqual(metrics["num_replicas_in_sync"], 1)
      self.assertIn("eval_accuracy", metrics)
      # Tune saw the log points' reports on the way (its schedulers' input).
      frame = result.metrics_dataframe
      self.assertContainsSubset([4, TUNE_STEPS], list(frame["step"]))
      self.assertTrue(frame.loc[frame["step"] == 4, "loss"].notna().all())
      # The trial's checkpoint: its final tfdist checkpoint and manifest,
      # of a run with its own learning rate and --model_dir.
      self.assertIsNotNone(result.checkpoint)
      with result.checkpoint.as_directory() as folder:
        self.assertTrue(tf.train.latest_checkpoint(folder).endswith(
            f"ckpt-{TUNE_STEPS}"))
        saved = json.load(open(os.path.join(folder, "run_manifest.json")))
      self.assertEqual(saved["config"]["base_learning_rate"], rate)
      model_dir = saved["config"]["model_dir"]
      self.assertEqual(os.path.dirname(model_dir),
                       os.path.join(root, "trials"))
      self.assertTrue(tf.train.latest_checkpoint(
          os.path.join(model_dir, "checkpoints")).endswith(
              f"ckpt-{TUNE_STEPS}"))
      model_dirs.add(model_dir)
      checkpoints.add(result.checkpoint.path)
    self.assertLen(model_dirs, 2)
    self.assertLen(checkpoints, 2)
    # Different learning rates, different runs.
    self.assertNotEqual(*[r.metrics["eval_loss"] for r in by_rate.values()])
    best = results.get_best_result(metric="eval_loss", mode="min")
    self.assertEqual(best.metrics["eval_loss"],
                     min(r.metrics["eval_loss"] for r in by_rate.values()))


if __name__ == "__main__":
  absltest.main()
