"""absl flag definitions for tfdist binaries, in small `define_*` groups.

Each `define_*` function defines one group and returns the names of its key
flags (shown by `--helpshort`). `flags_to_config` turns parsed flags into a
frozen `tfdist.config.TrainConfig`; it is the only reader of `FLAGS`.
"""

from flags.definitions import define_all_flags
from flags.definitions import define_base_flags
from flags.definitions import define_distribution_flags
from flags.definitions import define_lr_flags
from flags.definitions import define_performance_flags
from flags.definitions import define_train_flags
from flags.definitions import LIBRARY_ONLY_FIELDS
from flags.definitions import config_flag_names
from flags.definitions import flags_to_config

__all__ = ["LIBRARY_ONLY_FIELDS", "config_flag_names", "define_all_flags",
           "define_base_flags", "define_distribution_flags",
           "define_lr_flags", "define_performance_flags",
           "define_train_flags", "flags_to_config"]
