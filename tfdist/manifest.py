"""The run manifest: `run_manifest.json`, a record of what ran.

Written atomically (to a temporary file, then renamed) so a reader never sees
half a manifest.
"""

import hashlib
import json
import os
import platform
import subprocess
import time
import uuid
from typing import Iterable, List, Optional

import tensorflow as tf

from tfdist import allocator

MANIFEST_FILE = "run_manifest.json"


def file_fingerprints(paths: Iterable[str]) -> List[dict]:
  """Size (bytes) and SHA-256 of each file, read through `tf.io.gfile`."""
  out = []
  for path in paths:
    digest = hashlib.sha256()
    with tf.io.gfile.GFile(path, "rb") as f:
      while True:
        chunk = f.read(1 << 20)
        if not chunk:
          break
        digest.update(chunk)
    out.append({"path": path, "bytes": tf.io.gfile.stat(path).length,
                "sha256": digest.hexdigest()})
  return out


def git_commit(start_dir: Optional[str] = None) -> Optional[str]:
  """The commit of the git checkout holding tfdist, or None outside git."""
  start_dir = start_dir or os.path.dirname(os.path.abspath(__file__))
  try:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=start_dir,
                         capture_output=True, text=True, timeout=10)
  except (OSError, subprocess.TimeoutExpired):
    return None
  return out.stdout.strip() if out.returncode == 0 else None


def software_versions() -> dict:
  import keras  # pylint: disable=g-import-not-at-top
  import tfdist  # pylint: disable=g-import-not-at-top
  return {"tfdist": tfdist.__version__, "tensorflow": tf.__version__,
          "keras": keras.__version__, "python": platform.python_version()}


def run_header(config) -> dict:
  """The fields every manifest starts with: when, flags, config, versions,
  git commit, and the malloc settings in force (`allocator`: they change
  resident memory, see `tfdist.allocator`). `config` is a
  `tfdist.config.TrainConfig`."""
  return {"created": utc_now(), "flags": dict(config.flags_snapshot),
          "config": config.to_dict(), "versions": software_versions(),
          "git_commit": git_commit(),
          "allocator": allocator.state().to_dict()}


def write_manifest(directory: str, manifest: dict) -> str:
  """Writes `manifest` as `directory/run_manifest.json` atomically.

  Returns:
    The manifest's path.
  """
  tf.io.gfile.makedirs(directory)
  path = os.path.join(directory, MANIFEST_FILE)
  tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
  with tf.io.gfile.GFile(tmp, "w") as f:
    json.dump(manifest, f, indent=2, sort_keys=True, default=str)
  tf.io.gfile.rename(tmp, path, overwrite=True)
  return path


def read_manifest(directory: str) -> dict:
  with tf.io.gfile.GFile(os.path.join(directory, MANIFEST_FILE)) as f:
    return json.load(f)


def utc_now() -> str:
  return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
