"""absl flag definitions for tfdist binaries, in small `define_*` groups.

Each `define_*` function defines one group and returns the names of its key
flags (shown by `--helpshort`). `flags_to_config` turns parsed flags into a
frozen `tfdist.config.TrainConfig`; it is the only reader of `FLAGS`.

Imported as `tfdist.flags` (this folder is installed there; see
`tfdist/__init__.py`), so a project's own `flags.py` never shadows it. A
project's own binary can define them all and call `tfdist.fit`:

    from absl import app
    from tfdist import flags as tfdist_flags
    tfdist_flags.define_all_flags()
    app.run(lambda argv: tfdist.fit(..., config=tfdist_flags.flags_to_config()))
"""

from .definitions import define_all_flags
from .definitions import define_base_flags
from .definitions import define_distribution_flags
from .definitions import define_lr_flags
from .definitions import define_performance_flags
from .definitions import define_train_flags
from .definitions import LIBRARY_ONLY_FIELDS
from .definitions import config_flag_names
from .definitions import flags_to_config

__all__ = ["LIBRARY_ONLY_FIELDS", "config_flag_names", "define_all_flags",
           "define_base_flags", "define_distribution_flags",
           "define_lr_flags", "define_performance_flags",
           "define_train_flags", "flags_to_config"]
