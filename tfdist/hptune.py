"""Vertex AI hyperparameter tuning: report each evaluation's metric.

`--hptune_metric=NAME` (one of `tfdist.config.HPTUNE_METRICS`) makes the task
that evaluates report NAME's value after every evaluation through
`cloudml-hypertune` (preinstalled in Vertex AI's prebuilt training
containers; `pip install 'tfdist[vertex]'` elsewhere). The library appends
one JSON line per report to `$CLOUD_ML_HP_METRIC_FILE` (default
`/tmp/hypertune/output.metrics`), which Vertex AI reads; the tag written is
NAME itself, so the tuning job's `studySpec.metrics[].metricId` must be NAME.

Every strategy runs its evaluations in the one controller, which calls the
callbacks' `on_epoch_end` with the `val_*` values; only the chief reports
(one report per evaluation per trial; under multi_worker_mirrored every
worker takes part in the evaluation). A side-car evaluator task does not
report.
"""

from typing import Callable, Optional

from absl import logging
import keras

from tfdist.config import ConfigError, HPTUNE_METRICS

# `--hptune_metric` name -> the key the training loop's callbacks receive in
# `on_epoch_end` logs after an evaluation (Keras's `val_` convention).
LOGS_KEYS = {"eval_accuracy": "val_accuracy", "eval_loss": "val_loss",
             "eval_auc": "val_auc"}
assert set(LOGS_KEYS) == set(HPTUNE_METRICS)


def make_hypertune():
  """A `hypertune.HyperTune()` (reads `CLOUD_ML_HP_METRIC_FILE` now).

  Raises:
    ConfigError: `cloudml-hypertune` is not installed; the message names the
      flag and the package.
  """
  try:
    import hypertune  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConfigError(
        "--hptune_metric needs the package cloudml-hypertune (preinstalled "
        "in Vertex AI's prebuilt TensorFlow containers): pip install "
        "'tfdist[vertex]' or cloudml-hypertune, or drop --hptune_metric."
    ) from None
  return hypertune.HyperTune()


def check_metric(metric: str, *, task: str):
  """Checks that `metric` exists for a model of `task`.

  Args:
    metric: the `--hptune_metric` value.
    task: the data set's task (`multiclass` or `binary`).

  Raises:
    ConfigError: an unknown name, or `eval_auc` for a multiclass task.
  """
  if metric not in HPTUNE_METRICS:
    raise ConfigError(
        f"--hptune_metric={metric!r} is not an evaluation metric tfdist "
        f"reports. Use one of: {', '.join(HPTUNE_METRICS)}.")
  if metric == "eval_auc" and task != "binary":
    raise ConfigError(
        f"--hptune_metric=eval_auc: AUC is computed for binary tasks only "
        f"(e.g. --dataset=movielens); this data set's task is {task}. Use "
        "eval_accuracy or eval_loss.")


class HypertuneCallback(keras.callbacks.Callback):
  """Reports one evaluation metric to Vertex AI after each evaluation.

  The training loop calls `on_epoch_end(epoch, logs)`; when `logs` holds the
  evaluation's `val_*` values (an evaluation ran), the metric is reported
  with the current global step.

  Args:
    metric: one of `HPTUNE_METRICS` (e.g. `eval_accuracy`).
    step_fn: returns the global step (optimizer updates) at report time;
      default: the model optimizer's `iterations`.
    reporter: a `hypertune.HyperTune` (default: `make_hypertune()`).

  Attributes:
    reports: `(global_step, value)` of every report made, in order.
  """

  def __init__(self, metric: str, *, step_fn: Optional[Callable[[], int]] =
               None, reporter=None):
    super().__init__()
    if metric not in LOGS_KEYS:
      raise ConfigError(
          f"--hptune_metric={metric!r} is not an evaluation metric tfdist "
          f"reports. Use one of: {', '.join(HPTUNE_METRICS)}.")
    self.metric = metric
    self.step_fn = step_fn
    self.reporter = reporter if reporter is not None else make_hypertune()
    self.reports = []

  def _step(self) -> int:
    if self.step_fn is not None:
      return int(self.step_fn())
    return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

  def on_epoch_end(self, epoch, logs=None):
    key = LOGS_KEYS[self.metric]
    if not logs or key not in logs:
      return  # no evaluation at this epoch's end
    value, step = float(logs[key]), self._step()
    self.reporter.report_hyperparameter_tuning_metric(
        hyperparameter_metric_tag=self.metric, metric_value=value,
        global_step=step)
    self.reports.append((step, value))
    logging.info("hptune: reported %s=%.6g at step %d to %s", self.metric,
                 value, step, self.reporter.metric_path)
