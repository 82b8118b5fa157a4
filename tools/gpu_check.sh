#!/usr/bin/env bash
# The prepared GPU check: one script, under 8 minutes on one GPU, that runs
# tfdist's GPU-relevant measurements and writes each one's JSON to $OUT.
#
#   bash tools/gpu_check.sh                       # results in ./gpu_check_out
#   OUT=/tmp/gc WHEELHOUSE=/wheels bash tools/gpu_check.sh
#
# What it runs, each part bounded by `timeout` and by the script's overall
# budget (GPU_CHECK_BUDGET seconds: 450 on a GPU, 900 in the CPU quick
# mode), each writing its own JSON:
#   main_job      the README's quick start (`tfdist.train` on the bundled
#                 Fashion-MNIST), short: --train_steps; its manifest's peak
#                 device memory (memory.device_memory_peak_bytes)
#   keras_parity  benchmarks/keras_parity.py on one device (the GPU if any)
#   precision     the ResNet (--model=resnet) at --dtype=fp32, bf16
#                 (mixed_bfloat16) and fp16 (mixed_float16) at a batch that
#                 fills the device (GPU_CHECK_BATCH, default 8192 on a GPU);
#                 goal: bf16 >= 1.8x fp32 examples/sec
#   xla           the bf16 ResNet run with --enable_xla, against the bf16 run
#                 without it
#   diagnose      python -m tfdist.diagnose on a one-device run
#   pipeline      the quick start's run cut into 2 pipeline stages (1F1B, 4
#                 micro-batches): stage i on GPU i with two GPUs or more,
#                 else on 2 logical CPU devices; its examples/sec against
#                 main_job's (the same run unsplit) and each device's peak
# and then gpu_check.json (GPU name or "no GPU", TensorFlow version, each
# part's status and figures, the bf16/fp32 ratio) and a short table.
#
# Without a GPU it still runs end to end in a CPU quick mode (tiny step
# counts and batches, a few minutes); every GPU-only figure reads "no GPU".
#
# Python: the first of $TFDIST_PYTHON, .venv/bin/python, python3 that
# imports TensorFlow; else a virtual environment under $OUT/venv with
# `tensorflow[and-cuda]` from $WHEELHOUSE (pip --no-index --find-links) when
# given, else from PyPI. tfdist itself is imported from this checkout
# (PYTHONPATH) when its dependencies are there, else `pip install -e .`
# (--no-deps when TensorFlow was already present).
#
# The GPU machine this project is lent (one NVIDIA H200, about 15 minutes in
# all) has no TensorFlow installed and no network, and what can travel to it
# is capped at 64 MiB, while the TensorFlow GPU wheel is about 570 MB plus the
# NVIDIA libraries: there, as things stand, this script stops at the
# TensorFlow step with "no TensorFlow" in gpu_check.json. Run it on a GPU
# machine that has TensorFlow (a Vertex AI prebuilt TensorFlow GPU container,
# or after `pip install 'tensorflow[and-cuda]'`). docs/benchmarks/gpu-check.md
# has the details and a CPU run's output.
set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BUDGET=${GPU_CHECK_BUDGET:-450}
STARTED=$SECONDS
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}

log() { echo "[gpu_check $(date -u +%H:%M:%S)] $*" >&2; }

# --- a Python with TensorFlow -------------------------------------------------
has_tf() { timeout 120 "$1" -c 'import tensorflow' >/dev/null 2>&1; }
PY=""
for candidate in "${TFDIST_PYTHON:-}" "$ROOT/.venv/bin/python" python3; do
  [ -n "$candidate" ] || continue
  command -v "$candidate" >/dev/null 2>&1 || [ -x "$candidate" ] || continue
  if has_tf "$candidate"; then
    PY=$candidate; break
  fi
done
TF_WAS_PRESENT=1
if [ -z "$PY" ]; then
  TF_WAS_PRESENT=0
  log "no Python with TensorFlow found; installing into $OUT/venv"
  if timeout 60 python3 -m venv "$OUT/venv" >"$OUT/install.log" 2>&1; then
    if [ -n "${WHEELHOUSE:-}" ]; then
      from=(--no-index --find-links "$WHEELHOUSE")
    else
      from=()
    fi
    timeout 900 "$OUT/venv/bin/python" -m pip install "${from[@]}" \
      'tensorflow[and-cuda]' >>"$OUT/install.log" 2>&1 \
      && has_tf "$OUT/venv/bin/python" && PY="$OUT/venv/bin/python"
  fi
fi
if [ -z "$PY" ]; then
  log "no TensorFlow: none installed and the install failed ($OUT/install.log)"
  gpu=$(timeout 30 nvidia-smi --query-gpu=name --format=csv,noheader \
        2>/dev/null | head -1)
  python3 - "$OUT" "${gpu:-no GPU}" <<'EOF'
import json, os, sys, time
out = sys.argv[1]
json.dump({"status": "no TensorFlow", "gpu": sys.argv[2],
           "tensorflow": None, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                     time.gmtime()),
           "load_average": list(os.getloadavg()),
           "install_log": os.path.join(out, "install.log")},
          open(os.path.join(out, "gpu_check.json"), "w"), indent=2)
EOF
  exit 1
fi
log "python: $PY"

# --- tfdist ---------------------------------------------------------------------
if ! timeout 120 "$PY" -c 'import tfdist.train, tfdist.diagnose' \
    >/dev/null 2>&1; then
  deps=()
  [ "$TF_WAS_PRESENT" = 1 ] && deps=(--no-deps)
  log "installing tfdist (pip install -e . ${deps[*]})"
  timeout 600 "$PY" -m pip install "${deps[@]}" -e "$ROOT" \
    >>"$OUT/install.log" 2>&1 || { log "pip install -e . failed"; exit 1; }
fi

# --- the device -----------------------------------------------------------------
timeout 180 "$PY" - "$OUT/environment.json" <<'EOF' || { log "TensorFlow does not start"; exit 1; }
import json, os, platform, sys, time
import tensorflow as tf
gpus = tf.config.list_physical_devices("GPU")
names = [tf.config.experimental.get_device_details(g).get("device_name", g.name)
         for g in gpus]
json.dump({"tensorflow": tf.__version__, "python": platform.python_version(),
           "gpus": names, "cpus": os.cpu_count(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_average_at_start": list(os.getloadavg())},
          open(sys.argv[1], "w"), indent=2)
EOF
GPU_COUNT=$("$PY" -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["gpus"]))' "$OUT/environment.json")
if [ "$GPU_COUNT" -gt 0 ]; then
  MODE=gpu
  BATCH=${GPU_CHECK_BATCH:-8192}
  MAIN_STEPS=300 MAIN_LOG=100
  RES_STEPS=60 RES_LOG=20
  PARITY=(--pairs=2 --steps=200 --warmup_steps=20)
  DIAG=(--steps=200 --log_steps=50)
  CAP_MAIN=120 CAP_PARITY=150 CAP_RUN=90 CAP_DIAG=120 CAP_PIPE=90
else
  MODE=cpu
  BATCH=${GPU_CHECK_BATCH:-32}
  MAIN_STEPS=6 MAIN_LOG=2
  RES_STEPS=6 RES_LOG=2
  PARITY=(--pairs=1 --steps=10 --warmup_steps=3)
  DIAG=(--steps=6 --log_steps=2)
  CAP_MAIN=240 CAP_PARITY=300 CAP_RUN=240 CAP_DIAG=300 CAP_PIPE=240
  # CPU quick mode: the budget covers a loaded 2-core machine.
  BUDGET=${GPU_CHECK_BUDGET:-900}
fi
log "mode: $MODE ($GPU_COUNT GPU(s)), batch $BATCH, budget ${BUDGET}s, out $OUT"

# run_part NAME CAP CMD...: runs CMD under `timeout`, capped by what is left
# of the budget; writes $OUT/NAME.log and $OUT/NAME.status.json.
run_part() {
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - (SECONDS - STARTED)))
  local limit=$(( cap < left ? cap : left ))
  local status rc=null t0=$SECONDS
  if [ "$limit" -lt 10 ]; then
    status="skipped: budget spent"
  else
    log "$name (at most ${limit}s)"
    # tfdist.train takes SIGTERM as a preemption (a grace period to save a
    # checkpoint): KILL follows if it is still running 30 s later.
    timeout --kill-after=30 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    case $rc in
      0) status=ok ;;
      124|137) status="timed out after ${limit}s" ;;
      *) status="failed (exit $rc)" ;;
    esac
  fi
  printf '{"status": "%s", "rc": %s, "seconds": %d, "limit_seconds": %d, "log": "%s"}\n' \
    "$status" "$rc" $((SECONDS - t0)) "$limit" "$OUT/$name.log" \
    >"$OUT/$name.status.json"
  log "$name: $status ($((SECONDS - t0))s)"
}

TRAIN=("$PY" -m tfdist.train --seed=42)
RUNS=$OUT/runs
# A rerun starts afresh: runs/ is removed only when this script made it.
if [ -e "$RUNS" ] && [ ! -e "$RUNS/.gpu_check" ]; then
  log "$RUNS exists and was not made by this script; set OUT to another folder"
  exit 2
fi
rm -rf "$RUNS"
mkdir -p "$RUNS" && touch "$RUNS/.gpu_check"
# The precision and XLA runs: one device, whatever the machine has.
RESNET=(--model=resnet --distribution_strategy=one_device --mode=train \
        --batch_size="$BATCH" --train_steps="$RES_STEPS" --log_steps="$RES_LOG")

run_part main_job "$CAP_MAIN" "${TRAIN[@]}" --model_dir="$RUNS/main_job" \
  --train_steps="$MAIN_STEPS" --log_steps="$MAIN_LOG"
run_part keras_parity "$CAP_PARITY" "$PY" benchmarks/keras_parity.py \
  --strategies=one_device --sides=keras,tfdist "${PARITY[@]}" \
  --output="$OUT/keras_parity.json"
for dtype in fp32 bf16 fp16; do
  prefix=()
  # fp16 on a CPU with oneDNN's ops is hundreds of times slower than fp32
  # (tfdist.training.step.precision warns); the CPU quick mode turns them off for it.
  [ "$MODE" = cpu ] && [ "$dtype" = fp16 ] && prefix=(env TF_ENABLE_ONEDNN_OPTS=0)
  run_part "resnet_$dtype" "$CAP_RUN" "${prefix[@]}" "${TRAIN[@]}" \
    --model_dir="$RUNS/resnet_$dtype" --dtype="$dtype" "${RESNET[@]}"
done
run_part resnet_bf16_xla "$CAP_RUN" "${TRAIN[@]}" \
  --model_dir="$RUNS/resnet_bf16_xla" --dtype=bf16 --enable_xla "${RESNET[@]}"
run_part diagnose "$CAP_DIAG" "$PY" -m tfdist.diagnose --nobaseline \
  "${DIAG[@]}" --timeout_seconds="$CAP_DIAG" --output="$OUT/diagnose.json" \
  -- --distribution_strategy=one_device --dataset=fashion_mnist --seed=42
# Last: the parts above keep the budget they had before it was added.
PIPE=(--pipeline_stages=2 --num_microbatches=4 --pipeline_schedule=1f1b)
[ "$GPU_COUNT" -lt 2 ] && PIPE+=(--num_gpus=0)
run_part pipeline "$CAP_PIPE" "${TRAIN[@]}" --model_dir="$RUNS/pipeline" \
  --train_steps="$MAIN_STEPS" --log_steps="$MAIN_LOG" "${PIPE[@]}"

# --- the summary ------------------------------------------------------------------
"$PY" - "$OUT" "$MODE" "$BATCH" $((SECONDS - STARTED)) <<'EOF'
import json, os, sys

out, mode, batch, wall = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
NO_GPU = "no GPU"
gpu = mode == "gpu"


def load(path):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


env = load(os.path.join(out, "environment.json"))
parts = {}


def part(name):
  parts[name] = load(os.path.join(out, f"{name}.status.json")) or {
      "status": "not run"}
  return parts[name]


def run_figures(name):
  """A tfdist.train run's figures from its run_manifest.json."""
  p = part(name)
  manifest = load(os.path.join(out, "runs", name, "run_manifest.json"))
  if not manifest:
    return p
  tp, mem = manifest.get("throughput", {}), manifest.get("memory", {})
  device_peak = mem.get("device_memory_peak_bytes")
  p.update({
      "examples_per_second": tp.get("examples_per_second"),
      "step_time_ms": (tp["step_time_seconds"] * 1e3
                       if tp.get("step_time_seconds") else None),
      "input_wait_fraction": tp.get("input_wait_fraction"),
      "peak_rss_mib": (mem["peak_rss_bytes"] / 2**20
                       if mem.get("peak_rss_bytes") else None),
      "device_memory_peak_mib": (device_peak / 2**20 if device_peak
                                 else NO_GPU if not gpu else None),
      "strategy": manifest.get("strategy"),
      "replica_devices": manifest.get("replica_devices"),
      "dtype_policy": manifest.get("dtype_policy"),
      "final_metrics": manifest.get("final_metrics"),
  })
  return p


run_figures("main_job")
p = part("keras_parity")
parity = load(os.path.join(out, "keras_parity.json"))
if parity and parity.get("results"):
  r = parity["results"][0]
  p["tfdist_over_keras"] = r["ratios"]["tfdist/keras"]["median"]
  p["examples_per_second"] = {s: v["examples_per_second"]
                              for s, v in r["sides"].items()}
  p["goal"] = ">= 0.98"
for name in ("resnet_fp32", "resnet_bf16", "resnet_fp16", "resnet_bf16_xla"):
  run_figures(name)
  parts[name]["global_batch_size"] = batch


def eps(name):
  return parts[name].get("examples_per_second")


def ratio(a, b):
  return eps(a) / eps(b) if eps(a) and eps(b) else None


bf16 = ratio("resnet_bf16", "resnet_fp32")
summary = {
    "mode": mode,
    "gpu": (env or {}).get("gpus", [NO_GPU])[0] if gpu else NO_GPU,
    "tensorflow": (env or {}).get("tensorflow"),
    "python": (env or {}).get("python"),
    "date": (env or {}).get("date"),
    "load_average": {"start": (env or {}).get("load_average_at_start"),
                     "end": list(os.getloadavg())},
    "wall_seconds": wall,
    "bf16_over_fp32": bf16 if gpu else NO_GPU,
    "bf16_goal": ">= 1.8 (on a GPU)",
    "bf16_goal_met": (bf16 >= 1.8 if bf16 else None) if gpu else NO_GPU,
    "fp16_over_fp32": ratio("resnet_fp16", "resnet_fp32") if gpu else NO_GPU,
    "xla_over_no_xla_bf16": ratio("resnet_bf16_xla", "resnet_bf16"),
    "parts": parts,
}
if not gpu:
  # Measured on the CPU, for the record; not the GPU goal's figure.
  summary["bf16_over_fp32_cpu"] = bf16
  summary["note"] = ("CPU quick mode: tiny runs, figures for the record "
                     "only; resnet_fp16 ran with TF_ENABLE_ONEDNN_OPTS=0.")
run_figures("pipeline")
# The same run as main_job, cut into 2 stages: on GPU 0 and 1 only with
# two GPUs (else on logical CPU devices, where the ratio is not a GPU's).
summary["pipeline_over_one_device"] = ratio("pipeline", "main_job")
summary["pipeline_devices"] = parts["pipeline"].get("replica_devices")
p = part("diagnose")
diag = load(os.path.join(out, "diagnose.json"))
if diag:
  p["verdict"] = diag.get("verdict")
  p["requested"] = diag.get("requested")
summary["parts"] = parts
with open(os.path.join(out, "gpu_check.json"), "w") as f:
  json.dump(summary, f, indent=2, default=str)


def fmt(v, spec="{:.1f}"):
  if v is None:
    return "-"
  return spec.format(v) if isinstance(v, (int, float)) else str(v)


print(f"\nGPU check ({mode}): {summary['gpu']}, TensorFlow "
      f"{summary['tensorflow']}, {wall} s; {out}/gpu_check.json")
print(f"{'part':<16} {'status':<24} {'examples/s':>11} {'step ms':>8} "
      f"{'device peak MiB':>16}")
for name, p in parts.items():
  e = p.get("examples_per_second")
  print(f"{name:<16} {p['status'][:24]:<24} "
        f"{fmt(e) if not isinstance(e, dict) else fmt(e.get('tfdist')):>11} "
        f"{fmt(p.get('step_time_ms')):>8} "
        f"{fmt(p.get('device_memory_peak_mib')):>16}")
print(f"bf16/fp32: {fmt(summary['bf16_over_fp32'], '{:.2f}')} (goal >= 1.8)"
      + (f"; on this CPU {fmt(bf16, '{:.2f}')}" if not gpu else "")
      + f"; fp16/fp32: {fmt(summary['fp16_over_fp32'], '{:.2f}')}"
      + f"; XLA on/off (bf16): {fmt(summary['xla_over_no_xla_bf16'], '{:.2f}')}"
      + f"; keras_parity tfdist/keras: "
      f"{fmt(parts['keras_parity'].get('tfdist_over_keras'), '{:.3f}')}")
print(f"pipeline (2 stages, 1f1b) / one device: "
      f"{fmt(summary['pipeline_over_one_device'], '{:.2f}')} on "
      f"{summary['pipeline_devices'] or '-'}")
if diag and diag.get("verdict"):
  v = diag["verdict"]
  print("diagnose verdict:", v.get("label", v) if isinstance(v, dict) else v)
EOF
summary_rc=$?
failed=$(grep -L '"status": "ok"' "$OUT"/*.status.json | wc -l)
[ "$summary_rc" = 0 ] && [ "$failed" = 0 ]
