"""Manifest and commit-marker schema: msgpack, versioned, checksummed, validated on read.

Every metadata file is a *frame*: a msgpack map ``{"magic": "ckptstore", "kind": <"manifest"|"commit">,
"format": <int>, "body": <msgpack bytes>, "blake3": <32 bytes>}``. The checksum covers ``body``, so a
truncated or bit-flipped file is detected before anything in it is believed. Nothing is ever unpickled: msgpack
decodes to plain values only, and everything decoded is checked here against the schema (types, ranges, blob
ids, dtypes, byte counts) before other modules see it.

Manifest body (one per rank and step)::

    {"step": int, "rank": int, "world_size": int, "stateful": [str, ...],
     "replicated": [str, ...],                         # optional: top-level keys saved by rank 0 only
     "packs": [pack_id, ...],                          # format 2: the packs this manifest reads from
     "nodes": [[path, kind, payload], ...]}            # pre-order, see ckptstore.state.flatten.Node
    path    = [str | int, ...]
    payload = tensor:  {"dtype": "float32", "shape": [int], "device": "cpu", "requires_grad": bool,
                        "chunks": [chunk, ...]}
    chunk   = [chunk_id, raw_nbytes, codec]                          a blob (objects/)
            | [chunk_id, raw_nbytes, codec, pack, offset, stored]     bytes [offset, offset+stored) of a pack
                                                                      (format 2; pack = index into "packs";
                                                                      stored = bytes in the pack)
            | [chunk_id, raw_nbytes, "delta", key, seq]              a delta blob (objects/<id>.dlt, format 5):
                                                                      key = [key_id, raw_nbytes, codec], the
                                                                      full blob it is a difference with (never a
                                                                      delta: chain depth 1); seq >= 1: deltas
                                                                      against that key so far (FORMAT.md "The
                                                                      delta codec")
    dtensor: the tensor payload (``shape`` = the local shard's) plus
                        "shard": {"global_shape": [int], "offset": [int], "mesh": [int], "placements": [str]}
              ndarray / npscalar: {"dtype": "<f4", "shape": [int], "chunks": [...]}
              value: the value | bigint: decimal str | dtype: torch dtype name | list/tuple: length | dict: nil

Commit body (one per step, written last)::

    {"step": int, "world_size": int, "created": float (unix seconds), "bytes_total": int,
     "manifests": [[rank, blake3 of the manifest file (32 bytes), size in bytes(, generation)], ...],
     | "table": [blake3 of the table file, its size, rows per page, [blake3 of each page, ...]],
                                            # format 3, world_size > INLINE_ROWS: see ckptstore.format.mtable
     "metrics": {str: plain value}, "config": {str: plain value} | nil, "writer": "ckptstore <version>",
     "run_id": str (optional), "best": {"metric": str, "mode": "min"|"max"} (optional)}
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import msgpack
import numpy as np
import torch
import zstandard

from .blobs import CODECS, digest_bytes
from ..util.errors import CorruptCheckpointError, IncompatibleCheckpointError
from .layout import check_blob_id, check_step
from . import mtable
from ..state.sharding import ShardInfo
from ..state.flatten import TORCH_DTYPES, KeyPath, path_str

FORMAT_VERSION = 2            # written by this library; 1 and 2 are read (see FORMAT.md)
#: a commit marker naming a manifest table, and a rows file, are written as format 3 (so that readers from
#: before the table refuse them as too new rather than misread them); nothing else is
#: a manifest naming a chunk stored with the planes codec is written as format 4 (readers from before the codec
#: refuse it as too new, ``IncompatibleCheckpointError``, rather than call the step corrupt); nothing else is
PLANES_FORMAT = 4
#: a manifest naming a delta chunk (codec ``"delta"``, issue 30) is written as format 5, for the same reason: a
#: reader from before the delta codec would find a record it cannot read and call the step corrupt
DELTA_FORMAT = 5
#: a shard map is written as format 3: its body zstd-compressed (outer field "zstd": the body's raw length),
#: 3.3x smaller (a 70B-shaped FSDP2 map 61.6 -> 18.3 KB: what a resuming rank reads, issue 29)
SHARDS_FORMAT = 3
READ_FORMATS = {"commit": mtable.TABLE_FORMAT, "rows": mtable.TABLE_FORMAT, "manifest": DELTA_FORMAT,
                "shards": SHARDS_FORMAT}
MAX_FRAME_BODY = 256 << 20      # the raw length a compressed frame body may claim
MAX_CHUNK_BYTES = 1 << 40
MAX_COMMIT_BYTES = 64 << 20     # ~60 bytes per rank: room for a million ranks; read with this bound
MAGIC = "ckptstore"
_NP_DTYPE_RE = re.compile(r"^[<>|=][biufcSUVmM][0-9]+(\[[0-9]*[a-zA-Z]+\])?$")
CONTAINER_KINDS = ("dict", "list", "tuple")
ARRAY_KINDS = ("tensor", "dtensor", "ndarray", "npscalar")
TENSOR_KINDS = ("tensor", "dtensor")
NODE_KINDS = CONTAINER_KINDS + ARRAY_KINDS + ("value", "bigint", "dtype")


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a tensor's bytes and where they live.

    ``blob_id``: BLAKE3-256 hex of the chunk's raw bytes (the chunk's identity, whatever its location).
    ``nbytes``: raw length in bytes. ``codec``: ``"raw"``, ``"zstd"``, ``"planes"`` or ``"delta"`` (how the stored
    bytes encode it; ``"planes"``: :mod:`ckptstore.format.planes`, in manifests of format 4; ``"delta"``:
    :mod:`ckptstore.format.delta`, format 5).
    ``pack``: ``None`` when the chunk is a blob of its own (``objects/``), else the id of the pack holding it,
    at byte ``offset`` for ``stored`` bytes (``stored == nbytes`` for raw chunks).
    ``base``: a delta's key, the full blob (same raw length, codec not ``"delta"``, no pack) which, added back to
    the delta's decoded difference, gives the chunk; ``seq``: how many deltas against that key the chain has
    reached with this one (1, 2, ...; the writer stores the chunk in full again after ``Writing.deltas``).
    Both are ``None`` / 0 for every other codec.
    """
    blob_id: str
    nbytes: int
    codec: str
    pack: Optional[str] = None
    offset: int = 0
    stored: int = 0
    base: Optional["ChunkRef"] = None
    seq: int = 0

    @property
    def stored_nbytes(self) -> int:
        return self.stored if self.pack is not None else self.nbytes

    def encode(self, pack_index: Dict[str, int]) -> list:
        """The manifest form; ``pack_index`` (pack id -> position in the manifest's pack table) grows."""
        if self.codec == "delta":
            return [self.blob_id, self.nbytes, self.codec, self.base.encode(pack_index), self.seq]
        if self.pack is None:
            return [self.blob_id, self.nbytes, self.codec]
        return [self.blob_id, self.nbytes, self.codec, pack_index.setdefault(self.pack, len(pack_index)),
                self.offset, self.stored]


@dataclass
class ArrayEntry:
    """Where a tensor's / array's bytes live. ``dtype`` is a torch dtype name or a numpy dtype string."""
    dtype: str
    shape: Tuple[int, ...]
    chunks: List[ChunkRef]
    device: str = "cpu"
    requires_grad: bool = False
    shard: Optional[ShardInfo] = None   # a DTensor's local shard: where it sits in the global tensor

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


@dataclass
class ManifestNode:
    path: KeyPath
    kind: str
    payload: Any = None       # ArrayEntry for array kinds, else as in the module docstring


@dataclass
class Manifest:
    step: int
    rank: int
    world_size: int
    stateful: List[str]
    nodes: List[ManifestNode]
    #: top-level keys the saver declared equal on every rank (``Store.save(replicated=...)``), sorted. Rank 0's
    #: manifest holds them (never as DTensors); every other rank's manifest lists them and holds none of them:
    #: readers take them from rank 0's manifest
    replicated: List[str] = field(default_factory=list)

    def replace(self, **changes) -> "Manifest":
        """A copy with ``changes`` (field name -> value) and every other field as in ``self``: the one way a
        manifest is derived from another (repack, a ranged pull, a restore's merged view), so that a field the
        format gains is never dropped by a copy naming fields one by one (issue 26: ``replicated`` was, and
        rank 1 of a DDP job could no longer find rank 0's keys). Raises ``TypeError`` for an unknown field."""
        return dataclasses.replace(self, **changes)

    def arrays(self):
        """(node, ArrayEntry) for every tensor / array node, in order."""
        return [(n, n.payload) for n in self.nodes if n.kind in ARRAY_KINDS]

    def chunk_refs(self):
        """Every chunk reference, in order (a chunk used twice appears twice), each delta's key right after the
        delta: what gc keeps, uploads, pulls and replication copy, and usage counts, so that a delta's key goes
        wherever the delta goes (FORMAT.md "The delta codec")."""
        return [r for _, e in self.arrays() for c in e.chunks for r in ((c, c.base) if c.base is not None else (c,))]

    def blob_ids(self):
        """Ids of the chunks stored as blobs of their own (``objects/``)."""
        return {c.blob_id for c in self.chunk_refs() if c.pack is None}

    def pack_ids(self):
        """Ids of the packs this manifest reads from."""
        return {c.pack for c in self.chunk_refs() if c.pack is not None}

    @property
    def bytes_total(self) -> int:
        return sum(e.nbytes for _, e in self.arrays())


@dataclass
class Commit:
    step: int
    world_size: int
    #: rank -> (blake3 digest, size in bytes, generation): a dict, or a lazy
    #: :class:`~ckptstore.format.mtable.ManifestTable` for a marker naming a manifest table
    manifests: Mapping[int, Tuple[bytes, int, int]]
    created: float
    bytes_total: int
    metrics: Dict[str, Any] = field(default_factory=dict)
    config: Optional[Dict[str, Any]] = None
    writer: str = ""
    run_id: str = ""                              # the run's stable id ("" in markers written before it)
    best: Optional[Dict[str, str]] = None         # {"metric": str, "mode": "min"|"max"}: the best criterion
    shards: Optional[Tuple[bytes, int, int]] = None   # the shard map's (blake3 digest, size, generation)
    names: Tuple[str, ...] = ()                   # the step's names (e.g. a trainer's checkpoint paths), sorted

    def replace(self, **changes) -> "Commit":
        """A copy with ``changes`` (field name -> value) and every other field as in ``self``: the one way a
        commit marker is derived from another (repack, a ranged pull), as :meth:`Manifest.replace`."""
        return dataclasses.replace(self, **changes)

    @property
    def table(self) -> Optional["mtable.TableRef"]:
        """The manifest table the marker names (format 3), else ``None`` (the rows are inline)."""
        return self.manifests.ref if isinstance(self.manifests, mtable.ManifestTable) else None


# -- framing ------------------------------------------------------------------------------------------------
def frame(kind: str, body: Dict[str, Any], fmt: int = FORMAT_VERSION, compress: bool = False) -> bytes:
    """A file's bytes: ``body`` packed (msgpack), with ``compress`` zstd-compressed (outer ``"zstd"``: its raw
    length), under a BLAKE3 checksum of the stored body (FORMAT.md "Framing")."""
    packed = msgpack.packb(body, use_bin_type=True)
    outer = {"magic": MAGIC, "kind": kind, "format": fmt}
    if compress:
        outer["zstd"] = len(packed)
        packed = zstandard.ZstdCompressor(level=3).compress(packed)
    outer.update(body=packed, blake3=bytes.fromhex(digest_bytes(packed)))
    return msgpack.packb(outer, use_bin_type=True)


def unframe(data: bytes, kind: str, *, what: str, step: Optional[int] = None) -> Tuple[Dict[str, Any], int]:
    """Check a frame's magic, kind, format version and checksum; return the decoded body and its format.

    Raises ``CorruptCheckpointError`` (naming ``what``, the file) on any damage, and
    ``IncompatibleCheckpointError`` for a format version newer than this library reads.
    """
    def corrupt(msg):
        return CorruptCheckpointError(f"{what}: {msg}", step=step, blob=what)
    try:
        outer = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=1 << 31)
    except Exception as e:  # msgpack raises several types for truncated / garbage input
        raise corrupt(f"not a ckptstore file ({type(e).__name__}: {e})") from None
    if not isinstance(outer, dict) or outer.get("magic") != MAGIC:
        raise corrupt("not a ckptstore file (bad magic)")
    if outer.get("kind") != kind:
        raise corrupt(f"expected a {kind}, found {outer.get('kind')!r}")
    fmt = outer.get("format")
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt < 1:
        raise corrupt(f"bad format version {fmt!r}")
    if fmt > READ_FORMATS.get(kind, FORMAT_VERSION):
        raise IncompatibleCheckpointError(f"{what} has format version {fmt}; this ckptstore reads up to "
                                          f"{READ_FORMATS.get(kind, FORMAT_VERSION)}: upgrade ckptstore", step=step)
    body, checksum = outer.get("body"), outer.get("blake3")
    if not isinstance(body, bytes) or not isinstance(checksum, bytes):
        raise corrupt("missing body or checksum")
    if digest_bytes(body) != checksum.hex():
        raise corrupt("checksum mismatch")
    raw = outer.get("zstd")
    if raw is not None:                  # a compressed body (checked above as stored): bounded by its claim
        if not isinstance(raw, int) or isinstance(raw, bool) or not 0 < raw <= MAX_FRAME_BODY:
            raise corrupt(f"bad compressed body length {raw!r:.40}")
        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=raw)
        except zstandard.ZstdError as e:
            raise corrupt(f"compressed body does not decode ({e})") from None
        if len(body) != raw:
            raise corrupt(f"compressed body holds {len(body)} bytes, its frame says {raw}")
    try:
        decoded = msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=True)
    except Exception as e:
        raise corrupt(f"undecodable body ({type(e).__name__})") from None
    if not isinstance(decoded, dict):
        raise corrupt("body is not a map")
    return decoded, fmt


# -- manifest -----------------------------------------------------------------------------------------------
def encode_manifest(m: Manifest) -> bytes:
    nodes = []
    packs: Dict[str, int] = {}
    fmt = FORMAT_VERSION
    for n in m.nodes:
        p = n.payload
        if n.kind in ARRAY_KINDS:
            for c in p.chunks:
                if c.codec == "delta":
                    fmt = DELTA_FORMAT
                elif c.codec == "planes":
                    fmt = max(fmt, PLANES_FORMAT)
            d = {"dtype": p.dtype, "shape": list(p.shape), "chunks": [c.encode(packs) for c in p.chunks]}
            if n.kind in TENSOR_KINDS:
                d["device"], d["requires_grad"] = p.device, p.requires_grad
            if n.kind == "dtensor":
                d["shard"] = p.shard.encode()
            p = d
        nodes.append([list(n.path), n.kind, p])
    body = {"step": m.step, "rank": m.rank, "world_size": m.world_size,
            "stateful": list(m.stateful), "packs": list(packs), "nodes": nodes}
    if m.replicated:
        body["replicated"] = sorted(m.replicated)
    return frame("manifest", body, fmt)


def _int(v, what, lo=0, hi=None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise ValueError(f"{what}: expected an int in [{lo}, {hi}], got {v!r}")
    return v


_TORCH_ITEMSIZE = {name: dt.itemsize for name, dt in TORCH_DTYPES.items()}


def itemsize(kind: str, dtype: str) -> int:
    if kind in TENSOR_KINDS:
        if not isinstance(dtype, str) or dtype not in _TORCH_ITEMSIZE:
            raise ValueError(f"unknown torch dtype {dtype!r}")
        return _TORCH_ITEMSIZE[dtype]
    if not isinstance(dtype, str) or not _NP_DTYPE_RE.match(dtype):
        raise ValueError(f"unsupported numpy dtype {dtype!r}")
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise ValueError(f"object numpy dtype {dtype!r}")
    return dt.itemsize


def _decode_chunk(c: Any, where: str, fmt: int, packs: List[str]) -> ChunkRef:
    if isinstance(c, list) and len(c) >= 3 and c[2] == "delta":
        return _decode_delta(c, where, fmt, packs)
    if not isinstance(c, list) or len(c) not in ((3, 6) if fmt >= 2 else (3,)):
        raise ValueError(f"{where}: bad chunk {c!r:.120}")
    blob_id, nbytes, codec = c[:3]
    check_blob_id(blob_id)
    if codec not in CODECS:
        raise ValueError(f"{where}: unknown codec {codec!r}")
    nbytes = _int(nbytes, f"{where} chunk size", 1, MAX_CHUNK_BYTES)
    if len(c) == 3:
        return ChunkRef(blob_id, nbytes, codec)
    pack, offset, stored = c[3:]
    pack = packs[_int(pack, f"{where} pack index", 0, len(packs) - 1)]
    offset = _int(offset, f"{where} chunk offset", 0, MAX_CHUNK_BYTES)
    stored = _int(stored, f"{where} chunk stored size", 1, MAX_CHUNK_BYTES)
    if codec == "raw" and stored != nbytes:
        raise ValueError(f"{where}: raw chunk {blob_id} stores {stored} bytes for {nbytes}")
    return ChunkRef(blob_id, nbytes, codec, pack, offset, stored)


MAX_DELTA_SEQ = 1 << 31


def _decode_delta(c: list, where: str, fmt: int, packs: List[str]) -> ChunkRef:
    """A delta record ``[chunk id, raw length, "delta", key, seq]`` (format 5): its key must be a full blob of the
    same raw length (chain depth 1, so a cycle cannot be written down), not the chunk itself."""
    if fmt < DELTA_FORMAT or len(c) != 5:
        raise ValueError(f"{where}: bad delta chunk {c!r:.160} (format {fmt})")
    blob_id, nbytes, _, key, seq = c
    check_blob_id(blob_id)
    nbytes = _int(nbytes, f"{where} chunk size", 1, MAX_CHUNK_BYTES)
    if isinstance(key, list) and len(key) >= 3 and key[2] == "delta":
        raise ValueError(f"{where}: delta chunk {blob_id} names a delta ({key[0]!r:.70}) as its key: a key must "
                         "be a full blob (chain depth 1)")
    if not isinstance(key, list) or len(key) != 3:
        raise ValueError(f"{where}: delta chunk {blob_id} names a key that is not a blob: {key!r:.160}")
    base = _decode_chunk(key, where, fmt, packs)
    if base.nbytes != nbytes:
        raise ValueError(f"{where}: delta chunk {blob_id} of {nbytes} bytes names a key of {base.nbytes}")
    if base.blob_id == blob_id:
        raise ValueError(f"{where}: delta chunk {blob_id} names itself as its key")
    return ChunkRef(blob_id, nbytes, "delta", base=base, seq=_int(seq, f"{where} delta seq", 1, MAX_DELTA_SEQ))


def _check_pack_ranges(nodes: List["ManifestNode"]) -> None:
    """Within one pack, two references to the same bytes must name the same chunk, and no two ranges may
    overlap partially: a manifest that claims otherwise is damaged or hostile."""
    ranges: Dict[str, Dict[Tuple[int, int], str]] = {}
    for n in nodes:
        if n.kind not in ARRAY_KINDS:
            continue
        for c in n.payload.chunks:
            if c.pack is None:
                continue
            seen = ranges.setdefault(c.pack, {})
            other = seen.setdefault((c.offset, c.stored), c.blob_id)
            if other != c.blob_id:
                raise ValueError(f"pack {c.pack}: bytes [{c.offset}, {c.offset + c.stored}) claimed by chunks "
                                 f"{other} and {c.blob_id}")
    for pack, seen in ranges.items():
        end, prev = -1, None
        for (off, stored) in sorted(seen):
            if off < end:
                raise ValueError(f"pack {pack}: overlapping ranges [{prev[0]}, {prev[0] + prev[1]}) and "
                                 f"[{off}, {off + stored})")
            end, prev = off + stored, (off, stored)


def _decode_array(kind: str, p: Any, where: str, fmt: int = FORMAT_VERSION, packs: List[str] = ()) -> ArrayEntry:
    if not isinstance(p, dict):
        raise ValueError(f"{where}: array payload is not a map")
    dtype = p.get("dtype")
    size = itemsize(kind, dtype)
    shape = p.get("shape")
    if not isinstance(shape, list) or len(shape) > 64:
        raise ValueError(f"{where}: bad shape {shape!r}")
    shape = tuple(_int(s, f"{where} shape", 0, 1 << 48) for s in shape)
    chunks_raw = p.get("chunks")
    if not isinstance(chunks_raw, list):
        raise ValueError(f"{where}: chunks is not a list")
    chunks = [_decode_chunk(c, where, fmt, packs) for c in chunks_raw]
    numel = 1
    for d in shape:                     # exact (Python ints never wrap), bounded by the 2**40 check below
        numel *= d
    if numel * size > MAX_CHUNK_BYTES * max(1, len(chunks)) or numel * size != sum(c.nbytes for c in chunks):
        raise ValueError(f"{where}: chunks hold {sum(c.nbytes for c in chunks)} bytes, shape {list(shape)} of "
                         f"{dtype} needs {numel * size}")
    entry = ArrayEntry(dtype, shape, chunks)
    if kind == "dtensor":
        entry.shard = ShardInfo.decode(p.get("shard"), shape, where)
    if kind in TENSOR_KINDS:
        dev = p.get("device", "cpu")
        if not isinstance(dev, str) or len(dev) > 64:
            raise ValueError(f"{where}: bad device {dev!r}")
        entry.device, entry.requires_grad = dev, bool(p.get("requires_grad", False))
    return entry


def decode_manifest(data: bytes, *, step: int, rank: int, what: str) -> Manifest:
    """Decode and validate a manifest. Raises ``CorruptCheckpointError`` naming the file and key path."""
    body, fmt = unframe(data, "manifest", what=what, step=step)
    where = what
    try:
        if body.get("step") != step or body.get("rank") != rank:
            raise ValueError(f"manifest is for step {body.get('step')!r} rank {body.get('rank')!r}")
        world_size = _int(body.get("world_size"), "world_size", 1, 1 << 20)
        stateful = body.get("stateful")
        if not isinstance(stateful, list) or not all(isinstance(s, str) for s in stateful):
            raise ValueError("bad stateful list")
        replicated = body.get("replicated", [])
        if (not isinstance(replicated, list) or len(replicated) > (1 << 16)
                or not all(isinstance(k, str) and 0 < len(k) <= 4096 for k in replicated)
                or replicated != sorted(set(replicated))):
            raise ValueError(f"bad replicated list {replicated!r:.80}")
        if replicated and world_size == 1:
            raise ValueError("replicated keys in a step saved by one rank")
        packs = body.get("packs", [])
        if not isinstance(packs, list) or len(packs) > (1 << 24):
            raise ValueError("bad pack table")
        packs = [check_blob_id(p) for p in packs]
        nodes_raw = body.get("nodes")
        if not isinstance(nodes_raw, list):
            raise ValueError("nodes is not a list")
        nodes = []
        for raw in nodes_raw:
            if not isinstance(raw, list) or len(raw) != 3:
                raise ValueError(f"bad node {raw!r:.80}")
            path, kind, payload = raw
            if not isinstance(path, list) or not all(
                    isinstance(k, (str, int)) and not isinstance(k, bool) for k in path):
                raise ValueError(f"bad key path {path!r:.80}")
            path = tuple(path)
            where = f"{what} key {path_str(path)!r}"
            if kind not in NODE_KINDS:
                raise ValueError(f"{where}: unknown node kind {kind!r}")
            if kind in ARRAY_KINDS:
                payload = _decode_array(kind if kind in TENSOR_KINDS else "ndarray", payload, where, fmt, packs)
            elif kind in ("list", "tuple"):
                payload = _int(payload, f"{where} length", 0, 1 << 32)
            elif kind == "bigint":
                if not isinstance(payload, str) or not re.match(r"^-?[0-9]{1,4300}$", payload):
                    raise ValueError(f"{where}: bad bigint")
            elif kind == "dtype":
                if payload not in TORCH_DTYPES:
                    raise ValueError(f"{where}: unknown dtype {payload!r}")
            elif kind == "value":
                if isinstance(payload, (dict, list)):
                    raise ValueError(f"{where}: a plain value cannot be a container")
            nodes.append(ManifestNode(path, kind, payload))
        if not nodes or nodes[0].path != () or nodes[0].kind != "dict":
            raise ValueError("nodes must start with the root dict")
        where = what
        _check_pack_ranges(nodes)
        _validate_tree(nodes, stateful)
        _check_replicated(nodes, replicated, rank)
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError) as e:
        # TypeError & co: a field of the wrong type met an operation before its own check (e.g. an unhashable
        # dtype); every such manifest is invalid, never an exception of another kind for the caller
        raise CorruptCheckpointError(f"invalid manifest: {type(e).__name__ + ': ' if not isinstance(e, ValueError) else ''}"
                                     f"{e}", step=step, blob=what) from None
    return Manifest(step=step, rank=rank, world_size=world_size, stateful=stateful, nodes=nodes,
                    replicated=replicated)


def _check_replicated(nodes: List["ManifestNode"], replicated: List[str], rank: int) -> None:
    """Rank 0's manifest holds every replicated key, none as a DTensor; another rank's holds none of them."""
    if not replicated:
        return
    rep = set(replicated)
    top = {n.path[0] for n in nodes if len(n.path) == 1}
    if rank == 0:
        missing = sorted(rep - top)
        if missing:
            raise ValueError(f"replicated keys {missing!r:.80} are not in rank 0's manifest")
        bad = sorted({n.path[0] for n in nodes if n.kind == "dtensor" and n.path[0] in rep})
        if bad:
            raise ValueError(f"replicated keys {bad!r:.80} hold DTensor shards")
    else:
        held = sorted(rep & top)
        if held:
            raise ValueError(f"keys {held!r:.80} are marked replicated (saved by rank 0) but rank {rank}'s "
                             "manifest holds them too")


_PLAIN_VALUE_TYPES = (type(None), bool, int, float, str, bytes)
_MAX_ELEMENTS = 1 << 62           # bound on the product of an array's non-zero dims (numpy/torch use int64)


def _validate_tree(nodes: List["ManifestNode"], stateful: List[str]) -> None:
    """The checks that need the whole tree (untrusted input: see FORMAT.md), run before anything is allocated
    or applied. Every node but the root has a non-empty path whose parent is an earlier container node; paths
    are unique; top-level keys are str; a list/tuple of length n has exactly the children 0..n-1 (so a length
    can never exceed the nodes actually present); plain values are plain; numpy dtypes are in canonical form
    from the kinds ckptstore writes; array shapes stay within int64 element counts even where a dim is 0.
    Raises ``ValueError`` naming the key path."""
    kinds: Dict[tuple, str] = {}
    lengths: Dict[tuple, int] = {}
    children: Dict[tuple, int] = {}
    for i, n in enumerate(nodes):
        path = n.path
        if i == 0:
            kinds[path] = n.kind
            children[path] = 0
            continue
        where = path_str(path) or "<root>"
        if not path:
            raise ValueError(f"node {i} ({n.kind}) has an empty key path: only the root may")
        if path in kinds:
            raise ValueError(f"key {where!r} appears twice")
        parent, key = path[:-1], path[-1]
        pkind = kinds.get(parent)
        if pkind is None:
            raise ValueError(f"key {where!r} has no parent container before it")
        if pkind not in CONTAINER_KINDS:
            raise ValueError(f"key {where!r} is under a {pkind}, not a container")
        if pkind == "dict":
            if not parent and not isinstance(key, str):
                raise ValueError(f"top-level key {key!r} is not a str")
        elif not isinstance(key, int) or not 0 <= key < lengths[parent]:
            raise ValueError(f"index {key!r} out of range for the {pkind} of length {lengths[parent]} at "
                             f"{path_str(parent) or '<root>'!r}")
        children[parent] += 1
        kinds[path] = n.kind
        if n.kind in CONTAINER_KINDS:
            children[path] = 0
            if n.kind != "dict":
                lengths[path] = n.payload
        elif n.kind == "value" and not isinstance(n.payload, _PLAIN_VALUE_TYPES):
            raise ValueError(f"key {where!r}: a plain value cannot be a {type(n.payload).__name__}")
        elif n.kind in ARRAY_KINDS:
            _check_array_sanity(n.kind, n.payload, where)
    for path, length in lengths.items():
        if children[path] != length:
            raise ValueError(f"{kinds[path]} {path_str(path)!r} claims {length} elements, the manifest holds "
                             f"{children[path]}")
    top = {p[0] for p in kinds if len(p) == 1}
    missing = [s for s in stateful if s not in top]
    if missing:
        raise ValueError(f"stateful keys {missing!r:.80} are not top-level keys")


def _check_array_sanity(kind: str, entry: "ArrayEntry", where: str) -> None:
    if kind in ("ndarray", "npscalar"):
        try:
            dt = np.dtype(entry.dtype)
        except TypeError:
            raise ValueError(f"key {where!r}: unknown numpy dtype {entry.dtype!r}") from None
        if dt.str != entry.dtype or dt.kind not in "biufcmMSUV" or dt.fields is not None or dt.itemsize == 0:
            raise ValueError(f"key {where!r}: unsupported numpy dtype {entry.dtype!r}")
        if kind == "npscalar" and entry.shape:
            raise ValueError(f"key {where!r}: a numpy scalar has shape (), not {list(entry.shape)}")
    elements = 1
    for d in entry.shape:
        elements *= max(d, 1)
    if elements > _MAX_ELEMENTS:
        raise ValueError(f"key {where!r}: shape {list(entry.shape)} is out of range")


# -- commit marker ------------------------------------------------------------------------------------------
def encode_commit(c: Commit) -> bytes:
    """The commit marker's bytes. Raises ``ValueError`` when they would exceed ``MAX_COMMIT_BYTES`` (a reader
    never reads more: metrics and config are meant to be small). A marker of more than
    :data:`mtable.INLINE_ROWS <ckptstore.format.mtable.INLINE_ROWS>` ranks names a manifest table, which
    :func:`encode_commit_files` gives too: whoever writes the marker writes the table first."""
    return encode_commit_files(c)[0]


def encode_commit_files(c: Commit) -> Tuple[bytes, Optional[bytes]]:
    """``(marker bytes, table bytes or None)``: the table when ``c`` has more than ``mtable.INLINE_ROWS`` ranks
    (format 3), else ``None`` and the marker as before (format 2, the manifest rows inline)."""
    table = None
    if len(c.manifests) > mtable.INLINE_ROWS:
        table, ref = mtable.encode_table(c.manifests, c.world_size)
        rows: Dict[str, Any] = {"table": ref.encode()}
    else:
        rows = {"manifests": [[r, d, s] + ([g] if g else []) for r, (d, s, g) in sorted(c.manifests.items())]}
    data = frame("commit", {"step": c.step, "world_size": c.world_size, "created": c.created,
                            "bytes_total": c.bytes_total, **rows,
                            "metrics": c.metrics, "config": c.config, "writer": c.writer,
                            **({"run_id": c.run_id} if c.run_id else {}),
                            **({"best": dict(c.best)} if c.best else {}),
                            **({"shards": list(c.shards)} if c.shards else {}),
                            **({"names": sorted(c.names)} if c.names else {})},
                 mtable.TABLE_FORMAT if table is not None else FORMAT_VERSION)
    if len(data) > MAX_COMMIT_BYTES:
        raise ValueError(f"step {c.step}: commit marker of {len(data)} bytes exceeds {MAX_COMMIT_BYTES} "
                         "(metrics and config must be small)")
    return data, table


def decode_commit(data: bytes, *, step: int, what: str) -> Commit:
    body, fmt = unframe(data, "commit", what=what, step=step)
    try:
        if body.get("step") != step:
            raise ValueError(f"commit marker is for step {body.get('step')!r}")
        world_size = _int(body.get("world_size"), "world_size", 1, 1 << 20)
        manifests: Mapping[int, Tuple[bytes, int, int]] = {}
        if fmt >= mtable.TABLE_FORMAT:
            if "manifests" in body:
                raise ValueError("a format-3 commit marker names its manifests in a table, not inline")
            manifests = mtable.ManifestTable(step, world_size, mtable.decode_ref(body.get("table"), world_size))
        else:
            lengths = (3, 4) if fmt >= 2 else (3,)
            for m in body.get("manifests") or []:
                if not isinstance(m, list) or len(m) not in lengths or not isinstance(m[1], bytes) or len(m[1]) != 32:
                    raise ValueError(f"bad manifest reference {m!r:.80}")
                gen = _int(m[3], "manifest generation", 0, 10**9 - 1) if len(m) == 4 else 0
                manifests[_int(m[0], "rank", 0, world_size - 1)] = (m[1], _int(m[2], "manifest size", 1), gen)
            if sorted(manifests) != list(range(world_size)):
                raise ValueError(f"commit names manifests of ranks {sorted(manifests)}, world_size is {world_size}")
        metrics = body.get("metrics") or {}
        config = body.get("config")
        if not isinstance(metrics, dict) or not (config is None or isinstance(config, dict)):
            raise ValueError("bad metrics or config")
        _check_plain_tree(metrics, "metrics")
        _check_plain_tree(config, "config")
        created = body.get("created")
        if (not isinstance(created, (int, float)) or isinstance(created, bool)
                or not MIN_CREATED <= created <= MAX_CREATED):
            raise ValueError(f"bad creation time {created!r:.40}")
        if not isinstance(body.get("writer", ""), str):
            raise ValueError("bad writer")
        run_id = body.get("run_id", "")
        if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id):
            raise ValueError(f"bad run id {run_id!r:.80}")
        best = body.get("best")
        if best is not None:
            if (not isinstance(best, dict) or set(best) != {"metric", "mode"} or not isinstance(best["metric"], str)
                    or not 0 < len(best["metric"]) <= 256 or best["mode"] not in ("min", "max")):
                raise ValueError(f"bad best criterion {best!r:.80}")
        shards = body.get("shards")
        if shards is not None:
            if not isinstance(shards, list) or len(shards) != 3 or not isinstance(shards[0], bytes) \
                    or len(shards[0]) != 32:
                raise ValueError(f"bad shard map reference {shards!r:.80}")
            shards = (shards[0], _int(shards[1], "shard map size", 1), _int(shards[2], "shard map generation", 0,
                                                                            10**9 - 1))
        return Commit(step=check_step(step), world_size=world_size, manifests=manifests, created=float(created),
                      bytes_total=_int(body.get("bytes_total", 0), "bytes_total"), metrics=metrics,
                      config=config, writer=str(body.get("writer", "")), run_id=run_id, best=best,
                      shards=shards, names=_names(body.get("names", [])))
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError) as e:
        raise CorruptCheckpointError(f"invalid commit marker: {e}", step=step, blob=what) from None


MAX_NAMES, MAX_NAME_CHARS = 64, 1024


def check_names(names) -> Tuple[str, ...]:
    """A step's names, sorted and unique: at most ``MAX_NAMES`` non-empty strings of at most ``MAX_NAME_CHARS``
    characters each, no NUL. Raises ``ValueError`` naming the first bad one."""
    if isinstance(names, (str, bytes)) or not isinstance(names, (list, tuple, set, frozenset)):
        raise ValueError(f"names must be a list of strings, got {type(names).__name__}")
    out = set()
    for n in names:
        if not isinstance(n, str) or not 0 < len(n) <= MAX_NAME_CHARS or "\x00" in n:
            raise ValueError(f"bad step name {n!r:.80} (a non-empty str of at most {MAX_NAME_CHARS} characters)")
        out.add(n)
    if len(out) > MAX_NAMES:
        raise ValueError(f"{len(out)} names for one step; at most {MAX_NAMES}")
    return tuple(sorted(out))


def _names(raw) -> Tuple[str, ...]:
    if not isinstance(raw, list):
        raise ValueError(f"bad names {raw!r:.80}")
    return check_names(raw)


_RUN_ID_RE = re.compile(r"^[0-9A-Za-z_.-]{0,128}$")     # uuid4 hex as written; "" for older markers
MIN_CREATED, MAX_CREATED = 0.0, 253402300799.0      # 1970-01-01 .. 9999-12-31 UTC: datetime can print it


def _check_plain_tree(value: Any, what: str, depth: int = 0) -> None:
    """Metrics and config hold plain values: maps with str keys, lists, str, bytes, numbers, bool, None."""
    if depth > 64:
        raise ValueError(f"{what}: nested too deeply")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{what}: key {k!r:.40} is not a str")
            _check_plain_tree(v, f"{what}.{k}", depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_plain_tree(v, what, depth + 1)
    elif not isinstance(value, _PLAIN_VALUE_TYPES):
        raise ValueError(f"{what}: a {type(value).__name__} is not a plain value")
