"""Tests for tfdist.observability.profiling: a real TensorFlow profiler trace of a window."""

import os
import tempfile

from absl.testing import absltest
import tensorflow as tf

from tfdist.observability import profiling


class ProfileWindowTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.logdir = os.path.join(
        tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR")), "train")

  def test_rejects_a_window_that_is_not_one(self):
    for steps in ((0, 3), (5, 4)):
      with self.assertRaisesRegex(ValueError, "need 1 <= START <= END"):
        profiling.ProfileWindow(steps, self.logdir)

  def test_boundaries_are_the_edges_after_the_step(self):
    window = profiling.ProfileWindow((7, 9), self.logdir)
    self.assertEqual(window.boundaries(0), [6, 9])
    self.assertEqual(window.boundaries(6), [9])
    self.assertEqual(window.boundaries(9), [])

  def test_traces_the_window_and_nothing_outside_it(self):
    window = profiling.ProfileWindow((3, 4), self.logdir)
    step = tf.function(lambda x: x * 2.0)
    window.before_steps(0)  # Steps 1-2: outside the window.
    self.assertFalse(window.active)
    window.before_steps(2)
    self.assertTrue(window.active)
    step(tf.constant(1.0))
    window.after_steps(3)
    self.assertTrue(window.active)
    window.after_steps(4)
    self.assertFalse(window.active)
    self.assertTrue(window.done)
    self.assertRegex(window.latest_trace,
                     r"/train/plugins/profile/[^/]+/[^/]+\.xplane\.pb$")
    self.assertEqual(profiling.trace_files(self.logdir),
                     [window.latest_trace])
    window.before_steps(2)  # Done: a second trace never starts.
    self.assertFalse(window.active)

  def test_a_running_profiler_means_no_trace_and_no_error(self):
    tf.profiler.experimental.start(self.logdir)
    try:
      window = profiling.ProfileWindow((1, 2), self.logdir)
      with self.assertLogs(level="WARNING") as logs:
        window.before_steps(0)
    finally:
      tf.profiler.experimental.stop()
    self.assertTrue(window.done)
    self.assertFalse(window.active)
    self.assertIn("already running", "".join(logs.output))

  def test_stop_without_a_trace_does_nothing(self):
    window = profiling.ProfileWindow((1, 2), self.logdir)
    window.stop()
    self.assertFalse(window.done)
    self.assertIsNone(window.latest_trace)


if __name__ == "__main__":
  absltest.main()
