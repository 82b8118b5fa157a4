"""One short training run per strategy that runs on a CPU, through the
public entry points (`python -m tfdist.train`, `python -m tfdist.launch`).

tools/test.sh runs this file on every supported TensorFlow: in the default
environment (under Bazel) and in .venv-tf217 (TensorFlow 2.17, Python 3.10).
Each run trains the CNN for 12 steps on a real 512-example Fashion-MNIST
subset, evaluates, checkpoints and exports; clusters run on 127.0.0.1 with
ports from portpicker, under a hard timeout.
"""

import json
import os

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import pytest

from tests import multi_worker_testlib as testlib
from tests import testutil

# Also run on the oldest supported TensorFlow (see tests/conftest.py).
pytestmark = pytest.mark.compat

STEPS = 12
TIMEOUT = 300


class _RunChecks(parameterized.TestCase):
  """One run of the binary or the launcher, and what it must leave."""

  def check_run(self, launch_args, strategy_args, replicas):
    import keras  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    data = testutil.fashion_mnist_subset(limit=512, train_shards=4,
                                         test_shards=2)
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    args = [f"--train_files={data['train']}", f"--eval_files={data['eval']}",
            f"--model_dir={model_dir}", f"--train_steps={STEPS}",
            "--batch_size=64", "--log_steps=6", *strategy_args]
    if launch_args:
      status, output = testlib.run_launcher(launch_args, args, timeout=TIMEOUT)
    else:
      proc = testutil.run_module("tfdist.train", args, timeout=TIMEOUT)
      status, output = proc.returncode, proc.stdout
    self.assertEqual(status, 0, output[-4000:])

    with open(os.path.join(model_dir, "run_manifest.json")) as f:
      manifest = json.load(f)
    strategy = strategy_args[0].split("=")[1]
    self.assertEqual(manifest["strategy"], strategy)
    self.assertEqual(manifest["num_replicas_in_sync"], replicas)
    self.assertEqual(manifest["final_step"], STEPS)
    # The run used this environment's TensorFlow and Keras.
    self.assertEqual(manifest["versions"]["tensorflow"], tf.__version__)
    self.assertEqual(manifest["versions"]["keras"], keras.__version__)
    final = manifest["final_metrics"]
    self.assertTrue(np.isfinite(final["eval_loss"]), final)
    self.assertBetween(final["eval_accuracy"], 0.0, 1.0)
    self.assertTrue(os.path.exists(os.path.join(
        model_dir, "checkpoints", f"ckpt-{STEPS}.index")),
                    os.listdir(model_dir))
    # Every strategy exports (the parameter-server coordinator too).
    reloaded = tf.saved_model.load(os.path.join(model_dir, "saved_model"))
    served = reloaded.signatures["serving_default"](
        tf.zeros([2, 28, 28, 1], tf.float32))
    self.assertEqual(list(served.values())[0].shape, (2, 10))


if __name__ == "__main__":
  absltest.main()


class StrategyRunsTest(_RunChecks):
  """The strategies of one process."""

  @parameterized.named_parameters(
      ("one_device", [], ["--distribution_strategy=one_device"], 1),
      ("mirrored_on_two_logical_cpus", [],
       ["--distribution_strategy=mirrored", "--num_cpu_devices=2"], 2),
  )
  def test_trains_evaluates_and_checkpoints(self, launch_args, strategy_args,
                                            replicas):
    self.check_run(launch_args, strategy_args, replicas)


@pytest.mark.cluster
class ClusterRunsTest(_RunChecks):
  """The strategies of several processes, through tfdist.launch."""

  @parameterized.named_parameters(
      ("multi_worker_mirrored_two_workers", ["--num_workers=2"],
       ["--distribution_strategy=multi_worker_mirrored"], 2),
      # The worker pinned to a core of its own: with one inter-op thread it
      # would never finish a closure (tfdist.launch.PS_WORKER_INTER_OP_THREADS).
      ("parameter_server_one_worker_one_ps",
       ["--num_workers=1", "--num_ps=1", "--pin_workers"],
       ["--distribution_strategy=parameter_server"], 1),
  )
  def test_trains_evaluates_and_checkpoints(self, launch_args, strategy_args,
                                            replicas):
    self.check_run(launch_args, strategy_args, replicas)
