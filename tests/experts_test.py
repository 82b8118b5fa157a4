"""MixtureOfExperts (tfdist/parallel/experts/layer.py) against an
independent NumPy reference of the same routing (GShard Algorithm 2 for
top-2, Switch for top-1: token loops, not the layer's masks and cumsums),
its auxiliary losses against hand-computed values, its gradients, ties,
serialization, and training in Keras's fit and tfdist.fit."""

import math
import os
import re
import shutil
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf

import tfdist
from tests import testutil
from tfdist.config import TrainConfig
from tfdist.parallel.experts import layer as moe_layer
from tfdist.parallel.experts.layer import MixtureOfExperts


def _expert_numpy(expert, x):
  """A relu FeedForwardExpert, in float64 NumPy from its weights."""
  w1, b1 = (np.asarray(v, np.float64) for v in expert.hidden.get_weights())
  w2, b2 = (np.asarray(v, np.float64)
            for v in expert.output_dense.get_weights())
  return np.maximum(x @ w1 + b1, 0.0) @ w2 + b2


def reference(moe, x):
  """(outputs, kept [tokens, k] bool, expert ids [tokens, k]) of `moe` on
  `x` by token loops: first choices in token order, then second choices,
  each expert full at C = ceil(k * group_size * cf / E)."""
  x = np.asarray(x, np.float64)
  flat = x.reshape(-1, x.shape[-1])
  size = moe.group_size or len(flat)
  e, k = moe.num_experts, moe.top_k
  slots = math.ceil(k * size * moe.capacity_factor / e)
  router = np.asarray(moe.router.get_weights()[0], np.float64)
  out = np.zeros_like(flat)
  kept = np.zeros((len(flat), k), bool)
  chosen = np.zeros((len(flat), k), int)
  for start in range(0, len(flat), size):
    group = range(start, start + size)
    logits = flat[start:start + size] @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    for t in group:
      p = probs[t - start].copy()
      chosen[t, 0] = int(np.argmax(p))  # The first of equal maxima.
      p[chosen[t, 0]] = -1.0
      if k == 2:
        chosen[t, 1] = int(np.argmax(p))
    load = [0] * e
    for choice in range(k):
      for t in group:
        if load[chosen[t, choice]] < slots:
          load[chosen[t, choice]] += 1
          kept[t, choice] = True
    for t in group:
      gates = probs[t - start][chosen[t]]
      if k == 2:
        gates = gates / gates.sum()
      for choice in range(k):
        if kept[t, choice]:
          expert = moe.experts[chosen[t, choice]]
          out[t] += gates[choice] * _expert_numpy(expert, flat[t:t + 1])[0]
  return out.reshape(x.shape), kept, chosen


def _moe(**kwargs):
  args = dict(num_experts=4, hidden_dim=8, activation="relu",
              kernel_initializer=keras.initializers.RandomNormal(stddev=0.5,
                                                                 seed=1))
  args.update(kwargs)
  return MixtureOfExperts(**args)


class RoutingTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("top1_no_drop", 1, 4.0, None),
      ("top1_dropping", 1, 0.5, None),
      ("top2_no_drop", 2, 2.0, None),
      ("top2_dropping", 2, 0.5, None),
      ("top2_groups_dropping", 2, 0.75, 6))
  def test_matches_the_numpy_reference(self, top_k, capacity_factor,
                                       group_size):
    moe = _moe(top_k=top_k, capacity_factor=capacity_factor,
               group_size=group_size)
    x = tf.random.stateless_normal([3, 6, 5], seed=(1, 2))
    got = moe(x).numpy()
    want, kept, chosen = reference(moe, x.numpy())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    stats = moe.routing_statistics()
    per_expert = np.zeros(4)
    np.add.at(per_expert, chosen[kept], 1)
    np.testing.assert_array_equal(stats["tokens_per_expert"], per_expert)
    self.assertAlmostEqual(float(stats["dropped_fraction"]),
                           1.0 - kept.mean(), places=6)
    # Which tokens dropped (all their choices): their outputs are zero.
    gone = ~kept.any(axis=1)
    if capacity_factor >= 2.0:
      self.assertFalse((~kept).any())
    else:
      self.assertTrue((~kept).any())  # The case really drops.
    np.testing.assert_array_equal(got.reshape(-1, 5)[gone], 0.0)

  def test_rank_two_input_and_unknown_batch_match_the_reference(self):
    moe = _moe(top_k=2, capacity_factor=0.75)
    x = tf.random.stateless_normal([10, 5], seed=(3, 4))
    got = moe(x).numpy()
    want, _, _ = reference(moe, x.numpy())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    traced = tf.function(
        moe, input_signature=[tf.TensorSpec([None, 5], tf.float32)])
    np.testing.assert_allclose(traced(x).numpy(), want, rtol=1e-5,
                               atol=1e-5)

  def test_ties_go_to_the_lower_expert_then_the_earlier_token(self):
    # A zero router scores every expert 1/E: first choices all expert 0,
    # second choices all expert 1; C = ceil(2 * 4 * 1.0 / 4) = 2.
    moe = _moe(top_k=2, capacity_factor=1.0,
               kernel_initializer="zeros")
    x = tf.random.stateless_normal([4, 5], seed=(5, 6))
    got = moe(x).numpy()
    e0 = _expert_numpy(moe.experts[0], x.numpy())
    e1 = _expert_numpy(moe.experts[1], x.numpy())
    np.testing.assert_allclose(got[:2], 0.5 * (e0 + e1)[:2], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_array_equal(got[2:], 0.0)  # Tokens 2 and 3 dropped.
    stats = moe.routing_statistics()
    np.testing.assert_array_equal(stats["tokens_per_expert"], [2, 2, 0, 0])
    self.assertAlmostEqual(float(stats["dropped_fraction"]), 0.5)

  def test_auxiliary_losses_equal_hand_computed_values(self):
    # Zero router: probs 1/4 each; every first choice is expert 0, so
    # f = [1, 0, 0, 0], P = [1/4] * 4: E * sum f P = 4 * 1/4 = 1; the
    # z-loss is logsumexp(0, 0, 0, 0)^2 = log(4)^2.
    moe = _moe(top_k=1, kernel_initializer="zeros",
               load_balancing_loss_weight=0.5, router_z_loss_weight=0.25)
    moe(tf.ones([6, 5]))
    balance, z_loss = (float(v) for v in moe.losses)
    self.assertAlmostEqual(balance, 0.5 * 1.0, places=6)
    self.assertAlmostEqual(z_loss, 0.25 * math.log(4) ** 2, places=5)
    # A router giving two tokens logits (ln 3, 0) and (0, ln 3): probs
    # (3/4, 1/4) and (1/4, 3/4), f = (1/2, 1/2), P = (1/2, 1/2):
    # 2 * (1/4 + 1/4) = 1; logsumexp = ln 4 for both.
    moe = MixtureOfExperts(2, 4, top_k=1, router_z_loss_weight=1.0,
                           load_balancing_loss_weight=1.0)
    moe.build((None, 2))
    moe.router.set_weights([np.log(3.0) * np.eye(2, dtype=np.float32)])
    moe(tf.constant([[1.0, 0.0], [0.0, 1.0]]))
    balance, z_loss = (float(v) for v in moe.losses)
    self.assertAlmostEqual(balance, 1.0, places=6)
    self.assertAlmostEqual(z_loss, math.log(4) ** 2, places=5)
    # Both tokens on expert 0 (rows of ln 3 in column 0): f = (1, 0),
    # P = (3/4, 1/4): 2 * 3/4 = 1.5.
    moe.router.set_weights([np.log(3.0) * np.array(
        [[1, 0], [1, 0]], np.float32)])
    moe(tf.constant([[1.0, 0.0], [0.0, 1.0]]))
    self.assertAlmostEqual(float(moe.losses[0]), 1.5, places=6)
    self.assertAlmostEqual(
        float(moe.routing_statistics()["load_balancing_loss"]), 1.5,
        places=6)

  def test_zero_weights_add_no_losses(self):
    moe = _moe(load_balancing_loss_weight=0.0, router_z_loss_weight=0.0)
    moe(tf.ones([4, 5]))
    self.assertEmpty(moe.losses)
    self.assertGreater(
        float(moe.routing_statistics()["router_z_loss"]), 0.0)

  def test_gradients_reach_the_router_and_the_experts(self):
    moe = _moe(top_k=2, capacity_factor=2.0)
    x = tf.random.stateless_normal([8, 5], seed=(7, 8))
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(moe(x)))
    grads = tape.gradient(loss, moe.trainable_weights)
    named = {w.path: g for w, g in zip(moe.trainable_weights, grads)}
    self.assertGreater(float(tf.norm(named[moe.router.kernel.path])), 0.0)
    used = set(np.flatnonzero(
        moe.routing_statistics()["tokens_per_expert"].numpy()))
    self.assertGreater(len(used), 1)
    for i in used:
      kernel = moe.experts[i].hidden.kernel.path
      self.assertGreater(float(tf.norm(named[kernel])), 0.0)
    # The losses alone train the router too.
    with tf.GradientTape() as tape:
      moe(x)
      aux = tf.add_n(moe.losses)
    self.assertGreater(float(tf.norm(
        tape.gradient(aux, moe.router.kernel))), 0.0)


class ArgumentsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("no_experts", dict(num_experts=0), "num_experts=0"),
      ("top3", dict(top_k=3), "top_k=3.*top_k=1 .*or top_k=2"),
      ("top_k_above_e", dict(num_experts=1, top_k=2),
       "top_k=2 with num_experts=1.*top_k <= num_experts"),
      ("zero_capacity", dict(capacity_factor=0.0),
       "capacity_factor=0.0.*capacity 0.*capacity_factor > 0"),
      ("group", dict(group_size=0), "group_size=0"),
      ("weight", dict(router_z_loss_weight=-1.0),
       "router_z_loss_weight=-1.0"),
      ("no_hidden", dict(hidden_dim=None), "hidden_dim=None"))
  def test_bad_arguments_are_refused_by_name(self, changes, message):
    args = dict(num_experts=4, hidden_dim=8)
    args.update(changes)
    with self.assertRaisesRegex(ValueError, message):
      MixtureOfExperts(**args)

  def test_bad_inputs_are_refused(self):
    with self.assertRaisesRegex(ValueError, r"input shape \(2, 3, 4, 5\)"):
      _moe()(tf.ones([2, 3, 4, 5]))
    with self.assertRaisesRegex(ValueError, "group_size=4 .* 6 tokens"):
      _moe(group_size=4)(tf.ones([2, 3, 5]))
    moe = _moe()
    moe(tf.ones([2, 5]))
    with self.assertRaises(ValueError):  # Keras's input spec: d_model.
      moe(tf.ones([2, 6]))


@keras.saving.register_keras_serializable(package="tfdist_test")
class _Doubler(keras.layers.Layer):
  """An expert with one weight: x * scale."""

  def __init__(self, init=2.0, **kwargs):
    super().__init__(**kwargs)
    self.init = init

  def build(self, input_shape):
    self.scale = self.add_weight(shape=(), initializer=keras.initializers
                                 .Constant(self.init), name="scale")

  def call(self, x):
    return x * keras.ops.cast(self.scale, x.dtype)

  def get_config(self):
    return {**super().get_config(), "init": self.init}


class ModelsTest(absltest.TestCase):

  def tearDown(self):
    keras.config.set_dtype_policy("float32")
    super().tearDown()

  def test_serialization_round_trip(self):
    for moe in (_moe(top_k=1, group_size=3, capacity_factor=1.5),
                MixtureOfExperts(3, expert=_Doubler,
                                 expert_config={"init": 3.0})):
      inputs = keras.Input((3, 5))
      model = keras.Model(inputs, moe(inputs))
      x = np.random.default_rng(0).normal(size=(2, 3, 5)).astype("float32")
      path = tempfile.mkdtemp() + "/moe.keras"
      self.addCleanup(shutil.rmtree, path.rsplit("/", 1)[0])
      model.save(path)
      loaded = keras.saving.load_model(path)
      self.assertEqual(loaded.layers[1].get_config(), moe.get_config())
      np.testing.assert_allclose(loaded(x), model(x), rtol=1e-6)
    self.assertEqual(moe.get_config()["expert"], "tfdist_test>_Doubler")
    restored = MixtureOfExperts.from_config(moe.get_config())
    self.assertIs(restored.expert, _Doubler)
    self.assertLen(restored.experts, 3)

  def test_checkpoints_name_every_expert_and_restore(self):
    moe = _moe()
    x = tf.random.stateless_normal([6, 5], seed=(9, 9))
    want = moe(x).numpy()
    directory = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, directory)
    path = tf.train.Checkpoint(layer=moe).save(directory + "/ckpt")
    names = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    for i in range(4):
      self.assertIn(f"layer/expert_{i}/hidden/_kernel/.ATTRIBUTES/"
                    "VARIABLE_VALUE", names)
    fresh = _moe(kernel_initializer="zeros")
    fresh(x)
    tf.train.Checkpoint(layer=fresh).restore(path).assert_consumed()
    np.testing.assert_allclose(fresh(x).numpy(), want, rtol=1e-6)

  def test_a_function_makes_the_experts(self):
    moe = MixtureOfExperts(2, top_k=1, expert=lambda i: _Doubler(i + 1.0))
    x = tf.ones([4, 3])
    y = moe(x).numpy()
    gates = moe.route(tf.reshape(x, [1, 4, 3]))["combine"].numpy()
    scales = (gates.sum(axis=(0, 3)) * [1.0, 2.0]).sum(-1)
    np.testing.assert_allclose(y, scales[:, None] * np.ones([4, 3]),
                               rtol=1e-6)
    with self.assertRaisesRegex(ValueError, "returned int"):
      MixtureOfExperts(2, expert=lambda i: i)

  def test_subclassed_model_under_mixed_bfloat16(self):
    keras.config.set_dtype_policy("mixed_bfloat16")

    class Block(keras.Model):

      def __init__(self):
        super().__init__()
        self.moe = MixtureOfExperts(4, 16, top_k=2)
        self.out = keras.layers.Dense(1, dtype="float32")

      def call(self, x):
        return self.out(keras.ops.mean(x + self.moe(x), axis=1))

    model = Block()
    x = np.random.default_rng(1).normal(size=(8, 4, 6)).astype("float32")
    y = model(x)
    self.assertEqual(y.dtype, tf.float32)
    self.assertEqual(model.moe.router.kernel.dtype, "float32")
    self.assertEqual(model.moe.compute_dtype, "bfloat16")
    self.assertEqual(model.moe(x).dtype, tf.bfloat16)
    self.assertTrue(all(l.dtype == tf.float32 for l in model.moe.losses))
    model.compile(optimizer="adam", loss="mse")
    history = model.fit(x, np.ones((8, 1)), batch_size=4, epochs=1,
                        verbose=0)
    self.assertTrue(np.isfinite(history.history["loss"]).all())

  def test_statistics_are_written_inside_a_replicas_control_flow(self):
    # tfdist's evaluation step calls the model under a tf.cond in
    # strategy.run: statistics synchronized on write would need a
    # merge_call there, which TensorFlow refuses.
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
      moe = _moe(top_k=1, capacity_factor=4.0)
      moe.build((None, 5))

    @tf.function
    def step(x):
      return strategy.run(lambda x: tf.cond(
          tf.shape(x)[0] > 0, lambda: moe(x), lambda: tf.zeros_like(x)),
                          (x,))

    step(tf.ones([4, 5]))
    stats = moe.routing_statistics()
    self.assertEqual(float(tf.reduce_sum(stats["tokens_per_expert"])), 4.0)

  def test_model_statistics_name_each_layer(self):
    inputs = keras.Input((4, 6))
    x = MixtureOfExperts(2, 8, top_k=1, name="first")(inputs)
    outputs = MixtureOfExperts(3, 8, top_k=1, name="second")(x)
    model = keras.Model(inputs, outputs)
    model(np.ones((2, 4, 6), np.float32))
    stats = moe_layer.model_statistics(model)
    self.assertEqual(sorted(stats), sorted(
        f"{layer}/{name}" for layer in ("first", "second")
        for name in moe_layer.STATISTICS))
    self.assertEqual(stats["second/tokens_per_expert"].shape, (3,))
    # 8 equal tokens pick the same expert, which takes ceil(8 * 1.25 / 2).
    self.assertEqual(sorted(stats["first/tokens_per_expert"].numpy()),
                     [0.0, 5.0])
    self.assertAlmostEqual(float(stats["first/dropped_fraction"]), 3 / 8)
    self.assertEqual(moe_layer.model_statistics(keras.Sequential()), {})

  def test_functional_model_trains_with_keras_fit(self):
    # Seeded: with the initial weights earlier tests' draws left, the loss
    # could rise over 3 epochs (it failed after mode_test..controller_test).
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4, 6))
    x = inputs + MixtureOfExperts(4, 16, top_k=1, group_size=4)(inputs)
    outputs = keras.layers.Dense(1)(keras.layers.Flatten()(x))
    model = keras.Model(inputs, outputs)
    router = model.layers[1].router.kernel
    before = router.numpy().copy()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.random.default_rng(2).normal(size=(16, 4, 6)).astype("float32")
    y = x.sum(axis=(1, 2))[:, None]
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0)
    self.assertLess(history.history["loss"][-1], history.history["loss"][0])
    self.assertFalse(np.allclose(router.numpy(), before))

  def test_trains_with_tfdist_fit_on_one_device(self):
    def model_fn():
      inputs = keras.Input((4, 6))
      x = inputs + tfdist.MixtureOfExperts(4, 16, top_k=2,
                                           group_size=4)(inputs)
      outputs = keras.layers.Dense(1)(keras.layers.Flatten()(x))
      model = keras.Model(inputs, outputs)
      model.compile(loss="mse")
      return model

    directory = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, directory, ignore_errors=True)
    x = np.random.default_rng(3).normal(size=(32, 4, 6)).astype("float32")
    result = tfdist.fit(
        model_fn, x=x, y=x.sum(axis=(1, 2)), verbose=0,
        config=TrainConfig(model_dir=directory, train_steps=4, batch_size=8,
                           log_steps=2, distribution_strategy="one_device",
                           optimizer="adam", base_learning_rate=0.01,
                           base_batch_size=8, warmup_steps=0))
    self.assertEqual(result["final_step"], 4)
    self.assertTrue(np.isfinite(result["history"]["loss"]).all())

  def test_the_guides_example_runs(self):
    guide = open(os.path.join(testutil.REPO_ROOT, "docs", "guides",
                              "experts.md")).read()
    example = re.search(
        r"<!-- run: tests/experts_test.py layer-example -->\n"
        r"```python\n(.*?)```", guide, re.S).group(1)
    scope = {}
    exec(compile(example, "docs/guides/experts.md (layer-example)",
                 "exec"), scope)  # pylint: disable=exec-used
    self.assertEqual(scope["y"].shape, (2, 8, 16))
    # Kept slots and dropped ones add up to k * tokens = 2 * 16.
    self.assertAlmostEqual(
        float(tf.reduce_sum(scope["stats"]["tokens_per_expert"])) +
        32 * float(scope["stats"]["dropped_fraction"]), 32.0, places=4)

  def test_the_plans_expert_shape_is_the_built_transformers(self):
    # The --dry_run plan counts the all-to-all bytes from the flags
    # (models.experts_shape); the built model must have those layers.
    from tfdist import config as config_lib  # pylint: disable=g-import-not-at-top
    from tfdist import models  # pylint: disable=g-import-not-at-top
    from tfdist.core.dataset_spec import DatasetSpec  # pylint: disable=g-import-not-at-top
    task = config_lib.TaskConfig(
        model="transformer", transformer_layers=3, transformer_experts=4,
        experts_top_k=1, experts_capacity_factor=2.0)
    spec = DatasetSpec(name="text", input_shape=(24,), vocabulary_size=50,
                       num_classes=2, parse_fn=lambda record: record)
    shape = models.experts_shape("transformer", task, spec)
    model = models.transformer.build_transformer(
        sequence_length=24, vocabulary_size=50, num_classes=2,
        num_layers=3, experts=models.transformer_experts(task))
    layers = moe_layer.moe_layers(model)
    self.assertEqual(shape.layers, len(layers))
    for layer in layers:
      self.assertEqual((shape.num_experts, shape.top_k, shape.d_model,
                        shape.tokens_per_group),
                       (layer.num_experts, layer.top_k,
                        layer.input.shape[-1], layer.group_size))
      self.assertEqual(shape.capacity, moe_layer.capacity(
          layer.group_size, num_experts=layer.num_experts,
          top_k=layer.top_k, capacity_factor=layer.capacity_factor))
    self.assertEqual(shape.capacity, 12)  # ceil(1 * 24 * 2.0 / 4)
    self.assertIsNone(models.experts_shape(
        "transformer", config_lib.TaskConfig(model="transformer"), spec))
    self.assertIsNone(models.experts_shape("cnn", task, spec))

  def test_the_guides_plan_lines_are_the_modes(self):
    # docs/guides/experts.md shows the --dry_run lines of its command
    # (clothing reviews: 128 tokens an example, 64 a batch, 2 replicas).
    from tfdist import config as config_lib  # pylint: disable=g-import-not-at-top
    from tfdist import models  # pylint: disable=g-import-not-at-top
    from tfdist.core.dataset_spec import DatasetSpec  # pylint: disable=g-import-not-at-top
    from tfdist.parallel import modes  # pylint: disable=g-import-not-at-top
    task = config_lib.TaskConfig(model="transformer", transformer_experts=4)
    spec = DatasetSpec(name="text", input_shape=(128,), vocabulary_size=50,
                       num_classes=2, parse_fn=lambda record: record)
    lines = modes.get_mode("experts").plan_lines(modes.PlanFacts(
        parallelism=config_lib.ParallelismConfig(expert_parallel=2),
        num_replicas_in_sync=2, per_replica_batch_size=32,
        experts=models.experts_shape("transformer", task, spec)))
    self.assertEqual(testutil.shown_output("guides/experts.md"), lines)

  def test_the_plan_states_the_state_per_replica_under_zero(self):
    from tfdist import config as config_lib  # pylint: disable=g-import-not-at-top
    from tfdist.parallel import modes  # pylint: disable=g-import-not-at-top
    facts = dict(parallelism=config_lib.ParallelismConfig(expert_parallel=2),
                 num_replicas_in_sync=4, per_replica_batch_size=8)
    plain = modes.get_mode("experts").plan_lines(modes.PlanFacts(**facts))
    for stage in (1, 2):
      lines = modes.get_mode("experts").plan_lines(
          modes.PlanFacts(**facts, zero_stage=stage))
      self.assertEqual(lines[0], plain[0])
      self.assertEqual(lines[2:], plain[1:])
      self.assertEqual(
          lines[1],
          f"  optimizer state        ZeRO stage {stage}: each replica keeps "
          "1/4 of the non-expert weights' optimizer state (one shard of "
          "their flat buffer) and the whole state of its 1/2 of the "
          "experts" + (", and 1/4 of the non-expert gradient accumulators "
                       "(with --gradient_accumulation_steps)"
                       if stage == 2 else ""))
      if stage == 1:  # docs/guides/experts.md shows it.
        with open(os.path.join(testutil.REPO_ROOT, "docs", "guides",
                               "experts.md"), encoding="utf-8") as f:
          shown = re.search(
              r"<!-- not run: output of the plan for --expert_parallel=2 "
              r"--zero_stage=1[^>]*-->\n```text\n(.*?)```", f.read(),
              re.S).group(1)
        self.assertEqual(shown.splitlines(), [lines[1]])

  def test_capacity_formula(self):
    self.assertEqual(moe_layer.capacity(128, num_experts=8, top_k=2,
                                        capacity_factor=1.25), 40)
    self.assertEqual(moe_layer.capacity(3, num_experts=8, top_k=1,
                                        capacity_factor=1.0), 1)


if __name__ == "__main__":
  absltest.main()
