"""`tfdist.training.decay_schedules`: the decay-schedule registry now lives in
`tfdist.core.decay_schedules` (the bottom floor,
docs/design/architecture.md); this old path is the same module object, kept
because `--helpfull` (--lr_schedule) and user code name
`tfdist.training.decay_schedules.register_decay_schedule`."""

import sys

from tfdist.core import decay_schedules

sys.modules[__name__] = decay_schedules
