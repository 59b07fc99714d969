"""Copy committed steps between two storages, in commit order: blobs and packs, then manifests (and the step's
shard map), then the commit marker.

The destination never shows a committed step with a missing blob or pack: the commit marker is copied only
after every object and manifest it depends on is in place. Every byte is verified on the way: blobs and packs
against their BLAKE3 id (a pack's id is the digest of the whole file, so a pack is checked as one object),
manifests against the digests in the commit marker. Packs move as whole objects (multipart from their file when
large). The latest pointer is the caller's business.
Used by the uploader (local -> remote) and by pull / resume (remote -> local).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Set, Tuple

import zstandard

from .blobs import decompress, digest_bytes, hash_stream
from .catalog import Catalog, ManifestCache
from .errors import CorruptCheckpointError, UploadError
from .layout import blob_path, commit_path, manifest_path, pack_path, shards_path
from . import lease
from .lease import WriterOp, read_epoch
from .manifest import Commit, Manifest
from .retry import RetryPolicy
from .threads import background_pool

log = logging.getLogger("ckptstore")
STREAM_THRESHOLD = 16 << 20      # blobs above this are uploaded from their file (multipart, bounded memory)
_HASH_PIECE = 8 << 20


@dataclass
class TransferStats:
    step: int
    blobs_total: int = 0
    blobs_copied: int = 0
    bytes_copied: int = 0
    seconds: float = 0.0


def _file_digest(path: str) -> Tuple[str, int]:
    with open(path, "rb", buffering=0) as f:
        h, n = hash_stream(f.read, piece=_HASH_PIECE)
    return h.hexdigest(), n


class StepCopier:
    """Copies steps from ``src`` to ``dst`` (two :class:`~ckptstore.storage.Storage`). Thread-safe.

    ``known_dst``: ``("blob", id)`` / ``("pack", id)`` keys of objects known to exist on ``dst`` (grows as
    they are copied or found), so an object is looked up at most once and never copied twice.

    ``progress``: called as ``progress(done, total)`` (bytes, cumulative for the step being copied) from the
    copying threads, once before the first object and after each object is copied or found present. A blob
    weighs its raw length, a pack the end of the last range the step reads from it (its size is not known
    before it is read); a pass redone after transient errors starts again from 0.
    """

    def __init__(self, src, dst, *, workers: int = 8, retry: Optional[RetryPolicy] = None,
                 mark_src: bool = False, progress: Optional[Callable[[int, int], None]] = None,
                 decoded: Optional[ManifestCache] = None):
        self.src, self.dst = src, dst
        self.progress = progress
        self.mark_src = mark_src         # also register the copy as in flight on src (our own root)
        self._dst_epoch = None
        self.src_catalog, self.dst_catalog = Catalog(src, decoded), Catalog(dst, decoded)
        self.retry = retry or RetryPolicy()
        self.known_dst: Set[Tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._pool = background_pool(workers, "ckptstore-xfer")
        self._disturbed = False          # a call needed a retry: the destination may have lost state
        self._calls = background_pool(4 * workers, "ckptstore-call")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._calls.shutdown(wait=False)

    def call(self, fn, what, policy: Optional[RetryPolicy] = None):
        """Run ``fn`` under the retry policy (or ``policy``, which leaves the step being copied undisturbed);
        a retry under the copier's own policy marks the step being copied as disturbed."""
        if policy is not None:
            return policy.call(fn, what, executor=self._calls)
        return self.retry.call(fn, what, executor=self._calls, on_retry=self._note_retry)

    def _note_retry(self, e: BaseException) -> None:
        self._disturbed = True

    # -- reading the source step ----------------------------------------------------------------------------
    def read_step(self, step: int, ranks=None) -> Tuple[bytes, Commit, List[Tuple[int, bytes, Manifest]]]:
        """The source step's commit marker (bytes and decoded) and manifests, verified against each other.
        ``ranks``: only these ranks' manifests (default: every rank the marker names); ``"present"``: those
        whose manifest file exists in the source (a node-local root holds only its own ranks' parts)."""
        commit_bytes, commit = self.call(lambda: self.src_catalog.read_commit_bytes(step),
                                         f"read commit of step {step}")
        if ranks == "present":
            ranks = [r for r, (_, _, g) in commit.manifests.items()
                     if self.call(lambda r=r, g=g: self.src.exists(manifest_path(step, r, g)),
                                  f"look up manifest of step {step} rank {r}")]
        manifests = []
        for rank in sorted(commit.manifests if ranks is None else set(ranks) & set(commit.manifests)):
            data, manifest = self.call(lambda r=rank: self.src_catalog.read_manifest_bytes(commit, r),
                                       f"read manifest of step {step} rank {rank}")
            manifests.append((rank, data, manifest))
        return commit_bytes, commit, manifests

    # -- blobs --------------------------------------------------------------------------------------------------
    def _dst_has(self, key, path: str) -> bool:
        if key in self.known_dst:
            return True
        present = self.call(lambda: self.dst.exists(path), f"look up {path}")
        if present:
            with self._lock:
                self.known_dst.add(key)
        return present

    def _put_verified_file(self, step: int, path: str, local: str, want_id: str, want_size: Optional[int],
                           what: str, name: str) -> int:
        """Hash the local file (it must hash to ``want_id`` and, if given, have ``want_size`` bytes), then upload
        it from the file (multipart, bounded memory). Returns its size. Raises ``CorruptCheckpointError``
        naming ``name`` when it is missing or does not match."""
        try:
            digest, size = _file_digest(local)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{what} missing", step=step, blob=name) from None
        if digest != want_id or (want_size is not None and size != want_size):
            raise CorruptCheckpointError(f"{what} content does not match its hash", step=step, blob=name)
        self.call(lambda: self.dst.put_file(path, local), f"upload {what} {want_id} ({size} bytes)")
        return size

    def _dst_pack_ok(self, pack_id: str, path: str) -> bool:
        """A pack already on a local destination (a pull into the local root) is hashed before it is trusted:
        a damaged local copy is what sends resume to the remote in the first place. Remote destinations are
        trusted by name (their copies were verified when uploaded)."""
        full = self.dst.local_path(path)
        if full is None:
            return True
        try:
            ok = _file_digest(full)[0] == pack_id
        except FileNotFoundError:
            return False
        if not ok:
            log.warning("local pack %s is damaged: replacing it with the copy from %s", pack_id, self.src.url)
        return ok

    def _copy_pack(self, step: int, pack_id: str) -> int:
        """Copy one pack if ``dst`` lacks it, verifying the whole file against its id first (one HEAD, then one
        PUT, multipart from the file when it is large). Returns bytes sent (0 if present)."""
        key = ("pack", pack_id)
        with self._lock:
            if key in self.known_dst:
                return 0
        path = pack_path(pack_id)
        if self._dst_has(key, path):
            if self._dst_pack_ok(pack_id, path):
                return 0
            with self._lock:
                self.known_dst.discard(key)
        local = self.src.local_path(path)
        size = self.src.size(path) if local is not None else None
        if local is not None and size is not None and size > STREAM_THRESHOLD:
            sent = self._put_verified_file(step, path, local, pack_id, None, "pack", path)
        else:
            try:
                payload = self.call(lambda: self.src.read_bytes(path), f"read pack {pack_id}")
            except FileNotFoundError:
                raise CorruptCheckpointError("pack missing", step=step, blob=path) from None
            if digest_bytes(payload, threads=True) != pack_id:
                raise CorruptCheckpointError("pack content does not match its hash", step=step, blob=path)
            if self.dst.exists(path):                 # damaged copy found above: replace it, atomically
                self.call(lambda: self.dst.write_atomic(path, payload), f"replace pack {pack_id}")
                wrote = True
            else:
                wrote = self.call(lambda: self.dst.write_new(path, payload), f"write pack {pack_id}")
            sent = len(payload) if wrote else 0
        with self._lock:
            self.known_dst.add(key)
        return sent

    def _copy_blob(self, step: int, blob_id: str, codec: str, nbytes: int) -> int:
        """Copy one blob if ``dst`` lacks it, verifying its bytes first. Returns bytes sent (0 if present).

        Small blobs on a destination with create-only writes are not looked up first: the write itself is
        conditional (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``), so a present blob costs one request
        and a resend of at most ``STREAM_THRESHOLD`` bytes, and an absent one (the common case) one request
        instead of two. Large blobs are looked up (one HEAD) before their bytes are sent."""
        key = ("blob", blob_id)
        with self._lock:
            if key in self.known_dst:
                return 0
        path = blob_path(blob_id, codec)
        local = self.src.local_path(path)
        streamed = local is not None and codec == "raw" and nbytes > STREAM_THRESHOLD
        if (streamed or not self.dst.conditional_writes) and self._dst_has(key, path):
            return 0
        if streamed:
            sent = self._put_verified_file(step, path, local, blob_id, nbytes, "blob", blob_id)
        else:
            try:
                payload = self.call(lambda: self.src.read_bytes(path), f"read blob {blob_id}")
            except FileNotFoundError:
                raise CorruptCheckpointError("blob missing", step=step, blob=blob_id) from None
            try:
                raw = payload if codec == "raw" else decompress(payload, nbytes)   # bounded by nbytes
            except (ValueError, zstandard.ZstdError) as e:
                raise CorruptCheckpointError(f"blob unreadable ({e})", step=step, blob=blob_id) from None
            if len(raw) != nbytes or digest_bytes(raw) != blob_id:
                raise CorruptCheckpointError("blob content does not match its hash", step=step, blob=blob_id)
            wrote = self.call(lambda: self.dst.write_new(path, payload), f"write blob {blob_id}")
            sent = len(payload) if wrote else 0
        with self._lock:
            self.known_dst.add(key)
        return sent

    def copy_step(self, step: int, *, ranks=None, marker: str = "write",
                  others_timeout: Optional[float] = None) -> TransferStats:
        """Copy one committed step. Raises ``CorruptCheckpointError`` if the source is damaged (nothing of the
        step becomes visible on ``dst``), :class:`~ckptstore.errors.UploadError` past the retry deadline.

        ``ranks``: copy only these ranks' parts (see :meth:`read_step`; default all). ``marker``: ``"write"``
        the commit marker after the parts; ``"skip"`` it (a node uploading its ranks' parts: rank 0's uploader
        commits); ``"after_all"``: write it only once every rank's manifest is on ``dst`` with the digest the
        marker names (parts copied by other nodes), waiting up to ``others_timeout`` seconds (default: the
        retry deadline) and raising ``UploadError`` naming the missing ranks after that.

        The copy is registered as in flight on ``dst`` (and on ``src`` with ``mark_src``), so a gc there waits
        for it (see :mod:`ckptstore.lease`); after a gc on ``dst`` what we knew of its objects is dropped."""
        ops = [self._begin_on_dst(step)]
        try:
            if self.mark_src:
                ops.append(WriterOp(self.src, "copy", step=step).begin())
            epoch = self.call(lambda: read_epoch(self.dst), "read gc epoch")
            if epoch != self._dst_epoch:
                with self._lock:
                    self.known_dst.clear()
                self._dst_epoch = epoch
            return self._copy_step(step, ranks, marker, others_timeout)
        finally:
            for op in ops:
                try:
                    op.end()
                except Exception as e:             # stale after its TTL: a gc removes it then
                    log.warning("could not remove the in-flight marker of step %d: %s", step, e)

    def _begin_on_dst(self, step: int) -> WriterOp:
        """Register the copy as in flight on ``dst``: each attempt under the retry policy (a stalled server
        fails by the deadline), attempts given up on are ended (a late one removes its own marker), and a gc
        on ``dst`` is waited for up to ``lease.WRITER_WAIT`` seconds."""
        attempts: List[WriterOp] = []

        def attempt() -> WriterOp:
            op = WriterOp(self.dst, "copy", wait=0.0, step=step)
            attempts.append(op)
            return op.begin()
        deadline = time.monotonic() + lease.WRITER_WAIT
        op = None
        try:
            while op is None:
                try:
                    op = self.call(attempt, f"mark step {step} in flight on {self.dst.url}")
                except lease.GCBusy:
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.2)
            return op
        finally:
            for other in attempts:
                if other is not op:
                    self._calls.submit(other.end)      # may do I/O on a stalled server: not on this thread

    def _copy_step(self, step: int, ranks=None, marker: str = "write", others_timeout=None) -> TransferStats:
        t0 = time.perf_counter()
        commit_bytes, commit, manifests = self.read_step(step, ranks)
        blobs, packs, pack_ends = {}, set(), {}
        for _, _, m in manifests:
            for c in m.chunk_refs():
                if c.pack is None:
                    blobs[c.blob_id] = c
                else:
                    packs.add(c.pack)
                    pack_ends[c.pack] = max(pack_ends.get(c.pack, 0), c.offset + c.stored)
        stats = TransferStats(step=step, blobs_total=len(blobs) + len(packs))
        for _ in range(10):
            self._disturbed = False
            self._copy_objects(step, blobs, packs, stats, pack_ends)
            self.dst.sync({blob_path(b, c.codec).rsplit("/", 1)[0] for b, c in blobs.items()} |
                          {pack_path(p).rsplit("/", 1)[0] for p in packs})
            for rank, data, _ in manifests:
                path = manifest_path(step, rank, commit.manifests[rank][2])
                self.call(lambda p=path, d=data: self.dst.write_atomic(p, d), f"write {path}")
            if commit.shards is not None and marker != "skip":     # after the manifests, before the marker
                shard_map = self.call(lambda: self.src_catalog.read_shard_map_bytes(commit),
                                      f"read shard map of step {step}")
                path = shards_path(step, commit.shards[2])
                self.call(lambda: self.dst.write_atomic(path, shard_map), f"write {path}")
            if not self._disturbed:
                if marker == "after_all":
                    self._await_other_parts(step, commit, {r for r, _, _ in manifests}, others_timeout)
                if marker != "skip":
                    self.call(lambda: self.dst.write_atomic(commit_path(step), commit_bytes),
                              f"write commit of step {step}")
                if not self._disturbed:
                    break
            # A call failed and was retried (outage, timeout): the destination may have lost or never stored
            # what we believe it holds. Forget what we know of this step's blobs and check each again; the
            # commit marker is (re)written only after a pass without errors.
            log.warning("step %d: transient errors during upload; re-checking its %d blobs on %s", step,
                        len(blobs), self.dst.url)
            self.dst.refresh()
            with self._lock:
                self.known_dst.difference_update({("blob", b) for b in blobs} | {("pack", p) for p in packs})
        else:
            raise UploadError(f"step {step}: the destination kept failing while its blobs were checked")
        stats.seconds = time.perf_counter() - t0
        return stats

    def _await_other_parts(self, step: int, commit: Commit, copied, timeout: Optional[float]) -> None:
        """Wait until ``dst`` holds the manifest of every rank not in ``copied`` (uploaded by the nodes that
        hold them), each matching the digest in the commit marker. Its blobs and packs were written before it
        (every node's upload order), so the step is then complete on ``dst``."""
        deadline = time.monotonic() + (self.retry.deadline if timeout is None else timeout)
        missing = sorted(set(commit.manifests) - set(copied))
        delay = 0.05
        while missing:
            for r in list(missing):
                digest, size, gen = commit.manifests[r]
                path = manifest_path(step, r, gen)
                try:
                    data = self.call(lambda p=path: self.dst.read_bytes(p), f"read {path}")
                except FileNotFoundError:
                    continue
                if len(data) == size and digest_bytes(data) == digest.hex():
                    missing.remove(r)
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise UploadError(f"step {step}: the parts of rank(s) {missing} did not reach {self.dst.url} "
                                  "(their node has not uploaded them): the step is not committed there")
            time.sleep(delay)
            delay = min(2.0, delay * 2)

    def _copy_objects(self, step: int, blobs, packs, stats: TransferStats,
                      pack_ends: Optional[Dict[str, int]] = None) -> None:
        weight = {("pack", p): (pack_ends or {}).get(p, 0) for p in packs}
        weight.update({("blob", b): c.nbytes for b, c in blobs.items()})
        done, total = [0], sum(weight.values())
        if self.progress is not None:
            self.progress(0, total)

        def counted(fn, key, *args):
            sent = fn(step, key[1], *args)
            if self.progress is not None:
                with self._lock:
                    done[0] += weight[key]
                    now = done[0]
                self.progress(now, total)
            return sent
        # packs first: they are the large objects, and the pool overlaps them with the many small blobs
        futures = [self._pool.submit(counted, self._copy_pack, ("pack", p)) for p in sorted(packs)]
        futures += [self._pool.submit(counted, self._copy_blob, ("blob", b), c.codec, c.nbytes)
                    for b, c in blobs.items()]
        error = None
        for f in futures:
            try:
                sent = f.result()
                if sent:
                    stats.blobs_copied += 1
                    stats.bytes_copied += sent
            except BaseException as e:
                error = error or e
        if error is not None:
            raise error

    def forget_dst(self) -> None:
        """Drop everything known about the destination (after a failure: it may have changed)."""
        self.dst.refresh()
        with self._lock:
            self.known_dst.clear()

    def remember_dst_step(self, step: int) -> None:
        """Add the blobs of a step already committed on ``dst`` to ``known_dst`` (one manifest read per rank)."""
        try:
            commit = self.dst_catalog.read_commit(step)
            for rank in commit.manifests:
                m = self.dst_catalog.read_manifest(commit, rank)
                with self._lock:
                    self.known_dst |= {("blob", b) for b in m.blob_ids()} | {("pack", p) for p in m.pack_ids()}
        except Exception as e:  # only an optimisation: a damaged remote step is simply not trusted
            log.info("not using the blobs of step %d of %s as known: %s", step, self.dst.url, e)
