"""Expert parallelism across two MultiWorkerMirrored workers
(`--expert_parallel=2`, tfdist/parallel/experts/mode.py), against one
device.

`tfdist.launch` runs 2 workers (a chief and worker 0, one CPU device each,
ports from the launcher on 127.0.0.1) of this module's program: each
builds the expert-parallel model of tests/experts_testlib.py with
`expert_mode.build` under the run's MultiWorkerMirroredStrategy (E_p = 2:
each worker holds 2 of each layer's 4 experts; the tokens cross the
processes by all-to-all), trains it K = 3 updates with Adam in tfdist's
Trainer, and in the same process trains the one-device model (the default
strategy, each worker's batch one routing group) from the same initial
weights. Both workers' gathered views (each expert read from the worker
holding it, a collective) give the one-device losses, weights and Adam
slots within 1e-5. Both save the checkpoint (each its own folder, as
every worker saves); the chief restores it into a fresh one-device model
and optimizer, equal to the one-device run's.

Run as a module this file is a worker's program: `worker OUT_DIR [E_P]`.
"""

import json
import os

from absl.testing import absltest

from tests import multi_worker_testlib
from tests import testutil

EXPERT_PARALLEL = 2
# The launcher and both workers (TensorFlow's start, the cluster, the
# runs); measured about 30 s on the 2-core test machine.
LAUNCH_TIMEOUT = 240


def _max_diff(got, want) -> float:
  import numpy as np  # pylint: disable=g-import-not-at-top
  return max((float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(got, want)), default=0.0)


def _run(strategy, task: str, out_dir: str, expert_parallel: int) -> dict:
  """Both runs on this worker, its checks, and (chief) the restore."""
  # pylint: disable=g-import-not-at-top
  import numpy as np
  import tensorflow as tf
  from tests import experts_testlib as lib
  from tfdist.parallel.experts import layer as moe_layer
  from tfdist.parallel.experts import mode as expert_mode
  # pylint: enable=g-import-not-at-top
  step = expert_mode.build(lib.model, strategy, expert_parallel)
  initial = [np.asarray(w) for w in step.unsharded.get_weights()]
  initial_trainable = [np.asarray(w) for w in step.unsharded.trainable_weights]
  trainer, losses = lib.train(strategy, step.model, "adam", step)
  one = lib.model(lib.replica_tokens(step.placement.num_replicas))
  one.set_weights(initial)
  one_trainer, one_losses = lib.train(tf.distribute.get_strategy(), one,
                                      "adam")
  narrow = step.model.get_layer("narrow")
  gathered = step.gathered_model()
  statistics = moe_layer.model_statistics(one)
  result = {
      "replicas": step.placement.num_replicas,
      "devices": list(step.placement.devices),
      "local_experts": len(narrow.experts),
      "local_components": len(
          expert_mode._components(narrow.experts[0].weights[0])),  # pylint: disable=protected-access
      "losses": losses, "one_losses": one_losses,
      "weights_diff": _max_diff(gathered.get_weights(), one.get_weights()),
      "statistics_diff": _max_diff(
          [moe_layer.model_statistics(gathered)[k] for k in statistics],
          statistics.values()),
      "dropped": float(statistics["narrow/dropped_fraction"]),
      "moved": _max_diff(one.trainable_weights, initial_trainable)}
  view = step.checkpoint_optimizer(trainer)
  result["optimizer_diff"] = _max_diff(
      [v._tfdist_read() for v in view.variables],  # pylint: disable=protected-access
      [v.numpy() for v in one_trainer.optimizer.variables])
  # Every worker saves (the reads are collectives); the chief's folder is
  # the run's.
  path = tf.train.Checkpoint(model=step.checkpoint_model(),
                             optimizer=view).save(
                                 os.path.join(out_dir, task, "ep"))
  if task == "chief0":
    fresh, fresh_optimizer = (
        lib.model(lib.replica_tokens(step.placement.num_replicas)),
                              lib.optimizer("adam"))
    fresh_optimizer.build(fresh.trainable_variables)
    tf.train.Checkpoint(model=fresh, optimizer=fresh_optimizer).restore(
        path).assert_consumed()
    result["restored_diff"] = _max_diff(fresh.get_weights(),
                                        one.get_weights())
    result["restored_optimizer_diff"] = _max_diff(
        [v.numpy() for v in fresh_optimizer.variables],
        [v.numpy() for v in one_trainer.optimizer.variables])
  return result


def worker_main(out_dir: str, expert_parallel: int = EXPERT_PARALLEL):
  """One MultiWorkerMirrored worker: writes `experts-<task>.json`.
  (`expert_parallel` other than 2, with another `--num_workers`: by hand,
  e.g. 4 workers at E_p = 4 and 2, docs/guides/experts.md.)"""
  strategy = multi_worker_testlib._strategy(out_dir)  # pylint: disable=protected-access
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.experimental.enable_op_determinism()
  task = multi_worker_testlib._task_name()  # pylint: disable=protected-access
  result = _run(strategy, task, out_dir, expert_parallel)
  with open(os.path.join(out_dir, f"experts-{task}.json"), "w") as f:
    json.dump(result, f)
  print(f"experts: {task} done", flush=True)


class ExpertsAcrossWorkersTest(absltest.TestCase):

  def test_two_workers_equal_one_device_and_restore_on_one(self):
    results = multi_worker_testlib.run_for_results(
        self, "tests.experts_workers_test", ["worker", testutil.scratch_dir()],
        "experts", timeout=LAUNCH_TIMEOUT)
    for task, got in results.items():
      with self.subTest(task=task):
        self.assertEqual(got["replicas"], 2)
        self.assertEqual([d.split("/")[1:4:2] for d in got["devices"]],
                         [["job:chief", "task:0"], ["job:worker", "task:0"]])
        # This worker holds 2 of the 4 experts, one replica's copy.
        self.assertEqual(got["local_experts"], 2)
        self.assertEqual(got["local_components"], 1)
        for a, b in zip(got["losses"], got["one_losses"]):
          self.assertAlmostEqual(a, b, delta=1e-5 * max(1.0, abs(b)))
        self.assertLess(got["weights_diff"], 1e-5)
        self.assertLess(got["optimizer_diff"], 1e-5)
        self.assertLess(got["statistics_diff"], 1e-5)
        # The narrow layer dropped tokens; training moved the weights.
        self.assertGreater(got["dropped"], 0.0)
        self.assertGreater(got["moved"], 1e-3)
    self.assertLess(results["chief0"]["restored_diff"], 1e-5)
    self.assertLess(results["chief0"]["restored_optimizer_diff"], 1e-5)


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top
  if len(sys.argv) in (3, 4) and sys.argv[1] == "worker":
    worker_main(sys.argv[2], *map(int, sys.argv[3:]))
  else:
    absltest.main()
