"""Tests for tfdist.distribute.cluster: sources, precedence, aliases and errors."""

import json

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from tfdist import errors
from tfdist.distribute import cluster as cluster_lib

# Also run on the oldest supported TensorFlow (see tests/conftest.py).
pytestmark = pytest.mark.compat


def _tf_config(cluster, task_type="worker", index=0, **extra):
  return json.dumps({"cluster": cluster,
                     "task": {"type": task_type, "index": index}, **extra})


class FromFlagsTest(absltest.TestCase):

  def test_worker_hosts(self):
    info = cluster_lib.resolve_cluster(
        worker_hosts="10.0.0.1:2222,10.0.0.2:2222", task_index=1, environ={})
    self.assertEqual(info.task_type, "worker")
    self.assertEqual(info.task_index, 1)
    self.assertEqual(info.num_workers, 2)
    self.assertFalse(info.is_chief)
    self.assertEqual(info.source, "flags")
    self.assertEqual(info.address, "10.0.0.2:2222")
    self.assertEqual(info.to_tf_config(), {
        "cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]},
        "task": {"type": "worker", "index": 1}})

  def test_worker_zero_is_chief_without_chief_job(self):
    info = cluster_lib.from_flags("a:1,b:2", 0)
    self.assertTrue(info.is_chief)
    self.assertEqual(info.worker_id, 0)

  def test_index_out_of_range_names_flag(self):
    with self.assertRaisesRegex(errors.ClusterConfigError,
                                r"--task_index=2 is out of range.*0\.\.1"):
      cluster_lib.from_flags("a:1,b:2", 2)

  def test_missing_task_index(self):
    with self.assertRaisesRegex(errors.ClusterConfigError, "set --task_index"):
      cluster_lib.from_flags("a:1,b:2", -1)

  def test_task_index_without_hosts(self):
    with self.assertRaisesRegex(
        errors.ClusterConfigError, "needs --worker_hosts"):
      cluster_lib.resolve_cluster(task_index=1, environ={})

  def test_missing_port_names_flag(self):
    with self.assertRaisesRegex(errors.ClusterConfigError,
                                r"--worker_hosts.*'a' has no port"):
      cluster_lib.from_flags("a,b:2", 0)

  def test_duplicate_address(self):
    with self.assertRaisesRegex(errors.ClusterConfigError, "a:1 is used twice"):
      cluster_lib.from_flags("a:1,a:1", 0)


class FromTfConfigTest(parameterized.TestCase):

  def test_chief_and_workers(self):
    info = cluster_lib.from_tf_config(_tf_config(
        {"chief": ["c:1"], "worker": ["w:1", "w:2"]}, "worker", 1,
        environment="cloud"))
    self.assertEqual((info.task_type, info.task_index), ("worker", 1))
    self.assertEqual(info.num_workers, 3)
    self.assertFalse(info.is_chief)
    self.assertEqual(info.worker_id, 2)
    self.assertEqual(info.environment, "cloud")
    self.assertTrue(info.is_multi_worker)

  def test_master_is_chief(self):
    info = cluster_lib.from_tf_config(_tf_config(
        {"master": ["m:1"], "worker": ["w:1"]}, "master", 0))
    self.assertEqual(info.task_type, "chief")
    self.assertTrue(info.is_chief)
    self.assertEqual(dict(info.cluster), {"chief": ("m:1",),
                                          "worker": ("w:1",)})

  def test_evaluator_is_not_a_member(self):
    info = cluster_lib.from_tf_config(_tf_config(
        {"chief": ["c:1"], "worker": ["w:1"]}, "evaluator", 0))
    self.assertEqual(info.task_type, "evaluator")
    self.assertFalse(info.is_chief)
    self.assertIsNone(info.address)
    self.assertEqual(info.worker_id, -1)

  def test_ps(self):
    info = cluster_lib.from_tf_config(_tf_config(
        {"chief": ["c:1"], "worker": ["w:1"], "ps": ["p:1", "p:2"]}, "ps", 1))
    self.assertEqual(info.num_ps, 2)
    self.assertEqual(info.num_workers, 2)

  def test_cluster_is_frozen(self):
    info = cluster_lib.from_tf_config(_tf_config({"worker": ["a:1", "b:1"]}))
    with self.assertRaises(TypeError):
      info.cluster["worker"] = ("x:1",)
    with self.assertRaises(Exception):
      info.task_index = 3

  @parameterized.named_parameters(
      ("bad_json", "{cluster: ", r"TF_CONFIG is not valid JSON"),
      ("not_object", "[1, 2]", r"TF_CONFIG must be a JSON object"),
      ("unknown_task_type",
       _tf_config({"worker": ["a:1", "b:1"]}, "boss", 0),
       r"TF_CONFIG: unknown task type 'boss'"),
      ("unknown_job", _tf_config({"workers": ["a:1"]}),
       r"TF_CONFIG: unknown job 'workers'"),
      ("evaluator_in_cluster",
       _tf_config({"worker": ["a:1"], "evaluator": ["e:1"]}),
       r"the evaluator is not listed"),
      ("index_out_of_range", _tf_config({"worker": ["a:1", "b:1"]}, index=2),
       r"TF_CONFIG: task index 2 is out of range for worker.*0\.\.1"),
      ("negative_index", _tf_config({"worker": ["a:1", "b:1"]}, index=-1),
       r"TF_CONFIG: task index -1 must be an integer >= 0"),
      ("type_not_in_cluster", _tf_config({"worker": ["a:1", "b:1"]}, "ps"),
       r"lists no ps tasks"),
      ("duplicate_address",
       _tf_config({"chief": ["a:1"], "worker": ["a:1"]}),
       r"TF_CONFIG: address a:1 is used twice"),
      ("missing_port", _tf_config({"worker": ["a:1", "host"]}),
       r"TF_CONFIG cluster\['worker'\]: address 'host' has no port"),
      ("bad_port", _tf_config({"worker": ["a:1", "b:99999"]}),
       r"invalid port '99999'"),
      ("chief_twice", _tf_config({"chief": ["a:1", "b:1"]}, "chief"),
       r"TF_CONFIG: the chief is listed 2 times"),
      ("chief_and_master",
       _tf_config({"chief": ["a:1"], "master": ["b:1"]}, "chief"),
       r"TF_CONFIG: the chief is listed twice"),
      ("no_task", json.dumps({"cluster": {"worker": ["a:1", "b:1"]}}),
       r"TF_CONFIG has a cluster but no 'task'"),
      # Kubeflow's dynamic-worker form: it ran as a single process before.
      ("sparse_cluster",
       json.dumps({"sparseCluster": {"worker": {"1": "w1:2222"}},
                   "task": {"type": "worker", "index": 1}}),
       r"TF_CONFIG names a task \(\{\"type\": \"worker\", \"index\": 1\}\) "
       r"but no usable 'cluster' \(its keys: 'sparseCluster', 'task'\); "
       r"'sparseCluster' .* is not read .*Give the whole cluster, e\.g\. "
       r"\{\"cluster\": \{\"worker\""),
      ("task_without_cluster",
       json.dumps({"task": {"type": "chief", "index": 0}}),
       r"TF_CONFIG names a task .* no usable 'cluster' \(its keys: 'task'\)"
       r".*or unset TF_CONFIG"),
      ("empty_cluster",
       json.dumps({"cluster": {}, "task": {"type": "worker", "index": 0}}),
       r"no usable 'cluster' \(its keys: 'cluster', 'task'\)"),
  )
  def test_errors(self, text, pattern):
    with self.assertRaisesRegex(errors.ClusterConfigError, pattern) as cm:
      cluster_lib.resolve_cluster(environ={"TF_CONFIG": text})
    self.assertEqual(errors.exit_code_for(cm.exception), errors.CONFIG)

  def test_evaluator_needs_no_cluster(self):
    info = cluster_lib.resolve_cluster(environ={"TF_CONFIG": json.dumps(
        {"task": {"type": "evaluator", "index": 0}})})
    self.assertEqual(info.task_type, "evaluator")


class FromClusterSpecTest(parameterized.TestCase):

  def _spec(self, pool, index, cluster=None):
    cluster = cluster or {"workerpool0": ["c:1"],
                          "workerpool1": ["w:1", "w:2"],
                          "workerpool2": ["p:1"],
                          "workerpool3": ["e:1"]}
    return json.dumps({"cluster": cluster, "environment": "cloud",
                       "task": {"type": pool, "index": index, "trial": ""},
                       "job": {}})

  @parameterized.named_parameters(
      ("chief", "workerpool0", 0, "chief", True),
      ("worker", "workerpool1", 1, "worker", False),
      ("ps", "workerpool2", 0, "ps", False),
      ("evaluator", "workerpool3", 0, "evaluator", False),
  )
  def test_pools(self, pool, index, task_type, is_chief):
    info = cluster_lib.resolve_cluster(
        environ={"CLUSTER_SPEC": self._spec(pool, index)})
    self.assertEqual((info.task_type, info.task_index), (task_type, index))
    self.assertEqual(info.is_chief, is_chief)
    self.assertEqual(info.source, "CLUSTER_SPEC")
    self.assertNotIn("evaluator", info.cluster)
    self.assertEqual(info.num_workers, 3)
    self.assertEqual(info.num_ps, 1)

  def test_unknown_pool(self):
    with self.assertRaisesRegex(errors.ClusterConfigError,
                                "CLUSTER_SPEC: unknown task type 'pool9'"):
      cluster_lib.from_cluster_spec(self._spec("pool9", 0))

  def test_index_out_of_range(self):
    with self.assertRaisesRegex(errors.ClusterConfigError,
                                "CLUSTER_SPEC: task index 2 is out of range"):
      cluster_lib.from_cluster_spec(self._spec("workerpool1", 2))

  def test_bad_json(self):
    with self.assertRaisesRegex(errors.ClusterConfigError,
                                "CLUSTER_SPEC is not valid JSON"):
      cluster_lib.resolve_cluster(environ={"CLUSTER_SPEC": "{"})


class PrecedenceTest(absltest.TestCase):

  TF_CONFIG = _tf_config({"chief": ["c:1"], "worker": ["w:1"]}, "worker", 0)
  CLUSTER_SPEC = json.dumps({"cluster": {"workerpool0": ["x:1"]},
                             "task": {"type": "workerpool0", "index": 0}})

  def test_flags_beat_environment(self):
    info = cluster_lib.resolve_cluster(
        worker_hosts="a:1,b:1", task_index=0,
        environ={"TF_CONFIG": self.TF_CONFIG,
                 "CLUSTER_SPEC": self.CLUSTER_SPEC})
    self.assertEqual(info.source, "flags")

  def test_tf_config_beats_cluster_spec(self):
    info = cluster_lib.resolve_cluster(
        environ={"TF_CONFIG": self.TF_CONFIG,
                 "CLUSTER_SPEC": self.CLUSTER_SPEC})
    self.assertEqual(info.source, "TF_CONFIG")
    self.assertEqual(info.task_type, "worker")

  def test_cluster_spec_alone(self):
    info = cluster_lib.resolve_cluster(
        environ={"CLUSTER_SPEC": self.CLUSTER_SPEC})
    self.assertEqual(info.source, "CLUSTER_SPEC")
    self.assertFalse(info.is_multi_worker)

  def test_nothing_is_single_process(self):
    info = cluster_lib.resolve_cluster(environ={"TF_CONFIG": " "})
    self.assertEqual(info.source, "single_process")
    self.assertTrue(info.is_chief)
    self.assertEqual(info.num_workers, 1)
    self.assertIn("single process", info.describe())

  def test_describe(self):
    info = cluster_lib.resolve_cluster(environ={"TF_CONFIG": self.TF_CONFIG})
    self.assertEqual(
        info.describe(),
        "tfdist cluster: role worker, index 0, 2 training worker(s) "
        "[1 chief, 1 worker], from TF_CONFIG")


if __name__ == "__main__":
  absltest.main()
