"""`tfdist.training.lr_schedule`: the learning-rate scaling and warmup
schedules now live in `tfdist.training.plan.lr_schedule` (what a run decides
before it starts); this old path is the same module object, kept because
every `run_manifest.json` written before the move names it: the manifest's
`lr_schedule` is Keras's serialization of the run's schedule, whose `module`
is the defining module's path, and a script that imports that module to
deserialize the schedule (`LinearWarmup`, registered as `tfdist>LinearWarmup`)
finds it here."""

import sys

from tfdist.training.plan import lr_schedule

sys.modules[__name__] = lr_schedule
