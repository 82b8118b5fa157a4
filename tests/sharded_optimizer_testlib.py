"""The cases of tests/sharded_optimizer_test.py and
tests/sharded_optimizer_workers_test.py: sharded optimizer state and
gradients (ZeRO stages 1 and 2) against unsharded training under one
strategy, and the checks of their results.

`mirrored_cases` runs them under MirroredStrategy on 2 logical CPU devices
(in tests/sharded_optimizer_test.py's process, configured as it starts:
logical devices, op determinism and `TF_ENABLE_ONEDNN_OPTS=0` must be set
before TensorFlow starts);
`python -m tests.sharded_optimizer_testlib worker OUT TRAIN_GLOB`, started
by `tfdist.launch`, runs them as one MultiWorkerMirrored worker and writes
its results to OUT. `CaseChecks` holds the assertions both test files make.
"""

import json
import os

from tests import multi_worker_testlib
from tests import testutil

TOLERANCE = 1e-5
STEPS = 3
GLOBAL_BATCH = 8
# (optimizer, stage, gradient accumulation steps, clipping); each against
# the unsharded run of the same optimizer, accumulation and clipping.
MIRRORED_CASES = (
    ("adam", 1, 1, None), ("adam", 2, 2, "global_clipnorm"),
    ("momentum", 1, 2, "clipnorm"), ("momentum", 2, 1, "global_clipnorm"),
    # tfdist's `sgd` is Keras's SGD with momentum, as `momentum` is.
    ("adamw", 2, 2, None), ("rmsprop", 1, 1, None))
MWMS_CASES = (("adam", 2, 2, "global_clipnorm"),
              ("momentum", 1, 1, "clipnorm"),
              # ZeRO stage 3 (tfdist.parallel.zero3): the weights sharded
              # across the two workers too.
              ("adam", 3, 2, "global_clipnorm"))
# Stage 3 on the built-in Transformer (its token embedding kept
# replicated), Adam with global-norm clipping, against unsharded training:
# tokens that never repeat within a batch, as in tests/zero3_test.py (with
# repeats, stage 0's Keras Adam takes the table's IndexedSlices otherwise
# than stages 1-3).
TRANSFORMER_CASE = ("adam", 3, 1, "global_clipnorm")


def case_name(case) -> str:
  return "-".join(str(part) for part in case)


# --- the cases, run under one strategy (child process or worker) -----------
def small_transformer():
  """The built-in Transformer as tests/zero3_test.py's: one block, 8 tokens
  of a 400-token vocabulary, width 16, dropout; logits of 10 classes."""
  from tfdist.models import transformer  # pylint: disable=g-import-not-at-top
  return transformer.build_transformer(
      sequence_length=8, vocabulary_size=400, num_classes=10, embed_dim=16,
      num_heads=2, ff_dim=32, num_layers=1, dropout=0.1)


def unique_tokens(rows: int):
  """`(tokens, labels)`: int64 token ids [rows, 8], 6 per row then 2 of
  padding (0), no id repeated anywhere; int64 labels in [0, 10)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  tokens = np.zeros((rows, 8), "int64")
  tokens[:, :6] = rng.permutation(np.arange(1, 6 * rows + 1)).reshape(rows, 6)
  return tokens, rng.integers(0, 10, size=rows).astype("int64")


def run_cases(strategy, train_glob: str, cases, *, scratch: str,
           fp16_stages=(1, 2), chain_stages=(0, 2, 0),
           single_replica=None, transformer=False) -> dict:
  """Runs the equality, fp16 and checkpoint cases under `strategy`.

  `fp16_stages`: the stages of the fp16 case; `chain_stages`: the stages
  of the checkpoint chain's segments (2 Adam updates each);
  `single_replica`: a one-replica MirroredStrategy that runs the chain's
  third segment (a change of replica count), or None; `transformer`: also
  `TRANSFORMER_CASE` (result `"transformer"`).
  """
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
  from tfdist.data import input_pipeline  # pylint: disable=g-import-not-at-top
  from tfdist.core import optimizers  # pylint: disable=g-import-not-at-top
  from tfdist.training.step import precision  # pylint: disable=g-import-not-at-top
  from tfdist.parallel.zero3 import optimizer as zero3  # pylint: disable=g-import-not-at-top
  from tfdist.parallel.data import sharded_optimizer  # pylint: disable=g-import-not-at-top
  from tfdist.training.step.train_loop import Trainer  # pylint: disable=g-import-not-at-top

  images, labels = next(iter(tf.data.TFRecordDataset(
      input_pipeline.list_files(train_glob), compression_type="GZIP").map(
          datasets.parse_image_example).batch(GLOBAL_BATCH * 8)))
  images, labels = images.numpy(), labels.numpy()

  def build(strat, opt_name, stage, clip=None, dtype="fp32",
            model_fn=None):
    keras.utils.set_random_seed(5)
    with strat.scope():
      # 784 x 7 + 7 + 7 x 10 + 10 = 5575 parameters: odd, so the last of
      # 2 shards holds one element of padding.
      model = model_fn() if model_fn else keras.Sequential([
          keras.Input((28, 28, 1)), keras.layers.Flatten(),
          keras.layers.Dense(7, activation="relu"), keras.layers.Dense(10)])
      optimizer = precision.wrap_optimizer_for_precision(
          optimizers.build_optimizer(
              opt_name, 0.05, weight_decay=0.05 if opt_name == "adamw"
              else 0.0, **({clip: 0.05} if clip else {})), dtype=dtype)
      optimizer.build([] if stage else model.trainable_variables)
    return model, optimizer

  def trainer_for(strat, model, optimizer, stage, accumulate, steps=1):
    return Trainer(
        strategy=strat, model=model, optimizer=optimizer,
        global_batch_size=GLOBAL_BATCH, steps_per_execution=steps,
        gradient_accumulation_steps=accumulate, time_steps=False,
        sharding=sharded_optimizer.ShardingOptions(stage=stage))

  def iterator(strat, accumulate, first_step=0, steps=STEPS,
               data=(images, labels)):
    start, end = first_step * GLOBAL_BATCH, (first_step + steps) * GLOBAL_BATCH
    ds = tf.data.Dataset.from_tensor_slices(
        (data[0][start:end], data[1][start:end])).batch(
            GLOBAL_BATCH // accumulate)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA)
    return iter(strat.experimental_distribute_dataset(
        ds.with_options(options)))

  def weights(model):
    return [np.asarray(v.numpy(), np.float64)
            for v in model.trainable_variables]

  def max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))

  def train(opt_name, stage, accumulate, clip, model_fn=None,
            data=(images, labels)):
    model, optimizer = build(strategy, opt_name, stage, clip,
                             model_fn=model_fn)
    before = weights(model)
    trainer = trainer_for(strategy, model, optimizer, stage, accumulate)
    batches = iterator(strategy, accumulate, data=data)
    for _ in range(STEPS):
      trainer.train_function(batches, tf.constant(1, tf.int32))
    # Stage 3: the weights gathered into the model (all workers at once).
    zero3.materialize(trainer)
    info = {"moved": max_diff(weights(model), before),
            "iterations": int(optimizer.iterations.numpy())}
    if stage:
      # What each replica holds: slots of S elements, none in the user's
      # optimizer; under stage 2 with accumulation, no per-variable
      # accumulators.
      sharded = trainer.sharded
      info["shard_size"] = sharded.layout.shard_size
      info["padding"] = sharded.layout.padding
      info["slot_sizes"] = sorted({
          int(np.prod(v.shape)) for copy in sharded.copies
          for v in copy.variables if v is not copy.iterations and
          int(np.prod(v.shape)) > 1})
      info["user_optimizer_variables"] = len(
          sharded_optimizer.inner_optimizer(optimizer).variables)
      # Between steps the master shard holds nothing (stage 3: the
      # weights), and the state counted per replica is the slots (and
      # accumulator shard) alone.
      info["master_elements"] = sorted({
          int(tf.size(c).numpy()) for c in sharded.master.values})
      slot_bytes = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
                       for v in sharded.copies[0].variables)
      info["state_bytes_beyond_slots"] = (
          sharded.state_bytes_per_replica() - slot_bytes)
      if accumulate > 1:
        info["variable_accumulators"] = len(trainer._accumulators[0])  # pylint: disable=protected-access
    return weights(model), info

  out = {}

  def equal_cases():
    out.update(parameters=None, equal={})
    references = {}
    for case in cases:
      opt_name, stage, accumulate, clip = case
      key = (opt_name, accumulate, clip)
      if key not in references:
        references[key] = train(opt_name, 0, accumulate, clip)
      reference, ref_info = references[key]
      got, info = train(*case)
      out["equal"][case_name(case)] = {"max_diff": max_diff(got, reference),
                                   "reference": ref_info, **info}
    out["parameters"] = int(sum(w.size for w in reference))

  def transformer_case():
    tokens = unique_tokens(STEPS * GLOBAL_BATCH)
    opt_name, stage, accumulate, clip = TRANSFORMER_CASE
    reference, _ = train(opt_name, 0, accumulate, clip,
                         model_fn=small_transformer, data=tokens)
    got, info = train(*TRANSFORMER_CASE, model_fn=small_transformer,
                      data=tokens)
    out["transformer"] = {"max_diff": max_diff(got, reference), **info}

  def fp16_cases():
    # fp16: replica 1's (worker 1's) half of the first batch has inputs of
    # 1e4 (float16 gradients overflow); the second batch is finite.
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
      for stage in fp16_stages:
        with strategy.scope():
          model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
              3, kernel_initializer="ones")])
          optimizer = precision.wrap_optimizer_for_precision(
              keras.optimizers.SGD(1e-3), dtype="fp16", loss_scale="dynamic")
          optimizer.build([])
        trainer = trainer_for(strategy, model, optimizer, stage, 1, steps=1)
        inputs = np.ones((2 * GLOBAL_BATCH, 4), np.float32)
        inputs[GLOBAL_BATCH // 2:GLOBAL_BATCH] = 1e4
        ds = tf.data.Dataset.from_tensor_slices(
            (inputs, np.zeros([2 * GLOBAL_BATCH], np.int64))).batch(
                GLOBAL_BATCH)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA)
        it = iter(strategy.experimental_distribute_dataset(
            ds.with_options(options)))
        steps = []
        for _ in range(2):
          sums = trainer.train_function(it, tf.constant(1, tf.int32))
          kernels = [np.asarray(k, np.float64) for k in
                     strategy.experimental_local_results(
                         model.layers[-1].kernel.value)]
          steps.append({
              "skipped": float(sums["skipped_steps"]),
              "loss_scale": precision.current_loss_scale(optimizer),
              "iterations": int(optimizer.iterations.numpy()),
              "kernel_finite": all(bool(np.isfinite(k).all())
                                   for k in kernels),
              "kernel_unchanged": all(bool((k == 1).all()) for k in kernels)})
        out[f"fp16_stage{stage}"] = steps
    finally:
      keras.mixed_precision.set_global_policy("float32")

  def checkpoint_chain():
    # Checkpoints: a chain of `chain_stages` segments, 2 Adam updates each,
    # each restoring the previous one's checkpoint, against as many
    # uninterrupted unsharded updates.
    def segment(strat, stage, first_step, restore=None, save=None):
      model, optimizer = build(strat, "adam", stage)
      trainer = trainer_for(strat, model, optimizer, stage, 1, steps=2)
      checkpoint = tf.train.Checkpoint(
          model=model, optimizer=(trainer.sharded.checkpoint_view()
                                  if trainer.sharded else optimizer))
      if restore:
        checkpoint.restore(restore).assert_existing_objects_matched()
      trainer.train_function(iterator(strat, 1, first_step, steps=2),
                             tf.constant(2, tf.int32))
      path = checkpoint.save(save) if save else None
      return weights(model), path

    chain = [(single_replica if i == 2 and single_replica else strategy,
              stage) for i, stage in enumerate(chain_stages)]
    path = None
    saved = []
    for i, (strat, stage) in enumerate(chain):
      final, path = segment(strat, stage, 2 * i, restore=path,
                            save=os.path.join(scratch, f"ckpt-{i}"))
      saved.append(path)
    model, optimizer = build(strategy, "adam", 0)
    total = 2 * len(chain)
    trainer_for(strategy, model, optimizer, 0, 1, steps=total).train_function(
        iterator(strategy, 1, 0, steps=total), tf.constant(total, tf.int32))

    def layout(path):
      return sorted((name, shape) for name, shape in
                    tf.train.list_variables(path) if name.startswith(
                        "optimizer"))

    out["checkpoint"] = {
        "chain_vs_uninterrupted": max_diff(final, weights(model)),
        "sharded_layout_equals_unsharded": all(
            layout(path) == layout(saved[0]) for path in saved[1:]),
        "slot_entries": len([n for n, _ in layout(saved[1])
                             if n.startswith("optimizer/_variables/")]),
        "replica_counts": [s.num_replicas_in_sync for s, _ in chain]}

  for part in (equal_cases, fp16_cases, checkpoint_chain) + (
      (transformer_case,) if transformer else ()):
    error = guarded(part)
    if error:
      out[part.__name__] = error
  return out


def guarded(fn):
  """`fn()`, or {"error": its traceback}."""
  try:
    return fn()
  except Exception as e:  # pylint: disable=broad-except
    import traceback  # pylint: disable=g-import-not-at-top
    return {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}


def resting_memory(strategy, stage: int = 1) -> dict:
  """What the compiled step of ZeRO `stage` keeps between calls: the allocator's
  bytes at rest with the step function alive, less without it (one
  allocator serves all logical CPU devices). A model of 529,930
  parameters, so that each replica's shard (1 MiB of int32 per replica at
  N = 2) is under Grappler's 10 MiB constant-folding limit."""
  import gc  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.parallel.zero3 import optimizer as zero3  # pylint: disable=g-import-not-at-top,unused-import
  from tfdist.parallel.data import sharded_optimizer  # pylint: disable=g-import-not-at-top
  from tfdist.training.step.train_loop import Trainer  # pylint: disable=g-import-not-at-top

  def at_rest():
    gc.collect()
    # The collectives' threads release their buffers shortly after a step
    # returns: read until 5 reads 20 ms apart agree (at most 2 s).
    reads = [tf.config.experimental.get_memory_info("CPU:0")["current"]]
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and (
        len(reads) < 5 or len(set(reads[-5:])) > 1):
      time.sleep(0.02)
      reads.append(tf.config.experimental.get_memory_info("CPU:0")["current"])
    return reads[-1]

  with strategy.scope():
    model = keras.Sequential([keras.Input((1024,)),
                              keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(10)])
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build([])
  trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                    global_batch_size=GLOBAL_BATCH, time_steps=False,
                    sharding=sharded_optimizer.ShardingOptions(stage=stage))
  rng = np.random.default_rng(0)
  data = tf.data.Dataset.from_tensor_slices(
      (rng.normal(size=(3 * GLOBAL_BATCH, 1024)).astype(np.float32),
       rng.integers(0, 10, size=3 * GLOBAL_BATCH))).batch(GLOBAL_BATCH)
  batches = iter(strategy.experimental_distribute_dataset(data))
  for _ in range(2):
    trainer.train_function(batches, tf.constant(1, tf.int32))
  with_function = at_rest()
  trainer.train_function = None
  return {"function_bytes": with_function - at_rest(),
          "shard_size": trainer.sharded.layout.shard_size}


def mirrored_cases(train_glob: str, devices) -> dict:
  """The cases under MirroredStrategy on the 2 logical CPU `devices`
  (tests/sharded_optimizer_test.py: its process configured as it starts,
  with op determinism and TensorFlow's BFC CPU allocator, whose statistics
  `resting_memory` reads), and the chain's third segment on the first
  device alone. Returns `{"mirrored", "resting", "resting_stage3"}`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  mirrored = tf.distribute.MirroredStrategy(list(devices))
  single = tf.distribute.MirroredStrategy(list(devices[:1]))
  return {"mirrored": guarded(lambda: run_cases(
      mirrored, train_glob, MIRRORED_CASES, scratch=testutil.scratch_dir(),
      fp16_stages=(1, 2, 3), chain_stages=(0, 1, 2, 0),
      single_replica=single)),
          "resting": guarded(lambda: resting_memory(mirrored)),
          "resting_stage3": guarded(lambda: resting_memory(mirrored, 3))}


def worker_main(out_dir: str, train_glob: str):
  """One MultiWorkerMirrored worker: the cases; writes its results."""
  strategy = multi_worker_testlib._strategy(out_dir)  # pylint: disable=protected-access
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.experimental.enable_op_determinism()
  task = multi_worker_testlib._task_name()  # pylint: disable=protected-access
  scratch = os.path.join(out_dir, task)
  os.makedirs(scratch, exist_ok=True)
  result = guarded(lambda: run_cases(strategy, train_glob, MWMS_CASES,
                                   scratch=scratch, fp16_stages=(1,),
                                   chain_stages=(0, 2, 0),
                                   transformer=True))
  with open(os.path.join(out_dir, f"sharded-{task}.json"), "w") as f:
    json.dump(result, f)
  print(f"sharded: {task} done", flush=True)


class CaseChecks:
  """Assertions shared by both strategies' results."""

  def check_equal(self, result, cases):
    self.assertNotIn("equal_cases", result, result.get("equal_cases"))
    for case in cases:
      got = result["equal"][case_name(case)]
      with self.subTest(case=case_name(case)):
        self.assertLess(got["max_diff"], TOLERANCE, got)
        # Training moved the weights (the comparison is not vacuous).
        self.assertGreater(got["moved"], 1e-3, got)
        self.assertEqual(got["iterations"], STEPS)
        self.assertEqual(got["reference"]["iterations"], STEPS)
        # Each replica's slots are one shard: ceil(P / 2) elements.
        self.assertEqual(got["shard_size"], -(-result["parameters"] // 2))
        self.assertEqual(got["padding"], 1)
        self.assertEqual(got["slot_sizes"], [got["shard_size"]])
        self.assertLessEqual(got["user_optimizer_variables"], 2)
        stage3 = case[1] == 3
        self.assertEqual(got["master_elements"],
                         [got["shard_size"] if stage3 else 0])
        self.assertEqual(got["state_bytes_beyond_slots"],
                         4 * got["shard_size"]
                         if case[1] >= 2 and case[2] > 1 else 0)
        if case[2] > 1:
          self.assertEqual(got["variable_accumulators"],
                           0 if case[1] >= 2 else 4)

  def check_fp16(self, result, stages=(1, 2)):
    self.assertNotIn("fp16_cases", result, result.get("fp16_cases"))
    for stage in stages:
      first, second = result[f"fp16_stage{stage}"]
      self.assertEqual(first["skipped"], 1.0)
      self.assertEqual(first["loss_scale"], 2.0**14)
      self.assertEqual(first["iterations"], 0)
      self.assertTrue(first["kernel_finite"])
      self.assertTrue(first["kernel_unchanged"])
      self.assertEqual(second["skipped"], 0.0)
      self.assertEqual(second["loss_scale"], 2.0**14)
      self.assertEqual(second["iterations"], 1)
      self.assertTrue(second["kernel_finite"])
      self.assertFalse(second["kernel_unchanged"])

  def check_transformer(self, result):
    self.assertNotIn("transformer_case", result,
                     result.get("transformer_case"))
    got = result["transformer"]
    self.assertLess(got["max_diff"], TOLERANCE, got)
    self.assertGreater(got["moved"], 1e-3, got)
    self.assertEqual(got["iterations"], STEPS)
    # The weights were sharded (the token table stays whole on each
    # replica, out of the shards).
    self.assertEqual(got["master_elements"], [got["shard_size"]])
    self.assertGreater(got["shard_size"], 0)

  def check_checkpoint(self, result, replica_counts):
    self.assertNotIn("checkpoint_chain", result,
                     result.get("checkpoint_chain"))
    ckpt = result["checkpoint"]
    self.assertLess(ckpt["chain_vs_uninterrupted"], TOLERANCE, ckpt)
    self.assertTrue(ckpt["sharded_layout_equals_unsharded"], ckpt)
    self.assertEqual(ckpt["slot_entries"], 8)  # Adam: 2 slots x 4 variables.
    self.assertEqual(ckpt["replica_counts"], replica_counts)


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top
  if len(sys.argv) == 4 and sys.argv[1] == "worker":
    worker_main(sys.argv[2], sys.argv[3])
  else:
    sys.exit("usage: python -m tests.sharded_optimizer_testlib worker "
             "OUT_DIR TRAIN_GLOB")
