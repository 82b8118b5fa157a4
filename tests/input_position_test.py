"""A run stopped mid-epoch and resumed sees the same examples, on two
MultiWorkerMirrored workers through `tfdist.launch`.

Run A trains 8 steps uninterrupted (checkpoints at 3 and 6, 5 steps per
epoch, `--deterministic`, 2-step accumulation); run B resumes from A's
step-3 checkpoint (mid-epoch) in another folder and trains to 8. The
example ids each worker's training used (recorded by
`tests.input_position_testlib`) equal A's from step 4 on, and B ends with
A's weights. A dataset function that takes `input_context` (it shards
itself) under ZeRO stage 3 (`--dataset=tests.resume_forms_testlib:
make_dataset_ctx`): A on 2 workers, B resumed from A's step-3 checkpoint
on 2 workers and C on 1 (`tfdist.launch --num_workers=1`), each within
1e-6 of A's weights and optimizer slots (before: B read the function from
the start, and C discarded the position, "the worker count changed from 2
to 1", and started the epoch over; now C replays the 2 workers' order).
The pipeline itself and the one-device and Mirrored runs are
`tests/input_position_one_process_test.py` (one process at a time, outside
the cluster lane).

Cost (pytest on 2 cores, load 3-5, 4 December 2026): 15 s (two launcher
runs); with the dataset function's two more, 2 min 44 s wall at load 10-11
(6 December 2026); its three runs under ZeRO stage 3 (the third one
process), 2 min 40 s wall at load 4-10, 60 s of CPU (6 December 2026).
"""

import os

from absl.testing import absltest

from tests import input_position_testlib as ids_lib
from tests import multi_worker_testlib
from tests import resume_forms_testlib as forms_lib
from tests import testutil


def _train_flags(data, model_dir, ids_file, steps):
  # --mode=train: no final evaluation (nothing here reads it; it cost each
  # run an evaluation step's trace in both tasks).
  return [f"--train_files={data['train']}", "--mode=train",
          f"--model_dir={model_dir}", f"--train_steps={steps}",
          f"--batch_size={ids_lib.BATCH}",
          f"--checkpoint_steps={ids_lib.STOP}", "--max_checkpoints=10",
          "--deterministic", "--log_steps=4", "--warmup_steps=0",
          "--shuffle_buffer_size=64", f"--model={ids_lib.MODEL}",
          f"--ids_file={ids_file}"]


class ResumedRunsTest(absltest.TestCase):
  """Runs A (uninterrupted) and B (resumed from A's step-3 checkpoint)."""

  def test_multi_worker_mirrored(self):
    data = testutil.fashion_mnist_subset(limit=ids_lib.LIMIT,
                                         train_shards=2, test_shards=1)
    out = testutil.scratch_dir()
    ids, dirs = {}, {}
    for run, steps in (("a", ids_lib.STEPS), ("b", ids_lib.STEPS)):
      dirs[run] = os.path.join(out, run)
      if run == "b":
        ids_lib.copy_checkpoint(dirs["a"], dirs["b"], ids_lib.STOP)
      status, output = multi_worker_testlib.run_launcher(
          ["--num_workers=2", "--module=tests.input_position_testlib"],
          ["--distribution_strategy=multi_worker_mirrored",
           "--gradient_accumulation_steps=2",
           *_train_flags(data, dirs[run], os.path.join(out, f"ids-{run}"),
                         steps)], timeout=ids_lib.TIMEOUT_S)
      self.assertEqual(status, 0, output[-4000:])
      ids[run] = {task: os.path.join(out, f"ids-{run}.{task}")
                  for task in ("chief-0", "worker-0")}
    self.assertIn("input position restored: step 3 continues epoch 1",
                  output)
    self.assertIn("after 48 of this worker's 80 examples", output)
    ids_lib.compare_runs(self, ids["a"], ids["b"],
                         ids_lib.max_weight_difference(dirs["a"], dirs["b"]),
                         2, "multi_worker_mirrored")

  def test_dataset_function_and_zero3_across_worker_counts(self):
    # `--dataset=module:function` taking input_context (it shards itself;
    # before: no position, "reading its examples from the start"), under
    # ZeRO stage 3: A on 2 workers, B resumed from A's step-3 checkpoint on
    # 2 and C on 1 (before: "input position discarded: the worker count
    # (input pipelines) changed from 2 to 1", the epoch started over).
    out = testutil.scratch_dir()
    dirs = {run: os.path.join(out, run) for run in ("a", "b", "c")}
    outputs = {}
    for run, workers in (("a", 2), ("b", 2), ("c", 1)):
      if run != "a":
        ids_lib.copy_checkpoint(dirs["a"], dirs[run], ids_lib.STOP)
      status, outputs[run] = multi_worker_testlib.run_launcher(
          [f"--num_workers={workers}", "--module=tfdist.train"],
          ["--distribution_strategy=multi_worker_mirrored", "--zero_stage=3",
           "--dataset=tests.resume_forms_testlib:make_dataset_ctx",
           "--model=tests.resume_forms_testlib:build_model",
           f"--model_dir={dirs[run]}", f"--train_steps={ids_lib.STEPS}",
           f"--batch_size={ids_lib.BATCH}",
           f"--checkpoint_steps={ids_lib.STOP}", "--max_checkpoints=10",
           "--deterministic", "--warmup_steps=0", "--mode=train",
           "--shuffle_buffer_size=64"], timeout=ids_lib.TIMEOUT_S)
      self.assertEqual(status, 0, outputs[run][-4000:])
    for run in ("b", "c"):
      with self.subTest(run):
        self.assertIn("input position restored: step 3 continues epoch 1",
                      outputs[run])
        self.assertLessEqual(
            forms_lib.max_difference(dirs["a"], dirs[run]), 1e-6)
    self.assertIn("pass 1 over this worker's 80 examples of the dataset "
                  "function, after 48 of them", outputs["b"])
    self.assertIn("the worker count changed from 2 to 1: the input replays "
                  "the checkpoint's 2 workers' order", outputs["c"])
    self.assertGreater(forms_lib.max_difference(
        dirs["a"], os.path.join(dirs["a"], "checkpoints",
                                f"ckpt-{ids_lib.STOP}")), 1e-3)

if __name__ == "__main__":
  absltest.main()
