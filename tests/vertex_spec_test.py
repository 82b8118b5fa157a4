"""Tests for tfdist.cloud.vertex_spec: the CustomJob's layout and forms (without
google-cloud-aiplatform; tests/job_spec_test.py validates with it)."""

from absl.testing import absltest

from tfdist import errors
from tfdist.cloud import job_plan
from tfdist.cloud import vertex_spec

_ARGS = ("--model_dir=gs://b/run",)


class VertexCustomJobTest(absltest.TestCase):

  def test_pools_in_vertex_order(self):
    job = vertex_spec.vertex_custom_job(
        job_plan.JobPlan(num_workers=2, evaluator=True, train_args=_ARGS),
        display_name="run", package_uris=["gs://b/tfdist-1.tar.gz"],
        base_output_dir="gs://b/out")
    pools = job["jobSpec"]["workerPoolSpecs"]
    self.assertEqual([p.get("replicaCount") for p in pools], [1, 2, None, 1])
    self.assertEqual(pools[2], {})  # No ps, no Reduction Server.
    package = pools[0]["pythonPackageSpec"]
    self.assertEqual(package["pythonModule"], "tfdist.train")
    self.assertEqual(package["args"], list(_ARGS))
    self.assertEqual(package["executorImageUri"],
                     "us-docker.pkg.dev/vertex-ai/training/"
                     "tf-cpu.2-17.py310:latest")
    self.assertEqual(job["jobSpec"]["baseOutputDirectory"],
                     {"outputUriPrefix": "gs://b/out"})

  def test_reduction_server_adds_its_flag(self):
    job = vertex_spec.vertex_custom_job(
        job_plan.JobPlan(num_workers=1, reduction_server_replicas=2,
                         accelerator_type="NVIDIA_L4", accelerator_count=1,
                         train_args=_ARGS),
        display_name="run", container_image_uri="gcr.io/p/tfdist:1")
    pools = job["jobSpec"]["workerPoolSpecs"]
    self.assertLen(pools, 3)
    self.assertEqual(pools[0]["containerSpec"]["args"],
                     [*_ARGS, "--reduction_server"])
    self.assertEqual(pools[0]["machineSpec"]["acceleratorCount"], 1)
    self.assertEqual(pools[2]["replicaCount"], 2)
    self.assertNotIn("acceleratorType", pools[2]["machineSpec"])

  def test_prebuilt_image_unknown_version(self):
    with self.assertRaisesRegex(errors.JobSpecError,
                                r"--tf_version=2.99.*Known: 2.17"):
      vertex_spec.prebuilt_image("2.99", gpu=False)

  def test_forms(self):
    job = vertex_spec.vertex_custom_job(
        job_plan.JobPlan(train_args=_ARGS), display_name="run",
        package_uris=["gs://b/t.tar.gz"], base_output_dir="gs://b/out")
    self.assertIs(vertex_spec.vertex_form(job, "rest"), job)
    self.assertIs(vertex_spec.vertex_form(job, "gcloud"), job["jobSpec"])
    sdk = vertex_spec.vertex_form(job, "sdk")
    self.assertEqual(sdk["display_name"], "run")
    self.assertEqual(sdk["base_output_dir"], "gs://b/out")
    self.assertIn("python_package_spec", sdk["worker_pool_specs"][0])
    self.assertIn("executor_image_uri",
                  sdk["worker_pool_specs"][0]["python_package_spec"])
    with self.assertRaisesRegex(errors.JobSpecError, r"--form=xml"):
      vertex_spec.vertex_form(job, "xml")


if __name__ == "__main__":
  absltest.main()
