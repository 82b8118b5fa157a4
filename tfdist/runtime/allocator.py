"""glibc malloc settings that stop TensorFlow's per-step page-fault churn.

The churn: the first `GeneratorDataset` op a process builds (every
`tf.distribute` distributed iterator builds one: Mirrored, MultiWorkerMirrored,
parameter-server workers, one GPU; tfdist reads one CPU device without one)
calls `mallopt(M_MMAP_THRESHOLD, 128 KiB)` once (TensorFlow 2.21's
`ApplyPython311MemoryPatch`, logged as "Memory patch applied:
M_TRIM_THRESHOLD=128 kb was set"). That fixes glibc's mmap threshold at
128 KiB and turns off its adaptive threshold, so every tensor buffer above
128 KiB is `mmap`ped, zero-filled page by page and `munmap`ped again at every
step. Where TensorFlow's own CPU allocator hands large buffers to glibc
(oneDNN off: `TF_ENABLE_ONEDNN_OPTS=0`, or CPUs where TensorFlow leaves
oneDNN off by default), the Fashion-MNIST CNN at batch 128 took about 59,600
minor page faults per step and as much system as user CPU time, and ran at
about half the speed of plain Keras `fit` (which builds no such op on one
device). With oneDNN on, TensorFlow's CPU allocator keeps large buffers
itself and the churn does not show.

The fix, `configure_allocator`, calls `mallopt` through `ctypes` in this
process, so it works for library users too (environment variables such as
`MALLOC_MMAP_THRESHOLD_` are read by glibc only at process start):

* `M_MMAP_MAX = 0`: glibc serves every buffer from its heaps instead of
  private mappings. TensorFlow changes only the mmap *threshold*, so this
  holds whether it is applied before or after TensorFlow's patch.
* `M_TOP_PAD = 64 MiB` (`top_pad_bytes`): when a heap grows it takes 64 MiB
  extra, and when freed memory at a heap's top is trimmed, 64 MiB stay
  mapped. Without it the heap top is trimmed and faulted in again at every
  step. 64 MiB is the most glibc keeps by itself (twice its largest adaptive
  mmap threshold of 32 MiB). Measured on the CNN above (oneDNN off, 40
  steps): 16 MiB left 5,500 faults per step, 32 MiB 1,500, 64 MiB 160,
  128 MiB 200.

Resident-memory cost: each glibc arena (the main heap and the per-thread
arenas, at most 8 per core) can keep up to `top_pad_bytes` of freed memory
mapped instead of returning it to the system, and large buffers freed in the
middle of a heap are reused rather than unmapped. Measured peak resident
memory of the CNN (`benchmarks/keras_parity.py`, oneDNN off): Mirrored over
2 logical CPUs 977 MiB tuned against 789 MiB untuned (the untuned process
returns its step buffers to the system at every step, and faults them in
again); one device 894 against 863 MiB. Turn it off with
`configure_allocator(False)` (the `--notune_allocator` flag,
`TrainConfig(tune_allocator=False)`).

Linux with glibc only; elsewhere (macOS, musl) nothing is changed and the
returned state says why.
"""

import ctypes
import dataclasses
import sys
import threading
from typing import Dict, Optional

from absl import logging

# mallopt(3) parameter numbers (glibc's <malloc.h>).
M_TOP_PAD = -2
M_MMAP_MAX = -4
# glibc's documented defaults (mallopt(3)), restored when tuning is turned
# off after it was applied in this process.
GLIBC_DEFAULT_MMAP_MAX = 65536
GLIBC_DEFAULT_TOP_PAD = 128 * 1024
DEFAULT_TOP_PAD_BYTES = 64 << 20

_PARAMS = {"M_MMAP_MAX": M_MMAP_MAX, "M_TOP_PAD": M_TOP_PAD}


@dataclasses.dataclass(frozen=True)
class AllocatorState:
  """What `configure_allocator` left in force in this process.

  Attributes:
    tune_allocator: whether tuning was asked for.
    applied: the `mallopt` settings now in force by tfdist, by name
      (`{"M_MMAP_MAX": 0, "M_TOP_PAD": 67108864}`; bytes for `M_TOP_PAD`);
      empty when nothing was applied.
    glibc_version: e.g. `"2.36"`; None when the C library is not glibc.
    note: one sentence: what was done, or why nothing was.
  """
  tune_allocator: bool
  applied: Dict[str, int]
  glibc_version: Optional[str]
  note: str

  def to_dict(self) -> dict:
    """A JSON-serializable dict (for run manifests and benchmarks)."""
    return dataclasses.asdict(self)


_lock = threading.Lock()
_state: Optional[AllocatorState] = None


def _glibc():
  """`(libc, version)` of this process's glibc, or `(None, None)`."""
  if not sys.platform.startswith("linux"):
    return None, None
  try:
    libc = ctypes.CDLL(None)
    version_fn = libc.gnu_get_libc_version
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return None, None
  version_fn.restype = ctypes.c_char_p
  mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  mallopt.restype = ctypes.c_int
  return libc, version_fn().decode()


def _mallopt(libc, values: Dict[str, int]) -> Dict[str, int]:
  """Sets each value; returns those glibc accepted."""
  return {name: value for name, value in values.items()
          if libc.mallopt(_PARAMS[name], int(value)) == 1}


def state() -> AllocatorState:
  """The allocator settings tfdist left in force in this process.

  Before any `configure_allocator` call: nothing applied.
  """
  if _state is not None:
    return _state
  return AllocatorState(tune_allocator=False, applied={},
                        glibc_version=_glibc()[1],
                        note="not configured in this process")


def configure_allocator(tune_allocator: bool = True, *,
                        top_pad_bytes: int = DEFAULT_TOP_PAD_BYTES
                        ) -> AllocatorState:
  """Applies (or undoes) the malloc settings of the module docstring.

  Safe to call more than once and at any time, before or after TensorFlow
  is imported or builds its input pipeline: the result does not depend on
  the order. Logs the outcome once per change.

  Args:
    tune_allocator: True applies `M_MMAP_MAX=0` and `M_TOP_PAD`; False
      leaves glibc as it is, or restores glibc's defaults for both if this
      process applied them before.
    top_pad_bytes: `M_TOP_PAD` in bytes (> 0).

  Returns:
    The `AllocatorState` now in force.

  Raises:
    ValueError: `top_pad_bytes` <= 0 or >= 2 GiB (mallopt takes an int).
  """
  global _state
  if not 0 < top_pad_bytes < 2**31:
    raise ValueError(f"top_pad_bytes={top_pad_bytes} must be in (0, 2 GiB).")
  with _lock:
    previous = _state
    libc, version = _glibc()
    if libc is None:
      new = AllocatorState(
          tune_allocator=bool(tune_allocator), applied={}, glibc_version=None,
          note="not glibc (or not Linux): malloc left as it is")
    elif tune_allocator:
      wanted = {"M_MMAP_MAX": 0, "M_TOP_PAD": int(top_pad_bytes)}
      applied = _mallopt(libc, wanted)
      refused = sorted(set(wanted) - set(applied))
      note = (f"glibc {version} malloc tuned for TensorFlow: M_MMAP_MAX=0 "
              f"(no mmap/munmap per tensor buffer), M_TOP_PAD="
              f"{top_pad_bytes / 2**20:g} MiB (each arena keeps up to that "
              "much freed memory mapped)")
      if refused:
        note += f"; glibc refused {', '.join(refused)}"
      new = AllocatorState(tune_allocator=True, applied=applied,
                           glibc_version=version, note=note)
    elif previous is not None and previous.applied:
      _mallopt(libc, {"M_MMAP_MAX": GLIBC_DEFAULT_MMAP_MAX,
                      "M_TOP_PAD": GLIBC_DEFAULT_TOP_PAD})
      new = AllocatorState(
          tune_allocator=False, applied={}, glibc_version=version,
          note=f"glibc {version} malloc tuning turned off: M_MMAP_MAX and "
               "M_TOP_PAD restored to glibc's defaults")
    else:
      new = AllocatorState(
          tune_allocator=False, applied={}, glibc_version=version,
          note=f"glibc {version} malloc left as it is (tuning turned off)")
    _state = new
  if new != previous:
    logging.info("%s.", new.note)
  return new
