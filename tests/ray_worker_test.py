"""Tests for tfdist.cloud.ray_worker: checkpoints copied to and from Ray's
folders, the final metrics, and the per-worker set-up (no Ray cluster)."""

import logging as std_logging
import os
import sys
import tempfile

from absl.testing import absltest
import tensorflow as tf

from tests import testutil
from tfdist import ray as tfdist_ray
from tfdist.cloud import ray_worker


def _save(folder: str, step: int, value: float) -> str:
  """A tfdist-style checkpoint `folder/ckpt-<step>` holding `value`."""
  variable = tf.Variable(value)
  manager = tf.train.CheckpointManager(
      tf.train.Checkpoint(v=variable), folder, max_to_keep=None)
  return manager.save(checkpoint_number=step)


def _restored_value(folder: str) -> float:
  variable = tf.Variable(0.0)
  tf.train.Checkpoint(v=variable).restore(
      tf.train.latest_checkpoint(folder)).expect_partial()
  return float(variable.numpy())


class CheckpointStateTest(absltest.TestCase):

  def test_state_file_read_back_without_a_deprecation_warning(self):
    # TensorFlow's update_checkpoint_state, deprecated, put its warning in
    # every Ray worker's log (a new-user trial).
    folder = testutil.scratch_dir()
    with self.assertNoLogs("tensorflow", level="WARNING"):
      ray_worker.write_checkpoint_state(folder, ["ckpt-8", 'ckpt-"16"'])
    state = tf.train.get_checkpoint_state(folder)
    self.assertEqual(state.model_checkpoint_path,
                     os.path.join(folder, 'ckpt-"16"'))
    self.assertEqual(list(state.all_model_checkpoint_paths),
                     [os.path.join(folder, "ckpt-8"),
                      os.path.join(folder, 'ckpt-"16"')])
    self.assertEqual(os.listdir(folder), ["checkpoint"])  # No leftovers.


class CheckpointCopyTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    root = tempfile.mkdtemp(dir=testutil.scratch_dir())
    self.run_dir = os.path.join(root, "checkpoints")
    self.ray_dir = os.path.join(root, "ray")
    os.makedirs(self.ray_dir)

  def test_checkpoint_step(self):
    self.assertEqual(ray_worker.checkpoint_step("/a/b-c/ckpt-48"), 48)

  def test_export_copies_the_latest_only_when_newer(self):
    _save(self.run_dir, 4, 1.5)
    _save(self.run_dir, 8, 2.5)
    self.assertIsNone(
        ray_worker.export_checkpoint(self.run_dir, self.ray_dir, newer_than=8))
    self.assertEqual(ray_worker.export_checkpoint(self.run_dir, self.ray_dir),
                     8)
    self.assertEqual(os.path.basename(tf.train.latest_checkpoint(
        self.ray_dir)), "ckpt-8")
    self.assertEqual(_restored_value(self.ray_dir), 2.5)
    self.assertFalse(any(n.startswith("ckpt-4")
                         for n in os.listdir(self.ray_dir)))

  def test_export_without_checkpoint(self):
    os.makedirs(self.run_dir)
    self.assertIsNone(ray_worker.export_checkpoint(self.run_dir,
                                                   self.ray_dir))

  def test_import_only_a_newer_checkpoint(self):
    _save(self.ray_dir, 12, 7.0)
    _save(self.run_dir, 4, 1.0)
    self.assertEqual(ray_worker.import_checkpoint(self.ray_dir, self.run_dir),
                     12)
    self.assertEqual(_restored_value(self.run_dir), 7.0)
    state = tf.train.get_checkpoint_state(self.run_dir)
    self.assertEqual([os.path.basename(p)
                      for p in state.all_model_checkpoint_paths],
                     ["ckpt-4", "ckpt-12"])
    # As new already: nothing to do.
    self.assertIsNone(ray_worker.import_checkpoint(self.ray_dir, self.run_dir))

  def test_wait_for_checkpoint_times_out_with_the_step(self):
    os.makedirs(self.run_dir)
    with self.assertRaisesRegex(RuntimeError, r"step 5 into .*within 0 s"):
      ray_worker.wait_for_checkpoint(self.run_dir, 5, timeout=0.0,
                                     poll_seconds=0.01)
    _save(self.run_dir, 6, 0.0)
    ray_worker.wait_for_checkpoint(self.run_dir, 5, timeout=0.0)


class FinalMetricsTest(absltest.TestCase):

  def test_from_the_manifest(self):
    record = {"final_step": 48, "num_replicas_in_sync": 2,
              "final_metrics": {"eval_loss": 0.5, "eval_auc": None},
              "throughput": {"examples_per_second": 812.5}}
    self.assertEqual(
        ray_worker.final_metrics(record, start_step=16),
        {"step": 48, "final_step": 48, "start_step": 16,
         "num_replicas_in_sync": 2, "eval_loss": 0.5,
         "examples_per_second": 812.5})

  def test_without_throughput(self):
    record = {"final_step": 3, "num_replicas_in_sync": 1,
              "final_metrics": {}}
    self.assertNotIn("examples_per_second",
                     ray_worker.final_metrics(record, start_step=0))


class WorkerProcessTest(absltest.TestCase):

  def test_tensorflow_lines_go_through_the_root_handlers_only(self):
    root = std_logging.getLogger()
    tf_logger = std_logging.getLogger("tensorflow")
    root_handler = std_logging.StreamHandler(sys.stderr)
    own = std_logging.StreamHandler(sys.stderr)
    kept = std_logging.FileHandler(os.path.join(testutil.scratch_dir(),
                                                "tf.log"))
    root.addHandler(root_handler)
    tf_logger.addHandler(own)
    tf_logger.addHandler(kept)
    try:
      ray_worker.log_tensorflow_once()
      self.assertNotIn(own, tf_logger.handlers)
      self.assertIn(kept, tf_logger.handlers)  # Not a console handler.
    finally:
      root.removeHandler(root_handler)
      for handler in (own, kept):
        tf_logger.removeHandler(handler)
      kept.close()

  def test_names_importable_from_tfdist_ray(self):
    for name in ("RayReportCallback", "checkpoint_step", "export_checkpoint",
                 "import_checkpoint", "final_metrics",
                 "IMPORT_TIMEOUT_SECONDS"):
      self.assertIs(getattr(tfdist_ray, name), getattr(ray_worker, name))
    with self.assertRaises(AttributeError):
      getattr(tfdist_ray, "no_such_name")


if __name__ == "__main__":
  absltest.main()
