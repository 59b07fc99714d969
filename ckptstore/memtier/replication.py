"""Peer replication of memory-tier steps, and the rebuild of a lost node's parts from its peers.

Who holds what: node ``n`` = ``rank // node_size``; with ``replicas = k`` each rank sends its part of a memory
step (its manifest and the chunks it references) to the rank with the same local index on each of the next
``k`` nodes (a ring), and receives the parts of the same local rank of the previous ``k`` nodes. A part is the
manifest's bytes verbatim plus every blob and pack it references that the peer's memory root lacks, by name; a
pack is assembled at the peer from the chunks it holds already (:class:`LocalChunks`) and only the byte ranges
it cannot fill cross (content addressing: data-parallel replicas hold the same chunks, so their parts cost the
manifest and their few chunks of their own). The receiver verifies every object against its id (a blob's raw bytes hash to its id, a pack's bytes
to its id) and the manifest by decoding it, writes them into its own memory root in the ordinary layout, and
only then answers; the sender's save fails unless every peer answered "held". The commit marker that makes a
memory step visible is written after that (see :mod:`ckptstore.memtier.tiering`), so a step whose replication failed
is never committed in memory.

Transport: framed byte messages (a length, then the bytes) over a gloo process group of ckptstore's own
(never the training's), point to point, with a deadline on every wait. The group connects lazily
(:class:`~ckptstore.distributed.peers.PeerGroup`): making it at ``Store()`` opens no connection, and a rank
connects only to the ranks it exchanges with: its ``replicas`` ring targets and sources at a save (at most
``2 x replicas`` connections per rank, whatever the world size), the holders or receivers of its items at a
rebuild. A peer that dies mid-exchange fails the
wait (connection closed, or the deadline); nothing retries in place: the step stays uncommitted and the error
is raised once by the save.

Exchange of one part (both sides at once: every rank is a sender and a receiver each round)::

    offer  : sender -> receiver   msgpack {step, rank, gen, manifest: bytes, objects: [[kind, id, codec, nbytes,
                                  size]], marker?: bytes, shards?: bytes}   (or {error: str})
    want   : receiver -> sender   msgpack [[index, None | [[offset, length], ...]], ...]: the objects it lacks,
                                  a pack as the byte ranges it cannot assemble from chunks it holds
    payload: sender -> receiver   the wanted objects' stored bytes (or ranges), concatenated in want order
    status : receiver -> sender   msgpack {ok: bool, error?: str}

Loading never unpickles: offers and answers are msgpack with plain types, checked before use.
"""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import msgpack
import torch

from ..distributed.peers import PeerGroup
from ..format.blobs import CODECS, BlobStore, digest_bytes
from ..util.errors import CheckpointError, CorruptCheckpointError
from ..format.layout import blob_path, check_blob_id, commit_path, manifest_path, pack_path, shards_path
from ..format.manifest import Manifest, decode_commit, decode_manifest

log = logging.getLogger("ckptstore.memtier.replication")

#: the largest offer or answer accepted (a manifest of a very large state is a few MiB)
MAX_MESSAGE = 1 << 30


class ReplicationError(CheckpointError):
    """A part could not be replicated to (or rebuilt from) a peer: the peer's error, a dead peer, a deadline,
    or bytes that do not match their id. The memory step is then not committed (save), or the next tier is
    used (resume)."""


@dataclass
class ReplicationStats:
    """What one exchange moved. Bytes are stored object bytes (blobs and packs; manifests not counted)."""
    bytes_sent: int = 0
    bytes_received: int = 0
    objects_sent: int = 0
    objects_received: int = 0

    def add(self, other: "ReplicationStats") -> None:
        self.bytes_sent += other.bytes_sent
        self.bytes_received += other.bytes_received
        self.objects_sent += other.objects_sent
        self.objects_received += other.objects_received


class Ring:
    """Which ranks replicate to which: ``node = rank // node_size``; the ``j``-th replica of a rank's part lives
    on rank ``((node + j) % nodes) * node_size + local`` (``j = 1 .. replicas``, capped at ``nodes - 1``)."""

    def __init__(self, rank: int, world_size: int, node_size: int, replicas: int):
        if node_size < 1 or world_size % node_size:
            raise ValueError(f"node_size={node_size} does not divide world_size={world_size}")
        self.rank, self.world_size, self.node_size = rank, world_size, node_size
        self.nodes = world_size // node_size
        self.node, self.local = divmod(rank, node_size)
        self.replicas = max(0, min(replicas, self.nodes - 1))

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def target(self, j: int) -> int:
        return ((self.node + j) % self.nodes) * self.node_size + self.local

    def source(self, j: int) -> int:
        return ((self.node - j) % self.nodes) * self.node_size + self.local


class Link:
    """Framed byte messages over a lazily connected gloo group of ckptstore's own
    (:class:`~ckptstore.distributed.peers.PeerGroup`). Made collectively (every rank, in the same order as
    ckptstore's other groups), at ``Store`` construction; it connects to no rank until it exchanges with it.
    Every wait is bounded by ``timeout`` seconds; a failure raises :class:`ReplicationError` naming the peer."""

    def __init__(self, timeout: float):
        self.timeout = datetime.timedelta(seconds=float(timeout))
        self.group = PeerGroup(float(timeout))

    def _wait(self, works, what: str) -> None:
        try:
            for w in works:
                w.wait(self.timeout)
        except Exception as e:
            raise ReplicationError(f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") \
                from e

    def exchange(self, dst: int, data: bytes, src: int, what: str) -> bytes:
        """Send ``data`` to ``dst`` while receiving one message from ``src``; returns the bytes received."""
        g = self.group
        n_out = torch.tensor([len(data)], dtype=torch.int64)
        n_in = torch.zeros(1, dtype=torch.int64)
        self._wait([g.isend(n_out, dst), g.irecv(n_in, src)],
                   f"{what} (sizes, with ranks {dst} / {src})")
        size = int(n_in.item())
        if not 0 <= size <= MAX_MESSAGE:
            raise ReplicationError(f"{what}: rank {src} announced {size} bytes")
        out = torch.empty(size, dtype=torch.uint8)
        works = []
        if data:
            works.append(g.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst))
        if size:
            works.append(g.irecv(out, src))
        self._wait(works, f"{what} (with ranks {dst} / {src})")
        return out.numpy().tobytes()

    def send(self, dst: int, data: bytes, what: str) -> None:
        g = self.group
        works = [g.isend(torch.tensor([len(data)], dtype=torch.int64), dst)]
        if data:
            works.append(g.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst))
        self._wait(works, f"{what} (to rank {dst})")

    def recv(self, src: int, what: str) -> bytes:
        g = self.group
        n = torch.zeros(1, dtype=torch.int64)
        self._wait([g.irecv(n, src)], f"{what} (from rank {src})")
        size = int(n.item())
        if not 0 <= size <= MAX_MESSAGE:
            raise ReplicationError(f"{what}: rank {src} announced {size} bytes")
        out = torch.empty(size, dtype=torch.uint8)
        if size:
            self._wait([g.irecv(out, src)], f"{what} (from rank {src})")
        return out.numpy().tobytes()

    def close(self) -> None:
        self.group.close()


# -- parts: what a manifest references -------------------------------------------------------------------------
def part_objects(storage, manifest: Manifest) -> List[list]:
    """``[[kind, id, codec, nbytes, stored size], ...]`` for every blob and pack ``manifest`` references, as
    stored in ``storage`` (kind ``"blob"`` or ``"pack"``; ``nbytes``: a blob's raw length, 0 for a pack).
    Raises ``CorruptCheckpointError`` naming the object when it is missing."""
    out: List[list] = []
    seen = set()
    for c in manifest.chunk_refs():
        key = ("pack", c.pack) if c.pack is not None else ("blob", c.blob_id)
        if key in seen:
            continue
        seen.add(key)
        path = pack_path(c.pack) if c.pack is not None else blob_path(c.blob_id, c.codec)
        size = storage.size(path)
        if size is None:
            raise CorruptCheckpointError(f"{key[0]} missing from {storage.url}", step=manifest.step,
                                         blob=path)
        out.append([key[0], key[1], "raw" if c.pack is not None else c.codec,
                    0 if c.pack is not None else c.nbytes, size])
    return out


def _object_path(obj) -> Tuple[str, str, str, int, int]:
    """An offered object, checked (untrusted input): ``(path, kind, id, nbytes, size)``."""
    if not isinstance(obj, list) or len(obj) != 5:
        raise CorruptCheckpointError(f"malformed object in a peer's offer: {obj!r:.100}")
    kind, oid, codec, nbytes, size = obj
    if kind not in ("blob", "pack") or not isinstance(oid, str) or codec not in CODECS \
            or not isinstance(nbytes, int) or not isinstance(size, int) or nbytes < 0 or size < 0:
        raise CorruptCheckpointError(f"malformed object in a peer's offer: {obj!r:.100}")
    check_blob_id(oid)
    path = pack_path(oid) if kind == "pack" else blob_path(oid, codec)
    return path, kind, oid, nbytes, size


def _intact(kind: str, oid: str, codec: str, nbytes: int, payload: bytes) -> bool:
    if kind == "pack":
        return digest_bytes(payload, threads=True) == oid
    return BlobStore.intact(payload, oid, codec, nbytes, threads=True)


def make_offer(storage, step: int, rank: int, gen: int, manifest_bytes: bytes, manifest: Manifest,
               extra: Optional[Dict[str, bytes]] = None) -> Tuple[bytes, List[list]]:
    objects = part_objects(storage, manifest)
    body: Dict[str, Any] = {"step": step, "rank": rank, "gen": gen, "manifest": manifest_bytes,
                            "objects": objects}
    body.update(extra or {})
    return msgpack.packb(body, use_bin_type=True), objects


def error_offer(e: BaseException) -> bytes:
    return msgpack.packb({"error": f"{type(e).__name__}: {e}"[:2000]}, use_bin_type=True)


def read_offer(data: bytes, *, step: int, rank: int, what: str) -> Dict[str, Any]:
    """A peer's offer, checked: it is for ``step`` and ``rank``; raises :class:`ReplicationError` for an
    error offer, ``CorruptCheckpointError`` for a malformed one."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:
        raise CorruptCheckpointError(f"{what}: undecodable offer ({type(e).__name__})", step=step) from None
    if not isinstance(body, dict):
        raise CorruptCheckpointError(f"{what}: malformed offer", step=step)
    if "error" in body:
        raise ReplicationError(f"{what}: the peer could not send it: {body['error']}")
    if body.get("step") != step or body.get("rank") != rank or not isinstance(body.get("gen"), int) \
            or not isinstance(body.get("manifest"), bytes) or not isinstance(body.get("objects"), list):
        raise CorruptCheckpointError(f"{what}: the offer is not step {step} rank {rank}'s part", step=step)
    body["paths"] = [_object_path(o) for o in body["objects"]]
    body["decoded"] = decode_manifest(body["manifest"], step=step, rank=rank, what=f"{what}: manifest")
    return body


class LocalChunks:
    """Chunks a receiving root already holds, by id (from manifests it holds for the step: its own rank's at a
    save, the parts it received so far at a rebuild), so that a pack the peer offers is assembled from them and
    only the byte ranges the root lacks cross the network: data-parallel replicas pack the same small chunks
    beside a few of their own (RNG, data position), into packs of different ids."""

    def __init__(self, storage):
        self.storage = storage
        self._where: Dict[str, Tuple[str, int, int, str]] = {}     # id -> (path, offset, stored, codec)

    def add(self, manifest: Manifest) -> None:
        for c in manifest.chunk_refs():
            if c.blob_id in self._where:
                continue
            if c.pack is not None:
                self._where[c.blob_id] = (pack_path(c.pack), c.offset, c.stored, c.codec)
            else:
                self._where[c.blob_id] = (blob_path(c.blob_id, c.codec), 0, c.nbytes, c.codec)

    def source(self, blob_id: str, codec: str, stored: int) -> Optional[Tuple[str, int]]:
        got = self._where.get(blob_id)
        if got is None or got[3] != codec or got[2] != stored or not self.storage.exists(got[0]):
            return None
        return got[0], got[1]


def _pack_plan(offer: Dict[str, Any], i: int, local: Optional[LocalChunks]):
    """``(ranges to ask for, [(dst offset, src path, src offset, length)] to fill locally)`` for offered pack
    ``i``, or ``None`` when nothing of it is here (ask for the whole pack). Ranges are ``[offset, length]``,
    merged; the bytes of the pack no chunk reference covers are asked for too."""
    if local is None or offer.get("decoded") is None:
        return None
    _path, _kind, oid, _n, size = offer["paths"][i]
    refs = sorted({(c.offset, c.stored, c.blob_id, c.codec) for c in offer["decoded"].chunk_refs() if c.pack == oid})
    fills, ranges = [], []
    pos = 0

    def ask(off: int, n: int) -> None:
        if n <= 0:
            return
        if ranges and ranges[-1][0] + ranges[-1][1] == off:
            ranges[-1][1] += n
        else:
            ranges.append([off, n])
    for off, stored, cid, codec in refs:
        if off < pos or off + stored > size:
            return None                             # overlapping or out of bounds: ask for it whole
        ask(pos, off - pos)
        src = local.source(cid, codec, stored)
        if src is None:
            ask(off, stored)
        else:
            fills.append((off, src[0], src[1], stored))
        pos = off + stored
    ask(pos, size - pos)
    if not fills:
        return None
    return ranges, fills


def wanted(storage, offer: Dict[str, Any], local: Optional[LocalChunks] = None) -> List[list]:
    """What to ask for of the offered objects ``storage`` lacks (by name: a memory root holds bytes of this
    boot only, each verified when it arrived or written by this job): ``[index, None]`` for a whole object,
    ``[index, [[offset, length], ...]]`` for the ranges of a pack that ``local`` cannot fill."""
    out: List[list] = []
    for i, (path, kind, *_rest) in enumerate(offer["paths"]):
        if storage.exists(path):
            continue
        plan = _pack_plan(offer, i, local) if kind == "pack" else None
        out.append([i, None if plan is None else plan[0]])
    return out


def _check_want(want, objects: Sequence[list]) -> List[Tuple[int, Optional[List[Tuple[int, int]]]]]:
    """A peer's answer, checked against what was offered (untrusted input)."""
    if not isinstance(want, list):
        raise CorruptCheckpointError("malformed answer")
    out = []
    for w in want:
        if not isinstance(w, list) or len(w) != 2 or not isinstance(w[0], int) or not 0 <= w[0] < len(objects):
            raise CorruptCheckpointError(f"malformed answer: {w!r:.80}")
        size = objects[w[0]][4]
        if w[1] is None:
            out.append((w[0], None))
            continue
        if not isinstance(w[1], list) or objects[w[0]][0] != "pack":
            raise CorruptCheckpointError(f"malformed answer: {w!r:.80}")
        ranges = []
        for r in w[1]:
            if not (isinstance(r, list) and len(r) == 2 and all(isinstance(v, int) for v in r)
                    and r[0] >= 0 and r[1] > 0 and r[0] + r[1] <= size):
                raise CorruptCheckpointError(f"malformed range {r!r:.80}")
            ranges.append((r[0], r[1]))
        out.append((w[0], ranges))
    return out


def payload_of(storage, objects: Sequence[list], want) -> bytes:
    """The bytes a peer asked for (``want`` as :func:`wanted` makes it), concatenated in its order."""
    parts = []
    for i, ranges in _check_want(want, objects):
        kind, oid, codec, _n, size = objects[i]
        path = pack_path(oid) if kind == "pack" else blob_path(oid, codec)
        if ranges is None:
            data = storage.read_bytes(path)
            if len(data) != size:
                raise CorruptCheckpointError(f"{kind} changed size while being sent ({len(data)} != {size} "
                                             "bytes)", blob=path)
            parts.append(data)
            continue
        for off, n in ranges:
            buf = bytearray(n)
            if storage.read_range_into(path, off, memoryview(buf)) != n:
                raise CorruptCheckpointError(f"{kind} shorter than a range asked for", blob=path)
            parts.append(bytes(buf))
    return b"".join(parts)


def take(storage, offer: Dict[str, Any], want: Sequence[list], payload: bytes, *, step: int, rank: int,
         what: str, local: Optional[LocalChunks] = None) -> ReplicationStats:
    """Verify and write the received objects (a pack asked for by ranges is assembled from ``local`` and the
    ranges, then hashed whole), then the manifest (decoded first: untrusted input). Raises
    ``CorruptCheckpointError`` naming the object that does not match its id."""
    stats = ReplicationStats()
    pos = 0
    for i, ranges in want:
        path, kind, oid, nbytes, size = offer["paths"][i]
        codec = offer["objects"][i][2]
        if ranges is None:
            piece = payload[pos:pos + size]
            pos += size
            got = len(piece)
            ok = len(piece) == size and _intact(kind, oid, codec, nbytes, piece)
        else:
            plan = _pack_plan(offer, i, local)
            if plan is None or [list(r) for r in plan[0]] != [list(r) for r in ranges]:
                raise CorruptCheckpointError(f"{what}: the pack's local chunks changed during the exchange",
                                             step=step, blob=path)
            buf = bytearray(size)
            got = 0
            for off, n in ranges:
                buf[off:off + n] = payload[pos:pos + n]
                pos += n
                got += n
            for off, src, src_off, n in plan[1]:
                if storage.read_range_into(src, src_off, memoryview(buf)[off:off + n]) != n:
                    raise CorruptCheckpointError(f"{what}: a local chunk of {src} is short", step=step, blob=src)
            piece = bytes(buf)
            ok = pos <= len(payload) and _intact(kind, oid, codec, nbytes, piece)
        if not ok:
            raise CorruptCheckpointError(f"{what}: {kind} does not match its id", step=step, blob=path)
        storage.write_new(path, piece)
        stats.objects_received += 1
        stats.bytes_received += got
    if pos != len(payload):
        raise CorruptCheckpointError(f"{what}: {len(payload) - pos} bytes more or less than the objects asked "
                                     "for", step=step)
    data = offer["manifest"]
    path = manifest_path(step, rank, offer["gen"])
    storage.write_atomic(path, data)
    if local is not None and offer.get("decoded") is not None:
        local.add(offer["decoded"])
    return stats


def _status(error: Optional[BaseException]) -> bytes:
    return msgpack.packb({"ok": error is None, "error": None if error is None else
                          f"{type(error).__name__}: {error}"[:2000]}, use_bin_type=True)


def _read_status(data: bytes) -> Tuple[bool, str]:
    try:
        body = msgpack.unpackb(data, raw=False)
        return bool(body["ok"]), str(body.get("error") or "")
    except Exception:
        return False, "undecodable answer"


# -- saving: replicate this rank's part to its peers ---------------------------------------------------------
def _row_of(offer: Dict[str, Any]) -> Tuple[bytes, int, int]:
    """The manifest row (digest, size, generation) of the part an offer carried."""
    data = offer["manifest"]
    return bytes.fromhex(digest_bytes(data)), len(data), int(offer["gen"])


def replicate(link: Link, ring: Ring, storage, step: int, gen: int, manifest: Manifest,
              rows: Optional[Dict[int, Tuple[bytes, int, int]]] = None) -> ReplicationStats:
    """This rank's side of one memory step's replication (see the module docstring): for each replica ``j``,
    send this rank's part to ``ring.target(j)`` while taking ``ring.source(j)``'s. ``rows``: filled with the
    manifest row of each part taken (rank -> (digest, size, generation)): where the step's marker names a
    manifest table, this root holds no row of another node's rank until they are written (the committed rows:
    a rank commits the manifest it replicated). Returns the bytes moved; raises :class:`ReplicationError` (or
    ``CorruptCheckpointError``) when this rank's part did not reach a peer, or a peer's part did not reach this
    rank."""
    stats = ReplicationStats()
    rank = ring.rank
    mbytes = storage.read_bytes(manifest_path(step, rank, gen))
    local = LocalChunks(storage)
    local.add(manifest)                  # a data-parallel peer's packs are mostly this rank's chunks
    for j in range(1, ring.replicas + 1):
        dst, src = ring.target(j), ring.source(j)
        what = f"step {step}: replica {j} of rank {src}'s part"
        try:
            offer, objects = make_offer(storage, step, rank, gen, mbytes, manifest)
        except Exception as e:              # still take part in the exchange: the peers must not wait
            offer, objects = error_offer(e), []
        theirs_raw = link.exchange(dst, offer, src, f"step {step}: offers")
        error: Optional[BaseException] = None
        try:
            theirs = read_offer(theirs_raw, step=step, rank=src, what=what)
            want = wanted(storage, theirs, local)
        except Exception as e:
            theirs, want, error = None, [], e
        their_want_raw = link.exchange(src, msgpack.packb(want), dst, f"step {step}: wants")
        try:
            their_want = msgpack.unpackb(their_want_raw) if objects else []
            log.debug("step %d: sending rank %d's part to rank %d", step, rank, dst)
            out = payload_of(storage, objects, their_want)
            stats.objects_sent += len(their_want)
            stats.bytes_sent += len(out)
        except Exception as e:
            out = b""
            error = error or e
        got = link.exchange(dst, out, src, f"step {step}: chunks")
        if error is None and theirs is not None:
            try:
                stats.add(take(storage, theirs, want, got, step=step, rank=src, what=what, local=local))
                if rows is not None:
                    rows[src] = _row_of(theirs)
            except Exception as e:
                error = e
        answer = link.exchange(src, _status(error), dst, f"step {step}: answers")
        ok, why = _read_status(answer)
        if error is not None:
            raise ReplicationError(f"{what} was not taken on rank {rank}: {type(error).__name__}: {error}") \
                from error
        if not ok:
            raise ReplicationError(f"step {step}: rank {dst} could not hold rank {rank}'s part: {why}")
    return stats


# -- resuming: rebuild the parts a node lacks from the nodes that hold them --------------------------------------
def rebuild(link: Link, storage, catalog, step: int, marker_digest: str, plan: Sequence[Sequence[int]],
            rank: int) -> Tuple[ReplicationStats, Optional[Tuple[bytes, Optional[bytes]]]]:
    """Run this rank's side of a rebuild ``plan`` (``[holder, receiver, part]`` items, the same list and order
    on every rank; ``part`` -1: the commit marker alone) for memory ``step``, whose commit marker hashes to
    ``marker_digest``. A holder sends the part from its memory root (with the marker and the shard map); a
    receiver verifies every object and writes it into its own root. Items of other ranks are skipped. Each
    rank runs its items in the plan's order, so the earliest unfinished item always has both its ranks at it:
    the point-to-point exchanges pair up without deadlock, and items of disjoint pairs run at once. Returns
    ``(bytes moved, (marker bytes, shard map bytes) received or None)``: the marker is written by the root's
    leader with :func:`write_marker` once every rank's items succeeded. Raises :class:`ReplicationError` /
    ``CorruptCheckpointError`` after the whole plan ran (so no peer is left waiting) when any of this rank's
    items failed."""
    stats = ReplicationStats()
    failure: Optional[BaseException] = None
    marker: Optional[Tuple[bytes, Optional[bytes]]] = None
    local = LocalChunks(storage)         # chunks of the parts received so far: shared ones cross once
    for holder, receiver, part in plan:
        if rank == holder:
            what = f"step {step}: rank {part}'s part for rank {receiver}"
            objects: List[list] = []
            try:
                data, commit = catalog.read_commit_bytes(step)
                if digest_bytes(data) != marker_digest:
                    raise CorruptCheckpointError("commit marker differs from the one agreed on", step=step)
                extra: Dict[str, Any] = {"marker": data}
                if part >= 0 and commit.table is not None:      # the receiver's root may hold no row of it
                    extra["row"] = list(commit.manifests[part])
                if commit.shards is not None and storage.exists(shards_path(step, commit.shards[2])):
                    extra["shards"] = storage.read_bytes(shards_path(step, commit.shards[2]))
                if part >= 0:
                    mbytes, manifest = catalog.read_manifest_bytes(commit, part)
                    offer, objects = make_offer(storage, step, part, commit.manifests[part][2], mbytes,
                                                manifest, extra)
                else:
                    offer = msgpack.packb(dict(extra, step=step, rank=part, gen=0, manifest=b"", objects=[]),
                                          use_bin_type=True)
            except Exception as e:
                link.send(receiver, error_offer(e), what)
                failure = failure or e
                continue
            link.send(receiver, offer, what)
            want = msgpack.unpackb(link.recv(receiver, what))
            try:
                log.debug("step %d: sending rank %d's part to rank %d", step, part, receiver)
                out = payload_of(storage, objects, want if isinstance(want, list) else [])
            except Exception as e:
                out, failure = b"", failure or e
            link.send(receiver, out, what)
            stats.objects_sent += len(want) if isinstance(want, list) else 0
            stats.bytes_sent += len(out)
            ok, why = _read_status(link.recv(receiver, what))
            if not ok:
                failure = failure or ReplicationError(f"{what}: rank {receiver} refused it: {why}")
        elif rank == receiver:
            what = f"step {step}: rank {part}'s part from rank {holder}"
            raw = link.recv(holder, what)
            error: Optional[BaseException] = None
            want: List[int] = []
            try:
                body = _rebuild_offer(raw, step, part, what)
            except ReplicationError as e:        # the holder sent an error offer and goes on to its next item
                failure = failure or e
                continue
            except Exception as e:               # malformed: answer all the same, the holder waits for it
                body, error = {"paths": []}, e
            try:
                if error is not None:
                    raise error
                m = body.get("marker")
                if not isinstance(m, bytes) or digest_bytes(m) != marker_digest:
                    raise CorruptCheckpointError("commit marker differs from the one agreed on", step=step)
                commit = decode_commit(m, step=step, what=f"{what}: commit marker")
                if part >= 0 and commit.table is not None:      # the holder's row, checked against the part
                    row = body.get("row")
                    if not (isinstance(row, list) and len(row) == 3 and tuple(row) == _row_of(body)):
                        raise CorruptCheckpointError("manifest row differs from the part's manifest", step=step)
                elif part >= 0 and commit.manifests.get(part, (None, None, None))[2] != body["gen"]:
                    raise CorruptCheckpointError("manifest generation differs from the commit marker's", step=step)
                marker = (m, body.get("shards") if isinstance(body.get("shards"), bytes) else None)
                want = wanted(storage, body, local) if part >= 0 else []
            except Exception as e:
                error = e
            link.send(holder, msgpack.packb(want), what)
            got = link.recv(holder, what)
            if error is None and part >= 0:
                try:
                    stats.add(take(storage, body, want, got, step=step, rank=part, what=what, local=local))
                    if commit.table is not None:     # its row, before the leader writes the marker
                        catalog.write_rows(step, commit.table.digest, {part: _row_of(body)})
                except Exception as e:
                    error = e
            link.send(holder, _status(error), what)
            if error is not None:
                failure = failure or error
    if failure is not None:
        if isinstance(failure, CheckpointError):
            raise failure
        raise ReplicationError(f"step {step}: rebuild on rank {rank} failed: {type(failure).__name__}: "
                               f"{failure}") from failure
    return stats, marker


def write_marker(storage, step: int, marker: Tuple[bytes, Optional[bytes]]) -> None:
    """Last step of a rebuild, on the root's leader once every rank's items succeeded: the shard map, then the
    commit marker (received from a holder, checked against the agreed digest), unless the root has it."""
    data, shard_map = marker
    try:
        have = storage.read_bytes(commit_path(step)) if storage.exists(commit_path(step)) else None
    except OSError:
        have = None
    if have == data:
        return
    commit = decode_commit(data, step=step, what=f"step {step}: commit marker")
    if shard_map is not None and commit.shards is not None:
        storage.write_atomic(shards_path(step, commit.shards[2]), shard_map)
    storage.write_atomic(commit_path(step), data)            # last: the step is whole here now


def _rebuild_offer(raw: bytes, step: int, part: int, what: str) -> Dict[str, Any]:
    if part >= 0:
        return read_offer(raw, step=step, rank=part, what=what)
    try:
        body = msgpack.unpackb(raw, raw=False)
    except Exception:
        raise CorruptCheckpointError(f"{what}: undecodable offer", step=step) from None
    if not isinstance(body, dict):
        raise CorruptCheckpointError(f"{what}: malformed offer", step=step)
    if "error" in body:
        raise ReplicationError(f"{what}: the peer could not send it: {body['error']}")
    body["paths"] = []
    return body
