"""Expert parallelism (`--expert_parallel`, tfdist/parallel/experts/mode.py)
against one device, on 4 logical CPU devices in this process.

One MirroredStrategy over the 4 devices (two strategies of different
sizes in one process reuse a collective group key) runs tfdist's Trainer
with the `experts` mode for K = 3 updates at E_p = 4 (one expert group:
each replica holds 1 of the 4 experts) with Adam, and at E_p = 2 (two
groups of 2 replicas: each expert on 2 replicas, its gradients summed
over them) with SGD and momentum. The model has two MixtureOfExperts
layers: a top-2 one whose capacity drops nothing and a top-1 one whose
capacity drops tokens. The same model on one device (the default
strategy), from the same initial weights, routes each replica's batch as
one group (`group_size` = the tokens of one replica's batch, the rule:
capacity is per routing group, and under expert parallelism a group never
spans replicas), and must give the same losses, weights (the gathered
view), optimizer slots and routing statistics within 1e-5, under op
determinism (and, under mixed_bfloat16, within 2e-3). Then checkpoints: the expert-parallel view restores into the
one-device model and optimizer, and back.
"""

import contextlib
import functools
import io
import os
import re
import tempfile

from absl.testing import absltest
import keras
import numpy as np
import tensorflow as tf

from tests import testutil
from tfdist.distribute import devices as devices_lib

_DEVICES = devices_lib.configure_cpu_devices(4)

# pylint: disable=g-import-not-at-top,wrong-import-position
from tfdist import errors
from tfdist.config import TrainConfig
from tfdist.parallel.experts import layer as moe_layer
from tfdist.parallel.experts import mode as expert_mode
from tfdist.parallel.experts import placement as placement_lib
from tfdist.parallel.experts.layer import MixtureOfExperts
from tests import experts_testlib as experts_lib
# pylint: enable=g-import-not-at-top,wrong-import-position

_EXPERTS, _STEPS, _TOLERANCE = (experts_lib.EXPERTS, experts_lib.STEPS,
                                experts_lib.TOLERANCE)
_REPLICAS = 4
# One replica's tokens: one device's routing group.
_GROUP = experts_lib.replica_tokens(_REPLICAS)
_model, _optimizer = experts_lib.model, experts_lib.optimizer
_data, _train = experts_lib.data, experts_lib.train


@functools.lru_cache(maxsize=None)
def _strategy():
  return tf.distribute.MirroredStrategy(_DEVICES)


@functools.lru_cache(maxsize=None)
def _one_device(optimizer: str, policy: str = "float32",
                micro_steps: int = 1) -> dict:
  """The one-device run of the model (built under the Keras dtype
  `policy`), from the weights every build starts from, its updates of
  `micro_steps` micro-batches (a routing group: one replica's
  micro-batch)."""
  keras.config.set_dtype_policy(policy)
  try:
    one = _model(_GROUP // micro_steps)
  finally:
    keras.config.set_dtype_policy("float32")
  one_trainer, one_losses = _train(tf.distribute.get_strategy(), one,
                                   optimizer, micro_steps=micro_steps)
  return dict(one=one, one_trainer=one_trainer, one_losses=one_losses)


@functools.lru_cache(maxsize=None)
def _runs(expert_parallel: int, optimizer: str, policy: str = "float32",
          zero_stage: int = 0, micro_steps: int = 1) -> dict:
  """The expert-parallel run (under ZeRO `zero_stage`, `micro_steps`
  micro-batches an update) and the one-device run of the same model
  (built under the Keras dtype `policy`)."""
  keras.config.set_dtype_policy(policy)
  try:
    step = expert_mode.build(_model, _strategy(), expert_parallel)
  finally:
    keras.config.set_dtype_policy("float32")
  initial = [np.asarray(w) for w in step.unsharded.get_weights()]
  for got, want in zip(initial, _model(_GROUP).get_weights()):
    np.testing.assert_array_equal(got, want)  # The builds start alike.
  trainer, losses = _train(_strategy(), step.model, optimizer, step,
                           zero_stage=zero_stage, micro_steps=micro_steps)
  return dict(step=step, trainer=trainer, losses=losses,
              **_one_device(optimizer, policy, micro_steps))


def setUpModule():
  tf.config.experimental.enable_op_determinism()


def _assert_all_close(test, got, want, what):
  test.assertEqual(len(got), len(want), what)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                               atol=_TOLERANCE, err_msg=what)


class EqualsOneDeviceTest(absltest.TestCase):

  def _check(self, expert_parallel: int, optimizer: str):
    run = _runs(expert_parallel, optimizer)
    np.testing.assert_allclose(run["losses"], run["one_losses"], rtol=1e-6)
    gathered = run["step"].gathered_model()
    _assert_all_close(self, gathered.get_weights(), run["one"].get_weights(),
                      "weights")
    ours = moe_layer.model_statistics(gathered)
    theirs = moe_layer.model_statistics(run["one"])
    self.assertEqual(sorted(ours), sorted(theirs))
    for key in theirs:
      np.testing.assert_allclose(ours[key], theirs[key], atol=_TOLERANCE,
                                 err_msg=key)
    # The narrow layer dropped tokens, the wide one none.
    self.assertGreater(float(theirs["narrow/dropped_fraction"]), 0.2)
    self.assertEqual(float(theirs["wide/dropped_fraction"]), 0.0)
    # The weights moved: the comparison is not of initial values.
    self.assertGreater(np.abs(run["losses"][0] - run["losses"][-1]), 1e-3)
    # The optimizer's slots, gathered from the replicas.
    view = run["step"].checkpoint_optimizer(run["trainer"])
    _assert_all_close(
        self, [v._tfdist_read() for v in view.variables],  # pylint: disable=protected-access
        [v.numpy() for v in run["one_trainer"].optimizer.variables],
        "optimizer")
    if expert_parallel == 4:
      return
    # Evaluation: 6 examples over 4 replicas (2, 2, 1, 1: padded).
    batch = tf.data.Dataset.from_tensor_slices(
        tuple(a[:6] for a in _data())).batch(6)
    sums = run["trainer"].eval_function(next(iter(
        _strategy().experimental_distribute_dataset(batch))))
    self.assertEqual(float(sums["count"]), 6.0)
    self.assertTrue(np.isfinite(float(sums["loss_sum"])))

  def test_four_way_with_adam_equals_one_device(self):
    self._check(4, "adam")

  def test_two_way_in_two_groups_with_momentum_equals_one_device(self):
    self._check(2, "sgd")

  def test_two_way_under_mixed_bfloat16_is_close_to_one_device(self):
    """bfloat16 rounds each replica's partial gradients (over its tokens,
    or its group's for an expert) before the float32 sum over replicas, as
    under data parallelism, where one device rounds the whole sum once:
    within 2e-3 after 3 updates."""
    run = _runs(2, "sgd", "mixed_bfloat16")
    np.testing.assert_allclose(run["losses"], run["one_losses"], rtol=2e-3)
    gathered = run["step"].gathered_model()
    self.assertEqual(gathered.get_layer("wide").compute_dtype, "bfloat16")
    for a, b in zip(gathered.trainable_weights, run["one"].trainable_weights):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-3,
                                 err_msg=a.path)

  def test_each_replica_holds_only_its_experts(self):
    step = _runs(2, "sgd")["step"]
    narrow = [l for l in step.model.layers if l.name == "narrow"][0]
    self.assertLen(narrow.experts, _EXPERTS // 2)
    for pair in step.pairs:
      parts = [np.asarray(c.numpy()) for c in
               expert_mode._components(pair.variable)]  # pylint: disable=protected-access
      self.assertLen(parts, _REPLICAS)
      self.assertEqual(parts[0].shape, tuple(pair.view.shape))
      if pair.slot is not None:
        # Replicas r and r + 2 hold slot r's experts, and train them alike.
        np.testing.assert_array_equal(parts[0], parts[2])
        np.testing.assert_array_equal(parts[1], parts[3])
        self.assertFalse(np.array_equal(parts[0], parts[1]))


class ZeroTest(absltest.TestCase):
  """ZeRO stage 1 beside expert parallelism (tfdist/parallel/experts/
  zero.py): E_p = 2 on the 4 replicas (two expert groups), the
  non-expert optimizer state sharded over all 4."""

  def _check(self, optimizer: str, slots_per_weight: int, stage: int = 1,
             micro_steps: int = 1):
    run = _runs(2, optimizer, zero_stage=stage, micro_steps=micro_steps)
    step, trainer = run["step"], run["trainer"]
    np.testing.assert_allclose(run["losses"], run["one_losses"], rtol=1e-6)
    self.assertGreater(np.abs(run["losses"][0] - run["losses"][-1]), 1e-3)
    _assert_all_close(self, step.gathered_model().get_weights(),
                      run["one"].get_weights(), "weights")
    view = step.checkpoint_optimizer(trainer)
    _assert_all_close(
        self, [v._tfdist_read() for v in view.variables],  # pylint: disable=protected-access
        [v.numpy() for v in run["one_trainer"].optimizer.variables],
        "optimizer")
    # Per replica: the non-expert slots / 4 (whole shards), and the
    # slots of the replica's 2 of each layer's 4 experts.
    sharded = trainer.sharded
    experts = {id(w) for layer in moe_layer.moe_layers(step.unsharded)
               for e in layer.experts for w in e.trainable_weights}
    shared = sum(int(np.prod(w.shape)) for w in
                 step.unsharded.trainable_weights if id(w) not in experts)
    local = sum(int(np.prod(w.shape)) for w in
                step.unsharded.trainable_weights if id(w) in experts) // 2
    want = 4 * slots_per_weight * (-(-shared // _REPLICAS) + local)
    # The user's optimizer keeps no slot.
    self.assertEqual(
        [v for v in trainer.optimizer.variables if len(v.shape)], [])
    per_replica = [0] * _REPLICAS
    for copy, replica in zip(sharded.zero.copies, sharded.zero.replica_ids):
      per_replica[replica] += sum(
          v.numpy().nbytes for v in copy.variables
          if v is not copy.iterations and v is not copy._learning_rate)  # pylint: disable=protected-access
    for v in sharded.experts.variables:
      if len(v.shape):  # The iterations and learning rate are scalars.
        for r, component in enumerate(expert_mode._components(v)):  # pylint: disable=protected-access
          per_replica[r] += component.numpy().nbytes
    self.assertEqual(per_replica, [want] * _REPLICAS)
    # With accumulation at stage 2, also the experts' accumulators.
    accumulators = 4 * local if sharded.expert_accumulators else 0
    self.assertEqual(sharded.zero.state_bytes_per_replica() +
                     sharded.expert_slot_bytes_per_replica() + accumulators,
                     sharded.state_bytes_per_replica())
    self.assertEqual(sharded.expert_slot_bytes_per_replica(),
                     4 * slots_per_weight * local)
    return run

  def test_stage_1_with_adam_equals_one_device(self):
    self._check("adam", 2)

  def test_stage_2_momentum_accumulation_equals_one_device_and_restores(
      self):
    """Stage 2, SGD with momentum, 2 micro-batches an update: the
    non-expert accumulators are shards (1/4 of the flat buffer per
    replica), the experts' per replica; the checkpoint restores on one
    device and back."""
    run = self._check("sgd", 1, stage=2, micro_steps=2)
    sharded = run["trainer"].sharded
    self.assertEqual(sharded.grad_accumulator.values[0].shape,
                     [sharded.layout.shard_size])
    self.assertEqual(
        [tuple(a.shape) for a in sharded.expert_accumulators],
        [tuple(v.shape) for v in sharded.expert_variables])
    step, trainer = run["step"], run["trainer"]
    path = tf.train.Checkpoint(
        model=step.checkpoint_model(),
        optimizer=step.checkpoint_optimizer(trainer)).save(
            tempfile.mkdtemp() + "/zero")
    fresh, fresh_optimizer = _model(_GROUP), _optimizer("sgd")
    fresh_optimizer.build(fresh.trainable_variables)
    tf.train.Checkpoint(model=fresh, optimizer=fresh_optimizer).restore(
        path).assert_consumed()
    _assert_all_close(self, fresh.get_weights(), run["one"].get_weights(),
                      "restored weights")
    _assert_all_close(self, [v.numpy() for v in fresh_optimizer.variables],
                      [v.numpy() for v in run["one_trainer"].optimizer
                       .variables], "restored optimizer")
    # And back into the shards and the replicas' experts.
    for v in fresh_optimizer.variables[2:]:
      v.assign(v.numpy() + 1.0)
    back = tf.train.Checkpoint(optimizer=fresh_optimizer).save(
        tempfile.mkdtemp() + "/one")
    tf.train.Checkpoint(optimizer=step.checkpoint_optimizer(
        trainer)).restore(back).assert_consumed()
    _assert_all_close(
        self, [v._tfdist_read() for v in step.checkpoint_optimizer(  # pylint: disable=protected-access
            trainer).variables],
        [v.numpy() for v in fresh_optimizer.variables], "optimizer back")


class CheckpointTest(absltest.TestCase):

  def test_restores_on_one_device_and_back(self):
    run = _runs(2, "sgd")
    step, trainer = run["step"], run["trainer"]
    directory = tempfile.mkdtemp()
    path = tf.train.Checkpoint(
        model=step.checkpoint_model(),
        optimizer=step.checkpoint_optimizer(trainer)).save(directory + "/ep")
    fresh, fresh_optimizer = _model(_GROUP), _optimizer("sgd")
    fresh_optimizer.build(fresh.trainable_variables)
    tf.train.Checkpoint(model=fresh, optimizer=fresh_optimizer).restore(
        path).assert_consumed()
    # (The statistics are those of the last call: evaluation's, maybe.)
    _assert_all_close(self, fresh.get_weights(),
                      step.gathered_model().get_weights(), "restored weights")
    _assert_all_close(self, fresh.trainable_weights,
                      run["one"].trainable_weights, "one device's weights")
    _assert_all_close(self, [v.numpy() for v in fresh_optimizer.variables],
                      [v.numpy() for v in run["one_trainer"].optimizer
                       .variables], "restored optimizer")
    # And back: changed values on one device restore into the replicas.
    for v in fresh.trainable_variables + fresh_optimizer.variables[2:]:
      v.assign(v.numpy() + 1.0)
    back = tf.train.Checkpoint(model=fresh, optimizer=fresh_optimizer).save(
        directory + "/one")
    tf.train.Checkpoint(
        model=step.checkpoint_model(),
        optimizer=step.checkpoint_optimizer(trainer)).restore(
            back).assert_consumed()
    _assert_all_close(self, step.gathered_model().get_weights(),
                      fresh.get_weights(), "weights back")
    again = tf.train.Checkpoint(
        model=step.checkpoint_model(),
        optimizer=step.checkpoint_optimizer(trainer)).save(
            directory + "/again")
    reader = tf.train.load_checkpoint(again)
    for name in tf.train.list_variables(back):
      if name[0] != "_CHECKPOINTABLE_OBJECT_GRAPH":
        np.testing.assert_allclose(reader.get_tensor(name[0]),
                                   tf.train.load_variable(back, name[0]),
                                   atol=_TOLERANCE, err_msg=name[0])


class GuideTest(absltest.TestCase):

  def _run_block(self, name: str) -> str:
    """Runs docs/guides/experts.md's block `name`; its last printed
    line."""
    guide = os.path.join(testutil.REPO_ROOT, "docs", "guides", "experts.md")
    with open(guide, encoding="utf-8") as f:
      example = re.search(
          rf"<!-- run: tests/experts_parallel_test.py {name} -->\n"
          r"```python\n(.*?)```", f.read(), re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      exec(compile(example, f"docs/guides/experts.md ({name})",  # pylint: disable=exec-used
                   "exec"), {})
    return out.getvalue().splitlines()[-1]

  def test_the_guides_fit_example_runs(self):
    """docs/guides/experts.md, block fit-example: tfdist.fit with
    expert_parallel=2 on the 4 logical CPU devices."""
    self.assertEqual(self._run_block("fit-example"), "4")

  def test_the_guides_zero_example_keeps_the_state_it_says(self):
    """docs/guides/experts.md, block fit-zero-example: the same with
    zero_stage=1 and Adam; the run's optimizer bytes per replica are the
    guide's sum."""
    self.assertEqual(self._run_block("fit-zero-example"),
                     str(2 * 4 * (2 * 1072 + -(-193 // 4)) + 2 * 8))


class RefusalsTest(absltest.TestCase):

  def test_flags_are_refused_at_start_by_name(self):
    base = dict(model_dir="/tmp/unused", model="transformer",
                transformer_experts=4, expert_parallel=2)
    for changes, message in (
        (dict(distribution_strategy="parameter_server"),
         "--expert_parallel=2 .*--distribution_strategy=parameter_server "
         "cannot host it"),
        (dict(distribution_strategy="tpu"),
         "--distribution_strategy=tpu cannot host it"),
        (dict(distribution_strategy="one_device"),
         "--distribution_strategy=one_device cannot host it. Use "
         "--distribution_strategy=mirrored, multi_worker_mirrored or auto"),
        (dict(pipeline_stages=2), "cannot run with --pipeline_stages=2|"
         "--transformer_experts=4 cannot run with --pipeline_stages=2"),
        (dict(transformer_experts=6, expert_parallel=4),
         "--expert_parallel=4 splits the --transformer_experts=6 experts.*"
         "Use --expert_parallel=2, 3 or 6"),
        (dict(distribution_strategy="mirrored", num_cpu_devices=3),
         "--num_cpu_devices=3 gives 3 replica.*not a multiple of 2"),
        (dict(transformer_experts=0), "--transformer_experts=0"),
        (dict(model="cnn"), "--model=cnn has none"),
        (dict(dtype="fp16"), "cannot run with --dtype=fp16"),
        (dict(expert_parallel=0), "--expert_parallel=0 must be a positive")):
      with self.subTest(message=message):
        with self.assertRaisesRegex(errors.ConfigError, message):
          TrainConfig(**{**base, **changes})
    self.assertEqual(
        TrainConfig(**base, distribution_strategy="mirrored",
                    num_cpu_devices=4).expert_parallel, 2)
    # ZeRO stages 1-2 run beside it (tfdist/parallel/experts/zero.py);
    # stage 3 is refused by flag, value and fix.
    for zero in (dict(zero_stage=1), dict(shard_optimizer_state=True),
                 dict(zero_stage=2), dict(shard_gradients=True)):
      config = TrainConfig(**base, distribution_strategy="mirrored",
                           num_cpu_devices=2, **zero)
      self.assertIn(config.zero_stage_resolved, (1, 2))
    for zero in (dict(zero_stage=3), dict(shard_parameters=True)):
      with self.assertRaisesRegex(
          errors.ConfigError, r"--expert_parallel=2 cannot run with "
          r"--zero_stage=3: .*use --zero_stage=2 or 1 instead"):
        TrainConfig(**base, distribution_strategy="mirrored",
                    num_cpu_devices=2, **zero)
    # Across workers the replicas are every worker's (on CPUs one each,
    # whatever --num_cpu_devices; --num_gpus counts one worker's): known
    # when the cluster is (tests/experts_workers_test.py runs it).
    for devices in (dict(num_cpu_devices=3), dict(num_gpus=1)):
      self.assertEqual(TrainConfig(
          **base, distribution_strategy="multi_worker_mirrored",
          **devices).expert_parallel, 2)

  def test_a_model_that_cannot_be_split_is_refused_before_training(self):
    with self.assertRaisesRegex(errors.ConfigError,
                                "--expert_parallel=3 must be >= 2 and "
                                "divide the 4 replicas"):
      expert_mode.build(_model, _strategy(), 3)
    placement = placement_lib.ExpertPlacement(4, tuple(_DEVICES))
    with placement_lib.placement_scope(placement):
      with self.assertRaisesRegex(
          errors.ConfigError, "--expert_parallel=4 splits.*num_experts=6 "
          r"is not a multiple of 4\. Use --expert_parallel=2 \(it divides "
          r"both the 6 experts and the 4 replicas\), or num_experts a "
          r"multiple of 4 \(4 or 8\)"):
        MixtureOfExperts(6, 8, top_k=2)
    with self.assertRaisesRegex(ValueError, "top_k=2 with num_experts=1"):
      MixtureOfExperts(1, 8, top_k=2)
    with self.assertRaisesRegex(errors.ConfigError, "the model has none"):
      expert_mode.build(lambda: keras.Sequential([keras.layers.Dense(1)]),
                        _strategy(), 2)
    with self.assertRaisesRegex(errors.ConfigError,
                                "the run's strategy is OneDeviceStrategy"):
      expert_mode.build(_model, tf.distribute.OneDeviceStrategy("/cpu:0"),
                        2)


if __name__ == "__main__":
  absltest.main()
