"""CPU time per thread name of tfdist.train processes over a window.

Not a test: it starts a command (a `tfdist.train` run, or `tfdist.launch`
starting several), waits `--start_seconds` (past start-up and warm-up),
reads the CPU time of every thread of every `tfdist.train` process
(`/proc/PID/task/TID/stat`: user plus system), waits `--window_seconds`,
reads again, and prints and writes, per process, the CPU seconds each
thread name took in the window and its share: where a step's CPU goes
(TensorFlow's compute threads `tf_Compute`, the Python main thread, the
collective executor `collective_ops`, gRPC's `event_engine`) and how busy
the process kept its core.

Usage (docs/benchmarks/README.md, "On a quiet machine"):
  python benchmarks/thread_cpu.py --output=/tmp/threads_mwms.json -- \\
      python -m tfdist.launch --num_workers=2 --pin_workers -- \\
      --model_dir=/tmp/threads_mwms --train_steps=500 --log_steps=50 \\
      --batch_size=256 --distribution_strategy=multi_worker_mirrored \\
      --epochs_between_evals=1000
  python benchmarks/thread_cpu.py --output=/tmp/threads_one.json -- \\
      taskset -c 0 python -m tfdist.train --model_dir=/tmp/threads_one \\
      --train_steps=600 --log_steps=50 --batch_size=128 \\
      --distribution_strategy=one_device --epochs_between_evals=1000
"""

import collections
import datetime
import json
import os
import subprocess
import sys
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_float("start_seconds", 30, "Seconds before the window.")
flags.DEFINE_float("window_seconds", 20, "Length of the window, seconds.")
flags.DEFINE_string("output", "thread_cpu.json", "JSON written here.")
flags.DEFINE_string("log", "thread_cpu_run.log", "The command's output.")
flags.DEFINE_float("timeout_seconds", 900, "Limit of the command.")

_TICKS = os.sysconf("SC_CLK_TCK")


def _training_processes() -> dict:
  """`{pid: command line}` of the running `python -m tfdist.train`s."""
  found = {}
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        args = f.read().split(b"\0")
    except OSError:
      continue
    if b"tfdist.train" in args and b"-m" in args:
      found[int(pid)] = b" ".join(args).decode(errors="replace")
  return found


def _thread_seconds(pid: int) -> collections.Counter:
  """CPU seconds (user plus system) per thread name of process `pid`."""
  seconds = collections.Counter()
  for tid in os.listdir(f"/proc/{pid}/task"):
    try:
      with open(f"/proc/{pid}/task/{tid}/stat") as f:
        stat = f.read()
    except OSError:
      continue
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    seconds[name] += (int(fields[11]) + int(fields[12])) / _TICKS
  return seconds


def main(argv):
  command = argv[1:]
  if not command:
    raise app.UsageError("Give the command after --.")
  load_start = os.getloadavg()
  with open(FLAGS.log, "w") as log:
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
      time.sleep(FLAGS.start_seconds)
      pids = _training_processes()
      before = {pid: _thread_seconds(pid) for pid in pids}
      time.sleep(FLAGS.window_seconds)
      after = {pid: _thread_seconds(pid) for pid in pids}
      process.wait(timeout=FLAGS.timeout_seconds)
    finally:
      if process.poll() is None:
        process.kill()
  results = []
  for pid in pids:
    used = {name: after[pid][name] - before[pid].get(name, 0.0)
            for name in after[pid]}
    total = sum(used.values())
    threads = [{"name": name, "cpu_seconds": round(value, 2),
                "share": round(value / total, 4) if total else None}
               for name, value in sorted(used.items(), key=lambda kv: -kv[1])
               if value > 0]
    results.append({"pid": pid, "command": pids[pid],
                    "cpu_seconds": round(total, 2),
                    "busy": round(total / FLAGS.window_seconds, 4),
                    "threads": threads})
    print(f"pid {pid}: {total:.2f} s CPU in {FLAGS.window_seconds:g} s "
          f"({100 * total / FLAGS.window_seconds:.1f}% of a core)")
    for t in threads[:12]:
      print(f"   {t['name']:20s} {t['cpu_seconds']:6.2f}  "
            f"{100 * t['share']:5.1f}%")
  record = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "command": " ".join(["python", *sys.argv]),
      "load_average": {"start": load_start, "end": os.getloadavg()},
      "start_seconds": FLAGS.start_seconds,
      "window_seconds": FLAGS.window_seconds,
      "exit_status": process.returncode, "processes": results}
  with open(FLAGS.output, "w") as f:
    json.dump(record, f, indent=2)
  print(f"Wrote {FLAGS.output}.")


if __name__ == "__main__":
  app.run(main)
