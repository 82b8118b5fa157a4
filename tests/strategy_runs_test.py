"""One short training run per strategy that runs on a CPU, through the
public entry points (`python -m tfdist.train`, `python -m tfdist.launch`).

tools/test.sh runs this file on every supported TensorFlow: in the default
environment (under Bazel) and in .venv-tf217 (TensorFlow 2.17, Python 3.10).
Each run trains the CNN for 12 steps on a real 512-example Fashion-MNIST
subset, evaluates, checkpoints and exports; clusters run on 127.0.0.1 with
ports from portpicker, under a hard timeout. The Mirrored run also shows the
binary's batch split and learning-rate lines, and that it ends without
Python's teardown after a finished run.
"""

import glob
import json
import os
import subprocess
import sys

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

  def check_run(self, launch_args, strategy_args, replicas, env=None):
    """Runs, checks what every run leaves; returns (manifest, output)."""
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
      proc = testutil.run_module("tfdist.train", args, timeout=TIMEOUT,
                                 env=env)
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
    self.assertTrue(glob.glob(os.path.join(model_dir, "train",
                                           "events.out.tfevents.*")))
    # Every strategy exports (the parameter-server coordinator too).
    reloaded = tf.saved_model.load(os.path.join(model_dir, "saved_model"))
    served = reloaded.signatures["serving_default"](
        tf.zeros([2, 28, 28, 1], tf.float32))
    self.assertEqual(list(served.values())[0].shape, (2, 10))
    return manifest, output


if __name__ == "__main__":
  absltest.main()


class StrategyRunsTest(_RunChecks):
  """The strategies of one process."""

  def test_trains_evaluates_and_checkpoints_one_device(self):
    self.check_run([], ["--distribution_strategy=one_device"], 1)

  def test_trains_evaluates_and_checkpoints_mirrored_on_two_logical_cpus(
      self):
    # After a finished run the binary ends without Python's teardown, which
    # took 7 to 45 s after a Mirrored run on this busy machine (long enough
    # for tfdist.launch to stop a task that had written its done marker and
    # count the run failed): an atexit hook that every Python process here
    # registers (sitecustomize) must not run.
    hook = testutil.scratch_dir()
    marker = os.path.join(hook, "teardown_ran")
    with open(os.path.join(hook, "sitecustomize.py"), "w") as f:
      f.write("import atexit\n"
              f"atexit.register(lambda: open({marker!r}, 'w').close())\n")
    env = {"PYTHONPATH": os.pathsep.join([hook, testutil.REPO_ROOT])}
    control = subprocess.run([sys.executable, "-c", "pass"], env=env,
                             timeout=60, check=True)
    self.assertEqual(control.returncode, 0)
    self.assertTrue(os.path.exists(marker), "the atexit hook did not load")
    os.remove(marker)
    manifest, output = self.check_run(
        [], ["--distribution_strategy=mirrored", "--num_cpu_devices=2"], 2,
        env=env)
    self.assertFalse(os.path.exists(marker),
                     "the binary ran Python's teardown after a finished run")
    self.assertEqual(manifest["per_replica_batch_size"], 32)
    self.assertEqual(manifest["global_batch_size"], 64)
    self.assertLen(manifest["replica_devices"], 2)
    self.assertEqual(manifest["final_metrics"]["eval_examples"], 512)
    self.assertIn("num_replicas_in_sync   2", output)
    self.assertIn("0.1 at batch 256 -> 0.025 at batch 64 (linear rule)",
                  output)


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
