"""The pipeline bubble and in-flight activations, measured from stage timelines.

Each stage of a P-stage model (tfdist.parallel.pipeline) is one layer of
known cost: its forward sleeps `--forward_ms`, its backward `--backward_ms`
(a stateless `tf.numpy_function`, so only the schedule's control
dependencies order the tasks), and each records its start and end time.
Under the interleaved schedule (`--virtual_stages=V`) each stage holds V
chunks, each one such layer sleeping 1/V of those times (the same work per
stage, cut V ways).
Sleeping needs no CPU, so the timeline shows the schedule, not this
2-core machine's contention. Per configuration (P, M, schedule), after one
step that traces, `--steps` steps are timed and for each:

  * the bubble: per stage, 1 - busy / span (span: the step's first task
    start to its last task end, over all stages), averaged over the stages;
    compared with the ideal (P-1)/(V*M+P-1) (V = 1 for GPipe and 1F1B);
  * the micro-batches in flight per stage: the most forwards started whose
    backward has not ended (GPipe: M; 1F1B: P - s on stage s; interleaved:
    chunk micro-batches, 2(P-s-1) + (V-1)P + 1 at most).

Figures printed and written as JSON, and drawn as an SVG (written here
by hand: matplotlib is not a dependency), also from a JSON written before:

  python benchmarks/pipeline_bubble.py \\
      --out=benchmarks/results/pipeline_bubble.json \\
      --plot=benchmarks/results/pipeline_bubble.svg
  python benchmarks/pipeline_bubble.py \\
      --from_json=benchmarks/results/pipeline_bubble.json \\
      --plot=benchmarks/results/pipeline_bubble.svg
  python benchmarks/pipeline_bubble.py --schedules=interleaved \\
      --virtual_stages=2 --microbatches=4,8 \\
      --out=benchmarks/results/pipeline_bubble_interleaved.json
"""

import json
import os
import sys
import threading
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from benchmarks import machine  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_list("stages", ["2", "4"], "Pipeline stages (P).")
flags.DEFINE_list("microbatches", ["4", "8", "16"], "Micro-batches (M).")
flags.DEFINE_list("schedules", ["gpipe", "1f1b"], "Schedules: gpipe, 1f1b, "
                  "interleaved.")
flags.DEFINE_integer("virtual_stages", 2, "V, the chunks each stage holds "
                     "under the interleaved schedule (the others: 1).")
flags.DEFINE_float("forward_ms", 100.0, "Forward time of one stage on one "
                   "micro-batch (ms).")
flags.DEFINE_float("backward_ms", 200.0, "Backward time of one stage on one "
                   "micro-batch (ms).")
flags.DEFINE_integer("steps", 3, "Timed steps per configuration.")
flags.DEFINE_string("out", "", "Write the figures here as JSON.")
flags.DEFINE_string("plot", "", "Draw the figures here as an SVG.")
flags.DEFINE_string("from_json", "", "Plot this JSON (written by --out) "
                    "instead of measuring.")


def _work_layer(keras, tf, log, lock):
  """A Keras layer y = x * w whose forward and backward sleep and log."""

  def record(kind, stage, x, seconds):
    start = time.perf_counter()
    time.sleep(seconds)
    end = time.perf_counter()
    with lock:
      log.append((stage, kind, int(round(float(x.reshape(-1)[0]))), start,
                  end))

  class Work(keras.layers.Layer):

    def __init__(self, stage, forward_s, backward_s, **kwargs):
      super().__init__(**kwargs)
      self.stage, self.forward_s, self.backward_s = (stage, forward_s,
                                                     backward_s)

    def build(self, input_shape):
      self.w = self.add_weight(shape=(), initializer="ones", name="w")

    def call(self, x):

      @tf.custom_gradient
      def timed(x):

        def forward(a):
          record("F", self.stage, a, self.forward_s)
          return a

        def backward(dy, a):
          record("B", self.stage, a, self.backward_s)
          return dy

        y = tf.numpy_function(forward, [x], tf.float32, stateful=False)
        y.set_shape(x.shape)

        def grad(dy):
          g = tf.numpy_function(backward, [dy, x], tf.float32,
                                stateful=False)
          g.set_shape(dy.shape)
          return g

        return y, grad

      # w stays 1 (learning rate 0): the micro-batch's index rides in x;
      # w before the timed op makes every stage's backward run it.
      return timed(x * self.w)

  return Work


def _timeline_figures(events, num_stages, num_microbatches,
                      virtual_stages=1):
  """The bubble and in-flight counts of one step's events (e[0]: the
  chunk, on stage e[0] mod P)."""
  span_start = min(e[3] for e in events)
  span = max(e[4] for e in events) - span_start
  bubbles, in_flight, order_ok = [], [], True
  for s in range(num_stages):
    own = sorted((e for e in events if e[0] % num_stages == s),
                 key=lambda e: e[3])
    busy = sum(e[4] - e[3] for e in own)
    bubbles.append(1.0 - busy / span)
    # A stage's tasks never overlap when its chain holds.
    order_ok &= all(a[4] <= b[3] + 1e-4 for a, b in zip(own, own[1:]))
    points = sorted([(e[3], +1) for e in own if e[1] == "F"] +
                    [(e[4], -1) for e in own if e[1] == "B"],
                    key=lambda p: (p[0], p[1]))
    alive = peak = 0
    for _, delta in points:
      alive += delta
      peak = max(peak, alive)
    in_flight.append(peak)
    assert len(own) == 2 * virtual_stages * num_microbatches, (s, len(own))
  return dict(span_s=span, bubble_per_stage=bubbles,
              bubble=sum(bubbles) / len(bubbles),
              in_flight_per_stage=in_flight, stage_tasks_serial=order_ok,
              order=[[(e[1], e[2], e[0])[:3 if virtual_stages > 1 else 2]
                      for e in sorted((e for e in events
                                       if e[0] % num_stages == s),
                                      key=lambda e: e[3])]
                     for s in range(num_stages)])


def run_config(num_stages, num_microbatches, schedule, forward_ms,
               backward_ms, steps, virtual_stages=1):
  """Times `steps` pipelined steps of one configuration (V chunks per
  stage, each 1/V of the stage's times, under `interleaved`)."""
  import keras  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.parallel.pipeline import stages as pipeline  # pylint: disable=g-import-not-at-top

  log, lock = [], threading.Lock()
  work = _work_layer(keras, tf, log, lock)
  v = virtual_stages
  x = keras.Input((1,))
  h = x
  for c in range(num_stages * v):
    h = work(c, forward_ms / 1e3 / v, backward_ms / 1e3 / v,
             name=f"chunk_{c}")(h)
  model = keras.Model(x, h)
  pipe = pipeline.split_model(model, num_stages, virtual_stages=v)
  optimizer = keras.optimizers.SGD(0.0)

  @tf.function
  def step(x, y):
    return pipe.train_step(x, y, loss_fn=lambda y, p: tf.reduce_mean(p),
                           optimizer=optimizer,
                           num_microbatches=num_microbatches,
                           schedule=schedule)

  # One example per micro-batch, holding its index.
  xs = np.arange(num_microbatches, dtype="float32").reshape(-1, 1)
  ys = np.zeros_like(xs)
  step(xs, ys)  # traces
  results = []
  for _ in range(steps):
    del log[:]
    step(xs, ys)
    results.append(_timeline_figures(list(log), num_stages,
                                     num_microbatches, v))
  order = pipeline.schedule_order(num_stages, num_microbatches, schedule, v)
  best = min(results, key=lambda r: r["span_s"])
  measured = [r["bubble"] for r in results]
  ideal = pipeline.bubble_fraction(num_stages, num_microbatches, v)
  return dict(
      stages=num_stages, microbatches=num_microbatches, schedule=schedule,
      virtual_stages=v, forward_ms=forward_ms, backward_ms=backward_ms,
      ideal_bubble=ideal,
      bubble_median=float(np.median(measured)), bubble_all=measured,
      relative_error=float(np.median(measured)) / ideal - 1.0,
      ideal_span_s=(v * num_microbatches + num_stages - 1) * (
          forward_ms + backward_ms) / 1e3 / v,
      span_s_all=[r["span_s"] for r in results],
      in_flight_per_stage=best["in_flight_per_stage"],
      in_flight_planned=[pipeline.peak_in_flight(o) for o in order],
      order_as_planned=all(r["order"] == [list(o) for o in order]
                           for r in results),
      stage_tasks_serial=all(r["stage_tasks_serial"] for r in results))


_SVG_COLORS = {2: "#1f77b4", 4: "#d62728"}


def svg_plot(result: dict) -> str:
  """Two panels as an SVG document: the bubble against M (the ideal
  (P-1)/(M+P-1) as lines, each schedule's measured median as marks), and
  the most micro-batches in flight on stage 0 against M (GPipe M, 1F1B
  at most P).

  Args:
    result: the benchmark's JSON (`rows` of P, M, schedule, figures).
  """
  rows = result["rows"]
  ms = sorted({r["microbatches"] for r in rows})
  ps = sorted({r["stages"] for r in rows})
  width, height, pad = 360, 260, 50
  out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * width}" '
         f'height="{height + 40}" font-family="sans-serif" font-size="11">',
         '<rect width="100%" height="100%" fill="white"/>',
         f'<text x="{width}" y="16" text-anchor="middle" font-size="13">'
         f'Pipeline bubble and micro-batches in flight ({result["date"]}, '
         f'{result["cpu"]}, {result["cores"]} cores)</text>']

  def x_of(m, left):
    span = max(len(ms) - 1, 1)
    return left + pad + (width - 2 * pad) * ms.index(m) / span

  def panel(left, title, y_max, y_label, ticks):
    def y_of(v):
      return 50 + (height - pad - 20) * (1 - v / y_max)
    out.append(f'<text x="{left + width / 2}" y="40" text-anchor="middle">'
               f'{title}</text>')
    base = y_of(0)
    out.append(f'<line x1="{left + pad}" y1="{base}" x2="{left + width - pad}"'
               f' y2="{base}" stroke="black"/>')
    out.append(f'<line x1="{left + pad}" y1="{y_of(y_max)}" x2="{left + pad}"'
               f' y2="{base}" stroke="black"/>')
    for m in ms:
      out.append(f'<text x="{x_of(m, left)}" y="{base + 14}" '
                 f'text-anchor="middle">{m}</text>')
    out.append(f'<text x="{left + width / 2}" y="{base + 30}" '
               'text-anchor="middle">micro-batches M</text>')
    for t in ticks:
      out.append(f'<text x="{left + pad - 4}" y="{y_of(t) + 4}" '
                 f'text-anchor="end">{t:g}</text>')
      out.append(f'<line x1="{left + pad}" y1="{y_of(t)}" '
                 f'x2="{left + width - pad}" y2="{y_of(t)}" stroke="#ddd"/>')
    middle = y_of(y_max / 2)
    out.append(f'<text x="{left + 12}" y="{middle}" text-anchor="middle" '
               f'transform="rotate(-90 {left + 12} {middle})">{y_label}'
               '</text>')
    return y_of

  def mark(x, y, schedule, color):
    if schedule == "gpipe":
      out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="none" '
                 f'stroke="{color}" stroke-width="1.5"/>')
    elif schedule == "interleaved":  # Below its own ideal, (P-1)/(VM+P-1).
      out.append(f'<polygon points="{x:.1f},{y - 4:.1f} {x - 4:.1f},'
                 f'{y + 3:.1f} {x + 4:.1f},{y + 3:.1f}" fill="{color}"/>')
    else:
      out.append(f'<rect x="{x - 3:.1f}" y="{y - 3:.1f}" width="6" '
                 f'height="6" fill="{color}"/>')

  y_of = panel(0, "bubble: ideal (P-1)/(M+P-1) (line), measured (marks)",
               0.5, "idle fraction of the step", (0, 0.1, 0.2, 0.3, 0.4, 0.5))
  for p in ps:
    color = _SVG_COLORS.get(p, "black")
    points = " ".join(f"{x_of(m, 0):.1f},{y_of((p - 1) / (m + p - 1)):.1f}"
                      for m in ms)
    out.append(f'<polyline points="{points}" fill="none" stroke="{color}"/>')
    for r in rows:
      if r["stages"] == p:
        mark(x_of(r["microbatches"], 0), y_of(r["bubble_median"]),
             r["schedule"], color)
  top = max(max(r["in_flight_per_stage"]) for r in rows)
  y_of = panel(width, "micro-batches in flight on stage 0", top,
               "activations held", sorted({0, *ms, *ps}))
  for r in rows:
    mark(x_of(r["microbatches"], width), y_of(r["in_flight_per_stage"][0]),
         r["schedule"], _SVG_COLORS.get(r["stages"], "black"))
  legend = [(f"P = {p}", _SVG_COLORS.get(p, "black"), None) for p in ps]
  legend += [(name, "black", name) for name in ("gpipe", "1f1b",
                                                  "interleaved")
             if any(r["schedule"] == name for r in rows)]
  for i, (label, color, schedule) in enumerate(legend):
    x, y = pad + 110 * i, height + 30
    if schedule:
      mark(x, y - 4, schedule, color)
    else:
      out.append(f'<line x1="{x - 8}" y1="{y - 4}" x2="{x + 8}" '
                 f'y2="{y - 4}" stroke="{color}" stroke-width="2"/>')
    out.append(f'<text x="{x + 12}" y="{y}">{label}</text>')
  out.append("</svg>")
  return "\n".join(out) + "\n"


def _write_plot(result: dict, path: str):
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    f.write(svg_plot(result))
  print(f"wrote {path}")


def main(argv):
  del argv
  if FLAGS.from_json:
    with open(FLAGS.from_json) as f:
      result = json.load(f)
    if FLAGS.plot:
      _write_plot(result, FLAGS.plot)
    return
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfdist.distribute import devices  # pylint: disable=g-import-not-at-top
  stages = [int(p) for p in FLAGS.stages]
  # Enough executor threads for every stage's task at once (the default is
  # the core count, 2 here, which would serialize a 4-stage pipeline); set
  # before the runtime starts, as the logical devices.
  tf.config.threading.set_inter_op_parallelism_threads(4 * max(stages))
  devices.configure_cpu_devices(max(stages))
  rows = []
  started = time.time()
  for p in stages:
    for m in [int(m) for m in FLAGS.microbatches]:
      for schedule in FLAGS.schedules:
        v = FLAGS.virtual_stages if schedule == "interleaved" else 1
        row = run_config(p, m, schedule, FLAGS.forward_ms, FLAGS.backward_ms,
                         FLAGS.steps, v)
        rows.append(row)
        print(f"P={p} M={m:2d} {schedule:5s} V={v} bubble "
              f"{row['bubble_median']:.3f} (ideal {row['ideal_bubble']:.3f}, "
              f"{100 * row['relative_error']:+.1f}%) span "
              f"{min(row['span_s_all']):.3f} s (ideal "
              f"{row['ideal_span_s']:.3f}) in flight "
              f"{row['in_flight_per_stage']} (planned "
              f"{row['in_flight_planned']}) order as planned "
              f"{row['order_as_planned']}", flush=True)
  result = dict(
      benchmark="pipeline_bubble",
      date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
      cpu=machine.cpu_model(), cores=os.cpu_count(),
      load_average=machine.load_average(),
      tensorflow=tf.__version__,
      command=machine.command_line(),
      seconds=round(time.time() - started, 1), rows=rows)
  if FLAGS.out:
    machine.write_json(FLAGS.out, result)
  if FLAGS.plot:
    _write_plot(result, FLAGS.plot)


if __name__ == "__main__":
  app.run(main)
