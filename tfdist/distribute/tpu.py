"""TPUs: resolve, connect, initialize, and build `tf.distribute.TPUStrategy`.

`--tpu` takes Model Garden's three forms:

* `local`: a TPU attached to this machine (a Cloud TPU VM);
* `grpc://HOST:PORT`: a TPU worker's gRPC address (port 8470 on TPU nodes);
* `NAME`: a Cloud TPU name, looked up through the Cloud TPU API with
  `--tpu_zone` and `--tpu_gcp_project` (from the metadata server when unset).

TensorFlow itself never gives up on a gRPC address where nothing answers:
`experimental_connect_to_cluster` waited for more than 60 s (measured) on a
socket that accepted connections and said nothing. tfdist therefore

1. probes a `grpc://` address first with a plain TCP connect and an HTTP/2
   handshake (a gRPC server answers the client preface with a SETTINGS frame
   at once), each bounded by `probe_timeout` seconds; and
2. runs resolution, connection and `initialize_tpu_system` in a daemon thread
   it abandons after `init_timeout` seconds.

Every failure raises `TPUNotAvailableError`, whose message says what was
tried, what went wrong and what to check.

The constraints tfdist applies whenever the strategy is TPU (static shapes,
more than one step per execution, bfloat16, input on `gs://`) are checked by
`validate_tpu_config` before any expensive work.
"""

import dataclasses
import glob
import os
import socket
import threading
import time
from typing import Callable, Optional, Sequence, Tuple
import urllib.parse

from absl import logging

from tfdist import errors
from tfdist import config as config_lib
from tfdist.config import TPU_DEFAULT_STEPS_PER_EXECUTION  # pylint: disable=unused-import

# The port Cloud TPU nodes serve gRPC on.
DEFAULT_TPU_PORT = 8470
# Seconds for the TCP connect and for the HTTP/2 answer of a grpc:// probe.
DEFAULT_PROBE_TIMEOUT = 5.0
# Seconds allowed for resolve + connect + initialize_tpu_system. A healthy
# TPU v4-8 initializes in well under a minute; pods take longer.
DEFAULT_INIT_TIMEOUT = 300.0

# The HTTP/2 client connection preface, then an empty SETTINGS frame
# (RFC 9113 sections 3.4 and 6.5).
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HTTP2_EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_HTTP2_SETTINGS_TYPE = 0x04

_CHECKS = {
    "local": ("run on a Cloud TPU VM (where /dev/accel* or /dev/vfio/* "
              "exist), with a TPU build of TensorFlow (`tensorflow-tpu` and "
              "`libtpu`); or drop --distribution_strategy=tpu (auto picks "
              "what this machine has)"),
    "grpc": ("the TPU is READY (`gcloud compute tpus describe NAME`), the "
             "address and port (8470 on TPU nodes), firewall rules between "
             "this machine and the TPU network, and that the TPU runs a "
             "TensorFlow version matching this one"),
    "name": ("the TPU name, --tpu_zone and --tpu_gcp_project, that this "
             "machine runs in Google Cloud with credentials for the Cloud "
             "TPU API (`pip install cloud-tpu-client`), and that the TPU is "
             "READY (`gcloud compute tpus describe NAME --zone=ZONE`)"),
}


@dataclasses.dataclass(frozen=True)
class TPUSystem:
  """A connected and initialized TPU system.

  Attributes:
    address: `--tpu` as given (`local`, `grpc://HOST:PORT` or a name).
    kind: `local`, `grpc` or `name`.
    resolver: the `TPUClusterResolver` (or a test double with the same
      `num_accelerators()` and `master()` methods).
    topology: what `initialize_tpu_system` returned (a `Topology`), or None.
    num_cores: TPU cores in the system.
    seconds: wall time spent resolving, connecting and initializing.
  """
  address: str
  kind: str
  resolver: object
  topology: object
  num_cores: int
  seconds: float


def tpu_address_kind(tpu: str) -> str:
  """Classifies `--tpu`: `local`, `grpc` (`grpc://HOST:PORT`) or `name`.

  Raises:
    ConfigError: `tpu` is empty or a URL of another scheme.
  """
  value = (tpu or "").strip()
  if not value:
    raise errors.ConfigError(
        "--distribution_strategy=tpu needs --tpu: `local` on a Cloud TPU VM, "
        "the TPU's name (with --tpu_zone and --tpu_gcp_project), or "
        "grpc://HOST:8470 (or set $TPU_NAME). Received --tpu=''.")
  if value == "local":
    return "local"
  if "://" in value:
    if not value.startswith("grpc://"):
      raise errors.ConfigError(
          f"--tpu={value!r}: only grpc:// addresses are understood, e.g. "
          "--tpu=grpc://10.0.0.2:8470.")
    return "grpc"
  return "name"


def parse_grpc_address(tpu: str) -> Tuple[str, int]:
  """`grpc://HOST[:PORT]` -> (host, port); the port defaults to 8470.

  Raises:
    ConfigError: no host, or a port that is not a number in 1..65535.
  """
  parsed = urllib.parse.urlsplit(tpu)
  try:
    port = parsed.port or DEFAULT_TPU_PORT
  except ValueError:
    port = -1
  if not parsed.hostname or not 0 < port < 65536:
    raise errors.ConfigError(
        f"--tpu={tpu!r} is not a valid gRPC address. Use grpc://HOST:PORT, "
        "e.g. grpc://10.0.0.2:8470.")
  return parsed.hostname, port


def probe_grpc(host: str, port: int, *,
               timeout: float = DEFAULT_PROBE_TIMEOUT) -> float:
  """Checks that a gRPC (HTTP/2) server answers at `host:port`.

  Opens a TCP connection, sends the HTTP/2 client preface and an empty
  SETTINGS frame, and waits for the server's first frame, which must be a
  SETTINGS frame. Bounded: each of connect and answer waits at most
  `timeout` seconds.

  Args:
    host: host name or IP address.
    port: TCP port.
    timeout: seconds for the connect, and again for the answer.

  Returns:
    Seconds the probe took.

  Raises:
    TPUNotAvailableError: refused, unreachable, no answer within `timeout`,
      or an answer that is not HTTP/2. The message names the address.
  """
  where = f"{host}:{port}"
  started = time.monotonic()
  try:
    conn = socket.create_connection((host, port), timeout=timeout)
  except socket.timeout:
    raise errors.TPUNotAvailableError(
        f"Nothing answered a TCP connect to {where} within {timeout:g} s "
        "(the address is unreachable or filtered).") from None
  except OSError as e:
    raise errors.TPUNotAvailableError(
        f"TCP connect to {where} failed: {e.strerror or e}.") from None
  with conn:
    conn.settimeout(timeout)
    try:
      conn.sendall(_HTTP2_PREFACE + _HTTP2_EMPTY_SETTINGS)
      header = b""
      while len(header) < 9:
        chunk = conn.recv(9 - len(header))
        if not chunk:
          break
        header += chunk
    except socket.timeout:
      raise errors.TPUNotAvailableError(
          f"{where} accepted a TCP connection but sent no gRPC (HTTP/2) "
          f"answer within {timeout:g} s: it is not a TPU's gRPC server, or "
          "the server is stuck.") from None
    except OSError as e:
      raise errors.TPUNotAvailableError(
          f"{where} accepted a TCP connection, then failed: "
          f"{e.strerror or e}.") from None
  if len(header) < 9 or header[3] != _HTTP2_SETTINGS_TYPE:
    raise errors.TPUNotAvailableError(
        f"{where} answered, but not as a gRPC (HTTP/2) server "
        f"(first bytes {header[:9]!r}).")
  return time.monotonic() - started


def run_with_deadline(fn: Callable[[], object], *, timeout: float,
                      what: str) -> object:
  """Runs `fn()` in a daemon thread and gives up after `timeout` seconds.

  TensorFlow's connect and TPU initialization cannot be interrupted; the
  thread is abandoned (it dies with the process) rather than waited for.

  Args:
    fn: the work; its return value is returned.
    timeout: seconds to wait.
    what: a phrase for the error, e.g. "connecting to grpc://...".

  Returns:
    What `fn` returned.

  Raises:
    TimeoutError: `fn` did not finish within `timeout` seconds.
    BaseException: whatever `fn` raised, re-raised in this thread.
  """
  result = {}

  def target():
    try:
      result["value"] = fn()
    except BaseException as e:  # pylint: disable=broad-except
      result["error"] = e

  thread = threading.Thread(target=target, name="tfdist-tpu-init",
                            daemon=True)
  thread.start()
  thread.join(timeout)
  if thread.is_alive():
    raise TimeoutError(f"{what} did not finish within {timeout:g} s")
  if "error" in result:
    raise result["error"]
  return result.get("value")


def _default_resolver_factory(tpu, zone, project):
  # Imported here: this module is read by TensorFlow-free paths (auto
  # without a TPU, the launcher); only connecting needs TensorFlow.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.distribute.cluster_resolver.TPUClusterResolver(
      tpu=tpu, zone=zone or None, project=project or None)


def _default_initialize(resolver, kind: str):
  # Imported here: this module is read by TensorFlow-free paths (auto
  # without a TPU, the launcher); only connecting needs TensorFlow.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if kind != "local":
    tf.config.experimental_connect_to_cluster(resolver)
  return tf.tpu.experimental.initialize_tpu_system(resolver)


def _count_cores(resolver, topology) -> int:
  num = getattr(topology, "num_tasks", None)
  per = getattr(topology, "num_tpus_per_task", None)
  if num and per:
    return int(num) * int(per)
  try:
    return int(resolver.num_accelerators().get("TPU", 0))
  except Exception:  # pylint: disable=broad-except
    return 0


def _first_sentences(text: str, limit: int = 200) -> str:
  """The start of an error message, cut at a sentence end near `limit`."""
  text = " ".join(text.split())
  if len(text) <= limit:
    return text.rstrip(".")
  cut = text.rfind(". ", 0, limit)
  return text[:cut] if cut > 0 else text[:limit] + "..."


# Which TPU to connect to, and how long to try: the config's TPU section
# (`--tpu`, `--tpu_zone`, `--tpu_gcp_project`, `--tpu_init_timeout`), handed
# to this part as it is.
TpuOptions = config_lib.TpuConfig


_CONNECTED = {}
_LOCK = threading.Lock()


def connect_tpu(tpu: str, *, zone: str = "", project: str = "",
                init_timeout: float = DEFAULT_INIT_TIMEOUT,
                probe_timeout: float = DEFAULT_PROBE_TIMEOUT,
                resolver_factory: Optional[Callable] = None,
                initialize_fn: Optional[Callable] = None) -> TPUSystem:
  """Resolves, connects (when remote) and initializes a TPU system, bounded.

  A system connected once is reused by later calls with the same address
  (initializing a TPU system twice wipes its state).

  Args:
    tpu: `local`, `grpc://HOST:PORT` or a Cloud TPU name (`--tpu`).
    zone: `--tpu_zone` (names only; default: this VM's zone).
    project: `--tpu_gcp_project` (names only; default: this VM's project).
    init_timeout: seconds allowed for resolve + connect + initialize.
    probe_timeout: seconds for each step of the `grpc://` probe.
    resolver_factory: `(tpu, zone, project) -> resolver`; default
      `tf.distribute.cluster_resolver.TPUClusterResolver`. Tests pass a fake.
    initialize_fn: `(resolver, kind) -> topology`; default connects to the
      cluster (unless local) and calls `tf.tpu.experimental.
      initialize_tpu_system`.

  Returns:
    A `TPUSystem`.

  Raises:
    ConfigError: `--tpu` is empty or malformed.
    TPUNotAvailableError: no TPU reachable, or it did not initialize within
      `init_timeout`; the message says what was tried and what to check.
  """
  kind = tpu_address_kind(tpu)
  key = (tpu, zone, project)
  with _LOCK:
    if key in _CONNECTED:
      return _CONNECTED[key]
  started = time.monotonic()
  fail = _failure(tpu, kind, zone=zone, project=project, started=started)
  if kind == "grpc":
    host, port = parse_grpc_address(tpu)
    try:
      probe_grpc(host, port, timeout=probe_timeout)
    except errors.TPUNotAvailableError as e:
      raise fail(str(e)) from None
  resolver, topology = _initialize_bounded(
      tpu, kind, zone=zone, project=project, init_timeout=init_timeout,
      factory=resolver_factory or _default_resolver_factory,
      initialize=initialize_fn or _default_initialize, fail=fail)
  system = TPUSystem(address=tpu, kind=kind, resolver=resolver,
                     topology=topology,
                     num_cores=_count_cores(resolver, topology),
                     seconds=time.monotonic() - started)
  if system.num_cores <= 0:
    raise fail("the TPU system initialized but reports no TPU cores.")
  logging.info("TPU %s (%s) initialized: %d cores in %.1f s", tpu, kind,
               system.num_cores, system.seconds)
  with _LOCK:
    _CONNECTED[key] = system
  return system


def _failure(tpu: str, kind: str, *, zone: str, project: str,
             started: float) -> Callable[[str], "errors.TPUNotAvailableError"]:
  """`problem -> TPUNotAvailableError` naming what was tried and for how long.

  Args:
    tpu: the `--tpu` address tried.
    kind: its `tpu_address_kind`.
    zone, project: `--tpu_zone`, `--tpu_gcp_project` (named for names).
    started: `time.monotonic()` when the attempt began.
  """
  tried = [f"--tpu={tpu}"]
  if kind == "name":
    tried.append(f"--tpu_zone={zone or '(from metadata)'}")
    tried.append(f"--tpu_gcp_project={project or '(from metadata)'}")
  tried_text = " ".join(tried)

  def fail(problem: str) -> errors.TPUNotAvailableError:
    return errors.TPUNotAvailableError(
        f"No TPU available: {problem} Tried: {tried_text} (after "
        f"{time.monotonic() - started:.1f} s). Check: {_CHECKS[kind]}.")

  return fail


def _initialize_bounded(tpu: str, kind: str, *, zone: str, project: str,
                        init_timeout: float, factory: Callable,
                        initialize: Callable, fail: Callable):
  """Resolves and initializes the TPU within `init_timeout` seconds.

  Returns:
    `(resolver, topology)`.

  Raises:
    ConfigError: from `factory` or `initialize` (a malformed address).
    TPUNotAvailableError: (`fail`'s) on a timeout or any other error.
  """

  def work():
    resolver = factory(tpu, zone, project)
    return resolver, initialize(resolver, kind)

  try:
    return run_with_deadline(
        work, timeout=init_timeout,
        what=f"Resolving, connecting to and initializing --tpu={tpu}")
  except TimeoutError as e:
    raise fail(f"{e} (TensorFlow waits forever here; tfdist gave up). "
               "Raise --tpu_init_timeout if a large pod needs longer."
               ) from None
  except errors.ConfigError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    # NotFoundError ("TPUs not found in the cluster") for local, URLError or
    # RuntimeError (no cloud-tpu-client) for names, ValueError for bad names.
    message = _first_sentences(str(e))
    raise fail(f"{type(e).__name__}: {message}.") from None


def make_tpu_strategy(system: TPUSystem):
  """Builds `tf.distribute.TPUStrategy` over a connected `TPUSystem`."""
  # Imported here: see `_default_resolver_factory`.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.distribute.TPUStrategy(system.resolver)


def tpu_hints(env=None, *, device_globs: Sequence[str] = (
    "/dev/accel*", "/dev/vfio/[0-9]*")) -> Tuple[str, ...]:
  """Signs that this machine has, or is meant to use, a TPU (for `auto`).

  `auto` tries to connect to a TPU only when there is a sign of one, so that
  machines without TPUs pay nothing: `$TPU_NAME` (set on TPU nodes' clients
  and read by `TPUClusterResolver`), `$TPU_ACCELERATOR_TYPE` or
  `$TPU_WORKER_HOSTNAMES` (Cloud TPU VMs and GKE TPU pods), and TPU device
  files (`/dev/accel*` on v2 to v4 VMs, `/dev/vfio/N` on v5e and later).

  Args:
    env: a mapping of environment variables (default `os.environ`).
    device_globs: device-file patterns to look for.

  Returns:
    Human-readable hints, empty when there is none.
  """
  env = os.environ if env is None else env  # Tests pass their own.
  hints = [f"${name}={env[name]}" for name in (
      "TPU_NAME", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")
           if env.get(name)]
  for pattern in device_globs:
    found = sorted(glob.glob(pattern))
    if found:
      hints.append(f"device files {', '.join(found[:4])}")
  return tuple(hints)


def resolve_tpu_address(tpu: str, hints: Sequence[str] = ()) -> str:
  """The one rule for which TPU to use: `--tpu` (the binary's edge fills it
  from `$TPU_NAME` when unset), else `local` when `hints` show a TPU on this
  machine, else '' (no TPU)."""
  tpu = (tpu or "").strip()
  return tpu or ("local" if hints else "")


def is_gcs_path(path: str) -> bool:
  return path.strip().startswith("gs://")


def validate_tpu_config(tpu: str, *, data_patterns: Sequence[Tuple[str, str]]
                        ) -> None:
  """Checks the TPU constraints that can be checked without a TPU.

  Args:
    tpu: the run's `--tpu` (its strategy resolved to `tpu`).
    data_patterns: `(flag, pattern)` pairs the run will read, e.g.
      `[("--train_files", "gs://b/train-*")]`.

  Raises:
    ConfigError: `--tpu` empty (and no `$TPU_NAME`) or malformed; or, with
      `--tpu` other than `local`, an input path not on `gs://` (remote TPU
      workers read the input themselves and cannot see this machine's
      disks).
  """
  address = resolve_tpu_address(tpu)
  kind = tpu_address_kind(address)
  if kind == "grpc":
    parse_grpc_address(address)
  if kind == "local":
    return
  local = [(flag, p) for flag, p in data_patterns
           if any(not is_gcs_path(x) for x in p.split(",") if x.strip())]
  if local:
    given = ", ".join(f"{flag}={p}" for flag, p in local)
    raise errors.ConfigError(
        f"--tpu={address} runs the input pipeline on the TPU workers, "
        "which read files themselves and cannot see this machine's disk: "
        f"input must be on gs://. Received {given}. Copy the data to a "
        "bucket (gsutil -m cp -r DIR gs://BUCKET/DIR) and pass gs:// paths "
        "(or --data_dir=gs://...); only --tpu=local reads local files.")
