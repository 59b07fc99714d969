"""Packs: many small chunks in one write-once object, and ranged reads back out of them.

A *pack* is the concatenation of the stored bytes of some chunks (raw, or one zstd or planes frame per chunk),
nothing else. Its id is the BLAKE3-256 hex digest of the whole file, so a pack is content-addressed like a blob:
write-once (``link(2)`` locally, create-only PUT remotely), verifiable as a whole when it is copied (uploads and
pulls hash it against its name), and two ranks that pack the same chunks in the same order write one file.
Where each chunk lives (pack, offset, stored length) is recorded in the manifest, so a reader needs no other
index; every chunk read is still checked against its own id.

Why packs (measured, see benchmarks/README.md): the cost of a chunk as an object of its own is per object
(a file create and a directory entry locally, one request of ~ms remotely), not per byte. 4000 tensors of
64 B - 16 KiB took 20-37x as long as ``torch.save`` as 4000 blobs, and 53x boto3's upload of one object.

Why large chunks stay blobs: a chunk of ``Packing.threshold`` bytes or more already costs far more to move than
its object does; as a blob it is written straight from tensor memory with O_DIRECT (no copy into a pack
buffer), uploaded as its own parallel (multipart) PUT, and deduplicated across ranks and steps by its name
without any index.

Nothing here knows steps or manifests: :func:`plan_packs` is a pure function (sizes -> groups), the writer
turns groups into packs, and :func:`read_chunks` turns chunk references into verified bytes.
"""
from __future__ import annotations

import mmap
import threading
import uuid
from collections import defaultdict
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import blake3
import zstandard

from .blobs import decode_into, digest_bytes, encode_chunk, pack_intact, read_verified, zstd_claim_possible
from ..util.errors import CorruptCheckpointError, DamagedRead
from .layout import PACKS, pack_path
from . import planes
from .manifest import ChunkRef

PAGE = 4096
MAX_SPAN = 16 << 20      # a coalesced ranged read is at most this long (or one chunk)


@dataclass(frozen=True)
class Packing:
    """How chunks are packed. Sizes in bytes.

    ``threshold``: chunks of fewer raw bytes go into packs; larger ones are blobs of their own. 0 turns packing
    off (every chunk a blob, as in format 1). Default 4 MiB (measured: see benchmarks/README.md).
    ``target_size``: a pack is closed once adding the next chunk would pass this size (default 64 MiB); packs
    of one save are written in parallel, one per worker.
    """
    threshold: int = 4 << 20
    target_size: int = 64 << 20

    def __post_init__(self):
        for name in ("threshold", "target_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Packing.{name} must be a non-negative int (bytes), got {v!r}")
        if self.target_size < self.threshold:
            raise ValueError(f"Packing.target_size ({self.target_size}) must be >= threshold ({self.threshold})")

    def packs(self, nbytes: int) -> bool:
        """Whether a chunk of ``nbytes`` raw bytes goes into a pack."""
        return 0 < nbytes < self.threshold


def plan_packs(sizes: Sequence[int], target_size: int) -> List[List[int]]:
    """Split chunk indices ``0..len(sizes)-1``, in order, into groups whose sizes sum to at most
    ``target_size`` bytes (a group closes when the next chunk would pass it; a chunk alone may exceed it)."""
    groups: List[List[int]] = []
    current: List[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if current and total + n > target_size:
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        groups.append(current)
    return groups


class PackBuffers:
    """Page-aligned buffers that packs are assembled in, kept between saves (allocating fresh memory costs
    page faults on every save). At most one buffer per concurrent pack write; ``bytes_held`` is bounded by
    ``workers x target_size``."""

    def __init__(self):
        self._free: List[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> mmap.mmap:
        need = max(PAGE, -(-nbytes // PAGE) * PAGE)
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= need:
                    return self._free.pop(i)
            if self._free:                       # too small: drop one rather than hold both
                _close(self._free.pop())
        return mmap.mmap(-1, need)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            self._free.append(buf)

    @property
    def bytes_held(self) -> int:
        with self._lock:
            return sum(len(b) for b in self._free)

    def clear(self) -> None:
        with self._lock:
            bufs, self._free = self._free, []
        for b in bufs:
            _close(b)


def _close(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:                       # a view is still alive somewhere: let it be freed with it
        pass


def write_pack(storage, chunks: Sequence[tuple], *, codec: str, level: int,
               buffers: PackBuffers, encoded: Optional[Sequence[tuple]] = None) -> Tuple[List[ChunkRef], int]:
    """Assemble ``chunks`` (``(chunk id, raw bytes)`` or ``(chunk id, raw bytes, float element size or None)``,
    ids already computed) into one pack and store it (create-only: an identical pack already present is not
    written again). Each chunk is encoded as :func:`~ckptstore.format.blobs.encode_chunk` chooses for ``codec``,
    unless ``encoded`` gives its ``(codec used, stored bytes)`` already (in the same order). The pack is
    assembled in a buffer of ``buffers`` and hashed as a whole (threads); :class:`PackStream` writes one chunk
    by chunk instead, as they come.

    Returns the chunks' references (in order) and the bytes written (0 when the pack existed). The caller makes
    the pack durable (``storage.sync``) before a manifest names it. Raises ``OSError`` from the storage.
    """
    raw_total = sum(len(c[1]) for c in chunks)
    buf = buffers.take(raw_total)
    mv = memoryview(buf)
    body = None
    try:
        placed = []
        off = 0
        for i, (chunk_id, view, *itemsize) in enumerate(chunks):
            n = len(view)
            if encoded is not None:
                used, payload = encoded[i]
            else:
                used, payload = encode_chunk(view, codec, level, itemsize[0] if itemsize else None)
            k = len(payload)
            mv[off: off + k] = payload
            placed.append((chunk_id, n, used, off, k))
            off += k
        body = mv[:off]
        pack_id = digest_bytes(body, threads=True)
        path = pack_path(pack_id)
        wrote = storage.write_new(path, body)
        if not wrote and not pack_intact(storage, pack_id, off):
            # a pack of this name exists but is damaged (e.g. a flipped bit found on load): never reference
            # it; replace it with the bytes that hash to its name, atomically (one that cannot be read fails
            # the save: only a missing file counts as not intact here)
            storage.write_atomic(path, body)
            wrote = True
    finally:
        if body is not None:                  # no view of the buffer may outlive this call (even on error):
            body.release()                    # the buffer is reused, and an mmap with views cannot close
        mv.release()
        buffers.give(buf)
    refs = [ChunkRef(cid, n, used, pack_id, o, k) for cid, n, used, o, k in placed]
    return refs, (off if wrote else 0)


class PackStream:
    """One pack written chunk by chunk as the chunks' stored bytes come (the writer's chunks are encoded by a
    pool while it writes: the disk takes the first chunks of a pack while the last are still being encoded):
    each :meth:`add` ed chunk is hashed (BLAKE3 is incremental: the same id as hashing the whole) and written
    to a new file (:meth:`~ckptstore.storage.base.Storage.open_new`, in a random ``packs/<xx>/`` folder, so a
    process that dies leaves a temp file garbage collection removes); :meth:`finish` names it, create-only as
    :func:`write_pack` (a damaged pack of that name is replaced, never referenced). :meth:`discard` in any case.
    Not thread-safe: one writer."""

    def __init__(self, storage):
        self._storage = storage
        self._out = storage.open_new(f"{PACKS}/{uuid.uuid4().hex[:2]}")
        self._hasher = blake3.blake3()
        self._placed: List[tuple] = []
        self.size = 0                           # stored bytes so far
        self.raw_bytes = 0                      # raw bytes of the chunks so far
        self.chunks = 0

    def add(self, chunk_id: str, nbytes: int, used: str, payload) -> None:
        """Append one chunk: its id, raw length, codec used and stored bytes (written before this returns)."""
        k = len(payload)
        self._hasher.update(payload)
        self._out.write(payload)
        self._placed.append((chunk_id, nbytes, used, self.size, k))
        self.size += k
        self.raw_bytes += nbytes
        self.chunks += 1

    def finish(self) -> Tuple[List[ChunkRef], int]:
        """Name the pack; its chunks' references (in order) and the bytes written (0: the pack existed). The
        caller makes it durable (``storage.sync``) before a manifest names it. Raises ``OSError``."""
        pack_id = self._hasher.hexdigest()
        path = pack_path(pack_id)
        wrote = self._out.link(path)
        if not wrote and not pack_intact(self._storage, pack_id, self.size):
            self._out.replace(path)
            wrote = True
        return [ChunkRef(cid, n, used, pack_id, o, k) for cid, n, used, o, k in self._placed], \
            (self.size if wrote else 0)

    def discard(self) -> None:
        """Remove what was written and not named (idempotent)."""
        self._out.discard()


# -- reading ----------------------------------------------------------------------------------------------------
@dataclass
class ReadItem:
    """One chunk to read: its reference, the buffer of exactly ``ref.nbytes`` to fill, and names for errors.
    ``itemsize``: set on read for a planes chunk (its frame's element size), so a re-encode can keep the codec."""
    ref: ChunkRef
    out: memoryview
    step: Optional[int] = None
    key: Optional[str] = None
    itemsize: Optional[int] = None


def coalesce(items: Sequence[ReadItem], *, gap: int, max_span: int) -> List[Tuple[int, int, List[ReadItem]]]:
    """Group one pack's reads into spans ``(offset, length, items)``: items sorted by offset, neighbours merged
    while the hole between them is at most ``gap`` bytes and the span stays within ``max_span`` bytes (or holds
    a single item). A pure function: reading holes costs less than another request up to ``gap``."""
    spans: List[Tuple[int, int, List[ReadItem]]] = []
    for it in sorted(items, key=lambda i: i.ref.offset):
        start, end = it.ref.offset, it.ref.offset + it.ref.stored
        if spans:
            s_off, s_len, s_items = spans[-1]
            s_end = s_off + s_len
            if start - s_end <= gap and max(end, s_end) - s_off <= max_span:
                s_items.append(it)                    # the list is this function's own: no copy per item
                spans[-1] = (s_off, max(end, s_end) - s_off, s_items)
                continue
        spans.append((start, end - start, [it]))
    return spans


def _corrupt(msg: str, it: ReadItem, got=None) -> CorruptCheckpointError:
    """The error for chunk ``it``: bytes that were read but are wrong (``got``: what came back, see
    :class:`~ckptstore.util.errors.DamagedRead`), else a plain ``CorruptCheckpointError`` (a missing pack)."""
    where = f"{msg} (pack {it.ref.pack}, bytes [{it.ref.offset}, {it.ref.offset + it.ref.stored}))"
    if got is None:
        return CorruptCheckpointError(where, step=it.step, key=it.key, blob=it.ref.blob_id)
    return DamagedRead(where, got=got, step=it.step, key=it.key, blob=it.ref.blob_id)


def _finish(it: ReadItem, stored: memoryview) -> None:
    """Decode one chunk's stored bytes into ``it.out`` (unless read there already) and verify its id; bytes
    that fail raise :class:`~ckptstore.util.errors.DamagedRead`."""
    ref = it.ref
    if ref.codec != "raw":
        got = (ref.blob_id, len(stored), digest_bytes(stored))
        if not zstd_claim_possible(ref.stored, ref.nbytes):
            raise _corrupt(f"{ref.stored} bytes of {ref.codec} cannot hold {ref.nbytes} bytes", it)   # the claim's
        try:
            n = decode_into(ref.codec, stored, it.out)      # bounded by the declared size
            if ref.codec == "planes":
                it.itemsize = planes.parse_header(stored)[1]
        except (zstandard.ZstdError, ValueError) as e:
            raise _corrupt(f"chunk unreadable ({e})", it, got) from None
        if n != ref.nbytes:
            raise _corrupt(f"chunk decodes to {n} bytes, expected {ref.nbytes}", it, got)
    elif stored is not None:
        it.out[:] = stored
    digest = digest_bytes(it.out, threads=True)
    if digest != ref.blob_id:
        raise _corrupt("chunk content does not match its hash", it, (ref.blob_id, len(it.out), digest))


def _span_read(read, first: ReadItem) -> int:
    """Run one span's read; a missing or unreadable pack is a CorruptCheckpointError naming its first chunk."""
    try:
        return read()
    except FileNotFoundError:
        raise _corrupt("pack missing", first) from None
    except OSError as e:
        raise _corrupt(f"pack unreadable ({e.strerror or e})", first) from None


def _read_span(storage, pack: str, offset: int, length: int, items: List[ReadItem]) -> None:
    """Read one coalesced span with a scatter read: raw chunks land in their own ``out`` buffers (no staging
    copy of the span), zstd chunks in a buffer of their stored size, holes in one scratch buffer of at most
    the coalescing gap; then every chunk is decoded and verified. A chunk referenced by several items (two
    keys with equal bytes) is read once and copied. Spans whose ranges overlap (possible only across the
    manifests of several ranks) are read into one staging buffer instead."""
    path = pack_path(pack)
    first: Dict[int, ReadItem] = {}
    dups: List[Tuple[ReadItem, ReadItem]] = []
    end, overlapping = offset, False
    for it in items:                                   # sorted by offset (see coalesce)
        same = first.get(it.ref.offset)
        if same is not None and same.ref == it.ref:
            dups.append((it, same))
            continue
        if it.ref.offset < end:
            overlapping = True
        first[it.ref.offset] = it
        end = max(end, it.ref.offset + it.ref.stored)
    if overlapping:
        return _read_span_staged(storage, path, offset, length, items)
    reads = list(first.values())
    holes = [it.ref.offset - (prev.ref.offset + prev.ref.stored) for prev, it in zip(reads, reads[1:])]
    scratch = memoryview(bytearray(max(holes, default=0)))
    bufs: List[memoryview] = []
    staged: List[Optional[memoryview]] = []
    for i, it in enumerate(reads):
        if i and holes[i - 1]:
            bufs.append(scratch[:holes[i - 1]])
        st = None if it.ref.codec == "raw" else memoryview(bytearray(it.ref.stored))
        bufs.append(it.out if st is None else st)
        staged.append(st)
    got = _span_read(lambda: storage.read_range_scatter(path, offset, bufs), items[0])
    for it, st in zip(reads, staged):
        if it.ref.offset - offset + it.ref.stored > got:
            raise _corrupt(f"pack ends at byte {offset + got}, before the chunk's end", it, ("short", offset + got))
        _finish(it, st)
    for it, src in dups:                               # same reference: the bytes were verified in src.out
        it.out[:] = src.out


def _read_span_staged(storage, path: str, offset: int, length: int, items: List[ReadItem]) -> None:
    buf = memoryview(bytearray(length))
    got = _span_read(lambda: storage.read_range_into(path, offset, buf), items[0])
    for it in items:
        lo = it.ref.offset - offset
        if lo + it.ref.stored > got:
            raise _corrupt(f"pack ends at byte {offset + got}, before the chunk's end", it, ("short", offset + got))
        _finish(it, buf[lo: lo + it.ref.stored])


def read_chunks(storage, items: Sequence[ReadItem], *, executor: Executor, gap: int = 1 << 20,
                max_span: int = MAX_SPAN) -> list:
    """Submit the reads of packed chunks to ``executor``: ranged reads (``pread`` locally, ranged GET remotely)
    of coalesced spans, each chunk decoded into its ``out`` buffer and verified against its id.

    Returns the futures; each raises ``CorruptCheckpointError`` naming step, key and chunk for a missing pack,
    a pack shorter than a chunk's range, an undecodable chunk, or bytes that do not hash to the chunk's id.
    """
    by_pack: Dict[str, List[ReadItem]] = defaultdict(list)
    for it in items:
        by_pack[it.ref.pack].append(it)
    futures = []
    for pack, its in by_pack.items():
        for offset, length, span in coalesce(its, gap=gap, max_span=max_span):
            futures.append(executor.submit(_read_span_checked, storage, pack, offset, length, span))
    return futures


def _read_span_checked(storage, pack: str, offset: int, length: int, items: List[ReadItem]) -> None:
    """:func:`_read_span` under :func:`~ckptstore.format.blobs.read_verified`: from an object store, a span whose
    chunks come back wrong (hash, codec) or cut short is read again, since the bytes may have been damaged in
    transfer, not at rest (issue 17: one damaged GET body sent resume to an older step; issue 26: three sent it
    to a fresh start); a local read, or a missing pack, is final at once."""
    read_verified(storage, pack_path(pack), lambda: _read_span(storage, pack, offset, length, items))
