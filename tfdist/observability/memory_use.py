"""What a run uses, measured: the process's peak host RSS, the host's
memory, each visible GPU's current and peak bytes, and how to print them.

The run log (`tfdist.observability.run_log`) reads these at every log point;
`tfdist.training.plan.memory` (what a model needs) and `tfdist.diagnose` name
them there too. Host readings need no TensorFlow; `device_memory` imports it
when called.
"""

import os
import resource
import shutil
import subprocess
from typing import Dict, List, Optional, Sequence


# Linux reports ru_maxrss in KiB.
_RUSAGE_UNIT_BYTES = 1024


def peak_rss_bytes() -> int:
  """Peak resident set size of this process so far (bytes)."""
  return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss *
             _RUSAGE_UNIT_BYTES)


def host_memory_bytes() -> int:
  """Physical memory of this host (bytes)."""
  return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def device_memory() -> Dict[str, Dict[str, int]]:
  """Current and peak memory of each visible GPU, as TensorFlow's allocator
  counts it: `{"GPU:0": {"current": bytes, "peak": bytes}, ...}`; `{}`
  without GPUs. Untested here (no GPU on the test machines)."""
  # Imported here: the host-memory readings (`peak_rss_bytes`, the run log's
  # and `tfdist.diagnose`'s) stay TensorFlow-free.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  out = {}
  for index, _ in enumerate(tf.config.list_logical_devices("GPU")):
    name = f"GPU:{index}"
    try:
      info = tf.config.experimental.get_memory_info(name)
    except (ValueError, RuntimeError):
      continue
    out[name] = {"current": int(info["current"]), "peak": int(info["peak"])}
  return out


def gpu_memory_capacity_bytes() -> List[int]:
  """Total memory of each NVIDIA GPU (bytes), from `nvidia-smi`; `[]` when
  there is none (TensorFlow reports usage, not capacity). Untested here."""
  binary = shutil.which("nvidia-smi")
  if not binary:
    return []
  try:
    out = subprocess.run(
        [binary, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=20, check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return []
  return [int(float(line)) << 20 for line in out.split() if line.strip()]


def format_bytes(n: Optional[float]) -> str:
  """`1.5 GiB`, `812 MiB`, `3.2 KiB`; `-` for None."""
  if n is None:
    return "-"
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(n) >= size:
      return f"{n / size:.1f} {unit}"
  return f"{int(n)} B"


def peak_device_bytes(devices: Dict[str, Dict[str, int]]) -> Optional[int]:
  """The largest peak over `device_memory()`'s devices, or None."""
  peaks: Sequence[int] = [d["peak"] for d in devices.values()]
  return max(peaks) if peaks else None
