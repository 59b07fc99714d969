"""Gloo groups of ckptstore's own whose connections open lazily: a rank connects only to the ranks it talks to.

The memory tier's replication (:mod:`ckptstore.memtier.replication`) talks to its ring peers only, and
read-once (:mod:`ckptstore.distributed.fanout`) runs gloo's broadcast (a binomial tree: rank ``r`` exchanges with
ranks ``r +/- 2^i``) and all-reduce (a ring: ``r +/- 1``). A group made with
``torch.distributed.new_group(backend="gloo")`` connects every rank to every other at creation (gloo's full mesh:
``N - 1`` sockets per rank, ``N^2`` in all, made at ``Store()``). A :class:`PeerGroup` is a
``ProcessGroupGloo`` on a device made with ``lazy_init=True`` (the per-device form of torch's process-wide
``TORCH_GLOO_LAZY_INIT``): creating it publishes this rank's address in the c10d store and connects to nobody;
the first message to or from a rank opens that pair's one connection. So a rank holds ``O(replicas)``
connections for the memory tier and ``O(log N)`` for read-once, whatever ``N``.

The group is none of the caller's: it is not registered with ``torch.distributed`` (no entry in its group list,
no shift of the names of the caller's later ``new_group`` calls), and no environment variable is set. It
publishes and looks up addresses in the default group's c10d store (as ``new_group``'s groups do), under the
prefix ``ckptstore/gloo/<n>/``: ``n`` counts the groups this process made, the same on every rank (they are
made collectively, in the same order). Ranks are the default group's. Creating it waits for no other rank
(a full mesh waits until every rank connected to it).
"""
from __future__ import annotations

import datetime
import itertools
import logging
import os
import threading
import torch

log = logging.getLogger("ckptstore")

_groups = itertools.count()
_groups_lock = threading.Lock()


class PeerGroup:
    """One lazily connected gloo group over every rank of the default process group (see the module
    docstring). ``timeout``: seconds, the deadline of every connection and wait. Made collectively (every rank,
    the same point of the program), but creation itself waits for no other rank. Raises ``ValueError`` when
    ``torch.distributed`` is not initialised."""

    def __init__(self, timeout: float):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d
        from torch._C._distributed_c10d import ProcessGroupGloo
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("a peer group needs an initialised torch.distributed process group")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout = datetime.timedelta(seconds=float(timeout))
        # the default group's store client itself, as new_group's groups use it: a clone() is one more connection
        # to the store server per rank, and 16 ranks cloning at once wait 5 s each for some (measured, torch 2.13)
        kv = distributed_c10d._get_default_store()
        with _groups_lock:
            n = next(_groups)
        opts = ProcessGroupGloo._Options()
        opts._timeout = self.timeout
        # the devices torch's own constructor picks (the interfaces GLOO_SOCKET_IFNAME lists, else the default),
        # lazy: torch reads TORCH_GLOO_LAZY_INIT only for the process-wide default, so it is asked here per device
        ifnames = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
        try:
            opts._devices = [ProcessGroupGloo.create_device(interface=i, lazy_init=True) for i in ifnames] \
                or [ProcessGroupGloo.create_default_device(lazy_init=True)]
        except TypeError:                   # a torch without per-device lazy init: connected at once (a full mesh)
            log.debug("this torch has no lazy gloo devices: ckptstore's peer group connects every rank at once")
            opts._devices = [ProcessGroupGloo.create_device(interface=i) for i in ifnames] \
                or [ProcessGroupGloo.create_default_device()]
        self.backend = ProcessGroupGloo(dist.PrefixStore(f"ckptstore/gloo/{n}/", kv), self.rank,
                                        self.world_size, opts)

    # -- point to point ------------------------------------------------------------------------------------------
    def isend(self, t: torch.Tensor, dst: int):
        """Start sending ``t`` to rank ``dst``: a work to ``wait(timeout)`` on."""
        return self.backend.send([t], dst, 0)

    def irecv(self, t: torch.Tensor, src: int):
        """Start receiving into ``t`` from rank ``src``: a work to ``wait(timeout)`` on."""
        return self.backend.recv([t], src, 0)

    # -- collectives (every rank) --------------------------------------------------------------------------------
    def broadcast(self, t: torch.Tensor, src: int) -> None:
        """``t`` of rank ``src`` into ``t`` of every rank (gloo's binomial tree), within the timeout."""
        from torch.distributed import BroadcastOptions
        o = BroadcastOptions()
        o.rootRank, o.rootTensor, o.timeout = src, 0, self.timeout
        self.backend.broadcast([t], o).wait(self.timeout)

    def all_reduce_min(self, t: torch.Tensor) -> torch.Tensor:
        """The element-wise minimum of ``t`` over every rank, in place (gloo's ring), within the timeout."""
        from torch.distributed import AllreduceOptions, ReduceOp
        o = AllreduceOptions()
        o.reduceOp, o.timeout = ReduceOp.MIN, self.timeout
        self.backend.allreduce([t], o).wait(self.timeout)
        return t

    def close(self) -> None:
        """Close this group's connections (its peers' ends see them closed)."""
        try:
            self.backend.shutdown()
        except Exception as e:              # pragma: no cover - already shut down, or a peer gone
            log.debug("peer group shutdown: %s", e)

