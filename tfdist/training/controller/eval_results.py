"""The evaluations file: one JSON line per evaluation
(`eval_results.jsonl`), read by a restarted evaluator and by the runs'
readers.
"""

import json
import os
from typing import List

import tensorflow as tf

from tfdist.runtime import strict_json


EVAL_RESULTS_FILE = "eval_results.jsonl"


def read_eval_results(results_dir: str) -> List[dict]:
  """Every result in `results_dir/eval_results.jsonl` ([] without it)."""
  path = os.path.join(results_dir, EVAL_RESULTS_FILE)
  results = []
  if tf.io.gfile.exists(path):
    with tf.io.gfile.GFile(path) as f:
      for line in f:
        if line.strip():
          results.append(json.loads(line))
  return results


def append_eval_result(results_dir: str, result: dict) -> str:
  """Appends one evaluation as a JSON line to
  `results_dir/eval_results.jsonl` (NaN as null); returns the path."""
  tf.io.gfile.makedirs(results_dir)
  path = os.path.join(results_dir, EVAL_RESULTS_FILE)
  with tf.io.gfile.GFile(path, "a") as f:
    f.write(json.dumps(strict_json.json_safe(result),
                       allow_nan=False) + "\n")
  return path
