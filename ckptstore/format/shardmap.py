"""The shard map of a step: which saved rank holds which box of every sharded key, and which plain values are
rank-local. It lets a resume on another world size read only the manifests it needs.

Without it, a rank that reshards must read every saved rank's manifest to find the shards overlapping its own
(and to tell rank-local values from replicated ones): O(saved ranks) reads per rank, quadratic over the job
(the "resume reading every file on every rank" of pytorch#125740). With it, a rank reads the commit marker,
this map, rank 0's manifest (plain values) and the manifests of the ranks whose shards overlap its targets.

**Described by rule, not by box** (issue 19). A DTensor's local shard is, by torch's definition, a function of
(global shape, mesh shape, the rank's mesh coordinate, placements). So the map records, once per sharded key,
its 8-byte key hash, global shape, mesh and placements, and once per device mesh its rank grid (4 bytes per
rank of the mesh): O(keys + ranks), never O(keys x ranks). A reader finds the saved ranks overlapping a target
box by walking the mesh dims (a bisection per ``Shard`` dim, one coordinate per ``Replicate`` dim), never by
scanning ranks. The map is exact only when every rank laid its shards out alike, so at every save each rank
sends rank 0 8 bytes hashing its layout (key hashes, global shapes, placements, mesh grids) and one bit saying
its own boxes are what the rule gives for its coordinate (:func:`layout`); rank 0 writes a map only when every
rank's layout equals its own and every bit is set.

**FSDP2 + tensor parallel** (issue 29): ``_StridedShard(d, split_factor=sf)`` (FSDP2's dim over a dim tensor
parallelism already shards) is walked like ``Shard``, by torch's ``_StridedShard._split_tensor`` rule: chunk the
extent into ``sf`` pieces, each piece into the mesh dim's size, a coordinate holding its chunk of every piece. A
rank may thus hold several intervals of a dim. The saved boxes follow torch's sharding order instead
(:func:`~ckptstore.state.sharding.placed_box`: each tp shard chunked over dp), which this walk matches only where
the shards are even; a save where some rank's saved box is not the walk's (uneven strided shards) writes no map. DTensors on a sub-mesh (the norms on
FSDP2's ``dp`` mesh of a ``dp x tp`` mesh: a different rank grid per tp rank) are described on the grid of every
slice of the sub-mesh (:func:`~ckptstore.state.sharding.mesh_grid`), a leading mesh dim whose slices hold the
same shards (``"rule": 2``). Other placements are recorded but not walked: a reader reads every manifest for
those keys.

**Rank-local values** are found by group digests: each rank hashes its plain values (not DTensors, not keys
saved as replicated) in at most :data:`MAX_GROUPS` groups (top-level keys, split into their children where a
key has few: ``rng/torch``, ``progress/consumed``), 16 bytes a group (:func:`plain_groups`); rank 0 folds them
rank by rank (:class:`RankLocalFold`): a group whose digest differs on any rank is rank-local. The map records
the top-most rank-local paths (``None``, "unknown": readers compare the manifests, when some rank holds a group
rank 0 does not).

Who writes it (FORMAT.md "Shard map"): rank 0 builds it from its own manifest and meshes (:func:`build_rule`)
and writes it as ``steps/<step>/shards[.g<gen>].msgpack`` before the commit marker, which records its digest;
a leader of another root builds the same bytes from its own manifest and the rank-local paths in its message,
and writes them only when their digest is the one recorded. Keys are named by hash: the map only *selects*
manifests; the shards come from the manifests, matched by their full key path and checked to cover every
target element, and a map that selects too few ranks, cannot be read, or does not describe the first manifest
the reader reads as it is (:meth:`ShardMap.check_manifest`) makes the reader fall back to every manifest,
logged: the map is a hint, the manifests are the truth (issue 26). Maps written before issue 19 (one box per
rank and key, ``"boxes"``) are still read, under the same rules.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import msgpack
import numpy as np

from ..util.errors import CorruptCheckpointError
from .manifest import ARRAY_KINDS, CONTAINER_KINDS, SHARDS_FORMAT, Manifest, frame, unframe
from ..state.sharding import (Intervals, Parsed, SavedShard, ShardIndex, _chunk, _merge, _select, _split,  # noqa: F401
                              parse_placements)
from ..state.flatten import KeyPath, path_str

log = logging.getLogger("ckptstore")

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]
MAX_SHARD_MAP_BYTES = 256 << 20      # a reader never reads more (about 8 M saved shard boxes)
MAX_GROUPS = 64                      # plain-value groups a rank sends (16 bytes each); more -> one per top key
SPLIT_CHILDREN = 16                  # a top-level key with at most this many children is split into them
MAX_SENT_GROUPS = 256                # beyond this many top-level keys: rank-local values are "unknown"


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


# -- what each rank sends at a save ---------------------------------------------------------------------------
def rule_box(global_shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
             parsed: Parsed) -> Optional[Box]:
    """The box ``(offset, shape)`` the coordinate ``coord`` holds by rule (mesh dims applied left to right);
    ``None`` when what it holds is no box (a strided shard whose pieces do not join up). Where this differs
    from the box a rank saved (:func:`~ckptstore.state.sharding.placed_box`: uneven strided shards), no map is
    written for the layout (:func:`layout`)."""
    hold: Dict[int, Intervals] = {}
    for (kind, d, sf), n, c in zip(parsed, mesh_shape, coord):
        if kind != "R":
            hold[d] = _split(hold.get(d, [(0, global_shape[d])]), kind, sf, n, c)
    off, size = [0] * len(global_shape), list(global_shape)
    for d, iv in hold.items():
        iv = _merge(iv)
        if len(iv) > 1:
            return None
        off[d], size[d] = iv[0] if iv else (global_shape[d], 0)
    return tuple(off), tuple(size)


def _same_box(a: Optional[Box], b: Box) -> bool:
    if a is None:                            # the rule gives no box (a strided shard in pieces)
        return False
    if 0 in a[1] or 0 in b[1]:               # empty shards: torch puts their offset at the dim's end
        return 0 in a[1] and 0 in b[1]
    return tuple(a[0]) == tuple(b[0]) and tuple(a[1]) == tuple(b[1])


def _family_shape(mesh: Sequence[int], grid: bytes) -> Optional[Tuple[int, ...]]:
    """The shape of a saved rank grid (:attr:`~ckptstore.state.sharding.ShardInfo.grid`): the mesh's shape, or
    ``(slices,) + mesh`` when the grid lists every slice of a sub-mesh of a larger mesh (FSDP2's ``dp``
    sub-mesh of a ``dp x tp`` mesh: one slice per ``tp`` coordinate, each holding the same shards); ``None``
    when the grid's length fits neither."""
    size = int(np.prod(mesh)) if len(mesh) else 1
    n, rem = divmod(len(grid), 4)
    if rem or size < 1 or n < size or n % size:
        return None
    return tuple(mesh) if n == size else (n // size,) + tuple(mesh)


def _meshes(m: Manifest) -> Tuple[List[Tuple[Tuple[int, ...], bytes]], Dict[Any, int]]:
    """The distinct device meshes of ``m``'s DTensor nodes in order of first use, as ``(shape, rank grid)``
    (the shape has a leading slice dim for the slices of a sub-mesh: :func:`_family_shape`), and
    :func:`_mesh_key` -> index. Meshes are told apart by content (shape and ranks), not by object: two
    DeviceMesh objects of the same ranks are one mesh of the map."""
    grids: List[Tuple[Tuple[int, ...], bytes]] = []
    index: Dict[Any, int] = {}
    for n in m.nodes:
        if n.kind == "dtensor":
            info = n.payload.shard
            k = _mesh_key(info)
            if info.grid is not None and k not in index:
                shape = _family_shape(info.mesh, info.grid)
                if shape is not None:
                    index[k] = len(grids)
                    grids.append((shape, info.grid))
    return grids, index


def _lead(parsed: Parsed, mesh_shape: Sequence[int]) -> Parsed:
    """``parsed`` for a map mesh of ``mesh_shape``: its slice dims (if any) lead, replicated."""
    return [("R", -1, 1)] * (len(mesh_shape) - len(parsed)) + list(parsed)


def _mesh_key(info) -> Any:
    return (tuple(info.mesh), info.grid)


def layout(m: Manifest, rank: int) -> Tuple[bytes, bool]:
    """This rank's layout digest (8 bytes: the sharded keys' hashes, global shapes, dtypes, placements, mesh
    shapes and rank grids, in manifest order) and whether each of its saved boxes is the one the rule gives for
    its coordinate (``False`` too when a DTensor's mesh grid is unknown or a placement is not walked: no map)."""
    h = hashlib.blake2b(digest_size=8)
    grids, index = _meshes(m)
    for shape, g in grids:
        h.update(msgpack.packb(list(shape)))
        h.update(hashlib.blake2b(g, digest_size=16).digest())
    ok = True
    coords: Dict[int, Optional[Tuple[int, ...]]] = {}
    for n in m.nodes:
        if n.kind != "dtensor":
            continue
        e = n.payload
        info = e.shard
        h.update(key_hash(n.path))
        h.update(msgpack.packb([list(info.global_shape), e.dtype, list(info.mesh), list(info.placements),
                                index.get(_mesh_key(info), -1)], use_bin_type=True))
        if not ok:
            continue
        parsed = parse_placements(info.placements)
        mi = index.get(_mesh_key(info))
        if mi is None or parsed is None:
            ok = False
            continue
        shape = grids[mi][0]
        if mi not in coords:
            coords[mi] = _coordinate(info.grid, shape, rank)
        c = coords[mi]
        ok = c is not None and _same_box(rule_box(info.global_shape, shape, c, _lead(parsed, shape)),
                                         (info.offset, e.shape))
    return h.digest(), ok


def _coordinate(grid: bytes, mesh_shape: Sequence[int], rank: int) -> Optional[Tuple[int, ...]]:
    flat = np.flatnonzero(np.frombuffer(grid, dtype="<i4") == rank)
    if len(flat) != 1:
        return None
    return tuple(int(x) for x in np.unravel_index(int(flat[0]), tuple(mesh_shape)))


def replicated_digest(m: Manifest) -> bytes:
    """8 bytes naming the keys ``m`` was saved with as replicated (every rank must pass the same)."""
    return hashlib.blake2b(msgpack.packb(sorted(m.replicated), use_bin_type=True), digest_size=8).digest()


def plain_groups(m: Manifest) -> Tuple[List[KeyPath], Optional[bytes], Optional[bytes]]:
    """``(group paths, key hashes, digests)``: this rank's plain values in groups (see the module docstring),
    8 + 8 bytes per group, at most :data:`MAX_GROUPS` unless there are more top-level keys; ``(paths, None,
    None)`` beyond :data:`MAX_SENT_GROUPS` top-level keys (rank-local values then "unknown")."""
    paths, sigs = _plain_signatures(m)
    children: Dict[Any, set] = {}
    tops: Dict[Any, None] = {}
    for p in paths:
        tops.setdefault(p[0])
        if len(p) >= 2:
            children.setdefault(p[0], set()).add(p[1])
    if len(tops) > MAX_SENT_GROUPS:
        return [], None, None
    split, count = set(), len(tops)
    for t in sorted(tops, key=str):
        k = len(children.get(t, ()))
        if 0 < k <= SPLIT_CHILDREN and count + k <= MAX_GROUPS:
            split.add(t)
            count += k
    hashers: Dict[KeyPath, Any] = {}
    for i, p in enumerate(paths):
        g = p[:2] if p[0] in split and len(p) >= 2 else p[:1]
        h = hashers.get(g)
        if h is None:
            h = hashers[g] = hashlib.blake2b(digest_size=8)
            h.update(msgpack.packb(list(p[:1]), use_bin_type=True))
        h.update(msgpack.packb(list(p[1:]), use_bin_type=True))
        h.update(sigs[8 * i: 8 * i + 8])
    groups = list(hashers)
    return (groups, b"".join(key_hash(g) for g in groups), b"".join(hashers[g].digest() for g in groups))


class RankLocalFold:
    """Rank 0's fold of every rank's :func:`plain_groups` (memory: O(groups), whatever the number of ranks)."""

    def __init__(self, groups: List[KeyPath], keys: Optional[bytes], digests: Optional[bytes]):
        self.groups, self.keys = groups, keys
        self.unknown = keys is None
        self.base = np.frombuffer(digests or b"", dtype="<u8")
        self.index = {keys[8 * i: 8 * i + 8]: i for i in range(len(groups))} if keys is not None else {}
        self.differ = np.zeros(len(self.base), dtype=bool)
        self._pending: List[bytes] = []         # digests of ranks with rank 0's groups, compared 512 at a time

    def _flush(self) -> None:
        if self._pending:
            got = np.frombuffer(b"".join(self._pending), dtype="<u8").reshape(len(self._pending), -1)
            self.differ |= (got != self.base).any(axis=0)
            self._pending = []

    def add(self, keys: Optional[bytes], digests: Optional[bytes]) -> None:
        if self.unknown:
            return
        if not isinstance(keys, bytes) or not isinstance(digests, bytes) or len(keys) != len(digests) \
                or len(keys) % 8:
            self.unknown = True
            return
        if keys == self.keys:                                   # the common case: same groups, same order
            self._pending.append(digests)
            if len(self._pending) >= 512:
                self._flush()
            return
        seen = np.zeros(len(self.base), dtype=bool)
        got = np.frombuffer(digests, dtype="<u8")
        for j in range(len(keys) // 8):
            i = self.index.get(keys[8 * j: 8 * j + 8])
            if i is None:                   # a group rank 0 does not hold: it cannot name it
                self.unknown = True
                return
            seen[i] = True
            self.differ[i] |= bool(got[j] != self.base[i])
        self.differ |= ~seen

    def rank_local(self) -> Optional[List[KeyPath]]:
        """Top-most rank-local paths, ``None`` when unknown."""
        if self.unknown:
            return None
        self._flush()
        return top_most([self.groups[i] for i in np.flatnonzero(self.differ)])


def _is_arange(grid: bytes) -> bool:
    return len(grid) % 4 == 0 and np.array_equal(np.frombuffer(grid, dtype="<i4"), np.arange(len(grid) // 4))


def build_rule(step: int, world_size: int, m: Manifest, rank_local: Optional[List[KeyPath]]) -> bytes:
    """The map's bytes from this rank's manifest ``m`` (whose layout every rank shares: see :func:`layout`)
    and the rank-local paths rank 0 found. The same inputs give the same bytes on any rank."""
    grids, index = _meshes(m)
    keys = []
    for n in m.nodes:
        if n.kind == "dtensor":
            info = n.payload.shard
            keys.append([key_hash(n.path), index[_mesh_key(info)], list(info.global_shape), list(info.mesh),
                         list(info.placements)])
    # a grid equal to arange over its shape (a mesh of ranks 0..n-1 in order: the common case) is written nil:
    # the map's only O(N) part was 4 bytes a rank of it (issue 29)
    meshes = [[list(shape), None if _is_arange(g) else g] for shape, g in grids]
    # rule 2: a mesh may list the slices of a sub-mesh (a leading slice dim); rule 1 readers cannot read that
    rule = 2 if any(len(shape) != len(info) for (shape, _), info in
                    zip((grids[k[1]] for k in keys), (k[3] for k in keys))) else 1
    return frame("shards", {"step": step, "world_size": world_size, "rule": rule, "meshes": meshes, "keys": keys,
                            "rank_local": None if rank_local is None else [list(p) for p in rank_local]},
                 SHARDS_FORMAT, compress=True)


def owner_ranks(step: int, world_size: int, m: Manifest, limit: int = 16) -> Optional[List[int]]:
    """The ranks other than ``m.rank`` that own a chunk of ``m``'s sharded keys by the map's rule (for each
    shard the rank holding the same box on rank 0's coordinates of the replicated mesh dims: what
    :meth:`ShardMap.ranks` gives with ``prefer=0``), plus rank 0 (the owner of plain values every rank holds
    alike), sorted; ``None`` when ``m``'s layout does not follow torch's rule or more than ``limit`` ranks own
    its chunks. An uploader of a node-local root leaves those chunks to their owner's root and confirms them by
    the owner's manifest row (issue 29: past ``mtable.INLINE_ROWS`` ranks a root holds only its own ranks'
    rows, so its leader is given these owners' rows too). Cost: O(``m``'s sharded keys), no I/O: ~0.1 s for a
    70B-shaped FSDP2 manifest (3,627 keys), so callers cache it by :func:`layout` digest."""
    if not layout(m, m.rank)[1]:
        return None
    smap = ShardMap.decode(build_rule(step, world_size, m, None), step=step, world_size=world_size,
                           what="this rank's shard map")
    out = {0}
    for n in m.nodes:
        if n.kind == "dtensor":
            owner = smap.owner(n)
            if owner is not None:
                out.add(owner)
                if len(out) > limit + 1:
                    return None
    out.discard(m.rank)
    return sorted(out)


class _Rule:
    """The rule half of a map: per key (mesh index, global shape, parsed placements or None), per mesh (shape,
    rank grid). A mesh with more dims than a key's placements lists the slices of a sub-mesh: the leading dims
    are replicas (:func:`_lead`)."""

    def __init__(self, meshes: List[Tuple[Tuple[int, ...], np.ndarray]],
                 keys: Dict[bytes, Tuple[int, Tuple[int, ...], Optional[Parsed]]]):
        self.meshes, self.keys = meshes, keys
        self._members: Dict[int, set] = {}
        self._prefs: Dict[Tuple[int, int], Tuple[int, ...]] = {}

    def _pref(self, mi: int, prefer: int) -> Tuple[int, ...]:
        """``prefer``'s coordinate on mesh ``mi`` (a rank off the mesh: the one at flat position ``prefer``
        modulo its size), found once per mesh and rank (a search of the rank grid: O(mesh size))."""
        got = self._prefs.get((mi, prefer))
        if got is None:
            shape, grid = self.meshes[mi]
            pos = np.flatnonzero(grid == prefer)
            got = self._prefs[(mi, prefer)] = tuple(int(x) for x in np.unravel_index(
                int(pos[0]) if len(pos) else prefer % len(grid), shape))
        return got

    def members(self, mi: int) -> set:
        got = self._members.get(mi)
        if got is None:
            got = self._members[mi] = set(int(x) for x in self.meshes[mi][1])
        return got

    def mismatch(self, h: bytes, shard, box: Box, rank: int, coords: Dict[int, Any]) -> Optional[str]:
        """Why the rule for key ``h`` does not give ``rank`` the saved ``shard`` (a manifest's
        :class:`~ckptstore.state.sharding.ShardInfo`) at ``box``; ``None`` when it does (or the key's placements are
        not walked). ``coords``: mesh index -> ``rank``'s coordinate, filled as meshes are met."""
        mi, g, parsed = self.keys[h]
        shape, grid = self.meshes[mi]
        if tuple(g) != tuple(shard.global_shape) or tuple(shape[len(shape) - len(shard.mesh):]) != \
                tuple(shard.mesh) or len(shard.mesh) > len(shape):
            return (f"global shape {list(g)} on a mesh of {list(shape)}, the manifest says {list(shard.global_shape)} "
                    f"on {list(shard.mesh)}")
        if parsed != parse_placements(shard.placements):
            return f"placements differ from the manifest's {list(shard.placements)}"
        if parsed is None:
            return None
        if mi not in coords:
            pos = np.flatnonzero(grid == rank)
            coords[mi] = tuple(int(x) for x in np.unravel_index(int(pos[0]), shape)) if len(pos) == 1 else None
        if coords[mi] is None or not _same_box(rule_box(g, shape, coords[mi], _lead(parsed, shape)), box):
            return f"the rule's box for the rank is not the manifest's (offset {list(box[0])}, shape {list(box[1])})"
        return None

    def ranks(self, h: bytes, global_shape: Tuple[int, ...], box: Box, prefer: int) -> Optional[List[int]]:
        info = self.keys.get(h)
        if info is None or info[2] is None or tuple(info[1]) != tuple(global_shape):
            return None
        mi, g, parsed = info
        shape, grid = self.meshes[mi]
        if 0 in box[1]:
            return []
        pref = self._pref(mi, prefer)
        # a leaf: a coordinate prefix and, per tensor dim sharded so far, what it holds there (intervals)
        leaves: List[Tuple[Tuple[int, ...], Dict[int, Intervals]]] = [((), {})]
        for i, (kind, d, sf) in enumerate(_lead(parsed, shape)):
            n, nxt = shape[i], []
            for coord, hold in leaves:
                if kind == "R":
                    nxt.append((coord + (int(pref[i]),), hold))
                    continue
                lo, hi = box[0][d], box[0][d] + box[1][d]
                iv = hold.get(d, [(0, g[d])])
                total = sum(x for _, x in iv)
                for c in _candidates(iv, total, kind, sf, n, lo, hi):
                    got = _split(iv, kind, sf, n, c)
                    if any(a < hi and a + x > lo for a, x in got):
                        nxt.append((coord + (c,), {**hold, d: got}))
            leaves = nxt
        return sorted({int(grid[np.ravel_multi_index(c, shape)]) for c, _ in leaves})


def _candidates(iv: Intervals, total: int, kind: str, sf: int, n: int, lo: int, hi: int) -> List[int]:
    """The coordinates of a mesh dim of ``n`` whose part of ``iv`` (see :func:`_split`) may meet ``[lo, hi)``:
    the chunks holding the positions (in the concatenation of ``iv``) of the elements in ``[lo, hi)``, found
    by division (no pass over the ``n`` coordinates)."""
    spans, pos = [], 0                 # positions in the concatenation of iv whose elements are in [lo, hi)
    for a, x in iv:
        s0, s1 = max(a, lo), min(a + x, hi)
        if s0 < s1:
            spans.append((pos + s0 - a, pos + s1 - a))
        pos += x
    out: set = set()
    pieces = [(total, 0)] if kind == "S" else [_chunk(total, sf, j) for j in range(sf)]
    for psz, po in pieces:
        if psz == 0:
            continue
        per = -(-psz // n)                                  # torch.chunk's chunk size
        for s0, s1 in spans:
            s0, s1 = max(s0, po), min(s1, po + psz)
            if s0 < s1:
                out.update(range((s0 - po) // per, min(n - 1, (s1 - 1 - po) // per) + 1))
    return sorted(out)


class ShardMap:
    """A decoded, validated shard map. ``rank_local``: top-most rank-local paths (``None``: unknown)."""

    def __init__(self, world_size: int, boxes: Optional[Dict[bytes, List[Tuple[int, Box]]]],
                 rank_local: Optional[List[KeyPath]], rule: Optional[_Rule] = None):
        self.world_size, self._boxes, self.rank_local, self._rule = world_size, boxes, rank_local, rule
        self._indexes: Dict[bytes, ShardIndex] = {}

    @staticmethod
    def decode(data: bytes, *, step: int, world_size: int, what: str) -> "ShardMap":
        """Raises ``CorruptCheckpointError`` (naming ``what``) for damaged or inconsistent bytes."""
        body, _ = unframe(data, "shards", what=what, step=step)
        try:
            if body.get("step") != step or body.get("world_size") != world_size:
                raise ValueError(f"map is for step {body.get('step')!r}, world size {body.get('world_size')!r}")
            rl = body.get("rank_local")
            if rl is not None:
                if not isinstance(rl, list) or not all(
                        isinstance(p, list) and p and all(isinstance(x, (str, int)) for x in p) for p in rl):
                    raise ValueError("bad rank-local paths")
                rl = [tuple(p) for p in rl]
            if body.get("rule") in (1, 2):
                return ShardMap(world_size, None, rl, _decode_rule(body, world_size))
            boxes: Dict[bytes, List[Tuple[int, Box]]] = {}
            for h, shards in body["boxes"]:
                if not isinstance(h, bytes) or len(h) != 8 or not isinstance(shards, list):
                    raise ValueError("bad key hash")
                if not shards:                  # the writer listed a key for the boxes ranks saved of it
                    raise ValueError(f"key hash {h.hex()} has no boxes")
                out = []
                for r, off, shape in shards:
                    if (not isinstance(r, int) or not 0 <= r < world_size or len(off) != len(shape)
                            or not all(isinstance(x, int) and x >= 0 for x in list(off) + list(shape))):
                        raise ValueError(f"bad box {[r, off, shape]!r:.80}")
                    out.append((r, (tuple(off), tuple(shape))))
                boxes[h] = out
            return ShardMap(world_size, boxes, rl)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError) as e:
            # any schema a map does not have (a list where a map was, a field missing, a short record): invalid
            kind = "" if isinstance(e, ValueError) else f"{type(e).__name__}: "
            raise CorruptCheckpointError(f"invalid shard map: {kind}{e}", step=step, blob=what) from None

    def check_manifest(self, m: Manifest, step: int) -> None:
        """Raise ``CorruptCheckpointError`` unless the map describes ``m`` (one rank's manifest: the truth) as it
        is: the sharded keys the map says ``m.rank`` saved shards of are exactly ``m``'s, and for each the map
        gives ``m.rank`` the box ``m`` records (rule form: the same global shape, mesh shape and placements, and
        the rule's box for the rank's coordinate; box form: a box of that rank). A reader checks the map against
        the manifest it reads first and uses it only when this passes (FORMAT.md "Shard map": the map is a hint;
        when it is damaged the reader reads every manifest). Cost: O(``m``'s sharded keys), no I/O."""
        rank = m.rank
        nodes = {key_hash(n.path): n for n in m.nodes if n.kind == "dtensor"}
        if self._rule is not None:
            want = {h for h, (mi, _, _) in self._rule.keys.items() if rank in self._rule.members(mi)}
        else:
            want = {h for h, shards in self._boxes.items() if any(r == rank for r, _ in shards)}
        have = set(nodes)
        if have != want:
            raise CorruptCheckpointError(f"rank {rank}'s manifest holds {len(have)} sharded keys, the step's shard "
                                         f"map says {len(want)} ({len(want - have)} missing, {len(have - want)} "
                                         "unknown)", step=step)
        coords: Dict[int, Any] = {}
        for h, n in nodes.items():
            e = n.payload
            box = (tuple(e.shard.offset), tuple(e.shape))
            if self._rule is not None:
                why = self._rule.mismatch(h, e.shard, box, rank, coords)
            else:
                why = None if any(r == rank and _same_box(b, box) for r, b in self._boxes[h]) else \
                    f"no box of rank {rank} is the manifest's (offset {list(box[0])}, shape {list(box[1])})"
            if why is not None:
                raise CorruptCheckpointError(f"the shard map does not describe rank {rank}'s shard of "
                                             f"{path_str(n.path)!r}: {why}", step=step, key=path_str(n.path))

    def owner(self, n) -> Optional[int]:
        """The owner rank of DTensor manifest node ``n``'s shard (FORMAT.md "One uploader per object"): the one
        saved rank :meth:`ranks` gives for its box with ``prefer=0``, or ``None`` (no such single rank)."""
        e = n.payload
        got = self.ranks(n.path, tuple(e.shard.global_shape), (tuple(e.shard.offset), tuple(e.shape)), 0)
        return got[0] if got is not None and len(got) == 1 else None

    def ranks(self, path: KeyPath, global_shape: Tuple[int, ...], box: Box, prefer: int) -> Optional[List[int]]:
        """The saved ranks whose shards of ``path`` overlap ``box`` (one rank per replicated box: the one on
        ``prefer``'s coordinates of the replicated mesh dims, or those of saved rank ``prefer % world_size`` for a
        reader beyond the saved world, so the replicas of every key come from the same few manifests); ``None``
        when the map does not know the key (or cannot walk its placements)."""
        h = key_hash(path)
        if self._rule is not None:          # a reader beyond the saved world reads as saved rank prefer % world
            return self._rule.ranks(h, tuple(global_shape), box, prefer % self.world_size)
        index = self._indexes.get(h)
        if index is None:
            saved = self._boxes.get(h)
            if saved is None:
                return None
            ordered = sorted(saved, key=lambda rb: rb[0] != prefer)       # stable: then by rank
            index = self._indexes[h] = ShardIndex(tuple(global_shape), (SavedShard(b, None, r) for r, b in ordered))
        return sorted({s.rank for s, _ in index.overlapping(box)})


def _decode_rule(body: Dict[str, Any], world_size: int) -> _Rule:
    rule = body["rule"]
    meshes = []
    for item in body["meshes"]:
        shape, grid = item
        if (not isinstance(shape, list) or not 1 <= len(shape) <= 16
                or not all(isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= world_size for x in shape)):
            raise ValueError(f"bad mesh shape {shape!r:.80}")
        size = int(np.prod(shape))
        if grid is None and size <= world_size:          # nil: ranks 0..size-1 in mesh order (issue 29)
            grid = np.arange(size, dtype="<i4").tobytes()
        if not isinstance(grid, bytes) or size > world_size or len(grid) != 4 * size:
            raise ValueError(f"bad rank grid for mesh {shape}")
        ranks = np.frombuffer(grid, dtype="<i4")
        if ranks.min() < 0 or ranks.max() >= world_size or len(np.unique(ranks)) != size:
            raise ValueError(f"rank grid of mesh {shape} names ranks outside 0..{world_size - 1} or twice")
        meshes.append((tuple(shape), ranks))
    keys: Dict[bytes, Tuple[int, Tuple[int, ...], Optional[Parsed]]] = {}
    for item in body["keys"]:
        h, mi, g, mesh, placements = item
        if not isinstance(h, bytes) or len(h) != 8 or h in keys:
            raise ValueError("bad key hash")
        if not isinstance(mi, int) or not 0 <= mi < len(meshes) or not isinstance(mesh, list):
            raise ValueError(f"bad mesh index {mi!r:.20}")
        lead = len(meshes[mi][0]) - len(mesh)          # rule 2: a slice dim may lead (a sub-mesh's slices)
        if lead not in ((0, 1) if rule == 2 else (0,)) or list(mesh) != list(meshes[mi][0][lead:]):
            raise ValueError(f"key's mesh {mesh!r:.40} is not mesh {mi}'s {list(meshes[mi][0])}")
        if (not isinstance(g, list) or not 1 <= len(g) <= 64
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 48 for x in g)):
            raise ValueError(f"bad global shape {g!r:.80}")
        if (not isinstance(placements, list) or len(placements) != len(mesh)
                or not all(isinstance(p, str) and len(p) < 64 for p in placements)):
            raise ValueError(f"bad placements {placements!r:.80}")
        parsed = parse_placements(placements)
        if parsed is not None and any(k != "R" and d >= len(g) for k, d, _ in parsed):
            raise ValueError(f"placements {placements} shard a dim the global shape {g} lacks")
        if parsed is not None and any(sf > world_size for _, _, sf in parsed):
            raise ValueError(f"placements {placements} split a dim into more pieces than there are ranks")
        keys[h] = (mi, tuple(g), parsed)
    return _Rule(meshes, keys)
