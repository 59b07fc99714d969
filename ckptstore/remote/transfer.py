"""Copy committed steps between two storages, in commit order: blobs and packs, then manifests (and the step's
shard map), then the commit marker.

The destination never shows a committed step with a missing blob or pack: the commit marker is copied only
after every object and manifest it depends on is in place. Every byte is verified on the way: blobs and packs
against their BLAKE3 id (a pack's id is the digest of the whole file, so a pack is checked as one object),
manifests against the digests in the commit marker. Packs move as whole objects (multipart from their file when
large), except in a *ranged pull* (``StepCopier(ranged=...)``, remote -> local only): a pack the step
references only a small part of is read by range, its referenced chunks (each verified against its id) are
written into new local packs, and the pulled manifests and the local commit marker are rewritten to name them
(see FORMAT.md "Ranged pulls"). The latest pointer is the caller's business.
Used by the uploader (local -> remote) and by pull / resume (remote -> local).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple


from ..format.blobs import FULL_CODECS, BlobStore, digest_bytes, encode_chunk, hash_stream, read_verified
from ..format.catalog import Catalog, ManifestCache
from ..util.errors import CheckpointError, CorruptCheckpointError, DamagedRead, UploadError
from ..format.layout import MAX_GENERATION, blob_path, commit_path, manifest_path, pack_path, shards_path, step_dir
from ..lifecycle import lease
from ..lifecycle.lease import WriterOp, read_epoch
from ..format.manifest import (ChunkRef, Commit, Manifest, decode_commit, decode_manifest, encode_commit_files,
                               encode_manifest)
from ..format import mtable
from ..format.planes import float_itemsize
from ..format.packs import MAX_SPAN, PackBuffers, Packing, ReadItem, coalesce, plan_packs
from ..lifecycle.repack import copy_chunks, repoint
from ..util.retry import RetryPolicy
from ..storage.retrying import with_retries
from ..util.threads import background_pool

log = logging.getLogger("ckptstore")
STREAM_THRESHOLD = 16 << 20      # blobs above this are uploaded from their file (multipart, bounded memory)
#: the largest raw blob ``codec="auto"`` encodes on upload: it is read whole (with its frame: about twice this
#: per upload worker); larger ones are streamed raw from their file. Writing.chunk_size's default (64 MiB).
ENCODE_MAX = 64 << 20
ONE_GET_MAX = 128 << 20          # a remote pack whose size is known and at most this is read by one GET
_HASH_PIECE = 8 << 20
_ARRAYS = ("tensor", "ndarray", "npscalar", "dtensor")     # manifest node kinds whose payload has chunks
#: A pull copies a pack whole when its ranged reads (the step's distinct ranges in it, coalesced across holes
#: of up to the source's ``coalesce_gap`` as every ranged read is) would fetch at least this fraction of its
#: size; below it, the pack is read by range. 0.5: ranges fetch R < S/2 bytes of a pack of S instead of S,
#: and the next upload from the pulled root sends at most those R bytes once more (the new local pack is not
#: on the remote), so R + R < S: below one half, a ranged pull never moves more bytes than a whole pack
#: would, counting both directions, and it reads at most half of them on the restart's critical path.
RANGED_PULL_THRESHOLD = 0.5


@dataclass
class TransferStats:
    """What one step's copy did. ``bytes_copied``: bytes written to the destination; ``bytes_fetched``: bytes
    read from the source (whole objects, and the coalesced ranges of the packs read by range, holes
    included); ``packs_whole`` / ``packs_ranged``: packs fetched whole / read by range (a ranged pull);
    ``ranges_fetched``: the ranged reads (one GET each remotely) of those packs."""
    step: int
    blobs_total: int = 0
    blobs_copied: int = 0
    bytes_copied: int = 0
    seconds: float = 0.0
    bytes_fetched: int = 0
    packs_whole: int = 0
    packs_ranged: int = 0
    ranges_fetched: int = 0


def _obj_key(c: ChunkRef) -> Tuple[str, str]:
    """The ``known_dst`` key of the object a chunk reference names: ``("pack", id)``, ``("blob", id)`` for a full
    copy of a chunk, ``("delta", id)`` for a delta (no full copy: a step naming the chunk in full still needs one)."""
    if c.pack is not None:
        return "pack", c.pack
    return ("delta" if c.codec == "delta" else "blob"), c.blob_id


def _dst_keys(m: Manifest) -> Set[Tuple[str, str]]:
    return {_obj_key(c) for c in m.chunk_refs()}


def _float_blobs(manifests) -> Dict[str, int]:
    """Blob id -> element size (bytes) of every chunk stored as a blob of its own whose tensor / array has a
    floating-point dtype (:func:`~ckptstore.format.planes.float_itemsize`): those the uploader may encode with
    the ``planes`` codec, and whose copy on a tier may be under either name (``<id>`` or ``<id>.bpl``)."""
    out: Dict[str, int] = {}
    for _, _, m in manifests:
        for _, e in m.arrays():
            size = float_itemsize(e.dtype)
            if size is not None:
                out.update((c.blob_id, size) for c in e.chunks if c.pack is None and c.codec != "delta")
    return out


def _plain_shared(n, replicated, rank_local) -> bool:
    """Whether manifest node ``n`` is a plain (not sharded) value that every rank holds alike, chunk ids
    included: not under a ``replicated`` key (rank 0 alone saves those) nor a path the shard map calls
    rank-local (``rank_local`` ``None``: unknown, so no)."""
    return (rank_local is not None and n.kind != "dtensor" and bool(n.path) and n.path[0] not in replicated
            and not any(tuple(n.path[:len(q)]) == tuple(q) for q in rank_local))


class _CountedReads:
    """The source of a ranged pull as :func:`~ckptstore.format.packs.read_chunks` sees it: each ranged read runs under
    the copier's retry policy (a transient network error is retried, not reported as damage: read_chunks turns
    any ``OSError`` into ``CorruptCheckpointError``) and is counted into the step's stats."""

    def __init__(self, copier: "StepCopier", stats: TransferStats):
        self._copier, self._stats = copier, stats

    def __getattr__(self, name):
        return getattr(self._copier.src, name)

    def read_range_scatter(self, path: str, offset: int, bufs) -> int:
        n = self._copier.call(lambda: self._copier.src.read_range_scatter(path, offset, bufs),
                              f"read {path} from byte {offset}")
        self._copier._tally(self._stats, ranges_fetched=1, bytes_fetched=n)
        return n

    def read_range_into(self, path: str, offset: int, out) -> int:
        return self.read_range_scatter(path, offset, [out])


def _file_digest(path: str) -> Tuple[str, int]:
    with open(path, "rb", buffering=0) as f:
        h, n = hash_stream(f.read, piece=_HASH_PIECE)
    return h.hexdigest(), n


class StepCopier:
    """Copies steps from ``src`` to ``dst`` (two :class:`~ckptstore.storage.Storage`). Thread-safe.

    ``known_dst``: ``("blob", id)`` / ``("delta", id)`` / ``("pack", id)`` keys of objects known to exist on
    ``dst`` (a full copy of a chunk, a delta of it, a pack; grows as
    they are copied or found), so an object is looked up at most once and never copied twice.

    ``progress``: called as ``progress(done, total)`` (bytes, cumulative for the step being copied) from the
    copying threads, once before the first object and after each object is copied or found present. A blob
    weighs its raw length, a pack the end of the last range the step reads from it (its size is not known
    before it is read); a pass redone after transient errors starts again from 0.

    ``ranged``: a ranged pull (only into a destination with a local path; the uploader leaves it ``None`` and
    copies whole packs): a pack of which the step's ranged reads would fetch less than this fraction of its
    size (see ``RANGED_PULL_THRESHOLD``) is read by range and its referenced chunks are written into new local
    packs of at most ``pack_target`` bytes; the pulled manifests and the local commit marker then name them.

    ``codec``: ``"raw"`` copies every object as the source stores it; ``"auto"`` (``Remote(codec="auto")``)
    looks for a raw-recorded float blob of a remote source under ``<id>.bpl`` first (a pull), and, uploading
    to a destination without a local path, encodes each raw blob of a floating-point chunk of at
    most ``ENCODE_MAX`` bytes with :func:`~ckptstore.format.blobs.encode_chunk` after checking its raw bytes
    against its id, and writes it as ``<id>.bpl`` where that pays. Manifests and markers are copied unchanged
    either way: a blob may be stored under another codec than its manifest records (FORMAT.md "Chunks, blobs
    and packs"), so the source's copy, and the destination's, are looked for under every full codec's name, by
    id. Raises ``ValueError`` for another ``codec``.
    """

    def __init__(self, src, dst, *, workers: int = 8, retry: Optional[RetryPolicy] = None,
                 mark_src: bool = False, progress: Optional[Callable[[int, int], None]] = None,
                 decoded: Optional[ManifestCache] = None, ranged: Optional[float] = None,
                 pack_target: int = Packing().target_size, codec: str = "raw"):
        if codec not in ("raw", "auto"):
            raise ValueError(f"StepCopier codec must be 'raw' or 'auto', got {codec!r}")
        self.codec = codec if dst.local_path("") is None else "raw"
        # manifest codec -> the codec a float blob recorded under it was last found stored as on src (tried
        # first: a remote written with Remote(codec="auto") holds its raw float chunks as .bpl)
        self._src_swap: Dict[str, str] = {"raw": "planes"} if codec == "auto" else {}
        self.retry = retry or RetryPolicy()
        # a remote source's reads are retried beneath the catalog, which reads a failed read as damage
        self.src = with_retries(src, self.retry)
        self.dst = dst
        self.ranged = ranged if dst.local_path("") is not None else None
        self.pack_target = pack_target
        self._buffers = PackBuffers()
        self.progress = progress
        self.mark_src = mark_src         # also register the copy as in flight on src (our own root)
        self._dst_epoch = None
        self.src_catalog, self.dst_catalog = Catalog(self.src, decoded), Catalog(dst, decoded)
        self.known_dst: Set[Tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._pool = background_pool(workers, "ckptstore-xfer")
        self._disturbed = False          # a call needed a retry: the destination may have lost state
        self._src_sizes: Dict[str, int] = {}   # pack id -> size on src, when a ranged-pull decision looked it up
        self._calls = background_pool(4 * workers, "ckptstore-call")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._calls.shutdown(wait=False)
        self._buffers.clear()

    def _tally(self, stats: TransferStats, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(stats, name, getattr(stats, name) + n)

    def call(self, fn, what, policy: Optional[RetryPolicy] = None, fresh: bool = False):
        """Run ``fn`` under the retry policy (or ``policy``, which leaves the step being copied undisturbed);
        a retry under the copier's own policy marks the step being copied as disturbed. ``fresh``: a deadline
        of its own even during an outage (see :meth:`RetryPolicy.call <ckptstore.util.retry.RetryPolicy.call>`)."""
        if policy is not None:
            return policy.call(fn, what, executor=self._calls, fresh=fresh)
        return self.retry.call(fn, what, executor=self._calls, on_retry=self._note_retry, fresh=fresh)

    def _note_retry(self, e: BaseException) -> None:
        self._disturbed = True

    # -- reading the source step ----------------------------------------------------------------------------
    def read_step(self, step: int, ranks=None, source: Optional[Tuple[bytes, Commit]] = None
                  ) -> Tuple[bytes, Commit, List[Tuple[int, bytes, Manifest]]]:
        """The source step's commit marker (bytes and decoded; ``source`` when the caller read it already) and
        manifests, verified against each other. ``ranks``: only these ranks' manifests (default: every rank the
        marker names); ``"present"``: those whose manifest file exists in the source (a node-local root holds
        only its own ranks' parts). Explicit ``ranks`` without rank 0 get rank 0's manifest too when theirs read
        replicated keys from it (``Store.save(replicated=...)``)."""
        explicit = ranks is not None and ranks != "present"
        commit_bytes, commit = source or self.call(lambda: self.src_catalog.read_commit_bytes(step),
                                                   f"read commit of step {step}")
        if ranks == "present":          # a table's rows: every row where the root holds it, else its rows files'
            here = self.call(lambda: mtable.rows_here(commit.manifests), f"read manifest rows of step {step}")
            ranks = [r for r, (_, _, g) in here.items()
                     if self.call(lambda r=r, g=g: self.src.exists(manifest_path(step, r, g)),
                                  f"look up manifest of step {step} rank {r}")]
        manifests = []
        for rank in sorted(commit.manifests if ranks is None else set(ranks) & set(commit.manifests)):
            data, manifest = self.call(lambda r=rank: self.src_catalog.read_manifest_bytes(commit, r),
                                       f"read manifest of step {step} rank {rank}")
            manifests.append((rank, data, manifest))
        if explicit and 0 in commit.manifests and all(r != 0 for r, _, _ in manifests) \
                and any(m.replicated for _, _, m in manifests):
            data, manifest = self.call(lambda: self.src_catalog.read_manifest_bytes(commit, 0),
                                       f"read manifest of step {step} rank 0")
            manifests.insert(0, (0, data, manifest))
        return commit_bytes, commit, manifests

    # -- blobs --------------------------------------------------------------------------------------------------
    def _dst_has(self, key, *paths: str) -> bool:
        """Whether ``dst`` holds the object of ``key``, under any of ``paths`` (looked up in turn, the
        likeliest first: a blob's names under the codecs it may be stored with)."""
        if key in self.known_dst:
            return True
        for path in paths:
            if self.call(lambda p=path: self.dst.exists(p), f"look up {path}"):
                with self._lock:
                    self.known_dst.add(key)
                return True
        return False

    def _blob_names(self, codec: str, itemsize: Optional[int]) -> List[str]:
        """The codecs a full copy of a blob recorded as ``codec`` may be stored under on a tier, the likeliest
        first: a float chunk's raw / planes copy under either (an upload with ``codec="auto"`` encodes, one with
        ``"raw"`` or a pull copies what it finds); any other under ``codec`` alone."""
        if codec not in ("raw", "planes") or itemsize is None:
            return [codec]
        first = "planes" if self.codec == "auto" else codec
        return [first, "raw" if first == "planes" else "planes"]

    def _src_codec(self, blob_id: str, codec: str, itemsize: Optional[int]) -> str:
        """The codec under which a local source holds a full blob recorded as ``codec`` (its file looked up
        under the other names when absent: a pulled ``.bpl``); ``codec`` itself when none is found (the copy
        then reports the blob missing)."""
        if codec == "delta":
            return codec
        for c in dict.fromkeys([codec] + self._blob_names(codec, itemsize) + list(FULL_CODECS)):
            if self.src.exists(blob_path(blob_id, c)):
                return c
        return codec

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

    def _copy_pack(self, step: int, pack_id: str, stats: Optional[TransferStats] = None) -> int:
        """Copy one pack if ``dst`` lacks it, verifying the whole file against its id first (one HEAD, then one
        PUT, multipart from the file when it is large). Returns bytes sent (0 if present); the bytes read from
        ``src`` go to ``stats``."""
        key = ("pack", pack_id)
        with self._lock:
            if key in self.known_dst:
                return 0
        path = pack_path(pack_id)
        local = self.src.local_path(path)
        size = self.src.size(path) if local is not None else None
        # A small pack bound for a remote with create-only writes is not looked up first (as small blobs, see
        # _copy_blob): the write itself is conditional, so an absent pack (the common case: a save's packs are
        # new) costs one request instead of two, a present one a resend of at most STREAM_THRESHOLD bytes.
        blind = (size is not None and size <= STREAM_THRESHOLD and self.dst.conditional_writes
                 and self.dst.local_path("") is None)
        replace = False
        if not blind and self._dst_has(key, path):
            if self._dst_pack_ok(pack_id, path):
                return 0
            replace = True                            # a damaged local copy: replaced, atomically
            with self._lock:
                self.known_dst.discard(key)
        if local is not None and size is not None and size > STREAM_THRESHOLD:
            sent = self._put_verified_file(step, path, local, pack_id, None, "pack", path)
            fetched = sent
        else:
            known = self._src_sizes.get(pack_id) if local is None else None
            limit = known + 1 if known is not None and known <= ONE_GET_MAX else None   # one GET, no HEAD
            payload = self._read_checked(step, path, "pack", path, lambda: self.src.read_bytes(path, limit=limit),
                                         lambda b: digest_bytes(b, threads=True) == pack_id)
            fetched = len(payload)
            if replace:
                self.call(lambda: self.dst.write_atomic(path, payload), f"replace pack {pack_id}")
                wrote = True
            else:
                wrote = self.call(lambda: self.dst.write_new(path, payload), f"write pack {pack_id}")
            sent = len(payload) if wrote else 0
        if stats is not None:
            self._tally(stats, bytes_fetched=fetched, packs_whole=1)
        with self._lock:
            self.known_dst.add(key)
        return sent

    def _read_checked(self, step: int, path: str, what: str, name: str, read, intact) -> bytes:
        """``read()`` (under the retry policy), its bytes checked by ``intact(bytes)`` and judged by
        :func:`~ckptstore.format.blobs.read_verified`: bad bytes from a remote source are read again until good, the
        same twice in a row (damage: ``CorruptCheckpointError``) or the deadline is spent
        (:class:`~ckptstore.util.errors.TransferError`); from a local source they are damage at once. Raises
        ``CorruptCheckpointError`` naming ``name`` when missing or damaged."""
        def once() -> bytes:
            try:
                payload = self.call(read, f"read {what} {name}")
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{what} missing", step=step, blob=name) from None
            if not intact(payload):
                raise DamagedRead(f"{what} content does not match its hash",
                                  got=(len(payload), digest_bytes(payload, threads=True)), step=step, blob=name)
            return payload
        return read_verified(self.src, path, once)

    def _copy_blob(self, step: int, blob_id: str, codec: str, nbytes: int, base: Optional[ChunkRef] = None,
                   itemsize: Optional[int] = None, stats: Optional[TransferStats] = None) -> int:
        """Copy one blob if ``dst`` lacks it, verifying its bytes first. Returns bytes sent (0 if present).
        A delta (``base``: its key) is verified by decoding it against its key, read from ``src`` and verified
        (one more read of the key's raw length per delta copied). ``itemsize``: the element size of a
        floating-point chunk (``None`` for other dtypes): such a blob may be stored under ``<id>`` or
        ``<id>.bpl`` on either side whatever ``codec`` (the manifest's) says, and is encoded on its way with
        ``codec="auto"`` (see the class docstring).

        Small blobs on a destination with create-only writes are not looked up first: the write itself is
        conditional (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``), so a present blob costs one request
        and a resend of at most ``STREAM_THRESHOLD`` bytes, and an absent one (the common case) one request
        instead of two. Large blobs are looked up (one HEAD per name it may have) before their bytes are sent."""
        key = ("delta" if codec == "delta" else "blob", blob_id)
        with self._lock:
            if key in self.known_dst:
                return 0
        local_src = self.src.local_path("") is not None
        have = self._src_codec(blob_id, codec, itemsize) if local_src else codec
        path = blob_path(blob_id, have)
        local = self.src.local_path(path)
        streamed = local is not None and have == "raw" and nbytes > STREAM_THRESHOLD
        encode = self.codec == "auto" and itemsize is not None and codec != "delta"
        # where dst may hold it: under either name with codec="auto" or into a local root (lookups are cheap
        # there); a raw upload looks under the manifest's name alone (one HEAD, as before codecs on upload)
        raw_upload = self.codec == "raw" and self.dst.local_path("") is None
        names = [blob_path(blob_id, c) for c in ([codec] if raw_upload else self._blob_names(codec, itemsize))]
        if (streamed or not self.dst.conditional_writes) and self._dst_has(key, *names):
            return 0
        if streamed and not (encode and nbytes <= ENCODE_MAX):
            sent = fetched = self._put_verified_file(step, path, local, blob_id, nbytes, "blob", blob_id)
        else:
            have, payload = self._read_blob(step, blob_id, codec, nbytes, base, itemsize, have, local_src)
            fetched = len(payload)
            if encode and have == "raw":           # verified raw bytes: encoded after the check, never before
                have, payload = encode_chunk(memoryview(payload), "auto", 1, itemsize)
            out = blob_path(blob_id, have)
            wrote = self.call(lambda: self.dst.write_new(out, payload), f"write blob {blob_id}")
            sent = len(payload) if wrote else 0
        if stats is not None:
            self._tally(stats, bytes_fetched=fetched)
        with self._lock:
            self.known_dst.add(key)
        return sent

    def _read_blob(self, step: int, blob_id: str, codec: str, nbytes: int, base: Optional[ChunkRef],
                   itemsize: Optional[int], have: str, local_src: bool) -> Tuple[str, bytes]:
        """A blob's stored bytes read from ``src`` and checked (decoded and hashed against its id; see
        :meth:`_read_checked`), with the codec they are stored under: ``have`` from a local source (looked up
        already), else the first of its possible names found, the one a float blob recorded as ``codec`` was
        last found under tried first (one GET for each name tried; a missing blob is reported as missing)."""
        if local_src or codec == "delta":
            order = [have]
        else:
            names = self._blob_names(codec, itemsize) + [c for c in FULL_CODECS if c != codec]
            first = self._src_swap.get(codec, codec) if itemsize is not None else codec
            order = list(dict.fromkeys([first, codec] + names))
        found = [order[0]]
        check = self._intact(step, blob_id, codec, nbytes, base) if codec == "delta" else None

        def read() -> bytes:
            for i, c in enumerate(order):
                try:
                    data = self.src.read_bytes(blob_path(blob_id, c))
                except FileNotFoundError:
                    if i == len(order) - 1:
                        raise
                    continue
                found[0] = c
                return data

        def intact(b) -> bool:
            return check(b) if check is not None else BlobStore.intact(b, blob_id, found[0], nbytes)
        payload = self._read_checked(step, blob_path(blob_id, order[0]), "blob", blob_id, read, intact)
        if found[0] != codec and itemsize is not None and not local_src:
            with self._lock:
                self._src_swap[codec] = found[0]
        return found[0], payload

    def _intact(self, step: int, blob_id: str, codec: str, nbytes: int, base: Optional[ChunkRef]):
        """``check(stored bytes) -> bool`` of one blob copied: decoded and hashed (a delta against its key)."""
        if codec != "delta":
            return lambda b: BlobStore.intact(b, blob_id, codec, nbytes)
        if base is None:
            raise CorruptCheckpointError("a delta chunk names no key", step=step, blob=blob_id)
        key = bytearray(nbytes)
        BlobStore(self.src, quarantine=False).read_into(base.blob_id, base.codec, memoryview(key), step=step)
        return lambda b: BlobStore.intact(b, blob_id, codec, nbytes, key=key, key_id=base.blob_id)

    def copy_step(self, step: int, *, ranks=None, marker: str = "write",
                  others_timeout: Optional[float] = None,
                  source: Optional[Tuple[bytes, Commit]] = None, fresh: bool = False) -> TransferStats:
        """Copy one committed step. Raises ``CorruptCheckpointError`` if the source is damaged (nothing of the
        step becomes visible on ``dst``), :class:`~ckptstore.util.errors.UploadError` past the retry deadline.

        ``ranks``: copy only these ranks' parts (see :meth:`read_step`; default all). ``marker``: ``"write"``
        the commit marker after the parts; ``"skip"`` it (a node uploading its ranks' parts: rank 0's uploader
        commits); ``"after_all"``: write it only once every rank's manifest is on ``dst`` with the digest the
        marker names (parts copied by other nodes), waiting up to ``others_timeout`` seconds (default: the
        retry deadline) and raising ``UploadError`` naming the missing ranks after that. ``source``: the
        source's commit marker (bytes, decoded) when the caller has just read it (one request fewer).
        ``fresh`` (with ``"after_all"``): the caller knows ``dst`` held nothing under this step's prefix before
        this job's uploaders wrote there, so a manifest listed with the size the marker records is the one the
        marker names and is not read back (see :meth:`_await_other_parts`).

        The copy is registered as in flight on ``dst`` (and on ``src`` with ``mark_src``), so a gc there waits
        for it (see :mod:`ckptstore.lifecycle.lease`); after a gc on ``dst`` what we knew of its objects is dropped."""
        ops = [self._begin_on_dst(step)]
        try:
            if self.mark_src:
                ops.append(WriterOp(self.src, "copy", step=step).begin())
            epoch = self.call(lambda: read_epoch(self.dst), "read gc epoch")
            if epoch != self._dst_epoch:
                with self._lock:
                    self.known_dst.clear()
                self._dst_epoch = epoch
            return self._copy_step(step, ranks, marker, others_timeout, source, fresh)
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

    def _copy_step(self, step: int, ranks=None, marker: str = "write", others_timeout=None,
                   source=None, fresh: bool = False) -> TransferStats:
        t0 = time.perf_counter()
        commit_bytes, commit, manifests = self.read_step(step, ranks, source)
        blobs, packs, pack_ends = {}, set(), {}
        ranges: Dict[str, Dict[Tuple[int, int], ChunkRef]] = {}
        for _, _, m in manifests:
            for c in m.chunk_refs():                # each delta's key too (FORMAT.md "The delta codec")
                if c.pack is None:
                    if c.blob_id not in blobs or blobs[c.blob_id].codec == "delta":   # a full copy serves both
                        blobs[c.blob_id] = c
                else:
                    packs.add(c.pack)
                    pack_ends[c.pack] = max(pack_ends.get(c.pack, 0), c.offset + c.stored)
                    ranges.setdefault(c.pack, {})[(c.offset, c.stored)] = c
        if marker == "skip":                      # a node's parts: rank 0's node uploads what it shares with them
            for b in self._rank0_uploads(step, commit, manifests):
                blobs.pop(b, None)
        # one of several uploaders (node-local roots): objects another root holds too are left to the root of
        # their owner rank, and confirmed on dst (in the owner's manifest there) before our manifests go
        deferred = self._owned_elsewhere(step, commit, manifests, blobs, packs) if marker != "write" else {}
        held = {b: blobs.pop(b) for kind, b in deferred if kind != "pack"}
        packs -= {p for kind, p in deferred if kind == "pack"}
        stats = TransferStats(step=step, blobs_total=len(blobs) + len(packs))
        floats = _float_blobs(manifests)
        for _ in range(10):
            self._disturbed = False
            ranged = self._ranged_packs(packs, ranges, pack_ends) if marker == "write" else set()
            new = self._copy_objects(step, blobs, packs - ranged, stats, pack_ends, ranged, ranges, floats)
            if deferred:                          # after our own objects (owners never wait for those)
                late = self._await_owners(step, commit, deferred, others_timeout)
                deferred = {}
                if late:                          # not where the owner's manifest says: uploaded by us after all
                    late_blobs = {b: held[b] for kind, b in late if kind != "pack"}
                    late_packs = {p for kind, p in late if kind == "pack"}
                    blobs.update(late_blobs)
                    packs |= late_packs
                    stats.blobs_total += len(late)
                    self._copy_objects(step, late_blobs, late_packs, stats, pack_ends, floats=floats)
            self.dst.sync({blob_path(b, c.codec).rsplit("/", 1)[0] for b, c in blobs.items()} |
                          {pack_path(p).rsplit("/", 1)[0] for p in packs - ranged})
            writes, marker_bytes, table = self._dst_metadata(step, commit_bytes, commit, manifests, ranged, new)
            for path, data in writes:
                self.call(lambda p=path, d=data: self.dst.write_atomic(p, d), f"write {path}")
            shard_map = self._shard_map(step, commit) if marker != "skip" else None
            if shard_map is not None:                              # after the manifests, before the marker
                path = shards_path(step, commit.shards[2])
                self.call(lambda: self.dst.write_atomic(path, shard_map), f"write {path}")
            if marker != "skip" and commit.table is not None:     # likewise the manifest table, or rows
                path, data = self._table_file(step, commit, marker_bytes, table, manifests,
                                              subset=ranks is not None and ranks != "present")
                self.call(lambda: self.dst.write_atomic(path, data), f"write {path}")
            if not self._disturbed:
                if marker == "after_all":
                    self._await_other_parts(step, commit, {r for r, _, _ in manifests}, others_timeout, fresh)
                if marker != "skip":
                    self.call(lambda: self.dst.write_atomic(commit_path(step), marker_bytes),
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
                self.known_dst.difference_update({_obj_key(c) for c in blobs.values()} | {("pack", p) for p in packs})
        else:
            raise UploadError(f"step {step}: the destination kept failing while its blobs were checked")
        stats.seconds = time.perf_counter() - t0
        return stats

    def _rank0_uploads(self, step: int, commit: Commit, manifests) -> Set[str]:
        """The blobs of a node's parts that rank 0's node uploads itself, so that the two never write one object
        name at once (issue 19: data-parallel replicas of a value saved without ``replicated=`` sent each of its
        blobs once per node, all at the same time): blobs referenced here only by plain (not sharded) values
        that the step's shard map does not call rank-local. Such a value has the same signature, chunk ids
        included, on every rank (FORMAT.md "Shard map"), so rank 0's manifest names the same blobs, and rank 0's
        uploader puts them on the remote before its commit marker. Packs are left alone (a pack's name is the
        digest of the whole file, which differs between ranks that packed other chunks beside the shared ones).
        Empty (upload everything, as before) without a readable map, with rank 0's parts here, or when the map
        could not tell rank-local paths."""
        if commit.shards is None or any(r == 0 for r, _, _ in manifests):
            return set()
        try:
            rank_local = self.src_catalog.read_shard_map(commit).rank_local
        except CheckpointError as e:
            log.info("step %d: shard map unreadable (%s): this node uploads every blob its parts name", step, e)
            return set()
        if rank_local is None:
            return set()
        shared, own = set(), set()
        for _, _, m in manifests:
            rep = set(m.replicated)
            for n in m.nodes:
                if n.kind not in _ARRAYS:
                    continue
                ids = {c.blob_id for c in n.payload.chunks if c.pack is None}
                (shared if _plain_shared(n, rep, rank_local) else own).update(ids)
        return shared - own

    def _owned_elsewhere(self, step: int, commit: Commit, manifests, blobs, packs) -> Dict[Tuple[str, str], int]:
        """The objects of this root's parts that another root uploads (issue 29: HSDP shards and identical packs
        were PUT by every node holding them): ``("blob" | "pack", id) -> owner rank``, a rank whose parts this
        root does not hold. Each chunk has an owner rank, the same whichever rank holding it asks: a DTensor
        shard's is the rank holding the same box on rank 0's coordinates of the replicated mesh dims (the shard
        map's rule, :meth:`ShardMap.ranks <ckptstore.format.shardmap.ShardMap.ranks>` with ``prefer=0``); a plain
        value the map does not call rank-local is held alike by every rank (FORMAT.md "Shard map"): rank 0's;
        anything else: the rank's own. An object (a blob, or a pack: the same bytes on two ranks packed alike)
        is left to its owner when every chunk of it our ranks name has that one owner and the owner is not ours,
        unless it is known to be on ``dst`` already (an earlier step's object costs nothing to keep).
        An owner's own chunks are its own, so it never waits on another root for them. Empty without a readable
        shard map (every root uploads what it holds, as before), and with every rank's parts here (one root)."""
        mine = {r for r, _, _ in manifests}
        if commit.shards is None or not manifests or mine >= set(commit.manifests):    # one root holds all
            return {}
        try:
            smap = self.src_catalog.read_shard_map(commit)
        except CheckpointError as e:
            log.info("step %d: shard map unreadable (%s): this node uploads every object its parts name", step, e)
            return {}
        owners: Dict[Tuple[str, str], Set[int]] = {}
        for r, _, m in manifests:
            try:
                smap.check_manifest(m, step)             # the map describes this manifest: its rule applies
                walk = True
            except CheckpointError:
                walk = False
            rep = set(m.replicated)
            for n in m.nodes:
                if n.kind not in _ARRAYS:
                    continue
                e, owner = n.payload, r
                if n.kind == "dtensor":
                    got = smap.owner(n) if walk else None
                    if got is not None:
                        owner = got
                elif _plain_shared(n, rep, smap.rank_local):
                    owner = 0
                for c in e.chunks:
                    owners.setdefault(_obj_key(c), set()).add(owner)
        with self._lock:                              # known there already (an earlier step's): nothing to leave
            known = set(self.known_dst)
        ours = {_obj_key(c) for c in blobs.values()}
        out = {k: next(iter(o)) for k, o in owners.items()
               if len(o) == 1 and not o & mine and k not in known and (k in ours if k[0] != "pack" else k[1] in packs)}
        if out and commit.table is not None:
            # a marker naming a manifest table (more than mtable.INLINE_ROWS ranks): this root holds its own
            # ranks' rows and, from its leader, the owners' (rows files' refs); an owner's manifest is confirmed
            # by the digest of its row: objects of an owner whose row is not here this node uploads itself
            known = {o for o in set(out.values()) if self._row_known(commit, o)}
            out = {k: o for k, o in out.items() if o in known}
        if out:
            log.info("step %d: %d object(s) left to the root(s) of rank(s) %s, which hold them too", step, len(out),
                     sorted(set(out.values())))
        return out

    @staticmethod
    def _row_known(commit: Commit, rank: int) -> bool:
        try:
            commit.manifests[rank]
            return True
        except (CheckpointError, KeyError):
            return False

    def _await_owners(self, step: int, commit: Commit, deferred: Dict[Tuple[str, str], int],
                      timeout: Optional[float]) -> Set[Tuple[str, str]]:
        """Wait until each owner rank's manifest of ``deferred`` (see :meth:`_owned_elsewhere`) is on ``dst`` with
        the digest the commit marker names: its node wrote it after every object it names (chunks, then
        manifests), so the deferred objects it names are there. Returns the deferred objects not confirmed so:
        those the owner's manifest does not name (replicas that differ, packs packed otherwise), and every one
        still waiting after ``timeout`` seconds (default: the retry deadline; the owner's node is slow, dead or
        failing): the caller uploads those itself. So a manifest of ours never reaches ``dst`` before the objects
        it names, whatever the other roots do. Each round: one listing of the step's prefix (where the storage
        lists sizes) and one bounded GET per owner manifest that appears with the marker's size."""
        waiting: Dict[int, Set[Tuple[str, str]]] = {}
        for key, owner in deferred.items():
            waiting.setdefault(owner, set()).add(key)
        late: Set[Tuple[str, str]] = set()
        for owner in [o for o in waiting if o not in commit.manifests]:
            late |= waiting.pop(owner)
        for owner, data in self._arrivals(step, commit, sorted(waiting), timeout):
            keys = waiting.pop(owner)
            try:
                m = decode_manifest(data, step=step, rank=owner, what=manifest_path(step, owner,
                                                                                  commit.manifests[owner][2]))
                have = _dst_keys(m)
            except CheckpointError:
                have = set()
            with self._lock:
                self.known_dst |= keys & have
            late |= keys - have
        if waiting:
            log.warning("step %d: the manifests of rank(s) %s did not reach %s in %.0f s: this node uploads "
                        "the %d object(s) it left to them", step, sorted(waiting), self.dst.url,
                        self.retry.deadline if timeout is None else timeout, sum(len(k) for k in waiting.values()))
            for keys in waiting.values():
                late |= keys
        if late:
            log.info("step %d: %d object(s) left to other roots are not confirmed there: uploading them", step,
                     len(late))
        return late

    # -- ranged pulls -------------------------------------------------------------------------------------------
    def _ranged_packs(self, packs, ranges, pack_ends) -> Set[str]:
        """The packs to read by range: those of which the ranged reads (the step's distinct ranges, coalesced
        as :func:`~ckptstore.format.packs.read_chunks` will read them, holes included) would fetch less than
        ``self.ranged`` of the pack's size, unless ``dst`` already holds them intact. The end of the last range
        is a lower bound of the size that often decides alone; otherwise the size is looked up (one HEAD per
        pack, in parallel)."""
        if self.ranged is None:
            return set()

        def judge(p: str) -> bool:
            key, path = ("pack", p), pack_path(p)
            if self._dst_has(key, path):
                if self._dst_pack_ok(p, path):
                    return False                          # here already (saved, or pulled whole before)
                with self._lock:
                    self.known_dst.discard(key)
            items = [ReadItem(c, None) for c in ranges[p].values()]
            fetch = sum(n for _, n, _ in coalesce(items, gap=self.src.coalesce_gap, max_span=MAX_SPAN))
            if fetch < self.ranged * pack_ends[p]:
                return True
            size = self.call(lambda: self.src.size(path), f"look up the size of pack {p}")
            if size is not None:
                with self._lock:
                    self._src_sizes[p] = size          # a whole copy then needs no lookup of its own
            return size is not None and fetch < self.ranged * size    # missing: the whole copy says so
        futures = {p: self._pool.submit(judge, p) for p in sorted(packs)}
        return {p for p, f in futures.items() if f.result()}

    def _copy_ranged(self, step: int, ranged: Set[str], ranges, stats: TransferStats,
                     done) -> Dict[str, ChunkRef]:
        """Read the referenced chunks of the ``ranged`` packs (coalesced ranged reads, each chunk verified
        against its id) and write them into new local packs, in batches of at most ``pack_target`` referenced
        bytes (memory stays bounded). Returns chunk id -> its new reference. ``done(pack)``: progress."""
        order = sorted(ranged)
        refs_of = {p: sorted(ranges[p].values(), key=lambda c: c.offset) for p in order}
        src = _CountedReads(self, stats)
        new: Dict[str, ChunkRef] = {}
        for group in plan_packs([sum(c.stored for c in refs_of[p]) for p in order], self.pack_target):
            batch = [order[i] for i in group]
            got = copy_chunks(src, self.dst, [c for p in batch for c in refs_of[p]], executor=self._pool,
                              buffers=self._buffers, target_size=self.pack_target, step=step)
            new.update(got)
            written = {r.pack: r for r in got.values()}
            self._tally(stats, packs_ranged=len(batch), blobs_copied=len(written),
                        bytes_copied=sum(r.stored for r in got.values()))
            for p in batch:
                done(p)
        return new

    def _table_file(self, step: int, commit: Commit, marker_bytes: bytes, table: Optional[bytes], manifests,
                    subset: bool) -> Tuple[str, bytes]:
        """What ``dst`` needs of a marker's manifest table (FORMAT.md "Manifest table"): the whole table for a
        copy of the whole step (``table``: a new one the copy made, else the source's, checked against its
        digest), or for a copy of some ranks' parts (a pull of a rank's own part) only those ranks' rows, in a
        rows file: a resuming rank's pull reads and writes O(its ranks), not O(world size)."""
        new = decode_commit(marker_bytes, step=step, what=f"step {step}: commit marker")
        if not subset:
            if table is None:
                table = self.call(lambda: self.src_catalog.read_table_bytes(commit),
                                  f"read manifest table of step {step}")
            return mtable.table_path(step, new.table.digest), table
        if table is None:
            rows = {r: commit.manifests[r] for r, _, _ in manifests}
        else:
            rows = {r: row for r, row in mtable.parse_rows(table[:mtable.ROW.size * commit.world_size], 0).items()
                    if r in {q for q, _, _ in manifests}}
        return mtable.encode_rows(step, new.table.digest, rows)

    def _dst_metadata(self, step: int, commit_bytes: bytes, commit: Commit, manifests, ranged: Set[str],
                      new: Dict[str, ChunkRef]) -> Tuple[List[Tuple[str, bytes]], bytes, Optional[bytes]]:
        """The manifest files to write on ``dst`` and the commit marker's bytes: the source's, verbatim, unless
        packs were read by range. Then each pulled rank's manifest that reads from them is rewritten to name
        the new packs, as generation g+1 (g: the source's, or the local committed marker's when this step is
        being repaired, so the manifest the local marker names now is never overwritten), and the local
        marker names those manifests; every other field of it is the source's. Third: the new manifest table
        the new marker names (``None``: the marker is the source's, or names no table)."""
        if not ranged:
            return [(manifest_path(step, r, commit.manifests[r][2]), d) for r, d, _ in manifests], commit_bytes, None
        local_gens = {}
        try:
            if self.dst_catalog.is_committed(step):
                here = mtable.rows_here(self.dst_catalog.read_commit(step).manifests)
                local_gens = {r: g for r, (_, _, g) in here.items()}
        except CheckpointError:
            pass                                         # a damaged local marker names nothing worth keeping
        entries = dict(commit.manifests)
        writes = []
        for rank, data, m in manifests:
            if any(c.pack in ranged for c in m.chunk_refs()):
                gen = max(commit.manifests[rank][2], local_gens.get(rank, -1)) + 1
                if gen >= MAX_GENERATION:   # a generation no run reaches (one per repack): hostile input
                    raise CorruptCheckpointError(f"manifest generation {gen - 1} of rank {rank} leaves no room "
                                                 "for the pulled copy's", step=step)
                local = repoint(m, ranged, new)
                data = encode_manifest(local)
                entries[rank] = (bytes.fromhex(digest_bytes(data)), len(data), gen)
                if self.dst_catalog.decoded is not None:     # the restore that follows need not decode it
                    self.dst_catalog.decoded.put((entries[rank][0], len(data), step, rank), len(data), local)
            writes.append((manifest_path(step, rank, entries[rank][2]), data))
        return (writes, *encode_commit_files(commit.replace(manifests=entries)))

    def _shard_map(self, step: int, commit: Commit) -> Optional[bytes]:
        """The source's shard map of ``step`` (checked against the marker), to copy with it; ``None`` when the
        marker names none, or (logged) when it is missing or damaged there. The map is a hint (FORMAT.md "Shard
        map"): the step is copied without it, and readers of the copy, finding it missing, read every manifest,
        rather than the step being lost (issue 26)."""
        if commit.shards is None:
            return None
        try:
            return self.call(lambda: self.src_catalog.read_shard_map_bytes(commit), f"read shard map of step {step}")
        except CorruptCheckpointError as e:
            log.warning("step %d: shard map unusable on %s, copied without it (readers read every manifest): %s",
                        step, self.src.url, e)
            return None

    def _await_other_parts(self, step: int, commit: Commit, copied, timeout: Optional[float],
                           fresh: bool = False) -> None:
        """Wait until ``dst`` holds the manifest of every rank not in ``copied`` (uploaded by the nodes that
        hold them), each matching the digest in the commit marker. Its blobs and packs were written before it
        (every node's upload order), so the step is then complete on ``dst``.

        Each round costs one listing of the step's prefix with sizes (S3: one LIST per 1,000 objects) and one
        bounded GET per manifest that newly appears there with the size the marker records, read once and
        checked against its digest (a manifest of an earlier, uncommitted attempt at this step may sit under
        the same name): issue 19 measured one HEAD and one GET per other rank, again every round. ``fresh``:
        no earlier attempt can have left anything under the step's prefix (the uploader saw no such prefix when
        it listed the remote, and has not failed, truncated or deleted since): a listed manifest of the right
        size is this attempt's, written by its node after that node verified it against the marker's digest,
        and is not read back; a save then costs rank 0 one LIST per round (per 1,000 ranks) whatever the
        number of ranks. Storages that cannot list sizes are read rank by rank, one bounded GET each."""
        missing = sorted(set(commit.manifests) - set(copied))
        arrived = {r for r, _ in self._arrivals(step, commit, missing, timeout, trust_listing=fresh)}
        missing = [r for r in missing if r not in arrived]
        if missing:
            raise UploadError(f"step {step}: the parts of rank(s) {missing} did not reach {self.dst.url} "
                              "(their node has not uploaded them): the step is not committed there")

    def _arrivals(self, step: int, commit: Commit, ranks: List[int], timeout: Optional[float],
                  trust_listing: bool = False) -> Iterator[Tuple[int, Optional[bytes]]]:
        """Poll ``dst`` for the manifests of ``ranks`` of ``step``, yielding ``(rank, bytes)`` as each is there
        with the size and digest the commit marker names, until all are or ``timeout`` seconds (default: the
        retry deadline) have passed (the caller tells the missing ones by what was not yielded). Each round: one
        listing of the step's prefix with sizes, and one bounded GET per manifest newly listed with the
        marker's size (every rank's, one by one, where the storage cannot list sizes); backoff 0.05 s -> 2 s.
        ``trust_listing``: a manifest listed with the marker's size is taken without reading it (bytes
        ``None``; see :meth:`_await_other_parts`)."""
        deadline = time.monotonic() + (self.retry.deadline if timeout is None else timeout)
        missing = sorted(ranks)
        delay = 0.05
        while missing:
            listed = self.call(lambda: self.dst.list_sizes(step_dir(step)), f"list step {step} of {self.dst.url}")
            for r in list(missing):
                digest, size, gen = commit.manifests[r]
                path = manifest_path(step, r, gen)
                if listed is not None and listed.get(path.rsplit("/", 1)[1]) != size:
                    continue                       # not there yet (or not yet the bytes the marker names)
                if listed is not None and trust_listing:
                    missing.remove(r)
                    yield r, None
                    continue
                try:
                    data = self.call(lambda p=path, n=size: self.dst.read_bytes(p, limit=n + 1), f"read {path}")
                except FileNotFoundError:
                    continue
                if len(data) == size and digest_bytes(data) == digest.hex():   # else an earlier attempt's
                    missing.remove(r)
                    yield r, data
            if not missing or time.monotonic() >= deadline:
                return
            time.sleep(delay)
            delay = min(2.0, delay * 2)

    def _copy_objects(self, step: int, blobs, packs, stats: TransferStats,
                      pack_ends: Optional[Dict[str, int]] = None, ranged: Set[str] = frozenset(),
                      ranges=None, floats: Optional[Dict[str, int]] = None) -> Dict[str, ChunkRef]:
        """Copy the blobs and the whole packs (in the pool), and meanwhile the ``ranged`` packs' chunks (from
        this thread, their reads in the pool). Returns the new references of the ranged packs' chunks."""
        weight = {("pack", p): (pack_ends or {}).get(p, 0) for p in set(packs) | set(ranged)}
        weight.update({("blob", b): c.nbytes for b, c in blobs.items()})
        done, total = [0], sum(weight.values())
        if self.progress is not None:
            self.progress(0, total)

        def advance(key):
            if self.progress is not None:
                with self._lock:
                    done[0] += weight[key]
                    now = done[0]
                self.progress(now, total)

        def counted(fn, key, *args):
            sent = fn(step, key[1], *args, stats=stats)
            advance(key)
            return sent
        # packs first: they are the large objects, and the pool overlaps them with the many small blobs
        futures = [self._pool.submit(counted, self._copy_pack, ("pack", p)) for p in sorted(packs)]
        futures += [self._pool.submit(counted, self._copy_blob, ("blob", b), c.codec, c.nbytes, c.base,
                                      (floats or {}).get(b)) for b, c in blobs.items()]
        error, new = None, {}
        if ranged:
            try:
                new = self._copy_ranged(step, ranged, ranges, stats, lambda p: advance(("pack", p)))
            except BaseException as e:
                error = e
        for f in futures:
            try:
                sent = f.result()
                if sent:
                    stats.blobs_copied += 1
                    stats.bytes_copied += sent
            except BaseException as e:
                if error is None:              # the step fails: objects not started yet are not copied (each
                    for g in futures:          # would wait out an attempt against a silent store, issue 26)
                        g.cancel()
                error = error or e
        if error is not None:
            raise error
        return new

    def forget_dst(self) -> None:
        """Drop everything known about the destination (after a failure: it may have changed)."""
        self.dst.refresh()
        with self._lock:
            self.known_dst.clear()

    def remember_dst_step(self, step: int, ranks=None) -> None:
        """Add the blobs of a step already committed on ``dst`` to ``known_dst`` (one manifest read per rank).
        ``ranks="present"``: only the ranks whose manifest of ``step`` the source holds (a node-local root: the
        parts this copier will upload; issue 19: rank 0's uploader read every rank's manifest at each start)."""
        try:
            commit = self.dst_catalog.read_commit(step)
            wanted = list(commit.manifests)
            if ranks == "present" and self.src_catalog.is_committed(step):
                here = mtable.rows_here(self.src_catalog.read_commit(step).manifests)   # the source's rows
                wanted = [r for r, (_, _, g) in here.items()
                          if r in commit.manifests and self.src.exists(manifest_path(step, r, g))]
            for rank in wanted:
                m = self.dst_catalog.read_manifest(commit, rank)
                with self._lock:
                    self.known_dst |= _dst_keys(m)
        except Exception as e:  # only an optimisation: a damaged remote step is simply not trusted
            log.info("not using the blobs of step %d of %s as known: %s", step, self.dst.url, e)
