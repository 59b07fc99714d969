"""Repack: rewrite the live chunks of mostly dead packs into new packs, then retire the old packs.

A pack is kept whole while any committed step references any chunk in it, so after retention has removed
older steps a pack may hold mostly dead bytes. ``repack_packs`` (run by gc, under the gc lease, with no save in
flight: see :mod:`ckptstore.lifecycle.lease`) rewrites them. Per batch of packs (at most ``target_size`` live bytes):

1. read the batch's live chunks (ranged reads, each chunk verified against its id), write them into new packs
   (content-named, create-only) and make those durable;
2. write a note ``locks/retired/<old pack id>`` for each old pack (its mtime is the retirement time);
3. for each committed step that references an old pack: write each affected rank's manifest as generation
   g+1 (the same nodes, chunks pointing into the new packs), then replace the step's commit marker atomically
   with one naming those generations (everything else in it unchanged);
4. nothing is deleted here: gc deletes an old pack once no commit references it and it has been retired for
   the grace period, and the replaced manifests once the new commit marker is older than the grace period.

A crash (SIGKILL) at any point leaves every step either with its old commit marker (old manifests, old packs:
all still there) or with its new one (new manifests, new packs: durable before it was written). A repeated
repack redoes what is left. Readers that opened an old commit marker or manifest just before it was replaced
still find the old pack until the grace period has passed.
"""
from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Set, Tuple

from ..util.errors import CheckpointError
from ..format.layout import pack_path, retired_path
from ..format.manifest import ARRAY_KINDS, ChunkRef, Commit, Manifest, ManifestNode
from ..format.packs import PackBuffers, ReadItem, plan_packs, read_chunks, write_pack

log = logging.getLogger("ckptstore")

DEFAULT_THRESHOLD = 0.5


def _live_ranges(catalog, committed: List[int]):
    """pack id -> {(offset, stored): ChunkRef} of every range a readable committed step references, and
    pack id -> the steps that reference it. Raises ``CheckpointError`` for an unreadable step."""
    ranges: Dict[str, Dict[Tuple[int, int], ChunkRef]] = defaultdict(dict)
    steps_of: Dict[str, Set[int]] = defaultdict(set)
    for step in committed:
        commit = catalog.read_commit(step)
        for rank in sorted(commit.manifests):
            for c in catalog.read_manifest(commit, rank).chunk_refs():
                if c.pack is not None:
                    ranges[c.pack][(c.offset, c.stored)] = c
                    steps_of[c.pack].add(step)
    return ranges, steps_of


def candidates(storage, ranges, threshold: float) -> List[Tuple[str, int, int]]:
    """``(pack id, live bytes, size)`` of the packs whose live bytes are below ``threshold`` x size."""
    out = []
    for pack, rs in sorted(ranges.items()):
        size = storage.size(pack_path(pack))
        if not size:
            continue                                   # missing: a damaged step's business, not ours
        live = sum(stored for _, stored in rs)
        if live < threshold * size:
            out.append((pack, live, size))
    return out


def repack_packs(storage, catalog, committed: List[int], *, threshold: float = DEFAULT_THRESHOLD, report,
                 deleter=None, target_size: int = 64 << 20, buffers: Optional[PackBuffers] = None,
                 workers: int = 4) -> None:
    """Repack every pack whose live bytes are below ``threshold`` (0..1) of its size; counts go to ``report``
    (a :class:`~ckptstore.lifecycle.gc.GCReport`). The caller holds the gc lease with no save in flight."""
    if not 0 <= threshold <= 1:
        raise ValueError(f"repack threshold must be in [0, 1], got {threshold!r}")
    try:
        ranges, steps_of = _live_ranges(catalog, committed)
    except CheckpointError as e:
        log.warning("repack: skipped, a committed step is unreadable (%s)", e)
        return
    todo = candidates(storage, ranges, threshold)
    if not todo:
        return
    # the same pure grouping a save uses for new chunks: old packs whose live bytes fill one new pack
    batches = [[todo[i][0] for i in group] for group in plan_packs([live for _, live, _ in todo], target_size)]
    own_buffers = buffers is None
    buffers = buffers or PackBuffers()
    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ckptstore-repack")
    try:
        for batch in batches:
            if deleter is not None:
                deleter.check()
            _repack_batch(storage, catalog, batch, ranges, steps_of, report, buffers, pool, target_size)
    finally:
        pool.shutdown(wait=True)
        if own_buffers:
            buffers.clear()


def copy_chunks(src, dst, refs, *, executor, buffers: PackBuffers, target_size: int,
                step: Optional[int] = None) -> Dict[str, ChunkRef]:
    """Read the packed chunks ``refs`` from ``src`` (coalesced ranged reads, each chunk verified against its
    id), write them in order into new content-named packs on ``dst`` (create-only; at most ``target_size``
    bytes each, as a save plans them) and make those durable. Returns chunk id -> its new reference.

    One buffer per distinct chunk: the caller bounds ``refs`` (repack and a ranged pull batch them by
    ``target_size``). When any chunk was compressed, all are re-encoded as ``Writing(codec="auto")`` would
    (a planes chunk with the element size its frame named, the others as zstd where it pays; each kept only where
    it saves >= 3%, as a save does), so ``stored`` comes from the new pack. Raises ``CorruptCheckpointError`` naming ``step``
    and the chunk for an unreadable or damaged chunk, before anything is written; ``OSError`` from ``dst``.
    Shared by repack (``src is dst``) and a ranged pull (remote -> local, see :mod:`ckptstore.remote.transfer`)."""
    chunks: Dict[str, ChunkRef] = {}
    for ref in sorted(refs, key=lambda r: (r.pack, r.offset)):      # a deterministic order: same packs again
        chunks.setdefault(ref.blob_id, ref)
    items = [ReadItem(ref, memoryview(bytearray(ref.nbytes)), step=step) for ref in chunks.values()]
    for f in read_chunks(src, items, executor=executor, gap=src.coalesce_gap):
        f.result()
    codec = "auto" if any(it.ref.codec != "raw" for it in items) else "raw"
    groups = plan_packs([it.ref.nbytes for it in items], target_size)
    futures = [executor.submit(write_pack, dst, [(items[i].ref.blob_id, items[i].out, items[i].itemsize) for i in g], codec=codec,
                               level=1, buffers=buffers) for g in groups]
    new: Dict[str, ChunkRef] = {}
    for f in futures:
        for r in f.result()[0]:
            new[r.blob_id] = r
    dst.sync({pack_path(r.pack).rsplit("/", 1)[0] for r in new.values()})
    return new


def repoint(m: Manifest, old: Set[str], new: Dict[str, ChunkRef]) -> Manifest:
    """``m`` with every chunk that lives in a pack of ``old`` pointing at its new reference in ``new`` (by
    chunk id); every other field unchanged (:meth:`Manifest.replace`)."""
    nodes = []
    for n in m.nodes:
        if n.kind in ARRAY_KINDS:
            e = n.payload
            chunks = [new[c.blob_id] if c.pack in old else c for c in e.chunks]
            n = ManifestNode(n.path, n.kind, dataclasses.replace(e, chunks=chunks))
        nodes.append(n)
    return m.replace(nodes=nodes)


def _repack_batch(storage, catalog, batch: List[str], ranges, steps_of, report, buffers, pool,
                  target_size: int) -> None:
    # 1. the live chunks, read, verified and written into new packs (made durable)
    refs = [ref for pack in batch for ref in ranges[pack].values()]
    try:
        new = copy_chunks(storage, storage, refs, executor=pool, buffers=buffers, target_size=target_size)
    except CheckpointError as e:
        log.warning("repack: packs %s left as they are: a live chunk is unreadable (%s)", batch, e)
        return
    written = {r.pack for r in new.values()}
    if set(batch) & written:                       # rewriting a pack into itself gains nothing
        log.info("repack: %s rewrite to themselves; left as they are", sorted(set(batch) & written))
        return
    # 2. retirement notes before any commit stops naming the old packs
    for pack in batch:
        storage.write_atomic(retired_path(pack), b"")
    # 3. new manifests (generation + 1), then the commit marker, step by step
    old = set(batch)
    for step in sorted(set().union(*(steps_of[p] for p in batch))):
        _rewrite_step(catalog, step, old, new)
        report.steps_rewritten.append(step)
    report.packs_repacked += len(batch)
    report.packs_written += len(written)
    report.bytes_repacked += sum({r.blob_id: r.stored for r in refs}.values())
    log.info("repack: %d pack(s) -> %d, %d live chunk(s), steps %s", len(batch), len(written), len(new),
             sorted(set().union(*(steps_of[p] for p in batch))))


def _rewrite_step(catalog, step: int, old: Set[str], new: Dict[str, ChunkRef]) -> None:
    commit = catalog.read_commit(step)
    entries = dict(commit.manifests)
    changed = False
    for rank in sorted(commit.manifests):
        m = catalog.read_manifest(commit, rank)
        if not any(c.pack in old for c in m.chunk_refs()):
            continue
        entries[rank] = catalog.write_manifest(repoint(m, old, new), commit.manifests[rank][2] + 1)
        changed = True
    if changed:
        catalog.write_commit(commit.replace(manifests=entries))
