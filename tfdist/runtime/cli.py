"""What tfdist's binaries share at their edge (absl's usage text and help).

absl prints, for `--help` and `--helpshort`, the docstring of `__main__` and
the key flags of the module named by `sys.argv[0]`. Under `python -m
tfdist.train` both are the binary's own module; under a pip console script
(`tfdist-train`, `tfdist-launch`, `tfdist-ray`) `__main__` is the wrapper
script, whose docstring is empty or, where the interpreter's path is too
long for a `#!` line, pip's shell trampoline (`'exec' ... "$0" "$@"`).
`adopt_usage` gives the wrapper the binary's text and key flags.

An unknown flag or a bad value is a usage error (`usage_error`, through
`flags_parser`): one line naming it, status 2 (`tfdist.errors.CONFIG`,
permanent), not absl's `FATAL Flags parsing error` with status 1, the
status of divergence and bugs.

absl's own help flags (`--help`, `--helpshort`, `--helpfull`, `--helpxml`)
print the help and exit with status 1, the status tfdist gives a failed
run (`tfdist.exit_codes`); `define_help_flags` replaces them by flags that
print the same and exit 0, since the help asked for was given.
"""

import sys
from typing import Callable, Iterable, List, NoReturn

from absl import app
from absl import flags

from tfdist import errors


class _ExitZero:
  """Mixin for absl's help flags: leaves with status 0 where they left
  with 1 (they print their help, then `sys.exit(1)`)."""

  def parse(self, arg):
    try:
      super().parse(arg)
    except SystemExit as e:
      raise SystemExit(0 if e.code == 1 else e.code) from None


class _HelpFlag(_ExitZero, app.HelpFlag):
  pass


class _HelpshortFlag(_ExitZero, app.HelpshortFlag):
  pass


class _HelpfullFlag(_ExitZero, app.HelpfullFlag):
  pass


class _HelpXMLFlag(_ExitZero, app.HelpXMLFlag):
  pass


_HELP_FLAG_CLASSES = (_HelpFlag, _HelpshortFlag, _HelpfullFlag, _HelpXMLFlag)


def define_help_flags(flag_values: flags.FlagValues = flags.FLAGS):
  """Defines absl's help flags in `flag_values`, exiting 0 after the help.

  Idempotent. In absl's global `FLAGS`, absl's own are defined first
  (`app.define_help_flags`, which `app.run` then finds done) and replaced,
  so `--helpfull` still lists them under `absl.app`.

  Args:
    flag_values: the registry (absl's global `FLAGS` by default).
  """
  if flag_values is flags.FLAGS:
    app.define_help_flags()
  for flag_class in _HELP_FLAG_CLASSES:
    flag = flag_class()
    for name in (flag.name, flag.short_name):
      if name and name in flag_values:
        delattr(flag_values, name)
    flags.DEFINE_flag(flag, flag_values, module_name=app.__name__)


def adopt_usage(doc: str, key_flags: Iterable[flags.Flag], *,
                flag_values: flags.FlagValues = flags.FLAGS):
  """Makes `doc` the usage text and `key_flags` the `--helpshort` flags.

  Also makes the help flags exit 0 (`define_help_flags`).

  Args:
    doc: the binary module's docstring, made `__main__`'s (under `python
      -m` it is `__main__`'s already).
    key_flags: `absl.flags.Flag` objects to list under `sys.argv[0]`.
    flag_values: the registry (absl's global `FLAGS` by default).
  """
  sys.modules["__main__"].__doc__ = doc
  for flag in key_flags:
    flag_values.register_key_flag_for_module(sys.argv[0], flag)
  define_help_flags(flag_values)


def usage_error(binary: str, error: Exception) -> NoReturn:
  """Bad input to `binary` (e.g. "tfdist.train"): one line naming the flag,
  the value and the fix (the error's text), a pointer to the key flags, and
  exit status 2 (`tfdist.errors.CONFIG`); no usage dump.

  Raises:
    SystemExit: always, with code 2.
  """
  print(f"{binary}: error: {error}\nSee python -m {binary} --helpshort for "
        "the key flags.", file=sys.stderr, flush=True)
  sys.exit(errors.CONFIG)


def flags_parser(binary: str,
                 flag_values: flags.FlagValues = flags.FLAGS
                 ) -> Callable[[List[str]], List[str]]:
  """An `app.run(..., flags_parser=)` that parses `flag_values` and makes
  absl's `flags.Error` (an unknown flag, a value of the wrong type or out of
  its enum) a `usage_error` of `binary`: status 2, one line.

  Returns:
    The parser: argv in, the arguments absl leaves (argv[0] first) out.
  """
  def parse(argv: List[str]) -> List[str]:
    try:
      return flag_values(argv)
    except flags.Error as e:
      usage_error(binary, e)
  return parse
