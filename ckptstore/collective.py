"""How the ranks of one job agree: small messages with deadlines, off the training's collectives.

A :class:`Coordinator` gathers one small message per rank to rank 0 and broadcasts rank 0's answer. The save
uses it once per step (each rank's manifest digest or error -> rank 0 -> the verdict: committed, or who
failed), resume once per candidate step (each rank's outcome -> the verdict). A save costs three key-value
operations per rank whatever the number of tensors (gather, rank 0's compare-and-set decision, broadcast),
about 150 bytes per rank gathered to rank 0 (measured: 2,336 bytes at 16 ranks; benchmarks/README.md).

:class:`StoreCoordinator` runs them over the key-value store ``torch.distributed`` was initialised with (the
``TCPStore`` of ``init_process_group`` / torchrun), through torch's own store-based control collectives
(``torch.distributed._StoreCollectives``). So the agreement:

* needs no process group of the training's backend: it works beside NCCL, never interleaves with the
  training's collectives, and never hangs a GPU stream (the "CPU group of the store's own", without even a
  gloo group: a plain TCP key-value exchange);
* has a real deadline per operation (``collective_timeout``, seconds) and, when it passes, names the ranks
  that never arrived (torch's error lists the missing ranks; rank 0 puts them in the verdict);
* never unpickles: messages are msgpack maps of plain values.

Keys are namespaced per store instance and per operation (``ckptstore/<instance>/<seq>/<op>``): every rank
creates its stores in the same order and calls ``save`` / ``resume`` in the same order, as collectives require.
"""
from __future__ import annotations

import datetime
import itertools
import logging
import re
import threading
from typing import Any, Dict, List, Optional

import msgpack

from .errors import CheckpointError

log = logging.getLogger("ckptstore")

_instances = itertools.count()
_instances_lock = threading.Lock()


class CollectiveTimeout(CheckpointError):
    """Some ranks did not reach an agreement within the deadline. ``missing``: their ranks (may be empty when
    the underlying error does not say)."""

    def __init__(self, message: str, missing: List[int]):
        super().__init__(message)
        self.missing = missing


class Coordinator:
    """Gather-to-rank-0 and broadcast-from-rank-0 of small plain-value messages, each with a deadline."""

    rank: int
    world_size: int

    def gather(self, op: str, message: Dict[str, Any], timeout: float) -> Optional[List[Dict[str, Any]]]:
        """Rank 0 gets every rank's message (index = rank); other ranks get ``None``. Raises
        :class:`CollectiveTimeout` on rank 0 naming the ranks that did not arrive within ``timeout`` s."""
        raise NotImplementedError

    def broadcast(self, op: str, message: Optional[Dict[str, Any]], timeout: float) -> Dict[str, Any]:
        """Rank 0 sends ``message``; every rank returns it. Raises :class:`CollectiveTimeout` naming rank 0
        when it does not come within ``timeout`` s."""
        raise NotImplementedError

    def decide(self, op: str, proposal: str) -> str:
        """Atomically settle ``op`` once: the first proposal any rank makes wins; every call returns the
        winner. The save uses it so that rank 0 committing and another rank giving up on the verdict can never
        both happen."""
        raise NotImplementedError


_MISSING_RE = re.compile(r"missing ranks:\s*([0-9,\s]+)")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class StoreCoordinator(Coordinator):
    """A :class:`Coordinator` over the c10d key-value store of the default process group."""

    def __init__(self, rank: int, world_size: int, kv_store=None):
        import torch.distributed as dist
        if kv_store is None:
            from torch.distributed import distributed_c10d
            kv_store = distributed_c10d._get_default_store()
        with _instances_lock:
            instance = next(_instances)
        self.rank, self.world_size = rank, world_size
        self._kv = dist.PrefixStore(f"ckptstore/{instance}", kv_store)
        self._collectives = dist._StoreCollectives(self._kv, rank, world_size)
        self._seq = itertools.count()

    def next_tag(self, op: str) -> str:
        """A key no earlier operation of this store used; every rank derives the same sequence."""
        return f"{next(self._seq)}/{op}"

    def gather(self, op, message, timeout):
        data = msgpack.packb(message, use_bin_type=True)
        td = datetime.timedelta(seconds=timeout)
        try:
            if self.rank != 0:
                self._collectives.gather_send(op, data, td)
                return None
            raw = self._collectives.gather_recv(op, data, td)
        except Exception as e:
            m = _MISSING_RE.search(str(e))
            missing = sorted({int(x) for x in m.group(1).replace(",", " ").split()}) if m else []
            raise CollectiveTimeout(f"{op}: rank(s) {missing or '?'} did not arrive within {timeout:.0f} s "
                                    f"({_first_line(e)})", missing) from None
        return [msgpack.unpackb(bytes(r), raw=False) for r in raw]

    def broadcast(self, op, message, timeout):
        # a plain key (not _StoreCollectives.broadcast_*): a receiver may wait for the same answer twice
        key = f"{op}/bcast"
        try:
            if self.rank == 0:
                self._kv.set(key, msgpack.packb(message, use_bin_type=True))
                return message
            self._kv.wait([key], datetime.timedelta(seconds=timeout))
            return msgpack.unpackb(bytes(self._kv.get(key)), raw=False)
        except Exception as e:
            raise CollectiveTimeout(f"{op}: no answer from rank 0 within {timeout:.0f} s ({_first_line(e)})",
                                    [0]) from None

    def decide(self, op, proposal):
        return self._kv.compare_set(f"{op}/decision", "", proposal).decode()


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
