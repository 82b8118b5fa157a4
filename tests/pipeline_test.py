"""Pipeline parallelism (tfdist.parallel.pipeline) trains like the unsplit model.

On 4 logical CPU devices (8 for the data x pipeline x tensor mesh) with
op determinism (set when this file is
imported, before TensorFlow's runtime starts: run it as its own process):

* 3 updates of SGD with momentum through P = 2 and 4 stages, M = 1, 2
  and 4 micro-batches, GPipe and 1F1B (all 12), and of Adam through 4 of
  them and M = 8 (the cases: `_cases`), give the unsplit
  one-device run's weights and losses within 1e-5, on a functional model
  whose skip connection crosses every cut (balanced cuts and named cuts),
  and on a Sequential model; so do 3 updates of both under the
  interleaved schedule (P = 2, V = 2 chunks per stage, M = 4);
* each stage runs its forward and backward tasks in the schedule's order
  (recorded by the tasks themselves; under the interleaved schedule a
  device's tasks of both its chunks, in one chain), and 1F1B keeps at
  most P - s micro-batches in flight on stage s where GPipe keeps M;
* the interleaved order (pure): Megatron-LM's order for P = 2, V = 2,
  M = 4 written out, every task once, and a simulation of the orders
  with a forward's cost 1/V and a backward's 2/V (one chunk) that gives
  the bubble (P-1)/(V*M+P-1) exactly (and 1F1B's (P-1)/(M+P-1));
* `place_variables` moves each stage's variables to its device, and the
  optimizer's state follows them; trained so, the run is still equal;
* a pipelined run's checkpoint (model and optimizer, the variables on 4
  devices) restores into the unsplit model, whose next update equals the
  pipelined run's;
* two copies of a two-stage pipeline (`DataCopies` on a data 2 x
  pipeline 2 mesh, `train_step(..., copies=...)`), each on half of the
  batch, train like the unsplit model (SGD with momentum and Adam, GPipe
  and 1F1B), the copies' variables on their own devices;
* a user's MLP whose Dense layers a Keras LayoutMap splits by columns
  and rows (two Megatron pairs), cut into P = 2 stages, each stage's
  split layers over its T = 2 devices (`tfdist.parallel.pipeline.
  tensor`), trains like the unsplit model (3 updates, SGD with momentum
  and Adam) on a pipeline x tensor mesh of 4 devices (D = 1) and with
  D = 2 copies on a data x pipeline x tensor mesh of 8, every shard's
  weights on its own device; `tfdist.fit` trains it so on the 8 devices
  (`pipeline_stages=2, num_cpu_devices=8` and the map) to the one-device
  run's weights (3 updates of SGD with momentum), the plan printing the
  mesh with each device's coordinates;
* the refusals: P above the layers or the devices (P * V chunks above
  the layers), M not dividing the batch, a layer shared across stages, a
  subclassed model, bad cut names, an unknown schedule, virtual stages
  that do not fit the schedule or M, copies of an interleaved pipeline.
"""

import json
import os
import re
import shlex
import sys
import threading

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from absl.testing import absltest  # pylint: disable=g-import-not-at-top
from absl.testing import parameterized  # pylint: disable=g-import-not-at-top
import keras  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

from tfdist import errors  # pylint: disable=g-import-not-at-top
from tfdist.distribute import devices  # pylint: disable=g-import-not-at-top
from tfdist.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
from tfdist.parallel.pipeline import copies as copies_lib  # pylint: disable=g-import-not-at-top
from tfdist.parallel.pipeline import stages as pipeline  # pylint: disable=g-import-not-at-top
from tfdist.parallel.pipeline import tensor as pipeline_tensor  # pylint: disable=g-import-not-at-top
from tests import testutil  # pylint: disable=g-import-not-at-top

# The first 4 for every test but the data x pipeline x tensor mesh's.
ALL_DEVICES = devices.configure_cpu_devices(8)
DEVICES = ALL_DEVICES[:4]
tf.config.experimental.enable_op_determinism()

BATCH = 16
STEPS = 3
TOLERANCE = 1e-5
_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(STEPS, BATCH, 8)).astype("float32")
Y = _RNG.normal(size=(STEPS, BATCH, 3)).astype("float32")
OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
}


def skip_model(seed=1):
  """Six layer calls; block_1's output skips to block_4 (an Add)."""
  keras.utils.set_random_seed(seed)
  x = keras.Input((8,), name="features")
  h1 = keras.layers.Dense(16, activation="tanh", name="block_1")(x)
  h2 = keras.layers.Dense(16, activation="tanh", name="block_2")(h1)
  h3 = keras.layers.Dense(16, activation="tanh", name="block_3")(h2)
  added = keras.layers.Add(name="block_4")([h1, h3])
  h5 = keras.layers.Dense(16, activation="tanh", name="block_5")(added)
  return keras.Model(x, keras.layers.Dense(3, name="block_6")(h5),
                     name="skip")


def sequential_model(seed=1):
  keras.utils.set_random_seed(seed)
  return keras.Sequential(
      [keras.Input((8,))] +
      [keras.layers.Dense(16, activation="relu", name=f"dense_{i}")
       for i in range(3)] + [keras.layers.Dense(3, name="logits")],
      name="chain")


def _loss_fn():
  return keras.losses.MeanSquaredError()


def unsplit_run(make_model, optimizer_name, steps=STEPS):
  """`(weights, losses)` of `steps` plain one-device updates."""
  model, optimizer, loss_fn = (make_model(), OPTIMIZERS[optimizer_name](),
                               _loss_fn())

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  losses = [float(step(X[i], Y[i])) for i in range(steps)]
  return [w.numpy() for w in model.weights], losses


def pipelined(model, optimizer, num_microbatches, schedule, **split):
  pipe = pipeline.split_model(model, **split)
  loss_fn = _loss_fn()

  @tf.function
  def step(x, y):
    return pipe.train_step(x, y, loss_fn=loss_fn, optimizer=optimizer,
                           num_microbatches=num_microbatches,
                           schedule=schedule)

  return pipe, step


_REFERENCE = {}


def reference(make_model, optimizer_name):
  key = (make_model.__name__, optimizer_name)
  if key not in _REFERENCE:
    _REFERENCE[key] = unsplit_run(make_model, optimizer_name)
  return _REFERENCE[key]


# The schedules of one chunk per stage (the interleaved one: its own test).
_ONE_CHUNK = (pipeline.GPIPE, pipeline.ONE_F_ONE_B)


def _cases():
  """SGD with momentum on every P x M x schedule; Adam on each P, each
  schedule and M = 1, 2, 4 once, and on M = 8. (P, M and the schedule
  decide the gradients, which one `apply_gradients` then applies to all
  the variables; SGD's update is proportional to them, so it also sees a
  wrongly scaled gradient, which Adam's normalization would hide.)"""
  cases = []
  for stages in (2, 4):
    for micro in (1, 2, 4):
      for schedule in _ONE_CHUNK:
        cases.append(("sgd_momentum", stages, micro, schedule))
  cases += [("adam", 2, 2, "gpipe"), ("adam", 2, 4, "1f1b"),
            ("adam", 4, 1, "1f1b"), ("adam", 4, 4, "gpipe")]
  cases += [("adam", 4, 8, schedule) for schedule in _ONE_CHUNK]
  return [dict(testcase_name=f"{o}_P{p}_M{m}_{s}", optimizer=o, stages=p,
               micro=m, schedule=s) for o, p, m, s in cases]


def _simulated_bubble(orders, num_chunks: int, virtual: int) -> float:
  """The mean idle fraction of the stages when they run `orders` (per
  stage, (kind, micro-batch, chunk)) as soon as their data is there, a
  chunk's forward taking 1/V and its backward 2/V (a stage's work on one
  micro-batch: 1 + 2); fails on a deadlock."""
  done, position = {}, [0] * len(orders)
  free, busy = [0.0] * len(orders), [0.0] * len(orders)
  while any(p < len(o) for p, o in zip(position, orders)):
    progressed = False
    for s, order in enumerate(orders):
      if position[s] == len(order):
        continue
      kind, m, c = order[position[s]]
      if kind == "F":
        needs = [("F", m, c - 1)] if c else []
      else:
        needs = [("F", m, c)] + (
            [("B", m, c + 1)] if c < num_chunks - 1 else [])
      if all(n in done for n in needs):
        cost = (1.0 if kind == "F" else 2.0) / virtual
        done[(kind, m, c)] = free[s] = max(
            [free[s]] + [done[n] for n in needs]) + cost
        busy[s] += cost
        position[s] += 1
        progressed = True
    assert progressed, f"deadlock at {position}"
  span = max(free)
  return sum(1 - b / span for b in busy) / len(orders)


class EqualToUnsplitTest(parameterized.TestCase):

  def assert_same_run(self, expected, model, losses):
    weights, expected_losses = expected
    np.testing.assert_allclose(losses, expected_losses, atol=TOLERANCE,
                               rtol=0)
    self.assertLen(model.weights, len(weights))
    for want, got in zip(weights, model.weights):
      np.testing.assert_allclose(got.numpy(), want, atol=TOLERANCE, rtol=0,
                                 err_msg=got.path)

  @parameterized.named_parameters(*_cases())
  def test_balanced_cuts(self, optimizer, stages, micro, schedule):
    model = skip_model()
    pipe, step = pipelined(model, OPTIMIZERS[optimizer](), micro, schedule,
                           num_stages=stages)
    self.assertLen(pipe.stages, stages)
    # block_1's output crosses the first cut: stage 0 hands on more than
    # the next layer's input when block_1 is alone in it.
    self.assertEqual([s.device for s in pipe.stages], DEVICES[:stages])
    losses = [float(step(X[i], Y[i])) for i in range(STEPS)]
    self.assert_same_run(reference(skip_model, optimizer), model, losses)

  @parameterized.named_parameters(
      ("gpipe", "gpipe", "sgd_momentum"), ("1f1b", "1f1b", "adam"))
  def test_named_cuts_carry_the_skip_across_two_stages(self, schedule,
                                                       optimizer):
    model = skip_model()
    pipe, step = pipelined(model, OPTIMIZERS[optimizer](), 4, schedule,
                           cuts=["block_2", "block_3", "block_5"])
    self.assertEqual([s.layer_names for s in pipe.stages],
                     [("block_1",), ("block_2",), ("block_3", "block_4"),
                      ("block_5", "block_6")])
    # Stages 1 and 2 receive block_1's output too (stage 1 only carries it).
    self.assertEqual([len(s.input_keys) for s in pipe.stages], [1, 1, 2, 1])
    self.assertEqual([len(s.output_keys) for s in pipe.stages], [1, 2, 1, 1])
    losses = [float(step(X[i], Y[i])) for i in range(STEPS)]
    self.assert_same_run(reference(skip_model, optimizer), model, losses)

  @parameterized.named_parameters(("sgd_momentum", "sgd_momentum"),
                                  ("adam", "adam"))
  def test_interleaved_P2_V2_M4(self, optimizer):
    model = skip_model()
    pipe, step = pipelined(model, OPTIMIZERS[optimizer](), 4, "interleaved",
                           num_stages=2, virtual_stages=2)
    # 4 chunks, chunk c on device c mod 2; block_1's output skips from
    # chunk 0 to chunk 3 (carried by chunks 1 and 2).
    self.assertEqual((pipe.num_stages, pipe.virtual_stages), (2, 2))
    self.assertEqual([s.device for s in pipe.stages], DEVICES[:2] * 2)
    self.assertEqual([s.layer_names[0] for s in pipe.stages],
                     ["block_1", "block_2", "block_3", "block_4"])
    losses = [float(step(X[i], Y[i])) for i in range(STEPS)]
    self.assert_same_run(reference(skip_model, optimizer), model, losses)

  def test_eager_step(self):
    model, optimizer = skip_model(), OPTIMIZERS["sgd_momentum"]()
    pipe = pipeline.split_model(model, 2)
    losses = [float(pipe.train_step(
        X[i], Y[i], loss_fn=_loss_fn(), optimizer=optimizer,
        num_microbatches=2, schedule="1f1b")) for i in range(STEPS)]
    self.assert_same_run(reference(skip_model, "sgd_momentum"), model,
                         losses)

  def test_sequential_model(self):
    model = sequential_model()
    pipe, step = pipelined(model, OPTIMIZERS["adam"](), 2, "1f1b",
                           num_stages=2)
    self.assertLen(pipe.stages, 2)
    losses = [float(step(X[i], Y[i])) for i in range(STEPS)]
    self.assert_same_run(reference(sequential_model, "adam"), model, losses)

  @parameterized.named_parameters(("gpipe", "gpipe"), ("1f1b", "1f1b"))
  def test_embedding_gradients_sum_over_microbatches(self, schedule):
    # An Embedding's gradient is an IndexedSlices per micro-batch; summing
    # them with `+` failed (the built-in Transformer in stages).
    tokens = _RNG.integers(0, 20, size=(STEPS, BATCH, 6)).astype("int32")

    def embedding_model():
      keras.utils.set_random_seed(3)
      x = keras.Input((6,), dtype="int32", name="tokens")
      h = keras.layers.Embedding(20, 8, name="embed")(x)
      h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
      h = keras.layers.Dense(16, activation="tanh", name="hidden")(h)
      return keras.Model(x, keras.layers.Dense(3, name="out")(h))

    want_model, want_opt, loss_fn = (embedding_model(),
                                     OPTIMIZERS["adam"](), _loss_fn())
    want_losses = []
    for i in range(STEPS):
      with tf.GradientTape() as tape:
        loss = loss_fn(Y[i], want_model(tokens[i], training=True))
      grads = tape.gradient(loss, want_model.trainable_variables)
      want_opt.apply_gradients(zip(grads, want_model.trainable_variables))
      want_losses.append(float(loss))
    model = embedding_model()
    _, step = pipelined(model, OPTIMIZERS["adam"](), 4, schedule,
                        cuts=["hidden"])
    losses = [float(step(tokens[i], Y[i])) for i in range(STEPS)]
    self.assert_same_run(([w.numpy() for w in want_model.weights],
                          want_losses), model, losses)

  def test_forward_equals_the_model(self):
    model = skip_model()
    pipe = pipeline.split_model(model, 4)
    np.testing.assert_allclose(pipe(X[0]).numpy(), model(X[0]).numpy(),
                               atol=1e-6)

  def test_dict_inputs_flatten_as_the_models(self):
    # Named so that the dict's order and the sorted order differ.
    b = keras.Input((8,), name="b")
    a = keras.Input((8,), name="a")
    h = keras.layers.Dense(4, name="left")(b)
    out = keras.layers.Concatenate(name="cat")(
        [h, keras.layers.Dense(4, name="right")(a)])
    model = keras.Model({"b": b, "a": a}, out)
    pipe = pipeline.split_model(model, 2)
    x = {"b": X[0], "a": X[1]}
    np.testing.assert_allclose(pipe(x).numpy(), model(x).numpy(), atol=1e-6)

  def test_stages_hold_the_models_own_variables(self):
    model = skip_model()
    pipe = pipeline.split_model(model, 4)
    staged = [v for s in pipe.stages for v in s.trainable_variables]
    self.assertEqual([id(v) for v in staged],
                     [id(v) for v in model.trainable_variables])
    self.assertEqual(sum(s.param_bytes for s in pipe.stages),
                     4 * model.count_params())


class PlacementTest(absltest.TestCase):

  def test_placed_variables_and_optimizer_state_train_like_unsplit(self):
    model, optimizer = skip_model(), OPTIMIZERS["adam"]()
    names = [v.path for v in model.weights]
    pipe = pipeline.split_model(model, 4)
    per_device = pipe.place_variables()
    self.assertEqual(per_device, {s.device: s.param_bytes
                                  for s in pipe.stages})
    self.assertEqual(sum(per_device.values()), 4 * model.count_params())
    self.assertEqual([v.path for v in model.weights], names)
    optimizer.build(model.trainable_variables)
    device_of = {}
    for stage in pipe.stages:
      for v in stage.weights:
        self.assertEqual(tf.DeviceSpec.from_string(v.value.device)
                         .device_index,
                         tf.DeviceSpec.from_string(stage.device)
                         .device_index, v.path)
        device_of[v.path] = v.value.device
    # Adam's moments sit beside their variables (Keras colocates them):
    # ".../block_1_kernel_momentum" beside "block_1/kernel" (the
    # optimizer's own name is "adam", "adam_1", ... in this process).
    slots = {v.path.split("/")[-1]: v.value.device
             for v in optimizer.variables}
    for path, device in device_of.items():
      for moment in ("momentum", "velocity"):
        slot = f"{path.replace('/', '_')}_{moment}"
        self.assertEqual(slots[slot], device, slot)

    loss_fn = _loss_fn()

    @tf.function
    def step(x, y):
      return pipe.train_step(x, y, loss_fn=loss_fn, optimizer=optimizer,
                             num_microbatches=4, schedule="1f1b")

    losses = [float(step(X[i], Y[i])) for i in range(STEPS)]
    weights, expected_losses = reference(skip_model, "adam")
    np.testing.assert_allclose(losses, expected_losses, atol=TOLERANCE,
                               rtol=0)
    for want, got in zip(weights, model.weights):
      np.testing.assert_allclose(got.numpy(), want, atol=TOLERANCE, rtol=0,
                                 err_msg=got.path)


def _train_like_unsplit(pipe, optimizer, schedule, copies, make_model,
                        optimizer_name, weights):
  """Trains `pipe` STEPS updates (M = 2, `copies`) and checks its losses
  and `weights()` (in `make_model()`'s order) against the unsplit run's;
  returns the traced step."""
  loss_fn = _loss_fn()

  @tf.function
  def step(x, y):
    return pipe.train_step(x, y, loss_fn=loss_fn, optimizer=optimizer,
                           num_microbatches=2, schedule=schedule,
                           copies=copies)

  losses = [float(step(X[i], Y[i])) for i in range(STEPS)]
  want_weights, want_losses = reference(make_model, optimizer_name)
  np.testing.assert_allclose(losses, want_losses, atol=TOLERANCE, rtol=0)
  for i, (want, got) in enumerate(zip(want_weights, weights())):
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0,
                               err_msg=f"weight {i}")
  return step


class DataCopiesTest(parameterized.TestCase):

  @parameterized.parameters(("sgd_momentum", "gpipe"), ("adam", "1f1b"))
  def test_two_copies_of_two_stages_train_like_unsplit(self, optimizer_name,
                                                       schedule):
    model, optimizer = skip_model(), OPTIMIZERS[optimizer_name]()
    # The guide's block (docs/guides/pipeline-parallelism.md).
    mesh = mesh_lib.DeviceMesh.build(DEVICES, pipeline=2)  # D = 4 / 2
    pipe = pipeline.split_model(
        model, 2, devices=copies_lib.copy0_devices(mesh))
    pipe.place_variables()
    copies = copies_lib.DataCopies(pipe, mesh)
    _train_like_unsplit(pipe, optimizer, schedule, copies, skip_model,
                        optimizer_name,
                        lambda: [w.numpy() for w in model.weights])
    index = lambda d: tf.DeviceSpec.from_string(d).device_index
    self.assertEqual([index(s.device) for s in pipe.stages], [0, 2])
    self.assertEqual(
        {key: {index(v.device) for v in vs}
         for key, vs in copies.variables.items()}, {(1, 0): {1}, (1, 1): {3}})
    # In one process every data group runs the sub-group collectives (a
    # cluster's chief sums its own: tests/pipeline_workers_test.py).
    self.assertEqual(copies.collective_groups(), [True, True])
    # The copy holds copy 0's weights as of the last step's start: the
    # update since is copied to it at the next step's start.
    stage = pipe.stages[1]
    self.assertTrue(any(float(np.max(np.abs(mine.numpy() - v.numpy())))
                        for v, mine in zip(stage.weights,
                                           copies.variables[(1, 1)])))

  def test_a_mesh_that_does_not_fit_is_refused(self):
    pipe = pipeline.split_model(skip_model(), 2, devices=DEVICES[:2])
    with self.assertRaisesRegex(errors.PipelineConfigError,
                                r"does not fit a pipeline of 2 stages"):
      copies_lib.DataCopies(pipe, mesh_lib.DeviceMesh.build(DEVICES,
                                                            pipeline=4))
    with self.assertRaisesRegex(errors.PipelineConfigError,
                                r"stage 1 runs on .*CPU:1, but copy 0's "
                                r"device of that stage in the mesh is "
                                r".*CPU:2"):
      copies_lib.DataCopies(pipe, mesh_lib.DeviceMesh.build(DEVICES,
                                                            pipeline=2))
    mesh = mesh_lib.DeviceMesh.build(DEVICES, pipeline=2)
    pipe = pipeline.split_model(skip_model(), 2,
                                devices=copies_lib.copy0_devices(mesh))
    with self.assertRaisesRegex(errors.PipelineConfigError,
                                r"2 copies x num_microbatches=2 do not "
                                r"divide the batch of 6 examples"):
      pipe.forward_backward(X[0][:6], Y[0][:6], loss_fn=_loss_fn(),
                            num_microbatches=2,
                            copies=copies_lib.DataCopies(pipe, mesh))


def split_mlp(seed=1, input_name="features"):
  """8 -> up_1 16 (relu) -> down_1 8 -> up_2 16 (tanh) -> down_2 3: two
  column-then-row pairs (`split_map`); `input_name` None: an input Keras
  names."""
  keras.utils.set_random_seed(seed)
  x = keras.Input((8,), name=input_name)
  h = keras.layers.Dense(16, activation="relu", name="up_1")(x)
  h = keras.layers.Dense(8, name="down_1")(h)
  h = keras.layers.Dense(16, activation="tanh", name="up_2")(h)
  return keras.Model(x, keras.layers.Dense(3, name="down_2")(h),
                     name="split_mlp")


def split_map(tensor=2):
  """`split_mlp`'s Keras LayoutMap: `up_*` by columns, `down_*` by rows."""
  mesh = keras.distribution.DeviceMesh(
      (1, tensor), ["batch", "model"],
      devices=[f"cpu:{i}" for i in range(tensor)])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map["up_.*/kernel"] = (None, "model")
  layout_map["down_.*/kernel"] = ("model", None)
  return layout_map


def _guide_block(name="pxt-guide-block", **names) -> dict:
  """Runs docs/guides/device-mesh.md's block `name` (pxt-guide-block, or
  pxt-fit-block) with `names` (pxt-guide-block: devices, model,
  layout_map) defined; returns its names."""
  with open(os.path.join(testutil.REPO_ROOT, "docs", "guides",
                         "device-mesh.md"), encoding="utf-8") as f:
    code = re.search(rf"<!-- run: tests/pipeline_test.py {name} -->"
                     r"\n```python\n(.*?)```", f.read(), re.S).group(1)
  exec(compile(code, "device-mesh.md", "exec"), names)  # pylint: disable=exec-used
  return names


class TensorStagesTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("D2_P2_T2_sgd_momentum", 2, "sgd_momentum", "gpipe"),
      ("D2_P2_T2_adam", 2, "adam", "1f1b"),
      ("D1_P2_T2_sgd_momentum", 1, "sgd_momentum", "1f1b"),
      ("D1_P2_T2_adam", 1, "adam", "gpipe"))
  def test_split_stages_train_like_unsplit(self, data, optimizer_name,
                                           schedule):
    # docs/guides/device-mesh.md's block pxt-guide-block builds it.
    built = _guide_block(devices=ALL_DEVICES[:4 * data], model=split_mlp(),
                         layout_map=split_map())
    model, pipe, copies = built["split"], built["pipe"], built["data_copies"]
    optimizer = OPTIMIZERS[optimizer_name]()
    optimizer.build(model.trainable_variables)  # Slots beside the shards.
    step = _train_like_unsplit(pipe, optimizer, schedule, copies, split_mlp,
                               optimizer_name,
                               lambda: pipeline_tensor.full_weights(model))
    # Each shard on its device: index(d, p, t) = (p * D + d) * T + t.
    def index(v):
      v = v.value if isinstance(v, keras.Variable) else v  # A tf.Variable.
      return tf.DeviceSpec.from_string(v.device).device_index

    for p, stage in enumerate(pipe.stages):
      self.assertEqual(
          {(v.name, index(v)) for v in stage.weights},
          {(v.name, 2 * p * data + pipeline.shard_of(v))
           for v in stage.weights})
    for (d, p), mine in (copies.variables.items() if copies else ()):
      self.assertEqual(
          [index(m) for m in mine],
          [(p * data + d) * 2 + pipeline.shard_of(v)
           for v in pipe.stages[p].weights])
    # Each shard's products, forward and backward, run on its device:
    # every device of the mesh runs matrix products.
    graph = step.get_concrete_function(X[0], Y[0]).graph
    self.assertEqual(
        {tf.DeviceSpec.from_string(op.device).device_index
         for op in graph.get_operations() if op.type == "MatMul"},
        set(range(4 * data)))
    # The optimizer's slots sit beside their shards.
    self.assertEqual(
        {index(v) for v in optimizer.variables if "up_1_kernel" in v.path},
        {0, 1})

  def test_a_model_with_an_unnamed_input_is_split(self):
    # Its clone's input is named anew ("keras_tensor_4"): looked up by
    # name, the split failed with "No such layer".
    unsplit = split_mlp(input_name=None)
    model = pipeline_tensor.split_model(unsplit, split_map(), 2)
    for mine, theirs in zip(pipeline_tensor.full_weights(model),
                            unsplit.get_weights()):
      np.testing.assert_array_equal(mine, theirs)

  def test_split_model_keeps_the_random_layers_seed_states(self):
    # An unnamed Input too: the clone renames its input layer.
    keras.utils.set_random_seed(4)
    x = keras.Input((8,))
    h = keras.layers.Dense(16, name="up_1")(x)
    h = keras.layers.Dropout(0.5, name="drop")(h)
    model = keras.Model(x, keras.layers.Dense(8, name="down_1")(h))
    split = pipeline_tensor.split_model(model, split_map(), 2)
    np.testing.assert_array_equal(
        split.get_layer("drop").seed_generator.state.numpy(),
        model.get_layer("drop").seed_generator.state.numpy())

  def test_split_layer_serializes_to_json_and_back(self):
    layer = pipeline_tensor.StageSplitDense(
        16, split="row", shards=2, activation="tanh", use_bias=False,
        kernel_initializer="ones", name="row")
    copy = keras.saving.deserialize_keras_object(json.loads(json.dumps(
        keras.saving.serialize_keras_object(layer))))
    self.assertIsInstance(copy, pipeline_tensor.StageSplitDense)
    self.assertEqual(copy.get_config(), layer.get_config())

  def test_attention_split_by_heads_is_refused(self):
    inputs = keras.Input((5, 8))
    outputs = keras.layers.MultiHeadAttention(2, 4, name="mha")(inputs,
                                                                 inputs)
    layout_map = keras.distribution.LayoutMap(split_map().device_mesh)
    layout_map["mha/(query|key|value)/kernel"] = (None, "model", None)
    layout_map["mha/(query|key|value)/bias"] = ("model", None)
    layout_map["mha/attention_output/kernel"] = ("model", None, None)
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"splits MultiHeadAttention 'mha' by heads: inside a pipeline's "
        r"stages .* only Dense layers split by columns or rows"):
      pipeline_tensor.split_model(keras.Model(inputs, outputs), layout_map,
                                  2)

  def test_a_mesh_of_another_tensor_degree_is_refused(self):
    model = pipeline_tensor.split_model(split_mlp(), split_map(), 2)
    mesh = mesh_lib.DeviceMesh.build(ALL_DEVICES[:4], pipeline=2)  # T = 1
    pipe = pipeline.split_model(model, 2, cuts=["up_2"],
                                devices=copies_lib.copy0_devices(mesh))
    with self.assertRaisesRegex(
        errors.PipelineConfigError,
        r"split 2 way\(s\): build it with DeviceMesh.build\(devices, "
        r"pipeline=2, tensor=2\)"):
      copies_lib.DataCopies(pipe, mesh)


def _guide_text(name: str) -> str:
  """docs/guides/device-mesh.md's block `name` (any fence), as written."""
  with open(os.path.join(testutil.REPO_ROOT, "docs", "guides",
                         "device-mesh.md"), encoding="utf-8") as f:
    return re.search(rf"<!-- run: tests/pipeline_test.py {name} -->"
                     r"\n```\w*\n(.*?)```", f.read(), re.S).group(1)


def _layout_map_command(model_dir: str, train_steps=None) -> dict:
  """docs/guides/device-mesh.md's layout-map-command run in this process:
  its flags parsed as `tfdist.train` parses them (`--model_dir` moved to
  `model_dir`; `--train_steps` replaced when given), then the run
  (`tfdist.experiment.run_experiment`); returns its manifest. The
  layout-map-module block must be importable as `my_mlp`."""
  from tfdist import experiment  # pylint: disable=g-import-not-at-top
  from tfdist.cloud import job_plan  # pylint: disable=g-import-not-at-top
  from tfdist.distribute import environment  # pylint: disable=g-import-not-at-top
  words = shlex.split(_guide_text("layout-map-command").replace("\\\n", " "))
  assert words[:3] == ["python", "-m", "tfdist.train"], words
  drop = ("--model_dir=",) + (("--train_steps=",) if train_steps else ())
  args = [w for w in words[3:] if not w.startswith(drop)]
  args.append(f"--model_dir={model_dir}")
  if train_steps:
    args.append(f"--train_steps={train_steps}")
  config = job_plan.parse_train_flags(args, where="device-mesh.md")
  return experiment.run_experiment(
      config, environment=environment.read_environment({}))


class TrainerTest(absltest.TestCase):
  """`tfdist.fit` with `pipeline_stages=2`, `split_map()` (T = 2) and
  `num_cpu_devices=8`: D x P x T = 2 x 2 x 2 in the trainer; the same run
  from `tfdist.train`'s flags with `--layout_map` (docs/guides/
  device-mesh.md's layout-map-module and layout-map-command), 2 steps and
  then resumed to 3."""

  def test_fit_D2_P2_T2_equals_one_device(self):
    from tfdist import api  # pylint: disable=g-import-not-at-top
    from tfdist.config import TrainConfig  # pylint: disable=g-import-not-at-top
    rng = np.random.default_rng(2)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    built = []

    def model_fn():
      model = split_mlp()
      model.compile(loss="mse")
      built.append(model)
      return model

    api.fit(model_fn, x=x, y=y, verbose=0, config=TrainConfig(
        model_dir=os.path.join(testutil.scratch_dir(), "run"),
        train_steps=3, batch_size=BATCH, deterministic=True, seed=1,
        optimizer="momentum", momentum=0.9, base_learning_rate=0.05,
        lr_scaling="none", mode="train"))
    # The model as built: the one a caller gets back, trained.
    one = built[-1].get_weights()
    with self.assertLogs(level="INFO") as logs:
      # docs/guides/device-mesh.md's block pxt-fit-block: the same run with
      # pipeline_stages=2, num_cpu_devices=8 and the map.
      manifest = _guide_block(
          "pxt-fit-block", model_fn=model_fn, x=x, y=y,
          layout_map=split_map(),
          model_dir=os.path.join(testutil.scratch_dir(), "run"))["result"]
    mesh = built[-1].get_weights()
    self.assertLess(max(float(np.max(np.abs(a - b)))
                        for a, b in zip(one, mesh)), TOLERANCE)
    self.assertEqual((manifest["pipeline"]["data"],
                      manifest["pipeline"]["tensor"]), (2, 2))
    plan = "\n".join(logs.output)
    self.assertIn("mesh: data 2 x pipeline 2 x tensor 2 over 8 devices",
                  plan)
    self.assertRegex(plan, r"/device:CPU:7\s+data 1  pipeline 1  tensor 1")
    self.assert_layout_map_flag_trains(one, mesh)

  def assert_layout_map_flag_trains(self, one, mesh):
    """The guide's `--layout_map` command (its module `my_mlp`: the same
    model, examples and map) for 2 steps, then resumed to 3 by the command
    as written: each start reads the map again (T and the entries in the
    manifest), and the weights equal the fit runs' (one device, and
    D x P x T)."""
    folder = testutil.scratch_dir()
    with open(os.path.join(folder, "my_mlp.py"), "w") as f:
      f.write(_guide_text("layout-map-module"))
    sys.path.insert(0, folder)
    try:
      model_dir = os.path.join(folder, "run")
      manifests = [_layout_map_command(model_dir, train_steps=2),
                   _layout_map_command(model_dir)]
    finally:
      sys.path.remove(folder)
      sys.modules.pop("my_mlp", None)
    for manifest, steps in zip(manifests, (2, 3)):
      config = manifest["config"]
      self.assertEqual(
          (config["layout_map"], config["tensor_parallel"],
           config["layout_map_entries"], config["train_steps"],
           manifest["pipeline"]["data"], manifest["pipeline"]["tensor"]),
          ("my_mlp:layout_map", 2, [["up_.*/kernel", "(None, 'model')"],
                                    ["down_.*/kernel", "('model', None)"]],
           steps, 2, 2))
    self.assertEqual(manifests[0]["flags"]["layout_map"],
                     "my_mlp:layout_map")
    trained = split_mlp(seed=7)
    tf.train.Checkpoint(model=trained).read(tf.train.latest_checkpoint(
        os.path.join(model_dir, "checkpoints"))).expect_partial(
            ).assert_existing_objects_matched()
    for reference in (one, mesh):
      self.assertLess(max(float(np.max(np.abs(a - b))) for a, b in
                          zip(trained.get_weights(), reference)), TOLERANCE)


class CheckpointTest(absltest.TestCase):

  def test_pipelined_checkpoint_restores_into_the_unsplit_model(self):
    model, optimizer = skip_model(), OPTIMIZERS["adam"]()
    pipe, step = pipelined(model, optimizer, 4, "1f1b", num_stages=4)
    pipe.place_variables()  # the variables on 4 devices: same checkpoint
    for i in range(2):
      step(X[i], Y[i])
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(
        os.path.join(testutil.scratch_dir(), "ckpt"))
    step(X[2], Y[2])  # the pipelined run's third update

    unsplit, unsplit_optimizer = skip_model(seed=7), OPTIMIZERS["adam"]()
    unsplit_optimizer.build(unsplit.trainable_variables)
    tf.train.Checkpoint(model=unsplit, optimizer=unsplit_optimizer).restore(
        path).assert_consumed()
    self.assertEqual([v.path for v in unsplit.weights],
                     [v.path for v in model.weights])
    loss_fn = _loss_fn()
    with tf.GradientTape() as tape:
      loss = loss_fn(Y[2], unsplit(X[2], training=True))
    unsplit_optimizer.apply_gradients(zip(
        tape.gradient(loss, unsplit.trainable_variables),
        unsplit.trainable_variables))
    for want, got in zip(model.weights, unsplit.weights):
      np.testing.assert_allclose(got.numpy(), want.numpy(), atol=TOLERANCE,
                                 rtol=0, err_msg=got.path)


class ScheduleTest(parameterized.TestCase):

  def test_orders(self):
    self.assertEqual(pipeline.schedule_order(2, 3, "gpipe")[0],
                     [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1),
                      ("B", 2)])
    self.assertEqual(pipeline.schedule_order(2, 3, "1f1b"),
                     [[("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1),
                       ("B", 2)],
                      [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2),
                       ("B", 2)]])

  @parameterized.parameters((2, 8), (4, 8), (4, 2), (3, 1))
  def test_in_flight(self, stages, micro):
    gpipe = pipeline.schedule_order(stages, micro, "gpipe")
    one_f = pipeline.schedule_order(stages, micro, "1f1b")
    self.assertEqual([pipeline.peak_in_flight(o) for o in gpipe],
                     [micro] * stages)
    self.assertEqual([pipeline.peak_in_flight(o) for o in one_f],
                     [min(stages - s, micro) for s in range(stages)])

  def test_interleaved_order(self):
    # Megatron-LM's order for P = 2, V = 2, M = 4 (chunks 0, 2 on stage 0,
    # 1, 3 on stage 1): stage 0 warms up with 2(P-1) + (V-1)P = 4
    # forwards (micro-batches 0, 1 through chunk 0, then through chunk 2),
    # stage 1 with 2; backwards run the chunks in reverse.
    self.assertEqual(pipeline.schedule_order(2, 4, "interleaved", 2), [
        [("F", 0, 0), ("F", 1, 0), ("F", 0, 2), ("F", 1, 2),
         ("F", 2, 0), ("B", 0, 2), ("F", 3, 0), ("B", 1, 2),
         ("F", 2, 2), ("B", 0, 0), ("F", 3, 2), ("B", 1, 0),
         ("B", 2, 2), ("B", 3, 2), ("B", 2, 0), ("B", 3, 0)],
        [("F", 0, 1), ("F", 1, 1), ("F", 0, 3), ("B", 0, 3),
         ("F", 1, 3), ("B", 1, 3), ("F", 2, 1), ("B", 0, 1),
         ("F", 3, 1), ("B", 1, 1), ("F", 2, 3), ("B", 2, 3),
         ("F", 3, 3), ("B", 3, 3), ("B", 2, 1), ("B", 3, 1)]])

  @parameterized.parameters((2, 4, 2), (2, 8, 2), (4, 4, 2), (4, 8, 2),
                            (4, 8, 4), (3, 6, 3))
  def test_interleaved_tasks_in_flight_and_bubble(self, p, m, v):
    orders = pipeline.schedule_order(p, m, "interleaved", v)
    for s, order in enumerate(orders):
      want = {(kind, mb, c) for kind in "FB" for mb in range(m)
              for c in range(s, p * v, p)}
      self.assertLen(order, 2 * v * m)
      self.assertEqual(set(order), want)
      self.assertEqual(pipeline.peak_in_flight(order),
                       min(2 * (p - s - 1) + (v - 1) * p + 1, v * m))
    self.assertAlmostEqual(_simulated_bubble(orders, p * v, v),
                           pipeline.bubble_fraction(p, m, v), places=9)
    self.assertAlmostEqual(pipeline.bubble_fraction(p, m, v),
                           (p - 1) / (v * m + p - 1))
    one_f = [[(kind, mb, s) for kind, mb in order] for s, order in
             enumerate(pipeline.schedule_order(p, m, "1f1b"))]
    self.assertAlmostEqual(_simulated_bubble(one_f, p, 1),
                           pipeline.bubble_fraction(p, m), places=9)

  def test_virtual_stages_must_fit_the_schedule(self):
    with self.assertRaisesRegex(
        errors.PipelineConfigError,
        r"num_microbatches \(received 3\) to be a multiple of "
        r"num_stages=2.*among 2, 4, 6"):
      pipeline.schedule_order(2, 3, "interleaved", 2)
    with self.assertRaisesRegex(
        errors.PipelineConfigError,
        r"schedule='interleaved' needs virtual_stages >= 2 \(received 1\)"):
      pipeline.schedule_order(2, 4, "interleaved")
    with self.assertRaisesRegex(
        errors.PipelineConfigError,
        r"virtual_stages=2 chunks per stage runs schedule='interleaved', "
        r"not '1f1b'"):
      pipeline.schedule_order(2, 4, "1f1b", 2)

  def test_bubble_and_balance(self):
    self.assertAlmostEqual(pipeline.bubble_fraction(4, 8), 3 / 11)
    self.assertEqual(pipeline.balanced_cuts([1, 1, 1, 1], 2), [2])
    self.assertEqual(pipeline.balanced_cuts([8, 1, 1, 1, 1, 4, 4], 3),
                     [1, 5])
    self.assertEqual(pipeline.balanced_cuts([1, 2, 3], 3), [1, 2])
    with self.assertRaisesRegex(errors.PipelineConfigError,
                                r"num_stages=4 is more than the 3 items"):
      pipeline.balanced_cuts([1, 2, 3], 4)

  def test_balance_counts_activations_when_asked(self):
    # Weight bytes per call: 576, 1088, 1088, 0 (Add), 1088, 204: the best
    # cut of 2 is after block_2 (1664 | 2380 bytes). With 1000 examples'
    # outputs (64 bytes each for the 16-wide calls, 12 for the last) it
    # moves after block_3 (194752 | 141292).
    self.assertEqual(pipeline.split_model(skip_model(), 2).stages[0]
                     .layer_names, ("block_1", "block_2"))
    self.assertEqual(pipeline.split_model(skip_model(), 2,
                                          activation_examples=1000)
                     .stages[0].layer_names,
                     ("block_1", "block_2", "block_3"))

  @parameterized.parameters(("gpipe", 3, 1), ("1f1b", 3, 1),
                            ("interleaved", 2, 2))
  def test_stages_run_their_tasks_in_the_schedules_order(self, schedule,
                                                         stages, virtual):
    events, lock = [], threading.Lock()

    class Recorded(keras.layers.Layer):
      """y = x * w; forward and backward log (stage, kind, micro-batch)."""

      def __init__(self, stage, **kwargs):
        super().__init__(**kwargs)
        self.stage = stage

      def build(self, input_shape):
        self.w = self.add_weight(shape=(), initializer="ones", name="w")

      def call(self, x):
        stage = self.stage

        def log(kind, a):
          with lock:
            events.append((stage, kind, int(a.reshape(-1)[0])))

        @tf.custom_gradient
        def recorded(x):

          def forward(a):
            log("F", a)
            return a

          def backward(dy, a):
            log("B", a)
            return dy

          y = tf.numpy_function(forward, [x], tf.float32, stateful=False)
          y.set_shape(x.shape)

          def grad(dy):
            g = tf.numpy_function(backward, [dy, x], tf.float32,
                                  stateful=False)
            g.set_shape(dy.shape)
            return g

          return y, grad

        return recorded(x * self.w)

    micro = 4
    x = keras.Input((1,))
    h = x
    for c in range(stages * virtual):  # One layer a chunk.
      h = Recorded(c, name=f"stage_{c}")(h)
    model = keras.Model(x, h)
    pipe = pipeline.split_model(model, stages, virtual_stages=virtual)
    optimizer = keras.optimizers.SGD(0.0)

    @tf.function
    def mean_step(x, y):
      return pipe.train_step(x, y, loss_fn=lambda _, p: tf.reduce_mean(p),
                             optimizer=optimizer,
                             num_microbatches=micro, schedule=schedule)

    # One example per micro-batch, holding its index (w stays 1).
    xs = np.arange(micro, dtype="float32").reshape(-1, 1)
    mean_step(xs, np.zeros_like(xs))
    order = pipeline.schedule_order(stages, micro, schedule, virtual)
    for s in range(stages):
      # A device's tasks of all its chunks, in one order.
      self.assertEqual([(kind, m, c)[:len(order[s][0])]
                        for c, kind, m in events if c % stages == s],
                       order[s], f"stage {s}")


class RefusalTest(absltest.TestCase):

  def test_more_stages_than_layers(self):
    with self.assertRaisesRegex(
        errors.PipelineConfigError,
        r"num_stages=7 is more than the 6 layer call\(s\) of model 'skip'.*"
        r"choose num_stages <= 6"):
      pipeline.split_model(skip_model(), 7, devices=["/cpu:0"] * 8)

  def test_more_chunks_than_layers_and_copies_of_chunks(self):
    with self.assertRaisesRegex(
        errors.PipelineConfigError,
        r"num_stages=4 x virtual_stages=2 = 8 chunks is more than the 6 "
        r"layer call\(s\) of model 'skip'.*<= 6"):
      pipeline.split_model(skip_model(), 4, virtual_stages=2)
    with self.assertRaisesRegex(
        errors.PipelineConfigError,
        r"num_stages=2 x virtual_stages=2 disagrees with cuts=block_3 "
        r"\(2 chunks\)"):
      pipeline.split_model(skip_model(), 2, cuts=["block_3"],
                           virtual_stages=2)
    pipe = pipeline.split_model(skip_model(), cuts=["block_2", "block_4",
                                                     "block_5"],
                                virtual_stages=2)
    self.assertEqual([s.device for s in pipe.stages], DEVICES[:2] * 2)
    with self.assertRaisesRegex(
        errors.PipelineConfigError,
        r"schedule='interleaved', not 'gpipe'"):
      pipe.check_step(BATCH, 4, "gpipe")
    with self.assertRaisesRegex(errors.PipelineConfigError,
                                r"copies of a pipeline of virtual_stages=2"):
      copies_lib.DataCopies(pipe, mesh_lib.DeviceMesh.build(DEVICES,
                                                            pipeline=2))

  def test_more_stages_than_devices(self):
    with self.assertRaisesRegex(
        errors.PipelineConfigError,
        r"num_stages=3 is more than the 2 device\(s\).*--num_cpu_devices=3"):
      pipeline.split_model(skip_model(), 3, devices=DEVICES[:2])
    with self.assertRaisesRegex(errors.PipelineConfigError,
                                r"more than the 4 device\(s\)"):
      pipeline.split_model(skip_model(), 5, devices=DEVICES)

  def test_microbatches_not_dividing_the_batch(self):
    pipe = pipeline.split_model(skip_model(), 2)
    message = (r"num_microbatches=3 does not divide the batch of 16 "
               r"examples.*\[1, 2, 4, 8, 16\]")
    # At the edge, before anything is traced.
    with self.assertRaisesRegex(errors.PipelineConfigError, message):
      pipe.check_step(BATCH, 3, "gpipe")
    with self.assertRaisesRegex(errors.PipelineConfigError,
                                r"schedule='zb' is not offered"):
      pipe.check_step(BATCH, 2, "zb")
    self.assertEqual(pipe.check_step(BATCH, 4, "1f1b"), 4)
    # While tracing (autograph off: autograph re-raises as StagingError).
    optimizer = OPTIMIZERS["adam"]()

    @tf.function(autograph=False)
    def step(x, y):
      return pipe.train_step(x, y, loss_fn=_loss_fn(), optimizer=optimizer,
                             num_microbatches=3)

    with self.assertRaisesRegex(errors.PipelineConfigError, message):
      step(X[0], Y[0])

  def test_layer_shared_across_stages(self):
    shared = keras.layers.Dense(8, name="shared")
    x = keras.Input((8,))
    h = shared(x)
    h = keras.layers.Dense(8, name="middle")(h)
    model = keras.Model(x, shared(h))
    with self.assertRaisesRegex(
        errors.PipelineConfigError,
        r"layer 'shared' is called in pipeline stages 0 and 1"):
      pipeline.split_model(model, cuts=["middle"])
    # Both calls in one stage is fine.
    self.assertLen(pipeline.split_model(model, 1).stages, 1)

  def test_subclassed_model(self):

    class Subclassed(keras.Model):

      def __init__(self):
        super().__init__(name="custom")
        self.dense = keras.layers.Dense(2)

      def call(self, x):
        return self.dense(x)

    model = Subclassed()
    model(X[0])
    with self.assertRaisesRegex(
        errors.PipelineConfigError,
        r"model 'custom' \(Subclassed\) is a subclassed model without a "
        r"functional graph.*functional API"):
      pipeline.split_model(model, 2)

  def test_bad_cuts_and_schedule(self):
    with self.assertRaisesRegex(errors.PipelineConfigError,
                                r"cut 'block_9' is not a layer.*'block_3'"):
      pipeline.split_model(skip_model(), cuts=["block_9"])
    with self.assertRaisesRegex(errors.PipelineConfigError,
                                r"cuts=block_5,block_3 must name distinct"):
      pipeline.split_model(skip_model(), cuts=["block_5", "block_3"])
    with self.assertRaisesRegex(errors.PipelineConfigError,
                                r"num_stages=3 disagrees with cuts=block_3"):
      pipeline.split_model(skip_model(), 3, cuts=["block_3"])
    with self.assertRaisesRegex(errors.PipelineConfigError,
                                r"schedule='zb' is not offered.*gpipe, 1f1b, "
                                r"interleaved"):
      pipeline.schedule_order(2, 2, "zb")
    self.assertTrue(issubclass(errors.PipelineConfigError, ValueError))
    self.assertEqual(errors.exit_code_for(errors.PipelineConfigError("x")),
                     2)


if __name__ == "__main__":
  absltest.main()
