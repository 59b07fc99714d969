"""The memory tier's options and its capacity rule.

:class:`Memory` (``Store(memory=Memory(...))``) puts a RAM-backed root (tmpfs, e.g. ``/dev/shm/<job>``, one per
node) in front of the local disk and the remote: saves go to memory at their own cadence, every ``disk_every``-th
memory step is promoted to the disk root (and from there uploaded, every ``Remote.every``-th step), and each
node's part of a memory step is replicated to peers on other nodes before the step counts as committed in
memory (see :mod:`ckptstore.memtier.replication`, :mod:`ckptstore.memtier.tiering` and FORMAT.md "The memory tier").
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from dataclasses import dataclass
from typing import Iterable, List, Optional, Set, Tuple

from ..lifecycle.gc import GCReport, referenced, sweep_objects
from ..format.blobs import CODECS
from ..format.layout import GC_EPOCH, blob_path, pack_path, parse_manifest_name, step_dir
from ..format.manifest import decode_manifest
from ..orchestration.options import _count


@dataclass(frozen=True)
class Memory:
    """The memory tier (``Store(root, memory=Memory("/dev/shm/run", ...))``). Sizes in bytes, times in seconds.

    ``root``: a local directory on a RAM-backed filesystem (tmpfs), node-local: every rank of a node passes the
    same one, nodes pass different ones (or the same path on different hosts). Created if missing.
    ``every``: save to memory every ``every`` steps (``save`` of another step does nothing and returns ``None``).
    ``disk_every``: promote every step that is a multiple of it to the disk root (``Store``'s ``root``), in the
    background, in commit order, copying the memory step's chunks without hashing them again; a multiple of
    ``every``. ``None``: nothing reaches the disk (nor the remote, which uploads disk steps).
    ``capacity``: bound on the bytes the memory root holds (files of its steps, chunks, packs): after each
    memory commit the oldest memory steps are dropped until it fits, never the newest committed one nor one
    still waiting for promotion. ``None``: no bound beyond ``keep``.
    ``keep``: at most this many committed memory steps (the newest; default 2).
    ``replicas``: peers (on other nodes) holding each node's part of a memory step (default 1; 0: none, a node
    loss then falls back to disk / remote). A memory step is committed once every rank's part is durable in its
    own node's memory root and in ``replicas`` peers'.
    ``node_size``: ranks per node (node = rank // node_size); default the ``LOCAL_WORLD_SIZE`` environment
    variable (set by torchrun), else the world size (one node).
    ``timeout``: seconds a replication or rebuild exchange waits for a peer before failing (the step is then not
    committed in memory; a rebuild then falls back to the next tier).
    """
    root: str
    every: int = 1
    disk_every: Optional[int] = None
    capacity: Optional[int] = None
    keep: int = 2
    replicas: int = 1
    node_size: Optional[int] = None
    timeout: float = 60.0

    def __post_init__(self):
        if not isinstance(self.root, (str, os.PathLike)) or not os.fspath(self.root):
            raise ValueError(f"Memory.root must be a local directory, got {self.root!r}")
        if "://" in os.fspath(self.root) and not os.fspath(self.root).startswith("file://"):
            raise ValueError(f"Memory.root must be a local (RAM-backed) directory, not {self.root!r}")
        _count("Memory", "every", self.every, 1)
        if self.disk_every is not None:
            _count("Memory", "disk_every", self.disk_every, 1)
            if self.disk_every % self.every:
                raise ValueError(f"Memory.disk_every ({self.disk_every}) must be a multiple of Memory.every "
                                 f"({self.every}): a disk step is promoted from a memory step")
        if self.capacity is not None:
            _count("Memory", "capacity", self.capacity, 1)
        _count("Memory", "keep", self.keep, 1)
        _count("Memory", "replicas", self.replicas, 0)
        if self.node_size is not None:
            _count("Memory", "node_size", self.node_size, 1)
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"Memory.timeout must be > 0 seconds, got {self.timeout!r}")

    def due(self, step: int) -> bool:
        """Whether ``step`` is saved to memory (a disk step always is)."""
        return step % self.every == 0 or self.promoted(step)

    def promoted(self, step: int) -> bool:
        """Whether ``step`` is promoted to disk."""
        return self.disk_every is not None and step % self.disk_every == 0

    def ranks_per_node(self, world_size: int) -> int:
        """``node_size``, else ``LOCAL_WORLD_SIZE``, else ``world_size``; raises ``ValueError`` unless it divides
        ``world_size``."""
        n = self.node_size if self.node_size is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if n < 1 or world_size % n:
            raise ValueError(f"Memory: {n} ranks per node does not divide world_size={world_size}")
        return n


def check_memory_option(memory, read_only: bool) -> None:
    """``Store(memory=)`` checked before anything is opened: ``None`` or a :class:`Memory` (else ``TypeError``),
    and not with ``read_only`` (``ValueError``: the memory tier is for a store that saves)."""
    if memory is not None and not isinstance(memory, Memory):
        raise TypeError(f"memory must be a ckptstore.Memory, got {type(memory).__name__}")
    if memory is not None and read_only:
        raise ValueError("memory= is for a store that saves: not with read_only=True")


def root_usage(path: str) -> int:
    """Bytes of the regular files under ``path`` (not following links)."""
    total = 0
    stack = [path]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    elif e.is_file(follow_symlinks=False):
                        try:
                            total += e.stat(follow_symlinks=False).st_size
                        except FileNotFoundError:
                            pass
        except (FileNotFoundError, NotADirectoryError):
            continue
    return total


def over_keep(committed: List[int], keep: int, protected: Iterable[int]) -> List[int]:
    """The committed memory steps (ascending) that ``keep`` drops: all but the newest ``keep``, sparing
    ``protected`` (steps waiting for promotion) and always the newest."""
    spare = set(protected) | set(committed[-keep:])
    return [s for s in committed if s not in spare]


def next_to_drop(committed: List[int], protected: Iterable[int]) -> Optional[int]:
    """The oldest committed memory step capacity may drop (never the newest, never a protected one)."""
    spare = set(protected) | set(committed[-1:])
    for s in committed:
        if s not in spare:
            return s
    return None



class NodeLock:
    """The memory root's lock between the ranks of a node (``flock`` on ``locks/memory.lock``; every
    acquisition opens its own descriptor, so threads of one process exclude each other too). Saves hold it
    *shared* while they decide what to reuse and write (chunks, packs, manifest, the peers' replicas); the
    memory sweep holds it *exclusive*. So a sweep never runs while a rank of the node has chosen to reuse an
    object it has not yet named in a durable manifest, and it waits only for the ranks' write phases, never
    for their commits (which may wait for the sweeping rank: the gc lease of the disk root would deadlock
    there, see :func:`sweep`)."""

    def __init__(self, root: str):
        self.path = os.path.join(root, "locks", "memory.lock")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)

    @contextlib.contextmanager
    def _held(self, how: int):
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, how)
            yield
        finally:
            os.close(fd)                       # releases the lock

    def shared(self):
        return self._held(fcntl.LOCK_SH)

    def exclusive(self):
        return self._held(fcntl.LOCK_EX)


#: a targeted sweep (the dropped steps' chunks only) is replaced by a full one (every file listed) at least this often
FULL_SWEEP_EVERY = 16


def dropped_chunks(catalog, steps: Iterable[int]) -> Optional[Tuple[Set[str], Set[str]]]:
    """``(blob ids, pack ids)`` the committed ``steps`` of this root reference, read before they are dropped:
    the candidates of a targeted :func:`sweep`. ``None`` when one cannot be read (sweep every file then)."""
    report = GCReport()
    out = referenced(catalog, list(steps), report)
    return None if report.unreadable_steps else out


def sweep(storage, catalog, lock: NodeLock, candidates: Optional[Tuple[Set[str], Set[str]]] = None) -> int:
    """Delete the blobs and packs of the memory root that no step references, under ``lock`` held
    exclusive: every committed step's manifests, and those of the steps in flight (directories newer than the
    newest committed step: with the lock held, their manifests are whole) count; uncommitted directories older
    than the newest committed step (a step whose replication or commit failed) go. No grace period, gc lease or
    temp-file rule of :func:`ckptstore.lifecycle.gc.collect` applies: the lock alone keeps every write phase out.

    ``candidates`` ``(blob ids, pack ids)`` (:func:`dropped_chunks` of the steps just dropped): only those are
    looked at, by name, instead of listing every file of the root (what made the sweep after every memory save
    cost 2-10 ms of CPU). The rule is the same, so a targeted sweep deletes a subset of what a full one would;
    what it leaves (chunks of a save that failed or of a killed process) waits for a full sweep, which runs when
    an uncommitted step directory is removed and when the caller asks for one (``Tiering``: its first sweep and
    every :data:`FULL_SWEEP_EVERY`-th). Returns bytes freed."""
    removed = False
    with lock.exclusive():
        committed = catalog.committed_steps()
        newest = committed[-1] if committed else -1
        live: Set[str] = set()
        packs: Set[str] = set()
        for step in catalog.step_dirs():
            if step in committed:
                continue
            if step < newest:
                storage.rmtree(step_dir(step))
                removed = True
                continue
            for name in storage.listdir(step_dir(step)):           # a step in flight
                parsed = parse_manifest_name(name)
                if parsed is None:
                    continue
                m = decode_manifest(storage.read_bytes(f"{step_dir(step)}/{name}"), step=step, rank=parsed[0],
                                    what=name)
                live |= m.blob_ids()
                packs |= m.pack_ids()
        report = GCReport()
        more_live, more_packs = referenced(catalog, committed, report)
        if report.unreadable_steps:
            return 0                                   # cannot tell what they reference: sweep nothing
        live |= more_live
        packs |= more_packs
        if candidates is None or removed:
            sweep_objects(storage, report, live, packs, storage.delete)
        else:
            _sweep_named(storage, report, candidates[0] - live, candidates[1] - packs)
        if removed or report.blobs_deleted or report.packs_deleted:
            # savers drop what they believed present (checked in their write phase)
            storage.write_atomic(GC_EPOCH, (uuid.uuid4().hex + "\n").encode())
    return report.bytes_freed


def _sweep_named(storage, report: GCReport, blobs: Set[str], packs: Set[str]) -> None:
    """Delete the blobs ``blobs`` (stored raw or zstd) and the packs ``packs`` by their paths, counting what was
    there into ``report``; a symbolic link is never deleted."""
    for paths, what in (([blob_path(b, c) for b in sorted(blobs) for c in CODECS], "blobs_deleted"),
                        ([pack_path(x) for x in sorted(packs)], "packs_deleted")):
        for path in paths:
            size = storage.size(path)
            if size is None or storage.is_link(path):
                continue
            report.bytes_freed += size
            setattr(report, what, getattr(report, what) + 1)
            storage.delete(path)
