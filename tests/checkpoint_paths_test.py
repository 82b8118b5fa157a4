"""Unit tests of tfdist.training.state.checkpoint_paths: checkpoint numbers,
save leftovers."""

import pytest

from tfdist.training.state import checkpoint_paths


@pytest.mark.compat
@pytest.mark.parametrize("path,step", [
    ("/m/checkpoints/ckpt-48", 48),
    ("gs://bucket/run-3/checkpoints/ckpt-0", 0),
    ("ckpt-1200", 1200),
])
def test_numbered_prefixes(path, step):
  assert checkpoint_paths.checkpoint_step(path) == step


@pytest.mark.compat
@pytest.mark.parametrize("path", ["/m/checkpoints/ckpt", "model.weights.h5",
                                  "", "/m/ckpt-x"])
def test_unnumbered_paths_give_the_default(path):
  assert checkpoint_paths.checkpoint_step(path) == -1
  assert checkpoint_paths.checkpoint_step(path, default=0) == 0


@pytest.mark.compat
def test_interrupted_saves():
  assert checkpoint_paths.is_interrupted_save("ckpt-12_temp")
  assert checkpoint_paths.is_interrupted_save("ckpt-12_temp/")
  assert not checkpoint_paths.is_interrupted_save("ckpt-12.index")
  assert not checkpoint_paths.is_interrupted_save("my_temp")
  assert not checkpoint_paths.is_interrupted_save("checkpoint")
