"""One rank of a tiny data-parallel job saving to the memory tier (issue 20), launched like torchrun by
tests/memtier/test_memory_tier.py through tests/dist.py (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT).

Every rank holds the same ``nn.Linear(64, 64)`` wrapped in DDP (gloo) with AdamW, draws its batch from a
per-rank dataset at a data position (a plain int in the state) plus noise from the global RNG (saved per rank
through ``ckptstore.RNGState``), so a resume that restores the wrong rank's part, a stale RNG or a stale
position changes the losses. Each rank appends ``{"step", "loss"}`` to ``--log``/loss-rank<r>.jsonl (one
write per line) right after the step's optimizer step, then saves the step non-blocking.

``--disk`` / ``--mem`` may hold ``{node}`` (= rank // ``--node-size``): node-local roots shared by the ranks of
one node. Options:
  --no-memory      a plain store on the disk roots (no memory tier): saves every step to disk.
  --replicas N     Memory(replicas=N) (default 1; 0: a lost node's memory parts are gone with it).
  --hold-after K   after step K's save: wait for it (and for the uploads), meet, write ``held-rank<r>`` in
                   ``--log`` and sleep until killed (the test SIGKILLs every rank: a node loss).
  --die-at K       rank ``--die-rank`` attaches a logging.Handler to "ckptstore.memtier.replication" that SIGKILLs its
                   own process on the record "step K: sending ...": a real kill in the middle of replication.
                   The other ranks wait for step K's save, report what it raised, and exit at once.
  --connections    report in RESULT the TCP connections this rank opened to its peers (not the c10d store's,
                   not the training's default group's, made before): ``store`` after ``Store()``, ``saved`` after
                   the last save, ``peers`` the ranks its ring exchanges with (issue 29).
  --mark URL       rank 0 marks ``resumed`` on the counting proxy (tests/countproxy.py) once every rank resumed.
Each rank prints ``RESULT {...}`` (resume step, ``resumed_from``, the error of step K's save when --die-at).
"""
import argparse
import json
import logging
import os
import random
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from countproxy import mark  # noqa: E402

from ckptstore import Memory, Remote, Retention, RNGState, Store  # noqa: E402
from ckptstore.util.errors import CheckpointError  # noqa: E402
from rank import add_options, finish, join, leave_now, result, tcp_connections  # noqa: E402


class KillOnReplication(logging.Handler):
    """SIGKILL this process when the replicator is about to send a part's bytes for ``step``."""

    def __init__(self, step: int):
        super().__init__(logging.DEBUG)
        self.prefix = f"step {step}: sending "

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(self.prefix):
            sys.stdout.write(f"dying: {record.getMessage()}\n")
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--disk", required=True)
    ap.add_argument("--mem", required=True)
    ap.add_argument("--remote", default="")
    ap.add_argument("--so", default="{}")
    ap.add_argument("--log", required=True)
    add_options(ap, remote_every=6, disk_every=3, mem_keep=3, capacity_mib=64, node_size=2, timeout=20.0,
                collective_timeout=60.0, steps=10, hold_after=0, die_at=0, die_rank=3, mark="", no_memory=False,
                replicas=1, connections=False)
    ap.add_argument("--resume-by", choices=["resume", "resolve"], default="resume",
                    help="Store.resume, or Store.resolve then Store.restore of that step (the trainers' way)")
    args = ap.parse_args()

    rank, world = join(timeout=90)
    node = rank // args.node_size
    disk = args.disk.replace("{node}", str(node))
    mem = args.mem.replace("{node}", str(node))
    if args.die_at and rank == args.die_rank:
        lg = logging.getLogger("ckptstore.memtier.replication")
        lg.setLevel(logging.DEBUG)
        lg.addHandler(KillOnReplication(args.die_at))

    torch.manual_seed(0)                                  # the same initial model on every rank
    model = nn.Linear(64, 64)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=False)
    g = torch.Generator().manual_seed(100 + rank)       # this rank's dataset: 16 batches of 8
    data = torch.randn(16, 8, 64, generator=g)
    targets = torch.randn(16, 8, 64, generator=g)
    random.seed(200 + rank)
    np.random.seed(200 + rank)
    torch.manual_seed(300 + rank)                         # per-rank noise, saved in the state through RNGState
    state = {"model": model, "optim": opt, "rng": RNGState(), "pos": 0}

    remote = Remote(args.remote, every=args.remote_every) if args.remote else None
    memory = None if args.no_memory else Memory(mem, every=1, disk_every=args.disk_every,
                                                capacity=args.capacity_mib << 20, keep=args.mem_keep,
                                                replicas=args.replicas, node_size=args.node_size,
                                                timeout=args.timeout)
    store_port = int(os.environ["MASTER_PORT"])
    before = tcp_connections(exclude_port=store_port)
    store = Store(disk, rank=rank, world_size=world, remote=remote, storage_options=json.loads(args.so),
                  keep=Retention(last=2), collective_timeout=args.collective_timeout, memory=memory)
    at_store = tcp_connections(exclude_port=store_port) - before
    if args.resume_by == "resolve":                 # as the HF and torchtitan adapters do: choose, then restore
        found = store.resolve()
        start = store.restore(state, found[0]) if found is not None else 0
    else:
        start = store.resume(state) or 0
    out = {"rank": rank, "resumed": start, "resumed_from": store.resumed_from, "pos": state["pos"]}
    print(f"rank {rank} resumed from {start}: {store.resumed_from}", flush=True)
    dist.barrier()
    if args.mark and rank == 0:
        mark(args.mark, "resumed")

    logf = open(os.path.join(args.log, f"loss-rank{rank}.jsonl"), "a")
    last = args.die_at or args.steps
    for step in range(start + 1, last + 1):
        pos = state["pos"]
        x = data[pos % 16] + 0.01 * torch.randn(8, 64)
        loss = ((ddp(x) - targets[pos % 16]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["pos"] = pos + 1
        logf.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
        logf.flush()
        print(f"step {step} loss {loss.item()!r}", flush=True)
        if step == args.die_at:
            t0 = time.monotonic()
            try:
                store.save(state, step, blocking=False)
                store.wait()
                out["error"] = None
            except Exception as e:  # noqa: BLE001  (reported to the test, which asserts on it)
                out["error"] = f"{type(e).__name__}: {e}"[:500]
                out["checkpoint_error"] = isinstance(e, CheckpointError)
            out["save_s"] = time.monotonic() - t0
            result(out)
            leave_now()                                   # a peer is dead: no collective teardown
        store.save(state, step, blocking=False)
        if step == args.hold_after:
            store.wait()
            if remote is not None:
                store.wait_for_uploads(60)
            dist.barrier()
            open(os.path.join(args.log, f"held-rank{rank}"), "w").close()
            print(f"holding after step {step}", flush=True)
            while True:
                time.sleep(60)
    store.wait()
    if args.connections:
        nodes, local = world // args.node_size, rank % args.node_size    # the ring (README: "Memory tier")
        reps = 0 if args.no_memory else min(args.replicas, nodes - 1)
        peers = sorted({((node + d) % nodes) * args.node_size + local for j in range(1, reps + 1) for d in (j, -j)})
        saved = tcp_connections(exclude_port=store_port) - before
        out["connections"] = {"store": len(at_store), "saved": len(saved), "peers": peers}
    store.close()
    result(out)
    finish()


if __name__ == "__main__":
    main()
