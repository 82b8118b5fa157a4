"""Tests for tfdist.runtime.console: a `tfdist.fit` script's lines."""

import io
import logging as std_logging
import sys

from absl import logging as absl_logging
from absl.testing import absltest

from tfdist.runtime import console


class KerasLikeLinesTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.stdout = io.StringIO()
    self.stderr = io.StringIO()
    self.enter_context(absltest.mock.patch.object(sys, "stdout", self.stdout))
    self.handler = std_logging.StreamHandler(self.stderr)
    self.handler.setFormatter(std_logging.Formatter("GLOG %(message)s"))
    self.logger = std_logging.getLogger("tfdist_console_test")
    self.logger.addHandler(self.handler)
    self.logger.propagate = False
    self.logger.setLevel(std_logging.INFO)
    self.addCleanup(self.logger.removeHandler, self.handler)

  def test_plain_lines_that_never_start_inside_a_progress_bar(self):
    with console.keras_like_lines(self.handler, plain=True):
      self.assertIsNot(sys.stdout, self.stdout)  # Tracked while it runs.
      sys.stdout.write("\r 3/16 ━━━━ - loss: 0.5")  # A bar, left open.
      self.logger.info("tfdist: saved")
      sys.stdout.write("\r 4/16 ━━━━ - loss: 0.4\n")  # The epoch's end.
      self.logger.warning("careful")
    self.assertIs(sys.stdout, self.stdout)
    self.assertEqual(self.stdout.getvalue(),
                     "\r 3/16 ━━━━ - loss: 0.5\n\r 4/16 ━━━━ - loss: 0.4\n")
    self.assertEqual(self.stderr.getvalue(),
                     "tfdist: saved\nWARNING: careful\n")
    self.logger.info("after")  # The caller's format again.
    self.assertTrue(self.stderr.getvalue().endswith("GLOG after\n"))

  def test_not_plain_keeps_the_format_and_still_ends_the_bar(self):
    with console.keras_like_lines(self.handler, plain=False):
      sys.stdout.write("\r 3/16 ━━━━")
      self.logger.info("line")
    self.assertEqual(self.stdout.getvalue(), "\r 3/16 ━━━━\n")
    self.assertEqual(self.stderr.getvalue(), "GLOG line\n")

  def test_an_open_line_is_ended_when_the_block_ends(self):
    with console.keras_like_lines(None, plain=False):
      sys.stdout.write("bar")
    self.assertEqual(self.stdout.getvalue(), "bar\n")
    console.end_open_line()  # Outside a block: nothing.
    self.assertEqual(self.stdout.getvalue(), "bar\n")

  def test_the_absl_pre_parse_notice_is_off_while_plain(self):
    before = absl_logging._warn_preinit_stderr  # pylint: disable=protected-access
    with console.keras_like_lines(self.handler, plain=True):
      self.assertFalse(absl_logging._warn_preinit_stderr)  # pylint: disable=protected-access
    self.assertEqual(absl_logging._warn_preinit_stderr, before)  # pylint: disable=protected-access

  def test_tensorflows_warnings_once(self):
    tensorflow = std_logging.getLogger("tensorflow")
    own = std_logging.StreamHandler(self.stderr)
    own.setFormatter(std_logging.Formatter("%(levelname)s:%(message)s"))
    tensorflow.addHandler(own)
    self.addCleanup(tensorflow.removeHandler, own)
    root = std_logging.StreamHandler(self.stderr)
    root.setFormatter(std_logging.Formatter("ROOT %(message)s"))
    std_logging.getLogger().addHandler(root)
    self.addCleanup(std_logging.getLogger().removeHandler, root)
    propagate = tensorflow.propagate
    with console.keras_like_lines(None, plain=False):
      for _ in range(3):
        tensorflow.warning("Using MirroredStrategy eagerly")
      tensorflow.warning("another")
    self.assertEqual(self.stderr.getvalue(),
                     "WARNING:Using MirroredStrategy eagerly\n"
                     "WARNING:another\n")
    self.assertEqual(tensorflow.propagate, propagate)


if __name__ == "__main__":
  absltest.main()
