"""Two kills on a MultiWorkerMirrored run lose nothing (benchmarks/chaos.py).

The short version of `benchmarks/chaos.py`: two workers of `python -m
tfdist.train` under `tfdist.launch --max_restarts` train the `cnn` with
`--deterministic` on a real Fashion-MNIST subset while a seeded schedule
sends SIGKILL and SIGTERM to the chief and the worker (both timed to a
checkpoint write); the launcher restarts the whole cluster each time. The
run must finish with status 0, every restart must resume from the newest
whole checkpoint, every listed checkpoint must be whole and hold its step,
and the final variables must equal an uninterrupted run's within
`chaos.WEIGHT_TOLERANCE`.

Cost (Bazel on 2 cores, 1 December 2026): 100 to 120 s with three kills,
five 2-worker cluster start-ups (the uninterrupted reference and the chaos
run's four attempts) of 12 steps each; the steps themselves take about a
second. Two kills (one of each signal, one on each task, both during a
save) prove the same with four start-ups: the third kill (a worker SIGTERM
at step 4) repeated the worker SIGTERM.
"""

import os

from absl.testing import absltest

from benchmarks import chaos
from tests import testutil

# Seed 39 at these sizes: chief SIGKILL at the step-6 save, worker SIGTERM
# at the step-9 save.
_OPTIONS = chaos.ChaosOptions(strategy=chaos.MWMS, kills=2, seed=39,
                              train_steps=12, checkpoint_steps=3,
                              deterministic=True, timeout_seconds=400,
                              preemption_grace_seconds=15)


class ChaosTest(absltest.TestCase):

  def test_two_kills_lose_nothing_and_weights_match(self):
    schedule = chaos.plan_kills(_OPTIONS)
    self.assertEqual({k.task for k in schedule}, {"chief:0", "worker:0"})
    self.assertEqual({k.signal for k in schedule}, {"SIGKILL", "SIGTERM"})
    self.assertEqual({k.mode for k in schedule}, {"save"})
    work = testutil.scratch_dir()
    data = chaos.prepare_data(os.path.join(work, "data"))
    reference_dir = os.path.join(work, "uninterrupted")
    reference = chaos.run_uninterrupted(_OPTIONS, data, reference_dir)
    self.assertEqual(reference["status"], 0, reference["output_tail"])
    self.assertEqual(reference["audit"]["lost"], [])
    model_dir = os.path.join(work, "chaos")
    result = chaos.compare_to_reference(
        chaos.run_mwms(_OPTIONS, data, model_dir), model_dir, reference_dir)
    summary = {k: result[k] for k in ("kills", "status", "attempts", "lost")}
    self.assertEqual(result["kills_tried"], 2, summary)
    self.assertEqual(result["survived"], 2, summary)
    self.assertEqual(result["lost"], [], summary)
    self.assertEqual(result["status"], 0, summary)
    self.assertEqual(result["attempts"], 3, summary)  # Each kill restarted.
    self.assertEqual(result["audit"]["final_step"], _OPTIONS.train_steps)
    self.assertLessEqual(result["weight_difference"], chaos.WEIGHT_TOLERANCE)
    for kill in result["kills"]:
      self.assertEqual(kill["resumed_at"], kill["newest_whole_checkpoint"],
                       kill)
      self.assertGreater(kill["resumed_at"], 0, kill)
      if kill["signal"] == "SIGTERM":
        # Every worker stopped after the same step and saved it.
        self.assertEqual(set(kill["exits"].values()), {143}, kill)
    # The comparison sees a difference where there is one: the weights of
    # 3 steps earlier.
    self.assertGreater(chaos.max_weight_difference(
        model_dir, os.path.join(reference_dir, "checkpoints", "ckpt-9")),
                       1e-4)


if __name__ == "__main__":
  absltest.main()
