"""Each mesh layout of 4 logical CPU devices: the state each device holds
against the mesh's formula, and throughput against data parallelism.

Not a test: it prints figures and writes JSON (and an SVG). On N = 4
logical CPU devices (`num_cpu_devices=4`) it trains the built-in
Transformer on the clothing reviews (`tfdist.fit("transformer")`,
`dataset="clothing_reviews"`, Adam, `--steps` steps of `--batch_size`
examples) in one fresh process per run, in each layout of `LAYOUTS`:

* `data`: D = 4, MirroredStrategy (the baseline);
* `zero1`, `zero3`: D = 4 with ZeRO stage 1 or 3 (`zero_stage`);
* `dxp`: D x P = 2 x 2 (`pipeline_stages=2`, tfdist.parallel.pipeline.copies);
* `dxt`: D x T = 2 x 2 (`tensor_parallel=2`, tfdist.parallel.tensor);
* `p4`: P = 4 (`pipeline_stages=4`, one copy);
* `t4`: T = 4 (`tensor_parallel=4`: the Transformer's 4 heads and 128
  feed-forward units divide by 4).

Per device, each run records:

* `recorded`: the state per device tfdist itself records, the run
  manifest's `memory.model` ("Model state per replica": weights, gradients,
  optimizer state; under a pipeline its heaviest stage's);
* `formula`: the mesh's formula for the layout,
  `tfdist.training.plan.mesh_plan` (weights W s_P t_T, optimizer state
  O s_P t_T / D under ZeRO, ...), from an unsharded build of the same
  model in the same child (`memory.estimate_model_memory`,
  `memory.model_facts`), so that both sides count the same variables;
* `held`: what the process actually holds, read at the end of training
  (a Keras callback's `on_train_end`) from every live `tf.Variable`'s
  device, shape and dtype (`gc`: the Keras model's, the optimizer's, the
  ZeRO shards', the pipeline copies' and the tensor-parallel replicas'
  variables alike), split into the model's weights and everything else
  (optimizer slots, ZeRO's shards, metrics' accumulators and step
  counters), by the variable against the model's (`_held_per_device`).
  Gradients are not variables: TensorFlow holds them only inside the
  step, so the gradients column is the formula's and `recorded`'s only.

Throughput is the median of the run manifest's log intervals
(`throughput.this_process.intervals`, the first, warm-up one excluded),
and each layout's figure is its ratio to the `data` run of the same
repeat: the runs alternate (every layout once per repeat, the order
reversed every other repeat), so a drift of the machine's load falls on
all alike. Compare only ratios from a quiet machine: on a 2-core CPU the
4 logical devices share 2 cores, so a ratio shows what a layout's
collectives, bubble and bookkeeping cost, never a speed-up (docs/guides/
device-mesh.md, "Measured: each layout on 4 logical CPU devices").

Usage:
  python benchmarks/mesh_layouts.py --repeats=3 \\
    --out=benchmarks/results/mesh_layouts.json \\
    --plot=benchmarks/results/mesh_layouts.svg
  python benchmarks/mesh_layouts.py --quick --out=/tmp/mesh_layouts.json
"""

import datetime
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import machine  # pylint: disable=g-import-not-at-top,wrong-import-position

DEVICES = 4
# name: (data, pipeline, tensor, zero stage); D x P x T = DEVICES.
LAYOUTS = {
    "data": (4, 1, 1, 0),
    "zero1": (4, 1, 1, 1),
    "zero3": (4, 1, 1, 3),
    "dxp": (2, 2, 1, 0),
    "dxt": (2, 1, 2, 0),
    "p4": (1, 4, 1, 0),
    "t4": (1, 1, 4, 0),
}

FLAGS = flags.FLAGS
flags.DEFINE_list("layouts", list(LAYOUTS), "Layouts run (data is always "
                  "run: the baseline).")
flags.DEFINE_integer("repeats", 3, "Runs of every layout, alternated.")
flags.DEFINE_integer("steps", 60, "Training steps per run.")
flags.DEFINE_integer("log_steps", 10, "Steps per measured interval.")
flags.DEFINE_integer("batch_size", 64, "Global batch (examples).")
flags.DEFINE_integer("run_timeout", 900, "Seconds one run may take.")
flags.DEFINE_bool("quick", False, "A check that the script works: one "
                  "repeat of 6 steps (log every 2). Its throughput means "
                  "nothing.")
flags.DEFINE_string("data_dir", "", "Converted data sets (default: a "
                    "temporary folder).")
flags.DEFINE_string("out", "", "Write the figures here as JSON.")
flags.DEFINE_string("plot", "", "Draw the figures here as an SVG.")
flags.DEFINE_string("child", "", "Internal: run one layout.")
flags.DEFINE_string("model_dir", "", "Internal: the child's model_dir.")


def formula(unsharded: dict, facts: dict, layout: str, *,
            global_batch_size: int) -> dict:
  """The mesh formula's bytes per device for `layout` (`LAYOUTS`):
  `tfdist.training.plan.mesh_plan`'s row of that mesh and stage.

  Args:
    unsharded: `ModelMemory.to_dict()` of an unsharded build (weights,
      gradients, optimizer state).
    facts: `memory.model_facts(model)` of it (`tensor_parallel_bytes`,
      `pipeline_shares`).
    layout: a key of `LAYOUTS`.
    global_batch_size: the batch (only activations depend on it).

  Returns:
    `{"weights", "gradients", "optimizer"}` in bytes per device.
  """
  from tfdist.training.plan import memory  # pylint: disable=g-import-not-at-top
  from tfdist.training.plan import mesh_plan  # pylint: disable=g-import-not-at-top
  data, pipeline, tensor, stage = LAYOUTS[layout]
  estimate = memory.ModelMemory(**{
      k: unsharded[k] for k in ("parameters_bytes", "gradients_bytes",
                                "optimizer_bytes", "num_parameters",
                                "replicated_bytes")})
  shares = {int(k): v for k, v in facts.get("pipeline_shares", {}).items()}
  lf = memory.LayoutFacts(
      estimate=estimate, num_devices=DEVICES, capacity_bytes=1 << 40,
      shared_memory=True, global_batch_size=global_batch_size,
      optimizer="adam", tensor_parallel_bytes=int(
          facts.get("tensor_parallel_bytes", 0)),
      tensor_parallel_flag="--tensor_parallel", pipeline_shares=shares)
  row = next(m for m in mesh_plan.mesh_layouts(lf)
             if (m.data, m.pipeline, m.tensor, m.zero_stage) ==
             (data, pipeline, tensor, stage))
  return {"weights": row.memory.parameters_bytes,
          "gradients": row.memory.gradients_bytes,
          "optimizer": row.memory.optimizer_bytes}


def _components(variable) -> list:
  """The `tf.Variable`s behind a Keras or distributed variable, one per
  device it lives on."""
  import keras  # pylint: disable=g-import-not-at-top
  if isinstance(variable, keras.Variable):
    variable = variable.value
  try:
    parts = getattr(variable, "values", None)
  except Exception:  # pylint: disable=broad-except
    parts = None
  return list(parts) if parts else [variable]


def _handle_key(v) -> int:
  handle = getattr(v, "handle", None)
  return id(handle) if handle is not None else id(v)


def _held_per_device(model_variables) -> dict:
  """Bytes of every live `tf.Variable` per device (`gc`), split into the
  model's weights and the rest. A weight is a component of one of
  `model_variables` (the Keras model's), or a variable named as one
  (`_base_name`: a pipeline's other copies, the tensor-parallel shards);
  the rest, the largest 3 named per device, is optimizer state, ZeRO's
  shards and buffers."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  model_keys, model_names = set(), set()
  for variable in model_variables:
    for v in _components(variable):
      if not isinstance(v, tf.Variable):
        continue  # ZeRO 3's model reads a gathered tensor.
      model_keys.add(_handle_key(v))
      model_names.add(_base_name(v.name))
  seen, held, largest = set(), {}, {}
  for obj in gc.get_objects():
    try:
      if not isinstance(obj, tf.Variable):
        continue
      components = _components(obj)
    except Exception:  # pylint: disable=broad-except
      continue
    for v in components:
      try:
        key = _handle_key(v)
        if key in seen or not getattr(v, "device", ""):
          continue
        seen.add(key)
        # ZeRO's master shard has shape [None] ([S] or [0] by now).
        elements = (v.shape.num_elements() if v.shape.is_fully_defined()
                    else int(tf.size(v)))
        size = elements * v.dtype.size
        spec = tf.DeviceSpec.from_string(v.device)
        device = f"{spec.device_type}:{spec.device_index}"
        name = v.name
      except Exception:  # pylint: disable=broad-except
        continue
      kind = ("weights" if key in model_keys or
              _base_name(name) in model_names else "other")
      row = held.setdefault(device, {"weights": 0, "other": 0,
                                     "variables": 0})
      row[kind] += size
      row["variables"] += 1
      if kind == "other":
        largest.setdefault(device, []).append((size, name))
  for device, row in held.items():
    row["largest_other"] = [
        [name, size] for size, name in sorted(largest.get(device, []),
                                              reverse=True)[:3]]
  return dict(sorted(held.items()))


def _base_name(name: str) -> str:
  """A variable's own name as every copy of it has it: the last component
  that is not `replica_N`, without `:0` and a `_N` suffix
  (`copy1/kernel_2:0`, `kernel/replica_1:0` -> `kernel`). The optimizer's
  slots are named after their variable's path (`adam/dense_kernel_momentum`)
  and never match."""
  parts = [p for p in name.split(":")[0].split("/")
           if not (p.startswith("replica_") and p[8:].isdigit())]
  head, _, tail = parts[-1].rpartition("_")
  return head if tail.isdigit() and head else parts[-1]


def _child(layout: str, model_dir: str):
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top
  from tfdist.config import TrainConfig  # pylint: disable=g-import-not-at-top
  from tfdist.data import datasets  # pylint: disable=g-import-not-at-top
  from tfdist.models import transformer  # pylint: disable=g-import-not-at-top
  from tfdist.training.plan import memory  # pylint: disable=g-import-not-at-top
  data, pipeline, tensor, stage = LAYOUTS[layout]
  held = {}

  class Held(keras.callbacks.Callback):
    """Reads the variables per device once training has ended."""

    def on_train_end(self, logs=None):
      held.update(_held_per_device(
          self.model.variables if self.model else []))

  config = TrainConfig(
      dataset="clothing_reviews", data_dir=FLAGS.data_dir,
      model_dir=model_dir, train_steps=FLAGS.steps,
      batch_size=FLAGS.batch_size, log_steps=FLAGS.log_steps, mode="train",
      seed=1, optimizer="adam", num_cpu_devices=DEVICES,
      distribution_strategy="off" if pipeline > 1 else "mirrored",
      pipeline_stages=pipeline, tensor_parallel=tensor, zero_stage=stage)
  manifest = tfdist.fit("transformer", config=config, callbacks=[Held()],
                        verbose=0)
  # The formula's side: an unsharded build of the same model, Adam built.
  spec = datasets.get_dataset_spec("clothing_reviews")
  probe = transformer.build_transformer(
      sequence_length=spec.input_shape[0],
      vocabulary_size=spec.vocabulary_size,
      num_classes=max(1, spec.num_classes))
  optimizer = keras.optimizers.Adam()
  optimizer.build(probe.trainable_variables)
  facts = memory.model_facts(probe)
  # ZeRO 3 keeps embedding tables whole: the formula counts them apart.
  unsharded = memory.estimate_model_memory(
      probe, optimizer,
      replicated_variables=facts.get("replicated_variables", ())).to_dict()
  throughput = manifest["throughput"]
  intervals = [i["examples_per_second"]
               for i in throughput["this_process"]["intervals"]
               if not i["excluded"]]
  print(json.dumps({
      "layout": layout, "data": data, "pipeline": pipeline,
      "tensor": tensor, "zero_stage": stage,
      "recorded": manifest.get("memory", {}).get("model"),
      "formula": formula(unsharded, facts, layout,
                         global_batch_size=FLAGS.batch_size),
      "unsharded": unsharded,
      "tensor_parallel_bytes": facts.get("tensor_parallel_bytes", 0),
      "held": held,
      "examples_per_second": (statistics.median(intervals) if intervals
                              else None),
      "intervals": intervals,
      "cpu_seconds_per_step": throughput.get("cpu_seconds_per_step"),
      "final_step": manifest.get("final_step"),
      "tensorflow": tf.__version__, "keras": keras.__version__}),
        flush=True)
  sys.stdout.flush()
  os._exit(0)  # pylint: disable=protected-access


def _run(layout: str, data_dir: str) -> dict:
  """One layout's run in a fresh process; a failed run is recorded as
  `{"layout", "error"}` (its output's end) and the others go on."""
  model_dir = tempfile.mkdtemp(prefix=f"mesh_layouts_{layout}_")
  try:
    return machine.run_child(
        [os.path.abspath(__file__), f"--child={layout}",
         f"--model_dir={model_dir}", f"--data_dir={data_dir}",
         f"--steps={FLAGS.steps}", f"--log_steps={FLAGS.log_steps}",
         f"--batch_size={FLAGS.batch_size}"],
        timeout=FLAGS.run_timeout, what=f"layout {layout}",
        timeout_flag="--run_timeout")
  except SystemExit as e:
    print(e, file=sys.stderr)
    return {"layout": layout, "error": str(e)[-3000:]}
  finally:
    shutil.rmtree(model_dir, ignore_errors=True)


def summarize(runs: list) -> dict:
  """Per layout: the median over repeats of its throughput ratio to the
  `data` run of the same repeat (and min, max), and the memory figures of
  its first run (they do not change between runs)."""
  out = {}
  for layout in dict.fromkeys(r["layout"] for r in runs):
    mine = [r for r in runs if r["layout"] == layout and "error" not in r]
    if not mine:
      out[layout] = {"error": next(r["error"] for r in runs
                                   if r["layout"] == layout)}
      continue
    ratios = [r["ratio_to_data"] for r in mine
              if r.get("ratio_to_data") is not None]
    first = mine[0]
    held = first["held"]
    out[layout] = {
        "mesh": f"D{first['data']} x P{first['pipeline']} x "
                f"T{first['tensor']}" + (f", ZeRO {first['zero_stage']}"
                                        if first["zero_stage"] else ""),
        "formula": first["formula"], "recorded": first["recorded"],
        "held_max_weights": max((h["weights"] for h in held.values()),
                                default=0),
        "held_min_weights": min((h["weights"] for h in held.values()),
                                default=0),
        "held_max_other": max((h["other"] for h in held.values()),
                              default=0),
        "held_min_other": min((h["other"] for h in held.values()),
                              default=0),
        "median_ratio": statistics.median(ratios) if ratios else None,
        "min_ratio": min(ratios) if ratios else None,
        "max_ratio": max(ratios) if ratios else None}
  return out


def table(summary: dict) -> str:
  """The summary as text: MiB per device, formula / recorded / held."""
  mib = float(1 << 20)
  lines = [f"{'layout':<7} {'mesh':<21} {'weights f/r':>13} "
           f"{'held':>13} {'grads f/r':>13} {'optimizer f/r':>15} "
           f"{'held other':>13} {'ratio to data':>20}",
           "  (MiB per device; f: the mesh formula, r: what tfdist records"
           " (the heaviest stage under a pipeline), held: live variables, "
           "the least..most of the 4 devices; ratio: median (min..max) of "
           "examples/s over the data run's)"]
  for name, s in summary.items():
    if "error" in s:
      lines.append(f"{name:<7} failed: {s['error'].splitlines()[0]}")
      continue
    f, r = s["formula"], s["recorded"] or {}
    ratio = ("-" if s["median_ratio"] is None else
             f"{s['median_ratio']:.3f} ({s['min_ratio']:.2f}.."
             f"{s['max_ratio']:.2f})")
    pair = lambda a, b: f"{a / mib:.2f}/{b / mib:.2f}"
    span = lambda a, b: f"{a / mib:.2f}..{b / mib:.2f}"
    lines.append(
        f"{name:<7} {s['mesh']:<21} "
        f"{pair(f['weights'], r.get('parameters_bytes', 0)):>13} "
        f"{span(s['held_min_weights'], s['held_max_weights']):>13} "
        f"{pair(f['gradients'], r.get('gradients_bytes', 0)):>13} "
        f"{pair(f['optimizer'], r.get('optimizer_bytes', 0)):>15} "
        f"{span(s['held_min_other'], s['held_max_other']):>13} "
        f"{ratio:>20}")
  return "\n".join(lines)


def svg_plot(result: dict) -> str:
  """Two panels as an SVG (matplotlib is not a dependency): bytes per
  device (formula against held, weights + other state) and the
  throughput ratio to data parallelism, one bar group per layout."""
  summary = {k: v for k, v in result["summary"].items() if "error" not in v}
  names = list(summary)
  width, height, left, top, panel = 760, 380, 60, 40, 300
  bar = panel / max(len(names), 1)
  out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
         f'height="{height}" font-family="sans-serif" font-size="11">',
         f'<text x="{left}" y="16">Mesh layouts on {DEVICES} logical CPU '
         f'devices, {result["cpu_model"]}, {result["date"]}</text>',
         f'<text x="{left}" y="30" font-size="9">{result["command"]}'
         '</text>']
  mib = float(1 << 20)
  most = max([max(s["formula"]["weights"] + s["formula"]["optimizer"],
                  s["held_max_weights"] + s["held_max_other"])
              for s in summary.values()] + [1]) / mib
  base = top + 280
  for i, name in enumerate(names):
    s = summary[name]
    x = left + i * bar
    f = (s["formula"]["weights"] + s["formula"]["optimizer"]) / mib
    h = (s["held_max_weights"] + s["held_max_other"]) / mib
    for j, (value, colour) in enumerate(((f, "#4477aa"), (h, "#ee6677"))):
      hh = 260 * value / most
      out.append(f'<rect x="{x + 4 + j * bar * 0.42:.1f}" '
                 f'y="{base - hh:.1f}" width="{bar * 0.4:.1f}" '
                 f'height="{hh:.1f}" fill="{colour}"/>')
    out.append(f'<text x="{x + 4:.1f}" y="{base + 14}">{name}</text>')
  out.append(f'<text x="{left}" y="{base + 32}">MiB per device '
             f'(max {most:.1f}): blue the formula (weights + optimizer), '
             'red the live variables</text>')
  left2 = left + panel + 60
  ratios = [s["median_ratio"] or 0 for s in summary.values()]
  top_ratio = max(ratios + [1.0])
  for i, (name, ratio) in enumerate(zip(names, ratios)):
    x = left2 + i * bar
    hh = 260 * ratio / top_ratio
    out.append(f'<rect x="{x + 4:.1f}" y="{base - hh:.1f}" '
               f'width="{bar * 0.8:.1f}" height="{hh:.1f}" fill="#228833"/>')
    out.append(f'<text x="{x + 4:.1f}" y="{base - hh - 3:.1f}">'
               f'{ratio:.2f}</text>')
    out.append(f'<text x="{x + 4:.1f}" y="{base + 14}">{name}</text>')
  out.append(f'<text x="{left2}" y="{base + 32}">examples/s over data '
             'parallelism (median of repeats)</text>')
  out.append("</svg>")
  return "\n".join(out)


def main(argv):
  del argv
  if FLAGS.quick:
    FLAGS.repeats, FLAGS.steps, FLAGS.log_steps = 1, 6, 2
  if FLAGS.child:
    _child(FLAGS.child, FLAGS.model_dir)
    return
  unknown = [name for name in FLAGS.layouts if name not in LAYOUTS]
  if unknown:
    raise app.UsageError(f"--layouts: unknown {unknown}; use some of "
                         f"{list(LAYOUTS)}.")
  layouts = ["data"] + [n for n in FLAGS.layouts if n != "data"]
  data_dir = FLAGS.data_dir or tempfile.mkdtemp(prefix="mesh_layouts_data_")
  from tfdist.data import clothing_reviews  # pylint: disable=g-import-not-at-top
  clothing_reviews.prepare(data_dir, "")
  FLAGS.data_dir = data_dir
  started = datetime.datetime.now(datetime.timezone.utc)
  load = machine.load_average()
  runs = []
  for repeat in range(FLAGS.repeats):
    order = layouts if repeat % 2 == 0 else layouts[::-1]
    mine = []
    for layout in order:
      run = _run(layout, data_dir)
      run["repeat"] = repeat
      mine.append(run)
      print(f"repeat {repeat} {layout}: "
            f"{run.get('examples_per_second', 'failed')} examples/s",
            flush=True)
    baseline = next(r for r in mine if r["layout"] == "data")
    for run in mine:
      if baseline.get("examples_per_second") and run.get(
          "examples_per_second"):
        run["ratio_to_data"] = (run["examples_per_second"] /
                                baseline["examples_per_second"])
    runs.extend(mine)
  summary = summarize(runs)
  print(table(summary))
  seconds = (datetime.datetime.now(datetime.timezone.utc) -
             started).total_seconds()
  result = {"date": started.isoformat(timespec="seconds"),
            "command": machine.command_line(),
            "cpu_model": machine.cpu_model(), "cores": os.cpu_count(),
            "load_average_at_start": load,
            "load_average_at_end": machine.load_average(),
            "tensorflow": next((r["tensorflow"] for r in runs
                                if "tensorflow" in r), None),
            "keras": next((r["keras"] for r in runs if "keras" in r), None),
            "quick": FLAGS.quick, "devices": DEVICES,
            "steps": FLAGS.steps, "batch_size": FLAGS.batch_size,
            "seconds": seconds, "summary": summary, "runs": runs}
  print(f"{seconds:.0f} s; load average at start {load[0]:.1f}, at end "
        f"{result['load_average_at_end'][0]:.1f}")
  if FLAGS.out:
    machine.write_json(FLAGS.out, result)
  if FLAGS.plot:
    with open(FLAGS.plot, "w") as f:
      f.write(svg_plot(result))
    print(f"wrote {FLAGS.plot}")


if __name__ == "__main__":
  app.run(main)
