"""Tests for the measuring code: input wait, the verdict, tfdist.diagnose.

* A real pipeline slowed on purpose (a `map` that sleeps) trained under the
  real controller is measured input-bound; the same pipeline cached is not.
* The verdict's rules on crafted measurements.
* `python -m tfdist.diagnose` end to end on a real short run: the table,
  the verdict, the per-interval fields of `metrics.jsonl` and the manifest,
  and the `--profile_steps` trace.

Speed targets are not asserted here (benchmarks/ measures them).
"""

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf

from tests import testutil
from tfdist import errors
from tfdist import diagnose
from tfdist import job_spec
from tfdist.backends import base as backend_base
from tfdist.backends import registry as backend_registry
from tfdist.diagnose import RunMeasurement
from tfdist.core.strategy_kind import StrategyKind
from tfdist.observability import run_log as run_log_lib
from tfdist.training.state import checkpointing
from tfdist.training.plan import memory
from tfdist.training.step import step_runner
from tfdist.training.controller import Controller, ControllerOptions
from tfdist.training.step.train_loop import Trainer

BATCH = 128
SLEEP_SECONDS = 0.1  # Per batch, in the slowed pipeline's map.


def _run(kind="GPU", *, label="requested", replicas=1, eps=100.0, step=1.0,
         wait=0.01, rss=1 << 30, device_peak=None, workers=1):
  return RunMeasurement(
      label=label, strategy="mirrored" if replicas > 1 else "one_device",
      num_replicas=replicas, num_workers=workers, device_kind=kind,
      dtype="fp32", global_batch_size=64 * replicas, per_replica_batch_size=64,
      examples_per_second=eps, step_time_seconds=step,
      input_wait_fraction=wait,
      input_wait_seconds=None if wait is None else wait * step,
      peak_rss_bytes=rss, device_memory_peak_bytes=device_peak)


class VerdictTest(parameterized.TestCase):
  """The rules on crafted measurements."""

  def test_speedup_and_efficiency_of_the_seeds_example(self):
    # 4 devices at 300 examples/sec against one at 100: 3x and 75%.
    base = _run(label="baseline", eps=100.0)
    four = _run(replicas=4, eps=300.0)
    speedup, efficiency = diagnose.scaling(base, four)
    self.assertAlmostEqual(speedup, 3.0)
    self.assertAlmostEqual(efficiency, 0.75)
    result = diagnose.verdict(four, base)
    self.assertEqual(result.label, "communication-bound")
    self.assertIn("3.00x, 75% scaling efficiency", result.reasons[0])
    self.assertIn("gradient accumulation", result.advice[0])
    self.assertIn("--all_reduce_alg=nccl", result.advice[0])

  def test_input_bound_names_the_numbers_and_pipeline_knobs(self):
    result = diagnose.verdict(_run(wait=0.35, step=0.2, eps=640.0),
                              _run(label="baseline", wait=0.3))
    self.assertEqual(result.label, "input-bound")
    self.assertIn("35% of its step time (70.0 ms per step", result.reasons[0])
    self.assertIn("baseline waited 30%", result.reasons[1])
    self.assertIn("--cache_dataset", result.advice[0])
    self.assertIn("--train_files", result.advice[0])

  @parameterized.named_parameters(("moderate", 0.12), ("low", 0.01))
  def test_below_the_threshold_is_not_input_bound(self, wait):
    result = diagnose.verdict(_run(wait=wait), _run(label="baseline"))
    self.assertEqual(result.label, "compute-bound")
    self.assertEqual(any("moderately" in n for n in result.notes),
                     wait >= diagnose.INPUT_MODERATE_SHARE)

  def test_scaling_well_is_compute_bound(self):
    result = diagnose.verdict(_run(replicas=2, eps=190.0),
                              _run(label="baseline", eps=100.0))
    self.assertEqual(result.label, "compute-bound")
    self.assertAlmostEqual(result.scaling_efficiency, 0.95)

  def test_a_logical_cpu_speedup_is_called_what_it_is(self):
    result = diagnose.verdict(
        _run("logical CPU", replicas=2, eps=110.0),
        _run("CPU", label="baseline", eps=100.0), cores=2)
    # 55% efficiency, but the replicas share the cores: not communication.
    self.assertEqual(result.label, "compute-bound")
    self.assertIn("1.10x is a logical-CPU speedup, not scaling",
                  result.notes[0])
    self.assertIn("share its 2 core(s)", result.notes[0])
    # Unpinned workers on one host share the cores as well; pinned ones not.
    unpinned = diagnose.verdict(_run("CPU", replicas=2, workers=2, eps=110.0),
                                _run("CPU", label="baseline"), cores=2)
    self.assertEqual(unpinned.label, "compute-bound")
    pinned = diagnose.verdict(_run("CPU", replicas=2, workers=2, eps=110.0),
                              _run("CPU", label="baseline"), cores=2,
                              pinned=True)
    self.assertEqual(pinned.label, "communication-bound")

  def test_memory_bound_from_the_model_or_the_measured_peak(self):
    estimate = memory.ModelMemory(parameters_bytes=40 << 30,
                                  gradients_bytes=40 << 30,
                                  optimizer_bytes=80 << 30,
                                  num_parameters=10 << 30)
    fit = memory.fits_data_parallel(estimate, capacity_bytes=80 << 30)
    result = diagnose.verdict(_run(wait=0.5), _run(label="baseline"),
                              model_fit=fit)
    self.assertEqual(result.label, "memory-bound")  # Before input-bound.
    self.assertIn("does not fit", result.reasons[0])
    self.assertIn("mixed precision", result.advice[0])
    full = diagnose.verdict(_run(device_peak=78 << 30), device_memory_bytes=
                            80 << 30)
    self.assertEqual(full.label, "memory-bound")
    self.assertIn("peaked at 78.0 GiB of 80.0 GiB (98%)", full.reasons[0])
    ok = diagnose.verdict(_run(device_peak=40 << 30),
                          device_memory_bytes=80 << 30)
    self.assertEqual(ok.label, "compute-bound")

  def test_advice_fits_the_hardware_measured(self):
    # A CPU-only run at 56% efficiency (pinned workers: real scaling).
    cpu = diagnose.verdict(_run("CPU", replicas=2, workers=2, eps=112.0),
                           _run("CPU", label="baseline", eps=100.0), cores=2,
                           pinned=True)
    self.assertEqual(cpu.label, "communication-bound")
    for absent in ("GPU", "nccl", "Reduction Server", "bf16", "XLA"):
      self.assertNotIn(absent, cpu.advice[0])
    compute = diagnose.verdict(_run("CPU", workers=2, replicas=2), cores=2)
    self.assertEqual(compute.label, "compute-bound")
    for absent in ("GPU", "bf16", "fp16", "XLA"):
      self.assertNotIn(absent, compute.advice[0])
    self.assertIn("--pin_workers", compute.advice[0])
    # bf16 on a CPU that has bf16 matrix instructions.
    self.assertIn("--dtype=bf16: this CPU has bf16", diagnose.verdict(
        _run("CPU"), cpu_bf16=True).advice[0])
    # GPUs: bf16/fp16 by compute capability, XLA, NCCL.
    gpu = diagnose.verdict(_run())
    self.assertIn("--dtype=bf16 on GPUs of compute capability",
                  gpu.advice[0])
    self.assertIn("--enable_xla", gpu.advice[0])
    # A run already in bf16 is not told to use it.
    in_bf16 = _run()
    in_bf16.dtype = "bf16"
    self.assertNotIn("mixed precision", diagnose.verdict(in_bf16).advice[0])
    tpu = diagnose.verdict(_run("TPU"))
    self.assertIn("--dtype=bf16", tpu.advice[0])
    self.assertNotIn("XLA", tpu.advice[0])

  def test_a_one_process_run_gets_no_cluster_advice(self):
    # Compute-, memory- and communication-bound runs of one process, and a
    # logical-CPU speedup: nothing about workers, ps tasks or pinning.
    cluster_words = ("--pin_workers", "parameter_server", "ps task",
                     "Reduction Server", "--reduction_server", "worker",
                     "--num_workers", "tfdist.launch")
    huge = memory.fits_data_parallel(
        memory.ModelMemory(parameters_bytes=40 << 30,
                           gradients_bytes=40 << 30,
                           optimizer_bytes=80 << 30, num_parameters=10 << 30),
        capacity_bytes=80 << 30)
    one_device = _run("CPU", label="baseline")
    verdicts = {
        "compute": diagnose.verdict(_run("CPU"), cores=2),
        "memory": diagnose.verdict(_run("CPU"), model_fit=huge),
        "communication": diagnose.verdict(
            _run(replicas=4, eps=200.0), _run(label="baseline", eps=100.0)),
        "logical CPU": diagnose.verdict(
            _run("logical CPU", replicas=2, eps=110.0), one_device, cores=2),
    }
    for constraint, result in verdicts.items():
      text = " ".join(result.advice + result.notes)
      for word in cluster_words:
        self.assertNotIn(word, text, f"{constraint}: {text}")
    self.assertIn("a machine with more cores",
                  verdicts["compute"].advice[0])
    self.assertIn("--all_reduce_alg=nccl",
                  verdicts["communication"].advice[0])
    # One replica: no sharding to offer either.
    self.assertNotIn("--shard_optimizer_state",
                     verdicts["memory"].advice[0])
    # Two workers do get the cluster's options.
    two = _run("CPU", replicas=2, workers=2)
    self.assertIn("--pin_workers", diagnose.compute_advice(two))
    self.assertIn("--shard_optimizer_state", diagnose.memory_advice(two))
    self.assertIn("parameter_server", diagnose.memory_advice(two))

  def test_zero_is_called_unneeded_for_a_small_model(self):
    small = memory.ModelMemory(parameters_bytes=4 << 20,
                               gradients_bytes=4 << 20,
                               optimizer_bytes=8 << 20,
                               num_parameters=1 << 20)
    notes = diagnose.layout_notes(
        small, optimizer="adamw", zero_stage=1, num_replicas=2,
        capacity_bytes=16 << 30, replicas_sharing=2, where="host")
    self.assertLen(notes, 1)
    self.assertIn("ZeRO stage 1 is not needed at this size", notes[0])
    self.assertIn("plain data parallelism holds 16.0 MiB per replica",
                  notes[0])
    self.assertIn("2 slot(s) per parameter", notes[0])  # The registry's.
    self.assertIn("4.0 MiB per replica instead of 8.0 MiB", notes[0])
    self.assertIn("about the same bytes per step", notes[0])
    self.assertIn("stage 3 1.5x (Rajbhandari et al. 2020)", notes[0])
    self.assertIn("Drop --zero_stage=1", notes[0])
    # Where plain data parallelism does not fit, stage 1 is needed.
    needed = diagnose.layout_notes(
        small, optimizer="adamw", zero_stage=1, num_replicas=8,
        capacity_bytes=15 << 20)
    self.assertIn("ZeRO stage 1 is needed at this size", needed[0])
    self.assertIn("does not fit unsharded", needed[0])
    # Plain data parallelism has no layout note; one replica shards nothing.
    self.assertEqual(diagnose.layout_notes(
        small, optimizer="sgd", zero_stage=0, num_replicas=2,
        capacity_bytes=1 << 30), [])
    self.assertIn("one replica to shard over", diagnose.layout_notes(
        small, optimizer="sgd", zero_stage=2, num_replicas=1,
        capacity_bytes=1 << 30)[0])

  def test_stage_3_note_names_its_switch_state_and_traffic(self):
    small = memory.ModelMemory(parameters_bytes=4 << 20,
                               gradients_bytes=4 << 20,
                               optimizer_bytes=8 << 20,
                               num_parameters=1 << 20)
    note, = diagnose.layout_notes(
        small, optimizer="adamw", zero_stage=3, num_replicas=2,
        capacity_bytes=16 << 30, where="host")
    self.assertIn("Drop --zero_stage=3 (--shard_parameters)", note)
    self.assertIn("the weights, gradients and optimizer state are 8.0 MiB "
                  "per replica instead of 16.0 MiB", note)
    self.assertIn("about 2x the bytes of plain data parallelism", note)
    self.assertNotIn("all-gathers the updated weights", note)

  def test_pipeline_stages_are_judged_at_this_size(self):
    small = memory.ModelMemory(parameters_bytes=4 << 20,
                               gradients_bytes=4 << 20,
                               optimizer_bytes=8 << 20,
                               num_parameters=1 << 20)
    notes = diagnose.layout_notes(
        small, optimizer="adamw", zero_stage=0, num_replicas=1,
        capacity_bytes=16 << 30, where="host", pipeline_stages=4,
        num_microbatches=4)
    self.assertLen(notes, 1)
    self.assertIn("4 pipeline stages are not needed at this size: the "
                  "whole model's state is 16.0 MiB", notes[0])
    self.assertIn("about 4.0 MiB per stage", notes[0])
    self.assertIn("a bubble of 3/7 = 43% of each step (Huang et al. 2019;",
                  notes[0])
    self.assertIn("Drop --pipeline_stages=4", notes[0])
    needed = diagnose.layout_notes(
        small, optimizer="adamw", zero_stage=0, num_replicas=1,
        capacity_bytes=10 << 20, pipeline_stages=2, num_microbatches=8)
    self.assertIn("2 pipeline stages are needed at this size", needed[0])
    self.assertIn("does not fit one device", needed[0])
    self.assertIn("1/9 = 11%", needed[0])

  def test_the_baseline_drops_pipeline_flags(self):
    for flag in ("pipeline_stages", "num_microbatches", "pipeline_schedule",
                 "pipeline_cuts"):
      self.assertIn(flag, diagnose.MULTI_REPLICA_FLAGS)

  def test_cpu_bf16_from_cpuinfo(self):
    path = os.path.join(testutil.scratch_dir(), "cpuinfo")
    for flags, expected in (("fpu avx2 avx512f", False),
                            ("fpu avx512f avx512_bf16", True),
                            ("fpu amx_bf16 amx_tile", True)):
      with open(path, "w") as f:
        f.write(f"processor\t: 0\nflags\t\t: {flags}\n")
      self.assertEqual(diagnose.cpu_has_bf16(path), expected, flags)
    self.assertFalse(diagnose.cpu_has_bf16(path + ".missing"))

  def test_disturbed_measurements_are_called_so(self):
    base = _run(label="baseline", eps=100.0)
    base.interval_examples_per_second = [60.0, 140.0]
    result = diagnose.verdict(_run(replicas=2, eps=300.0), base)
    self.assertEqual(result.label, "compute-bound")
    self.assertIn("efficiency of 150% (above 100%)", result.notes[0])
    self.assertIn("ranged 60-140 examples/sec", result.notes[1])

  def test_table_and_flag_rewriting(self):
    base = _run(label="baseline", eps=100.0, step=0.64)
    base.interval_examples_per_second = [90.0, 110.0]
    table = diagnose.render_table([base, _run(replicas=2, eps=150.0)], base)
    self.assertIn("speedup", table.splitlines()[0])
    self.assertIn("90-110", table)
    self.assertIn("1.50x", table)
    self.assertIn("75%", table)
    self.assertEqual(
        diagnose.baseline_args(["--dataset=fashion_mnist", "--batch_size=256",
                                "--distribution_strategy=mirrored",
                                "--num_cpu_devices=2", "--nosync_batch_norm",
                                "--dtype=bf16"], 128),
        ["--dataset=fashion_mnist", "--dtype=bf16",
         "--distribution_strategy=one_device", "--per_replica_batch_size=128"])
    # ZeRO's switches and stage, in every spelling, apply only to several
    # replicas: the baseline drops them and says so.
    sharded = ["--dataset=fashion_mnist", "--distribution_strategy=mirrored",
               "--num_cpu_devices=2", "--shard_optimizer_state",
               "--noshard_gradients", "--zero_stage", "1",
               "--optimizer=adamw"]
    self.assertEqual(diagnose.baseline_args(sharded, 32),
                     ["--dataset=fashion_mnist", "--optimizer=adamw",
                      "--distribution_strategy=one_device",
                      "--per_replica_batch_size=32"])
    self.assertEqual(diagnose.baseline_dropped(sharded),
                     ["--num_cpu_devices=2", "--shard_optimizer_state",
                      "--noshard_gradients", "--zero_stage 1"])


def _dataset(slow: bool, cached: bool) -> tf.data.Dataset:
  """8 batches of 128 random examples, repeated; `slow`: a map that sleeps
  SLEEP_SECONDS per batch; `cached`: cached after that map."""
  rng = np.random.RandomState(0)
  x = rng.rand(8 * BATCH, 256).astype(np.float32)
  y = rng.randint(0, 10, 8 * BATCH).astype(np.int64)
  ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
  if slow:
    def sleep(a, b):
      time.sleep(SLEEP_SECONDS)
      return a, b

    ds = ds.map(lambda a, b: tf.numpy_function(sleep, [a, b],
                                               (tf.float32, tf.int64)))
    ds = ds.map(lambda a, b: (tf.ensure_shape(a, [BATCH, 256]),
                              tf.ensure_shape(b, [BATCH])))
  if cached:
    ds = ds.cache()
  return ds.repeat()


class InputWaitTest(parameterized.TestCase):
  """Real steps under the real controller: the measured input wait."""

  @parameterized.named_parameters(
      ("slowed", True, False, "input-bound"),
      ("slowed_then_cached", True, True, "compute-bound"))
  def test_a_slowed_pipeline_is_input_bound_and_a_cached_one_is_not(
      self, slow, cached, expected):
    tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
      # Steps of tens of milliseconds: the fixed cost of taking a cached
      # batch (about 0.5 ms on a loaded 2-core machine) stays far below
      # the 20% input-bound line (with 1024 units, a 9 ms step made it 20%).
      model = keras.Sequential([keras.Input((256,)),
                                keras.layers.Dense(2048, activation="relu"),
                                keras.layers.Dense(2048, activation="relu"),
                                keras.layers.Dense(10)])
      optimizer = keras.optimizers.SGD(0.01)
      optimizer.build(model.trainable_variables)
    trainer = Trainer(strategy=strategy, model=model, optimizer=optimizer,
                      global_batch_size=BATCH)
    data = strategy.experimental_distribute_dataset(_dataset(slow, cached))
    log = run_log_lib.RunLog(tensorboard_dir=None, metrics_dir=tmp,
                             global_batch_size=BATCH, total_steps=24)
    keeper = checkpointing.CheckpointKeeper(
        checkpoint=tf.train.Checkpoint(step=trainer.global_step),
        directory=os.path.join(tmp, "checkpoints"),
        step_counter=trainer.global_step)
    # Log every 8 steps: the first interval (tracing, and the cache's first
    # pass) is warm-up, left out of the averages.
    Controller(runner=step_runner.LocalStepRunner(trainer=trainer,
                                                  iterator=iter(data)),
               options=ControllerOptions(total_steps=24, steps_per_epoch=24,
                                         log_steps=8),
               checkpoints=keeper, step_counter=trainer.global_step,
               run_log=log, learning_rate=lambda: 0.01).run()
    throughput = log.throughput()
    records = [r for r in run_log_lib.read_metrics(tmp)
               if r["kind"] == "train"]
    self.assertLen(records, 3)
    for record in records:
      for key in ("input_wait_seconds", "input_wait_fraction",
                  "execution_seconds", "step_time_seconds",
                  "peak_rss_bytes"):
        self.assertIn(key, record)
    if slow and not cached:
      # Every step waited for the sleeping map (less what the distributed
      # iterator's prefetching overlapped with the step).
      self.assertGreater(throughput["input_wait_seconds"],
                         0.25 * SLEEP_SECONDS)
    measured = RunMeasurement(
        label="requested", strategy="one_device", num_replicas=1,
        num_workers=1, device_kind="CPU", dtype="fp32",
        global_batch_size=BATCH, per_replica_batch_size=BATCH,
        examples_per_second=throughput["examples_per_second"],
        step_time_seconds=throughput["step_time_seconds"],
        input_wait_fraction=throughput["input_wait_fraction"],
        input_wait_seconds=throughput["input_wait_seconds"])
    result = diagnose.verdict(measured)
    self.assertEqual(result.label, expected,
                     f"{result.render()}\n{throughput}")


def _lm_model():
  """`--model=tests.diagnose_test:_lm_model`: 8 -> up 32 (relu) -> down 4,
  compiled (mse)."""
  inputs = keras.Input((8,))
  x = keras.layers.Dense(32, activation="relu", name="up")(inputs)
  model = keras.Model(inputs, keras.layers.Dense(4, name="down")(x))
  model.compile(loss="mse")
  return model


def _lm_examples(training):
  """`--dataset=tests.diagnose_test:_lm_examples`: 64 examples for
  `_lm_model`."""
  del training
  return tf.data.Dataset.from_tensor_slices(
      (np.zeros((64, 8), np.float32), np.zeros((64, 4), np.float32)))


def _lm_map():
  """`--layout_map=tests.diagnose_test:_lm_map`: `_lm_model`'s pair split
  over a 'model' axis of 2."""
  mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"],
                                       devices=["cpu:0", "cpu:1"])
  layout_map = keras.distribution.LayoutMap(mesh)
  layout_map["up/kernel"] = (None, "model")
  layout_map["down/kernel"] = ("model", None)
  return layout_map


class PlanTest(absltest.TestCase):
  """Every run planned and checked before any is measured (no training)."""

  def test_a_layout_map_flag_plans_its_meshes(self):
    # --layout_map: the meshes of 4 devices at the map's T = 2, with the
    # flags that run them; the one-device baseline drops the map.
    out = io.StringIO()
    flag = "--layout_map=tests.diagnose_test:_lm_map"
    result = diagnose.diagnose(
        ["--model=tests.diagnose_test:_lm_model",
         "--dataset=tests.diagnose_test:_lm_examples", flag,
         "--distribution_strategy=mirrored", "--num_cpu_devices=4",
         "--batch_size=16", "--model_dir=" + os.path.join(
             testutil.scratch_dir(), "plan-layout-map")],
        plan_only=True, out=out)
    self.assertIn(flag, result["plan"]["baseline_dropped"])
    rows = {(m["data"], m["pipeline"], m["tensor"], m["zero_stage"]): m
            for m in result["meshes"]["rows"]}
    self.assertEqual(rows[(2, 1, 2, 0)]["flags"],
                     f"--distribution_strategy=mirrored {flag} "
                     "--num_cpu_devices=4")
    self.assertTrue(rows[(2, 1, 2, 0)]["available"])
    self.assertEqual(rows[(1, 2, 2, 0)]["flags"],
                     f"--pipeline_stages=2 {flag}")
    self.assertTrue(rows[(1, 2, 2, 0)]["available"])
    self.assertIn("has a 'model' axis of 2: T = 4 needs a map",
                  rows[(1, 1, 4, 0)]["note"])
    # What the map itself splits: the up/down pair over its T = 2.
    self.assertEqual(result["tensor_split"]["pairs"], [["up", "down"]])
    self.assertIn(f"This model trains so with {flag}.", out.getvalue())

  def _data_flags(self):
    data = testutil.fashion_mnist_subset(limit=1024)
    return [f"--train_files={data['train']}", f"--eval_files={data['eval']}"]

  def test_a_sharded_setup_is_adapted_before_anything_runs(self):
    # Issue 38 item 3: the baseline inherited --shard_optimizer_state and
    # was refused (status 2) only after the requested run.
    root = os.path.join(testutil.scratch_dir(), "plan-sharded")
    out = io.StringIO()
    started = time.monotonic()
    result = diagnose.diagnose(
        [*self._data_flags(), "--distribution_strategy=mirrored",
         "--num_cpu_devices=2", "--shard_optimizer_state",
         "--optimizer=adamw", "--batch_size=64", f"--model_dir={root}"],
        plan_only=True, out=out)
    elapsed = time.monotonic() - started
    text = out.getvalue()
    plan = result["plan"]
    self.assertEqual(plan["strategy"], "mirrored")
    self.assertEqual(plan["num_replicas"], 2)
    self.assertEqual(plan["per_replica_batch_size"], 32)
    for arg in plan["baseline_args"]:
      self.assertNotRegex(arg, r"shard|zero_stage|num_cpu_devices")
    self.assertIn("--distribution_strategy=one_device",
                  plan["baseline_args"])
    self.assertIn("--per_replica_batch_size=32", plan["baseline_args"])
    baseline = job_spec.parse_train_flags(
        [*plan["baseline_args"], f"--model_dir={root}-baseline"],
        where="baseline")
    self.assertEqual(baseline.zero_stage_resolved, 0)
    self.assertEqual(baseline.num_cpu_devices, 0)
    self.assertEqual(plan["baseline_dropped"],
                     ["--num_cpu_devices=2", "--shard_optimizer_state"])
    self.assertIn("Baseline: one_device, per-replica batch 32; dropped "
                  "--num_cpu_devices=2 --shard_optimizer_state", text)
    self.assertIn("ZeRO stage 1 is not needed at this size", text)
    self.assertEqual(result["layout"], [line for line in text.splitlines()
                                        if line.startswith("ZeRO")])
    # Every layout side by side for 2 replicas on this host's memory; the
    # CNN's state fits whole, so plain data parallelism is recommended.
    layouts = result["layouts"]
    self.assertEqual([row["layout"] for row in layouts["rows"]],
                     ["data parallel", "ZeRO 1", "ZeRO 2", "ZeRO 3",
                      "pipeline", "tensor parallel"])
    rows = {row["layout"]: row for row in layouts["rows"]}
    self.assertEqual(rows["data parallel"]["devices"], 2)
    self.assertGreater(rows["data parallel"]["activations_bytes"], 0)
    self.assertLess(rows["ZeRO 3"]["per_device_bytes"],
                    rows["ZeRO 1"]["per_device_bytes"])
    self.assertLess(rows["ZeRO 1"]["optimizer_bytes"],
                    rows["data parallel"]["optimizer_bytes"])
    self.assertIn("--pipeline_stages=2", rows["pipeline"]["flags"])
    # The CNN's dense pair splits by a layout map, but tfdist's trainer
    # trains tensor parallelism only for the built-in Transformer: the row
    # says so (not "no layer of this model can be split").
    self.assertFalse(rows["tensor parallel"]["available"])
    self.assertIn("splits only --model=transformer: train this model "
                  "split with tfdist.fit(..., layout_map=...)",
                  rows["tensor parallel"]["note"])
    self.assertLess(rows["tensor parallel"]["parameters_bytes"],
                    rows["data parallel"]["parameters_bytes"])
    self.assertIn("the splits tfdist trains cover", text)
    # The meshes of 2 devices (tfdist.training.plan.mesh_plan): D2 at ZeRO 0-3,
    # a 2-stage pipeline, tensor parallelism over 2; data parallelism
    # recommended, as in the single-axis table.
    meshes = result["meshes"]
    self.assertEqual([(m["data"], m["pipeline"], m["tensor"],
                       m["zero_stage"]) for m in meshes["rows"]],
                     [(2, 1, 1, 0), (2, 1, 1, 1), (2, 1, 1, 2),
                      (2, 1, 1, 3), (1, 2, 1, 0), (1, 1, 2, 0)])
    self.assertEqual(meshes["recommended"], "D2 x P1 x T1")
    self.assertEqual(meshes["rows"][0]["per_device_bytes"],
                     rows["data parallel"]["per_device_bytes"])
    self.assertIn("Meshes of 2 devices", text)
    self.assertIn("Recommended mesh: D2 x P1 x T1 (no extra flags)", text)
    self.assertEqual(layouts["recommended"], "data parallel")
    self.assertIn("Recommended layout: data parallel (no extra flags)", text)
    # Nothing trained: no run folder, and seconds (flags parsed, the model
    # built once for its estimate), not a measured run.
    self.assertFalse(os.path.exists(root))
    self.assertLess(elapsed, 60.0)

  def test_a_cluster_the_strategy_cannot_use_is_refused_at_start(self):
    # Refused by the plan, before a run starts: status 2 naming the flags.
    started = time.monotonic()
    with self.assertRaisesRegex(errors.ConfigError,
                                r"--num_workers=2 --num_ps=0 .*"
                                r"--distribution_strategy=mirrored"):
      diagnose.diagnose([*self._data_flags(),
                         "--distribution_strategy=mirrored"], num_workers=2,
                        out=io.StringIO())
    self.assertLess(time.monotonic() - started, 30.0)
    with self.assertRaisesRegex(errors.ConfigError, r"--num_ps=1"):
      diagnose.diagnose([*self._data_flags(),
                         "--distribution_strategy=multi_worker_mirrored"],
                        num_workers=2, num_ps=1, out=io.StringIO())
    with self.assertRaisesRegex(errors.ConfigError, r"--num_ps=1 or more"):
      diagnose.diagnose([*self._data_flags(),
                         "--distribution_strategy=parameter_server"],
                        num_workers=2, out=io.StringIO())
    # The requested run's own flags, as tfdist.train would refuse them.
    with self.assertRaisesRegex(errors.JobSpecError,
                                r"the requested run: .*--zero_stage=1"):
      diagnose.diagnose([*self._data_flags(),
                         "--distribution_strategy=one_device",
                         "--zero_stage=1"], out=io.StringIO())
    # The batch must split over the planned replicas (here 3 logical CPUs).
    with self.assertRaisesRegex(
        errors.ConfigError, r"--batch_size=64 \(global\) is not divisible "
        r"by 3 replicas"):
      diagnose.plan_measurements([], job_spec.parse_train_flags(
          [*self._data_flags(), "--distribution_strategy=mirrored",
           "--num_cpu_devices=3", "--batch_size=64", "--model_dir=/tmp/x"],
          where="test"), gpus=0)

  def test_replicas_and_cluster_rules_are_the_backends(self):
    # The plan asks the registered backend (planned_replicas, training
    # workers, asynchronous, on_tpu) instead of restating the kinds' rules:
    # a backend registered in place of Mirrored's changes the plan.
    kind = StrategyKind.MIRRORED
    self.assertEqual(diagnose.planned_replicas(
        kind, num_workers=1, gpus=0, num_cpu_devices=3), 3)
    self.assertEqual(diagnose.planned_replicas(
        StrategyKind.MULTI_WORKER_MIRRORED, num_workers=3, gpus=0,
        num_cpu_devices=0), 3)
    self.assertEqual(diagnose.planned_replicas(
        StrategyKind.PARAMETER_SERVER, num_workers=2, gpus=0,
        num_cpu_devices=0), 1)
    self.assertIsNone(diagnose.planned_replicas(
        StrategyKind.TPU, num_workers=1, gpus=0, num_cpu_devices=0))
    builtin = backend_base.registered_backend(kind)
    self.addCleanup(backend_registry.register_backend, kind, builtin)

    class FiveReplicasOverWorkers(builtin):

      def planned_replicas(self, config, decisions, *, cluster):
        return 5, self.training_workers(cluster)

      def training_workers(self, cluster):
        return cluster.num_workers

    backend_registry.register_backend(kind, FiveReplicasOverWorkers)
    self.assertEqual(diagnose.planned_replicas(
        kind, num_workers=1, gpus=0, num_cpu_devices=3), 5)
    # Trains in several processes now: a local cluster is not refused.
    diagnose.check_cluster(kind, num_workers=2, num_ps=0)

  def test_the_binary_exits_2_on_a_refused_plan(self):
    # The binary's main, in this process (a refused plan starts no child;
    # UserCodeTest runs the binary itself).
    from tfdist.diagnose import cli  # pylint: disable=g-import-not-at-top
    self.addCleanup(cli._FLAGS.unparse_flags)  # pylint: disable=protected-access
    with contextlib.redirect_stdout(io.StringIO()) as out, \
        contextlib.redirect_stderr(io.StringIO()) as err:
      with self.assertRaises(SystemExit) as caught:
        cli.main(["tfdist.diagnose", "--num_workers=2", "--",
                  *self._data_flags(), "--distribution_strategy=one_device"])
    output = out.getvalue() + err.getvalue()
    self.assertEqual(caught.exception.code, 2, output[-3000:])
    self.assertIn("tfdist.diagnose: error: --num_workers=2", err.getvalue())
    self.assertNotIn("run: started", output)


class DiagnoseBinaryTest(absltest.TestCase):
  """`tfdist.diagnose` on a real short run (two `tfdist.train` children)."""

  def test_a_temporary_folder_is_never_named_once_deleted(self):
    # A run that fails (its data files do not exist) keeps its log where
    # the error says; a finished one's temporary folder is not named.
    out = io.StringIO()
    with self.assertRaisesRegex(errors.DiagnoseError,
                                r"exited with status 2: tfdist.train: error: "
                                r"--train_files=.*\nThe end of its "
                                r"output \((\S+\.log)\)") as caught:
      diagnose.diagnose([
          "--train_files=/nonexistent/train-*.tfrecord.gz",
          "--eval_files=/nonexistent/test-*.tfrecord.gz"], baseline=False,
                        steps=2, log_steps=1, timeout_seconds=300, out=out)
    # Progress: the plan, and a line as the run starts and as it ends, with
    # the run's status and its last error line (issue 47 item 5).
    self.assertRegex(out.getvalue(),
                     r"Plan: 1 run\(s\).*\n"
                     r"\[1/1\] requested run: started \(tfdist.train\)\.\n"
                     r"(\[1/1\] requested run: \d+ s, starting.*\n)*"
                     r"\[1/1\] requested run: failed after \d+ s "
                     r"\(status 2\): tfdist.train: error: "
                     r"--train_files='/nonexistent/")
    self.assertEqual(caught.exception.exit_code, errors.CONFIG)
    log = re.search(r"\((\S+\.log)\)", str(caught.exception)).group(1)
    self.assertTrue(os.path.exists(log), log)
    shutil.rmtree(os.path.dirname(log))
    note = diagnose.report.runs_folder_note("/tmp/tfdist-diagnose-x",
                                            keep=False)
    self.assertNotIn("/tmp", note)
    self.assertIn("--model_dir=DIR", note)

  def test_table_verdict_records_and_profile(self):
    # The measured runs of `_diagnosed` (UserCodeTest's run of the binary,
    # from the folder of a user's own model: its --output file is this
    # result): two real `tfdist.train` children.
    run = _diagnosed()
    self.assertEqual(run["returncode"], 0, run["out"][-4000:])
    out, result, root = run["out"], run["result"], run["root"]
    self.assertIn("examples/sec", out)
    self.assertIn("efficiency", out)
    self.assertRegex(out, r"baseline\s+one_device\s+1 CPU\s+32")
    self.assertRegex(out, r"requested\s+mirrored\s+2 logical CPU\s+64")
    self.assertIn("Verdict: ", out)
    self.assertIn("logical-CPU speedup, not scaling", out)
    # Progress, in order: each run's start and end with its seconds, and
    # between them a line every --progress_seconds while it runs.
    self.assertRegex(out, r"\[1/2\] requested run: started[^\n]*\n"
                          r"(\[1/2\] requested run: (\d+ s, starting|step "
                          r"\d+/12 after)[^\n]*\n)*"
                          r"\[1/2\] requested run: finished in \d+ s, "
                          r"[\d.]+ examples/sec\.\n"
                          r"\[2/2\] baseline run: started[^\n]*\n"
                          r"(\[2/2\] baseline run: (\d+ s, starting|step "
                          r"\d+/12 after)[^\n]*\n)*"
                          r"\[2/2\] baseline run: finished in \d+ s")
    # One process: no cluster advice.
    self.assertNotIn("--pin_workers", out.split("Verdict: ")[1])
    self.assertIn("Model state per replica: parameters", out)
    # Every layout side by side after the measured runs too.
    self.assertIn("Recommended layout: data parallel (no extra flags)", out)
    # tfdist.runtime.allocator's malloc settings, on by default, read back from
    # both runs' manifests.
    self.assertIn("malloc tuning on;", out)
    self.assertEqual(result["baseline"]["per_replica_batch_size"], 32)
    self.assertEqual(result["requested"]["num_replicas"], 2)
    self.assertTrue(result["model_fit"]["fits"])
    self.assertTrue(result["requested"]["malloc_tuning"])
    self.assertEqual(result["verdict"]["label"], "compute-bound")
    self.assertEqual(result["layouts"]["recommended"], "data parallel")
    # The manifest's model estimate is the same as the diagnosis's own.
    self.assertEqual(result["requested"]["model_memory"],
                     result["model_memory"])
    # What every run now records, at each log point and in the manifest.
    requested = os.path.join(root, "requested")
    records = run_log_lib.read_metrics(requested)
    train = [r for r in records if r["kind"] == "train"]
    self.assertEqual([r["step"] for r in train], [4, 8, 12])
    for record in train:
      self.assertGreaterEqual(record["input_wait_fraction"], 0.0)
      self.assertLessEqual(record["input_wait_fraction"], 1.0)
      self.assertGreater(record["peak_rss_bytes"], 100 << 20)
      self.assertGreater(record["step_time_seconds"], 0.0)
    self.assertIn("peak_rss_bytes",
                  [r for r in records if r["kind"] == "eval"][0])
    with open(os.path.join(requested, "run_manifest.json")) as f:
      manifest = json.load(f)
    self.assertIsNotNone(manifest["throughput"]["input_wait_fraction"])
    self.assertGreater(manifest["memory"]["peak_rss_bytes"], 100 << 20)
    self.assertEqual(manifest["memory"]["model"]["total_bytes"],
                     result["model_memory"]["total_bytes"])
    # --profile_steps: a trace TensorBoard's profile plugin reads.
    trace = manifest["artifacts"]["profile"]
    self.assertTrue(trace.startswith(os.path.join(requested, "train",
                                                  "plugins", "profile")))
    self.assertTrue(trace.endswith(".xplane.pb"))
    # TensorBoard's profile plugin converts the trace with TensorFlow's own
    # converter (the plugin package itself is not installed here): the
    # trace viewer's events include the traced steps' compiled function.
    from tensorflow.python.profiler.internal import _pywrap_profiler_plugin  # pylint: disable=g-import-not-at-top
    data, converted = _pywrap_profiler_plugin.xspace_to_tools_data(
        [trace], "trace_viewer@", {})
    self.assertTrue(converted)
    events = json.loads(data)["traceEvents"]
    self.assertIn("_train_function", {e.get("name") for e in events})
    # The baseline was not profiled.
    self.assertIsNone(json.load(open(os.path.join(
        root, "baseline", "run_manifest.json")))["artifacts"]["profile"])




# A user's own model and data, in a folder of the user's (issue 47 item 5).
# Wide enough that a step computes for tens of milliseconds (the verdict
# DiagnoseBinaryTest checks is compute-bound), on 1024 examples in memory
# (12 steps of 64 stay in the first epoch).
_USER_MODULE = """
import keras
import tensorflow as tf


def build():
  model = keras.Sequential([keras.Input((8,)),
                            keras.layers.Dense(2048, activation="relu"),
                            keras.layers.Dense(2048, activation="relu"),
                            keras.layers.Dense(1)])
  model.compile(loss="mse")
  return model


def examples(training):
  n = 1024 if training else 64
  x = tf.random.stateless_normal([n, 8], seed=[1, 2])
  return tf.data.Dataset.from_tensor_slices(
      (x, tf.reduce_sum(x, 1, keepdims=True)))
"""

_DIAGNOSED = {}


def _diagnosed() -> dict:
  """`python -m tfdist.diagnose`, run once from the folder of a user's own
  model and data (`_USER_MODULE`) on 2 logical CPU devices (12 steps of a
  global batch of 64, measured every 4, steps 6-7 profiled), for
  UserCodeTest's and DiagnoseBinaryTest's end-to-end cases: the binary and
  its two `tfdist.train` children, one at a time. Returns `{"returncode",
  "out"` (its stdout and stderr), `"result"` (its --output file, None when
  absent), `"root"` (the runs' --model_dir)`}`."""
  if _DIAGNOSED:
    return _DIAGNOSED
  folder = tempfile.mkdtemp(dir=testutil.scratch_dir())
  with open(os.path.join(folder, "mymodel.py"), "w") as f:
    f.write(_USER_MODULE)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
             PYTHONPATH=testutil.REPO_ROOT)
  out_json = os.path.join(folder, "result.json")
  root = os.path.join(folder, "diagnose")
  proc = subprocess.run(
      [sys.executable, "-m", "tfdist.diagnose", "--steps=12",
       "--log_steps=4", "--progress_seconds=0.5", f"--output={out_json}",
       "--", "--model=mymodel:build", "--dataset=mymodel:examples",
       "--batch_size=64", "--shuffle_buffer_size=256",
       "--distribution_strategy=mirrored", "--num_cpu_devices=2",
       "--profile_steps=6,7", f"--model_dir={root}"],
      cwd=folder, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True, timeout=600)
  result = None
  if os.path.exists(out_json):
    with open(out_json) as f:
      result = json.load(f)
  _DIAGNOSED.update(returncode=proc.returncode, out=proc.stdout,
                    result=result, root=root)
  return _DIAGNOSED


class UserCodeTest(absltest.TestCase):
  """`python -m tfdist.diagnose` from the folder of the user's own model."""

  def test_runs_import_the_users_model_from_its_folder(self):
    # Before: both children started in tfdist's folder and failed with
    # "cannot import mymodel ... Run from the folder that holds it"; the
    # binary exited 1, silent while each run measured.
    run = _diagnosed()
    out = run["out"]
    self.assertEqual(run["returncode"], 0, out[-4000:])
    self.assertRegex(out, r"\[1/2\] requested run: finished in \d+ s")
    self.assertRegex(out, r"\[2/2\] baseline run: finished in \d+ s")
    self.assertRegex(out, r"baseline\s+one_device")
    # Progress while each run measured: every half second a line.
    self.assertRegex(out, r"\[1/2\] requested run: (step \d+/12 after \d+ s"
                          r"|\d+ s, starting)")
    self.assertRegex(out, r"\[2/2\] baseline run: (step \d+/12 after \d+ s"
                          r"|\d+ s, starting)")
    # The tensor-parallel row of a plain Dense MLP: what a layout map
    # derived for it splits (before: "no layer of this model can be split").
    self.assertNotIn("no layer of this model can be split", out)
    self.assertRegex(out, r"Tensor parallelism over 2 devices .*the "
                          r"splits tfdist trains cover dense \(column\), "
                          r"dense_1 \(row\).*\(saving [\d.]+ MiB\)\. A "
                          r"model of your own trains so through "
                          r"tfdist\.fit\(model_fn, \.\.\., layout_map=")
    result = run["result"]
    rows = {r["layout"]: r for r in result["layouts"]["rows"]}
    self.assertLess(rows["tensor parallel"]["parameters_bytes"],
                    rows["data parallel"]["parameters_bytes"] * 0.6)
    self.assertEqual(result["tensor_split"]["pairs"], [["dense", "dense_1"]])

  def test_a_layout_map_derived_for_a_dense_mlp(self):
    # Dense 8->64->64->1: the first two form a column/row pair over 2 (the
    # last, 1 unit wide, reaches the output: a column split would need a
    # gather); over 3, 64 units do not divide.
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(1)])
    split = diagnose.tensor_split.tensor_split_of(model, 2)
    self.assertEqual(split.layers, {model.layers[0].name: "column",
                                    model.layers[1].name: "row"})
    # Column kernel and bias, row kernel (its bias stays whole), float32.
    self.assertEqual(split.split_bytes, (8 * 64 + 64 + 64 * 64) * 4)
    self.assertEqual(split.weight_bytes, model.count_params() * 4)
    self.assertEqual(split.trained_bytes, split.split_bytes)
    self.assertEqual(diagnose.tensor_split.tensor_split_of(
        model, 3).split_bytes, 0)

  def test_an_embedding_a_map_could_split_is_not_counted_as_trained(self):
    # A layout map can split an Embedding by vocabulary; tfdist's trainer
    # does not: the saving counts only the Dense pair (a new user found
    # the note claiming the Transformer's token embedding split, and a
    # saving no run gives).
    inputs = keras.Input((4,), dtype="int32")
    x = keras.layers.Embedding(64, 8, name="tokens")(inputs)
    x = keras.layers.Dense(16, activation="relu", name="up")(x)
    x = keras.layers.Dense(8, name="down")(x)
    model = keras.Model(inputs, keras.layers.GlobalAveragePooling1D()(x))
    split = diagnose.tensor_split.tensor_split_of(model, 2)
    self.assertEqual(split.layers, {"tokens": "vocabulary", "up": "column",
                                    "down": "row"})
    self.assertEqual(split.trained_layers, ("up", "down"))
    self.assertEqual(split.split_bytes, (64 * 8 + 8 * 16 + 16 + 16 * 8) * 4)
    self.assertEqual(split.trained_bytes, (8 * 16 + 16 + 16 * 8) * 4)

  def test_progress_reads_steps_and_time_left(self):
    model_dir = tempfile.mkdtemp(dir=testutil.scratch_dir())
    out = io.StringIO()
    progress = diagnose.diagnosis._Progress("[1/2] requested run:",
                                            model_dir, 60, out=out)
    progress()
    metrics = os.path.join(model_dir, "metrics.jsonl")
    with open(metrics, "w") as f:
      f.write(json.dumps({"kind": "train", "step": 10}) + "\n")
    progress()
    time.sleep(0.2)
    with open(metrics, "a") as f:
      f.write(json.dumps({"kind": "eval", "step": 20}) + "\n")
      f.write(json.dumps({"kind": "train", "step": 20}) + "\n{\"kind\": ")
    progress()
    lines = out.getvalue().splitlines()
    self.assertRegex(lines[0], r"^\[1/2\] requested run: \d+ s, starting")
    self.assertRegex(lines[1], r"step 10/60 after \d+ s, time left after "
                               r"the next log point\.$")
    # 10 steps in about 0.2 s: 40 steps left, about 1 s.
    left = float(re.search(r"step 20/60 after \d+ s, about (\d+) s left\.$",
                           lines[2]).group(1))
    self.assertLess(left, 10)
    shutil.rmtree(model_dir)

if __name__ == "__main__":
  absltest.main()
