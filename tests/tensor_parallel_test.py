"""tfdist.parallel.tensor_parallel: sharded layers train like unsharded Keras.

Two child processes (`_process`), one per N = 4 and 2 logical CPU devices
(the split is fixed once TensorFlow starts), each running its cases one
MirroredStrategy after another. For N = 2 and 4 they train a column -> row
MLP and an attention block (ParallelMultiHeadAttention, residual, column ->
row MLP) for K steps next to the same unsharded Keras model (Dense,
MultiHeadAttention) from the same initial weights (each unsharded run made
once for both processes), then compare the gathered weights; on 2 replicas also the built-in Transformer
(`models/transformer.py`, `tensor_parallel=True`). SGD runs in float32.
Adam runs in float64: the key projection's bias has an exact gradient of
zero (softmax ignores a shift that is the same for every key), so its
float32 gradients are rounding noise of about 1e-9, which Adam divides by
its epsilon (1e-7) into updates near 1e-4 that differ between any two
orders of summation; in float64 the noise is 1e-18. The process of 2
devices first runs the example of docs/guides/tensor-parallelism.md
(block docs-example), which splits the CPU itself.

`TrainerTest` runs tfdist's trainer with `--tensor_parallel=2` (a
`TrainConfig`, as `tfdist.train` makes it) against one device
(`_trainer_child`, N = 2); `MeshTest` a 2 x 2 data x tensor mesh
(`_mesh_child`, N = 4, its checkpoint then resumed at N = 2), without
and with ZeRO stage 1 inside each data group (hybrid sharding);
`LayoutMapTest` a user's own models split by a Keras LayoutMap in
`tfdist.fit` (`_layout_map_child`, N = 4 then 2, and the guide's
layout-map-example).
"""

import json
import os
import re
import subprocess
import sys

from absl.testing import absltest

from tests import testutil

_STEPS = 4
_TOLERANCE = 1e-5
# The built-in Transformer's blocks in the trainer's runs (`_trainer_child`,
# `_mesh_child`): one block holds every kind of split weight (the
# attention's heads, the feed-forward column -> row pair) and the
# replicated ones around them (embeddings, layer norms, classifier); a
# second block only repeats them, and made each run cost 1.5 to 1.8 times
# the CPU time (the default 2 blocks, measured 8 December 2026).
_BLOCKS = 1


def _child(n: int, root: str) -> dict:
  """The cases on `n` replicas, run in this (fresh) process; a dict of
  results by case. The unsharded runs they compare with are kept in
  `root` (`unsharded_run`): n = 4 writes them, n = 2 reads them."""
  # pylint: disable=g-import-not-at-top
  import json
  import pickle
  import keras
  import numpy as np
  import tensorflow as tf
  from models import transformer
  from tfdist import errors
  from tfdist.distribute import devices
  from tfdist.parallel.tensor import layers as tp
  # pylint: enable=g-import-not-at-top
  devices.configure_cpu_devices(n)

  def build(kind: str, parallel: bool, dtype: str):
    if kind == "transformer":
      # The built-in classifier, small; no dropout, so both draw nothing.
      keras.config.set_dtype_policy(dtype)
      try:
        return transformer.build_transformer(
            sequence_length=5, vocabulary_size=20, num_classes=8,
            embed_dim=8, num_heads=4, ff_dim=16, num_layers=1, dropout=0.0,
            tensor_parallel=parallel)
      finally:
        keras.config.set_dtype_policy("float32")
    inputs = keras.Input((5, 8), dtype=dtype)
    x = inputs
    if kind == "attention":
      attention = (tp.ParallelMultiHeadAttention if parallel else
                   keras.layers.MultiHeadAttention)(4, 3, dtype=dtype)
      x = x + attention(x, x, use_causal_mask=True)
    if kind == "mlp_gathered":
      hidden = (tp.ColumnParallelDense(16, activation="relu", dtype=dtype,
                                       gather_output=True) if parallel else
                keras.layers.Dense(16, activation="relu", dtype=dtype))(x)
      outputs = keras.layers.Dense(8, dtype=dtype)(hidden)
    else:
      hidden = (tp.ColumnParallelDense if parallel else keras.layers.Dense)(
          16, activation="relu", dtype=dtype)(x)
      outputs = (tp.RowParallelDense if parallel else keras.layers.Dense)(
          8, dtype=dtype)(hidden)
    return keras.Model(inputs, outputs)

  def data(dtype, kind=""):
    rng = np.random.RandomState(0)
    if kind == "transformer":
      # Token ids with padding (0) at the end of some examples; targets
      # for the 8 logits.
      tokens = rng.randint(1, 20, size=(6, 5)).astype(np.int64)
      tokens[::2, 3:] = 0
      return tokens, rng.normal(size=(6, 8)).astype(dtype)
    return (rng.normal(size=(6, 5, 8)).astype(dtype),
            rng.normal(size=(6, 5, 8)).astype(dtype))

  def make_optimizer(name):
    return (keras.optimizers.SGD(0.1, momentum=0.5) if name == "sgd" else
            keras.optimizers.Adam(0.01))

  def train_reference(model, optimizer, x, y):
    optimizer.build(model.trainable_variables)

    @tf.function
    def step():
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
      optimizer.apply_gradients(
          zip(tape.gradient(loss, model.trainable_variables),
              model.trainable_variables))
      return loss
    return [float(step()) for _ in range(_STEPS)]

  def train_parallel(strategy, model, optimizer, x, y):
    replica_optimizer = tp.ReplicaOptimizer(optimizer,
                                            model.trainable_variables,
                                            strategy)

    @tf.function
    def step():
      def replica_step():
        with tf.GradientTape() as tape:
          loss = tf.reduce_mean(tf.square(model(x) - y))
        return loss, tape.gradient(loss, model.trainable_variables)
      loss, grads = strategy.run(replica_step)
      replica_optimizer.apply_gradients(grads)
      return strategy.experimental_local_results(loss)
    return [[float(v) for v in step()] for _ in range(_STEPS)]

  def shard_report(model, n):
    """Per sharded weight: full shape, component shapes, devices, whether
    the components differ; per whole weight of a parallel layer: whether
    its mirrors are equal."""
    sharded, whole = [], []
    for layer in model.layers:
      if not isinstance(layer, (tp.ColumnParallelDense, tp.RowParallelDense,
                                tp.ParallelMultiHeadAttention)):
        continue
      for variable, full in zip(layer.weights, tp.gathered_weights(layer)):
        components = tp._components(variable)  # pylint: disable=protected-access
        values = [np.asarray(c.numpy()) for c in components]
        if tuple(variable.shape) == full.shape:
          whole.append(all(np.array_equal(values[0], v) for v in values))
          continue
        sharded.append({
            "path": variable.path, "full": list(full.shape),
            "shards": [list(v.shape) for v in values],
            "devices": sorted({c.device for c in components}),
            "distinct": not any(np.array_equal(values[0], v)
                                for v in values[1:])})
    return {"sharded": sharded, "whole_mirrors_equal": whole, "n": n}

  def unsharded_run(kind, optimizer_name, dtype):
    """`(initial weights, final weights, losses)` of the unsharded Keras
    model's _STEPS updates, run once per model, optimizer and dtype for
    both processes (the process of 4 devices runs first and leaves them
    under `root`; "mlp_gathered"'s unsharded model is "mlp"'s, the same
    Dense -> Dense, and the no-strategy case's is "attention"'s)."""
    key = ("mlp" if kind == "mlp_gathered" else kind, optimizer_name, dtype)
    if key not in references:
      reference = build(kind, parallel=False, dtype=dtype)
      initial = reference.get_weights()
      losses = train_reference(reference, make_optimizer(optimizer_name),
                               *data(dtype, kind))
      references[key] = (initial, reference.get_weights(), losses)
    return references[key]

  def train_case(strategy, kind, optimizer_name, dtype):
    x, y = data(dtype, kind)
    initial, final, reference_losses = unsharded_run(kind, optimizer_name,
                                                     dtype)
    with strategy.scope():
      model = build(kind, parallel=True, dtype=dtype)
    tp.load_full_weights(model, initial)
    losses = train_parallel(strategy, model, make_optimizer(optimizer_name),
                            x, y)
    gathered = tp.gathered_weights(model)
    extra = {}
    if kind == "transformer" and optimizer_name == "sgd":
      extra = transformer_checkpoint(strategy, model, x, dtype)
    return {
        **extra,
        "shapes_match": [list(a.shape) for a in gathered] ==
                        [list(b.shape) for b in final],
        "max_weight_diff": max(float(np.abs(a - b).max())
                               for a, b in zip(gathered, final)),
        "moved": max(float(np.abs(a - b).max())
                     for a, b in zip(initial, final)),
        "max_loss_diff": max(abs(v - r) for row, r in
                             zip(losses, reference_losses) for v in row),
        **shard_report(model, strategy.num_replicas_in_sync)}

  def transformer_checkpoint(strategy, model, x, dtype):
    """The trained sharded Transformer's gathered weights, saved as the
    unsharded Transformer's checkpoint and restored into a fresh one:
    its outputs against the sharded model's on every replica."""
    path = os.path.join(testutil.scratch_dir(), "transformer.weights.h5")
    saved = build("transformer", parallel=False, dtype=dtype)
    saved.set_weights(tp.gathered_weights(model))
    saved.save_weights(path)
    restored = build("transformer", parallel=False, dtype=dtype)
    restored.load_weights(path)
    outputs = strategy.experimental_local_results(
        tf.function(lambda: strategy.run(lambda: model(x)))())
    sharded_bytes = sum(
        int(np.prod(c.shape)) * c.dtype.size
        for v in model.weights if getattr(v, tp._SHARD_AXIS, None) is not None  # pylint: disable=protected-access
        for c in tp._components(v)[:1])  # pylint: disable=protected-access
    return {"restored_outputs_diff": max(
        float(np.abs(np.asarray(o) - np.asarray(restored(x))).max())
        for o in outputs),
            # One replica's shards against the weights they split.
            "shard_bytes_ratio": sharded_bytes / tp.splittable_weight_bytes(
                restored)}

  def error_case(strategy):
    found = {}
    with strategy.scope():
      for name, make in (
          ("units", lambda: tp.ColumnParallelDense(6)),
          ("heads", lambda: tp.ParallelMultiHeadAttention(6, 2))):
        try:
          layer = make()
          inputs = keras.Input((5, 8))
          if name == "heads":
            layer(inputs, inputs)
          else:
            layer(inputs)
          found[name] = None
        except errors.ConfigError as e:
          found[name] = str(e)
      model = build("mlp", parallel=True, dtype="float32")
      try:
        model(np.zeros((2, 5, 8), np.float32))
        found["cross_replica_call"] = None
      except errors.ConfigError as e:
        found["cross_replica_call"] = str(e)
      try:
        tp.ReplicaOptimizer(keras.optimizers.SGD(0.1),
                            model.trainable_variables, strategy)
        found["optimizer_in_scope"] = None
      except errors.ConfigError as e:
        found["optimizer_in_scope"] = str(e)
    # Split 2 ways over the 4 replicas (2 x 2): replica r holds shard
    # r mod 2; ReplicaOptimizer, which does not sum over the copies,
    # refuses it.
    from tfdist.parallel.tensor import groups as groups_lib  # pylint: disable=g-import-not-at-top
    with strategy.scope(), groups_lib.split_over(2):
      layer = tp.ColumnParallelDense(8)
      layer(keras.Input((5, 8)))
    parts = [c.numpy() for c in tp._components(layer.kernel)]  # pylint: disable=protected-access
    found["mesh_shards"] = [bool(np.array_equal(parts[r], parts[r % 2]))
                            for r in range(4)] + [
                                bool(np.array_equal(parts[0], parts[1]))]
    found["mesh_full_shape"] = list(tp.gathered_weights(layer)[0].shape)
    try:
      tp.ReplicaOptimizer(keras.optimizers.SGD(0.1), layer.trainable_variables,
                          strategy)
      found["mesh_optimizer"] = None
    except errors.ConfigError as e:
      found["mesh_optimizer"] = str(e)
    for name, optimizer in (
        ("loss_scale", keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.1))),
        ("accumulation", keras.optimizers.SGD(
            0.1, gradient_accumulation_steps=2))):
      try:
        tp.ReplicaOptimizer(optimizer, model.trainable_variables, strategy)
        found[name] = None
      except errors.ConfigError as e:
        found[name] = str(e)
    return found

  def checkpoint_case(strategy, folder):
    """Unsharded file -> sharded model -> training -> unsharded file."""
    x, y = data("float32")
    saved = build("attention", parallel=False, dtype="float32")
    first = os.path.join(folder, "unsharded.weights.h5")
    saved.save_weights(first)
    loaded = build("attention", parallel=False, dtype="float32")
    loaded.load_weights(first)
    with strategy.scope():
      model = build("attention", parallel=True, dtype="float32")
    tp.load_full_weights(model, loaded.get_weights())
    restored = max(float(np.abs(a - b).max()) for a, b in
                   zip(tp.gathered_weights(model), saved.get_weights()))
    train_parallel(strategy, model, make_optimizer("sgd"), x, y)
    back = build("attention", parallel=False, dtype="float32")
    back.set_weights(tp.gathered_weights(model))
    second = os.path.join(folder, "trained.weights.h5")
    back.save_weights(second)
    reread = build("attention", parallel=False, dtype="float32")
    reread.load_weights(second)
    outputs = strategy.experimental_local_results(
        tf.function(lambda: strategy.run(lambda: model(x)))())
    return {"restored_diff": restored,
            "outputs_diff": max(float(np.abs(np.asarray(o) - reread(x)).max())
                                for o in outputs)}

  def config_case():
    """get_config -> JSON -> Keras deserialization -> get_config."""
    same = {}
    for layer in (tp.ColumnParallelDense(8, activation="relu",
                                         gather_output=True, name="c"),
                  tp.RowParallelDense(4, use_bias=False, name="r"),
                  tp.ParallelMultiHeadAttention(2, 3, value_dim=5,
                                                output_shape=7, name="a")):
      text = json.dumps(keras.saving.serialize_keras_object(layer))
      copy = keras.saving.deserialize_keras_object(json.loads(text))
      same[type(layer).__name__] = (type(copy) is type(layer) and
                                    copy.get_config() == layer.get_config())
    return same

  saved_references = os.path.join(root, "unsharded_runs.pkl")
  references = {}
  if os.path.exists(saved_references):
    with open(saved_references, "rb") as f:
      references = pickle.load(f)
  results = {}
  if n == 2:
    results["config_2"] = config_case()
    # No strategy at all: one replica, the operators are identities.
    results["attention_sgd_1"] = train_case(tf.distribute.get_strategy(),
                                            "attention", "sgd", "float32")
  strategy = tf.distribute.MirroredStrategy(
      [d.name for d in tf.config.list_logical_devices("CPU")])
  cases = [("mlp", "sgd", "float32"), ("attention", "sgd", "float32"),
           ("mlp", "adam", "float64"), ("attention", "adam", "float64")]
  if n == 2:
    cases.extend([("mlp_gathered", "sgd", "float32"),
                  ("transformer", "sgd", "float32"),
                  ("transformer", "adam", "float64")])
  for kind, optimizer_name, dtype in cases:
    name = f"{kind}_{optimizer_name}_{n}"
    try:
      results[name] = train_case(strategy, kind, optimizer_name, dtype)
    except Exception as e:  # pylint: disable=broad-except
      results[name] = {"error": f"{type(e).__name__}: {e}"}
  with open(saved_references, "wb") as f:
    pickle.dump(references, f)
  if n == 4:
    results["errors_4"] = error_case(strategy)
  else:
    try:
      results["checkpoint_2"] = checkpoint_case(strategy,
                                                testutil.scratch_dir())
    except Exception as e:  # pylint: disable=broad-except
      results["checkpoint_2"] = {"error": f"{type(e).__name__}: {e}"}
  return results


def _trainer_child(root: str, resume: bool = False) -> dict:
  """`--tensor_parallel=2` in tfdist's trainer against one device, in this
  (fresh) process split into 2 logical CPU devices, in folders under
  `root`: K = 3 steps of the built-in Transformer (`_BLOCKS` block) on a
  subset of the clothing reviews (dropout 0.1 on, SGD with momentum 0.9,
  float32: Adam's float32 noise, see the module docstring), each run's
  checkpoint read back, and the tensor-parallel run resumed unsharded for
  one more step (`--mode=train`, as every resumed run here: no
  evaluation).
  The one-device run is `_mesh_child`'s "sgd" one (the same settings) when
  that part ran first under `root` (it leaves `one_device/` and
  `one_device.json`), else it runs here.
  `resume` (after the call without it): the one-device run resumed with
  `--tensor_parallel=2`, and the two resumed checkpoints compared."""
  # pylint: disable=g-import-not-at-top
  import keras
  import numpy as np
  import tensorflow as tf
  from tfdist import experiment
  from tfdist.config import TrainConfig
  from tfdist.data import clothing_reviews
  from tfdist.distribute import devices
  from tfdist.distribute import environment as environment_lib
  from tfdist.parallel.tensor import layers as tp
  # pylint: enable=g-import-not-at-top
  devices.configure_cpu_devices(2)
  data = os.path.join(root, "clothing_reviews")
  if not os.path.isdir(data):  # The mesh's part may have made it.
    clothing_reviews.convert_clothing_reviews(data, limit=200,
                                              train_shards=1, test_shards=1)
  layouts = {"tensor_parallel": dict(tensor_parallel=2, num_cpu_devices=2,
                                     distribution_strategy="mirrored"),
             "one_device": dict(distribution_strategy="one_device")}

  class Replicas(keras.callbacks.Callback):
    """At the end, what each replica holds of the trained model's weights
    and the optimizer's slots."""
    found = {}

    def on_train_end(self, logs=None):
      def parts(variable):
        return [np.asarray(c.numpy()) for c in tp._components(variable)]  # pylint: disable=protected-access

      sharded = {v.path for v in self.model.weights
                 if getattr(v, tp._SHARD_AXIS, None) is not None}  # pylint: disable=protected-access
      spread, distinct = 0.0, []
      for v in self.model.weights:
        a, b = parts(v)
        if v.path in sharded:
          distinct.append(bool(np.any(a != b)))
        else:
          spread = max(spread, float(np.max(np.abs(a - b))))
      # SGD's momentum of each trainable weight, in their order.
      slots = [(v, m) for v, m in zip(self.model.trainable_variables,
                                      self.model.optimizer.momentums)
               if v.path in sharded]
      Replicas.found.update(
          replicated_spread=spread, shards=len(distinct),
          shards_distinct=all(distinct), shard_slots=len(slots),
          shard_slots_shard_shaped=all(m.shape == v.shape
                                       for v, m in slots),
          shard_slots_distinct=sum(bool(np.any(a != b)) for a, b in
                                   (parts(m) for _, m in slots)))

  def run(folder, steps, layout, callbacks=(), mode="train_and_eval"):
    config = TrainConfig(
        model_dir=os.path.join(root, folder), model="transformer",
        dataset="clothing_reviews",
        train_files=os.path.join(data, "train-*.tfrecord.gz"),
        eval_files=os.path.join(data, "test-*.tfrecord.gz"),
        train_steps=steps, batch_size=8, deterministic=True, seed=3,
        optimizer="sgd", base_learning_rate=0.01, lr_scaling="none",
        log_steps=steps, mode=mode, transformer_layers=_BLOCKS,
        **layouts[layout])
    return experiment.run_experiment(
        config, environment=environment_lib.read_environment({}),
        callbacks=list(callbacks))

  def served(folder):
    """The SavedModel's serving outputs for two reviews."""
    serve = tf.saved_model.load(os.path.join(
        root, folder, "saved_model")).signatures["serving_default"]
    (name, spec), = serve.structured_input_signature[1].items()
    if spec.dtype == tf.string:
      request = tf.constant(["a lovely dress", "too small, sent it back"])
    else:
      request = tf.constant([[2, 3, 4] + [0] * (spec.shape[1] - 3)] * 2,
                            spec.dtype)
    return np.concatenate([np.ravel(v.numpy())
                           for v in serve(**{name: request}).values()])

  def saved(folder):
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(
        os.path.join(root, folder, "checkpoints")))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
            if k.endswith("VARIABLE_VALUE")}

  def compare(a, b):
    floats = [k for k in a if k in b and a[k].dtype.kind == "f"]
    return {"same_keys": sorted(a) == sorted(b),
            "same_shapes": all(a[k].shape == b[k].shape for k in floats),
            "max_diff": max(float(np.max(np.abs(a[k] - b[k])))
                            for k in floats)}

  # The resumed runs (one more step) train only (--mode=train): their
  # checkpoints are all that is compared; the 3-step runs evaluate.
  if resume:
    run("one_device", 4, "tensor_parallel", mode="train")
    return {"after_resume": compare(saved("tensor_parallel"),
                                    saved("one_device"))}
  results = {}
  runs = {"tensor_parallel": run("tensor_parallel", 3, "tensor_parallel",
                                 [Replicas()])}
  done = os.path.join(root, "one_device.json")
  if os.path.exists(done):  # `_mesh_child`'s "sgd" part ran it.
    with open(done) as f:
      runs["one_device"] = {"final_metrics": json.load(f)}
  else:
    runs["one_device"] = run("one_device", 3, "one_device")
  results["replicas_hold"] = Replicas.found
  results["losses"] = {k: r["final_metrics"]["train_loss"]
                       for k, r in runs.items()}
  results["evaluations"] = {k: r["final_metrics"]["eval_loss"]
                            for k, r in runs.items()}
  results["replicas"] = runs["tensor_parallel"]["num_replicas_in_sync"]
  results["after_3"] = compare(saved("tensor_parallel"), saved("one_device"))
  results["export_outputs_diff"] = float(np.max(np.abs(
      served("tensor_parallel") - served("one_device"))))
  run("tensor_parallel", 4, "one_device", mode="train")  # Resumed unsharded.
  return results


def _mesh_child(root: str, part: str) -> dict:
  """`--tensor_parallel=2` on a 2 x 2 data x tensor mesh of 4 logical CPU
  devices against one device, in this (fresh) process: the built-in
  Transformer (`_BLOCKS` block, dropout 0.1 on) on a subset of the
  clothing reviews, K = 3 updates with `--deterministic`, float32, in
  folders under `root`.

  `part`: "sgd" (SGD with momentum 0.9: the 2 x 2 and one-device runs,
  and the 2 x 2 run with --shard_optimizer_state (ZeRO stage 1 inside
  each data group: hybrid sharding, `_zero_results`); then the 2 x 2
  checkpoint (without ZeRO) resumed for one more update on one
  device, beside the one-device run's own fourth update), "adam" (the
  one-device run and the 2 x 2 run with --zero_stage=1 under Adam, with
  --gradient_accumulation_steps=2: the mesh's Adam run is the ZeRO one), or "t2" (in a process of 2 devices: the 2 x 2
  checkpoint of "sgd" resumed with --tensor_parallel=2 alone, D = 1;
  after "sgd", in another process)."""
  # pylint: disable=g-import-not-at-top
  import shutil
  import time
  import numpy as np
  from tfdist import experiment
  from tfdist.config import TrainConfig
  from tfdist.data import clothing_reviews
  from tfdist.distribute import devices
  from tfdist.distribute import environment as environment_lib
  # pylint: enable=g-import-not-at-top
  devices.configure_cpu_devices(2 if part == "t2" else 4)
  data = os.path.join(root, "clothing_reviews")
  if not os.path.isdir(data):
    clothing_reviews.convert_clothing_reviews(data, limit=200,
                                              train_shards=1, test_shards=1)
  layouts = {"mesh": dict(tensor_parallel=2, num_cpu_devices=4,
                          distribution_strategy="mirrored"),
             "tensor": dict(tensor_parallel=2, num_cpu_devices=2,
                            distribution_strategy="mirrored"),
             "one": dict(distribution_strategy="one_device")}
  # Stage 1 by its switch (SGD) and by its number (Adam).
  layouts["zero"] = dict(layouts["mesh"], **(
      dict(shard_optimizer_state=True) if part == "sgd" else
      dict(zero_stage=1)))
  # Adam also accumulates 2 micro-batches: 1 example per replica, and an
  # evaluation round (38 examples, 4 a batch) whose last batch leaves one
  # tensor group without examples.
  optimizer = dict(optimizer="adam", base_learning_rate=0.001,
                   gradient_accumulation_steps=2) if (
                       part == "adam") else dict(optimizer="sgd",
                                                 base_learning_rate=0.01)

  def run(folder, steps, layout, mode="train_and_eval"):
    config = TrainConfig(
        model_dir=os.path.join(root, folder), model="transformer",
        dataset="clothing_reviews",
        train_files=os.path.join(data, "train-*.tfrecord.gz"),
        eval_files=os.path.join(data, "test-*.tfrecord.gz"),
        train_steps=steps, batch_size=8, deterministic=True, seed=3,
        lr_scaling="none", log_steps=steps, mode=mode, **optimizer,
        transformer_layers=_BLOCKS, **layouts[layout])
    return experiment.run_experiment(
        config, environment=environment_lib.read_environment({}))

  def saved(folder):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(
        os.path.join(root, folder, "checkpoints")))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
            if k.endswith("VARIABLE_VALUE")}

  def compare(a, b):
    floats = [k for k in a if k in b and a[k].dtype.kind == "f"]
    diffs = {k: float(np.max(np.abs(a[k] - b[k]))) for k in floats}
    worst = max(diffs, key=diffs.get)
    return {"same_keys": sorted(a) == sorted(b), "keys": len(floats),
            "same_shapes": all(a[k].shape == b[k].shape for k in floats),
            "max_diff": diffs[worst], "worst": worst}

  # The resumed runs (one more update) only train (--mode=train): their
  # checkpoints are what is compared.
  if part == "t2":
    run("mesh_to_tensor", 4, "tensor", mode="train")
    return {"t2_resumed": compare(saved("mesh_to_tensor"), saved("one_sgd"))}
  # Adam's 2 x 2 run is its ZeRO stage 1 run: without ZeRO the mesh
  # updates through the same replica optimizer path as SGD's, tested above.
  runs = {layout: run(f"{layout}_{part}", 3, layout)
          for layout in (("one", "mesh") if part == "sgd" else ("one",))}
  started = time.monotonic()
  runs["zero"] = run(f"zero_{part}", 3, "zero")
  seconds = time.monotonic() - started  # What the ZeRO runs add.
  results = _zero_results(root, part, runs, compare(saved(f"zero_{part}"),
                                                    saved(f"one_{part}")))
  mesh = "mesh" if part == "sgd" else "zero"
  runs["mesh"] = runs[mesh]
  results.update({
      f"{part}_replicas": runs["mesh"]["num_replicas_in_sync"],
      f"{part}_losses": [runs[k]["final_metrics"]["train_loss"]
                         for k in ("one", "mesh")],
      f"{part}_evaluations": [runs[k]["final_metrics"]["eval_loss"]
                              for k in ("one", "mesh")],
      f"{part}_after_3": compare(saved(f"{mesh}_{part}"),
                                 saved(f"one_{part}"))})
  if part == "sgd":
    for copy in ("mesh_to_one", "mesh_to_tensor"):
      shutil.copytree(os.path.join(root, "mesh_sgd"), os.path.join(root, copy))
    # The one-device run is `_trainer_child`'s (the same TrainConfig): its
    # folder at step 3 and its final metrics, for it to compare with.
    shutil.copytree(os.path.join(root, "one_sgd"),
                    os.path.join(root, "one_device"))
    with open(os.path.join(root, "one_device.json"), "w") as f:
      json.dump({k: float(runs["one"]["final_metrics"][k])
                 for k in ("train_loss", "eval_loss")}, f)
    run("mesh_to_one", 4, "one", mode="train")
    run("one_sgd", 4, "one", mode="train")
    results["one_resumed"] = compare(saved("mesh_to_one"), saved("one_sgd"))
  results[f"{part}_zero_seconds"] = seconds
  return results


def _zero_results(root: str, part: str, runs: dict, after_3: dict) -> dict:
  """`_mesh_child`'s results of its 2 x 2 run with ZeRO stage 1 (`runs[
  "zero"]`) beside the one-device and 2 x 2 runs without ZeRO: the
  losses, the checkpoint after 3 updates against one device's
  (`after_3`), and the per-device model state each 2 x 2 run's manifest
  records (`run_manifest.json`: memory.model, bytes)."""
  def model_memory(folder):
    with open(os.path.join(root, folder, "run_manifest.json")) as f:
      return json.load(f)["memory"]["model"]
  return {
      f"{part}_zero_replicas": runs["zero"]["num_replicas_in_sync"],
      f"{part}_zero_losses": [runs[k]["final_metrics"]["train_loss"]
                              for k in ("one", "zero")],
      f"{part}_zero_evaluations": [runs[k]["final_metrics"]["eval_loss"]
                                   for k in ("one", "zero")],
      f"{part}_zero_after_3": after_3,
      f"{part}_zero_memory": {layout: model_memory(f"{layout}_{part}")
                              for layout in ("mesh", "zero")
                              if layout in runs}}


def _zero_reduce_scatter_child() -> dict:
  """ZeRO stage 2 inside the data groups of a 2 x 2 mesh, in the process
  of 4 devices: each replica's shard of its group's sum by
  `zero.DataGroupShards.replica_reduce_scatter` (an all-to-all) and by
  stage 1's all-reduce and slice, against NumPy. Replica r sends
  float32 [10] (a layout of 9 elements and one of padding, S = 5),
  range(10) x (r + 1) + r / 2; its data group is {r mod 2, r mod 2 + 2}.
  """
  # pylint: disable=g-import-not-at-top
  import numpy as np
  import tensorflow as tf
  from tfdist.parallel.data import sharded_optimizer
  from tfdist.parallel.tensor import groups as groups_lib
  from tfdist.parallel.tensor import zero
  # pylint: enable=g-import-not-at-top
  strategy = tf.distribute.MirroredStrategy(
      [d.name for d in tf.config.list_logical_devices("CPU")])
  shards = zero.DataGroupShards(groups_lib.groups_for(
      list(strategy.extended.worker_devices), 2))
  layout = sharded_optimizer.FlatLayout([tf.TensorShape([9])], 2)

  def replica():
    context = tf.distribute.get_replica_context()
    r = tf.cast(context.replica_id_in_sync_group, tf.float32)
    flat = tf.range(10, dtype=tf.float32) * (r + 1) + r / 2
    scattered = shards.replica_reduce_scatter(context, flat, "float32",
                                              layout)
    sliced = layout.shard_of(shards.replica_sum(context, flat, "float32"),
                             shards.replica_shard_index(context))
    return scattered, sliced

  scattered, sliced = tf.function(lambda: strategy.run(replica))()
  worst = 0.0
  for r, (a, b) in enumerate(zip(strategy.experimental_local_results(
      scattered), strategy.experimental_local_results(sliced))):
    members = (r % 2, r % 2 + 2)
    expected = sum(np.arange(10) * (m + 1) + m / 2 for m in members)
    want = expected[5 * (r // 2):5 * (r // 2) + 5]
    worst = max(worst, float(np.max(np.abs(a.numpy() - want))),
                float(np.max(np.abs(b.numpy() - want))))
  return {"zero_reduce_scatter_max_diff": worst}


def _layout_map_model(kind: str, compiled: bool = True):
  """A user's own model, compiled with its loss (unless not `compiled`):
  `mlp` 8 -> 32 (relu) -> 4 -> 1 (Dense; functional), `mlp_sequential`
  the same as a `keras.Sequential`, `attention` a causal
  MultiHeadAttention (4 heads of 3, dropout 0.1) and a 16-unit
  feed-forward pair, both residual, then a Dense of 1."""
  import keras  # pylint: disable=g-import-not-at-top
  if kind == "mlp_sequential":
    model = keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(32, activation="relu",
                                              name="up"),
        keras.layers.Dense(4, name="down"), keras.layers.Dense(1, name="out")])
    model.compile(loss="mse")
    return model
  if kind == "mlp":
    inputs = keras.Input((8,))
    x = keras.layers.Dense(32, activation="relu", name="up")(inputs)
    x = keras.layers.Dense(4, name="down")(x)
  else:
    inputs = keras.Input((5, 8))
    x = inputs + keras.layers.MultiHeadAttention(
        4, 3, dropout=0.1, name="mha")(inputs, inputs, use_causal_mask=True)
    hidden = keras.layers.Dense(16, activation="relu", name="up")(x)
    x = keras.layers.Flatten()(x + keras.layers.Dense(8, name="down")(hidden))
  model = keras.Model(inputs, keras.layers.Dense(1, name="out")(x))
  if compiled:
    model.compile(loss="mse")
  return model


def _user_mlp():
  """`fit`'s model_fn: `_layout_map_model("mlp")`."""
  return _layout_map_model("mlp")


def _user_mlp_sequential():
  """`fit`'s model_fn: `_layout_map_model("mlp_sequential")`."""
  return _layout_map_model("mlp_sequential")


def _user_attention():
  """`fit`'s model_fn: `_layout_map_model("attention")`."""
  return _layout_map_model("attention")


def _layout_map_for(kind: str, data: int):
  """The Keras LayoutMap of `_layout_map_model(kind)` on a data x model
  mesh of `data` x 2: `up` by columns, `down` by rows (patterns: a
  Sequential's paths start with its name), the attention by heads."""
  import keras  # pylint: disable=g-import-not-at-top
  mesh = keras.distribution.DeviceMesh(
      (data, 2), ["batch", "model"],
      devices=[f"cpu:{i}" for i in range(2 * data)])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map[".*up/kernel"] = (None, "model")
  layout_map[".*down/kernel"] = ("model", None)
  if kind == "attention":
    layout_map["mha/(query|key|value)/kernel"] = (None, "model", None)
    layout_map["mha/(query|key|value)/bias"] = ("model", None)
    layout_map["mha/attention_output/kernel"] = ("model", None, None)
  return layout_map


def _layout_map_child(root: str, n: int) -> dict:
  """`tfdist.fit(model_fn, ..., layout_map=...)` of a user's model against
  one device, 3 updates (`--deterministic`, float32), in folders under
  `root`. n = 4 (first): the MLP's one-device runs (SGD with momentum 0.9
  on the functional MLP, Adam on the same as a Sequential), kept under
  `root`, and its D x T = 2 x 2 runs; n = 2: its T = 2
  runs (against the kept one-device runs), both runs' checkpoints
  restored into the unsplit model, and the attention model (SGD) at T = 2
  and on one device."""
  # pylint: disable=g-import-not-at-top
  import keras
  import numpy as np
  import tensorflow as tf
  import tfdist
  # pylint: enable=g-import-not-at-top
  rng = np.random.default_rng(0)
  inputs = {"mlp": rng.normal(size=(64, 8)).astype("float32"),
            "attention": rng.normal(size=(64, 5, 8)).astype("float32")}
  # SGD (with momentum) trains the functional MLP, Adam the Sequential.
  mlp = {"sgd": "mlp", "adam": "mlp_sequential"}

  class Losses(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
      self.losses = []

    def on_train_batch_end(self, batch, logs=None):
      self.losses.append(float(logs["loss"]))

  def run(folder, kind, optimizer, layout_map=None, **layout):
    # Each split run's strategy numbers its collectives 20000 further
    # (`_process`'s `guarded` gives each part 100000).
    tf.distribute.MirroredStrategy._collective_key_base += 20000  # pylint: disable=protected-access
    x = inputs["attention" if kind == "attention" else "mlp"]
    losses = Losses()
    model_fn = {"mlp": _user_mlp, "mlp_sequential": _user_mlp_sequential,
                "attention": _user_attention}[kind]
    tfdist.fit(model_fn, x=x,
               y=x.reshape(len(x), -1).sum(axis=1), verbose=0,
               layout_map=layout_map, callbacks=[losses],
               config=tfdist.TrainConfig(
                   model_dir=os.path.join(root, folder), train_steps=3,
                   batch_size=16, deterministic=True, seed=1,
                   optimizer=optimizer, base_learning_rate=0.01,
                   lr_scaling="none", **layout))
    return losses.losses

  def latest(folder):
    return tf.train.latest_checkpoint(os.path.join(root, folder,
                                                   "checkpoints"))

  def saved(folder):
    reader = tf.train.load_checkpoint(latest(folder))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
            if k.endswith("VARIABLE_VALUE")}

  def compare(split, one, split_losses, one_losses):
    a, b = saved(split), saved(one)
    floats = [k for k in a if k in b and a[k].dtype.kind == "f"]
    return {"same_keys": sorted(a) == sorted(b), "keys": len(floats),
            "steps": [len(split_losses), len(one_losses)],
            "max_diff": max(float(np.max(np.abs(a[k] - b[k])))
                            for k in floats),
            "max_loss_diff": max(abs(p - q) for p, q in
                                 zip(split_losses, one_losses))}

  def restored_outputs(folder):
    model = _layout_map_model("mlp", compiled=False)
    tf.train.Checkpoint(model=model).read(
        latest(folder)).expect_partial().assert_existing_objects_matched()
    return model(inputs["mlp"]).numpy()

  one = os.path.join(root, "layout_map_one.json")
  results = {}
  if n == 4:
    losses = {opt: run(f"lm_one_{opt}", mlp[opt], opt,
                       distribution_strategy="one_device")
              for opt in ("sgd", "adam")}
    with open(one, "w") as f:
      json.dump(losses, f)
    for opt in ("sgd", "adam"):
      results[f"layout_map_mesh_{opt}"] = compare(
          f"lm_mesh_{opt}", f"lm_one_{opt}",
          run(f"lm_mesh_{opt}", mlp[opt], opt, _layout_map_for("mlp", 2),
              distribution_strategy="mirrored", num_cpu_devices=4),
          losses[opt])
    return results
  with open(one) as f:
    losses = json.load(f)
  for opt in ("sgd", "adam"):
    results[f"layout_map_t2_{opt}"] = compare(
        f"lm_t2_{opt}", f"lm_one_{opt}",
        run(f"lm_t2_{opt}", mlp[opt], opt, _layout_map_for("mlp", 1),
            distribution_strategy="mirrored"), losses[opt])
  one_outputs = restored_outputs("lm_one_sgd")
  results["layout_map_restored"] = {
      f"{folder}_outputs_diff": float(np.max(np.abs(
          restored_outputs(folder) - one_outputs)))
      for folder in ("lm_t2_sgd", "lm_mesh_sgd")}
  results["layout_map_attention"] = compare(
      "lm_attention_t2", "lm_attention_one",
      run("lm_attention_t2", "attention", "sgd",
          _layout_map_for("attention", 1), distribution_strategy="mirrored"),
      run("lm_attention_one", "attention", "sgd",
          distribution_strategy="one_device"))
  return results


def _docs_example(block: str = "docs-example") -> str:
  """An example of docs/guides/tensor-parallelism.md (`block`:
  docs-example, layout-map-example)."""
  path = os.path.join(testutil.REPO_ROOT, "docs", "guides",
                      "tensor-parallelism.md")
  with open(path, encoding="utf-8") as f:
    page = f.read()
  return re.search(
      rf"<!-- run: tests/tensor_parallel_test.py {block} -->\n"
      r"```python\n(.*?)```", page, re.S).group(1)


def _process(n: int, root: str) -> dict:
  """Every case of a process of `n` logical CPU devices, run in this
  (fresh) process, in order, one MirroredStrategy after another, each
  part's counting its collective keys from its own base (`guarded`; the
  tensor-parallel groups take keys from their devices' names, see
  tfdist/parallel/collectives.py). n = 4: `_child(4)`, then the mesh's
  "sgd" and "adam" parts, ZeRO stage 2's reduce-scatter
  (`_zero_reduce_scatter_child`) and the layout map's 2 x 2 part; n = 2: the
  guide's example first (it splits the CPU itself, so it needs a fresh
  process), `_child(2)`, the trainer and its resumption, the mesh's "t2"
  part (it resumes the n = 4 process's checkpoint from `root`), the
  layout map's T = 2 part (against the n = 4 process's one-device runs)
  and the guide's layout-map example. A part that raises gives
  `{"<part>_error": traceback}`."""
  # pylint: disable=g-import-not-at-top
  import contextlib
  import io
  import traceback
  import tensorflow as tf
  # pylint: enable=g-import-not-at-top
  results, started = {}, [0]

  def guarded(part, fn):
    # Each MirroredStrategy numbers its collectives from group key
    # 1 + `_collective_key_base` (instance keys from 100): a second one on
    # the same devices would reuse the first one's keys with other shapes
    # ("Shape mismatch in the collective instance 100"). Each part's
    # strategy starts 100000 further, as TensorFlow's own tests do.
    tf.distribute.MirroredStrategy._collective_key_base = 100000 * started[0]  # pylint: disable=protected-access
    started[0] += 1
    try:
      results.update(fn() or {})
    except Exception:  # pylint: disable=broad-except
      results[f"{part}_error"] = traceback.format_exc()[-4000:]

  if n == 2:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      guarded("docs", lambda: exec(_docs_example(), {"__name__": "__main__"}))  # pylint: disable=exec-used
    results["docs_stdout"] = out.getvalue()
    guarded("child", lambda: _child(2, root))
    guarded("trainer", lambda: _trainer_child(root, False))
    guarded("trainer", lambda: _trainer_child(root, True))
    guarded("mesh", lambda: _mesh_child(root, "t2"))
    guarded("layout_map", lambda: _layout_map_child(root, 2))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      guarded("layout_map", lambda: exec(  # pylint: disable=exec-used
          _docs_example("layout-map-example"), {"__name__": "__main__"}))
    results["layout_map_docs_stdout"] = out.getvalue()
  else:
    guarded("child", lambda: _child(4, root))
    guarded("mesh", lambda: _mesh_child(root, "sgd"))
    guarded("mesh", lambda: _mesh_child(root, "adam"))
    guarded("mesh", _zero_reduce_scatter_child)
    guarded("layout_map", lambda: _layout_map_child(root, 4))
  return results


_RESULTS = {}


def _results(test_class, part: str) -> dict:
  """The results of both processes (`_process`: 4 devices, then 2), run
  once per test process; raises AssertionError naming `test_class` when a
  process failed or `part` raised in one."""
  if not _RESULTS:
    root = testutil.scratch_dir()
    for n in (4, 2):
      proc = _run_child("import json; from tests import tensor_parallel_test "
                        f"as t; print(json.dumps(t._process({n}, {root!r})))")
      if proc.returncode:
        _RESULTS["failed"] = (f"process of {n} devices failed:\n"
                              f"{proc.stderr[-4000:]}")
        break
      _RESULTS.update(json.loads(proc.stdout.strip().splitlines()[-1]))
  for key in ("failed", f"{part}_error"):
    if key in _RESULTS:
      raise AssertionError(f"{test_class.__name__}: {_RESULTS[key]}")
  return _RESULTS


def _run_child(code: str) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, "-c", code], cwd=testutil.REPO_ROOT,
      capture_output=True, text=True, timeout=900,
      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": testutil.REPO_ROOT + os.pathsep +
                         os.environ.get("PYTHONPATH", "")})


class ArgumentsTest(absltest.TestCase):

  def test_bad_dropout_is_a_config_error(self):
    # In this process: checked before anything is built or placed.
    from tfdist import errors  # pylint: disable=g-import-not-at-top
    from tfdist.parallel.tensor import layers as tensor_parallel  # pylint: disable=g-import-not-at-top
    with self.assertRaisesRegex(errors.ConfigError,
                                r"0 <= dropout < 1\. Received: dropout=1\.5"):
      tensor_parallel.ParallelMultiHeadAttention(num_heads=2, key_dim=4,
                                                 dropout=1.5)


  def test_gathered_view_made_twice_takes_the_second_read_and_write(self):
    # Building the checkpoint view of one model twice (expert parallelism
    # did) mixed _Gathered into the variable's class again: TypeError.
    import keras  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    from tfdist.parallel.tensor import mode as tensor_mode  # pylint: disable=g-import-not-at-top
    variable = keras.Variable(np.zeros([2], np.float32), name="view")
    written = []
    tensor_mode._gather_through(  # pylint: disable=protected-access
        variable, lambda: np.ones([2], np.float32), written.append)
    tensor_mode._gather_through(  # pylint: disable=protected-access
        variable, lambda: np.full([2], 2.0, np.float32), written.append)
    saved = variable._serialize_to_tensors()  # pylint: disable=protected-access
    self.assertEqual(list(next(iter(saved.values())).numpy()), [2.0, 2.0])
    variable._restore_from_tensors(  # pylint: disable=protected-access
        {"VARIABLE_VALUE": np.full([2], 3.0, np.float32)})
    self.assertEqual([list(w) for w in written], [[3.0, 3.0]])

  def test_dry_run_plan_names_the_mesh(self):
    """The `--dry_run` plan's mesh lines for --tensor_parallel=2 on 4
    replicas, as docs/guides/device-mesh.md shows them."""
    lines = _tensor_plan_lines(2, 4)
    self.assertIn("2 data-parallel copies x 2 tensor-parallel", lines[0])
    self.assertEqual(lines[3].split(), ["replica", "1", "data", "0",
                                        "pipeline", "0", "tensor", "1"])
    self.assertEqual(lines[4].split(), ["replica", "2", "data", "1",
                                        "pipeline", "0", "tensor", "0"])
    self.assertEqual(testutil.shown_output("guides/device-mesh.md"), lines)

  def test_tensor_degree_not_dividing_the_replicas_is_refused(self):
    from tfdist import errors  # pylint: disable=g-import-not-at-top
    with self.assertRaisesRegex(errors.ConfigError,
                                r"--tensor_parallel=4 does not divide the 6 "
                                r"devices\. Use one of \[1, 2, 3, 6\]"):
      _tensor_plan_lines(4, 6)


def _tensor_plan_lines(tensor: int, replicas: int) -> list:
  """The run plan's lines of the tensor mode for `--tensor_parallel=T` on
  R replicas (`StepMode.plan_lines`)."""
  from tfdist import config as config_lib  # pylint: disable=g-import-not-at-top
  from tfdist.parallel import modes  # pylint: disable=g-import-not-at-top
  return modes.get_mode("tensor").plan_lines(modes.PlanFacts(
      parallelism=config_lib.ParallelismConfig(tensor_parallel=tensor),
      num_replicas_in_sync=replicas))


class TensorParallelTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.results = _results(cls, "child")

  def case(self, name):
    result = self.results[name]
    self.assertNotIn("error", result, result.get("error"))
    return result

  def assert_trains_like_keras(self, name):
    result = self.case(name)
    self.assertTrue(result["shapes_match"], result)
    self.assertGreater(result["moved"], 1e-3, result)
    self.assertLess(result["max_weight_diff"], _TOLERANCE, result)
    self.assertLess(result["max_loss_diff"], _TOLERANCE, result)
    return result

  def test_mlp_equals_dense(self):
    for n in (2, 4):
      for optimizer in ("sgd", "adam"):
        with self.subTest(n=n, optimizer=optimizer):
          self.assert_trains_like_keras(f"mlp_{optimizer}_{n}")

  def test_attention_block_equals_multi_head_attention(self):
    for n in (2, 4):
      for optimizer in ("sgd", "adam"):
        with self.subTest(n=n, optimizer=optimizer):
          self.assert_trains_like_keras(f"attention_{optimizer}_{n}")

  def test_without_a_strategy_the_layers_are_keras_layers(self):
    self.assert_trains_like_keras("attention_sgd_1")

  def test_built_in_transformer_equals_unsharded(self):
    for optimizer in ("sgd", "adam"):
      with self.subTest(optimizer=optimizer):
        result = self.assert_trains_like_keras(f"transformer_{optimizer}_2")
        # One block: the attention's query, key, value kernels and biases
        # and output kernel, the feed-forward kernels and the first's bias.
        self.assertLen(result["sharded"], 10)
        for weight in result["sharded"]:
          self.assertTrue(weight["distinct"], weight)
    result = self.case("transformer_sgd_2")
    # Each replica holds half of the weights the layers split.
    self.assertAlmostEqual(result["shard_bytes_ratio"], 0.5)
    # The gathered view is the unsharded Transformer's checkpoint.
    self.assertLess(result["restored_outputs_diff"], _TOLERANCE)

  def test_gathered_column_output_feeds_a_dense(self):
    self.assert_trains_like_keras("mlp_gathered_sgd_2")

  def test_each_replica_holds_one_nth_of_each_sharded_weight(self):
    for n in (2, 4):
      result = self.case(f"attention_sgd_{n}")
      # Column kernel and bias, row kernel; query, key, value kernels and
      # biases, output kernel.
      self.assertLen(result["sharded"], 10)
      for weight in result["sharded"]:
        with self.subTest(n=n, path=weight["path"]):
          self.assertLen(weight["shards"], n)
          self.assertLen(weight["devices"], n)
          self.assertTrue(weight["distinct"], weight)
          for shard in weight["shards"]:
            # One axis split N ways, the others whole.
            ratios = [f / s for f, s in zip(weight["full"], shard)]
            self.assertEqual(sorted(ratios), [1.0] * (len(ratios) - 1) +
                             [float(n)], weight)
      # The whole weights (row and attention output biases) stay equal on
      # every replica.
      self.assertEqual(result["whole_mirrors_equal"], [True, True])

  def test_unsharded_checkpoint_restores_and_trained_weights_save(self):
    result = self.case("checkpoint_2")
    self.assertEqual(result["restored_diff"], 0.0)
    self.assertLess(result["outputs_diff"], _TOLERANCE)

  def test_layers_serialize_to_json_and_back(self):
    self.assertEqual(self.results["config_2"],
                     {"ColumnParallelDense": True, "RowParallelDense": True,
                      "ParallelMultiHeadAttention": True})

  def test_clear_errors(self):
    found = self.results["errors_4"]
    self.assertIn("units=6 is not a multiple of 4", found["units"] or "")
    self.assertIn("e.g. 4 or 8", found["units"])
    self.assertIn("num_heads=6 is not a multiple of 4", found["heads"] or "")
    self.assertIn("strategy.run", found["cross_replica_call"] or "")
    self.assertIn("outside `strategy.scope()`",
                  found["optimizer_in_scope"] or "")
    self.assertIn("LossScaleOptimizer", found["loss_scale"] or "")
    self.assertIn("gradient_accumulation_steps=2",
                  found["accumulation"] or "")
    # split_over(2) on 4 replicas: shards 0, 1, 0, 1 (two different).
    self.assertEqual(found["mesh_shards"], [True] * 4 + [False])
    self.assertEqual(found["mesh_full_shape"], [8, 8])
    self.assertIn("split 2 ways over 4 replicas", found["mesh_optimizer"] or "")

  def test_docs_example_runs(self):
    # The example ran first in the process of 2 devices (it splits the CPU
    # itself), as a script (`__name__ == "__main__"`), its output captured.
    self.assertNotIn("docs_error", self.results,
                     self.results.get("docs_error"))
    stdout = self.results["docs_stdout"]
    losses = [float(v) for v in
              re.findall(r"^step \d+ loss ([\d.e-]+)$", stdout, re.M)]
    self.assertLen(losses, 5, stdout)
    self.assertLess(losses[-1], losses[0], stdout)
    self.assertIn("unsharded kernel (8, 32)", stdout)


class TrainerTest(absltest.TestCase):
  """`tfdist.train --model=transformer --tensor_parallel=2` (the same
  `TrainConfig`, run in the child process of 2 logical CPU devices)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.results = _results(cls, "trainer")

  def test_three_steps_equal_one_device(self):
    results = self.results
    self.assertEqual(results["replicas"], 2)
    # Loss counted once, the same dropout masks: one device's loss.
    self.assertAlmostEqual(results["losses"]["tensor_parallel"],
                           results["losses"]["one_device"], places=5)
    self.assertAlmostEqual(results["evaluations"]["tensor_parallel"],
                           results["evaluations"]["one_device"], places=5)
    # The checkpoint holds the gathered view: the unsharded run's keys and
    # shapes (momentum slots included) and its values.
    self.assertEqual(results["after_3"]["same_keys"], True, results)
    self.assertEqual(results["after_3"]["same_shapes"], True, results)
    self.assertLess(results["after_3"]["max_diff"], _TOLERANCE, results)
    # The SavedModel is the unsharded Transformer: the same outputs.
    self.assertLess(results["export_outputs_diff"], _TOLERANCE, results)

  def test_replicas_hold_shards_and_equal_copies(self):
    held = self.results["replicas_hold"]
    # No gradient all-reduce: the replicated weights' copies stay equal
    # (the same whole gradient on every replica) ...
    self.assertEqual(held["replicated_spread"], 0.0, held)
    # ... each replica trains its own shards (_BLOCKS blocks x 10 split
    # weights) and keeps the momentum of its shards only, shard-sized.
    self.assertEqual(held["shards"], 10 * _BLOCKS, held)
    self.assertTrue(held["shards_distinct"], held)
    self.assertEqual(held["shard_slots"], 10 * _BLOCKS, held)
    self.assertTrue(held["shard_slots_shard_shaped"], held)
    self.assertEqual(held["shard_slots_distinct"], 10 * _BLOCKS, held)

  def test_checkpoints_resume_in_the_other_layout(self):
    # The tensor-parallel checkpoint resumed unsharded, the unsharded one
    # with --tensor_parallel=2: one more step each, the same state.
    result = self.results["after_resume"]
    self.assertEqual(result["same_keys"], True, result)
    self.assertLess(result["max_diff"], _TOLERANCE, result)


class MeshTest(absltest.TestCase):
  """`--tensor_parallel=2 --num_cpu_devices=4`: a 2 x 2 data x tensor mesh
  against one device (`_mesh_child`, three parts: SGD with momentum and
  Adam in the process of 4 devices, and the 2 x 2 checkpoint resumed with
  --tensor_parallel=2 alone in the process of 2)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.results = _results(cls, "mesh")

  def _assert_equal_runs(self, part):
    results = self.results
    self.assertEqual(results[f"{part}_replicas"], 4)
    one, mesh = results[f"{part}_losses"]
    # Loss counted once per tensor group, each copy its half of the batch,
    # dropout masks of the global batch: one device's loss.
    self.assertAlmostEqual(one, mesh, places=5)
    one, mesh = results[f"{part}_evaluations"]
    self.assertAlmostEqual(one, mesh, places=5)
    after = results[f"{part}_after_3"]
    # The gathered view under the unsharded keys and shapes (slots too),
    # and the same values: every gradient summed over the data groups.
    self.assertTrue(after["same_keys"], after)
    self.assertTrue(after["same_shapes"], after)
    self.assertLess(after["max_diff"], _TOLERANCE, after)

  def test_sgd_with_momentum_equals_one_device(self):
    self._assert_equal_runs("sgd")

  def test_adam_with_accumulation_equals_one_device(self):
    # Two micro-batches of one example per replica; the evaluation's last
    # batch leaves a tensor group empty (it once crashed the process).
    # The run is --zero_stage=1's (`_mesh_child`).
    self._assert_equal_runs("adam")

  def test_zero_stage_1_in_data_groups_equals_one_device(self):
    # --shard_optimizer_state (SGD with momentum) and --zero_stage=1
    # (Adam, 2 micro-batches): each slot sharded over its data group's 2
    # replicas; 3 updates, the checkpoint (unsharded keys and shapes)
    # within 1e-5 of one device's.
    for part in ("sgd", "adam"):
      with self.subTest(part=part):
        self._assert_equal_runs(f"{part}_zero")

  def test_zero_stage_2_reduce_scatters_within_the_data_group(self):
    # The all-to-all reduce-scatter of stage 2 and the all-reduce and
    # slice of stage 1 both give each replica its data group's shard.
    # (Stage 2's whole run, 3 Adam updates over 2 micro-batches, equals
    # one device within 2.3e-6: checked by hand, docs/guides/
    # tensor-parallelism.md, not run here for the suite's time.)
    self.assertEqual(self.results["zero_reduce_scatter_max_diff"], 0.0)

  def test_zero_stage_1_state_per_device_is_the_formula(self):
    # Per device, per slot kind: ceil(P_t / D) float32 elements, P_t the
    # elements of one replica's variables (its tensor shard of the split
    # weights and the replicated ones, the gradients' bytes / 4), D = 2;
    # beside them two int64 iteration counters (the trainer's optimizer
    # and the replica's copy). Without ZeRO each replica holds P_t per
    # kind and one counter.
    for part, kinds in (("sgd", 1), ("adam", 2)):
      with self.subTest(part=part):
        memory = self.results[f"{part}_zero_memory"]
        zero = memory["zero"]
        elements = zero["gradients_bytes"] // 4
        if "mesh" in memory:  # SGD's: the same mesh without ZeRO.
          mesh = memory["mesh"]
          self.assertEqual(mesh["gradients_bytes"], zero["gradients_bytes"])
          self.assertEqual(mesh["optimizer_bytes"], kinds * 4 * elements + 8)
        self.assertEqual(zero["optimizer_bytes"],
                         kinds * 4 * -(-elements // 2) + 16)

  def test_checkpoint_restores_unsharded_and_at_tensor_parallel_2(self):
    # (The ZeRO run's checkpoint is compared key by key with one device's
    # at step 3, `sgd_zero_after_3`: a one-device resume reads the same.)
    for key in ("one_resumed", "t2_resumed"):
      result = self.results[key]
      self.assertTrue(result["same_keys"], result)
      self.assertLess(result["max_diff"], _TOLERANCE, result)



class LayoutMapTest(absltest.TestCase):
  """`tfdist.fit(model_fn, ..., layout_map=keras.distribution.LayoutMap(
  ...))`: a user's own MLP (column then row Dense pair; functional under
  SGD with momentum, Sequential under Adam) split T = 2 on 2 devices and
  D x T = 2 x 2 on 4, and an attention model (heads, then a
  column -> row pair) at T = 2, each against one device
  (`_layout_map_child`, a part of both processes)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.results = _results(cls, "layout_map")

  def assert_equals_one_device(self, key):
    result = self.results[key]
    # 3 updates' losses and the checkpoint (the unsharded model's keys and
    # shapes, the optimizer's slots included) equal one device's.
    self.assertEqual(result["steps"], [3, 3], result)
    self.assertTrue(result["same_keys"], result)
    self.assertLess(result["max_loss_diff"], _TOLERANCE, result)
    self.assertLess(result["max_diff"], _TOLERANCE, result)

  def test_mlp_split_t2_equals_one_device(self):
    for optimizer in ("sgd", "adam"):
      with self.subTest(optimizer=optimizer):
        self.assert_equals_one_device(f"layout_map_t2_{optimizer}")

  def test_mlp_split_2x2_equals_one_device(self):
    for optimizer in ("sgd", "adam"):
      with self.subTest(optimizer=optimizer):
        self.assert_equals_one_device(f"layout_map_mesh_{optimizer}")

  def test_checkpoint_restores_into_the_unsplit_model(self):
    for key, diff in self.results["layout_map_restored"].items():
      with self.subTest(key=key):
        self.assertLess(diff, _TOLERANCE)

  def test_attention_model_split_t2_equals_one_device(self):
    self.assert_equals_one_device("layout_map_attention")

  def test_docs_example_runs(self):
    # docs/guides/tensor-parallelism.md's layout-map-example, run as a
    # script in the process of 2 devices, its output captured.
    self.assertEqual(
        self.results["layout_map_docs_stdout"].strip().splitlines()[-1:],
        ["4 2"])

if __name__ == "__main__":
  absltest.main()
