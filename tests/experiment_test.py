"""`tfdist.experiment`: the run as an `ExperimentRunner` of named steps.

* the facts decided once (`training_workers`, `PreparedRun.is_writer`,
  `PreparedRun.kind`, its backend and `Role`) for every strategy and role;
* the backends (`tfdist.backends`): one registered per strategy kind, no
  strategy-kind branch in the assembly package, and a backend registered
  from outside tfdist used by a run in place of the built-in one;
* tiny one-device runs (a 4-feature linear model, 64 examples, 4 steps):
  the steps run in the documented order, a subclass's step is the one used,
  the training objects are released at the end, `--dry_run` builds and
  writes nothing, and `--mode=eval` evaluates through `EvaluatorRunner`.
"""

import dataclasses
import os
import re

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf

from tests import testutil
from tfdist import api
from tfdist import errors
from tfdist import experiment
from tfdist.backends import registry as backends
from tfdist.backends import single_process
from tfdist.config import TrainConfig
from tfdist.distribute import decisions as decisions_lib
from tfdist.distribute import cluster as cluster_lib
from tfdist.distribute import environment as environment_lib
from tfdist.core.strategy_kind import StrategyKind
from tfdist.observability import manifest as manifest_lib

# The steps `ExperimentRunner.train` documents, in order.
TRAINING_STEPS = [
    "build_strategy", "build_preemption_watcher", "set_seeds", "build_plan",
    "check_resume", "build_model_and_optimizer", "build_checkpoints",
    "warm_start", "build_inputs", "build_run_log", "build_callbacks",
    "build_profiler", "build_controller", "run_controller", "build_export",
    "build_manifest", "write_outputs", "leave_together"]


def _model():
  return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])


def _dataset(training):
  rng = np.random.default_rng(0 if training else 1)
  features = rng.normal(size=(64, 4)).astype("float32")
  labels = rng.integers(0, 3, size=(64,)).astype("int64")
  return tf.data.Dataset.from_tensor_slices((features, labels))


def _config(model_dir: str, **overrides) -> TrainConfig:
  fields = dict(model_dir=model_dir, distribution_strategy="one_device",
                batch_size=16, train_steps=4, log_steps=2,
                checkpoint_steps=2, seed=3, num_cpu_devices=1)
  fields.update(overrides)
  return TrainConfig(**fields)


def _task(config: TrainConfig):
  return api.make_task(
      _model, _dataset, config=config,
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy"])


def _start(config: TrainConfig):
  return experiment.start_run(config, task=_task(config),
                              environment=environment_lib.read_environment(
                                  {}))


def _cluster(task_type: str, task_index: int = 0, *, workers: int = 2,
             ps: int = 0, chief: bool = True) -> cluster_lib.ClusterInfo:
  jobs = {"worker": [f"w{i}:1" for i in range(workers)]}
  if chief:
    jobs["chief"] = ["c:1"]
  if ps:
    jobs["ps"] = [f"p{i}:1" for i in range(ps)]
  return cluster_lib.ClusterInfo(task_type=task_type, task_index=task_index,
                                 cluster=jobs, source="TF_CONFIG")


def _prepared(strategy: str, cluster) -> experiment.PreparedRun:
  config = TrainConfig(model_dir="/unused")
  decisions = decisions_lib.Decisions.of(config.replace(
      distribution_strategy=strategy, dtype="fp32"))
  return experiment.PreparedRun(config=config, cluster=cluster,
                                decisions=decisions)


class FactsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("one_device", "one_device", cluster_lib.ClusterInfo.single_process(),
       1, True),
      ("mirrored", "mirrored", cluster_lib.ClusterInfo.single_process(), 1,
       True),
      ("mwms_chief", "multi_worker_mirrored", _cluster("chief"), 3, True),
      ("mwms_worker", "multi_worker_mirrored", _cluster("worker", 1), 3,
       False),
      ("mwms_worker0_no_chief", "multi_worker_mirrored",
       _cluster("worker", 0, chief=False), 2, True),
      ("ps_coordinator", "parameter_server", _cluster("chief", ps=2), 2,
       True),
      ("tpu", "tpu", cluster_lib.ClusterInfo.single_process(), 1, True))
  def test_writer_and_workers_are_decided_once(self, strategy, cluster,
                                               workers, writer):
    prepared = _prepared(strategy, cluster)
    self.assertIs(prepared.kind, StrategyKind.parse(strategy))
    self.assertEqual(prepared.num_workers, workers)
    self.assertEqual(experiment.training_workers(prepared.kind, cluster),
                     workers)
    self.assertEqual(prepared.is_writer, writer)

  def test_long_cross_process_runs_are_warned_about_memory(self):
    # 30,000 calls of 10 KiB: about 293 MiB per task.
    warning = experiment.cross_process_memory_warning(
        total_steps=30_000, steps_per_execution=1, cross_process=True)
    self.assertIn("about 293 MiB per task", warning)
    self.assertIn("--steps_per_execution=10 divides that by 10", warning)
    # Ten steps per call: 3,000 calls, under the threshold.
    self.assertIsNone(experiment.cross_process_memory_warning(
        total_steps=30_000, steps_per_execution=10, cross_process=True))
    self.assertIsNone(experiment.cross_process_memory_warning(
        total_steps=10**6, steps_per_execution=1, cross_process=False))
    self.assertIsNone(experiment.cross_process_memory_warning(
        total_steps=2_000, steps_per_execution=1, cross_process=True))

  def test_prepared_run_holds_its_backend_and_role(self):
    prepared = experiment.prepare_run(
        TrainConfig(model_dir="/runs/x", train_steps=1,
                    distribution_strategy="one_device"),
        environment=environment_lib.read_environment({}))
    self.assertEqual(prepared.decision.strategy, "one_device")
    self.assertEqual((tuple(prepared.environment_applied),
                      tuple(prepared.trial_fields)), ((), ()))
    self.assertIs(prepared.kind, StrategyKind.ONE_DEVICE)
    self.assertIs(prepared.backend.kind, StrategyKind.ONE_DEVICE)
    self.assertIs(prepared.backend, prepared.backend)  # decided once
    self.assertTrue(prepared.role.is_writer)
    self.assertEqual(prepared.role.num_workers, 1)
    self.assertFalse(prepared.role.serves)
    # A record of decisions, not a tuple to unpack, index or count.
    for tuple_use in (iter, len, lambda p: p[0]):
      with self.assertRaises(TypeError):
        tuple_use(prepared)

  def test_decisions_are_kept_beside_the_config_never_in_it(self):
    # auto, and Vertex AI's folders: decided into `decisions`; the config
    # stays what the caller gave.
    config = TrainConfig(train_steps=1, num_cpu_devices=2,
                         distribution_strategy="auto", dtype="auto")
    prepared = experiment.prepare_run(
        config, environment=environment_lib.read_environment(
            {"AIP_MODEL_DIR": "/runs/vertex/model",
             "AIP_CHECKPOINT_DIR": "/runs/vertex/checkpoints"}))
    self.assertIs(prepared.config, config)
    self.assertEqual((config.distribution_strategy, config.dtype,
                      config.model_dir), ("auto", "auto", ""))
    decided = prepared.decisions
    self.assertIs(decided.strategy, StrategyKind.MIRRORED)
    self.assertEqual(decided.dtype, "fp32")
    self.assertEqual(decided.model_dir, "/runs/vertex/checkpoints")
    self.assertEqual(decided.checkpoint_dir, "/runs/vertex/checkpoints")
    self.assertEqual(decided.export_dir, "/runs/vertex/model")
    self.assertIn(("model_dir", "AIP_CHECKPOINT_DIR"),
                  decided.environment_applied)
    with self.assertRaises(dataclasses.FrozenInstanceError):
      decided.dtype = "bf16"
    # What the records list by flag name: the decided values.
    recorded = manifest_lib.recorded_config(config, decided)
    self.assertEqual((recorded["distribution_strategy"], recorded["dtype"],
                      recorded["model_dir"]),
                     ("mirrored", "fp32", "/runs/vertex/checkpoints"))

  def test_planned_replicas_use_the_same_workers(self):
    config = TrainConfig(model_dir="/unused", num_gpus=0, num_cpu_devices=2)
    for strategy, cluster, expected in (
        ("mirrored", cluster_lib.ClusterInfo.single_process(), (2, 1)),
        ("multi_worker_mirrored", _cluster("chief"), (3, 3)),
        ("parameter_server", _cluster("chief", ps=1), (1, 2)),
        ("one_device", cluster_lib.ClusterInfo.single_process(), (1, 1))):
      decisions = _prepared(strategy, cluster).decisions
      self.assertEqual(experiment.planned_replicas(
          config, decisions=decisions, cluster=cluster), expected, strategy)


class _RecordingRunner(experiment.ExperimentRunner):
  """Records the steps `train` calls."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.calls = []

  def __getattribute__(self, name):
    value = super().__getattribute__(name)
    if name in TRAINING_STEPS:
      self.calls.append(name)
    return value


class _Counter(keras.callbacks.Callback):

  def __init__(self):
    super().__init__()
    self.batches = 0

  def on_train_batch_end(self, batch, logs=None):
    self.batches += 1


class _ExtraCallbackRunner(experiment.ExperimentRunner):
  """Overrides one step: its callbacks gain a counter."""

  counter = None

  def build_callbacks(self):
    type(self).counter = _Counter()
    return super().build_callbacks() + [self.counter]


class RunnerTest(absltest.TestCase):

  def test_steps_run_in_the_documented_order(self):
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    task, prepared = _start(_config(model_dir))
    runner = _RecordingRunner(prepared, task=task)
    record = runner.run()
    self.assertEqual(runner.calls, TRAINING_STEPS)
    self.assertIs(runner.kind, StrategyKind.ONE_DEVICE)
    self.assertEqual((record["strategy"], record["final_step"],
                      record["num_workers"]), ("one_device", 4, 1))
    # The manifest, the SavedModel and the checkpoints are the writer's.
    self.assertTrue(os.path.exists(os.path.join(model_dir,
                                                "run_manifest.json")))
    self.assertTrue(os.path.exists(os.path.join(model_dir, "saved_model",
                                                "saved_model.pb")))
    self.assertIsNotNone(tf.train.latest_checkpoint(
        os.path.join(model_dir, "checkpoints")))
    # Released once the run is over (before the done marker).
    self.assertIsNone(runner.strategy)
    self.assertIsNone(runner.controller)
    self.assertTrue(os.path.exists(os.path.join(model_dir, "training_done")))

  def test_a_profile_window_after_the_run_is_refused(self):
    # The plan step reads --profile_steps from the outputs section.
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    task, prepared = _start(_config(model_dir, profile_steps=(7, 9)))
    runner = experiment.ExperimentRunner(prepared, task=task)
    with self.assertRaisesRegex(errors.ConfigError,
                                r"--profile_steps=7,9 starts after the "
                                r"run's last step \(4\)"):
      runner.strategy = runner.build_strategy().strategy
      runner.build_plan()

  def test_a_subclass_step_is_the_one_used(self):
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    task, prepared = _start(_config(model_dir))
    _ExtraCallbackRunner(prepared, task=task).run()
    self.assertEqual(_ExtraCallbackRunner.counter.batches, 4)

  def test_dry_run_builds_and_writes_nothing(self):
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    config = _config(model_dir, dry_run=True)
    result = experiment.run_experiment(
        config, task=_task(config),
        environment=environment_lib.read_environment({}))
    self.assertTrue(result["dry_run"])
    # The evaluation split of the dataset function, which the run evaluates
    # whole (0 before: only files were counted).
    self.assertEqual((result["global_batch_size"], result["total_steps"],
                      result["num_train_examples"],
                      result["num_eval_examples"]), (16, 4, 64, 64))
    for entry in ("checkpoints", "saved_model", "run_manifest.json"):
      self.assertFalse(os.path.exists(os.path.join(model_dir, entry)), entry)

  def test_dry_run_checks_experts_against_the_data_sets_model(self):
    # No --model: --dataset=clothing_reviews names the Transformer, whose
    # experts the run is checked against before anything is built (a
    # config alone cannot: tfdist.fit names its own model later). Before,
    # the dry run passed and the run failed once built.
    for changes, message in (
        (dict(), r"--model=transformer has none \(--transformer_experts=0\)"),
        (dict(transformer_experts=3, num_cpu_devices=4),
         r"3 is not a multiple of 2\. Use --transformer_experts=2 or 4\.")):
      with self.subTest(message=message):
        config = TrainConfig(**{
            **dict(model_dir=testutil.scratch_dir(), dry_run=True,
                   dataset="clothing_reviews", expert_parallel=2,
                   distribution_strategy="mirrored", num_cpu_devices=2),
            **changes})
        self.assertEqual(config.model, "transformer")
        with self.assertRaisesRegex(errors.ConfigError, message):
          experiment.run_experiment(
              config, environment=environment_lib.read_environment({}))

  def test_eval_mode_evaluates_the_latest_checkpoint(self):
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    config = _config(model_dir)
    environment = environment_lib.read_environment({})
    experiment.run_experiment(config, task=_task(config),
                              environment=environment)
    evaluated = experiment.run_experiment(
        config.replace(mode="eval"), task=_task(config),
        environment=environment)
    self.assertEqual(evaluated["role"], "evaluator")
    (result,) = evaluated["results"]
    self.assertTrue(result["checkpoint"].endswith("ckpt-4"))
    self.assertEqual(result["evaluated_with"]["strategy"], "one_device")
    self.assertEqual(result["evaluated_with"]["global_batch_size"], 16)


# What a branch on the strategy looks like: a kind's property, or a
# comparison with a member.
_KIND_BRANCH = re.compile(
    r"\.is_(asynchronous|multi_worker|mirrored|tpu|single_process)\b|"
    r"(\bis|==|!=|\bin)\s*\(?\s*StrategyKind\.|"
    r"\bkind\s*(is|==|!=|in)\b")


class _CountingBackend(single_process.OneDeviceBackend):
  """A user's backend, defined outside tfdist: the one-device strategy,
  counting what the run asks of it."""

  calls = []

  def build_strategy(self, config, decisions, *, cluster, lease=None):
    type(self).calls.append("build_strategy")
    return super().build_strategy(config, decisions, cluster=cluster,
                                  lease=lease)

  def build_inputs(self, run):
    type(self).calls.append("build_inputs")
    runner, evaluate, details = super().build_inputs(run)
    return runner, evaluate, {**details, "backend": "counting"}

  def export_model(self, run):
    type(self).calls.append("export_model")
    return super().export_model(run)

  def leave_together(self, run, *, failed=False):
    type(self).calls.append("leave_together")


class BackendTest(parameterized.TestCase):

  def test_every_strategy_kind_has_a_backend(self):
    for kind in StrategyKind:
      backend = backends.backend_for(kind)
      self.assertIsInstance(backend, backends.Backend)
      self.assertIs(backend.kind, kind)

  def test_the_assembly_package_never_branches_on_the_strategy(self):
    package = os.path.dirname(experiment.__file__)
    found = []
    for name in sorted(os.listdir(package)):
      if not name.endswith(".py"):
        continue
      with open(os.path.join(package, name)) as f:
        for number, line in enumerate(f, 1):
          code = line.split("#")[0]
          if _KIND_BRANCH.search(code):
            found.append(f"tfdist/experiment/{name}:{number}: {line.strip()}")
    self.assertEqual(found, [], "strategy-kind branches outside the "
                     "backends (tfdist/backends/):\n" + "\n".join(found))

  def test_the_branch_pattern_finds_branches(self):
    for line in ("if self.kind.is_asynchronous:",
                 "if kind is StrategyKind.MIRRORED:",
                 "elif how.strategy == StrategyKind.MIRRORED:",
                 "if kind in (StrategyKind.TPU,):"):
      self.assertRegex(line, _KIND_BRANCH)
    self.assertNotRegex("name = StrategyKind.ONE_DEVICE", _KIND_BRANCH)

  def test_a_registered_backend_runs_the_strategy(self):
    original = backends.base.registered_backend(StrategyKind.ONE_DEVICE)
    backends.register_backend(StrategyKind.ONE_DEVICE, _CountingBackend)
    self.addCleanup(backends.register_backend, StrategyKind.ONE_DEVICE,
                    original)
    _CountingBackend.calls = []
    model_dir = os.path.join(testutil.scratch_dir(), "run")
    task, prepared = _start(_config(model_dir))
    self.assertIsInstance(prepared.backend, _CountingBackend)
    record = experiment.ExperimentRunner(prepared, task=task).run()
    self.assertEqual(_CountingBackend.calls, [
        "build_strategy", "build_inputs", "export_model", "leave_together"])
    self.assertEqual(record["final_step"], 4)
    self.assertEqual(record["one_device"], {"backend": "counting"})

  def test_register_backend_refuses_what_is_no_backend(self):
    with self.assertRaisesRegex(TypeError, "subclass of .*Backend"):
      backends.register_backend(StrategyKind.MIRRORED, object)
    with self.assertRaisesRegex(ValueError, "--distribution_strategy"):
      backends.register_backend("pipeline_of_dreams",
                                single_process.MirroredBackend)


if __name__ == "__main__":
  absltest.main()
