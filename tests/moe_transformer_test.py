"""The built-in Transformer with mixture-of-experts feed-forward layers
(`--transformer_experts`, models/transformer.py): its layers and
parameters, the flags' refusals at start (exit status 2), and a few
training steps of tfdist's trainer on a real slice of the clothing
reviews with the experts split over 2 logical CPU devices
(`--expert_parallel=2`), evaluated and exported as a SavedModel (every
expert, gathered) that serves."""

import contextlib
import glob
import io
import os
import re

from absl.testing import absltest
from absl.testing import flagsaver
import numpy as np
import tensorflow as tf

from tests import testutil
from tfdist.distribute import devices as devices_lib

# Before any op: the training test's 2 replicas (the others use one).
devices_lib.configure_cpu_devices(2)

# pylint: disable=g-import-not-at-top,wrong-import-position
from tfdist import errors
from tfdist import exit_codes
from tfdist import experiment
from tfdist import train
from tfdist.config import ModelBuilderConfig
from tfdist.config import TrainConfig
from tfdist.data import clothing_reviews
from tfdist.data import datasets
from tfdist.models import transformer
from tfdist.parallel.experts.layer import MixtureOfExperts
from tfdist.training.state import checkpointing
from tfdist.core import registry
# pylint: enable=g-import-not-at-top,wrong-import-position

_SIZES = dict(sequence_length=16, vocabulary_size=50, num_classes=1,
              embed_dim=8, num_heads=2, ff_dim=12, num_layers=2)


class BuildTest(absltest.TestCase):

  def test_experts_replace_each_feed_forward_pair(self):
    dense = transformer.build_transformer(**_SIZES)
    moe = transformer.build_transformer(
        **_SIZES, experts=transformer.ExpertsOptions(num_experts=4, top_k=1))
    layers = [l for l in moe.layers if isinstance(l, MixtureOfExperts)]
    self.assertEqual([l.name for l in layers],
                     ["block0_experts", "block1_experts"])
    self.assertEqual((layers[0].top_k, layers[0].group_size,
                      layers[0].experts[0].hidden_dim), (1, 16, 12))
    # Each expert is the dense pair's shape: the feed-forward parameters
    # grow 4-fold, plus per block an 8 x 4 router and 7 statistics
    # (tokens per expert, dropped fraction, the two losses).
    ff = 8 * 12 + 12 + 12 * 8 + 8
    self.assertEqual(moe.count_params() - dense.count_params(),
                     2 * (3 * ff + 8 * 4 + 7))
    tokens = np.zeros((3, 16), np.int64)
    tokens[:, :5] = 7
    self.assertEqual(moe(tokens).shape, (3, 1))
    self.assertLen(moe.losses, 4)  # Two losses per block.

  def test_experts_with_tensor_parallel_are_refused(self):
    with self.assertRaisesRegex(ValueError, "tensor_parallel=True"):
      transformer.build_transformer(
          **_SIZES, tensor_parallel=True,
          experts=transformer.ExpertsOptions(num_experts=2))


  def test_the_registered_builder_reads_the_run_config(self):
    spec = datasets.get_dataset_spec("clothing_reviews")
    _, build = registry.get_model_builder("transformer")
    config = ModelBuilderConfig(TrainConfig(
        model_dir="/tmp/unused", dataset="clothing_reviews",
        transformer_experts=2, experts_top_k=1, transformer_layers=1,
        experts_capacity_factor=2.0))
    layer = build(spec, config=config).get_layer("block0_experts")
    self.assertEqual((layer.num_experts, layer.top_k, layer.capacity_factor,
                      layer.group_size),
                     (2, 1, 2.0, clothing_reviews.SEQUENCE_LENGTH))
    dense = build(spec, config=ModelBuilderConfig(TrainConfig(
        model_dir="/tmp/unused", dataset="clothing_reviews")))
    self.assertFalse(any(isinstance(l, MixtureOfExperts)
                         for l in dense.layers))
    with self.assertRaisesRegex(errors.ConfigError,
                                "--transformer_experts=2 cannot run with "
                                "--tensor_parallel"):
      build(spec, config=config, tensor_parallel=True)


class FlagsTest(absltest.TestCase):

  def test_bad_settings_are_refused_by_flag(self):
    for fields, message in (
        (dict(transformer_experts=1),
         "--experts_top_k=2 is above --transformer_experts=1.*Pass "
         "--experts_top_k <= --transformer_experts"),
        (dict(transformer_experts=4, experts_top_k=3),
         "--experts_top_k=3 must be 1 or 2"),
        (dict(transformer_experts=-1), "--transformer_experts=-1"),
        (dict(transformer_experts=4, experts_capacity_factor=0.0),
         "--experts_capacity_factor=0.0 must be > 0.*dropping every token"),
        (dict(experts_router_z_loss_weight=-0.1),
         "--experts_router_z_loss_weight=-0.1 must be >= 0"),
        (dict(transformer_experts=4, model="transformer",
              dataset="clothing_reviews", pipeline_stages=2),
         "--transformer_experts=4 cannot run with --pipeline_stages=2"),
        (dict(transformer_experts=4, model="transformer",
              dataset="clothing_reviews", tensor_parallel=2,
              distribution_strategy="mirrored"),
         "--transformer_experts=4 cannot run with --tensor_parallel=2")):
      with self.subTest(message=message):
        with self.assertRaisesRegex(errors.ConfigError, message):
          TrainConfig(model_dir="/tmp/unused", **fields)

  def test_top_k_above_experts_exits_2_at_start(self):
    with flagsaver.flagsaver():
      train._parse_flags([  # pylint: disable=protected-access
          "tfdist.train", "--dataset=clothing_reviews",
          "--transformer_experts=1", "--experts_top_k=2",
          f"--model_dir={testutil.scratch_dir()}"])
      with contextlib.redirect_stderr(io.StringIO()) as err:
        with self.assertRaises(SystemExit) as caught:
          train.main(["tfdist.train"])
    self.assertEqual(caught.exception.code, exit_codes.CONFIG)
    self.assertIn("--experts_top_k=2 is above --transformer_experts=1",
                  err.getvalue())


  def test_resuming_with_other_experts_is_refused(self):
    before = {"config": {"model": "transformer", "transformer_experts": 0}}
    after = {"config": {"model": "transformer", "transformer_experts": 8}}
    with self.assertRaisesRegex(errors.IncompatibleResumeError,
                                "the model changed .*--transformer_experts "
                                "0 -> 8"):
      checkpointing.check_resume(before, after, checkpoint="ckpt-3",
                                 restored_step=3)


class TrainTest(absltest.TestCase):

  def test_trains_on_clothing_reviews_and_serves(self):
    data = os.path.join(testutil.scratch_dir(), "clothing_reviews")
    clothing_reviews.convert_clothing_reviews(data, limit=96, train_shards=1,
                                              test_shards=1)
    model_dir = testutil.scratch_dir()
    record = experiment.run_experiment(TrainConfig(
        model_dir=model_dir, dataset="clothing_reviews",
        train_files=f"{data}/train-*.tfrecord.gz",
        eval_files=f"{data}/test-*.tfrecord.gz",
        distribution_strategy="mirrored", num_cpu_devices=2,
        expert_parallel=2, transformer_experts=4,
        experts_top_k=2, experts_capacity_factor=1.0, transformer_layers=1,
        batch_size=8, train_steps=3, log_steps=3, seed=1))
    self.assertEqual(record["final_step"], 3)
    self.assertEqual(record["mirrored"]["expert_parallel"],
                     "2 replicas in 1 expert group(s) of 2: each replica "
                     "holds 1/2 of each MixtureOfExperts layer's experts (1 "
                     "layer(s), 4 experts in all) and trains on its share "
                     "of the batch")
    # The checkpoint holds every expert under the unsharded model's names.
    names = tf.train.load_checkpoint(os.path.join(
        model_dir, "checkpoints")).get_variable_to_shape_map()
    # Each of the 4 experts' [64, 128] hidden kernel, and Adam's 2 slots
    # of it, whole (a replica holds 2 experts).
    self.assertLen([n for n in names if names[n] == [64, 128]], 4 * 3)
    self.assertTrue(np.isfinite([h["loss"] for h in record["history"]]).all())
    # The routing of the log point's step, in TensorBoard (RoutingLog):
    # each expert's kept slots, summed over the replicas (8 examples x 128
    # tokens x top-2 = 2048 at most), the dropped fraction, the two losses.
    routing = {}
    for path in glob.glob(os.path.join(model_dir, "**", "*tfevents*"),
                          recursive=True):
      for event in tf.compat.v1.train.summary_iterator(path):
        for value in event.summary.value:
          if value.tag.startswith("routing/"):
            routing[value.tag.split("/", 2)[2]] = (
                event.step, float(tf.make_ndarray(value.tensor)))
    self.assertEqual({step for step, _ in routing.values()}, {3})
    tokens = [routing[f"tokens_expert_{i}"][1] for i in range(4)]
    dropped = routing["dropped_fraction"][1]
    self.assertTrue(0 <= dropped < 1, dropped)
    self.assertAlmostEqual(sum(tokens), (1 - dropped) * 2048, delta=1.0)
    self.assertGreater(routing["load_balancing_loss"][1], 0)
    with open(os.path.join(testutil.SOURCE_ROOT, "docs", "reference",
                           "tensorboard-tags.md"), encoding="utf-8") as f:
      page = f.read()
    for name in routing:  # Documented as routing/<layer>/<name>.
      self.assertIn("`routing/<layer>/" + re.sub(r"_\d+$", "_<i>", name) +
                    "`", page)
    self.assertTrue(np.isfinite(record["final_metrics"]["eval_loss"]))
    served = tf.saved_model.load(os.path.join(model_dir, "saved_model"))
    tokens = tf.constant(np.full((2, clothing_reviews.SEQUENCE_LENGTH), 3),
                         tf.int64)
    out = served.signatures["serving_default"](tokens=tokens)
    probability = next(iter(out.values())).numpy()
    self.assertEqual(probability.shape, (2, 1))
    self.assertTrue(((probability > 0) & (probability < 1)).all())


if __name__ == "__main__":
  absltest.main()
