#!/usr/bin/env python
"""Connections per rank and ``Store()`` set-up time of the memory tier and read-once (issue 29), by hand:

    PYTHONPATH=$PWD python benchmarks/bench_connections.py --ranks 16 --node-size 2 --replicas 1
    python benchmarks/bench_connections.py --simulate 1024 4096 10000     # peer counts beyond, no processes

Real processes: ``--ranks`` ranks launched like torchrun (gloo on 127.0.0.1, tests/dist.py), ``--node-size``
ranks per "node". Each rank counts the established TCP connections it holds (``/proc/self/net/tcp``), leaving
out the c10d store's and those open before (the job's own default gloo group, a full mesh made by
``init_process_group``), at these points:

* ``Store()`` with ``Memory(replicas=...)``: connections after, and its seconds (the slowest rank's);
* after one replicated memory save of a small state (a 64 KiB tensor the same on every rank + 4 KiB of its own);
* after a resume with read-once forced on (``CKPTSTORE_READ_ONCE=1``) from a step every rank saved on a shared
  directory (the same ``2 x N`` 16 KiB tensors on every rank: each read by one rank and broadcast, every rank
  a broadcast's root);
* the group alone, made after a barrier: ``new_group(backend="gloo")`` (a full mesh: what both used before) and
  ckptstore's lazily connected one (``ckptstore.distributed.peers.PeerGroup``), seconds (the slowest rank's).

``--simulate``: the peers a rank exchanges with at ``N`` ranks, from the rules the transport follows
(ckptstore.memtier.replication.Ring for the memory tier; for read-once gloo's broadcast, a binomial tree whose
rank ``r`` exchanges with ``r +/- 2^i``, from every root, and its ring all-reduce, ``r +/- 1``), the most over
the ranks; a full mesh is ``N - 1``. The counts are the lazy groups' connections (one per peer).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import harness as H  # noqa: E402  (puts the checkout and tests/ on sys.path)


def rank_job(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    from ckptstore import Memory, Store
    from rank import tcp_connections
    work, node_size, replicas = Path(os.environ["BENCH_DIR"]), int(os.environ["BENCH_NODE_SIZE"]), \
        int(os.environ["BENCH_REPLICAS"])
    port = int(os.environ["MASTER_PORT"])
    node = rank // node_size
    out = {}
    base = tcp_connections(exclude_port=port)
    dist.barrier()                      # every rank started (process start-up is not Store()'s time)
    t0 = time.perf_counter()
    store = Store(str(work / f"disk{node}"), rank=rank, world_size=world,
                  memory=Memory(str(work / f"mem{node}"), every=1, disk_every=None, replicas=replicas,
                                node_size=node_size, timeout=60))
    out["store_s"] = time.perf_counter() - t0
    out["at_store"] = len(tcp_connections(exclude_port=port) - base)
    dist.barrier()                      # no rank's save connects to a rank still in Store()
    g = torch.Generator().manual_seed(0)
    state = {"shared": torch.randn(16384, generator=g), "own": torch.full((1024,), float(rank))}
    t0 = time.perf_counter()
    store.save(state, 1)
    out["save_s"] = time.perf_counter() - t0
    out["saved"] = len(tcp_connections(exclude_port=port) - base)
    store.close()
    # read-once: every rank saves the same 2 x N tensors (distinct chunks) to one shared directory, then resumes
    # through a new Store: each rank reads a run of them and broadcasts it (every rank a root of the tree)
    shared = {f"t{i}": torch.randn(4096, generator=g) for i in range(2 * world)}
    s = Store(str(work / "shared"), rank=rank, world_size=world)
    s.save(shared, 1)
    s.close()
    base = tcp_connections(exclude_port=port)
    os.environ["CKPTSTORE_READ_ONCE"] = "1"
    s = Store(str(work / "shared"), rank=rank, world_size=world)
    into = {k: torch.zeros_like(v) for k, v in shared.items()}
    dist.barrier()
    t0 = time.perf_counter()
    step = s.resume(into)
    out["resume_s"] = time.perf_counter() - t0
    out["read_once"] = len(tcp_connections(exclude_port=port) - base)
    out["read_once_used"] = bool((s.resumed_from or {}).get("read_once"))
    out["ok"] = step == 1 and all(torch.equal(into[k], v) for k, v in shared.items())
    out["read_once_chunks"] = ((s.resumed_from or {}).get("read_once") or {}).get("shared_chunks")
    s.close()
    # the group alone: a full mesh (what both used before issue 29) and a lazily connected one
    dist.barrier()
    t0 = time.perf_counter()
    mesh = dist.new_group(backend="gloo")
    out["mesh_group_s"] = time.perf_counter() - t0
    dist.barrier()
    try:
        from ckptstore.distributed.peers import PeerGroup
    except ImportError:                 # a checkout before issue 29
        out["lazy_group_s"] = None
    else:
        t0 = time.perf_counter()
        PeerGroup(60).close()
        out["lazy_group_s"] = time.perf_counter() - t0
    dist.destroy_process_group(mesh)
    return out


def simulate(n: int, node_size: int, replicas: int) -> dict:
    from ckptstore.memtier.replication import Ring
    dim = max(1, (n - 1).bit_length())                      # gloo: log2ceil(N) rounds of the binomial tree
    sample = sorted({0, 1, n // 2, n - 1} | set(range(0, n, max(1, n // 64))))
    mem = ro = 0
    for r in sample:
        ring = Ring(r, n, node_size, replicas)
        mem = max(mem, len({f(j) for j in range(1, ring.replicas + 1) for f in (ring.target, ring.source)}))
        peers = {(r + d) % n for i in range(dim) for d in (1 << i, -(1 << i))} | {(r + 1) % n, (r - 1) % n}
        ro = max(ro, len(peers - {r}))
    return {"ranks": n, "memory tier": mem, "read-once": ro, "full mesh": n - 1}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--node-size", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--simulate", type=int, nargs="*", default=None, help="rank counts to simulate (no processes)")
    args = ap.parse_args(argv)
    if args.simulate is not None:
        print("| ranks | memory tier peers / rank | read-once peers / rank | full mesh / rank |\n|---|---|---|---|")
        for n in args.simulate:
            s = simulate(n, args.node_size, args.replicas)
            print(f"| {n} | {s['memory tier']} | {s['read-once']} | {s['full mesh']} |")
        return
    work = Path(tempfile.mkdtemp(prefix="bench_connections_"))
    try:
        env = {"BENCH_DIR": str(work), "BENCH_NODE_SIZE": str(args.node_size), "BENCH_REPLICAS": str(args.replicas)}
        got = H.launch(args.ranks, __file__, "--rank-side", env=env, timeout=600)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert all(g["ok"] for g in got), got
    col = lambda k: [g[k] for g in got]                                             # noqa: E731
    print(json.dumps({"ranks": args.ranks, "node_size": args.node_size, "replicas": args.replicas,
                      "store_s_max": round(max(col("store_s")), 3), "save_s_max": round(max(col("save_s")), 3),
                      "resume_s_max": round(max(col("resume_s")), 3),
                      "mesh_group_s_max": round(max(col("mesh_group_s")), 4),
                      "lazy_group_s_max": round(max(col("lazy_group_s")), 4) if got[0]["lazy_group_s"] is not None
                      else None,
                      "connections_at_store_max": max(col("at_store")), "connections_saved_max": max(col("saved")),
                      "connections_read_once_max": max(col("read_once")),
                      "read_once_used": all(col("read_once_used")),
                      "read_once_shared_chunks": got[0]["read_once_chunks"]}, indent=1))


if __name__ == "__main__":
    import sys
    if "--rank-side" in sys.argv:
        H.rank_main(rank_job)
    else:
        main()
