"""Saving: ``state`` -> snapshot -> chunks, blobs and packs -> manifest -> commit marker -> latest pointer, then
the hand-off to retention and to the uploader.

:class:`Saver` runs one save at a time for its store (the non-blocking one on a background thread). It decides
*how* bytes move (snapshot, :func:`~ckptstore.io.writer.write_arrays`, the commit protocol of
:mod:`ckptstore.distributed.commit`); *what* a step holds comes from :mod:`ckptstore.state.flatten`; what happens
after a commit (retention, the sweep) is the ``retain`` callable it is given
(:meth:`ckptstore.orchestration.maintenance.Maintenance.after_commit`), and uploads are the uploader's.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from ..util.version import __version__
from ..distributed.commit import commit_across_ranks, root_identity
from ..util.errors import CheckpointError, CorruptCheckpointError
from ..format.layout import blob_path, check_step, manifest_path, pack_path
from ..lifecycle.lease import WriterOp, read_epoch
from ..format.manifest import ArrayEntry, Commit, Manifest, ManifestNode, check_names, encode_commit_files
from ..format.mtable import rows_here
from .parts import Parts, quiet
from ..format.pointers import point_away_from, point_to_if_newest
from ..lifecycle.rewind import drop_local_after, must_truncate
from ..state.runconfig import normalize
from ..io.snapshot import ArraySpec, direct_view, spec_of
from ..state.flatten import Node, flatten, gc_paused
from ..remote.upload import Uploader
from ..io.writer import write_arrays

log = logging.getLogger("ckptstore")


class SaveHandle:
    """A non-blocking save in flight. ``result(timeout=None)`` -> :class:`SaveResult` (raises the save's error);
    ``done()``; ``step``; ``stall_seconds`` (how long ``save`` blocked the caller)."""

    def __init__(self, step: int, future, stall_seconds: float):
        self.step, self._future, self.stall_seconds = step, future, stall_seconds
        self._reported = False

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: Optional[float] = None) -> Optional["SaveResult"]:
        """The save's result. Raises its error the first time it is asked for (by this method, or by the
        store's next ``save`` / ``wait`` / ``close``); afterwards returns ``None``."""
        try:
            return self._future.result(timeout)
        except BaseException:
            if not self._future.done():            # a timeout, not the save's own error
                raise
            if self._reported:
                return None
            self._reported = True
            raise

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, done={self.done()})"


@dataclass
class SaveResult:
    """What one ``save`` did. Sizes in bytes, times in seconds.

    ``bytes_total``: logical bytes of all tensors and arrays of this rank. ``bytes_written``: bytes of new
    blobs and packs actually written (after dedup and compression). ``blobs_total`` / ``blobs_new``: chunks
    referenced / chunks that were not in the store yet. ``objects_new``: files created (blobs + packs).
    ``bytes_unchanged``: bytes of tensors proven unchanged since the last save (neither copied nor hashed).
    ``seconds``: wall time of the whole save. ``stall_seconds``: time the caller was blocked (equal to
    ``seconds`` for a blocking save). ``phases``: seconds per phase.
    """
    step: int
    bytes_total: int
    bytes_written: int
    blobs_total: int
    blobs_new: int
    seconds: float
    stall_seconds: float = 0.0
    bytes_unchanged: int = 0
    phases: Dict[str, float] = field(default_factory=dict)
    committed: bool = True
    objects_new: int = 0


class Saver:
    """Saves of one store (see :meth:`ckptstore.store.Store.save` for the contract). ``retain(step, since,
    exclude)``: called after each commit this rank wrote (retention, then a sweep that spares the in-flight
    marker ``exclude``); returns whether the sweep ran, so the saver knows the gc epoch it caused."""

    def __init__(self, parts: Parts, *, on_rewind: str, retain: Callable[[int, float, Optional[str]], bool],
                 before_commit: Optional[Callable[[int, int, Manifest], None]] = None,
                 write_lock: Callable[[], Any] = contextlib.nullcontext):
        self.p = parts
        self.on_rewind = on_rewind
        self.retain = retain
        #: called as ``before_commit(step, gen, manifest)`` once this rank's manifest is durable and before the
        #: ranks agree on the commit (the memory tier's peer replication); an exception fails the step on
        #: every rank
        self.before_commit = before_commit
        #: called as ``after_table(step, table digest)`` on every rank once a collective save is committed under
        #: a marker naming a manifest table (the memory tier: the rows of the replicas this rank took)
        self.after_table: Optional[Callable[[int, bytes], None]] = None
        #: a context manager held while a save decides what to reuse and writes (chunks, packs, manifest,
        #: ``before_commit``): the memory tier's node lock, against its sweep
        #: (:class:`ckptstore.memtier.memory.NodeLock`)
        self.write_lock = write_lock
        #: ``(step, gen, manifest)`` of the last save this saver committed (on every rank): what a promotion
        #: of that step copies
        self.last_committed: Optional[Tuple[int, int, Manifest]] = None
        self._op: Optional[WriterOp] = None         # the save in flight's in-flight marker
        self._epoch = None                          # gc epoch seen at the last save (see ckptstore.lifecycle.lease)
        self._gen = 0                               # manifest generation the save in flight writes
        self._names: Tuple[str, ...] = ()           # names the save in flight records in its commit marker
        self._renaming = False                      # it re-saves the newest step under names (not a rewind)
        self._replicated: List[str] = []            # its replicated keys (save(replicated=...))

    # -- the save ------------------------------------------------------------------------------------------
    def save(self, state: Mapping[str, Any], step: int, *, metrics: Optional[Mapping[str, Any]], blocking: bool,
             names: Iterable[str], replicated: Iterable[str]):
        p = self.p
        self.wait()        # one save in flight; surfaces an earlier failure (a collective one: on every rank)
        t0 = time.perf_counter()
        tag = p.coord.next_tag(f"save/{step}") if p.coord is not None else None
        op = None
        try:              # from here on, a failure on one rank is reported to the others (they raise too)
            if p.uploader is not None:
                p.uploader.raise_if_failed()      # an upload failure is never swallowed
            check_step(step)
            metrics = normalize(metrics or {}, "metrics")
            names = check_names(names)
            rep = self._replicated_keys(state, replicated)
            op = self._begin_write(step)               # before the index: see ckptstore.lifecycle.lease
            self._names = self._check_rewind(step, names)   # holds the writer lease: may truncate
            p.index.prepare(p.catalog, p.rank)      # before the snapshot: it decides what is unchanged
            self._replicated = rep
            own = state if not rep or p.rank == 0 else {k: v for k, v in state.items() if k not in rep}
            with gc_paused():     # the snapshot is short and allocation-heavy: no heap-wide GC pass mid-stall
                nodes, stateful, specs = self._snapshot(own, blocking)
            sharded = sorted({n.path[0] for n in nodes if n.path and n.path[0] in rep
                              and getattr(n, "shard", None) is not None})
            if sharded:
                raise ValueError(f"save(step {step}): replicated keys {sharded} hold DTensors (sharded values "
                                 "are saved by every rank: leave them out of replicated=)")
        except BaseException as e:
            self._end_write(op)
            if tag is not None:                       # the other ranks must learn it: they raise too
                self._commit(step, None, 0, {}, tag=tag, error=e)
            raise
        t_snap = time.perf_counter()
        job = functools.partial(self._write_and_commit, step, nodes, stateful, specs, metrics, t0,
                                None if blocking else t_snap - t0, p.pool if blocking else p.bg_pool, tag)
        if blocking:
            return job()
        handle = SaveHandle(step, p.bg.submit(job), stall_seconds=t_snap - t0)
        p.inflight = handle
        return handle

    def wait(self, timeout: Optional[float] = None) -> Optional[SaveResult]:
        """Wait for the non-blocking save in flight, if any; its result, or ``None``. Raises its error once."""
        handle = self.p.inflight
        if handle is None:
            return None
        try:
            return handle.result(timeout)
        finally:
            if handle.done():
                self.p.inflight = None

    def close(self) -> None:
        """End this store's writing: its in-flight marker and writer lease go (after :meth:`wait`)."""
        self._end_write(self._op)
        if self.p.writer_lease is not None:
            self.p.writer_lease.release()

    @property
    def writer_lease(self):
        """The root's writer lease once rank 0 holds it
        (:meth:`~ckptstore.orchestration.parts.Parts.hold_writer_lease`)."""
        return self.p.writer_lease

    def _replicated_keys(self, state: Mapping[str, Any], replicated: Iterable[str]) -> List[str]:
        """``save(replicated=...)`` checked against ``state``: sorted keys, or [] for a store of one rank."""
        if isinstance(replicated, (str, bytes)) or not isinstance(replicated, (list, tuple, set, frozenset)):
            raise ValueError(f"replicated must be a list of top-level keys, got {type(replicated).__name__}")
        missing = [k for k in replicated if not isinstance(k, str) or k not in state]
        if missing:
            raise ValueError(f"replicated keys {missing!r:.200} are not top-level keys of the state")
        return sorted(set(replicated)) if self.p.world_size > 1 else []

    def _snapshot(self, state, blocking: bool):
        """Flatten ``state`` and give every array a stable byte view (see :mod:`ckptstore.io.snapshot`)."""
        p = self.p
        nodes, stateful = flatten(state)
        specs, to_copy = [], []
        for node in nodes:
            if node.kind not in ("tensor", "ndarray", "npscalar"):
                continue
            spec = spec_of(node)
            specs.append(spec)
            # A DTensor's local shard is never proven unchanged by its version counter: FSDP2 updates it
            # through views whose counters it does not share (measured: a stale shard was reused).
            if node.kind == "tensor" and p.writing.track_versions and node.shard is None:
                spec.known = p.versions.lookup(spec, node.value, p.index)
            if spec.known is None:
                if blocking:
                    spec.view = direct_view(node)
                else:
                    to_copy.append((spec, node))
        if not blocking:
            p.staging.stage(to_copy, live_paths=[s.path for s in specs])
        return nodes, stateful, specs

    # -- writers, leases, rewinds ---------------------------------------------------------------------------
    def _begin_write(self, step: int) -> WriterOp:
        """Rank 0 takes the writer lease at its first save (a second job is refused, naming the holder); every
        rank registers the save as in flight (waiting while a gc holds the store); after a gc elsewhere, what
        this store believed about existing blobs and packs is dropped. See FORMAT.md, "Writers and deleters"."""
        p = self.p
        p.hold_writer_lease()
        self._end_write(self._op)
        op = self._op = WriterOp(p.storage, "save", step=step, rank=p.rank).begin()
        epoch = read_epoch(p.storage)
        if epoch != self._epoch:
            p.blobs.forget_all()
            p.index.clear()
            self._epoch = epoch
        return op

    def _end_write(self, op: Optional[WriterOp]) -> None:
        if op is not None:
            op.end()
            if self._op is op:
                self._op = None

    def _check_still_writer(self) -> None:
        """Just before a commit: the writer lease and this save's in-flight marker must still be ours."""
        if self.p.writer_lease is not None:
            self.p.writer_lease.check()
        if self._op is not None:
            self._op.check()

    def _check_rewind(self, step: int, names: Tuple[str, ...]) -> Tuple[str, ...]:
        """``save`` of a step not newer than the newest committed one: raise (``on_rewind="error"``) or drop
        the later steps first (``"truncate"``); see :mod:`ckptstore.lifecycle.rewind`. Under torch.distributed each rank
        checks its own root (and rank 0 the remote); a refusal reaches every rank as ``CommitError``. The
        newest committed step saved again with ``names`` is a re-save, not a rewind. Returns the names the new
        commit marker records: ``names`` plus those of the commit it replaces."""
        catalog = self.p.catalog
        newest = self.p.newest_committed()
        self._renaming = bool(names) and step == newest and catalog.is_committed(step)
        if self._renaming:
            try:
                return tuple(sorted(set(names) | set(catalog.read_commit(step).names)))
            except CorruptCheckpointError:
                return names
        if must_truncate(step, newest, self.on_rewind):
            self._truncate_after(step)
        return names

    def _truncate_after(self, step: int) -> None:
        """Drop every committed step newer than ``step``: the uploader is held still (waiting steps newer than
        ``step`` are dropped), then the local steps go newest first, then the remote's (rank 0; its pointer
        moved back by compare-and-swap, see FORMAT.md "Rewinding a run")."""
        p = self.p
        uploader = p.uploader
        with (uploader.paused(drop_after=step) if uploader is not None else contextlib.nullcontext()):
            with p.maint:
                for s in drop_local_after(p.catalog, step, lambda s: point_away_from(p.storage, p.catalog, s)):
                    p.metrics_cache.pop(s, None)
            if uploader is not None:
                gone = uploader.truncate_remote(step)
                for s in gone:
                    p.remote_metrics_cache.pop(s, None)
                if gone:
                    log.warning("on_rewind=truncate: dropped remote steps %s of %s", gone, p.remote_storage.url)
        p.metrics_cache.pop(step, None)
        p.remote_metrics_cache.pop(step, None)

    # -- write, then commit -------------------------------------------------------------------------------------
    def _write_and_commit(self, step, nodes, stateful, specs, metrics, t0, stall, pool, tag=None) -> SaveResult:
        t_start = time.perf_counter()
        try:
            with self.p.maint:
                return self._write_and_commit_locked(step, nodes, stateful, specs, metrics, t0, stall, t_start,
                                                     pool, tag)
        finally:
            self._end_write(self._op)

    def _write_and_commit_locked(self, step, nodes, stateful, specs, metrics, t0, stall, t_start, pool, tag):
        p, w = self.p, self.p.writing
        try:
            try:
                self._gen = self._prepare_step(step)
                # chunk references and manifest nodes: thousands of small objects, no cycles among them; a
                # collector pass here walked the whole heap (measured: 0.1 s of a 0.17 s small-state save)
                with self.write_lock(), gc_paused():
                    refs, stats = write_arrays(p.blobs, specs, chunk_size=w.chunk_size, codec=w.codec,
                                               level=w.zstd_level, executor=pool, packing=w.packing,
                                               index=p.index, buffers=p.pack_buffers, deltas=w.deltas)
                    t_blobs = time.perf_counter()
                    manifest = Manifest(step=step, rank=p.rank, world_size=p.world_size,
                                        stateful=stateful, nodes=_manifest_nodes(nodes, specs, refs),
                                        replicated=self._replicated)
                    digest = p.catalog.write_manifest(manifest, self._gen)
                    if self.before_commit is not None:
                        self.before_commit(step, self._gen, manifest)
                self._check_still_writer()
            except BaseException as e:
                if tag is not None:                   # tell the other ranks; raises CommitError from e
                    self._commit(step, None, 0, metrics, tag=tag, error=e)
                raise
            committed = self._commit(step, digest, manifest.bytes_total, metrics, tag=tag, manifest=manifest)
        except BaseException:
            p.versions.clear()
            p.index.clear()
            raise
        p.versions.record(specs, refs)
        p.index.replace((r for per_spec in refs for r in per_spec), manifest)
        self.last_committed = (step, self._gen, manifest)
        t_commit = time.perf_counter()
        self._after_commit(step, committed, t0)
        t_end = time.perf_counter()
        return SaveResult(step=step, bytes_total=stats.bytes_total, bytes_written=stats.bytes_written,
                          blobs_total=stats.blobs_total, blobs_new=stats.blobs_new,
                          objects_new=stats.objects_new, seconds=t_end - t0,
                          stall_seconds=t_end - t0 if stall is None else stall, committed=committed,
                          bytes_unchanged=stats.bytes_unchanged,
                          phases={"snapshot": t_start - t0 if stall is None else stall,
                                  "blobs": t_blobs - t_start, "commit": t_commit - t_blobs,
                                  "retention": t_end - t_commit, "hash_cpu": stats.hash_seconds,
                                  "write_io": stats.write_seconds})

    def _after_commit(self, step: int, committed: bool, t0: float) -> None:
        """After ``step`` is committed: the lowest rank of a root other than rank 0's makes that root's parts
        uploader; a rank that wrote a commit marker applies retention, then queues the step for upload (only a
        step ``Remote(every=)`` names)."""
        p = self.p
        if committed and p.uploader is None and p.upload_args is not None:
            # the lowest rank of a root other than rank 0's (node-local disks) uploads that root's parts
            p.uploader = Uploader(p.storage, p.remote_storage, parts_only=True, **p.upload_args)
        if committed:
            try:
                if self.retain(step, t0, self._op.token if self._op else None):
                    self._epoch = read_epoch(p.storage)
            except Exception as e:          # the step is committed: a failed cleanup must not fail the save
                log.error("step %d is committed; retention / gc after it failed: %s: %s", step,
                          type(e).__name__, e)
            if p.uploader is not None:
                p.uploader.enqueue(step)

    # -- promotion: a committed step of another root (the memory tier) becomes a step of this one -------------
    def promote(self, step: int, src, manifest: Manifest, *, metrics: Mapping[str, Any],
                names: Iterable[str]) -> bool:
        """Make ``step`` a committed step of this store from this rank's part of it in the store root ``src``
        (a :class:`~ckptstore.storage.Storage`; the memory tier): the blobs and packs ``manifest`` references
        are copied as stored, without hashing them again (they were hashed when the memory step was saved, and
        each replica was verified when it arrived), into this root unless it holds them already (under the
        rules of dedup by name, FORMAT.md "Write order"); then the manifest (a new generation when the step is
        committed here already), then the ranks' agreement and the commit marker as for a save, then retention
        and the upload. Collective under torch.distributed, like ``save``: every rank promotes the same steps in
        the same order. Returns whether this rank wrote a commit marker. Raises ``CommitError`` on every rank
        when any rank failed (``CorruptCheckpointError`` / ``OSError`` as its cause)."""
        p = self.p
        t0 = time.perf_counter()
        tag = p.coord.next_tag(f"promote/{step}") if p.coord is not None else None
        metrics = normalize(metrics or {}, "metrics")
        try:
            with p.maint:
                try:
                    self._begin_write(step)
                    self._names = self._check_rewind(step, check_names(names))
                    self._replicated = list(manifest.replicated)
                    self._gen = self._prepare_step(step)
                    copy_part(src, p.storage, p.blobs, manifest)
                    digest = p.catalog.write_manifest(manifest, self._gen)
                    self._check_still_writer()
                except BaseException as e:
                    if tag is not None:
                        self._commit(step, None, 0, metrics, tag=tag, error=e)
                    raise
                committed = self._commit(step, digest, manifest.bytes_total, metrics, tag=tag, manifest=manifest)
                self._after_commit(step, committed, t0)
                return committed
        finally:
            self._end_write(self._op)

    def _prepare_step(self, step: int) -> int:
        """The manifest generation this save of ``step`` writes: 0 for a new step; for a committed one, one more
        than any its commit marker names, so the old step stays intact (and loadable) until the new commit
        marker replaces the old one atomically. A failed re-save therefore costs nothing committed; its
        manifests and objects are unreferenced, and gc reclaims them."""
        catalog = self.p.catalog
        if not catalog.is_committed(step):
            return 0
        try:
            commit = catalog.read_commit(step)
            # a table's rows this root holds (every row, or a leader's rows file): no O(N) read on every rank
            gen = max(g for _, _, g in rows_here(commit.manifests).values()) + 1
        except CorruptCheckpointError:
            gen = 1                                   # a damaged marker: replaced all the same
        if self.p.rank == 0:           # routine for a re-save under another name (Lightning's last.ckpt)
            log.log(logging.INFO if self._renaming else logging.WARNING,
                    "step %d is already committed in %s: replacing it (manifest generation %d)", step,
                    self.p.root, gen)
        return gen

    def _commit(self, step: int, own_digest, bytes_total: int, metrics, *, tag=None,
                error: Optional[BaseException] = None, manifest: Optional[Manifest] = None) -> bool:
        """Make ``step`` visible. Returns whether this rank wrote a commit marker (and so applies retention to
        its root). Under ``torch.distributed`` the ranks agree first (see :mod:`ckptstore.distributed.commit`): rank 0
        commits only when every rank's part is durable, and every rank raises ``CommitError`` otherwise
        (``error``: this rank's own failure, re-raised as the cause); ``manifest`` (this rank's) gives its
        entry of the step's shard map. Without a process group, rank 0 waits for the other ranks' manifest
        files in the shared root (and writes no shard map: readers then read every manifest)."""
        p = self.p
        if tag is not None:
            return commit_across_ranks(
                p.coord, tag, step, manifest=manifest, own_digest=own_digest, bytes_total=bytes_total,
                error=error, where=root_identity(p.storage.local_path("")), timeout=p.collective_timeout,
                new_commit=lambda manifests, total: self._new_commit(step, manifests, total, metrics),
                write_marker=lambda data, table: self._write_commit_marker(step, data, table),
                write_rows=lambda digest, rows, refs: p.catalog.write_rows(step, digest, rows, refs),
                write_map=lambda gen, data: p.catalog.write_shard_map(step, gen, data), gen=self._gen,
                adopt_run_id=p.adopt_run_id, owners=p.remote_storage is not None,
                on_table=None if self.after_table is None else (lambda digest: self.after_table(step, digest)))
        if p.rank != 0:
            return False
        manifests = {0: own_digest}
        deadline = time.monotonic() + p.collective_timeout
        for r in range(1, p.world_size):
            while not p.storage.exists(manifest_path(step, r, self._gen)):
                if time.monotonic() > deadline:
                    raise CheckpointError(f"step {step}: rank {r} wrote no manifest within "
                                          f"{p.collective_timeout:.0f} s; the step is left uncommitted")
                time.sleep(0.05)
            manifests[r] = p.catalog.manifest_digest(step, r, self._gen)
        self._write_commit_marker(step, *encode_commit_files(self._new_commit(step, manifests, bytes_total, metrics)))
        return True

    def _write_commit_marker(self, step: int, data: bytes, table: Optional[bytes] = None) -> None:
        """Write the commit marker (its manifest table first, when it names one), then move the latest pointer.
        An ``OSError`` after which the marker is in place with these bytes (e.g. ENOSPC / EIO from the directory fsync after the rename) means the step IS
        committed, visible to every reader: the save must not report it as failed. The pointer is only a hint:
        a failure to move it is logged, not raised."""
        catalog = self.p.catalog
        catalog.write_table(step, table)
        try:
            catalog.write_commit_bytes(step, data)
        except OSError as e:
            if not quiet(lambda: catalog.read_commit_bytes(step)[0] == data):
                raise
            log.warning("step %d is committed, but writing its commit marker reported: %s", step, e)
        try:
            point_to_if_newest(self.p.storage, catalog, step)
        except Exception as e:
            log.warning("step %d is committed; moving the latest pointer failed (it is only a hint): %s", step, e)

    def _new_commit(self, step, manifests, bytes_total, metrics) -> Commit:
        p = self.p
        return Commit(step=step, world_size=p.world_size, manifests=manifests, created=time.time(),
                      bytes_total=bytes_total, metrics=dict(metrics), config=p.config,
                      writer=f"ckptstore {__version__}", run_id=p.run_id,
                      best=p.keep.criterion if p.keep is not None else None, names=self._names)


def copy_part(src, dst, blobs, manifest: Manifest) -> int:
    """Copy the blobs and packs ``manifest`` references from the root ``src`` to the root ``dst`` (whose
    :class:`~ckptstore.format.blobs.BlobStore` is ``blobs``) as stored, unless ``dst`` holds them already, then make
    their directory entries durable. No hashing of bytes this job wrote (see :meth:`Saver.promote`). Returns
    the bytes written. Raises ``CorruptCheckpointError`` naming an object ``src`` lacks."""
    written = 0
    dirs = set()                                   # of the packs written (the blob store keeps the blobs')
    seen = set()
    for c in manifest.chunk_refs():
        key = c.pack if c.pack is not None else c.blob_id
        if key in seen:
            continue
        seen.add(key)
        path = pack_path(c.pack) if c.pack is not None else blob_path(c.blob_id, c.codec)
        try:
            if c.pack is None:
                wrote = blobs.put_stored(c.blob_id, c.codec, c.nbytes, lambda path=path: src.read_bytes(path))
            else:
                wrote = blobs.put_pack(c.pack, lambda path=path: src.read_bytes(path))
                if wrote:
                    dirs.add(path.rsplit("/", 1)[0])
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{'pack' if c.pack else 'blob'} missing from {src.url}",
                                         step=manifest.step, blob=path) from None
        written += wrote
    blobs.sync()
    dst.sync(dirs)
    return written


def _manifest_nodes(nodes: List[Node], specs: List[ArraySpec], refs) -> List[ManifestNode]:
    out, it = [], iter(zip(specs, refs))
    for n in nodes:
        kind = n.kind
        if kind in ("tensor", "ndarray", "npscalar"):
            spec, chunks = next(it)
            payload = ArrayEntry(spec.dtype, spec.shape, chunks, spec.device, spec.requires_grad, n.shard)
            kind = "dtensor" if n.shard is not None else kind
        else:
            payload = n.value
        out.append(ManifestNode(n.path, kind, payload))
    return out
