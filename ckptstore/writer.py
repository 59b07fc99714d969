"""The write path: array specs (byte views) -> chunks -> BLAKE3 ids -> blobs not yet stored -> chunk references.

Chunks run through a thread pool: hashing (BLAKE3) and compression (zstd) release the GIL and writes wait on
the disk, so hashing one chunk overlaps with writing another. Within one save, a chunk whose id another
worker already claimed is not written twice. Nothing here knows steps or manifests.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Dict, List

from .blobs import BlobStore, digest_bytes
from .manifest import ChunkRef
from .snapshot import ArraySpec


@dataclass
class WriteStats:
    bytes_total: int = 0        # logical bytes of all arrays
    bytes_written: int = 0      # bytes of new blobs actually written (after dedup and compression)
    blobs_total: int = 0
    blobs_new: int = 0
    bytes_unchanged: int = 0    # bytes of tensors proven unchanged (not copied, not hashed)
    hash_seconds: float = 0.0   # summed over workers
    write_seconds: float = 0.0  # summed over workers


@dataclass
class _Claims:
    lock: threading.Lock = field(default_factory=threading.Lock)
    claimed: Dict[str, threading.Event] = field(default_factory=dict)


def chunk_ranges(nbytes: int, chunk_size: int):
    """``[(offset, length), ...]`` covering ``nbytes`` in pieces of at most ``chunk_size`` (none for 0)."""
    return [(off, min(chunk_size, nbytes - off)) for off in range(0, nbytes, chunk_size)]


def write_arrays(blobs: BlobStore, specs: List[ArraySpec], *, chunk_size: int, codec: str, level: int,
                 executor: Executor) -> (List[List[ChunkRef]], WriteStats):
    """Store the bytes of every spec as blobs. Returns one chunk-reference list per spec, and statistics.

    A spec with ``known`` refs (unchanged since the last save) is neither hashed nor written. A spec with a
    ``ready`` CUDA event is read only after the event completes. Raises whatever a worker raised
    (``OSError`` from the disk, ...) once all workers are done; blobs already written stay (unreferenced blobs
    are removed by garbage collection).
    """
    stats = WriteStats()
    claims = _Claims()
    stats_lock = threading.Lock()

    def work(view: memoryview) -> ChunkRef:
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
            used, wrote = blobs.locate(blob_id) or codec, 0
        else:
            try:
                used, wrote = blobs.put(blob_id, view, codec, level)
            finally:
                ev.set()
        t2 = time.perf_counter()
        with stats_lock:
            stats.hash_seconds += t1 - t0
            stats.write_seconds += t2 - t1
            stats.blobs_total += 1
            if wrote:
                stats.blobs_new += 1
                stats.bytes_written += wrote
        return ChunkRef(blob_id, len(view), used)

    futures = []
    for spec in specs:
        stats.bytes_total += spec.nbytes
        if spec.known is not None:
            stats.blobs_total += len(spec.known)
            stats.bytes_unchanged += spec.nbytes
            futures.append(list(spec.known))
            continue
        if spec.ready is not None:
            spec.ready.synchronize()
        view = spec.view
        futures.append([executor.submit(work, view[off: off + n]) for off, n in chunk_ranges(len(view), chunk_size)])
    results, error = [], None
    for per_spec in futures:
        refs = []
        for f in per_spec:
            if isinstance(f, ChunkRef):
                refs.append(f)
                continue
            try:
                refs.append(f.result())
            except BaseException as e:      # keep draining so no worker is left touching the views
                error = error or e
        results.append(refs)
    if error is not None:
        raise error
    blobs.sync()
    return results, stats
