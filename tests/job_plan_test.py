"""Tests for tfdist.cloud.job_plan: a job's shape and its replicas' train flags."""

from absl.testing import absltest
from absl.testing import parameterized

from tfdist import errors
from tfdist.cloud import job_plan
from tfdist.config import TrainConfig
from tfdist.core.strategy_kind import StrategyKind

JobPlan = job_plan.JobPlan


class JobPlanTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("one_machine", {}, StrategyKind.ONE_DEVICE),
      ("workers", {"num_workers": 3}, StrategyKind.MULTI_WORKER_MIRRORED),
      ("ps", {"num_workers": 2, "num_ps": 1}, StrategyKind.PARAMETER_SERVER))
  def test_strategy_auto_picks(self, fields, kind):
    strategy = JobPlan(**fields).strategy
    self.assertIs(strategy, kind)
    self.assertEqual(strategy, kind.value)  # Still equal to the flag value.

  @parameterized.named_parameters(
      ("negative_workers", {"num_workers": -1}, r"--worker_replicas=-1 must be"),
      ("ps_and_reduction", {"num_workers": 1, "num_ps": 1,
                            "reduction_server_replicas": 1,
                            "accelerator_type": "T4",
                            "accelerator_count": 1}, r"either"),
      ("ps_without_workers", {"num_ps": 1}, r"needs --worker_replicas >= 1"),
      ("accelerator_half", {"accelerator_type": "T4"}, r"given together"),
      ("positional", {"train_args": ("model_dir=x",)}, r"is not a flag"))
  def test_bad_plans(self, fields, pattern):
    with self.assertRaisesRegex(errors.JobSpecError, pattern):
      JobPlan(**fields)

  def test_parse_accelerator(self):
    self.assertEqual(job_plan.parse_accelerator(""), ("", 0))
    self.assertEqual(job_plan.parse_accelerator("nvidia_l4"),
                     ("NVIDIA_L4", 1))
    self.assertEqual(job_plan.parse_accelerator("NVIDIA_TESLA_T4:2"),
                     ("NVIDIA_TESLA_T4", 2))
    with self.assertRaisesRegex(errors.JobSpecError, r"positive integer"):
      job_plan.parse_accelerator("NVIDIA_TESLA_T4:0")

  def test_need(self):
    job_plan.need(True, "unused")
    with self.assertRaisesRegex(errors.JobSpecError, "^the rule$"):
      job_plan.need(0, "the rule")


class CheckTrainConfigTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("mirrored_on_workers", "mirrored", {"num_workers": 2},
       r"mirrored runs on one machine; this job has 3 training replicas"),
      ("mwms_on_ps", "multi_worker_mirrored",
       {"num_workers": 1, "num_ps": 1}, r"multi_worker_mirrored cannot run a "
       r"cluster with 1 "
       r"parameter server"),
      ("ps_without_ps", "parameter_server", {"num_workers": 1},
       r"parameter_server needs --num_ps >= 1"))
  def test_strategy_against_the_job(self, strategy, fields, pattern):
    config = TrainConfig(model_dir="gs://b/run",
                         distribution_strategy=strategy)
    with self.assertRaisesRegex(errors.JobSpecError,
                                r"^pool 1: --distribution_strategy=" + pattern):
      job_plan.check_train_config(config, JobPlan(**fields), where="pool 1")

  @parameterized.parameters(
      ("auto", {"num_workers": 2}),
      ("multi_worker_mirrored", {"num_workers": 2}),
      ("parameter_server", {"num_workers": 2, "num_ps": 1}),
      ("mirrored", {}))
  def test_fitting_strategies_pass(self, strategy, fields):
    config = TrainConfig(model_dir="gs://b/run",
                         distribution_strategy=strategy)
    job_plan.check_train_config(config, JobPlan(**fields), where="pool 0")

  def test_local_model_dir_on_a_cluster(self):
    config = TrainConfig(model_dir="/tmp/run")
    with self.assertRaisesRegex(errors.JobSpecError,
                                r"own disk.*workers resume"):
      job_plan.check_train_config(config, JobPlan(num_workers=1),
                                  where="pool 0")
    job_plan.check_train_config(config, JobPlan(num_workers=1),
                                where="pool 0", shared_prefixes=("/tmp/",))


if __name__ == "__main__":
  absltest.main()
