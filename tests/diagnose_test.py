"""Tests for the measuring code: input wait, the verdict, tfdist.diagnose.

* A real pipeline slowed on purpose (a `map` that sleeps) trained under the
  real controller is measured input-bound; the same pipeline cached is not.
* The verdict's rules on crafted measurements.
* `python -m tfdist.diagnose` end to end on a real short run: the table,
  the verdict, the per-interval fields of `metrics.jsonl` and the manifest,
  and the `--profile_steps` trace.

Speed targets are not asserted here (benchmarks/ measures them).
"""

import json
import os
import re
import shutil
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf

from tests import testutil
from tfdist import diagnose
from tfdist.diagnose import RunMeasurement
from tfdist.observability import run_log as run_log_lib
from tfdist.training import checkpointing
from tfdist.training import memory
from tfdist.training import step_runner
from tfdist.training.controller import Controller, ControllerOptions
from tfdist.training.train_loop import Trainer

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
    compute = diagnose.verdict(_run("CPU"), cores=2)
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
      model = keras.Sequential([keras.Input((256,)),
                                keras.layers.Dense(1024, activation="relu"),
                                keras.layers.Dense(1024, activation="relu"),
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


class DiagnoseBinaryTest(absltest.TestCase):
  """`python -m tfdist.diagnose` on a real short run (two children)."""

  def test_a_temporary_folder_is_never_named_once_deleted(self):
    # A run that fails (its data files do not exist) keeps its log where
    # the error says; a finished one's temporary folder is not named.
    with self.assertRaisesRegex(diagnose.DiagnoseError,
                                r"exited with status \d+; the end of its "
                                r"output \((\S+\.log)\)") as caught:
      diagnose.diagnose([
          "--train_files=/nonexistent/train-*.tfrecord.gz",
          "--eval_files=/nonexistent/test-*.tfrecord.gz"], baseline=False,
                        steps=2, log_steps=1, timeout_seconds=300)
    log = re.search(r"\((\S+\.log)\)", str(caught.exception)).group(1)
    self.assertTrue(os.path.exists(log), log)
    shutil.rmtree(os.path.dirname(log))
    note = diagnose._runs_folder_note("/tmp/tfdist-diagnose-x", keep=False)  # pylint: disable=protected-access
    self.assertNotIn("/tmp", note)
    self.assertIn("--model_dir=DIR", note)

  def test_table_verdict_records_and_profile(self):
    data = testutil.fashion_mnist_subset(limit=1024)
    root = os.path.join(testutil.scratch_dir(), "diagnose")
    out_json = os.path.join(root + "-result.json")
    proc = testutil.run_module("tfdist.diagnose", [
        f"--output={out_json}", "--steps=12", "--log_steps=4", "--",
        f"--train_files={data['train']}", f"--eval_files={data['eval']}",
        "--distribution_strategy=mirrored", "--num_cpu_devices=2",
        "--batch_size=64", "--shuffle_buffer_size=256",
        "--profile_steps=6,7", f"--model_dir={root}"], timeout=600)
    self.assertEqual(proc.returncode, 0, proc.stdout[-4000:])
    out = proc.stdout
    self.assertIn("examples/sec", out)
    self.assertIn("efficiency", out)
    self.assertRegex(out, r"baseline\s+one_device\s+1 CPU\s+32")
    self.assertRegex(out, r"requested\s+mirrored\s+2 logical CPU\s+64")
    self.assertIn("Verdict: ", out)
    self.assertIn("logical-CPU speedup, not scaling", out)
    self.assertIn("Model state per replica: parameters", out)
    # tfdist.runtime.allocator's malloc settings, on by default, read back from
    # both runs' manifests.
    self.assertIn("malloc tuning on;", out)
    with open(out_json) as f:
      result = json.load(f)
    self.assertEqual(result["baseline"]["per_replica_batch_size"], 32)
    self.assertEqual(result["requested"]["num_replicas"], 2)
    self.assertTrue(result["model_fit"]["fits"])
    self.assertTrue(result["requested"]["malloc_tuning"])
    self.assertEqual(result["verdict"]["label"], "compute-bound")
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


if __name__ == "__main__":
  absltest.main()
