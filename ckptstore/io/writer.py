"""The write path: array specs (byte views) -> chunks -> BLAKE3 ids -> blobs / packs not yet stored -> chunk
references.

Chunks run through a thread pool: hashing (BLAKE3) and compression (zstd, planes) release the GIL and writes wait on
the disk, so hashing one chunk overlaps with writing another. Large chunks become blobs of their own; small
ones are hashed in batches and the new ones appended to packs (see :mod:`ckptstore.format.packs`): raw, packs
are assembled whole and written by the pool; with a codec, each batch is hashed and encoded in one task and the
saving thread streams the packs as batches finish (:func:`_pack_encoded`). Within one save, a chunk is never
written twice. Nothing here knows steps or manifests.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Executor, wait
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ..format.blobs import BlobStore, digest_bytes, encode_chunk
from ..format.index import ChunkIndex
from ..format.manifest import ChunkRef
from ..format.packs import PackBuffers, PackStream, Packing, plan_packs, write_pack
from ..format.planes import float_itemsize
from .deltas import put_chunk
from .snapshot import ArraySpec


@dataclass
class WriteStats:
    bytes_total: int = 0        # logical bytes of all arrays
    bytes_written: int = 0      # bytes of new blobs actually written (after dedup and compression)
    blobs_total: int = 0        # chunks referenced
    blobs_new: int = 0          # chunks written by this save (as blobs or into packs)
    objects_new: int = 0        # files created: blobs + packs
    bytes_unchanged: int = 0    # bytes of tensors proven unchanged (not copied, not hashed)
    hash_seconds: float = 0.0   # summed over workers
    write_seconds: float = 0.0  # summed over workers


@dataclass
class _Claims:
    lock: threading.Lock = field(default_factory=threading.Lock)
    claimed: Dict[str, threading.Event] = field(default_factory=dict)
    refs: Dict[str, ChunkRef] = field(default_factory=dict)      # what the first writer of a chunk stored


def chunk_ranges(nbytes: int, chunk_size: int):
    """``[(offset, length), ...]`` covering ``nbytes`` in pieces of at most ``chunk_size`` (none for 0)."""
    return [(off, min(chunk_size, nbytes - off)) for off in range(0, nbytes, chunk_size)]


_HASH_BATCH_BYTES = 4 << 20           # small chunks are hashed in batches: one task per ~4 MiB, not per chunk
_ENCODE_BATCH_BYTES = 1 << 20         # and encoded (a codec) in batches of ~1 MiB: ~1-2 ms of work per task


def write_arrays(blobs: BlobStore, specs: List[ArraySpec], *, chunk_size: int, codec: str, level: int,
                 executor: Executor, packing: Optional[Packing] = None, index: Optional[ChunkIndex] = None,
                 buffers: Optional[PackBuffers] = None, deltas: int = 0) -> (List[List[ChunkRef]], WriteStats):
    """Store the bytes of every spec. Returns one chunk-reference list per spec, and statistics.

    Chunks of ``packing.threshold`` bytes or more become blobs (hashed and written by ``executor``, one task
    each). Smaller chunks are hashed in batches; those neither in ``index`` nor earlier in this save are
    appended, in order, to new packs of about ``packing.target_size`` (written in parallel). Then one
    ``sync`` makes every new blob and pack durable. A spec with ``known`` refs (unchanged since the last save)
    is neither hashed nor written; a spec with a ``ready`` CUDA event is read only after the event completes.
    ``codec`` (``"raw"``, ``"zstd"``, ``"auto"``) is applied per chunk (:func:`~ckptstore.format.blobs.encode_chunk`;
    under ``"auto"`` a chunk of a floating-point spec is tried with the planes codec, by the spec's dtype).
    ``deltas`` (``"auto"`` only): a blob chunk whose parent step (``index``) had a blob chunk of the same key path,
    dtype, chunk index and length is stored as a delta against that chunk's key, at most ``deltas`` per key
    (:mod:`ckptstore.io.deltas`).

    Raises whatever a worker raised (``OSError`` from the disk, ...) once all workers are done; what was
    written stays unreferenced until garbage collection removes it.
    """
    packing = packing or Packing(threshold=0)
    buffers = buffers or PackBuffers()
    stats = WriteStats()
    claims = _Claims()
    stats_lock = threading.Lock()

    def account(wrote: int, hash_s: float = 0.0, write_s: float = 0.0, chunks: int = 0) -> None:
        with stats_lock:
            stats.hash_seconds += hash_s
            stats.write_seconds += write_s
            if wrote:
                stats.blobs_new += chunks
                stats.objects_new += 1
                stats.bytes_written += wrote

    def work(view: memoryview, itemsize, parent: Optional[ChunkRef]) -> ChunkRef:
        t0 = time.perf_counter()
        blob_id = digest_bytes(view)
        t1 = time.perf_counter()
        with claims.lock:
            ev = claims.claimed.get(blob_id)
            first = ev is None
            if first:
                ev = claims.claimed[blob_id] = threading.Event()
        if not first:
            ev.wait()                       # the same bytes are being written by another worker
            ref, wrote = claims.refs.get(blob_id) or ChunkRef(blob_id, len(view), blobs.locate(blob_id) or codec), 0
        else:
            try:
                if deltas and index is not None:
                    ref, wrote = put_chunk(blobs, blob_id, view, parent, deltas, level, itemsize)
                else:
                    used, wrote = blobs.put(blob_id, view, codec, level, itemsize)
                    ref = ChunkRef(blob_id, len(view), used)
                claims.refs[blob_id] = ref
            finally:
                ev.set()
        account(wrote, t1 - t0, time.perf_counter() - t1, 1)
        return ref

    def hash_batch(views: List[memoryview]) -> List[str]:
        t0 = time.perf_counter()
        ids = [digest_bytes(v) for v in views]
        account(0, time.perf_counter() - t0)
        return ids

    # 1. blobs start at once; small chunks are collected: (spec index, chunk index, view)
    results: List[list] = []
    small: List[tuple] = []
    for si, spec in enumerate(specs):
        stats.bytes_total += spec.nbytes
        stats.blobs_total += len(spec.known) if spec.known is not None else 0
        if spec.known is not None:
            stats.bytes_unchanged += spec.nbytes
            results.append(list(spec.known))
            continue
        if spec.ready is not None:
            spec.ready.synchronize()
        view = spec.view
        itemsize = float_itemsize(spec.dtype) if codec == "auto" else None
        per_spec = []
        for ci, (off, n) in enumerate(chunk_ranges(len(view), chunk_size)):
            stats.blobs_total += 1
            if packing.packs(n):
                per_spec.append(None)
                small.append((si, ci, view[off: off + n], itemsize))
            else:
                parent = index.parent(spec.path, spec.dtype, ci, n) if deltas and index is not None else None
                per_spec.append(executor.submit(work, view[off: off + n], itemsize, parent))
        results.append(per_spec)
    error = None
    try:
        if small:
            _pack_small(small, results, blobs, index, packing, buffers, codec, level, executor, hash_batch,
                        account)
    except BaseException as e:              # blobs still in flight must finish before the views go away
        error = e
    out = []
    for per_spec in results:
        refs = []
        for f in per_spec:
            if f is None or isinstance(f, ChunkRef):
                refs.append(f)
                continue
            try:
                refs.append(f.result())
            except BaseException as e:      # keep draining so no worker is left touching the views
                error = error or e
        out.append(refs)
    if error is not None:
        raise error
    blobs.sync()
    return out, stats


def _batches(items: list, size, limit: int = _HASH_BATCH_BYTES) -> List[list]:
    """``items`` in consecutive batches of about ``limit`` bytes (``size(item)`` bytes each)."""
    batches, cur, cur_bytes = [], [], 0
    for it in items:
        cur.append(it)
        cur_bytes += size(it)
        if cur_bytes >= limit:
            batches.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        batches.append(cur)
    return batches


def _pack_small(small, results, blobs, index, packing, buffers, codec, level, executor, hash_batch, account):
    """Hash the small chunks (batched), reuse those the store has, pack the rest; fill ``results`` in place.

    Raw: the chunks are hashed in batches of ~4 MiB, then the new ones are written in packs of about
    ``packing.target_size``, by the pool in parallel. With a codec: :func:`_pack_encoded`."""
    if codec != "raw":
        return _pack_encoded(small, results, blobs, index, packing, codec, level, executor, account)
    views = [v for _, _, v, _ in small]
    ids = [i for f in [executor.submit(hash_batch, b) for b in _batches(views, len)] for i in f.result()]
    new: Dict[str, tuple] = {}                       # chunk id -> (bytes, float element size), first occurrence
    for (si, ci, v, itemsize), cid in zip(small, ids):
        have = index.get(cid) if index is not None else None
        if have is None and cid not in new:
            new[cid] = (v, itemsize)
    placed: Dict[str, ChunkRef] = {}
    if new:
        items = [(cid, v, itemsize) for cid, (v, itemsize) in new.items()]

        def one_pack(group):
            t0 = time.perf_counter()
            refs, wrote = write_pack(blobs.storage, [items[i] for i in group], codec=codec, level=level,
                                     buffers=buffers)
            account(wrote, 0.0, time.perf_counter() - t0, len(group))
            return refs
        packs = [executor.submit(one_pack, g) for g in plan_packs([len(v) for _, v, _ in items],
                                                                  packing.target_size)]
        try:
            for f in packs:
                for r in f.result():
                    placed[r.blob_id] = r
        finally:                                 # on an error too: no task may still touch the views after this
            wait(packs)
    for (si, ci, v, _), cid in zip(small, ids):
        results[si][ci] = placed.get(cid) or index.get(cid)


def _pack_encoded(small, results, blobs, index, packing, codec, level, executor, account):
    """:func:`_pack_small` with a codec: the pool hashes the chunks in batches of ~1 MiB and, in the same task,
    encodes those the store does not have (while their bytes are in cache), and this thread streams the new
    chunks, in order and as their batches finish, into packs (:class:`~ckptstore.format.packs.PackStream`,
    grouped as :func:`~ckptstore.format.packs.plan_packs` groups them): the disk writes the first chunks while
    the pool still hashes and encodes the last. Before (hash all, then encode all, then write each pack whole)
    a blocking save with ``codec="auto"`` took 1.4x a raw one here; see benchmarks/README.md "bench_codec.py".
    A chunk met twice in one save is encoded twice, stored once."""
    def hash_and_encode(batch: List[int]):
        t0 = time.perf_counter()
        ids = [digest_bytes(small[i][2]) for i in batch]
        t1 = time.perf_counter()
        enc = [None if index is not None and index.get(cid) is not None
               else encode_chunk(small[i][2], codec, level, small[i][3]) for i, cid in zip(batch, ids)]
        account(0, t1 - t0, time.perf_counter() - t1)
        return ids, enc

    batches = _batches(list(range(len(small))), lambda i: len(small[i][2]), _ENCODE_BATCH_BYTES)
    futures = [executor.submit(hash_and_encode, b) for b in batches]
    ids: List[Optional[str]] = [None] * len(small)
    placed: Dict[str, ChunkRef] = {}
    packed = set()                                   # chunk ids in a pack of this save
    stream = None

    def finish(st) -> None:
        t0 = time.perf_counter()
        refs, wrote = st.finish()
        account(wrote, 0.0, time.perf_counter() - t0, st.chunks)
        placed.update((r.blob_id, r) for r in refs)
    try:
        for f, batch in zip(futures, batches):
            got, enc = f.result()
            for i, cid, e in zip(batch, got, enc):
                ids[i] = cid
                if e is None or cid in packed:
                    continue
                packed.add(cid)
                n = len(small[i][2])
                if stream is not None and stream.chunks and stream.raw_bytes + n > packing.target_size:
                    finish(stream)
                    stream.discard()
                    stream = None
                if stream is None:
                    stream = PackStream(blobs.storage)
                t0 = time.perf_counter()
                stream.add(cid, n, *e)
                account(0, 0.0, time.perf_counter() - t0)
        if stream is not None:
            finish(stream)
    finally:                                     # on an error too: no task may still touch the views after this
        if stream is not None:
            stream.discard()
        wait(futures)
    for (si, ci, _, _), cid in zip(small, ids):
        results[si][ci] = placed.get(cid) or index.get(cid)
