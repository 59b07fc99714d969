"""How the ranks of one job agree: small messages with deadlines, off the training's collectives.

A :class:`Coordinator` gathers one small message per rank to rank 0 and broadcasts rank 0's answer. The save
uses it once per step (each rank's manifest digest or error -> rank 0 -> the verdict: committed, or who
failed), resume once per candidate step (each rank's outcome -> the verdict).

:class:`StoreCoordinator` runs them over the key-value store ``torch.distributed`` was initialised with (the
``TCPStore`` of ``init_process_group`` / torchrun). So the agreement:

* needs no process group of the training's backend: it works beside NCCL, never interleaves with the
  training's collectives, and never hangs a GPU stream (a plain TCP key-value exchange);
* has a real deadline per operation (``collective_timeout``, seconds) and, when it passes, names the ranks
  that never arrived;
* never unpickles: messages are msgpack maps of plain values.

Cost per operation (issue 19: nothing a rank sends or receives grows with the number of ranks ``N``, except
rank 0's gather, which is O(N) in time and bytes and bounded in memory):

* gather: one ``set`` per rank (its message, ~200 bytes for a save); rank 0 waits for the N - 1 keys with one
  ``wait`` and reads them with ``multi_get`` in batches of :data:`GATHER_BATCH` keys, folding each batch
  through ``fold`` before reading the next (so rank 0 never holds every message at once). On a deadline it
  names the missing ranks (one ``check`` per key, on that failure path only).
* broadcast: one ``set`` by rank 0; one ``wait`` + ``get`` + ``add`` (a reader count) per other rank.
* key lifetime: nothing stays in the store after an agreement that every rank finished. A rank deletes its own
  gather key when it receives the next broadcast (rank 0 has read it by then); the last reader of a
  broadcast (the count reaches N - 1) deletes the broadcast's key, its count and the keys the caller names
  (e.g. the save's decision). An agreement some rank never finished leaves its few shared keys; rank 0 deletes
  them once its next gather completes (every rank is past them then). Measured with ``benchmarks/bench_agreement.py``.

Keys are namespaced per store instance and per operation (``ckptstore/<instance>/<seq>/<op>``): every rank
creates its stores in the same order and calls ``save`` / ``resume`` in the same order, as collectives require.
"""
from __future__ import annotations

import datetime
import itertools
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import msgpack

from ..util.errors import CheckpointError

log = logging.getLogger("ckptstore")

_instances = itertools.count()
_instances_lock = threading.Lock()


class CollectiveTimeout(CheckpointError):
    """Some ranks did not reach an agreement within the deadline. ``missing``: their ranks (may be empty when
    the underlying error does not say)."""

    def __init__(self, message: str, missing: List[int]):
        super().__init__(message)
        self.missing = missing


GATHER_BATCH = 512              # messages rank 0 reads per multi_get (bounds its memory, not its work)


class Coordinator:
    """Gather-to-rank-0 and broadcast-from-rank-0 of small plain-value messages, each with a deadline."""

    rank: int
    world_size: int

    def gather(self, op: str, message: Dict[str, Any], timeout: float,
               fold: Optional[Callable[[int, Dict[str, Any]], None]] = None) -> Optional[List[Dict[str, Any]]]:
        """Rank 0 gets every rank's message (index = rank); other ranks get ``None``. With ``fold``, rank 0
        instead calls ``fold(rank, message)`` for every rank in rank order, holding only a batch of messages at
        a time, and returns ``[]``. Raises :class:`CollectiveTimeout` on rank 0 naming the ranks that did not
        arrive within ``timeout`` s."""
        raise NotImplementedError

    def broadcast(self, op: str, message: Optional[Dict[str, Any]], timeout: float,
                  drop: Sequence[str] = ()) -> Dict[str, Any]:
        """Rank 0 sends ``message``; every rank returns it. ``drop``: further keys of this agreement (e.g. a
        :meth:`decide` op) the last reader deletes. Raises :class:`CollectiveTimeout` naming rank 0 when it does
        not come within ``timeout`` s."""
        raise NotImplementedError

    def await_readers(self, op: str, timeout: float) -> bool:
        """Rank 0, after :meth:`broadcast` of ``op``: wait up to ``timeout`` s until every other rank has read it.
        Before rank 0 raises an error it broadcast: its process may exit then, and with it the key-value store
        the others read from (a rank still polling got "connection reset" instead of the message). Returns
        whether every rank read it."""
        return True

    def decide(self, op: str, proposal: str) -> str:
        """Atomically settle ``op`` once: the first proposal any rank makes wins; every call returns the
        winner. The save uses it so that rank 0 committing and another rank giving up on the verdict can never
        both happen."""
        raise NotImplementedError

    def send_to(self, op: str, rank: int, message: Dict[str, Any]) -> None:
        """Rank 0 leaves ``message`` for one rank (read once with :meth:`receive`, which deletes it)."""
        raise NotImplementedError

    def receive(self, op: str, timeout: float) -> Optional[Dict[str, Any]]:
        """The message rank 0 left for this rank under ``op`` (:meth:`send_to`), ``None`` if it left none.
        Call only after a broadcast rank 0 made after sending it (the key exists by then or never will)."""
        raise NotImplementedError


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class StoreCoordinator(Coordinator):
    """A :class:`Coordinator` over the c10d key-value store of the default process group (or ``kv_store``;
    ``instance``: the namespace, for ranks simulated in one process). ``bytes_sent`` / ``bytes_received``: the message bytes this rank moved (benchmarks, tests)."""

    def __init__(self, rank: int, world_size: int, kv_store=None, instance: Optional[int] = None):
        import torch.distributed as dist
        if kv_store is None:
            from torch.distributed import distributed_c10d
            kv_store = distributed_c10d._get_default_store()
            # a client connection of this coordinator's own: a blocking get of one store's agreement must not
            # hold up another's set on another thread (the memory tier's saves and the disk promotions agree on
            # two threads at once; sharing one client, each waited behind the other's get until the timeout)
            try:
                kv_store = kv_store.clone()
            except Exception as e:            # pragma: no cover - a store type without clone(): share it
                log.debug("c10d store %s has no clone(): shared (%s)", type(kv_store).__name__, e)
        if instance is None:            # the n-th store each process creates: the same on every rank
            with _instances_lock:
                instance = next(_instances)
        self.rank, self.world_size = rank, world_size
        self._kv = dist.PrefixStore(f"ckptstore/{instance}", kv_store)
        self._seq = itertools.count()
        self._own: List[str] = []          # this rank's gather keys, deleted at the next broadcast it receives
        self._stale: List[str] = []        # rank 0: keys of its broadcasts, in case some reader never finishes
        self.bytes_sent = self.bytes_received = 0

    def next_tag(self, op: str) -> str:
        """A key no earlier operation of this store used; every rank derives the same sequence."""
        return f"{next(self._seq)}/{op}"

    def _set(self, key: str, data: bytes) -> None:
        self._kv.set(key, data)
        self.bytes_sent += len(data)

    def _delete(self, keys: Sequence[str]) -> None:
        for k in keys:
            try:
                self._kv.delete_key(k)
            except Exception as e:          # the store is going away: nothing left to tidy
                log.debug("could not delete %s from the key-value store: %s", k, e)

    def gather(self, op, message, timeout, fold=None):
        data = msgpack.packb(message, use_bin_type=True)
        td = datetime.timedelta(seconds=timeout)
        if self.rank != 0:
            key = f"{op}/p/{self.rank}"
            self._set(key, data)
            self._own.append(key)
            return None
        keys = [f"{op}/p/{r}" for r in range(1, self.world_size)]
        try:
            self._kv.wait(keys, td)
        except Exception as e:
            missing = [r for r, k in enumerate(keys, 1) if not _quiet_check(self._kv, k)]
            raise CollectiveTimeout(f"{op}: rank(s) {missing or '?'} did not arrive within {timeout:.0f} s "
                                    f"({_first_line(e)})", missing) from None
        if self._stale:                 # every rank is past rank 0's earlier broadcasts: none is still read
            self._delete(self._stale)
            self._stale = []
        out: List[Dict[str, Any]] = []
        take = fold if fold is not None else (lambda r, m: out.append(m))
        take(0, message)
        for lo in range(0, len(keys), GATHER_BATCH):
            raw = self._kv.multi_get(keys[lo:lo + GATHER_BATCH])
            for i, r in enumerate(raw, lo + 1):
                self.bytes_received += len(r)
                take(i, msgpack.unpackb(r, raw=False))
            del raw
        return out

    def broadcast(self, op, message, timeout, drop=()):
        # a plain key (not _StoreCollectives.broadcast_*): a receiver may wait for the same answer twice
        key = f"{op}/bcast"
        try:
            if self.rank == 0:
                self._set(key, msgpack.packb(message, use_bin_type=True))
                # the last reader deletes these; rank 0 does at its next gather when some reader never came
                self._stale += [key, f"{key}/n", *drop]
                return message
            self._kv.wait([key], datetime.timedelta(seconds=timeout))
            data = bytes(self._kv.get(key))
        except Exception as e:
            raise CollectiveTimeout(f"{op}: no answer from rank 0 within {timeout:.0f} s ({_first_line(e)})",
                                    [0]) from None
        self.bytes_received += len(data)
        own, self._own = self._own, []
        self._delete(own)                           # rank 0 read them before it could broadcast
        try:
            if self._kv.add(f"{key}/n", 1) == self.world_size - 1:
                self._delete([key, f"{key}/n", *drop])
        except Exception as e:
            log.debug("could not count the readers of %s: %s", key, e)
        return msgpack.unpackb(data, raw=False)

    def await_readers(self, op, timeout):
        key, deadline = f"{op}/bcast", time.monotonic() + timeout
        while self.world_size > 1 and time.monotonic() < deadline:
            try:
                if not self._kv.check([key]):       # the last reader deleted it: every rank has it
                    return True
            except Exception:                       # the store itself is gone: nothing left to wait for
                return False
            time.sleep(0.02)
        return self.world_size <= 1

    def decide(self, op, proposal):
        return self._kv.compare_set(f"{op}/decision", "", proposal).decode()

    def send_to(self, op, rank, message):
        self._set(f"{op}/to/{rank}", msgpack.packb(message, use_bin_type=True))

    def receive(self, op, timeout):
        key = f"{op}/to/{self.rank}"
        if not _quiet_check(self._kv, key):
            return None
        data = bytes(self._kv.get(key))
        self.bytes_received += len(data)
        self._delete([key])
        return msgpack.unpackb(data, raw=False)

    def keys_in_store(self) -> int:
        """How many keys the whole key-value store holds now (tests: agreements leave none behind)."""
        return int(self._kv.num_keys())


def _quiet_check(kv, key: str) -> bool:
    try:
        return bool(kv.check([key]))
    except Exception:
        return False


def default_coordinator(rank: int, world_size: int) -> Optional[Coordinator]:
    """A :class:`StoreCoordinator` when ``torch.distributed`` is initialised with this world size, else
    ``None`` (a single process, or ranks given by hand without a process group)."""
    if world_size <= 1:
        return None
    try:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world_size:
            return None
    except Exception:  # pragma: no cover - a broken dist install must not break a local store
        return None
    return StoreCoordinator(rank, world_size)
