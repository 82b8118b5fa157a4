"""The binary: `python -m tfdist.diagnose [flags] -- [tfdist.train flags]`.
"""

import json
import sys

from absl import app
from absl import flags

from tfdist import errors
from tfdist import job_spec
from tfdist.diagnose.child_runs import DEFAULT_LOG_STEPS
from tfdist.diagnose.child_runs import DEFAULT_STEPS
from tfdist.diagnose.diagnosis import diagnose


_FLAGS = flags.FlagValues()
flags.DEFINE_integer("num_workers", 1, "Training processes of the requested "
                     "run; more than 1 starts a local cluster through "
                     "tfdist.launch (multi_worker_mirrored, or "
                     "parameter_server with --num_ps).", flag_values=_FLAGS)
flags.DEFINE_integer("num_ps", 0, "Parameter-server tasks of the requested "
                     "run's local cluster.", flag_values=_FLAGS)
flags.DEFINE_bool("pin_workers", False, "Pin each worker (and the baseline) "
                  "to a CPU core of its own, as taskset -c does.",
                  flag_values=_FLAGS)
flags.DEFINE_integer("repeats", 1, "Runs of the requested configuration and "
                     "the baseline, alternated; the table shows medians and "
                     "the range of interval throughputs.", flag_values=_FLAGS)
flags.DEFINE_bool("baseline", True, "Also run the single-device baseline.",
                  flag_values=_FLAGS)
flags.DEFINE_integer("steps", DEFAULT_STEPS, "Training steps of each run "
                     "unless the train flags give --train_steps.",
                     flag_values=_FLAGS)
flags.DEFINE_integer("log_steps", DEFAULT_LOG_STEPS, "Measurement interval "
                     "(steps) unless the train flags give --log_steps; the "
                     "first interval is warm-up, left out.",
                     flag_values=_FLAGS)
flags.DEFINE_float("timeout_seconds", 900, "Limit of each child run.",
                   flag_values=_FLAGS)
flags.DEFINE_float("progress_seconds", 10, "Seconds between the progress "
                   "lines of a measuring run (steps done of its total, time "
                   "left).", flag_values=_FLAGS)
flags.DEFINE_string("output", "", "Also write the measurements and the "
                    "verdict to this JSON file.", flag_values=_FLAGS)
flags.DEFINE_bool("plan_only", False, "Check every planned run's flags, "
                  "print the plan (what the baseline drops), the model's "
                  "state per replica and whether its layout (ZeRO) is "
                  "needed, and measure nothing.", flag_values=_FLAGS)


def _check_own_flags(options):
  for name, low in (("num_workers", 1), ("num_ps", 0), ("repeats", 1),
                    ("steps", 2), ("log_steps", 1)):
    value = getattr(options, name)
    if value < low:
      raise app.UsageError(f"--{name}={value} must be >= {low}.")
  for name in ("timeout_seconds", "progress_seconds"):
    if getattr(options, name) <= 0:
      raise app.UsageError(
          f"--{name}={getattr(options, name)} must be > 0.")


def _exit(message: str, status: int):
  """Ends the binary with `message` on stderr and `status`
  (`tfdist.errors`' table)."""
  print(f"tfdist.diagnose: error: {message}", file=sys.stderr, flush=True)
  sys.exit(status)


def main(argv):
  if "--" in argv:
    split = argv.index("--")
    head, train_args = argv[:split], argv[split + 1:]
  else:
    head, train_args = argv, []
  if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in head):
    # The usage is the package's docstring (`tfdist/diagnose/__init__.py`).
    print(f"{sys.modules[__package__].__doc__}\nFlags:\n{_FLAGS.get_help()}")
    return
  try:
    rest = _FLAGS(head)
    _check_own_flags(_FLAGS)
  except (flags.Error, app.UsageError) as e:
    _exit(str(e), errors.CONFIG)
  if len(rest) > 1:
    _exit(f"unexpected arguments {rest[1:]}; put tfdist.train's flags after "
          "`--`.", errors.CONFIG)
  try:
    result = diagnose(train_args, num_workers=_FLAGS.num_workers,
                      num_ps=_FLAGS.num_ps, pin=_FLAGS.pin_workers,
                      repeats=_FLAGS.repeats, baseline=_FLAGS.baseline,
                      steps=_FLAGS.steps, log_steps=_FLAGS.log_steps,
                      timeout_seconds=_FLAGS.timeout_seconds,
                      plan_only=_FLAGS.plan_only,
                      progress_seconds=_FLAGS.progress_seconds)
  except (errors.ConfigError, errors.DiagnoseError) as e:
    # Flags or a plan refused: CONFIG (2), before anything ran; a run that
    # failed: its own status (tfdist.train's table: 2 for its flags, data
    # or a model that cannot be imported; KILLED past --timeout_seconds);
    # a run that wrote no manifest: 1.
    _exit(str(e), getattr(e, "exit_code", None) or
          errors.exit_code_for(e) or errors.UNEXPECTED)
  if _FLAGS.output:
    with open(_FLAGS.output, "w") as f:
      json.dump(result, f, indent=2, sort_keys=True)


def run():
  app.run(main, argv=sys.argv, flags_parser=job_spec.parse_own_flags_later)


if __name__ == "__main__":
  run()
