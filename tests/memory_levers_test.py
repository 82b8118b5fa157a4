"""Gradient accumulation and activation recomputation equal what they replace.

Proofs, fp32 and `--deterministic` (op determinism), on a model
without batch normalization or dropout for accumulation (both make a
micro-batch differ from the big batch: batch statistics over fewer
examples, other random masks):

* K-step accumulation gives the same weights as one update on the K-times
  larger batch (relative difference <= 1e-5), on one device and on 2
  MirroredStrategy replicas; the check is sensitive (K plain small updates
  land far away);
* clipping acts once, on the accumulated gradient;
* fp16: an overflow in one micro-batch skips the whole update (loss scale
  halved, weights untouched, on every replica), and the next update trains
  as without accumulation (the accumulators were emptied);
* recomputation gives the same gradients (and batch-norm statistics) as
  without it, on the real ResNet, and really recomputes: the traced step
  runs the recomputed blocks' convolutions a second time.

These run in one child process (this file run as a script): 2 logical CPU
devices and `TF_ENABLE_ONEDNN_OPTS=0` (fp16 on a CPU) must be set before
TensorFlow starts. The child prints one JSON line.
"""

import json
import os

from absl.testing import absltest
import pytest

from tests import testutil
from tfdist import errors

_CHILD_ENV = "TFDIST_LEVERS_CHILD"


def _case(test, name):
  """Case `name` of this file's child process (run once per process)."""
  return testutil.child_case(test, os.path.abspath(__file__), _CHILD_ENV,
                             name)


class AccumulationEqualsBigBatchTest(absltest.TestCase):

  def test_one_device_and_mirrored(self):
    result = _case(self, "accumulation")
    for name in ("one_device_k4", "mirrored_k4"):
      with self.subTest(name):
        self.assertLessEqual(result[name], 1e-5)
    # The comparison can fail: K plain updates on the micro-batches land
    # far from the big-batch update, and training moved the weights.
    self.assertGreater(result["plain_small_steps"], 1e-3)
    self.assertGreater(result["moved"], 1e-2)
    # Micro-steps are counted inside the step: 3 updates x K.
    self.assertEqual(result["micro_steps"], {"k1": 3, "k4": 12})
    self.assertEqual(result["iterations"], 3)

  def test_clipping_once_on_the_accumulated_gradient(self):
    result = _case(self, "clipping")
    for name in ("one_device", "mirrored"):
      with self.subTest(name):
        self.assertLessEqual(result[name], 1e-5)
    self.assertGreater(result["clipped_vs_unclipped"], 1e-3)  # It binds.

  def test_fp16_overflow_in_one_micro_batch_skips_the_update(self):
    result = _case(self, "fp16")
    for name in ("one_device", "mirrored"):
      with self.subTest(name):
        first, second = result[name]
        self.assertEqual(first["skipped"], 1.0)
        self.assertEqual(first["loss_scale"], 2.0**14)  # Halved.
        self.assertEqual(first["iterations"], 0)
        self.assertTrue(first["kernel_unchanged"])
        self.assertTrue(first["kernel_finite"])
        self.assertEqual(first["micro_steps"], 4.0)
        self.assertEqual(second["skipped"], 0.0)  # Then it trains,
        self.assertEqual(second["iterations"], 1)
        self.assertTrue(second["kernel_finite"])
        # as the same update without accumulation does.
        self.assertLess(second["vs_no_accumulation"], 1e-3)
    self.assertTrue(result["replicas_agree"])


class RecomputationTest(absltest.TestCase):

  def test_same_gradients_and_statistics_and_really_recomputed(self):
    result = _case(self, "recompute")
    for name in ("one_device", "mirrored"):
      with self.subTest(name):
        run = result[name]
        self.assertLessEqual(run["gradients"], 1e-6)
        # Batch norm's moving statistics got one update, not two.
        self.assertLessEqual(run["moving_statistics"], 1e-6)
        self.assertGreater(run["moving_moved"], 1e-4)
    self.assertEqual(result["recomputed_segments"], 7)  # Stem + 6 blocks.
    # The recomputed segments' 15 convolutions (stem 1, blocks 12, two
    # projection shortcuts) run again in the backward pass.
    self.assertEqual(result["conv_ops"]["recompute"] -
                     result["conv_ops"]["plain"], 15)
    self.assertTrue(result["same_checkpoint_layout"])
    self.assertTrue(result["inference_equal"])

  # Also on the oldest supported Keras: the recomputing model builds on
  # Keras's functional-subclass and sub-graph support.
  @pytest.mark.compat
  def test_models_that_cannot_say_so(self):
    import keras  # pylint: disable=g-import-not-at-top
    from tfdist import models  # pylint: disable=g-import-not-at-top
    from tfdist.models import recompute  # pylint: disable=g-import-not-at-top
    self.assertEqual([n for n in models.model_names()
                      if models.supports_recomputation(n)],
                     ["cnn", "resnet"])
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"--activation_recomputation \(--gradient_checkpointing"
        r"\) is not available for --model=ranking: its activations are"):
      models.check_recomputation("ranking", True)
    models.check_recomputation("ranking", False)
    # A user's builder says so by taking the argument (or **kwargs).
    with self.assertRaisesRegex(
        errors.ConfigError, "--model=my_project:build: its builder takes no "
        "activation_recomputation argument"):
      models.check_recomputation("my_project:build", True,
                                 builder=lambda spec: None)
    models.check_recomputation(
        "my_project:build", True,
        builder=lambda spec, activation_recomputation=False: None)
    # The cnn's dropout is in its head, which is not recomputed.
    model = models.build_model("cnn", input_shape=(28, 28, 1),
                               num_classes=10, activation_recomputation=True)
    self.assertEqual(model.num_recomputed_segments, 2)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dropout(0.5)(keras.layers.Dense(4)(inputs))
    with self.assertRaisesRegex(ValueError, "random layers .*dropout"):
      recompute.recomputing_model(inputs, keras.layers.Dense(2)(hidden),
                                  boundaries=[hidden])


@pytest.mark.compat
class FlagsTest(absltest.TestCase):

  def test_accumulation_and_determinism_flags(self):
    from tfdist.backends import registry  # pylint: disable=g-import-not-at-top
    from tfdist.config import TrainConfig
    from tfdist.training.plan import batch_plan  # pylint: disable=g-import-not-at-top
    base = dict(model_dir="/tmp/x", train_steps=1)
    self.assertEqual(TrainConfig(gradient_accumulation_steps=4,
                                 **base).gradient_accumulation_steps, 4)
    with self.assertRaisesRegex(errors.ConfigError,
                                "--gradient_accumulation_steps=0 must be"):
      TrainConfig(gradient_accumulation_steps=0, **base)
    with self.assertRaisesRegex(
        errors.ConfigError,
        "--gradient_accumulation_steps=2 is not supported with "
        "--distribution_strategy=parameter_server: there each worker step"):
      # The strategy's rules: its backend's, run as the run is prepared.
      registry.check_strategy_rules(TrainConfig(
          gradient_accumulation_steps=2,
          distribution_strategy="parameter_server", **base))
    with self.assertRaisesRegex(
        errors.ConfigError, "--deterministic needs a --seed"):
      TrainConfig(deterministic=True, seed=None, **base)
    with self.assertRaisesRegex(errors.ConfigError, "--deterministic is not "
                                "supported with --distribution_strategy="
                                "parameter_server"):
      registry.check_strategy_rules(TrainConfig(
          deterministic=True, distribution_strategy="parameter_server",
          **base))
    # The global batch is the effective one; the learning rate scales to it.
    plan = batch_plan.make_batch_plan(num_replicas_in_sync=2, batch_size=64,
                                      gradient_accumulation_steps=4)
    self.assertEqual((plan.per_replica_batch_size, plan.global_batch_size),
                     (8, 64))

  def test_gradient_checkpointing_is_an_alias(self):
    from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
    import flags as tfdist_flags  # pylint: disable=g-import-not-at-top
    from tfdist import train  # pylint: disable=g-import-not-at-top,unused-import
    with flagsaver.as_parsed(gradient_checkpointing="true",
                             deterministic="true",
                             gradient_accumulation_steps="4"):
      config = tfdist_flags.flags_to_config()
    self.assertTrue(config.activation_recomputation)
    self.assertTrue(config.deterministic)
    self.assertEqual(config.gradient_accumulation_steps, 4)
    self.assertTrue(config.checkpoint_input_position)


# --- the child process --------------------------------------------------------
def _child_main(train_glob: str) -> dict:
  """Runs the strategy cases; returns JSON-able results."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
  tf.config.experimental.enable_op_determinism()
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from tfdist import models  # pylint: disable=g-import-not-at-top
  from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
  from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
  from tfdist.training.step import precision  # pylint: disable=g-import-not-at-top
  from tfdist.training.step.train_loop import Trainer  # pylint: disable=g-import-not-at-top
  one = tf.distribute.OneDeviceStrategy("/cpu:0")
  mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  # 96 real images and labels: 3 updates of 32.
  images, labels = next(iter(tf.data.TFRecordDataset(
      input_pipeline.list_files(train_glob), compression_type="GZIP").map(
          datasets.parse_image_example).batch(96)))
  images, labels = images.numpy(), labels.numpy()

  def relative(a, b):
    return max(float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-12))
               for x, y in zip(a, b))

  def small_model(strategy, **optimizer_options):
    """Conv + dense, no batch norm, no dropout; fixed initial weights."""
    keras.utils.set_random_seed(7)
    with strategy.scope():
      model = keras.Sequential([
          keras.Input((28, 28, 1)),
          keras.layers.Conv2D(8, 3, activation="relu"),
          keras.layers.MaxPooling2D(),
          keras.layers.Flatten(),
          keras.layers.Dense(10)])
      optimizer = keras.optimizers.SGD(0.1, momentum=0.9,
                                       **optimizer_options)
      optimizer.build(model.trainable_variables)
    return model, optimizer

  def train(strategy, k, *, micro_global_batch=None, updates=3,
            global_batch=32, **optimizer_options):
    """`updates` updates of `global_batch` examples as `k` micro-batches;
    the data in the same order whatever `k`."""
    model, optimizer = small_model(strategy, **optimizer_options)
    trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                      global_batch_size=global_batch,
                      steps_per_execution=updates,
                      gradient_accumulation_steps=k,
                      time_steps=False)  # Op determinism is on.
    ds = tf.data.Dataset.from_tensor_slices((images, labels)).batch(
        micro_global_batch or global_batch // k)
    sums = trainer.train_function(
        iter(strategy.experimental_distribute_dataset(ds)),
        tf.constant(updates, tf.int32))
    return model.get_weights(), sums, optimizer

  def guarded(fn):
    try:
      return fn()
    except Exception as e:  # pylint: disable=broad-except
      import traceback  # pylint: disable=g-import-not-at-top
      return {"error": traceback.format_exc()[-3000:]}

  plain = []  # The unclipped one-device run without accumulation.

  def accumulation_case():
    plain.append(train(one, 1))
    reference, ref_sums, ref_opt = plain[0]
    initial = small_model(one)[0].get_weights()
    out = {"micro_steps": {"k1": int(ref_sums["micro_steps"])},
           "iterations": int(ref_opt.iterations.numpy()),
           "moved": max(float(np.abs(a - b).max())
                        for a, b in zip(reference, initial))}
    weights, sums, _ = train(one, 4)
    out["one_device_k4"] = relative(weights, reference)
    out["micro_steps"]["k4"] = int(sums["micro_steps"])
    out["mirrored_k4"] = relative(train(mirrored, 4)[0], reference)
    # 12 plain updates of 8 examples each: the same examples, other result.
    out["plain_small_steps"] = relative(
        train(one, 1, updates=12, global_batch=8)[0], reference)
    return out

  def clipping_case():
    clip = {"global_clipnorm": 0.05}
    reference = train(one, 1, **clip)[0]
    return {"one_device": relative(train(one, 4, **clip)[0], reference),
            "mirrored": relative(train(mirrored, 4, **clip)[0], reference),
            "clipped_vs_unclipped": relative(
                reference, (plain[0] if plain else train(one, 1))[0])}

  def fp16_runs(strategy, k):
    """Two updates of 8 examples, 4 features: in the first, the second
    micro-batch (of 4 with k=4) has inputs of 1e4 and its float16
    gradients overflow; the second update is finite."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
      model, optimizer = testutil.fp16_dense_model(strategy)
      trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                        global_batch_size=8, gradient_accumulation_steps=k,
                        time_steps=False)  # Op determinism is on.
      inputs = np.ones((16, 4), np.float32)
      inputs[:8] *= np.arange(1, 9, dtype=np.float32)[:, None]
      inputs[2:4] = 1e4  # Micro-batch 2 of update 1 (k=4).
      ds = tf.data.Dataset.from_tensor_slices(
          (inputs, np.arange(16, dtype=np.int64) % 3)).batch(8 // k)
      iterator = iter(strategy.experimental_distribute_dataset(ds))
      out = []
      for _ in range(2):
        sums = trainer.train_function(iterator, tf.constant(1, tf.int32))
        kernels = [np.asarray(v, np.float64) for v in
                   strategy.experimental_local_results(
                       model.layers[-1].kernel.value)]
        out.append({
            "skipped": float(sums["skipped_steps"]),
            "micro_steps": float(sums["micro_steps"]),
            "loss_scale": precision.current_loss_scale(optimizer),
            "iterations": int(optimizer.iterations.numpy()),
            "kernel_finite": all(bool(np.isfinite(x).all()) for x in kernels),
            "kernel_unchanged": all(bool((x == 1).all()) for x in kernels),
            "kernels": [x.ravel().tolist() for x in kernels]})
      return out
    finally:
      keras.mixed_precision.set_global_policy("float32")

  def fp16_case():
    plain = fp16_runs(one, 1)
    out = {}
    for name, strategy in (("one_device", one), ("mirrored", mirrored)):
      runs = fp16_runs(strategy, 4)
      runs[1]["vs_no_accumulation"] = float(np.abs(
          np.array(runs[1]["kernels"][0]) -
          np.array(plain[1]["kernels"][0])).max())
      out[name] = runs
    out["replicas_agree"] = (out["mirrored"][1]["kernels"][0] ==
                             out["mirrored"][1]["kernels"][1])
    return out

  def resnet_gradients(strategy, recompute):
    keras.utils.set_random_seed(3)
    with strategy.scope():
      model = models.build_model("resnet", input_shape=(28, 28, 1),
                                 num_classes=10,
                                 sync_batch_norm=strategy is mirrored,
                                 activation_recomputation=recompute)
    x, y = images[:16], labels[:16]

    def replica_grads(x, y):
      with tf.GradientTape() as tape:
        logits = model(x, training=True)
        loss = tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(
            y, logits, from_logits=True)) / 16.0
      grads = tape.gradient(loss, model.trainable_variables)
      context = tf.distribute.get_replica_context()
      return context.all_reduce(tf.distribute.ReduceOp.SUM, grads)

    @tf.function
    def step(x, y):
      return strategy.run(replica_grads, args=(x, y))

    ds = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors((x, y)))
    batch = next(iter(ds))
    grads = strategy.experimental_local_results(step(*batch))[0]
    bns = [l for l in model.layers
           if isinstance(l, keras.layers.BatchNormalization)]
    moving = [np.asarray(v, np.float64) for bn in bns
              for v in (bn.moving_mean.numpy(), bn.moving_variance.numpy())]
    graph = step.get_concrete_function(*batch).graph
    convs = sum(1 for op in _all_ops(graph) if op.type == "Conv2D")
    return ([np.asarray(g, np.float64) for g in grads], moving, convs,
            model)

  def recompute_case():
    out = {"conv_ops": {}}
    for name, strategy in (("one_device", one), ("mirrored", mirrored)):
      plain, plain_moving, plain_convs, plain_model = resnet_gradients(
          strategy, False)
      grads, moving, convs, model = resnet_gradients(strategy, True)
      out[name] = {
          "gradients": relative(grads, plain),
          "moving_statistics": relative(moving, plain_moving),
          # Initial moving statistics are 0 (mean) and 1 (variance).
          "moving_moved": max(float(np.abs(m - (i % 2)).max())
                              for i, m in enumerate(moving))}
      if strategy is one:
        out["conv_ops"] = {"plain": plain_convs, "recompute": convs}
        out["recomputed_segments"] = model.num_recomputed_segments
        keys = lambda m: [k for k, _ in tf.train.list_variables(
            tf.train.Checkpoint(model=m).write(os.path.join(
                _scratch(), m.name)))]
        out["same_checkpoint_layout"] = keys(model) == keys(plain_model)
        model.set_weights(plain_model.get_weights())
        out["inference_equal"] = bool(np.array_equal(
            model(images[:4], training=False).numpy(),
            plain_model(images[:4], training=False).numpy()))
    return out

  return {"accumulation": guarded(accumulation_case),
          "clipping": guarded(clipping_case),
          "fp16": guarded(fp16_case),
          "recompute": guarded(recompute_case)}


def _all_ops(graph):
  """Operations of `graph` and of the functions it calls."""
  ops = list(graph.get_operations())
  for function in graph._functions.values():  # pylint: disable=protected-access
    inner = getattr(function, "graph", None)
    if inner is not None:
      ops += _all_ops(inner)
  return ops


def _scratch():
  import tempfile  # pylint: disable=g-import-not-at-top
  return tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR") or None)


if __name__ == "__main__":
  if os.environ.get(_CHILD_ENV):
    print(json.dumps(_child_main(os.environ[_CHILD_ENV])), flush=True)
  else:
    absltest.main()
