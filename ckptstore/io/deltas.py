"""The writer's side of the delta codec (``Writing(codec="auto", deltas=K)``, FORMAT.md "The delta codec"): which
blob chunks are stored as a delta against their parent step's key, and how.

A chunk stored as a blob whose tensor had a blob chunk of the same key path, dtype, chunk index and raw length in
this rank's parent step (:meth:`ckptstore.format.index.ChunkIndex.parent`) is stored as the difference with that chunk's
*key*: the parent's chunk itself when it is stored in full, else the key the parent's chunk is a delta against. So
a delta's key is never a delta (chain depth 1) and a chain never passes ``K`` deltas against one key: the
``K + 1``-th save stores the chunk in full, and it becomes the next key. The key's raw bytes are read back from the
store and verified (one read of the chunk's raw length per delta written: the cost of the option). A delta is kept
only where its frame is at most 97% of what storing the chunk in full would take (estimated on a 64 KiB sample
of the chunk); Adam's first moment, which changes by a tenth of the gradient at every step, is stored in full.
"""
from __future__ import annotations

import logging
from typing import Optional, Tuple

import numpy as np

from ..format import delta
from ..format.blobs import BlobStore, encode_chunk
from ..format.manifest import ChunkRef
from ..format.planes import sample
from ..util.errors import CheckpointError

log = logging.getLogger("ckptstore")

_MIN_GAIN = 0.97                 # a delta is kept when it is at most 97% of the full copy's estimated size


def put_chunk(blobs: BlobStore, blob_id: str, view: memoryview, parent: Optional[ChunkRef], limit: int, level: int,
              itemsize: Optional[int]) -> Tuple[ChunkRef, int]:
    """Store one blob chunk (raw bytes ``view``, id ``blob_id``) under ``codec="auto"`` with deltas of at most
    ``limit`` per key against ``parent`` (the parent step's chunk, or ``None``). Returns ``(reference, bytes
    written)``. A key that cannot be read (missing, damaged) makes the chunk a full one: nothing is lost."""
    n = len(view)
    if parent is not None and parent.blob_id == blob_id:
        if parent.codec == "delta" and blobs.delta_trusted(parent):
            return parent, 0                     # unchanged since the parent step: its delta, as it was
    elif parent is not None and blobs.locate(blob_id) is None:
        key, seq = (parent.base, parent.seq + 1) if parent.codec == "delta" else (parent, 1)
        if seq <= limit:
            ref, wrote = _put_delta(blobs, blob_id, view, key, seq, level, itemsize)
            if ref is not None:
                return ref, wrote
    used, wrote = blobs.put(blob_id, view, "auto", level, itemsize)
    return ChunkRef(blob_id, n, used), wrote


def _put_delta(blobs: BlobStore, blob_id: str, view: memoryview, key: ChunkRef, seq: int, level: int,
               itemsize: Optional[int]):
    n = len(view)
    keybuf = bytearray(n)
    try:
        blobs.read_into(key.blob_id, key.codec, memoryview(keybuf))
    except CheckpointError as e:
        log.info("delta codec: key %s unreadable (%s): chunk %s stored in full", key.blob_id, e, blob_id)
        return None, 0
    frame = delta.encode(view, keybuf, key.blob_id, itemsize, level)
    probe = sample(np.frombuffer(view, dtype=np.uint8))
    full = len(encode_chunk(probe, "auto", level, itemsize)[1]) / max(1, probe.size)
    if len(frame) > _MIN_GAIN * full * n:
        return None, 0
    wrote = blobs.write_delta(blob_id, frame, check=lambda stored: BlobStore.intact(
        stored, blob_id, "delta", n, key=keybuf, key_id=key.blob_id))
    if wrote < 0:                                # a delta of this chunk against another key is there
        return None, 0
    return ChunkRef(blob_id, n, "delta", base=key, seq=seq), wrote
