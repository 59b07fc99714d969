"""Read each byte once at resume: chunks every rank needs are read by one rank and broadcast to the others.

Data-parallel replicas resume the same values: keys saved with ``save(replicated=[...])`` (every rank reads rank
0's chunks), identical plain tensors saved by every rank (content addressing gives them the same chunk ids),
and every plain value after a world-size change (all read from rank 0's manifest). Without this module each of
the N ranks reads those bytes from storage; with it the job reads them once.

The plan, agreed without any exchange that grows with N x chunks (every step is O(chunks) per rank):

1. each rank lists the chunks its plain values need: unique ``(chunk id, raw bytes)``;
2. rank 0 broadcasts its list (40 bytes a chunk, sorted by pack and offset so that neighbours stay together);
3. one all-reduce (MIN) of a byte per listed chunk: 1 where this rank needs it too. The chunks left at 1 are
   needed by every rank (a chunk needed by only some ranks, e.g. a rank-local value, is read by those ranks
   as before, so a damaged or lying manifest can only make fewer chunks shared, never a rank wait for bytes
   nobody sends);
4. the shared chunks, in that order, are cut into ``world_size`` contiguous runs of about equal bytes: rank r
   reads run r (ranged reads stay contiguous, no hole is read twice) and verifies every chunk against its id
   (BLAKE3) as any read does;
5. one all-reduce (MIN) of every rank's outcome: if any rank failed to read (a missing pack, a chunk that does
   not match its id), the lowest failing rank broadcasts its error and every rank raises it (as a
   :class:`PeerReadError`, a ``CorruptCheckpointError`` naming the rank, on the others), so resume's agreement
   falls back on every rank together;
6. else each run is broadcast from its reader in pieces of at most ``PIECE`` bytes (a chunk of at least
   ``PIECE`` bytes straight from / into the destination buffers, smaller ones through one staging buffer), and
   each receiver hashes every chunk it received against its id before it is used (receivers re-hash: BLAKE3
   costs far less than a read from an object store, and it keeps "every byte used was verified on this rank").

Transport: a gloo process group of this module's own (:class:`~ckptstore.distributed.peers.PeerGroup`, made
by every rank at the first resume attempt, the same point of the program on every rank), so it works beside
NCCL and never interleaves with the training's collectives. Its connections open lazily, on first use: gloo's
broadcast is a binomial tree (rank ``r`` exchanges with ranks ``r +/- 2^i``, whoever the root) and its
all-reduce a ring (``r +/- 1``), so a rank connects to at most ``2 log2 N`` others, not to all ``N - 1``.
Extra memory: one staging buffer of ``PIECE`` bytes per rank.

Every rank takes part exactly once per resume attempt (:meth:`ReadOnce.session`): a rank that fails before it
reads anything (a missing manifest, keys that do not match) still joins the first all-reduce with its error,
so no rank waits for one that is not coming.

When: automatically when ``torch.distributed`` is initialised with the store's rank and world size (> 1) and
the step is read from an object store or a shared / network filesystem (:func:`worth_it`; every rank must
agree, else all read for themselves). Not from a node's own disk (ext4, xfs, ...): the ranks of one node
reading the same files are served by one page cache there, and a broadcast only costs time (measured hot:
0.44 s -> 0.96 s for 192 MiB at 2 ranks; benchmarks/bench_read_once.py). ``CKPTSTORE_READ_ONCE=1`` turns it
on for any storage, ``=0`` off for all (every rank reads what it needs itself, as before).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from concurrent.futures import Executor
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..format.blobs import digest_bytes
from .peers import PeerGroup
from ..util.errors import CheckpointError, CorruptCheckpointError
from ..format.manifest import ARRAY_KINDS
from ..io.reader import wait_all

log = logging.getLogger("ckptstore")

PIECE = 32 << 20            # bytes per broadcast (and the size of the one staging buffer)
_ENTRY = 40                 # bytes per listed chunk: 32 of id, 8 of raw length
_ERROR_BYTES = 16 << 10     # an error's message as broadcast (truncated)


class PeerReadError(CorruptCheckpointError):
    """Another rank failed to read (or to get ready to read) its share of a step's chunks: every rank raises
    this error for that step, so resume falls back together. ``rank``: the failing rank; ``origin``: the
    class name of its error (``"CorruptCheckpointError"`` when the bytes at fault are damaged or missing)."""

    def __init__(self, message: str, *, rank: int, origin: str, step=None, key=None, blob=None):
        super().__init__(message)           # the message names step, key and blob already (the reader's own)
        self.step, self.key, self.blob = step, key, blob
        self.rank, self.origin = rank, origin


#: filesystems of a node's own disks: ranks of one node reading the same files there are served by one page
#: cache (the disk is read once), and ranks of other nodes read their own disks; a broadcast over the network
#: only costs time there (measured: benchmarks/bench_read_once.py)
LOCAL_DISKS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "jfs", "reiserfs", "nilfs2", "zfs",
                         "bcachefs", "overlay", "tmpfs", "ramfs"})


def worth_it(storage) -> bool:
    """Whether reading through ``storage`` gains from read-once: an object store (every replica's GET costs
    the bucket's bandwidth and requests) or a shared / network filesystem (NFS, Lustre, GPFS, a FUSE mount:
    any type not in :data:`LOCAL_DISKS`); not a node's own disk. ``CKPTSTORE_READ_ONCE=1`` says yes anywhere."""
    if os.environ.get("CKPTSTORE_READ_ONCE", "auto") == "1":
        return True
    try:
        root = storage.local_path("")
    except (OSError, ValueError):
        return False
    if root is None:
        return True
    from ..storage.local import filesystem_type
    fstype = filesystem_type(root)
    return fstype is not None and fstype not in LOCAL_DISKS


def enabled(rank: int, world_size: int) -> bool:
    """Whether read-once may apply: ``torch.distributed`` initialised with this rank and world size (> 1), and
    not turned off by ``CKPTSTORE_READ_ONCE=0``."""
    if world_size < 2 or os.environ.get("CKPTSTORE_READ_ONCE", "1") == "0":
        return False
    import torch.distributed as dist
    return (dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size
            and dist.get_rank() == rank)


class ReadOnce:
    """One store's read-once transport: its gloo group (made on first use) and the statistics of the last
    session. ``stats``: ``{"shared_bytes", "read_bytes", "received_bytes", "shared_chunks", "group_seconds"}``
    of the last attempt that shared anything (bytes are raw chunk bytes; ``group_seconds``: the time spent
    making the gloo group, once per store, else 0)."""

    def __init__(self, rank: int, world_size: int, timeout: float):
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._group = None
        self.stats: Optional[Dict[str, Any]] = None
        self.group_seconds = 0.0

    def group(self) -> PeerGroup:
        if self._group is None:
            t0 = time.perf_counter()
            self._group = PeerGroup(self.timeout)
            self.group_seconds = time.perf_counter() - t0
        return self._group

    @contextlib.contextmanager
    def session(self) -> Iterator[Optional["Session"]]:
        """One resume attempt of one step: yields a :class:`Session` (or ``None`` when read-once does not apply)
        that the attempt's plain-value read uses once. On leaving, a session no read used still takes part in
        the ranks' exchange (with this rank's error, or needing nothing), so every rank does so exactly once."""
        if not enabled(self.rank, self.world_size):
            yield None
            return
        s = Session(self)
        try:
            yield s
        except BaseException as e:
            if not s.used:
                s.join_unused(e if isinstance(e, Exception) else CheckpointError(repr(e)))
            raise
        if not s.used:
            s.join_unused(None)


class Session:
    """The exchange of one resume attempt (see the module docstring). :meth:`begin` (by the reader, before it
    allocates anything), :meth:`take` for every chunk occurrence it would read, then :meth:`finish` after its
    reads, or :meth:`fail` when anything went wrong. Each of these is collective."""

    def __init__(self, owner: ReadOnce):
        self.o = owner
        self.rank, self.world = owner.rank, owner.world_size
        self.used = False
        self.wanted = True
        self.step: Optional[int] = None
        self._owner: Dict[Tuple[str, int], int] = {}        # shared chunk -> reading rank
        self._order: List[Tuple[str, int]] = []               # shared chunks in broadcast order
        self._primary: Dict[Tuple[str, int], Tuple[memoryview, Optional[str]]] = {}
        self._copies: List[Tuple[Tuple[str, int], memoryview]] = []
        self._executor: Optional[Executor] = None

    # -- the collective steps --------------------------------------------------------------------------------
    def _all_min(self, values: torch.Tensor) -> torch.Tensor:
        return self.o.group().all_reduce_min(values)

    def _bcast(self, t: torch.Tensor, src: int) -> None:
        if t.numel():
            self.o.group().broadcast(t, src)

    def _agree(self, error: Optional[BaseException], want: bool = True) -> Optional[BaseException]:
        """All-reduce the lowest failing rank (and whether every rank wants read-once: ``self.wanted``); when
        some rank failed, it broadcasts its error and every rank returns the error to raise (the failing rank
        its own)."""
        got = self._all_min(torch.tensor([self.rank if error is not None else self.world, int(want)],
                                         dtype=torch.int64))
        first, self.wanted = int(got[0]), bool(got[1])
        if first >= self.world:
            return None
        buf = torch.zeros(_ERROR_BYTES, dtype=torch.uint8)
        if first == self.rank:
            data = json.dumps(_describe(error)).encode()[:_ERROR_BYTES - 4]
            buf[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
            buf[4: 4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._bcast(buf, first)
        if first == self.rank:
            return error
        raw = bytes(buf.numpy())
        n = int.from_bytes(raw[:4], "little")
        try:
            d = json.loads(raw[4: 4 + n].decode("utf-8", "replace"))
        except ValueError:
            d = {"message": "(unreadable error)", "class": "Exception"}
        return PeerReadError(f"rank {first} could not read its share of the step: {d.get('message')}",
                             rank=first, origin=str(d.get("class")), step=d.get("step", self.step),
                             key=d.get("key"), blob=d.get("blob"))

    def _plan(self, needs: List[Tuple[str, int, tuple]]) -> None:
        """Steps 2-4: rank 0's list, the all-reduce of who needs what, the contiguous runs."""
        if self.rank == 0:
            needs = sorted(needs, key=lambda n: n[2])
            body = b"".join(bytes.fromhex(cid) + nb.to_bytes(8, "little") for cid, nb, _ in needs)
            count = torch.tensor([len(needs)], dtype=torch.int64)
        else:
            count = torch.zeros(1, dtype=torch.int64)
        self._bcast(count, 0)
        n = int(count[0])
        listed = torch.frombuffer(bytearray(body), dtype=torch.uint8) if self.rank == 0 and n else \
            torch.zeros(n * _ENTRY, dtype=torch.uint8)
        self._bcast(listed, 0)
        raw = bytes(listed.numpy())
        keys = [(raw[i * _ENTRY: i * _ENTRY + 32].hex(), int.from_bytes(raw[i * _ENTRY + 32: (i + 1) * _ENTRY],
                                                                       "little")) for i in range(n)]
        mine = {(cid, nb) for cid, nb, _ in needs}
        have = torch.tensor([k in mine for k in keys], dtype=torch.uint8) if n else torch.zeros(0, dtype=torch.uint8)
        if n:
            self._all_min(have)
        shared = [k for k, h in zip(keys, have.tolist()) if h and k[1] > 0]
        total = sum(nb for _, nb in shared)
        before = 0
        for k in shared:                        # run r: chunks whose middle byte falls in [r, r+1) * total / N
            self._owner[k] = min(self.world - 1, (2 * before + k[1]) * self.world // (2 * total))
            before += k[1]
        self._order = sorted(shared, key=lambda k: self._owner[k])      # stable: runs keep their order

    # -- the reader's interface ------------------------------------------------------------------------------
    def begin(self, step: int, nodes: Sequence[Any], executor: Executor, storage) -> Optional["Session"]:
        """Agree on the plan for the manifest nodes ``nodes`` (those about to be read through ``storage``) of
        ``step``. Returns ``self``, or ``None`` when each rank is to read all it needs itself: this session was
        used already (a second read in the same attempt), or some rank's storage is not :func:`worth_it`.
        Raises the agreed error when a rank failed before reading."""
        if self.used:
            return None
        self.used, self.step, self._executor = True, step, executor
        needs, seen = [], set()
        for m in nodes:
            if m.kind not in ARRAY_KINDS:
                continue
            for c in m.payload.chunks:
                k = (c.blob_id, c.nbytes)
                if k not in seen and len(c.blob_id) == 64:
                    seen.add(k)
                    needs.append((c.blob_id, c.nbytes, (c.pack or "", c.offset or 0, len(needs))))
        agreed = self._agree(None, worth_it(storage))
        if agreed is not None:
            raise agreed
        if not self.wanted:
            return None
        self._plan(needs)
        return self

    def join_unused(self, error: Optional[Exception]) -> None:
        """The attempt ended without reading through this session: take part with ``error`` (or needing
        nothing). Raises nothing of the exchange's: the attempt's own outcome stands (resume's agreement on
        outcomes tells every rank about the others')."""
        self.used = True
        if self._agree(error) is not None or not self.wanted:
            return
        self._plan([])
        try:
            self.finish()
        except CheckpointError as e:
            log.debug("read-once: another rank's read failed after this rank's attempt ended: %s", e)

    def received(self, c) -> bool:
        """Whether another rank reads chunk ``c`` for this one (no stat, no read here)."""
        own = self._owner.get((c.blob_id, c.nbytes))
        return own is not None and own != self.rank

    def take(self, c, out: memoryview, key: Optional[str]) -> bool:
        """Record the destination ``out`` of one occurrence of chunk ``c``; ``True`` when this rank must not
        read it itself (another rank's share, or a second occurrence of a shared chunk: copied after)."""
        k = (c.blob_id, c.nbytes)
        if k not in self._owner or len(out) != c.nbytes:    # (a short view: the read raises what is wrong)
            return False
        if k in self._primary:
            self._copies.append((k, out))
            return True
        self._primary[k] = (out, key)
        return self._owner[k] != self.rank

    def fail(self, error: BaseException) -> BaseException:
        """This rank's reads failed: tell every rank (the lowest failing rank's error reaches the others);
        returns ``error``, for the caller to raise."""
        self._agree(error)
        return error

    def finish(self) -> None:
        """This rank's reads succeeded: agree, then broadcast every run from its reader, each received chunk
        verified against its id, second occurrences copied. Raises the agreed error when some rank failed,
        ``CorruptCheckpointError`` when received bytes do not match their id."""
        agreed = self._agree(None)
        if agreed is not None:
            raise agreed
        if not self._order:
            return
        stage = torch.empty(min(PIECE, sum(nb for _, nb in self._order)), dtype=torch.uint8)
        checks = []
        read = received = 0
        for src, piece in _pieces(self._order, self._owner):
            if src == self.rank:
                read += sum(hi - lo for _, lo, hi in piece)
            else:
                received += sum(hi - lo for _, lo, hi in piece)
            if len(piece) == 1:                          # one chunk (or a slice of a large one): in place
                k, lo, hi = piece[0]
                self._bcast(torch.frombuffer(self._primary[k][0][lo:hi], dtype=torch.uint8), src)
            else:
                n = sum(hi - lo for _, lo, hi in piece)
                view = memoryview(stage.numpy()).cast("B")
                if src == self.rank:
                    pos = 0
                    for k, lo, hi in piece:
                        view[pos: pos + hi - lo] = self._primary[k][0][lo:hi]
                        pos += hi - lo
                self._bcast(stage[:n], src)
                if src != self.rank:
                    pos = 0
                    for k, lo, hi in piece:
                        self._primary[k][0][lo:hi] = view[pos: pos + hi - lo]
                        pos += hi - lo
            if src != self.rank:
                for k, lo, hi in piece:
                    if hi == k[1]:                      # the chunk's last byte arrived: verify it
                        checks.append(self._executor.submit(self._check, k))
        wait_all(checks)                                # every check done before the first error is raised
        for k, out in self._copies:
            out[:] = self._primary[k][0]
        self.o.stats = {"shared_bytes": sum(nb for _, nb in self._order), "read_bytes": read,
                        "received_bytes": received, "shared_chunks": len(self._order),
                        "group_seconds": round(self.o.group_seconds, 4)}
        self.o.group_seconds = 0.0

    def _check(self, k) -> None:
        out, key = self._primary[k]
        if digest_bytes(out, threads=True) != k[0]:
            raise CorruptCheckpointError(f"chunk received from rank {self._owner[k]} does not match its hash",
                                         step=self.step, key=key, blob=k[0])


def _pieces(order: List[Tuple[str, int]], owner: Dict[Tuple[str, int], int]):
    """``(reading rank, [(chunk, lo, hi), ...])`` broadcasts of at most ``PIECE`` bytes, in order: a chunk of
    ``PIECE`` bytes or more in slices of its own, smaller neighbours of one reader grouped."""
    cur: List[Tuple[Tuple[str, int], int, int]] = []
    cur_src, size = None, 0
    for k in order:
        src, nb = owner[k], k[1]
        if cur and (src != cur_src or size + nb > PIECE):
            yield cur_src, cur
            cur, size = [], 0
        if nb >= PIECE:
            for lo in range(0, nb, PIECE):
                yield src, [(k, lo, min(nb, lo + PIECE))]
            continue
        cur_src = src
        cur.append((k, 0, nb))
        size += nb
    if cur:
        yield cur_src, cur


def _describe(e: BaseException) -> Dict[str, Any]:
    msg = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    return {"class": type(e).__name__, "message": msg[:4000], "step": getattr(e, "step", None),
            "key": str(getattr(e, "key", None) or "")[:1000] or None, "blob": getattr(e, "blob", None)}

