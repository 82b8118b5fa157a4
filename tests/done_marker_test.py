"""Unit tests of tfdist.distribute.done_marker: the chief's "training finished" file."""

import json
import os
import time

import pytest

from tests import testutil
from tfdist.distribute import parameter_server
from tfdist.distribute import done_marker


@pytest.mark.compat
def test_mark_clear_and_since():
  model_dir = os.path.join(testutil.scratch_dir(), "new", "model_dir")
  assert not done_marker.marked_done_since(model_dir, 0.0)
  before = time.time()
  done_marker.mark_done(model_dir)  # Creates the folder.
  assert done_marker.done_marker(model_dir) == os.path.join(
      model_dir, "training_done")
  with open(done_marker.done_marker(model_dir)) as f:
    assert json.load(f)["finished"] >= before
  assert done_marker.marked_done_since(model_dir, before - 1)
  # A marker older than this run's start is another run's.
  assert not done_marker.marked_done_since(model_dir, time.time() + 60)
  done_marker.clear_done(model_dir)
  assert not os.path.exists(done_marker.done_marker(model_dir))
  done_marker.clear_done(model_dir)  # Nothing there: no error.


@pytest.mark.compat
def test_an_unreadable_marker_is_not_done():
  model_dir = testutil.scratch_dir()
  with open(os.path.join(model_dir, done_marker.DONE_MARKER), "w") as f:
    f.write("half a wri")
  assert not done_marker.marked_done_since(model_dir, 0.0)


@pytest.mark.compat
def test_parameter_server_exports_the_same_marker():
  assert parameter_server.DONE_MARKER == done_marker.DONE_MARKER
  assert parameter_server.mark_done is done_marker.mark_done
  assert parameter_server.marked_done_since is done_marker.marked_done_since
