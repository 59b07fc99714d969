"""Sharded values: what a rank's shard of a DTensor is, and how saved shards fill any other sharding.

**Saving.** A ``torch.distributed.tensor.DTensor`` (FSDP2 ``fully_shard``, tensor parallel, 2-D meshes, the
values of ``get_state_dict``) is stored as its *local shard* only, like any tensor (chunked, content-addressed,
deduplicated), plus a :class:`ShardInfo`: the global shape, the shard's offset in it, the mesh shape and the
placements. The box ``[offset, offset + local shape)`` is where torch puts the local tensor's elements
(:func:`dtensor_box`): what :func:`torch.distributed.tensor._utils.compute_local_shape_and_global_offset` gives
(the description DCP's planner writes), except with ``_StridedShard`` placements, where that function is wrong
for uneven shards and the box follows torch's sharding order (:func:`placed_box`, issue 29). ``Partial``
placements (unreduced values) are refused: they are not a value until reduced; so is a local tensor that is
several pieces of the global one (no box describes it).

**Loading (resharding).** A target is a box of the global tensor: a DTensor's local shard under *its* current
mesh and placements, or the whole tensor for a plain target. For each target, :func:`plan` finds the saved
shards that overlap it and :func:`fill` copies the overlapping regions in, reading only the chunks that hold
them (ranged reads of packs, whole blobs otherwise), each verified against its id, in slabs of at most
``slab_bytes`` so the extra memory is a few chunks, not a copy of the state.

Planning is per target: saved shards of a key are sorted once by their offset in dim 0, and each target looks
up the candidates by bisection (no pass over every pair of saved and target shards, so thousands of ranks and
tensors stay cheap). Replicated shards (the same box saved by several ranks) are read once.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..util.errors import CorruptCheckpointError

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]       # (offset, shape)
MAX_DIMS = 64


@dataclass(frozen=True)
class ShardInfo:
    """Where a saved local shard sits in its global tensor.

    ``global_shape``: the full tensor's shape. ``offset``: the shard's first index in each dim (the shard's
    own shape is the manifest entry's ``shape``). ``mesh``: the device mesh's shape at save time.
    ``placements``: one string per mesh dim, as torch prints them (``"S(0)"``, ``"R"``, ``"_S(0, 2)"``);
    informational (the box alone drives resharding). ``grid``: at save time only (never in a manifest), the
    mesh's ranks in mesh order as little-endian int32 bytes, one object shared by every DTensor of the same
    mesh (the step's shard map records it once: :mod:`ckptstore.format.shardmap`); for a sub-mesh (FSDP2's
    ``dp`` of a ``dp x tp`` mesh) the ranks of every slice of it, slice by slice (:func:`mesh_grid`).
    """
    global_shape: Tuple[int, ...]
    offset: Tuple[int, ...]
    mesh: Tuple[int, ...] = ()
    placements: Tuple[str, ...] = ()
    grid: Optional[bytes] = field(default=None, compare=False, repr=False)

    def encode(self) -> Dict[str, Any]:
        return {"global_shape": list(self.global_shape), "offset": list(self.offset), "mesh": list(self.mesh),
                "placements": list(self.placements)}

    @staticmethod
    def decode(d: Any, local_shape: Tuple[int, ...], where: str) -> "ShardInfo":
        """Validate a manifest's shard record against the entry's shape. Raises ``ValueError``."""
        if not isinstance(d, dict):
            raise ValueError(f"{where}: shard record is not a map")

        def ints(name, hi):
            v = d.get(name)
            if not isinstance(v, list) or len(v) > MAX_DIMS or not all(
                    isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= hi for x in v):
                raise ValueError(f"{where}: bad shard {name} {v!r:.80}")
            return tuple(v)
        g, o, m = ints("global_shape", 1 << 48), ints("offset", 1 << 48), ints("mesh", 1 << 24)
        p = d.get("placements", [])
        if not isinstance(p, list) or len(p) != len(m) or not all(isinstance(x, str) and len(x) < 64 for x in p):
            raise ValueError(f"{where}: bad shard placements {p!r:.80}")
        if not (len(g) == len(o) == len(local_shape)):
            raise ValueError(f"{where}: shard of rank {len(local_shape)} in a global tensor of rank {len(g)}")
        for dim, (gs, off, ls) in enumerate(zip(g, o, local_shape)):
            if off + ls > gs:
                raise ValueError(f"{where}: shard [{off}, {off + ls}) exceeds global size {gs} in dim {dim}")
        return ShardInfo(g, o, m, tuple(p))


# -- placements as rules over intervals (the shard map walks the same rules: ckptstore.format.shardmap) ------
_S_RE = re.compile(r"S\((\d+)\)")
_SS_RE = re.compile(r"_S\((\d+), (\d+)\)")         # torch's str(_StridedShard(dim, split_factor=sf))

Parsed = List[Tuple[str, int, int]]                 # (kind "S" / "SS" / "R", tensor dim, split factor)


def parse_placements(placements: Sequence[str]) -> Optional[Parsed]:
    """``("_S(0, 2)", "S(0)", "R")`` -> ``[("SS", 0, 2), ("S", 0, 1), ("R", -1, 1)]``; ``None`` when some
    placement is none of these (not walked)."""
    out = []
    for p in placements:
        if p == "R":
            out.append(("R", -1, 1))
            continue
        m = _S_RE.fullmatch(p)
        if m is not None:
            out.append(("S", int(m.group(1)), 1))
            continue
        m = _SS_RE.fullmatch(p)
        if m is None or int(m.group(2)) < 1:
            return None
        out.append(("SS", int(m.group(1)), int(m.group(2))))
    return out


def _chunk(size: int, n: int, c: int) -> Tuple[int, int]:
    """(size, offset) of chunk ``c`` of ``n`` of ``size`` elements, as torch's ``Shard`` splits a dim
    (``torch.chunk``: ceil(size / n) each, the last ones shorter or empty). Written out (torch's own
    ``Shard.local_shard_size_and_offset`` costs ~80 us a call); a save whose boxes differ from it writes no
    map (:func:`layout`), so a change of torch's rule cannot make a reader trust a wrong map."""
    per = -(-size // n)
    off = min(c * per, size)
    return max(0, min(size, off + per) - off), off


Intervals = List[Tuple[int, int]]                   # (offset, size) along one dim, in the local shard's order


def _select(iv: Intervals, start: int, n: int) -> Intervals:
    """Elements ``[start, start + n)`` of the concatenation of ``iv``, as intervals of the global dim."""
    out, pos, end = [], 0, start + n
    for a, s in iv:
        lo, hi = max(start, pos), min(end, pos + s)
        if lo < hi:
            out.append((a + lo - pos, hi - lo))
        pos += s
        if pos >= end:
            break
    return out


def _split(iv: Intervals, kind: str, sf: int, n: int, c: int) -> Intervals:
    """What coordinate ``c`` of a mesh dim of ``n`` keeps of a dim holding ``iv``: ``S`` takes chunk ``c`` of
    the concatenation (torch.chunk); ``SS`` (``_StridedShard(d, split_factor=sf)``, FSDP2 over tensor parallel)
    chunks it into ``sf`` pieces, each piece into ``n``, and takes chunk ``c`` of every piece, in piece order
    (torch's ``_StridedShard._split_tensor``). The result may be several intervals (a strided shard)."""
    total = sum(s for _, s in iv)
    if kind == "S":
        sz, o = _chunk(total, n, c)
        return _select(iv, o, sz)
    out: Intervals = []
    for j in range(sf):
        psz, po = _chunk(total, sf, j)
        ssz, so = _chunk(psz, n, c)
        out += _select(iv, po + so, ssz)
    return out


def _merge(iv: Intervals) -> Intervals:
    """``iv`` with consecutive intervals that continue each other joined (the local order is kept)."""
    out: List[List[int]] = []
    for a, s in iv:
        if out and out[-1][0] + out[-1][1] == a:
            out[-1][1] += s
        else:
            out.append([a, s])
    return [(a, s) for a, s in out]


def shard_order(parsed: Parsed, mesh_shape: Sequence[int]) -> Optional[Dict[int, List[int]]]:
    """Per sharded tensor dim, the mesh dims that shard it, in the order torch applies them to the data; ``None``
    when some ``_StridedShard``'s split factor fits no order. torch's rule (``DTensorSpec.
    _maybe_convert_StridedShard_to_shard_order``, torch >= 2.9): placements are read right to left; a ``Shard``
    goes first (split factor 1), a ``_StridedShard(d, sf)`` after the mesh dims (in the order so far) whose sizes
    multiply to ``sf``. FSDP2 + tensor parallel's ``(_S(d, tp), S(d))`` is thus ``tp`` then ``dp``: each tp
    shard chunked over dp, as ``fully_shard`` chunks the tensor parallel local tensor. Without ``_S`` placements
    the order is left to right, as for ``Shard``."""
    order: Dict[int, List[int]] = {}
    for md in reversed(range(len(parsed))):
        kind, d, sf = parsed[md]
        if kind == "R":
            continue
        dims = order.setdefault(d, [])
        acc = 1
        for i in range(len(dims) + 1):
            if acc == sf:
                dims.insert(i, md)
                break
            if i < len(dims):
                acc *= mesh_shape[dims[i]]
        else:
            return None
    return order


def placed_box(global_shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
               parsed: Parsed) -> Optional[Box]:
    """The box ``(offset, shape)`` of the global tensor whose elements the mesh coordinate ``coord`` holds, as
    torch places them: in :func:`shard_order` when the placements have one (each mesh dim chunking what the
    previous ones left, ``torch.chunk``'s sizes: always one box), else left to right by
    ``_StridedShard._split_tensor`` (:func:`_split`), which may leave a coordinate several disjoint pieces: then
    ``None`` (no one box describes that local tensor). An empty shard's offset is the dim's size, as torch's.

    Not ``compute_local_shape_and_global_offset``: it applies ``_StridedShard`` left to right whatever the
    order, which differs from the data FSDP2 + tensor parallel hold (and from ``redistribute``) when a dim
    does not split evenly: a 13-row weight on a 3 x 2 (dp x tp) mesh is held as rows ``[6, 7)`` by
    coordinate (2, 0) and ``[11, 13)`` by (2, 1); it says ``[6, 8)`` and ``[12, 13)`` (issue 29)."""
    off, size = [0] * len(global_shape), [int(n) for n in global_shape]
    order = shard_order(parsed, mesh_shape)
    if order is not None:
        for d, dims in order.items():
            for md in dims:
                size[d], o = _chunk(size[d], mesh_shape[md], coord[md])
                off[d] += o
    else:
        hold: Dict[int, Intervals] = {}
        for (kind, d, sf), n, c in zip(parsed, mesh_shape, coord):
            if kind != "R":
                hold[d] = _split(hold.get(d, [(0, global_shape[d])]), kind, sf, n, c)
        for d, iv in hold.items():
            iv = _merge(iv)
            if len(iv) > 1:
                return None
            off[d], size[d] = iv[0] if iv else (0, 0)
    for d, n in enumerate(size):
        if n == 0:
            off[d] = int(global_shape[d])
    return tuple(off), tuple(size)


def is_dtensor(value: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (checked without importing torch.distributed)."""
    return isinstance(value, torch.Tensor) and type(value).__name__ == "DTensor" and hasattr(value, "placements")


def local_shard(t) -> Tuple[torch.Tensor, ShardInfo]:
    """A DTensor's local tensor and its :class:`ShardInfo` (its box: :func:`dtensor_box`). Raises ``TypeError``
    for ``Partial`` placements and for a local tensor that is not one box of the global tensor."""
    from torch.distributed.tensor import Partial
    if any(isinstance(p, Partial) for p in t.placements):
        raise TypeError(f"a DTensor with Partial placements {tuple(t.placements)} holds unreduced values: "
                        "redistribute it to Shard/Replicate before saving")
    local = t.to_local()
    offset, _ = dtensor_box(t, local)
    return local, ShardInfo(tuple(int(s) for s in t.shape), offset,
                            tuple(int(s) for s in t.device_mesh.shape), tuple(str(p) for p in t.placements),
                            mesh_grid(t.device_mesh))


def dtensor_box(t, local: Optional[torch.Tensor] = None) -> Box:
    """The box of the global tensor that DTensor ``t``'s local tensor holds on this rank.

    With a ``_StridedShard`` placement, the box torch places the data in (:func:`placed_box`); otherwise (and
    where the rank is outside the mesh or a placement is of another kind) torch's
    ``compute_local_shape_and_global_offset``, DCP's description of a shard. Raises ``TypeError`` when the
    placements leave this rank several pieces of a dim (a ``_StridedShard`` whose split factor fits no sharding
    order, e.g. ``(S(0), _S(0, 2))``: not FSDP2's) or the box's shape is not the local tensor's: ckptstore saves
    and fills one box per rank and key, and refuses rather than place elements where they do not belong."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    local = t.to_local() if local is None else local
    names = [str(p) for p in t.placements]
    parsed = parse_placements(names) if any(n.startswith("_S(") for n in names) else None
    coord = t.device_mesh.get_coordinate() if parsed is not None else None
    if parsed is not None and coord is not None:
        box = placed_box(tuple(int(s) for s in t.shape), tuple(int(s) for s in t.device_mesh.shape),
                         [int(c) for c in coord], parsed)
        if box is None:
            raise TypeError(f"DTensor placements {tuple(names)} leave this rank (mesh coordinate {list(coord)}) "
                            f"several pieces of the global tensor {tuple(t.shape)}, not one box: ckptstore cannot "
                            "place it (redistribute it, e.g. to the placements FSDP2 + tensor parallel use)")
        offset, shape = box
    else:
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    offset, shape = tuple(int(o) for o in offset), tuple(int(s) for s in shape)
    if shape != tuple(local.shape):
        raise TypeError(f"DTensor local shard has shape {tuple(local.shape)}, its placements "
                        f"{tuple(t.placements)} say {shape}: cannot place it")
    return offset, shape


_GRIDS: Dict[int, Tuple[Any, bytes]] = {}       # id(mesh) -> (mesh, its grid): a few long-lived meshes


def mesh_grid(mesh) -> Optional[bytes]:
    """A device mesh's ranks in mesh order, int32 little-endian (cached per mesh object); ``None`` if
    unavailable. For a sub-mesh of a larger mesh (``mesh["dp"]`` of a ``dp x tp`` mesh: rank 0 sees ranks
    ``[0, 2]``, rank 1 ``[1, 3]``) the ranks of *every* slice of it, shape ``(slices, *mesh.shape)``, as
    torch's ``DeviceMesh`` lays them out (``_layout.remap_to_tensor(_rank_map)``, the tensor its ``mesh``
    property slices its own ranks from): the same bytes on every rank, so the step's shard map can describe
    the sub-mesh's DTensors (the norms of FSDP2 + TP) by rule. Just the mesh's own ranks where that is not
    available (an older torch) or does not hold them."""
    hit = _GRIDS.get(id(mesh))
    if hit is not None and hit[0] is mesh:
        return hit[1]
    try:
        own = mesh.mesh.to(torch.int32).contiguous().cpu()
    except Exception:                  # pragma: no cover - a mesh type without a rank grid
        return None
    grid = own
    try:
        every = mesh._layout.remap_to_tensor(mesh._rank_map).to(torch.int32).cpu().reshape(-1, *own.shape)
        if any(torch.equal(s, own) for s in every):
            grid = every.contiguous()
    except Exception:                  # a torch without CuTe mesh layouts: own ranks only
        pass
    grid = grid.numpy().astype("<i4").tobytes()
    if len(_GRIDS) >= 64:
        _GRIDS.clear()
    _GRIDS[id(mesh)] = (mesh, grid)
    return grid


def target_box(t) -> Box:
    """The box of the global tensor that target ``t`` holds: its local shard for a DTensor (:func:`dtensor_box`,
    which raises ``TypeError`` for a local tensor that is not one box), else all of it."""
    if is_dtensor(t):
        return dtensor_box(t)
    return (0,) * t.dim(), tuple(t.shape)


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The intersection of two boxes, ``None`` when empty (a 0-d box intersects a 0-d box)."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


@dataclass
class SavedShard:
    """One saved shard of a key: its box and what reads it (``entry``: the manifest's ArrayEntry; ``rank``)."""
    box: Box
    entry: Any
    rank: int


class ShardIndex:
    """The saved shards of one key, sorted for lookup by dim-0 offset. Same-box shards (replicas) count once,
    the first rank's (a rank's own shard is preferred by passing it first)."""

    def __init__(self, global_shape: Tuple[int, ...], shards: Iterable[SavedShard]):
        self.global_shape = global_shape
        seen, uniq = set(), []
        for s in shards:
            if s.box not in seen:
                seen.add(s.box)
                uniq.append(s)
        uniq.sort(key=lambda s: s.box[0][0] if s.box[0] else 0)
        self.shards = uniq
        self._starts = [s.box[0][0] if s.box[0] else 0 for s in uniq]
        self._max_len = max((s.box[1][0] if s.box[1] else 1 for s in uniq), default=0)

    def overlapping(self, box: Box) -> List[Tuple[SavedShard, Box]]:
        """Saved shards overlapping ``box`` with the overlap, by bisection on dim 0."""
        if not box[0]:                                   # 0-d: every shard is the whole value
            return [(s, box) for s in self.shards[:1]]
        lo, hi = box[0][0], box[0][0] + box[1][0]
        first = bisect.bisect_left(self._starts, lo - self._max_len + 1) if self._max_len else 0
        out = []
        for s in self.shards[first: bisect.bisect_left(self._starts, hi)]:
            r = intersect(box, s.box)
            if r is not None:
                out.append((s, r))
        return out

    def check_covers(self, box: Box, overlaps: List[Tuple[SavedShard, Box]], where: str) -> None:
        """Raise ``CorruptCheckpointError`` unless the overlaps cover every element of ``box`` exactly once:
        they are pairwise disjoint (saved shards of one key never overlap except as identical replicas, which
        the index keeps once) and their sizes add up to the box's. Counting alone is not enough: a shard moved
        to overlap another by k rows leaves k rows uncovered with the same count (issue 17). Disjointness is
        checked by a sweep along dim 0 (sorted once; each overlap is compared only with those whose dim-0 range
        it meets), not all pairs."""
        want = _numel(box[1])
        got = sum(_numel(r[1]) for _, r in overlaps)
        if got != want:
            raise CorruptCheckpointError(f"saved shards cover {got} of the {want} elements this rank needs "
                                         f"(box offset {list(box[0])}, shape {list(box[1])})", key=where)
        if not box[0]:                                   # 0-d: one value
            if len(overlaps) > 1:
                raise CorruptCheckpointError("several saved shards of a 0-d value", key=where)
            return
        active: List[Tuple[int, SavedShard, Box]] = []   # (dim-0 end, shard, overlap) meeting the sweep line
        for shard, region in sorted(overlaps, key=lambda o: o[1][0][0]):
            start = region[0][0]
            active = [a for a in active if a[0] > start]
            for _, other, prev in active:
                if intersect(prev, region) is not None:
                    raise CorruptCheckpointError(
                        f"saved shards of rank {other.rank} (offset {list(other.box[0])}, shape "
                        f"{list(other.box[1])}) and rank {shard.rank} (offset {list(shard.box[0])}, shape "
                        f"{list(shard.box[1])}) overlap: the step's shards do not tile the tensor", key=where)
            active.append((start + region[1][0], shard, region))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _strides(shape: Sequence[int]) -> Tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


def fill(dst: torch.Tensor, dst_box: Box, shard: SavedShard, region: Box, read_span, *,
         slab_bytes: int = 16 << 20) -> None:
    """Copy ``region`` (global coordinates) of a saved shard into ``dst`` (holding ``dst_box``).

    ``read_span(entry, byte_lo, byte_hi) -> torch.uint8 tensor`` returns the saved shard's flat bytes
    ``[byte_lo, byte_hi)``, verified. Rows of the region (dim 0) are read in slabs of about ``slab_bytes``.
    """
    entry = shard.entry
    src_off, src_shape = shard.box
    dtype = dst.dtype
    item = dst.element_size()
    rel_src = tuple(r - o for r, o in zip(region[0], src_off))
    rel_dst = tuple(r - o for r, o in zip(region[0], dst_box[0]))
    size = region[1]
    if not size:                                            # 0-d
        data = read_span(entry, 0, item)
        dst.copy_(data.view(dtype).reshape(()))
        return
    strides = _strides(src_shape)
    row_bytes = strides[0] * item
    rows_per_slab = max(1, slab_bytes // max(1, row_bytes))
    for r0 in range(0, size[0], rows_per_slab):
        nrows = min(rows_per_slab, size[0] - r0)
        first = (rel_src[0] + r0) * strides[0] + sum(i * s for i, s in zip(rel_src[1:], strides[1:]))
        last = (rel_src[0] + r0 + nrows - 1) * strides[0] + sum(
            (i + n - 1) * s for i, n, s in zip(rel_src[1:], size[1:], strides[1:]))
        data = read_span(entry, first * item, (last + 1) * item).view(dtype)
        src = data.as_strided((nrows,) + tuple(size[1:]), strides)
        view = dst
        for d, (lo, n) in enumerate(zip((rel_dst[0] + r0,) + rel_dst[1:], (nrows,) + tuple(size[1:]))):
            view = view.narrow(d, lo, n)
        view.copy_(src)
