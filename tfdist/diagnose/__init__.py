"""Measure before distributing: a baseline, the requested run, a verdict.

Usage:
  python -m tfdist.diagnose -- --dataset=fashion_mnist \\
      --distribution_strategy=mirrored --num_cpu_devices=2
  python -m tfdist.diagnose --num_workers=2 --pin_workers -- \\
      --distribution_strategy=multi_worker_mirrored --dataset=fashion_mnist

Everything after `--` is `tfdist.train` flags. The diagnosis:

1. plans every run and checks it before any is measured
   (`plan_measurements`, seconds): the requested run's flags and the
   baseline's, each by tfdist.train's own parser, the local cluster against
   the strategy, the batch against the replicas; a refusal ends the binary
   with status 2 (`tfdist.errors.CONFIG`) naming the flag. The baseline
   drops what applies only to several replicas (`MULTI_REPLICA_FLAGS`: ZeRO
   stages and sharding switches, `--num_cpu_devices`, collectives, cluster,
   parameter-server and TPU flags) and the report says which it dropped;
2. estimates, from the model alone, the bytes of its parameters, gradients
   and optimizer state (`tfdist.training.plan.memory`), and whether every
   replica's copy fits the device's memory under data parallelism (which
   strategy fits if not); for a sharded layout (ZeRO), whether it is needed at
   this size and what it costs in traffic (`layout_notes`); and every layout
   side by side (`layout_choice`: plain data parallelism, ZeRO 1/2/3, pipeline
   stages, tensor parallelism; state and activations per device) with the
   cheapest that fits recommended with its flags; the tensor-parallel row from
   what a layout map derived for the model could split (`tensor_split_of`:
   Megatron column/row pairs of Dense and EinsumDense layers, attention by
   heads, embeddings by vocabulary), whatever its layers are named;
3. runs the requested configuration and a single-device baseline
   (`one_device`, the same model, data and per-replica batch) as child
   processes of `tfdist.train` (through `tfdist.launch` for a local cluster,
   `--num_workers` / `--num_ps`), for `--train_steps` steps (default 60),
   each in its own `--model_dir` (a temporary folder unless `--model_dir` is
   given; then `<model_dir>/baseline` and `<model_dir>/requested`), in
   alternation `--repeats` times, with a line as each starts and ends and
   every `--progress_seconds` while it runs (steps done of the total, time
   left); each starts in this binary's working directory with its import
   path, so `--model=mymodel:build` imports there as in `--plan_only`; a
   run that fails ends the binary with that run's status (137 past
   `--timeout_seconds`) and its last error line; `--plan_only` stops
   before this step;
4. reads their manifests and `metrics.jsonl`, prints a table (examples/sec,
   step time, input-wait share, peak memory, speedup, scaling efficiency;
   medians over repeats, with the range) and a verdict with the numbers
   behind it (`verdict`): memory-bound, input-bound, communication-bound or
   compute-bound, with what to try (for the hardware measured, and no
   cluster advice for a run of one process).

The rule: measure one device first and find the binding constraint
before adding devices; judge N devices by speedup (examples/sec against the
baseline's) and scaling efficiency (speedup / N): 4 devices at 300
examples/sec against one at 100 is 3x and 75%. Replicas that are logical
devices of one CPU share its cores: their "speedup" is called a
logical-CPU speedup, not scaling.

It replaces `benchmarks/scaling_benchmark.py`; `benchmarks/scaling.py`
drives it for the README's scaling figures.
"""

# The package, one module per role: `measure` (`RunMeasurement`, read from a
# run's manifest), `verdicts` (the rules and `verdict`), `advice` (what to
# try), `plan` (`plan_measurements`: every run checked first; the strategy's
# replicas and cluster asked of its backend), `child_runs` (the runs' flags
# and processes), `layouts` (the model's state per layout), `tensor_split` (what a
# layout map derived for the model could split), `report` (the
# table and lines), `diagnosis` (`diagnose`) and `cli` (the binary;
# `python -m tfdist.diagnose` runs `__main__`). Every public name is
# importable from here.
# (A comment, not the docstring: the docstring is the binary's usage.)

from tfdist.diagnose.advice import COMMUNICATION_ADVICE
from tfdist.diagnose.advice import INPUT_ADVICE
from tfdist.diagnose.advice import MEMORY_ADVICE
from tfdist.diagnose.advice import communication_advice
from tfdist.diagnose.advice import compute_advice
from tfdist.diagnose.advice import cpu_has_bf16
from tfdist.diagnose.advice import memory_advice
from tfdist.diagnose.child_runs import DEFAULT_LOG_STEPS
from tfdist.diagnose.child_runs import DEFAULT_STEPS
from tfdist.diagnose.child_runs import MULTI_REPLICA_FLAGS
from tfdist.diagnose.child_runs import RunSpec
from tfdist.diagnose.child_runs import baseline_args
from tfdist.diagnose.child_runs import baseline_dropped
from tfdist.diagnose.child_runs import command_for
from tfdist.diagnose.child_runs import run_training
from tfdist.diagnose.child_runs import split_flags
from tfdist.diagnose.child_runs import without_flags
from tfdist.diagnose.cli import main
from tfdist.diagnose.cli import run
from tfdist.diagnose.diagnosis import diagnose
from tfdist.diagnose.layouts import ModelSizes
from tfdist.diagnose.layouts import TrainFacts
from tfdist.diagnose.layouts import ZERO3_TRAFFIC
from tfdist.diagnose.layouts import ZERO_TRAFFIC
from tfdist.diagnose.layouts import device_memory_capacity
from tfdist.diagnose.layouts import layout_choice
from tfdist.diagnose.layouts import layout_notes
from tfdist.diagnose.layouts import model_memory_of
from tfdist.diagnose.layouts import model_sizes_of
from tfdist.diagnose.layouts import tensor_split_note
from tfdist.diagnose.measure import RunMeasurement
from tfdist.diagnose.measure import measurement_from_run
from tfdist.diagnose.measure import median_measurement
from tfdist.diagnose.plan import MeasurementPlan
from tfdist.diagnose.plan import check_cluster
from tfdist.diagnose.plan import plan_measurements
from tfdist.diagnose.tensor_split import TensorSplit
from tfdist.diagnose.tensor_split import tensor_split_of
from tfdist.diagnose.plan import planned_replicas
from tfdist.diagnose.report import render_table
from tfdist.diagnose.verdicts import COMMUNICATION_EFFICIENCY
from tfdist.diagnose.verdicts import INPUT_BOUND_SHARE
from tfdist.diagnose.verdicts import INPUT_MODERATE_SHARE
from tfdist.diagnose.verdicts import MEMORY_FULL_SHARE
from tfdist.diagnose.verdicts import NOISY_INTERVAL_RATIO
from tfdist.diagnose.verdicts import SUPERLINEAR_EFFICIENCY
from tfdist.diagnose.verdicts import Verdict
from tfdist.diagnose.verdicts import scaling
from tfdist.diagnose.verdicts import verdict
