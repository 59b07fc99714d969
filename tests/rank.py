"""One rank's side of the multi-process test jobs (the ``*_worker.py`` scripts, launched like torchrun by
tests/dist.py's ``Job``): join the process group, print ``RESULT {json}`` lines for the launcher, leave together.

The launcher side (tests/dist.py) reads every ``RESULT`` line a rank printed, later lines adding to earlier ones."""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from typing import Optional, Tuple


def add_options(ap: argparse.ArgumentParser, **defaults) -> None:
    """Add ``--some-name`` for each ``some_name=default``, typed as its default (``False``: a flag)."""
    for name, default in defaults.items():
        flag = "--" + name.replace("_", "-")
        if default is False:
            ap.add_argument(flag, action="store_true")
        else:
            ap.add_argument(flag, type=type(default), default=default)


def join(timeout: Optional[float] = None) -> Tuple[int, int]:
    """``init_process_group("gloo")`` from the torchrun variables (``timeout`` in seconds; ``None``: torch's
    default); returns ``(rank, world size)``."""
    import torch.distributed as dist
    kw = {"timeout": timedelta(seconds=timeout)} if timeout is not None else {}
    dist.init_process_group("gloo", **kw)
    return dist.get_rank(), dist.get_world_size()


def result(out: dict, **dumps) -> None:
    """Print ``out`` as a ``RESULT`` line for the launcher (``dumps``: json.dumps keywords, e.g. ``default=str``)."""
    print("RESULT " + json.dumps(out, **dumps), flush=True)


def close_and_report(store, rank: int) -> None:
    """Close the store (waits for uploads) and print how that went."""
    from ckptstore.util.errors import CheckpointError
    run_id = store.run_id
    try:
        store.close()
        result({"rank": rank, "close": "ok", "run_id": run_id})
    except CheckpointError as e:
        result({"rank": rank, "close": f"{type(e).__name__}: {e}"})


def leave_now() -> None:
    """Exit at once, output flushed, with no collective teardown (a peer is dead, or stopped on purpose)."""
    sys.stdout.flush()
    os._exit(0)


def finish() -> None:
    """Leave together: rank 0 hosts the key-value store, so nobody tears down while others still use it.
    Then exit at once: about 1 job in 20 here aborted in interpreter teardown after destroy_process_group
    ("terminate called without an active exception", after all work and output were done)."""
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()
    leave_now()


def tcp_connections(pid: Optional[int] = None, exclude_port: Optional[int] = None) -> set:
    """The established TCP connections process ``pid`` (default: this one) holds, as ``(local port, remote
    port)`` pairs (psutil), leaving out those with ``exclude_port`` at either end (e.g. the c10d store's,
    ``MASTER_PORT``): what a rank opened to its peers, for the tests and benchmarks that count connections."""
    import psutil
    out = set()
    for c in psutil.Process(pid).net_connections(kind="tcp"):
        if c.status == psutil.CONN_ESTABLISHED and c.raddr and exclude_port not in (c.laddr.port, c.raddr.port):
            out.add((c.laddr.port, c.raddr.port))
    return out
