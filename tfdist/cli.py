"""What tfdist's binaries share at their edge (absl's usage text).

absl prints, for `--help` and `--helpshort`, the docstring of `__main__` and
the key flags of the module named by `sys.argv[0]`. Under `python -m
tfdist.train` both are the binary's own module; under a pip console script
(`tfdist-train`, `tfdist-launch`, `tfdist-ray`) `__main__` is the wrapper
script, whose docstring is empty or, where the interpreter's path is too
long for a `#!` line, pip's shell trampoline (`'exec' ... "$0" "$@"`).
`adopt_usage` gives the wrapper the binary's text and key flags.
"""

import sys
from typing import Iterable

from absl import flags


def adopt_usage(doc: str, key_flags: Iterable[flags.Flag], *,
                flag_values: flags.FlagValues = flags.FLAGS):
  """Makes `doc` the usage text and `key_flags` the `--helpshort` flags.

  Args:
    doc: the binary module's docstring, made `__main__`'s (under `python
      -m` it is `__main__`'s already).
    key_flags: `absl.flags.Flag` objects to list under `sys.argv[0]`.
    flag_values: the registry (absl's global `FLAGS` by default).
  """
  sys.modules["__main__"].__doc__ = doc
  for flag in key_flags:
    flag_values.register_key_flag_for_module(sys.argv[0], flag)
