"""Chaos: random SIGKILL and SIGTERM on 2-worker runs, restarted until done.

Not a test: it prints figures and writes JSON (`tests/chaos_test.py` runs a
short version of `run_mwms`). Each run trains the `cnn` on a real
Fashion-MNIST subset with `python -m tfdist.train` on 127.0.0.1, while a
seeded schedule sends random tasks SIGKILL or SIGTERM at random steps; about
a third of the kills are timed to a checkpoint write (the moment a new entry
of the next checkpoint, such as its `ckpt-N_temp/` parts folder, appears in
the chief's checkpoint folder). Every dead task is restarted as a cluster
manager would, until the run completes:

* MultiWorkerMirrored: the whole cluster, by `tfdist.launch --max_restarts`
  (new ports). Every worker takes part in every all-reduce, so a survivor
  of a lost peer cannot go on (it exits with status 200); a Kubeflow TFJob
  that restarts only the failed replica restarts the survivors too, on that
  status. The restarted cluster resumes from the chief's last checkpoint.
* One process (`mirrored`, e.g. with `--extra_flags=--num_cpu_devices=2,
  --zero_stage=3`, whose replicas each write their slices of a
  checkpoint): the harness starts the process again after each kill, as a
  job scheduler restarts a failed job (`run_one_process`).
* Parameter servers (chief, 2 workers, 1 ps; `tests.ps_testutil`): a lost
  worker is restarted alone at its address, as a Kubernetes pod or Vertex
  replica keeps its name: the coordinator runs that worker's unfinished
  steps on the other worker, and TensorFlow's `ClusterCoordinator` takes it
  back when it returns, so training never stops. A lost ps task (it holds
  the variables) or chief (the coordinator: it holds the program and the
  step) stops the run: the whole cluster restarts, from the last checkpoint.

What is checked, for every kill and run (anything failing is "lost"):

* the restarted cluster resumed from the newest whole checkpoint there was
  when the last task died (a checkpoint was not lost), and a kill during a
  write left no partial checkpoint listed (`checkpoint` names only
  checkpoints whose index and data files exist and load);
* the run finished: final status 0, `run_manifest.json`'s `final_step` and
  the last checkpoint's `global_step` equal the planned steps, the last
  checkpoint is `ckpt-<train_steps>`, no `*_temp` parts left behind;
* `--deterministic` (MultiWorkerMirrored only: synchronous): every floating
  variable of the final checkpoint (weights, optimizer slots, batch-norm
  statistics) equals an uninterrupted run's within `WEIGHT_TOLERANCE`.
  Parameter-server runs are asynchronous: their checks are the ones above;
  tfdist counts a step once even when a lost worker's chunk ran again on
  another (`tfdist.training.step.step_runner.CoordinatorStepRunner`), so
  `global_step` is exact, and the optimizer's own update count may exceed it by
  the re-run steps (reported as `rerun_updates`, not a loss).

Usage (from the repository root):
  PYTHONPATH=$PWD python benchmarks/chaos.py --seed=1 --deterministic \
      --runs=3 --kills=4 --output=benchmarks/results/chaos.json

Replay a schedule with the same `--seed` (and the same `--runs`, `--kills`,
`--train_steps`, `--checkpoint_steps`); which step a kill lands on depends
on timing, the schedule does not.
"""

import dataclasses
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Tuple

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from tests import multi_worker_testlib  # pylint: disable=g-import-not-at-top,wrong-import-position
from tests import ps_testutil  # pylint: disable=g-import-not-at-top,wrong-import-position

MWMS = "multi_worker_mirrored"
PS = "parameter_server"
# One process of MirroredStrategy (e.g. with --zero_stage=3: its replicas'
# sliced checkpoints, each slice written by the replica holding it).
MIRRORED = "mirrored"
# Largest absolute difference allowed between a chaotic run's final
# variables and an uninterrupted run's (--deterministic).
WEIGHT_TOLERANCE = 1e-6
# A kill timed to a checkpoint write polls the checkpoint folder this often.
_SAVE_POLL_SECONDS = 0.002
_TEMP_RE = re.compile(r"-(\d+)_temp$")
_STEP_RE = r"tfdist: (?:epoch \d+/\d+, )?step (\d+)/\d+"
_RESUMED_RE = r"tfdist: restored \S*ckpt-(\d+): resuming at step (\d+)"


@dataclasses.dataclass(frozen=True)
class ChaosOptions:
  """One chaotic run.

  Attributes:
    strategy: `MWMS` or `PS`.
    kills: signals to send over the run.
    seed: seeds the schedule (which task, which signal, when).
    train_steps: optimizer updates in the run.
    checkpoint_steps: save every this many steps.
    batch_size: global batch.
    deterministic: `--deterministic` (MWMS only).
    timeout_seconds: bound on the whole run (restarts included).
    save_share: the share of kills timed to a checkpoint write.
    preemption_grace_seconds: the training flag of that name.
    extra_flags: more `tfdist.train` flags (e.g. `--zero_stage=3`).
  """
  strategy: str = MWMS
  kills: int = 3
  seed: int = 0
  train_steps: int = 24
  checkpoint_steps: int = 4
  batch_size: int = 32
  deterministic: bool = True
  timeout_seconds: float = 600.0
  save_share: float = 1 / 3
  preemption_grace_seconds: float = 15.0
  extra_flags: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Kill:
  """One planned signal: `task` gets `signal` once the chief logged step
  `step` (mode "step") or once checkpoint `step`'s write shows in the
  checkpoint folder after the chief logged step `step - 1` (mode "save")."""
  task: str
  signal: str
  mode: str
  step: int


def _resume_losses(record: dict) -> list:
  """What a restart lost: it never trained, or it did not resume at the
  newest whole checkpoint (`record`'s `resumed_at` and
  `newest_whole_checkpoint`)."""
  if record.get("resumed_at") is None:
    return ["the restarted cluster never trained"]
  if record["resumed_at"] != record["newest_whole_checkpoint"]:
    return [f"resumed at step {record['resumed_at']}, but ckpt-"
            f"{record['newest_whole_checkpoint']} was the newest whole "
            "checkpoint"]
  return []


def tasks_of(strategy: str) -> List[str]:
  """The tasks a kill can hit, as `tfdist.launch` names them."""
  if strategy == MIRRORED:
    return ["chief:0"]  # The one process.
  if strategy == MWMS:
    return ["chief:0", "worker:0"]
  return ["chief:0", "worker:0", "worker:1", "ps:0"]


def plan_kills(options: ChaosOptions) -> List[Kill]:
  """The seeded schedule: `options.kills` kills at increasing steps.

  Steps lie in [2, train_steps - 3] and at least 2 apart (a SIGTERM stops
  every worker a step or two later); "save" kills are at checkpoint steps.

  Raises:
    ValueError: the run is too short for that many kills.
  """
  rng = random.Random(options.seed)
  last = options.train_steps - 3
  if options.kills > (last - 2) // 2 + 1:
    raise ValueError(
        f"--kills={options.kills} needs a longer run: --train_steps="
        f"{options.train_steps} leaves room for {(last - 2) // 2 + 1} kills "
        "2 steps apart between steps 2 and train_steps - 3.")
  kills, step = [], 1
  for i in range(options.kills):
    # Leave 2 steps for each kill still to come.
    room = last - 2 * (options.kills - 1 - i)
    low = step + 2 if kills else 2
    at_save = rng.random() < options.save_share
    saves = [s for s in range(low, room + 1)
             if s % options.checkpoint_steps == 0]
    if at_save and saves:
      step, mode = rng.choice(saves), "save"
    else:
      step, mode = rng.randint(low, max(low, room)), "step"
    kills.append(Kill(task=rng.choice(tasks_of(options.strategy)),
                      signal=rng.choice(["SIGKILL", "SIGTERM"]), mode=mode,
                      step=step))
  return kills


def train_flags(options: ChaosOptions, data: dict, model_dir: str
                ) -> List[str]:
  """`tfdist.train` flags of a run (the uninterrupted one's too)."""
  # --mode=train: no evaluation (not what is measured; it costs a trace).
  args = [f"--distribution_strategy={options.strategy}", "--model=cnn",
          "--mode=train", f"--train_files={data['train']}",
          f"--model_dir={model_dir}", f"--batch_size={options.batch_size}",
          f"--train_steps={options.train_steps}", "--log_steps=1",
          f"--checkpoint_steps={options.checkpoint_steps}",
          "--max_checkpoints=1000", "--warmup_steps=0", "--seed=7",
          f"--preemption_grace_seconds={options.preemption_grace_seconds:g}",
          "--collective_timeout_seconds=60",
          "--cluster_start_timeout_seconds=120"]
  if options.deterministic and options.strategy in (MWMS, MIRRORED):
    args.append("--deterministic")
  return args + list(options.extra_flags)


def prepare_data(out_dir: str, *, train_examples: int = 512) -> dict:
  """The first `train_examples` real Fashion-MNIST training images as
  tfdist's TFRecords, in 2 shards (one per worker). Returns `{"train"}`:
  their file glob."""
  from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
  datasets.convert_fashion_mnist(out_dir, limit=train_examples,
                                 train_shards=2, test_shards=1)
  return {"train": os.path.join(out_dir, "train-*.tfrecord.gz")}


# --- the checkpoint folder, read without TensorFlow (while tasks run) --------
def listed_checkpoints(checkpoint_dir: str) -> List[int]:
  """The steps the `checkpoint` index file lists (oldest first)."""
  path = os.path.join(checkpoint_dir, "checkpoint")
  try:
    with open(path) as f:
      text = f.read()
  except OSError:
    return []
  return [int(s) for s in re.findall(
      r'^all_model_checkpoint_paths: "[^"]*ckpt-(\d+)"', text, re.M)]


def whole_checkpoints(checkpoint_dir: str) -> List[int]:
  """Listed steps whose `.index` and data files all exist."""
  out = []
  for step in listed_checkpoints(checkpoint_dir):
    prefix = os.path.join(checkpoint_dir, f"ckpt-{step}")
    if not os.path.exists(prefix + ".index"):
      continue
    data = [n for n in _listdir(checkpoint_dir)
            if n.startswith(f"ckpt-{step}.data-")]
    shards = {int(m.group(1)) for n in data
              for m in [re.search(r"-of-(\d+)$", n)] if m}
    if data and shards and len(data) == max(shards):
      out.append(step)
  return out


def temp_parts(checkpoint_dir: str) -> List[str]:
  """`ckpt-N_temp` folders (parts of a save not finished)."""
  return sorted(n for n in _listdir(checkpoint_dir) if _TEMP_RE.search(n))


def _listdir(folder: str) -> List[str]:
  try:
    return os.listdir(folder)
  except OSError:
    return []


def _snapshot(folder: str) -> dict:
  """name -> (inode, mtime in ns) of `folder`'s entries."""
  out = {}
  for name in _listdir(folder):
    try:
      stat = os.stat(os.path.join(folder, name))
    except OSError:
      continue
    out[name] = (stat.st_ino, stat.st_mtime_ns)
  return out


def _unlisted_entries(checkpoint_dir: str, before: dict) -> List[str]:
  """Entries new or changed since `before` (`_snapshot`) that belong to a
  save in progress: a `_temp` folder, or files of a checkpoint the index
  does not list yet. Changed counts: a killed save's leftover `_temp`
  folder is written again by the same save after the restart."""
  listed = set(listed_checkpoints(checkpoint_dir))
  now = _snapshot(checkpoint_dir)
  out = []
  for name in [n for n, key in now.items() if before.get(n) != key]:
    match = _TEMP_RE.search(name) or re.match(r"ckpt-(\d+)\.", name)
    if match and int(match.group(1)) not in listed:
      out.append(name)
  return sorted(out)


# --- the final audit (TensorFlow) -----------------------------------------------
def audit_run(model_dir: str, train_steps: int) -> dict:
  """What a finished run left: `{"lost": [...], "final_step",
  "checkpoints", "rerun_updates"}`; `lost` lists each problem found."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  lost = []
  checkpoint_dir = os.path.join(model_dir, "checkpoints")
  listed = listed_checkpoints(checkpoint_dir)
  whole = whole_checkpoints(checkpoint_dir)
  for step in sorted(set(listed) - set(whole)):
    lost.append(f"checkpoint ckpt-{step} is listed but partial or missing")
  for name in temp_parts(checkpoint_dir):
    lost.append(f"partial checkpoint parts left behind: {name}")
  rerun_updates = None
  for step in whole:
    try:
      reader = tf.train.load_checkpoint(
          os.path.join(checkpoint_dir, f"ckpt-{step}"))
      saved_step = int(reader.get_tensor(
          "global_step/.ATTRIBUTES/VARIABLE_VALUE"))
      if step == whole[-1]:
        rerun_updates = int(reader.get_tensor(
            "optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE")) - saved_step
    except (tf.errors.OpError, ValueError) as e:
      lost.append(f"checkpoint ckpt-{step} does not load: "
                  f"{type(e).__name__}: {str(e).splitlines()[0]}")
      continue
    if saved_step != step:
      lost.append(f"checkpoint ckpt-{step} holds global_step {saved_step}")
  if not whole or whole[-1] != train_steps:
    lost.append(f"the last checkpoint is ckpt-{whole[-1] if whole else None},"
                f" not ckpt-{train_steps}")
  final_step = None
  try:
    with open(os.path.join(model_dir, "run_manifest.json")) as f:
      final_step = json.load(f).get("final_step")
  except (OSError, ValueError) as e:
    lost.append(f"no readable run_manifest.json: {e}")
  if final_step != train_steps:
    lost.append(f"run_manifest.json final_step {final_step}, planned "
                f"{train_steps}")
  return {"lost": lost, "final_step": final_step, "checkpoints": whole,
          "rerun_updates": rerun_updates}


def max_weight_difference(run_a: str, run_b: str) -> float:
  """Largest absolute difference between the floating variables of two
  checkpoints (`inf` when their variables differ in name or shape).

  Args:
    run_a, run_b: each a `--model_dir` (its latest checkpoint) or a
      checkpoint prefix (`.../ckpt-12`).
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  readers = [tf.train.load_checkpoint(tf.train.latest_checkpoint(
      os.path.join(p, "checkpoints")) if os.path.isdir(p) else p)
             for p in (run_a, run_b)]
  dtypes = [r.get_variable_to_dtype_map() for r in readers]
  if set(dtypes[0]) != set(dtypes[1]):
    return float("inf")
  worst = 0.0
  for name, dtype in dtypes[0].items():
    if not dtype.is_floating:
      continue
    a, b = (np.asarray(r.get_tensor(name), np.float64) for r in readers)
    if a.shape != b.shape:
      return float("inf")
    worst = max(worst, float(np.abs(a - b).max(initial=0.0)))
  return worst


# --- watching output ------------------------------------------------------------
class _Lines:
  """A growing list of output lines (a launcher's, or a log file's)."""

  def __init__(self, read):
    self._read = read

  def lines(self) -> List[str]:
    return self._read()

  def find(self, pattern: str, start: int = 0):
    """The first line at or after `start` matching; (match, index) or
    (None, len)."""
    regex = re.compile(pattern)
    lines = self.lines()
    for i in range(start, len(lines)):
      match = regex.search(lines[i])
      if match:
        return match, i
    return None, len(lines)


def _wait_line(lines: _Lines, pattern: str, start: int, *, deadline: float,
               alive) -> tuple:
  """Waits for a line matching `pattern` at or after `start`: (match, index);
  (None, index) when `alive()` turns False or the deadline passes."""
  while True:
    match, index = lines.find(pattern, start)
    if match:
      return match, index
    if not alive() or time.time() > deadline:
      match, index = lines.find(pattern, start)
      return match, index
    time.sleep(0.05)


def _wait_step(lines: _Lines, who: str, step: int, start: int, *,
               deadline: float, alive) -> Optional[int]:
  """Waits until `who` (a line-prefix pattern) logged a step >= `step` at or
  after line `start`; returns that step, or None (ended, or deadline)."""
  regex = re.compile(who + r".*" + _STEP_RE)
  index = start
  while True:
    lines_now = lines.lines()
    for line in lines_now[index:]:
      match = regex.search(line)
      if match and int(match.group(1)) >= step:
        return int(match.group(1))
    index = max(index, len(lines_now))
    if not alive() or time.time() > deadline:
      return None
    time.sleep(0.02)


def _before_restart(checkpoint_dir: str) -> dict:
  """What a restart must find, read once every task of the attempt has
  exited: the newest whole checkpoint (0: none) and the parts of a write
  the kill cut short."""
  whole = whole_checkpoints(checkpoint_dir)
  return {"newest_whole_checkpoint": whole[-1] if whole else 0,
          "temp_parts_at_restart": temp_parts(checkpoint_dir)}


def _after_restart(record: dict, resumed) -> None:
  """Records in `record` where the restarted run resumed (`resumed`: its
  first line matching `_RESUMED_RE` or `_STEP_RE`, or None) and what the
  restart lost (`_resume_losses`)."""
  if resumed and resumed.group(2) is not None:
    record["resumed_at"] = int(resumed.group(3))
  elif resumed:
    record["resumed_at"] = 0  # Trained from step 0: no restore.
  record["lost"] = _resume_losses(record)
  record["survived"] = not record["lost"]


def _last_step(lines: _Lines, who: str, start: int) -> Optional[int]:
  steps = [int(m.group(1)) for line in lines.lines()[start:]
           for m in [re.search(who + r".*" + _STEP_RE, line)] if m]
  return steps[-1] if steps else None


def _send(pid: int, signum: int) -> bool:
  """Sends `signum` to `pid`; False when that process is gone."""
  try:
    os.kill(pid, signum)
    return True
  except ProcessLookupError:
    return False


def _kill(pid: int, signum: int, mode: str, checkpoint_dir: str, *,
          deadline: float, alive) -> dict:
  """Sends `signum` to `pid`: at once (mode "step") or the moment a save
  shows in `checkpoint_dir` (mode "save"). Returns what to record; `sent`
  is False when the process had already exited."""
  if mode == "save":
    before = _snapshot(checkpoint_dir)
    while time.time() < deadline and alive():
      entries = _unlisted_entries(checkpoint_dir, before)
      if entries:
        return {"sent": _send(pid, signum), "during_save": True,
                "save_entries": entries}
      time.sleep(_SAVE_POLL_SECONDS)
  # No save seen (the run ended, or mode "step"): a plain kill.
  return {"sent": _send(pid, signum), "during_save": False,
          "save_entries": []}


# --- MultiWorkerMirrored: the launcher restarts the whole cluster --------------
def run_mwms(options: ChaosOptions, data: dict, model_dir: str,
             log=print) -> dict:
  """One chaotic MultiWorkerMirrored run under `tfdist.launch`.

  Returns:
    `{"strategy", "seed", "schedule", "kills": [per kill], "status",
    "attempts", "audit", "lost": [...], "seconds"}`.
  """
  schedule = plan_kills(options)
  started = time.time()
  deadline = started + options.timeout_seconds
  checkpoint_dir = os.path.join(model_dir, "checkpoints")
  watch = multi_worker_testlib.LauncherWatch(
      ["--num_workers=2", f"--max_restarts={len(schedule) + 2}",
       "--stop_grace_seconds=60"],
      train_flags(options, data, model_dir), timeout=options.timeout_seconds)
  lines = _Lines(lambda: watch.lines)
  alive = lambda: watch.proc.poll() is None
  attempt_start, attempt = 0, 0
  results = []
  try:
    for kill in schedule:
      record = dataclasses.asdict(kill)
      match, attempt_start = _wait_line(
          lines, rf"\[launch\] attempt {attempt}: started {kill.task} pid "
          r"(\d+)", attempt_start, deadline=deadline, alive=alive)
      if not match:
        record["result"] = "no such attempt (the run had ended)"
        results.append(record)
        break
      pid = int(match.group(1))
      wait_for = kill.step - 1 if kill.mode == "save" else kill.step
      reached = _wait_step(lines, r"\[chief:0\]", wait_for, attempt_start,
                           deadline=deadline, alive=alive)
      if reached is None:
        record["result"] = "not sent: the run ended first"
        results.append(record)
        break
      record.update(_kill(pid, getattr(signal, kill.signal), kill.mode,
                          checkpoint_dir, deadline=deadline, alive=alive))
      if not record["sent"]:
        record["result"] = "not sent: the task had exited (the run ended)"
        results.append(record)
        break
      record["sent_after_step"] = _last_step(lines, r"\[chief:0\]",
                                             attempt_start)
      record["attempt"] = attempt
      log(f"chaos: {options.strategy} seed {options.seed}: {kill.signal} to "
          f"{kill.task} after step {record['sent_after_step']}"
          + (" during a checkpoint write " + ",".join(record["save_entries"])
             if record.get("during_save") else ""))
      match, restart_index = _wait_line(
          lines, r"\[launch\] (restarting the group|done:|stopped|failed)",
          attempt_start, deadline=deadline, alive=alive)
      exits = [m.groups() for line in lines.lines()[attempt_start:
                                                    restart_index + 1]
               for m in [re.search(r"\[launch\] (\S+) exited with status "
                                   r"(\d+)", line)] if m]
      record["exits"] = {task: int(status) for task, status in exits}
      # Survivors still running 5 s after the first exit (killed).
      record["stopped_by_launcher"] = [
          m.group(1) for line in lines.lines()[attempt_start:
                                               restart_index + 1]
          for m in [re.search(r"\[launch\] stopping (.*)\.$", line)] if m]
      if not match or not match.group(1).startswith("restarting"):
        record["result"] = ("survived: the run ended without a restart"
                            if match and match.group(1) == "done:" else
                            "the launcher gave up")
        record["survived"] = bool(match and match.group(1) == "done:")
        results.append(record)
        break
      # Every task of the attempt has exited: what the restart must find.
      record.update(_before_restart(checkpoint_dir))
      attempt += 1
      match, attempt_start = _wait_line(
          lines, rf"\[launch\] attempt {attempt}: started chief:0",
          restart_index, deadline=deadline, alive=alive)
      resumed, _ = _wait_line(
          lines, r"\[chief:0\] .*(" + _RESUMED_RE + "|" + _STEP_RE + ")",
          attempt_start, deadline=deadline, alive=alive)
      _after_restart(record, resumed)
      results.append(record)
    try:
      status = watch.wait()
    except AssertionError:  # LauncherWatch's timeout.
      status = "timeout"
  finally:
    if watch.proc.poll() is None:
      multi_worker_testlib._stop(watch.proc)  # pylint: disable=protected-access
  output = watch.output()
  attempts = len(re.findall(r"\[launch\] attempt \d+: started chief:0",
                            output))
  return _finish(options, schedule, results, status, attempts, model_dir,
                 started, output)


# --- one process: restarted as a scheduler restarts a failed job -----------
def run_one_process(options: ChaosOptions, data: dict, model_dir: str,
                    log=print) -> dict:
  """One chaotic single-process run (`MIRRORED`): each kill ends the
  process, and it is started again with the same flags, as a job
  scheduler restarts a failed job, until the run completes.

  Returns:
    As `run_mwms`.
  """
  schedule = plan_kills(options)
  started = time.time()
  deadline = started + options.timeout_seconds
  checkpoint_dir = os.path.join(model_dir, "checkpoints")
  log_root = model_dir + "-logs"
  os.makedirs(log_root, exist_ok=True)
  command = [sys.executable, "-m", "tfdist.train",
             *train_flags(options, data, model_dir)]
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep +
             os.environ.get("PYTHONPATH", ""))
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  logs = []

  def start():
    path = os.path.join(log_root, f"attempt{len(logs)}.log")
    logs.append(path)
    with open(path, "w") as out:
      return subprocess.Popen(command, cwd=REPO, env=env, stdout=out,
                              stderr=subprocess.STDOUT)

  def read(path):
    try:
      with open(path, errors="replace") as f:
        return f.read().splitlines()
    except OSError:
      return []

  proc, results = start(), []
  try:
    for kill in schedule:
      record = dataclasses.asdict(kill)
      lines = _Lines(lambda path=logs[-1]: read(path))
      alive = lambda p=proc: p.poll() is None
      wait_for = kill.step - 1 if kill.mode == "save" else kill.step
      if _wait_step(lines, "", wait_for, 0, deadline=deadline,
                    alive=alive) is None:
        record["result"] = "not sent: the run ended first"
        results.append(record)
        break
      record.update(_kill(proc.pid, getattr(signal, kill.signal), kill.mode,
                          checkpoint_dir, deadline=deadline, alive=alive))
      record["sent_after_step"] = _last_step(lines, "", 0)
      log(f"chaos: {options.strategy} seed {options.seed}: {kill.signal} "
          f"after step {record['sent_after_step']}"
          + (" during a checkpoint write " + ",".join(record["save_entries"])
             if record.get("during_save") else ""))
      try:
        code = proc.wait(timeout=max(deadline - time.time(), 1))
      except subprocess.TimeoutExpired:
        record["result"] = "the process did not end"
        results.append(record)
        break
      record["exits"] = {kill.task: _shell_status(code)}
      record.update(_before_restart(checkpoint_dir))
      proc = start()
      lines = _Lines(lambda path=logs[-1]: read(path))
      resumed, _ = _wait_line(lines, "(" + _RESUMED_RE + "|" + _STEP_RE +
                              ")", 0, deadline=deadline,
                              alive=lambda p=proc: p.poll() is None)
      _after_restart(record, resumed)
      results.append(record)
    try:
      status = _shell_status(proc.wait(
          timeout=max(deadline - time.time(), 1)))
    except subprocess.TimeoutExpired:
      status = "timeout"
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  output = "\n".join(line for path in logs for line in read(path))
  return _finish(options, schedule, results, status, len(logs), model_dir,
                 started, output)


# --- parameter servers: a worker alone, or the whole cluster -------------------
def run_ps(options: ChaosOptions, data: dict, model_dir: str,
           log=print) -> dict:
  """One chaotic parameter-server run (chief, 2 workers, 1 ps).

  Returns:
    As `run_mwms`; each kill says `restart` "task" or "cluster".
  """
  schedule = plan_kills(options)
  started = time.time()
  deadline = started + options.timeout_seconds
  checkpoint_dir = os.path.join(model_dir, "checkpoints")
  log_root = model_dir + "-logs"
  flags_ = train_flags(options, data, model_dir)
  clusters = []

  def new_cluster():
    cluster = ps_testutil.LocalCluster(
        flags_, os.path.join(log_root, f"attempt{len(clusters)}"),
        num_workers=2, num_ps=1)
    clusters.append(cluster)
    return cluster.start()

  cluster = new_cluster()
  lines = _Lines(lambda: cluster.log("chief-0").splitlines())
  alive = lambda: cluster.procs["chief-0"].poll() is None
  results = []
  rejoining = []  # (record, cluster, worker log, its "serving" lines before)
  status = None
  try:
    for kill in schedule:
      record = dataclasses.asdict(kill)
      record["attempt"] = len(clusters) - 1
      wait_for = kill.step - 1 if kill.mode == "save" else kill.step
      reached = _wait_step(lines, "", wait_for, 0, deadline=deadline,
                           alive=alive)
      if reached is None:
        record["result"] = "not sent: the run ended first"
        results.append(record)
        break
      name = kill.task.replace(":", "-")
      proc = cluster.procs[name]
      record.update(_kill(proc.pid, getattr(signal, kill.signal), kill.mode,
                          checkpoint_dir, deadline=deadline,
                          alive=alive) if proc.poll() is None else
                    {"sent": False})
      if not record["sent"]:
        record["result"] = "not sent: the task had exited (the run ended)"
        results.append(record)
        break
      record["sent_after_step"] = _last_step(lines, "", 0)
      log(f"chaos: {options.strategy} seed {options.seed}: {kill.signal} to "
          f"{kill.task} after step {record['sent_after_step']}"
          + (" during a checkpoint write " + ",".join(record["save_entries"])
             if record.get("during_save") else ""))
      record["lost"] = []
      try:
        code = proc.wait(timeout=options.preemption_grace_seconds + 45)
      except subprocess.TimeoutExpired:
        record["lost"].append(f"{kill.task} still ran "
                              f"{options.preemption_grace_seconds + 45:g} s "
                              f"after {kill.signal}: killed")
        cluster.kill(name)
        code = proc.returncode
      record["exits"] = {kill.task: _shell_status(code)}
      chief = cluster.procs["chief-0"]
      if kill.task.startswith("worker") and chief.poll() is None:
        record["restart"] = "task"
        task_type, index = kill.task.split(":")
        log_name = f"worker-{index}"
        served = cluster.log(log_name).count(" serving at ")
        time.sleep(1.0)  # A pod restart is not instant.
        cluster.start_task(task_type, int(index))
        # Whether it served again is read at the end of the run (the
        # schedule goes on meanwhile, as a cluster's life does).
        rejoining.append((record, cluster, log_name, served))
        # The coordinator trains on: 2 more steps (or the end).
        last = _last_step(lines, "", 0) or 0
        _wait_step(lines, "", min(last + 2, options.train_steps), 0,
                   deadline=deadline, alive=alive)
        if chief.poll() not in (0, None):
          record["lost"].append(
              f"the chief exited with status {_shell_status(chief.poll())} "
              "after a worker was lost")
      elif kill.task.startswith("worker"):
        record["result"] = "the run had finished: no restart needed"
      else:
        try:
          code = chief.wait(timeout=120)
          record["exits"]["chief:0"] = _shell_status(code)
        except subprocess.TimeoutExpired:
          record["lost"].append(f"the chief still ran 120 s after "
                                f"{kill.signal} to {kill.task}")
          code = None
        if code == 0:
          # A ps serves on through its grace period after SIGTERM: the
          # chief finished within it.
          record["result"] = "the run finished: no restart needed"
          record["survived"] = True
          results.append(record)
          break
        record["restart"] = "cluster"
        cluster.stop()
        record.update(_before_restart(checkpoint_dir))
        cluster = new_cluster()
        resumed, _ = _wait_line(lines, "(" + _RESUMED_RE + "|" + _STEP_RE +
                                ")", 0, deadline=deadline, alive=alive)
        record["resumed_at"] = (int(resumed.group(3)) if resumed and
                                resumed.group(2) is not None else
                                0 if resumed else None)
        record["lost"] += _resume_losses(record)
      record["survived"] = not record["lost"]
      results.append(record)
    status = cluster.wait("chief-0", max(1.0, deadline - time.time()))
    if status is not None:
      status = _shell_status(status)
      # Worker and ps tasks exit once the chief marks the run done.
      for name in cluster.procs:
        cluster.wait(name, timeout=30)
    for record, where, log_name, served in rejoining:
      record["served_again"] = where.log(log_name).count(" serving at ") > (
          served)
  finally:
    for c in clusters:
      c.stop()
  output = "\n".join(
      f"[attempt {i}] " + c.log("chief-0") for i, c in enumerate(clusters))
  return _finish(options, schedule, results,
                 status if status is not None else "timeout", len(clusters),
                 model_dir, started, output)


def _shell_status(code: Optional[int]) -> Optional[int]:
  """A Popen return code as a shell status (signal N: 128 + N)."""
  if code is None:
    return None
  return 128 - code if code < 0 else code


def _finish(options, schedule, kills, status, attempts, model_dir, started,
            output) -> dict:
  lost = [f"kill {i} ({k['signal']} to {k['task']}): {problem}"
          for i, k in enumerate(kills) for problem in k.get("lost", [])]
  if status != 0:
    lost.append(f"final status {status}, not 0")
  audit = audit_run(model_dir, options.train_steps)
  lost += audit["lost"]
  tracebacks = output.count("Traceback (most recent call last)")
  return {"strategy": options.strategy, "seed": options.seed,
          "options": dataclasses.asdict(options),
          "schedule": [dataclasses.asdict(k) for k in schedule],
          "kills": kills, "kills_tried": sum(
              "sent_after_step" in k for k in kills),
          "survived": sum(bool(k.get("survived")) for k in kills),
          "during_save": sum(bool(k.get("during_save")) for k in kills),
          "status": status, "attempts": attempts, "audit": audit,
          "tracebacks_in_output": tracebacks, "lost": lost,
          "seconds": round(time.time() - started, 1),
          "output_tail": output[-4000:] if lost else ""}


def run_uninterrupted(options: ChaosOptions, data: dict, model_dir: str
                      ) -> dict:
  """The same run with no kill (the reference for `--deterministic`)."""
  started = time.time()
  status, output = multi_worker_testlib.run_launcher(
      ["--num_workers=2"], train_flags(options, data, model_dir),
      timeout=options.timeout_seconds)
  return {"status": status, "seconds": round(time.time() - started, 1),
          "audit": audit_run(model_dir, options.train_steps),
          "output_tail": output[-3000:] if status else ""}


def compare_to_reference(result: dict, model_dir: str,
                         reference_dir: str) -> dict:
  """Adds `weight_difference` to a finished MWMS `result` (and a loss when
  it exceeds `WEIGHT_TOLERANCE`)."""
  difference = max_weight_difference(model_dir, reference_dir)
  result["weight_difference"] = difference
  if not difference <= WEIGHT_TOLERANCE:
    result["lost"].append(
        f"final weights differ from the uninterrupted run's by {difference:g}"
        f" (> {WEIGHT_TOLERANCE:g})")
  return result


# --- binary ------------------------------------------------------------------------
FLAGS = flags.FLAGS
flags.DEFINE_integer("seed", 0, "Seeds every run's kill schedule (run i of "
                     "a strategy uses seed + i): replay a failing one with it.")
flags.DEFINE_list("strategies", [MWMS, PS], "Strategies to run.")
flags.DEFINE_integer("runs", 3, "Chaotic runs per strategy.")
flags.DEFINE_integer("kills", 4, "Kills per run.")
flags.DEFINE_integer("train_steps", 30, "Steps per run.")
flags.DEFINE_integer("checkpoint_steps", 4, "--checkpoint_steps of the runs.")
flags.DEFINE_bool("deterministic", False,
                  "Train MultiWorkerMirrored runs with --deterministic and "
                  "require their final weights to equal an uninterrupted "
                  f"run's within {WEIGHT_TOLERANCE:g}.")
flags.DEFINE_float("run_timeout_seconds", 900.0, "Bound on each run.")
flags.DEFINE_float(
    "preemption_grace_seconds", 15.0,
    "--preemption_grace_seconds of the runs: after SIGTERM a task saves "
    "(MultiWorkerMirrored, the chief of parameter servers) or serves on "
    "(parameter-server workers and ps) at most this long.")
flags.DEFINE_string("output", os.path.join(REPO, "benchmarks", "results",
                                           "chaos.json"),
                    "Where the JSON goes.")
flags.DEFINE_string("work_dir", "", "Where runs write (default: a fresh "
                    "temporary folder).")
flags.DEFINE_list("extra_flags", [], "More tfdist.train flags for every run "
                  "(e.g. --num_cpu_devices=2,--zero_stage=3 with "
                  f"--strategies={MIRRORED}: sliced ZeRO checkpoints).")


def _write(report: dict, path: str):
  """Writes `report` as JSON (after every run, so a run cut short by a
  timeout still leaves the runs before it)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(report, f, indent=2, default=str)


def _uptime() -> str:
  try:
    return subprocess.run(["uptime"], stdout=subprocess.PIPE, text=True,
                          timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ""


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  for name in FLAGS.strategies:
    if name not in (MWMS, PS, MIRRORED):
      raise app.UsageError(f"--strategies: {name!r} is not {MWMS}, {PS} "
                           f"or {MIRRORED}.")
  work = FLAGS.work_dir or tempfile.mkdtemp(prefix="tfdist-chaos-")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  report = {"command": " ".join(sys.argv), "started": time.strftime(
      "%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load_at_start": _uptime(),
            "machine": f"{platform.node()} {os.cpu_count()} cores",
            "seed": FLAGS.seed, "runs": []}
  data = prepare_data(os.path.join(work, "data"))
  reference = None
  for strategy in FLAGS.strategies:
    for i in range(FLAGS.runs):
      options = ChaosOptions(
          strategy=strategy, kills=FLAGS.kills, seed=FLAGS.seed + i,
          train_steps=FLAGS.train_steps,
          checkpoint_steps=FLAGS.checkpoint_steps,
          deterministic=FLAGS.deterministic and strategy != PS,
          extra_flags=tuple(FLAGS.extra_flags),
          timeout_seconds=FLAGS.run_timeout_seconds,
          preemption_grace_seconds=FLAGS.preemption_grace_seconds)
      try:
        plan_kills(options)
      except ValueError as e:
        raise app.UsageError(str(e)) from None
      if options.deterministic and reference is None:
        reference_dir = os.path.join(work, "uninterrupted")
        reference = run_uninterrupted(options, data, reference_dir)
        reference["model_dir"] = reference_dir
        report["uninterrupted"] = reference
        print(f"chaos: uninterrupted run: status {reference['status']} in "
              f"{reference['seconds']} s", flush=True)
      model_dir = os.path.join(work, f"{strategy}-{options.seed}")
      run = {MWMS: run_mwms, PS: run_ps,
             MIRRORED: run_one_process}[strategy]
      result = run(options, data, model_dir,
                   log=lambda text: print(text, flush=True))
      if options.deterministic and reference["status"] == 0:
        compare_to_reference(result, model_dir, reference["model_dir"])
      report["runs"].append(result)
      _write(report, FLAGS.output)
      print(f"chaos: {strategy} seed {options.seed}: {result['kills_tried']} "
            f"kill(s) tried ({result['during_save']} during a checkpoint "
            f"write), {result['survived']} survived, {result['attempts']} "
            f"attempt(s), status {result['status']}, "
            f"{result['seconds']} s"
            + (f", weights differ by {result['weight_difference']:g}"
               if "weight_difference" in result else "")
            + f"; lost: {result['lost'] or 'nothing'}", flush=True)
  runs = report["runs"]
  report["totals"] = {
      "runs": len(runs), "kills_tried": sum(r["kills_tried"] for r in runs),
      "survived": sum(r["survived"] for r in runs),
      "during_save": sum(r["during_save"] for r in runs),
      "lost": [f"{r['strategy']} seed {r['seed']}: {x}" for r in runs
               for x in r["lost"]],
      "completed": sum(r["status"] == 0 for r in runs)}
  report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
  report["load_at_end"] = _uptime()
  totals = report["totals"]
  print(f"chaos: {totals['runs']} run(s), {totals['completed']} completed; "
        f"{totals['kills_tried']} kill(s) tried, {totals['survived']} "
        f"survived, {totals['during_save']} during a checkpoint write; lost: "
        f"{totals['lost'] or 'nothing'}", flush=True)
  _write(report, FLAGS.output)
  print(f"chaos: wrote {FLAGS.output}", flush=True)
  return 0 if not totals["lost"] else 1


if __name__ == "__main__":
  app.run(main)
