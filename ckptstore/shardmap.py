"""The shard map of a step: which saved rank holds which box of every sharded key, and which plain values are
rank-local. It lets a resume on another world size read only the manifests it needs.

Without it, a rank that reshards must read every saved rank's manifest to find the shards overlapping its own
(and to tell rank-local values from replicated ones): O(saved ranks) reads per rank, quadratic over the job
(the "resume reading every file on every rank" of pytorch#125740). With it, a rank reads the commit marker,
this map, rank 0's manifest (plain values) and the manifests of the ranks whose shards overlap its targets.

Who writes it, and when (FORMAT.md "Shard map"): each rank adds a small *entry* to its part of the commit's one
gather (:func:`local_entry`: per sharded key an 8-byte key hash and the saved box; per plain value, by position,
an 8-byte signature hash), so the number of collectives per save stays constant. Rank 0 builds the map
(:func:`build`), writes it as ``steps/<step>/shards[.g<gen>].msgpack`` before the commit marker, and records
its digest, size and generation in the marker (leaders of other roots get its bytes through the coordinator
and write it too). Keys are named by hash, not by path: the map stays small, and it only *selects* manifests:
the shards themselves come from the manifests, matched by their full key path and checked to cover every
target element, and a map that selects too few ranks (or cannot be read) makes the reader fall back to every
manifest, logged. A commit marker without a map (older steps, single-process saves) reads every manifest, as
before.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import msgpack
import numpy as np

from .manifest import ARRAY_KINDS, CONTAINER_KINDS, Manifest, frame, unframe
from .sharding import SavedShard, ShardIndex
from .state import KeyPath

log = logging.getLogger("ckptstore")

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]
MAX_SHARD_MAP_BYTES = 256 << 20      # a reader never reads more (about 8 M saved shard boxes)


def key_hash(path: KeyPath) -> bytes:
    """8 bytes naming a key path (its components are str / int)."""
    return hashlib.blake2b(msgpack.packb(list(path), use_bin_type=True), digest_size=8).digest()


def signatures(m: Manifest, wanted: Optional[set] = None) -> Dict[KeyPath, Any]:
    """path -> what must be equal across ranks for a non-sharded value to load on another world size (its
    kind, dtype, shape and chunk ids; a container's kind and length; a plain value's repr)."""
    out: Dict[KeyPath, Any] = {}
    rep = set(m.replicated)           # equal on every rank by declaration; held by rank 0 only
    for n in m.nodes:
        if (not n.path or n.kind == "dtensor" or (wanted is not None and n.path[0] not in wanted)
                or n.path[0] in rep):
            continue
        if n.kind in ARRAY_KINDS:
            e = n.payload
            out[n.path] = (n.kind, e.dtype, tuple(e.shape), tuple(c.blob_id for c in e.chunks))
        elif n.kind in CONTAINER_KINDS:
            out[n.path] = (n.kind, n.payload if n.kind != "dict" else None)
        else:
            out[n.path] = (n.kind, repr(n.payload))
    return out


def top_most(paths: Sequence[KeyPath]) -> List[KeyPath]:
    """The paths not under another one of ``paths``, shortest first."""
    top: List[KeyPath] = []
    for p in sorted(paths, key=lambda p: (len(p), [str(x) for x in p])):
        if not any(p[:len(q)] == q for q in top):
            top.append(p)
    return top


def _plain_signatures(m: Manifest) -> Tuple[List[KeyPath], bytes]:
    """The paths of ``m``'s plain values in manifest order, and 8 bytes per value hashing what
    :func:`signatures` compares (so both ways of finding rank-local values agree)."""
    paths, out = [], []
    rep = set(m.replicated)
    for n in m.nodes:
        if not n.path or n.kind == "dtensor" or n.path[0] in rep:
            continue
        h = hashlib.blake2b(digest_size=8)
        if n.kind in ARRAY_KINDS:
            e = n.payload
            h.update(f"{n.kind}|{e.dtype}|{tuple(e.shape)}|".encode())
            for c in e.chunks:
                h.update(c.blob_id.encode())
        elif n.kind in CONTAINER_KINDS:
            h.update(repr((n.kind, n.payload if n.kind != "dict" else None)).encode())
        else:
            h.update(repr((n.kind, repr(n.payload))).encode())
        paths.append(n.path)
        out.append(h.digest())
    return paths, b"".join(out)


def _order(paths: List[KeyPath]) -> bytes:
    return hashlib.blake2b(msgpack.packb([list(p) for p in paths], use_bin_type=True), digest_size=8).digest()


def local_entry(m: Manifest) -> Dict[str, Any]:
    """This rank's contribution to the map, sent in the commit's gather: ``boxes`` ``[[key hash, offset,
    shape], ...]`` of its sharded values; ``order``: 8 bytes hashing the paths of its plain values, in manifest
    order; ``plain``: 8 bytes per plain value, in that order, hashing its signature (measured: 64 KiB and
    23 ms for 4000 plain tensors with a key hash per value; by position, 32 KiB and 7 ms)."""
    boxes = [[key_hash(n.path), list(n.payload.shard.offset), list(n.payload.shape)]
             for n in m.nodes if n.kind == "dtensor"]
    paths, plain = _plain_signatures(m)
    entry = {"boxes": boxes, "order": _order(paths), "plain": plain}
    if m.replicated:
        entry["replicated"] = list(m.replicated)
    return entry


def build(step: int, entries: Sequence[Dict[str, Any]], rank0: Manifest) -> bytes:
    """The map's bytes from every rank's :func:`local_entry` (index = rank) and rank 0's manifest (which names
    the rank-local paths). ``rank_local`` is ``None`` ("unknown": readers compare the manifests) when some
    rank's plain values are not the same paths in the same order as rank 0's (rank 0 could not name them)."""
    rep = list(rank0.replicated)
    differ_rep = [r for r, e in enumerate(entries) if list(e.get("replicated", [])) != rep]
    if differ_rep:       # a step rank r could not load: refuse to commit it (the save raises CommitError)
        raise ValueError(f"ranks {differ_rep} declared other replicated keys than rank 0 ({rep}): every rank "
                         "must pass the same save(replicated=...)")
    boxes: Dict[bytes, List[list]] = {}
    for r, e in enumerate(entries):
        for h, off, shape in e["boxes"]:
            boxes.setdefault(h, []).append([r, off, shape])
    paths, own = _plain_signatures(rank0)
    order = _order(paths)
    rank_local: Optional[List[list]] = None
    if all(e.get("order") == order and len(e.get("plain", b"")) == len(own) for e in entries):
        base = np.frombuffer(own, dtype=np.uint64)
        differ = np.zeros(len(base), dtype=bool)
        for e in entries:
            differ |= np.frombuffer(e["plain"], dtype=np.uint64) != base
        rank_local = [list(p) for p in top_most([paths[i] for i in np.flatnonzero(differ)])]
    return frame("shards", {"step": step, "world_size": len(entries), "boxes": list(boxes.items()),
                            "rank_local": rank_local})


class ShardMap:
    """A decoded, validated shard map. ``rank_local``: top-most rank-local paths (``None``: unknown)."""

    def __init__(self, world_size: int, boxes: Dict[bytes, List[Tuple[int, Box]]],
                 rank_local: Optional[List[KeyPath]]):
        self.world_size, self._boxes, self.rank_local = world_size, boxes, rank_local
        self._indexes: Dict[bytes, ShardIndex] = {}

    @staticmethod
    def decode(data: bytes, *, step: int, world_size: int, what: str) -> "ShardMap":
        """Raises ``CorruptCheckpointError`` (naming ``what``) for damaged or inconsistent bytes."""
        body, _ = unframe(data, "shards", what=what, step=step)
        from .errors import CorruptCheckpointError
        try:
            if body.get("step") != step or body.get("world_size") != world_size:
                raise ValueError(f"map is for step {body.get('step')!r}, world size {body.get('world_size')!r}")
            boxes: Dict[bytes, List[Tuple[int, Box]]] = {}
            for h, shards in body["boxes"]:
                if not isinstance(h, bytes) or len(h) != 8 or not isinstance(shards, list):
                    raise ValueError("bad key hash")
                out = []
                for r, off, shape in shards:
                    if (not isinstance(r, int) or not 0 <= r < world_size or len(off) != len(shape)
                            or not all(isinstance(x, int) and x >= 0 for x in list(off) + list(shape))):
                        raise ValueError(f"bad box {[r, off, shape]!r:.80}")
                    out.append((r, (tuple(off), tuple(shape))))
                boxes[h] = out
            rl = body.get("rank_local")
            if rl is not None:
                if not isinstance(rl, list) or not all(
                        isinstance(p, list) and p and all(isinstance(x, (str, int)) for x in p) for p in rl):
                    raise ValueError("bad rank-local paths")
                rl = [tuple(p) for p in rl]
            return ShardMap(world_size, boxes, rl)
        except (ValueError, TypeError, KeyError) as e:
            raise CorruptCheckpointError(f"invalid shard map: {e}", step=step, blob=what) from None

    def check_rank_keys(self, rank: int, paths: Sequence[KeyPath], step: int) -> None:
        """Raise ``CorruptCheckpointError`` unless ``paths`` (the sharded keys in ``rank``'s manifest) are exactly
        the keys the map says ``rank`` saved shards of: a manifest that lost a sharded key (or gained one) must
        not load as a tree without it (found by the format-2 fuzz, issue 17)."""
        from .errors import CorruptCheckpointError
        have = {key_hash(p) for p in paths}
        want = {h for h, shards in self._boxes.items() if any(r == rank for r, _ in shards)}
        if have != want:
            raise CorruptCheckpointError(f"rank {rank}'s manifest holds {len(have)} sharded keys, the step's shard "
                                         f"map says {len(want)} ({len(want - have)} missing, {len(have - want)} "
                                         "unknown)", step=step)

    def ranks(self, path: KeyPath, global_shape: Tuple[int, ...], box: Box, prefer: int) -> Optional[List[int]]:
        """The saved ranks whose shards of ``path`` overlap ``box`` (one rank per replicated box, ``prefer``
        first), by bisection on dim 0; ``None`` when the map does not know the key."""
        h = key_hash(path)
        index = self._indexes.get(h)
        if index is None:
            saved = self._boxes.get(h)
            if saved is None:
                return None
            ordered = sorted(saved, key=lambda rb: rb[0] != prefer)       # stable: then by rank
            index = self._indexes[h] = ShardIndex(tuple(global_shape), (SavedShard(b, None, r) for r, b in ordered))
        return sorted({s.rank for s, _ in index.overlapping(box)})
