"""Reading a committed step for one rank of the current run, whatever world size and mesh wrote it.

:class:`StepLoader` turns a step's manifests into the values ``resume`` / ``load`` apply:

* **plain values and tensors** come from one manifest: this rank's when the world size is unchanged, else
  rank 0's. With a changed world size, values that differ between the saved ranks are *rank-local* (per-rank
  RNG, data-loader position): ``rank_local="error"`` (default) raises ``IncompatibleCheckpointError`` naming
  them and both world sizes; ``"fresh"`` leaves them as they are in the target (logged). Values equal on every
  saved rank load on any world size. Everything here is read into fresh buffers and verified before anything
  is applied.
* **sharded values** (saved from DTensors): each target is filled from the saved shards that overlap it
  (:mod:`ckptstore.state.sharding`): a DTensor target **in place** (its local shard under its current mesh and
  placements), any other target as a new full tensor. Only the chunks holding the overlaps are read (ranged),
  each verified; extra memory is a few chunks. Other ranks' manifests are read only when this rank's own
  shards do not cover its targets (a changed world size or mesh), and then only those the step's shard map
  (:mod:`ckptstore.format.shardmap`) names as overlapping, plus rank 0's.

Under ``torch.distributed`` (at resume), the chunks of plain values that every rank needs (replicated keys, the
identical tensors of data-parallel replicas, every plain value after a world-size change) are read by one rank
each and broadcast to the others (:mod:`ckptstore.distributed.fanout`, through ``share``); sharded values are read by
each rank as above.

In-place fills are the one exception to "apply nothing before everything is verified" (the price of not
holding a second copy of the model): a damaged chunk found halfway leaves some DTensor targets filled from the
step being read, and the caller must then load another step into them (resume falls back to an older step;
when none is valid it raises rather than start fresh). Plain values are still applied only after all reads.
"""
from __future__ import annotations

import bisect
import logging
from collections import OrderedDict
from concurrent.futures import Executor
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Set, Tuple

import torch

from ..util.errors import CorruptCheckpointError, IncompatibleCheckpointError
from ..format.manifest import Commit, Manifest
from ..format.packs import ReadItem, read_chunks
from .reader import wait_all
from ..state.sharding import SavedShard, ShardIndex, fill, is_dtensor, target_box
from ..format.shardmap import signatures, top_most
from ..state.flatten import TORCH_DTYPES, KeyPath, Node, path_str, unflatten

log = logging.getLogger("ckptstore")

RANK_LOCAL_MODES = ("error", "fresh")


class SpanReader:
    """Verified byte ranges of a saved array: reads the chunks covering ``[lo, hi)`` (whole chunks, since a
    chunk is verified against its id as a whole), keeping the last ``keep`` chunks for the next slab."""

    def __init__(self, blobs, executor: Executor, step: int, keep: int = 2):
        self.blobs, self.executor, self.step, self.keep = blobs, executor, step, keep
        self._cache: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        self._starts: Dict[int, List[int]] = {}

    def _chunk(self, c, key: str) -> torch.Tensor:
        hit = self._cache.get(c.blob_id)
        if hit is not None:
            self._cache.move_to_end(c.blob_id)
            return hit
        try:
            buf = torch.empty(c.nbytes, dtype=torch.uint8)
        except (RuntimeError, MemoryError) as e:
            raise CorruptCheckpointError(f"cannot allocate the {c.nbytes} bytes a chunk claims ({type(e).__name__})",
                                         step=self.step, key=key, blob=c.blob_id) from None
        mv = memoryview(buf.numpy()).cast("B")
        if c.pack is not None:
            for f in read_chunks(self.blobs.storage, [ReadItem(c, mv, self.step, key)], executor=self.executor):
                f.result()
        else:
            self.blobs.read_into(c.blob_id, c.codec, mv, step=self.step, key=key, base=c.base)
        self._cache[c.blob_id] = buf
        while len(self._cache) > self.keep:
            self._cache.popitem(last=False)
        return buf

    def read(self, entry, key: str, lo: int, hi: int) -> torch.Tensor:
        starts = self._starts.get(id(entry))
        if starts is None:
            starts, acc = [], 0
            for c in entry.chunks:
                starts.append(acc)
                acc += c.nbytes
            self._starts[id(entry)] = starts
        first = bisect.bisect_right(starts, lo) - 1
        parts, pos = [], starts[first]
        i = first
        while pos < hi:
            c = entry.chunks[i]
            parts.append(self._chunk(c, key))
            pos += c.nbytes
            i += 1
        data = parts[0] if len(parts) == 1 else torch.cat(parts)
        base = starts[first]
        return data[lo - base: hi - base]


def tensor_leaves(obj: Any, path: KeyPath = ()) -> Dict[KeyPath, Any]:
    """Every tensor (DTensors included) in a nested dict / list / tuple, by key path."""
    out: Dict[KeyPath, Any] = {}
    stack = [(path, obj)]
    while stack:
        p, v = stack.pop()
        if isinstance(v, torch.Tensor):
            out[p] = v
        elif isinstance(v, Mapping):
            stack.extend((p + (k,), x) for k, x in v.items())
        elif isinstance(v, (list, tuple)):
            stack.extend((p + (i,), x) for i, x in enumerate(v))
    return out


def value_at(obj: Any, path: KeyPath):
    """``(True, value)`` at ``path`` inside nested containers, ``(False, None)`` when absent."""
    for k in path:
        try:
            obj = obj[k]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, obj


class StepLoader:
    """One committed step, read for ``rank`` of a run of ``world_size`` (see the module docstring)."""

    def __init__(self, catalog, blobs, commit: Commit, *, rank: int, world_size: int, executor: Executor,
                 read_nodes: Callable[..., List[Node]], share=None):
        self.catalog, self.blobs, self.commit = catalog, blobs, commit
        self.share = share                          # a fanout.Session: plain chunks every rank needs, read once
        self.rank, self.world_size, self.executor = rank, world_size, executor
        self._read_nodes = read_nodes
        self.same_world = commit.world_size == world_size
        self._manifests: Dict[int, Manifest] = {}
        self._base: Optional[Manifest] = None
        self._by_path: Optional[Dict[KeyPath, List[SavedShard]]] = None
        self._sharded_nodes: Dict[int, Dict[KeyPath, Any]] = {}     # rank -> path -> ArrayEntry
        self._map: Any = False                      # the step's ShardMap; None: none / unreadable
        self.touched = False                        # some DTensor target was written in place
        self.manifests_read = 0                     # how many manifests this loader read

    def manifest(self, r: int) -> Manifest:
        m = self._manifests.get(r)
        if m is None:
            m = self._manifests[r] = self.catalog.read_manifest(self.commit, r)
            self.manifests_read += 1
        return m

    def shard_map(self):
        """The step's :class:`~ckptstore.format.shardmap.ShardMap` (read on first use: a changed world size or mesh)
        when the commit names one; ``None`` otherwise, or when it is missing, damaged, or does not describe
        :attr:`base` (the manifest read first: the truth) as it is (logged: every manifest is read instead, and
        checked against the others, see :meth:`_check_sharded_keys`). The map is a hint (FORMAT.md "Shard
        map"): no damage to it fails a step whose manifests are whole."""
        if self._map is False:
            self._map = None
            if self.commit.shards is not None:
                base = self.base                  # raises for a damaged manifest: that is no map's doing
                try:
                    smap = self.catalog.read_shard_map(self.commit)
                    smap.check_manifest(base, self.commit.step)
                    self._map = smap
                except (CorruptCheckpointError, IncompatibleCheckpointError) as e:     # damaged, or a newer format
                    log.warning("step %d: shard map unusable, reading every rank's manifest instead: %s",
                                self.commit.step, e)
        return self._map

    @property
    def base(self) -> Manifest:
        """The manifest plain values come from: this rank's (same world size) or rank 0's, with the keys saved
        as replicated (``Store.save(replicated=...)``) taken from rank 0's manifest."""
        if self._base is None:
            own = self.manifest(self.rank if self.same_world else 0)
            if own.replicated and own.rank != 0:
                r0 = self.manifest(0)
                if r0.replicated != own.replicated:
                    raise CorruptCheckpointError(
                        f"rank {own.rank}'s manifest reads the replicated keys {own.replicated} from rank 0, "
                        f"whose manifest names {r0.replicated}", step=self.commit.step)
                rep = set(own.replicated)
                own = own.replace(stateful=own.stateful + [k for k in r0.stateful if k in rep],
                                  nodes=own.nodes + [n for n in r0.nodes if n.path and n.path[0] in rep])
            self._base = own
        return self._base

    def saved_keys(self) -> Set[str]:
        return {n.path[0] for n in self.base.nodes if len(n.path) == 1}

    def sharded_keys(self) -> Set[str]:
        """Top-level keys holding saved DTensor shards (their targets are filled in place)."""
        return {n.path[0] for n in self.base.nodes if n.kind == "dtensor"}

    def rank_local_paths(self, wanted: Set[str]) -> List[KeyPath]:
        """Top-most paths under ``wanted`` whose plain values or structure differ between the saved ranks."""
        if self.same_world:
            return []
        m = self.shard_map()
        if m is not None and m.rank_local is not None:          # computed at save time from every rank
            return [p for p in m.rank_local if p[0] in wanted]
        sigs = [signatures(self.manifest(r), wanted) for r in range(self.commit.world_size)]
        paths = set().union(*(s.keys() for s in sigs))
        return top_most([p for p in paths if len({s.get(p) for s in sigs}) > 1])

    def _shards(self, path: KeyPath) -> List[SavedShard]:
        """Every saved shard of ``path`` over all ranks' manifests, this rank's first (read once, lazily)."""
        if self._by_path is None:
            by: Dict[KeyPath, List[SavedShard]] = {}
            order = list(range(self.commit.world_size))
            if self.rank in order:
                order.remove(self.rank)
                order.insert(0, self.rank)
            for r in order:
                for n in self.manifest(r).nodes:
                    if n.kind == "dtensor":
                        e = n.payload
                        by.setdefault(n.path, []).append(SavedShard((e.shard.offset, e.shape), e, r))
            self._by_path = by
        return self._by_path.get(path, [])

    def _overlaps(self, path: KeyPath, g, box, key: str):
        """The saved shards of ``path`` overlapping ``box``, with the overlaps, checked to cover it exactly.
        Through the shard map, only the manifests of the ranks it names are read; when those do not cover the
        box (a damaged or stale map), every manifest is. Raises ``CorruptCheckpointError``."""
        m = self.shard_map()
        ranks = m.ranks(path, g, box, prefer=self.rank) if m is not None else None
        if ranks is not None:
            index = ShardIndex(g, self._checked(self._shards_of(path, ranks), g, key))
            overlaps = index.overlapping(box)
            try:
                index.check_covers(box, overlaps, key)
                return overlaps
            except CorruptCheckpointError as e:
                log.warning("step %d: the shard map's ranks %s do not cover %s (%s): reading every manifest",
                            self.commit.step, ranks, key, e)
        index = ShardIndex(g, self._checked(self._shards(path), g, key))
        overlaps = index.overlapping(box)
        index.check_covers(box, overlaps, key)
        return overlaps

    def _checked(self, shards: List[SavedShard], g, key: str) -> List[SavedShard]:
        """The saved shards of one key, each checked to agree with the first on the global shape and dtype and
        to lie inside the global shape (another rank's manifest is untrusted input too). Raises
        ``CorruptCheckpointError`` naming the rank."""
        if not shards:
            return shards
        dtype = shards[0].entry.dtype
        for s in shards:
            e = s.entry
            off, shape = s.box
            if (tuple(e.shard.global_shape) != tuple(g) or e.dtype != dtype or len(off) != len(g)
                    or len(shape) != len(g)
                    or any(o < 0 or n < 0 or o + n > d for o, n, d in zip(off, shape, g))):
                raise CorruptCheckpointError(
                    f"rank {s.rank}'s shard (offset {list(off)}, shape {list(shape)}, {e.dtype}, global shape "
                    f"{list(e.shard.global_shape)}) does not fit the key's global shape {list(g)} ({dtype})",
                    step=self.commit.step, key=key)
        return shards

    def _shards_of(self, path: KeyPath, ranks: List[int]) -> List[SavedShard]:
        """The saved shards of ``path`` in the manifests of ``ranks`` (this rank's first when among them)."""
        out = []
        for r in sorted(ranks, key=lambda r: r != self.rank):
            nodes = self._sharded_nodes.get(r)
            if nodes is None:
                nodes = self._sharded_nodes[r] = {n.path: n.payload for n in self.manifest(r).nodes
                                                  if n.kind == "dtensor"}
            e = nodes.get(path)
            if e is not None:
                out.append(SavedShard((e.shard.offset, e.shape), e, r))
        return out

    def load(self, wanted: Set[str], targets: Mapping[str, Any], *, rank_local: str = "error",
             map_location=None) -> Dict[str, Any]:
        """The values of the top-level keys ``wanted``, as nested dicts; DTensor leaves of ``targets`` (top key
        -> the tree a Stateful's ``state_dict()`` returned, or the value in ``state``) are filled in place and
        returned as themselves. Raises ``CorruptCheckpointError`` / ``IncompatibleCheckpointError``."""
        if rank_local not in RANK_LOCAL_MODES:
            raise ValueError(f"rank_local must be one of {RANK_LOCAL_MODES}, got {rank_local!r}")
        base, step = self.base, self.commit.step
        fresh = self.rank_local_paths(wanted)
        if fresh and rank_local == "error":
            raise IncompatibleCheckpointError(
                f"rank-local values differ between the {self.commit.world_size} saved ranks and cannot be split "
                f"over world_size={self.world_size}: {', '.join(path_str(p) for p in fresh)} (saved by "
                f"world_size={self.commit.world_size}; pass resume(..., rank_local=\"fresh\") to keep this run's "
                "values for them and load the rest)", step=step)
        if fresh:
            log.warning("step %d: world size %d -> %d: keeping this run's values for the rank-local keys %s",
                        step, self.commit.world_size, self.world_size, [path_str(p) for p in fresh])
        leaves = {k: tensor_leaves(v, (k,)) for k, v in targets.items()}

        def under_fresh(p):
            return any(p[:len(q)] == q for q in fresh)
        keep, sharded = [], []
        for n in base.nodes:
            if n.path and n.path[0] not in wanted:
                continue
            if under_fresh(n.path):
                if n.path in fresh:
                    found, value = value_at(targets.get(n.path[0]), n.path[1:]) if n.path[0] in targets \
                        else (False, None)
                    if found:
                        keep.append(n.__class__(n.path, "value", value))
                continue
            if n.kind == "dtensor":
                sharded.append((len(keep), n))
                keep.append(n.__class__(n.path, "value", None))
            else:
                keep.append(n)
        plain = base.replace(nodes=keep)
        extra = {"share": self.share} if self.share is not None else {}
        nodes = self._read_nodes(self.blobs, plain, map_location=map_location, **extra)  # verified, none applied
        if sharded:
            reader = SpanReader(self.blobs, self.executor, step)
            self._futures, self._packed = [], []
            for i, n in sharded:
                target = leaves.get(n.path[0], {}).get(n.path)
                nodes[i] = Node(n.path, "tensor", self._fill(n, target, reader))
            self._futures += read_chunks(self.blobs.storage, self._packed, executor=self.executor,
                                         gap=self.blobs.storage.coalesce_gap)
            wait_all(self._futures)
        if self.commit.shards is not None and self._map is None:     # consulted, unusable: every manifest read
            self._check_sharded_keys(base, wanted)      # the tree comes from base: is it whole?
        try:
            return unflatten(nodes)
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise CorruptCheckpointError(f"invalid key tree ({e})", step=step) from None

    def _check_sharded_keys(self, base: Manifest, wanted: Set[str]) -> None:
        """The loaded tree is ``base``'s. A step whose marker names a shard map was saved with the same sharded
        keys on every rank (FORMAT.md "Shard map": rank 0 writes a map only then); when the map, consulted,
        cannot vouch for ``base`` (unusable), the other manifests (every one is read then) do: a sharded key
        under ``wanted`` that another rank saved and ``base`` lacks means ``base`` is damaged, and the step must
        not load as a tree without it (the fuzz of issue 17). Raises ``CorruptCheckpointError`` naming the key
        and a rank holding it."""
        have = {n.path for n in base.nodes if n.kind == "dtensor"}
        for r in range(self.commit.world_size):
            if r == base.rank:
                continue
            for n in self.manifest(r).nodes:
                if n.kind == "dtensor" and n.path[0] in wanted and n.path not in have:
                    raise CorruptCheckpointError(
                        f"rank {r}'s manifest holds shards of {path_str(n.path)!r}, rank {base.rank}'s (whose key "
                        "tree is loaded) does not", step=self.commit.step,
                        key=path_str(n.path))

    def _fill(self, n, target, reader: SpanReader):
        entry, key = n.payload, path_str(n.path)
        g = entry.shard.global_shape
        dtype = TORCH_DTYPES[entry.dtype]
        if is_dtensor(target):
            if tuple(target.shape) != g or target.dtype != dtype:
                raise IncompatibleCheckpointError(
                    f"{key}: checkpoint holds {entry.dtype} of global shape {list(g)}, the target is "
                    f"{str(target.dtype).replace('torch.', '')} of shape {list(target.shape)}", step=self.commit.step)
            try:
                box = target_box(target)
            except TypeError as e:                  # its local tensor is no one box: nothing to fill it by
                raise IncompatibleCheckpointError(f"{key}: {e}", step=self.commit.step) from None
        else:
            if isinstance(target, torch.Tensor) and (tuple(target.shape) != tuple(g) or target.dtype != dtype):
                raise IncompatibleCheckpointError(
                    f"{key}: checkpoint holds {entry.dtype} of global shape {list(g)}, the target is "
                    f"{str(target.dtype).replace('torch.', '')} of shape {list(target.shape)}", step=self.commit.step)
            box = ((0,) * len(g), tuple(g))
        own = entry if self.same_world else None
        if own is not None and (own.shard.offset, own.shape) == box:
            overlaps = [(SavedShard(box, own, self.rank), box)]
        else:
            overlaps = self._overlaps(n.path, g, box, key)      # checked before anything is allocated or written
        if is_dtensor(target):
            dst = target.to_local()
            self.touched = True
        else:
            try:
                dst = torch.empty(g, dtype=dtype)
            except (RuntimeError, MemoryError, ValueError) as e:
                raise CorruptCheckpointError(f"cannot allocate the global shape {list(g)} the manifest claims "
                                             f"({type(e).__name__})", step=self.commit.step, key=key) from None
        for shard, region in overlaps:
            whole = _contiguous_part(dst, box, region) if region == shard.box else None
            if whole is not None:
                self._read_whole(whole, shard.entry, key)     # straight into place, chunks in parallel
            else:
                fill(dst, box, shard, region, lambda e, lo, hi: reader.read(e, key, lo, hi))
        return target if is_dtensor(target) else dst

    def _read_whole(self, dst: torch.Tensor, entry, key: str) -> None:
        """Queue the reads of a saved shard that is exactly ``dst``'s box into ``dst``'s own memory, every chunk
        verified there (no staging copy); all such reads of a step run in parallel, packed ones coalesced."""
        mv = memoryview(dst.view(-1).view(torch.uint8).numpy()).cast("B")
        if len(mv) != entry.nbytes:
            raise CorruptCheckpointError(f"saved shard holds {entry.nbytes} bytes, the target {len(mv)}",
                                         step=self.commit.step, key=key)
        off = 0
        for c in entry.chunks:
            if c.pack is not None:
                self._packed.append(ReadItem(c, mv[off: off + c.nbytes], self.commit.step, key))
            else:
                self._futures.append(self.executor.submit(self.blobs.read_into, c.blob_id, c.codec,
                                                          mv[off: off + c.nbytes], step=self.commit.step, key=key,
                                                          base=c.base))
            off += c.nbytes


def _contiguous_part(dst: torch.Tensor, box, region) -> Optional[torch.Tensor]:
    """The part of ``dst`` (holding ``box``) that ``region`` covers, when it is one contiguous CPU range: the
    whole box, or a dim-0 slice of it spanning every other dim (FSDP's shards, resharded to fewer ranks: each
    saved shard is such a slice of the new one). ``None`` otherwise. Boxes are ``(offsets, sizes)``."""
    (b_off, b_size), (r_off, r_size) = box, region
    if not dst.numel() or dst.device.type != "cpu" or not dst.is_contiguous():
        return None
    if (r_off, r_size) == (b_off, b_size):
        return dst
    if not b_size or tuple(r_off[1:]) != tuple(b_off[1:]) or tuple(r_size[1:]) != tuple(b_size[1:]):
        return None
    part = dst.narrow(0, r_off[0] - b_off[0], r_size[0])
    return part if part.numel() else None
