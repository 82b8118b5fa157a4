"""Compares what `tfdist.train` says before and after a change.

Runs `python -m tfdist.train --helpfull` and `--dry_run` for a set of flag
combinations (every strategy and role, the memory levers, precision,
accumulation, a refused flag) in two checkouts, the current tree and a
git revision, and prints the differences of their normalized output (log
prefixes, the run's temporary folders and timings removed) and exit
statuses. Exits 1 when they differ.

    .venv/bin/python tools/compare_cli.py --base=<revision>

The base is checked out with `git worktree add` into a temporary folder
(removed at the end) and run with this checkout's virtual environment.
"""

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, flags, environment): each runs as `tfdist.train FLAGS --dry_run`
# with `--model_dir` in a fresh folder, except `helpfull`.
CASES = [
    ("helpfull", ["--helpfull"], {}),
    ("defaults", [], {}),
    ("mirrored", ["--distribution_strategy=mirrored", "--num_cpu_devices=2",
                  "--batch_size=64"], {}),
    ("accumulation_sqrt_warmup", [
        "--gradient_accumulation_steps=2", "--lr_scaling=sqrt",
        "--warmup_epochs=1", "--lr_schedule=cosine"], {}),
    ("zero_stage_1", ["--distribution_strategy=mirrored",
                      "--num_cpu_devices=2", "--zero_stage=1"], {}),
    ("bf16", ["--dtype=bf16"], {}),
    ("transformer", ["--model=transformer", "--dataset=clothing_reviews",
                     "--train_steps=20"], {}),
    ("mwms_worker", ["--distribution_strategy=multi_worker_mirrored",
                     "--worker_hosts=127.0.0.1:1,127.0.0.1:2",
                     "--task_index=1"], {}),
    ("ps_chief", [], {"TF_CONFIG": json.dumps({
        "cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"],
                    "ps": ["127.0.0.1:3"]},
        "task": {"type": "chief", "index": 0}})}),
    ("ps_server", [], {"TF_CONFIG": json.dumps({
        "cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"],
                    "ps": ["127.0.0.1:3"]},
        "task": {"type": "ps", "index": 0}}),
                       }),
    ("evaluator", ["--mode=eval"], {}),
    ("refused_batch", ["--batch_size=-4"], {}),
    ("refused_zero3", ["--zero_stage=3"], {}),
]

_LOG_PREFIX = re.compile(
    r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ [\w.]+:\d+\] ")
_NOISE = re.compile(
    r"(\d+\.\d+ s\b|\d+(\.\d+)? seconds|in \d+(\.\d+)?s\b|"
    r"pid \d+|0x[0-9a-f]+)")


def _normalize(text: str, model_dir: str) -> list:
  lines = []
  for line in text.splitlines():
    line = _LOG_PREFIX.sub("", line)
    line = line.replace(model_dir, "<model_dir>")
    line = _NOISE.sub("<n>", line)
    # TensorFlow's and absl's own start-up chatter.
    if (line.startswith(("WARNING: All log messages", "I0000 ", "W0000 ",
                         "To enable the following instructions",
                         # A data set's one-time conversion (cached after).
                         "Converting ")) or
        "oneDNN custom operations" in line or
        "cpu_feature_guard" in line):
      continue
    lines.append(line.rstrip())
  return lines


def run_cases(checkout: str, python: str, scratch: str) -> dict:
  """`{case: (exit status, normalized lines)}` in `checkout`."""
  results = {}
  for name, flags, env in CASES:
    model_dir = os.path.join(scratch, name)
    args = [python, "-m", "tfdist.train", *flags]
    if name != "helpfull":
      args += [f"--model_dir={model_dir}", "--dry_run"]
    environ = {k: v for k, v in os.environ.items()
               if k not in ("TF_CONFIG", "CLUSTER_SPEC")}
    environ.update(env, PYTHONPATH=checkout, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(args, cwd=checkout, env=environ,
                          capture_output=True, text=True, timeout=300,
                          check=False)
    results[name] = (proc.returncode,
                     _normalize(proc.stdout + proc.stderr, model_dir))
    print(f"  {name}: exit {proc.returncode}", flush=True)
  return results


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--base", required=True,
                      help="the git revision to compare with")
  parser.add_argument("--python",
                      default=os.path.join(ROOT, ".venv", "bin", "python"))
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory(prefix="tfdist-compare-") as scratch:
    base_tree = os.path.join(scratch, "base")
    subprocess.run(["git", "worktree", "add", "--detach", base_tree,
                    args.base], cwd=ROOT, check=True, capture_output=True)
    try:
      print(f"base {args.base}:", flush=True)
      before = run_cases(base_tree, args.python,
                         os.path.join(scratch, "runs"))
      print("this tree:", flush=True)
      after = run_cases(ROOT, args.python, os.path.join(scratch, "runs"))
    finally:
      subprocess.run(["git", "worktree", "remove", "--force", base_tree],
                     cwd=ROOT, check=False, capture_output=True)
  differ = 0
  for name, _, _ in CASES:
    (code_a, lines_a), (code_b, lines_b) = before[name], after[name]
    if code_a != code_b:
      differ += 1
      print(f"{name}: exit status {code_a} -> {code_b}")
    diff = list(difflib.unified_diff(lines_a, lines_b, f"{name} (base)",
                                     f"{name} (this tree)", lineterm="",
                                     n=1))
    if diff:
      differ += 1
      print("\n".join(diff))
  print(f"{len(CASES)} cases, {differ} difference(s).")
  return 1 if differ else 0


if __name__ == "__main__":
  sys.exit(main())
