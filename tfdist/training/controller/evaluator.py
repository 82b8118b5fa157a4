"""The side-car evaluator: every checkpoint evaluated once, in step order
(`Controller.evaluate_continuously`).
"""

import time
from typing import Callable, List, Optional

from absl import logging
import tensorflow as tf

from tfdist import errors
from tfdist.training.state.checkpoint_paths import checkpoint_step
from tfdist.training.controller.eval_results import append_eval_result
from tfdist.training.controller.eval_results import read_eval_results


def evaluate_continuously(evaluate: Callable[[int], dict], run_log, *,
                          checkpoint_dir: str, results_dir: str,
                          restore: Callable[[str], None],
                          final_step: int,
                          finished: Callable[[], bool] = lambda: False,
                          poll_seconds: float = 2.0,
                          idle_timeout: Optional[float] = None
                          ) -> List[dict]:
  """Evaluates every checkpoint in `checkpoint_dir` once, in step order.

  Each result is logged (TensorBoard `validation/` scalars at the
  checkpoint's step) and appended as one JSON line to
  `results_dir/eval_results.jsonl`; a restarted evaluator skips the steps
  already there. A checkpoint that was rotated away (`--max_checkpoints`)
  before it could be read is named in a warning.

  Args:
    evaluate: `(step) -> result`: evaluates the restored weights, logs the
      result and returns it (`Controller.evaluate`).
    run_log: the `tfdist.observability.run_log.RunLog` (flushed after each
      result).
    checkpoint_dir: the chief's checkpoint folder.
    results_dir: where `eval_results.jsonl` goes.
    restore: loads a checkpoint path's model weights.
    final_step: stop after evaluating this step's checkpoint.
    finished: returns True once the training job is done (e.g. the chief's
      done marker); the newest checkpoint is then evaluated and the loop
      ends.
    poll_seconds: how often to look for new checkpoints.
    idle_timeout: stop after this many seconds without a new checkpoint
      (None: wait for `final_step` or `finished`).

  Returns:
    Every result in `eval_results.jsonl` (earlier runs' included).
  """
  tf.io.gfile.makedirs(results_dir)
  results = read_eval_results(results_dir)
  done = {result["step"] for result in results}
  seen_paths = set()
  last_new = time.time()
  logging.info("Evaluator: watching %s (final step %d)", checkpoint_dir,
               final_step)
  while True:
    paths = _checkpoint_paths(checkpoint_dir)
    _note_rotated_away(seen_paths - set(paths), done)
    seen_paths.update(paths)
    todo = sorted((p for p in paths if checkpoint_step(p) not in done),
                  key=checkpoint_step)
    for path in todo:
      result = _evaluate_checkpoint(evaluate, run_log, path, restore,
                                    results_dir)
      done.add(checkpoint_step(path))
      if result is not None:
        results.append(result)
        last_new = time.time()
    if final_step in done:
      break
    if finished() and not todo:
      if _latest_is_done(checkpoint_dir, done):
        break
      continue
    if idle_timeout is not None and time.time() - last_new > idle_timeout:
      logging.warning("Evaluator: no new checkpoint for %.0f s; stopping.",
                      idle_timeout)
      break
    time.sleep(poll_seconds)
  return results


def _evaluate_checkpoint(evaluate: Callable[[int], dict], run_log, path: str,
                         restore: Callable[[str], None],
                         results_dir: str) -> Optional[dict]:
  """Restores and evaluates one checkpoint and appends the result to
  `eval_results.jsonl`; None when the checkpoint is gone (rotated away
  before it could be read)."""
  try:
    restore(path)
  except (tf.errors.NotFoundError, tf.errors.DataLossError) as e:
    logging.warning(
        "Evaluator: checkpoint %s was deleted (rotated away by "
        "--max_checkpoints) before it could be evaluated: %s", path,
        errors.first_line(e, default=type(e).__name__))
    return None
  result = evaluate(checkpoint_step(path))
  result.update(checkpoint=path)
  append_eval_result(results_dir, result)
  run_log.flush()
  return result


def _checkpoint_paths(checkpoint_dir: str) -> List[str]:
  """The checkpoints `checkpoint_dir`'s state file lists (oldest first)."""
  state = tf.train.get_checkpoint_state(checkpoint_dir)
  return list(state.all_model_checkpoint_paths) if state else []


def _note_rotated_away(gone: set, done: set):
  """Warns of each checkpoint in `gone` (listed once, no longer) that was
  not evaluated, and adds its step to `done`."""
  for path in sorted(gone, key=checkpoint_step):
    if checkpoint_step(path) not in done:
      logging.warning(
          "Evaluator: checkpoint %s was rotated away (--max_checkpoints)"
          " before it could be evaluated; step %d has no evaluation.",
          path, checkpoint_step(path))
      done.add(checkpoint_step(path))


def _latest_is_done(checkpoint_dir: str, done: set) -> bool:
  """There is no checkpoint, or the newest one's step is in `done`."""
  state = tf.train.get_checkpoint_state(checkpoint_dir)
  latest = state.model_checkpoint_path if state else None
  return latest is None or checkpoint_step(latest) in done
