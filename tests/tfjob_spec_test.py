"""Tests for tfdist.cloud.tfjob_spec: the TFJob's replicas and pod options
(without the Kubeflow SDK; tests/job_spec_test.py validates with it)."""

from absl.testing import absltest

from tfdist import errors
from tfdist.cloud import job_plan
from tfdist.cloud import tfjob_spec

_ARGS = ("--model_dir=gs://b/run",)


class KubernetesTfJobTest(absltest.TestCase):

  def test_replicas_and_restart_policy(self):
    job = tfjob_spec.kubernetes_tfjob(
        job_plan.JobPlan(num_workers=2, num_ps=1, evaluator=True,
                         train_args=_ARGS),
        name="run", image="gcr.io/p/tfdist:1")
    specs = job["spec"]["tfReplicaSpecs"]
    self.assertEqual(sorted(specs), ["Chief", "Evaluator", "PS", "Worker"])
    self.assertEqual({k: v["replicas"] for k, v in specs.items()},
                     {"Chief": 1, "Evaluator": 1, "PS": 1, "Worker": 2})
    for spec in specs.values():
      self.assertEqual(spec["restartPolicy"], "ExitCode")
      container, = spec["template"]["spec"]["containers"]
      self.assertEqual(container["name"], tfjob_spec.TFJOB_CONTAINER)
      self.assertEqual(container["command"][-2:], ["-m", "tfdist.train"])

  def test_pod_options_from_flags(self):
    pods = tfjob_spec.pod_options(cpu="4", memory="16Gi", ps_cpu="1",
                                  env=["A=1"], node_selector=["pool=gpu"],
                                  service_account="trainer")
    self.assertEqual(pods.values["resources"]["limits"],
                     {"cpu": "4", "memory": "16Gi"})
    self.assertEqual(pods.values["env"], [{"name": "A", "value": "1"}])
    self.assertEqual(pods.values["nodeSelector"], {"pool": "gpu"})
    self.assertEqual(pods.values["serviceAccountName"], "trainer")
    self.assertEqual(pods.for_replica("PS")["resources"]["limits"]["cpu"],
                     "1")
    with self.assertRaisesRegex(errors.JobSpecError, r"--env"):
      tfjob_spec.pod_options(env=["NO_VALUE"])


if __name__ == "__main__":
  absltest.main()
