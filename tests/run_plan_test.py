"""Tests for tfdist.training.plan.run_plan: a run's plan from real options and
data."""

import dataclasses
import os
import tempfile

from absl.testing import absltest
import pytest
import tensorflow as tf

from tfdist import config as config_lib
from tfdist import errors
from tfdist.core.dataset_spec import DatasetSpec
from tfdist.distribute import auto_select
from tfdist.core.strategy_kind import StrategyKind
from tfdist.training.plan import lr_schedule
from tfdist.training.plan import run_plan
from tests import testutil

pytestmark = pytest.mark.compat


def _function_spec(num_examples: int = 1000) -> DatasetSpec:
  """A data set from a dataset function: `num_examples` (x, y) pairs."""

  def input_fn(training):
    del training  # The same examples for both splits.
    return tf.data.Dataset.from_tensor_slices(
        (tf.zeros([num_examples, 2]), tf.zeros([num_examples], tf.int64)))

  return DatasetSpec(name="mine", input_fn=input_fn)


def _options(**settings) -> run_plan.PlanOptions:
  """The plan's options: `lr` as given, each other setting (by its flag
  name) in its section, the section's other settings their defaults."""
  lr = settings.pop("lr", lr_schedule.LROptions(
      base_learning_rate=0.1, base_batch_size=100, lr_scaling="linear"))
  by_section = {}
  for name, value in settings.items():
    (section,) = config_lib.section_of(name)
    by_section.setdefault(section, {})[name] = value
  sections = {name: dataclasses.replace(getattr(config_lib, cls)(), **values)
              for name, cls in _SECTION_CLASSES.items()
              for values in [by_section.pop(name, {})]}
  assert not by_section, by_section  # A section the plan does not read.
  return run_plan.PlanOptions(data=run_plan.DataOptions(dataset="mine"),
                              lr=lr, **sections)


# The sections the plan reads (`PlanOptions`'s fields).
_SECTION_CLASSES = {"loop": "LoopConfig", "task": "TaskConfig",
                    "precision": "PrecisionConfig", "memory": "MemoryConfig",
                    "strategy": "StrategyConfig"}


def _decision(kind=StrategyKind.ONE_DEVICE) -> auto_select.Decision:
  return auto_select.Decision(kind, "asked for", "fp32", "the default")


class MakeRunPlanTest(absltest.TestCase):

  def test_batch_steps_and_learning_rate(self):
    plan = run_plan.make_run_plan(
        _options(batch_size=200, train_epochs=3), _function_spec(1000),
        num_replicas_in_sync=2, num_workers=1, asynchronous=False,
        decision=_decision(StrategyKind.MIRRORED))
    self.assertEqual(plan.num_train_examples, 1000)
    self.assertEqual(plan.global_batch_size, 200)
    self.assertEqual(plan.batch.per_replica_batch_size, 100)
    self.assertEqual(plan.steps_per_epoch, 5)  # 1000 // 200.
    self.assertEqual(plan.total_steps, 15)  # 3 epochs x 5 steps.
    # Linear scaling: 0.1 at batch 100 -> 0.2 at batch 200.
    self.assertAlmostEqual(plan.lr.peak_learning_rate, 0.2)
    # Neither warmup flag: the smaller of one epoch and a tenth of the run.
    self.assertEqual(plan.lr.warmup_steps, 1)
    self.assertIs(plan.strategy, StrategyKind.MIRRORED)
    self.assertEqual(plan.train_files, ())
    self.assertEqual(plan.eval_batch_size, 200)

  def test_batch_norm_default_reads_the_backends_traits(self):
    # The plan asks the backend's traits (`asynchronous`, `on_tpu`), not
    # the kind: the same two replicas normalize together only when they
    # step together, and --enable_xla compiles per replica off a TPU.
    def sync(*, asynchronous=False, on_tpu=False, **options):
      return run_plan.make_run_plan(
          _options(batch_size=200, train_epochs=1, **options),
          _function_spec(1000), num_replicas_in_sync=2, num_workers=1,
          asynchronous=asynchronous, decision=_decision(StrategyKind.MIRRORED),
          on_tpu=on_tpu).sync_batch_norm

    self.assertTrue(sync())
    self.assertFalse(sync(asynchronous=True))
    self.assertFalse(sync(enable_xla=True))
    self.assertTrue(sync(enable_xla=True, on_tpu=True))

  def test_train_steps_and_warmup_flags_win(self):
    lr = lr_schedule.LROptions(base_learning_rate=0.5, base_batch_size=50,
                               lr_scaling="none", warmup_steps=4)
    plan = run_plan.make_run_plan(
        _options(batch_size=50, train_steps=40, lr=lr), _function_spec(1000),
        num_replicas_in_sync=1, num_workers=1, asynchronous=False,
        decision=_decision())
    self.assertEqual(plan.total_steps, 40)
    self.assertEqual(plan.lr.warmup_steps, 4)
    self.assertAlmostEqual(plan.lr.peak_learning_rate, 0.5)
    # The schedule ramps linearly from 0 to the peak over the warmup.
    self.assertAlmostEqual(float(plan.lr.schedule(2)), 0.25, places=6)
    self.assertAlmostEqual(float(plan.lr.schedule(10)), 0.5, places=6)

  def test_parameter_server_batches_are_per_worker_step(self):
    plan = run_plan.make_run_plan(
        _options(batch_size=100, train_steps=10), _function_spec(1000),
        num_replicas_in_sync=1, num_workers=3, asynchronous=True,
        decision=_decision(StrategyKind.PARAMETER_SERVER))
    self.assertTrue(plan.asynchronous)
    self.assertEqual(plan.batch.num_input_pipelines, 1)
    # The coordinator evaluates alone, with a larger batch.
    self.assertEqual(plan.eval_batch_size, run_plan.MIN_EVAL_BATCH_SIZE)
    self.assertIn("asynchronous: 3 worker(s)", plan.describe(_options()))

  def test_gradient_accumulation_evaluates_with_the_micro_batch(self):
    plan = run_plan.make_run_plan(
        _options(batch_size=200, gradient_accumulation_steps=4,
                 train_steps=5), _function_spec(1000),
        num_replicas_in_sync=1, num_workers=1, asynchronous=False,
        decision=_decision())
    self.assertEqual(plan.batch.per_replica_batch_size, 50)
    self.assertEqual(plan.eval_batch_size, 50)

  def test_a_batch_larger_than_the_data_is_refused(self):
    with self.assertRaisesRegex(
        errors.ConfigError, "larger than the 100 training"):
      run_plan.make_run_plan(
          _options(batch_size=128), _function_spec(100),
          num_replicas_in_sync=1, num_workers=1, asynchronous=False,
          decision=_decision())

  def test_describe_names_the_plan(self):
    options = _options(batch_size=200, train_steps=10, deterministic=True,
                       zero_stage=1, model="transformer")
    plan = run_plan.make_run_plan(
        options, _function_spec(1000), num_replicas_in_sync=2,
        num_workers=1, asynchronous=False,
        decision=_decision(StrategyKind.MIRRORED))
    text = plan.describe(options)
    self.assertIn("strategy               mirrored: asked for", text)
    self.assertIn("model                  transformer", text)
    self.assertIn("dataset                mine", text)
    self.assertIn("--dataset=mine's dataset function", text)
    self.assertIn("learning rate          0.1 at batch 100 -> 0.2 at batch "
                  "200 (linear rule), constant after warmup", text)
    self.assertIn("zero_stage             1: optimizer state sharded over "
                  "the 2 replicas", text)
    self.assertIn("deterministic", text)

  def test_zero_stage_2_without_accumulation_and_beside_experts(self):
    # Stage 2 without accumulation keeps stage 1's state: said, so that
    # its line does not read as stage 1's (a new user's question); beside
    # experts only the non-expert weights' state is sharded.
    for changes, parallelism, tail in (
        (dict(zero_stage=2), {}, " (stage 2 also shards the accumulators "
         "of --gradient_accumulation_steps > 1; with none, its state is "
         "stage 1's)"),
        (dict(zero_stage=1), dict(expert_parallel=2), ""),
    ):
      with self.subTest(changes=changes):
        options = _options(batch_size=8, train_steps=10, model="transformer",
                           **changes)
        options = dataclasses.replace(
            options, strategy=config_lib.StrategyConfig(
                parallelism=config_lib.ParallelismConfig(**parallelism)))
        text = run_plan.make_run_plan(
            options, _function_spec(1000), num_replicas_in_sync=4,
            num_workers=1, asynchronous=False,
            decision=_decision(StrategyKind.MIRRORED)).describe(options)
        over = ("the 4 replicas (1/4 each of the non-expert weights' "
                "state; each expert's stays on its replicas)"
                if parallelism else "the 4 replicas (1/4 each)")
        self.assertIn(f"  zero_stage             {changes['zero_stage']}: "
                      f"optimizer state sharded over {over}{tail}",
                      text.splitlines())

  def test_zero_beside_tensor_parallelism_names_the_data_groups(self):
    # Hybrid sharding: ZeRO inside each data group of the D x T mesh.
    options = _options(batch_size=8, train_steps=10,
                       shard_optimizer_state=True, model="transformer")
    options = dataclasses.replace(options, strategy=config_lib.StrategyConfig(
        parallelism=config_lib.ParallelismConfig(tensor_parallel=2)))
    plan = run_plan.make_run_plan(
        options, _function_spec(1000), num_replicas_in_sync=4,
        num_workers=1, asynchronous=False,
        decision=_decision(StrategyKind.MIRRORED))
    text = plan.describe(options)
    line = ("  zero_stage             1: optimizer state sharded over "
            "each data group's 2 replicas (1/2 of each replica's "
            "variables; replicated across the 2 tensor ranks: hybrid "
            "sharding)")
    self.assertIn(line, text.splitlines())
    # docs/guides/tensor-parallelism.md shows it.
    self.assertEqual(
        testutil.shown_output("guides/tensor-parallelism.md"), [line])
    self.assertIn("2 data-parallel copies x 2 tensor-parallel replicas",
                  text)

  def test_expert_parallel_plan_counts_the_all_to_all_bytes(self):
    # The built-in Transformer with 4 experts per block over 2 replicas:
    # 2 layers x 4 all-to-alls x 1/2 of [E=4, groups=32 (one per example
    # of the replica's 32), C=ceil(2 * 128 * 1.25 / 4)=80, d_model=64]
    # float32 elements = 10,485,760 bytes sent by each replica per update.
    options = _options(batch_size=64, train_steps=10, model="transformer",
                       transformer_experts=4)
    options = dataclasses.replace(options, strategy=config_lib.StrategyConfig(
        parallelism=config_lib.ParallelismConfig(expert_parallel=2)))
    spec = dataclasses.replace(_function_spec(1000), input_shape=(128,))
    plan = run_plan.make_run_plan(
        options, spec, num_replicas_in_sync=2, num_workers=1,
        asynchronous=False, decision=_decision(StrategyKind.MIRRORED))
    text = plan.describe(options)
    self.assertIn("expert_parallel        2: each MixtureOfExperts layer's "
                  "experts split over 1 expert group(s) of 2", text)
    self.assertIn("all-to-all per update  10.00 MiB sent by each replica: 2 "
                  "layer(s) x 4 (2 forward, 2 backward) x 1/2 of [E=4, "
                  "groups=32, C=80, d_model=64] x 4 bytes", text)
    # Half the bytes in bf16; a quarter with twice the replicas (half the
    # examples each, the groups of 2 unchanged).
    bf16 = run_plan.make_run_plan(
        options, spec, num_replicas_in_sync=4, num_workers=1,
        asynchronous=False, decision=auto_select.Decision(
            StrategyKind.MIRRORED, "asked for", "bf16", "asked for"))
    self.assertIn("2.50 MiB sent by each replica", bf16.describe(options))
    self.assertIn("over 2 expert group(s)", bf16.describe(options))
    # Beside ZeRO stage 1 (tfdist/parallel/experts/zero.py): the state
    # each replica keeps.
    zero = dataclasses.replace(options,
                               memory=config_lib.MemoryConfig(zero_stage=1))
    self.assertIn(
        "optimizer state        ZeRO stage 1: each replica keeps 1/2 of the "
        "non-expert weights' optimizer state (one shard of their flat "
        "buffer) and the whole state of its 1/2 of the experts",
        run_plan.make_run_plan(
            zero, spec, num_replicas_in_sync=2, num_workers=1,
            asynchronous=False,
            decision=_decision(StrategyKind.MIRRORED)).describe(zero))


class DataFilesTest(absltest.TestCase):

  def _folder(self) -> str:
    folder = tempfile.TemporaryDirectory()
    self.addCleanup(folder.cleanup)
    return folder.name

  def _write(self, folder, name, records):
    path = os.path.join(folder, name)
    with tf.io.TFRecordWriter(path) as writer:
      for i in range(records):
        writer.write(f"record {i}".encode())
    return path

  def _file_spec(self):
    return DatasetSpec(name="records", parse_fn=lambda record: record)

  def test_lists_the_files_of_each_flag(self):
    folder = self._folder()
    train = [self._write(folder, f"train-{i}.tfrecord", 3) for i in (1, 0)]
    test = self._write(folder, "test-0.tfrecord", 2)
    data = run_plan.DataOptions(
        dataset="records", train_files=os.path.join(folder, "train-*"),
        eval_files=os.path.join(folder, "test-*"))
    train_files, eval_files = run_plan.resolve_data_files(
        data, self._file_spec())
    self.assertEqual(train_files, tuple(sorted(train)))
    self.assertEqual(eval_files, (test,))
    # --mode=train lists no evaluation files.
    self.assertEqual(run_plan.resolve_data_files(
        data, self._file_spec(), need_eval=False)[1], ())

  def test_a_glob_matching_nothing(self):
    folder = self._folder()
    data = run_plan.DataOptions(
        dataset="records", train_files=os.path.join(folder, "none-*"),
        eval_files=os.path.join(folder, "none-*"))
    with self.assertRaises(errors.DataNotFoundError):
      run_plan.resolve_data_files(data, self._file_spec())

  def test_no_files_and_nothing_to_convert(self):
    with self.assertRaisesRegex(errors.DataNotFoundError, "--train_files"):
      run_plan.resolve_data_files(run_plan.DataOptions(dataset="records"),
                                  self._file_spec())

  def test_a_dataset_function_reads_no_files(self):
    self.assertEqual(run_plan.resolve_data_files(
        run_plan.DataOptions(dataset="mine"), _function_spec()), ((), ()))
    self.assertEqual(run_plan.data_patterns(
        run_plan.DataOptions(data_dir="/d"), _function_spec()), [])

  def test_data_patterns(self):
    self.assertEqual(
        run_plan.data_patterns(run_plan.DataOptions(
            train_files="gs://b/train-*", eval_files="gs://b/test-*")),
        [("--train_files", "gs://b/train-*"),
         ("--eval_files", "gs://b/test-*")])
    # Without both file flags the data set's folder is read too.
    self.assertEqual(
        run_plan.data_patterns(run_plan.DataOptions(
            train_files="/t-*", data_dir="/data")),
        [("--train_files", "/t-*"), ("--data_dir", "/data")])


if __name__ == "__main__":
  absltest.main()
