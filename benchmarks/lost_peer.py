"""How fast a two-worker MultiWorkerMirrored run notices a lost peer.

Not a test: it starts a chief and a worker of `python -m tfdist.train`
(`TF_CONFIG` on 127.0.0.1, no launcher, so nothing else stops the survivor),
waits until the chief has logged step `--at_step`, then sends one task
SIGKILL (a lost machine) or SIGSTOP (a hung one), and measures how long the
other task takes to exit, with which status and which tfdist message. The
stopped task is killed afterwards. Repeats every case `--repeats` times and
writes JSON.

Usage:
  python benchmarks/lost_peer.py --repeats=1 \\
      --output=benchmarks/results/lost_peer.json
"""

import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

FLAGS = flags.FLAGS
flags.DEFINE_integer("repeats", 1, "Runs per case.")
flags.DEFINE_integer("at_step", 60, "Signal the peer after this step.")
flags.DEFINE_float("collective_timeout_seconds", 0.0,
                   "--collective_timeout_seconds of the runs.")
flags.DEFINE_float("timeout", 300, "Seconds a survivor may take to exit "
                   "before the case counts as a hang.")
flags.DEFINE_list("cases", ["SIGKILL:worker", "SIGSTOP:worker",
                            "SIGKILL:chief", "SIGSTOP:chief"],
                  "SIGNAL:TASK cases.")
flags.DEFINE_string("output", os.path.join(REPO, "benchmarks", "results",
                                           "lost_peer.json"), "JSON out.")


def _start(task, cluster, flags_list, log_path):
  env = dict(os.environ, PYTHONPATH=REPO, TF_CONFIG=json.dumps(
      {"cluster": cluster, "task": {"type": task, "index": 0}}))
  log = open(log_path, "w")  # pylint: disable=consider-using-with
  return subprocess.Popen([sys.executable, "-m", "tfdist.train", *flags_list],
                          cwd=REPO, env=env, stdout=log,
                          stderr=subprocess.STDOUT), log


def _case(signame, victim, data):
  import portpicker  # pylint: disable=g-import-not-at-top
  tmp = tempfile.mkdtemp(prefix="lost-peer-")
  cluster = {"chief": [f"127.0.0.1:{portpicker.pick_unused_port()}"],
             "worker": [f"127.0.0.1:{portpicker.pick_unused_port()}"]}
  flags_list = [
      "--distribution_strategy=multi_worker_mirrored",
      f"--train_files={data['train']}", f"--eval_files={data['eval']}",
      "--batch_size=16", "--train_steps=100000", "--log_steps=20",
      "--checkpoint_steps=100000", "--epochs_between_evals=100000",
      f"--collective_timeout_seconds={FLAGS.collective_timeout_seconds:g}",
      f"--model_dir={os.path.join(tmp, 'run')}"]
  procs, logs = {}, {}
  for task in ("chief", "worker"):
    procs[task], logs[task] = _start(task, cluster, flags_list,
                                     os.path.join(tmp, f"{task}.log"))
  survivor = "worker" if victim == "chief" else "chief"
  chief_log = os.path.join(tmp, "chief.log")
  result = {"signal": signame, "victim": victim, "survivor": survivor}
  try:
    deadline = time.time() + 600
    while time.time() < deadline:
      with open(chief_log, errors="replace") as f:
        if f" step {FLAGS.at_step}/" in f.read():
          break
      if any(p.poll() is not None for p in procs.values()):
        break
      time.sleep(0.2)
    else:
      result["error"] = f"step {FLAGS.at_step} not reached in 600 s"
      return result
    sent = time.time()
    os.kill(procs[victim].pid, getattr(signal, signame))
    try:
      status = procs[survivor].wait(timeout=FLAGS.timeout)
      result["seconds_to_exit"] = round(time.time() - sent, 1)
      result["exit_status"] = status
    except subprocess.TimeoutExpired:
      result["seconds_to_exit"] = None
      result["exit_status"] = f"still running after {FLAGS.timeout:g} s"
    logs[survivor].flush()
    with open(os.path.join(tmp, f"{survivor}.log"), errors="replace") as f:
      lines = f.read().splitlines()
    result["tfdist_message"] = next(
        (l for l in reversed(lines) if l.startswith("tfdist.train:")), None)
    result["last_lines"] = lines[-3:]
  finally:
    for proc in procs.values():
      if proc.poll() is None:
        proc.kill()
        proc.wait()
    for log in logs.values():
      log.close()
  return result


def main(argv):
  del argv  # Unused.
  from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
  out = os.path.join(tempfile.mkdtemp(prefix="lost-peer-data-"), "fm")
  datasets.convert_fashion_mnist(out, limit=2048)
  data = {"train": os.path.join(out, "train-*.tfrecord.gz"),
          "eval": os.path.join(out, "test-*.tfrecord.gz")}
  results = []
  for _ in range(FLAGS.repeats):
    for case in FLAGS.cases:
      signame, victim = case.split(":")
      result = _case(signame, victim, data)
      results.append(result)
      print(json.dumps({k: v for k, v in result.items()
                        if k != "last_lines"}), flush=True)
  record = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "command": " ".join(sys.argv), "load_average": os.getloadavg(),
      "collective_timeout_seconds": FLAGS.collective_timeout_seconds,
      "results": results}
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.output)), exist_ok=True)
  with open(FLAGS.output, "w") as f:
    json.dump(record, f, indent=1)
  print(f"JSON: {FLAGS.output}")


if __name__ == "__main__":
  app.run(main)
