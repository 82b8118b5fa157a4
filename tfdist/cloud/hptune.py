"""Vertex AI hyperparameter tuning: report each evaluation's metric.

`--hptune_metric=eval_NAME` makes the chief report the value NAME of every
evaluation through `cloudml-hypertune` (preinstalled in Vertex AI's
prebuilt training containers; `pip install 'tfdist[vertex]'` elsewhere).
NAME is `loss` or the name of any metric of the model (tfdist's built-in
models: `accuracy`, and `auc` for binary tasks; a model compiled with
`metrics=[keras.metrics.F1Score(name="f1")]` or a `Task(metrics=...)`:
`f1`): the keys of the run's `eval_history`. `check_metric` checks NAME
against the built model before training. The library appends one JSON line
per report to `$CLOUD_ML_HP_METRIC_FILE` (default
`/tmp/hypertune/output.metrics`), which Vertex AI reads; the tag written is
`eval_NAME` itself, so the tuning job's `studySpec.metrics[].metricId` must
be `eval_NAME`.

Every strategy runs its evaluations in the one controller, which calls the
callbacks' `on_epoch_end` with the `val_*` values; only the chief reports
(one report per evaluation per trial; under multi_worker_mirrored every
worker takes part in the evaluation). A side-car evaluator task does not
report.
"""

from typing import Callable, Iterable, Optional

from absl import logging
import keras

from tfdist import errors

PREFIX = "eval_"


def logs_key(metric: str) -> str:
  """The key of `metric` (`eval_NAME`) in the `on_epoch_end` logs after an
  evaluation: `val_NAME` (Keras's `val_` convention)."""
  return "val_" + metric[len(PREFIX):]


def make_hypertune():
  """A `hypertune.HyperTune()` (reads `CLOUD_ML_HP_METRIC_FILE` now).

  Raises:
    ConfigError: `cloudml-hypertune` is not installed; the message names the
      flag and the package.
  """
  try:
    # Optional (cloudml-hypertune, the vertex extra): imported on first use.
    import hypertune  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise errors.ConfigError(
        "--hptune_metric needs the package cloudml-hypertune (preinstalled "
        "in Vertex AI's prebuilt TensorFlow containers): pip install "
        "'tfdist[vertex]' or cloudml-hypertune, or drop --hptune_metric."
    ) from None
  return hypertune.HyperTune()


def check_metric(metric: str, *, available: Iterable[str]):
  """Checks that the evaluation reports `metric`.

  Args:
    metric: the `--hptune_metric` value, `eval_NAME`.
    available: the names an evaluation of the built model reports (`loss`
      and its metrics' names, the keys of `eval_history`).

  Raises:
    ConfigError: NAME is not among `available`; the message lists them.
  """
  names = [PREFIX + n for n in available]
  if metric not in names:
    raise errors.ConfigError(
        f"--hptune_metric={metric}: this model's evaluation reports "
        f"{', '.join(names)}. Use one of them (eval_ and the name of the "
        "model's loss or metric).")


class HypertuneCallback(keras.callbacks.Callback):
  """Reports one evaluation metric to Vertex AI after each evaluation.

  The training loop calls `on_epoch_end(epoch, logs)`; when `logs` holds the
  evaluation's `val_*` values (an evaluation ran), the metric is reported
  with the current global step.

  Args:
    metric: `eval_NAME` (e.g. `eval_accuracy`), checked by `check_metric`.
    step_fn: returns the global step (optimizer updates) at report time;
      default: the model optimizer's `iterations`.
    reporter: a `hypertune.HyperTune` (default: `make_hypertune()`).

  Attributes:
    reports: `(global_step, value)` of every report made, in order.
  """

  def __init__(self, metric: str, *, step_fn: Optional[Callable[[], int]] =
               None, reporter=None):
    super().__init__()
    if not metric.startswith(PREFIX):
      raise errors.ConfigError(
          f"--hptune_metric={metric!r} must be eval_ and a "
          "metric's name, e.g. eval_accuracy.")
    self.metric = metric
    self.step_fn = step_fn
    self.reporter = reporter if reporter is not None else make_hypertune()
    self.reports = []

  def _step(self) -> int:
    if self.step_fn is not None:
      return int(self.step_fn())
    return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

  def on_epoch_end(self, epoch, logs=None):
    key = logs_key(self.metric)
    if not logs or key not in logs:
      return  # no evaluation at this epoch's end
    value, step = float(logs[key]), self._step()
    self.reporter.report_hyperparameter_tuning_metric(
        hyperparameter_metric_tag=self.metric, metric_value=value,
        global_step=step)
    self.reports.append((step, value))
    logging.info("hptune: reported %s=%.6g at step %d to %s", self.metric,
                 value, step, self.reporter.metric_path)
