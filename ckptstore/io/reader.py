"""The read path: a manifest's chunk references -> verified bytes -> tensors, arrays and plain values.

Every chunk is read into the destination buffer and its BLAKE3 digest checked before the value is handed out.
Blobs are read whole; packed chunks by ranged reads of coalesced spans, only those of the selected keys (see
:func:`ckptstore.format.packs.read_chunks`). Reads run on a thread pool.
"""
from __future__ import annotations

from concurrent.futures import Executor
from typing import Any, Callable, List, Optional, Union

import numpy as np
import torch

from ..format.blobs import BlobStore, zstd_claim_possible
from ..util.errors import CorruptCheckpointError
from ..format.layout import pack_path
from ..format.manifest import ARRAY_KINDS, Manifest
from ..format.packs import ReadItem, read_chunks
from ..state.flatten import TORCH_DTYPES, Node, path_str

MapLocation = Union[None, str, torch.device, Callable[[torch.Tensor, str], torch.Tensor]]


def read_nodes(blobs: BlobStore, manifest: Manifest, *, executor: Executor, map_location: MapLocation = "cpu",
               select: Optional[Callable[[tuple], bool]] = None, share=None) -> List[Node]:
    """Load a manifest into :class:`ckptstore.state.flatten.Node` records holding real values.

    ``map_location``: ``"cpu"`` (default), a device, ``None`` (each tensor to the device it was saved from
    when that device exists here, else CPU), or a callable ``(tensor, saved_device) -> tensor``.
    ``select(path) -> bool`` limits loading to some key paths (their containers are kept).
    ``share``: a :class:`ckptstore.distributed.fanout.Session` (a rank of a job at resume): chunks every rank needs
    are read by one rank and received by the others (collective: every rank of the job calls this for the step).
    Raises ``CorruptCheckpointError`` naming the step, the key and the blob of the first bad chunk.
    """
    chosen = [m for m in manifest.nodes if select is None or not m.path or select(m.path)]
    share = share.begin(manifest.step, chosen, executor, blobs.storage) if share is not None else None
    if share is None:
        nodes = _read(blobs, manifest, chosen, executor, None)
    else:
        try:
            nodes = _read(blobs, manifest, chosen, executor, share)
        except Exception as e:
            raise share.fail(e)
        share.finish()                    # the others' shares arrive, verified
    for node in nodes:
        if node.kind in ARRAY_KINDS:
            node.value = _materialise(node.kind, *node.value, map_location)
    return nodes


def _read(blobs: BlobStore, manifest: Manifest, chosen, executor: Executor, share) -> List[Node]:
    """The nodes ``chosen``, array values as ``(verified uint8 buffer, entry)``; the chunks ``share`` says
    another rank reads are left for it to fill."""
    nodes: List[Node] = []
    pending, packed = [], []
    skip = share.received if share is not None else None
    stored = stored_sizes(blobs, manifest, chosen, executor=executor, skip=skip)
    for mnode in chosen:
        if mnode.kind not in ARRAY_KINDS:
            value = mnode.payload
            if mnode.kind == "bigint":
                value = int(value)
            elif mnode.kind == "dtype":
                value = TORCH_DTYPES[value]
            nodes.append(Node(mnode.path, mnode.kind, value))
            continue
        entry = mnode.payload
        key = path_str(mnode.path)
        try:
            buf = torch.empty(entry.nbytes, dtype=torch.uint8)
        except (RuntimeError, MemoryError) as e:
            raise CorruptCheckpointError(f"cannot allocate the {entry.nbytes} bytes the manifest claims "
                                         f"({type(e).__name__})", step=manifest.step, key=key) from None
        mv = memoryview(buf.numpy()).cast("B") if entry.nbytes else memoryview(bytearray())
        off = 0
        for c in entry.chunks:
            if share is not None and share.take(c, mv[off: off + c.nbytes], key):
                pass
            elif c.pack is not None:
                packed.append(ReadItem(c, mv[off: off + c.nbytes], manifest.step, key))
            else:
                codec, size = stored[("blob", c.blob_id, c.codec)]
                pending.append(executor.submit(blobs.read_into, c.blob_id, codec, mv[off: off + c.nbytes],
                                               step=manifest.step, key=key, size=size, base=c.base))
            off += c.nbytes
        node = Node(mnode.path, mnode.kind, (buf, entry))
        nodes.append(node)
    pending += read_chunks(blobs.storage, packed, executor=executor, gap=blobs.storage.coalesce_gap)
    wait_all(pending)
    return nodes


def wait_all(futures) -> None:
    """Wait for every future, then raise the first error: no read outlives the call (its buffer is the
    caller's)."""
    error = None
    for f in futures:
        try:
            f.result()
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error


def stored_sizes(blobs: BlobStore, manifest: Manifest, chosen, *, executor: Executor,
                 quarantine: bool = True, skip: Optional[Callable[[Any], bool]] = None) -> dict:
    """Look up the stored size of every blob and pack the ``chosen`` nodes read (in parallel: one ``stat`` or
    HEAD each), and check every chunk's claims against them **before anything is allocated**: a raw blob has
    exactly its raw length, a packed range lies inside its pack, and no zstd chunk claims more raw bytes than
    its stored bytes can hold. A manifest can thus never make a reader allocate more than the files hold.
    ``skip(chunk ref) -> bool``: chunks not read here (another rank reads them).

    Returns ``{("blob", id, codec): (codec found, size), ("pack", id): size}``. Raises
    ``CorruptCheckpointError`` naming step, key and file for the first chunk whose claim cannot hold.
    """
    refs = [(path_str(m.path), c) for m in chosen if m.kind in ARRAY_KINDS for c in m.payload.chunks
            if skip is None or not skip(c)]
    blob_keys = {("blob", c.blob_id, c.codec) for _, c in refs if c.pack is None}
    pack_keys = {("pack", c.pack) for _, c in refs if c.pack is not None}
    futures = {k: executor.submit(blobs.stat, k[1], k[2]) for k in blob_keys}
    futures.update({k: executor.submit(blobs.storage.size, pack_path(k[1])) for k in pack_keys})
    out, error = {}, None
    for k, f in futures.items():
        try:
            out[k] = f.result()
        except OSError as e:
            error = error or CorruptCheckpointError(f"cannot stat ({e.strerror or e})", step=manifest.step,
                                                    blob=k[1])
    if error is not None:
        raise error
    for key, c in refs:
        if c.pack is None:
            codec, size = out[("blob", c.blob_id, c.codec)]
            blobs.check_claim(c.blob_id, codec, size, c.nbytes, step=manifest.step, key=key, quarantine=quarantine)
            continue
        size = out[("pack", c.pack)]
        where = f"(pack {c.pack}, bytes [{c.offset}, {c.offset + c.stored}))"
        if size is None:
            raise CorruptCheckpointError(f"pack missing {where}", step=manifest.step, key=key, blob=c.blob_id)
        if c.offset + c.stored > size:
            raise CorruptCheckpointError(f"pack ends at byte {size}, before the chunk's end {where}",
                                         step=manifest.step, key=key, blob=c.blob_id)
        if c.codec != "raw" and not zstd_claim_possible(c.stored, c.nbytes):
            raise CorruptCheckpointError(f"{c.stored} bytes of zstd cannot hold {c.nbytes} bytes {where}",
                                         step=manifest.step, key=key, blob=c.blob_id)
    return out


def _materialise(kind: str, buf: torch.Tensor, entry, map_location: MapLocation) -> Any:
    if kind == "tensor":
        t = buf.view(TORCH_DTYPES[entry.dtype]).reshape(entry.shape)
        t = _place(t, entry.device, map_location)
        if entry.requires_grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        return t
    arr = buf.numpy().view(np.dtype(entry.dtype)).reshape(entry.shape)
    return arr[()] if kind == "npscalar" else arr


def _place(t: torch.Tensor, saved_device: str, map_location: MapLocation) -> torch.Tensor:
    if callable(map_location):
        return map_location(t, saved_device)
    if map_location is None:
        try:
            dev = torch.device(saved_device)
        except (RuntimeError, ValueError):
            return t
        if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
            return t
        if dev.type not in ("cpu", "cuda"):
            return t
        return t.to(dev)
    dev = torch.device(map_location)
    return t if dev.type == "cpu" else t.to(dev)
