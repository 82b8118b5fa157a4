"""Tests for tfdist.training.plan.memory: the model-state estimate against the
real bytes of a model's variables and its optimizer's, and the data-parallel
fit."""

import dataclasses
import math

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import pytest

from tfdist.parallel.tensor import options as tensor_parallel_options
from tfdist.training.plan import memory
from tfdist.training.step import precision

# Also run on the oldest supported TensorFlow (see tests/conftest.py).
pytestmark = pytest.mark.compat


def _model():
  inputs = keras.Input((12,))
  x = keras.layers.Dense(32, use_bias=False)(inputs)
  x = keras.layers.BatchNormalization()(x)  # Non-trainable statistics too.
  outputs = keras.layers.Dense(3)(x)
  return keras.Model(inputs, outputs)


def _nbytes(variables) -> int:
  return sum(np.asarray(v.numpy()).nbytes for v in variables)


class EstimateTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("sgd_momentum", lambda: keras.optimizers.SGD(0.1, momentum=0.9), 1),
      ("adam", lambda: keras.optimizers.Adam(1e-3), 2),
      ("fp16_loss_scale", lambda: precision.wrap_optimizer_for_precision(
          keras.optimizers.SGD(0.1, momentum=0.9), dtype="fp16"), 1))
  def test_equals_the_bytes_of_variables_and_optimizer_state(
      self, make_optimizer, slots_per_weight):
    model = _model()
    optimizer = make_optimizer()
    optimizer.build(model.trainable_variables)
    estimate = memory.estimate_model_memory(model, optimizer)
    self.assertEqual(estimate.parameters_bytes, _nbytes(model.variables))
    self.assertEqual(estimate.gradients_bytes,
                     _nbytes(model.trainable_variables))
    self.assertEqual(estimate.optimizer_bytes, _nbytes(optimizer.variables))
    self.assertEqual(estimate.total_bytes,
                     _nbytes(model.variables) +
                     _nbytes(model.trainable_variables) +
                     _nbytes(optimizer.variables))
    # The slots dominate the optimizer's state: 1 (momentum) or 2 (Adam)
    # per trainable value, plus a few scalars (iterations, loss scale).
    trainable = _nbytes(model.trainable_variables)
    self.assertBetween(estimate.optimizer_bytes - slots_per_weight *
                       trainable, 0, 64)
    self.assertEqual(estimate.num_parameters,
                     sum(int(np.prod(v.shape)) for v in model.variables))


class FitTest(absltest.TestCase):

  def test_fits_and_the_strategy_that_fits_when_not(self):
    estimate = memory.ModelMemory(parameters_bytes=4 << 30,
                                  gradients_bytes=4 << 30,
                                  optimizer_bytes=8 << 30,
                                  num_parameters=1 << 30)
    fit = memory.fits_data_parallel(estimate, capacity_bytes=80 << 30)
    self.assertTrue(fit.fits)
    self.assertAlmostEqual(fit.share, 16 / 80)
    fit = memory.fits_data_parallel(estimate, capacity_bytes=80 << 30,
                                    replicas_sharing=8)  # 8 CPU copies.
    self.assertFalse(fit.fits)
    small = memory.fits_data_parallel(estimate, capacity_bytes=5 << 30,
                                      optimizer="adam")
    self.assertFalse(small.fits)
    # Variables and slots (12 GiB) sharded over ps tasks of 5 GiB: 3.
    self.assertIn("parameter_server with at least 3 ps task(s)", small.advice)
    self.assertIn("--optimizer=adam keeps 2 slots", small.advice)
    # 16 GiB of state over devices of 5 GiB: at least 4 pipeline stages.
    self.assertIn("--pipeline_stages=4 cuts the model into 4 stages on 4 "
                  "devices", small.advice)
    self.assertIn("each holding about 4.0 GiB", small.advice)

  def test_sharding_recommended_when_it_makes_the_state_fit(self):
    # fp32 Adam, 1 Gi parameters: 4 + 4 + 8 bytes each.
    estimate = memory.ModelMemory(parameters_bytes=4 << 30,
                                  gradients_bytes=4 << 30,
                                  optimizer_bytes=8 << 30,
                                  num_parameters=1 << 30)
    # Stage 1 over 4 replicas: 4 + 4 + 8 / 4 = 10 bytes each.
    sharded = memory.sharded_estimate(estimate, num_replicas=4)
    self.assertEqual(sharded.optimizer_bytes, 2 << 30)
    self.assertEqual(sharded.total_bytes, 10 << 30)
    self.assertEqual(memory.sharded_estimate(estimate, num_replicas=4,
                                             stage=0), estimate)
    # 16 GiB does not fit 12 GiB; 10 GiB does.
    fit = memory.fits_data_parallel(estimate, capacity_bytes=12 << 30,
                                    optimizer="adam", num_replicas=4)
    self.assertFalse(fit.fits)
    self.assertIn("--shard_optimizer_state (--zero_stage=1) over the 4 "
                  "replicas keeps 2.0 GiB", fit.advice)
    self.assertTrue(memory.fits_data_parallel(
        estimate, capacity_bytes=12 << 30, num_replicas=4,
        zero_stage=1).fits)
    # One replica, or too little memory even sharded: not recommended.
    for replicas, capacity in ((1, 12 << 30), (4, 9 << 30)):
      fit = memory.fits_data_parallel(estimate, capacity_bytes=capacity,
                                      optimizer="adam",
                                      num_replicas=replicas)
      self.assertNotIn("--shard_optimizer_state", fit.advice)
    # LAMB cannot shard.
    self.assertNotIn("--shard_optimizer_state", memory.fits_data_parallel(
        estimate, capacity_bytes=12 << 30, optimizer="lamb",
        num_replicas=4).advice)

  def test_stage_3_splits_weights_gradients_and_optimizer_state(self):
    # fp32 Adam, 1 Gi trainable parameters and 1 MiB of batch-norm
    # statistics: 16 bytes per parameter unsharded, 16 / N under stage 3.
    estimate = memory.ModelMemory(parameters_bytes=(4 << 30) + (1 << 20),
                                  gradients_bytes=4 << 30,
                                  optimizer_bytes=8 << 30,
                                  num_parameters=(1 << 30) + (1 << 18))
    stage3 = memory.sharded_estimate(estimate, num_replicas=4, stage=3)
    self.assertEqual(stage3.parameters_bytes, (1 << 30) + (1 << 20))
    self.assertEqual(stage3.gradients_bytes, 1 << 30)
    self.assertEqual(stage3.optimizer_bytes, 2 << 30)
    self.assertEqual(stage3.total_bytes - (1 << 20), (16 << 30) // 4)
    # Embedding tables stay whole at stage 3, with their gradients: of 1 GiB
    # of trainable tables, nothing is split.
    tables = dataclasses.replace(estimate, replicated_bytes=1 << 30)
    stage3 = memory.sharded_estimate(tables, num_replicas=4, stage=3)
    self.assertEqual(stage3.parameters_bytes,
                     (1 << 30) + (3 << 30) // 4 + (1 << 20))
    self.assertEqual(stage3.gradients_bytes, (1 << 30) + (3 << 30) // 4)
    rows = {r.layout: r for r in memory.layout_table(
        tables, num_devices=4, global_batch_size=4, shared_memory=False,
        activation_bytes_per_example=0, capacity_bytes=1 << 40).rows}
    self.assertEqual(rows["ZeRO 3"].parameters_bytes,
                     stage3.parameters_bytes)
    self.assertEqual(rows["ZeRO 3"].gradients_bytes, stage3.gradients_bytes)
    # Stage 2's per-step gradients stay whole (no reduce-scatter).
    self.assertEqual(
        memory.sharded_estimate(estimate, num_replicas=4, stage=2),
        memory.sharded_estimate(estimate, num_replicas=4))

  def test_peak_rss_is_this_process(self):
    self.assertGreater(memory.peak_rss_bytes(), 50 << 20)
    self.assertGreater(memory.host_memory_bytes(), memory.peak_rss_bytes())
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    if not tf.config.list_physical_devices("GPU"):
      self.assertEqual(memory.device_memory(), {})
    self.assertEqual(memory.format_bytes(3 << 20), "3.0 MiB")


_GIB = 1 << 30


def _adam_state(gib_of_weights: float) -> memory.ModelMemory:
  """fp32 Adam: weights W, gradients W, two moments 2W (no scalars)."""
  w = int(gib_of_weights * _GIB)
  return memory.ModelMemory(parameters_bytes=w, gradients_bytes=w,
                            optimizer_bytes=2 * w, num_parameters=w // 4)


class LayoutTableTest(absltest.TestCase):
  """`layout_table` on synthetic sizes: 4 GPUs of 16 GiB each, batch 32."""

  def table(self, estimate, **kwargs):
    options = dict(num_devices=4, capacity_bytes=16 * _GIB,
                   shared_memory=False, global_batch_size=32,
                   optimizer="adam")
    options.update(kwargs)
    return memory.layout_table(estimate, **options)

  def rows(self, choice):
    return {r.layout: r for r in choice.rows}

  def test_every_layout_side_by_side(self):
    choice = self.table(_adam_state(2), activation_bytes_per_example=1 << 20,
                        tensor_parallel_bytes=_GIB,
                        tensor_parallel_flag="--tensor_parallel=4")
    self.assertEqual([r.layout for r in choice.rows], list(memory.LAYOUTS))
    rows = self.rows(choice)
    state = {name: r.per_device_bytes - r.activations_bytes
             for name, r in rows.items()}
    # Plain: 16 bytes per parameter (8 GiB); ZeRO 1 and 2: 4 + 4 + 8/4;
    # ZeRO 3: 16/4; one of 2 pipeline stages: 16/2; tensor parallel over 4
    # with half the weights split: 4 + 4/4.
    self.assertEqual(state, {
        "data parallel": 8 * _GIB, "ZeRO 1": 5 * _GIB, "ZeRO 2": 5 * _GIB,
        "ZeRO 3": 2 * _GIB, "pipeline": 4 * _GIB,
        "tensor parallel": 5 * _GIB})
    # Activations: 8 examples per replica; a pipeline stage (GPipe, M = P =
    # 2) half the whole batch's; tensor parallelism the whole batch's.
    self.assertEqual(rows["data parallel"].activations_bytes, 8 << 20)
    self.assertEqual(rows["ZeRO 3"].activations_bytes, 8 << 20)
    self.assertEqual(rows["pipeline"].activations_bytes, 16 << 20)
    self.assertEqual(rows["pipeline"].flags,
                     "--distribution_strategy=one_device --pipeline_stages=2"
                     " --num_microbatches=2")
    self.assertEqual(rows["tensor parallel"].activations_bytes, 32 << 20)
    self.assertTrue(all(r.fits for r in choice.rows))
    text = choice.render()
    self.assertIn("Recommended layout: data parallel (no extra flags)", text)
    for name in memory.LAYOUTS:
      self.assertIn(name, text)
    self.assertEqual(choice.to_dict()["recommended"], "data parallel")

  def test_one_f_one_b_keeps_fewer_micro_batches_in_flight(self):
    rows = self.rows(self.table(_adam_state(2),
                                activation_bytes_per_example=1 << 20,
                                num_microbatches=8, pipeline_schedule="1f1b"))
    # Stage 0 holds P = 2 of the 8 micro-batches of 4 examples, each half
    # the layers' outputs: 2 * 4 * 1 MiB / 2.
    self.assertEqual(rows["pipeline"].activations_bytes, 4 << 20)

  def test_state_that_fits_recommends_plain_data_parallelism(self):
    choice = self.table(_adam_state(2))  # 8 GiB of 16.
    self.assertEqual(choice.recommended.layout, "data parallel")
    self.assertEqual(choice.recommended.flags, "")

  def test_optimizer_state_too_big_recommends_zero_1(self):
    # 4.5 GiB of weights: 18 GiB plain; 4.5 + 4.5 + 9/4 with ZeRO 1.
    estimate = _adam_state(4.5)
    choice = self.table(estimate)
    self.assertFalse(self.rows(choice)["data parallel"].fits)
    self.assertEqual(choice.recommended.layout, "ZeRO 1")
    self.assertIn("Recommended layout: ZeRO 1 (--zero_stage=1): 11.2 GiB "
                  "per device", choice.advice())
    # An optimizer that cannot be sharded (LAMB) skips ZeRO: the pipeline.
    lamb = self.table(estimate, optimizer="lamb")
    self.assertFalse(self.rows(lamb)["ZeRO 1"].available)
    self.assertIn("--optimizer=lamb cannot be sharded",
                  self.rows(lamb)["ZeRO 1"].note)
    self.assertEqual(lamb.recommended.layout, "pipeline")

  def test_weights_too_big_recommend_zero_3_or_pipeline(self):
    # 8 GiB of weights on 15 GiB devices: 32 GiB plain, 8 + 8 + 16/4 = 20
    # with ZeRO 1 and 2, 32/4 = 8 with ZeRO 3; pipeline stages hold 32/2 =
    # 16 (too much) or 32/3.
    estimate = _adam_state(8)
    choice = self.table(estimate, capacity_bytes=15 * _GIB)
    rows = self.rows(choice)
    for name in ("data parallel", "ZeRO 1", "ZeRO 2"):
      self.assertFalse(rows[name].fits, name)
    self.assertTrue(rows["ZeRO 3"].fits)
    self.assertEqual(choice.recommended.layout, "ZeRO 3")
    self.assertEqual(choice.recommended.flags, "--zero_stage=3")
    # The pipeline row takes the fewest stages that fit: 3.
    self.assertEqual(rows["pipeline"].devices, 3)
    self.assertTrue(rows["pipeline"].fits)
    # Without ZeRO (an unshardable optimizer), the pipeline.
    self.assertEqual(self.table(estimate, optimizer="lamb",
                                capacity_bytes=15 * _GIB).recommended.flags,
                     "--distribution_strategy=one_device --pipeline_stages=3"
                     " --num_microbatches=3")

  def test_an_uneven_cut_needs_more_stages(self):
    # The same 32 GiB, but one layer holds 60% of the weights: 2 and 3
    # stages leave a stage with 60% (19.2 GiB: too much); the first cut
    # whose heaviest stage holds 40% (12.8 GiB) takes 4 stages.
    choice = self.table(_adam_state(8), capacity_bytes=15 * _GIB,
                        optimizer="lamb",
                        pipeline_shares={2: 0.6, 3: 0.6, 4: 0.4})
    row = self.rows(choice)["pipeline"]
    self.assertEqual(row.devices, 4)
    self.assertEqual(row.parameters_bytes, math.ceil(8 * _GIB * 0.4))

  def test_a_refused_layout_is_shown_but_not_recommended(self):
    choice = self.table(_adam_state(8), capacity_bytes=15 * _GIB,
                        refused={"ZeRO 3": "--zero_stage=3 is not offered"})
    zero3 = self.rows(choice)["ZeRO 3"]
    self.assertFalse(zero3.available)
    self.assertEqual(zero3.per_device_bytes, 8 * _GIB)
    self.assertIn("n/a: --zero_stage=3 is not offered", choice.render())
    self.assertEqual(choice.recommended.layout, "pipeline")

  def test_gradient_accumulators_are_what_zero_2_adds(self):
    rows = self.rows(self.table(_adam_state(2), gradient_accumulation=True))
    self.assertEqual(rows["data parallel"].gradients_bytes, 4 * _GIB)
    self.assertEqual(rows["ZeRO 1"].gradients_bytes, 4 * _GIB)
    self.assertEqual(rows["ZeRO 2"].gradients_bytes, 2 * _GIB + _GIB // 2)
    self.assertEqual(rows["ZeRO 3"].gradients_bytes, _GIB)

  def test_nothing_fits(self):
    choice = self.table(_adam_state(20))  # 80 GiB: 20 per device at best.
    self.assertIsNone(choice.recommended)
    self.assertIn("No layout fits 16.0 GiB: the smallest is ZeRO 3 "
                  "(--zero_stage=3) at 20.0 GiB", choice.advice())

  def test_devices_sharing_one_memory_count_together(self):
    # 4 logical CPU devices on a 24 GiB host: plain holds 4 copies of
    # 8 GiB; ZeRO 3 holds the state once.
    choice = self.table(_adam_state(2), capacity_bytes=24 * _GIB,
                        shared_memory=True)
    rows = self.rows(choice)
    self.assertEqual(rows["data parallel"].needed_bytes, 32 * _GIB)
    self.assertEqual(rows["ZeRO 3"].needed_bytes, 8 * _GIB)
    self.assertEqual(choice.recommended.layout, "ZeRO 1")  # 4 x 5 GiB.

  def test_one_device_offers_no_split_and_tensor_parallel_needs_a_flag(self):
    choice = self.table(_adam_state(8), num_devices=1)
    rows = self.rows(choice)
    for name in memory.LAYOUTS[1:]:
      self.assertFalse(rows[name].available, name)
    self.assertIsNone(choice.recommended)
    rows = self.rows(self.table(_adam_state(1), tensor_parallel_bytes=_GIB))
    self.assertIn("--tensor_parallel splits only --model=transformer",
                  rows["tensor parallel"].note)
    rows = self.rows(self.table(_adam_state(1)))
    self.assertIn("no layer of this model can be split",
                  rows["tensor parallel"].note)

  def test_tensor_parallel_is_recommended_with_its_flags(self):
    # The built-in Transformer's row names --tensor_parallel; with the
    # layouts before it refused, it is the one recommended.
    flags = tensor_parallel_options.flags_for("transformer", 4)
    self.assertEqual(flags,
                     "--distribution_strategy=mirrored --tensor_parallel=4")
    self.assertEqual(tensor_parallel_options.flags_for("cnn", 4), "")
    self.assertEqual(tensor_parallel_options.flags_for("transformer", 1), "")
    refused = {name: "refused here" for name in memory.LAYOUTS[:-1]}
    choice = self.table(_adam_state(2), tensor_parallel_bytes=_GIB,
                        tensor_parallel_flag=flags, refused=refused)
    self.assertEqual(choice.recommended.layout, "tensor parallel")
    self.assertIn(f"Recommended layout: tensor parallel ({flags})",
                  choice.render())

  def test_bad_arguments_are_refused(self):
    with self.assertRaisesRegex(ValueError, "num_devices=0"):
      self.table(_adam_state(1), num_devices=0)
    with self.assertRaisesRegex(ValueError, "pipeline_schedule='1F1B'"):
      self.table(_adam_state(1), pipeline_schedule="1F1B")

  def test_expert_parallel_row_for_a_model_with_experts(self):
    # Half the trainable weights are experts (E = 8) on 4 devices: E_p = 4
    # divides both; the experts' state / 4, the rest whole.
    choice = self.table(_adam_state(2), activation_bytes_per_example=1 << 20,
                        expert_bytes=_GIB, num_experts=8)
    self.assertEqual([r.layout for r in choice.rows],
                     [*memory.LAYOUTS, *memory.OPTIONAL_LAYOUTS])
    row = self.rows(choice)["expert parallel"]
    self.assertEqual(row.per_device_bytes - row.activations_bytes, 5 * _GIB)
    self.assertEqual(row.activations_bytes, 8 << 20)
    self.assertEqual(row.flags, "--distribution_strategy=mirrored "
                     "--expert_parallel=4")
    # Beside ZeRO (tfdist/parallel/experts/zero.py): the non-expert
    # optimizer state / 4 (1 GiB of 2 GiB of moments), the experts' / 4.
    row = self.rows(choice)["expert parallel + ZeRO 1"]
    self.assertEqual(row.optimizer_bytes, _GIB)
    self.assertEqual(row.per_device_bytes - row.activations_bytes,
                     3 * _GIB + _GIB // 2)
    self.assertEqual(row.flags, "--distribution_strategy=mirrored "
                     "--expert_parallel=4 --zero_stage=1")
    # ZeRO 2 under accumulation: the non-expert accumulators / 4 too.
    rows = self.rows(self.table(_adam_state(2), expert_bytes=_GIB,
                                num_experts=8, gradient_accumulation=True))
    self.assertEqual(rows["expert parallel"].gradients_bytes,
                     2 * _GIB + _GIB // 2)
    self.assertEqual(rows["expert parallel + ZeRO 2"].gradients_bytes,
                     _GIB + _GIB // 4 + _GIB // 4 + _GIB // 4)
    self.assertEqual(rows["expert parallel + ZeRO 1"].gradients_bytes,
                     2 * _GIB + _GIB // 2)
    lamb = self.rows(self.table(_adam_state(2), expert_bytes=_GIB,
                                num_experts=8, optimizer="lamb"))
    self.assertTrue(lamb["expert parallel"].available)
    self.assertFalse(lamb["expert parallel + ZeRO 1"].available)
    self.assertIn("--optimizer=lamb cannot be sharded",
                  lamb["expert parallel + ZeRO 2"].note)
    # 6 experts on 4 devices: E_p = 2. 3 experts: no common divisor.
    row = self.rows(self.table(_adam_state(2), expert_bytes=_GIB,
                               num_experts=6))["expert parallel"]
    self.assertIn("--expert_parallel=2", row.flags)
    self.assertEqual(row.parameters_bytes, (3 * _GIB) // 2)  # 1 + 1/2
    row = self.rows(self.table(_adam_state(2), expert_bytes=_GIB,
                               num_experts=3))["expert parallel"]
    self.assertFalse(row.available)
    self.assertIn("4 devices and 3 experts share no divisor", row.note)
    # No experts: no row.
    self.assertNotIn("expert parallel", self.rows(self.table(_adam_state(2))))

  def test_experts_are_measured_in_the_model(self):
    from tfdist.parallel.experts.layer import MixtureOfExperts  # pylint: disable=g-import-not-at-top
    inputs = keras.Input((3, 4))
    x = MixtureOfExperts(num_experts=4, hidden_dim=8)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    facts = memory.model_facts(model)
    # Each expert: Dense 4->8 and 8->4 with biases: 32+8+32+4 = 76 floats.
    self.assertEqual(facts["expert_bytes"], 4 * 76 * 4)
    self.assertEqual(facts["num_experts"], 4)

  def test_activations_of_a_functional_model_per_example(self):
    model = _model()  # Dense 32, batch norm 32, Dense 3, float32.
    self.assertEqual(memory.activation_bytes_per_example(model),
                     (32 + 32 + 3) * 4)

  def test_every_mode_measures_the_model(self):
    inputs = keras.Input((5,), dtype="int32")
    x = keras.layers.Embedding(11, 4)(inputs)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(6)(x)
    model = keras.Model(inputs, keras.layers.Dense(3)(x))
    facts = memory.model_facts(model)
    self.assertEqual([v.path for v in facts["replicated_variables"]],
                     [model.layers[1].embeddings.path])
    self.assertEqual(facts["tensor_parallel_bytes"], 0)  # No Transformer.
    # Embedding 44, Dense 20*6+6 = 126, Dense 6*3+3 = 21 weights (float32):
    # the balanced cut into two stages holds 44 and 147 of 191 (cutting
    # after the first Dense would hold 170).
    self.assertAlmostEqual(facts["pipeline_shares"][2], 147 / 191)
    self.assertLessEqual(max(facts["pipeline_shares"]), 8)


if __name__ == "__main__":
  absltest.main()
