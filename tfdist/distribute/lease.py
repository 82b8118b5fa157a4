"""The chief's lease on `--model_dir`: one training run per folder.

Two training runs in one `--model_dir` overwrite each other's checkpoints,
SavedModel and manifest, and each resumes from the other's half-finished
state. So the process that writes `--model_dir` (the only process, the
MultiWorkerMirrored chief, the parameter-server coordinator) holds a lease,
`<model_dir>/lease.json`:

    {"holder": "host:pid:nonce", "host": ..., "pid": ..., "pid_start": ...,
     "command": ..., "started": <unix time>, "heartbeat": <unix time>,
     "expires": <unix time>, "timeout_seconds": ...}

* Taking it: created with an exclusive create (`O_CREAT | O_EXCL`) on local
  and mounted file systems, so of two runs started together exactly one
  gets it.
* Keeping it: a thread renews `heartbeat` and `expires` (now +
  `--lease_timeout_seconds`) every quarter of the timeout. Around a call
  that may hold the interpreter for long (building a MultiWorkerMirrored
  strategy waits in C++ for every peer), `extended` pushes the expiry past
  it.
* A second run refuses (`LeaseHeldError`, naming the holder) while the lease
  is live. It takes the lease over when it has expired (a restarted job: the
  holder was killed, its host preempted, a launcher or Ray restarted it), or
  at once when the holder ran on this host and its process is gone (pid not
  running, or a different process under that pid). A holder that has missed
  two renewals in a row is waited for, up to one timeout, until its lease
  expires.
* Giving it back: the lease file is deleted when the run ends, however it
  ends short of SIGKILL; after SIGKILL it expires.
* A holder that finds, at a renewal, that someone else has taken the lease
  (it stalled past the timeout) stops before its next checkpoint
  (`LeaseLostError`).

`gs://` and other object stores have no exclusive create through
`tf.io.gfile`: there the lease is written, read back after
`settle_seconds`, and kept only if it is still this run's. Two runs started
within that window may both write; the later write wins and the earlier run
stops at its first renewal (within a quarter of the timeout, before any
checkpoint of its own lands in a folder the other holds). Expiry compares
the wall clocks of different hosts: keep clock skew (NTP) well below
`--lease_timeout_seconds`.
"""

import contextlib
import dataclasses
import json
import os
import socket
import sys
import threading
import time
import uuid
from typing import Optional

from absl import logging
import tensorflow as tf

from tfdist import errors

LEASE_FILE = "lease.json"


def _is_local(path: str) -> bool:
  return "://" not in path


def lease_path(model_dir: str) -> str:
  return os.path.join(model_dir, LEASE_FILE)


def _process_start(pid: int) -> Optional[str]:
  """The start time of process `pid` (clock ticks since boot, from
  /proc/PID/stat), or None where /proc is unavailable or pid is gone."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      text = f.read()
  except OSError:
    return None
  # Field 22; field 2 (the command) may hold spaces, so split after it.
  fields = text.rsplit(")", 1)[-1].split()
  return fields[19] if len(fields) > 19 else None


def _pid_running(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # Someone else's process.
  return True


@dataclasses.dataclass(frozen=True)
class LeaseInfo:
  """A lease as read from `lease.json` (times in seconds since the epoch)."""
  holder: str
  host: str
  pid: int
  pid_start: Optional[str]
  command: str
  started: float
  heartbeat: float
  expires: float
  timeout_seconds: float

  @classmethod
  def from_json(cls, text: str) -> "LeaseInfo":
    data = json.loads(text)
    return cls(holder=str(data["holder"]), host=str(data["host"]),
               pid=int(data["pid"]), pid_start=data.get("pid_start"),
               command=str(data.get("command", "")),
               started=float(data["started"]),
               heartbeat=float(data["heartbeat"]),
               expires=float(data["expires"]),
               timeout_seconds=float(data.get("timeout_seconds", 0.0)))

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), sort_keys=True)

  def describe(self, now: Optional[float] = None) -> str:
    """`holder H (pid P on host X, COMMAND), started ..., ...`."""
    now = time.time() if now is None else now
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC",
                            time.gmtime(self.started))
    left = self.expires - now
    expiry = (f"expires in {left:.0f} s" if left >= 0 else
              f"expired {-left:.0f} s ago")
    command = f", {self.command}" if self.command else ""
    return (f"holder {self.holder} (pid {self.pid} on host {self.host}"
            f"{command}), started {started}, last heartbeat "
            f"{max(0.0, now - self.heartbeat):.0f} s ago, {expiry}")

  def gone_reason(self, now: float) -> Optional[str]:
    """Why this lease may be taken over, or None while it is live."""
    if now > self.expires:
      return (f"its lease expired {now - self.expires:.0f} s ago (no "
              f"heartbeat for {now - self.heartbeat:.0f} s)")
    if self.host == socket.gethostname():
      if not _pid_running(self.pid):
        return f"its process (pid {self.pid} on this host) is gone"
      start = _process_start(self.pid)
      if self.pid_start and start and start != self.pid_start:
        return (f"its process (pid {self.pid} on this host) is gone; the "
                "pid now belongs to another process")
    return None


def read_lease(model_dir: str) -> Optional[LeaseInfo]:
  """The lease in `model_dir`, or None when there is none.

  Raises:
    ValueError: the file exists but does not hold a lease (damaged).
  """
  path = lease_path(model_dir)
  try:
    with tf.io.gfile.GFile(path) as f:
      text = f.read()
  except tf.errors.NotFoundError:
    return None
  try:
    return LeaseInfo.from_json(text)
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{path} does not hold a lease: {e}") from None


class Lease:
  """This run's lease on `model_dir` (see the module docstring).

  Args:
    model_dir: the run's `--model_dir` (local, mounted, or `gs://`).
    timeout_seconds: `--lease_timeout_seconds`: a lease not renewed for
      this long may be taken over; renewed every quarter of it.
    settle_seconds: object stores only: how long to wait before reading a
      written lease back (None: 1 s, or 0 on local file systems).

  Raises:
    ValueError: `timeout_seconds` <= 0.
  """

  def __init__(self, model_dir: str, *, timeout_seconds: float = 60.0,
               settle_seconds: Optional[float] = None):
    if timeout_seconds <= 0:
      raise ValueError(f"--lease_timeout_seconds={timeout_seconds} must be "
                       "> 0.")
    self.model_dir = model_dir
    self.path = lease_path(model_dir)
    self.timeout_seconds = float(timeout_seconds)
    self.local = _is_local(model_dir)
    self.settle_seconds = (settle_seconds if settle_seconds is not None else
                           (0.0 if self.local else 1.0))
    self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    self.started = time.time()
    self.held = False
    self.lost: Optional[LeaseInfo] = None
    self._extended_until = 0.0
    self._stop = threading.Event()
    self._lock = threading.Lock()
    self._thread: Optional[threading.Thread] = None

  # --- the record ------------------------------------------------------------
  def _info(self, now: float) -> LeaseInfo:
    command = " ".join([os.path.basename(sys.argv[0] or "python")] +
                       sys.argv[1:])[:160]
    return LeaseInfo(
        holder=self.holder, host=socket.gethostname(), pid=os.getpid(),
        pid_start=_process_start(os.getpid()), command=command,
        started=self.started, heartbeat=now,
        expires=max(now + self.timeout_seconds, self._extended_until),
        timeout_seconds=self.timeout_seconds)

  def _create_exclusive(self, info: LeaseInfo) -> bool:
    """Creates the lease file if absent; False if it exists."""
    tf.io.gfile.makedirs(self.model_dir)
    if self.local:
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        return False
      with os.fdopen(fd, "w") as f:
        f.write(info.to_json())
        f.flush()
        os.fsync(f.fileno())
      return True
    if tf.io.gfile.exists(self.path):
      return False
    with tf.io.gfile.GFile(self.path, "w") as f:
      f.write(info.to_json())
    return True

  def _replace(self, info: LeaseInfo):
    """Writes `info` over the lease file, atomically where possible."""
    tmp = f"{self.path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    with tf.io.gfile.GFile(tmp, "w") as f:
      f.write(info.to_json())
    tf.io.gfile.rename(tmp, self.path, overwrite=True)

  def _read(self) -> Optional[LeaseInfo]:
    try:
      return read_lease(self.model_dir)
    except ValueError as e:
      logging.warning("tfdist: %s; treating it as an expired lease.", e)
      return LeaseInfo(holder="(damaged lease file)", host="?", pid=-1,
                       pid_start=None, command="", started=0.0,
                       heartbeat=0.0, expires=0.0, timeout_seconds=0.0)

  def _wait_for_stale(self, current: LeaseInfo):
    """A holder that missed two renewals in a row is most likely gone (a
    restarted job finds its predecessor's lease): wait, at most one timeout,
    for the lease to expire rather than fail at once.

    Returns:
      `(lease now, reason it may be taken over or None)`.
    """
    now = time.time()
    stale = now - current.heartbeat > current.timeout_seconds / 2
    wait = current.expires - now
    if not stale or wait > self.timeout_seconds:
      return current, None
    logging.warning("tfdist: the lease on %s is held by %s, which has not "
                    "renewed it for %.0f s: waiting %.0f s for it to expire.",
                    self.model_dir, current.holder, now - current.heartbeat,
                    wait)
    time.sleep(max(0.0, wait) + 0.5)
    later = self._read()
    if later is None:
      return current, "it was released"
    return later, later.gone_reason(time.time())

  def _held_error(self, current: LeaseInfo,
                  now: float) -> errors.LeaseHeldError:
    wait = max(0.0, current.expires - now)
    return errors.LeaseHeldError(
        f"--model_dir={self.model_dir} is in use by another run: "
        f"{current.describe(now)}. Two runs in one --model_dir would "
        "overwrite each other's checkpoints, SavedModel and manifest. Wait "
        "for that run to end, give this run another --model_dir, or, if "
        f"that run is gone, run again once its lease expires (in {wait:.0f} "
        f"s; {LEASE_FILE}, --lease_timeout_seconds).")

  # --- taking, keeping, giving back -------------------------------------------
  def acquire(self) -> "Lease":
    """Takes the lease (or takes over a gone holder's); starts renewing it.

    Returns:
      self.

    Raises:
      LeaseHeldError: another live run holds it; the message names it.
    """
    for _ in range(3):
      now = time.time()
      info = self._info(now)
      if self._create_exclusive(info):
        how = "taken"
        break
      current = self._read()
      if current is None:
        continue  # Released between our two looks: try again.
      if current.holder == self.holder:
        how = "kept"
        break
      reason = current.gone_reason(now)
      if reason is None:
        current, reason = self._wait_for_stale(current)
      if reason is None:
        raise self._held_error(current, time.time())
      logging.warning("tfdist: taking over the lease on %s from %s: %s.",
                      self.model_dir, current.holder, reason)
      self._replace(self._info(time.time()))
      how = "taken over"
      break
    else:
      raise errors.LeaseHeldError(
          f"--model_dir={self.model_dir}: the lease file "
          f"{self.path} keeps appearing and vanishing; "
          "another run is starting there.")
    if self.settle_seconds:
      time.sleep(self.settle_seconds)
    current = self._read()
    if current is None or current.holder != self.holder:
      if current is None:
        raise errors.LeaseHeldError(
            f"--model_dir={self.model_dir}: this run's "
            f"lease {self.path} vanished just after it was "
            "written; another run is starting there.")
      raise self._held_error(current, time.time())
    self.held = True
    logging.info("tfdist: lease on %s %s (%s; renewed every %.0f s).",
                 self.model_dir, how, self.holder, self.timeout_seconds / 4)
    self._thread = threading.Thread(target=self._renew_loop,
                                    name="tfdist-lease", daemon=True)
    self._thread.start()
    return self

  def check_free(self):
    """Raises `LeaseHeldError` if another live run holds the lease (for
    `--dry_run`, which never takes it)."""
    current = self._read()
    now = time.time()
    if current is not None and current.holder != self.holder and (
        current.gone_reason(now) is None):
      raise self._held_error(current, now)

  def renew(self) -> bool:
    """Renews the lease now; False (and `lost` set) if another run took it.
    """
    with self._lock:
      if not self.held:
        return False
      current = self._read()
      if current is not None and current.holder != self.holder:
        if self.lost is None:
          self.lost = current
          logging.error(
              "tfdist: lost the lease on %s to another run: %s. This run "
              "stops before its next checkpoint.", self.model_dir,
              current.describe())
        self.held = False
        return False
      self._replace(self._info(time.time()))
      return True

  def _renew_loop(self):
    interval = self.timeout_seconds / 4
    while not self._stop.wait(interval):
      try:
        if not self.renew():
          return
      except (tf.errors.OpError, OSError) as e:
        # A failed renewal is retried; the lease lasts a whole timeout.
        logging.warning("tfdist: could not renew the lease on %s: %s",
                        self.model_dir, e)

  @contextlib.contextmanager
  def extended(self, seconds: float):
    """Keeps the lease live through a block that may stop renewals for up
    to `seconds` (a call holding the interpreter in C++); afterwards the
    expiry is the usual heartbeat + timeout again."""
    self._extended_until = time.time() + float(seconds) + self.timeout_seconds
    if self.held:
      self.renew()
    try:
      yield self
    finally:
      self._extended_until = 0.0
      if self.held:
        self.renew()

  def check(self):
    """Raises `LeaseLostError` if another run has taken the lease."""
    if self.lost is not None:
      raise errors.LeaseLostError(
          f"--model_dir={self.model_dir}: another run took over this run's "
          f"lease ({self.lost.describe()}): this run stalled for longer than "
          "--lease_timeout_seconds. Stopping without writing more there.")

  def release(self):
    """Stops renewing and deletes the lease file if it is still ours."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=10)
    with self._lock:
      if not self.held:
        return
      self.held = False
      try:
        current = self._read()
        if current is not None and current.holder == self.holder:
          tf.io.gfile.remove(self.path)
      except (tf.errors.OpError, OSError) as e:
        logging.warning("tfdist: could not remove the lease %s: %s (it "
                        "expires in %.0f s).", self.path, e,
                        self.timeout_seconds)

  def __enter__(self) -> "Lease":
    return self.acquire()

  def __exit__(self, *exc_info):
    self.release()
    return False
