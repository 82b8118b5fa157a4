"""Unit tests of tfdist.training.state.checkpointing with real checkpoints in a
temp folder.

A checkpoint is whole or absent (a save's leftovers are removed, a NaN
state is never saved, a damaged one is named), numbered with its step, and
records the run that wrote it and the input position.
"""

import json
import logging
import os
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import testutil
from tfdist import errors
from tfdist.data import input_position
from tfdist.training.state import checkpoint_paths
from tfdist.training.state import checkpointing


def _keeper(directory, *, layout=None, max_to_keep=5, before_save=None,
            restore_dir=None):
  """A keeper over a small model's state; returns (keeper, model, step)."""
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  step = tf.Variable(0, dtype=tf.int64)
  position = None if layout is None else input_position.InputPosition(
      layout, steps_per_epoch=4)
  keeper = checkpointing.CheckpointKeeper(
      checkpoint=tf.train.Checkpoint(model=model, global_step=step),
      directory=directory, step_counter=step, max_to_keep=max_to_keep,
      restore_dir=restore_dir, input_position=position,
      variables=model.variables, before_save=before_save)
  return keeper, model, step


def test_checkpoints_are_numbered_with_their_step_and_rotate():
  directory = testutil.scratch_dir()
  keeper, _, step = _keeper(directory, max_to_keep=2)
  assert keeper.restore() is None  # A fresh run.
  paths = []
  for number in (3, 6, 9):
    step.assign(number)
    paths.append(keeper.save(number))
  assert [checkpoint_paths.checkpoint_step(p) for p in paths] == [3, 6, 9]
  assert keeper.latest == paths[-1] == os.path.join(directory, "ckpt-9")
  assert tf.train.get_checkpoint_state(
      directory).all_model_checkpoint_paths == paths[1:]
  assert not tf.io.gfile.glob(paths[0] + ".*")


def test_saves_are_logged_at_info_now_and_then(caplog):
  # The first save, then at most one a minute at INFO (counting the ones
  # between); the others at DEBUG, so a short run's lines stay readable.
  now = [0.0]
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  step = tf.Variable(0, dtype=tf.int64)
  keeper = checkpointing.CheckpointKeeper(
      checkpoint=tf.train.Checkpoint(model=model, global_step=step),
      directory=testutil.scratch_dir(), step_counter=step,
      log_every_seconds=60, clock=lambda: now[0])
  caplog.set_level(logging.DEBUG, logger="absl")
  for number, seconds in ((1, 0), (2, 10), (3, 20), (4, 61), (5, 62)):
    now[0] = seconds
    step.assign(number)
    keeper.save(number)
  saves = [(r.levelname, r.getMessage().rsplit("/", 1)[-1])
           for r in caplog.records if "Saved checkpoint" in r.getMessage()]
  assert saves == [
      ("INFO", "ckpt-1"), ("DEBUG", "ckpt-2"), ("DEBUG", "ckpt-3"),
      ("INFO", "ckpt-4 (2 more saved since the last such line)"),
      ("DEBUG", "ckpt-5")]


def test_resume_restores_the_newest_state():
  directory = testutil.scratch_dir()
  keeper, model, step = _keeper(directory)
  model.layers[0].kernel.assign(np.full((3, 2), 0.5, np.float32))
  step.assign(4)
  path = keeper.save(4)
  again, model2, step2 = _keeper(directory)
  assert again.restore() == path == again.latest
  assert int(step2.numpy()) == 4
  np.testing.assert_array_equal(model2.layers[0].kernel.numpy(), 0.5)


def test_a_nan_state_is_never_saved():
  directory = testutil.scratch_dir()
  keeper, model, step = _keeper(directory)
  good = keeper.save(1)
  model.layers[0].bias.assign([np.nan, 0.0])
  step.assign(2)
  with pytest.raises(errors.NonFiniteStateError, match="at step 2 holds NaN"):
    keeper.save(2)
  assert keeper.latest == good
  assert tf.train.latest_checkpoint(directory) == good
  assert not keeper.state_is_finite()


def test_restore_skips_a_nan_checkpoint_for_the_one_before():
  directory = testutil.scratch_dir()
  keeper, model, step = _keeper(directory)
  good = keeper.save(1)
  model.layers[0].bias.assign([np.inf, 0.0])
  keeper.manager.save(checkpoint_number=2)  # As an older tfdist did.
  again, _, _ = _keeper(directory)
  assert again.restore() == good
  # Only non-finite checkpoints: nothing to resume from.
  only_bad = testutil.scratch_dir()
  bad, bad_model, _ = _keeper(only_bad)
  bad_model.layers[0].bias.assign([np.nan, 0.0])
  bad.manager.save(checkpoint_number=5)
  with pytest.raises(errors.NonFiniteStateError, match="Every checkpoint"):
    _keeper(only_bad)[0].restore()


def test_a_checkpoint_without_its_index_is_absent():
  directory = testutil.scratch_dir()
  keeper, _, _ = _keeper(directory)
  older = keeper.save(1)
  newer = keeper.save(2)
  os.remove(newer + ".index")  # The index is written last: not whole.
  assert _keeper(directory)[0].restore() == older


def test_a_damaged_index_is_named():
  directory = testutil.scratch_dir()
  keeper, _, _ = _keeper(directory)
  path = keeper.save(3)
  with open(path + ".index", "wb") as f:
    f.write(b"not an sstable")
  with pytest.raises(errors.DamagedCheckpointError) as caught:
    _keeper(directory)[0].restore()
  assert str(caught.value).startswith(f"The checkpoint {path} cannot be read")
  assert "move its files (ckpt-3.*)" in str(caught.value)
  assert errors.exit_code_for(caught.value) == errors.CONFIG


def test_interrupted_saves_are_removed():
  directory = testutil.scratch_dir()
  keeper, _, _ = _keeper(directory)
  kept = keeper.save(1)
  os.makedirs(os.path.join(directory, "ckpt-2_temp", "part-0"))
  os.makedirs(os.path.join(directory, "my_temp"))
  assert checkpointing.clean_interrupted_saves(directory) == [
      os.path.join(directory, "ckpt-2_temp")]
  assert sorted(os.listdir(directory)) == sorted(
      ["checkpoint", "my_temp", "ckpt-1.index",
       "ckpt-1.data-00000-of-00001"])
  assert tf.train.latest_checkpoint(directory) == kept
  assert checkpointing.clean_interrupted_saves(
      os.path.join(directory, "absent")) == []


def test_before_save_runs_first_and_can_refuse():
  directory = testutil.scratch_dir()
  calls = []

  def lease_check():
    calls.append(len(tf.io.gfile.glob(os.path.join(directory, "*.index"))))
    if len(calls) == 2:
      raise errors.LeaseLostError("taken over")

  keeper, _, _ = _keeper(directory, before_save=lease_check)
  keeper.save(1)
  with pytest.raises(errors.LeaseLostError):
    keeper.save(2)
  assert calls == [0, 1]
  assert tf.train.latest_checkpoint(directory).endswith("ckpt-1")


def test_a_non_chief_saves_apart_and_resumes_from_the_chief():
  chief_dir, scratch = testutil.scratch_dir(), testutil.scratch_dir()
  chief, _, chief_step = _keeper(chief_dir)
  chief_step.assign(5)
  chief_path = chief.save(5)
  worker, _, step = _keeper(scratch, restore_dir=chief_dir)
  assert worker.restore() == chief_path
  assert int(step.numpy()) == 5
  assert worker.save(6).startswith(scratch)


def test_the_input_position_is_saved_and_optional():
  layout = {"num_input_pipelines": 2, "seed": 1, "files": ["f"]}
  directory = testutil.scratch_dir()
  keeper, _, step = _keeper(directory, layout=layout)
  step.assign(6)
  path = keeper.save(6)
  assert "input_position" in checkpointing.root_children(path)
  assert json.loads(tf.train.load_checkpoint(path).get_tensor(
      checkpointing.INPUT_POSITION_KEY)) == layout
  same = _keeper(directory, layout=layout)[0]
  same.restore()
  assert same.input_position.saved == layout
  assert same.input_position.resume_step(6) == 6
  # Written without a position: the rest restores, the epoch starts over.
  without = testutil.scratch_dir()
  _keeper(without)[0].save(6)
  assert "input_position" not in checkpointing.root_children(
      os.path.join(without, "ckpt-6"))
  later = _keeper(without, layout=layout)[0]
  assert later.restore().endswith("ckpt-6")
  assert later.input_position.saved is None
  assert later.input_position.resume_step(6) == 4


def _plan(**kw):
  fields = dict(global_batch_size=64, total_steps=100, steps_per_epoch=10,
                eval_batch_size=64, strategy="mirrored",
                batch=types.SimpleNamespace(num_replicas_in_sync=2,
                                            per_replica_batch_size=32),
                lr=types.SimpleNamespace(warmup_steps=5,
                                         peak_learning_rate=0.1))
  fields.update(kw)
  return types.SimpleNamespace(**fields)


@pytest.mark.compat
def test_the_run_record_leaves_out_operational_settings():
  settings = {"model": "cnn", "model_dir": "/m", "lr_schedule": "cosine",
              "log_steps": 10, "seed": 3}
  record = checkpointing.run_record(settings, _plan())
  assert record["config"] == {"model": "cnn", "lr_schedule": "cosine",
                              "seed": 3}
  assert (record["global_batch_size"], record["num_replicas_in_sync"],
          record["per_replica_batch_size"], record["warmup_steps"]) == (
              64, 2, 32, 5)
  directory = os.path.join(testutil.scratch_dir(), "checkpoints")
  checkpointing.write_run_record(directory, record)
  assert checkpointing.read_run_record(directory) == json.loads(
      json.dumps(record))
  assert os.listdir(directory) == [checkpointing.RUN_RECORD_FILE]


@pytest.mark.compat
def test_an_older_run_is_read_from_its_manifest():
  model_dir = testutil.scratch_dir()
  with open(os.path.join(model_dir, "run_manifest.json"), "w") as f:
    json.dump({"global_batch_size": 32, "train_steps": 50,
               "config": {"model": "mlp", "model_dir": model_dir}}, f)
  record = checkpointing.read_run_record(
      os.path.join(model_dir, "checkpoints"), model_dir)
  assert (record["global_batch_size"], record["total_steps"],
          record["config"]) == (32, 50, {"model": "mlp"})
  assert checkpointing.read_run_record(testutil.scratch_dir()) is None


@pytest.mark.compat
def test_check_resume():
  before = checkpointing.run_record({"model": "cnn", "lr_schedule": "cosine",
                                     "seed": 1}, _plan())
  same = dict(before)
  assert checkpointing.check_resume(before, same, checkpoint="ckpt-5",
                                    restored_step=5) == []
  other_model = checkpointing.run_record(
      {"model": "mlp", "lr_schedule": "cosine", "seed": 1}, _plan())
  with pytest.raises(errors.IncompatibleResumeError,
                     match=r"Cannot resume from ckpt-5: the model changed "
                           r"\(--model cnn -> mlp\)"):
    checkpointing.check_resume(before, other_model, checkpoint="ckpt-5",
                               restored_step=5)
  longer = checkpointing.run_record(
      {"model": "cnn", "lr_schedule": "cosine", "seed": 2},
      _plan(total_steps=200, global_batch_size=128))
  notes = checkpointing.check_resume(before, longer, checkpoint="ckpt-5",
                                     restored_step=5, allow=True)
  assert notes[0].startswith("the global batch changed from 64 to 128")
  assert notes[0].endswith("(--allow_incompatible_resume)")
  assert notes[1].startswith("the run is longer: 100 -> 200 steps")
  assert notes[2] == "--seed 1 -> 2"


@pytest.mark.compat
def test_a_changed_optimizer_is_refused_even_when_allowed():
  before = checkpointing.run_record({"model": "cnn", "optimizer": "sgd"},
                                    _plan())
  after = checkpointing.run_record({"model": "cnn", "optimizer": "adam"},
                                   _plan())
  for allow in (False, True):
    with pytest.raises(errors.IncompatibleResumeError,
                       match=r"the optimizer changed \(--optimizer sgd -> "
                             r"adam\).*--optimizer=sgd.*--init_checkpoint="
                             r"ckpt-5"):
      checkpointing.check_resume(before, after, checkpoint="ckpt-5",
                                 restored_step=5, allow=allow)


@pytest.mark.compat
def test_old_names_stay_importable():
  assert checkpointing.InputPosition is input_position.InputPosition
  assert checkpointing.checkpoint_step is checkpoint_paths.checkpoint_step
