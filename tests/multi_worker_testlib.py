"""Helpers for multi-process tests: a local cluster runner and worker programs.

`run_launcher` runs `python -m tfdist.launch` with a hard timeout and, on
timeout, stops it (and through it every task it started) without touching
any other process. `LauncherWatch` does the same in the background while a
test reads the output line by line (to act mid-training).

Run as a module (`python -m tests.multi_worker_testlib MODE OUT_DIR ...`,
normally by the launcher) this file is a worker program:

* `shard OUT_DIR FILES_GLOB...`: under MultiWorkerMirroredStrategy, reads one
  epoch of each glob through `tfdist.data.input_pipeline` and writes the example
  ids this worker saw to `OUT_DIR/ids-<task>.json`.
* `train OUT_DIR FILES_GLOB STEPS`: trains a small dense model (no batch
  norm, no dropout: per-replica statistics or randomness would make runs
  differ) for STEPS steps with the tfdist `Trainer` at global batch
  `GLOBAL_BATCH`, from fixed initial weights, in a fixed data order; the
  chief (or the single process) writes `OUT_DIR/weights.npz`.
* `programs PROGRAM + PROGRAM ...`: the `shard` and `train` programs in
  turn, under one strategy (one cluster for several tests).
* `train_linger SECONDS TRAIN_FLAGS...`: runs `tfdist.train` with
  TRAIN_FLAGS; `worker` 0 sleeps SECONDS where its process would end after
  the run (a test-only stand-in for a worker whose exit hangs after its
  work is done).
* `agree OUT_DIR`: the fp16, random-stream and barrier checks of
  `tests/distributed_correctness_test.py` under MultiWorkerMirroredStrategy
  (with `--collective_timeout_seconds`-like timeout `COLLECTIVE_TIMEOUT`);
  writes `OUT_DIR/agree-<task>.json`.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import List, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOBAL_BATCH = 32
# Collective timeout of the `agree` program: short, so that a worker left
# alone in an all-reduce fails the test quickly instead of hanging.
COLLECTIVE_TIMEOUT = 15


def _env(extra=None):
  env = dict(os.environ)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
  for name in ("TF_CONFIG", "CLUSTER_SPEC"):
    env.pop(name, None)
  env.update(extra or {})
  return env


def _stop(proc: subprocess.Popen):
  """Stops a launcher: Ctrl-C, then a second one (kills its tasks), then kill."""
  for _ in range(2):
    if proc.poll() is None:
      proc.send_signal(signal.SIGINT)
      try:
        proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        pass
  if proc.poll() is None:
    proc.kill()
    proc.wait()


class LauncherWatch:
  """Runs the launcher in the background and collects its output lines.

  Args:
    launch_args: flags of `tfdist.launch` (before `--`), after
      `--output=all` (every task's lines, prefixed `[chief:0] `, which the
      tests read; `--output=chief` here overrides it).
    task_args: arguments after `--`.
    timeout: seconds after which the launcher is stopped (and the test
      fails when it calls `wait`).
    command: run this command line instead of the launcher (one process
      alone, watched the same way); `launch_args` and `task_args` are then
      unused.
    own_group: start the process as the leader of a process group of its
      own, as a shell starts a foreground job, so that `ctrl_c` can send
      SIGINT to the whole group as a terminal's Ctrl-C does.
  """

  def __init__(self, launch_args: List[str], task_args: List[str], *,
               timeout: float, env=None,
               command: Optional[List[str]] = None, own_group: bool = False):
    self.lines: List[str] = []
    self.timed_out = False
    self._cond = threading.Condition()
    self.proc = subprocess.Popen(
        command or [sys.executable, "-m", "tfdist.launch", "--output=all",
                    *launch_args, "--",
                    *task_args], cwd=REPO_ROOT, env=_env(env), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        errors="replace", preexec_fn=os.setpgrp if own_group else None)
    self._deadline = time.time() + timeout
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()
    self._timer = threading.Thread(target=self._guard, daemon=True)
    self._timer.start()

  def _read(self):
    for line in self.proc.stdout:
      with self._cond:
        self.lines.append(line.rstrip("\n"))
        self._cond.notify_all()
    with self._cond:
      self._cond.notify_all()

  def _guard(self):
    while self.proc.poll() is None:
      if time.time() > self._deadline:
        self.timed_out = True
        _stop(self.proc)
        return
      time.sleep(0.2)

  def wait_for(self, pattern: str, timeout: float) -> Optional[re.Match]:
    """Waits until an output line matches `pattern`; None on timeout/exit."""
    regex = re.compile(pattern)
    end = time.time() + timeout
    seen = 0
    with self._cond:
      while True:
        for line in self.lines[seen:]:
          match = regex.search(line)
          if match:
            return match
        seen = len(self.lines)
        remaining = end - time.time()
        if remaining <= 0 or (self.proc.poll() is not None and
                              not self._reader.is_alive()):
          return None
        self._cond.wait(min(remaining, 0.5))

  def task_pid(self, task: str, attempt: int = 0) -> int:
    match = self.wait_for(
        rf"\[launch\] attempt {attempt}: started {task} pid (\d+)", 30)
    if not match:
      raise AssertionError(f"no pid for {task}:\n{self.output()}")
    return int(match.group(1))

  def ctrl_c(self):
    """SIGINT to every process of the group (`own_group=True`), as a
    terminal sends it on Ctrl-C: the process and every helper it started
    in its group."""
    os.killpg(self.proc.pid, signal.SIGINT)

  def wait(self) -> int:
    """Waits for the launcher to exit; returns its exit status."""
    self.proc.wait(timeout=max(1.0, self._deadline - time.time() + 30))
    self._reader.join(timeout=10)
    if self.timed_out:
      raise AssertionError("the launcher timed out:\n" + self.output()[-6000:])
    return self.proc.returncode

  def output(self) -> str:
    return "\n".join(self.lines)


def run_launcher(launch_args, task_args, *, timeout: float, env=None):
  """Runs the launcher to the end; returns (exit status, output)."""
  watch = LauncherWatch(launch_args, task_args, timeout=timeout, env=env)
  status = watch.wait()
  return status, watch.output()


def run_for_results(test, module: str, task_args, prefix: str, *,
                    timeout: float) -> dict:
  """`tfdist.launch --num_workers=2 --module=MODULE -- TASK_ARGS` to the
  end (`run_launcher`, oneDNN off: the same arithmetic in every process),
  `test` failing on a non-zero exit status with the output's end; then
  each task's JSON result, `{task: result}` from `OUT/PREFIX-<task>.json`
  for the chief and worker 0 (OUT = `task_args[1]`)."""
  status, output = run_launcher(
      ["--num_workers=2", f"--module={module}"], task_args, timeout=timeout,
      env={"TF_ENABLE_ONEDNN_OPTS": "0"})
  test.assertEqual(status, 0, output[-4000:])
  results = {}
  for task in ("chief0", "worker0"):
    with open(os.path.join(task_args[1], f"{prefix}-{task}.json")) as f:
      results[task] = json.load(f)
  return results


def run_module_with_timeout(module: str, args, *, timeout: float, env=None):
  """`python -m module args` (no TF_CONFIG unless `env` sets it).

  Returns:
    (returncode, output, seconds); on timeout the process is killed and
    returncode is None.
  """
  started = time.time()
  proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO_ROOT,
                          env=_env(env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True,
                          errors="replace")
  try:
    out, _ = proc.communicate(timeout=timeout)
    code = proc.returncode
  except subprocess.TimeoutExpired:
    proc.kill()
    out, _ = proc.communicate()
    code = None
  return code, out, time.time() - started


def small_model():
  """`--model=tests.multi_worker_testlib:small_model`: a Fashion-MNIST
  classifier, float32 images [batch, 28, 28, 1] to 10 logits, of two dense
  layers (25,450 parameters), for runs whose claims are about processes
  and checkpoints rather than the model: it builds and traces in less time
  than `--model=cnn` (convolutions, batch normalization, dropout)."""
  import keras  # pylint: disable=g-import-not-at-top
  inputs = keras.Input((28, 28, 1), name="image")
  hidden = keras.layers.Dense(32, activation="relu")(
      keras.layers.Flatten()(inputs))
  return keras.Model(inputs, keras.layers.Dense(10)(hidden))


# --- worker programs -------------------------------------------------------
def _task_name() -> str:
  from tfdist.distribute import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  info = cluster_lib.resolve_cluster()
  return f"{info.task_type}{info.task_index}"


def _strategy(out_dir: str, collective_timeout_seconds: float = 60):
  from tfdist import config as config_lib  # pylint: disable=g-import-not-at-top
  from tfdist import experiment  # pylint: disable=g-import-not-at-top
  from tfdist.distribute import strategy as strategy_lib  # pylint: disable=g-import-not-at-top
  from tfdist.backends import registry as backend_registry  # pylint: disable=g-import-not-at-top
  # Under the launcher (TF_CONFIG set) `auto` must pick the multi-worker
  # strategy from the cluster alone, decided where every run decides it.
  name = "auto" if os.environ.get("TF_CONFIG") else "one_device"
  config = config_lib.TrainConfig(
      distribution_strategy=name, model_dir=out_dir, train_steps=1,
      num_gpus=0, collective_timeout_seconds=collective_timeout_seconds,
      cluster_start_timeout_seconds=60)
  prepared = experiment.prepare_run(config)
  config, cluster, decision = (prepared.config, prepared.cluster,
                               prepared.decision)
  choice = backend_registry.make_strategy(
      strategy_lib.StrategyOptions.of(config.strategy, prepared.decisions),
      cluster=cluster)
  print(f"strategy {choice.name} ({decision.strategy_reason})", flush=True)
  return choice.strategy


def shard_main(out_dir: str, globs: List[str], strategy=None):
  """Writes the ids of one epoch of each glob seen by this worker (under
  `strategy`, else one made here)."""
  strategy = strategy or _strategy(out_dir)
  import functools  # pylint: disable=g-import-not-at-top
  from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
  from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
  from tfdist.distribute import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  num_workers = cluster_lib.resolve_cluster().num_workers
  result = {}
  for pattern in globs:
    files = input_pipeline.list_files(pattern)
    counts = input_pipeline.count_records_per_file(files)
    total = sum(counts)
    steps = total // GLOBAL_BATCH
    options = input_pipeline.PipelineOptions(
        files=files, parse_fn=functools.partial(datasets.parse_image_example,
                                                with_id=True),
        global_batch_size=GLOBAL_BATCH, is_training=True,
        shuffle_buffer_size=64, cache=False, seed=7,
        file_record_counts=counts)
    iterator = iter(input_pipeline.distribute(strategy, options))
    ids, batch_sizes = [], set()
    for _ in range(steps):
      batch = next(iterator)
      for local in strategy.experimental_local_results(batch[2]):
        ids.extend(int(i) for i in local.numpy())
        batch_sizes.add(int(local.shape[0]))
    result[pattern] = {"ids": ids, "batch_sizes": sorted(batch_sizes),
                       "steps": steps, "total": total,
                       "mode": input_pipeline.plan_sharding(
                           counts, num_files=len(files),
                           num_input_pipelines=num_workers,
                           global_batch_size=GLOBAL_BATCH,
                           is_training=True).mode}
  with open(os.path.join(out_dir, f"ids-{_task_name()}.json"), "w") as f:
    json.dump(result, f)


def train_main(out_dir: str, pattern: str, steps: int,
               bytes_per_pack: int = 0, all_reduce_dtype: str = "float32",
               strategy=None):
  """Trains the dense model (under `strategy`, else one made here); the
  chief writes weights.npz. Prints `OUT_DIR: trained ...` with the step's
  all-reduce count (`bytes_per_pack`: the gradients' packs;
  `all_reduce_dtype`: the dtype the gradients travel in)."""
  strategy = strategy or _strategy(out_dir)
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
  from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
  from tfdist.training.step.train_loop import Trainer  # pylint: disable=g-import-not-at-top
  with strategy.scope():
    model = keras.Sequential([
        keras.Input((28, 28, 1)), keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    optimizer = keras.optimizers.SGD(learning_rate=0.5)
    optimizer.build(model.trainable_variables)
  rng = np.random.RandomState(0)
  model.set_weights([rng.normal(0, 0.1, w.shape).astype(np.float32)
                     for w in model.get_weights()])
  trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                    global_batch_size=GLOBAL_BATCH,
                    bytes_per_pack=bytes_per_pack,
                    all_reduce_dtype=all_reduce_dtype)
  options = input_pipeline.PipelineOptions(
      files=input_pipeline.list_files(pattern),
      parse_fn=datasets.parse_image_example, global_batch_size=GLOBAL_BATCH,
      is_training=True, shuffle_buffer_size=0, cache=False, deterministic=True)
  iterator = iter(input_pipeline.distribute(strategy, options))
  losses = []
  for _ in range(steps):
    out = trainer.train_function(iterator, tf.constant(1, tf.int32))
    losses.append(float(out["loss"]))
  graph = trainer.train_function.get_concrete_function(
      iterator, tf.TensorSpec([], tf.int32)).graph.as_graph_def()
  collectives = [node for node in [*graph.node, *(
      n for f in graph.library.function for n in f.node_def)]
                 if node.op.startswith("CollectiveReduce")]
  reduces = len(collectives)
  dtypes = ",".join(sorted(tf.as_dtype(node.attr["T"].type).name
                           for node in collectives))
  from tfdist.distribute import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  if cluster_lib.resolve_cluster().is_chief:
    np.savez(os.path.join(out_dir, "weights.npz"), *model.get_weights(),
             losses=np.array(losses))
  print(f"{out_dir}: trained {steps} steps, replicas "
        f"{strategy.num_replicas_in_sync}, last loss {losses[-1]:.6f}, "
        f"all-reduces per step {reduces} ({dtypes})", flush=True)


def agree_main(out_dir: str):
  """fp16 skip in unison, per-worker dropout masks, batch norm's moving
  statistics averaged over the workers, the final barrier."""
  strategy = _strategy(out_dir, collective_timeout_seconds=COLLECTIVE_TIMEOUT)
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.training.step import moving_statistics  # pylint: disable=g-import-not-at-top
  from tfdist.training.step import precision  # pylint: disable=g-import-not-at-top
  from tfdist.training.step.train_loop import Trainer  # pylint: disable=g-import-not-at-top
  from tests import testutil  # pylint: disable=g-import-not-at-top
  task = _task_name()
  result = {"task": task}
  # 1. fp16: at step 1 only worker 0's gradients overflow (inputs of 1e4
  # give float16 gradients of about 1e4 * 2**15: inf); step 2 is finite.
  keras.mixed_precision.set_global_policy("mixed_float16")
  model, optimizer = testutil.fp16_dense_model(strategy)
  trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                    global_batch_size=8)

  def dataset_fn(context):
    big = 1e4 if context.input_pipeline_id == 1 else 1.0
    inputs = np.stack([np.full((4, 4), big, np.float32),
                       np.ones((4, 4), np.float32)])
    return tf.data.Dataset.from_tensor_slices(
        (inputs, np.zeros((2, 4), np.int64))).repeat()

  iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
  steps = []
  for _ in range(2):
    out = trainer.train_function(iterator, tf.constant(1, tf.int32))
    kernel = np.asarray(strategy.experimental_local_results(
        model.layers[-1].kernel.value)[0], np.float64)
    steps.append({"skipped": float(out["skipped_steps"]),
                  "loss_scale": precision.current_loss_scale(optimizer),
                  "iterations": int(optimizer.iterations.numpy()),
                  "kernel_finite": bool(np.all(np.isfinite(kernel))),
                  "kernel": kernel.tolist()})
  result["fp16_steps"] = steps
  keras.mixed_precision.set_global_policy("float32")
  # 2. Dropout masks: the same seed on every worker, as --seed gives.
  keras.utils.set_random_seed(7)
  with strategy.scope():
    dropout_model = keras.Sequential([keras.Input((64,)),
                                      keras.layers.Dropout(0.5)])
  Trainer(strategy=strategy, model=dropout_model,
          optimizer=keras.optimizers.SGD(0.1), global_batch_size=4)
  masks = strategy.run(tf.function(
      lambda: dropout_model(tf.ones((2, 64)), training=True) != 0))
  result["dropout_mask"] = np.asarray(
      strategy.experimental_local_results(masks)[0]).astype(int).tolist()
  # 3. Unsynchronized batch norm: each worker's copy of the moving mean
  # follows its own data (inputs of 1 on the chief, 5 on worker 0), until
  # the copies are averaged over both workers (once per step).
  with strategy.scope():
    bn_model = keras.Sequential([
        keras.Input((2,)), keras.layers.Dense(2, kernel_initializer="ones"),
        keras.layers.BatchNormalization(momentum=0.5)])
  bn_trainer = Trainer(strategy=strategy, model=bn_model,
                       optimizer=keras.optimizers.SGD(0.1), global_batch_size=8)

  def bn_dataset_fn(context):
    value = 1.0 + 4.0 * context.input_pipeline_id
    return tf.data.Dataset.from_tensor_slices(
        (np.full((4, 2), value, np.float32), np.zeros((4,), np.int64))
    ).batch(4).repeat()

  bn_iterator = iter(strategy.distribute_datasets_from_function(
      bn_dataset_fn))
  bn_trainer.train_function(bn_iterator, tf.constant(1, tf.int32))

  def local_mean():
    return np.asarray(strategy.experimental_local_results(
        bn_model.layers[-1].moving_mean.value)[0], np.float64).tolist()

  result["bn_before"] = local_mean()
  statistics = moving_statistics.MovingStatistics(
      strategy, bn_model, step_counter=bn_trainer.global_step)
  result["bn_synchronized"] = [statistics.synchronize(),
                               statistics.synchronize()]
  result["bn_after"] = local_mean()
  # 4. The final barrier: worker 0 arrives 3 s late; nobody leaves before.
  from tfdist.distribute import worker_exit  # pylint: disable=g-import-not-at-top
  if task == "worker0":
    time.sleep(3)
  result["barrier_arrived"] = time.time()
  worker_exit.leave_together(strategy, num_workers=2)
  result["barrier_left"] = time.time()
  with open(os.path.join(out_dir, f"agree-{task}.json"), "w") as f:
    json.dump(result, f)
  print(f"agree: {task} done", flush=True)


def train_linger_main(seconds: float, train_args: List[str]):
  """`python -m tfdist.train TRAIN_ARGS`; then worker 0 lingers."""
  from absl import app  # pylint: disable=g-import-not-at-top
  from tfdist import train  # pylint: disable=g-import-not-at-top

  def main(argv):
    if _task_name() == "worker0":
      from tfdist.distribute import worker_exit  # pylint: disable=g-import-not-at-top
      end_process = worker_exit._end_process  # pylint: disable=protected-access

      def linger():
        print(f"test: worker 0 finished; lingering {seconds:g} s before "
              "exiting", flush=True)
        time.sleep(seconds)
        print("test: worker 0 exits", flush=True)
        end_process()

      worker_exit._end_process = linger  # pylint: disable=protected-access
    train.main(argv)

  app.run(main, argv=[sys.argv[0], *train_args])


def _run_program(args: List[str], strategy=None):
  """Runs one `shard ...` or `train ...` program (`args` as after `python
  -m tests.multi_worker_testlib`)."""
  if args[0] == "shard":
    shard_main(args[1], args[2:], strategy=strategy)
  else:
    train_main(args[1], args[2], int(args[3]), *map(int, args[4:5]),
               *args[5:6], strategy=strategy)


def programs_main(args: List[str]):
  """`PROGRAM + PROGRAM + ...`: the `shard` and `train` programs in turn,
  under one strategy (made once, with the first program's OUT_DIR): one
  cluster start for several tests' runs."""
  programs = [[]]
  for arg in args:
    if arg == "+":
      programs.append([])
    else:
      programs[-1].append(arg)
  strategy = _strategy(programs[0][1])
  for program in programs:
    _run_program(program, strategy)


if __name__ == "__main__":
  _mode = sys.argv[1]
  if _mode in ("shard", "train"):
    _run_program(sys.argv[1:])
  elif _mode == "programs":
    programs_main(sys.argv[2:])
  elif _mode == "train_linger":
    train_linger_main(float(sys.argv[2]), sys.argv[3:])
  elif _mode == "agree":
    agree_main(sys.argv[2])
  else:
    raise SystemExit(f"unknown mode {_mode!r}")
