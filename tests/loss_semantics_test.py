"""What a Keras loss says, tfdist does: `tfdist.fit` against `Model.fit`.

Cases (tfdist/training/step/objectives.py `loss_values`,
tfdist/training/step/train_loop.py `Trainer`):

* a loss function returning one value for the whole batch (a `lambda`, and
  a named function): the value is the batch's loss, as `fit` takes it, not
  a per-example value divided by the batch;
* `model.losses` (a kernel regularizer, `add_loss`): in the training loss
  and in the evaluation loss, as `Model.evaluate` reports it;
* a `keras.losses.Loss` with `reduction="sum"` (with and without sample
  weights), and with `reduction=None`
  (`fit` differentiates the sum of the values and reports their mean).

Each case (tests/loss_semantics_testlib.py) runs `Model.fit` then
`Model.evaluate` on one device (the reference) and `tfdist.fit` on one
device and under MirroredStrategy on 2 logical CPUs, in one child process
(this file run as a script: the logical devices must exist before
TensorFlow starts), which prints one JSON line. (Two MultiWorkerMirrored
workers: tests/loss_semantics_multi_worker_test.py.)
The same updates on the same global batches (plain SGD, no shuffling,
zero-initialized weights): weights and losses agree to float32 round-off.
"""

import json
import os
import shutil
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized

from tests import loss_semantics_testlib as lib
from tests import testutil

_CHILD_ENV = "TFDIST_LOSS_SEMANTICS_CHILD"
STRATEGIES = ("one_device", "mirrored")
_RESULTS = {}


def _child_main() -> dict:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
  root = tempfile.mkdtemp(dir=testutil.scratch_dir())
  out = {}
  try:
    for case in lib.CASES:
      out[case] = {"keras": lib.keras_fit(case)}
      for strategy in STRATEGIES:
        try:
          out[case][strategy] = lib.tfdist_fit(
              case, strategy, os.path.join(root, f"{case}-{strategy}"))
        except Exception as e:  # pylint: disable=broad-except
          out[case][strategy] = {"error": f"{type(e).__name__}: {e}"}
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return out


def _results() -> dict:
  """The child's results, run once per test process."""
  if not _RESULTS:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **{_CHILD_ENV: "1"})
    env["PYTHONPATH"] = (testutil.REPO_ROOT + os.pathsep +
                         env.get("PYTHONPATH", ""))
    import subprocess  # pylint: disable=g-import-not-at-top
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)],
                          cwd=testutil.REPO_ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600, check=False)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode or not lines:
      raise AssertionError(f"child failed ({proc.returncode}):\n"
                           f"{proc.stdout[-4000:]}")
    _RESULTS.update(json.loads(lines[-1]))
  return _RESULTS


class TfdistFitAgreesWithModelFitTest(lib.Checks, parameterized.TestCase):

  def _check(self, case: str, strategy: str):
    result = _results()[case]
    self.check_run(case, strategy, result[strategy], result["keras"])

  @parameterized.parameters(*STRATEGIES)
  def test_a_lambda_returning_one_value_per_batch(self, strategy):
    self._check("batch_valued_lambda", strategy)

  @parameterized.parameters(*STRATEGIES)
  def test_a_function_returning_one_value_per_batch(self, strategy):
    self._check("batch_valued_function", strategy)

  @parameterized.parameters(*STRATEGIES)
  def test_model_losses_in_training_and_evaluation(self, strategy):
    self._check("regularized", strategy)

  @parameterized.parameters(*STRATEGIES)
  def test_reduction_sum(self, strategy):
    self._check("sum", strategy)

  @parameterized.parameters(*STRATEGIES)
  def test_reduction_sum_with_sample_weights(self, strategy):
    self._check("sum_weighted", strategy)

  @parameterized.parameters(*STRATEGIES)
  def test_reduction_none(self, strategy):
    self._check("none", strategy)

  @parameterized.parameters(*STRATEGIES)
  def test_jit_compile_is_warned_and_changes_nothing(self, strategy):
    # regularized (JIT_COMPILED) trains as Model.fit (compiled without XLA).
    self._check("regularized", strategy)
    self.check_jit_warning(_results()["regularized"][strategy], strategy)


if __name__ == "__main__":
  if os.environ.get(_CHILD_ENV):
    print(json.dumps(_child_main()), flush=True)
  else:
    absltest.main()
