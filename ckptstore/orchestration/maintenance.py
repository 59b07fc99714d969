"""Maintenance of one store: retention after each commit and each upload, ``keep_local``, :meth:`gc`,
:meth:`verify`, :meth:`delete_step` and pulling a remote step into the local root.

Every deletion goes through :func:`ckptstore.lifecycle.retention.apply` /
:meth:`ckptstore.format.catalog.Catalog.delete_step` (commit marker first) and every sweep through
:func:`ckptstore.lifecycle.gc.collect` under the gc lease; here they are only scheduled: after a commit (the saver's
``retain`` hand-off), after an upload and once the uploader has derived its work (its callbacks), at ``close``, or
when asked.

With a remote, retention after a commit spares the local steps whose upload is pending; once no upload needs
them they follow ``keep`` again: after each upload, at ``close`` (uploads done), and when a restarted writer's
uploader has derived its work (steps a killed run left). The remote's retention is applied after each upload
and, likewise, once the work is derived, so a kill between an upload and its retention is made good.
"""
from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import wait as futures_wait
from typing import Any, Dict, List, Optional, Set, Tuple

from ..lifecycle import retention as _retention
from ..remote import transfer
from ..format.blobs import stream_check
from ..format.catalog import Catalog
from ..util.errors import CheckpointError, CorruptCheckpointError
from ..lifecycle.gc import GCReport, collect
from ..format.layout import check_step, pack_path
from ..format.manifest import Commit, Manifest
from ..format.packs import ReadItem, read_chunks
from .parts import Parts
from ..format.pointers import point_away_from, point_to_if_newest
from ..io.reader import stored_sizes
from ..state.flatten import path_str
from ..remote.transfer import StepCopier, TransferStats
from .options import Remote
from ..remote.upload import Uploader, apply_remote_retention, leads_other_root

log = logging.getLogger("ckptstore")

RETENTION_WAIT = 5.0      # seconds retention's sweep waits for other ranks' saves in flight before deferring
STREAM_VERIFY_BYTES = 16 << 20   # packed chunks larger than this are hashed as streams by verify


class Maintenance:
    """Retention, gc, verify, deletion and pulls of one store (see :class:`~ckptstore.store.Store`'s methods of
    the same names for the contracts). ``pulled``: what each pull into this root did, oldest first."""

    def __init__(self, parts: Parts):
        self.p = parts
        self.pulled: List[TransferStats] = []
        self._seen_committed: Set[int] = set()   # step directories found committed (each marker HEAD-ed once)

    def upload_args(self, remote: Remote) -> Dict[str, Any]:
        """The :class:`~ckptstore.remote.upload.Uploader` arguments of this store (its knobs from ``remote``, and these
        callbacks)."""
        return dict(workers=remote.workers, retry=remote.retry, max_backlog=remote.backlog, every=remote.every,
                    codec=remote.codec,
                    on_uploaded=self.after_upload, on_derived=self.after_derive)

    def open_uploader(self) -> None:
        """Make this root's uploader, not started yet (it starts after ``resume()``, or at the first save / wait
        / close: see :meth:`~ckptstore.remote.upload.Uploader.start`), when the store uploads and writes. One
        uploader per store root: rank 0's, and a parts-only one for each other root, made by its lowest rank at
        its first commit (see :mod:`ckptstore.orchestration.saving`), or now when this root already shows it is
        such a root (a restarted job finishing uploads)."""
        p = self.p
        if p.remote is None or not p.remote.upload or p.read_only:
            return
        p.upload_args = self.upload_args(p.remote)
        if p.rank == 0:
            p.uploader = Uploader(p.storage, p.remote_storage, start=False, **p.upload_args)
            p.uploader.prefetch()                # the first save's rewind check, listed off the save's path
        elif leads_other_root(p.catalog, p.storage, p.rank):
            p.uploader = Uploader(p.storage, p.remote_storage, parts_only=True, start=False, **p.upload_args)

    def _needed_by_uploads(self) -> Optional[Set[int]]:
        """The local steps an upload still needs (waiting or being uploaded); ``None`` while the uploader's work
        is still to be derived (then every local step may be one: a restarted job's backlog). Read
        busy_deriving() before pending(): derived afterwards, the backlog is in pending()."""
        u = self.p.uploader
        if u is None:
            return set()
        if u.busy_deriving():
            return None
        return set(u.pending())

    # -- after a commit, after an upload --------------------------------------------------------------------
    def _leftovers_before(self, step: int) -> bool:
        """Whether an uncommitted step directory older than ``step`` is there (a crash leftover of this job: it
        holds the writer lease). One listing; a marker is looked for once per directory and process (a HEAD of
        every step's marker at every save made a save O(steps) in a store that keeps them all)."""
        catalog = self.p.catalog
        dirs = catalog.step_dirs()
        self._seen_committed.intersection_update(dirs)
        for s in dirs:
            if s >= step or s in self._seen_committed:
                continue
            if not catalog.is_committed(s):
                return True
            self._seen_committed.add(s)
        return False

    def after_commit(self, step: int, since: float, exclude: Optional[str]) -> bool:
        """After a commit this rank wrote: delete the steps retention drops, then sweep under the gc lease
        (waiting a little for other ranks' saves in flight, else deferring the sweep to a later save), sparing
        the in-flight marker ``exclude``. Step ``step`` is committed already: a failure here is logged, never
        raised (an exception from ``save`` means the step is not committed). Returns whether a sweep ran."""
        p = self.p
        try:
            needed = self._needed_by_uploads()
            protected = set(p.catalog.committed_steps()) if needed is None else needed
            protected.add(step)
            doomed = _retention.apply(p.catalog, p.keep, protected, cache=p.metrics_cache,
                                      before_delete=self._point_away_from)
            stale = p.world_size == 1 and self._leftovers_before(step)
            if doomed or stale:
                # Blobs written before this save began and no longer referenced can go: no save is in flight
                # (the gc lease waits for in-flight markers). Uncommitted directories of older steps are crash
                # leftovers of this job (it holds the writer lease).
                r = collect(p.storage, p.catalog, p.blobs,
                            grace_seconds=max(0.0, time.perf_counter() - since) if p.world_size == 1 else 3600.0,
                            keep_steps={step}, index=p.index, exclude=[exclude], wait=RETENTION_WAIT)
                return not r.deferred
        except Exception as e:
            log.error("step %d is committed, but retention / gc after it failed (retried after the next save): "
                      "%s: %s", step, type(e).__name__, e)
        return False

    def after_upload(self, step: int) -> None:
        """Uploader callback: apply retention to the remote (its own copy of the policy's result), then to the
        local steps no upload needs any more (``keep``, then ``keep_local``: local steps older than the newest
        uploaded one may go). Logged, never raised."""
        self._apply_remote_retention(step)
        self._retain_local(uploaded=step)

    def after_derive(self) -> None:
        """Uploader callback once it has derived its work (at start-up: a restarted writer): retention on the
        remote (a kill between an upload and its retention left more than the policy keeps), then ``keep`` on
        the local steps no upload needs (a killed run's steps it spared for their uploads)."""
        self._apply_remote_retention(None)
        self._retain_local(uploaded=None, keep_local=False)

    def close(self) -> None:
        """``Store.close``'s part: close the uploader (waits for the uploads and remote deletions; raises their
        failure), then, the uploads done, local retention once more (``keep``, then ``keep_local``) for the
        steps that waited for an upload. A no-op without an uploader."""
        uploader = self.p.uploader
        if uploader is None:
            return
        try:
            uploader.close()
        finally:
            self._retain_local(uploaded=None)

    def _retain_local(self, uploaded: Optional[int], keep_local: bool = True) -> None:
        """Delete the local steps ``keep`` drops among those no upload needs (``uploaded``: the step just
        uploaded, needed no more), then with ``keep_local=K`` the uploaded local steps beyond the newest K
        (those up to ``uploaded``, else up to the remote's newest); then sweep what they alone referenced
        (no wait: deferred while a save is in flight). Never the newest or the best step. Logged, never raised."""
        p = self.p
        limit = p.remote.keep_local if keep_local and p.remote is not None else None
        if (p.keep is None or not p.keep.deletes) and limit is None:
            return
        try:
            with p.maint:
                needed = self._needed_by_uploads()
                if needed is None:
                    return
                needed.discard(uploaded)
                doomed = _retention.apply(p.catalog, p.keep, needed, cache=p.metrics_cache,
                                          before_delete=self._point_away_from)
                if limit is not None:
                    doomed += self._drop_uploaded(limit, needed, uploaded)
                if doomed:
                    collect(p.storage, p.catalog, p.blobs, grace_seconds=0.0, index=p.index, wait=0.0)
                    log.info("local retention of %s: removed steps %s (no upload needs them)", p.root,
                             sorted(doomed))
        except Exception as e:
            log.error("local retention of %s after the uploads failed (retried after the next upload or at "
                      "close): %s: %s", p.root, type(e).__name__, e)

    def _drop_uploaded(self, keep_local: int, needed: Set[int], uploaded: Optional[int]) -> List[int]:
        """``Remote(keep_local=)``: delete the local steps up to ``uploaded`` (else the remote's newest) beyond
        the newest ``keep_local``, except ``needed``; return them."""
        p = self.p
        upto = uploaded if uploaded is not None else p.uploader.remote_newest
        local = p.catalog.committed_steps()
        if upto is None:
            return []
        newest = set(local[-keep_local:]) if keep_local > 0 else set()
        doomed = [s for s in local if s <= upto and s not in newest and s not in needed]
        for s in doomed:
            self._point_away_from(s)
            p.catalog.delete_step(s)
            p.metrics_cache.pop(s, None)
        if doomed:
            log.info("keep_local=%d: removed local steps %s (uploaded)", keep_local, doomed)
        return doomed

    def _apply_remote_retention(self, step: Optional[int]) -> None:
        """On the uploader's thread, after ``step`` is uploaded (``None``: once its work is derived): delete the
        remote steps the policy drops, then gc the remote under its gc lease (see
        :func:`ckptstore.remote.upload.apply_remote_retention`). Only the uploader that writes the remote's steps
        (rank 0's) deletes there, never a node's parts uploader. Logged, never raised: the step is uploaded."""
        p = self.p
        if p.keep is None or not p.keep.deletes or not p.writes_remote:
            return
        try:
            apply_remote_retention(p.remote_storage, p.keep, () if step is None else {step},
                                   cache=p.remote_metrics_cache, wait=RETENTION_WAIT, call=p.uploader.copier.call)
        except Exception as e:
            what = f"step {step} is uploaded" if step is not None else "the uploads are derived"
            log.error("%s, but retention on %s failed (retried after the next upload): %s: %s",
                      what, p.remote_storage.url, type(e).__name__, e)

    def _point_away_from(self, step: int) -> None:
        point_away_from(self.p.storage, self.p.catalog, step)

    # -- asked for ----------------------------------------------------------------------------------------------
    def gc(self, *, grace_seconds: float, dry_run: bool, force: bool, repack: Optional[float],
           wait_seconds: float) -> GCReport:
        p = self.p
        handle = p.inflight
        if handle is not None:
            futures_wait([handle._future])         # its error, if any, stays for wait() / the next save
        with p.maint:
            r = collect(p.storage, p.catalog, p.blobs, grace_seconds=grace_seconds, dry_run=dry_run,
                        force=force, index=p.index, repack=repack, wait=wait_seconds, buffers=p.pack_buffers)
            if r.packs_repacked:
                p.index.clear()                  # its packs were retired: learn the new locations
                p.versions.clear()
            return r

    def delete_step(self, step: int, *, remote: bool, force: bool) -> None:
        p = self.p
        check_step(step)
        inflight = p.inflight
        if inflight is not None and not inflight.done() and inflight.step == step:
            raise CheckpointError(f"step {step} is being saved: it cannot be deleted now")
        if step == p.newest_committed() and not force:
            raise CheckpointError(f"step {step} is the newest committed step of {p.root}: it is never deleted "
                                  "(save a newer one first)")
        uploader = p.uploader
        # An upload of this step in progress reads its local files, and a derivation of the uploader's work (at
        # its start) may queue it: hold the uploader still while the local copy goes (waits only then).
        busy = uploader is not None and (step in uploader.pending() or uploader.busy_deriving())
        with (uploader.paused() if busy else contextlib.nullcontext()):
            if remote and p.writes_remote:
                uploader.delete_after_uploads(step)           # drops a waiting upload of the step
                p.remote_metrics_cache.pop(step, None)
            with p.maint:
                self._point_away_from(step)
                p.catalog.delete_step(step)
        p.metrics_cache.pop(step, None)

    def pull(self, step: Optional[int]) -> int:
        p = self.p
        if p.remote_storage is None:
            raise CheckpointError("pull needs Store(..., remote=URL)")
        remote_catalog = Catalog(p.remote_storage)
        if step is None:
            steps = remote_catalog.committed_steps()
            if not steps:
                raise FileNotFoundError(f"no committed step in {p.remote_storage.url}")
            step = steps[-1]
        elif not remote_catalog.is_committed(check_step(step)):
            raise FileNotFoundError(f"step {step} is not committed in {p.remote_storage.url}")
        self.pull_step(step)
        return step

    def pull_step(self, step: int, ranks: Optional[List[int]] = None,
                  source: Optional[Tuple[bytes, Commit]] = None) -> None:
        """Copy a committed remote step (``ranks``' parts only, if given) into the local root (blobs
        verified), then mark it committed here. ``source``: its remote commit marker (bytes, decoded), when
        the caller read it already."""
        p = self.p
        copier = StepCopier(p.remote_storage, p.storage, retry=p.retry, decoded=p.decoded,
                            ranged=transfer.RANGED_PULL_THRESHOLD, pack_target=p.writing.packing.target_size,
                            codec=p.remote.codec if p.remote is not None else "raw")
        try:
            with p.maint:
                stats = copier.copy_step(step, ranks=ranks, source=source)
                point_to_if_newest(p.storage, p.catalog, step)
        finally:
            copier.close()
        log.info("pulled step %d from %s: %d objects, %d bytes written, %d bytes fetched (%d pack(s) whole, "
                 "%d by %d range(s)) in %.2f s", step, p.remote_storage.url, stats.blobs_copied,
                 stats.bytes_copied, stats.bytes_fetched, stats.packs_whole, stats.packs_ranged,
                 stats.ranges_fetched, stats.seconds)
        self.pulled.append(stats)

    # -- verify -------------------------------------------------------------------------------------------------
    def verify(self, step: Optional[int]) -> Dict[int, Optional[str]]:
        return self.verify_steps([step] if step is not None else self.p.catalog.committed_steps())

    def verify_steps(self, steps: List[int]) -> Dict[int, Optional[str]]:
        """step -> ``None`` (every chunk of every rank's part reads back whole) or what is wrong with it."""
        catalog = self.p.catalog
        out: Dict[int, Optional[str]] = {}
        for s in steps:
            try:
                commit = catalog.read_commit(s)
                if commit.shards is not None:
                    catalog.read_shard_map(commit)
                for rank in sorted(commit.manifests):
                    self._verify_manifest(catalog.read_manifest(commit, rank))
                out[s] = None
            except CheckpointError as e:
                out[s] = str(e)
        return out

    def _verify_manifest(self, manifest: Manifest, batch_bytes: int = 64 << 20) -> None:
        """Read and hash every distinct chunk of ``manifest`` in bounded memory: sizes are checked against the
        files first, at most ``batch_bytes`` of small packed chunks are held at once, and blobs and large
        chunks are hashed as streams. Read-only: nothing is quarantined. Raises ``CorruptCheckpointError`` for
        the first bad chunk."""
        p = self.p
        stored_sizes(p.blobs, manifest, manifest.nodes, executor=p.pool, quarantine=False)
        seen, futures, batch, held = set(), [], [], 0

        def flush():
            nonlocal batch, held
            for f in read_chunks(p.storage, batch, executor=p.pool, gap=p.storage.coalesce_gap):
                f.result()
            batch, held = [], 0
        for node, entry in manifest.arrays():
            for c in entry.chunks:
                if c.blob_id in seen:
                    continue
                seen.add(c.blob_id)
                key = path_str(node.path)
                if c.pack is None:
                    futures.append(p.pool.submit(p.blobs.verify, c.blob_id, c.codec, c.nbytes,
                                                 step=manifest.step, key=key, base=c.base))
                elif c.nbytes > STREAM_VERIFY_BYTES:
                    futures.append(p.pool.submit(_verify_packed_stream, p.storage, c, manifest.step, key))
                else:
                    batch.append(ReadItem(c, memoryview(bytearray(c.nbytes)), manifest.step, key))
                    held += c.nbytes
                    if held >= batch_bytes:
                        flush()
        flush()
        for f in futures:
            f.result()


def _verify_packed_stream(storage, c, step, key) -> None:
    """Hash one large packed chunk as a stream (``verify`` holds at most a few MiB per chunk)."""
    import zstandard
    try:
        ok, got = stream_check(storage, pack_path(c.pack), c.codec, nbytes=c.nbytes, blob_id=c.blob_id,
                               offset=c.offset, stored=c.stored)
    except OSError as e:
        raise CorruptCheckpointError(f"pack unreadable ({e.strerror or e})", step=step, key=key,
                                     blob=c.blob_id) from None
    except (ValueError, zstandard.ZstdError) as e:
        raise CorruptCheckpointError(f"chunk unreadable ({e}) (pack {c.pack})", step=step, key=key,
                                     blob=c.blob_id) from None
    if not ok:
        raise CorruptCheckpointError(f"chunk content does not match its hash (pack {c.pack})", step=step,
                                     key=key, blob=c.blob_id)
