"""Unit tests of tfdist.training.step.training_checks: skipped steps and
divergence."""

import math

import pytest

from tfdist import errors
from tfdist.training.step import training_checks
from tfdist.training.step.training_checks import SkippedStepMonitor


@pytest.mark.compat
def test_counts_and_intervals():
  monitor = SkippedStepMonitor(10, start_step=100)
  monitor.record_chunk(steps=5, skipped=2, skipped_at_end=1)
  monitor.record_chunk(steps=5, skipped=0.9999, skipped_at_end=0)  # Sums.
  assert (monitor.step, monitor.total_skipped, monitor.consecutive) == (
      110, 3, 0)
  assert monitor.take_interval() == 3
  assert monitor.take_interval() == 0
  monitor.finish()  # Some steps updated: no error.


@pytest.mark.compat
def test_a_run_of_skips_across_chunks_stops_the_run():
  monitor = SkippedStepMonitor(6)
  monitor.record_chunk(steps=4, skipped=3, skipped_at_end=3)
  monitor.record_chunk(steps=2, skipped=2, skipped_at_end=2)  # 5 in a row.
  with pytest.raises(errors.TrainingStalledError) as caught:
    monitor.record_chunk(steps=4, skipped=4, skipped_at_end=4,
                         loss_scale=lambda: 1.0)
  message = str(caught.value)
  assert "for the last 9 steps in a row (steps 2-10)" in message
  assert "at loss scale 1" in message
  assert message.endswith("--max_consecutive_skipped_steps=6.")
  assert errors.exit_code_for(caught.value) == errors.DIVERGED


@pytest.mark.compat
def test_an_update_resets_the_run_of_skips():
  monitor = SkippedStepMonitor(5)
  monitor.record_chunk(steps=4, skipped=4, skipped_at_end=4)
  monitor.record_chunk(steps=4, skipped=1, skipped_at_end=0)
  assert monitor.consecutive == 0
  monitor.record_chunk(steps=4, skipped=4, skipped_at_end=4)  # 4 < 5.


@pytest.mark.compat
def test_no_limit_still_fails_a_run_without_any_update():
  monitor = SkippedStepMonitor(0, start_step=20)
  monitor.record_chunk(steps=50, skipped=50, skipped_at_end=50)
  with pytest.raises(errors.TrainingStalledError,
                     match=r"at any of this run's 50 steps \(steps 21-70\)"):
    monitor.finish(loss_scale=lambda: None)
  SkippedStepMonitor(0, start_step=20).finish()  # No steps: nothing to judge.


@pytest.mark.compat
def test_a_negative_limit_is_refused():
  with pytest.raises(ValueError, match="--max_consecutive_skipped_steps=-1"):
    SkippedStepMonitor(-1)
  assert SkippedStepMonitor().max_consecutive == (
      training_checks.DEFAULT_MAX_CONSECUTIVE_SKIPPED_STEPS)


@pytest.mark.compat
@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_a_non_finite_eval_loss_is_divergence(loss):
  with pytest.raises(errors.TrainingDivergedError,
                     match=f"evaluation loss at step 9 is {loss}"):
    training_checks.check_eval_loss(loss, step=9)


@pytest.mark.parametrize("state_is_finite", [None, False])
def test_a_non_finite_eval_loss_with_a_non_finite_state_is_divergence(
    state_is_finite):
  with pytest.raises(errors.TrainingDivergedError,
                     match="Lower --base_learning_rate"):
    training_checks.check_eval_loss(math.nan, step=9,
                                    state_is_finite=state_is_finite)


def test_a_non_finite_eval_loss_with_finite_weights_names_the_data(caplog):
  with caplog.at_level("WARNING"):
    assert not training_checks.check_eval_loss(math.nan, step=9,
                                               state_is_finite=True)
  message = caplog.text
  assert ("the evaluation loss at step 9 is nan while the model's weights "
          "and optimizer state are finite, so the evaluation data is the "
          "likely cause") in message
  assert "--eval_files" in message and "check_numerics" in message
  assert "Training goes on, as keras.Model.fit's does" in message
  assert "--base_learning_rate" not in message


@pytest.mark.compat
def test_a_finite_eval_loss_passes():
  assert training_checks.check_eval_loss(0.25, step=9)


def test_compiled_steps_per_execution_that_differs_is_warned(caplog):
  import keras  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
  assert not training_checks.check_steps_per_execution(
      model, steps_per_execution=8)  # Not compiled: nothing asked.
  model.compile(loss="mse", steps_per_execution=4)
  assert not training_checks.check_steps_per_execution(
      model, steps_per_execution=4)
  with caplog.at_level("WARNING"):
    assert training_checks.check_steps_per_execution(
        model, steps_per_execution=1, model_name="--model=mine")
  assert ("--model=mine was compiled with steps_per_execution=4, which "
          "tfdist does not read: it runs --steps_per_execution=1") in (
              caplog.text)
  assert "Set --steps_per_execution=4" in caplog.text


def test_compiled_jit_compile_without_enable_xla_is_warned(caplog):
  # compile(jit_compile=True) was dropped without a word before.
  import keras  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
  assert not training_checks.check_jit_compile(model, enable_xla=False)
  model.compile(loss="mse")  # "auto": False on this CPU-only machine.
  assert not training_checks.check_jit_compile(model, enable_xla=False)
  model.compile(loss="mse", jit_compile=True)
  assert not training_checks.check_jit_compile(model, enable_xla=True)
  with caplog.at_level("WARNING"):
    assert training_checks.check_jit_compile(model, enable_xla=False,
                                             model_name="--model=mine")
  assert ("--model=mine was compiled with jit_compile=True, which tfdist "
          "does not read") in caplog.text
  assert "Set --enable_xla" in caplog.text
