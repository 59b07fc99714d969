"""Who may write a store root and who may delete from it (FORMAT.md, "Writers and deleters").

Three kinds of small JSON objects under ``locks/``, the same on local disk and on object stores:

* ``locks/writer.json``, the **writer lease**: the one job that saves into this root (taken by its rank 0 at
  its first save, renewed by a heartbeat, released by ``close``). A second job is refused with a
  :class:`~ckptstore.util.errors.CheckpointError` naming the holder (host, pid, start time).
* ``locks/inflight/<token>.json``, an **in-flight marker**: one per operation that may reference objects
  already in the store without writing them (a save of any rank, from before it consults its chunk index
  until its commit; a step being copied in by an upload or pull).
* ``locks/gc.json``, the **gc lease**: the one deleter (gc, the retention sweep, repack) working now.

Deleters and writers exclude each other with two flags, each written before the other is read (Dekker's
protocol): a writer first writes its marker, then reads the gc lease, and withdraws and waits while a live gc
holds it; a deleter first takes the gc lease, then lists the markers, and sweeps nothing while a live foreign
marker remains. On a store where a write is visible to every later read (local filesystems; S3 and GCS since
they became strongly consistent), at least one side sees the other, so a deleter never sweeps while a save is
between its dedup decisions and its commit. A deleter that did remove something changes ``locks/gc-epoch``;
a writer that finds it changed since its last save drops what it believed about the store (known blobs, its
chunk index) and looks again.

A lease or marker is *stale*, and may be taken over or removed, when its process is gone (same host, judged by
pid and process start time, so a reused pid does not count) or when it was not renewed for ``TTL`` seconds
(any host; a live process renews every ``TTL / 4`` seconds from a background thread). Takeover is a
compare-and-swap (``flock`` locally, ``If-Match`` on S3, ``ifGenerationMatch`` on GCS); a holder whose renewal
fails has lost its lease, and its next save / commit raises instead of writing.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from typing import Iterable, List, Optional, Tuple

from ..util.errors import CheckpointError
from ..format.layout import GC_EPOCH, GC_LEASE, INFLIGHT, WRITER_LEASE, inflight_path, parse_inflight_name

log = logging.getLogger("ckptstore")

#: seconds without renewal after which a lease or marker of another host (or a stopped process) is stale
TTL = float(os.environ.get("CKPTSTORE_LEASE_TTL", "120"))
#: seconds a save waits for a gc / repack in progress before it gives up
WRITER_WAIT = float(os.environ.get("CKPTSTORE_WRITER_WAIT", "600"))
#: seconds a second writer waits for the writer lease before it is refused
LEASE_WAIT = float(os.environ.get("CKPTSTORE_LEASE_WAIT", "0"))
POLL = 0.05


def _read_first_line(path: str) -> str:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return ""


def _host_id() -> str:
    """Hostname + boot id + pid namespace: two processes compare pids only when this is equal."""
    try:
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pidns = ""
    return f"{socket.gethostname()}/{_read_first_line('/proc/sys/kernel/random/boot_id')}/{pidns}"


HOST = _host_id()
BOOT_ID = _read_first_line("/proc/sys/kernel/random/boot_id")
MACHINE_ID = _read_first_line("/etc/machine-id")


def pid_start(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (clock ticks since boot), or ``None`` if there is no such process."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            stat = f.read()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError, ValueError):
        if not os.path.isdir("/proc/self"):          # no procfs: only say whether the pid exists
            try:
                os.kill(int(pid), 0)
                return "?"
            except ProcessLookupError:
                return None
            except (PermissionError, ValueError):
                return "?"
        return None


_ME = pid_start(os.getpid())


def holder(kind: str, **extra) -> dict:
    now = time.time()
    return {"token": uuid.uuid4().hex, "kind": kind, "host": HOST, "hostname": socket.gethostname(),
            "machine_id": MACHINE_ID, "boot_id": BOOT_ID, "pid": os.getpid(), "pid_start": pid_start(os.getpid()), "started": now, "renewed": now, **extra}


def decode(data: Optional[bytes]) -> Optional[dict]:
    try:
        info = json.loads(data.decode())
        return info if isinstance(info, dict) and isinstance(info.get("token"), str) else None
    except (AttributeError, ValueError, UnicodeDecodeError):
        return None


def is_stale(info: Optional[dict], mtime: Optional[float], ttl: Optional[float] = None,
             now: Optional[float] = None) -> bool:
    """Whether a lease / marker may be taken over: garbled, its process gone (same host), or not renewed
    for ``ttl`` seconds (by the store's clock when it has one, else by the holder's own record)."""
    if info is None:
        return True
    ttl = TTL if ttl is None else ttl
    now = time.time() if now is None else now
    if info.get("host") == HOST:
        start = pid_start(info.get("pid", -1)) if isinstance(info.get("pid"), int) else None
        if start is None or (start != "?" and start != info.get("pid_start")):
            return True
    elif _earlier_boot_of_this_machine(info):
        return True                 # the machine rebooted since: every process of that boot is gone
    last = mtime if mtime is not None else info.get("renewed")
    if not isinstance(last, (int, float)):
        return True
    return now - last > ttl


def _earlier_boot_of_this_machine(info: dict) -> bool:
    """Whether the holder ran on this machine (same hostname and ``/etc/machine-id``, which survives reboots
    and differs between machines) in an earlier boot (another boot id). Holders written without these fields,
    or a machine without a machine id, never match: they wait for the TTL as before."""
    return (bool(MACHINE_ID) and bool(BOOT_ID) and info.get("hostname") == socket.gethostname()
            and info.get("machine_id") == MACHINE_ID and isinstance(info.get("boot_id"), str)
            and bool(info["boot_id"]) and info["boot_id"] != BOOT_ID)


def describe(info: Optional[dict]) -> str:
    if not info:
        return "an unreadable lease"
    started = info.get("started")
    when = (datetime.datetime.fromtimestamp(started, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
            if isinstance(started, (int, float)) else "?")
    me = " (this process)" if info.get("host") == HOST and info.get("pid") == os.getpid() else ""
    extra = "".join(f" {k} {info[k]}" for k in ("step", "rank", "job") if info.get(k) is not None)
    return (f"{info.get('kind', '?')} of host {info.get('hostname', '?')} pid {info.get('pid', '?')}{me}, "
            f"started {when}{extra}")


# -- heartbeat ---------------------------------------------------------------------------------------------
class _Heartbeat:
    """One daemon thread per process renewing every live lease and marker every ``TTL / 4`` seconds."""

    def __init__(self):
        self._items = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread = None
        self._wake = threading.Event()

    def add(self, item) -> None:
        with self._lock:
            self._items.add(item)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ckptstore-lease", daemon=True)
                self._thread.start()

    def remove(self, item) -> None:
        with self._lock:
            self._items.discard(item)

    def _run(self) -> None:
        while True:
            self._wake.wait(max(0.05, TTL / 4))
            self._wake.clear()
            with self._lock:
                items = list(self._items)
            for it in items:
                try:
                    it.renew()
                except Exception as e:      # a transient storage error: the next beat tries again
                    log.warning("could not renew %s: %s: %s", it, type(e).__name__, e)


HEARTBEAT = _Heartbeat()


class _Held:
    """A lease object at ``path`` that this process holds (exclusive: writer or gc lease) or a marker."""

    def __init__(self, storage, path: str, info: dict):
        self.storage, self.path, self.info = storage, path, info
        self._version = None
        self.lost = False
        self.released = False
        self._lock = threading.Lock()

    def _body(self) -> bytes:
        return (json.dumps(self.info, sort_keys=True) + "\n").encode()

    def _read(self) -> Tuple[Optional[dict], object]:
        data, version = self.storage.read_versioned(self.path)
        return (decode(data) if data is not None else None), version

    def renew(self) -> None:
        """Rewrite the object with a fresh ``renewed`` time, only if it is still ours (compare-and-swap)."""
        with self._lock:
            if self.lost or self.released:
                return
            info, version = self._read()
            if info is None or info.get("token") != self.info["token"]:
                self._lose("it was taken over or removed")
                return
            self.info["renewed"] = time.time()
            if not self.storage.write_if_match(self.path, self._body(), version):
                self._lose("it changed under us")

    def _lose(self, why: str) -> None:
        self.lost = True
        HEARTBEAT.remove(self)
        log.error("%s: lost %s (%s): this process was not heard from for %.0f s", self.storage.url,
                  self.path, why, TTL)

    def check(self) -> None:
        """Raise if this lease / marker was lost (taken over as stale): what it protected is no longer safe."""
        if self.lost:
            raise CheckpointError(f"{self.storage.url}: lost {self.path} ({describe(self.info)}): another "
                                  f"process judged it stale (not renewed for {TTL:.0f} s) and may have "
                                  f"changed the store; refusing to commit")

    def still_ours(self) -> bool:
        info, _ = self._read()
        ok = info is not None and info.get("token") == self.info["token"]
        if not ok and not self.lost:
            self._lose("it is no longer in the store")
        return ok

    def release(self) -> None:
        with self._lock:
            if self.released:
                return
            self.released = True
            HEARTBEAT.remove(self)
            if self.lost:
                return
            try:
                info, _ = self._read()
                if info is not None and info.get("token") == self.info["token"]:
                    self.storage.delete(self.path)
            except Exception as e:      # stale after TTL: the next holder takes it over
                log.warning("could not release %s of %s: %s", self.path, self.storage.url, e)

    def __repr__(self) -> str:
        return f"{self.path} of {self.storage.url}"


def _try_take(storage, path: str, info: dict, ttl: Optional[float] = None):
    """Create the exclusive object at ``path`` or take it over if stale. Returns ``(held, None)`` or
    ``(None, holder info)`` when a live holder has it."""
    held = _Held(storage, path, info)
    data, version = storage.read_versioned(path)
    if data is not None:
        current = decode(data)
        if not is_stale(current, storage.mtime(path), ttl):
            return None, current
        log.warning("%s: taking over the stale %s (%s)", storage.url, path, describe(current))
    wrote = (storage.write_new(path, held._body()) if data is None else
             storage.write_if_match(path, held._body(), version))
    if not wrote:
        data, _ = storage.read_versioned(path)
        return None, decode(data) if data is not None else None
    if not held.still_ours():                 # a backend without real conditional writes lost a race
        data, _ = storage.read_versioned(path)
        return None, decode(data) if data is not None else None
    return held, None


def acquire_writer(storage, *, wait: Optional[float] = None, **extra) -> _Held:
    """Take the writer lease of ``storage``'s root (waiting up to ``wait`` seconds for a live holder).

    Raises ``CheckpointError`` naming the holder when another live job holds it."""
    wait = LEASE_WAIT if wait is None else wait
    deadline = time.monotonic() + wait
    info = holder("writer", **extra)
    while True:
        held, other = _try_take(storage, WRITER_LEASE, info)
        if held is not None:
            HEARTBEAT.add(held)
            return held
        if time.monotonic() >= deadline:
            raise CheckpointError(
                f"{storage.url} already has a writer: {describe(other)}. Two jobs must not save into one "
                f"store; if that process is gone, its lease is taken over once it is stale (at once on the same "
                f"host, else after {TTL:.0f} s without renewal)")
        time.sleep(POLL)


# -- in-flight markers and the gc lease --------------------------------------------------------------------
def read_epoch(storage) -> Optional[bytes]:
    try:
        return storage.read_bytes(GC_EPOCH)
    except FileNotFoundError:
        return None


def gc_holder(storage) -> Optional[dict]:
    """The live gc lease's holder, or ``None`` (none, or a stale one)."""
    data, _ = storage.read_versioned(GC_LEASE)
    if data is None:
        return None
    info = decode(data)
    return None if is_stale(info, storage.mtime(GC_LEASE)) else info


class GCBusy(CheckpointError):
    """A gc / repack held the store for longer than a writer was willing to wait."""


class WriterOp:
    """An operation that may reference objects already in the store (a save, a step copied in), registered by
    an in-flight marker from before it decides what it may reuse until it is committed (or has failed).
    ``begin`` waits while a gc / repack holds the store (withdrawing its marker meanwhile), then raises
    :class:`GCBusy`. ``end`` may be called from another thread while ``begin`` still runs (an attempt given up
    as stalled): the marker is then removed as soon as ``begin`` has written it."""

    def __init__(self, storage, kind: str = "save", wait: Optional[float] = None, **extra):
        self.storage, self.kind, self.extra = storage, kind, extra
        self.wait = WRITER_WAIT if wait is None else wait
        self.marker: Optional[_Held] = None
        self._ended = False
        self._lock = threading.Lock()

    @property
    def token(self) -> Optional[str]:
        return self.marker.info["token"] if self.marker is not None else None

    def begin(self) -> "WriterOp":
        deadline = time.monotonic() + self.wait
        announced = False
        while True:
            info = holder(self.kind, **self.extra)
            path = inflight_path(info["token"])
            marker = _Held(self.storage, path, info)
            # create-only under a fresh name; not fsynced: after a power loss the marker's process is gone too
            self.storage.write_new(path, marker._body())
            gc = gc_holder(self.storage)
            if gc is None:
                with self._lock:
                    if not self._ended:
                        self.marker = marker
                        HEARTBEAT.add(marker)
                        return self
                marker.release()
                raise CheckpointError(f"{self.storage.url}: {self.kind} abandoned before it began")
            marker.release()                            # withdraw, so the deleter can go on
            if not announced:
                log.info("%s: waiting for %s before saving", self.storage.url, describe(gc))
                announced = True
            while gc_holder(self.storage) is not None:
                if time.monotonic() >= deadline:
                    raise GCBusy(f"{self.storage.url}: {describe(gc)} has held the store for more than "
                                 f"{self.wait:.0f} s; not writing")
                time.sleep(POLL)

    def check(self) -> None:
        """Before a commit: our marker must still be ours (not removed by a deleter as stale)."""
        if self.marker is not None:
            self.marker.check()
            if not self.marker.still_ours():
                self.marker.check()

    def end(self) -> None:
        with self._lock:
            self._ended = True
            marker, self.marker = self.marker, None
        if marker is not None:
            marker.release()


def live_markers(storage, exclude: Iterable[str] = (), remove_stale: bool = True) -> List[dict]:
    """Holders of the live in-flight markers other than ``exclude`` (tokens); stale ones are removed."""
    out = []
    exclude = set(exclude)
    for name in storage.listdir(INFLIGHT):
        token = parse_inflight_name(name)
        if token is None or token in exclude:
            continue
        path = f"{INFLIGHT}/{name}"
        try:
            data = storage.read_bytes(path)
        except FileNotFoundError:
            continue
        info = decode(data)
        if is_stale(info, storage.mtime(path)):
            if remove_stale:
                log.warning("%s: removing the stale in-flight marker %s (%s)", storage.url, name, describe(info))
                storage.delete(path)
            continue
        out.append(info)
    return out


class Deleter:
    """Context manager every deleter runs under: takes the gc lease, then waits (up to ``wait`` seconds) until
    no live in-flight marker other than ``exclude`` remains. ``clear`` says whether it may delete; if not,
    ``busy`` names who is in the way (another gc, or saves in flight). Set ``deleted`` when something was
    removed: leaving then changes the gc epoch."""

    def __init__(self, storage, *, wait: float = 600.0, exclude: Iterable[str] = ()):
        self.storage, self.wait, self.exclude = storage, wait, set(t for t in exclude if t)
        self.lease: Optional[_Held] = None
        self.clear = False
        self.busy: List[str] = []
        self.deleted = False

    def __enter__(self) -> "Deleter":
        deadline = time.monotonic() + self.wait
        info = holder("gc")
        while True:
            held, other = _try_take(self.storage, GC_LEASE, info)
            if held is not None:
                break
            if time.monotonic() >= deadline:
                self.busy = [describe(other)]
                return self
            time.sleep(POLL)
        self.lease = held
        HEARTBEAT.add(held)
        while True:
            live = live_markers(self.storage, self.exclude)
            if not live:
                self.clear = True
                return self
            if time.monotonic() >= deadline:
                self.busy = [describe(i) for i in live]
                return self
            time.sleep(POLL)

    def check(self) -> None:
        """Between deletions: the gc lease must still be ours."""
        if self.lease is not None:
            self.lease.check()

    def __exit__(self, *exc) -> None:
        try:
            if self.deleted:
                self.storage.write_atomic(GC_EPOCH, (uuid.uuid4().hex + "\n").encode())
        finally:
            if self.lease is not None:
                self.lease.release()
