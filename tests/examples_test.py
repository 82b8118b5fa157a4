"""The example projects in examples/ under two workers (`tfdist.launch`).

Each project (tests/examples_testlib.py) is copied to a scratch folder and
run from there with plain `python`, as a new user runs it, as a 2-worker
MultiWorkerMirrored job; one process then evaluates what the job left and
must get the metrics the two workers' summed metric states gave:

* `examples/tagging`: its own TFRecords through `--feature_spec`, its own
  `models/` package (`--model=models.tagger:build_tagger`) and `flags.py`,
  from the command line; `--mode=eval` on the job's last checkpoint;
* `examples/movielens_rating`: its own Keras model and dataset function
  through `tfdist.fit`, on MovieLens-100k from the recbole package, started
  with `tfdist.launch --module`; `--mode=continuous_eval` on every
  checkpoint.

The one-process runs of both projects (one device, Mirrored, a resume, the
SavedModel, parameter-server placement) are tests/examples_one_process_test.py.

Cost (Bazel on 2 cores): two launcher runs of two workers and two
one-process evaluations, nearly all process start-up and graph building.
"""

import glob
import json
import os

from absl.testing import absltest

from tests import examples_testlib
from tests import testutil


class TaggingProjectTest(examples_testlib.TaggingProject):

  def test_multi_worker_then_eval(self):
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    self.train(model_dir, "--distribution_strategy=multi_worker_mirrored",
               "--train_steps=16",
               launcher=["-m", "tfdist.launch", "--num_workers=2",
                         "--output=all", "--"])
    manifest = self.manifest(model_dir)
    self.check_manifest(manifest, strategy="multi_worker_mirrored",
                        replicas=2, final_step=16)
    self.assertEqual(manifest["num_workers"], 2)
    # One process evaluating the job's last checkpoint gets what the two
    # workers' summed metric states gave.
    proc = self.train(model_dir, "--mode=eval")
    self.assertIn("Eval of ", proc.stdout)
    results_path = os.path.join(model_dir, "eval", "eval_results.jsonl")
    with open(results_path) as f:
      once = [json.loads(line) for line in f]
    self.assertEqual([r["step"] for r in once], [16])
    final = manifest["final_metrics"]
    self.assert_same_metrics(
        {"loss": final["eval_loss"], "auc": final["eval_auc"],
         "accuracy": final["eval_accuracy"]}, once[0],
        ["loss", "auc", "accuracy"])
    self.assertTrue(glob.glob(os.path.join(model_dir, "eval",
                                           "events.out.tfevents.*")))


class RatingProjectTest(examples_testlib.RatingProject):

  def test_multi_worker_through_launch_module_then_continuous_eval(self):
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    self.train(model_dir, "--distribution_strategy=multi_worker_mirrored",
               "--train_steps=20", "--checkpoint_steps=10", module=True)
    manifest = self.manifest(model_dir)
    self.check_manifest(manifest, strategy="multi_worker_mirrored",
                        replicas=2, final_step=20)
    self.assertEqual(manifest["num_workers"], 2)
    # The side-car evaluator, after the job: every checkpoint once, in step
    # order, until the final step's; one process gets what the two workers'
    # summed metric states gave.
    self.train(model_dir, "--mode=continuous_eval", "--train_steps=20")
    with open(os.path.join(model_dir, "eval", "eval_results.jsonl")) as f:
      results = [json.loads(line) for line in f]
    self.assertEqual([r["step"] for r in results], [10, 20])
    final = manifest["final_metrics"]
    self.assert_same_metrics(
        {"loss": final["eval_loss"], "rmse": final["eval_rmse"],
         "mae": final["eval_mae"]}, results[1], ["loss", "rmse", "mae"])


if __name__ == "__main__":
  absltest.main()
